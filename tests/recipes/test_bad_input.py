"""Each bad input stops the recipe before training: one line naming the value and the fix,
exit status 2, no traceback, and the checkpoints already in output_dir left as they were.

Most cases call the recipe's entry point in this process (what `tune run` calls after its
~8 s of imports, which would otherwise be paid 18 times); a few go through `tune run` itself
to show the exit status reaches the shell.
"""

import hashlib
import json
import sys
from dataclasses import dataclass

import pytest
import torch

from conftest import DATA_DIR, FAST, RECIPE, REPO_ROOT, TINY_CONFIG, run_recipe


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def run_in_process(output_dir, *overrides, capsys, monkeypatch) -> Result:
    from recipes.full_finetune_single_device import recipe_main

    argv = [
        RECIPE,
        "--config",
        TINY_CONFIG,
        f"data_dir={DATA_DIR}",
        f"output_dir={output_dir}",
        *FAST,
        "metric_logger=null",
        *overrides,
    ]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.chdir(REPO_ROOT)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        recipe_main()
    captured = capsys.readouterr()
    return Result(stop.value.code, captured.out, captured.err)


def snapshot(folder):
    return {
        str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def out_with_checkpoint(tmp_path):
    """An output_dir that already holds a (stand-in) good checkpoint and metrics."""
    out = tmp_path / "out"
    (out / "epoch_0").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "recipe_state.pt", "tokenizer.model"):
        (out / "epoch_0" / name).write_bytes(name.encode() * 100)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    return out


def write_json(path, records):
    path.write_text(json.dumps(records))
    return path


GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi."}

# (id, overrides (callable of tmp_path -> list), words the message must hold ({t} = tmp_path))
CASES = [
    (
        "unknown-optimizer",
        lambda t: ["optimizer=torch.optim.NoSuchAdam"],
        ["optimizer=torch.optim.NoSuchAdam cannot be imported", "torch.optim.AdamW"],
    ),
    (
        "optimizer-not-a-module",
        lambda t: ["optimizer=nosuchpackage.AdamW"],
        ["optimizer=nosuchpackage.AdamW cannot be imported"],
    ),
    # torch's AdamW takes maximize=, bitsandbytes' does not: not a backend flag, so it is an error.
    (
        "kwarg-rejected",
        lambda t: ["optimizer=bitsandbytes.optim.AdamW8bit", "optimizer.maximize=True"],
        ["optimizer.maximize=True is not accepted by bitsandbytes.optim.AdamW8bit", "~optimizer.maximize"],
    ),
    (
        "missing-data-file",
        lambda t: [f"dataset.data_files={t}/nope/alpaca_data.json"],
        [
            "dataset.data_files={t}/nope/alpaca_data.json does not exist",
            "set dataset.data_files=FILE",
            "dataset.source=tatsu-lab/alpaca",
        ],
    ),
    (
        "malformed-data-file",
        lambda t: [f"dataset.data_files={t / 'bad.json'}"],
        ["dataset.data_files={t}/bad.json line 1 is not valid JSON (Expecting value at column 55)", "fix or drop"],
    ),
    (
        "record-without-output",
        lambda t: [f"dataset.data_files={t / 'no_output.json'}"],
        ["record 1 of", "has no 'output'"],
    ),
    (
        "records-without-instruction",
        lambda t: [f"dataset.data_files={t / 'no_instruction.json'}"],
        ["have no 'instruction' field"],
    ),
    (
        "missing-tokenizer",
        lambda t: [f"tokenizer.path={t}/tokenizer.model"],
        ["tokenizer.path={t}/tokenizer.model does not exist", "set tokenizer.path=FILE"],
    ),
    (
        "wrong-data-dir",
        lambda t: [f"data_dir={t}/nowhere"],
        ["tokenizer.path={t}/nowhere/llama2_tokenizer/tokenizer.model does not exist", "set data_dir=DIR"],
    ),
    ("no-gpu", lambda t: ["device=cuda"], ["device=cuda but no CUDA GPU is visible", "device=cpu"]),
    (
        "missing-checkpoint-dir",
        lambda t: [f"checkpoint_dir={t}/Llama-2-7b-hf"],
        ["checkpoint_dir={t}/Llama-2-7b-hf is not a folder with HF weights", "checkpoint_dir=null"],
    ),
    (
        "missing-resume-dir",
        lambda t: [f"resume_from_checkpoint={t}/step_9"],
        ["resume_from_checkpoint={t}/step_9 lacks model.safetensors, recipe_state.pt"],
    ),
    ("zero-lr", lambda t: ["optimizer.lr=0"], ["optimizer.lr=0 must be a positive number"]),
    ("negative-lr", lambda t: ["optimizer.lr=-1e-4"], ["optimizer.lr=-0.0001 must be a positive number"]),
    ("zero-batch-size", lambda t: ["batch_size=0"], ["batch_size=0 must be a positive integer"]),
    ("negative-batch-size", lambda t: ["batch_size=-2"], ["batch_size=-2 must be a positive integer"]),
    (
        "in-bwd-with-accumulation",
        lambda t: ["optimizer_in_bwd=True", "clip_grad_norm=null", "gradient_accumulation_steps=2"],
        ["optimizer_in_bwd=True cannot accumulate gradients", "gradient_accumulation_steps=1"],
    ),
    (
        "in-bwd-with-clipping",
        lambda t: ["optimizer_in_bwd=True", "clip_grad_norm=1.0"],
        ["optimizer_in_bwd=True cannot clip gradients", "clip_grad_norm=null"],
    ),
    ("bad-dtype", lambda t: ["dtype=fp16"], ["dtype='fp16' is not supported"]),
    # torchao's CPU offload copies gradients out during backward: clipping afterwards would not reach them.
    (
        "offload-with-clipping",
        lambda t: ["optimizer=torchao.optim.CPUOffloadOptimizer"],
        [
            "optimizer=torchao.optim.CPUOffloadOptimizer copies gradients to the CPU during backward",
            "clip_grad_norm=null",
        ],
    ),
    (
        "offload-bad-inner-class",
        lambda t: [
            "optimizer=torchao.optim.CPUOffloadOptimizer",
            "clip_grad_norm=null",
            "optimizer.optimizer_class=torch.optim.NoSuchAdam",
        ],
        ["optimizer.optimizer_class=torch.optim.NoSuchAdam cannot be imported", "torch.optim.AdamW"],
    ),
]


CLI_CASES = ("unknown-optimizer", "missing-data-file", "zero-lr")


@pytest.mark.parametrize(
    "make_overrides, words, via_cli",
    [pytest.param(o, w, i in CLI_CASES, id=i + ("-via-tune-run" if i in CLI_CASES else "")) for i, o, w in CASES],
)
def test_bad_input_stops_before_training(
    tmp_path, out_with_checkpoint, make_overrides, words, via_cli, capsys, monkeypatch
):
    (tmp_path / "bad.json").write_text('[{"instruction": "a", "output": "b"}, {"instruction": ')
    write_json(tmp_path / "no_output.json", [GOOD, {"instruction": "Say bye.", "input": ""}, GOOD])
    write_json(tmp_path / "no_instruction.json", [{"input": "", "output": "x"}] * 3)
    before = snapshot(out_with_checkpoint)
    if "device=cuda" in make_overrides(tmp_path) and torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: device=cuda is not bad input here")

    if via_cli:
        run = run_recipe(out_with_checkpoint, *make_overrides(tmp_path), timeout=300)
    else:
        run = run_in_process(out_with_checkpoint, *make_overrides(tmp_path), capsys=capsys, monkeypatch=monkeypatch)

    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    for word in words:
        assert word.format(t=tmp_path) in errors[0], errors[0]
    assert "Traceback" not in run.stderr
    assert "step 1 |" not in run.stdout  # nothing trained
    assert snapshot(out_with_checkpoint) == before
    assert not (out_with_checkpoint / "wandb").exists()


def test_unwritable_output_dir(tmp_path):
    # A path below a regular file cannot be created by anyone, root included (chmod would not
    # stop root, and tests may run as root).
    blocker = tmp_path / "file"
    blocker.write_text("")
    run = run_recipe(blocker / "out", timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert f"error: output_dir={blocker / 'out'} is not writable" in run.stderr
    assert "set output_dir=DIR" in run.stderr
