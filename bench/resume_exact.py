"""How exactly a config resumes, sample after sample and under variants: where a resume's first loss parts from the run
it continues.

    python bench/resume_exact.py --config qwen2_5/3B_full_12gb_fp8 --folders /dev/shm/folders --data-dir /tmp/data \\
        --variant base --variant static:TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0 \\
        --variant sync:async_checkpoint=False --repeat 2 --parallel 4 --out outputs/bench/resume_exact.json

bench/configs_check.py checks a config's resume once (``resumed_first_step_equal``), beside its other checks; where
that fails, this tells the causes apart. Per sample of a variant:

1. run A: the config with a save at ``--save-at`` N (the config's save mode unless the variant sets
   ``async_checkpoint``), stopped once step N+1 is logged and ``step_N/`` is in place (no epoch save is written);
2. ``--resumes`` fresh processes, one after another, each resuming from A's ``step_N/`` and stopped after its first
   step: that step's loss is the forward of the weights ``step_N/`` holds, on the batch A's step N+1 took, so it
   equals A's loss bit for bit when the checkpoint holds what A trained and the resume computes what A did.

Resumes that agree with each other but not with A point at A's process (kernels it chose, a graph it recompiled);
resumes that disagree with each other point at a fresh process's own choices; a variant that makes the difference go
away names its cause. ``step_sha`` (the first 16 hex digits of ``step_N/model.safetensors``' sha256) compares what two
samples saved where their runs are deterministic (``packed_attention=flex``).

A variant is ``NAME`` or ``NAME:ITEM,ITEM...``: an ITEM whose key is an environment variable's name (capitals, digits,
underscores) is set in the runs' environment, any other is a recipe override (key=value) of both runs. Samples run
``--parallel`` at a time on one GPU (a 12 GB config's cap leaves room for several on an 80 GB card; the host memory is
theirs together). The folders are configs_check's: ``--checkpoint DIR``, or ``--folders DIR`` where the model's
random-valued folder is made once.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Tuple

import _harness as harness
import configs_check
from finetune.data.packing import file_digest

ENV_KEY = re.compile(r"^[A-Z][A-Z0-9_]*$")
BLOCKED = re.compile(r"training blocked ([\d.]+) s")


def parse_variant(spec: str) -> Tuple[str, Dict[str, str], List[str]]:
    """``NAME[:ITEM,...]`` -> (name, environment, overrides); a bad spec is refused with one line."""
    name, _, items = spec.partition(":")
    if not re.fullmatch(r"[\w.-]+", name):
        harness.refuse(f"--variant {spec!r}: name it NAME or NAME:ITEM,ITEM (e.g. static:TORCH_DYNAMO_...=0)")
    env: Dict[str, str] = {}
    overrides: List[str] = []
    for item in filter(None, (i.strip() for i in items.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            harness.refuse(f"--variant {spec!r}: {item!r} is not KEY=VALUE")
        if ENV_KEY.match(key):
            env[key] = value
        else:
            overrides.append(item)
    return name, env, overrides


def summarize(a_losses: List[float], resumed: List[Optional[float]], save_at: int) -> dict:
    """A sample's figures: A's loss at step N+1 against each resume's first loss."""
    expected = a_losses[save_at] if len(a_losses) > save_at else None
    exact = [expected is not None and r == expected for r in resumed]
    rel = [None if expected is None or r is None else (r - expected) / abs(expected) for r in resumed]
    return {"expected": expected, "resumed_first": resumed, "exact": exact, "rel_diff": rel}


def sample(variant: Tuple[str, Dict[str, str], List[str]], index: int, folder: str, args) -> dict:
    name, env, overrides = variant
    work = Path(args.work_dir) / f"{name}_{index}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    logs = Path(args.logs_dir) if args.logs_dir else None
    steps = args.save_at + 2  # (both runs take the same length: the lr schedule follows max_steps_per_epoch)
    step = f"step_{args.save_at}"
    lines: List[str] = []
    a_dir = work / "a"
    a = harness.run(
        configs_check.recipe_command(args.config, folder, a_dir, args, steps, args.save_at, overrides),
        work / "a.log",
        timeout=args.timeout,
        env=env,
        until=lambda: len(harness.read_metrics(a_dir)) > args.save_at
        and any((m := configs_check.SAVED_LINE.search(ln)) and m.group(1) == step for ln in lines),
        on_line=lambda line, t: lines.append(line),
    )
    # Through step N+1, the sample's end: the stop reaches a fast run (a toy on the CPU) after it logged step N+2 too,
    # sometimes, so a loss past it would make the same sample's record differ from one run to the next.
    a_losses = [m["loss"] for m in harness.read_metrics(a_dir)][: args.save_at + 1]
    row = {"variant": name, "sample": index, "env": env, "overrides": overrides, "a_losses": a_losses}
    blocked = [float(m.group(1)) for ln in lines if (m := BLOCKED.search(ln))]
    row["a_blocked_s"] = blocked[0] if blocked else None  # (the save's copy, where the log says it)
    saved = a_dir / step / "model.safetensors"
    if not saved.is_file() or len(a_losses) <= args.save_at:
        row["error"] = f"run A: {a.error() or 'no ' + step}"
    else:
        row["step_sha"] = file_digest(saved)[:16]
        resumed: List[Optional[float]] = []
        for r in range(args.resumes):
            b_dir = work / f"resumed_{r}"
            resume = [f"resume_from_checkpoint={a_dir / step}", *overrides]
            b = harness.run(
                configs_check.recipe_command(args.config, folder, b_dir, args, steps, "null", resume),
                work / f"resumed_{r}.log",
                timeout=args.timeout,
                env=env,
                until=lambda d=b_dir: len(harness.read_metrics(d)) >= 1,
            )
            got = harness.read_metrics(b_dir)
            resumed.append(got[0]["loss"] if got else None)
            if not got:
                row["error"] = f"resume {r}: {b.error()}"
        row.update(summarize(a_losses, resumed, args.save_at))
    if logs:
        logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copyfile(log, logs / f"{name}_{index}_{log.name}")
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({k: row.get(k) for k in ("variant", "sample", "expected", "resumed_first", "exact", "error")}))
    return row


def variant_summary(rows: List[dict]) -> Dict[str, dict]:
    """Per variant: resumes equal to A's loss, of those that ran; and whether the resumes agreed among themselves."""
    out: Dict[str, dict] = {}
    for row in rows:
        s = out.setdefault(row["variant"], {"exact": 0, "resumes": 0, "resumes_agree": 0, "samples": 0, "errors": 0})
        s["samples"] += 1
        s["errors"] += "error" in row
        firsts = [r for r in row.get("resumed_first") or [] if r is not None]
        s["exact"] += sum(bool(e) for e in row.get("exact") or [])
        s["resumes"] += len(firsts)
        s["resumes_agree"] += bool(firsts) and len(set(firsts)) == 1
    return out


def parse_args(argv: List[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="as under configs/ without .yaml")
    ap.add_argument("--checkpoint", help="the model's HF folder")
    ap.add_argument("--folders", dest="folders_dir", help="make the model's random-valued folder here (configs_check)")
    ap.add_argument("--data-dir", default=harness.DATA_DIR)
    ap.add_argument("--work-dir", default=harness.scratch("resume_exact"))
    ap.add_argument("--variant", action="append", default=[], help="NAME[:ITEM,...] (repeatable; default: base)")
    ap.add_argument("--repeat", type=int, default=1, help="samples of each variant")
    ap.add_argument("--resumes", type=int, default=2, help="fresh resumes from each sample's checkpoint")
    ap.add_argument("--save-at", type=int, default=4, help="the step saved and resumed from")
    ap.add_argument("--parallel", type=int, default=1, help="samples run at once")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--set", action="append", default=[], help="an override for every run (key=value)")
    ap.add_argument("--logs-dir", help="keep each run's log here")
    ap.add_argument("--out", default=harness.scratch("resume_exact.json"))
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    if not (harness.REPO_ROOT / "configs" / f"{args.config}.yaml").is_file():
        harness.refuse(f"--config: no configs/{args.config}.yaml")
    if not args.checkpoint and not args.folders_dir:
        harness.refuse(f"--config {args.config}: give its HF folder with --checkpoint DIR, or --folders DIR")
    for flag in ("repeat", "resumes", "save_at", "parallel"):
        if getattr(args, flag) < 1:
            harness.refuse(f"--{flag.replace('_', '-')}={getattr(args, flag)}: give 1 or more")
    args.variants = [parse_variant(v) for v in args.variant or ["base"]]
    names = [v[0] for v in args.variants]
    if len(set(names)) != len(names):
        harness.refuse(f"--variant: each name once ({', '.join(names)})")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    doc = {**harness.provenance(__file__, argv, args.allow_dirty), "weights": "random values", "config": args.config}
    folder = args.checkpoint
    if not folder:
        made = SimpleNamespace(
            folders={}, resolved={}, folders_dir=args.folders_dir, keep_folders=True, toy_folders=False,
            data_dir=args.data_dir, timeout=args.timeout,
        )  # fmt: skip
        error = configs_check.ensure_folder(args.config, made)
        if error:
            harness.refuse(error)
        folder = made.resolved[args.config]
    jobs = [(v, i) for i in range(args.repeat) for v in args.variants]
    start = time.monotonic()
    with ThreadPoolExecutor(args.parallel) as pool:
        rows = list(pool.map(lambda job: sample(*job, folder, args), jobs))
    doc.update(rows=rows, summary=variant_summary(rows), wall_s=round(time.monotonic() - start))
    harness.write_json(args.out, doc)
    for name, s in doc["summary"].items():
        print(f"{name}: {s['exact']} of {s['resumes']} resumes exact; resumes agreed in {s['resumes_agree']} of "
              f"{s['samples']} samples; {s['errors']} errors")  # fmt: skip


if __name__ == "__main__":
    main()
