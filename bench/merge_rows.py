"""Merge a device call's bench/configs_check.py results into the committed results file of its GPU.

    python bench/merge_rows.py /path/to/cc.json --call AW
    python bench/merge_rows.py /path/to/cc.json --call AW --note "what the next reader must know" --into FILE

A device call writes its own file (``--out $OUT/cc.json``); the shipped configs' proof is the committed file of the
GPU that ran them, ``bench/results/configs_check_h100.json`` or ``_h200.json`` (chosen from the call's ``hardware``;
``--into`` names another). Each row takes its call's provenance, so that a row read alone says what ran it:
``code`` (the commit the call's tree was: where the call's copy of git recorded a stale commit or "+dirty", the
commit of this repository's history whose code files are the ones the call fingerprinted, ``code_tree``; refused
where the call recorded no code or a dirty tree that no commit holds: that row would prove no commit),
``device_call`` (``--call``, the letter the closing notes use), ``measured_at``, ``results_command`` and
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
import subprocess
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


# How far back a call's files are looked for (a call runs the tree of a recent commit).
SEARCH_COMMITS = 400


def commit_of(tree: Optional[str], root: Path) -> Optional[str]:
    """The commit, of the last SEARCH_COMMITS reachable from HEAD in ``root``, whose code files have the fingerprint
    ``tree`` (``harness.code_tree``); None where none has."""
    if not tree:
        return None
    try:
        commits = subprocess.run(
            ["git", "rev-list", f"--max-count={SEARCH_COMMITS}", "HEAD"],
            cwd=root, capture_output=True, text=True, timeout=60, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return next((c for c in commits if harness.commit_code_tree(c, root) == tree), None)


def call_code(new: dict, root: Path) -> tuple:
    """(the commit the call's rows ran, a line saying how it was told or None): the recorded commit where the call's
    tree was clean and its code files are that commit's (or cannot be compared: no fingerprint, a commit this
    repository lacks), else the commit whose code files the call fingerprinted; refused where none is."""
    code, tree = new.get("code"), new.get("code_tree")
    if code and not str(code).endswith("+dirty"):
        at = harness.commit_code_tree(code, root) if tree else None
        if at is None or at == tree:
            return code, None
    found = commit_of(tree, root)
    if found is None:
        harness.refuse(
            f"the call's code is {code!r}" + (" and no commit here holds its files" if tree else "")
            + ": its rows would prove no commit; run the call on a committed tree (a clean checkout of the commit) "
            "and merge that"
        )  # fmt: skip
    return found, (
        f"the call's copy of git recorded {code}; its code files are those of {found[:7]}: its rows record {found[:7]}"
    )


def merge(new: dict, doc: dict, call: str, note: Optional[str], root: Path = harness.REPO_ROOT) -> List[str]:
    """Merge ``new``'s rows into ``doc`` (module docstring); one line per row, for the terminal. ``root``: the
    repository whose history the call's code is looked up in."""
    code, told = call_code(new, root)
    if doc.get("code") == new.get("code"):  # (a file this call starts: its provenance is the call's)
        doc["code"] = code
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
    if told:
        lines.append(told)
        note = f"Call {call}: {told}." + (f" {note}" if note else "")
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
