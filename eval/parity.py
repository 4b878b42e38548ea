"""Parity check: our eval command against lm-eval's own `hf` model path on the same checkpoint.

    python -m eval.parity --checkpoint_dir /tmp/tiny/epoch_0 [--limit 20] [--out eval/results/tiny_parity.json]

Ours runs as users run it (`tune run recipes/evaluate.py ...`, local mc_task.json). The reference is
`lm_eval.simple_evaluate(model="hf", model_args="pretrained=DIR,add_bos_token=False,dtype=float32", ...)`: lm-eval
loads the folder itself (AutoModelForCausalLM, AutoTokenizer) and runs its own truthfulqa_mc2 config, whose
dataset is the hub's rows written to a JSON-lines file (the hub is out of reach here) and read by `datasets`'
json loader. Both set the same BOS convention explicitly (default: no BOS) and run fp32 on CPU. Prints both scores; with --out, writes them with the commands,
timings, hardware and date.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import lm_eval
import torch

from eval.truthfulqa import DATA_FILE, TASK_NAME, lm_eval_task_config

REPO_ROOT = Path(__file__).resolve().parent.parent


def hub_rows(mc_task_json) -> list[dict]:
    """What the hub's truthful_qa "multiple_choice" loader yields per question: each {answer: label} map as
    parallel choices/labels lists in the map's order. Kept apart from eval.truthfulqa on purpose."""
    questions = json.loads(Path(mc_task_json).read_text(encoding="utf-8"))
    return [
        {
            "question": q["question"],
            "mc1_targets": {"choices": list(q["mc1_targets"].keys()), "labels": list(q["mc1_targets"].values())},
            "mc2_targets": {"choices": list(q["mc2_targets"].keys()), "labels": list(q["mc2_targets"].values())},
        }
        for q in questions
    ]


def reference_task_config(hub_jsonl) -> dict:
    """lm-eval's own truthfulqa_mc2 config with only its dataset pointed at hub-format rows on disk."""
    cfg = lm_eval_task_config(TASK_NAME)
    cfg.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": {"validation": str(hub_jsonl)}})
    return cfg


def write_hub_jsonl(mc_task_json, path) -> Path:
    path = Path(path)
    path.write_text(
        "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in hub_rows(mc_task_json)), encoding="utf-8"
    )
    return path


def hf_model_args(checkpoint_dir, add_bos: bool) -> str:
    return f"pretrained={Path(checkpoint_dir).resolve()},add_bos_token={add_bos},dtype=float32"


def run_lm_eval_hf(checkpoint_dir, data_dir, *, limit=None, batch_size=8, add_bos=False) -> tuple[dict, str]:
    """lm-eval's `hf` path on checkpoint_dir; returns (results, the call as text)."""
    with tempfile.TemporaryDirectory() as tmp:
        task = reference_task_config(write_hub_jsonl(Path(data_dir) / DATA_FILE, Path(tmp) / "truthfulqa_mc.jsonl"))
        call = f"lm_eval.simple_evaluate(model='hf', model_args='{hf_model_args(checkpoint_dir, add_bos)}', tasks=[truthfulqa_mc2 on hub-format rows], limit={limit}, batch_size={batch_size}, device='cpu')"
        results = lm_eval.simple_evaluate(
            model="hf",
            model_args=hf_model_args(checkpoint_dir, add_bos),
            tasks=[task],
            task_manager=lm_eval.tasks.TaskManager(include_defaults=False),
            limit=limit,
            batch_size=batch_size,
            device="cpu",
            log_samples=False,
        )
    return results, call


def tune_command() -> str:
    """torchtune's `tune` of this Python's environment (found without an activated venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("tune")
    return str(beside) if beside.is_file() else "tune"


def our_command(checkpoint_dir, data_dir, output_dir, *, limit=None, batch_size=8, add_bos=False) -> list[str]:
    return [
        tune_command(), "run", "recipes/evaluate.py", "--config", "configs/eval/truthfulqa_mc2.yaml",
        f"checkpoint_dir={checkpoint_dir}", f"data_dir={data_dir}", f"output_dir={output_dir}",
        f"limit={'null' if limit is None else limit}", f"batch_size={batch_size}", f"add_bos={add_bos}", "device=cpu", "dtype=fp32",
    ]  # fmt: skip


def run_ours(
    checkpoint_dir, data_dir, output_dir, *, limit=None, batch_size=8, add_bos=False
) -> tuple[dict, list[str]]:
    """Our recipe as a user runs it, from the repo root; returns (its results JSON, the command)."""
    cmd = our_command(
        Path(checkpoint_dir).resolve(),
        Path(data_dir).resolve(),
        output_dir,
        limit=limit,
        batch_size=batch_size,
        add_bos=add_bos,
    )
    subprocess.run(cmd, cwd=REPO_ROOT, check=True)
    (path,) = sorted(Path(output_dir).glob("results_*.json"))[-1:]
    return json.loads(path.read_text()), cmd


def hardware() -> dict:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "gpu": None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "lm_eval": lm_eval.__version__ if hasattr(lm_eval, "__version__") else "0.4.13",
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--checkpoint_dir",
        required=True,
        help="an HF checkpoint folder, e.g. the fine-tune recipe's outputs/tiny/epoch_0",
    )
    parser.add_argument(
        "--data_dir",
        default="../shared/data",
        help="the data folder holding truthfulqa/mc_task.json (default ../shared/data)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N questions (default: all 817)")
    parser.add_argument("--batch_size", type=int, default=8, help="requests per forward pass, both paths (default 8)")
    parser.add_argument(
        "--add_bos", action="store_true", help="prepend BOS in both paths (default: no BOS, see docs/eval.md)"
    )
    parser.add_argument("--out", default=None, help="write the numbers here as JSON")
    parser.add_argument(
        "--note", default=None, help="free text stored with the numbers (e.g. how the checkpoint was made)"
    )
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ours, cmd = run_ours(
            args.checkpoint_dir, args.data_dir, tmp, limit=args.limit, batch_size=args.batch_size, add_bos=args.add_bos
        )
        ours_wall = time.perf_counter() - start
    start = time.perf_counter()
    ref, call = run_lm_eval_hf(
        args.checkpoint_dir, args.data_dir, limit=args.limit, batch_size=args.batch_size, add_bos=args.add_bos
    )
    ref_wall = time.perf_counter() - start

    ours_score = ours["results"][TASK_NAME]["acc,none"]
    ref_score = ref["results"][TASK_NAME]["acc,none"]
    record = {
        "task": TASK_NAME,
        "checkpoint_dir": str(Path(args.checkpoint_dir).resolve()),
        "note": args.note,
        "questions": ours["n-samples"][TASK_NAME]["effective"],
        "questions_lm_eval_hf": ref["n-samples"][TASK_NAME]["effective"],
        "ours": {
            "truthfulqa_mc2": ours_score,
            "stderr": ours["results"][TASK_NAME]["acc_stderr,none"],
            "command": " ".join(str(c) for c in cmd),
            "wall_seconds": round(ours_wall, 1),  # whole command: start-up, model load, eval
            "eval_seconds": round(float(ours["total_evaluation_time_seconds"]), 1),  # lm_eval.simple_evaluate only
        },
        "lm_eval_hf": {
            "truthfulqa_mc2": ref_score,
            "stderr": ref["results"][TASK_NAME]["acc_stderr,none"],
            "call": call,
            "wall_seconds": round(ref_wall, 1),  # in-process: model load and eval
        },
        "abs_diff": abs(ours_score - ref_score),
        "add_bos": args.add_bos,  # the same in both paths: add_bos=... / add_bos_token=...
        "batch_size": args.batch_size,
        "dtype": "float32",
        "hardware": hardware(),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if record["abs_diff"] <= 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
