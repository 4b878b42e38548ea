"""What a checkpoint costs training, per memory class: seconds blocked per save, synchronous vs in the background.

    python bench/e2e.py --make-checkpoint /dev/shm/llama2-7b-random      # HF-format Llama2-7B, random values
    python bench/checkpoint_save.py --checkpoint-dir /dev/shm/llama2-7b-random --data-dir /tmp/data \\
        --out bench/results/llama2_7b_checkpoint_h200.json
    python bench/checkpoint_save.py --toy                                # the tiny config on the CPU (the tests)

Each row is one fresh process of recipes/full_finetune_single_device.py on a 7B config, capped at its memory class
(configs/llama2/7B_full_80gb.yaml with device_memory_limit_gib=80, 7B_full_24gb.yaml with 24), with
async_checkpoint=False or True, log_every_n_steps=1, and is stopped once its saves are measured (no epoch
checkpoint):

- a synchronous row saves once, at step --sync-at: training is blocked for the whole save;
- an asynchronous row saves --saves times, every --save-every steps (pick it longer than one background write, or a
  save waits for the one before: that wait counts as blocked, as it would for a user), and runs --tail steps after
  its last save is published.

Per save (``saves``): ``blocked_s`` (what training waited: the snapshot, for a synchronous save all of it),
``write_s`` (the background write; synchronous: the save), ``total_s`` (from the save to its folder in place) and the
size, from the recipe's "Saved checkpoint" line. Per row: ``tok_s_writing`` / ``tok_s_idle``, the median tokens/s
of the steps that ran beside a background write and of the others (after --skip-steps), and their ratio;
``peak_reserved_gib`` against ``cap_gib``; ``peak_host_rss_gib``, ``host_pinned_gib`` and where the snapshot was held
(``staged_gpu_gib`` / ``staged_host_gib``), from the metrics records. A row's checkpoints are deleted as newer ones
appear (a 7B checkpoint is 20.6 GB; the H200 machine's disk holds about three) and with the row.

The JSON (--out, default outputs/bench/llama2_7b_checkpoint.json; rewritten after every row; --merge keeps the rows of
an earlier run that this one does not re-measure) opens with the command, hardware, versions, date and commit
(bench/_harness.py). The four 7B rows take about 7 minutes on an H200 (each: ~20 s to load, ~25 s to compile, then
its steps: ~0.6 s each at 80gb, ~0.8 s at 24gb, and a synchronous row's ~30 s save).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

import _harness as harness

RECIPE = "full_finetune_single_device"
# name -> (config, overrides, cap in GiB: the memory class's device_memory_limit_gib, None on the CPU)
ROWS: Dict[str, tuple] = {
    "80gb_sync": ("configs/llama2/7B_full_80gb.yaml", ["async_checkpoint=False"], 80),
    "80gb_async": ("configs/llama2/7B_full_80gb.yaml", ["async_checkpoint=True"], 80),
    "24gb_sync": ("configs/llama2/7B_full_24gb.yaml", ["async_checkpoint=False"], 24),
    "24gb_async": ("configs/llama2/7B_full_24gb.yaml", ["async_checkpoint=True"], 24),
}
# --toy: the tests' tiny model (tests/conftest.py's FAST) on the CPU.
TOY = [
    "model.num_layers=1",
    "model.embed_dim=64",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "tokenizer.max_seq_len=64",
    "batch_size=2",
    "optimizer.lr=1e-2",
    "lr_scheduler.num_warmup_steps=0",
]
TOY_ROWS: Dict[str, tuple] = {
    "tiny_sync": ("configs/tiny.yaml", TOY + ["async_checkpoint=False"], None),
    "tiny_async": ("configs/tiny.yaml", TOY + ["async_checkpoint=True"], None),
}
SAVED = re.compile(
    r"Saved checkpoint (\S+) \(([\d.]+) GB in ([\d.]+) s\)"
    r"(?:; written in the background \(([\d.]+) s\), training blocked ([\d.]+) s)?"
)


def is_async(overrides: List[str]) -> bool:
    return "async_checkpoint=True" in overrides


def plan(args, overrides: List[str]) -> tuple:
    """(save_every_n_steps, the steps saved at, steps to run before stopping) of a row."""
    if not is_async(overrides):
        return args.sync_at, [args.sync_at], args.sync_at + 1
    at = [args.save_every * (i + 1) for i in range(args.saves)]
    return args.save_every, at, at[-1] + args.tail


def command(name: str, args, out: Path) -> List[str]:
    config, overrides, cap = args.rows_table[name]
    every, _, steps = plan(args, overrides)
    extra = [] if args.toy else [f"checkpoint_dir={args.checkpoint_dir}", f"device_memory_limit_gib={cap}"]
    return harness.recipe_command(
        RECIPE,
        "--config",
        config,
        f"output_dir={out}",
        f"data_dir={args.data_dir}",
        "metric_logger=null",
        f"pack_cache_dir={args.pack_cache_dir}",
        "log_every_n_steps=1",
        f"save_every_n_steps={every}",
        f"max_steps_per_epoch={steps + 50}",
        *extra,
        *overrides,
    )  # (+50: stopped before the epoch checkpoint)


def median(values: List[float]) -> Optional[float]:
    return round(statistics.median(values), 1) if values else None


def run_row(name: str, args, runs: Path) -> dict:
    config, overrides, cap = args.rows_table[name]
    _, saved_at, steps = plan(args, overrides)
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    saves: List[dict] = []

    def on_line(line: str, t: float) -> None:
        m = SAVED.search(line)
        if not m:
            return
        background = m.group(4) is not None
        saves.append(
            {
                "name": Path(m.group(1)).name,
                "gb": float(m.group(2)),
                "total_s": float(m.group(3)),
                "write_s": float(m.group(4)) if background else float(m.group(3)),
                "blocked_s": float(m.group(5)) if background else float(m.group(3)),
                "at_s": round(t, 1),
            }
        )
        for old in out.glob("step_*"):  # keep the newest only: the disk holds about three 7B checkpoints
            if old.name != saves[-1]["name"]:
                shutil.rmtree(old, ignore_errors=True)

    def done() -> bool:
        records = harness.read_metrics(out)
        return len(saves) >= len(saved_at) and bool(records) and records[-1]["step"] >= steps

    run = harness.run(
        command(name, args, out),
        out.parent / f"{name}.log",
        timeout=args.timeout,
        until=done,
        on_line=on_line,
        env={"WANDB_MODE": "disabled"},
    )
    records = harness.read_metrics(out)
    row = {
        "name": name,
        "config": config,
        "overrides": overrides,
        "async_checkpoint": is_async(overrides),
        "cap_gib": cap,
        "command": run.command,
        "wall_s": run.wall_s,
        "saved_at_steps": saved_at,
        "saves": saves,
    }
    if len(saves) < len(saved_at) or not records or records[-1]["step"] < steps:
        why = run.error() or " / ".join(list(run.tail)[-3:])
        row["error"] = f"{len(saves)} of {len(saved_at)} saves, {len(records)} of {steps} steps: " + why[-600:]
        shutil.rmtree(out, ignore_errors=True)
        return row
    steady = [r for r in records if r["step"] > args.skip_steps]
    writing = [r["tokens_per_second"] for r in steady if r.get("checkpoint_writing")]
    idle = [r["tokens_per_second"] for r in steady if not r.get("checkpoint_writing")]

    def peak(key: str) -> Optional[float]:
        values = [r[key] for r in records if r.get(key) is not None]
        return round(max(values), 2) if values else None

    row.update(
        blocked_s_max=max(s["blocked_s"] for s in saves),
        write_s_median=median([s["write_s"] for s in saves]),
        tok_s_writing=median(writing),
        tok_s_idle=median(idle),
        steps_writing=len(writing),
        steps_idle=len(idle),
        writing_vs_idle=round(statistics.median(writing) / statistics.median(idle), 3) if writing and idle else None,
        peak_alloc_gib=peak("peak_memory_alloc_gib"),
        peak_reserved_gib=peak("peak_memory_reserved_gib"),
        peak_host_rss_gib=peak("peak_host_rss_gib") or peak("peak_rss_gib"),
        host_pinned_gib=peak("host_pinned_gib"),
        staged_gpu_gib=peak("checkpoint_staged_gpu_gib"),
        staged_host_gib=peak("checkpoint_staged_host_gib"),
        blocked_s_metrics=[round(r["checkpoint_blocked_s"], 3) for r in records if "checkpoint_blocked_s" in r],
        tok_s_per_step=[round(r["tokens_per_second"], 1) for r in records],
        writing_per_step=[bool(r.get("checkpoint_writing")) for r in records],
    )
    if cap is not None and row["peak_reserved_gib"] is not None:
        row["within_cap"] = row["peak_reserved_gib"] <= cap
    shutil.rmtree(out, ignore_errors=True)
    return row


def table(rows: List[dict]) -> str:
    lines = []
    for r in rows:
        if r.get("error"):
            lines.append([r["name"], f"error: {r['error'][:100]}", "", "", "", "", ""])
            continue
        lines.append(
            [
                r["name"],
                " / ".join(f"{s['blocked_s']:.2f}" for s in r["saves"]),
                " / ".join(f"{s['write_s']:.1f}" for s in r["saves"]),
                f"{r['tok_s_writing'] or '-'} / {r['tok_s_idle'] or '-'}",
                f"{r['peak_reserved_gib']}" + (f" of {r['cap_gib']}" if r["cap_gib"] else ""),
                f"{r['peak_host_rss_gib']}",
                f"{r['staged_gpu_gib'] or 0} / {r['staged_host_gib'] or 0}",
            ]
        )
    return harness.table(
        [
            "row",
            "blocked s per save",
            "write s per save",
            "tok/s writing / idle",
            "peak reserved GiB",
            "host RSS GiB",
            "staged GPU / host GiB",
        ],
        lines,
    )


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint-dir", help="the HF Llama2-7B folder every row loads (bench/e2e.py --make-checkpoint)")
    ap.add_argument("--data-dir", default=harness.DATA_DIR, help="holds alpaca/alpaca_data.json")
    ap.add_argument("--toy", action="store_true", help="the tiny config on the CPU, rows tiny_sync and tiny_async")
    ap.add_argument("--rows", help="comma-separated (default: every row of the mode)")
    ap.add_argument("--save-every", type=int, help="steps between an asynchronous row's saves (default 50; toy 3)")
    ap.add_argument("--saves", type=int, default=2, help="saves per asynchronous row")
    ap.add_argument("--tail", type=int, help="steps after the last save (default 10; toy 1)")
    ap.add_argument("--sync-at", type=int, help="the step a synchronous row saves at (default 6; toy 2)")
    ap.add_argument("--skip-steps", type=int, help="first steps left out of tokens/s (compile; default 5, toy 1)")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per row before it is stopped as an error")
    ap.add_argument("--runs-dir", default="/tmp/checkpoint_save_runs", help="where the rows run (deleted after each)")
    ap.add_argument("--pack-cache-dir", default="/tmp/e2e_pack_cache", help="the rows' pack cache (shared)")
    ap.add_argument(
        "--out",
        default=harness.scratch("llama2_7b_checkpoint.json"),
        help="the JSON written (default outputs/bench/llama2_7b_checkpoint.json)",
    )
    ap.add_argument("--merge", action="store_true", help="keep --out's rows that this run does not re-measure")
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    toy = args.toy
    args.save_every = args.save_every or (3 if toy else 50)
    args.tail = args.tail if args.tail is not None else (1 if toy else 10)
    args.sync_at = args.sync_at or (2 if toy else 6)
    args.skip_steps = args.skip_steps if args.skip_steps is not None else (1 if toy else 5)
    args.rows_table = TOY_ROWS if toy else ROWS
    args.names = harness.pick(ap, args.rows, args.rows_table, "rows", list(args.rows_table))
    if not toy and not args.checkpoint_dir:
        ap.error("--checkpoint-dir is required (make one with python bench/e2e.py --make-checkpoint DIR), or --toy")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    old = harness.earlier(args.out, args.merge)
    doc = {
        **prov,
        "commands": harness.commands(old, prov["command"]),
        "weights": None if args.toy else "random values (HF-format Llama2-7B made by bench/e2e.py)",
        "save_every": args.save_every,
        "saves": args.saves,
        "tail": args.tail,
        "sync_at": args.sync_at,
        "skip_steps": args.skip_steps,
        "rows": [r for r in old.get("rows", []) if r["name"] not in args.names],
    }
    for name in args.names:
        row = run_row(name, args, Path(args.runs_dir))
        row["measured_at"], row["code"] = prov["date"], prov["code"]  # (a merged file mixes runs: each row says)
        doc["rows"].append(row)
        print(
            f"{name}: "
            + (
                f"error {row['error']}"
                if row.get("error")
                else f"blocked {[s['blocked_s'] for s in row['saves']]} s, written in "
                f"{[s['write_s'] for s in row['saves']]} s, tok/s writing {row['tok_s_writing']} vs "
                f"idle {row['tok_s_idle']}, peak reserved {row['peak_reserved_gib']} GiB, host RSS "
                f"{row['peak_host_rss_gib']} GiB, wall {row['wall_s']} s"
            ),
            flush=True,
        )
        harness.write_json(args.out, doc)  # after every row: a stopped run keeps what it measured
    print(table(doc["rows"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
