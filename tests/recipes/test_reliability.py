"""Reliability and security of the recipes: planted pickles, non-finite steps, run folders, unknown keys, bad data,
corrupt inputs, the checkpoint protocol, stop signals and resumes with changed settings; then the newer surfaces at
the recipe level (the lock, the pack cache, overwrite, resume into another folder, the resume table, a constant lr,
data with nothing to train, the skip limit across a resume). Their components are tested in
test_reliability_surfaces.py, the distributed stop signals in test_distributed.py.

Most cases drive the recipe's entry point in this process (no ~8 s of imports per case) and most stop during setup;
one real run (module fixture) provides checkpoints and reference losses, and one subprocess receives a SIGTERM.
"""

import errno
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    DATA_DIR,
    HANG_GUARD_S,
    LOCK_HOLDER,
    REPO_ROOT,
    RecipeRun,
    read_metrics,
    recipe_command,
    recipe_env,
    run_here,
    run_recipe,
)


@pytest.fixture
def run(tmp_path):
    def go(*overrides, out=None):
        return run_here(out or tmp_path / "out", *overrides)

    return go


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One uninterrupted FAST run (6 steps) with step_2, step_4 and epoch_0: checkpoints and reference losses."""
    out = tmp_path_factory.mktemp("base") / "out"
    result = run_recipe(out, "save_every_n_steps=2")
    assert result.ok, result.stderr[-3000:]
    return result


def copy_checkpoint(base, name, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copytree(base.output_dir / name, dest / name))


# ------------------------------------------------------------------------------------------------
# 1. resume runs planted code
# ------------------------------------------------------------------------------------------------


class _Planted:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_planted_pickle_in_recipe_state_is_refused_unrun(base, tmp_path, run):
    ckpt = copy_checkpoint(base, "step_2", tmp_path / "ckpt")
    marker = tmp_path / "PWNED"
    torch.save({"config": _Planted(marker), "optimizer": {}}, ckpt / "recipe_state.pt")
    (ckpt / "recipe_state.pt.crc32").unlink()  # (else its checksum refuses it before any unpickling is tried)
    result = run(f"resume_from_checkpoint={ckpt}")
    assert result.returncode == 2
    assert not marker.exists()
    assert "recipe_state.pt" in result.error and "refused to load it" in result.error
    assert "Traceback" not in result.stderr


def test_load_state_file_accepts_every_optimizer_state_we_write():
    """torch AdamW, ours, bitsandbytes' and the RNG states round-trip through weights_only loading."""
    import io

    import bitsandbytes.optim

    import optimizers
    from finetune.checkpoint import checkpointer

    def roundtrip(obj):
        buf = io.BytesIO()
        torch.save(obj, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=True)

    for make in (
        torch.optim.AdamW,
        optimizers.AdamW8bit,
        optimizers.AdamW4bit,
        lambda p: bitsandbytes.optim.AdamW8bit(p, min_8bit_size=1),
    ):
        model = torch.nn.Linear(256, 256)
        opt = make(model.parameters())
        model(torch.randn(2, 256)).sum().backward()
        opt.step()
        roundtrip(opt.state_dict())
    import numpy as np

    np.random.seed(3)
    state = roundtrip(checkpointer.rng_state())
    expected = np.random.rand()
    np.random.seed(4)
    checkpointer.set_rng_state(state)
    assert np.random.rand() == expected


# ------------------------------------------------------------------------------------------------
# 2. non-finite steps
# ------------------------------------------------------------------------------------------------


class PoisonedAdamW(torch.optim.AdamW):
    """torch's AdamW whose gradients turn NaN at the given (1-based) steps: a hook on the first parameter poisons
    its gradient after accumulation, before the recipe checks the step."""

    def __init__(self, params, poison_at=(), **kwargs):
        params = list(params)
        super().__init__(params, **kwargs)
        self.backward_calls = 0
        poison = set(poison_at)

        def hook(p):
            self.backward_calls += 1
            if self.backward_calls in poison:
                p.grad.fill_(float("nan"))

        params[0].register_post_accumulate_grad_hook(hook)


POISON = f"optimizer._component_={__name__}.PoisonedAdamW"


@pytest.mark.parametrize("clip", ["1.0", "null"])
def test_nonfinite_step_is_skipped_counted_and_checkpoint_finite(run, tmp_path, clip):
    result = run(POISON, "optimizer.poison_at=[2]", f"clip_grad_norm={clip}", "max_steps_per_epoch=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["skipped_steps"] for m in result.metrics] == [0, 1, 1]
    assert all(math.isfinite(m["loss"]) for m in result.metrics[2:])
    line = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[1]
    assert "NaN" not in line and json.loads(line)["grad_norm"] is None  # strict JSON: null, not NaN
    ckpt = tmp_path / "out" / "epoch_0"
    assert all(torch.isfinite(t).all() for t in load_file(ckpt / "model.safetensors").values())
    state = torch.load(ckpt / "recipe_state.pt", weights_only=True)
    # 3 steps, one skipped: AdamW stepped twice (the skipped step left its state untouched)
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {2.0}
    assert state["skipped_steps"] == 1


def test_consecutive_nonfinite_steps_stop_the_run(run, tmp_path):
    result = run(POISON, "optimizer.poison_at=[2,3,4,5,6]", "max_consecutive_skipped_steps=3")
    assert result.returncode == 2
    assert "3 steps in a row had a non-finite loss or gradient" in result.error
    assert not (tmp_path / "out" / "epoch_0").exists()


def test_nonfinite_weights_are_never_written(tmp_path):
    from finetune.base import NonFiniteStop
    from finetune.checkpoint.checkpointer import check_finite_weights

    check_finite_weights({"w": torch.ones(3)}, tmp_path / "step_1", 1)
    with pytest.raises(NonFiniteStop, match="not finite .*refused to write"):
        check_finite_weights({"w": torch.ones(3), "v": torch.tensor([1.0, float("inf")])}, tmp_path / "step_1", 1)


# (The hyperparameters' refusals, each a line naming the value: tests/finetune/settings/test_read.py, the readers.)


# ------------------------------------------------------------------------------------------------
# 3. run folders
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def other_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_live_lock_refuses_naming_its_pid_and_stale_one_is_taken_over(run, tmp_path, other_process):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text(json.dumps({"pid": other_process.pid}))
    result = run()
    assert result.returncode == 2
    assert f"in use by a live run (PID {other_process.pid}" in result.error

    from finetune.checkpoint.run_folder import OutputDirLock

    (out / ".lock").write_text(json.dumps({"pid": dead_pid()}))
    lock = OutputDirLock(out)
    lock.acquire()
    assert json.loads((out / ".lock").read_text())["pid"] == os.getpid()
    lock.release()
    assert not (out / ".lock").exists()


def test_fresh_run_into_a_used_folder_refuses_unless_overwrite(run, tmp_path):
    out = tmp_path / "out"
    (out / "epoch_0").mkdir(parents=True)
    (out / "epoch_0" / "model.safetensors").write_bytes(b"old")
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    result = run()
    assert result.returncode == 2
    for words in (
        "already holds a run",
        f"(e.g. output_dir={out}-2)",
        "overwrite=True",
        f"resume_from_checkpoint={out}/step_N",
    ):
        assert words in result.error
    assert (out / "epoch_0" / "model.safetensors").read_bytes() == b"old"

    result = run("overwrite=True", "max_steps_per_epoch=1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["step"] for m in result.metrics] == [1]
    assert (out / "epoch_0" / "model.safetensors").stat().st_size > 1000
    assert not (out / ".lock").exists()


# ------------------------------------------------------------------------------------------------
# 4. unknown config keys
# ------------------------------------------------------------------------------------------------


# (An unknown key, with the closest known one suggested: tests/finetune/settings/test_read.py.)


def test_known_keys_cover_every_config_file():
    from omegaconf import OmegaConf

    from finetune.settings import DISTRIBUTED_CONFIG_KEYS, KNOWN_CONFIG_KEYS

    known = set(DISTRIBUTED_CONFIG_KEYS)
    for path in [*(REPO_ROOT / "configs").glob("*.yaml"), *(REPO_ROOT / "configs" / "llama2").glob("*.yaml")]:
        keys = set(OmegaConf.load(path).keys())
        assert keys <= known, (path, keys - known)
    for key in (
        "pack_cache_dir",
        "ac_mode",
        "ac_option",
        "enable_activation_offloading",
        "device_memory_limit_gib",
        "overwrite",
        "max_consecutive_skipped_steps",
    ):
        assert key in KNOWN_CONFIG_KEYS


# ------------------------------------------------------------------------------------------------
# 5. bad data
# ------------------------------------------------------------------------------------------------


GOOD = {"instruction": "Say hi.", "input": "", "output": "Hi."}


@pytest.mark.parametrize(
    "bad, words",
    [
        (
            {"instruction": "a", "input": "", "output": True},
            "record 2 of {f} (counting from 1): field 'output' is True",
        ),
        ({"instruction": 7, "input": "", "output": "x"}, "record 2 of {f} (counting from 1): field 'instruction' is 7"),
    ],
)
def test_non_string_fields_are_refused(run, tmp_path, bad, words):
    f = tmp_path / "data.json"
    f.write_text(json.dumps([GOOD, bad, GOOD]))
    result = run(f"dataset.data_files={f}")
    assert result.returncode == 2 and words.format(f=f) in result.error


def test_tokenizer_longer_than_model_is_refused(run):
    result = run("tokenizer.max_seq_len=1024")
    assert result.returncode == 2
    assert "tokenizer.max_seq_len=1024 is longer than the model's max_seq_len=512" in result.error


# ------------------------------------------------------------------------------------------------
# 6. corrupt inputs
# ------------------------------------------------------------------------------------------------


def test_truncated_weights_and_garbage_state_are_one_line(base, tmp_path, run):
    ckpt = copy_checkpoint(base, "step_2", tmp_path / "a")
    weights = ckpt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    result = run(f"resume_from_checkpoint={ckpt}")
    assert result.returncode == 2 and f"{weights} is not a readable safetensors file" in result.error

    ckpt = copy_checkpoint(base, "step_2", tmp_path / "b")
    (ckpt / "recipe_state.pt").write_bytes(b"garbage" * 100)
    result = run(f"resume_from_checkpoint={ckpt}")
    assert result.returncode == 2 and f"{ckpt / 'recipe_state.pt'} does not match the checksum" in result.error
    (ckpt / "recipe_state.pt.crc32").unlink()  # (a checkpoint without one: torch.load says what the file is)
    result = run(f"resume_from_checkpoint={ckpt}")
    assert result.returncode == 2 and f"{ckpt / 'recipe_state.pt'} is unreadable" in result.error


def test_checkpoint_of_another_size_and_pickled_bin_are_one_line(base, tmp_path, run):
    result = run(f"resume_from_checkpoint={base.output_dir / 'step_2'}", "model.embed_dim=128")
    assert result.returncode == 2 and "do not fit the model config" in result.error

    folder = tmp_path / "hf"
    folder.mkdir()
    marker = tmp_path / "PWNED"
    torch.save({"w": _Planted(marker)}, folder / "pytorch_model.bin")
    result = run(f"checkpoint_dir={folder}")
    assert result.returncode == 2 and str(folder / "pytorch_model.bin") in result.error
    assert "which a weights file never does" in result.error  # (not "a recipe state file": it is the weights)
    assert not marker.exists()


def test_full_disk_while_saving_is_one_line(run, tmp_path, monkeypatch):
    from finetune.checkpoint import hf_format

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_format, "write_safetensors", full)
    result = run("max_steps_per_epoch=1")
    assert result.returncode == 2
    assert f"no space left on the disk of {tmp_path / 'out'} while writing epoch_0" in result.error
    assert not [p for p in (tmp_path / "out").iterdir() if p.name.startswith((".tmp-", "epoch_"))]


def _tmpfs_mount_works(where: Path) -> str:
    """'' if this user can mount a tmpfs in a private user+mount namespace (``unshare -rm``), else why not."""
    if shutil.which("unshare") is None:
        return "no unshare(1) here"
    where.mkdir(exist_ok=True)
    probe = subprocess.run(
        ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs "$0"', str(where)],
        capture_output=True,
        text=True,
    )
    return (
        ""
        if probe.returncode == 0
        else (
            f"cannot mount a tmpfs as this user (unshare -rm + mount -t tmpfs: {probe.stderr.strip()[:200]}; user "
            "namespaces disabled or restricted here): the fake-ENOSPC test above covers the message"
        )
    )


def test_real_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path):
    """The recipe on a tmpfs too small for two checkpoints (FAST: about 50 MB each, weights plus AdamW state): step_2
    fits, step_4 does not. The real writers (safetensors, torch.save's zip writer) report a full disk without an
    errno, so this is what tells the recipe's check apart from a faked OSError."""
    disk = tmp_path / "disk"
    why = _tmpfs_mount_works(disk)
    if why:
        pytest.skip(why)
    out, kept = disk / "out", tmp_path / "kept"
    command = recipe_command(out, "save_every_n_steps=2")
    # In the namespace: mount, run, and copy what is left out of the tmpfs (it goes with the namespace).
    script = 'mount -t tmpfs -o size=80m tmpfs "$0" && "$@"; rc=$?; cp -r "$0/out" "$1"; exit $rc'
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script.replace('"$1"', shlex.quote(str(kept))), str(disk), *command],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    run = RecipeRun(proc.returncode, proc.stdout, proc.stderr, kept, read_metrics(kept))
    assert run.error.startswith(f"error: no space left on the disk of {out} while writing step_4 (")
    assert "Traceback" not in run.stderr
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["step_2"]  # no .tmp-* left, nothing replaced
    weights = load_file(kept / "step_2" / "model.safetensors")
    assert weights and torch.load(kept / "step_2" / "recipe_state.pt", weights_only=True)["global_step"] == 2


# ------------------------------------------------------------------------------------------------
# 7. checkpoint protocol
# ------------------------------------------------------------------------------------------------


def test_recovery_restores_old_and_removes_dead_tmp(tmp_path, other_process, monkeypatch):
    from finetune.checkpoint import run_folder

    dead = dead_pid()
    (tmp_path / f".old-step_2-{dead}-abcd1234").mkdir()
    (tmp_path / f".old-step_2-{dead}-abcd1234" / "model.safetensors").write_text("w")
    (tmp_path / f".tmp-step_4-{dead}-abcd1234").mkdir()
    (tmp_path / f".tmp-step_6-{other_process.pid}-abcd1234").mkdir()
    run_folder.recover_run_folder(tmp_path)
    assert (tmp_path / "step_2" / "model.safetensors").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".tmp-step_6-{other_process.pid}-abcd1234", "step_2"]

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    a, b = run_folder.tmp_dir(tmp_path, "step_8"), run_folder.tmp_dir(tmp_path, "step_8")
    assert a != b  # a PID plus a random part: never the same name twice
    (a / "f").write_text("x")
    run_folder.finish_dir(a)
    run_folder.replace_dir(a, tmp_path / "step_2")
    assert len(synced) >= 3 and (tmp_path / "step_2" / "f").exists()


# ------------------------------------------------------------------------------------------------
# 8. SIGTERM
# ------------------------------------------------------------------------------------------------


def test_sigterm_saves_a_checkpoint_and_resume_gives_the_uninterrupted_losses(base, tmp_path, run):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        recipe_command(out),
        cwd=REPO_ROOT,
        env=recipe_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + HANG_GUARD_S
    while proc.poll() is None and time.monotonic() < deadline:
        if any(m["step"] >= 2 for m in read_metrics(out)):
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=HANG_GUARD_S)  # (its exit after SIGTERM is tested)
    assert proc.returncode == 0, err[-3000:]
    steps = sorted(int(p.name[5:]) for p in out.glob("step_*"))
    assert len(steps) == 1 and 2 <= steps[0] < 6, steps
    n = steps[0]
    resumed = run(f"resume_from_checkpoint={out / f'step_{n}'}", out=out)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    tail = resumed.metrics[-(6 - n) :]
    assert [m["step"] for m in tail] == list(range(n + 1, 7))
    assert [m["loss"] for m in tail] == pytest.approx(base.losses[n:], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# 9. resume with changed settings
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, words",
    [
        (
            "batch_size=4",
            "batch_size x gradient_accumulation_steps = 4 samples per step differs from the checkpoint's 2",
        ),
        ("seed=1", "seed=1 differs from the checkpoint's 42"),
        ("shuffle=False", "shuffle=False differs from the checkpoint's True"),
        ("optimizer.lr=0.001", "optimizer.lr=0.001 differs from the checkpoint's 0.01"),
    ],
)
def test_resume_with_changed_settings_is_refused(base, run, override, words):
    result = run(f"resume_from_checkpoint={base.output_dir / 'step_2'}", override)
    assert result.returncode == 2 and words in result.error


def test_resume_past_the_end_trains_nothing(base, run, tmp_path):
    result = run(f"resume_from_checkpoint={base.output_dir / 'epoch_0'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.metrics == [] and not list((tmp_path / "out").glob("epoch_*"))
    assert result.stdout.strip().splitlines()[-1].startswith("Nothing trained: resume_from_checkpoint=")
    assert "nothing was written" in result.stdout


# ------------------------------------------------------------------------------------------------
# 10. the newer surfaces, at the recipe level
# ------------------------------------------------------------------------------------------------


def test_a_live_run_in_another_container_keeps_its_folder(run, tmp_path):
    """Another container's run (its PID dead here) trains in out/: a second run, even with overwrite=True, is
    refused with one line, and the first one's metrics and lock stay as they were."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n')
    owner = json.dumps(
        {
            "host": "container-b",
            "boot_id": "other",
            "pid_ns": "pid:[4026532000]",
            "pid": dead_pid(),
            "start": "1",
            "token": "theirs",
        }
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out / ".lock"), owner], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        result = run("overwrite=True")  # (what would delete the live run's results, were the folder taken)
    finally:
        holder.kill()
        holder.wait()
    assert result.returncode == 2
    assert "is in use by a live run (PID" in result.error and "on container-b" in result.error
    assert (out / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.9}\n'
    assert (out / ".lock").read_text() == owner


def test_the_pack_cache_key_covers_the_whole_tokenizer_section(run, tmp_path):
    """A run with a prompt template must not reuse the samples cached without one: it trains on what the same run
    with no cache trains on."""
    cache, template = tmp_path / "cache", "tokenizer.prompt_template=torchtune.models.llama2.Llama2ChatTemplate"
    packed = ["dataset.packed=True", "dataset.split=train[:40]", "max_steps_per_epoch=2"]
    plain = run(*packed, f"pack_cache_dir={cache}", out=tmp_path / "plain")
    templated = run(*packed, f"pack_cache_dir={cache}", template, out=tmp_path / "templated")
    uncached = run(*packed, "pack_cache_dir=off", template, out=tmp_path / "uncached")
    assert plain.ok and templated.ok and uncached.ok, templated.stderr[-3000:]
    assert len(list(cache.glob("samples-*.npz"))) == 2
    assert templated.losses == uncached.losses != plain.losses
    assert [m["tokens"] for m in templated.metrics] == [m["tokens"] for m in uncached.metrics]


def test_overwrite_never_deletes_the_checkpoint_a_run_starts_from(base, run, tmp_path):
    """checkpoint_dir=out/epoch_0 output_dir=out overwrite=True (continuing a finished run in its folder): refused
    before anything is read or deleted, naming the folder and the fix."""
    out = tmp_path / "out"
    copy_checkpoint(base, "epoch_0", out)
    (out / "metrics.jsonl").write_text('{"step": 6, "loss": 8.0}\n')
    before = (out / "epoch_0" / "model.safetensors").read_bytes()
    result = run(f"checkpoint_dir={out / 'epoch_0'}", "overwrite=True")
    assert result.returncode == 2
    assert f"overwrite=True would delete {out / 'epoch_0'}, which this run reads (checkpoint_dir=" in result.error
    assert (out / "epoch_0" / "model.safetensors").read_bytes() == before
    assert (out / "metrics.jsonl").exists()


def test_a_resume_into_another_runs_folder_is_refused(base, run, tmp_path):
    other = tmp_path / "other"
    copy_checkpoint(base, "epoch_0", other)
    (other / "metrics.jsonl").write_text('{"step": 6, "loss": 8.0}\n')
    before = {p.name: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()}
    result = run(f"resume_from_checkpoint={base.output_dir / 'step_2'}", out=other)
    assert result.returncode == 2
    assert f"output_dir={other} already holds another run" in result.error
    assert f"output_dir={base.output_dir}" in result.error  # (the checkpoint's own folder)
    assert {p.name: p.stat().st_mtime_ns for p in other.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize(
    "override, words",
    [
        ("tokenizer.max_seq_len=32", "tokenizer.max_seq_len=32 differs from the checkpoint's 64"),
        ("dataset.train_on_input=False", "dataset.train_on_input=False differs from the checkpoint's True"),
        ("dtype=bf16", "dtype=bf16 differs from the checkpoint's fp32"),
        ("lr_scheduler.num_warmup_steps=3", "lr_scheduler.num_warmup_steps=3 differs from the checkpoint's 0"),
        ("optimizer.weight_decay=0.1", "optimizer.weight_decay=0.1 differs from the checkpoint's 0.01"),
        ("optimizer.eps=1e-6", "optimizer.eps=1e-06 differs from the checkpoint's (unset)"),
        ("EDITED", "the content of the data files (dataset.data_files) differs from the checkpoint's"),
    ],
)
def test_the_resume_table_refuses_what_changes_the_run(base, run, tmp_path, override, words):
    if override == "EDITED":  # the same file name and records, one character changed
        edited = tmp_path / "alpaca" / "alpaca_data.json"
        edited.parent.mkdir()
        edited.write_text((DATA_DIR / "alpaca" / "alpaca_data.json").read_text().replace("Give", "give", 1))
        override = f"dataset.data_files={edited}"
    result = run(f"resume_from_checkpoint={base.output_dir / 'step_2'}", override)
    assert result.returncode == 2 and words in result.error


def test_a_resume_may_split_a_step_into_more_micro_batches(base, run):
    """batch_size=1 x gradient_accumulation_steps=2 reads the same 2 samples a step as batch_size=2: it resumes,
    with the uninterrupted run's losses."""
    result = run(
        f"resume_from_checkpoint={base.output_dir / 'step_2'}", "batch_size=1", "gradient_accumulation_steps=2"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["step"] for m in result.metrics[-4:]] == [3, 4, 5, 6]
    assert [m["loss"] for m in result.metrics[-4:]] == pytest.approx(base.losses[2:], rel=1e-4)


def test_lr_scheduler_null_trains_at_a_constant_lr(run):
    result = run("lr_scheduler=null", "max_steps_per_epoch=3")
    assert result.returncode == 0, result.stderr[-3000:]
    assert [m["lr"] for m in result.metrics] == [0.01, 0.01, 0.01]


def test_a_bad_config_json_in_checkpoint_dir_is_one_line(base, run, tmp_path):
    folder = copy_checkpoint(base, "epoch_0", tmp_path / "hf")
    (folder / "config.json").write_text('{"hidden_size": 64,')
    result = run(f"checkpoint_dir={folder}")
    assert result.returncode == 2 and f"{folder / 'config.json'} is not a JSON object" in result.error
    assert "Traceback" not in result.stderr


def test_data_with_nothing_to_train_says_so(run, tmp_path):
    """Every response cut off by tokenizer.max_seq_len, the prompt masked: no step has a trained token. The stop
    names the data and those settings, not the lr."""
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": "Repeat this. " * 40, "input": "", "output": "Done."}] * 12))
    result = run(f"dataset.data_files={data}", "dataset.train_on_input=False", "max_consecutive_skipped_steps=2")
    assert result.returncode == 2
    assert "2 steps in a row had no trained tokens" in result.error and "dataset.train_on_input" in result.error
    assert "optimizer.lr" not in result.error


class EnvPoisonedAdamW(PoisonedAdamW):
    """PoisonedAdamW with its steps to poison in $POISON_AT (a resume refuses a change of the optimizer's kwargs)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, poison_at=json.loads(os.environ.get("POISON_AT", "[]")), **kwargs)


def test_the_skip_limit_counts_across_a_resume(run, tmp_path, monkeypatch):
    """Steps 2 and 3 are skipped and step_3 saved; the resumed run's first step (4) is skipped too: 3 in a row."""
    out, poison = tmp_path / "out", f"optimizer._component_={__name__}.EnvPoisonedAdamW"
    monkeypatch.setenv("POISON_AT", "[2, 3]")
    first = run(poison, "save_every_n_steps=3", "max_steps_per_epoch=4", "max_consecutive_skipped_steps=3")
    assert first.returncode == 0, first.stderr[-3000:]
    monkeypatch.setenv("POISON_AT", "[1]")  # (counted from the resumed process's first backward: step 4)
    resumed = run(
        poison, f"resume_from_checkpoint={out / 'step_3'}", "max_steps_per_epoch=4", "max_consecutive_skipped_steps=3"
    )
    assert resumed.returncode == 2
    assert "3 steps in a row had a non-finite loss or gradient (last: step 4" in resumed.error
    # (no checkpoint since the resume: the state it resumed from may be the cause, and the stop says so)
    assert f"this run resumed from {out / 'step_3'} and has written no checkpoint since" in resumed.error
