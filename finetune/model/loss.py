"""The output layer and its cross-entropy in one step, so the logits of a whole batch never exist (``loss=``).

    loss:
      _component_: finetune.model.LinearCrossEntropyLoss
      impl: auto          # cce, liger, torch; auto = cce, else liger, on a GPU; torch on the CPU
      num_chunks: 8       # the torch path's chunks

With this loss the model returns its last hidden state (after the final norm) instead of logits, and the loss
multiplies by the output weight (the embedding's, when tied) itself. What each path keeps for the backward pass,
at N tokens per micro-batch, vocabulary V, hidden size d:

- ``cce`` (Apple's cut-cross-entropy, ``pip install cut-cross-entropy``): nothing of size N x V. Its Triton kernels
  compute the log-sum-exp and the gradients block by block, and skip gradient blocks below bf16 resolution (its
  default ``filter_eps``).
- ``liger`` (LinkedIn's liger-kernel, ``pip install liger-kernel``): nothing of size N x V either; it computes the
  gradients chunk by chunk during the forward pass and keeps the output weight's gradient (V x d) until backward.
- ``torch`` (no extra package, any device): ``num_chunks`` chunks of tokens, each chunk's logits made, reduced to its
  loss and dropped; the backward pass makes them again (one more N x d x V matmul, checkpointing per chunk). It peaks
  at one chunk's fp32 logits, N / num_chunks x V x 4 bytes.

torchtune's ``CEWithChunkedOutputLoss``, which every Llama 2 config uses, keeps the bf16 logits of the whole batch
(N x V x 2 bytes: 0.5 GiB at 8,192 tokens x 32,000 for Llama 2; 2.0 GiB at 128,256 for Llama 3; 2.3 GiB at 151,936
for Qwen) and in backward their gradient of the same size, besides one chunk's fp32 copy. ``bench/model_families.py``
measures the paths against it per family (``--loss-rows``).
"""

from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from finetune.base import BadInput

IMPLS = ("auto", "cce", "liger", "torch")
INSTALL = {"cce": "pip install cut-cross-entropy", "liger": "pip install liger-kernel"}


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed cross-entropy of one chunk of tokens, its logits upcast to fp32 (as CEWithChunkedOutputLoss does)."""
    return F.cross_entropy(F.linear(hidden, weight).float(), labels, ignore_index=ignore_index, reduction="sum")


def _kernel(impl: str) -> Optional[Callable]:
    """The library's function, or None where it is not installed."""
    try:
        if impl == "cce":
            from cut_cross_entropy import linear_cross_entropy

            return lambda h, w, y, ignore: linear_cross_entropy(h, w, y, ignore_index=ignore, reduction="sum")
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w, y, ignore: liger_fused_linear_cross_entropy(h, w, y, ignore_index=ignore, reduction="sum")
    except ImportError:
        return None


class LinearCrossEntropyLoss(nn.Module):
    """Mean cross-entropy over the labels that are not ``ignore_index``, from the model's last hidden state."""

    def __init__(self, impl: str = "auto", num_chunks: int = 8, ignore_index: int = -100):
        super().__init__()
        if impl not in IMPLS:
            raise BadInput(f"loss.impl={impl!r} is not one of {', '.join(IMPLS)}; set loss.impl=auto")
        if not (isinstance(num_chunks, int) and num_chunks >= 1):
            raise BadInput(f"loss.num_chunks={num_chunks!r} must be a positive integer; set e.g. loss.num_chunks=8")
        self.requested, self.num_chunks, self.ignore_index = impl, num_chunks, ignore_index
        self.impl: Optional[str] = None  # resolved by set_model_output
        self._weight: Optional[Callable[[], torch.Tensor]] = None
        self._fused: Optional[Callable] = None
        self._chunk = _chunk_loss

    def set_model_output(self, model: nn.Module, compile: bool = False) -> str:
        """Make ``model`` return its final-norm hidden state, take its output weight, and pick the path for its
        device (``_model.wire_loss`` calls it). Returns the path's name."""
        output = model.output  # an nn.Linear, or torchtune's TiedLinear (not a Module) holding the embedding
        self._weight = (lambda: output.weight) if isinstance(output, nn.Module) else (lambda: output.tied_module.weight)
        norm = model.norm
        model.unembed = lambda h: norm(h)  # (a function, not a Module: the state dict keeps its keys)
        on_gpu = self._weight().device.type == "cuda"
        impl = self.requested
        if impl == "auto":
            impl = next((i for i in ("cce", "liger") if on_gpu and _kernel(i) is not None), "torch")
        elif impl != "torch":
            if not on_gpu:
                raise BadInput(
                    f"loss.impl={impl} runs Triton kernels on a CUDA GPU; on the CPU use loss.impl=torch (or auto)"
                )
            if _kernel(impl) is None:
                raise BadInput(
                    f"loss.impl={impl} needs its library: {INSTALL[impl]} (or pip install -e "
                    "'.[fused-ce]'), or set loss.impl=torch"
                )
        self.impl = impl
        self._fused = None if impl == "torch" else _kernel(impl)
        if compile and impl == "torch":
            self._chunk = torch.compile(_chunk_loss)
        return impl

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self._weight is None:
            raise RuntimeError("LinearCrossEntropyLoss needs set_model_output(model) before its first call")
        weight = self._weight()
        if hasattr(weight, "full_tensor"):  # a DTensor shard (FSDP2): the loss needs all of it
            weight = weight.full_tensor()
        hidden, labels = hidden.reshape(-1, hidden.size(-1)), labels.reshape(-1)
        count = (labels != self.ignore_index).sum()
        if self._fused is not None:
            return self._fused(hidden, weight, labels, self.ignore_index) / count
        total = 0.0
        for h, y in zip(hidden.chunk(self.num_chunks), labels.chunk(self.num_chunks)):
            total = total + checkpoint(self._chunk, h, weight, y, self.ignore_index, use_reentrant=False)
        return total / count


def training_loss(model: nn.Module, loss: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The loss a step trains on after ``model``'s last forward: ``loss`` (its cross-entropy) plus
    ``router_aux_loss_coef`` times the load-balancing loss for a mixture of experts (transformers' training loss), and
    that loss unscaled and detached for the metrics (``aux_loss``); a dense model's ``loss`` and None. (Here, not in
    finetune/model/moe.py, which only a mixture of experts' run imports: a dense config's end-to-end row names the
    files its run imported, and a change to the MoE blocks leaves it current.)"""
    aux = getattr(model, "aux_loss", None)
    if aux is None:
        return loss, None
    return loss + model.router_aux_loss_coef * aux, aux.detach()
