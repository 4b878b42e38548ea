"""FSDP2's plumbing for the distributed recipe: the process group, rank 0's full weights scattered into the
shards, and whether an optimizer's state can be gathered into one unsharded state dict."""

import os
import socket
from typing import Any, Dict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtune import training


def init_process_group(device: torch.device) -> None:
    """NCCL for GPUs, gloo for the CPU. Without torchrun's variables, a world of one (handy for debugging)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(training.get_distributed_backend(device.type))


def scatter_full_weights(
    model: torch.nn.Module, full_sd: Dict[str, torch.Tensor], *, main: bool, device: torch.device
) -> None:
    """Scatter rank 0's full weights (``full_sd``; {} on the other ranks) into the model's shards, one tensor at a
    time.

    The other ranks pass an empty tensor of the full shape, which distribute_tensor ignores (it scatters rank 0's
    data), so no rank but 0 ever holds more than one full tensor.
    """
    sharded = {}
    for name, meta in model.state_dict().items():
        full = full_sd.pop(name) if main else torch.empty(meta.shape, dtype=meta.dtype, device=device)
        full = full.to(device, meta.dtype)
        sharded[name] = torch.nn.Parameter(
            distribute_tensor(full, meta.device_mesh, meta.placements, src_data_rank=0), requires_grad=True
        )
        del full
    model.load_state_dict(sharded, strict=True, assign=True)


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def optimizer_state_layout(optimizer: torch.optim.Optimizer) -> str:
    """``"full"`` if the state can be gathered into one unsharded state dict, else ``"per_rank"``.

    torch.optim keeps states shaped like the parameter (DTensors here), which torch's distributed state-dict
    utilities gather and re-shard for any rank count. Quantized states (ours: codes and block scales of the local
    shard, in flat buffers) are plain per-rank tensors with no global shape: only the rank that made them can
    load them.
    """
    for t in _tensors(dict(optimizer.state)):
        if t.dim() > 0 and not isinstance(t, DTensor):
            return "per_rank"
    return "full"
