"""The recipe, run for real on the FAST tiny model and Alpaca.

Expected losses were recorded from a trusted run on the 2-core CPU machine (torch 2.13.0+cpu,
OMP_NUM_THREADS=2) and are compared with rtol 1e-4. To add an optimizer, add one entry to
OPTIMIZER_CASES: run it once, paste its losses (``run.losses``) in.

Most runs call the recipe in this process (conftest.run_here): a subprocess spends most of its time importing torch
and torchtune, and torch's AdamW gives the same losses here as in a subprocess (to ~1e-7). Subprocesses remain where
the process matters: the quantized optimizers' recorded losses (recorded under recipe_env's AVX2 pin, which this
process lacks), torchao's compiled updates, a process without Triton, the run killed after a save, and the reference
run (wandb, and the summary the process prints last).
"""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import optimizers
from conftest import (
    TORCH_ADAMW_LOSSES,
    kill_once_saved,
    read_metrics,
    recipe_env,
    run_here,
    run_in_one_process,
    run_recipe,
    wandb_history,
)

RTOL = 1e-4

# TORCH_ADAMW_LOSSES (conftest): recorded from the FAST config (6 steps, lr 1e-2, clip 1.0, fp32) with
# torch.optim.AdamW.

# The same with clip_grad_norm=null (recorded from a plain torch.optim.AdamW run).
TORCH_ADAMW_NO_CLIP_LOSSES = [
    10.581151008605957,
    9.88840389251709,
    9.055660247802734,
    8.4867525100708,
    8.535334587097168,
    7.8871355056762695,
]

# How a case runs. HERE: in this process (torch's AdamW: its losses do not depend on the process). PINNED: the
# quantized optimizers, whose losses were recorded under recipe_env's AVX2 pin (a state element rounding the other
# way under AVX-512 moves a loss past RTOL): all of a session's PINNED cases in one pinned subprocess (pinned_runs),
# which imports torch once for them. OWN: a pinned subprocess of its own, for torchao's optimizers, which
# torch.compile their update: in a shared process one case's compiled graphs and recompile counts would carry over
# into the next.
HERE, PINNED, OWN = "here", "pinned", "own"

# (id, overrides, expected losses, marks, how it runs). Kwargs the class rejects (fused=True from the
# config) are dropped by the recipe, so a swap is just optimizer=PATH.
OPTIMIZER_CASES = [
    ("torch-fused", ["optimizer.fused=True"], TORCH_ADAMW_LOSSES, [], HERE),
    ("torch-foreach", ["optimizer.fused=False", "optimizer.foreach=True"], TORCH_ADAMW_LOSSES, [], HERE),
    (
        "bnb-AdamW8bit",
        ["optimizer=bitsandbytes.optim.AdamW8bit"],
        [
            10.581151008605957,
            9.888405799865723,
            9.05609130859375,
            8.488571166992188,
            8.54041576385498,
            7.895923614501953,
        ],
        [],
        PINNED,
    ),
    # On CPU bitsandbytes falls back to non-paged state (it warns); the update is the same.
    (
        "bnb-PagedAdamW8bit",
        ["optimizer=bitsandbytes.optim.PagedAdamW8bit"],
        [
            10.581151008605957,
            9.888405799865723,
            9.05609130859375,
            8.488571166992188,
            8.54041576385498,
            7.895923614501953,
        ],
        [],
        PINNED,
    ),
    # torchao's optimizers torch.compile their update; on CPU that works (inductor + gcc) but the
    # first step compiles for ~30 s, so each case takes about 45 s.
    (
        "torchao-AdamW8bit",
        ["optimizer=torchao.optim.AdamW8bit"],
        [
            10.581151008605957,
            9.888410568237305,
            9.057902336120605,
            8.489923477172852,
            8.548670768737793,
            7.89932918548584,
        ],
        [],
        OWN,
    ),
    (
        "torchao-AdamW4bit",
        ["optimizer=torchao.optim.AdamW4bit"],
        [10.581151008605957, 9.888410568237305, 9.10706615447998, 8.58837890625, 8.647028923034668, 8.03925895690918],
        [],
        OWN,
    ),
    (
        "torchao-AdamWFp8",
        ["optimizer=torchao.optim.AdamWFp8"],
        [
            10.581151008605957,
            9.888410568237305,
            9.061450958251953,
            8.493914604187012,
            8.549219131469727,
            7.910982608795166,
        ],
        [],
        OWN,
    ),
]

# Ours, by key of optimizers.VARIANTS: on CPU the plain-PyTorch path (the Triton kernel is held to it in
# tests/optimizers/test_optimizers.py). Every registered variant gets a case (our_cases); one without recorded losses here fails
# with the instruction to record them.
OUR_LOSSES = {
    "ours8": [
        10.581151008605957,
        9.88840103149414,
        9.05556583404541,
        8.488266944885254,
        8.5391845703125,
        7.893004894256592,
    ],
    "ours4": [
        10.581151008605957,
        9.88840103149414,
        9.054448127746582,
        8.47649097442627,
        8.524319648742676,
        7.8692498207092285,
    ],
    "oursfp8": [
        10.581151008605957,
        9.88840103149414,
        9.055978775024414,
        8.488475799560547,
        8.53968334197998,
        7.895044803619385,
    ],
    "ours16": [
        10.581151008605957,
        9.88840103149414,
        9.055523872375488,
        8.488167762756348,
        8.539460182189941,
        7.893132209777832,
    ],
}


def our_cases() -> list:
    """(id, overrides, expected losses or None, marks, PINNED) for every registered variant, read at collection
    time."""
    return [
        (f"ours-{v.cls.__name__}", v.overrides, OUR_LOSSES.get(v.key), [], PINNED) for v in optimizers.VARIANTS.values()
    ]


OPTIMIZER_CASES += our_cases()

METRIC_KEYS = {
    "step",
    "loss",
    "lr",
    "tokens_per_second",
    "peak_rss_gib",
    "optimizer_step_ms",
    "optimizer_state_bytes",
    "grad_norm",
    "gc_ms",
    "gc_full",
}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """One uninterrupted run with wandb on and a periodic checkpoint, shared by several tests."""
    out = tmp_path_factory.mktemp("reference") / "out"
    run = run_recipe(out, "save_every_n_steps=2", wandb=True)
    assert run.ok, run.stderr[-3000:]
    return run


# torchao's FP8 AdamW rounds its states to e4m3 (3 mantissa bits) in inductor-compiled C++. On a Xeon with AVX-512 and
# AMX, every ISA pin of conftest.recipe_env set, its last recorded loss lands 1.0e-3 from the AVX2 recording (steps 1-5
# within 1e-4): a state element rounding the other way. Its last step is held to 2e-3, every other step to RTOL, which
# still tells it from torchao's 8-bit AdamW (4e-4 apart at step 3).
LAST_STEP_RTOL = {"optimizer=torchao.optim.AdamWFp8": 2e-3}


@pytest.fixture(scope="module")
def pinned_runs(request, tmp_path_factory):
    """The PINNED cases this session selected, by id, run one after another in one subprocess pinned as run_recipe's
    (support.run_batch): each a fresh recipe_main, seeded as in a process of its own."""
    selected = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and getattr(item, "originalname", None) == "test_optimizer_losses"
    }
    root = tmp_path_factory.mktemp("pinned")
    cases = {i: (root / i, o) for i, o, _, _, how in OPTIMIZER_CASES if how == PINNED and i in selected}
    return run_in_one_process(cases)


@pytest.mark.parametrize(
    "case, overrides, expected, how",
    [pytest.param(i, o, e, how, id=i, marks=m) for i, o, e, m, how in OPTIMIZER_CASES],
)
def test_optimizer_losses(request, tmp_path, case, overrides, expected, how):
    if how == HERE:
        run = run_here(tmp_path / "out", *overrides)
    elif how == OWN:
        run = run_recipe(tmp_path / "out", *overrides)
    else:
        run = request.getfixturevalue("pinned_runs")[case]
    assert run.ok, run.stderr[-3000:]
    assert expected is not None, f"no recorded losses for {overrides}: add {run.losses} to OUR_LOSSES"
    last_rtol = max([RTOL] + [LAST_STEP_RTOL.get(o, RTOL) for o in overrides])
    assert run.losses[:-1] == pytest.approx(expected[:-1], rel=RTOL)
    assert run.losses[-1] == pytest.approx(expected[-1], rel=last_rtol)


def test_without_triton_our_optimizer_trains_on_the_plain_path(recipe_runner, tmp_path):
    """`pip install -e .` brings no Triton: with it unimportable, optimizers.AdamW8bit still imports and the fine-tune
    gives the recorded losses (the CPU runs the plain-PyTorch path either way)."""
    hide = tmp_path / "hide_triton"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['triton'] = None  # import triton -> ImportError\n")
    env = recipe_env(PYTHONPATH=str(hide))
    probe = subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "triton" in probe.stderr
    run = recipe_runner("optimizer=optimizers.AdamW8bit", env=env)
    assert run.ok, run.stderr[-3000:]
    expected = next(e for i, _, e, _, _ in OPTIMIZER_CASES if i == "ours-AdamW8bit")
    assert run.losses == pytest.approx(expected, rel=RTOL)


def test_reference_run_metrics_and_checkpoints(reference_run):
    assert reference_run.losses == pytest.approx(TORCH_ADAMW_LOSSES, rel=RTOL)
    assert [m["step"] for m in reference_run.metrics] == [1, 2, 3, 4, 5, 6]
    for record in reference_run.metrics:
        assert METRIC_KEYS <= set(record), record
        assert record["tokens_per_second"] > 0 and record["optimizer_state_bytes"] > 0
        assert record["gc_ms"] >= 0 and record["gc_full"] >= 0
    # fp32 AdamW: two states the size of the model, plus one step counter per parameter.
    weights = (reference_run.output_dir / "epoch_0" / "model.safetensors").stat().st_size
    assert 2 * weights * 0.99 < reference_run.metrics[-1]["optimizer_state_bytes"] < 2 * weights * 1.01
    # step_2 and step_4 periodic, step_6 skipped (it ends the epoch, epoch_0 holds it).
    names = sorted(p.name for p in reference_run.output_dir.iterdir() if p.is_dir() and p.name != "wandb")
    assert names == ["epoch_0", "step_2", "step_4"]
    for name in names:
        files = {p.name for p in (reference_run.output_dir / name).iterdir()}
        assert files == {
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.model",
            "recipe_state.pt",
            "recipe_state.pt.crc32",
            "run.json",
        }  # (run.json: the wandb run that wrote it, for the eval; .crc32: the state file's checksum)
    assert "step 6 | epoch 0 | loss" in reference_run.stdout


def test_wandb_offline_run_holds_logged_loss(reference_run):
    runs = list((reference_run.output_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "expected one offline wandb run (no WANDB_API_KEY in the test env)"
    history = wandb_history(runs[0])
    assert [row["loss"] for row in history] == pytest.approx(reference_run.losses, rel=1e-9)


def test_wandb_folder_holds_a_copy_of_the_config_and_the_run_ends_with_a_summary(reference_run):
    """The offline run folder is self-contained (a copy of this run's config, not a link a later run overwrites),
    the config is not dumped on the terminal, and the last output is one paragraph pointing at every output."""
    from omegaconf import OmegaConf

    out = reference_run.output_dir
    run_dir = next((out / "wandb").glob("offline-run-*"))
    saved = run_dir / "files" / "torchtune_config.yaml"
    assert saved.is_file() and not saved.is_symlink()
    cfg = OmegaConf.load(saved)
    assert cfg.output_dir == str(out) and cfg.save_every_n_steps == 2 and cfg.model.num_layers == 1
    text = reference_run.stdout + reference_run.stderr
    assert "resolved config" not in text and "\nbatch_size: " not in text
    summary = reference_run.stdout.strip().splitlines()[-1]
    losses = reference_run.losses
    assert summary.startswith("Run done: trained steps 1-6 (6 steps) in ")
    assert f"loss {losses[0]:.4f} at step 1 -> {losses[-1]:.4f} at step 6" in summary
    assert (
        f"Metrics: {out / 'metrics.jsonl'}" in summary
        and f"Checkpoints: {out / 'epoch_0'} (latest; also step_2, step_4)" in summary
        and f"wandb: {run_dir}" in summary
    )


def test_saved_checkpoint_lines_report_size_and_time(reference_run):
    """Each checkpoint is announced with its size and write time; the sizes are the folders' on disk. (That
    bench/pipeline.py reads these lines: tests/bench/test_harness.py.)"""
    from pathlib import Path

    found = [
        m
        for m in map(
            re.compile(r"Saved checkpoint (\S+) \(([\d.]+) GB in ([\d.]+) s\)").search,
            reference_run.stdout.splitlines(),
        )
        if m
    ]
    assert [Path(m.group(1)).name for m in found] == ["step_2", "step_4", "epoch_0"]
    for m in found:
        folder = Path(m.group(1))
        on_disk = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        assert float(m.group(3)) >= 0 and float(m.group(2)) == pytest.approx(on_disk / 1e9, abs=0.006), m.group(0)


def test_checkpoint_loads_in_transformers_with_same_logits(reference_run):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from torchtune.models.convert_weights import hf_to_tune
    from torchtune.models.llama2 import llama2

    ckpt = reference_run.output_dir / "epoch_0"
    hf_model = transformers.LlamaForCausalLM.from_pretrained(ckpt).eval()
    config = json.loads((ckpt / "config.json").read_text())
    tune_model = llama2(vocab_size=32000, num_layers=1, num_heads=2, num_kv_heads=2, embed_dim=64, max_seq_len=512)
    tune_model.load_state_dict(hf_to_tune(load_file(ckpt / "model.safetensors"), num_heads=2, num_kv_heads=2, dim=64))
    tokens = torch.randint(0, config["vocab_size"], (2, 17))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, tune_model(tokens), rtol=1e-4, atol=1e-4)


def folder_contents(folder) -> dict:
    """Every file's bytes and every link's target under ``folder``, by relative path."""
    return {
        str(p.relative_to(folder)): os.readlink(p) if p.is_symlink() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_symlink() or p.is_file()
    }


def test_resuming_a_finished_run_writes_nothing(reference_run, tmp_path):
    """A resume from the finished run's epoch_0, into its own folder, with wandb on: exit 0 and one closing line;
    summary.json still names the finished wandb run (not a new, empty one), and no wandb run folder is added
    (``latest-run`` still points to the run that trained). Nothing in the folder changes."""
    out = tmp_path / "out"
    shutil.copytree(reference_run.output_dir, out, symlinks=True)
    before = folder_contents(out)
    resumed = run_recipe(out, "save_every_n_steps=2", f"resume_from_checkpoint={out / 'epoch_0'}", wandb=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert folder_contents(out) == before
    assert resumed.stdout.strip().splitlines() == [
        f"Nothing trained: resume_from_checkpoint={out / 'epoch_0'} is at global step 6, already the end of training "
        "with epochs=1, max_steps_per_epoch=6; nothing was written. To train further, raise epochs or "
        "max_steps_per_epoch (the lr schedule then differs from the finished run's)"
    ]


def test_resume_after_kill_continues_with_same_losses(tmp_path):
    """Kill a run once its step_2 checkpoint exists; resuming gives the uninterrupted losses. (The kill needs a
    process; the resume is a run like any other, here.)"""
    out = tmp_path / "out"
    kill_once_saved(out, "step_2", "save_every_n_steps=2")

    resumed = run_here(out, "save_every_n_steps=2", f"resume_from_checkpoint={out / 'step_2'}")
    assert resumed.ok, resumed.stderr[-3000:]
    tail = resumed.metrics[-4:]  # the killed run's records come first: resume appends
    assert [m["step"] for m in tail] == [3, 4, 5, 6]
    assert [m["loss"] for m in tail] == pytest.approx(TORCH_ADAMW_LOSSES[2:], rel=RTOL)
    assert [m["lr"] for m in tail] == pytest.approx([m["lr"] for m in read_metrics(out)][-4:])


def test_optimizer_in_backward_and_its_resume(tmp_path):
    common = ["optimizer_in_bwd=True", "clip_grad_norm=null", "save_every_n_steps=3"]
    full = run_here(tmp_path / "full", *common)
    assert full.ok, full.stderr[-3000:]
    # The per-parameter AdamW steps give what one AdamW over all parameters gives without clipping.
    assert full.losses == pytest.approx(TORCH_ADAMW_NO_CLIP_LOSSES, rel=RTOL)
    assert full.metrics[0]["grad_norm"] is None and full.metrics[0]["optimizer_step_ms"] is None

    resumed = run_here(tmp_path / "resumed", *common, f"resume_from_checkpoint={tmp_path / 'full' / 'step_3'}")
    assert resumed.ok, resumed.stderr[-3000:]
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    assert resumed.losses == pytest.approx(full.losses[3:], rel=RTOL)


def test_24gb_mode_in_miniature_resumes(tmp_path):
    """configs/llama2/7B_full_24gb.yaml's mode on the tiny model: our 4-bit AdamW in backward, chunked loss (the tiny
    config's), a checkpoint at step 3, and a resume from it that continues with the same losses."""
    common = ["optimizer=optimizers.AdamW4bit", "optimizer_in_bwd=True", "clip_grad_norm=null", "save_every_n_steps=3"]
    # Both runs here: the resume is compared with the full run, not with a recording, so the vector ISA is moot.
    full = run_here(tmp_path / "full", *common)
    assert full.ok, full.stderr[-3000:]
    assert all(math.isfinite(x) for x in full.losses) and full.losses[-1] < full.losses[0]
    resumed = run_here(tmp_path / "resumed", *common, f"resume_from_checkpoint={tmp_path / 'full' / 'step_3'}")
    assert resumed.ok, resumed.stderr[-3000:]
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    assert resumed.losses == pytest.approx(full.losses[3:], rel=RTOL)


def test_plain_loss_gives_the_chunked_losses(tmp_path):
    # The tiny config uses the chunked loss (as the 7B configs do); the full-logits loss trains identically.
    run = run_here(tmp_path / "out", "loss=torch.nn.CrossEntropyLoss")
    assert run.ok, run.stderr[-3000:]
    assert run.losses == pytest.approx(TORCH_ADAMW_LOSSES, rel=RTOL)


def test_gradient_accumulation_matches_the_big_batch(tmp_path):
    # batch 1 x 2 micro-batches sees the same samples per step as batch 2, and the loss is
    # normalised over all tokens of the step, so the losses match the recorded batch-2 run.
    run = run_here(tmp_path / "out", "batch_size=1", "gradient_accumulation_steps=2")
    assert run.ok, run.stderr[-3000:]
    assert run.losses == pytest.approx(TORCH_ADAMW_LOSSES, rel=RTOL)


def test_activation_checkpointing_changes_nothing_but_memory(tmp_path):
    run = run_here(tmp_path / "out", "enable_activation_checkpointing=True")
    assert run.ok, run.stderr[-3000:]
    assert run.losses == pytest.approx(TORCH_ADAMW_LOSSES, rel=RTOL)


def test_bf16_runs(tmp_path):
    run = run_here(tmp_path / "out", "dtype=bf16", "max_steps_per_epoch=3")
    assert run.ok, run.stderr[-3000:]
    assert len(run.losses) == 3 and all(math.isfinite(x) for x in run.losses)
    # Only the first two steps are comparable: a 3-step run has a shorter cosine schedule.
    assert run.losses[:2] == pytest.approx(TORCH_ADAMW_LOSSES[:2], rel=2e-2)  # bf16 rounding, same trajectory
    state = json.loads((run.output_dir / "epoch_0" / "config.json").read_text())
    assert state["torch_dtype"] == "bfloat16"


# compile=True on the CPU: tests/finetune/data/test_packing.py runs it with packing and selective checkpointing, and checks that
# nothing recompiles after the first step.


@pytest.mark.gpu
def test_gpu_bf16_fused(recipe_runner):
    run = recipe_runner("device=cuda", "dtype=bf16", "optimizer.fused=True")
    assert run.ok, run.stderr[-3000:]
    assert "peak_memory_alloc_gib" in run.metrics[-1] and "peak_memory_reserved_gib" in run.metrics[-1]
    assert run.losses[-1] < run.losses[0]
