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
    device, same dtype, same format) updates every parameter of the step. A table of per-tensor addresses and
    hyper-parameters is uploaded each step; each program handles one tile of ``NB`` quantization blocks of one
    tensor. No torch.compile, so the first step costs only Triton's compile (cached on disk afterwards).

Layout: all states of a bucket live in flat buffers; each parameter owns a block-aligned slice, padded up to a
whole block (padding stays exactly zero because its gradient and weight are read as zero). ``self.state[p]``
holds views of those slices, so ``state_dict()`` sees per-parameter tensors like any torch optimizer.

Update (fp32 math, torch.optim.AdamW semantics, decoupled weight decay)::

    p  <- p * (1 - lr * wd)
    m  <- b1 * m + (1 - b1) * g
    v  <- b2 * v + (1 - b2) * g * g
    p  <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Non-finite gradients: an element whose gradient is NaN or +-inf is not updated at all (its weight, moments and
error buffer keep their values) and is counted in ``optimizer.nonfinite_count`` (a device tensor, so no host
sync). torch.optim.AdamW would instead write NaN into the weight and both moments; with quantized states one
NaN would also poison the scale of its whole block, so we never let it in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch.optim import Optimizer

from ._triton import INSTALL_HINT, HAVE_TRITON, jit, tl, triton_usable

# Largest finite fp32: |g| <= this is false for NaN and inf, so one compare checks both.
_FP32_MAX = 3.4028234663852886e38
_FP32_MAX_TL = tl.constexpr(_FP32_MAX) if tl is not None else None


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
    # Triton path: @triton.jit load(codes, scale, qmap, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, SIGNED)
    # -> (lo, hi) fp32 [NB, block/2]; store(codes, scale, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, lo, hi, SIGNED)
    triton_load: Any
    triton_store: Any
    # code -> value tables for the signed (first moment) and unsigned (second moment) maps, if the format has them
    qmap_signed: Optional[torch.Tensor] = None
    qmap_unsigned: Optional[torch.Tensor] = None
    bytes_per_element: float = 1.0  # per moment, excluding scales; for docs and the benchmark
    # Triton launch shape: blocks per program and warps, tuned on the H200 (bench/results/optimizer_sweep_h200.log)
    tile_blocks: int = 4
    num_warps: int = 4


# ---------------------------------------------------------------------------------------------------------
# Triton path: one kernel for all formats. LOAD/STORE are the format's jit helpers, passed as constexprs.
# ---------------------------------------------------------------------------------------------------------


@jit
def _adam_math(p, g, m, v, e, lr, wd, b1, b2, eps, step_size, inv_sqrt_bc2, sign, COMPENSATE: tl.constexpr):
    finite = tl.abs(g) <= _FP32_MAX_TL
    g = tl.where(finite, g * sign, 0.0)
    x = p
    if COMPENSATE:
        x = p + e
    m_new = b1 * m + (1.0 - b1) * g
    v_new = b2 * v + (1.0 - b2) * g * g
    denom = tl.sqrt(v_new) * inv_sqrt_bc2 + eps
    x_new = x * (1.0 - lr * wd) - step_size * (m_new / denom)
    m_new = tl.where(finite, m_new, m)
    v_new = tl.where(finite, v_new, v)
    x_new = tl.where(finite, x_new, x)
    return x_new, m_new, v_new, finite


@jit
def round_to(x, ty: tl.constexpr):
    """fp32 -> ``ty`` with round-to-nearest-even. For bf16 the rounding is spelled out in integer ops: the same
    result as the GPU's cvt.rn, and also under TRITON_INTERPRET, whose bf16 conversion does not round to even
    (CI would otherwise test a different function from the one the GPU runs). Inputs are finite here."""
    if ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(ty)


@jit
def _write_param(p_ptr, e_ptr, off, s_off, mask, x_new, seed, COMPENSATE: tl.constexpr, STOCHASTIC: tl.constexpr):
    out_ty = p_ptr.dtype.element_ty
    if STOCHASTIC:
        # Add 16 random low bits, then truncate to bf16: rounds up with probability equal to the dropped fraction.
        r = tl.randint(seed, s_off + off).to(tl.uint32) & 0xFFFF
        bits = (x_new.to(tl.uint32, bitcast=True) + r) & 0xFFFF0000
        tl.store(p_ptr + off, bits.to(tl.float32, bitcast=True).to(out_ty), mask=mask)
    else:
        p_new = round_to(x_new, out_ty)
        tl.store(p_ptr + off, p_new, mask=mask)
        if COMPENSATE:
            tl.store(e_ptr + s_off + off, (x_new - p_new.to(tl.float32)).to(e_ptr.dtype.element_ty), mask=mask)


@jit
def _adamw_kernel(
    ptr_tab,  # int64 [T, 2]: address of each param and of its grad (rebuilt every step)
    meta_tab,  # int64 [T, 4]: numel, element offset of its state slice, index of its first tile, unused
    hp_tab,  # fp32 [T, 8]: lr, weight_decay, beta1, beta2, eps, lr / bc1, 1 / sqrt(bc2), sign (-1 maximize)
    tile_tab,  # int32 [n_tiles]: which tensor each tile belongs to
    p0,  # the first param: only its pointer type is used, to type the addresses read from ptr_tab
    g0,  # the first grad, likewise
    m_codes, m_scale, v_codes, v_scale, qmap_m, qmap_v,
    err_ptr,  # compensation buffer (same offsets as the states), or a dummy
    nonfinite_ptr,  # int32 [1]: count of skipped non-finite gradient elements
    seed,
    BLOCK: tl.constexpr, NB: tl.constexpr,
    LOAD: tl.constexpr, STORE: tl.constexpr,
    COMPENSATE: tl.constexpr, STOCHASTIC: tl.constexpr, ALIGNED: tl.constexpr,
):
    tile = tl.program_id(0)
    t = tl.load(tile_tab + tile).to(tl.int64)
    numel = tl.load(meta_tab + t * 4)
    s_off = tl.load(meta_tab + t * 4 + 1)
    first = tl.load(meta_tab + t * 4 + 2)
    p_ptr = tl.load(ptr_tab + t * 2).to(p0.dtype)
    g_ptr = tl.load(ptr_tab + t * 2 + 1).to(g0.dtype)
    # Values read from tables carry no alignment facts, and without them Triton emits one load per element
    # (measured: 4x slower). State slices start on block boundaries by construction; for the params we
    # promise 16-element sizes and 16-byte addresses only when the host checked them (ALIGNED).
    s_off = tl.multiple_of(s_off, BLOCK)
    if ALIGNED:
        numel = tl.multiple_of(numel, 16)
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
    lr = tl.load(hp_tab + t * 8)
    wd = tl.load(hp_tab + t * 8 + 1)
    b1 = tl.load(hp_tab + t * 8 + 2)
    b2 = tl.load(hp_tab + t * 8 + 3)
    eps = tl.load(hp_tab + t * 8 + 4)
    step_size = tl.load(hp_tab + t * 8 + 5)
    inv_sqrt_bc2 = tl.load(hp_tab + t * 8 + 6)
    sign = tl.load(hp_tab + t * 8 + 7)

    # A tile is NB blocks; each block is handled as two halves (lo, hi) so that 4-bit formats can pack
    # element j with element j + BLOCK/2 of the same block into one byte without shuffles.
    base = (tile - first).to(tl.int64) * (NB * BLOCK)
    rows = tl.arange(0, NB)
    off_lo = base + rows[:, None] * BLOCK + tl.arange(0, BLOCK // 2)[None, :]  # within the tensor
    off_hi = off_lo + BLOCK // 2
    emask_lo = off_lo < numel
    emask_hi = off_hi < numel
    bmask = (base + rows * BLOCK) < numel  # blocks of this tensor (its padded slice)
    blk = (s_off + base) // BLOCK + rows  # global block index, for per-block scales
    soff_lo = s_off + off_lo  # offsets into the flat state buffers
    soff_hi = s_off + off_hi

    p_lo = tl.load(p_ptr + off_lo, mask=emask_lo, other=0.0).to(tl.float32)
    p_hi = tl.load(p_ptr + off_hi, mask=emask_hi, other=0.0).to(tl.float32)
    g_lo = tl.load(g_ptr + off_lo, mask=emask_lo, other=0.0).to(tl.float32)
    g_hi = tl.load(g_ptr + off_hi, mask=emask_hi, other=0.0).to(tl.float32)
    e_lo = p_lo
    e_hi = p_hi
    if COMPENSATE:
        e_lo = tl.load(err_ptr + soff_lo, mask=emask_lo, other=0.0).to(tl.float32)
        e_hi = tl.load(err_ptr + soff_hi, mask=emask_hi, other=0.0).to(tl.float32)
    m_lo, m_hi = LOAD(m_codes, m_scale, qmap_m, soff_lo, soff_hi, blk, emask_lo, emask_hi, bmask, True)
    v_lo, v_hi = LOAD(v_codes, v_scale, qmap_v, soff_lo, soff_hi, blk, emask_lo, emask_hi, bmask, False)

    x_lo, m_lo, v_lo, ok_lo = _adam_math(p_lo, g_lo, m_lo, v_lo, e_lo, lr, wd, b1, b2, eps, step_size,
                                         inv_sqrt_bc2, sign, COMPENSATE)
    x_hi, m_hi, v_hi, ok_hi = _adam_math(p_hi, g_hi, m_hi, v_hi, e_hi, lr, wd, b1, b2, eps, step_size,
                                         inv_sqrt_bc2, sign, COMPENSATE)

    STORE(m_codes, m_scale, soff_lo, soff_hi, blk, emask_lo, emask_hi, bmask, m_lo, m_hi, True)
    STORE(v_codes, v_scale, soff_lo, soff_hi, blk, emask_lo, emask_hi, bmask, v_lo, v_hi, False)
    _write_param(p_ptr, err_ptr, off_lo, s_off, emask_lo, x_lo, seed, COMPENSATE, STOCHASTIC)
    _write_param(p_ptr, err_ptr, off_hi, s_off, emask_hi, x_hi, seed, COMPENSATE, STOCHASTIC)

    bad = tl.sum(tl.sum((emask_lo & ~ok_lo).to(tl.int32), axis=1), axis=0) + tl.sum(
        tl.sum((emask_hi & ~ok_hi).to(tl.int32), axis=1), axis=0)
    if bad > 0:  # rare: keeps the atomic off the hot path
        tl.atomic_add(nonfinite_ptr, bad)


# ---------------------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------------------

_FP32 = None  # the fallback format for small tensors; set by adamw.py at import (avoids an import cycle)


def _set_fp32_format(fmt: StateFormat) -> None:
    global _FP32
    _FP32 = fmt


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2 parameters and their grads), else the tensor itself.

    Each rank quantizes only its own shard: blocks never straddle ranks, uneven (even empty) shards work, and
    the kernel sees plain local tensors. The state is per rank, so a checkpoint of it is per rank too.
    """
    to_local = getattr(t, "to_local", None)
    return to_local() if to_local is not None else t


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
        self.err = zeros(total, params[0].dtype) if compensate else zeros(1, params[0].dtype)
        self.compensate = compensate
        self.qmap_m = (fmt.qmap_signed if fmt.qmap_signed is not None else torch.zeros(1)).to(device)
        self.qmap_v = (fmt.qmap_unsigned if fmt.qmap_unsigned is not None else torch.zeros(1)).to(device)
        self.plans: dict = {}

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

    def plan(self, active: tuple, nb: int):
        """Device tables for one set of active tensors (cached: normally every step has the same set)."""
        key = (active, nb)
        if key not in self.plans:
            tile = nb * self.fmt.block_size
            meta, tiles = [], []
            first = 0
            for j, i in enumerate(active):
                n = self.numels[i]
                nt = -(-n // tile)
                meta.append([n, self.offsets[i], first, 0])
                tiles.extend([j] * nt)
                first += nt
            meta_t = torch.tensor(meta, dtype=torch.int64, device=self.device)
            tile_t = torch.tensor(tiles, dtype=torch.int32, device=self.device)
            self.plans = {key: (meta_t, tile_t)}  # keep one: a changing active set is rare
        return self.plans[key]


class LowBitAdamW(Optimizer):
    """AdamW with the state format chosen by a subclass. Use the public classes, not this one."""

    FORMAT: StateFormat = None  # set by each public class

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
        stochastic_round: bool = False,
        compensate: bool = False,
        tile_blocks: Optional[int] = None,
        num_warps: Optional[int] = None,
        _format: Optional[StateFormat] = None,
    ):
        if isinstance(lr, torch.Tensor) and lr.numel() != 1:
            raise ValueError(f"lr must be a float or a one-element tensor, got a tensor of shape {tuple(lr.shape)}")
        if not float(lr) >= 0.0:
            raise ValueError(f"Invalid learning rate: {float(lr)} (must be >= 0)")
        if not 0.0 <= eps:
            raise ValueError(f"Invalid epsilon value: {eps} (must be >= 0)")
        for i, b in enumerate(betas):
            if not 0.0 <= float(b) < 1.0:
                raise ValueError(f"Invalid beta parameter at index {i}: {float(b)} (must be in [0, 1))")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Invalid weight_decay value: {weight_decay} (must be >= 0)")
        if amsgrad:
            raise NotImplementedError(f"{type(self).__name__} does not implement amsgrad; use torch.optim.AdamW")
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend must be 'auto', 'torch' or 'triton', got {backend!r}")
        if backend == "triton" and not HAVE_TRITON:
            raise RuntimeError(f"backend='triton' needs Triton: {INSTALL_HINT}")
        if stochastic_round and compensate:
            raise ValueError("stochastic_round and compensate are alternatives; pick one")
        self.format = _format or self.FORMAT
        self.backend = backend
        self.min_quant_numel = int(min_quant_numel)
        self.stochastic_round = bool(stochastic_round)
        self.compensate = bool(compensate)
        self.tile_blocks = tile_blocks  # Triton tuning knobs (bench/optimizer_step.py sweeps them); None = default
        self.num_warps = num_warps
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=False, maximize=maximize,
                        state_format=self.format.name)
        super().__init__(params, defaults)
        self._buckets: Optional[list[_Bucket]] = None
        self._seed = 0
        self.nonfinite_count: Optional[torch.Tensor] = None

    # -- state -------------------------------------------------------------------------------------------

    def _param_format(self, p: torch.Tensor) -> StateFormat:
        if self.format.scaled and p.numel() < self.min_quant_numel:
            return _FP32  # tiny tensors (norms, biases): full-precision states cost nothing and lose nothing
        return self.format

    def _init_state(self) -> None:
        groups: dict = {}
        for group in self.param_groups:
            for p in group["params"]:
                if not _local(p).is_contiguous():
                    raise ValueError(f"{type(self).__name__} needs contiguous parameters; got one of shape "
                                     f"{tuple(p.shape)} with strides {_local(p).stride()}")
                fmt = self._param_format(p)
                key = (_local(p).device, p.dtype, fmt.name)
                groups.setdefault(key, (fmt, []))[1].append(p)
        self._buckets = []
        for (device, dtype, _), (fmt, params) in groups.items():
            compensate = self.compensate and dtype in (torch.bfloat16, torch.float16)
            b = _Bucket(fmt, params, device, compensate)
            for i, p in enumerate(params):
                st = self.state[p]
                st["step"] = torch.tensor(0.0)
                st.update(b.views(i))
            self._buckets.append(b)
        dev = _local(self.param_groups[0]["params"][0]).device
        self.nonfinite_count = torch.zeros(1, dtype=torch.int32, device=dev)

    def _hparams(self) -> dict:
        """id(param) -> (group, hyper-parameters) for this step."""
        out = {}
        for group in self.param_groups:
            for p in group["params"]:
                out[id(p)] = group
        return out

    # -- step --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._buckets is None:
            self._init_state()
        group_of = self._hparams()
        self._seed += 1
        for b in self._buckets:
            active = tuple(i for i, p in enumerate(b.params) if p.grad is not None)
            if not active:
                continue
            rows = []
            for i in active:
                p = b.params[i]
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                st = self.state[p]
                st["step"] += 1
                t = float(st["step"])
                g = group_of[id(p)]
                b1, b2 = (float(x) for x in g["betas"])
                lr = float(g["lr"])
                bc1 = 1.0 - b1 ** t
                bc2 = 1.0 - b2 ** t
                rows.append([lr, float(g["weight_decay"]), b1, b2, float(g["eps"]), lr / bc1,
                             1.0 / math.sqrt(bc2), -1.0 if g["maximize"] else 1.0])
            if self._use_triton(b.device):
                self._step_triton(b, active, rows)
            else:
                for j, i in enumerate(active):
                    self._step_torch(b, i, rows[j])
        return loss

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        usable = triton_usable(device)
        if self.backend == "triton" and not usable:
            raise RuntimeError(
                f"backend='triton' cannot run on {device}: the Triton path needs CUDA tensors (or CPU tensors "
                f"with TRITON_INTERPRET=1 set before import, for tests). Use backend='torch' or 'auto'.")
        return usable if self.backend == "triton" else device.type == "cuda" and usable

    def _step_triton(self, b: _Bucket, active: tuple, rows: list) -> None:
        nb = self.tile_blocks or b.fmt.tile_blocks
        meta, tiles = b.plan(active, nb)
        grads = []
        ptrs = []
        locals_ = []
        for i in active:
            p = _local(b.params[i])
            g = _local(b.params[i].grad)
            if g.dtype != p.dtype or not g.is_contiguous():
                g = g.to(dtype=p.dtype, memory_format=torch.contiguous_format)
            grads.append(g)  # keeps converted grads alive until the launch is queued
            locals_.append(p)
            ptrs.append([p.data_ptr(), g.data_ptr()])
        if tiles.numel() == 0:  # every active shard on this rank is empty
            return
        aligned = all(n % 16 == 0 for n in (b.numels[i] for i in active)) and all(
            a % 16 == 0 for pair in ptrs for a in pair)
        pin = b.device.type == "cuda"
        ptr_t = torch.tensor(ptrs, dtype=torch.int64, pin_memory=pin).to(b.device, non_blocking=True)
        hp_t = torch.tensor(rows, dtype=torch.float32, pin_memory=pin).to(b.device, non_blocking=True)
        fmt = b.fmt
        _adamw_kernel[(tiles.numel(),)](
            ptr_t, meta, hp_t, tiles, locals_[0], grads[0],
            b.m_codes, b.m_scale, b.v_codes, b.v_scale, b.qmap_m, b.qmap_v, b.err, self.nonfinite_count,
            self._seed,
            BLOCK=fmt.block_size, NB=nb, LOAD=fmt.triton_load, STORE=fmt.triton_store,
            COMPENSATE=b.compensate, STOCHASTIC=self.stochastic_round and b.params[0].dtype == torch.bfloat16,
            ALIGNED=aligned,
            num_warps=self.num_warps or fmt.num_warps,
        )

    def _step_torch(self, b: _Bucket, i: int, hp: list) -> None:
        """The reference path: same math as the kernel, one parameter at a time, in plain PyTorch."""
        st = self.state[b.params[i]]
        p, grad = _local(b.params[i]), _local(b.params[i].grad)
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
        finite = g.abs() <= _FP32_MAX
        g = torch.where(finite, g * sign, 0.0)
        x = padded(p)
        if b.compensate:
            x = x + st["error"].float()
        m = fmt.dequantize(st["exp_avg"], st.get("exp_avg_scale"), True)
        v = fmt.dequantize(st["exp_avg_sq"], st.get("exp_avg_sq_scale"), False)
        m_new = b1 * m + (1.0 - b1) * g
        v_new = b2 * v + (1.0 - b2) * g * g
        denom = v_new.sqrt() * inv_sqrt_bc2 + eps
        x_new = x * (1.0 - lr * wd) - step_size * (m_new / denom)
        m_new = torch.where(finite, m_new, m)
        v_new = torch.where(finite, v_new, v)
        x_new = torch.where(finite, x_new, x)
        bad = int((~finite).sum())  # padding is finite (zero), so this counts real elements only
        if bad:
            self.nonfinite_count += bad
        for key, val, signed in (("exp_avg", m_new, True), ("exp_avg_sq", v_new, False)):
            codes, scale = fmt.quantize(val, signed)
            st[key].copy_(codes)
            if fmt.scaled:
                st[key + "_scale"].copy_(scale)
        flat = x_new.view(-1)[:n]
        if self.stochastic_round and p.dtype == torch.bfloat16:
            p.copy_(stochastic_round_bf16(flat).view_as(p))
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
        into our flat buffers instead, after checking the format, parameter count and shapes.
        """
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
                if key not in st or not isinstance(val, torch.Tensor):
                    raise ValueError(f"unexpected optimizer state entry {key!r} for a parameter of shape "
                                     f"{tuple(p.shape)}; was it saved with other options (compensate=...)?")
                if key == "step":
                    st["step"] = val.detach().to("cpu", torch.float32).clone().reshape(())
                    continue
                if val.shape != st[key].shape or val.dtype != st[key].dtype:
                    raise ValueError(f"optimizer state {key!r} for a parameter of shape {tuple(p.shape)}: saved "
                                     f"{tuple(val.shape)} {val.dtype}, expected {tuple(st[key].shape)} "
                                     f"{st[key].dtype}; it was saved with other options (min_quant_numel?)")
                st[key].copy_(val)
        for sg, g in zip(saved_groups, self.param_groups):
            for k, v in sg.items():
                if k != "params":
                    g[k] = v

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


def stochastic_round_bf16(x: torch.Tensor, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """Round fp32 to bf16 up or down with probability proportional to the distance (unbiased)."""
    bits = x.float().contiguous().view(torch.int32)
    r = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + r) & -65536).view(torch.float32).to(torch.bfloat16)
