"""Transformer layers whose weights live in host memory and come to the GPU for their forward and backward
(``stream_layers=N``, with ``stream_optimizer_states=True``).

Why: Llama 3.1 8B's bf16 weights (14.96 GiB) do not fit a 16 GB card at all, nor Llama2-7B's (12.55 GiB) a 12 GB one.
With optimizer-in-backward and every layer checkpointed, a layer's weights are needed at three moments of a step:
its forward, its recomputation and backward (one stretch), and its update right after. So ``N`` layers, spread
evenly over the stack, keep their weights in pinned host memory; each crosses the PCIe link twice up (forward,
backward) and once down (the updated weights) per step: 0.4 GB per 7-8B layer, ~8 ms each way at PCIe 5.0 x16,
against ~20 ms of compute per layer and step. The copies of the next streamed layer run while the resident layers
between compute; the update stays on the GPU, in the optimizer's kernel, with unchanged numbers.

The schedule, per streamed layer ``i`` (hooks on its checkpoint wrapper; a layer's recomputation runs inside the
wrapper, after them):

- forward: wait for its weights (prefetched), prefetch the next streamed layer's; after the layer, free its GPU copy
  (the host copy is unchanged), except the last streamed layer's, which backward needs first;
- backward: when the gradient reaches the layer's output, wait for its weights and prefetch the previous streamed
  layer's; after each weight's optimizer step (``StreamedStates``' ``after_step``), copy it down and free it;
- at the end of backward the first streamed layer is prefetched for the next forward.

So at most two streamed layers are on the GPU at once. Weights under ``MIN_BYTES`` (norms) stay resident.
Checkpoints read the host copies (a state-dict hook). Without gradients (validation) every layer is freed after
its forward.
"""

from typing import Any, Dict, List, Optional

import torch

from finetune.base import BadInput
from finetune.streaming.link import link_for

MIN_BYTES = 64 * 2**10


def streamed_params(layer: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The weights of ``layer`` that go to host memory: those of at least ``MIN_BYTES`` (the norms stay)."""
    return [p for p in layer.parameters() if p.numel() * p.element_size() >= MIN_BYTES]


def spread(count: int, layers: int) -> List[int]:
    """``count`` layer indices spread evenly over ``layers`` (each gap of resident layers hides a copy)."""
    return sorted({min(layers - 1, int((j + 0.5) * layers / count)) for j in range(count)})


def _rope_unbuilt(module: torch.nn.Module) -> bool:
    """A RoPE module whose cache a model built on the meta device lacks: a meta buffer, or (Llama 3's scaled RoPE)
    none built. It is built on the device then, as a resident run builds it; a cache that exists (a model built on
    the CPU) moves with the model unchanged, as a resident model's would: the GPU's cos and sin differ from the CPU's
    in the last bit, and a rebuilt one made the streamed run's first loss differ from the resident one's."""
    if not hasattr(module, "rope_init"):
        return False
    return getattr(module, "is_cache_built", True) is False or any(b.is_meta for b in module.buffers(recurse=False))


class _Layer:
    """One streamed layer: its streamed weights, their (device storage, host slot) pairs, and where they are."""

    def __init__(self, index: int, position: int, params: list, pairs: list):
        self.index, self.position, self.params, self.pairs = index, position, params, pairs
        self.nbytes = sum(h.numel() for _, h in pairs)
        self.ready: Any = None  # the fetch's event once fetched (None on CPU)
        self.on_device = False
        self.written: Any = None  # the write-back the next fetch waits for
        self.unwritten: set = set()  # parameters stepped in this backward still to be written down


class StreamedWeights:
    """Moves ``model`` to ``device`` except the big weights of the layers ``indices`` (of ``model.layers``), which
    go to host slots; registers the hooks that bring them back when needed.

    Call with the model still off the GPU (built on the meta device and given its weights with ``assign``, or on the
    CPU): it is never whole on the GPU. ``after_step`` goes to ``StreamedStates``. ``trace``: as StreamedStates'.
    """

    def __init__(
        self, model: torch.nn.Module, indices: List[int], device: torch.device, *, link: Any = None, trace=None
    ):
        self.link = link if link is not None else link_for(device)
        self.trace = trace
        self._layers: List[_Layer] = []
        self._of: Dict[torch.nn.Parameter, _Layer] = {}
        self._host: Dict[torch.nn.Parameter, torch.Tensor] = {}
        self._moved = 0
        self._in_backward = False
        streamed = [streamed_params(model.layers[i]) for i in indices]
        slots = iter(self.link.slots.take_all([p.numel() * p.element_size() for params in streamed for p in params]))
        for position, (i, params) in enumerate(zip(indices, streamed)):
            pairs = []
            for p in params:
                host = next(slots)
                host.view(p.dtype).view(p.shape).copy_(p.detach())
                p.data = torch.empty(p.shape, dtype=p.dtype, device=device)
                p.untyped_storage().resize_(0)
                pairs.append((p.untyped_storage(), host))
                self._host[p] = host
            layer = _Layer(i, position, params, pairs)
            self._layers.append(layer)
            self._of.update((p, layer) for p in params)
            model.layers[i].register_forward_pre_hook(self._before_forward(layer))
            model.layers[i].register_forward_hook(self._after_forward(layer))
        for module in model.modules():
            if any(p in self._host for p in module.parameters(recurse=False)):
                # (a function, not a bound method: the public hook API marks the callable it is given)
                module.register_state_dict_post_hook(lambda *args: self._host_views(*args))
        for module in model.modules():  # RoPE's cache, where the meta device left none: built on the device
            if _rope_unbuilt(module):
                with device:
                    module.rope_init()
        model.to(device)  # the rest (the streamed weights are there already, with no bytes)
        self.host_bytes = sum(layer.nbytes for layer in self._layers)

    # -- the schedule --------------------------------------------------------------------------------------

    def _note(self, op: str, layer: _Layer) -> None:
        if self.trace is not None:
            self.trace.append((op, f"layers.{layer.index}"))

    def _fetch(self, layer: _Layer) -> None:
        if layer.on_device:
            return
        self._note("fetch_weights", layer)
        layer.ready = self.link.fetch(layer.pairs, layer.written)
        layer.on_device = True
        self._moved += layer.nbytes

    def _ensure(self, layer: _Layer) -> None:
        self._fetch(layer)
        self._note("wait_weights", layer)
        self.link.use(layer.pairs, layer.ready)

    def _free(self, layer: _Layer) -> None:
        """Drop the GPU copy of weights that did not change (the host slots hold them)."""
        self._note("free_weights", layer)
        for storage, _ in layer.pairs:
            storage.resize_(0)
        layer.on_device = False

    def _neighbour(self, layer: _Layer, step: int) -> Optional[_Layer]:
        k = layer.position + step
        return self._layers[k] if 0 <= k < len(self._layers) else None

    def _before_forward(self, layer: _Layer):
        def hook(module, args):
            self._ensure(layer)
            following = self._neighbour(layer, 1)
            if following is not None:
                self._fetch(following)

        return hook

    def _after_forward(self, layer: _Layer):
        def hook(module, args, output):
            training = torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad
            if training:
                output.register_hook(self._backward_reaches(layer))
            if not training or self._neighbour(layer, 1) is not None:
                self._free(layer)

        return hook

    def _backward_reaches(self, layer: _Layer):
        def hook(grad):
            if not self._in_backward:
                self._in_backward = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            self._ensure(layer)
            layer.unwritten = set(layer.params)
            previous = self._neighbour(layer, -1)
            if previous is not None:
                self._fetch(previous)

        return hook

    def after_step(self, p: torch.nn.Parameter) -> None:
        """``p`` stepped: copy its new weights down to the host and free them on the GPU."""
        layer = self._of.get(p)
        if layer is None or p not in layer.unwritten:
            return
        layer.unwritten.discard(p)
        pair = [(p.untyped_storage(), self._host[p])]
        self._note("write_weights", layer)
        layer.written = self.link.write(pair)
        self._moved += pair[0][1].numel()
        if not layer.unwritten:
            layer.on_device = False

    def _backward_end(self) -> None:
        self._in_backward = False
        for layer in self._layers:  # (weights that got no gradient did not change: their host copy holds)
            if layer.on_device and layer.unwritten:
                layer.unwritten = set()
                self._free(layer)
        if self._layers:
            self._fetch(self._layers[0])  # the next forward's first streamed layer travels now

    # -- checkpoints and figures ---------------------------------------------------------------------------

    def _host_views(self, module, state_dict, prefix, local_metadata) -> None:
        self.link.settle()
        for name, p in module.named_parameters(recurse=False):
            if p in self._host and prefix + name in state_dict:
                state_dict[prefix + name] = self._host[p].view(p.dtype).view(p.shape)

    def metrics(self) -> Dict[str, float]:
        moved, self._moved = self._moved, 0
        return {"weights_copy_gb": moved / 1e9, "host_weights_gib": self.host_bytes / 2**30}


def streamed_indices(model: torch.nn.Module, count: int) -> List[int]:
    """The layers ``stream_layers=count`` streams, spread over the model (refused where it has fewer)."""
    layers = len(model.layers)
    if count > layers:
        raise BadInput(f"stream_layers={count} is more than the model's {layers} layers; set stream_layers<={layers}")
    return spread(count, layers)


def streamed_bytes(model: torch.nn.Module, indices: List[int]) -> int:
    """The bytes the weights of layers ``indices`` take in host memory once streamed (a meta model's too)."""
    return sum(p.numel() * p.element_size() for i in indices for p in streamed_params(model.layers[i]))


def stream_weights(model: torch.nn.Module, count: int, device: torch.device, *, trace=None) -> StreamedWeights:
    """``stream_layers=count``: check it against the model, then place the model (``StreamedWeights``). The host's
    room for the weights is checked before they are loaded, with the states' (room.check_host_room)."""
    return StreamedWeights(model, streamed_indices(model, count), device, trace=trace)


def step_metrics(states: Any, weights: Optional[StreamedWeights]) -> Dict[str, float]:
    """A step's streaming figures for metrics.jsonl: ``host_copy_gb`` counts states and weights together."""
    record = states.metrics() if states is not None else {}
    if weights is not None:
        extra = weights.metrics()
        record["host_copy_gb"] = record.get("host_copy_gb", 0.0) + extra["weights_copy_gb"]
        record.update(extra)
    return record
