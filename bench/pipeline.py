"""The whole pipeline a user runs, timed: fine-tune, step and epoch checkpoints, resume, truthfulqa_mc2.

    python bench/pipeline.py --config configs/llama2/7B_full_80gb.yaml --checkpoint-dir /tmp/llama2-7b-random \\
        --data-dir /tmp/data --work /tmp/pipeline --steps 6 --save-every 3 \\
        --out bench/results/llama2_7b_pipeline_h200.json

Each stage is the user's own command in a fresh process, from the repository root:

1. train: the recipe with ``max_steps_per_epoch=--steps save_every_n_steps=--save-every``: it writes
   ``step_{K}/`` and ``epoch_0/`` (weights, config, tokenizer, ``recipe_state.pt``); the time and size of each
   checkpoint are read from the recipe's "Saved checkpoint" lines and the folders.
2. eval: ``recipes/evaluate.py`` on ``epoch_0/``, every question of truthfulqa_mc2 (817), on --eval-device.
3. lm-eval's own ``hf`` model path on the same folder (``lm_eval.simple_evaluate(model="hf", ...)``, lm-eval's
   task config with only its dataset pointed at the local rows, as ``python -m eval.parity`` does), same dtype
   and batch size: the two scores must be equal.
4. resume: a second process with ``resume_from_checkpoint=step_{K}`` trains steps K+1..N again; its losses must
   equal the first run's (``loss_max_abs_diff``). Before it, ``epoch_0/`` (scored already) and, with
   --delete-source, the source checkpoint are removed: a 7B step checkpoint with 4-bit states is ~21 GB and the
   device's disk holds three of them, not four.

--no-eval skips stages 2 and 3 (the checkpoint and exact-resume checks alone, without lm-eval).

The JSON (--out, default outputs/bench/llama2_7b_pipeline.json) opens with the command, hardware, versions, date
and commit (bench/_harness.py) and records each stage's command, wall time and exit code (with the last lines of
its output when it failed; the whole log is in {work}/logs/). A failed training stage stops the pipeline; the JSON
written so far says where.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional

import _harness as harness

RECIPE = "recipes/full_finetune_single_device.py"  # by path, as a user runs it
EVAL_RECIPE = "recipes/evaluate.py"
EVAL_CONFIG = "configs/eval/truthfulqa_mc2.yaml"
SAVED = re.compile(r"Saved checkpoint (\S+)(?: \(([\d.]+) GB in ([\d.]+) s\))?")


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def run_stage(name: str, cmd: List[str], logs: Path, timeout: float) -> dict:
    """Run one stage to its end; note when each "Saved checkpoint" line came."""
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    saves = []

    def on_line(line: str, t: float) -> None:
        m = SAVED.search(line)
        if m:
            saves.append(
                {
                    "path": m.group(1),
                    "t_s": round(t, 1),
                    "line": line.strip(),
                    "gb": float(m.group(2)) if m.group(2) else None,
                    "save_s": float(m.group(3)) if m.group(3) else None,
                }
            )

    run = harness.run(cmd, logs / f"{name}.log", timeout=timeout, on_line=on_line)
    rc = "timeout" if run.timed_out else run.returncode
    print(f"[{name}] exit {rc} after {run.wall_s:.0f} s", flush=True)
    stage = {
        "command": run.command,
        "wall_s": run.wall_s,
        "rc": rc,
        "log": str(run.log),
        "saves": saves,
        "last_output_s": round(run.last_output_s or 0.0, 1),
    }
    if run.error():
        stage["error"], stage["log_tail"] = run.error(), list(run.tail)[-15:]
    return stage


def losses(output_dir: Path) -> dict:
    """step -> metrics record (the last record of a step wins)."""
    return {int(r["step"]): r for r in harness.read_metrics(output_dir) if "loss" in r and "step" in r}


def lm_eval_hf(
    checkpoint_dir: str, data_dir: str, device: str, dtype: str, batch_size: int, out: str, limit: Optional[int] = None
) -> int:
    """Stage 3, in its own process: lm-eval loads the folder itself (AutoModelForCausalLM, AutoTokenizer)."""
    import tempfile

    import lm_eval

    from eval.parity import reference_task_config, write_hub_jsonl
    from eval.truthfulqa import DATA_FILE, TASK_NAME

    start = time.perf_counter()
    model_args = f"pretrained={Path(checkpoint_dir).resolve()},add_bos_token=False,dtype={dtype}"
    with tempfile.TemporaryDirectory() as tmp:
        task = reference_task_config(
            write_hub_jsonl(harness.repo_path(data_dir) / DATA_FILE, Path(tmp) / "truthfulqa_mc.jsonl")
        )
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args=model_args,
            tasks=[task],
            task_manager=lm_eval.tasks.TaskManager(include_defaults=False),
            batch_size=batch_size,
            device=device,
            limit=limit,
            log_samples=False,
        )
    record = {
        "call": f"lm_eval.simple_evaluate(model='hf', model_args='{model_args}', tasks=[truthfulqa_mc2 on the "
        f"hub-format rows of mc_task.json], batch_size={batch_size}, device='{device}', limit={limit})",
        "truthfulqa_mc2": results["results"][TASK_NAME]["acc,none"],
        "stderr": results["results"][TASK_NAME]["acc_stderr,none"],
        "questions": results["n-samples"][TASK_NAME]["effective"],
        "in_process_s": round(time.perf_counter() - start, 1),  # model load + eval, without interpreter start-up
    }
    Path(out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record), flush=True)
    return 0


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/llama2/7B_full_80gb.yaml")
    ap.add_argument("--checkpoint-dir", default=None, help="the HF folder to fine-tune (null: the config's)")
    ap.add_argument("--data-dir", default=harness.DATA_DIR)
    ap.add_argument("--work", default="/tmp/pipeline", help="run folder root (replaced)")
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps of the fine-tune")
    ap.add_argument("--save-every", type=int, default=3, help="save_every_n_steps: the step checkpoint resumed from")
    ap.add_argument("--eval-device", default="cuda")
    ap.add_argument("--eval-dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--limit", type=int, default=None, help="first N questions (default all 817; smoke tests only)")
    ap.add_argument("--no-eval", action="store_true", help="skip both eval stages: train and resume only")
    ap.add_argument(
        "--delete-source",
        action="store_true",
        help="remove --checkpoint-dir after the first run (disk room for the resume's checkpoint)",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per stage")
    ap.add_argument(
        "--out",
        default=harness.scratch("llama2_7b_pipeline.json"),
        help="the JSON written (default outputs/bench/llama2_7b_pipeline.json)",
    )
    ap.add_argument("--lm-eval-hf", nargs=2, metavar=("CHECKPOINT", "OUT_JSON"), help=argparse.SUPPRESS)
    harness.add_arguments(ap)
    ap.add_argument("overrides", nargs="*", help="extra key=value overrides for both training runs")
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.lm_eval_hf:
        return lm_eval_hf(
            args.lm_eval_hf[0],
            args.data_dir,
            args.eval_device,
            {"bf16": "bfloat16", "fp32": "float32"}[args.eval_dtype],
            args.eval_batch,
            args.lm_eval_hf[1],
            args.limit,
        )
    result = {
        **harness.provenance(__file__, argv, args.allow_dirty),
        "what": "fine-tune -> step and epoch checkpoints -> resume from the step checkpoint"
        + ("" if args.no_eval else " -> truthfulqa_mc2 (ours and lm-eval's hf path) on the epoch checkpoint"),
        "config": args.config,
        "checkpoint_dir": args.checkpoint_dir,
        "stages": {},
    }
    work = Path(args.work).resolve()
    shutil.rmtree(work, ignore_errors=True)
    logs = work / "logs"
    logs.mkdir(parents=True)
    run_dir, data_dir = work / "run", args.data_dir  # (relative: from the repository root, where each stage runs)
    common = [
        f"data_dir={data_dir}",
        f"output_dir={run_dir}",
        "metric_logger=null",
        f"max_steps_per_epoch={args.steps}",
        f"save_every_n_steps={args.save_every}",
        "log_every_n_steps=1",
        f"pack_cache_dir={work / 'packs'}",
        *args.overrides,
    ]

    def stage(name: str, cmd: List[str]) -> dict:
        result["stages"][name] = run_stage(name, cmd, logs, args.timeout)
        harness.write_json(args.out, result)
        return result["stages"][name]

    # 1. The fine-tune.
    source = [f"checkpoint_dir={Path(args.checkpoint_dir).resolve()}"] if args.checkpoint_dir else []
    st = stage("train", harness.recipe_command(RECIPE, "--config", args.config, *source, *common))
    first = losses(run_dir)
    st["losses"] = {s: first[s]["loss"] for s in sorted(first)}
    for key in ("tokens_per_second", "first_step_s", "peak_memory_alloc_gib", "peak_memory_reserved_gib"):
        vals = [r[key] for r in first.values() if r.get(key) is not None]
        if vals:
            st[key] = vals[-1] if key != "first_step_s" else vals[0]
    for name in (f"step_{args.save_every}", "epoch_0"):
        folder = run_dir / name
        if folder.is_dir():
            st.setdefault("checkpoints", {})[name] = {
                "bytes": folder_bytes(folder),
                "files": sorted(f.name for f in folder.iterdir()),
                "save_s": next((s["save_s"] for s in st["saves"] if s["path"].rstrip("/").endswith(name)), None),
            }
    harness.write_json(args.out, result)
    if st["rc"] != 0:
        return 1
    if args.delete_source and args.checkpoint_dir:
        shutil.rmtree(args.checkpoint_dir, ignore_errors=True)

    epoch = run_dir / "epoch_0"
    if not args.no_eval:  # a failed eval does not stop the pipeline: the resume check does not depend on it
        # 2. Our eval command on the epoch checkpoint.
        ours_out = work / "eval_ours"
        st = stage(
            "eval",
            harness.recipe_command(
                EVAL_RECIPE,
                "--config",
                EVAL_CONFIG,
                f"checkpoint_dir={epoch}",
                f"data_dir={data_dir}",
                f"output_dir={ours_out}",
                f"device={args.eval_device}",
                f"dtype={args.eval_dtype}",
                f"batch_size={args.eval_batch}",
                f"limit={'null' if args.limit is None else args.limit}",
            ),
        )
        found = sorted(ours_out.glob("results_*.json"))
        if found:
            res = json.loads(found[-1].read_text())
            st.update(
                truthfulqa_mc2=res["results"]["truthfulqa_mc2"]["acc,none"],
                stderr=res["results"]["truthfulqa_mc2"]["acc_stderr,none"],
                questions=res["n-samples"]["truthfulqa_mc2"]["effective"],
                eval_seconds=round(float(res.get("total_evaluation_time_seconds", 0.0)), 1),
            )

        # 3. lm-eval's own hf path on the same folder.
        ref_json = work / "lm_eval_hf.json"
        limit = [] if args.limit is None else ["--limit", str(args.limit)]
        st = stage(
            "lm_eval_hf",
            [
                sys.executable,
                "bench/pipeline.py",
                "--data-dir",
                str(data_dir),
                "--eval-device",
                args.eval_device,
                "--eval-dtype",
                args.eval_dtype,
                "--eval-batch",
                str(args.eval_batch),
                *limit,
                "--lm-eval-hf",
                str(epoch),
                str(ref_json),
            ],
        )
        if ref_json.is_file():
            st.update(json.loads(ref_json.read_text()))
            ours_score = result["stages"]["eval"].get("truthfulqa_mc2")
            if ours_score is not None:
                result["score_abs_diff"] = abs(ours_score - st["truthfulqa_mc2"])

    # 4. Resume from the step checkpoint in a second process: the same next losses.
    shutil.rmtree(epoch, ignore_errors=True)
    step_dir = run_dir / f"step_{args.save_every}"
    st = stage(
        "resume",
        harness.recipe_command(
            RECIPE,
            "--config",
            args.config,
            *common,
            f"resume_from_checkpoint={step_dir}",
            f"tokenizer.path={step_dir / 'tokenizer.model'}",
            "checkpoint_dir=null",
        ),
    )
    second = losses(run_dir)
    replay = [s for s in sorted(first) if s > args.save_every]
    st["losses"] = {s: second[s]["loss"] for s in replay if s in second}
    diffs = [abs(second[s]["loss"] - first[s]["loss"]) for s in replay if s in second]
    st["steps_compared"] = len(diffs)
    if diffs and len(diffs) == len(replay):
        result["loss_max_abs_diff"] = max(diffs)
    result["ok"] = (
        st["rc"] == 0
        and result.get("loss_max_abs_diff") == 0.0
        and (args.no_eval or result.get("score_abs_diff", 1.0) <= 1e-4)
    )
    harness.write_json(args.out, result)
    print(json.dumps({k: result.get(k) for k in ("loss_max_abs_diff", "score_abs_diff", "ok")}), flush=True)
    print(f"wrote {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
