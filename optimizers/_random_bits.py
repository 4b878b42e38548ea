"""The kernel's two sources of random bits, each with its plain-PyTorch twin, so that both paths round alike.

- ``_sr_bits`` / ``stochastic_round_bf16``: stochastic rounding of bf16 weights. A counter hash of (step seed, the
  element's place in its bucket): a Weyl step, one xorshift and one multiply give the 16 high bits, 7 integer
  instructions per element where Philox (tl.randint) needs ~40. Quality needed here is only that the bits be uniform
  and unrelated to the weights' low bits (unbiased rounding); two elements share their bits only if their places
  differ by a multiple of 2^32 or steps pair up with far places.
- ``_m_dither`` / ``m_dither``: the first moment's dither, for formats that round it stochastically (``adamw4bit.py``).
  23 bits per element from a Weyl sequence over (the element's index in its tensor, step seed), 2 instructions per
  element (an add to a per-thread constant, then the shift, which ptxas folds into the format's add). Stochastic
  rounding needs each element's bits to be uniform over the steps and unrelated to the value being rounded; a Weyl
  sequence gives that (the seed's multiplier is odd, so one element's bits step through all 2^32 values), and
  neighbouring elements' bits differ by the golden ratio's fraction, which spreads a block's rounding errors evenly.
  The seed's multiplier differs from ``_sr_bits``' so that the moment's and the weight's rounding do not draw related
  bits. The index is the tensor's, not the bucket's, so that grouping (optimizer-in-backward's one optimizer per
  parameter) rounds alike.

The constants are repeated as literals in ``_sr_bits``, ``_m_dither`` and the PyTorch twins.
"""

import torch

from ._triton import jit, tl


@jit
def _sr_bits(place, seed):
    x = place.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32) * 0x85EBCA77
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    return x >> 16


_M_DITHER_SEED = 0xC2B2AE3D
_M_DITHER_SEED_TL = tl.constexpr(_M_DITHER_SEED)


@jit
def _m_dither(t_base, off, seed):
    k = t_base.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32) * _M_DITHER_SEED_TL
    return (k + off.to(tl.uint32) * 0x9E3779B1) >> 9


_M32 = 0xFFFFFFFF
_STEPS: dict = {}  # device -> i * 0x9E3779B1 mod 2^32 for i < its length (int64), grown on demand


def _steps(n: int, device) -> torch.Tensor:
    device = torch.device(device or "cpu")
    t = _STEPS.get(device)
    if t is None or t.numel() < n:
        t = _STEPS[device] = (torch.arange(max(n, 1 << 15), dtype=torch.int64, device=device) * 0x9E3779B1) & _M32
    return t[:n]


def _weyl_sum(place: int, n: int, seed: int, seed_mult: int, device=None) -> torch.Tensor:
    """(place + i) * 0x9E3779B1 + seed * seed_mult for i < n, as int64 in [0, 2^33): the Weyl step both random-bit
    sources start from, its low 32 bits the kernel's 32-bit value. The per-element part comes from a table made
    once (the plain path asks for the same chunk lengths every step), the rest is one constant added."""
    c = ((place & _M32) * 0x9E3779B1 + (seed & _M32) * seed_mult) & _M32
    return _steps(n, device) + c


def _weyl(place: int, n: int, seed: int, seed_mult: int, device=None) -> torch.Tensor:
    """The Weyl step as the kernel's 32-bit arithmetic leaves it: int64 values in [0, 2^32)."""
    return _weyl_sum(place, n, seed, seed_mult, device) & _M32


def m_dither(place: int, n: int, seed: int, device=None) -> torch.Tensor:
    """The kernel's first-moment dither (``_m_dither``) for a tensor's elements place .. place + n - 1: int32 in
    [0, 2^23)."""
    return ((_weyl_sum(place, n, seed, _M_DITHER_SEED, device) >> 9) & 0x7FFFFF).to(torch.int32)


def stochastic_round_bf16(x: torch.Tensor, seed: int, place: int = 0) -> torch.Tensor:
    """Round fp32 to bf16 up or down with probability proportional to the distance (unbiased). The random bits are
    the kernel's (``_sr_bits``): element i uses the hash of (seed, place + i), ``place`` being the first element's
    offset in its state bucket, so both paths give the same bits."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    h = _weyl(place, x.numel(), seed, 0x85EBCA77, x.device).view(x.shape)
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    out = (bits + (h >> 16)) & -65536  # the carry into the sign bit cannot happen: |x| < max float
    return out.to(torch.int32).view(torch.float32).to(torch.bfloat16)
