"""``stream_optimizer_states=True`` in the recipe, on the CPU (the stand-in link: the states leave their storages
between steps for host slots and come back for each step): the run trains the losses of the same run with resident
states, bit for bit; its checkpoint resumes exactly; what it moves is recorded per step; a config that cannot
stream is refused in one line."""

import pytest
import torch

from conftest import run_in_process

IN_BACKWARD = ["optimizer_in_bwd=True", "clip_grad_norm=null", "max_steps_per_epoch=4", "save_every_n_steps=2"]


@pytest.fixture
def runs(tmp_path, capsys, monkeypatch):
    resident = run_in_process(tmp_path / "resident", *IN_BACKWARD, capsys=capsys, monkeypatch=monkeypatch)
    streamed = run_in_process(
        tmp_path / "streamed", *IN_BACKWARD, "stream_optimizer_states=True", capsys=capsys, monkeypatch=monkeypatch
    )
    assert resident.ok, resident.stderr[-3000:]
    assert streamed.ok, streamed.stderr[-3000:]
    return resident, streamed


def test_streamed_states_train_the_resident_losses_and_resume_exactly(runs, tmp_path, capsys, monkeypatch):
    resident, streamed = runs
    assert len(streamed.losses) == 4 and streamed.losses == resident.losses
    assert all(m["host_copy_gb"] > 0 for m in streamed.metrics)  # (the first step writes out only)
    # The checkpoint holds the same optimizer state a resident run writes, tensor for tensor.
    load = lambda run: torch.load(run.output_dir / "step_2" / "recipe_state.pt", weights_only=True)["optimizer"]  # noqa: E731
    a, b = load(resident), load(streamed)
    assert a.keys() == b.keys()
    for name in a:
        for pid, entry in a[name]["state"].items():
            for key, value in entry.items():
                assert torch.equal(value, b[name]["state"][pid][key]), (name, key)
    resumed = run_in_process(
        tmp_path / "resumed",
        *IN_BACKWARD,
        "stream_optimizer_states=True",
        f"resume_from_checkpoint={streamed.output_dir / 'step_2'}",
        capsys=capsys,
        monkeypatch=monkeypatch,
    )
    assert resumed.ok, resumed.stderr[-3000:]
    assert resumed.losses == streamed.losses[2:]


def test_streaming_without_optimizer_in_backward_is_one_error_line(tmp_path, capsys, monkeypatch):
    run = run_in_process(tmp_path / "bad", "stream_optimizer_states=True", capsys=capsys, monkeypatch=monkeypatch)
    assert run.returncode == 2
    errors = [line for line in (run.stderr + run.stdout).splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stream_optimizer_states=True" in errors[0] and "optimizer_in_bwd=True" in errors[0]
    assert "Traceback" not in run.stderr
