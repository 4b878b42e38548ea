"""The one AdamW update that every state format shares.

What lives here:

* ``StateFormat``: what a state format must provide (one file per format: ``adamw.py``, ``adamw8bit.py``,
  ``adamw4bit.py``, ``adamw_fp8.py``). A format is a storage layout (codes + optional per-block fp32 scale)
  with a plain-PyTorch ``quantize``/``dequantize`` pair and the matching Triton ``load``/``store`` helpers.
* ``LowBitAdamW``: the ``torch.optim.Optimizer`` that owns the parameter loop, the state buffers, the fp32
  update math, ``state_dict`` / ``load_state_dict``, and the choice between the two paths:

  - the plain-PyTorch path (``backend="torch"``): one parameter at a time, readable, runs anywhere. It is the
    reference the tests hold the kernel to, and the path on CPU.
  - the Triton path (``backend="triton"``): one multi-tensor kernel launch per bucket of parameters (same
    device, same dtype, same format) updates every parameter of the step. A table of per-tensor addresses is
    uploaded when an address changed, the hyper-parameters go as kernel arguments (or, with several param groups or
    step counts, as a small table); a persistent grid of programs walks the tiles (``NB`` quantization
    blocks of one tensor each), loading the next tile while it updates the current one (``_adamw_kernel``). No
    torch.compile, so the first step costs only Triton's compile (cached on disk afterwards).

Layout: all states of a bucket live in flat buffers; each parameter owns a block-aligned slice, padded up to a
whole block (padding stays exactly zero because its gradient and weight are read as zero). ``self.state[p]``
holds views of those slices, so ``state_dict()`` sees per-parameter tensors like any torch optimizer.

Update (fp32 math, torch.optim.AdamW semantics, decoupled weight decay)::

    p  <- p * (1 - lr * wd)
    m  <- b1 * m + (1 - b1) * g
    v  <- b2 * v + (1 - b2) * g * g
    p  <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Non-finite gradients: an element whose gradient is NaN or +-inf, or so large that its square would overflow fp32
(|g| > 2^63, ``_G_MAX``), is not updated at all (its weight, moments and error buffer keep their values) and is
counted in ``optimizer.nonfinite_count`` (a device tensor, so no host sync). torch.optim.AdamW would instead write
NaN into the weight and both moments (for a huge finite g: an inf v, and that element never moves again); with
quantized states one NaN or inf would also poison the scale of its whole block, so we never let it in.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

from ._triton import INSTALL_HINT, HAVE_TRITON, INTERPRET, jit, tl, triton_usable

_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")
_NONES = itertools.repeat(None)

# The gradient guard: an element is updated only where |g| <= _G_MAX, one compare that is false for NaN and +-inf and
# also for a finite g whose square overflows. g * g is inf in fp32 from |g| = 2^64 on, (1 - b2) g^2 from ~6e20 at
# b2 = 0.999, and one inf v poisons its block: an infinite block scale (8-bit, 4-bit: the block's other elements never
# move again) or NaN codes (FP8: NaN in every weight of the block). 2^63 keeps every stored v (at most the largest g^2
# it has seen, up to its format's rounding, for any b2) a factor 4 below fp32's max. Same instruction count as the
# NaN/inf compare alone (only the constant differs).
_G_MAX = 2.0 ** 63
_G_MAX_TL = tl.constexpr(_G_MAX)


@dataclass(frozen=True)
class StateFormat:
    """How one state format stores a moment. One instance per format file."""

    name: str  # saved in state_dict param_groups as 'state_format'; loading another format is refused
    block_size: int  # elements per quantization block; also the padding unit of each parameter's slice
    code_dtype: torch.dtype  # storage dtype of the codes
    elems_per_code: int  # 2 for packed 4-bit codes, else 1
    scaled: bool  # whether a per-block fp32 scale is stored
    # plain-PyTorch path: quantize(x [nblk, block] fp32, signed) -> (codes [nblk, block // elems_per_code], scale [nblk])
    quantize: Callable
    # dequantize(codes, scale, signed) -> [nblk, block] fp32
    dequantize: Callable
    # Triton path, three @triton.jit helpers (use ld/st/ldb/stb below for the optional masks):
    #   load(codes, scale, lo, hi, rows, bmask) -> (raw_lo, raw_hi, s): the loads only, no arithmetic (the kernel
    #     issues them a tile ahead); codes/scale point at the tile's first code and block scale, lo/hi are int32
    #     element offsets [NB, block/2] inside the tile, rows = the tile's block indices [NB] (in the layout of a
    #     reduction over axis 1), bmask None (full tile) or [NB];
    #   decode(raw_lo, raw_hi, s, lut, SIGNED) -> (lo, hi) fp32 [NB, block/2];
    #   store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED): quantize and store
    #     val (root = sqrt(val) for the second moment, already computed by the update; = val for the first).
    #   lut points at the format's ``table`` on the device (for table-coded formats; else a dummy).
    # (Triton 3.6 cannot return None from a helper, hence ld/st for element masks and ldb/stb for block masks.)
    triton_load: Any
    triton_decode: Any
    triton_store: Any
    bytes_per_element: float = 1.0  # per moment, excluding scales; for docs and the benchmark
    # int32 lookup table(s) the Triton helpers read through ``lut`` (copied to each bucket's device once)
    table: Optional[torch.Tensor] = None
    # The first moment is rounded stochastically: quantize(x, True, dither) takes ``m_dither``'s 23-bit integers
    # (one per element) on the PyTorch path, and the Triton store gets the kernel's same bits as its root_lo/hi.
    dithered_m: bool = False
    # Triton launch shape: blocks per tile, warps per program, persistent programs per SM; tuned on the H200
    # (bench/results/optimizer_sweep_h200.log)
    tile_blocks: int = 4
    num_warps: int = 4
    programs_per_sm: int = 8
    max_registers: Optional[int] = None  # per thread (Triton's maxnreg), to fit more programs per SM

    def __post_init__(self):
        _FORMATS[self.name] = self

    def __reduce__(self):
        # copy.deepcopy and pickle refer to a format by its name: each is a module constant, and its Triton helpers
        # (and closures) neither copy nor pickle
        return (_format_named, (self.name,))


_FORMATS: dict = {}  # every StateFormat by name (importing optimizers defines them all)


def _format_named(name: str) -> StateFormat:
    return _FORMATS[name]


# ---------------------------------------------------------------------------------------------------------
# Triton path: one kernel for all formats. LOAD/STORE are the format's jit helpers, passed as constexprs.
# ---------------------------------------------------------------------------------------------------------


if HAVE_TRITON and not INTERPRET:
    from triton.language.extra import libdevice as _libdevice
else:
    _libdevice = None
# On the GPU the update's division is div.approx (one reciprocal and one multiply, <= 2 ulp): the IEEE-style
# division that `/` emits costs ~9 instructions per element, the largest single item of the 16-bit kernel. The
# interpreter has no libdevice, so CI runs `/`; the tests' tolerances cover both (GPU tests run the fast one).
_FAST_DIV = tl.constexpr(_libdevice is not None)
_INTERP = tl.constexpr(INTERPRET)


@jit
def _fdiv(a, b):
    if _FAST_DIV:
        return _libdevice.fast_dividef(a, b)
    else:
        return a / b


@jit
def _adam_math(p, g, m, v, e, lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign, COMPENSATE: tl.constexpr):
    """Returns (x_new, m_new, v_new, sqrt(v_new)). A non-finite g makes m_new, v_new, x_new NaN or inf; the selects
    put the old values back (one select each, mostly folded into predicated multiply-adds)."""
    finite = tl.abs(g) <= _G_MAX_TL  # false for NaN, inf and a g whose square would overflow (see _G_MAX)
    x = p
    if COMPENSATE:
        x = p + e
    m_new = tl.where(finite, b1 * m + ((1.0 - b1) * sign) * g, m)  # sign: -1 to maximize (g * g needs none)
    v_new = tl.where(finite, b2 * v + ((1.0 - b2) * g) * g, v)
    root = tl.sqrt(v_new)  # formats that store sqrt(v) reuse it (adamw8bit.py)
    denom = root * inv_sqrt_bc2 + eps
    x_new = tl.where(finite, x * (1.0 - lr * wd) - step_size * _fdiv(m_new, denom), x)
    return x_new, m_new, v_new, root


@jit
def _nanmax(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@jit
def round_to(x, ty: tl.constexpr):
    """fp32 -> ``ty`` with round-to-nearest-even. On the GPU that is the hardware conversion. Under TRITON_INTERPRET
    the bf16 conversion does not round to even, so there the rounding is spelled out in integer ops (bit-equal to
    the GPU's cvt.rn; CI would otherwise test a different function from the one the GPU runs). Inputs are finite."""
    if _INTERP and ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(ty)


@jit
def ld(ptr, mask, other):
    """``tl.load`` with an optional mask: full tiles pass ``mask=None`` and get unpredicated, vectorised loads."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=other)


@jit
def st(ptr, val, mask):
    """``tl.store`` with an optional mask (see ``ld``)."""
    if mask is None:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=mask)


@jit
def ldb(ptr, bmask, other):
    """``ld`` with a per-block mask [NB] (or None) broadcast over each block's elements [NB, K]."""
    if bmask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=bmask[:, None], other=other)


@jit
def stb(ptr, val, bmask):
    """``st`` with a per-block mask [NB] (or None), like ``ldb``."""
    if bmask is None:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=bmask[:, None])


@jit
def st_scale(scale, lo, absmax, bmask, BLOCK: tl.constexpr):
    """Store the per-block scales [NB] (a row reduction of the tile) at ``scale + block``.

    Written as a masked [NB, BLOCK/2] store of the broadcast value, one element per block enabled: a plain [NB]
    store makes Triton convert the reduction's layout to a 1-D one through shared memory, with two barriers per
    tile, which stalls all warps of the program mid-update."""
    first = (lo % BLOCK) == 0
    if bmask is not None:
        first = first & bmask[:, None]
    tl.store(scale + lo // BLOCK, tl.broadcast_to(absmax[:, None], lo.shape), mask=first)


# Stochastic rounding's random bits: a counter hash of (step seed, the element's place in its bucket), the same in
# both paths (stochastic_round_bf16), so the kernel and the reference round identically. A Weyl step, one xorshift
# and one multiply give the 16 high bits: 7 integer instructions per element where Philox (tl.randint) needs ~40.
# Quality needed here is only that the bits be uniform and unrelated to the weights' low bits (unbiased rounding);
# two elements share their bits only if their places differ by a multiple of 2^32 or steps pair up with far places.
# The constants are repeated as literals in _weyl and stochastic_round_bf16.
@jit
def _sr_bits(place, seed):
    x = place.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32) * 0x85EBCA77
    x = (x ^ (x >> 15)) * 0x2C1B3C6D
    return x >> 16


# The first moment's dither, for formats that round it stochastically (adamw4bit.py): 23 bits per element from a
# Weyl sequence over (the element's index in its tensor, step seed), 2 instructions per element (an add to a
# per-thread constant, then the shift, which ptxas folds into the format's add). Stochastic rounding needs each
# element's bits to be uniform over the steps and unrelated to the value being rounded; a Weyl sequence gives that
# (the seed's multiplier is odd, so one element's bits step through all 2^32 values), and neighbouring elements' bits
# differ by the golden ratio's fraction, which spreads a block's rounding errors evenly. The seed's multiplier
# differs from _sr_bits' so that the moment's and the weight's rounding do not draw related bits. The index is the
# tensor's, not the bucket's, so that grouping (optimizer-in-backward's one optimizer per parameter) rounds alike.
# Twin: ``m_dither``.
_M_DITHER_SEED = 0xC2B2AE3D
_M_DITHER_SEED_TL = tl.constexpr(_M_DITHER_SEED)


@jit
def _m_dither(t_base, off, seed):
    k = t_base.to(tl.uint32) * 0x9E3779B1 + seed.to(tl.uint32) * _M_DITHER_SEED_TL
    return (k + off.to(tl.uint32) * 0x9E3779B1) >> 9


def _weyl(place: int, n: int, seed: int, seed_mult: int, device=None) -> torch.Tensor:
    """The Weyl step both random-bit sources start from, in 32-bit arithmetic as the kernel's: (place + i) *
    0x9E3779B1 + seed * seed_mult for i < n, as int64 values in [0, 2^32)."""
    M = 0xFFFFFFFF
    idx = (torch.arange(n, dtype=torch.int64, device=device) + place) & M
    return (idx * 0x9E3779B1 + (seed & M) * seed_mult) & M


def m_dither(place: int, n: int, seed: int, device=None) -> torch.Tensor:
    """The kernel's first-moment dither (``_m_dither``) for a tensor's elements place .. place + n - 1: int64 in
    [0, 2^23)."""
    return _weyl(place, n, seed, _M_DITHER_SEED, device) >> 9


@jit
def _write_param(p_ptr, e_ptr, off, mask, x_new, seed, s_base, COMPENSATE: tl.constexpr, STOCHASTIC: tl.constexpr):
    out_ty = p_ptr.dtype.element_ty
    if STOCHASTIC:
        # Add 16 random low bits, then truncate to bf16: rounds up with probability equal to the dropped fraction.
        r = _sr_bits(s_base.to(tl.uint32) + off.to(tl.uint32), seed)
        bits = (x_new.to(tl.uint32, bitcast=True) + r) & 0xFFFF0000
        st(p_ptr + off, bits.to(tl.float32, bitcast=True).to(out_ty), mask)
    else:
        p_new = round_to(x_new, out_ty)
        st(p_ptr + off, p_new, mask)
        if COMPENSATE:
            st(e_ptr + off, (x_new - p_new.to(tl.float32)).to(e_ptr.dtype.element_ty), mask)


@jit
def _udiv(x, d: tl.constexpr):
    """x // d for x >= 0 and d a power of two: a shift (signed // needs a round-towards-zero fix-up)."""
    return (x.to(tl.uint64) // d).to(tl.int64)


@jit
def _f32(x):
    return tl.full((), x, tl.float32)


@jit
def _hparams(hp_tab, hp_idx, t, hp0, ONE_ROW: tl.constexpr):
    """Tensor t's hyper-parameters: its row of hp_tab (rows are shared by the tensors of a group and step), or with
    ONE_ROW (one group, one step count: the usual case) the row hp0 passed as kernel arguments."""
    if ONE_ROW:
        # As fp32 scalars: the interpreter (CI) would keep Python floats and do their arithmetic in float64
        lr, wd, b1, b2, eps, ss, isb, sign = hp0
        return (_f32(lr), _f32(wd), _f32(b1), _f32(b2), _f32(eps), _f32(ss), _f32(isb), _f32(sign))
    else:
        hp = hp_tab + tl.load(hp_idx + t) * 8
        return (tl.load(hp), tl.load(hp + 1), tl.load(hp + 2), tl.load(hp + 3), tl.load(hp + 4), tl.load(hp + 5),
                tl.load(hp + 6), tl.load(hp + 7))


@jit
def _find(j, t, cum_full):
    """The tensor holding full tile j, searching forward from tensor t (a program's tiles only ever move forward, so
    this walks each tensor boundary once): cum_full[t] <= j < cum_full[t + 1]. Returns (t, tile within tensor t)."""
    while j >= tl.load(cum_full + t + 1):
        t += 1
    return t, j - tl.load(cum_full + t)


@jit
def _locate(t, k, meta_tab, ptr_tab, p0, g0, TILE: tl.constexpr, BLOCK: tl.constexpr, ALIGNED: tl.constexpr):
    """Tile k of tensor t -> (param and grad pointers at the tile start, the tile's element offset in the bucket's
    state buffers, elements of the tensor from the tile start on, the tile's element offset in the tensor)."""
    t = t.to(tl.int64)
    base = k.to(tl.int64) * TILE
    numel = tl.load(meta_tab + t * 2)
    s_off = tl.multiple_of(tl.load(meta_tab + t * 2 + 1), BLOCK)  # state slices start on block boundaries
    p_ptr = tl.load(ptr_tab + t * 2).to(p0.dtype)
    g_ptr = tl.load(ptr_tab + t * 2 + 1).to(g0.dtype)
    # Values read from tables carry no alignment facts, and without them Triton emits one load per element
    # (measured: 4x slower). For the params we promise 16-byte addresses only when the host checked them.
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    return p_ptr + base, g_ptr + base, s_off + base, numel - base, base


@jit
def _ld_param(ptr, off, emask, HI: tl.constexpr, BLOCK: tl.constexpr, WORDS: tl.constexpr):
    """A half tile (HI: the upper halves of its blocks) of weights or grads. bf16 full tiles come as int32 words of
    two values ([NB, BLOCK/4]), turned into fp32 by ``_to_f32`` with one shift or one and per value: Triton's bf16
    -> fp32 conversion of a packed pair spends a byte permute and a multiply on the upper value. WORDS: the address
    is known to be 4-byte aligned (a bf16 tensor may start 2 bytes off: word loads would then fault)."""
    if WORDS and (emask is None) and (ptr.dtype.element_ty == tl.bfloat16):
        NB: tl.constexpr = off.shape[0]
        K: tl.constexpr = BLOCK // 4
        w = tl.arange(0, NB)[:, None] * (BLOCK // 2) + tl.arange(0, K)[None, :] + HI * K
        return tl.load(ptr.to(tl.pointer_type(tl.int32)) + w)
    else:
        return ld(ptr + off, emask, 0.0)


@jit
def _to_f32(x):
    """fp32 of a loaded half tile (see ``_ld_param``)."""
    if x.dtype == tl.int32:  # bf16 pairs: element 2i is the low half of word i
        f = tl.join((x << 16).to(tl.float32, bitcast=True), (x & -65536).to(tl.float32, bitcast=True))
        return tl.reshape(f, (x.shape[0], 2 * x.shape[1]))
    else:
        return x.to(tl.float32)


@jit
def _fetch(p_ptr, g_ptr, err_ptr, m_codes, m_scale, v_codes, v_scale, s_base, lo, hi, rows, emask_lo, emask_hi,
           bmask, BLOCK: tl.constexpr, EPC: tl.constexpr, LOAD: tl.constexpr, COMPENSATE: tl.constexpr,
           WORDS: tl.constexpr):
    """Issue every load of one tile (raw: bf16 weights and grads, codes and scales); no arithmetic on them."""
    p_lo = _ld_param(p_ptr, lo, emask_lo, 0, BLOCK, WORDS)
    p_hi = _ld_param(p_ptr, hi, emask_hi, 1, BLOCK, WORDS)
    g_lo = _ld_param(g_ptr, lo, emask_lo, 0, BLOCK, WORDS)
    g_hi = _ld_param(g_ptr, hi, emask_hi, 1, BLOCK, WORDS)
    if COMPENSATE:  # our own buffer: always aligned
        e_lo = _ld_param(err_ptr + s_base, lo, emask_lo, 0, BLOCK, True)
        e_hi = _ld_param(err_ptr + s_base, hi, emask_hi, 1, BLOCK, True)
    else:
        e_lo = p_lo
        e_hi = p_hi
    c_off = _udiv(s_base, EPC)
    b_off = _udiv(s_base, BLOCK)
    mc_lo, mc_hi, ms = LOAD(m_codes + c_off, m_scale + b_off, lo, hi, rows, bmask)
    vc_lo, vc_hi, vs = LOAD(v_codes + c_off, v_scale + b_off, lo, hi, rows, bmask)
    return p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs


@jit
def _update_tile(p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs, p_ptr, err_ptr,
                 m_codes, m_scale, v_codes, v_scale, lut, s_base, lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign,
                 lo, hi, rows, emask_lo, emask_hi, bmask, seed, t_base,
                 BLOCK: tl.constexpr, EPC: tl.constexpr, DECODE: tl.constexpr, STORE: tl.constexpr,
                 COMPENSATE: tl.constexpr, STOCHASTIC: tl.constexpr):
    """Decode, update and store one fetched tile. Returns max(|g|) of the lo/hi element pairs, NaN where either g
    is NaN: the kernel folds it into a running max, its only trace of non-finite gradients in the hot loop (see
    ``_count_nonfinite``)."""
    g_lo = _to_f32(g_lo)
    g_hi = _to_f32(g_hi)
    m_lo, m_hi = DECODE(mc_lo, mc_hi, ms, lut, True)
    v_lo, v_hi = DECODE(vc_lo, vc_hi, vs, lut, False)
    x_lo, m_lo, v_lo, r_lo = _adam_math(_to_f32(p_lo), g_lo, m_lo, v_lo, _to_f32(e_lo), lr, wd, b1, b2, eps,
                                        step_size, inv_sqrt_bc2, sign, COMPENSATE)
    x_hi, m_hi, v_hi, r_hi = _adam_math(_to_f32(p_hi), g_hi, m_hi, v_hi, _to_f32(e_hi), lr, wd, b1, b2, eps,
                                        step_size, inv_sqrt_bc2, sign, COMPENSATE)
    c_off = _udiv(s_base, EPC)
    b_off = _udiv(s_base, BLOCK)
    # the first moment's "root" arguments carry its dither (formats without one ignore them; the compiler drops
    # the computation)
    STORE(m_codes + c_off, m_scale + b_off, lo, hi, rows, bmask, m_lo, m_hi, _m_dither(t_base, lo, seed),
          _m_dither(t_base, hi, seed), lut, True)
    STORE(v_codes + c_off, v_scale + b_off, lo, hi, rows, bmask, v_lo, v_hi, r_lo, r_hi, lut, False)
    e_ptr = err_ptr + s_base
    _write_param(p_ptr, e_ptr, lo, emask_lo, x_lo, seed, s_base, COMPENSATE, STOCHASTIC)
    _write_param(p_ptr, e_ptr, hi, emask_hi, x_hi, seed, s_base, COMPENSATE, STOCHASTIC)
    return _nanmax(tl.abs(g_lo), tl.abs(g_hi))


@jit
def _nonfinite(g):
    """How many elements of g the guard skips (NaN, +-inf, |g| > _G_MAX)."""
    return tl.sum(tl.sum((~(tl.abs(g.to(tl.float32)) <= _G_MAX_TL)).to(tl.int32), axis=1), axis=0)


@jit
def _count_nonfinite(pid, G, n_full, n_tail, cum_full, tail_tab, meta_tab, ptr_tab, p0, g0, lo, hi,
                     TILE: tl.constexpr, BLOCK: tl.constexpr, RUN: tl.constexpr, ALIGNED: tl.constexpr):
    """Non-finite gradient elements of this program's tiles, by walking them again (reading only the gradients).

    Counting in the update itself cost ~5 instructions per element (an integer per element, and the non-finite
    flags no longer fit the predicate registers: spilled to general ones and back), a quarter of the 4-bit step's
    instructions; a running max of |g| that keeps NaN costs 1. Only programs that saw a non-finite gradient come
    here, so the second read of their share of the gradients happens only on steps with NaN or inf."""
    n = pid * 0
    t = pid * 0  # the tiles only move forward, as in the kernel's walk
    for c in range(pid, tl.cdiv(n_full, RUN), G):
        for j in range(c * RUN, tl.minimum(c * RUN + RUN, n_full)):
            t, k = _find(j, t, cum_full)
            p_ptr, g_ptr, s_base, rem, _ = _locate(t, k, meta_tab, ptr_tab, p0, g0, TILE, BLOCK, ALIGNED)
            n += _nonfinite(tl.load(g_ptr + lo)) + _nonfinite(tl.load(g_ptr + hi))
    for j in range(pid, n_tail, G):
        t = tl.load(tail_tab + 2 * j)
        p_ptr, g_ptr, s_base, rem, _ = _locate(t, tl.load(tail_tab + 2 * j + 1), meta_tab, ptr_tab, p0, g0, TILE,
                                               BLOCK, ALIGNED)
        r = rem.to(tl.int32)
        n += _nonfinite(tl.load(g_ptr + lo, mask=lo < r, other=0.0)) + _nonfinite(tl.load(g_ptr + hi, mask=hi < r,
                                                                                          other=0.0))
    return n


# The seed changes every step: Triton would otherwise specialize it (value 1, multiple of 16) and compile the kernel
# anew at steps 1, 2 and 16 (about 1.5 s each on the H200).
@jit(do_not_specialize=["seed"])
def _adamw_kernel(
    ptr_tab,  # int64 [T, 2]: address of each param and of its grad (rebuilt every step)
    meta_tab,  # int64 [T, 2]: numel, element offset of its state slice
    hp_tab,  # fp32 [R, 8]: lr, weight_decay, beta1, beta2, eps, lr / bc1, 1 / sqrt(bc2), sign (-1 maximize)
    hp_idx,  # int32 [T]: each tensor's row of hp_tab (one row per param group and step count, usually 1-2 rows)
    lr0, wd0, b10, b20, eps0, ss0, isb0, sign0,  # with ONE_ROW: the one row, as arguments (no table upload)
    cum_full, n_full,  # int64 [T + 1]: full tiles of the tensors before each one (a prefix sum); their total
    tail_tab, n_tail,  # int32 [n_tail, 2]: (tensor, tile within it) of each tensor's partial last tile, if any
    p0,  # the first param: only its pointer type is used, to type the addresses read from ptr_tab
    g0,  # the first grad, likewise
    m_codes, m_scale, v_codes, v_scale,
    lut,  # int32: the format's lookup table (StateFormat.table), or a dummy
    err_ptr,  # compensation buffer (same offsets as the states), or a dummy
    nonfinite_ptr,  # int32 [1]: count of skipped non-finite gradient elements
    seed,
    BLOCK: tl.constexpr, NB: tl.constexpr, EPC: tl.constexpr, RUN: tl.constexpr,
    LOAD: tl.constexpr, DECODE: tl.constexpr, STORE: tl.constexpr,
    COMPENSATE: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr, ONE_ROW: tl.constexpr,
    WORDS: tl.constexpr,  # every param and grad 4-byte aligned: bf16 full tiles load as int32 words (_ld_param)
):
    """Persistent: a grid of a few programs per SM; program i takes chunks i, i + G, ... of RUN consecutive full
    tiles (each chunk's tensor found from ``cum_full``), then tail tiles i, i + G, ... of the tail table. Full
    tiles are software-pipelined: the next tile's loads are issued before the current tile is decoded and updated,
    so every program keeps a tile of loads in flight while it computes (one tile per program at a time left the SMs
    idle between the load and store phases)."""
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    hp0 = (lr0, wd0, b10, b20, eps0, ss0, isb0, sign0)
    TILE: tl.constexpr = NB * BLOCK
    # Offsets inside a tile are small int32s; the 64-bit tile start goes into the base pointers. A tile is NB
    # blocks, each handled as two halves (lo, hi) so that 4-bit formats can pack element j with element
    # j + BLOCK/2 of the same block into one byte without shuffles.
    lo = tl.arange(0, NB)[:, None] * BLOCK + tl.arange(0, BLOCK // 2)[None, :]
    hi = lo + BLOCK // 2
    # Block index in the layout a row reduction produces (the per-block absmax): scales are loaded and stored in
    # that layout, so no per-tile layout conversion (a shared-memory round trip and a barrier) is needed.
    rows = tl.max(lo, axis=1) // BLOCK
    seen = tl.zeros(lo.shape, tl.float32)  # running max of |g|, NaN once a NaN was seen
    # Full tiles, in chunks of RUN consecutive tiles: program i takes chunks i, i + G, i + 2G, ... Inside a chunk
    # the tiles are almost always of one tensor, so the next tile's addresses are this one's plus a tile and the
    # tensor's table entries (addresses, state offset, hyper-parameters) are read only at a chunk's start or where
    # it crosses into the next tensor (reading them for every tile cost ~100 of the ~190 per-thread instructions a
    # tile needed besides its elements' own). Chunks rather than one long run per program keep all programs
    # streaming through nearby addresses at any moment (DRAM pages), as a plain grid-stride walk does.
    n_chunks = tl.cdiv(n_full, RUN)
    if pid < n_chunks:
        n_mine = tl.cdiv(n_chunks - pid, G)
        last = pid + (n_mine - 1) * G
        n_tiles = (n_mine - 1) * RUN + tl.minimum(RUN, n_full - last * RUN)
        j = pid * RUN
        t, k = _find(j, pid * 0, cum_full)  # (pid * 0: a tensor, as the loop needs; a literal 0 is a constexpr)
        end = tl.load(cum_full + t + 1)
        p_ptr, g_ptr, s_base, rem, t_base = _locate(t, k, meta_tab, ptr_tab, p0, g0, TILE, BLOCK, ALIGNED)
        lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign = _hparams(hp_tab, hp_idx, t, hp0, ONE_ROW)
        p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs = _fetch(
            p_ptr, g_ptr, err_ptr, m_codes, m_scale, v_codes, v_scale, s_base, lo, hi, rows, None, None, None,
            BLOCK, EPC, LOAD, COMPENSATE, WORDS)
        for q in tl.range(0, n_tiles, 1, num_stages=1):
            # Prefetch the next tile: the next of this chunk, or the first of this program's next chunk; after its
            # last tile a program fetches that tile again (one wasted tile per program).
            in_chunk = (q + 1) % RUN != 0
            jn = tl.where(q + 1 >= n_tiles, j, tl.where(in_chunk, j + 1, j + 1 + (G - 1) * RUN))
            if in_chunk & (q + 1 < n_tiles) & (j + 1 < end):
                t2 = t
                end2 = end
                p_ptr2 = p_ptr + TILE
                g_ptr2 = g_ptr + TILE
                s_base2 = s_base + TILE
                t_base2 = t_base + TILE
            else:
                t2, k2 = _find(jn, t, cum_full)
                end2 = tl.load(cum_full + t2 + 1)
                p_ptr2, g_ptr2, s_base2, rem2, t_base2 = _locate(t2, k2, meta_tab, ptr_tab, p0, g0, TILE, BLOCK,
                                                                  ALIGNED)
            p_lo2, p_hi2, g_lo2, g_hi2, e_lo2, e_hi2, mc_lo2, mc_hi2, ms2, vc_lo2, vc_hi2, vs2 = _fetch(
                p_ptr2, g_ptr2, err_ptr, m_codes, m_scale, v_codes, v_scale, s_base2, lo, hi, rows, None, None,
                None, BLOCK, EPC, LOAD, COMPENSATE, WORDS)
            g_abs = _update_tile(p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs, p_ptr,
                                 err_ptr, m_codes, m_scale, v_codes, v_scale, lut, s_base, lr, wd, b1, b2, eps,
                                 step_size, inv_sqrt_bc2, sign, lo, hi, rows, None, None, None, seed, t_base, BLOCK,
                                 EPC, DECODE, STORE, COMPENSATE, STOCHASTIC)
            seen = _nanmax(seen, g_abs)
            if t2 != t:
                lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign = _hparams(hp_tab, hp_idx, t2, hp0, ONE_ROW)
            j, t, end, p_ptr, g_ptr, s_base, t_base = jn, t2, end2, p_ptr2, g_ptr2, s_base2, t_base2
            p_lo, p_hi, g_lo, g_hi, e_lo, e_hi = p_lo2, p_hi2, g_lo2, g_hi2, e_lo2, e_hi2
            mc_lo, mc_hi, ms, vc_lo, vc_hi, vs = mc_lo2, mc_hi2, ms2, vc_lo2, vc_hi2, vs2
    # Each tensor's last, partial tile: element masks for the param and grad, block masks for the (padded) states.
    for j in range(pid, n_tail, G):
        t = tl.load(tail_tab + 2 * j)
        p_ptr, g_ptr, s_base, rem, t_base = _locate(t, tl.load(tail_tab + 2 * j + 1), meta_tab, ptr_tab, p0, g0,
                                                    TILE, BLOCK, ALIGNED)
        r = rem.to(tl.int32)
        emask_lo = lo < r
        emask_hi = hi < r
        bmask = rows * BLOCK < r
        p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs = _fetch(
            p_ptr, g_ptr, err_ptr, m_codes, m_scale, v_codes, v_scale, s_base, lo, hi, rows, emask_lo, emask_hi,
            bmask, BLOCK, EPC, LOAD, COMPENSATE, WORDS)
        lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign = _hparams(hp_tab, hp_idx, t, hp0, ONE_ROW)
        g_abs = _update_tile(p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs, p_ptr, err_ptr,
                             m_codes, m_scale, v_codes, v_scale, lut, s_base, lr, wd, b1, b2, eps, step_size,
                             inv_sqrt_bc2, sign, lo, hi, rows, emask_lo, emask_hi, bmask, seed, t_base, BLOCK, EPC,
                             DECODE, STORE, COMPENSATE, STOCHASTIC)
        seen = _nanmax(seen, g_abs)
    smax = tl.reduce(seen, None, _nanmax)
    if (smax > _G_MAX_TL) | (smax != smax):  # rare: a skipped gradient (see _G_MAX) in this program's tiles
        tl.atomic_add(nonfinite_ptr, _count_nonfinite(pid, G, n_full, n_tail, cum_full, tail_tab, meta_tab, ptr_tab,
                                                      p0, g0, lo, hi, TILE, BLOCK, RUN, ALIGNED))


# ---------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------

_FP32 = None  # the fallback format for small tensors; set by adamw.py at import (avoids an import cycle)


def _set_fp32_format(fmt: StateFormat) -> None:
    global _FP32
    _FP32 = fmt


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor the update works on: the local shard of a DTensor (FSDP2 parameters and their grads), as reals
    if it is complex, else the tensor itself.

    Each rank quantizes only its own shard: blocks never straddle ranks, uneven (even empty) shards work, and
    the kernel sees plain local tensors. The state is per rank, so a checkpoint of it is per rank too.
    A complex tensor is updated as ``torch.view_as_real`` of it (a view: real and imaginary parts interleaved), as
    torch.optim.AdamW does: the two parts are independent elements with moments of their own.
    """
    to_local = getattr(t, "to_local", None)
    if to_local is not None:
        t = to_local()
    return torch.view_as_real(t) if t.is_complex() and not t.is_sparse else t


def _no_4g_crossing(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of ``table`` that does not straddle a 4 GiB address boundary: the kernel's table gathers add
    their offsets to the low 32 bits of the address only (one instruction instead of two; adamw4bit.py). Of two
    back-to-back copies at most one can contain the boundary (a table is far smaller than 4 GiB)."""
    n = table.numel()
    buf = torch.empty(2 * n, dtype=table.dtype, device=device)
    start = buf.data_ptr()
    crosses = (start & 0xFFFFFFFF) + n * table.element_size() > 1 << 32
    out = buf[n:] if crosses else buf[:n]
    out.copy_(table)
    return out


class _Bucket:
    """Parameters that share one device, one dtype and one format, with their flat state buffers."""

    def __init__(self, fmt: StateFormat, params: list, device: torch.device, compensate: bool):
        self.fmt = fmt
        self.params = params
        self.device = device
        B = fmt.block_size
        self.numels = [_local(p).numel() for p in params]
        self.offsets = []
        total = 0
        for n in self.numels:
            self.offsets.append(total)
            total += -(-n // B) * B
        self.total = total
        epc = fmt.elems_per_code
        zeros = lambda n, dt: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        self.m_codes = zeros(total // epc, fmt.code_dtype)
        self.v_codes = zeros(total // epc, fmt.code_dtype)
        nblk = total // B if fmt.scaled else 1
        self.m_scale = zeros(nblk, torch.float32)
        self.v_scale = zeros(nblk, torch.float32)
        dtype = _local(params[0]).dtype  # a bucket's one dtype, as the kernel sees it (complex: its real dtype)
        self.err = zeros(total if compensate else 1, dtype)
        self.lut = _no_4g_crossing(fmt.table, device) if fmt.table is not None else zeros(1, torch.int32)
        self.compensate = compensate
        self._plan_key = None
        self._plans: list = []
        # Every param's step count in one CPU tensor: optimizer.state[p]["step"] is a 0-dim view of its entry, so
        # a step bumps them all in one op and reads them back in one .tolist().
        self.step_all = torch.zeros(len(params), dtype=torch.float32)
        self.uniform_t: Optional[float] = 0.0  # the step count all of them have, None if they differ
        self.group_of: list = []  # each param's param-group index (set by LowBitAdamW._init_state)
        self.one_group = True  # all of them in one group (likewise)
        self.all_active = tuple(range(len(params)))
        # DTensor parameters (FSDP2) are updated through their local shards, complex ones through their real views
        # (_local); plain ones skip the lookup
        self.wrapped = any(hasattr(p, "to_local") or p.is_complex() for p in params)

    def __getstate__(self) -> dict:
        # (copy.deepcopy, pickle) The launch plans hold this process's addresses and compiled kernel: rebuilt on the
        # next step.
        return dict(self.__dict__, _plan_key=None, _plans=[])

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.fmt.table is not None:  # the copied table may straddle a 4 GiB boundary (see _no_4g_crossing)
            self.lut = _no_4g_crossing(self.fmt.table, self.device)

    def read_steps(self) -> list:
        """Every param's step count (one ``.tolist()``), noting in ``uniform_t`` whether they are all equal."""
        steps = self.step_all.tolist()
        self.uniform_t = steps[0] if steps.count(steps[0]) == len(steps) else None
        return steps

    def views(self, i: int) -> dict:
        """Per-parameter views of the flat buffers, as stored in ``optimizer.state[p]``."""
        fmt, B, epc = self.fmt, self.fmt.block_size, self.fmt.elems_per_code
        nblk = -(-self.numels[i] // B)
        lo = self.offsets[i]
        out = {
            "exp_avg": self.m_codes[lo // epc: (lo + nblk * B) // epc].view(nblk, B // epc),
            "exp_avg_sq": self.v_codes[lo // epc: (lo + nblk * B) // epc].view(nblk, B // epc),
        }
        if fmt.scaled:
            out["exp_avg_scale"] = self.m_scale[lo // B: lo // B + nblk]
            out["exp_avg_sq_scale"] = self.v_scale[lo // B: lo // B + nblk]
        if self.compensate:
            out["error"] = self.err[lo: lo + nblk * B].view(nblk, B)
        return out

    def plans(self, active: tuple, nb: int, first_share: float) -> list:
        """Launch tables for one set of active tensors, as (j0, j1, plan) per launch over ``active[j0:j1]``
        (cached: normally every step has the same set). With ``first_share`` > 0 the first launch takes the
        shortest prefix holding that share of the elements, the second the rest (see LowBitAdamW._step_triton)."""
        key = (active, nb, first_share)
        if self._plan_key != key:
            cut = len(active)
            if first_share > 0 and len(active) > 1:
                sizes = [self.numels[i] for i in active]
                total, acc, cut = sum(sizes), 0, 0
                while cut < len(active) - 1 and acc < first_share * total:
                    acc += sizes[cut]
                    cut += 1
            spans = [(0, cut), (cut, len(active))] if cut < len(active) else [(0, cut)]
            # keep one set of plans: a changing active set is rare
            self._plans = [(j0, j1, self._plan(active[j0:j1], nb)) for j0, j1 in spans]
            self._plan_key = key
        return self._plans

    def _plan(self, active: tuple, nb: int) -> "_Plan":
        tile = nb * self.fmt.block_size
        numels = torch.tensor([self.numels[i] for i in active], dtype=torch.int64)
        meta = torch.stack([numels, torch.tensor([self.offsets[i] for i in active], dtype=torch.int64)], 1)
        n_full = numels // tile
        tensors = torch.arange(len(active), dtype=torch.int32)
        # Full tiles are found in the kernel from this prefix sum (a per-tile table would be ~50 MB for a 7B
        # model: 6.6 M tiles); only the partial last tiles, at most one per tensor, are listed.
        cum_full = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(n_full, 0)])
        has_tail = numels % tile != 0
        tail = torch.stack([tensors[has_tail], n_full[has_tail].to(torch.int32)], 1)
        dev = self.device
        plan = _Plan(meta.to(dev), cum_full.to(dev), int(cum_full[-1]), tail.to(dev), len(tail))
        plan.numels_aligned = all(self.numels[i] % 16 == 0 for i in active)
        return plan


class _Plan:
    """A launch's tables (a bucket's active tensors, or a share of them), plus the last uploaded addresses and row
    indices and the kernel compiled for them."""

    def __init__(self, meta, cum_full, n_full, tail, n_tail):
        self.meta, self.cum_full, self.n_full, self.tail, self.n_tail = meta, cum_full, n_full, tail, n_tail
        self.ptrs = self.ptr_t = self.idx = self.idx_t = None
        self.aligned = self.numels_aligned = self.words = False
        self.compiled = None  # (specialization key, Triton's compiled kernel) of the last launch


# Tiles per chunk of the kernel's walk (see _adamw_kernel): long enough to amortise a table lookup, short enough
# that all programs stay in nearby addresses.
_RUN = 8

_SM_COUNT: dict = {}


def _programs(device: torch.device, per_sm: int) -> int:
    """Size of the persistent grid: ``per_sm`` programs per SM (on CPU, for the interpreter: a few, so that the
    tests walk the loop over several tiles per program)."""
    if device.type != "cuda":
        return 3
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device] * per_sm


class LowBitAdamW(Optimizer):
    """AdamW with the state format chosen by a subclass. Use the public classes, not this one."""

    FORMAT: StateFormat = None  # set by each public class
    # A bucket of at least _SPLIT_MIN_NUMEL elements is updated in two launches, the first over _FIRST_SHARE of the
    # elements (see _step_triton); tests lower the threshold to run the split on small problems.
    _FIRST_SHARE = 0.1
    _SPLIT_MIN_NUMEL = 1 << 24

    def __init__(
        self,
        params,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        backend: str = "auto",
        min_quant_numel: int = 4096,
        stochastic_round: Optional[bool] = None,
        compensate: bool = False,
        tile_blocks: Optional[int] = None,
        num_warps: Optional[int] = None,
        programs_per_sm: Optional[int] = None,
        _format: Optional[StateFormat] = None,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"lr must be a float or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        if not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {float(lr)} (must be >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
        for i, b in enumerate(betas):
            if isinstance(b, torch.Tensor) and b.numel() != 1:
                raise ValueError(f"Tensor betas[{i}] must be 1-element")
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {float(b)} (must be in [0, 1))")
        # torch.optim.AdamW's rule, in its words
        if not (all(isinstance(b, float) for b in betas) or all(isinstance(b, torch.Tensor) for b in betas)):
            raise ValueError("betas must be either both floats or both Tensors")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if amsgrad:
            raise NotImplementedError(f"{type(self).__name__} does not implement amsgrad; use torch.optim.AdamW")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if backend == "triton" and not HAVE_TRITON:
            raise RuntimeError(f"backend='triton' needs Triton: {INSTALL_HINT}")
        if stochastic_round is None:
            # On unless compensate is asked for: the two are alternative cures for the same loss (see
            # docs/optimizers.md, "bf16 weights"), and without either a bf16 weight drops every update below half an
            # ulp of itself. Applies to bf16 weights only.
            stochastic_round = not compensate
        elif stochastic_round and compensate:
            raise ValueError("stochastic_round and compensate are alternatives; pick one")
        self.format = _format or self.FORMAT
        self.backend = backend
        self.min_quant_numel = int(min_quant_numel)
        self.stochastic_round = bool(stochastic_round)
        self.compensate = bool(compensate)
        self.tile_blocks = tile_blocks  # Triton tuning knobs (bench/optimizer_step.py sweeps them); None = default
        self.num_warps = num_warps
        self.programs_per_sm = programs_per_sm
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=maximize,
                        state_format=self.format.name)
        super().__init__(params, defaults)
        self._buckets: Optional[list[_Bucket]] = None
        self._seed = 0
        self.nonfinite_count: Optional[torch.Tensor] = None

    # -- state -------------------------------------------------------------------------------------------

    def _param_format(self, p: torch.Tensor) -> StateFormat:
        # (a DTensor's global size, so that every rank picks the same format; a complex tensor's count of reals)
        if self.format.scaled and p.numel() * (2 if p.is_complex() else 1) < self.min_quant_numel:
            return _FP32  # tiny tensors (norms, biases): full-precision states cost nothing and lose nothing
        return self.format

    def _init_state(self) -> None:
        self._buckets = []
        self._add_buckets([p for group in self.param_groups for p in group["params"]])

    def _add_buckets(self, params: list) -> None:
        """State buffers for ``params``, which have none yet: all params at the first step, or a group added by
        ``add_param_group`` after it (in buckets of its own: the existing flat buffers cannot grow in place)."""
        groups: dict = {}
        for p in params:
            if not _local(p).is_contiguous():
                raise ValueError(f"{type(self).__name__} needs contiguous parameters; got one of shape "
                                 f"{tuple(p.shape)} with strides {_local(p).stride()}")
            fmt = self._param_format(p)
            key = (_local(p).device, _local(p).dtype, fmt.name)
            groups.setdefault(key, (fmt, []))[1].append(p)
        new = []
        for (device, dtype, _), (fmt, ps) in groups.items():
            compensate = self.compensate and dtype in (torch.bfloat16, torch.float16)
            b = _Bucket(fmt, ps, device, compensate)
            self._link_state(b)
            new.append(b)
        if self.nonfinite_count is None or (new and not self._buckets):
            # on the params' device, for the kernel's atomic add (a CPU placeholder while there are none)
            dev = _local(params[0]).device if params else torch.device("cpu")
            self.nonfinite_count = torch.zeros(1, dtype=torch.int32, device=dev)
        # largest first: the big bucket's first launch is not held up by the host work of small ones
        self._buckets = sorted(self._buckets + new, key=lambda b: -b.total)
        group_index = {id(p): k for k, group in enumerate(self.param_groups) for p in group["params"]}
        for b in new:
            b.group_of = [group_index[id(p)] for p in b.params]
            b.one_group = len(set(b.group_of)) == 1

    def _link_state(self, b: _Bucket) -> None:
        """``self.state[p]`` of the bucket's params: views of its buffers (and of its step counts)."""
        for i, p in enumerate(b.params):
            st = self.state[p]
            st["step"] = b.step_all[i]
            st.update(b.views(i))

    def add_param_group(self, param_group: dict) -> None:
        """torch's, and after the first step the new params get their state at once, as if they had been there
        from the start without a grad so far (torch.optim.Optimizer.__init__ calls this before our state exists)."""
        super().add_param_group(param_group)
        if getattr(self, "_buckets", None) is not None:
            self._add_buckets(self.param_groups[-1]["params"])

    # -- copies ------------------------------------------------------------------------------------------

    # Ours, beyond the defaults, state and param groups that torch.optim.Optimizer.__getstate__ keeps
    _COPIED = ("format", "backend", "min_quant_numel", "stochastic_round", "compensate", "tile_blocks", "num_warps",
               "programs_per_sm", "_buckets", "_seed", "nonfinite_count")

    def __getstate__(self) -> dict:
        """For copy.deepcopy and pickle (torch.save(optimizer), multiprocessing): torch's state plus ours."""
        state = super().__getstate__()
        state.update((k, self.__dict__[k]) for k in self._COPIED)
        if self._buckets is not None:
            # self.state holds views of the buckets' buffers: pickle would write each view out as a tensor of its
            # own (twice the bytes, and no longer views). __setstate__ makes them again from the buckets.
            state["state"] = defaultdict(dict)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for b in self.__dict__.get("_buckets") or ():
            self._link_state(b)

    # -- step --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._buckets is None:
            self._init_state()
        self._seed += 1
        # Host work is per step and per parameter (291 tensors for Llama2-7B), on the critical path whenever the
        # GPU waits for it (~1 ms of a 16-20 ms step on the H200's host): keep it to C-level list walks. The step
        # counts are bumped and read in one op each; in the usual case (all grads present, one param group, one
        # step count) the one hyper-parameter row goes to the kernel as arguments, with no table upload, and a
        # large bucket on the GPU takes _step_early, which starts the GPU before walking most of the grads.
        for b in self._buckets:
            if self._step_early(b):
                continue
            grads = list(map(_GRAD, b.params))
            if not any(map(operator.is_, grads, _NONES)):
                active = b.all_active
                b.step_all += 1
            else:
                active = tuple(i for i, g in enumerate(grads) if g is not None)
                if not active:
                    continue
                b.step_all[list(active)] += 1
                grads = [grads[i] for i in active]
            steps = b.read_steps()
            if b.one_group and len(active) == len(steps) and b.uniform_t is not None:
                rows, idx = [self._hp_row(b.group_of[0], steps[0])], None
            else:
                rows, row_of, idx = [], {}, []
                for i in active:
                    key = (b.group_of[i], steps[i])
                    r = row_of.get(key)
                    if r is None:
                        r = row_of[key] = len(rows)
                        rows.append(self._hp_row(*key))
                    idx.append(r)
            if self._use_triton(b.device):
                self._step_triton(b, active, grads, rows, idx)
            else:
                for j, i in enumerate(active):
                    self._step_torch(b, i, rows[idx[j] if idx is not None else 0])
        return loss

    def _hp_row(self, group_index: int, t: int) -> list:
        """The kernel's fp32 hyper-parameter row for a param group at step count t (see ``_adamw_kernel``)."""
        g = self.param_groups[group_index]
        b1, b2 = (float(x) for x in g["betas"])
        lr = float(g["lr"])
        return [lr, float(g["weight_decay"]), b1, b2, float(g["eps"]), lr / (1.0 - b1 ** t),
                1.0 / math.sqrt(1.0 - b2 ** t), -1.0 if g["maximize"] else 1.0]

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        usable = triton_usable(device)
        if self.backend == "triton" and not usable:
            raise RuntimeError(
                f"backend='triton' cannot run on {device}: the Triton path needs CUDA tensors (or CPU tensors "
                f"with TRITON_INTERPRET=1 set before import, for tests). Use backend='torch' or 'auto'.")
        return usable if self.backend == "triton" else device.type == "cuda" and usable

    def _tile_blocks(self, b: _Bucket) -> int:
        nb = self.tile_blocks or b.fmt.tile_blocks
        if b.device.type == "cpu" and not self.tile_blocks:
            # Under TRITON_INTERPRET (tests) every op costs Python overhead, whatever the tile's size: bigger tiles
            # mean fewer loop iterations. NB is a constexpr of the same code, so the logic tested is unchanged.
            nb = max(nb, 2048 // b.fmt.block_size)
        return nb

    def _step_early(self, b: _Bucket) -> bool:
        """The usual step of a large bucket on the Triton path, ordered so that the GPU starts early: read the grads
        of the first launch's tensors only (a tenth of the elements, ~30 of 291 tensors for Llama2-7B), launch,
        then read the rest and launch again. The general path reads all grads, bumps and reads back the step
        counts before any launch: ~0.4 ms on the H200's host, the GPU idle meanwhile. Needs all step counts equal
        (``b.uniform_t``, kept by every step and by load_state_dict) and one param group; returns False, having
        done nothing, where it does not apply."""
        if (b.uniform_t is None or not b.one_group or b.total < self._SPLIT_MIN_NUMEL or len(b.params) < 2
                or not self._use_triton(b.device)):
            return False
        plans = b.plans(b.all_active, self._tile_blocks(b), self._FIRST_SHARE)
        if len(plans) != 2:
            return False
        (_, cut, first), (_, _, second) = plans
        g1 = list(map(_GRAD, b.params[:cut]))
        if any(map(operator.is_, g1, _NONES)):
            return False
        t = b.uniform_t + 1
        rows = [self._hp_row(b.group_of[0], t)]
        self._run_piece(b, first, b.params[:cut], g1, rows, None, None)
        g2 = list(map(_GRAD, b.params[cut:]))
        if not any(map(operator.is_, g2, _NONES)):
            self._run_piece(b, second, b.params[cut:], g2, rows, None, None)
            b.step_all += 1
            b.uniform_t = t
            return True
        # Some of the rest have no grad: the first launch stands; the rest's active tensors (all at step t too)
        # go through the general launcher, with plans of their own.
        active = tuple(i for i in range(cut, len(b.params)) if g2[i - cut] is not None)
        b.step_all[list(range(cut)) + list(active)] += 1
        b.uniform_t = None
        if active:
            self._step_triton(b, active, [g2[i - cut] for i in active], rows, None)
        return True

    def _step_triton(self, b: _Bucket, active: tuple, grads: list, rows: list, idx: Optional[list]) -> None:
        """Launch the kernel for the active params of a bucket (grads: theirs); idx None: one hyper-parameter row.

        A large bucket goes in two launches: the first over the shortest prefix of its tensors holding
        ``_FIRST_SHARE`` of the elements, the second over the rest. The host's walk over the tensors (reading
        291 grads' addresses for Llama2-7B, ~0.5 ms on the H200's host) then overlaps the first launch's GPU work
        instead of preceding all of it; the price is one more launch (~0.15 ms of host, hidden behind the first
        launch's ~1.5 ms) and one kernel boundary (microseconds)."""
        share = self._FIRST_SHARE if b.total >= self._SPLIT_MIN_NUMEL else 0.0
        plans = b.plans(active, self._tile_blocks(b), share)
        params = b.params if len(active) == len(b.params) else [b.params[i] for i in active]
        hp_t = None
        if idx is not None:
            hp_t = torch.tensor(rows, dtype=torch.float32, pin_memory=b.device.type == "cuda").to(b.device,
                                                                                              non_blocking=True)
        whole = len(plans) == 1
        for j0, j1, plan in plans:
            if whole:
                self._run_piece(b, plan, params, grads, rows, idx, hp_t)
            else:
                self._run_piece(b, plan, params[j0:j1], grads[j0:j1], rows, None if idx is None else idx[j0:j1],
                                hp_t)

    def _run_piece(self, b: _Bucket, plan: _Plan, ps: list, gs: list, rows: list, idx: Optional[list],
                   hp_t: Optional[torch.Tensor]) -> None:
        """One launch over the tensors of ``plan`` (ps, gs: their params and grads; idx: their hyper-parameter
        rows, None for the one row ``rows[0]``; hp_t: ``rows`` on the device when idx is given)."""
        if plan.n_full + plan.n_tail == 0:  # every tensor of this launch has an empty shard on this rank
            return
        if b.wrapped:
            ps, gs = [_local(p) for p in ps], [_local(g) for g in gs]
        # The checks and address reads run as C-level map() calls (no Python bytecode per tensor): this host
        # work is on the step's critical path whenever the GPU waits for it. A grad that needs fixing (another
        # dtype via grad_dtype, sparse, or strided) is rare and fixed in a second pass.
        dt = ps[0].dtype  # a bucket has one dtype
        if not (all(map(_IS_CONTIGUOUS, gs)) and set(map(_DTYPE, gs)) == {dt}):
            gs = list(gs)
            for j, g in enumerate(gs):
                if g.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                if g.dtype != dt or not g.is_contiguous():
                    gs[j] = g.to(dtype=dt, memory_format=torch.contiguous_format)  # alive until the launch
        ptrs = [0] * (2 * len(gs))
        ptrs[0::2] = map(_DATA_PTR, ps)
        ptrs[1::2] = map(_DATA_PTR, gs)
        dev = b.device
        pin = dev.type == "cuda"
        # Uploads only when something changed: the addresses normally repeat (the caching allocator hands
        # torchtune's freshly allocated grads the same blocks), the row indices always do.
        if ptrs != plan.ptrs:
            if any(a % 16 for a in ptrs[1::2]):
                # A grad off a 16-byte boundary (a view into a flat buffer at an odd offset, say) would make the
                # whole launch use unaligned, element-wise loads (or, 2 bytes off, forbid word loads): a copy is
                # cheaper. Its new address changes every step, so this check repeats while such grads come.
                gs = list(gs)
                for j, a in enumerate(ptrs[1::2]):
                    if a % 16:
                        gs[j] = gs[j].clone(memory_format=torch.contiguous_format)  # alive until the launch
                        ptrs[2 * j + 1] = gs[j].data_ptr()
            plan.ptrs = ptrs
            plan.ptr_t = torch.tensor(ptrs, dtype=torch.int64, pin_memory=pin).to(dev, non_blocking=True)
            plan.aligned = plan.numels_aligned and all(a % 16 == 0 for a in ptrs)
            plan.words = all(a % 4 == 0 for a in ptrs)  # only a param can fail this now (grads are aligned)
        if idx is None:
            idx_t = hp_t = plan.meta  # (unread table arguments)
        else:
            if idx != plan.idx:
                plan.idx = idx
                plan.idx_t = torch.tensor(idx, dtype=torch.int32, pin_memory=pin).to(dev, non_blocking=True)
            idx_t = plan.idx_t
        self._launch(b, plan, self._tile_blocks(b), ps[0], gs[0], hp_t, idx_t, rows[0], idx is None)

    def _launch(self, b: _Bucket, plan: _Plan, nb: int, p0, g0, hp_t, idx_t, row0: list, one_row: bool) -> None:
        fmt, dev = b.fmt, b.device
        grid = max(1, min(max(plan.n_full, plan.n_tail), _programs(dev, self.programs_per_sm or fmt.programs_per_sm)))
        stochastic = self.stochastic_round and p0.dtype == torch.bfloat16
        args = (plan.ptr_t, plan.meta, hp_t, idx_t, *row0, plan.cum_full, plan.n_full, plan.tail, plan.n_tail,
                p0, g0, b.m_codes, b.m_scale, b.v_codes, b.v_scale, b.lut, b.err, self.nonfinite_count, self._seed,
                # constexprs, in the kernel's order: BLOCK, NB, EPC, RUN, LOAD, DECODE, STORE, COMPENSATE,
                # STOCHASTIC, ALIGNED, ONE_ROW, WORDS
                fmt.block_size, nb, fmt.elems_per_code, _RUN, fmt.triton_load, fmt.triton_decode, fmt.triton_store,
                b.compensate, stochastic, plan.aligned, one_row, plan.words)
        # Triton's launcher re-derives the kernel's specialization from every argument on every call (~0.15 ms of
        # host on the H200's CPU). The arguments that can change between this plan's launches are the flags and
        # the per-step tensors (their 16-byte alignment is all Triton specializes them on; the seed is not
        # specialized): when they repeat, the kernel compiled for the last launch is launched directly.
        key = (stochastic, plan.aligned, plan.words, one_row, self.num_warps,
               *(x.data_ptr() % 16 == 0 for x in (plan.ptr_t, hp_t, idx_t, p0, g0)))
        if plan.compiled is not None and plan.compiled[0] == key:
            plan.compiled[1][(grid, 1, 1)](*args)
            return
        kernel = _adamw_kernel[(grid,)](
            *args, num_warps=self.num_warps or fmt.num_warps,
            **({"maxnreg": fmt.max_registers} if fmt.max_registers and dev.type == "cuda" else {}))
        # (the interpreter returns no compiled kernel: it takes this path every time)
        plan.compiled = (key, kernel) if dev.type == "cuda" and hasattr(kernel, "__getitem__") else None

    def _step_torch(self, b: _Bucket, i: int, hp: list) -> None:
        """The reference path: same math as the kernel, one parameter at a time, in plain PyTorch."""
        st = self.state[b.params[i]]
        p, grad = _local(b.params[i]), _local(b.params[i].grad)
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        # fp32 scalars, like the kernel's table, so that both paths round the same way
        lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign = torch.tensor(hp, dtype=torch.float32,
                                                                           device=p.device).unbind()
        fmt, B = b.fmt, b.fmt.block_size
        n = p.numel()
        nblk = -(-n // B)

        def padded(x):
            x = x.reshape(-1).float()
            return torch.nn.functional.pad(x, (0, nblk * B - n)).view(nblk, B)

        g = padded(grad)
        finite = g.abs() <= _G_MAX  # the kernel's guard (see _G_MAX)
        x = padded(p)
        if b.compensate:
            x = x + st["error"].float()
        m = fmt.dequantize(st["exp_avg"], st.get("exp_avg_scale"), True)
        v = fmt.dequantize(st["exp_avg_sq"], st.get("exp_avg_sq_scale"), False)
        # the kernel's operations in the kernel's order (see _adam_math)
        m_new = torch.where(finite, b1 * m + ((1.0 - b1) * sign) * g, m)
        v_new = torch.where(finite, b2 * v + ((1.0 - b2) * g) * g, v)
        denom = v_new.sqrt() * inv_sqrt_bc2 + eps
        x_new = torch.where(finite, x * (1.0 - lr * wd) - step_size * (m_new / denom), x)
        bad = int((~finite).sum())  # padding is finite (zero), so this counts real elements only
        if bad:
            self.nonfinite_count += bad
        for key, val, signed in (("exp_avg", m_new, True), ("exp_avg_sq", v_new, False)):
            if signed and fmt.dithered_m:
                dither = m_dither(0, nblk * B, self._seed, p.device).view(nblk, B)
                codes, scale = fmt.quantize(val, signed, dither)
            else:
                codes, scale = fmt.quantize(val, signed)
            st[key].copy_(codes)
            if fmt.scaled:
                st[key + "_scale"].copy_(scale)
        flat = x_new.view(-1)[:n]
        if self.stochastic_round and p.dtype == torch.bfloat16:
            p.copy_(stochastic_round_bf16(flat, self._seed, b.offsets[i]).view_as(p))
        else:
            p_new = flat.to(p.dtype)
            p.copy_(p_new.view_as(p))
            if b.compensate:
                err = torch.zeros(nblk * B, dtype=torch.float32, device=p.device)
                err[:n] = flat - p_new.float()
                st["error"].copy_(err.view(nblk, B))

    # -- checkpointing -----------------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state saved by ``state_dict()`` of the same class, on any device.

        torch's generic loader would cast the uint8 codes to the parameter dtype, so we copy each saved tensor
        into our flat buffers instead, after checking the format, parameter count and shapes. As torch's, it runs
        the hooks registered with ``register_load_state_dict_pre_hook`` (which may return a replacement for the
        state dict) and ``register_load_state_dict_post_hook``.
        """
        state_dict = state_dict.copy()  # shallow, as torch's: a pre hook may change it, the caller's stays as is
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"loaded state has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for sg, g in zip(saved_groups, self.param_groups):
            fmt = sg.get("state_format", "<none: not an optimizers.* state>")
            if fmt != self.format.name:
                raise ValueError(
                    f"cannot load optimizer state of format {fmt!r} into {type(self).__name__} (format "
                    f"{self.format.name!r}); load it with the optimizer that saved it, or start the optimizer "
                    f"state afresh")
            if len(sg["params"]) != len(g["params"]):
                raise ValueError(f"loaded param group has {len(sg['params'])} params, this one has "
                                 f"{len(g['params'])}")
        if self._buckets is None:
            self._init_state()
        params = [p for g in self.param_groups for p in g["params"]]
        ids = [i for sg in saved_groups for i in sg["params"]]
        for pid, p in zip(ids, params):
            saved = state_dict["state"].get(pid)
            if saved is None:
                continue
            st = self.state[p]
            for key, val in saved.items():
                if key not in st:
                    raise ValueError(f"unexpected optimizer state entry {key!r} for a parameter of shape "
                                     f"{tuple(p.shape)}; was it saved with other options (compensate=...)?")
                if key == "step":  # into the bucket's step tensor, of which st["step"] is a view
                    # a tensor or, as torch.optim.AdamW also takes, a number
                    step = val.detach().to("cpu", torch.float32) if isinstance(val, torch.Tensor) else float(val)
                    st["step"].copy_(torch.as_tensor(step).reshape(()))
                    continue
                if not isinstance(val, torch.Tensor):
                    raise ValueError(f"optimizer state {key!r} for a parameter of shape {tuple(p.shape)} is a "
                                     f"{type(val).__name__}, expected a tensor")
                if val.shape != st[key].shape or val.dtype != st[key].dtype:
                    raise ValueError(f"optimizer state {key!r} for a parameter of shape {tuple(p.shape)}: saved "
                                     f"{tuple(val.shape)} {val.dtype}, expected {tuple(st[key].shape)} "
                                     f"{st[key].dtype}; it was saved with other options (min_quant_numel?)")
                st[key].copy_(val)
        for sg, g in zip(saved_groups, self.param_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v
        for b in self._buckets:
            b.read_steps()
        # The step seed (stochastic rounding's and the dithered first moment's bits) continues from the loaded step
        # count, so a resumed run rounds as the uninterrupted one did (exactly so when every step() updated every
        # parameter: the seed counts step() calls).
        self._seed = max((int(b.step_all.max()) for b in self._buckets), default=0)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def state_bytes(self) -> int:
        """Bytes held by the optimizer state on its devices (codes, scales, error buffers)."""
        if self._buckets is None:
            return 0
        total = 0
        for b in self._buckets:
            real = [b.m_codes, b.v_codes] + ([b.m_scale, b.v_scale] if b.fmt.scaled else [])
            real += [b.err] if b.compensate else []
            total += sum(t.numel() * t.element_size() for t in real)
        return total


def stochastic_round_bf16(x: torch.Tensor, seed: int, place: int = 0) -> torch.Tensor:
    """Round fp32 to bf16 up or down with probability proportional to the distance (unbiased). The random bits are
    the kernel's (``_sr_bits``): element i uses the hash of (seed, place + i), ``place`` being the first element's
    offset in its state bucket, so both paths give the same bits."""
    bits = x.float().contiguous().view(torch.int32).to(torch.int64)
    h = _weyl(place, x.numel(), seed, 0x85EBCA77, x.device).view(x.shape)
    h = ((h ^ (h >> 15)) * 0x2C1B3C6D) & 0xFFFFFFFF
    out = (bits + (h >> 16)) & -65536  # the carry into the sign bit cannot happen: |x| < max float
    return out.to(torch.int32).view(torch.float32).to(torch.bfloat16)
