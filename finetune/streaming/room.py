"""Before the weights are loaded: the host memory a streamed run will pin, against what the machine has.

A small-card config keeps its optimizer states (``stream_optimizer_states``) and some layers' weights
(``stream_layers``) in pinned host memory. Checked once the model is built on the meta device, before the 13-16 GB of
weights are read, so a machine without the room gets one line and a fix instead of a kernel OOM kill mid-run.
"""

from typing import Callable, Dict

import torch

from finetune.base import BadInput
from finetune.host_memory import available_host_bytes
from finetune.streaming.states import state_bytes
from finetune.streaming.weights import streamed_bytes, streamed_indices


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 // 10 else f"{nbytes / 2**20:.1f} MiB"


def check_host_room(
    model: torch.nn.Module,
    *,
    build: Callable,
    states: bool,
    layers: int,
    device: torch.device,
    resident: int = 0,
) -> Dict[str, int]:
    """The bytes the run pins in host memory ({what: bytes}); a BadInput naming them, what the machine has and the
    fix where they do not fit its available memory (MemAvailable less a reserve). ``resident``: bytes of the states
    kept on the GPU (at most that: whole parameters' states are kept, so the host may hold a little more)."""
    parts: Dict[str, int] = {}
    if states:
        parts["optimizer states"] = max(0, state_bytes(build, model.parameters(), device) - resident)
    per_layer = 0
    if layers:
        weights = streamed_bytes(model, streamed_indices(model, layers))
        parts[f"{layers} layers' weights"], per_layer = weights, weights // layers
    need, free = sum(parts.values()), available_host_bytes()
    if free is None or need <= free:
        return parts
    fits = (free - parts.get("optimizer states", 0)) // per_layer if per_layer else -1
    fix = f"stream fewer layers (stream_layers={fits} fits, with less room on the GPU), " if 0 <= fits < layers else ""
    what = ", ".join(f"{k} {_size(v)}" for k, v in parts.items())
    raise BadInput(
        f"this config keeps {_size(need)} in pinned host memory ({what}) besides the process and its "
        f"activations; this machine has {_size(max(free, 0))} available (MemAvailable less a reserve): "
        f"free host memory, {fix}or use the config of a larger GPU class (docs/models.md, Configs by card)"
    )
