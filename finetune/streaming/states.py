"""Optimizer states in host memory, brought to the GPU one parameter at a time during backward
(``stream_optimizer_states=True``, with ``optimizer_in_bwd=True``).

Why: a 16 GB card holds Llama2-7B's bf16 weights (12.55 GiB) and a step's activations, but not also its AdamW
states, even 4-bit ones (6.7 GiB). With optimizer-in-backward each state is needed only for the moment its
parameter steps, so it can live in pinned host memory and cross the PCIe link twice per step (0.2 GB per layer of
4-bit states each way: ~4 ms at PCIe 5.0 x16, against ~10-20 ms of backward per layer), while the update itself stays
on the GPU, in the optimizer's own kernel, with unchanged numbers.

Per parameter, in the post-accumulate-grad hook that optimizer-in-backward steps it from:

1. the training stream waits for the copy that brought its states (issued earlier: a prefetch);
2. the copies of the next parameters' states are issued, in the order the last backward reached them, while the
   bytes fetched and not yet used stay within ``ahead_bytes`` (at least one parameter ahead: while one steps, the
   next travels);
3. its optimizer steps and zeroes its gradient, as in torchtune's hook;
4. its states' copy back to the host is queued, and their GPU memory freed.

The first backward learns the order: the optimizer creates each state on the GPU at its first step, and it is
written out right after. At the end of each backward the first parameters of the next one are fetched, so their
copies run during the forward pass. Copies use two side streams (``link.CudaLink``): up and down overlap.

What travels: every storage behind the optimizer's state tensors of at least ``min_bytes`` (a storage once, however
many views of it the state holds); small ones (norm weights' states, step counts) stay where they are. Any
optimizer whose step reads its states from ``optimizer.state`` tensors it keeps (torch's AdamW, ours, torchao's and
bitsandbytes' low-bit ones) can be streamed: the tensors keep their identity, only their bytes come and go.

Where the GPU has room to spare, ``resident_bytes`` of the states stay there (``resident_states_gib``): those of the
parameters the first backward reaches first, while their sum fits, are never written out, and each step moves only
the rest. Every byte kept saves two crossings of the link, so a model whose step waits on the link (a mixture of
experts' 30 GiB of states at 48 layers) steps faster by as much; the cost is that GPU memory, which the config's cap
must leave beside the weights and the step's activations. A resume decides again, in the order it loads.

Checkpoints read the host copies (``state_dict``); a resume loads one parameter at a time and writes each state out
before the next (``load_state_dict``), so the GPU never holds more than one parameter's state then either.
"""

from typing import Any, Callable, Dict, List, Optional

import torch

from finetune.streaming.link import link_for

AHEAD_BYTES = 256 * 2**20  # ~1 layer of Llama2-7B's 4-bit states: copied in ~5 ms, a layer's backward takes longer
MIN_BYTES = 64 * 2**10  # a smaller state is not worth a copy's launch; it stays on the GPU

_MISSING = object()
PROBE_NUMEL = 1 << 16  # large enough for every low-bit format's blocks and minimum size (4096 elements)


def state_bytes(build: Callable, params, device: torch.device, min_bytes: int = MIN_BYTES) -> int:
    """The bytes the streamed states of ``params`` take in host memory. The bytes per element come from one step of
    the configured optimizer on a probe parameter of the run's device and dtype (exact for every format, whatever
    class the config names); ``params`` may be on the meta device (only their sizes are read)."""
    params = list(params)
    if not params:
        return 0
    probe = torch.zeros(PROBE_NUMEL, dtype=params[0].dtype, device=device, requires_grad=True)
    probe.grad = torch.zeros_like(probe)
    opt = build([probe])
    opt.step()
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in _tensors(opt.state)}
    per_element = sum(storages.values()) / PROBE_NUMEL
    del opt, probe
    return sum(int(p.numel() * per_element) for p in params if p.numel() * per_element >= min_bytes)


def _tensors(obj: Any) -> List[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _rebuild(obj: Any, leaf: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with new containers and every tensor passed through ``leaf`` (torch's ``state_dict`` hands out the
    optimizer's own per-parameter dicts: never change those)."""
    if isinstance(obj, torch.Tensor):
        return leaf(obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, leaf) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_rebuild(v, leaf) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_rebuild(v, leaf) for v in obj)
    return obj


class StreamedStates:
    """Steps one optimizer per parameter in backward (it replaces torchtune's ``register_optim_in_bwd_hooks``),
    keeping their states in host memory between steps.

    ``optim_dict``: parameter -> its optimizer. ``state_dict``/``load_state_dict`` take and give what torchtune's
    ``OptimizerInBackwardWrapper`` does (parameter name -> optimizer state dict), so checkpoints are the same files
    whether the states were streamed or not. ``trace``: a list that gets ``(op, parameter name)`` for every fetch,
    wait, step and write, and ``("backward_end", None)``, in the order they are issued (for tests). ``after_step``
    is called with each parameter once its step is queued.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optim_dict: Dict[torch.nn.Parameter, torch.optim.Optimizer],
        device: torch.device,
        *,
        ahead_bytes: int = AHEAD_BYTES,
        min_bytes: int = MIN_BYTES,
        resident_bytes: int = 0,
        link: Any = None,
        trace: Optional[list] = None,
        after_step: Optional[Callable[[torch.nn.Parameter], None]] = None,
    ):
        self._optims = optim_dict
        self._by_name = {n: p for n, p in model.named_parameters() if p in optim_dict}
        self._name = {p: n for n, p in self._by_name.items()}
        self.link = link if link is not None else link_for(device)
        self.ahead_bytes, self.min_bytes, self.trace = ahead_bytes, min_bytes, trace
        self.resident_bytes = resident_bytes  # the budget of states kept on the device
        self._resident: Dict[torch.nn.Parameter, int] = {}  # parameters whose states stay: their bytes
        self._after_step = after_step  # (StreamedWeights: the parameter's own new weights go down too)
        self._pairs: Dict[torch.nn.Parameter, list] = {}  # streamed (device storage, host slot)s of each parameter
        self._bytes: Dict[torch.nn.Parameter, int] = {}
        self._order: List[torch.nn.Parameter] = []  # the last backward's hook order
        self._seen: List[torch.nn.Parameter] = []  # this backward's, so far
        self._next = 0  # where in _order the prefetch goes on from
        self._fetched: Dict[torch.nn.Parameter, Any] = {}  # fetched, not yet used: parameter -> its copy's event
        self._fetched_bytes = 0
        self._written: Dict[torch.nn.Parameter, Any] = {}  # the write-back a parameter's next fetch comes after
        self._in_backward = False
        self.device_bytes = 0  # state bytes on the device now: fetched, in use, created by a first step, or kept there
        self.peak_device_bytes = 0
        self._moved = 0  # bytes copied either way since the last metrics()
        for p in self._by_name.values():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._hook)

    # -- the schedule --------------------------------------------------------------------------------------

    def _note(self, op: str, p: Optional[torch.nn.Parameter]) -> None:
        if self.trace is not None:
            self.trace.append((op, None if p is None else self._name[p]))

    def _hook(self, p: torch.nn.Parameter) -> None:
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
        if self._pairs.get(p):
            ready = self._fetched.pop(p, _MISSING)
            if ready is _MISSING:  # not prefetched: a first step after a resume, or the order changed
                ready = self._fetch(p)
            else:
                self._fetched_bytes -= self._bytes[p]
            self._note("wait", p)
            self.link.use(self._pairs[p], ready)
        self._seen.append(p)
        self._next = max(self._next, len(self._seen))
        self._prefetch()
        self._note("step", p)
        opt = self._optims[p]
        opt.step()
        opt.zero_grad()
        self._write(p)
        if self._after_step is not None:
            self._after_step(p)

    def _prefetch(self) -> None:
        while self._next < len(self._order):
            q = self._order[self._next]
            if self._pairs.get(q) and q not in self._fetched:
                if self._fetched and self._fetched_bytes + self._bytes[q] > self.ahead_bytes:
                    return
                self._fetched[q] = self._fetch(q)
                self._fetched_bytes += self._bytes[q]
            self._next += 1

    def _fetch(self, p: torch.nn.Parameter) -> Any:
        self._note("fetch", p)
        ready = self.link.fetch(self._pairs[p], self._written.get(p))
        self._count_in(self._bytes[p])
        self._moved += self._bytes[p]
        return ready

    def _write(self, p: torch.nn.Parameter) -> None:
        pairs = self._pairs.get(p)
        if pairs is None:  # its first step created the states on the device
            pairs = self._pairs[p] = self._discover(p)
            self._bytes[p] = sum(h.numel() for _, h in pairs)  # (0 where they stay: counted once, by _discover)
            self._count_in(self._bytes[p])
        if not pairs:
            return
        self._note("write", p)
        self._written[p] = self.link.write(pairs)
        self.device_bytes -= self._bytes[p]
        self._moved += self._bytes[p]

    def _count_in(self, nbytes: int) -> None:
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _discover(self, p: torch.nn.Parameter) -> list:
        """The storages of ``p``'s optimizer state worth streaming, each with a host slot of its size; none where they
        stay on the device (within ``resident_bytes``, or kept there before a reload)."""
        storages, seen = [], set()
        for t in _tensors(self._optims[p].state):
            s = t.untyped_storage()
            if t.device.type != self.link.device.type or s.nbytes() < self.min_bytes or s._cdata in seen:
                continue
            seen.add(s._cdata)
            storages.append(s)
        nbytes = sum(s.nbytes() for s in storages)
        kept = sum(self._resident.values())
        if p in self._resident or (storages and kept + nbytes <= self.resident_bytes):
            if p not in self._resident:
                self._resident[p] = nbytes
                self._count_in(nbytes)
            return []
        return [(s, self.link.slots.take(s.nbytes())) for s in storages]

    def _backward_end(self) -> None:
        """Queued by the first hook of a backward; runs when the backward is done."""
        self._in_backward = False
        if self._seen:
            self._order, self._seen = self._seen, []
        self._next = 0
        self._note("backward_end", None)
        self._prefetch()  # the next backward's first states travel during the forward pass

    # -- checkpoints and figures ---------------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """parameter name -> its optimizer's state dict, every streamed tensor a view of its host copy (taken once
        the copies in flight are done; the next step's write-backs come after the caller's copies of it, in
        stream order)."""
        self.link.settle()
        host_of = {s._cdata: h for pairs in self._pairs.values() for s, h in pairs}

        def leaf(t: torch.Tensor) -> torch.Tensor:
            h = host_of.get(t.untyped_storage()._cdata)
            if h is None:
                return t
            size = t.element_size()
            offset = h.storage_offset() // size + t.storage_offset()  # (slots start 512-byte aligned)
            return torch.empty(0, dtype=t.dtype).set_(h.untyped_storage(), offset, t.size(), t.stride())

        return {n: _rebuild(self._optims[p].state_dict(), leaf) for n, p in self._by_name.items()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load what ``state_dict`` (or torchtune's wrapper) saved, one parameter at a time: each state goes to the
        device, is loaded, and is written out to the host before the next."""
        unexpected = sorted(set(state) - set(self._by_name))
        if unexpected:
            raise RuntimeError(f"optimizer state for unexpected parameters {unexpected[:3]}")
        missing = sorted(set(self._by_name) - set(state))
        if missing:
            raise RuntimeError(f"no optimizer state for parameters {missing[:3]}")
        for name, p in self._by_name.items():
            if self._pairs.get(p):  # streamed already: bring the bytes back before the optimizer copies into them
                self.link.use(self._pairs[p], self._fetch(p))
            # (fresh tensors on the device: torch's AdamW keeps what it is given where it can, and a checkpoint's
            # tensors may be read-only file maps, which a storage cannot be resized away from)
            self._optims[p].load_state_dict(_rebuild(state[name], lambda t: t.to(self.link.device, copy=True)))
            if self._pairs.get(p):
                self.device_bytes -= self._bytes[p]
            self._pairs.pop(p, None)  # (torch's AdamW loads into new tensors: find them again)
            self._write(p)
        self.link.settle()
        self._moved = 0

    def metrics(self) -> Dict[str, float]:
        """Since the last call: GB copied between host and device (both ways), and the milliseconds the training
        stream waited for copies; the host memory the states hold."""
        moved, self._moved = self._moved, 0
        return {
            "host_copy_gb": moved / 1e9,
            "copy_wait_ms": self.link.waited_ms(),
            "host_state_gib": self.link.slots.nbytes / 2**30,
            "resident_state_gib": sum(self._resident.values()) / 2**30,
        }
