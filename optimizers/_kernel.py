"""The Triton kernel: one multi-tensor AdamW update that every state format shares (``_adamw_kernel``).

A launch updates a bucket's tensors (same device, dtype and format; ``_launch.py`` builds the tables and launches).
A persistent grid of programs walks the tiles (``NB`` quantization blocks of one tensor each), loading the next tile
while it updates the current one. The format comes in as three constexpr helpers (``LOAD``, ``DECODE``, ``STORE``:
see ``StateFormat``), so each format gets its own compiled kernel with its code inlined. docs/optimizers/kernel.md
describes the design and the measurements behind it.

Update (fp32 math, torch.optim.AdamW semantics, decoupled weight decay)::

    p  <- p * (1 - lr * wd)
    m  <- b1 * m + (1 - b1) * g
    v  <- b2 * v + (1 - b2) * g * g
    p  <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Grouped arguments: ``hp`` is a tensor's hyper-parameters (lr, weight_decay, beta1, beta2, eps, lr / bc1,
1 / sqrt(bc2), sign: -1 to maximize), ``states`` the bucket's state buffers (m codes, m scales, v codes, v scales),
``raw`` a fetched tile's loads (``_fetch``).
"""

from ._format import ld, round_to, st
from ._random_bits import _m_dither, _sr_bits
from ._triton import HAVE_TRITON, INTERPRET, jit, tl

# The gradient guard: an element is updated only where |g| <= G_MAX, one compare that is false for NaN and +-inf and
# also for a finite g whose square overflows. g * g is inf in fp32 from |g| = 2^64 on, (1 - b2) g^2 from ~6e20 at
# b2 = 0.999, and one inf v poisons its block: an infinite block scale (8-bit, 4-bit: the block's other elements never
# move again) or NaN codes (FP8: NaN in every weight of the block). 2^63 keeps every stored v (at most the largest g^2
# it has seen, up to its format's rounding, for any b2) a factor 4 below fp32's max. Same instruction count as the
# NaN/inf compare alone (only the constant differs).
G_MAX = 2.0**63
_G_MAX_TL = tl.constexpr(G_MAX)

if HAVE_TRITON and not INTERPRET:
    from triton.language.extra import libdevice as _libdevice
else:
    _libdevice = None
# On the GPU the update's division is div.approx (one reciprocal and one multiply, <= 2 ulp): the IEEE-style
# division that `/` emits costs ~9 instructions per element, the largest single item of the 16-bit kernel. The
# interpreter has no libdevice, so CI runs `/`; the tests' tolerances cover both (GPU tests run the fast one).
_FAST_DIV = tl.constexpr(_libdevice is not None)


@jit
def _fdiv(a, b):
    if _FAST_DIV:
        return _libdevice.fast_dividef(a, b)
    else:
        return a / b


@jit
def _adam_math(p, g, m, v, e, hp, COMPENSATE: tl.constexpr):
    """Returns (x_new, m_new, v_new, sqrt(v_new)). A non-finite g makes m_new, v_new, x_new NaN or inf; the selects
    put the old values back (one select each, mostly folded into predicated multiply-adds)."""
    lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign = hp
    finite = tl.abs(g) <= _G_MAX_TL  # false for NaN, inf and a g whose square would overflow (see G_MAX)
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
        return (
            tl.load(hp),
            tl.load(hp + 1),
            tl.load(hp + 2),
            tl.load(hp + 3),
            tl.load(hp + 4),
            tl.load(hp + 5),
            tl.load(hp + 6),
            tl.load(hp + 7),
        )


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
def _fetch(
    p_ptr,
    g_ptr,
    err_ptr,
    states,
    s_base,
    lo,
    hi,
    rows,
    emask_lo,
    emask_hi,
    bmask,
    BLOCK: tl.constexpr,
    EPC: tl.constexpr,
    LOAD: tl.constexpr,
    COMPENSATE: tl.constexpr,
    WORDS: tl.constexpr,
):
    """Issue every load of one tile (raw: bf16 weights and grads, codes and scales); no arithmetic on them."""
    m_codes, m_scale, v_codes, v_scale = states
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
def _update_tile(
    raw,
    p_ptr,
    err_ptr,
    states,
    lut,
    s_base,
    hp,
    lo,
    hi,
    rows,
    emask_lo,
    emask_hi,
    bmask,
    seed,
    t_base,
    BLOCK: tl.constexpr,
    EPC: tl.constexpr,
    DECODE: tl.constexpr,
    STORE: tl.constexpr,
    COMPENSATE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Decode, update and store one fetched tile. Returns max(|g|) of the lo/hi element pairs, NaN where either g
    is NaN: the kernel folds it into a running max, its only trace of non-finite gradients in the hot loop (see
    ``_count_nonfinite``)."""
    p_lo, p_hi, g_lo, g_hi, e_lo, e_hi, mc_lo, mc_hi, ms, vc_lo, vc_hi, vs = raw
    m_codes, m_scale, v_codes, v_scale = states
    g_lo = _to_f32(g_lo)
    g_hi = _to_f32(g_hi)
    m_lo, m_hi = DECODE(mc_lo, mc_hi, ms, lut, True)
    v_lo, v_hi = DECODE(vc_lo, vc_hi, vs, lut, False)
    x_lo, m_lo, v_lo, r_lo = _adam_math(_to_f32(p_lo), g_lo, m_lo, v_lo, _to_f32(e_lo), hp, COMPENSATE)
    x_hi, m_hi, v_hi, r_hi = _adam_math(_to_f32(p_hi), g_hi, m_hi, v_hi, _to_f32(e_hi), hp, COMPENSATE)
    c_off = _udiv(s_base, EPC)
    b_off = _udiv(s_base, BLOCK)
    # the first moment's "root" arguments carry its dither (formats without one ignore them; the compiler drops
    # the computation)
    STORE(
        m_codes + c_off,
        m_scale + b_off,
        lo,
        hi,
        rows,
        bmask,
        m_lo,
        m_hi,
        _m_dither(t_base, lo, seed),
        _m_dither(t_base, hi, seed),
        lut,
        True,
    )
    STORE(v_codes + c_off, v_scale + b_off, lo, hi, rows, bmask, v_lo, v_hi, r_lo, r_hi, lut, False)
    e_ptr = err_ptr + s_base
    _write_param(p_ptr, e_ptr, lo, emask_lo, x_lo, seed, s_base, COMPENSATE, STOCHASTIC)
    _write_param(p_ptr, e_ptr, hi, emask_hi, x_hi, seed, s_base, COMPENSATE, STOCHASTIC)
    return _nanmax(tl.abs(g_lo), tl.abs(g_hi))


@jit
def _nonfinite(g):
    """How many elements of g the guard skips (NaN, +-inf, |g| > G_MAX)."""
    return tl.sum(tl.sum((~(tl.abs(g.to(tl.float32)) <= _G_MAX_TL)).to(tl.int32), axis=1), axis=0)


@jit
def _count_nonfinite(
    pid,
    G,
    n_full,
    n_tail,
    cum_full,
    tail_tab,
    meta_tab,
    ptr_tab,
    p0,
    g0,
    lo,
    hi,
    TILE: tl.constexpr,
    BLOCK: tl.constexpr,
    RUN: tl.constexpr,
    ALIGNED: tl.constexpr,
):
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
        p_ptr, g_ptr, s_base, rem, _ = _locate(
            t, tl.load(tail_tab + 2 * j + 1), meta_tab, ptr_tab, p0, g0, TILE, BLOCK, ALIGNED
        )
        r = rem.to(tl.int32)
        n += _nonfinite(tl.load(g_ptr + lo, mask=lo < r, other=0.0)) + _nonfinite(
            tl.load(g_ptr + hi, mask=hi < r, other=0.0)
        )
    return n


# The seed changes every step: Triton would otherwise specialize it (value 1, multiple of 16) and compile the kernel
# anew at steps 1, 2 and 16 (about 1.5 s each on the H200). Launched with keyword arguments (``_launch.kernel_args``).
@jit(do_not_specialize=["seed"])
def _adamw_kernel(
    ptr_tab,  # int64 [T, 2]: address of each param and of its grad (rebuilt every step)
    meta_tab,  # int64 [T, 2]: numel, element offset of its state slice
    hp_tab,  # fp32 [R, 8]: each row a ``hp`` (see the module docstring)
    hp_idx,  # int32 [T]: each tensor's row of hp_tab (one row per param group and step count, usually 1-2 rows)
    lr0,
    wd0,
    b10,
    b20,
    eps0,
    ss0,
    isb0,
    sign0,  # with ONE_ROW: the one row, as arguments (no table upload)
    cum_full,
    n_full,  # int64 [T + 1]: full tiles of the tensors before each one (a prefix sum); their total
    tail_tab,
    n_tail,  # int32 [n_tail, 2]: (tensor, tile within it) of each tensor's partial last tile, if any
    p0,  # the first param: only its pointer type is used, to type the addresses read from ptr_tab
    g0,  # the first grad, likewise
    m_codes,
    m_scale,
    v_codes,
    v_scale,
    lut,  # int32: the format's lookup table (StateFormat.table), or a dummy
    err_ptr,  # compensation buffer (same offsets as the states), or a dummy
    nonfinite_ptr,  # int32 [1]: count of skipped non-finite gradient elements
    seed,
    BLOCK: tl.constexpr,
    NB: tl.constexpr,
    EPC: tl.constexpr,
    RUN: tl.constexpr,
    LOAD: tl.constexpr,
    DECODE: tl.constexpr,
    STORE: tl.constexpr,
    COMPENSATE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    ALIGNED: tl.constexpr,
    ONE_ROW: tl.constexpr,
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
    states = (m_codes, m_scale, v_codes, v_scale)
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
        hp = _hparams(hp_tab, hp_idx, t, hp0, ONE_ROW)
        raw = _fetch(
            p_ptr, g_ptr, err_ptr, states, s_base, lo, hi, rows, None, None, None, BLOCK, EPC, LOAD, COMPENSATE, WORDS
        )
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
                p_ptr2, g_ptr2, s_base2, rem2, t_base2 = _locate(
                    t2, k2, meta_tab, ptr_tab, p0, g0, TILE, BLOCK, ALIGNED
                )
            raw2 = _fetch(
                p_ptr2,
                g_ptr2,
                err_ptr,
                states,
                s_base2,
                lo,
                hi,
                rows,
                None,
                None,
                None,
                BLOCK,
                EPC,
                LOAD,
                COMPENSATE,
                WORDS,
            )
            g_abs = _update_tile(
                raw,
                p_ptr,
                err_ptr,
                states,
                lut,
                s_base,
                hp,
                lo,
                hi,
                rows,
                None,
                None,
                None,
                seed,
                t_base,
                BLOCK,
                EPC,
                DECODE,
                STORE,
                COMPENSATE,
                STOCHASTIC,
            )
            seen = _nanmax(seen, g_abs)
            if t2 != t:
                hp = _hparams(hp_tab, hp_idx, t2, hp0, ONE_ROW)
            j, t, end, p_ptr, g_ptr, s_base, t_base = jn, t2, end2, p_ptr2, g_ptr2, s_base2, t_base2
            raw = raw2
    # Each tensor's last, partial tile: element masks for the param and grad, block masks for the (padded) states.
    for j in range(pid, n_tail, G):
        t = tl.load(tail_tab + 2 * j)
        p_ptr, g_ptr, s_base, rem, t_base = _locate(
            t, tl.load(tail_tab + 2 * j + 1), meta_tab, ptr_tab, p0, g0, TILE, BLOCK, ALIGNED
        )
        r = rem.to(tl.int32)
        emask_lo = lo < r
        emask_hi = hi < r
        bmask = rows * BLOCK < r
        raw = _fetch(
            p_ptr,
            g_ptr,
            err_ptr,
            states,
            s_base,
            lo,
            hi,
            rows,
            emask_lo,
            emask_hi,
            bmask,
            BLOCK,
            EPC,
            LOAD,
            COMPENSATE,
            WORDS,
        )
        hp = _hparams(hp_tab, hp_idx, t, hp0, ONE_ROW)
        g_abs = _update_tile(
            raw,
            p_ptr,
            err_ptr,
            states,
            lut,
            s_base,
            hp,
            lo,
            hi,
            rows,
            emask_lo,
            emask_hi,
            bmask,
            seed,
            t_base,
            BLOCK,
            EPC,
            DECODE,
            STORE,
            COMPENSATE,
            STOCHASTIC,
        )
        seen = _nanmax(seen, g_abs)
    smax = tl.reduce(seen, None, _nanmax)
    if (smax > _G_MAX_TL) | (smax != smax):  # rare: a skipped gradient (see G_MAX) in this program's tiles
        tl.atomic_add(
            nonfinite_ptr,
            _count_nonfinite(
                pid, G, n_full, n_tail, cum_full, tail_tab, meta_tab, ptr_tab, p0, g0, lo, hi, TILE, BLOCK, RUN, ALIGNED
            ),
        )
