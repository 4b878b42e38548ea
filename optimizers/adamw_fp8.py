"""FP8 AdamW: both moments as float8 e4m3 (fn) with an fp32 scale per block of 256.

Bytes per parameter: 2 x (1 + 4/256) = 2.03, like 8-bit, but the code is a float: 3 mantissa bits at every
magnitude instead of the dynamic map's finer top decade. Each block is scaled so its max maps to 448, e4m3's
largest finite value. First moments under about 2^-9/448 of the block max round to zero; second moments are floored
at e4m3's smallest subnormal instead (a zero v under a non-zero m would blow the update up).
"""

import torch

from . import _dynamic_map as dm
from ._triton import jit, tl
from ._update import LowBitAdamW, StateFormat

BLOCK = 256
FP8_MAX = 448.0
_FP8_MAX = tl.constexpr(FP8_MAX) if tl is not None else None  # Triton reads only constexpr globals


# Smallest positive e4m3 value (a subnormal). Second moments are floored to it, never flushed to zero: with m
# non-zero, v = 0 would make the update lr * m / eps (see _dynamic_map.encode).
FP8_MIN = 2.0 ** -9
_FP8_MIN = tl.constexpr(FP8_MIN) if tl is not None else None


def quantize(x: torch.Tensor, signed: bool):
    absmax, inv = dm.inv_absmax(x)
    q = torch.clamp((x * inv[:, None]) * FP8_MAX, -FP8_MAX, FP8_MAX)
    if not signed:
        q = torch.where(q > 0, torch.clamp(q, min=FP8_MIN), q)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float() * (scale * (1.0 / FP8_MAX))[:, None]


@jit
def _load(codes, scale, qmap, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, SIGNED: tl.constexpr):
    s = (tl.load(scale + blk, mask=bmask, other=0.0) * (1.0 / _FP8_MAX))[:, None]
    c_lo = tl.load(codes + off_lo, mask=bmask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    c_hi = tl.load(codes + off_hi, mask=bmask[:, None], other=0).to(tl.float8e4nv, bitcast=True)
    return c_lo.to(tl.float32) * s, c_hi.to(tl.float32) * s


@jit
def _encode(x, inv, SIGNED: tl.constexpr):
    q = tl.minimum(tl.maximum((x * inv) * _FP8_MAX, -_FP8_MAX), _FP8_MAX)
    if not SIGNED:
        q = tl.where(q > 0, tl.maximum(q, _FP8_MIN), q)
    return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@jit
def _store(codes, scale, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, lo, hi, SIGNED: tl.constexpr):
    absmax, inv = dm.inv_absmax_tl(lo, hi)
    tl.store(scale + blk, absmax, mask=bmask)
    tl.store(codes + off_lo, _encode(lo, inv[:, None], SIGNED), mask=bmask[:, None])
    tl.store(codes + off_hi, _encode(hi, inv[:, None], SIGNED), mask=bmask[:, None])


FORMAT = StateFormat(
    name="fp8", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=1, scaled=True,
    quantize=quantize, dequantize=dequantize, triton_load=_load, triton_store=_store,
    bytes_per_element=1.0 + 4 / BLOCK, tile_blocks=8,
)


class AdamWFp8(LowBitAdamW):
    """AdamW with float8 e4m3 blockwise (block 256) states: about 2 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus the keyword-only
    extras of ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).
    """

    FORMAT = FORMAT
