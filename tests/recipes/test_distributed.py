"""The FSDP2 recipe, run for real: ``tune run --nproc_per_node 2`` on the CPU (gloo), FAST tiny model.

What is compared. 2 ranks x batch_size=2 read, per step, the same 4 samples as one device with batch_size=4
(one seeded permutation; rank r takes samples r, r+2, ...), and the loss and gradient are normalised by the
tokens of all ranks, so the distributed losses should equal the single-device ones at batch 4. Recorded
single-device losses (SINGLE_DEVICE_BATCH4, from ``recipes/full_finetune_single_device.py`` with FAST and
batch_size=4 on the 2-core CPU; ``test_single_device_reference_is_current`` re-runs them, marked slow) are the
reference. What still differs:

- fp32 arithmetic order: each rank pads its own 2 samples (not 4) and FSDP2 averages the gradient shards
  (reduce-scatter) before the recipe multiplies by world/tokens, so gradients differ in the last bits.
  torch.optim.AdamW and optimizers.AdamW (16-bit states) stay within RTOL_EXACT.
- Quantized states (optimizers.AdamW8bit / AdamW4bit / AdamWFp8): the blocks of 128/256 elements that share
  one scale live inside each rank's shard. Where a split point is not a block boundary (or a shard is short)
  the blocks, their absmax and so the rounding of m and v differ from the single-device state. In the FAST
  model every split point happens to fall on a multiple of 256 elements, so the blocks coincide and what is
  left are codes flipped by last-bit gradient differences (uneven shards are checked bit for bit against
  local stepping in test_optimizers_dtensor.py). FP8 is the most sensitive: v below about 2^-9 of its block
  max flushes to zero, so a last-bit change can move an element between 0 and the smallest subnormal and
  change its update a lot. The 4-bit first moment is rounded stochastically with bits drawn by the element's
  index in the tensor the optimizer holds, here the rank's shard, so its rounding differs from one device's by
  design (statistically the same). Measured max relative loss difference over the 6 steps: torch AdamW 2e-7,
  optimizers.AdamW 2e-7, 4-bit 2.4e-4 (7e-7 with session 5's nearest-rounded format), 8-bit 1.2e-6, FP8 7e-4
  (FP8 on one device, batch 2 x 2 accumulation vs batch 4, already differs by 5e-5: the same sensitivity).
  RTOL_QUANT allows 1e-3, RTOL_FP8 3e-3.

Runtime: each launch is mostly start-up (the launcher and every rank import torch, torchtune and torchao, ~6.5 s
each), so launches are shared where the checks allow: one 2-rank run per optimizer serves the matching, metrics,
layout, resume and late-write checks (``runs``), and one process re-runs the five single-device references. What
is left: 9 two-rank runs, two single-process resumes, the one-device twin of the output-layer loss's run and that
one reference process, plus the two stop-signal runs through recipes/launch.py (a launcher process, two ranks, a
save made 3 s slow).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import support
from conftest import (
    DATA_DIR,
    FAST,
    HANG_GUARD_S,
    REPO_ROOT,
    TINY_CONFIG,
    RecipeRun,
    read_metrics,
    recipe_env,
    run_distributed,
    run_here,
    run_in_one_process,
)
from conftest import DISTRIBUTED_RECIPE as RECIPE

RTOL_EXACT = 1e-4
RTOL_QUANT = 1e-3
RTOL_FP8 = 3e-3

# FAST + batch_size=4 on one device (the global batch of 2 ranks x batch_size=2).
SINGLE_DEVICE_BATCH4 = {
    "torch.optim.AdamW": [
        10.591089248657227,
        9.77411937713623,
        9.204625129699707,
        8.737532615661621,
        7.874703407287598,
        7.958918571472168,
    ],
    "optimizers.AdamW8bit": [
        10.591089248657227,
        9.774114608764648,
        9.204644203186035,
        8.737385749816895,
        7.8748040199279785,
        7.958981513977051,
    ],
    "optimizers.AdamW4bit": [
        10.591089248657227,
        9.774114608764648,
        9.203450202941895,
        8.729704856872559,
        7.853945732116699,
        7.9379167556762695,
    ],
    "optimizers.AdamWFp8": [
        10.591089248657227,
        9.774114608764648,
        9.205183982849121,
        8.732003211975098,
        7.874123573303223,
        7.959527492523193,
    ],
    "optimizers.AdamW": [
        10.591089248657227,
        9.774114608764648,
        9.204625129699707,
        8.737543106079102,
        7.874739170074463,
        7.958949565887451,
    ],
}
RTOL = {
    "torch.optim.AdamW": RTOL_EXACT,
    "optimizers.AdamW": RTOL_EXACT,
    "optimizers.AdamW8bit": RTOL_QUANT,
    "optimizers.AdamW4bit": RTOL_QUANT,
    "optimizers.AdamWFp8": RTOL_FP8,
}

METRIC_KEYS = {
    "step",
    "epoch",
    "loss",
    "lr",
    "tokens_per_second",
    "tokens_per_second_per_gpu",
    "peak_rss_gib",
    "peak_rss_gib_per_rank",
    "optimizer_step_ms",
    "optimizer_state_bytes",
    "optimizer_state_bytes_per_rank",
    "grad_norm",
    "world_size",
}


# How each run of ``runs`` names its optimizer (a resume of it must name the same). torch's AdamW is run as
# faults.LateWriteAdamW: torch.optim.AdamW itself, stepping the same numbers, whose background checkpoint writer
# reaches recipe_state.pt LATE_WRITE_S seconds late (set for that run only): the run serves the late-write test too,
# and the resumes from its step_3 continue from a state written while steps 4-6 trained.
OPTIMIZER_OVERRIDES = {"torch.optim.AdamW": ["optimizer._component_=faults.LateWriteAdamW"]}


def optimizer_overrides(optimizer: str) -> list:
    return OPTIMIZER_OVERRIDES.get(optimizer, [f"optimizer={optimizer}"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory, faults):
    """One 2-rank run per optimizer, batch 2 per rank; torch's AdamW and our 8-bit also save step_3, and torch's
    writes it late and logs to wandb (offline), as the README's command does (the late-write test)."""
    cache = {}

    def get(optimizer: str) -> RecipeRun:
        if optimizer not in cache:
            out = tmp_path_factory.mktemp(optimizer.replace(".", "_")) / "out"
            extra = ["save_every_n_steps=3"] if optimizer in ("torch.optim.AdamW", "optimizers.AdamW8bit") else []
            env = dict(faults)
            if optimizer == "torch.optim.AdamW":
                extra.append("metric_logger._component_=torchtune.training.metric_logging.WandBLogger")
                env["LATE_WRITE_S"] = "3"
            run = run_distributed(out, *optimizer_overrides(optimizer), *extra, env=env)
            assert run.ok, run.stderr[-4000:]
            cache[optimizer] = run
        return cache[optimizer]

    return get


# Each row is a 2-rank run (~25 s of CI). torch's AdamW and our 8-bit and 4-bit cover the three ways a state can
# live in a shard (plain tensors, block-scaled codes, stochastically rounded 4-bit codes); FP8 and the 16-bit
# states take the 8-bit path's flat per-rank buffers, checked bit for bit on uneven shards in
# test_optimizers_dtensor.py for every registered variant (the slow test_single_device_reference_is_current still
# re-records all five single-device references above).
TWO_RANK_MATRIX = ["torch.optim.AdamW", "optimizers.AdamW8bit", "optimizers.AdamW4bit"]


@pytest.mark.parametrize("optimizer", TWO_RANK_MATRIX)
def test_two_ranks_match_single_device_with_the_global_batch(runs, optimizer):
    run = runs(optimizer)
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5, 6]
    assert run.losses == pytest.approx(SINGLE_DEVICE_BATCH4[optimizer], rel=RTOL[optimizer])


def test_a_loss_that_applies_the_output_layer_itself_trains_what_one_device_trains(tmp_path):
    """finetune.model.LinearCrossEntropyLoss, the loss of most configs, applies the output layer itself, after the
    model's forward: 2 ranks x 1 row take the gradients one device takes from 2 micro-batches of 1 row (rank r reads
    samples r, r+2, ...; one device reads 0, 1, ... in that order), so the first step's gradient norm is the same sum
    and the losses after it follow. (While the root was resharded after its forward, each rank's output-layer
    gradient held its own tokens only: here a first norm of 1.0879 against one device's 1.0050.)"""
    same = ["loss._component_=finetune.model.LinearCrossEntropyLoss", "batch_size=1", "max_steps_per_epoch=4"]
    ranks = run_distributed(tmp_path / "ranks", *same)
    one = run_here(tmp_path / "one", *same, "gradient_accumulation_steps=2")
    assert ranks.ok, ranks.stderr[-3000:]
    assert one.ok, one.stderr[-3000:]
    norms = [[m["grad_norm"] for m in run.metrics] for run in (ranks, one)]
    # (1e-5 apart with the fix, the summation orders differing; 8e-2 without it)
    assert norms[0][0] == pytest.approx(norms[1][0], rel=1e-3)
    assert len(ranks.losses) == 4 and ranks.losses == pytest.approx(one.losses, rel=RTOL_EXACT)


def test_metrics_are_reduced_over_ranks(runs):
    run = runs("optimizers.AdamW8bit")
    for m in run.metrics:
        assert METRIC_KEYS <= set(m), m
        assert m["world_size"] == 2 and len(m["peak_rss_gib_per_rank"]) == 2
        assert m["tokens_per_second_per_gpu"] == pytest.approx(m["tokens_per_second"] / 2)
        assert m["peak_rss_gib"] == max(m["peak_rss_gib_per_rank"])
        assert m["optimizer_state_bytes"] == sum(m["optimizer_state_bytes_per_rank"])
        assert math.isfinite(m["grad_norm"]) and m["optimizer_step_ms"] > 0
    # Each rank holds about half of the 8-bit state (codes + scales of its own shards).
    per_rank = run.metrics[-1]["optimizer_state_bytes_per_rank"]
    assert abs(per_rank[0] - per_rank[1]) < 0.05 * per_rank[0]
    assert "step 6 | epoch 0 | loss" in run.stdout


def test_checkpoint_layout_and_full_weights(runs):
    from safetensors.torch import load_file

    run = runs("optimizers.AdamW8bit")
    names = sorted(p.name for p in run.output_dir.iterdir() if p.is_dir())
    assert names == ["epoch_0", "step_3"]
    files = {p.name for p in (run.output_dir / "epoch_0").iterdir()}
    assert files == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.model",
        "recipe_state.pt",
        "recipe_state_rank0.pt",
        "recipe_state_rank1.pt",
        *(f"{name}.crc32" for name in ("recipe_state.pt", "recipe_state_rank0.pt", "recipe_state_rank1.pt")),
    }
    weights = load_file(run.output_dir / "epoch_0" / "model.safetensors")
    config = json.loads((run.output_dir / "epoch_0" / "config.json").read_text())
    # Full (gathered) HF tensors, not shards.
    assert weights["model.embed_tokens.weight"].shape == (config["vocab_size"], config["hidden_size"])
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (config["intermediate_size"], config["hidden_size"])
    state = torch.load(run.output_dir / "step_3" / "recipe_state.pt", weights_only=False)
    # The optimizer state whole, in the format one device writes (finetune/checkpoint/optimizer_state.py)
    assert state["optimizer_layout"] == "full" and state["config"]["world_size"] == 2
    assert state["optimizer"]["param_groups"][0]["state_format"] == "8bit.v3" and state["optimizer"]["state"]
    torch_state = torch.load(runs("torch.optim.AdamW").output_dir / "step_3" / "recipe_state.pt", weights_only=False)
    assert torch_state["optimizer_layout"] == "full" and torch_state["optimizer"]["state"]


@pytest.mark.parametrize("optimizer", ["torch.optim.AdamW", "optimizers.AdamW8bit"])
def test_resume_on_two_ranks_continues_with_the_same_losses(runs, tmp_path, faults, optimizer):
    full = runs(optimizer)
    out = tmp_path / "out"
    resumed = run_distributed(
        out, *optimizer_overrides(optimizer), f"resume_from_checkpoint={full.output_dir / 'step_3'}", env=faults
    )
    assert resumed.ok, resumed.stderr[-4000:]
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6]
    # Same weights, optimizer shards, lr and data position: the same numbers as the uninterrupted run.
    assert resumed.losses == pytest.approx(full.losses[3:], rel=1e-6)
    assert [m["lr"] for m in resumed.metrics] == pytest.approx([m["lr"] for m in full.metrics[3:]])


def test_full_torch_state_resumes_on_another_rank_count(runs, tmp_path, faults):
    """torch.optim's state is saved in full, so 2 ranks x batch 2 resume on 1 rank x batch 4 (same global batch)."""
    full = runs("torch.optim.AdamW")
    resumed = run_distributed(
        tmp_path / "out",
        *optimizer_overrides("torch.optim.AdamW"),
        "batch_size=4",
        f"resume_from_checkpoint={full.output_dir / 'step_3'}",
        nproc=0,
        env=faults,
    )
    assert resumed.ok, resumed.stderr[-4000:]
    assert [m["step"] for m in resumed.metrics] == [4, 5, 6] and resumed.metrics[0]["world_size"] == 1
    assert resumed.losses == pytest.approx(full.losses[3:], rel=RTOL_EXACT)


def test_quantized_state_resumes_on_another_rank_count(runs, tmp_path):
    """A quantized state saved by 2 ranks resumes on 1 (launched without torchrun: a world of one) with batch 4: it
    was saved whole, on the tensors' own blocks (tests/recipes/test_portable_resume.py goes 1 -> 2 -> 1)."""
    full = runs("optimizers.AdamW8bit")
    run = run_distributed(
        tmp_path / "out",
        "optimizer=optimizers.AdamW8bit",
        "batch_size=4",
        f"resume_from_checkpoint={full.output_dir / 'step_3'}",
        nproc=0,
    )
    assert run.ok, run.stderr[-3000:]
    assert [m["step"] for m in run.metrics] == [4, 5, 6] and run.metrics[0]["world_size"] == 1
    assert run.losses == pytest.approx(full.losses[3:], rel=RTOL_QUANT)


def test_a_damaged_state_is_refused_on_two_ranks_as_in_one_process(runs, tmp_path):
    """Each rank takes its shard out of the whole saved state (``load_full``), which would pad a codes tensor one
    block short with zeros; the distributed resume runs the checks the single-device one runs (restore:
    finetune/checkpoint/state_check.py), so both stop with the same line before any step. The file's checksum is
    removed, as an older checkpoint has none: that refuses any damage first (tests/recipes/test_damaged_state.py)."""
    ckpt = tmp_path / "step_3"
    shutil.copytree(runs("optimizers.AdamW8bit").output_dir / "step_3", ckpt)
    state = torch.load(ckpt / "recipe_state.pt", weights_only=True)
    entry = state["optimizer"]["state"][0]
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        entry[key] = entry[key][:-1].clone()
    torch.save(state, ckpt / "recipe_state.pt")
    (ckpt / "recipe_state.pt.crc32").unlink()
    resume = ["optimizer=optimizers.AdamW8bit", f"resume_from_checkpoint={ckpt}"]
    two = run_distributed(tmp_path / "two", *resume)
    one = run_here(tmp_path / "one", *resume, "batch_size=4")  # (the single-device recipe: the same 4 samples a step)
    assert two.returncode == one.returncode == 2 and not two.metrics and "Traceback" not in two.stderr
    assert two.error == one.error
    assert two.error.startswith(
        f"error: the optimizer state in {ckpt / 'recipe_state.pt'} does not fit parameter tok_embeddings.weight "
        "(32000, 64): exp_avg is (7999, 256) torch.uint8, where 2048000 elements in 8bit.v3 blocks of 256 take "
        "(8000, 256) torch.uint8"
    ), two.error


@pytest.fixture(scope="module")
def single_device_references(tmp_path_factory):
    """{optimizer: its single-device run at batch 4}, the five run one after another in one subprocess pinned as the
    recorded runs were (recipe_env; support.run_batch: each a fresh recipe_main with `tune run`'s arguments). Start-up
    (importing torch, torchtune and torchao) is most of a run: paid once for the five."""
    root = tmp_path_factory.mktemp("single_device")
    return run_in_one_process(
        {o: (root / o.replace(".", "_"), [f"optimizer={o}", "batch_size=4"]) for o in SINGLE_DEVICE_BATCH4}
    )


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(SINGLE_DEVICE_BATCH4))
def test_single_device_reference_is_current(single_device_references, optimizer):
    run = single_device_references[optimizer]
    assert run.ok, run.stderr[-3000:]
    assert run.losses == pytest.approx(SINGLE_DEVICE_BATCH4[optimizer], rel=1e-4)


# ------------------------------------------------------------------------------------------------
# reliability on 2 ranks: a stop signal on one rank, a non-finite step, one rank's failed write, the lock, a stop
# signal to the launcher (one rank's unreadable resume file: test_reliability_surfaces.py, on 2 gloo processes)
# ------------------------------------------------------------------------------------------------

# Fault injectors the ranks import (the file goes on PYTHONPATH): a loss that turns NaN at given calls and an AdamW
# that sends itself SIGTERM inside given step() calls and makes torch.save fail with ENOSPC for one rank's file.
FAULTS = '''
import errno, os, signal
import torch

RANK = int(os.environ.get("RANK", "0"))


class NaNCrossEntropy(torch.nn.CrossEntropyLoss):
    def __init__(self, nan_at=(), **kwargs):
        super().__init__(**kwargs)
        self.nan_at, self.calls = set(nan_at), 0

    def forward(self, logits, labels):
        self.calls += 1
        loss = super().forward(logits, labels)
        return loss * float("nan") if self.calls in self.nan_at else loss


class FaultyAdamW(torch.optim.AdamW):
    def __init__(self, params, sigterm_at=(), sigterm_rank=1, enospc_in=None, enospc_rank=1, **kwargs):
        super().__init__(params, **kwargs)
        self.sigterm_at, self.calls = set(sigterm_at), 0
        self.sigterm_here = RANK == sigterm_rank
        if enospc_in is not None and RANK == enospc_rank:
            save = torch.save

            def full_disk(obj, f, *args, **kw):
                if enospc_in in str(f):
                    raise OSError(errno.ENOSPC, "No space left on device", str(f))
                return save(obj, f, *args, **kw)

            torch.save = full_disk

    def step(self, closure=None):
        self.calls += 1
        out = super().step(closure)
        if self.sigterm_here and self.calls in self.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # lands after this step's all-reduce: only this rank knows
        return out


class LateWriteAdamW(torch.optim.AdamW):
    """torch's AdamW in a run whose background checkpoint writer reaches recipe_state.pt $LATE_WRITE_S seconds late,
    as a writer thread on a loaded machine may: training takes its next steps meanwhile. (An environment variable, not
    an optimizer setting: a resume must repeat the optimizer's settings, and need not wait.)"""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        import time
        save, write_s = torch.save, float(os.environ.get("LATE_WRITE_S", "0"))

        def late(obj, f, *args, **kw):
            if str(f).endswith("recipe_state.pt"):
                time.sleep(write_s)
            return save(obj, f, *args, **kw)

        torch.save = late


class SlowSaveAdamW(torch.optim.AdamW):
    """torch's AdamW whose state_dict() (called only to save a checkpoint) takes ``save_s`` seconds longer."""

    def __init__(self, params, save_s=0.0, **kwargs):
        super().__init__(params, **kwargs)
        self.save_s = save_s

    def state_dict(self):
        import time
        time.sleep(self.save_s)
        return super().state_dict()
'''


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The environment that lets the ranks import FAULTS (as ``faults``)."""
    folder = tmp_path_factory.mktemp("faults")
    (folder / "faults.py").write_text(FAULTS)
    return {"PYTHONPATH": str(folder)}


def test_a_late_background_write_holds_its_steps_state_and_the_run_prints_one_seed_line(runs):
    """step_3's optimizer state is step 3's even when the writer gets to it only after steps 4-6 have run: torch's
    gather had handed the live step counts to the background save, which wrote 6 here (and, by the machine's load,
    sometimes 4: the resume tests' flake, steps 5-6 trained 0.3 % off).

    The same two-rank run (``runs``' torch AdamW run, which writes 3 s late) logs to wandb (offline), as the README's
    command does: torchtune's seed line once (rank 0's), not once per rank (the logger's import had set torchtune's
    shared logger back to DEBUG on every rank: console.set_log_level), and the closing summary states the first
    step's time, as the single-device recipe's does, read from the first metrics record."""
    run = runs("torch.optim.AdamW")
    state = torch.load(run.output_dir / "step_3" / "recipe_state.pt", weights_only=False)["optimizer"]["state"]
    assert state and {float(entry["step"]) for entry in state.values()} == {3.0}

    output = run.stdout + run.stderr
    assert output.count("Setting manual seed") == 1, output[-4000:]
    assert "first_step_s" in run.metrics[0] and all("first_step_s" not in m for m in run.metrics[1:])
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["first_step_s"] == run.metrics[0]["first_step_s"] > 0
    assert f"first step {summary['first_step_s']:.1f} s" in run.stdout


def test_signal_on_one_rank_and_a_nonfinite_step_stop_both_at_one_boundary(tmp_path, faults):
    """Step 2's loss is NaN on rank 1: both ranks skip it. Rank 1 gets SIGTERM inside its second optimizer step
    (step 3), after step 3's all-reduce: both ranks learn it from step 4's, save step_4 together and exit 0 (acting on
    the local flag, rank 1 alone would save step_3 while rank 0 trains on, and both would hang)."""
    run = run_distributed(
        tmp_path / "out",
        "optimizer._component_=faults.FaultyAdamW",
        "optimizer.sigterm_at=[2]",
        "loss._component_=faults.NaNCrossEntropy",
        "loss.nan_at=[2]",
        env=faults,
        timeout=HANG_GUARD_S,  # (a deadlock of the ranks is what is tested)
    )
    assert run.ok, run.stderr[-4000:]
    assert [m["step"] for m in run.metrics] == [1, 2, 3, 4]
    assert [m["skipped_steps"] for m in run.metrics] == [0, 1, 1, 1] and run.metrics[1]["loss"] is None
    assert sorted(p.name for p in run.output_dir.iterdir() if p.is_dir()) == ["step_4"]
    assert {"recipe_state_rank0.pt", "recipe_state_rank1.pt"} <= {p.name for p in (run.output_dir / "step_4").iterdir()}
    state = torch.load(run.output_dir / "step_4" / "recipe_state.pt", weights_only=True)
    assert state["global_step"] == 4 and state["skipped_steps"] == 1
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {3.0}  # step 2 did not step
    assert "Run stopped by SIGTERM: trained steps 1-4" in run.stdout


def test_a_failed_write_on_one_rank_is_one_error_on_all_and_keeps_the_last_checkpoint(tmp_path, faults):
    """Rank 1's part of step_4 hits a full disk; rank 0 finishes its part and learns it at the all-gather: one
    ``error:`` line (from rank 0), no rank left waiting, step_2 untouched and no step_4 or temporary folder.

    Every rank exits 2; torchrun then reports the failed ranks itself and exits 1 (its ChildFailedError report comes
    after our line; without torchrun a refused start exits with the recipe's own 2)."""
    run = run_distributed(
        tmp_path / "out",
        "optimizer._component_=faults.FaultyAdamW",
        "optimizer.enospc_in=step_4",
        "save_every_n_steps=2",
        env=faults,
        timeout=HANG_GUARD_S,  # (a deadlock of the ranks is what is tested)
    )
    assert run.returncode != 0, run.stderr[-4000:]
    assert run.error.startswith(f"error: no space left on the disk of {tmp_path / 'out'} while writing step_4")
    assert 'full_finetune_distributed.py", line' not in run.stderr  # no traceback through the recipe
    assert sorted(p.name for p in run.output_dir.iterdir() if p.is_dir()) == ["step_2"]
    assert torch.load(run.output_dir / "step_2" / "recipe_state.pt", weights_only=True)["global_step"] == 2


def test_a_live_lock_stops_every_rank_with_one_line(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        out = tmp_path / "out"
        out.mkdir()
        (out / ".lock").write_text(json.dumps({"pid": holder.pid}))
        run = run_distributed(out, timeout=HANG_GUARD_S)
    finally:
        holder.kill()
        holder.wait()
    assert run.returncode != 0, run.stderr[-4000:]  # (torchrun's 1 for the ranks' 2: see the test above)
    assert f"in use by a live run (PID {holder.pid}" in run.error
    assert 'full_finetune_distributed.py", line' not in run.stderr
    assert json.loads((out / ".lock").read_text())["pid"] == holder.pid  # the other run's lock is left alone


def test_no_torchao_extensions_warning_in_a_two_rank_run(runs):
    """The ranks filter torchao's "Skipping import of cpp extensions" (finetune/reporting/console.py, KNOWN_NOISE), and
    the `tune` launcher, which imports torchtune before any recipe code runs, too (the import hook,
    finetune/tune_run.py)."""
    run = runs("torch.optim.AdamW")
    assert "Skipping import of cpp extensions" not in run.stdout + run.stderr


# The launcher that makes a stop signal save (recipes/launch.py): `tune run`'s arguments, SIGTERM and SIGUSR1 its own.
LAUNCH = [sys.executable, "-m", "recipes.launch"]


def processes_with(marker: str) -> list:
    """PIDs of the processes whose environment holds ``marker`` (what a launch left behind)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_to_the_launcher_saves_exits_0_and_leaves_nothing_running(tmp_path, faults, sig):
    """The signal goes to the launcher, as Slurm and Kubernetes send it, while the ranks train; each save takes 3 s
    longer than torchrun's shutdown timeout (set to 1 s here: plain torchrun SIGKILLs the ranks mid-save and exits 1,
    and dies of SIGUSR1 at once leaving the ranks training). The ranks save step_N whole, the launch exits 0, and no
    process of it is left. The acceptance run at full scale: RELIABILITY_STOP_SAVE_S=35 RELIABILITY_SHUTDOWN_TIMEOUT=
    (empty: torchrun's default 30 s) on this test."""
    save_s = os.environ.get("RELIABILITY_STOP_SAVE_S", "3")
    timeout = os.environ.get("RELIABILITY_SHUTDOWN_TIMEOUT", "1")
    marker = f"RELIABILITY_LAUNCH={uuid.uuid4().hex}"
    env = recipe_env(OMP_NUM_THREADS="1", RELIABILITY_LAUNCH=marker.split("=")[1], **faults)
    if timeout:
        env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = timeout
    else:
        env.pop("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", None)
    out = tmp_path / "out"
    args = [
        *LAUNCH,
        "--nproc_per_node",
        "2",
        RECIPE,
        "--config",
        TINY_CONFIG,
        f"data_dir={DATA_DIR}",
        f"output_dir={out}",
        *FAST,
        "metric_logger=null",
        "max_steps_per_epoch=200",
        "optimizer._component_=faults.SlowSaveAdamW",
        f"optimizer.save_s={save_s}",
    ]
    proc = subprocess.Popen(args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_GUARD_S
    while not read_metrics(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)  # (its exit after the signal is tested)
    left = processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, stderr[-4000:]
    assert not left, f"processes left behind: {left}"
    steps = [p.name for p in out.iterdir() if p.is_dir()]
    assert len(steps) == 1 and steps[0].startswith("step_"), steps
    n = int(steps[0][5:])
    assert {p.name for p in (out / steps[0]).iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.model",
        "recipe_state.pt",
        "recipe_state_rank0.pt",
        "recipe_state_rank1.pt",
        *(f"{name}.crc32" for name in ("recipe_state.pt", "recipe_state_rank0.pt", "recipe_state_rank1.pt")),
    }
    assert torch.load(out / steps[0] / "recipe_state.pt", weights_only=True)["global_step"] == n
    assert [m["step"] for m in read_metrics(out)] == list(range(1, n + 1))
    assert f"Run stopped by {sig.name}: trained steps 1-{n}" in stdout


def test_ctrl_c_during_a_background_write_ends_the_launch_with_130_and_publishes_nothing(tmp_path):
    """Ctrl-C in the terminal reaches the launcher and both ranks (the foreground process group) while step_2 is
    written in the background, slowly: each rank stops at once and abandons the write (no collective to finish it
    together), rank 0's closing lines come last, and the launch exits with the shell's 130. Before, torchrun's agent
    raised SignalException and `tune` printed its traceback after those lines, exit status 1."""
    marker = f"RELIABILITY_LAUNCH={uuid.uuid4().hex}"
    slow = support.slow_writer_path(tmp_path / "slow")
    env = recipe_env(OMP_NUM_THREADS="1", RELIABILITY_LAUNCH=marker.split("=")[1], PYTHONPATH=slow)
    out = tmp_path / "out"
    args = [*LAUNCH, "--nproc_per_node", "2", RECIPE, "--config", TINY_CONFIG, f"data_dir={DATA_DIR}"]
    args += [f"output_dir={out}", *FAST, "metric_logger=null", "max_steps_per_epoch=60", "save_every_n_steps=2"]
    args += ["optimizer._component_=slow_writer.SlowWriteAdamW", "optimizer.write_s=8"]
    proc = subprocess.Popen(
        args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # (its own process group, signalled as a terminal signals its foreground job)
    )  # fmt: skip
    deadline = time.monotonic() + HANG_GUARD_S
    while not list(out.glob(".tmp-step_2-*")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # (the write is under way, in its slow part)
    os.killpg(proc.pid, signal.SIGINT)
    # (stdout and stderr apart: torchrun's agent logs its shutdown to stderr as it pleases, even after rank 0's
    # closing lines on stdout)
    stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)  # (its exit after the signal is tested)
    output = stdout + stderr
    left = processes_with(marker)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-4000:]
    assert not left, f"processes left behind: {left}"
    assert "Traceback" not in output and "terminate called" not in output, output[-4000:]
    assert stdout.strip().splitlines()[-1].startswith("Run stopped by Ctrl-C: trained steps 1-"), output[-4000:]
    assert not (out / "step_2").exists() and not (out / ".lock").exists()
