"""Ctrl-C and the compile cache: what a newcomer meets after the tests.

Ctrl-C (SIGINT) stops a run at once, as a user expects, and says where it stands: the summary, the last checkpoint
to resume from, and the shell's 130. (SIGTERM, the scheduler's signal, saves first: test_reliability.py.)
"""

import os
import signal
import subprocess
import time

import torch
from safetensors.torch import load_file

from conftest import REPO_ROOT, pinned_inductor_cache, read_metrics, recipe_command, recipe_env


def test_ctrl_c_sums_up_names_the_checkpoint_to_resume_from_and_exits_130(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(recipe_command(out, "save_every_n_steps=2", "max_steps_per_epoch=60"), cwd=REPO_ROOT,
                            env=recipe_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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


def test_pinned_runs_compile_into_their_own_cache():
    """Pinned test runs (AVX2: recorded losses hold on any x86 CPU) must not leave compiled code where an unpinned
    run of the user's would pick it up: TorchInductor's cache key does not include the pins."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    env = recipe_env()
    assert env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["TORCHINDUCTOR_CACHE_DIR"] == pinned_inductor_cache("avx2") != default_cache_dir()
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != env["TORCHINDUCTOR_CACHE_DIR"]
