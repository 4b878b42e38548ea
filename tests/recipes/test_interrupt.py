"""Ctrl-C and the compile cache: what a newcomer meets after the tests.

Ctrl-C (SIGINT) stops a run at once, as a user expects, and says where it stands: the summary, the last checkpoint
to resume from, and the shell's 130. (SIGTERM, the scheduler's signal, saves first: test_reliability.py.)
"""

import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

from conftest import (
    RECIPE,
    REPO_ROOT,
    ctrl_c_as_in_a_shell,
    pinned_inductor_cache,
    read_metrics,
    recipe_command,
    recipe_env,
)
from finetune.stops import StopSignal


def test_ctrl_c_sums_up_names_the_checkpoint_to_resume_from_and_exits_130(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(
        recipe_command(out, "save_every_n_steps=2", "max_steps_per_epoch=60"),
        cwd=REPO_ROOT,
        env=recipe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_shell,
    )
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline and not any(m["step"] >= 3 for m in read_metrics(out)):
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("Run stopped by Ctrl-C: trained steps 1-"), summary
    latest = max(out.glob("step_*"), key=lambda p: int(p.name[5:]))
    assert summary.endswith(f"Continue with resume_from_checkpoint={latest}."), summary
    # The checkpoint is whole, and nothing half-written is left beside it.
    state = torch.load(latest / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == int(latest.name[5:]) and load_file(latest / "model.safetensors")
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]


class _Thing:
    pass


# The recipe, with Ctrl-C arriving at step 3 while a weakref callback runs on the main thread (as when a finished
# checkpoint writer's thread object is freed): `python -c SWALLOWED_CTRL_C RECIPE ARGS...`.
SWALLOWED_CTRL_C = r"""
import runpy, signal, sys, weakref
from finetune.reporting.metrics import MetricsLog

write = MetricsLog.write
class Thing:
    pass

def write_and_ctrl_c(self, record):
    write(self, record)
    if record["step"] == 3:
        thing = Thing()
        ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGINT))
        del thing

MetricsLog.write = write_and_ctrl_c
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_ctrl_c_lost_in_a_callback_still_stops_the_run_at_the_next_step(tmp_path):
    out = tmp_path / "out"
    args = recipe_command(out, "max_steps_per_epoch=20")
    recipe = args.index(RECIPE)
    run = subprocess.run(
        [sys.executable, "-c", SWALLOWED_CTRL_C, *args[recipe:]],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=ctrl_c_as_in_a_shell,
    )
    assert run.returncode == 130, run.stderr[-3000:]  # (it trained all 20 steps and exited 0)
    assert "KeyboardInterrupt" not in run.stderr and "Exception ignored" not in run.stderr, run.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert run.stdout.strip().splitlines()[-1].startswith("Run stopped by Ctrl-C: trained steps 1-3"), run.stdout


def test_a_ctrl_c_python_swallows_in_a_weakref_callback_is_raised_at_the_step_boundary(monkeypatch, python_ctrl_c):
    """Python raises Ctrl-C's KeyboardInterrupt in whatever runs next on the main thread. When that is a weakref
    callback (a finished checkpoint writer's thread object being freed calls one), Python only prints it, and the run
    went on to its end with exit status 0. The recipes check at every step boundary."""
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with StopSignal() as stop:
        thing = _Thing()
        ref = weakref.ref(thing, lambda _: signal.raise_signal(signal.SIGINT))  # Ctrl-C, handled inside the callback
        del thing  # no KeyboardInterrupt comes out of here: Python cannot raise from a callback
        assert ref() is None and stop.ctrl_c
        with pytest.raises(KeyboardInterrupt):
            stop.check_ctrl_c()
    assert seen == []  # nor is "Exception ignored ... KeyboardInterrupt" printed
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler and sys.unraisablehook == seen.append


def test_other_errors_in_callbacks_are_still_reported_and_an_ignored_ctrl_c_stays_ignored(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    def fail(_):
        raise ValueError("a callback's own error")

    with StopSignal() as stop:
        thing = _Thing()
        ref = weakref.ref(thing, fail)
        del thing
        stop.check_ctrl_c()  # no Ctrl-C: nothing raised
    assert ref() is None and [type(u.exc_value) for u in seen] == [ValueError]
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # nohup, a shell's background job
    try:
        with StopSignal():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_pinned_runs_compile_into_their_own_cache():
    """Pinned test runs (AVX2: recorded losses hold on any x86 CPU) must not leave compiled code where an unpinned
    run of the user's would pick it up: TorchInductor's cache key does not include the pins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = recipe_env()
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == pinned_inductor_cache("avx2") != default_cache_dir()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != env["TORCHINDUCTOR_CACHE_DIR"]
