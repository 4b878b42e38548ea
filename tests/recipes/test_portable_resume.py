"""A run continued on another number of ranks, and with another AdamW variant, for real: FAST tiny on the CPU.

1 -> 2 -> 1: one device (batch_size=4) writes step_2; 2 gloo ranks (batch_size=2 each: the same 4 samples a step)
go on from it and write step_4; one device goes on from that. Each leg's losses are compared with the uninterrupted
one-device run's. They are not bit-equal, for the reason tests/recipes/test_distributed.py's docstring measures: on
2 ranks each rank pads its own 2 samples and FSDP2 reduce-scatters the gradients, so they differ in the last bits,
and an 8-bit code can flip; where a tensor's split falls inside a quantization block, that block is rounded once more
when the ranks' shards are joined (optimizers/_portable.py). Bound: RTOL_QUANT = 1e-3, as there.

8-bit -> 4-bit -> torch AdamW: the uninterrupted 8-bit run's step_2 goes on as 4-bit, whose step_4 goes on with
torch's AdamW. Each converts the moments once (one warning line) and keeps the step count. Bound: RTOL_VARIANT =
1e-2: another state format rounds the moments differently from step to step (test_distributed.py's recorded
one-device losses at batch 4: 4-bit's differ from 8-bit's by up to 2.7e-3 over the same 6 steps). The moments
before and after a conversion are compared in tests/finetune/checkpoint/test_optimizer_state.py.

Runtime: 5 one-device runs, one 2-rank run and one refused start: about 3 minutes on 2 cores.
"""

import pytest
import torch

from conftest import run_distributed, run_recipe

RTOL_QUANT = 1e-3
RTOL_VARIANT = 1e-2
BATCH4 = "batch_size=4"  # one device: the global batch of 2 ranks x batch_size=2


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted one-device 8-bit run, saving step_2 and step_4."""
    out = tmp_path_factory.mktemp("straight") / "out"
    run = run_recipe(out, "optimizer=optimizers.AdamW8bit", BATCH4, "save_every_n_steps=2")
    assert run.ok, run.stderr[-4000:]
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5, 6]
    return run


def conversion_lines(run) -> list:
    return [line for line in (run.stdout + run.stderr).splitlines() if "continues the state" in line]


def test_one_device_then_two_ranks_then_one_device_continue_the_same_run(straight, tmp_path):
    two = run_distributed(
        tmp_path / "two",
        "optimizer=optimizers.AdamW8bit",
        "save_every_n_steps=2",
        f"resume_from_checkpoint={straight.output_dir / 'step_2'}",
    )
    assert two.ok, two.stderr[-4000:]
    assert [m["step"] for m in two.metrics] == [3, 4, 5, 6] and two.metrics[0]["world_size"] == 2
    assert two.losses == pytest.approx(straight.losses[2:], rel=RTOL_QUANT)
    assert [m["lr"] for m in two.metrics] == pytest.approx([m["lr"] for m in straight.metrics[2:]])
    # The 2 ranks wrote the format one device writes: the whole tensors' blocks, not per-rank shards.
    state = torch.load(two.output_dir / "step_4" / "recipe_state.pt", weights_only=True)
    ref = torch.load(straight.output_dir / "step_4" / "recipe_state.pt", weights_only=True)
    assert state["optimizer_layout"] == "full" and state["config"]["world_size"] == 2
    assert state["optimizer"]["param_groups"][0]["state_format"] == "8bit.v3"
    for i, entry in ref["optimizer"]["state"].items():
        assert {k: tuple(v.shape) for k, v in state["optimizer"]["state"][i].items()} == {
            k: tuple(v.shape) for k, v in entry.items()
        }
    assert not conversion_lines(two)

    one = run_recipe(
        tmp_path / "one",
        "optimizer=optimizers.AdamW8bit",
        BATCH4,
        f"resume_from_checkpoint={two.output_dir / 'step_4'}",
    )
    assert one.ok, one.stderr[-4000:]
    assert [m["step"] for m in one.metrics] == [5, 6]
    assert one.losses == pytest.approx(straight.losses[4:], rel=RTOL_QUANT)


def test_8bit_then_4bit_then_torch_adamw_train_on_from_the_converted_moments(straight, tmp_path):
    four = run_recipe(
        tmp_path / "four",
        "optimizer=optimizers.AdamW4bit",
        BATCH4,
        "save_every_n_steps=2",
        f"resume_from_checkpoint={straight.output_dir / 'step_2'}",
    )
    assert four.ok, four.stderr[-4000:]
    lines = conversion_lines(four)
    assert len(lines) == 1 and "optimizers.AdamW8bit" in lines[0] and "4bit.v4" in lines[0], lines
    assert [m["step"] for m in four.metrics] == [3, 4, 5, 6]
    assert four.losses == pytest.approx(straight.losses[2:], rel=RTOL_VARIANT)
    state = torch.load(four.output_dir / "step_4" / "recipe_state.pt", weights_only=True)
    assert state["optimizer"]["param_groups"][0]["state_format"] == "4bit.v4"
    assert {float(e["step"]) for e in state["optimizer"]["state"].values()} == {4.0}  # 2 carried + 2

    adamw = run_recipe(
        tmp_path / "adamw",
        "optimizer=torch.optim.AdamW",
        BATCH4,
        f"resume_from_checkpoint={four.output_dir / 'step_4'}",
    )
    assert adamw.ok, adamw.stderr[-4000:]
    lines = conversion_lines(adamw)
    assert len(lines) == 1 and "optimizers.AdamW4bit" in lines[0], lines
    assert [m["step"] for m in adamw.metrics] == [5, 6]
    assert adamw.losses == pytest.approx(straight.losses[4:], rel=RTOL_VARIANT)
    final = torch.load(adamw.output_dir / "epoch_0" / "recipe_state.pt", weights_only=True)
    assert {float(e["step"]) for e in final["optimizer"]["state"].values()} == {6.0}


def test_an_optimizer_without_a_second_moment_is_refused_in_one_line(straight, tmp_path):
    run = run_recipe(
        tmp_path / "sgd",
        "optimizer=torch.optim.SGD",
        "~optimizer.fused",
        "~optimizer.weight_decay",
        BATCH4,
        f"resume_from_checkpoint={straight.output_dir / 'step_2'}",
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert "second moment" in run.error and "optimizer=optimizers.AdamW8bit" in run.error
    assert "Traceback" not in run.stderr
