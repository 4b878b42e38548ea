"""The Triton path's host side: the launch plan of a bucket (its tables on the device) and the launches.

Host work is per step and per parameter (291 tensors for Llama2-7B), on the critical path whenever the GPU waits
for it (~1 ms of a 16-20 ms step on the H200's host): it is kept to C-level list walks, uploads only what changed,
and launches the last compiled kernel directly when nothing it was specialized on changed. A large bucket goes in
two launches so that the host's walk over the grads overlaps the first launch (``TritonPath._step_triton``).
"""

from __future__ import annotations

import itertools
import operator
from typing import Optional

import torch

from ._buckets import Bucket, local
from ._kernel import _adamw_kernel
from ._triton import triton_usable

_IS_CONTIGUOUS = torch.Tensor.is_contiguous
_DATA_PTR = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_GRAD = operator.attrgetter("grad")
_NONES = itertools.repeat(None)

# Tiles per chunk of the kernel's walk (see _adamw_kernel): long enough to amortise a table lookup, short enough
# that all programs stay in nearby addresses.
RUN = 8

_SM_COUNT: dict = {}


class Plan:
    """A launch's tables (a bucket's active tensors, or a share of them), plus the last uploaded addresses and row
    indices and the kernel compiled for them."""

    def __init__(self, meta, cum_full, n_full, tail, n_tail):
        self.meta, self.cum_full, self.n_full, self.tail, self.n_tail = meta, cum_full, n_full, tail, n_tail
        self.ptrs = self.ptr_t = self.idx = self.idx_t = None
        self.aligned = self.numels_aligned = self.words = False
        self.compiled = None  # (specialization key, Triton's compiled kernel) of the last launch


def bucket_plans(b: Bucket, active: tuple, nb: int, first_share: float) -> list:
    """Launch tables for one set of active tensors, as (j0, j1, plan) per launch over ``active[j0:j1]`` (cached in
    the bucket: normally every step has the same set). With ``first_share`` > 0 the first launch takes the shortest
    prefix holding that share of the elements, the second the rest (see TritonPath._step_triton)."""
    key = (active, nb, first_share)
    if b._plan_key != key:
        cut = len(active)
        if first_share > 0 and len(active) > 1:
            sizes = [b.numels[i] for i in active]
            total, acc, cut = sum(sizes), 0, 0
            while cut < len(active) - 1 and acc < first_share * total:
                acc += sizes[cut]
                cut += 1
        spans = [(0, cut), (cut, len(active))] if cut < len(active) else [(0, cut)]
        # keep one set of plans: a changing active set is rare
        b._plans = [(j0, j1, _plan(b, active[j0:j1], nb)) for j0, j1 in spans]
        b._plan_key = key
    return b._plans


def _plan(b: Bucket, active: tuple, nb: int) -> Plan:
    tile = nb * b.fmt.block_size
    numels = torch.tensor([b.numels[i] for i in active], dtype=torch.int64)
    meta = torch.stack([numels, torch.tensor([b.offsets[i] for i in active], dtype=torch.int64)], 1)
    n_full = numels // tile
    tensors = torch.arange(len(active), dtype=torch.int32)
    # Full tiles are found in the kernel from this prefix sum (a per-tile table would be ~50 MB for a 7B
    # model: 6.6 M tiles); only the partial last tiles, at most one per tensor, are listed.
    cum_full = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(n_full, 0)])
    has_tail = numels % tile != 0
    tail = torch.stack([tensors[has_tail], n_full[has_tail].to(torch.int32)], 1)
    dev = b.device
    plan = Plan(meta.to(dev), cum_full.to(dev), int(cum_full[-1]), tail.to(dev), len(tail))
    plan.numels_aligned = all(b.numels[i] % 16 == 0 for i in active)
    return plan


def programs(device: torch.device, per_sm: int) -> int:
    """Size of the persistent grid: ``per_sm`` programs per SM (on CPU, for the interpreter: a few, so that the
    tests walk the loop over several tiles per program)."""
    if device.type != "cuda":
        return 3
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device] * per_sm


def kernel_args(
    b: Bucket,
    plan: Plan,
    nb: int,
    p0,
    g0,
    hp_t,
    idx_t,
    row0: list,
    one_row: bool,
    stochastic: bool,
    nonfinite_count: torch.Tensor,
    seed: int,
) -> dict:
    """``_adamw_kernel``'s arguments by name, in its signature's order (the direct relaunch passes the values
    positionally; tests/optimizers/test_optimizers.py checks the order)."""
    fmt = b.fmt
    lr0, wd0, b10, b20, eps0, ss0, isb0, sign0 = row0
    return dict(
        ptr_tab=plan.ptr_t,
        meta_tab=plan.meta,
        hp_tab=hp_t,
        hp_idx=idx_t,
        lr0=lr0,
        wd0=wd0,
        b10=b10,
        b20=b20,
        eps0=eps0,
        ss0=ss0,
        isb0=isb0,
        sign0=sign0,
        cum_full=plan.cum_full,
        n_full=plan.n_full,
        tail_tab=plan.tail,
        n_tail=plan.n_tail,
        p0=p0,
        g0=g0,
        m_codes=b.m_codes,
        m_scale=b.m_scale,
        v_codes=b.v_codes,
        v_scale=b.v_scale,
        lut=b.lut,
        err_ptr=b.err,
        nonfinite_ptr=nonfinite_count,
        seed=seed,
        BLOCK=fmt.block_size,
        NB=nb,
        EPC=fmt.elems_per_code,
        RUN=RUN,
        LOAD=fmt.triton_load,
        DECODE=fmt.triton_decode,
        STORE=fmt.triton_store,
        COMPENSATE=b.compensate,
        STOCHASTIC=stochastic,
        ALIGNED=plan.aligned,
        ONE_ROW=one_row,
        WORDS=plan.words,
    )


class TritonPath:
    """``LowBitAdamW``'s Triton path (a mixin: it reads the optimizer's options and ``_hp_row``)."""

    # A bucket of at least _SPLIT_MIN_NUMEL elements is updated in two launches, the first over _FIRST_SHARE of the
    # elements (see _step_triton); tests lower the threshold to run the split on small problems.
    _FIRST_SHARE = 0.1
    _SPLIT_MIN_NUMEL = 1 << 24

    def _use_triton(self, device: torch.device) -> bool:
        if self.backend == "torch":
            return False
        usable = triton_usable(device)
        if self.backend == "triton" and not usable:
            raise RuntimeError(
                f"backend='triton' cannot run on {device}: the Triton path needs CUDA tensors (or CPU tensors "
                f"with TRITON_INTERPRET=1 set before import, for tests). Use backend='torch' or 'auto'."
            )
        return usable if self.backend == "triton" else device.type == "cuda" and usable

    def _tile_blocks(self, b: Bucket) -> int:
        nb = self.tile_blocks or b.fmt.tile_blocks
        if b.device.type == "cpu" and not self.tile_blocks:
            # Under TRITON_INTERPRET (tests) every op costs Python overhead, whatever the tile's size: bigger tiles
            # mean fewer loop iterations. NB is a constexpr of the same code, so the logic tested is unchanged.
            nb = max(nb, 2048 // b.fmt.block_size)
        return nb

    def _step_early(self, b: Bucket) -> bool:
        """The usual step of a large bucket on the Triton path, ordered so that the GPU starts early: read the grads
        of the first launch's tensors only (a tenth of the elements, ~30 of 291 tensors for Llama2-7B), launch,
        then read the rest and launch again. The general path reads all grads, bumps and reads back the step
        counts before any launch: ~0.4 ms on the H200's host, the GPU idle meanwhile. Needs all step counts equal
        (``b.uniform_t``, kept by every step and by load_state_dict) and one param group; returns False, having
        done nothing, where it does not apply."""
        if (
            b.uniform_t is None
            or not b.one_group
            or b.total < self._SPLIT_MIN_NUMEL
            or len(b.params) < 2
            or not self._use_triton(b.device)
        ):
            return False
        plans = bucket_plans(b, b.all_active, self._tile_blocks(b), self._FIRST_SHARE)
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

    def _step_triton(self, b: Bucket, active: tuple, grads: list, rows: list, idx: Optional[list]) -> None:
        """Launch the kernel for the active params of a bucket (grads: theirs); idx None: one hyper-parameter row.

        A large bucket goes in two launches: the first over the shortest prefix of its tensors holding
        ``_FIRST_SHARE`` of the elements, the second over the rest. The host's walk over the tensors (reading
        291 grads' addresses for Llama2-7B, ~0.5 ms on the H200's host) then overlaps the first launch's GPU work
        instead of preceding all of it; the price is one more launch (~0.15 ms of host, hidden behind the first
        launch's ~1.5 ms) and one kernel boundary (microseconds)."""
        share = self._FIRST_SHARE if b.total >= self._SPLIT_MIN_NUMEL else 0.0
        plans = bucket_plans(b, active, self._tile_blocks(b), share)
        params = b.params if len(active) == len(b.params) else [b.params[i] for i in active]
        hp_t = None
        if idx is not None:
            hp_t = torch.tensor(rows, dtype=torch.float32, pin_memory=b.device.type == "cuda").to(
                b.device, non_blocking=True
            )
        whole = len(plans) == 1
        for j0, j1, plan in plans:
            if whole:
                self._run_piece(b, plan, params, grads, rows, idx, hp_t)
            else:
                self._run_piece(b, plan, params[j0:j1], grads[j0:j1], rows, None if idx is None else idx[j0:j1], hp_t)

    def _run_piece(
        self, b: Bucket, plan: Plan, ps: list, gs: list, rows: list, idx: Optional[list], hp_t: Optional[torch.Tensor]
    ) -> None:
        """One launch over the tensors of ``plan`` (ps, gs: their params and grads; idx: their hyper-parameter
        rows, None for the one row ``rows[0]``; hp_t: ``rows`` on the device when idx is given)."""
        if plan.n_full + plan.n_tail == 0:  # every tensor of this launch has an empty shard on this rank
            return
        if b.wrapped:
            ps, gs = [local(p) for p in ps], [local(g) for g in gs]
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

    def _launch(self, b: Bucket, plan: Plan, nb: int, p0, g0, hp_t, idx_t, row0: list, one_row: bool) -> None:
        fmt, dev = b.fmt, b.device
        grid = max(1, min(max(plan.n_full, plan.n_tail), programs(dev, self.programs_per_sm or fmt.programs_per_sm)))
        stochastic = self.stochastic_round and p0.dtype == torch.bfloat16
        args = kernel_args(
            b, plan, nb, p0, g0, hp_t, idx_t, row0, one_row, stochastic, self.nonfinite_count, self._seed
        )
        # Triton's launcher re-derives the kernel's specialization from every argument on every call (~0.15 ms of
        # host on the H200's CPU). The arguments that can change between this plan's launches are the flags and
        # the per-step tensors (their 16-byte alignment is all Triton specializes them on; the seed is not
        # specialized): when they repeat, the kernel compiled for the last launch is launched directly.
        key = (
            stochastic,
            plan.aligned,
            plan.words,
            one_row,
            self.num_warps,
            *(x.data_ptr() % 16 == 0 for x in (plan.ptr_t, hp_t, idx_t, p0, g0)),
        )
        if plan.compiled is not None and plan.compiled[0] == key:
            plan.compiled[1][(grid, 1, 1)](*args.values())
            return
        kernel = _adamw_kernel[(grid,)](
            **args,
            num_warps=self.num_warps or fmt.num_warps,
            **({"maxnreg": fmt.max_registers} if fmt.max_registers and dev.type == "cuda" else {}),
        )
        # (the interpreter returns no compiled kernel: it takes this path every time)
        plan.compiled = (key, kernel) if dev.type == "cuda" and hasattr(kernel, "__getitem__") else None
