"""The device and the model as both fine-tune recipes prepare them: the CUDA allocator and memory cap, activation
checkpointing, torch.compile, the chunked loss's output split. The recipes build the model (on the device, or on the
meta device before sharding) and load its weights; everything else about it is here.
"""

import os
from typing import Optional

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torchtune import training, utils

from finetune.base import BadInput

log = utils.get_logger("INFO")

FP8_RECIPES = ("tensorwise", "rowwise")  # the values of fp8: torchao's float8 training recipes (dynamic scaling)


def prepare_device(device: torch.device, memory_limit_gib: Optional[float]) -> None:
    """On a GPU: expandable segments unless the user configured the allocator, and ``device_memory_limit_gib``.

    Without expandable segments, a training step's changing allocation sizes leave the caching allocator holding
    far more than it uses (98 GiB reserved for 71 GiB allocated, measured at 7B with AC off): reserved memory is
    what runs out on a card. Set before the first allocation; any setting of ``PYTORCH_CUDA_ALLOC_CONF`` (or
    ``PYTORCH_ALLOC_CONF``), even an empty one, is left alone. The memory cap makes the caching allocator refuse
    to grow past that share of the card: a run that fits here fits a card of that size (the CUDA context,
    ~0.5 GiB, comes on top on a real card).
    """
    if device.type != "cuda":
        return
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if memory_limit_gib is not None:
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(memory_limit_gib / total, device)


def apply_activation_checkpointing(model: torch.nn.Module, every_n: int = 1) -> int:
    """Recompute the activations of one transformer layer in every ``every_n`` in the backward pass.

    Layers every_n - 1, 2 * every_n - 1, ... (0-based) are wrapped; every_n=1 wraps all of them. Each checkpointed
    layer keeps only its input (tokens x dim) instead of every intermediate, for one more forward pass of that layer
    in the backward. Returns the number of layers checkpointed.
    """
    count = 0
    for i, layer in enumerate(model.layers):
        if (i + 1) % every_n == 0:
            model.layers[i] = checkpoint_wrapper(
                layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False
            )
            count += 1
    return count


def wire_loss(model: torch.nn.Module, loss_fn: torch.nn.Module, *, compiled: bool, verbose: bool = True) -> None:
    """Compile the loss with the model (``compiled``: the config's ``compile``) and split the output projection into the chunks torchtune's
    chunked cross-entropy takes (it then never holds the fp32 logits of a whole batch). A loss that applies the
    output layer itself (``finetune.model.LinearCrossEntropyLoss``) takes the model instead: it then returns its
    last hidden state, and the loss compiles what it runs."""
    if hasattr(loss_fn, "set_model_output"):
        impl = loss_fn.set_model_output(model, compile=compiled)
        if verbose:
            log.info(f"Loss: the output layer's linear cross-entropy in one step ({impl})")
        return
    if compiled:
        training.compile_loss(loss_fn, verbose=verbose)
    if loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
        model.set_num_output_chunks(loss_fn.num_output_chunks)


# ------------------------------------------------------------------------------------------------
# FP8 matmuls (``fp8``)
# ------------------------------------------------------------------------------------------------


def fp8_suits(name: str, linear: torch.nn.Module, recipe: str) -> bool:
    """Whether the linear layer ``name`` runs its matmuls in FP8 under ``recipe``.

    Only the transformer layers' projections: the output projection (the vocabulary logits, whose loss is the most
    precision-sensitive step) and anything outside ``layers.`` stay in bf16. A layer's dimensions must be multiples
    of 16 (the FP8 tensor cores' requirement), and small layers stay in bf16 where the casts cost more than the
    faster matmul saves: torchao's thresholds from its H100 measurements (tensorwise: not when in <= 4096 and
    out <= 1024; rowwise: out > 2048, in > 1024, and not both out <= 4096 and in <= 2048). Every projection of a
    7-8B model converts; a 3B model's key/value projections (out 1024) stay in bf16 under tensorwise.
    """
    if not (isinstance(linear, torch.nn.Linear) and name.startswith("layers.")):
        return False
    out_features, in_features = linear.weight.shape
    if out_features % 16 or in_features % 16:
        return False
    if recipe == "tensorwise":
        return not (in_features <= 4096 and out_features <= 1024)
    return out_features > 2048 and in_features > 1024 and not (out_features <= 4096 and in_features <= 2048)


def convert_to_fp8(model: torch.nn.Module, recipe: str, *, suits=fp8_suits) -> int:
    """Swap the linear layers that ``suits`` into torchao's Float8Linear (dynamic scaling, ``recipe``): their
    matmuls cast inputs, weights and output gradients to FP8 with fresh scales each step, and the weights, their
    gradients and the optimizer stay as they are (bf16 parameters, the same Parameter objects). Call it after the
    weights are loaded and before activation checkpointing and compile. Returns the number of layers converted."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = []

    def keep(module: torch.nn.Module, fqn: str) -> bool:
        ok = suits(fqn, module, recipe)
        if ok:
            converted.append(fqn)
        return ok

    convert_to_float8_training(model, module_filter_fn=keep, config=Float8LinearConfig.from_recipe_name(recipe))
    if not converted:  # (a run that asked for FP8 would otherwise train in bf16 without a word)
        raise BadInput(
            f"fp8={recipe} converts no layer of this model: its projections are too small for FP8 to pay or not "
            "multiples of 16 (docs/recipes.md, FP8 matmuls); set fp8=null"
        )
    return len(converted)
