"""Ctrl-C and the compile cache: what a newcomer meets after the tests.

Ctrl-C (SIGINT) stops a run at once, as a user expects, and says where it stands: the summary, the last checkpoint
to resume from, and the shell's 130. (SIGTERM, the scheduler's signal, saves first: test_reliability.py; both end the
process, here.)
"""

import json
import os
import signal
import subprocess
import sys
import time
import weakref

import pytest
import torch
from safetensors.torch import load_file

import support
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

# How long a test waits for a signalled run to exit before it calls it a hang. Generous on purpose: a loaded 2-core
# machine must not turn slowness into a failure (the run exits in a few seconds; the failure message says how many).
EXIT_WAIT_S = 120


def exit_output(proc: subprocess.Popen, after: str) -> str:
    """The run's output once it has exited; a run still going EXIT_WAIT_S after the signal is killed and fails the
    test with its last lines."""
    try:
        return proc.communicate(timeout=EXIT_WAIT_S)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"still running {EXIT_WAIT_S} s after {after}:\n{output[-3000:]}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_to_the_pid_stops_the_run_and_the_process_exits(tmp_path, sig):
    """The signal a script or a scheduler sends: to the recipe's PID only (not its process group), with wandb on and
    a checkpoint written in the background every 2 steps. SIGINT (Ctrl-C) stops at once and exits 130; SIGTERM
    saves at the next step boundary and exits 0. Either way the process ends, with our closing line last and none of
    wandb's own lines. (SIGINT
    used to print its closing lines and hang: torchtune's WandBLogger.__del__ finished the wandb run during the
    interpreter's final garbage collection, after wandb's exit hook had stopped its service, and waited forever.)"""
    out = tmp_path / "out"
    env = recipe_env()
    env.pop("WANDB_SILENT")  # (the tests silence wandb; here the run's own settings must)
    proc = subprocess.Popen(
        recipe_command(out, "save_every_n_steps=2", "max_steps_per_epoch=60", wandb=True),
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream: the order of wandb's lines and ours is what is checked
        text=True,
        preexec_fn=ctrl_c_as_in_a_shell,
    )
    # After step 4, once its checkpoint is being written (often still in the background when the signal comes).
    while proc.poll() is None and not ((out / "step_4").is_dir() or list(out.glob(".tmp-step_4-*"))):
        time.sleep(0.02)
    sent = time.monotonic()
    os.kill(proc.pid, sig)
    output = exit_output(proc, f"{sig.name} to its PID")
    seconds = time.monotonic() - sent
    trained = max(m["step"] for m in read_metrics(out))
    last_line = output.strip().splitlines()[-1]
    exited = f"exit status {proc.returncode}, {seconds:.1f} s after {sig.name}; last line: {last_line}"
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    # wandb's own ~25 lines (its banner, the history's sparklines, a sync hint) are not printed: only ours.
    assert [line for line in output.splitlines() if line.startswith("wandb")] == [
        "wandb: no WANDB_API_KEY, logging offline (upload later with `wandb sync`)"
    ], output[-3000:]
    latest = max(out.glob("step_*"), key=lambda p: int(p.name[5:]))
    if sig == signal.SIGINT:
        assert proc.returncode == 130, exited
        assert last_line.startswith(f"Run stopped by Ctrl-C: trained steps 1-{trained} "), exited
        # step_4 was being written when the signal came, or had been: published either way, and named.
        assert int(latest.name[5:]) >= 4 and last_line.endswith(f"Continue with resume_from_checkpoint={latest}."), (
            exited
        )
    else:
        assert proc.returncode == 0, exited
        assert last_line.startswith(f"Run stopped by SIGTERM: trained steps 1-{trained} "), exited
        assert latest.name == f"step_{trained}", exited  # the stop's own checkpoint
    # The checkpoint is whole, and nothing half-written is left beside it.
    state = torch.load(latest / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == int(latest.name[5:]) and load_file(latest / "model.safetensors")
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")]
    assert list((out / "wandb").glob("offline-run-*/*.wandb")), "no wandb run"
    # summary.json, as at a run's end (Ctrl-C too), named in the closing line, with the wandb run it went to.
    summary = json.loads((out / "summary.json").read_text())
    assert summary["last_step"] == trained and summary["steps"] == trained, summary
    assert next((out / "wandb").glob(f"offline-run-*-{summary['wandb_run_id']}")).is_dir()
    assert f"({out / 'summary.json'})" in last_line, exited


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


def test_a_second_ctrl_c_abandons_the_background_write_and_the_process_exits_130(tmp_path):
    """Two Ctrl-C 0.05 s apart while step_2 is written in the background: the first waits for the write, the second
    abandons it. The process ends with the shell's 130 and its closing lines, within seconds, and step_2 is not
    published. It used to be published empty (an interrupted Thread.join marked the writer as ended: Job.join), and
    the interpreter's shutdown then stopped the writer's thread inside torch's C++ code, which aborted the process
    (exit status -6)."""
    out = tmp_path / "out"
    slow = ["optimizer._component_=slow_writer.SlowWriteAdamW", "optimizer.write_s=30"]
    proc = subprocess.Popen(
        recipe_command(out, "save_every_n_steps=2", "max_steps_per_epoch=60", *slow),
        cwd=REPO_ROOT,
        env=recipe_env(PYTHONPATH=support.slow_writer_path(tmp_path / "slow")),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=ctrl_c_as_in_a_shell,
    )
    while proc.poll() is None and not list(out.glob(".tmp-step_2-*")):
        time.sleep(0.02)
    time.sleep(1.0)  # (the write is under way, in the slow part)
    os.kill(proc.pid, signal.SIGINT)
    time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    output = exit_output(proc, "two Ctrl-C")
    assert proc.returncode == 130, f"exit status {proc.returncode}:\n{output[-3000:]}"
    assert "Traceback" not in output and "terminate called" not in output, output[-3000:]
    assert "Ctrl-C again abandons it" in output
    assert output.strip().splitlines()[-1].startswith("Run stopped by Ctrl-C: trained steps 1-"), output[-3000:]
    assert not (out / "step_2").exists()  # abandoned: its temporary folder is removed at the next start
    assert not (out / ".lock").exists()


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


def test_ctrl_c_while_the_libraries_import_is_one_line():
    """Ctrl-C to `tune run` while torch is still being imported (its library mapped, its Python modules still
    loading), before the recipe's own handler exists: one line and the process ends by SIGINT (the shell's 130),
    not a traceback through the import machinery (finetune/tune_run.py)."""
    proc = subprocess.Popen(
        recipe_command(REPO_ROOT / "unused"),
        cwd=REPO_ROOT,
        env=recipe_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=ctrl_c_as_in_a_shell,
    )
    maps = f"/proc/{proc.pid}/maps"
    while proc.poll() is None and "libtorch" not in open(maps).read():
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=EXIT_WAIT_S)
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err[-3000:])
    assert err == "Stopped by Ctrl-C while starting (before the recipe's setup): nothing was trained.\n", err[-3000:]
    assert out == "" and not (REPO_ROOT / "unused").exists()


def test_pinned_runs_compile_into_their_own_cache():
    """Pinned test runs (AVX2: recorded losses hold on any x86 CPU) must not leave compiled code where an unpinned
    run of the user's would pick it up: TorchInductor's cache key does not include the pins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = recipe_env()
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == pinned_inductor_cache("avx2") != default_cache_dir()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != env["TORCHINDUCTOR_CACHE_DIR"]
