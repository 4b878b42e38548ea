"""FP8 AdamW: both moments as float8 e4m3 (fn) with an fp32 scale per block of 256.

Bytes per parameter: 2 x (1 + 4/256) = 2.03, like 8-bit, but the code is a float: 3 mantissa bits at every
magnitude instead of the dynamic map's finer top level. Each block is scaled so its max maps to 448, e4m3's
largest finite value. First moments under about 2^-9/448 of the block max round to zero; second moments are floored
at e4m3's smallest subnormal instead (a zero v under a non-zero m would blow the update up).
"""

import torch

from . import _dynamic_map as dm
from ._triton import jit, tl
from ._update import LowBitAdamW, StateFormat, ld, ldb, st_scale, stb

BLOCK = 256
_BLOCK = tl.constexpr(BLOCK) if tl is not None else None  # Triton reads only constexpr globals
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
def _load(codes, scale, lo, hi, rows, bmask):
    return ldb(codes + lo, bmask, 0), ldb(codes + hi, bmask, 0), ld(scale + rows, bmask, 0.0)


@jit
def _decode(c_lo, c_hi, s, SIGNED: tl.constexpr):
    s = (s * (1.0 / _FP8_MAX))[:, None]
    return (c_lo.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s,
            c_hi.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s)


@jit
def _encode(x, inv, SIGNED: tl.constexpr):
    q = tl.minimum(tl.maximum((x * inv) * _FP8_MAX, -_FP8_MAX), _FP8_MAX)
    if not SIGNED:
        q = tl.where(q > 0, tl.maximum(q, _FP8_MIN), q)
    return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, SIGNED: tl.constexpr):
    absmax, inv = dm.inv_absmax_tl(val_lo, val_hi)
    st_scale(scale, lo, absmax, bmask, _BLOCK)
    stb(codes + lo, _encode(val_lo, inv[:, None], SIGNED), bmask)
    stb(codes + hi, _encode(val_hi, inv[:, None], SIGNED), bmask)


FORMAT = StateFormat(
    name="fp8", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=1, scaled=True,
    quantize=quantize, dequantize=dequantize, triton_load=_load, triton_decode=_decode, triton_store=_store,
    bytes_per_element=1.0 + 4 / BLOCK, tile_blocks=1, num_warps=1, programs_per_sm=16,
)


class AdamWFp8(LowBitAdamW):
    """AdamW with float8 e4m3 blockwise (block 256) states: about 2 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus the keyword-only
    extras of ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).
    """

    FORMAT = FORMAT
