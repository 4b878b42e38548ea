"""The GPU kernels of a profiler trace, by total time: what the recipes' profiler paragraph sums into categories,
kernel by kernel.

    python bench/trace_kernels.py outputs/run/profiler/iteration_8/*.pt.trace.json.gz [--top 40] [--json out.json]

Reads the Chrome trace that ``profiler.enabled=True`` writes (finetune/reporting/profiler.py), groups its kernels by name, and
prints per kernel: its category (the paragraph's rules), the calls and milliseconds per recorded step, and the share
of all kernel time; then the categories' totals. ``--json`` writes the same table.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from finetune.reporting.profiler import classify  # noqa: E402


def kernels(trace: dict):
    """(name, duration in µs) of every GPU kernel (and GPU memcpy/memset) in the trace."""
    for event in trace.get("traceEvents", []):
        if event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            yield event["name"], float(event.get("dur", 0))


def steps(trace: dict) -> int:
    names = {e["name"] for e in trace.get("traceEvents", []) if str(e.get("name", "")).startswith("ProfilerStep#")}
    return max(len(names), 1)


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", help="a .pt.trace.json or .pt.trace.json.gz")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args(argv)
    path = Path(args.trace)
    trace = json.loads((gzip.open if path.suffix == ".gz" else open)(path, "rt").read())
    n = steps(trace)
    total_us = collections.Counter()
    calls = collections.Counter()
    for name, dur in kernels(trace):
        total_us[name] += dur
        calls[name] += 1
    all_us = sum(total_us.values()) or 1.0
    rows = [
        {
            "kernel": name,
            "category": classify(name),
            "calls_per_step": calls[name] / n,
            "ms_per_step": us / n / 1e3,
            "share": us / all_us,
        }
        for name, us in total_us.most_common()
    ]
    by_category = collections.Counter()
    for row in rows:
        by_category[row["category"]] += row["ms_per_step"]
    print(f"{path}: {n} step(s), {all_us / n / 1e3:.1f} ms of kernels per step")
    for row in rows[: args.top]:
        print(
            f"{row['ms_per_step']:8.2f} ms {100 * row['share']:5.1f} % {row['calls_per_step']:6.0f}x "
            f"{row['category']:<12} {row['kernel'][:110]}"
        )
    print("categories (ms per step): " + ", ".join(f"{c} {ms:.1f}" for c, ms in by_category.most_common()))
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "trace": str(path),
                    "steps": n,
                    "kernel_ms_per_step": all_us / n / 1e3,
                    "categories_ms": dict(by_category),
                    "kernels": rows,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
