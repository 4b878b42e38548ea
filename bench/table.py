"""The AdamW comparison table and its plots, from the runs themselves: the same numbers a wandb dashboard shows.

    python bench/table.py outputs/tiny-adamw outputs/tiny-adamw8bit            # run folders (their summary.json)
    python bench/table.py --from wandb outputs/tiny-adamw outputs/tiny-adamw8bit   # their offline wandb runs
    python bench/table.py outputs/llama2-7b-* --out-dir outputs/bench/table       # table.md, table.json, plots

Each row is one training run, and each number is a key of its summary, the one the fine-tune recipe writes both to
``{output_dir}/summary.json`` and to its wandb run's summary (finetune/reporting/metrics.py, ``summary_metrics``), with the
eval's ``eval/truthfulqa_mc2`` beside them (recipes/evaluate.py writes it into both as well):

    run              the run's name (config-variant: ``7B_full_80gb-AdamW4bit``)
    peak GiB         peak_memory_alloc_gib (GPU: allocated), or peak_rss_gib (CPU: the process's resident set)
    reserved GiB     peak_memory_reserved_gib (GPU)
    state GiB        optimizer_state_gib: the optimizer's state
    tokens/s         tokens_per_second_median: median over the steady steps (after the first 2 of each process)
    first step s     first_step_s: the first step, compilation included
    epoch s          epoch_time_s: the summed step times of the last epoch
    final loss       final_loss
    val loss         val_loss: the last validation loss (runs with dataset_val; the column is left out when no row has it)
    skipped          skipped_steps
    truthfulqa_mc2   eval/truthfulqa_mc2 (with eval/questions: fewer than 817 marks a smoke test's limit)

Sources (``--from``):

- ``folders`` (default): each PATH is a run folder. Its ``summary.json``; a folder without one (a run stopped before
  its end) gets the same numbers computed from its ``metrics.jsonl``. The loss plot reads ``metrics.jsonl``.
- ``wandb``: each PATH is a wandb folder, or a run folder holding ``wandb/``. Every offline (and synced online)
  run file in it is read with wandb's own reader (``wandb leet inspect --json``); the files of one run id (the
  training run and the evals that resumed it) are merged in the order they started, as ``wandb sync`` merges them.
  The loss plot reads their history.

Outputs, in --out-dir (default outputs/bench/table): ``table.md`` (also printed), ``table.json`` (the rows, the
sources and the command), ``table_memory_speed.png`` (a bar panel per figure) and ``table_loss.png``.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import _harness as harness
from finetune.base import BadInput
from finetune.reporting.metrics import read_records, summary_metrics
from finetune.reporting.wandb_run import read_runs
from finetune.run_files import METRICS_FILE, SUMMARY_FILE, read_json

# (summary key, column header, format); the first of a tuple of keys that a row has is shown.
COLUMNS = [
    (("name",), "run", "{}"),
    (("peak_memory_alloc_gib", "peak_rss_gib"), "peak GiB", "{:.2f}"),
    (("peak_memory_reserved_gib",), "reserved GiB", "{:.2f}"),
    (("optimizer_state_gib",), "state GiB", "{:.2f}"),
    (("tokens_per_second_median",), "tokens/s", "{:,.0f}"),
    (("first_step_s",), "first step s", "{:.1f}"),
    (("epoch_time_s",), "epoch s", "{:.1f}"),
    (("final_loss",), "final loss", "{:.4f}"),
    (("val_loss",), "val loss", "{:.4f}"),
    (("skipped_steps",), "skipped", "{}"),
    (("eval/truthfulqa_mc2",), "truthfulqa_mc2", "{:.4f}"),
]
# Columns shown only when a row has a value (a feature most runs leave off).
OPTIONAL = {("val_loss",)}
PLOTTED = [
    ("peak_memory_alloc_gib", "peak_rss_gib"),
    ("optimizer_state_gib",),
    ("tokens_per_second_median",),
    ("eval/truthfulqa_mc2",),
]


def first(row: Dict[str, Any], keys) -> Any:
    return next((row[k] for k in keys if row.get(k) is not None), None)


# ------------------------------------------------------------------------------------------------
# sources
# ------------------------------------------------------------------------------------------------


def from_folder(folder: Path) -> Dict[str, Any]:
    """A run folder's row: its summary.json, or the same numbers from its metrics.jsonl; and its losses."""
    records = read_records(folder / METRICS_FILE)
    summary = read_json(folder / SUMMARY_FILE)
    if summary is None:
        if not records:
            harness.refuse(
                f"{folder} holds neither {SUMMARY_FILE} nor {METRICS_FILE}: give run folders "
                "(a fine-tune's output_dir), or --from wandb for wandb folders"
            )
        summary = {"name": folder.name, **summary_metrics(records)}
    return {
        **summary,
        "source": str(folder),
        "losses": [[r.get("step"), r.get("loss")] for r in records if r.get("loss") is not None],
    }


def wandb_runs(path: Path) -> Dict[str, Dict[str, Any]]:
    """Every run in a wandb folder (or a run folder's ``wandb/``) by id, read by the library's reader
    (finetune/reporting/wandb_run.py: wandb's own ``wandb leet inspect``, a run's files merged in the order they
    started); a folder without one, or a file wandb cannot read, is refused."""
    try:
        runs = read_runs(path)
    except BadInput as e:
        harness.refuse(str(e))
    if not runs:
        root = path / "wandb" if (path / "wandb").is_dir() else path
        harness.refuse(
            f"{path} holds no wandb run (no */run-*.wandb under {root}): give a wandb folder or a run "
            "folder with one, or run folders without --from wandb"
        )
    return runs


def from_wandb(path: Path) -> List[Dict[str, Any]]:
    rows = []
    for run in wandb_runs(path).values():
        history = run["history"]
        rows.append(
            {
                **{k: v for k, v in run["summary"].items() if not k.startswith("_")},
                "name": run.get("name", run["id"]),
                "group": run.get("group"),
                "tags": run.get("tags"),
                "wandb_run_id": run["id"],
                "source": ", ".join(run["files"]),
                "losses": [
                    [h.get("global_step", h.get("_step")), h["loss"]]
                    for h in history
                    if isinstance(h.get("loss"), (int, float))
                ],
            }
        )
    return rows


# ------------------------------------------------------------------------------------------------
# the table and the plots
# ------------------------------------------------------------------------------------------------


def columns(rows: List[Dict[str, Any]]):
    """COLUMNS, less the OPTIONAL ones no row has."""
    return [c for c in COLUMNS if c[0] not in OPTIONAL or any(first(row, c[0]) is not None for row in rows)]


def markdown(rows: List[Dict[str, Any]]) -> str:
    body, shown = [], columns(rows)
    for row in rows:
        cells = []
        for keys, _, fmt in shown:
            value = first(row, keys)
            cells.append("" if value is None else fmt.format(value))
        if row.get("eval/questions") not in (None, 817) and cells[-1]:
            cells[-1] += f" ({row['eval/questions']} q.)"
        body.append(cells)
    return harness.table([header for _, header, _ in shown], body)


def plot(rows: List[Dict[str, Any]], out_dir: Path) -> List[str]:
    plt = harness.pyplot()
    if plt is None or not rows:
        return []
    names = [row["name"] for row in rows]
    panels = [
        (keys, header)
        for keys, header, _ in COLUMNS
        if keys in PLOTTED and any(first(row, keys) is not None for row in rows)
    ]
    fig, axes = plt.subplots(
        1, len(panels), figsize=(3 * len(panels) + 2, 0.5 * len(rows) + 2), squeeze=False, sharey=True
    )
    for ax, (keys, header) in zip(axes[0], panels):
        ax.barh(names, [first(row, keys) or 0 for row in rows], color="tab:blue")
        ax.set_title(header)
        ax.invert_yaxis()
    fig.tight_layout()
    paths = [out_dir / "table_memory_speed.png"]
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in rows:
        if row["losses"]:
            steps, losses = zip(*row["losses"])
            ax.plot(steps, losses, label=row["name"])
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    paths.append(out_dir / "table_loss.png")
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return [str(p) for p in paths]


def build(paths: List[Path], source: str, out_dir: Path, argv: List[str]) -> Dict[str, Any]:
    """The rows of ``paths`` (run folders, or wandb folders with ``source="wandb"``), written into ``out_dir``."""
    rows = []
    for path in paths:
        if not path.is_dir():
            harness.refuse(f"{path} is not a folder")
        rows += from_wandb(path) if source == "wandb" else [from_folder(path)]
    out_dir.mkdir(parents=True, exist_ok=True)
    text = markdown(rows)
    (out_dir / "table.md").write_text(text)
    doc = {
        "command": shlex.join(["python", "bench/table.py", *argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "from": source,
        "rows": rows,
        "plots": plot(rows, out_dir),
    }
    harness.write_json(out_dir / "table.json", doc)
    return doc


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("paths", nargs="+", type=Path, help="run folders (or wandb folders with --from wandb)")
    parser.add_argument("--from", dest="source", choices=("folders", "wandb"), default="folders")
    parser.add_argument("--out-dir", type=Path, default=Path(harness.scratch("table")))
    args = parser.parse_args(argv)
    doc = build(args.paths, args.source, args.out_dir, argv)
    print(markdown(doc["rows"]), end="")
    print(f"{args.out_dir / 'table.md'}, {args.out_dir / 'table.json'}" + "".join(f", {p}" for p in doc["plots"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
