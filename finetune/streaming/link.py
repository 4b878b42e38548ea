"""The copies between host and GPU memory behind ``StreamedStates``: pinned host slots, and two copy streams.

``CudaLink`` is the real one. Host-to-GPU copies run on one stream and GPU-to-host copies on another, so the two
directions overlap (about 50 GB/s each way at once on a PCIe 5.0 x16 link, 55 one way); the training stream only
waits, per parameter, for the copy that brings that parameter's state. ``StandInLink`` does the same work with
plain synchronous CPU copies: the schedule and the numbers stay those of the GPU path, so CPU tests (and
``device=cpu`` runs) go through every line of ``StreamedStates``.

A device copy of a state is freed (its storage resized to zero bytes, as FSDP2 frees gathered weights) as soon as
its write-back is queued; ``record_stream`` keeps the caching allocator from handing the memory to anyone else
before the copy has read it.
"""

import ctypes
import weakref
from typing import List, Optional, Tuple

import torch

from finetune.host_memory import as_bytes

# Small host slots come out of pinned chunks of this size (a power of two: torch's pinned allocator rounds every
# request up to one, so a chunk wastes nothing and the slots in it waste at most their 512-byte alignment and the
# chunk's tail); a slot of more than LARGE_BYTES gets its exact size in a region of its own.
CHUNK_BYTES = 256 * 2**20
LARGE_BYTES = CHUNK_BYTES // 4
ALIGN = 512


class HostSlots:
    """Host memory for the states and streamed weights, handed out in 512-byte-aligned slots (a slot is never given
    back: a run's tensors keep their sizes). ``take`` hands slots out as they are asked for; ``take_all`` gives a
    known set of slots one region of their exact total.

    Host memory is what a 12-16 GB card's desktop is short of, so no slot wastes more than its alignment and the
    tail of a chunk: small slots share chunks of CHUNK_BYTES, each new one in the first chunk whose tail it fits
    (not only the last chunk's); a slot of more than LARGE_BYTES gets a region of its own, its exact size. Before,
    a new chunk was opened whenever the last one's tail was too short: an embedding's 263 MB 4-bit codes left up to a
    chunk's tail behind them, and the states of Llama 3.1 8B took 9.13 GB of chunks for 8.53 GB of states."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.chunks: List[torch.Tensor] = []
        self.regions: List[torch.Tensor] = []  # (exact: pinned in place)
        self.alone: List[torch.Tensor] = []  # (torch's pinned allocator's, where the driver cannot pin in place)
        self._used: List[int] = []  # bytes taken from each chunk

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``nbytes`` with a storage of its own (through numpy: a slice of the chunk tensor
        would share the chunk's storage, and torch.save writes a view's whole storage, so every checkpoint would
        carry whole chunks)."""
        if nbytes > LARGE_BYTES:
            return self.take_all([nbytes])[0]
        for i, chunk in enumerate(self.chunks):
            start = -(-self._used[i] // ALIGN) * ALIGN
            if start + nbytes <= chunk.numel():
                break
        else:
            self.chunks.append(torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=self.pin))
            self._used.append(0)
            i, start = len(self.chunks) - 1, 0
        self._used[i] = start + nbytes
        return torch.from_numpy(self.chunks[i].numpy()[start : start + nbytes])

    def take_all(self, sizes: List[int]) -> List[torch.Tensor]:
        """Slots of ``sizes`` bytes, laid end to end in one region of their exact total, pinned in place.

        Why not chunks: a region from torch's pinned allocator is rounded up to a power of two, and chunks leave
        tails wherever the next tensor does not fit. For the layer weights of ``stream_layers`` (tensors of 32
        to 130 MiB) that cost a third more host memory than the weights (7.0 GiB of chunks for Llama2-7B's 14
        layers, 5.3 GiB of weights): the margin a 32 GB desktop does not have. The region is ordinary host memory
        page-locked with cudaHostRegister, at its size; where the driver refuses that (some virtualised setups),
        each slot comes from torch's pinned allocator, rounded up as it rounds."""
        offsets, total = [], 0
        for n in sizes:
            total = -(-total // ALIGN) * ALIGN
            offsets.append(total)
            total += n
        region = torch.empty(total, dtype=torch.uint8)
        if self.pin and not _pin_in_place(region):
            return [self._pinned_alone(n) for n in sizes]
        self.regions.append(region)
        flat = region.numpy()
        return [torch.from_numpy(flat[o : o + n]) for o, n in zip(offsets, sizes)]

    def _pinned_alone(self, nbytes: int) -> torch.Tensor:
        """A slot of torch's pinned allocator, alone (the fallback where the driver cannot pin in place)."""
        if nbytes <= LARGE_BYTES:
            return self.take(nbytes)
        self.alone.append(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        return torch.from_numpy(self.alone[-1].numpy())

    @property
    def nbytes(self) -> int:
        """The host memory the slots hold: what the allocator handed over (torch's pinned allocator rounds a region
        of its own up to a power of two)."""
        exact = sum(c.numel() for c in self.chunks) + sum(r.numel() for r in self.regions)
        return exact + sum(1 << (a.numel() - 1).bit_length() for a in self.alone)


def _pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory for the GPU's copy engines (unlocked again when ``t`` is freed); False where the
    driver refuses."""
    cudart = torch.cuda.cudart()
    ptr = t.data_ptr()
    if int(cudart.cudaHostRegister(ptr, t.numel(), 0)) != 0:
        _clear_cuda_error()
        return False
    weakref.finalize(t, cudart.cudaHostUnregister, ptr).atexit = False  # (at exit the process's teardown unlocks)
    return True


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refusal we handled: torch checks it after every kernel launch and
    would report it there, far from its cause. (torch's cudart bindings have no cudaGetLastError; the runtime
    library torch loaded is found by its name.)"""
    try:
        ctypes.CDLL(f"libcudart.so.{torch.version.cuda.split('.')[0]}").cudaGetLastError()
    except (OSError, AttributeError):
        pass


class CudaLink:
    """Copies on two side streams of a CUDA device, and the time the training stream waited for them."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = HostSlots(pin=True)
        self.up = torch.cuda.Stream(device)  # host -> GPU
        self.down = torch.cuda.Stream(device)  # GPU -> host
        self._waits: List[Tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def fetch(self, pairs: List[Tuple[torch.UntypedStorage, torch.Tensor]], after: Optional[torch.cuda.Event]):
        """Give each storage its bytes again and copy its host slot in, on the up stream (after ``after``: the
        write-back that last filled these slots). Returns the event the training stream waits for."""
        with torch.cuda.stream(self.up):
            if after is not None:
                self.up.wait_event(after)
            for storage, host in pairs:
                storage.resize_(host.numel())  # allocated on the up stream, in its own pool of the allocator
                as_bytes(storage).copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.up)
        return done

    def use(self, pairs: List[Tuple[torch.UntypedStorage, torch.Tensor]], ready: torch.cuda.Event) -> None:
        """The training stream waits for ``ready``; its use of the storages is recorded for the allocator."""
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(ready)
        after.record(stream)
        self._waits.append((before, after))
        for storage, _ in pairs:
            as_bytes(storage).record_stream(stream)

    def write(self, pairs: List[Tuple[torch.UntypedStorage, torch.Tensor]]) -> torch.cuda.Event:
        """Copy each storage to its host slot on the down stream, once the training stream's work on it is done,
        and free the GPU copy. Returns the event after which the host slots hold the new values."""
        stepped = torch.cuda.Event()
        stepped.record(torch.cuda.current_stream(self.device))
        self.down.wait_event(stepped)
        with torch.cuda.stream(self.down):
            for storage, host in pairs:
                host.copy_(as_bytes(storage), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.down)
        for storage, _ in pairs:
            as_bytes(storage).record_stream(self.down)
            storage.resize_(0)
        return done

    def settle(self) -> None:
        """Block until every copy so far is complete (the host slots are then the states' values)."""
        self.down.synchronize()
        self.up.synchronize()

    def waited_ms(self) -> float:
        """Milliseconds the training stream waited for copies since the last call (waits for those events)."""
        total = 0.0
        for before, after in self._waits:
            after.synchronize()
            total += before.elapsed_time(after)
        self._waits.clear()
        return total


class StandInLink:
    """``CudaLink``'s work with synchronous copies between CPU tensors: the states still leave their "device"
    storages between steps and come back from host slots, so a CPU run or test exercises the whole schedule."""

    def __init__(self, device: torch.device):
        self.device = device
        self.slots = HostSlots(pin=False)

    def fetch(self, pairs, after):
        for storage, host in pairs:
            storage.resize_(host.numel())
            as_bytes(storage).copy_(host)
        return None

    def use(self, pairs, ready) -> None:
        pass

    def write(self, pairs):
        for storage, host in pairs:
            host.copy_(as_bytes(storage))
            storage.resize_(0)
        return None

    def settle(self) -> None:
        pass

    def waited_ms(self) -> float:
        return 0.0


def link_for(device: torch.device):
    return CudaLink(device) if device.type == "cuda" else StandInLink(device)
