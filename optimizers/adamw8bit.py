"""8-bit AdamW: both moments as 8-bit float codes, block 256, fp32 scale per block.

Bytes per parameter: 2 codes + 2 x 4/256 scale = 2.03 (torch AdamW with fp32 states: 8; bf16 states: 4).

- First moment: e4m3 of m / absmax * 448 (sign, 4 exponent and 3 mantissa bits; ``_codes.py``).
- Second moment: its square root u = sqrt(v), which is what the update divides by, as an unsigned 8-bit float
  with 4 exponent and 4 mantissa bits: code 16e + f is 2^(e-15) (1 + f/16) of umax / 1.9375, so the largest code is
  the block's max and the smallest is 1.6e-5 of it (v: 2.5e-10 of the block's max v). Nothing positive rounds to zero:
  u below the smallest code takes it (a zero v under a non-zero m would blow the update up).

Why float codes and not bitsandbytes' dynamic map (sign, a unary-coded decade, a linear fraction): the dynamic map
spends ~25 instructions per value to encode and ~12 to decode, and with both moments that made an 8-bit step
issue-bound at 2.3x the 16-bit one on the H200. A float code is read off the fp32 exponent and mantissa bits: e4m3
is one hardware conversion per two values, the u code an add and a shift. Accuracy: m gets 3 mantissa bits at every
magnitude, u 4 (<= 1/32 on the step's denominator) over 16 octaves. docs/optimizers/adamw8bit.md has the measurements.
"""

import torch

from ._codes import (
    decode_e4m3,
    decode_e4m3_words,
    encode_e4m3,
    encode_e4m3_tl,
    interleave4,
    inv_absmax,
    inv_absmax_tl,
    load_words,
)
from ._format import StateFormat, st_scale, stb
from ._optimizer import LowBitAdamW
from ._triton import jit, tl

BLOCK = 256
_BLOCK = tl.constexpr(BLOCK)  # Triton reads only constexpr globals
U_TOP = 31.0 / 16.0  # value of the largest code (e = 15, f = 15) in units of the smallest exponent's 2^0
U_FLOOR_BITS = (127 - 15) << 23  # fp32 bits of 2^-15, code 0
_U_TOP = tl.constexpr(U_TOP)
_U_DEC = tl.constexpr(1.0 / U_TOP)
_U_FLOOR_BITS = tl.constexpr(U_FLOOR_BITS)


def encode_root(u: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """u = sqrt(v) >= 0 [nblk, k], inv = 1/umax [nblk, 1] -> int32 codes 0..255, nearest value (ties up): adding
    half a code's step to the fp32 bits and shifting out the low 19 is rounding to 4 mantissa bits, carries into the
    exponent included. Below the smallest code: code 0 (clamped as an integer: one fused add-and-max on the GPU)."""
    return torch.clamp((u * (inv * U_TOP)).view(torch.int32) - (U_FLOOR_BITS - (1 << 18)), min=0) >> 19


def decode_root(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    z = ((codes.to(torch.int32) << 19) + U_FLOOR_BITS).view(torch.float32)
    return z * (scale * (1.0 / U_TOP))[:, None]


def quantize(x: torch.Tensor, signed: bool):
    if signed:
        absmax, inv = inv_absmax(x)
        return encode_e4m3(x, inv[:, None]), absmax
    u = x.sqrt()
    umax, inv = inv_absmax(u)
    return encode_root(u, inv[:, None]).to(torch.uint8), umax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    if signed:
        return decode_e4m3(codes, scale)
    u = decode_root(codes, scale)
    return u * u


@jit
def _decode_root_tl(w, s):
    """int32 words of 4 root codes [NB, K] and block scales [NB] -> v = u * u [NB, 4K]. Code c becomes the fp32
    bits (c << 19) + bits(2^-15): for byte j of the word, a shift and one and-or (the two fields do not overlap)."""
    z0 = ((w << 19) & (0xFF << 19)) | _U_FLOOR_BITS
    z1 = ((w << 11) & (0xFF << 19)) | _U_FLOOR_BITS
    z2 = ((w << 3) & (0xFF << 19)) | _U_FLOOR_BITS
    z3 = ((w >> 5) & (0xFF << 19)) | _U_FLOOR_BITS
    z = interleave4(z0, z1, z2, z3).to(tl.float32, bitcast=True)
    u = z * (s * _U_DEC)[:, None]
    return u * u


@jit
def _encode_root_tl(u, inv):
    t = (u * (inv * _U_TOP)).to(tl.int32, bitcast=True) - (_U_FLOOR_BITS - (1 << 18))
    return (tl.maximum(t, 0) >> 19).to(tl.uint8)


@jit
def _decode(c_lo, c_hi, s, lut, SIGNED: tl.constexpr):
    if SIGNED:
        return decode_e4m3_words(c_lo, s), decode_e4m3_words(c_hi, s)
    else:
        return _decode_root_tl(c_lo, s), _decode_root_tl(c_hi, s)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED: tl.constexpr):
    if SIGNED:
        absmax, inv = inv_absmax_tl(val_lo, val_hi)
        st_scale(scale, lo, absmax, bmask, _BLOCK)
        stb(codes + lo, encode_e4m3_tl(val_lo, inv[:, None]), bmask)
        stb(codes + hi, encode_e4m3_tl(val_hi, inv[:, None]), bmask)
    else:
        umax, inv = inv_absmax_tl(root_lo, root_hi)
        st_scale(scale, lo, umax, bmask, _BLOCK)
        stb(codes + lo, _encode_root_tl(root_lo, inv[:, None]), bmask)
        stb(codes + hi, _encode_root_tl(root_hi, inv[:, None]), bmask)


FORMAT = StateFormat(
    name="8bit.v3",
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


class AdamW8bit(LowBitAdamW):
    """AdamW with 8-bit blockwise (block 256) float-coded states: about 2 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus keyword-only extras:

    - ``backend``: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
    - ``min_quant_numel`` (4096): smaller tensors keep fp32 states.
    - ``stochastic_round`` (default ``None``: on unless ``compensate=True``; ``False`` for round-to-nearest): bf16
      weights are rounded up or down at random in proportion, so the rounding is unbiased and updates below half a
      bf16 ulp still move a weight on average (no extra memory). On by default because round-to-nearest loses
      most of a fine-tune at small learning rates: at lr 2e-5 an update is mostly below half an ulp of its weight
      and rounds away (docs/optimizers.md, "bf16 weights", has the measurement). Cost per Llama2-7B step on the
      H200 (bench/results/optimizer_step_h200.json): 0.1 ms (8-bit), 1.1 ms (16-bit), 1.8 ms (4-bit). fp32 weights
      are unaffected.
    - ``compensate``: keep a bf16 error buffer per weight (Kahan-style, +2 bytes/param) so updates below a bf16
      ulp accumulate instead of vanishing; the alternative to ``stochastic_round`` (``True`` with both raises).
    - ``tile_blocks``, ``num_warps``, ``programs_per_sm``: the Triton launch shape (``None``: the format's tuned
      default; ``bench/optimizer_step.py`` sweeps them).
    """

    FORMAT = FORMAT
