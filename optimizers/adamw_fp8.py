"""FP8 AdamW: both moments as float8 e4m3 (fn) with an fp32 scale per block of 256.

Bytes per parameter: 2 x (1 + 4/256) = 2.03, like 8-bit. Each block is scaled so its max maps to 448, e4m3's
largest finite value: 3 mantissa bits at every magnitude, down to 2^-6 of 448 (then subnormals to 2^-9). Second
moments are floored at e4m3's smallest subnormal instead of rounding to zero (a zero v under a non-zero m would blow
the update up); a block of zeros still decodes to zeros, its scale being 0.

The e4m3 helpers here (``encode_e4m3``/``decode_e4m3`` and their Triton twins) also code the first moment of
``AdamW8bit``. On the GPU the conversion is the hardware's (cvt.rn.satfinite, two values per instruction); under
TRITON_INTERPRET it is spelled out in integer ops with the same round-to-nearest-even, so CI checks the codes the
GPU writes against torch's float8_e4m3fn conversion code for code.
"""

import torch

from . import _dynamic_map as dm
from ._triton import jit, tl
from ._update import _INTERP, LowBitAdamW, StateFormat, ld, ldb, st_scale, stb

BLOCK = 256
_BLOCK = tl.constexpr(BLOCK)  # Triton reads only constexpr globals
FP8_MAX = 448.0
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)
# Smallest positive e4m3 value (a subnormal): the floor of second moments (see above).
FP8_MIN = 2.0 ** -9
_FP8_MIN = tl.constexpr(FP8_MIN)


def encode_e4m3(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x [nblk, k] fp32, inv [nblk, 1] = 1/absmax (or 0) -> uint8 e4m3 codes of x * inv * 448. The block factor
    inv * 448 is formed first (once per block, in the kernel too); |x| <= absmax keeps the product <= 448 up to
    rounding, which the conversion rounds back to 448, so no clamp is needed."""
    return (x * (inv * FP8_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)


def decode_e4m3(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.view(torch.float8_e4m3fn).float() * (scale * (1.0 / FP8_MAX))[:, None]


def quantize(x: torch.Tensor, signed: bool):
    absmax, inv = dm.inv_absmax(x)
    if signed:
        return encode_e4m3(x, inv[:, None]), absmax
    # v >= 0: the floor is one max, against a per-block floor that is 0 where the block is stored as zeros
    floor = torch.where(inv > 0, FP8_MIN, 0.0)
    q = torch.maximum(x * (inv * FP8_MAX)[:, None], floor[:, None])
    return q.to(torch.float8_e4m3fn).view(torch.uint8), absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    return decode_e4m3(codes, scale)


@jit
def e4m3_tl(q):
    """fp32 q, |q| <= 448 (up to rounding) -> uint8 e4m3fn code, round to nearest even."""
    if _INTERP:
        # The interpreter's fp8 cast does not round like the hardware; this is cvt.rn.satfinite's result.
        bits = q.to(tl.int32, bitcast=True)
        a = tl.abs(q)
        ab = a.to(tl.int32, bitcast=True)
        normal = ((ab + (0x7FFFF + ((ab >> 20) & 1))) >> 20) - ((127 - 7) << 3)  # rebias 127 -> 7, 3 mantissa bits
        t = a * 512.0  # below 2^-6 the codes are multiples of 2^-9: k = round-half-even(a * 2^9)
        f = tl.floor(t)
        fi = f.to(tl.int32)
        up = ((t - f) > 0.5) | (((t - f) == 0.5) & ((fi & 1) == 1))
        mag = tl.where(a < 0.015625, fi + up.to(tl.int32), normal)
        return (mag | ((bits >> 24) & 0x80)).to(tl.uint8)
    else:
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@jit
def encode_e4m3_tl(x, inv):
    """Triton twin of ``encode_e4m3``: inv is [NB, 1]."""
    return e4m3_tl(x * (inv * _FP8_MAX))


@jit
def load_words(codes, scale, lo, hi, rows, bmask):
    """The codes of a tile as int32 words, 4 codes each ([NB, BLOCK/8] per half), and the block scales.

    Words, not a uint8 tensor: the kernel carries a prefetched tile across loop iterations, and a carried vector
    of bytes is split into one register per byte and glued back into pairs for the conversions (~6 instructions per
    element in the 8-bit step); a word stays one register and is unpacked once, in ``unpack_words``."""
    NB: tl.constexpr = lo.shape[0]
    K: tl.constexpr = lo.shape[1] // 4
    w = tl.arange(0, NB)[:, None] * (2 * K) + tl.arange(0, K)[None, :]  # word offsets of the lo halves
    words = codes.to(tl.pointer_type(tl.int32))  # tile starts are block (256-byte) aligned
    return ldb(words + w, bmask, 0), ldb(words + w + K, bmask, 0), ld(scale + rows, bmask, 0.0)


@jit
def interleave4(b0, b1, b2, b3):
    """Four [NB, K] tensors -> [NB, 4K] with element 4i + j = bj[i] (the inverse of a word's byte order)."""
    x = tl.join(tl.join(b0, b2), tl.join(b1, b3))  # [NB, K, 2, 2]: [.., a, c] = b(2a + c)
    return tl.reshape(x, (x.shape[0], 4 * x.shape[1]))


@jit
def decode_e4m3_words(w, s):
    """int32 words of 4 e4m3 codes [NB, K] and block scales [NB] -> fp32 values [NB, 4K]."""
    if _INTERP:
        c = interleave4(w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFF, (w >> 24) & 0xFF).to(tl.uint8)
        x = c.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        # two hardware conversions of two codes each, straight from the word's halves
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            """{ .reg .b16 lo, hi, h0, h1, h2, h3; .reg .b32 p, q;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 p, lo;
            cvt.rn.f16x2.e4m3x2 q, hi;
            mov.b32 {h0, h1}, p;
            mov.b32 {h2, h3}, q;
            cvt.f32.f16 $0, h0;
            cvt.f32.f16 $1, h1;
            cvt.f32.f16 $2, h2;
            cvt.f32.f16 $3, h3; }""",
            "=r,=r,=r,=r,r", [w], dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
        x = interleave4(x0, x1, x2, x3)
    return x * (s * _INV_FP8_MAX)[:, None]


@jit
def _decode(c_lo, c_hi, s, lut, SIGNED: tl.constexpr):
    return decode_e4m3_words(c_lo, s), decode_e4m3_words(c_hi, s)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED: tl.constexpr):
    absmax, inv = dm.inv_absmax_tl(val_lo, val_hi)
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
    name="fp8", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=1, scaled=True,
    quantize=quantize, dequantize=dequantize, triton_load=load_words, triton_decode=_decode, triton_store=_store,
    bytes_per_element=1.0 + 4 / BLOCK, tile_blocks=1, num_warps=1, programs_per_sm=16,
)


class AdamWFp8(LowBitAdamW):
    """AdamW with float8 e4m3 blockwise (block 256) states: about 2 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus the keyword-only
    extras of ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).

    bf16 weights are rounded stochastically by default (``stochastic_round=None``: on unless ``compensate=True``;
    ``False`` rounds to nearest): round-to-nearest drops the updates below half a bf16 ulp, most of them at
    fine-tuning learning rates (measured: 0.26-0.29 of the fp32-master reference's loss improvement kept, against
    0.99-1.01 stochastically rounded; ``optimizers.AdamW8bit``'s docstring has the setup). fp32 weights are
    unaffected.
    """

    FORMAT = FORMAT
