"""The sparse mixture-of-experts block of Qwen3-MoE (``qwen3_moe``), and the decoder that adds its load-balancing loss.

torchtune 0.6.1 has no MoE modules; these are ours, built into torchtune's TransformerDecoder by
``finetune.model.builders.decoder`` (``num_experts`` > 0). Per sparse layer, for each token:

- the router (a linear layer, ``router``: config.json's ``mlp.gate``) gives a logit per expert; their softmax, in fp32,
  gives probabilities, and the token goes to its ``num_experts_per_tok`` most probable experts, weighted by those
  probabilities (renormalised to sum to 1 with ``norm_topk_prob``);
- dropless: every routed token is computed by its experts (no capacity, no token dropped), each a SwiGLU MLP of width
  ``moe_intermediate_size``, and the outputs are summed with the routing weights.

The experts are held as two stacked tensors, ``gate_up_proj`` [E, 2I, H] (each expert's gate rows, then its up rows)
and ``down_proj`` [E, H, I], transformers 5's own layout. Stacked, 128 experts are two parameters per layer instead of
384: one optimizer step each (4-bit AdamW's blocks run across experts), one host copy each when streamed, and one
grouped GEMM per projection. The tokens are sorted by expert, so each expert's tokens are one contiguous run, and:

- on a CUDA GPU of compute capability 9.0 or later, in bf16 (what torch's kernel takes), ``torch._grouped_mm`` runs
  every expert's GEMM in one launch from the runs' end offsets, with no host sync;
- elsewhere (the CPU, an A100, fp32) a loop over the experts that received tokens, one matmul each (the number of
  tokens per expert goes to the host once per layer).

Both compute the same function (tests/finetune/model/test_moe.py holds them equal, forward and backward; the GPU-marked
test there does it on the CUDA kernel). ``Experts.path`` forces one (``"grouped_mm"``, ``"loop"``; ``"auto"``).
The reorderings around them (the tokens' copies into expert order and the outputs back) are gathers whose backward
is a gather too (``_Dispatch``, ``_Permute``), not torch's index_put with its sort and accumulation.

An expert that receives no token in a step gets a zero gradient slice (its rows of the stacked tensors took no part),
not "no gradient": every AdamW variant then decays its moments and moves it by the decayed momentum, as torch's AdamW
does for any zero gradient (docs/models.md, "Mixture of experts").

The load-balancing loss is transformers' (``load_balancing_loss_func``, the Switch Transformer's): over all sparse
layers of one forward and every token position of the batch (padding included: the recipes pass no attention mask),
``num_experts * sum_e f_e * P_e`` with ``f_e`` the share of top-k assignments to expert ``e`` and ``P_e`` its mean router
probability. ``MoeDecoder.aux_loss`` holds it after each forward; ``loss.training_loss`` adds
``router_aux_loss_coef`` times it to the training loss, as transformers' ``Qwen3MoeForCausalLM`` does with
``output_router_logits``.
"""

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torchtune.modules import TransformerDecoder

EXPERT_PATHS = ("auto", "grouped_mm", "loop")


def grouped_mm_suits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM kernel takes these tensors: CUDA of compute capability 9.0+ (Hopper's kernel; on
    older cards torch's own fallback is a loop), bf16, and rows of a multiple of 16 bytes (hidden and expert widths
    multiples of 8)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
        and gate_up.shape[-1] % 8 == 0
        and down.shape[-1] % 8 == 0
    )


class _Dispatch(torch.autograd.Function):
    """The tokens' routed copies in expert order, ``x[order // top_k]``, with a backward that gathers.

    torch's backward of an indexing is index_put with accumulation: a sort of the indices and a sum of duplicates, on
    ``top_k`` times the tokens, every sparse layer. Here the index's shape is known: copy ``order[p]`` of token
    ``order[p] // top_k`` sits at ``p``, so a token's gradient is its ``top_k`` copies' gradients, gathered back to
    token-major order (``position``, the inverse of ``order``) and summed: a gather and a sum (accumulated in fp32 by
    torch's sum for bf16), deterministic, no sort."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, position: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(position)
        ctx.top_k = top_k
        return x[order // top_k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (position,) = ctx.saved_tensors
        summed = grad[position].view(position.numel() // ctx.top_k, ctx.top_k, grad.shape[-1]).sum(dim=1)
        return summed, None, None, None


class _Permute(torch.autograd.Function):
    """``rows[index]`` for an ``index`` that is a permutation (each row read once), whose backward is the gather by
    the ``inverse`` permutation rather than index_put's sort and accumulation."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return rows[index]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return grad[inverse], None, None


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs of width ``hidden_dim`` on a residual of ``dim``, as two stacked tensors."""

    def __init__(self, num_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.path = "auto"  # "grouped_mm" or "loop" forces one (the tests compare them)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """nn.Linear's default initialisation, per expert (a random-init run; a checkpoint's weights replace it)."""
        for weight in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x`` [N, dim]: the routed copies of the tokens sorted by expert, ``counts[e]`` of them for expert ``e``;
        returns each copy's output [N, dim] in the same order."""
        path = self.path
        if path == "auto":
            path = "grouped_mm" if grouped_mm_suits(x, self.gate_up_proj, self.down_proj) else "loop"
        if path == "grouped_mm":
            offsets = counts.cumsum(0).to(torch.int32)  # where each expert's run ends
            # (a transposed view: the kernel takes the weights column-major, as nn.Linear stores them)
            gate, up = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offsets).chunk(2, dim=-1)
            return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offsets)
        outputs, start = [], 0
        for expert, n in enumerate(counts.tolist()):
            if n:
                gate, up = F.linear(x[start : start + n], self.gate_up_proj[expert]).chunk(2, dim=-1)
                outputs.append(F.linear(F.silu(gate) * up, self.down_proj[expert]))
                start += n
        return torch.cat(outputs) if outputs else x.new_zeros(0, self.down_proj.shape[1])


class SparseMoe(nn.Module):
    """Qwen3-MoE's sparse block: softmax router, top-k, optional renormalisation, dropless experts.

    While its decoder's forward runs, ``record`` is True and the block keeps its routing statistics (the
    load-balancing loss's inputs) in ``routed``; otherwise it records nothing (so activation checkpointing's
    recomputation in backward, which runs the block again outside the decoder's forward, counts nothing twice).
    A flag and an attribute of the block's own, not a list shared by the layers: torch.compile guards on what a
    compiled layer reads, and a shared list's length (the layer's index) would make one graph per layer, past
    compile's limit of 8 recompilations at Qwen3-30B-A3B's 48; the flag makes two graphs for every layer."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, num_experts_per_tok: int, norm_topk_prob: bool):
        super().__init__()
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = Experts(num_experts, dim, hidden_dim)
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, num_experts_per_tok, norm_topk_prob
        self.record = False
        self.routed: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])
        tokens = x.shape[0]
        probs = torch.softmax(self.router(x), dim=-1, dtype=torch.float32)  # [T, E], fp32 as transformers routes
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        chosen = chosen.reshape(-1)  # [T * k], token-major
        # per expert, its routed copies (scatter_add on integers: no host sync, the same sums on every run)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, chosen, torch.ones_like(chosen))
        if self.record:  # (tensors only: under compile nothing symbolic leaves the layer)
            self.routed = (counts, probs.sum(dim=0))
        order = chosen.argsort(stable=True)  # the copies sorted by expert
        position = torch.empty_like(order)  # where each copy (token-major) sits in that order: order's inverse
        position[order] = torch.arange(order.numel(), device=order.device)
        y = self.experts(_Dispatch.apply(x, order, position, self.top_k), counts)
        # back to token-major order, then each token's k outputs summed with its weights (one small GEMM per token,
        # accumulated in fp32 inside it: deterministic, unlike an atomic index_add)
        y = _Permute.apply(y, position, order).view(tokens, self.top_k, shape[-1])
        out = torch.bmm(weights.to(y.dtype).unsqueeze(1), y)
        return out.view(shape)


def load_balancing_loss(stats: List[Tuple[torch.Tensor, torch.Tensor]], num_experts: int, top_k: int) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` from the sparse layers' (assignments per expert, probability sums):
    both summed over layers, each divided by the rows of all layers (every row made ``top_k`` assignments), their dot
    product times the number of experts: ``top_k`` for a perfectly even routing (each row counts its k assignments),
    more as the routing concentrates. The gradient reaches the router through the probabilities only."""
    counts = torch.stack([c for c, _ in stats]).sum(dim=0)  # (integers: exact at any batch)
    rows = counts.sum() / top_k
    probs = torch.stack([p for _, p in stats]).sum(dim=0) / rows
    counts = (counts / rows).float()
    return num_experts * torch.sum(counts * probs)


class MoeDecoder(TransformerDecoder):
    """torchtune's TransformerDecoder whose sparse layers' routing gives ``aux_loss`` (the load-balancing loss of the
    last forward; None with no sparse layer). ``moe_fields``: the config.json fields of the MoE part the model was
    built with (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``, ``norm_topk_prob``,
    ``decoder_sparse_step``, ``mlp_only_layers``, ``router_aux_loss_coef``, the dense layers' ``intermediate_size``),
    which a checkpoint's config.json is written with."""

    def __init__(self, *, moe_fields: Dict[str, Any], **decoder: Any):
        super().__init__(**decoder)
        self.moe_fields = dict(moe_fields)
        self.router_aux_loss_coef = float(moe_fields["router_aux_loss_coef"])
        self.aux_loss: Optional[torch.Tensor] = None
        # (a plain list: the blocks stay registered under their layers only; wrappers added later keep these objects)
        self._sparse = [m for m in self.modules() if isinstance(m, SparseMoe)]

    def forward(self, tokens: torch.Tensor, **kwargs: Any):
        for block in self._sparse:
            block.record, block.routed = True, None
        try:
            output = super().forward(tokens, **kwargs)
            stats = [block.routed for block in self._sparse if block.routed is not None]
        finally:
            for block in self._sparse:
                block.record, block.routed = False, None
        fields = self.moe_fields
        self.aux_loss = (
            load_balancing_loss(stats, fields["num_experts"], fields["num_experts_per_tok"]) if stats else None
        )
        return output
