"""The state layout: parameters that share a device, a dtype and a format form a bucket, whose states live in flat
buffers.

Each parameter owns a block-aligned slice of its bucket's buffers, padded up to a whole block (padding stays exactly
zero because its gradient and weight are read as zero). ``optimizer.state[p]`` holds views of those slices, so
``state_dict()`` sees per-parameter tensors like any torch optimizer.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._format import StateFormat


def local(t: torch.Tensor) -> torch.Tensor:
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


def no_4g_crossing(table: torch.Tensor, device: torch.device) -> torch.Tensor:
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


class Bucket:
    """Parameters that share one device, one dtype and one format, with their flat state buffers."""

    def __init__(self, fmt: StateFormat, params: list, device: torch.device, compensate: bool):
        self.fmt = fmt
        self.params = params
        self.device = device
        B = fmt.block_size
        self.numels = [local(p).numel() for p in params]
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
        dtype = local(params[0]).dtype  # a bucket's one dtype, as the kernel sees it (complex: its real dtype)
        self.err = zeros(total if compensate else 1, dtype)
        self.lut = no_4g_crossing(fmt.table, device) if fmt.table is not None else zeros(1, torch.int32)
        self.compensate = compensate
        # the launch plans (_launch.bucket_plans): cached for the last set of active tensors
        self._plan_key = None
        self._plans: list = []
        # Every param's step count in one CPU tensor: optimizer.state[p]["step"] is a 0-dim view of its entry, so
        # a step bumps them all in one op and reads them back in one .tolist().
        self.step_all = torch.zeros(len(params), dtype=torch.float32)
        self.uniform_t: Optional[float] = 0.0  # the step count all of them have, None if they differ
        self.group_of: list = []  # each param's param-group index (set by LowBitAdamW._add_buckets)
        self.one_group = True  # all of them in one group (likewise)
        self.all_active = tuple(range(len(params)))
        # DTensor parameters (FSDP2) are updated through their local shards, complex ones through their real views
        # (local); plain ones skip the lookup
        self.wrapped = any(hasattr(p, "to_local") or p.is_complex() for p in params)

    def __getstate__(self) -> dict:
        # (copy.deepcopy, pickle) The launch plans hold this process's addresses and compiled kernel: rebuilt on the
        # next step.
        return dict(self.__dict__, _plan_key=None, _plans=[])

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.fmt.table is not None:  # the copied table may straddle a 4 GiB boundary (see no_4g_crossing)
            self.lut = no_4g_crossing(self.fmt.table, self.device)

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
            "exp_avg": self.m_codes[lo // epc : (lo + nblk * B) // epc].view(nblk, B // epc),
            "exp_avg_sq": self.v_codes[lo // epc : (lo + nblk * B) // epc].view(nblk, B // epc),
        }
        if fmt.scaled:
            out["exp_avg_scale"] = self.m_scale[lo // B : lo // B + nblk]
            out["exp_avg_sq_scale"] = self.v_scale[lo // B : lo // B + nblk]
        if self.compensate:
            out["error"] = self.err[lo : lo + nblk * B].view(nblk, B)
        return out

    def state_bytes(self) -> int:
        """Bytes of this bucket's states (codes, scales, error buffer)."""
        real = [self.m_codes, self.v_codes] + ([self.m_scale, self.v_scale] if self.fmt.scaled else [])
        real += [self.err] if self.compensate else []
        return sum(t.numel() * t.element_size() for t in real)
