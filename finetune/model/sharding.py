"""FSDP2's plumbing for the distributed recipe: the process group and rank 0's full weights scattered into the
shards (the optimizer state's shards are gathered and scattered by finetune/checkpoint/optimizer_state.py)."""

import os
import socket
from typing import Dict

import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
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
