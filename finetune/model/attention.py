"""Packed rows' attention (``packed_attention``), in both fine-tune recipes.

A packed row holds several samples, and no sample may attend to another: block-causal attention. torchtune builds a
flex-attention BlockMask for it (``flex``, its default). ``varlen`` lays the batch's rows end to end and hands
FlashAttention-2's variable-length kernel (``torch.nn.attention.varlen``) where each sample starts
(``cu_seqlens``): no score between two samples is computed, the kernel takes q, k and v in the projections' own
[tokens, heads, head_dim] layout (flex attention's [b, heads, s, head_dim] costs four transposing copies per layer
and step), nothing is built per batch on the GPU (the BlockMask is), and there is no flex kernel to compile. On
an H200 the Llama2-7B configs train 1.9-6.0 % faster with it, same losses (bench/results/llama2_7b_e2e_h200.json,
llama2_7b_fusion_h200.json), so they set it. It needs a CUDA GPU of compute capability 8.0 or later and torch 2.9 or
later.

``collate_varlen`` hands the model ``mask={"cu_seqlens": ...}`` instead of a BlockMask; ``use_varlen_attention``
points each attention layer's attention call at ``varlen_attention``. The number of samples in a batch changes from
batch to batch, so that size is marked dynamic before the first compile: every step of every process then runs one
graph, and no step after the first compiles. Left to torch.compile, the first step compiled a graph for its own count
and the second step a dynamic one, so a run resumed from a checkpoint took its first step with a graph the run it
continues no longer ran: the lead for such a first step's loss differing from that run's in the last bits
(docs/models.md, "Configs by card").
"""

import functools
import inspect
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import MultiHeadAttention

PACKED_ATTENTION = ("flex", "varlen")  # the values of packed_attention


def varlen_available() -> bool:
    """Whether this torch has FlashAttention's variable-length kernel (``torch.nn.attention.varlen``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _causal() -> dict:
    """The keyword that makes ``varlen_attn`` causal: torch 2.9-2.10 take is_causal, later releases a window, (-1, 0)
    being causal. Read once, not in every layer's forward."""
    from torch.nn.attention.varlen import varlen_attn

    return (
        {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}
    )


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int
) -> torch.Tensor:
    """Causal attention within each sequence of ``cu_seqlens``: q, k, v and the output are [tokens, heads, dim]."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **_causal())


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask, dropout_p: float = 0.0, is_causal: bool = True
) -> torch.Tensor:
    """An attention layer's attention call for packed rows: q, k, v are [b, heads, s, head_dim] (transposed views of
    the projections' [b, s, heads, head_dim]), ``mask`` is ``collate_varlen``'s ``{"cu_seqlens": ...}``; returns
    [b, heads, s, head_dim] as a transposed view, which the layer transposes back for free."""
    if not isinstance(mask, dict) or "cu_seqlens" not in mask:
        raise ValueError(
            f"packed_attention=varlen needs the batch's mask from finetune.model.attention.collate_varlen (a "
            f"dict with cu_seqlens), got {type(mask).__name__}: set packed_attention=flex, or use a "
            "packed dataset (dataset.packed=True)"
        )
    if dropout_p:
        raise ValueError(
            f"packed_attention=varlen has no attention dropout (attn_dropout={dropout_p}); set packed_attention=flex"
        )
    b, h, s, d = q.shape
    tokens = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    out = _flash_varlen(*tokens, mask["cu_seqlens"], s)
    return out.view(b, s, h, d).transpose(1, 2)


def use_varlen_attention(model: nn.Module) -> int:
    """Point every attention layer of ``model`` at ``varlen_attention``, and have the model's forward mark the
    number of samples dynamic (``_samples_dynamic``); returns how many layers."""
    count = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module._attention_call = varlen_attention
            count += 1
    model.register_forward_pre_hook(_samples_dynamic, with_kwargs=True)
    return count


def _samples_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Before the model's forward, outside the compiled layers: the batch's ``cu_seqlens`` has a dynamic length for
    torch.compile from the first batch on (a hint: a layer that needs the length fixed still gets it)."""
    mask = kwargs.get("mask")
    if isinstance(mask, dict) and isinstance(mask.get("cu_seqlens"), torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(mask["cu_seqlens"], 0)


def collate_varlen(batch: List[Dict[str, torch.Tensor]]) -> Dict[str, object]:
    """Collate packed rows (``packing.PackedSFTDataset`` items) for ``varlen_attention``: tokens, labels and
    input_pos stacked as torchtune's ``padded_collate_packed`` does, and ``mask={"cu_seqlens": int32}``: where each
    segment of each row starts in the batch's tokens laid end to end, then their total (a row's segments, the padding
    included, fill it exactly)."""
    lengths = torch.cat([item["seq_lens"] for item in batch])
    lengths = lengths[lengths > 0]
    cu_seqlens = F.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    total = sum(item["tokens"].numel() for item in batch)
    if int(cu_seqlens[-1]) != total:
        raise ValueError(f"packed rows' seq_lens add up to {int(cu_seqlens[-1])} tokens, not the batch's {total}")
    return {
        "tokens": torch.stack([item["tokens"] for item in batch]),
        "labels": torch.stack([item["labels"] for item in batch]),
        "input_pos": torch.stack([item["input_pos"] for item in batch]),
        "mask": {"cu_seqlens": cu_seqlens},
    }
