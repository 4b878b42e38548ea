"""The plain-PyTorch path (``backend="torch"``, the path on CPU): the kernel's update written in torch ops.

It is the reference the tests hold the kernel to (code for code for the integer-coded formats), so it does the
kernel's operations in the kernel's order, in fp32. It is also where a newcomer on a CPU first meets the optimizers,
so it has to be quick there, and it is organised for that:

- Chunks. A parameter is updated ``chunk_elems`` elements (whole blocks, about 128 K) at a time. The update is
  elementwise and every block scale sees its whole block, so the result is the one a single pass over the tensor
  gives; but a chunk's dozen fp32 temporaries (512 KB each) stay in the caches and reuse the allocator's memory, where
  whole-tensor temporaries (35 MB each for the tiny model's embedding) made every op a trip to DRAM through freshly
  faulted pages. A chunk's ~80 torch ops cost a few microseconds each in Python and dispatch, whatever their size, so
  chunks much smaller pay mostly that: the tiny model's 4-bit step took 250-260 ms in 32 K chunks, 155-165 ms in
  128 K ones, 170-220 ms in 256 K or 512 K ones (``AdamW8bit``: 150-165, 105-125, 110-165; medians of 9 steps, a shared
  2-core EPYC, 2026-12-03).
- Serial ops. On the CPU the step runs with torch's intra-op threads set to one (``serial_on_cpu``). An op split
  across the cores pays an OpenMP barrier, and on a 2-core machine shared with other work a barrier waits for a
  descheduled thread: ops in 65536-element chunks, which split, took 1 to 22 s per step of the tiny model; and in
  chunks under torch's parallel grain (32768 elements) sqrt, whose grain is 2048, still split: a sqrt then an op took
  250 us against 16 us serial, most of a loaded machine's 4-bit step (3.2 s, against 0.54 s with one thread). (Sharing
  the chunks out to a pool of Python threads instead measured slower: ops this short spend their gain on the GIL.)
- Scalars once. The hyper-parameter products an update needs ((1 - b1) * sign, 1 - b2, 1 - lr * wd) are formed once
  per parameter, not per chunk, as the same fp32 0-dim tensor ops (so the same values).

Measured figures are in docs/optimizers.md ("On the CPU").
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from ._buckets import Bucket, local
from ._kernel import G_MAX
from ._random_bits import m_dither, stochastic_round_bf16

# elements per chunk: the largest whole number of blocks under this (see the module's docstring)
_CHUNK = 131072


def chunk_elems(block_size: int) -> int:
    """Elements per chunk for a format's block size."""
    return (_CHUNK - 1) // block_size * block_size


class ParamJob(NamedTuple):
    """One parameter's share of a step: what every chunk of it needs."""

    bucket: Bucket
    state: dict  # optimizer.state[p]: views of the bucket's buffers
    p: torch.Tensor  # flat, the tensor updated in place (a DTensor's local shard, a complex tensor's real view)
    g: torch.Tensor  # flat
    place: int  # the parameter's element offset in its bucket (stochastic rounding's bits)
    hp: tuple  # fp32 0-dim tensors: lr, weight decay, b1, b2, eps, step size, 1/sqrt(bc2), sign (see _kernel.py)
    coef: tuple  # fp32 0-dim tensors formed from hp once: (1 - b1) * sign, 1 - b2, 1 - lr * wd
    seed: int
    stochastic: bool  # round the bf16 weight stochastically


def param_job(b: Bucket, i: int, state: dict, hp: list, seed: int, stochastic_round: bool) -> ParamJob:
    """Parameter i of bucket b at hyper-parameter row ``hp`` (``LowBitAdamW._hp_row``)."""
    p, grad = local(b.params[i]), local(b.params[i].grad)
    # fp32 scalars, like the kernel's table, so that both paths round the same way
    scalars = tuple(torch.tensor(hp, dtype=torch.float32, device=p.device).unbind())
    stochastic = stochastic_round and p.dtype == torch.bfloat16
    lr, wd, b1, b2 = scalars[:4]
    coef = ((1.0 - b1) * scalars[7], 1.0 - b2, 1.0 - lr * wd)
    return ParamJob(b, state, p.view(-1), grad.reshape(-1), b.offsets[i], scalars, coef, seed, stochastic)


def update_chunk(job: ParamJob, e0: int, e1: int) -> int:
    """Update elements e0 .. e1 - 1 of a parameter (e0 on a block boundary; e1 one, or the tensor's end), its
    moments and error buffer. Returns how many of its gradient elements were skipped as non-finite (see G_MAX)."""
    b, st = job.bucket, job.state
    _, _, b1, b2, eps, step_size, inv_sqrt_bc2, _ = job.hp
    m_coef, v_coef, decay = job.coef
    fmt, B = b.fmt, b.fmt.block_size
    k0, k1 = e0 // B, -(-e1 // B)  # the chunk's blocks
    nb = k1 - k0

    def padded(x):
        # fp32 [blocks, B], zero past the tensor's end (the state's padding); may share x's memory
        x = x[e0:e1].float()
        if e1 - e0 < nb * B:
            x = torch.nn.functional.pad(x, (0, nb * B - (e1 - e0)))
        return x.view(nb, B)

    g = padded(job.g)
    # the kernel's guard (see G_MAX), one pass and no mask when, as almost always, every g passes (NaN fails both)
    lo, hi = g.aminmax()
    finite = None if bool((lo >= -G_MAX) & (hi <= G_MAX)) else g.abs() <= G_MAX
    x = padded(job.p)
    if b.compensate:
        x = x + st["error"][k0:k1].float()
    m = fmt.dequantize(st["exp_avg"][k0:k1], _rows(st.get("exp_avg_scale"), k0, k1), True)
    v = fmt.dequantize(st["exp_avg_sq"][k0:k1], _rows(st.get("exp_avg_sq_scale"), k0, k1), False)
    # the kernel's operations in the kernel's order (see _adam_math)
    m_new = b1 * m + m_coef * g
    v_new = b2 * v + (v_coef * g) * g
    denom = v_new.sqrt() * inv_sqrt_bc2 + eps
    x_new = x * decay - step_size * (m_new / denom)
    bad = 0
    if finite is not None:  # a skipped element keeps its weight and moments
        m_new = torch.where(finite, m_new, m)
        v_new = torch.where(finite, v_new, v)
        x_new = torch.where(finite, x_new, x)
        bad = int((~finite).sum())  # padding is finite (zero), so this counts real elements only
    for key, val, signed in (("exp_avg", m_new, True), ("exp_avg_sq", v_new, False)):
        if signed and fmt.dithered_m:
            codes, scale = fmt.quantize(val, signed, m_dither(e0, nb * B, job.seed, val.device).view(nb, B))
        else:
            codes, scale = fmt.quantize(val, signed)
        st[key][k0:k1].copy_(codes)
        if fmt.scaled:
            st[key + "_scale"][k0:k1].copy_(scale)
    flat = x_new.view(-1)[: e1 - e0]
    if job.stochastic:
        job.p[e0:e1].copy_(stochastic_round_bf16(flat, job.seed, job.place + e0))
    else:
        p_new = flat.to(job.p.dtype)
        job.p[e0:e1].copy_(p_new)
        if b.compensate:
            err = torch.zeros(nb * B, dtype=torch.float32, device=flat.device)
            err[: e1 - e0] = flat - p_new.float()
            st["error"][k0:k1].copy_(err.view(nb, B))
    return bad


def _rows(scale: Optional[torch.Tensor], k0: int, k1: int) -> Optional[torch.Tensor]:
    return None if scale is None else scale[k0:k1]


def step(jobs: list) -> int:
    """Update every parameter of ``jobs`` (``ParamJob``s); returns the count of skipped gradient elements."""
    bad = 0
    with serial_on_cpu(any(job.p.device.type == "cpu" for job in jobs)):
        for job in jobs:
            n, c = job.p.numel(), chunk_elems(job.bucket.fmt.block_size)
            for e0 in range(0, n, c):
                bad += update_chunk(job, e0, min(n, e0 + c))
    return bad


@contextlib.contextmanager
def serial_on_cpu(cpu: bool):
    """torch's intra-op threads set to one while the CPU step runs (see the module's docstring), then restored. The
    results are the same either way (elementwise ops and max reductions do not depend on how the work is split).
    OpenMP's thread count is the calling thread's setting, so threads already running keep theirs; torch also keeps
    it as the count a thread starting its first parallel op adopts, so one that starts during the step runs serial."""
    threads = torch.get_num_threads()
    if not cpu or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
