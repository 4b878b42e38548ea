"""Fewer, larger GPU kernels for the same model and the same math: two options both fine-tune recipes apply.

``fuse_projections: True`` runs the projections that read the same input as one matmul: an attention layer's
query, key and value (``torch.cat`` of the three weights, one GEMM, then split) and the MLP's gate and up
projections. The modules, their parameters and the checkpoint keep their names and shapes: only the forward
changes, so checkpoints, optimizers (in backward too), resume and eval are unaffected. One GEMM of N = 12,288 (or
22,016) columns keeps the tensor cores busier than three of 4,096 (or two of 11,008), and the backward's input
gradient is one GEMM instead of three plus the sum. The cost: the concatenated weight, written each forward (the
size of the weights, ~0.3 ms per 7B step) and, where autograd keeps it for the backward, held as an activation.
Only plain ``nn.Linear`` layers of torchtune's ``MultiHeadAttention`` and ``FeedForward`` fuse: FP8 layers
(``fp8``), Qwen3's ``QKNormAttention`` and anything else keep their own forward.

``packed_attention: varlen`` (packed datasets on a CUDA GPU) computes the block-causal attention of packed rows with
FlashAttention-2's variable-length kernel (``torch.nn.attention.varlen``) instead of torchtune's flex-attention
BlockMask: the batch's rows are laid end to end and each sample is one sequence of ``cu_seqlens``, so no score
between two samples is computed, and the kernel's [tokens, heads, head_dim] layout is the projections' own, so the
output needs no transposing copy. The collate function (``collate_varlen``) hands the model
``mask={"cu_seqlens": ...}`` instead of a BlockMask; ``use_varlen_attention`` points each attention layer's
attention call at ``varlen_attention``.
"""

import inspect
from typing import Dict, List

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import FeedForward, MultiHeadAttention

PACKED_ATTENTION = ("flex", "varlen")  # the values of packed_attention


# ------------------------------------------------------------------------------------------------
# fuse_projections
# ------------------------------------------------------------------------------------------------

def _plain(*linears: nn.Module) -> bool:
    """Plain nn.Linear layers whose biases are all present or all absent (so weights and biases concatenate)."""
    return all(type(m) is nn.Linear for m in linears) and len({m.bias is None for m in linears}) == 1


def _fused_linear(x: torch.Tensor, *linears: nn.Linear) -> torch.Tensor:
    weight = torch.cat([m.weight for m in linears])
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
    return F.linear(x, weight, bias)


class FusedQKVAttention(MultiHeadAttention):
    """torchtune's MultiHeadAttention with q, k and v projected by one matmul in self-attention (``y is x``).

    Cross-attention and a model generating with its key-value cache take torchtune's forward unchanged."""

    def forward(self, x: torch.Tensor, y=None, *, mask=None, input_pos=None) -> torch.Tensor:
        if y is not x or (self.kv_cache is not None and self.cache_enabled):
            return super().forward(x, y, mask=mask, input_pos=input_pos)
        b, s, _ = x.shape
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = _fused_linear(x, self.q_proj, self.k_proj, self.v_proj).split([q_width, kv_width, kv_width], -1)
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
            k = self.pos_embeddings(k, input_pos=input_pos)
        # [b, heads, s, head_dim]; the norms after RoPE, as torchtune's forward applies them
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        if self.num_heads != self.num_kv_heads:  # grouped-query attention: each k/v head serves q_per_kv queries
            expand = (b, self.num_kv_heads, self.num_heads // self.num_kv_heads, s, self.head_dim)
            k = k.unsqueeze(2).expand(expand).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand).flatten(1, 2)
        output = self._attention_call(q, k, v, mask=mask, dropout_p=self.attn_dropout if self.training else 0.0,
                                      is_causal=self.kv_cache is None and mask is None and self.is_causal)
        return self.output_proj(output.transpose(1, 2).contiguous().view(b, s, -1))


class FusedGateUpFeedForward(FeedForward):
    """torchtune's FeedForward with the gate (w1) and up (w3) projections as one matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _fused_linear(x, self.w1, self.w3).split([self.w1.out_features, self.w3.out_features], -1)
        return self.w2(self.activation(gate) * up)


def fuse_projections(model: nn.Module) -> Dict[str, int]:
    """Give every fusable attention and MLP module of ``model`` its fused forward (in place: the same modules and
    parameters, another class). Call it after the weights are loaded and FP8 conversion, before activation
    checkpointing, sharding and compile. Returns how many attention and MLP modules fused."""
    counts = {"attention": 0, "mlp": 0}
    for module in model.modules():
        if type(module) is MultiHeadAttention and _plain(module.q_proj, module.k_proj, module.v_proj):
            module.__class__ = FusedQKVAttention
            counts["attention"] += 1
        elif type(module) is FeedForward and module.w3 is not None and _plain(module.w1, module.w3):
            module.__class__ = FusedGateUpFeedForward
            counts["mlp"] += 1
    return counts


# ------------------------------------------------------------------------------------------------
# packed_attention: varlen
# ------------------------------------------------------------------------------------------------

def varlen_available() -> bool:
    """Whether this torch has FlashAttention's variable-length kernel (``torch.nn.attention.varlen``)."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                  max_len: int) -> torch.Tensor:
    """Causal attention within each sequence of ``cu_seqlens``: q, k, v and the output are [tokens, heads, dim]."""
    from torch.nn.attention.varlen import varlen_attn

    # torch 2.9-2.10 take is_causal; later releases a window, (-1, 0) being causal
    if "window_size" in inspect.signature(varlen_attn).parameters:
        return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, window_size=(-1, 0))
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, is_causal=True)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask, dropout_p: float = 0.0,
                     is_causal: bool = True) -> torch.Tensor:
    """An attention layer's attention call for packed rows: q, k, v are [b, heads, s, head_dim] (transposed views of
    the projections' [b, s, heads, head_dim]), ``mask`` is ``collate_varlen``'s ``{"cu_seqlens": ...}``; returns
    [b, heads, s, head_dim] as a transposed view, which the layer transposes back for free."""
    if not isinstance(mask, dict) or "cu_seqlens" not in mask:
        raise ValueError(f"packed_attention=varlen needs the batch's mask from recipes._fusion.collate_varlen (a dict "
                         f"with cu_seqlens), got {type(mask).__name__}: set packed_attention=flex, or use a packed "
                         "dataset (dataset.packed=True)")
    if dropout_p:
        raise ValueError(f"packed_attention=varlen has no attention dropout (attn_dropout={dropout_p}); set "
                         "packed_attention=flex")
    b, h, s, d = q.shape
    tokens = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    out = _flash_varlen(*tokens, mask["cu_seqlens"], s)
    return out.view(b, s, h, d).transpose(1, 2)


def use_varlen_attention(model: nn.Module) -> int:
    """Point every attention layer of ``model`` at ``varlen_attention``; returns how many."""
    count = 0
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module._attention_call = varlen_attention
            count += 1
    return count


def collate_varlen(batch: List[Dict[str, torch.Tensor]]) -> Dict[str, object]:
    """Collate packed rows (``_packing.PackedSFTDataset`` items) for ``varlen_attention``: tokens, labels and
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
