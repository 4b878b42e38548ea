"""4-bit AdamW: both moments as 4-bit codes, block 128, fp32 scale per block, two codes per byte.

Bytes per parameter: 1 (two 4-bit codes) + 2 x 4/128 scale = 1.06.

- First moment: sign and 3 bits E, the value (2^E - 1) / 127 of the block's absmax (0, 1/127, 3/127, ..., 63/127,
  1), **rounded stochastically** (up with probability equal to the distance from the level below over the gap, so the
  stored moment is unbiased). Rounded to the nearest of 16 values, a momentum that decays by b1 = 0.9 a step stays at
  its level when the levels are more than ~20 % apart (every 4-bit map), so small gradients neither move it nor let
  it fade. Encoding is arithmetic on fp32 bits: z = |m| / absmax * 127 + 1 lies in [2^E, 2^(E+1)] exactly when m lies
  between levels E and E + 1, and z's mantissa is the linear position between them, so adding 23 random bits to z's
  bits and keeping the exponent is the stochastic rounding (one multiply-add, one add, one shift, the sign). The bits
  come from the kernel's per-element Weyl dither (``_random_bits._m_dither``), the same in both paths. Decoded from a
  16-value table (one cache line).
- Second moment: u = sqrt(v), the update's denominator, on an unsigned float code with 3 exponent bits and 1 mantissa
  bit: code 2e + f is 2^(e-7) (1 + f/2) of umax / 1.5, i.e. u to within 20 % over 8 octaves (v: 2.7e-5 of the block
  max v up). No zero code, as in "Memory Efficient Optimizers with 4-bit States" (Li et al., 2023): with a zero code,
  small second moments round to 0 and m / (sqrt(v) + eps) explodes; without it they round up, which only shrinks
  those steps. Encoding is an add and a shift on the fp32 bits.

  The paper's rank-1 normalisation (scale = min(row max, column max)) would need a whole-tensor reduction before
  quantising, a second pass over the state; block-wise scaling keeps the update one pass.

Packing: byte j of a block holds element j (low nibble) and element j + 64 (high nibble), so the kernel packs
two halves it already holds in registers, with no shuffles. docs/optimizers/adamw4bit.md has the measurements.
"""

import torch

from ._codes import interleave4, inv_absmax, inv_absmax_tl
from ._format import _INTERP, StateFormat, ld, ldb, st_scale, stb
from ._optimizer import LowBitAdamW
from ._triton import jit, tl

BLOCK = 128
_BLOCK = tl.constexpr(BLOCK)  # Triton reads only constexpr globals
_HALF = tl.constexpr(BLOCK // 2)  # Triton reads only constexpr globals
# First moment's code: sign << 3 | E, value (2^E - 1) / 127 (code 8, -0, decodes to 0)
_M_LEVELS = (2.0 ** torch.arange(8, dtype=torch.float32) - 1.0) / 127.0
_QMAP_SIGNED = torch.cat([_M_LEVELS, -_M_LEVELS])
# |m| / absmax * M_SCALE + 1 < 128 even for the block max (1/absmax is rounded, maybe up): E <= 7 after any dither
M_SCALE = float(torch.tensor(127.0 * (1.0 - 2.0**-20), dtype=torch.float32))
_M_SCALE = tl.constexpr(M_SCALE)
_M_TABLE = _QMAP_SIGNED.view(torch.int32).clone()  # the decoder's 16 values, as fp32 bits (the kernel's lut)
# Second moment's code: u = sqrt(v) as 2^(e-7) (1 + f/2) of umax / 1.5 (e = 0..7, f = 0, 1); no zero
ROOT_TOP = 1.5
ROOT_FLOOR_BITS = (127 - 7) << 23  # bits of 2^-7, code 0
_ROOT_DEC = tl.constexpr(1.0 / ROOT_TOP)
_ROOT_TOP = tl.constexpr(ROOT_TOP)
_ROOT_FLOOR_BITS = tl.constexpr(ROOT_FLOOR_BITS)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    half = BLOCK // 2
    return (codes[:, :half] | (codes[:, half:] << 4)).to(torch.uint8)


def encode_m(x: torch.Tensor, inv: torch.Tensor, dither: torch.Tensor = None) -> torch.Tensor:
    """The first moment's code (twin of ``_encode_m_tl``): x fp32 [nblk, k], inv = 1/absmax [nblk, 1], dither int
    [nblk, k] in [0, 2^23) (``_random_bits.m_dither``) or None for round-to-nearest (ties up) -> int32 codes.

    z = |x| * inv * M_SCALE + 1 is computed in float64 and rounded once to fp32, as the kernel's fused multiply-add
    rounds it (the product of two fp32 values is exact in float64, so addcmul's sum is too). z < 128, so its bits plus
    the dither stay below 2^31: int32 holds them."""
    return _encode_m(x, x.abs(), inv, dither)


def _encode_m(x, x_abs, inv, dither):
    k = (inv * M_SCALE).double()
    z = torch.addcmul(_ONE_F64.to(x.device), x_abs.double(), k).float().view(torch.int32)
    e = ((z + (dither if dither is not None else (1 << 22))) >> 23) - 127
    return (e | ((x.view(torch.int32) >> 28) & 8)).to(torch.int32)


def _encode_root(u: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    # nearest, ties up (see adamw8bit.py); below the smallest code: code 0 (the clamp is on the integer, one fused
    # add-and-max on the GPU, rather than on the float)
    return torch.clamp((u * (inv * ROOT_TOP)).view(torch.int32) - (ROOT_FLOOR_BITS - (1 << 21)), min=0) >> 22


_ONE_F64 = torch.ones((), dtype=torch.float64)
# Decoding: a second-moment code c is the fp32 bits (c << 22) + bits(2^-7), u = that times the block's umax / 1.5.
# Both moments are decoded from a byte's two codes (low nibble: element j, high: j + 64) by table, one index per byte
# (index_select: a quicker gather than table[c] on the CPU), the block scale applied after.
_BYTES = torch.arange(256, dtype=torch.int32)
_ROOT_Z = ((torch.arange(16, dtype=torch.int32) << 22) + ROOT_FLOOR_BITS).view(torch.float32)
_BYTE_TABLES = {
    True: (_QMAP_SIGNED[_BYTES & 15], _QMAP_SIGNED[_BYTES >> 4]),
    False: (_ROOT_Z[_BYTES & 15], _ROOT_Z[_BYTES >> 4]),
}


def quantize(x: torch.Tensor, signed: bool, dither: torch.Tensor = None):
    if signed:  # (|x| once, for the scale and the codes)
        x_abs = x.abs()
        absmax, inv = inv_absmax(x_abs, is_abs=True)
        return _pack(_encode_m(x, x_abs, inv[:, None], dither)), absmax
    u = x.sqrt()
    umax, inv = inv_absmax(u)
    return _pack(_encode_root(u, inv[:, None])), umax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    c, half = codes.reshape(-1).int(), codes.shape[1]
    out = torch.empty(codes.shape[0], 2 * half, dtype=torch.float32, device=codes.device)
    s = scale[:, None] if signed else (scale * (1.0 / ROOT_TOP))[:, None]
    for t, o in zip(_BYTE_TABLES[signed], (out[:, :half], out[:, half:])):  # (written into place: no cat)
        torch.mul(t.to(codes.device).index_select(0, c).view(codes.shape), s, out=o)
    return out if signed else out.mul_(out)


@jit
def _load(codes, scale, lo, hi, rows, bmask):
    """A tile's packed codes as int32 words ([NB, BLOCK/8]: 4 bytes, 8 codes each; both halves' codes are in them, so
    raw_hi is the same tensor) and its block scales. Words rather than a uint8 tensor for the reason given in
    ``_codes.load_words``."""
    NB: tl.constexpr = lo.shape[0]
    K: tl.constexpr = lo.shape[1] // 4
    w = tl.arange(0, NB)[:, None] * K + tl.arange(0, K)[None, :]
    words = ldb(codes.to(tl.pointer_type(tl.int32)) + w, bmask, 0)
    return words, words, ld(scale + rows, bmask, 0.0)


@jit
def _nibbles(w):
    """Words [NB, K] -> (low nibbles, high nibbles) as int32 codes [NB, 4K]: byte j of word i is element 4i + j."""
    lo = interleave4(w & 15, (w >> 8) & 15, (w >> 16) & 15, (w >> 24) & 15)
    hi = interleave4((w >> 4) & 15, (w >> 12) & 15, (w >> 20) & 15, (w >> 28) & 15)
    return lo, hi


@jit
def _gather(lut, idx):
    """lut[idx] for an int32 index tensor. On the GPU an inline ld.global.nc per element: a plain tl.load of
    scattered addresses makes Triton's coalescing pass give the whole update a one-element-per-thread layout, with
    shared-memory round trips to convert to and from it (11 barriers per tile). The address is formed on its low 32
    bits only, by one multiply-add (the bucket's copy of the table never straddles a 4 GiB boundary:
    ``_buckets.no_4g_crossing``); a 64-bit add would take two instructions."""
    if _INTERP:
        return tl.load(lut + idx)
    else:
        a = lut.to(tl.int64)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 lo; .reg .b64 a; mad.lo.u32 lo, $1, 4, $2; mov.b64 a, {lo, $3}; ld.global.nc.b32 $0, [a]; }",
            "=r,r,r,r",
            [idx, (a & 0xFFFFFFFF).to(tl.int32), (a >> 32).to(tl.int32)],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )


@jit
def _decode_m_tl(words, s, lut):
    """The first moment: codes -> table values times the block scale, one gather per element from the 16 values (64
    bytes: one cache line). A table of byte pairs (256 x 2 values, one gather per two elements) took fewer
    instructions but was slower on the H200 (16.1 vs 15.8-16.0 ms device a 7B step): its 2 KB spread each warp's
    gathers over up to 16 cache lines, and the L1's line throughput was then what limited the step."""
    s = s[:, None]
    c_lo, c_hi = _nibbles(words)
    return _gather(lut, c_lo).to(tl.float32, bitcast=True) * s, _gather(lut, c_hi).to(tl.float32, bitcast=True) * s


@jit
def _encode_m_tl(x, inv, d):
    """Twin of ``encode_m``: inv = 1/absmax [NB, 1], d the dither [NB, K] (23 bits). The exponent of
    z = |x| inv M_SCALE + 1 plus a carry with probability equal to its mantissa's fraction is E, stochastically
    rounded."""
    z = tl.fma(tl.abs(x), inv * _M_SCALE, 1.0)
    e = ((z.to(tl.uint32, bitcast=True) + d) >> 23) - 127
    return (e | ((x.to(tl.uint32, bitcast=True) >> 28) & 8)).to(tl.int32)


@jit
def _decode_root_tl(w, s):
    """The second moment: nibble c -> fp32 bits (c << 22) + bits(2^-7), per nibble of the word a shift and one
    and-or (the two fields do not overlap); then u times the block scale, squared."""
    m: tl.constexpr = 15 << 22
    z_lo = interleave4((w << 22) & m, (w << 14) & m, (w << 6) & m, (w >> 2) & m)
    z_hi = interleave4((w << 18) & m, (w << 10) & m, (w << 2) & m, (w >> 6) & m)
    z_lo = (z_lo | _ROOT_FLOOR_BITS).to(tl.float32, bitcast=True)
    z_hi = (z_hi | _ROOT_FLOOR_BITS).to(tl.float32, bitcast=True)
    k = (s * _ROOT_DEC)[:, None]
    u_lo = z_lo * k
    u_hi = z_hi * k
    return u_lo * u_lo, u_hi * u_hi


@jit
def _encode_root_tl(u, inv, lut):
    k = inv * _ROOT_TOP
    return tl.maximum((u * k).to(tl.int32, bitcast=True) - (_ROOT_FLOOR_BITS - (1 << 21)), 0) >> 22


@jit
def _store_nibbles(codes, lo, rows, bmask, c_lo, c_hi):
    """Pack element j's code (low nibble) with element j + 64's (high nibble) into byte j of each block, and store."""
    stb(codes + (lo - rows[:, None] * _HALF), (c_lo | (c_hi << 4)).to(tl.uint8), bmask)


@jit
def _encode_store(codes, scale, lo, rows, bmask, x_lo, x_hi, aux_lo, aux_hi, ENCODE: tl.constexpr):
    """The store both moments share: the blocks' absmax is their scale (stored), and ENCODE(x, 1/absmax [NB, 1],
    aux) gives the codes, packed and stored by ``_store_nibbles``. aux: the table (``lut``) for the second moment's
    encoder, each half's dither for the first moment's."""
    absmax, inv = inv_absmax_tl(x_lo, x_hi)
    st_scale(scale, lo, absmax, bmask, _BLOCK)
    inv = inv[:, None]
    _store_nibbles(codes, lo, rows, bmask, ENCODE(x_lo, inv, aux_lo), ENCODE(x_hi, inv, aux_hi))


@jit
def _decode(words, unused, s, lut, SIGNED: tl.constexpr):
    if SIGNED:
        return _decode_m_tl(words, s, lut)
    else:
        return _decode_root_tl(words, s)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED: tl.constexpr):
    if SIGNED:  # root_lo/hi: the first moment's dither (see StateFormat.dithered_m)
        _encode_store(codes, scale, lo, rows, bmask, val_lo, val_hi, root_lo, root_hi, _encode_m_tl)
    else:
        _encode_store(codes, scale, lo, rows, bmask, root_lo, root_hi, lut, lut, _encode_root_tl)


FORMAT = StateFormat(
    name="4bit.v4",
    block_size=BLOCK,
    code_dtype=torch.uint8,
    elems_per_code=2,
    scaled=True,
    quantize=quantize,
    dequantize=dequantize,
    triton_load=_load,
    triton_decode=_decode,
    triton_store=_store,
    bytes_per_element=0.5 + 4 / BLOCK,
    table=_M_TABLE,
    dithered_m=True,
    # More registers unconstrained; capped at 160, 12 programs fit per SM. Measured on the H200
    # (bench/results/optimizer_sweep_h200.log), device ms per 7B step: 160 / 12: 15.8; 168 / 12: 16.0;
    # 160 / 11: 16.4; 128 / 16: 18.1; uncapped / 12: 19.4. With stochastic rounding of the weights, 160 / 12: 17.7.
    tile_blocks=4,
    num_warps=1,
    programs_per_sm=12,
    max_registers=160,
)


class AdamW4bit(LowBitAdamW):
    """AdamW with 4-bit blockwise (block 128) states: about 1.06 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus the keyword-only extras of
    ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).

    bf16 weights are rounded stochastically by default (see ``optimizers.AdamW8bit``); it costs ~1.8 ms per
    Llama2-7B step on the H200 (bench/results/optimizer_step_h200.json). (The first moment's stochastic rounding,
    above, is another thing and always on.)
    """

    FORMAT = FORMAT
