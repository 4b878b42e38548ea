"""What a newcomer met on a fresh clone (tiny config, CPU), each run as typed: the one `error:` line and exit status
2, or the success.

One `tune` process (a 2-rank torchrun launch that stops on a used output_dir) and a few runs in this process (a
one-step run from another folder, and runs that stop while the config is checked): about 20 s on 2 cores.
"""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from conftest import DATA_DIR, FAST, RECIPE, REPO_ROOT, TINY_CONFIG, TUNE, recipe_env


def typed(out: Path, *overrides: str):
    """``tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml ...`` in this process, stopped
    by the config check: (exit status, stderr lines)."""
    from recipes.full_finetune_single_device import recipe_main

    argv = [RECIPE, "--config", TINY_CONFIG, f"data_dir={DATA_DIR}", f"output_dir={out}", *overrides]
    stderr, code = io.StringIO(), 0
    with mock.patch.object(sys, "argv", argv), contextlib.chdir(REPO_ROOT), contextlib.redirect_stderr(stderr):
        try:
            recipe_main()
        except SystemExit as e:
            code = e.code or 0
    return code, stderr.getvalue().splitlines()


def test_a_bad_input_under_torchrun_is_one_line_last_with_exit_2(tmp_path):
    """The README's distributed command into a folder that already holds a run: our line once, at the end, not
    torchrun's ChildFailedError report."""
    out = tmp_path / "outputs" / "tiny"
    out.mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 10.0}\n')
    proc = subprocess.run(
        [
            TUNE,
            "run",
            "--nproc_per_node",
            "2",
            "recipes/full_finetune_distributed.py",
            "--config",
            TINY_CONFIG,
            f"data_dir={DATA_DIR}",
            f"output_dir={out}",
            *FAST,
            "metric_logger=null",
        ],
        cwd=REPO_ROOT,
        env=recipe_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr[-4000:]
    said = [line for line in (proc.stdout + proc.stderr).splitlines() if "error: " in line]
    assert len(said) == 1 and said[0].startswith(f"error: output_dir={out} already holds a run (metrics.jsonl); ")
    assert [line for line in proc.stderr.splitlines() if line.strip()][-1] == said[0]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr


def test_tune_run_from_another_folder_runs_our_recipe(tmp_path, monkeypatch, capsys):
    """`tune run ../path/to/recipes/x.py` made the module name `...path.to.recipes.x`: "Relative module names not
    supported". Our recipes run from any folder. (`tune`'s own entry point, in this process.)"""
    from torchtune._cli.tune import main

    recipe, config = (os.path.relpath(REPO_ROOT / p, tmp_path) for p in (RECIPE, TINY_CONFIG))
    assert recipe.startswith("..")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            TUNE,
            "run",
            recipe,
            "--config",
            config,
            f"data_dir={DATA_DIR}",
            "output_dir=outputs/tiny",
            *FAST,
            "max_steps_per_epoch=1",
            "metric_logger=null",
        ],
    )
    monkeypatch.setattr(sys, "path", list(sys.path))  # (tune run appends the current folder)
    with pytest.raises(SystemExit) as stop:
        main()
    assert not stop.value.code, capsys.readouterr().err[-3000:]
    assert "Run done: trained steps 1-1 (1 step)" in capsys.readouterr().out
    assert (tmp_path / "outputs" / "tiny" / "epoch_0" / "model.safetensors").is_file()


def test_another_recipe_outside_the_current_folder_is_one_error_line(tmp_path, capsys, monkeypatch):
    """What `tune run` does with a path it cannot import (the launcher hook of finetune/tune_run.py, in this process)."""
    from torchtune._cli.run import Run

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        Run._convert_to_dotpath(None, "../elsewhere/my_recipe.py")
    assert stop.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: tune run ../elsewhere/my_recipe.py: ")
    assert f"cd {tmp_path.parent / 'elsewhere'} and give its file name" in line
    assert Run._convert_to_dotpath(None, "my_recipes/custom.py") == "my_recipes.custom"  # below the folder: as before


@pytest.mark.parametrize(
    "override, says",
    [
        (
            "model.num_layer=2",
            "error: model.num_layer is not a key of torchtune.models.llama2.llama2; did you mean "
            "model.num_layers? its keys: attn_dropout, embed_dim, ",
        ),
        (
            "metric_logger.projct=x",
            "error: metric_logger.projct is not a key of "
            "torchtune.training.metric_logging.WandBLogger; did you mean metric_logger.project? ",
        ),
        (
            "profiler.enable=True",
            "error: profiler.enable is not a key of torchtune.training.setup_torch_profiler; did you "
            "mean profiler.enabled? ",
        ),
    ],
    ids=["model", "metric_logger", "profiler"],
)
def test_a_typo_in_a_component_key_is_one_line(tmp_path, override, says):
    code, lines = typed(tmp_path / "out", override)
    assert code == 2 and [line for line in lines if line.startswith("error: ")] == lines[-1:], lines
    assert lines[-1].startswith(says) and f"(remove it with ~{override.split('=')[0]})" in lines[-1]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_cpu_offload_on_a_cpu_says_it_needs_a_gpu(tmp_path):
    """docs/recipes.md's CPU-offload overrides on the tiny config (device=cpu)."""
    code, lines = typed(
        tmp_path / "out",
        "optimizer=torchao.optim.CPUOffloadOptimizer",
        "optimizer.offload_gradients=True",
        "clip_grad_norm=null",
    )
    assert code == 2 and [line for line in lines if line.startswith("error: ")] == lines[-1:], lines
    assert lines[-1].startswith(
        "error: optimizer=torchao.optim.CPUOffloadOptimizer moves the optimizer state from "
        "the GPU to the CPU and needs device=cuda (device=cpu)"
    )
    assert not (tmp_path / "out").exists()
