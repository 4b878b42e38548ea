"""optimizers/portable.py: one parameter's state taken apart into shards and joined again, on the whole tensor's
blocks, and decoded to fp32 moments and encoded into another format.

Shards here are cut by hand (the gloo test with real DTensors is tests/finetune/checkpoint/test_optimizer_state.py).
"""

import pytest
import torch

import optimizers
from optimizers import portable

NUMEL = 1000  # 4 blocks of 256 (the last one partial), 8 of 128
SCALED = [v for v in optimizers.VARIANTS.values() if v.cls.FORMAT.scaled]


def stepped_state(cls, numel: int = NUMEL, steps: int = 3):
    """A one-device optimizer of ``cls`` after a few steps on one fp32 parameter: (its state entry, format)."""
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(numel, generator=g))
    opt = cls([p], lr=0.01, **({} if cls is optimizers.AdamW else {"min_quant_numel": 1}))
    for _ in range(steps):
        p.grad = torch.randn(numel, generator=g)
        opt.step()
    return {k: v.clone() for k, v in opt.state[p].items()}, opt.param_format(p)


def cut(full: dict, fmt, cuts: list) -> list:
    return [(a, b - a, portable.shard(full, fmt, NUMEL, a, b - a)) for a, b in zip(cuts, cuts[1:])]


def block_error(a: torch.Tensor, b: torch.Tensor, block: int) -> float:
    """max |a - b| over each block's max |a|, the largest over the blocks."""
    n = -(-a.numel() // block) * block
    pad = lambda x: torch.nn.functional.pad(x, (0, n - x.numel())).view(-1, block)  # noqa: E731
    diff, top = (pad(a) - pad(b)).abs().amax(1), pad(a).abs().amax(1)
    return float((diff / top.clamp_min(1e-30)).max())


@pytest.mark.parametrize("variant", SCALED, ids=lambda v: v.key)
@pytest.mark.parametrize("cuts", [[0, 512, NUMEL], [0, 0, NUMEL, NUMEL], [0, 256, 768, NUMEL]])
def test_shards_cut_on_block_boundaries_join_bit_for_bit(variant, cuts):
    full, fmt = stepped_state(variant.cls)
    back = portable.gather(cut(full, fmt, cuts), fmt, NUMEL)
    for key in ("exp_avg", "exp_avg_sq", "exp_avg_scale", "exp_avg_sq_scale"):
        assert torch.equal(back[key], full[key]), key


@pytest.mark.parametrize("variant", SCALED, ids=lambda v: v.key)
def test_a_shard_shorter_than_a_block_stays_in_the_format_within_its_rounding(variant):
    """Shards of 100 and 40 elements (under one block) and one that starts inside a block: each is still codes and block scales
    (no fp32 fallback), decodes to the whole tensor's moments within one rounding of the format, and joins back
    into the whole tensor's blocks, where only the blocks that straddle a split were rounded again."""
    full, fmt = stepped_state(variant.cls)
    B = fmt.block_size
    cuts = [0, 100, 140, 512, NUMEL]
    pieces = cut(full, fmt, cuts)
    whole = portable.moments(full, fmt, NUMEL)
    # 4-bit: its 8 first-moment levels and 1-mantissa-bit root are one coarse rounding (up to half a level gap)
    bound = {"ours8": 0.07, "oursfp8": 0.07, "ours4": 0.6}[variant.key]
    for off, n, entry in pieces:
        assert entry["exp_avg"].dtype == fmt.code_dtype and entry["exp_avg_scale"].numel() == -(-n // B)
        mine = portable.moments(entry, fmt, n)
        for key in ("exp_avg", "exp_avg_sq"):
            assert block_error(whole[key][off : off + n], mine[key], B) <= bound, (off, key)
    back = portable.gather(pieces, fmt, NUMEL)
    assert back["exp_avg"].shape == full["exp_avg"].shape and back["exp_avg_scale"].shape == full["exp_avg_scale"].shape
    joined = portable.moments(back, fmt, NUMEL)
    for key in ("exp_avg", "exp_avg_sq"):
        assert block_error(whole[key], joined[key], B) <= 2 * bound, key
    # the blocks of the shard that starts on a block boundary (512) are the very codes and scales
    untouched = [512 // B + k for k in range(-(-(NUMEL - 512) // B))]
    for k in untouched:
        assert torch.equal(back["exp_avg_scale"][k], full["exp_avg_scale"][k])
        assert torch.equal(back["exp_avg"][k], full["exp_avg"][k])


def test_unscaled_states_are_cut_anywhere_exactly():
    full, fmt = stepped_state(optimizers.AdamW)
    back = portable.gather(cut(full, fmt, [0, 37, 300, NUMEL]), fmt, NUMEL)
    assert torch.equal(back["exp_avg"], full["exp_avg"]) and torch.equal(back["exp_avg_sq"], full["exp_avg_sq"])


def test_moments_encoded_into_another_format_are_that_formats_rounding_of_them():
    """8-bit moments decoded and encoded as 4-bit: the same as the 4-bit format quantizing those fp32 values, so
    the error is one 4-bit rounding (round-to-nearest) and nothing more."""
    full, fmt8 = stepped_state(optimizers.AdamW8bit)
    fmt4 = optimizers.AdamW4bit.FORMAT
    values = portable.moments(full, fmt8, NUMEL)
    entry = portable.encode(values, fmt4, full["step"])
    assert entry["exp_avg"].shape == (8, 64) and entry["exp_avg_scale"].shape == (8,)
    padded = torch.nn.functional.pad(values["exp_avg"], (0, 24)).view(8, 128)
    codes, scale = fmt4.quantize(padded, True)
    assert torch.equal(entry["exp_avg"], codes) and torch.equal(entry["exp_avg_scale"], scale)
    assert float(entry["step"]) == 3.0


@pytest.mark.parametrize("variant", list(optimizers.VARIANTS.values()), ids=lambda v: v.key)
def test_a_saved_entry_names_its_format(variant):
    """What a checkpoint's entry and its param group say is the format the optimizer kept it in: the group's for a
    scaled one, fp32 for a tensor too small to quantize, bf16 or fp32 for optimizers.AdamW's plain moments."""
    g = torch.Generator().manual_seed(0)
    big, tiny = (torch.nn.Parameter(torch.randn(n, generator=g)) for n in (NUMEL, 8))
    opt = variant.cls([big, tiny], lr=0.01, **({} if variant.cls is optimizers.AdamW else {"min_quant_numel": 64}))
    big.grad, tiny.grad = torch.randn(NUMEL, generator=g), torch.randn(8, generator=g)
    opt.step()
    sd = opt.state_dict()
    group = sd["param_groups"][0]
    for i, p in enumerate((big, tiny)):
        assert portable.saved_format(sd["state"][i], group) is opt.param_format(p)


@pytest.mark.parametrize("variant", list(optimizers.VARIANTS.values()), ids=lambda v: v.key)
def test_entry_problem_names_what_no_saved_entry_of_the_format_can_hold(variant):
    full, fmt = stepped_state(variant.cls)
    group = {"state_format": variant.cls.FORMAT.name}
    assert portable.entry_problem(full, group, NUMEL) is None
    blocks = -(-NUMEL // fmt.block_size)
    short = dict(full, exp_avg=full["exp_avg"][:-1])
    assert portable.entry_problem(short, group, NUMEL).startswith(f"exp_avg is ({blocks - 1}, ")
    assert portable.entry_problem(full, group, NUMEL + fmt.block_size).startswith("exp_avg is ")  # (another tensor's)
    if fmt.scaled:
        scale = full["exp_avg_sq_scale"].clone()
        scale[1] = -scale[1] - 1
        assert portable.entry_problem(dict(full, exp_avg_sq_scale=scale), group, NUMEL).startswith(
            "exp_avg_sq_scale[1] is -"
        )
        assert "is not a state format" in portable.entry_problem(full, {"state_format": "9bit"}, NUMEL)
