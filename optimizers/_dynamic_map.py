"""The dynamic-exponent code: the values of the 4-bit first moment, and the whole code of
``AdamW4bit(second_moment="dynamic")``'s second moment.

The 4-bit first moment uses only the map's values (``dynamic_map``): it encodes and decodes them by table lookup
(``adamw4bit.py``: ~10 instructions per value where the arithmetic below takes ~37). The 8-bit format used this code
until 8bit.v3, which codes both moments as floats read off the fp32 bits (``adamw8bit.py``:
~5 instructions per value instead of this map's ~25 to encode and ~12 to decode). The code stays general in its
number of bits; the tests check it at 4 and 8.

Values are normalised by the block's absolute maximum to [-1, 1]. Like bitsandbytes' dynamic map, a code is a
sign, a *level* (which power range the magnitude falls in) and a linear fraction inside that level, with more
cells in the levels near the block max. With B bits there are E = B - 1 levels; level i = 0..E-1 covers
[16^(i-E), 16^(i-E+1)) and is split into n_i equal cells whose midpoints are the code values: n_i = 2^i for the
signed map (plus a sign bit), 2^(i+1) for the unsigned one. 0 and 1.0 are codes of both maps.

Why levels of 16 (four octaves) and not bitsandbytes' decades of 10: with power-of-two levels the level and its
scale come out of the float's exponent bits, so encoding is ~25 integer and float ops (no compare chain over the
decade bounds, no exp2/log2) and decoding ~12 (no table gather, no division). With the decade map our 8-bit step
was issue-bound on the H200 (254 SASS instructions per element). Accuracy, mean relative
error of nearest-value encoding on |x| ~ U(0,1)^6 (bitsandbytes' 8-bit map in brackets), signed map:
[0.1, 1) 1.35 % (1.26 %), [0.01, 0.1) 2.46 % (2.47 %), [1e-3, 1e-2) 4.65 % (4.76 %), [1e-4, 1e-3) 8.5 % (9.0 %);
the unsigned map is about half of that, and the 8-bit maps reach down to 16^-7 = 3.7e-9 of the block max
(bitsandbytes: 1e-7). So the same accuracy where it matters, a little more range.

Code numbering: signed magnitude c in [2^i, 2^(i+1)) is level i, cell c - 2^i; unsigned c + 1 in [2^(i+1),
2^(i+2)) is level i, cell c + 1 - 2^(i+1). Signed code 2^E (a "negative zero") is +1.0; unsigned 2^B - 1 is 1.0.

Encoding rounds to the nearest value: the cell that contains |x|, except in a level's lowest cell, where the top
value of the level below (or 0) can be nearer and one compare decides. Magnitudes below the lowest level become 0
(first moment) or the smallest code (second moment: see ``encode``); above 1 - 15/(64 n_top) they become 1.0
(positive values only, as in bitsandbytes' map). The plain-PyTorch and Triton encoders do the same fp32 operations
in the same order and all but one multiply are exact, so they agree code for code; decoding agrees bit for bit
with ``dynamic_map``'s table.
"""

import torch

from ._triton import jit, tl

_R = 4  # octaves per level (the encoders divide by it with ">> 2")
_SPAN = 16.0 / 15.0  # 1 / (1 - 2^-R): cells per unit of (f - 2^-R) * n, f = |x| in level units


def dynamic_map(bits: int, signed: bool) -> torch.Tensor:
    """Code -> value table (fp32, 2^bits entries) in our code numbering (the plain-PyTorch path decodes with it)."""
    E = bits - 1
    vals = []
    for c in range(1 << bits):
        if signed:
            neg, mag = c >> E, c & ((1 << E) - 1)
            if mag == 0:
                vals.append(1.0 if neg else 0.0)
                continue
            i = mag.bit_length() - 1
            n, k = 1 << i, mag - (1 << i)
        else:
            neg = 0
            if c == 0 or c == (1 << bits) - 1:
                vals.append(0.0 if c == 0 else 1.0)
                continue
            i = (c + 1).bit_length() - 2
            n, k = 1 << (i + 1), c + 1 - (1 << (i + 1))
        # P + (15k + 7.5) * P / n with P = 16^(i-E): exact in float64, so the fp32 cast is the one rounding, the
        # same one the kernel's fused multiply-add makes.
        p = 2.0 ** (_R * (i - E))
        v = p + (15 * k + 7.5) * (p / n)
        vals.append(-v if neg else v)
    return torch.tensor(vals, dtype=torch.float32)


def _pow2(i: torch.Tensor) -> torch.Tensor:
    """2^i for integer i in the normal range (int32 tensor), exactly, from the exponent bits."""
    return ((i + 127) << 23).view(torch.float32)


def encode(x: torch.Tensor, inv_absmax: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """Plain-PyTorch encoder: x fp32 [nblk, k], inv_absmax fp32 [nblk, 1] -> int32 codes.

    The level i comes from the exponent bits. With S = 16^(E-1-i) * n (a power of two), d = a * S - n/16 is
    (f - 1/16) * n for f = a in level-i units, exactly (the product is a power-of-two scaling and the
    subtraction is exact by Sterbenz), so the cell is floor(d * 16/15): one rounding in the whole chain.
    """
    E = bits - 1
    xs = x * inv_absmax
    a = xs.abs()
    i = torch.clamp(((a.view(torch.int32) >> 23) - (127 - _R * E)) >> 2, min=0)  # below level 0: 0
    lg_n = i if signed else i + 1
    d = a * _pow2(_R * (E - 1) - 3 * i + (lg_n - i)) - _pow2(lg_n - _R)
    n = 1 << lg_n
    k = torch.minimum(torch.clamp(torch.floor(d * _SPAN).to(torch.int32), min=0), n - 1)
    # In a level's lowest cell the top value of the level below (the previous code) can be nearer: the midpoint
    # is at d = 105/512. Below level 0 of the signed map the previous code is 0 (exact midpoint there: 104/512).
    low = (d < 105.0 / 512.0).to(torch.int32)
    n_top = 1 << (E - 1) if signed else 1 << E
    thr = 1.0 - 15.0 / (64 * n_top)  # nearer to 1.0 than to the top cell's midpoint
    if signed:
        mag = n + k - low
        code = torch.where(mag == 0, 0, mag | ((x.view(torch.int32) >> (31 - E)) & (1 << E)))
        return torch.where(xs > thr, 1 << E, code)
    # A positive second moment never becomes 0: with m non-zero, v = 0 turns the update into lr * m / eps,
    # thousands of times lr (seen in loss-parity runs as loss spikes on rarely updated embedding rows).
    mag = torch.maximum(n - 1 + k - low, torch.clamp(a.view(torch.int32), max=1))
    return torch.where(a > thr, (1 << bits) - 1, mag)


@jit
def _pow2_tl(i):
    return ((i + 127) << 23).to(tl.float32, bitcast=True)


@jit
def encode_tl(x, inv_absmax, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Triton twin of ``encode`` (same operations): x fp32 [NB, K], inv_absmax fp32 [NB, 1] -> int32 codes."""
    E: tl.constexpr = BITS - 1
    xs = x * inv_absmax
    a = tl.abs(xs)
    i = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) - (127 - 4 * E)) >> 2, 0)
    if SIGNED:
        lg_n = i
        n_top: tl.constexpr = 1 << (E - 1)
    else:
        lg_n = i + 1
        n_top: tl.constexpr = 1 << E
    d = a * _pow2_tl(4 * (E - 1) - 3 * i + (lg_n - i)) - _pow2_tl(lg_n - 4)
    n = 1 << lg_n
    k = tl.minimum(tl.maximum(tl.floor(d * (16.0 / 15.0)).to(tl.int32), 0), n - 1)
    low = (d < 105.0 / 512.0).to(tl.int32)
    thr: tl.constexpr = 1.0 - 15.0 / (64 * n_top)
    if SIGNED:
        mag = n + k - low
        code = tl.where(mag == 0, 0, mag | ((x.to(tl.int32, bitcast=True) >> (31 - E)) & (1 << E)))
        code = tl.where(xs > thr, 1 << E, code)
    else:
        mag = tl.maximum(n - 1 + k - low, tl.minimum(a.to(tl.int32, bitcast=True), 1))  # see encode()
        code = tl.where(a > thr, (1 << BITS) - 1, mag)
    return code


@jit
def decode_tl(c, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Code (int32) -> map value, by arithmetic: the level comes from the exponent bits of float(magnitude code),
    and the powers of two are built from bits, so there is no table gather, division or transcendental.

    With n = 2^lg_n cells, q = 16^(i-E) / n and p = 16^(i-E): value = p + (15k + 7.5) q = q (15 mag' + 7.5) - 14 p,
    where mag' = k + n is the float of the magnitude code (signed) or code + 1 (unsigned). The product is exact, so
    the one rounding of the fused multiply-add gives ``dynamic_map``'s table value bit for bit.
    """
    E: tl.constexpr = BITS - 1
    if SIGNED:
        mag = c & ((1 << E) - 1)
        magf = mag.to(tl.float32)
        eb = magf.to(tl.int32, bitcast=True) >> 23  # 127 + lg_n, lg_n = i
        p = ((4 * eb - (3 * 127 + 4 * E)) << 23).to(tl.float32, bitcast=True)
        q = ((3 * eb - (2 * 127 + 4 * E)) << 23).to(tl.float32, bitcast=True)
    else:
        magf = (c + 1).to(tl.float32)
        eb = magf.to(tl.int32, bitcast=True) >> 23  # 127 + lg_n, lg_n = i + 1
        p = ((4 * eb - (3 * 127 + 4 * E + 4)) << 23).to(tl.float32, bitcast=True)
        q = ((3 * eb - (2 * 127 + 4 * E + 4)) << 23).to(tl.float32, bitcast=True)
    val = (magf * 15.0 + 7.5) * q - 14.0 * p
    if SIGNED:
        val = tl.where(mag == 0, tl.where(c == (1 << E), 1.0, 0.0), tl.where(c > (1 << E), -val, val))
    else:
        val = tl.where(c == 0, 0.0, tl.where(c == (1 << BITS) - 1, 1.0, val))
    return val


# Blocks whose max is below the smallest normal fp32 are stored as all-zero codes: 1/absmax would overflow to
# inf there (and 0 * inf = NaN). Such moments (|m| < 1e-38, v < 1e-38) contribute nothing to an update anyway.
TINY = 1.1754944e-38
TINY_TL = tl.constexpr(TINY)


def inv_absmax(x: torch.Tensor):
    """Per-row absmax and its reciprocal (0 where the row is all zero). x: [nblk, k]."""
    absmax = x.abs().amax(dim=1)
    inv = torch.where(absmax >= TINY, 1.0 / absmax, 0.0)
    return absmax, inv


@jit
def inv_absmax_tl(lo, hi):
    """Triton twin of ``inv_absmax`` over a block held as two halves [NB, K]."""
    absmax = tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1)
    inv = tl.where(absmax >= TINY_TL, tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), absmax), 0.0)
    return absmax, inv
