"""Packing (``dataset.packed=True``), the activation-memory keys and compile with packing.

Unit tests of finetune/data/packing.py run in-process on real Alpaca records; the recipe tests run the recipe on the
FAST tiny model (tests/conftest.py) over the first 400 records at a pack length of 256 tokens (about two samples a
row), with the pack cache in the test's own folder. They call it in this process (conftest.run_here: torch's AdamW
trains the same here as in a subprocess, without a subprocess's seconds of imports), but for the run killed after a
save, the compiled run (torch.compile stays out of the test process) and the two ranks.
"""

import math
from pathlib import Path

import pytest
import torch

from conftest import (
    DATA_DIR,
    REPO_ROOT,
    kill_once_saved,
    pinned_inductor_cache,
    recipe_env,
    run_distributed,
    run_here,
    run_recipe,
)
from finetune.data import packing as _packing

RTOL = 1e-4
SPLIT = "dataset.split=train[:400]"
PACKED = ["dataset.packed=True", "tokenizer.max_seq_len=256", SPLIT]

# Recorded from the FAST config with PACKED (torch AdamW, 6 steps of 2 rows each) on the 2-core CPU machine.
PACKED_LOSSES = [
    10.509599685668945,
    10.110212326049805,
    9.514917373657227,
    9.290122032165527,
    8.605596542358398,
    8.304932594299316,
]
PACKED_TOKENS = [505, 492, 507, 491, 507, 408]


def _samples(n=400, max_seq_len=256):
    from torchtune.datasets import alpaca_dataset
    from torchtune.models.llama2 import llama2_tokenizer

    tok = llama2_tokenizer(
        str(DATA_DIR / "llama2_tokenizer" / "tokenizer.model"), max_seq_len=max_seq_len, prompt_template=None
    )
    ds = alpaca_dataset(
        tok,
        source="json",
        data_files=str(DATA_DIR / "alpaca" / "alpaca_data.json"),
        split=f"train[:{n}]",
        train_on_input=True,
    )
    return ds, tok


def test_best_fit_decreasing_places_every_sample_once_within_capacity():
    lengths = [7, 3, 9, 1, 4, 4, 10, 2, 6, 5, 8, 0]
    rows = _packing.best_fit_decreasing(lengths, capacity=10)
    placed = sorted(i for row in rows for i in row)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]  # each non-empty sample exactly once
    assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
    # 59 tokens in rows of 10: best-fit-decreasing needs the minimum, 6 rows (greedy in order would take 8).
    assert len(rows) == 6
    with pytest.raises(ValueError, match="more than the pack length"):
        _packing.best_fit_decreasing([11], capacity=10)


def test_packed_rows_train_on_exactly_the_unpacked_tokens(tmp_path):
    ds, tok = _samples()
    samples = _packing.TokenizedSamples.from_dataset(ds)
    packed = _packing.PackedSFTDataset(samples, max_seq_len=256, padding_idx=tok.pad_id)
    assert packed.fill() > 0.95  # best-fit: Alpaca's first 400 records fill 96 % of the slots

    # What unpacked training predicts: from each sample's prefix, its next label (position t -> label t+1).
    unpacked, n_unpacked = [], 0
    for i in range(len(ds)):
        labels = ds[i]["labels"]
        n_unpacked += _packing.count_trained_tokens(torch.tensor([labels]))
        unpacked += [(i, t, labels[t + 1]) for t in range(len(labels) - 1) if labels[t + 1] != -100]
    # What a packed row predicts, mapped back to (sample, position in sample, label).
    got, n_packed = [], 0
    for r in range(len(packed)):
        item = packed[r]
        n_packed += _packing.count_trained_tokens(item["labels"][None])
        owner = [i for i, n in zip(packed.rows[r], item["seq_lens"].tolist()) for _ in range(n)]
        pos, labels = item["input_pos"].tolist(), item["labels"].tolist()
        got += [(owner[t], pos[t], labels[t + 1]) for t in range(len(labels) - 1) if labels[t + 1] != -100]
        # Every sample starts at position 0 and the padding (the last segment) is never trained on.
        assert sum(item["seq_lens"].tolist()) == 256
    assert n_packed == n_unpacked == len(unpacked)
    assert sorted(got) == sorted(unpacked)


def test_cache_round_trip_and_a_corrupt_cache_is_rebuilt(tmp_path):
    ds, _ = _samples(n=50)
    samples = _packing.TokenizedSamples.from_dataset(ds)
    path = tmp_path / "samples.npz"
    samples.save(path)
    again = _packing.TokenizedSamples.load(path)
    assert again is not None and (again.tokens == samples.tokens).all() and (again.offsets == samples.offsets).all()
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert _packing.TokenizedSamples.load(path) is None
    assert not list(tmp_path.glob(".tmp-*"))


def test_packed_run_losses_and_tokens(tmp_path):
    run = run_here(tmp_path / "a", *PACKED, f"pack_cache_dir={tmp_path / 'cache'}")
    assert run.ok, run.stderr[-3000:]
    assert run.losses == pytest.approx(PACKED_LOSSES, rel=RTOL)
    assert [m["tokens"] for m in run.metrics] == PACKED_TOKENS
    assert "Packed 400 samples into 192 rows of 256 tokens" in run.stdout + run.stderr
    assert len(list((tmp_path / "cache").glob("samples-*.npz"))) == 1


def test_packed_and_unpacked_epochs_train_on_the_same_number_of_tokens(tmp_path):
    """A whole epoch over 16 records: unpacked in batches of 2 (none dropped), packed one row a step."""
    split = "dataset.split=train[:16]"
    unpacked = run_here(tmp_path / "u", split, "tokenizer.max_seq_len=256", "max_steps_per_epoch=null")
    packed = run_here(
        tmp_path / "p",
        split,
        "dataset.packed=True",
        "tokenizer.max_seq_len=256",
        "batch_size=1",
        "max_steps_per_epoch=null",
        f"pack_cache_dir={tmp_path / 'c'}",
    )
    assert unpacked.ok and packed.ok, (unpacked.stderr + packed.stderr)[-3000:]
    assert len(unpacked.metrics) == 8 and len(packed.metrics) < 16  # rows hold several samples
    assert sum(m["tokens"] for m in packed.metrics) == sum(m["tokens"] for m in unpacked.metrics)


def test_packed_resume_after_kill_continues_with_same_losses(tmp_path):
    out, common = tmp_path / "out", [*PACKED, f"pack_cache_dir={tmp_path / 'c'}", "save_every_n_steps=2"]
    kill_once_saved(out, "step_4", *common)
    resumed = run_here(out, *common, f"resume_from_checkpoint={out / 'step_4'}")
    assert resumed.ok, resumed.stderr[-3000:]
    assert "cache in" in resumed.stdout + resumed.stderr  # the killed run's tokenized samples were reused
    tail = resumed.metrics[-2:]
    assert [m["step"] for m in tail] == [5, 6]
    assert [m["loss"] for m in tail] == pytest.approx(PACKED_LOSSES[4:], rel=RTOL)


def test_packed_compile_with_selective_checkpointing_does_not_recompile(tmp_path):
    """compile + packing + AC on every other layer: torch.compile's graph count is flat after the first step. The
    run is pinned to AVX2 (conftest.recipe_env), so its compiled code goes to a TorchInductor cache of its own, beside
    the unpinned one (here a fresh pair of folders, so that what is there was compiled by this run)."""
    unpinned = tmp_path / "inductor"  # (recipe_env names the pinned cache after the unpinned one: test_interrupt.py)
    env = recipe_env(TORCHINDUCTOR_CACHE_DIR=pinned_inductor_cache("avx2", str(unpinned)))
    run = run_recipe(
        tmp_path / "out",
        *PACKED,
        f"pack_cache_dir={tmp_path / 'c'}",
        "compile=True",
        "model.num_layers=2",
        "enable_activation_checkpointing=True",
        "ac_mode=selective",
        "ac_option=2",
        "max_steps_per_epoch=4",
        env=env,
    )
    assert run.ok, run.stderr[-3000:]
    assert all(math.isfinite(x) for x in run.losses) and run.losses[-1] < run.losses[0]
    graphs = [m["compiled_graphs"] for m in run.metrics]
    assert graphs[0] > 0 and len(set(graphs[1:])) == 1, graphs
    assert "first_step_s" in run.metrics[0]
    pinned = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    assert pinned == Path(pinned_inductor_cache("avx2", str(unpinned)))
    assert any(f.is_file() for f in pinned.rglob("*")) and not unpinned.exists()


def test_in_backward_warmup_matches_the_one_optimizer_run(tmp_path):
    """With a warmup, every per-parameter optimizer takes the scheduler's first lr (0), as one optimizer does."""
    common = ["clip_grad_norm=null", "lr_scheduler.num_warmup_steps=2", "max_steps_per_epoch=3"]
    plain = run_here(tmp_path / "plain", *common)
    in_bwd = run_here(tmp_path / "bwd", *common, "optimizer_in_bwd=True")
    assert plain.ok and in_bwd.ok, (plain.stderr + in_bwd.stderr)[-3000:]
    assert in_bwd.losses == pytest.approx(plain.losses, rel=RTOL)
    assert [m["lr"] for m in in_bwd.metrics] == pytest.approx([m["lr"] for m in plain.metrics])


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"ac_mode": "partial", "enable_activation_checkpointing": True}, "ac_mode"),
        ({"ac_mode": "selective", "ac_option": 0, "enable_activation_checkpointing": True}, "ac_option"),
        ({"enable_activation_offloading": True}, "enable_activation_offloading"),
        ({"device_memory_limit_gib": 24}, "device_memory_limit_gib"),
        ({"device_memory_limit_gib": -1}, "device_memory_limit_gib"),
        ({"dataset": {"packed": "maybe"}}, "dataset.packed"),
        (
            {"dataset": {"packed": True, "split": "train[:20]"}, "tokenizer": {"max_seq_len": None}},
            "tokenizer.max_seq_len",
        ),
    ],
)
def test_bad_memory_and_packing_keys_name_the_key(tmp_path, overrides, key):
    """Checked on the recipe's own classes; the test below shows the recipe's one-line exit 2."""
    from omegaconf import OmegaConf

    from finetune.base import BadInput
    from recipes.full_finetune_single_device import FullFinetuneRecipeSingleDevice

    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs" / "tiny.yaml"),
        {"data_dir": str(DATA_DIR), "output_dir": str(tmp_path / "out"), "metric_logger": None},
        overrides,
    )
    with pytest.raises(BadInput, match=key.replace(".", r"\.")):
        FullFinetuneRecipeSingleDevice(cfg).setup(cfg)


def test_bad_ac_mode_is_a_one_line_error_with_exit_2(tmp_path):
    # (The exit status as a shell sees it, through `tune run`: tests/recipes/test_bad_input.py's -via-tune-run cases.)
    run = run_here(tmp_path / "out", "ac_mode=partial", "enable_activation_checkpointing=True")
    assert run.returncode == 2, run.stderr[-2000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "ac_mode" in errors[0] and "Traceback" not in run.stderr


def test_two_ranks_pack_and_match_one_device(tmp_path):
    """The FSDP2 recipe packs the same rows on every rank: 2 ranks x 1 row give one device's 2-row losses."""
    run = run_distributed(tmp_path / "out", *PACKED, f"pack_cache_dir={tmp_path / 'c'}", "batch_size=1")
    assert run.ok, run.stderr[-3000:]
    assert [m["tokens"] for m in run.metrics] == PACKED_TOKENS
    assert run.losses == pytest.approx(PACKED_LOSSES, rel=1e-4)
