"""Checkpoints written in the background (async_checkpoint=True, the default; finetune/checkpoint/async_save.py).

What is checked, on the FAST tiny model on the CPU:

- the folder a background save writes is byte for byte the synchronous one, also with a save at every step while
  each write is slowed down (so each save must wait for the previous: at most one in flight, staging buffers reused);
- training goes on while a write is held, a kill -9 in the middle of one leaves the previous checkpoint (which resumes
  to the uninterrupted losses), SIGTERM during one saves and exits 0, a write that fails after training went on (a
  full disk, a permission) is one ``error:`` line and exit 2 with the previous checkpoint intact (a real full tmpfs:
  test_reliability.py, whose runs write in the background too);
- the parts: the streamed model.safetensors writer against safetensors' own, and the snapshot (a copy, views and
  shared tensors kept, tensor subclasses, one reused host buffer). The ``gpu`` tests check the GPU-held snapshot and
  a bf16 GPU run against a synchronous one.

A write is held back until training has logged a later step or a file appears (``hold`` in this process; in a
subprocess ``faults.GatedAdamW``, torch's AdamW whose construction wraps the checkpoint writer), never by a sleep.
Resumed losses are compared at rel=1e-5 (as in test_reliability.py): the interrupted runs are subprocesses, whose CPU
kernels are capped at AVX2, the reference is an in-process run. Two subprocess runs, six in-process ones.
"""

import errno
import io
import math
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import HANG_GUARD_S, REPO_ROOT, read_metrics, recipe_command, recipe_env, run_here

FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "recipe_state.pt",
    "recipe_state.pt.crc32",  # (its checksum: finetune/checkpoint/state_file.py)
    "tokenizer.model",
}

FAULTS = '''
import os, time
from pathlib import Path

import torch

from finetune.checkpoint import checkpointer
from finetune.reporting.metrics import read_records


def logged_step(metrics: Path) -> int:
    try:
        return max((r["step"] for r in read_records(metrics) if "step" in r), default=0)
    except OSError:
        return 0


class GatedAdamW(torch.optim.AdamW):
    """torch's AdamW. With GATE_HOLD=NAME in the environment, the background write of checkpoint NAME first touches
    GATE_MARKER, then waits until the file GATE_UNTIL_FILE exists or training has logged step GATE_UNTIL_STEP (neither
    given: for ever). (The environment, not optimizer kwargs: a resume must not see the optimizer's settings change.)"""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        env = os.environ
        hold, marker = env.get("GATE_HOLD"), env.get("GATE_MARKER")
        until_file, until_step = env.get("GATE_UNTIL_FILE"), int(env.get("GATE_UNTIL_STEP") or 0)
        if hold is None:
            return
        write = checkpointer.Checkpointer._write

        def held(self_, tmp, snap, ready):
            if tmp.name.startswith(f".tmp-{hold}-"):
                Path(marker).touch()
                while not ((until_file and Path(until_file).exists()) or
                           (until_step and logged_step(tmp.parent / "metrics.jsonl") >= until_step)):
                    time.sleep(0.02)
            return write(self_, tmp, snap, ready)

        checkpointer.Checkpointer._write = held
'''
GATED = "optimizer._component_=faults.GatedAdamW"


def hold(patch, name: str, until_step: int) -> list:
    """Make the background write of checkpoint ``name`` wait until training has logged ``until_step`` (or 120 s
    passed, so that a broken run cannot hang the test). Returns the (name, start, end) of every write, as they end."""
    from finetune.checkpoint import checkpointer

    spans, write = [], checkpointer.Checkpointer._write

    def held(self, tmp, snap, ready):
        began, deadline = time.monotonic(), time.monotonic() + 120
        if tmp.name.startswith(f".tmp-{name}-"):
            while last_step(tmp.parent) < until_step and time.monotonic() < deadline:
                time.sleep(0.02)
        try:
            write(self, tmp, snap, ready)
        finally:
            spans.append((tmp.name.split("-")[1], began, time.monotonic()))

    patch.setattr(checkpointer.Checkpointer, "_write", held)
    return spans


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two FAST runs (6 steps) with step_2, step_4 and epoch_0: synchronous, and in the background with the write of
    step_2 held until training has logged step 4, so that the save of step_4 comes while step_2 is being written."""
    root = tmp_path_factory.mktemp("runs")
    sync = run_here(root / "sync", "save_every_n_steps=2", "async_checkpoint=False")
    assert sync.ok, sync.stderr[-3000:]
    with pytest.MonkeyPatch.context() as patch:
        writes = hold(patch, "step_2", until_step=4)
        background = run_here(root / "async", "save_every_n_steps=2")
    assert background.ok, background.stderr[-3000:]
    return sync, background, writes


@pytest.fixture
def faults(tmp_path, monkeypatch):
    """faults.py importable here (in-process resumes) and by the subprocess runs (PYTHONPATH)."""
    (tmp_path / "faults.py").write_text(FAULTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return {"PYTHONPATH": str(tmp_path)}


def start(output_dir: Path, env: dict, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        recipe_command(output_dir, *overrides),
        cwd=REPO_ROOT,
        env=recipe_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(proc: subprocess.Popen, done, what: str, timeout: float = HANG_GUARD_S) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended (exit {proc.returncode}) before {what}:\n{(out + err)[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def last_step(output_dir: Path) -> int:
    return max((m["step"] for m in read_metrics(output_dir)), default=0)


def assert_complete(folder: Path, global_step: int) -> None:
    assert {p.name for p in folder.iterdir()} == FILES, sorted(folder.iterdir())
    assert load_file(folder / "model.safetensors")
    assert torch.load(folder / "recipe_state.pt", weights_only=True)["global_step"] == global_step


# ------------------------------------------------------------------------------------------------
# the same folder, at most one save in flight
# ------------------------------------------------------------------------------------------------


def test_background_saves_write_the_synchronous_folders_byte_for_byte(runs):
    sync, background, writes = runs
    assert background.losses == sync.losses and len(sync.losses) == 6  # training itself is untouched
    names = sorted(p.name for p in sync.output_dir.iterdir() if p.is_dir())
    assert names == ["epoch_0", "step_2", "step_4"]
    assert sorted(p.name for p in background.output_dir.iterdir() if p.is_dir()) == names  # no .tmp-* left
    for name in names:
        for f in sorted((sync.output_dir / name).iterdir()):
            assert (background.output_dir / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"
    # Training went on while step_2 was written (steps 3 and 4 ran beside it), and the save of step_4 waited for
    # that write to end before taking its snapshot into the same, reused, staging buffer: no two writes overlapped.
    assert [w[0] for w in writes] == ["step_2", "step_4", "epoch_0"]
    assert all(later[1] >= earlier[2] for earlier, later in zip(writes, writes[1:])), writes
    assert [m.get("checkpoint_writing", False) for m in background.metrics[2:4]] == [True, True]
    assert "written in the background" in background.stdout
    # Each record names what was published since the one before, and what the saves cost.
    # (step_4's write is not held: it is published at the first step boundary after it ends, which may come after the
    # last record, step 6, on a slow disk)
    saved = {m["checkpoint_saved"]: m for m in background.metrics if "checkpoint_saved" in m}
    assert list(saved) in (["step_2"], ["step_2", "step_4"]) and saved["step_2"]["step"] == 5  # (at step_4's save)
    assert all(m["checkpoint_staged_host_gib"] > 0 for m in background.metrics if "checkpoint_blocked_s" in m)


# ------------------------------------------------------------------------------------------------
# crashes and signals while a write is held
# ------------------------------------------------------------------------------------------------


def test_kill_9_during_a_background_write_keeps_the_previous_checkpoint_which_resumes_exactly(runs, tmp_path, faults):
    out, marker = tmp_path / "out", tmp_path / "holding"
    proc = start(out, {**faults, "GATE_HOLD": "step_4", "GATE_MARKER": str(marker)}, "save_every_n_steps=2", GATED)
    try:
        wait_for(proc, marker.exists, "the write of step_4 began")
        wait_for(proc, lambda: last_step(out) >= 6, "training went on to step 6")  # beside the held write
    finally:
        proc.kill()
        proc.communicate()
    assert sorted(p.name for p in out.iterdir() if p.is_dir() and not p.name.startswith(".tmp-")) == ["step_2"]
    assert [p.name.split("-")[1] for p in out.glob(".tmp-*")] == ["step_4"]  # the write the kill cut short
    assert_complete(out / "step_2", 2)

    resumed = run_here(out, GATED, f"resume_from_checkpoint={out / 'step_2'}")
    assert resumed.ok, resumed.stderr[-3000:]
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3, 4, 5, 6]
    assert resumed.losses[2:] == pytest.approx(runs[1].losses[2:], rel=1e-5)
    assert not list(out.glob(".tmp-*"))  # the dead run's temporary folder is gone
    assert_complete(out / "epoch_0", 6)


def test_sigterm_during_a_background_write_saves_and_exits_0(runs, tmp_path, faults):
    out, marker, release = tmp_path / "out", tmp_path / "holding", tmp_path / "release"
    proc = start(
        out,
        {**faults, "GATE_HOLD": "step_2", "GATE_MARKER": str(marker), "GATE_UNTIL_FILE": str(release)},
        "save_every_n_steps=2",
        GATED,
    )
    try:
        wait_for(proc, marker.exists, "the write of step_2 began")
        wait_for(proc, lambda: last_step(out) >= 3, "training went on to step 3")
        assert not (out / "step_2").exists()  # training went on while step_2 was still being written
        proc.send_signal(signal.SIGTERM)
        release.touch()
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "Run stopped by SIGTERM" in stdout
    steps = sorted(int(p.name[5:]) for p in out.glob("step_*"))
    assert steps[0] == 2 and steps[-1] >= 3 and not (out / "epoch_0").exists(), steps
    for n in steps:
        assert_complete(out / f"step_{n}", n)

    n = steps[-1]
    resumed = run_here(out, GATED, f"resume_from_checkpoint={out / f'step_{n}'}")
    assert resumed.ok, resumed.stderr[-3000:]
    assert resumed.losses[n:] == pytest.approx(runs[1].losses[n:], rel=1e-5)


# ------------------------------------------------------------------------------------------------
# a write that fails
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "failure, words",
    [
        (
            OSError(errno.ENOSPC, "No space left on device"),
            "error: no space left on the disk of {out} while writing step_4",
        ),
        (
            PermissionError(errno.EACCES, "Permission denied"),
            "error: could not write step_4 (PermissionError: [Errno 13]",
        ),
    ],
    ids=["full-disk", "permission"],
)
def test_a_failed_background_write_is_one_error_after_training_went_on(tmp_path, monkeypatch, failure, words):
    """The write of step_4 fails (a full disk; a permission, as if the folder were made read-only under the run)
    after training has logged step 5 beside it: the run still stops with one line, before epoch_0, and step_2 stays.
    (test_reliability.py fills a real tmpfs; the writers then raise without an errno.)"""
    from finetune.checkpoint import hf_format

    write = hf_format.write_config_and_tokenizer

    def refuse(folder, *args, **kwargs):
        if folder.name.startswith(".tmp-step_4-"):
            raise failure
        return write(folder, *args, **kwargs)

    monkeypatch.setattr(hf_format, "write_config_and_tokenizer", refuse)
    hold(monkeypatch, "step_4", until_step=5)
    out = tmp_path / "out"
    run = run_here(out, "save_every_n_steps=2")
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.error.startswith(words.format(out=out)) and "nothing was replaced" in run.error
    assert "Traceback" not in run.stderr
    assert max(m["step"] for m in run.metrics) >= 5
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step_2"]  # no .tmp-*, no epoch_0
    assert_complete(out / "step_2", 2)


def staged_bytes(obj) -> int:
    """What a host-held copy of ``obj`` takes in the staging buffer (each storage once, each slot page-aligned)."""
    from finetune.checkpoint import async_save

    sizes, _, _ = async_save.Staging._leaves(obj)
    return async_save.Layout(sizes, [False] * len(sizes)).host_bytes


@pytest.mark.parametrize("room", ["recipe_state", "weights", "nothing"])
def test_a_host_with_room_for_part_of_the_copy_stages_that_part(runs, tmp_path, monkeypatch, room):
    """The host has memory for the copy of only one of the checkpoint's two files (or of neither): that one is
    copied and written in the background, the other written before training goes on (neither: every save is
    synchronous). The folders are still the synchronous ones, byte for byte."""
    from finetune.checkpoint import async_save

    sync = runs[0]
    weights = staged_bytes(load_file(sync.output_dir / "step_2" / "model.safetensors"))
    state = staged_bytes(torch.load(sync.output_dir / "step_2" / "recipe_state.pt", weights_only=True))
    assert weights < state  # (bf16 weights, fp32 AdamW states: the larger file is the state)
    limit = {"recipe_state": state, "weights": weights, "nothing": 0}[room]
    # The host's available memory: ``limit``, less the staging buffer once allocated (as MemAvailable would drop).
    held, allocate = [0], async_save.Staging.allocate

    def allocate_and_count(self, layout):
        allocate(self, layout)
        held[0] = self.held_bytes

    monkeypatch.setattr(async_save.Staging, "allocate", allocate_and_count)
    monkeypatch.setattr(async_save, "available_host_bytes", lambda: limit - held[0])
    run = run_here(tmp_path / "out", "save_every_n_steps=2")
    assert run.ok, run.stderr[-3000:]
    names = sorted(p.name for p in sync.output_dir.iterdir() if p.is_dir())
    assert sorted(p.name for p in run.output_dir.iterdir() if p.is_dir()) == names
    for name in names:
        for f in sorted((sync.output_dir / name).iterdir()):
            assert (run.output_dir / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"
    # What the saves of step_2 and step_4 staged (epoch_0's comes after the last step's record).
    staged = [m["checkpoint_staged_host_gib"] * 2**30 for m in run.metrics if "checkpoint_staged_host_gib" in m]
    assert staged == ([] if room == "nothing" else [limit, limit]), [m for m in run.metrics if "checkpoint_saved" in m]


def test_host_memory_limit_stages_what_fits_beside_the_process_and_gives_it_back(runs, tmp_path, monkeypatch):
    """host_memory_limit_gib: the room for a snapshot is the limit less what the process holds (its resident set)
    less a margin, whatever the machine has available; the buffer is allocated for each save and released once that
    save is written, so the steps between checkpoints run without it. Same folders as synchronous saves."""
    from finetune.checkpoint import async_save

    sync = runs[0]
    state = staged_bytes(torch.load(sync.output_dir / "step_2" / "recipe_state.pt", weights_only=True))
    resident = 8 * 2**30  # the process as the limit sees it; the room left: the state's copy and not the whole
    limit_gib = (resident + async_save.HOST_LIMIT_MARGIN + state + 2**16) / 2**30
    monkeypatch.setattr(async_save, "resident_bytes", lambda: resident)
    monkeypatch.setattr(async_save, "available_host_bytes", lambda: 2**40)  # (a large machine: the limit rules)
    held, release = [], async_save.Staging.release

    def release_and_count(self):
        held.append(self.held_bytes)
        release(self)

    monkeypatch.setattr(async_save.Staging, "release", release_and_count)
    run = run_here(tmp_path / "out", "save_every_n_steps=2", f"host_memory_limit_gib={limit_gib}")
    assert run.ok, run.stderr[-3000:]
    for name in ("step_2", "step_4", "epoch_0"):
        for f in sorted((sync.output_dir / name).iterdir()):
            assert (run.output_dir / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"
    staged = [m["checkpoint_staged_host_gib"] * 2**30 for m in run.metrics if "checkpoint_staged_host_gib" in m]
    assert staged == [state, state]  # only recipe_state.pt's copy fitted; the weights were written at once
    assert [h for h in held if h] == [state, state, state]  # each save's buffer given back once it is written
    assert "given back once written" in run.stderr


@pytest.mark.parametrize("moment", ["before", "after"])
def test_ctrl_c_while_a_background_checkpoint_is_put_in_place_keeps_and_names_it(
    tmp_path, monkeypatch, moment, python_ctrl_c
):
    """Ctrl-C lands just {before, after} step_2, written in the background, is renamed into place: the moment a user
    (or a test) who waits for a step's metrics line most likely hits, since the publish follows that line. The run
    stops with 130, and step_2 is whole, announced, and named as the checkpoint to resume from."""
    from finetune.checkpoint import run_folder

    replace = run_folder.replace_dir

    def interrupted(tmp, final):
        if final.name == "step_2" and moment == "before":
            os.kill(os.getpid(), signal.SIGINT)
        replace(tmp, final)
        if final.name == "step_2" and moment == "after":
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(run_folder, "replace_dir", interrupted)
    out = tmp_path / "out"
    run = run_here(out, "save_every_n_steps=2")
    assert run.returncode == 130, run.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["step_2"]
    assert_complete(out / "step_2", 2)
    assert f"Saved checkpoint {out / 'step_2'} (" in run.stdout
    assert run.stdout.strip().splitlines()[-1].endswith(f"Continue with resume_from_checkpoint={out / 'step_2'}.")


def test_a_write_joined_again_after_a_ctrl_c_is_waited_for_to_its_end(python_ctrl_c):
    """Ctrl-C while the recipe waits for a background write, then a wait for it again (the stop publishes a good
    checkpoint): the second wait lasts until the write is over. Up to Python 3.12 an interrupted Thread.join marks
    the thread as ended while it runs, so the second wait returned at once and the folder still being written was
    published (tests/recipes/test_interrupt.py runs the whole case)."""
    from finetune.checkpoint.async_save import Job

    release = threading.Event()
    job = Job(release.wait, "writer")
    main = threading.main_thread().ident
    threading.Timer(0.2, lambda: signal.pthread_kill(main, signal.SIGINT)).start()
    with pytest.raises(KeyboardInterrupt):
        job.join()
    assert not job.done
    threading.Timer(0.5, release.set).start()
    job.join()
    assert job.done and job.error is None


# ------------------------------------------------------------------------------------------------
# the parts
# ------------------------------------------------------------------------------------------------


def tensors_of_every_kind(device: str = "cpu") -> dict:
    g = torch.Generator().manual_seed(0)
    return (
        {
            "layers.1.w": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "layers.0.w": torch.randn(7, generator=g).to(torch.bfloat16),
            "norm": torch.randn(4, generator=g),
            "scalar": torch.tensor(2.5),
            "empty": torch.zeros(0, 3),
            "index": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "codes": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
            "mask": torch.tensor([True, False, True]),
            "half": torch.randn(2, 2, generator=g).to(torch.float16),
        }
        if device == "cpu"
        else {k: v.to(device) for k, v in tensors_of_every_kind().items()}
    )


def test_streamed_safetensors_are_byte_identical_to_save_file(tmp_path):
    from finetune.checkpoint import async_save

    tensors = tensors_of_every_kind()
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})

    def rename(part):  # a converter, as the model families' are: key by key
        return {f"model.{k}": v for k, v in part.items()}

    save_file(rename(tensors), str(tmp_path / "renamed.safetensors"), metadata={"format": "pt"})
    async_save.write_safetensors(tmp_path / "streamed.safetensors", dict(tensors), rename, {"format": "pt"})
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "renamed.safetensors").read_bytes()


def test_a_snapshot_is_a_copy_that_keeps_views_sharing_and_subclasses(tmp_path):
    from torchao.optim.subclass_8bit import OptimState8bit

    from finetune.checkpoint import async_save

    flat = torch.randn(10)
    quantized = OptimState8bit.zeros((256,), signed=True, block_size=256)
    quantized.codes.random_(0, 255)
    shared = torch.ones(3)
    state = {
        "a": flat[:4],
        "b": flat[4:].view(2, 3),
        "shared": [shared, shared],
        "q": quantized,
        "lrs": [0.1, 0.2],
        "step": 7,
        "rng": (3, tuple(range(5)), None),
    }
    original = io.BytesIO()
    torch.save(state, original)

    staging = async_save.Staging(torch.device("cpu"))
    snap, ready = staging.snapshot(state, staging.plan(state))
    assert ready is None
    flat.add_(1.0)
    quantized.codes.zero_()
    shared.mul_(3)
    state["lrs"].append(0.3)  # (the scheduler's lists are copied too)
    copy = io.BytesIO()
    torch.save(snap, copy)
    assert copy.getvalue() == original.getvalue()  # the values at the snapshot, and the same layout for torch.save
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()  # one storage, as before
    assert snap["shared"][0] is snap["shared"][1] and type(snap["q"]) is OptimState8bit

    again, _ = staging.snapshot(state, staging.plan(state))  # the next save reuses the host buffer
    assert again["a"].untyped_storage().data_ptr() == snap["a"].untyped_storage().data_ptr()
    assert torch.equal(again["a"], flat[:4]) and not torch.equal(again["a"], state["a"] - 1)


def test_a_plan_that_moves_storages_off_the_gpu_keeps_the_host_slots_cut_before():
    """The first save may find less spare GPU memory than the first step's estimate (``settle``): the storages that
    no longer fit on the GPU get a buffer of their own, and the buffer cut before keeps its slots (made again whole,
    ~9 GB were allocated and touched inside that save). A plan that moves a host-held storage to the GPU starts over."""
    from finetune.checkpoint import async_save

    staging = async_save.Staging(torch.device("cpu"))
    sizes = [3 * async_save.ALIGN, 5000, 0, 7]
    first = async_save.Layout(sizes, [True, True, False, False])
    staging.allocate(first)
    slots = [staging._regions[2], staging._regions[3]]
    assert staging._regions[:2] == [None, None] and staging.held_bytes == async_save.ALIGN
    staging._regions[3].fill_(7)

    settled = async_save.Layout(sizes, [False, True, False, False])
    staging.allocate(settled)
    assert staging._regions[2] is slots[0] and staging._regions[3] is slots[1]  # the same regions, values kept
    assert torch.equal(staging._regions[3], torch.full((7,), 7, dtype=torch.uint8))
    assert staging._regions[0].numel() == sizes[0] and staging._regions[1] is None
    assert staging.held_bytes == async_save.ALIGN + 3 * async_save.ALIGN  # the moved storage's buffer alone

    parts = {  # the snapshot copies into the kept and the new regions alike
        "a": torch.arange(sizes[0], dtype=torch.uint8),
        "b": torch.ones(5000, dtype=torch.uint8),
        "c": torch.empty(0),
        "d": torch.arange(7, dtype=torch.uint8),
    }
    snap, _ = staging.snapshot(parts, settled)
    assert all(torch.equal(snap[k], parts[k]) for k in parts)
    assert snap["d"].untyped_storage().data_ptr() == slots[1].data_ptr()
    assert snap["a"].untyped_storage().data_ptr() == staging._regions[0].data_ptr()

    staging.allocate(async_save.Layout(sizes, [False, True, True, False]))  # a slotted storage to the GPU: anew
    assert staging._regions[2] is None and staging._regions[3] is not slots[1]
    assert staging.held_bytes == 4 * async_save.ALIGN
    staging.release()
    assert staging.held_bytes == 0 and staging._regions == []


# ------------------------------------------------------------------------------------------------
# on a GPU
# ------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_snapshot_split_between_gpu_and_host_writes_the_same_bytes(tmp_path):
    """Half the snapshot in spare GPU memory, half in pinned host memory; the GPU half streamed through a small
    bounce buffer (several pieces per tensor), the state through torch.save's pinned copies."""
    from finetune.checkpoint import async_save

    tensors = {f"w{i}": torch.randn(512, 512, device="cuda") for i in range(4)}
    staging = async_save.Staging(torch.device("cuda"), gpu_budget=2 * 512 * 512 * 4)
    layout = staging.plan(tensors)
    assert layout.on_gpu == [True, True, False, False] and staging.pinned_bytes == 0
    snap, ready = staging.snapshot(tensors, layout)
    assert staging.pinned_bytes >= 2 * 512 * 512 * 4
    reference = {k: v.cpu() for k, v in tensors.items()}
    for v in tensors.values():
        v.zero_()
    ready.synchronize()
    assert [v.is_cuda for v in snap.values()] == [True, True, False, False]
    save_file(reference, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    bounce = torch.empty(100_000, dtype=torch.uint8, pin_memory=True)  # (1 MiB tensors: 11 pieces each)
    async_save.write_safetensors(tmp_path / "streamed.safetensors", dict(snap), lambda d: d, {"format": "pt"}, bounce)
    assert (tmp_path / "streamed.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    gpu_state = {k: v for k, v in snap.items() if v.is_cuda}
    async_save.pinned_torch_save(gpu_state, tmp_path / "state.pt")
    loaded = torch.load(tmp_path / "state.pt", weights_only=True)
    assert all(torch.equal(loaded[k].cpu(), reference[k]) and loaded[k].is_cuda for k in gpu_state)
    staging.release()


@pytest.mark.gpu
def test_gpu_share_of_a_snapshot_is_settled_from_the_peak_at_the_first_save():
    """The first plan (after the first step) estimates the GPU's share from the peak so far; a compiled run's later
    steps peak higher, and a snapshot sized from the estimate took the memory they needed (out of memory at the step
    after the first save, under a 24 and a 32 GB card's caps). The first save settles it from the peak by then,
    never above the estimate; a later peak (the snapshots' own) changes it no more."""
    from finetune.checkpoint import async_save

    mib = 2**20
    tensors = {f"w{i}": torch.zeros(64 * mib, dtype=torch.uint8, device="cuda") for i in range(4)}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    # a cap with room for the four 64 MiB copies (and 32 MiB to spare) above the peak, beside the margin (2 GiB, or a
    # tenth of the cap where that is more)
    room = torch.cuda.max_memory_reserved() + 288 * mib
    cap = max(room + async_save.GPU_MARGIN_MIN, math.ceil(room / (1 - async_save.GPU_MARGIN_FRACTION)))
    staging = async_save.Staging(torch.device("cuda"), memory_limit_gib=cap / 2**30)
    assert staging.plan(tensors).on_gpu == [True] * 4  # the estimate, as Checkpointer.prepare makes it
    peak = torch.empty(128 * mib, dtype=torch.uint8, device="cuda")  # the steady steps' higher peak: 160 MiB left
    del peak
    staging.settle()  # the first save
    assert staging.plan(tensors).on_gpu == [True, True, False, False]
    higher = torch.empty(256 * mib, dtype=torch.uint8, device="cuda")
    del higher
    staging.settle()  # a later save: settled once
    assert staging.plan(tensors).on_gpu == [True, True, False, False]
    staging.release()


@pytest.mark.gpu
def test_gpu_first_save_that_settles_a_smaller_share_keeps_the_prepared_host_buffer():
    """After the first step (``Checkpointer.prepare``) two of four storages fit the GPU's estimated share and the
    other two get pinned slots; the first save settles a share of one storage: only the storage moved off the GPU
    gets a new buffer, the prepared slots stay (no 9 GB allocated and pinned again inside the save), and a slotted
    storage is never planned onto the GPU. The snapshot still holds the values."""
    from finetune.checkpoint import async_save

    mib = 2**20
    tensors = {f"w{i}": torch.full((64 * mib,), i, dtype=torch.uint8, device="cuda") for i in range(4)}
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    room = torch.cuda.max_memory_reserved() + 160 * mib  # two 64 MiB copies and 32 MiB to spare
    cap = max(room + async_save.GPU_MARGIN_MIN, math.ceil(room / (1 - async_save.GPU_MARGIN_FRACTION)))
    staging = async_save.Staging(torch.device("cuda"), memory_limit_gib=cap / 2**30)
    prepared = staging.plan(tensors)
    assert prepared.on_gpu == [True, True, False, False]
    staging.allocate(prepared)
    slots = [staging._regions[2].data_ptr(), staging._regions[3].data_ptr()]
    pinned = staging.pinned_bytes
    assert pinned >= 128 * mib
    peak = torch.empty(64 * mib, dtype=torch.uint8, device="cuda")  # the steady steps' higher peak
    del peak
    staging.settle()
    settled = staging.plan(tensors)
    assert settled.on_gpu == [True, False, False, False]
    snap, ready = staging.snapshot(tensors, settled)
    ready.synchronize()
    assert [staging._regions[2].data_ptr(), staging._regions[3].data_ptr()] == slots
    assert staging.held_bytes == 3 * 64 * mib and staging.pinned_bytes == pinned + 64 * mib
    assert [int(snap[k][-1]) for k in tensors] == [0, 1, 2, 3]
    assert [v.is_cuda for v in snap.values()] == [True, False, False, False]
    staging.release()


@pytest.mark.gpu
def test_gpu_bf16_run_in_the_background_writes_the_synchronous_folders(tmp_path):
    """The tiny model in bf16 on the GPU (in this process: the GPU machine has no `tune` script). Its checkpoint fits
    spare GPU memory, so it is held there and streamed out: the same bytes as a synchronous save, recipe_state.pt
    included (its tensors keep their cuda location)."""
    args = ("device=cuda", "dtype=bf16", "save_every_n_steps=3")
    background = run_here(tmp_path / "async", *args)
    sync = run_here(tmp_path / "sync", *args, "async_checkpoint=False")
    assert background.ok and sync.ok, background.stderr[-3000:] + sync.stderr[-3000:]
    assert background.losses == sync.losses
    for name in ("step_3", "epoch_0"):
        for f in (sync.output_dir / name).iterdir():
            assert (background.output_dir / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"
    saves = [m for m in background.metrics if "checkpoint_staged_gpu_gib" in m]
    assert saves and all(m["checkpoint_staged_gpu_gib"] > 0 for m in saves)


@pytest.mark.gpu
def test_gpu_saves_before_the_third_step_are_written_before_training_goes_on(tmp_path):
    """A save after a process's first or second step is written synchronously on a GPU: a background save's GPU share
    is sized from the steps' peak, which torch.compile's first steps keep lower than the later ones (a share sized
    then took the memory a later step needed). From the third step on the saves are staged and written in the
    background, and every folder holds what a synchronous run writes."""
    args = ("device=cuda", "dtype=bf16", "save_every_n_steps=1", "max_steps_per_epoch=4")
    background = run_here(tmp_path / "async", *args)
    sync = run_here(tmp_path / "sync", *args, "async_checkpoint=False")
    assert background.ok and sync.ok, background.stderr[-3000:] + sync.stderr[-3000:]
    assert "step_1 is written before training goes on" in background.stderr
    after = {m["step"]: m for m in background.metrics}  # (a save's figures are in the record of the step after it)
    for step in (2, 3):
        assert after[step]["checkpoint_saved"] == f"step_{step - 1}" and "checkpoint_staged_gpu_gib" not in after[step]
    assert "checkpoint_staged_gpu_gib" in after[4]  # (step_3, in the background)
    for name in ("step_1", "step_2", "step_3", "epoch_0"):
        for f in (sync.output_dir / name).iterdir():
            assert (background.output_dir / name / f.name).read_bytes() == f.read_bytes(), f"{name}/{f.name}"
