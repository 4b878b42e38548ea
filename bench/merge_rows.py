"""Merge a device call's bench/configs_check.py results into the committed results file of its GPU.

    python bench/merge_rows.py /path/to/cc.json --call AW
    python bench/merge_rows.py /path/to/cc.json --call AW --note "what the next reader must know" --into FILE

A device call writes its own file (``--out $OUT/cc.json``); the shipped configs' proof is the committed file of the
GPU that ran them, ``bench/results/configs_check_h100.json`` or ``_h200.json`` (chosen from the call's ``hardware``;
``--into`` names another). Each row takes its call's provenance, so that a row read alone says what ran it:
``code`` (the commit the call's tree was, refused where the call recorded none or a dirty tree: that row would prove
no commit), ``device_call`` (``--call``, the letter the closing notes use), ``measured_at``, ``results_command`` and
``hardware``. Then

- a passing row takes the place of the config's row in ``rows`` (the order of the file kept), the replaced one moving
  to ``superseded``: bench/configs_shipped.py reads ``rows`` for the proof of each config;
- a failing row goes to ``failed`` (configs_shipped.py calls a config whose current-code row failed ``failing``);
- a ``--speed-only`` row goes to ``speed_only`` (it never proves a config).

The file's ``date`` gains the call's date and its ``code_note`` the ``--note``. A call merged once is refused the
second time (its rows would stand twice). The file is rewritten whole or not at all.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import List, Optional

import _harness as harness

RESULTS = harness.REPO_ROOT / "bench" / "results"
PROVENANCE = ("command", "hardware", "versions", "code")  # (a new file's date is its calls', added as merged)


def gpu_of(hardware: str) -> Optional[str]:
    """ "h100" or "h200" from a result's hardware line (harness.hardware()), None for anything else."""
    for gpu in ("H100", "H200"):
        if gpu in hardware:
            return gpu.lower()
    return None


def read_json(path: Path, what: str) -> dict:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        harness.refuse(f"{what} {path}: cannot be read as JSON ({type(e).__name__}: {e}); give a results file")
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        harness.refuse(f"{what} {path} has no 'rows' list: give bench/configs_check.py's --out of the call")
    return doc


def merge(new: dict, doc: dict, call: str, note: Optional[str]) -> List[str]:
    """Merge ``new``'s rows into ``doc`` (module docstring); one line per row, for the terminal."""
    code = new.get("code")
    if not code or str(code).endswith("+dirty"):
        harness.refuse(
            f"the call's code is {code!r}: its rows would prove no commit; run the call on a committed tree "
            "(a clean checkout of the commit) and merge that"
        )
    merged = {
        (r.get("device_call"), r.get("measured_at"))
        for key in ("rows", "superseded", "failed", "speed_only")
        for r in doc.get(key, [])
    }
    if (call, new.get("date")) in merged:
        harness.refuse(
            f"call {call} of {new.get('date')} is in the file already: merging it again would count its rows twice"
        )
    lines = []
    for row in new["rows"]:
        row = {
            **row,
            "code": code,
            "device_call": call,
            "measured_at": new.get("date"),
            "results_command": new.get("command"),
            "hardware": new.get("hardware"),
        }
        if row.get("speed_only"):
            doc.setdefault("speed_only", []).append(row)
            verdict = "speed only"
        elif row.get("passed"):
            rows = doc["rows"]
            at = next((i for i, r in enumerate(rows) if r["config"] == row["config"]), len(rows))
            doc.setdefault("superseded", []).extend(r for r in rows if r["config"] == row["config"])
            doc["rows"] = rows[:at] + [row] + [r for r in rows[at:] if r["config"] != row["config"]]
            verdict = "pass: its row now"
        else:
            doc.setdefault("failed", []).append(row)
            verdict = f"FAIL ({row.get('error') or ', '.join(k for k, ok in row.get('checks', {}).items() if not ok)})"
        lines.append(f"{row['config']}: {verdict}")
    date = f"{new.get('date')} (call {call})"
    doc["date"] = f"{doc['date']}; {date}" if doc.get("date") else date
    if note:
        doc["code_note"] = f"{doc['code_note']} {note}" if doc.get("code_note") else note
    return lines


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="bench/configs_check.py's --out of the device call")
    ap.add_argument("--call", required=True, help="the device call's letter, as the closing notes name it")
    ap.add_argument("--note", help="added to the file's code_note: what a reader of these rows must know")
    ap.add_argument("--into", type=Path, help="the results file (default: bench/results/configs_check_<gpu>.json)")
    args = ap.parse_args(argv)
    new = read_json(args.results, "the call's results")
    gpu = gpu_of(new.get("hardware") or "")
    into = args.into or (RESULTS / f"configs_check_{gpu}.json" if gpu else None)
    if into is None:
        harness.refuse(f"the call ran on {new.get('hardware')!r}, not an H100 or H200: name its file with --into")
    if into.exists():
        doc = read_json(into, "--into")
        if gpu_of(doc.get("hardware") or "") != gpu:
            harness.refuse(
                f"{into} holds rows of {doc.get('hardware')!r}, the call ran on {new.get('hardware')!r}: a GPU's "
                "rows go to its own file (--into)"
            )
    else:  # (the first rows of a GPU: the file starts with the call's provenance)
        doc = {
            **{k: new[k] for k in PROVENANCE if k in new},
            "weights": new.get("weights", "random values"),
            "rows": [],
        }
    lines = merge(new, doc, args.call, args.note)
    harness.write_json(into, doc)
    for line in lines:
        print(line)
    print(f"{len(lines)} rows of call {args.call} merged into {into}")


if __name__ == "__main__":
    main()
