"""Coding primitives more than one format uses: block scaling, float8 e4m3 codes, and codes loaded as words.

- Block scaling: a block's absmax is its stored scale, and values are coded as x / absmax (``inv_absmax``).
- e4m3 (float8, fn variant): the codes of ``AdamWFp8``'s two moments and of ``AdamW8bit``'s first one. On the GPU
  the conversion is the hardware's (cvt.rn.satfinite, two values per instruction); under TRITON_INTERPRET it is
  spelled out in integer ops with the same round-to-nearest-even, so CI checks the codes the GPU writes against
  torch's float8_e4m3fn conversion code for code.
- Word loads: byte codes are loaded four to an int32 word (``load_words``) and unpacked with ``interleave4``.
"""

import torch

from ._format import _INTERP, ld, ldb
from ._triton import jit, tl

# Blocks whose max is below the smallest normal fp32 are stored as all-zero codes: 1/absmax would overflow to
# inf there (and 0 * inf = NaN). Such moments (|m| < 1e-38, v < 1e-38) contribute nothing to an update anyway.
TINY = 1.1754944e-38
TINY_TL = tl.constexpr(TINY)


def inv_absmax(x: torch.Tensor, *, is_abs: bool = False):
    """Per-row absmax and its reciprocal (0 where the row is all zero). x: [nblk, k]; ``is_abs``: x is |x| already."""
    absmax = (x if is_abs else x.abs()).amax(dim=1)
    inv = torch.where(absmax >= TINY, 1.0 / absmax, 0.0)
    return absmax, inv


@jit
def inv_absmax_tl(lo, hi):
    """Triton twin of ``inv_absmax`` over a block held as two halves [NB, K]."""
    absmax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1)
    inv = tl.where(absmax >= TINY_TL, tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), absmax), 0.0)
    return absmax, inv


# e4m3: each block is scaled so that its max maps to 448, e4m3's largest finite value
FP8_MAX = 448.0
_FP8_MAX = tl.constexpr(FP8_MAX)
_INV_FP8_MAX = tl.constexpr(1.0 / FP8_MAX)


def encode_e4m3(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x [nblk, k] fp32, inv [nblk, 1] = 1/absmax (or 0) -> uint8 e4m3 codes of x * inv * 448. The block factor
    inv * 448 is formed first (once per block, in the kernel too); |x| <= absmax keeps the product <= 448 up to
    rounding, which the conversion rounds back to 448, so no clamp is needed."""
    return (x * (inv * FP8_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)


# Every e4m3 code's value: on the CPU, looking codes up in it is ~5x faster than torch's float8 conversion (which
# runs element by element there), and gives the same values
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def decode_e4m3(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if codes.device.type == "cpu":
        x = _E4M3_VALUES.index_select(0, codes.reshape(-1).int()).view(codes.shape)
    else:
        x = codes.view(torch.float8_e4m3fn).float()
    return x * (scale * (1.0 / FP8_MAX))[:, None]


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
            "=r,=r,=r,=r,r",
            [w],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
        x = interleave4(x0, x1, x2, x3)
    return x * (s * _INV_FP8_MAX)[:, None]


@jit
def load_words(codes, scale, lo, hi, rows, bmask):
    """The codes of a tile of byte codes as int32 words, 4 codes each ([NB, BLOCK/8] per half), and the block scales
    (a format's ``load``).

    Words, not a uint8 tensor: the kernel carries a prefetched tile across loop iterations, and a carried vector
    of bytes is split into one register per byte and glued back into pairs for the conversions (~6 instructions per
    element in the 8-bit step); a word stays one register and is unpacked once, by the format's decode."""
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
