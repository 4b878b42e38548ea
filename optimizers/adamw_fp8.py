"""FP8 AdamW: both moments as float8 e4m3 (fn) with an fp32 scale per block of 256.

Bytes per parameter: 2 x (1 + 4/256) = 2.03, like 8-bit. Each block is scaled so its max maps to 448, e4m3's
largest finite value: 3 mantissa bits at every magnitude, down to 2^-6 of 448 (then subnormals to 2^-9). Second
moments are floored at e4m3's smallest subnormal instead of rounding to zero (a zero v under a non-zero m would blow
the update up); a block of zeros still decodes to zeros, its scale being 0. The e4m3 coding itself is in
``_codes.py`` (``AdamW8bit``'s first moment uses it too).
"""

import torch

from ._codes import (
    _FP8_MAX,
    FP8_MAX,
    decode_e4m3,
    decode_e4m3_words,
    e4m3_tl,
    encode_e4m3,
    encode_e4m3_tl,
    inv_absmax,
    inv_absmax_tl,
    load_words,
)
from ._format import StateFormat, st_scale, stb
from ._optimizer import LowBitAdamW
from ._triton import jit, tl

BLOCK = 256
_BLOCK = tl.constexpr(BLOCK)  # Triton reads only constexpr globals
# Smallest positive e4m3 value (a subnormal): the floor of second moments (see above).
FP8_MIN = 2.0**-9
_FP8_MIN = tl.constexpr(FP8_MIN)


def quantize(x: torch.Tensor, signed: bool):
    absmax, inv = inv_absmax(x)
    if signed:
        return encode_e4m3(x, inv[:, None]), absmax
    # v >= 0: the floor is one max, against a per-block floor that is 0 where the block is stored as zeros
    floor = torch.where(inv > 0, FP8_MIN, 0.0)
    q = torch.maximum(x * (inv * FP8_MAX)[:, None], floor[:, None])
    return q.to(torch.float8_e4m3fn).view(torch.uint8), absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    return decode_e4m3(codes, scale)


@jit
def _decode(c_lo, c_hi, s, lut, SIGNED: tl.constexpr):
    return decode_e4m3_words(c_lo, s), decode_e4m3_words(c_hi, s)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED: tl.constexpr):
    absmax, inv = inv_absmax_tl(val_lo, val_hi)
    st_scale(scale, lo, absmax, bmask, _BLOCK)
    if SIGNED:
        stb(codes + lo, encode_e4m3_tl(val_lo, inv[:, None]), bmask)
        stb(codes + hi, encode_e4m3_tl(val_hi, inv[:, None]), bmask)
    else:
        k = (inv * _FP8_MAX)[:, None]
        floor = tl.where(inv > 0, _FP8_MIN, 0.0)[:, None]
        stb(codes + lo, e4m3_tl(tl.maximum(val_lo * k, floor)), bmask)
        stb(codes + hi, e4m3_tl(tl.maximum(val_hi * k, floor)), bmask)


FORMAT = StateFormat(
    name="fp8",
    block_size=BLOCK,
    code_dtype=torch.uint8,
    elems_per_code=1,
    scaled=True,
    quantize=quantize,
    dequantize=dequantize,
    triton_load=load_words,
    triton_decode=_decode,
    triton_store=_store,
    bytes_per_element=1.0 + 4 / BLOCK,
    tile_blocks=1,
    num_warps=1,
    programs_per_sm=16,
)


class AdamWFp8(LowBitAdamW):
    """AdamW with float8 e4m3 blockwise (block 256) states: about 2 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus the keyword-only
    extras of ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).
    bf16 weights are rounded stochastically by default (see ``optimizers.AdamW8bit``). docs/optimizers/adamw_fp8.md.
    """

    FORMAT = FORMAT
