"""Checkpoints written in the background: the snapshot a step takes, where it lives, and the thread that writes it.

Part of the checkpoint component; ``checkpointer.Checkpointer`` drives it (``async_checkpoint=True``, the default).
A save has two halves:

1. At the step boundary, on the training thread, ``Staging.snapshot`` copies every tensor the checkpoint holds (the
   weights, the optimizer state, the RNG states) into staging buffers. The next optimizer step (with
   optimizer_in_bwd: the next backward) may then change the live tensors. This copy is all the time training waits.
2. A ``Job`` thread writes the copy into the checkpoint's temporary folder and fsyncs it; the training thread renames
   the folder into place at the first step boundary after (``RunFolder.commit``), so a checkpoint still appears only
   whole, and a crash at any moment leaves the previous one.

Where the snapshot lives, tensor by tensor in the order the checkpoint lists them (weights first):

- spare GPU memory, while there is some: a device-to-device copy, about 2 TB/s on an H200 (milliseconds for a 7B
  checkpoint). "Spare" is the run's cap (device_memory_limit_gib, else the card) minus the peak memory the run has
  reserved by the first save (not by the first step, when the host buffer is planned: a compiled run's first steps
  peak lower than its steady ones; a save before the third step is written synchronously, ``checkpointer.STEADY_STEP``),
  minus a margin (a tenth of the cap, at least 2 GiB): the copy stays allocated while the next steps run, until the
  writer has drained it. The writer drains it to the disk through one reused pinned buffer of BOUNCE_BYTES, so this
  costs the host almost nothing.
- else host memory: one buffer the size of what did not fit on the GPU, allocated and pinned (cudaHostRegister) once
  and reused by every save; a pinned copy runs about 55 GB/s on an H200 (a 20.6 GB 7B checkpoint: ~0.4 s). Pinning
  new memory costs ~1 s per 10 GB, so ``Checkpointer.prepare`` allocates it in the background after the first step.
  Where the first save finds less spare GPU memory than that step's estimate, only the storages moved off the GPU
  get a buffer of their own, at that save; the first buffer stays as it was cut.
- if the host has not that much memory available (MemAvailable less a reserve), the checkpointer (one process)
  copies only the larger of the checkpoint's two files whose copy fits and writes the other before training goes
  on; where neither fits, the save is written synchronously, as with async_checkpoint=False (it warns once).

So the memory an asynchronous save needs is, per rank: G + H = S, the checkpoint's tensors (weights and optimizer
state; rank 0 of the distributed recipe holds the gathered full weights), with G = min(S, spare GPU memory) on the
GPU until written and H = S - G in host memory for the whole run, plus BOUNCE_BYTES pinned.

The writer thread never runs a collective (the distributed recipe agrees on the main threads, see
``Checkpointer.poll``), and its heavy calls release the GIL (file writes, safetensors, torch.save's records, tensor
copies), so the training thread keeps launching work while it writes.
"""

import copy
import functools
import json
import os
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from finetune.host_memory import as_bytes, available_host_bytes, resident_bytes

BOUNCE_BYTES = 64 * 2**20  # the pinned buffer a GPU-held snapshot is drained through (~1 ms per fill at PCIe speed)
GPU_MARGIN_FRACTION, GPU_MARGIN_MIN = 0.10, 2 * 2**30  # kept free under the cap besides the run's peak
HOST_LIMIT_MARGIN = 2**30  # under host_memory_limit_gib: room for the writer's buffers and the allocator's slack
ALIGN = 4096  # host slots start on a page: each group of them is pinned as one range
PIN_GROUP_BYTES = 256 * 2**20  # cudaHostRegister in pieces of about this size (each call holds the GIL)
_IMMUTABLE = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


class Owned:
    """A part of a checkpoint that is already a private copy (the full optimizer state another call gathered to
    host memory): the snapshot takes it as it is."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


class Gather:
    """A weight to gather from the ranks' shards (a DTensor's ``full_tensor()``, a collective) as the snapshot is
    taken; ``keep``: this rank (0) keeps the full value, the others only take part in the gather."""

    __slots__ = ("tensor", "keep")

    def __init__(self, tensor: torch.Tensor, keep: bool):
        self.tensor, self.keep = tensor, keep

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()  # (a DTensor's numel is the full one)


def _walk(obj: Any, visit: Callable[[Any], None], seen: set) -> None:
    """Call ``visit`` on every plain tensor and Gather in ``obj``, in order (tensor subclasses through their inner
    tensors; Owned parts skipped)."""
    if id(obj) in seen or isinstance(obj, (Owned,) + _IMMUTABLE):
        return
    seen.add(id(obj))
    if isinstance(obj, Gather):
        visit(obj)
    elif isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            for name in obj.__tensor_flatten__()[0]:
                _walk(getattr(obj, name), visit, seen)
        else:
            visit(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _walk(v, visit, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _walk(v, visit, seen)


def _rebuild(obj: Any, leaf: Callable[[Any], Any], memo: dict) -> Any:
    """``obj`` with every plain tensor and Gather replaced by ``leaf(it)``, and every container copied (a list the
    scheduler appends to later must not change the snapshot). Shared objects stay shared, so torch.save writes the
    same pickle as for the original."""
    if isinstance(obj, _IMMUTABLE):
        return obj
    if id(obj) in memo:
        return memo[id(obj)][1]
    if isinstance(obj, Owned):
        out = obj.value
    elif isinstance(obj, Gather):
        out = leaf(obj)
    elif isinstance(obj, torch.Tensor):
        if is_traceable_wrapper_subclass(obj):
            names, ctx = obj.__tensor_flatten__()
            inner = {n: _rebuild(getattr(obj, n), leaf, memo) for n in names}
            out = type(obj).__tensor_unflatten__(inner, ctx, obj.size(), obj.stride())
        else:
            out = leaf(obj)
    elif type(obj) is dict:
        out = {k: _rebuild(v, leaf, memo) for k, v in obj.items()}
    elif isinstance(obj, dict):  # OrderedDict, defaultdict: keep the type
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = _rebuild(v, leaf, memo)
    elif isinstance(obj, list):
        out = type(obj)(_rebuild(v, leaf, memo) for v in obj)
    elif isinstance(obj, tuple):
        items = [_rebuild(v, leaf, memo) for v in obj]
        out = type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    else:
        out = copy.deepcopy(obj)
    memo[id(obj)] = (obj, out)  # (obj kept alive: its id is not reused while the memo lives)
    return out


def materialize(obj: Any) -> Any:
    """``obj`` as a synchronous save writes it: Owned parts unwrapped, Gather leaves gathered (to host memory on
    the rank that keeps them, None on the others); every other tensor is the live one."""
    if isinstance(obj, Owned):
        return obj.value
    if isinstance(obj, Gather):
        from torch.distributed.tensor import DTensor

        full = obj.tensor.full_tensor() if isinstance(obj.tensor, DTensor) else obj.tensor
        return full.cpu() if obj.keep else None
    if type(obj) is dict:
        return {k: materialize(v) for k, v in obj.items()}
    return obj


def spare_gpu_bytes(device: torch.device, limit_gib: Optional[float]) -> int:
    """GPU memory a snapshot may hold while training goes on: the cap (``limit_gib``, else what this process can
    reach) minus the peak this run has reserved so far, minus the margin. 0 off CUDA."""
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    cap = total if limit_gib is None else min(total, int(limit_gib * 2**30))
    reachable = min(cap, torch.cuda.memory_reserved(device) + free)  # (other processes' memory is not ours)
    margin = max(GPU_MARGIN_MIN, int(GPU_MARGIN_FRACTION * cap))
    return max(0, reachable - torch.cuda.max_memory_reserved(device) - margin)


def _slot_bytes(n: int) -> int:
    """A host slot of ``n`` bytes, rounded up to a page (each slot starts on one)."""
    return -(-n // ALIGN) * ALIGN


class Layout:
    """Where each storage of one checkpoint's snapshot goes: the GPU (``on_gpu[i]``) or a slot in host memory;
    what each side holds, host slots page-aligned."""

    def __init__(self, sizes: List[int], on_gpu: List[bool]):
        self.sizes, self.on_gpu = sizes, on_gpu
        self.host_bytes = sum(_slot_bytes(n) for n, gpu in zip(sizes, on_gpu) if not gpu)
        self.gpu_bytes = sum(n for n, gpu in zip(sizes, on_gpu) if gpu)

    @property
    def key(self) -> tuple:
        return tuple(self.sizes), tuple(self.on_gpu)


class Staging:
    """The staging buffers of one run's snapshots: ``plan`` where a checkpoint goes, ``allocate`` the host buffer
    (reused while the plan stays the same), ``snapshot`` copy a checkpoint into them."""

    def __init__(
        self,
        device: torch.device,
        memory_limit_gib: Optional[float] = None,
        gpu_budget: Optional[int] = None,
        host_limit_gib: Optional[float] = None,
    ):
        self.device = torch.device(device)
        self._limit = memory_limit_gib
        # host_memory_limit_gib: the host memory the whole process may hold; a snapshot takes only what fits under it
        # beside what the process holds already, and gives it back once written (``transient``)
        self.host_limit = None if host_limit_gib is None else int(host_limit_gib * 2**30)
        # GPU bytes a snapshot may hold; None: estimated at the first plan from the training's own peak, and settled
        # at the first snapshot (``settle``); later plans keep it: by then the peak counts the snapshots too
        self._gpu_budget = gpu_budget
        self._settled = gpu_budget is not None
        # The host buffers (the first plan's, and one per later plan that moved storages off the GPU), the plan
        # their regions were cut for, and each storage's region (None: it goes to the GPU)
        self._buffers: List[torch.Tensor] = []
        self._host_key: Optional[tuple] = None
        self._regions: List[Optional[torch.Tensor]] = []
        self._pinned: List[int] = []  # registered addresses, for cudaHostUnregister
        self.pinned_bytes = 0

    # -- where ------------------------------------------------------------------------------------

    @staticmethod
    def _leaves(obj: Any) -> Tuple[List[int], List[bool], dict]:
        """Sizes and devices of the storages in ``obj``, in order; index of each storage (by identity) and Gather."""
        sizes, cuda, index = [], [], {}

        def visit(x):
            if isinstance(x, Gather):
                if not x.keep:
                    return
                key, n, dev = id(x), x.nbytes, x.tensor.device
            else:
                s = x.untyped_storage()
                key, n, dev = s._cdata, s.nbytes(), s.device
            if key not in index:
                index[key] = len(sizes)
                sizes.append(n)
                cuda.append(dev.type == "cuda")

        _walk(obj, visit, set())
        return sizes, cuda, index

    def plan(self, obj: Any) -> Optional[Layout]:
        """Where ``obj``'s snapshot goes: spare GPU memory first (in order), the host for the rest; None if the host
        lacks the memory (then nothing may be staged: write synchronously)."""
        sizes, cuda, _ = self._leaves(obj)
        if self._gpu_budget is None:
            self._gpu_budget = spare_gpu_bytes(self.device, self._limit)
        # A storage that has its slot in the host buffer already keeps it: on the GPU it would only take memory.
        slotted = self._held_slots(sizes)
        budget, on_gpu = self._gpu_budget, []
        for n, c, slot in zip(sizes, cuda, slotted):
            gpu = c and n <= budget and not slot
            budget -= n if gpu else 0
            on_gpu.append(gpu)
        layout = Layout(sizes, on_gpu)
        if layout.key != self._host_key and layout.host_bytes:
            free = self.free_host_bytes()
            if free is not None and layout.host_bytes > free + self.held_bytes:
                return None
        return layout

    def _held_slots(self, sizes: List[int]) -> List[bool]:
        """Which of a checkpoint's storages (``sizes``) have a slot in the host buffers: those of the allocated plan,
        where the checkpoint has that plan's storages."""
        if self._host_key is None or self._host_key[0] != tuple(sizes):
            return [False] * len(sizes)
        return [r is not None for r in self._regions]

    @property
    def held_bytes(self) -> int:
        """The host memory the staging buffers hold now."""
        return sum(b.numel() for b in self._buffers)

    def settle(self) -> None:
        """Fix the GPU budget from the peak the training has reached by the first snapshot, before it is planned;
        later calls change nothing. The estimate of the first plan (``Checkpointer.prepare``, after the first step)
        can be too high: a compiled run's first steps peak lower than its steady ones (measured under a 24 GB
        card's cap: 17.6 GiB at step 1, 20.7 from step 3 on), and a snapshot sized from that peak took the memory
        step 5 needed (out of memory). Never raised above the estimate, which the host buffer was cut for."""
        if self._settled:
            return
        spare = spare_gpu_bytes(self.device, self._limit)
        self._gpu_budget = spare if self._gpu_budget is None else min(self._gpu_budget, spare)
        self._settled = True

    @property
    def transient(self) -> bool:
        """Under a host memory limit the host buffer lives only while a snapshot is written: the training steps
        between checkpoints run without it."""
        return self.host_limit is not None

    def free_host_bytes(self) -> Optional[int]:
        """Host memory a snapshot may take now: MemAvailable less the reserve, and under a limit what the process
        does not hold of it yet (its resident set, the pinned states and weights included), less a margin for the
        writer's own buffers."""
        free = available_host_bytes()
        if self.host_limit is None:
            return free
        room = self.host_limit - (resident_bytes() or 0) - HOST_LIMIT_MARGIN
        return room if free is None else min(free, room)

    def no_gpu(self) -> None:
        """Hold no snapshot in GPU memory from now on (a GPU copy did not fit after all)."""
        self._gpu_budget, self._settled = 0, True

    # -- the host buffer ---------------------------------------------------------------------------

    def allocate(self, layout: Layout) -> None:
        """The host buffer for ``layout``: touched, pinned, cut into one region per host-held storage. Safe on a
        background thread (Checkpointer.prepare); a no-op while the layout is the one already allocated.

        A layout that only moves storages off the GPU (the first save's ``settle`` found less spare GPU memory than
        the first step's estimate) keeps the buffer and its regions, and gets a buffer for the moved storages alone:
        made again whole, the buffer (~9 GB for a 3B model's checkpoint) was allocated, touched and pinned on the
        training thread inside that save, which then waited 2-16 s instead of ~0.2 s."""
        if layout.key == self._host_key:
            return
        regions = self._regions if any(self._held_slots(layout.sizes)) else []
        if not regions or any(r is not None and gpu for r, gpu in zip(regions, layout.on_gpu)):
            self.release()
            regions = [None] * len(layout.sizes)
        new = [i for i, (r, gpu) in enumerate(zip(regions, layout.on_gpu)) if r is None and not gpu]
        if new:
            offsets, end = [], 0
            for i in new:
                offsets.append(end)
                end += _slot_bytes(layout.sizes[i])
            host = torch.empty(end, dtype=torch.uint8)
            host.zero_()  # first touch now (in parallel), not page by page inside the copies
            array = host.numpy()
            regions = list(regions)
            for i, o in zip(new, offsets):
                n = layout.sizes[i]
                # each region a storage of its own (torch.frombuffer): torch.save writes that storage, not the buffer
                regions[i] = (
                    torch.frombuffer(array[o : o + n], dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
                )
            if end:
                self._buffers.append(host)
                self._pin(host, offsets + [end])
        self._regions, self._host_key = regions, layout.key

    def _pin(self, host: torch.Tensor, starts: List[int]) -> None:
        """Page-lock a host buffer (cudaHostRegister: copies into it run at full PCIe speed), in groups of whole
        slots (``starts``: each slot's offset, then the end). Where that fails the buffers stay pageable: correct,
        only slower (about 12 GB/s on an H200)."""
        if self.device.type != "cuda" or self.transient:  # (a buffer per save: pinning it would cost ~1 s per 10 GB)
            return
        cudart, base, end = torch.cuda.cudart(), host.data_ptr(), starts[-1]
        group, ranges = 0, []
        for start in starts[1:]:
            if start == group or (start - group < PIN_GROUP_BYTES and start != end):
                continue
            if int(cudart.cudaHostRegister(base + group, start - group, 0)) != 0:
                for address, _ in ranges:  # (this buffer stays pageable; the others keep their pins)
                    cudart.cudaHostUnregister(address)
                return
            ranges.append((base + group, start - group))
            group = start
        self._pinned += [address for address, _ in ranges]
        self.pinned_bytes += sum(n for _, n in ranges)

    def _unpin(self) -> None:
        for address in self._pinned:
            torch.cuda.cudart().cudaHostUnregister(address)
        self._pinned, self.pinned_bytes = [], 0

    def release(self) -> None:
        """Give the host buffer back (the end of the run, or a new layout)."""
        self._unpin()
        self._buffers, self._host_key, self._regions = [], None, []

    # -- the copy ------------------------------------------------------------------------------------

    def snapshot(self, obj: Any, layout: Layout) -> Tuple[Any, Optional[torch.cuda.Event]]:
        """``obj`` with every tensor replaced by a copy in the staging buffers, and the CUDA event after which the
        GPU-held copies are complete (None off CUDA). Returns once the host-held copies are complete, so the caller
        may change the originals right away; Gather leaves are gathered here (every rank calls this, in step)."""
        self.allocate(layout)
        sizes, _, index = self._leaves(obj)
        assert (tuple(sizes), tuple(layout.on_gpu)) == layout.key, "the checkpoint changed between plan and snapshot"
        staged: List[Optional[torch.UntypedStorage]] = [None] * len(sizes)

        def target(i: int, device: torch.device) -> torch.Tensor:
            if layout.on_gpu[i]:
                return torch.empty(sizes[i], dtype=torch.uint8, device=device)
            return self._regions[i]

        def leaf(x):
            if isinstance(x, Gather):
                from torch.distributed.tensor import DTensor

                full = (x.tensor.full_tensor() if isinstance(x.tensor, DTensor) else x.tensor).contiguous()
                if not x.keep:
                    return None
                dst = target(index[id(x)], full.device)
                dst.copy_(full.reshape(-1).view(torch.uint8), non_blocking=True)
                return torch.empty(0, dtype=full.dtype, device=dst.device).set_(
                    dst.untyped_storage(), 0, full.size(), full.stride()
                )
            s = x.untyped_storage()
            i = index[s._cdata]
            if staged[i] is None:
                dst = target(i, s.device)
                dst.copy_(as_bytes(s), non_blocking=True)
                staged[i] = dst.untyped_storage()
            out = torch.empty(0, dtype=x.dtype, device=staged[i].device).set_(
                staged[i], x.storage_offset(), x.size(), x.stride()
            )
            return out.requires_grad_() if x.requires_grad else out

        snap = _rebuild(obj, leaf, {})
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
            if not all(layout.on_gpu):
                ready.synchronize()  # the host-held copies (and the stream up to them) are done
        return snap, ready


# ------------------------------------------------------------------------------------------------
# model.safetensors, streamed
# ------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _safetensors_dtypes(dtypes: Tuple[torch.dtype, ...]) -> Tuple[Dict[torch.dtype, str], Dict[torch.dtype, int]]:
    """safetensors' name of each dtype and the order it sorts them in (its own rule, read off a tiny file it writes:
    the header lists tensors by dtype, then by name)."""
    from safetensors.torch import save

    blob = save({str(i): torch.zeros(1, dtype=d) for i, d in enumerate(dtypes)})
    header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    header.pop("__metadata__", None)
    order = [int(k) for k in header]
    return {dtypes[i]: header[str(i)]["dtype"] for i in order}, {dtypes[i]: r for r, i in enumerate(order)}


def write_safetensors(
    path: Path,
    tensors: Dict[str, torch.Tensor],
    convert: Callable[[dict], dict],
    metadata: Dict[str, str],
    bounce: Optional[torch.Tensor] = None,
) -> None:
    """``convert(tensors)`` as safetensors.torch.save_file would write it (the same bytes), converting and writing
    one tensor at a time, so weights held on the GPU need no host copy of themselves: each GPU tensor goes to the
    file through ``bounce`` (pinned uint8), a piece at a time, or without one, through a copy of that one tensor.
    ``convert`` maps a dict of some tensors to the written names (it must convert each key on its own, as torchtune's converters do); ``tensors`` is emptied as
    it is written. Ends with an fsync."""
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in tensors.items()}
    source: Dict[str, str] = {}
    specs: Dict[str, torch.Tensor] = {}
    for k, m in meta.items():
        for name, out in convert({k: m}).items():
            source[name], specs[name] = k, out
    names, rank = _safetensors_dtypes(tuple(sorted({s.dtype for s in specs.values()}, key=str)))
    order = sorted(specs, key=lambda n: (rank[specs[n].dtype], n))
    entries, offset = {}, 0
    for n in order:
        size = specs[n].numel() * specs[n].element_size()
        entries[n] = {
            "dtype": names[specs[n].dtype],
            "shape": list(specs[n].shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    header = json.dumps({"__metadata__": metadata, **entries}, separators=(",", ":"), ensure_ascii=False).encode()
    header += b" " * (-len(header) % 8)
    pending: Dict[str, torch.Tensor] = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for n in order:
            if n not in pending:
                pending.update(convert({source[n]: tensors.pop(source[n])}))
            flat = pending.pop(n).contiguous().reshape(-1).view(torch.uint8)
            if flat.device.type == "cpu":
                f.write(flat.numpy())
                continue
            if bounce is None:  # (no pinned buffer: one tensor at a time through a pageable copy)
                f.write(flat.cpu().numpy())
                continue
            for i in range(0, flat.numel(), bounce.numel()):
                piece = bounce[: min(bounce.numel(), flat.numel() - i)]
                piece.copy_(flat[i : i + piece.numel()], non_blocking=True)
                torch.cuda.current_stream(flat.device).synchronize()
                f.write(piece.numpy())
        f.flush()
        os.fsync(f.fileno())


def pinned_torch_save(obj: Any, path: Any) -> None:
    """torch.save (into a path or a file object), with any GPU storage copied out through pinned memory (torch's own option, thread-local here):
    pageable device-to-host copies run at a fraction of the speed and hold the GIL on older torch versions."""
    try:
        from torch.utils.serialization import config
    except ImportError:  # (torch < 2.7)
        torch.save(obj, path)
        return
    with config.patch({"save.use_pinned_memory_for_d2h": True}):
        torch.save(obj, path)


# ------------------------------------------------------------------------------------------------
# the writer thread
# ------------------------------------------------------------------------------------------------


class Job:
    """``fn()`` on a thread of its own: when it ran, and how it failed. A daemon thread: a process that dies (or is
    interrupted) does not wait for it; its temporary folder is removed at the next start.

    ``join`` waits for the job's own end, not for ``Thread.join``: up to Python 3.12, a Thread.join that Ctrl-C
    interrupts marks the thread as ended while it still runs (threading's bpo-45274 handling), so every later join
    returned at once, and a Ctrl-C while the recipe waited for a write made the next wait publish the folder the
    writer was still filling (an empty or half-written step_N/)."""

    def __init__(self, fn: Callable[[], None], name: str):
        self.error: Optional[BaseException] = None
        self.started, self.ended = time.perf_counter(), None
        self._over = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as e:  # reported by the training thread (Checkpointer.poll / wait)
            self.error = e
        finally:
            self.ended = time.perf_counter()
            self._over.set()

    @property
    def done(self) -> bool:
        return self.ended is not None

    @property
    def alive(self) -> bool:
        """Its thread still runs (``fn`` not over, or its last moments after)."""
        return self._thread.is_alive()

    def join(self) -> None:
        """Until ``fn`` returned or raised (a Ctrl-C meanwhile raises here and leaves the job as it is), then until
        the thread is gone: what ``fn`` leaves to free is freed on it, and a process that exits while a daemon
        thread still runs C++ code aborts (exit status -6)."""
        self._over.wait()
        self._thread.join()
