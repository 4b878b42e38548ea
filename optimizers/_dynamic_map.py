"""The dynamic-exponent ("dynamic tree") code shared by the 8-bit format and the 4-bit first moment.

Values are normalised by the block's absolute maximum to [-1, 1]. With B bits and E = B - 1 decades, the
codes cover 0, 1.0, and E decades [10^(i-E), 10^(i-E+1)] (i = 0..E-1) split into n_i equal cells, whose
midpoints are the code values: n_i = 2^i for the signed map (plus a sign bit), 2^(i+1) for the unsigned one.
These are exactly the values of bitsandbytes' ``create_dynamic_map`` (8-bit: 256 values; 4-bit signed: 16),
so our quantization error matches theirs, but the code *numbering* is ours: it makes encoding arithmetic
(E-1 compares and one floor) instead of a binary search over a sorted table, which keeps the kernel at
memory speed. Decoding is one gather from a 2^B-entry table that stays in L1.

Encoding rounds to the nearest value: the cell that contains |x|, except in a decade's lowest cell, where the
top value of the decade below (or 0) can be nearer and one compare decides. Above 1 - 0.225/n_top a value
becomes 1.0 (positive values only, as in bitsandbytes' map).

The plain-PyTorch and Triton encoders below do the same fp32 operations in the same order, so they agree
code for code except where Triton fuses a multiply-add differently (rare; tests bound the mismatch rate).
"""

import torch

from ._triton import jit, tl


def dynamic_map(bits: int, signed: bool) -> torch.Tensor:
    """Code -> value table (fp32, 2^bits entries) in our code numbering."""
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
            n, k = 1 << (i + 1), c - ((1 << (i + 1)) - 1)
        v = 10.0 ** (i - E + 1) * (0.1 + 0.9 * (k + 0.5) / n)
        vals.append(-v if neg else v)
    return torch.tensor(vals, dtype=torch.float32)


def _fp32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def _pow2(i: torch.Tensor) -> torch.Tensor:
    """2^i for small integer i (int32 tensor), exactly, from the exponent bits."""
    return ((i + 127) << 23).view(torch.float32)


def encode(x: torch.Tensor, inv_absmax: torch.Tensor, bits: int, signed: bool) -> torch.Tensor:
    """Plain-PyTorch encoder: x fp32 [nblk, k], inv_absmax fp32 [nblk, 1] -> int32 codes."""
    E = bits - 1
    a = x.abs() * inv_absmax
    # decade i: the number of decade bounds 10^(j-E), j = 1..E-1, that a reaches; inv_ub = 1 / 10^(i-E+1)
    i = torch.zeros_like(a, dtype=torch.int32)
    inv_ub = torch.full_like(a, 10.0 ** (E - 1))
    for j in range(1, E):
        up = a >= _fp32(10.0 ** (j - E))
        i = i + up.to(torch.int32)
        inv_ub = torch.where(up, _fp32(10.0 ** (E - 1 - j)), inv_ub)
    n = _pow2(i if signed else i + 1)  # cells in the decade
    rn = _pow2(-i if signed else -i - 1)  # 1 / n
    f = a * inv_ub
    k = torch.floor(((f - 0.1) * n) * _fp32(1.0 / 0.9))
    k = torch.minimum(torch.clamp(k, min=0.0), n - 1.0)
    mag = (n + k) if signed else (n - 1.0 + k)
    # In a decade's lowest cell the nearest value may be the top of the decade below (or 0 below decade 0):
    # in this decade's units that value is 0.1 - 0.09/n (or 0), so the midpoint is 0.1 + 0.18/n (or half the cell).
    bottom = i == 0
    low = (k == 0.0) & (f < torch.where(bottom, 0.05 + 0.225 * rn, 0.1 + 0.18 * rn))
    mag = torch.where(low, torch.where(bottom, 0.0, mag - 1.0), mag)
    n_top = float(1 << (E - 1)) if signed else float(1 << E)
    top = a > _fp32(1.0 - 0.225 / n_top)
    mag = mag.to(torch.int32)
    if signed:
        code = torch.where(x < 0, mag | (1 << E), mag)
        code = torch.where(mag == 0, 0, code)
        return torch.where(top & (x >= 0), 1 << E, code)
    # A positive second moment never becomes 0: with m non-zero, v = 0 turns the update into lr * m / eps,
    # thousands of times lr (seen in loss-parity runs as loss spikes on rarely updated embedding rows).
    mag = torch.where((mag == 0) & (a > 0), 1, mag)
    return torch.where(top, (1 << bits) - 1, mag)


@jit
def _pow2_tl(i):
    return ((i + 127) << 23).to(tl.float32, bitcast=True)


@jit
def encode_tl(x, inv_absmax, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Triton twin of ``encode``: x fp32 [NB, K], inv_absmax fp32 [NB, 1] -> int32 codes.

    Measured on the H200: this compare chain beats finding the decade with log2/exp2 (8-bit step 80 vs 100 ms).
    """
    E: tl.constexpr = BITS - 1
    a = tl.abs(x) * inv_absmax
    i = tl.zeros(a.shape, tl.int32)
    inv_ub = tl.full(a.shape, 10.0 ** (E - 1), tl.float32)
    for j in tl.static_range(1, E):
        up = a >= 10.0 ** (j - E)
        i = i + up.to(tl.int32)
        inv_ub = tl.where(up, 10.0 ** (E - 1 - j), inv_ub)
    if SIGNED:
        n = _pow2_tl(i)
        rn = _pow2_tl(-i)
    else:
        n = _pow2_tl(i + 1)
        rn = _pow2_tl(-i - 1)
    f = a * inv_ub
    k = tl.floor(((f - 0.1) * n) * (1.0 / 0.9))
    k = tl.minimum(tl.maximum(k, 0.0), n - 1.0)
    if SIGNED:
        mag = n + k
        n_top: tl.constexpr = 1 << (E - 1)
    else:
        mag = n - 1.0 + k
        n_top: tl.constexpr = 1 << E
    bottom = i == 0
    low = (k == 0.0) & (f < tl.where(bottom, 0.05 + 0.225 * rn, 0.1 + 0.18 * rn))
    mag = tl.where(low, tl.where(bottom, 0.0, mag - 1.0), mag)
    top = a > (1.0 - 0.225 / n_top)
    mag = mag.to(tl.int32)
    if SIGNED:
        code = tl.where(x < 0, mag | (1 << E), mag)
        code = tl.where(mag == 0, 0, code)
        code = tl.where(top & (x >= 0), 1 << E, code)
    else:
        mag = tl.where((mag == 0) & (a > 0), 1, mag)  # see encode(): a positive v never decodes to 0
        code = tl.where(top, (1 << BITS) - 1, mag)
    return code


@jit
def decode_tl(c, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Code (int32) -> map value, by arithmetic rather than a table gather.

    The decade i and the cell k come from the exponent bits of float(code): our numbering puts decade i at
    codes [2^i, 2^(i+1)) (signed magnitude) or [2^(i+1) - 1, 2^(i+2) - 1) (unsigned). On the H200 the per-element
    gather from a 256-entry table cost ~22 ms of a 7B step; this costs a few integer ops and one exp2. Values
    agree with ``dynamic_map`` to ~4e-7 relative (exp2 is approximate), far below a code step.
    """
    E: tl.constexpr = BITS - 1
    if SIGNED:
        mag = c & ((1 << E) - 1)
        magf = mag.to(tl.float32)
        n = (magf.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        i = (n.to(tl.int32, bitcast=True) >> 23) - 127
    else:
        magf = (c + 1).to(tl.float32)
        n = (magf.to(tl.int32, bitcast=True) & -8388608).to(tl.float32, bitcast=True)
        i = (n.to(tl.int32, bitcast=True) >> 23) - 128
    k = magf - n
    val = tl.exp2((i - (E - 1)).to(tl.float32) * 3.3219280948873622) * (0.1 + (0.9 * (k + 0.5)) / n)
    if SIGNED:
        val = tl.where(mag == 0, tl.where(c == (1 << E), 1.0, 0.0), tl.where(c > (1 << E), -val, val))
    else:
        val = tl.where(c == 0, 0.0, tl.where(c == (1 << BITS) - 1, 1.0, val))
    return val


# Blocks whose max is below the smallest normal fp32 are stored as all-zero codes: 1/absmax would overflow to
# inf there (and 0 * inf = NaN). Such moments (|m| < 1e-38, v < 1e-38) contribute nothing to an update anyway.
TINY = 1.1754944e-38
TINY_TL = tl.constexpr(TINY) if tl is not None else None


def inv_absmax(x: torch.Tensor):
    """Per-row absmax and its reciprocal (0 where the row is all zero). x: [nblk, k]."""
    absmax = x.abs().amax(dim=1)
    inv = torch.where(absmax >= TINY, 1.0 / absmax, 0.0)
    return absmax, inv


@jit
def inv_absmax_tl(lo, hi):
    """Triton twin of ``inv_absmax`` over a block held as two halves [NB, K]."""
    absmax = tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))
    inv = tl.where(absmax >= TINY_TL, tl.math.div_rn(tl.full(absmax.shape, 1.0, tl.float32), absmax), 0.0)
    return absmax, inv
