"""A run continued on another number of ranks, and with another AdamW variant, for real: FAST tiny on the CPU.

8-bit -> 4-bit -> torch AdamW: the uninterrupted 8-bit run's step_2 goes on as 4-bit, whose step_4 goes on with
torch's AdamW. Each converts the moments once (one warning line) and keeps the step count. Bound: RTOL_VARIANT =
1e-2: another state format rounds the moments differently from step to step (test_distributed.py's recorded
one-device losses at batch 4: 4-bit's differ from 8-bit's by up to 2.7e-3 over the same 6 steps). The moments
before and after a conversion are compared in tests/finetune/checkpoint/test_optimizer_state.py.

optimizer_in_bwd, one device <-> 2 ranks: an 8-bit run in backward with streamed states (the 16 GB configs' way;
clip_grad_norm=null, 8 steps) is continued from step_2 by one optimizer over all parameters on one device, from step_4
by 2 gloo ranks (batch_size=2 each: the same 4 samples a step), and the 2 ranks' step_6 by one device in backward
again. One device steps each parameter with the same arithmetic in either layout (fp32 weights: optimizers.* draw
random bits by a parameter's place in its optimizer only to round bf16 weights), and streamed states train the
resident losses bit for bit (test_streaming.py), so the first leg is exact. The legs on and after the 2 ranks are within RTOL_QUANT = 1e-3, for the reason
tests/recipes/test_distributed.py's docstring measures: on 2 ranks each rank pads its own 2 samples and FSDP2
reduce-scatters the gradients, so they differ in the last bits, and an 8-bit code can flip; where a tensor's split
falls inside a quantization block, that block is rounded once more when the ranks' shards are joined
(optimizers/portable.py).

Runtime: 6 one-device runs and one refused start, in this process (conftest.run_here: every comparison here is
run against run, so the process need not be pinned as for recorded losses), and 1 two-rank run.
"""

import pytest
import torch

from conftest import run_distributed, run_here

RTOL_QUANT = 1e-3
RTOL_VARIANT = 1e-2
BATCH4 = "batch_size=4"  # one device: the global batch of 2 ranks x batch_size=2


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted one-device 8-bit run, saving step_2 and step_4."""
    out = tmp_path_factory.mktemp("straight") / "out"
    run = run_here(out, "optimizer=optimizers.AdamW8bit", BATCH4, "save_every_n_steps=2")
    assert run.ok, run.stderr[-4000:]
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5, 6]
    return run


def conversion_lines(run) -> list:
    return [line for line in (run.stdout + run.stderr).splitlines() if "continues the state" in line]


def test_8bit_then_4bit_then_torch_adamw_train_on_from_the_converted_moments(straight, tmp_path):
    four = run_here(
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

    adamw = run_here(
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
    run = run_here(
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


# -- optimizer_in_bwd's layout (one optimizer per parameter) continued by one optimizer, and back -------------------

EIGHT_STEPS = ["optimizer=optimizers.AdamW8bit", "clip_grad_norm=null", "max_steps_per_epoch=8", "save_every_n_steps=2"]
IN_BWD = ["optimizer_in_bwd=True"]


@pytest.fixture(scope="module")
def in_bwd(tmp_path_factory):
    """The uninterrupted one-device 8-bit run in backward with streamed states, saving step_2, step_4 and step_6."""
    out = tmp_path_factory.mktemp("in_bwd") / "out"
    run = run_here(out, *EIGHT_STEPS, BATCH4, *IN_BWD, "stream_optimizer_states=True")
    assert run.ok, run.stderr[-4000:]
    assert [m["step"] for m in run.metrics] == list(range(1, 9))
    return run


def lrs(run) -> list:
    return [m["lr"] for m in run.metrics]


def test_in_backward_goes_on_as_one_optimizer_and_on_two_ranks_and_back(in_bwd, tmp_path):
    # One device, one optimizer over all parameters, from step_2: exact (the same arithmetic per parameter).
    one = run_here(tmp_path / "one", *EIGHT_STEPS, BATCH4, f"resume_from_checkpoint={in_bwd.output_dir / 'step_2'}")
    assert one.ok, one.stderr[-4000:]
    lines = conversion_lines(one)
    assert len(lines) == 1 and "optimizer_in_bwd=False continues the state saved with optimizer_in_bwd=True" in lines[0]
    assert "joined into one optimizer's" in lines[0], lines
    assert [m["step"] for m in one.metrics] == list(range(3, 9))
    assert one.losses == in_bwd.losses[2:]
    assert lrs(one) == lrs(in_bwd)[2:]
    state = torch.load(one.output_dir / "step_4" / "recipe_state.pt", weights_only=True)["optimizer"]
    assert len(state["param_groups"]) == 1 and {float(e["step"]) for e in state["state"].values()} == {4.0}

    # The streamed run's step_4 straight on 2 ranks (the 16 GB configs' state on several GPUs): the per-parameter
    # states joined (rank 0's one line), each rank's shard cut from them.
    two = run_distributed(tmp_path / "two", *EIGHT_STEPS, f"resume_from_checkpoint={in_bwd.output_dir / 'step_4'}")
    assert two.ok, two.stderr[-4000:]
    lines = conversion_lines(two)
    assert len(lines) == 1 and "joined into one optimizer's" in lines[0], lines
    assert [m["step"] for m in two.metrics] == [5, 6, 7, 8] and two.metrics[0]["world_size"] == 2
    assert two.losses == pytest.approx(in_bwd.losses[4:], rel=RTOL_QUANT)
    assert lrs(two) == pytest.approx(lrs(in_bwd)[4:])
    # The 2 ranks wrote the format one device writes: the whole tensors' blocks, not per-rank shards.
    state = torch.load(two.output_dir / "step_6" / "recipe_state.pt", weights_only=True)
    ref = torch.load(one.output_dir / "step_6" / "recipe_state.pt", weights_only=True)
    assert state["optimizer_layout"] == "full" and state["config"]["world_size"] == 2
    assert state["optimizer"]["param_groups"][0]["state_format"] == "8bit.v3"
    for i, entry in ref["optimizer"]["state"].items():
        assert {k: tuple(v.shape) for k, v in state["optimizer"]["state"][i].items()} == {
            k: tuple(v.shape) for k, v in entry.items()
        }

    # One device in backward again, from the 2 ranks' step_6.
    back = run_here(
        tmp_path / "back", *EIGHT_STEPS, BATCH4, *IN_BWD, f"resume_from_checkpoint={two.output_dir / 'step_6'}"
    )
    assert back.ok, back.stderr[-4000:]
    lines = conversion_lines(back)
    assert len(lines) == 1 and "optimizer_in_bwd=True continues the state saved with optimizer_in_bwd=False" in lines[0]
    assert [m["step"] for m in back.metrics] == [7, 8]
    assert back.losses == pytest.approx(in_bwd.losses[6:], rel=RTOL_QUANT)
    assert lrs(back) == pytest.approx(lrs(in_bwd)[6:])  # (the schedule drives every per-parameter optimizer again)
    final = torch.load(back.output_dir / "epoch_0" / "recipe_state.pt", weights_only=True)["optimizer"]
    assert "param_groups" not in final and {float(e["state"][0]["step"]) for e in final.values()} == {8.0}
