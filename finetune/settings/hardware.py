"""The keys that depend on the machine: ``fp8`` (FP8 tensor cores, compile) and ``packed_attention``
(FlashAttention's variable-length kernel on a CUDA GPU). Read against the device the run uses."""

from typing import Optional

import torch
from omegaconf import DictConfig

from finetune.base import BadInput
from finetune.model import attention
from finetune.model.prepare import FP8_RECIPES


def read_packed_attention(cfg: DictConfig, device: torch.device, *, packed: bool) -> str:
    """``packed_attention``: ``flex`` (torchtune's BlockMask, the default) or ``varlen`` (FlashAttention's
    variable-length kernel, finetune/model/attention.py): a packed dataset on a CUDA GPU of compute capability 8.0 or later,
    with a torch that has ``torch.nn.attention.varlen``."""
    value = cfg.get("packed_attention", "flex")
    if value not in attention.PACKED_ATTENTION:
        raise BadInput(
            f"packed_attention={value!r} is not an attention of packed rows; use packed_attention=flex "
            "(torchtune's flex-attention block mask) or packed_attention=varlen (FlashAttention's "
            "variable-length kernel, CUDA)"
        )
    if value == "flex":
        return value
    if not packed:
        raise BadInput(
            "packed_attention=varlen computes the attention of packed rows and needs dataset.packed=True; "
            "set dataset.packed=True, or packed_attention=flex"
        )
    if device.type != "cuda":
        raise BadInput(
            f"packed_attention=varlen runs FlashAttention's CUDA kernel and needs device=cuda "
            f"(device={device}); set packed_attention=flex"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 0):
        raise BadInput(
            f"packed_attention=varlen needs FlashAttention-2's GPUs (compute capability 8.0 or later: "
            f"Ampere, Hopper); {torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
            "set packed_attention=flex"
        )
    if not attention.varlen_available():  # (a module attribute: tests stand in for the kernel)
        raise BadInput(
            f"packed_attention=varlen needs torch.nn.attention.varlen (torch 2.9 or later; this is torch "
            f"{torch.__version__}); set packed_attention=flex"
        )
    return value


def read_fp8(cfg: DictConfig, device: torch.device, compile_: bool) -> Optional[str]:
    """``fp8``: null (bf16 matmuls), ``tensorwise`` or ``rowwise`` (torchao's float8 training recipes).

    On a GPU it needs FP8 tensor cores (compute capability 8.9: Ada, Hopper and later) and ``compile=True``: eager,
    every cast is a kernel of its own and FP8 runs slower than bf16. On the CPU, torch emulates the FP8 matmuls
    (correct, slow): allowed with or without compile, for tests and debugging.
    """
    value = cfg.get("fp8")
    if value in (None, False, "off"):
        return None
    if value not in FP8_RECIPES:
        raise BadInput(
            f"fp8={value!r} is not an FP8 recipe; use fp8=tensorwise (one scale per tensor, the fastest), "
            "fp8=rowwise (one scale per row), or fp8=null for bf16 matmuls"
        )
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise BadInput(
                f"fp8={value} needs FP8 tensor cores (compute capability 8.9 or later: Ada, Hopper); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: set fp8=null"
            )
        if not compile_:
            raise BadInput(
                f"fp8={value} needs compile=True on a GPU (eager, each FP8 cast is a kernel of its own and "
                "the step is slower than in bf16); set compile=True, or fp8=null"
            )
    return value
