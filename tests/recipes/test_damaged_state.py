"""A damaged recipe_state.pt at resume, through the single-device recipe: every damage ends in one ``error:`` line
before any step, naming the file, the parameter or value, and the fix; an undamaged copy resumes exactly.

Each damage is tried twice: as the checkpoint has it, with its checksum beside it (recipe_state.pt.crc32:
finetune/checkpoint/state_file.py), which any changed byte fails; and with the checksum removed, as a checkpoint
written before checksums (or edited on purpose) has it, where the state's own checks (finetune/checkpoint/
state_check.py) name what is wrong. The distributed recipe's resume runs the same checks (test_distributed.py).

All in this process (``run_here``): two short runs make the checkpoints, and each damaged resume stops during setup.
"""

import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import run_here

OPTIMIZERS = {"ours8": "optimizers.AdamW8bit", "torch": "torch.optim.AdamW"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One FAST run per optimizer (8-bit: block-scaled codes; torch's AdamW: plain tensors) with step_2."""
    runs = {}
    for key, optimizer in OPTIMIZERS.items():
        run = run_here(tmp_path_factory.mktemp(key) / "out", f"optimizer={optimizer}", "save_every_n_steps=2")
        assert run.returncode == 0 and len(run.losses) == 6, run.stderr[-3000:]
        runs[key] = run
    return runs


def copy_step_2(run, dest: Path) -> Path:
    return Path(shutil.copytree(run.output_dir / "step_2", dest / "step_2"))


def resume(key: str, ckpt: Path, out: Path):
    return run_here(out, f"optimizer={OPTIMIZERS[key]}", f"resume_from_checkpoint={ckpt}")


def edited(change):
    """A damage made by loading the state, changing it and saving it again (a file whose zip is consistent)."""

    def damage(path: Path) -> None:
        state = torch.load(path, weights_only=True)
        change(state)
        torch.save(state, path)

    return damage


def flipped(path: Path) -> None:
    """256 bytes flipped inside the largest tensor record, where torch.load does not look at the record's CRC."""
    with zipfile.ZipFile(path) as z:
        record = max(z.infolist(), key=lambda i: i.file_size)
    data = bytearray(path.read_bytes())
    header = record.header_offset
    start = header + 30 + int.from_bytes(data[header + 26 : header + 28], "little")
    start += int.from_bytes(data[header + 28 : header + 30], "little") + 1000
    data[start : start + 256] = bytes(b ^ 0xFF for b in data[start : start + 256])
    path.write_bytes(bytes(data))


def entry(state: dict, i: int = 0) -> dict:
    return state["optimizer"]["state"][i]


def short(state: dict) -> None:
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        entry(state)[key] = entry(state)[key][:-1].clone()


def assign(target, key, value):
    return lambda state: target(state).__setitem__(key, value)


FIRST = "tok_embeddings.weight"
BOTH, OURS = tuple(OPTIMIZERS), ("ours8",)
# name: (the optimizers it applies to, the damage, what the error line says without the checksum; None: no value
# check can tell, the checksum only: the scales stay finite and positive)
DAMAGES = {
    "flipped_bytes": (BOTH, flipped, "is damaged: its record archive/data/1 fails its CRC check"),
    "scale_x1e6": (OURS, edited(lambda s: entry(s)["exp_avg_scale"].mul_(1e6)), None),
    "entry_missing": (
        BOTH,
        edited(lambda s: s["optimizer"]["state"].pop(3)),
        "has no entry for parameter layers.0.attn.v_proj.weight (its moments would start again from zero",
    ),
    "lr_1e6": (
        BOTH,
        edited(assign(lambda s: s["optimizer"]["param_groups"][0], "lr", 1e6)),
        f"has lr=1000000.0 for parameter {FIRST}, where its lr schedule stands at 0.0075 (lr_scheduler's last lr)",
    ),
    "betas": (
        BOTH,
        edited(assign(lambda s: s["optimizer"]["param_groups"][0], "betas", (0.5, 0.6))),
        f"has betas=(0.5, 0.6) for parameter {FIRST}, where the settings it was saved with and this run's optimizer "
        "have betas=(0.9, 0.999)",
    ),
    "step_-5": (
        BOTH,
        edited(assign(entry, "step", torch.tensor(-5.0))),
        f"has step=-5 for parameter {FIRST}, where a step count is an integer >= 0",
    ),
    "global_step_-5": (
        OURS,
        edited(assign(lambda s: s, "global_step", -5)),
        "holds global_step=-5, where a checkpoint records a count of steps (an integer >= 0)",
    ),
    "optimizer_none": (
        OURS,
        edited(assign(lambda s: s, "optimizer", None)),
        "holds optimizer=None, where a recipe state file holds a dict",
    ),
    "optimizer_list": (
        OURS,
        edited(assign(lambda s: s, "optimizer", [1, 2])),
        "holds optimizer=<a list>, where a recipe state file holds a dict",
    ),
    "state_list": (
        OURS,
        edited(assign(lambda s: s["optimizer"], "state", [1])),
        "holds state=list, where an optimizer's state dict has a dict",
    ),
    "codes_one_block_short": (
        OURS,
        edited(short),
        f"does not fit parameter {FIRST} (32000, 64): exp_avg is (7999, 256) torch.uint8, where 2048000 elements "
        "in 8bit.v3 blocks of 256 take (8000, 256) torch.uint8",
    ),
    "scale_nan": (
        OURS,
        edited(lambda s: entry(s)["exp_avg_sq_scale"].__setitem__(5, float("nan"))),
        "exp_avg_sq_scale[5] is nan, where a block's scale is its largest magnitude (finite, >= 0)",
    ),
    "scale_negative": (
        OURS,
        edited(lambda s: entry(s)["exp_avg_scale"].__setitem__(3, -1.0)),
        "exp_avg_scale[3] is -1.0, where a block's scale is its largest magnitude (finite, >= 0)",
    ),
    "schedule_base_lr": (
        OURS,
        edited(assign(lambda s: s["lr_scheduler"], "base_lrs", [1e6])),
        f"has initial_lr=0.01 for parameter {FIRST}, where its lr schedule starts from 1000000.0",
    ),
}
CASES = [(name, key) for name, (keys, _, _) in DAMAGES.items() for key in keys]


@pytest.mark.parametrize("name, key", CASES, ids=[f"{name}-{key}" for name, key in CASES])
def test_a_damaged_state_is_one_error_line_before_any_step(saved, tmp_path, name, key):
    _, damage, words = DAMAGES[name]
    ckpt = copy_step_2(saved[key], tmp_path)
    path = ckpt / "recipe_state.pt"
    damage(path)
    fix = (
        "resume from another checkpoint (an earlier step_N or epoch_E), or start a new run from its weights with "
        f"checkpoint_dir={ckpt} and no resume_from_checkpoint"
    )

    run = resume(key, ckpt, tmp_path / "out")
    assert run.returncode == 2 and not run.metrics and "Traceback" not in run.stderr
    assert run.error.startswith(f"error: {path} does not match the checksum saved with it in recipe_state.pt.crc32")
    assert f"it was damaged or edited after it was written; {fix}" in run.error

    if words is None:
        return
    (ckpt / "recipe_state.pt.crc32").unlink()
    run = resume(key, ckpt, tmp_path / "out-unverified")
    assert run.returncode == 2 and not run.metrics and "Traceback" not in run.stderr
    assert str(path) in run.error and words in run.error and run.error.endswith(fix), run.error


@pytest.mark.parametrize("key", BOTH)
def test_an_undamaged_copy_resumes_exactly_and_one_without_its_checksum_says_so(saved, tmp_path, key):
    ckpt = copy_step_2(saved[key], tmp_path)
    run = resume(key, ckpt, tmp_path / "out")
    assert run.returncode == 0 and run.losses == saved[key].losses[2:], run.stderr[-3000:]
    assert "has no checksum beside it" not in run.stderr

    (ckpt / "recipe_state.pt.crc32").unlink()  # (a checkpoint written before checksums)
    run = resume(key, ckpt, tmp_path / "out-unverified")
    assert run.returncode == 0 and run.losses == saved[key].losses[2:], run.stderr[-3000:]
    assert f"{ckpt / 'recipe_state.pt'} has no checksum beside it (recipe_state.pt.crc32" in run.stderr


def test_a_nan_the_checks_do_not_read_stops_the_run_naming_the_state_it_resumed_from(saved, tmp_path):
    """A NaN code in the 8-bit first moment of a file without its checksum (a resume does not decode every code):
    the weights go non-finite, and the refusal to save them names the resumed state besides the lr."""
    ckpt = copy_step_2(saved["ours8"], tmp_path)
    edited(lambda s: entry(s)["exp_avg"].view(-1)[:256].fill_(0x7F))(ckpt / "recipe_state.pt")  # (e4m3's NaN)
    (ckpt / "recipe_state.pt.crc32").unlink()
    run = resume("ours8", ckpt, tmp_path / "out")
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert (
        f"this run resumed from {ckpt} and has written no checkpoint since: if its optimizer state is damaged, "
        "resume from an earlier checkpoint; if training diverged, resume from the last checkpoint with a lower "
        "optimizer.lr or clip_grad_norm=1.0" in run.error
    )
