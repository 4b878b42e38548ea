"""What a run that runs out of GPU memory prints: one ``error:`` line instead of torch's 30-line traceback.

The line says where it happened (setup, or the step), the peak the run reached against what it had (the GPU's
capacity, or the ``device_memory_limit_gib`` cap), what to change (the config of a smaller memory class beside the
one in use, else the keys that cut memory and are not on yet), and the last checkpoint, which is left as it was
(a checkpoint being written in the background is finished first, by the recipe). The recipes exit 2, as for any
other input that does not fit.
"""

import re
import resource
from pathlib import Path
from typing import List, Optional, Sequence

import torch

from finetune.base import first_line
from finetune.reporting.console import config_path_of
from finetune.reporting.metrics import latest_checkpoint

# A memory-class config is named <size>_full_<N>gb[_variant].yaml (configs/llama2/7B_full_24gb_fp8.yaml).
CLASS_NAME = re.compile(r"^(?P<size>[^_]+)_full_(?P<gib>\d+)gb(?P<variant>_\w+)?\.yaml$")
# A card sold as N GB reports a little less to CUDA (its total capacity: an RTX 4090 about 23.6 GiB, a 32 GB RTX
# 5090 31.4, an 8 GB RTX 4060 7.75): the N GB class is the one for a card, or a cap, of at least CARD_SHARE x N GiB.
# Compared with N itself, no card would be offered its own class.
CARD_SHARE = 0.96


def smaller_class_config(config_path: Optional[str], budget_gib: float) -> Optional[Path]:
    """The config beside ``config_path`` for the same model in the largest memory class below its own that fits
    ``budget_gib`` (the same variant preferred: an FP8 config suggests an FP8 one), or None. A class of N GB fits a
    budget of ``CARD_SHARE`` x N GiB or more: a 24 GB card reports about 23.6 GiB."""
    if not config_path:
        return None
    path = Path(config_path)
    mine = CLASS_NAME.match(path.name)
    if mine is None or not path.parent.is_dir():
        return None
    candidates = []
    for other in path.parent.glob("*.yaml"):
        m = CLASS_NAME.match(other.name)
        if (
            m
            and m["size"] == mine["size"]
            and int(m["gib"]) < int(mine["gib"])
            and int(m["gib"]) * CARD_SHARE <= budget_gib
        ):
            candidates.append((int(m["gib"]), m["variant"] == mine["variant"], other))
    return max(candidates, key=lambda c: (c[0], c[1]), default=(0, 0, None))[2]


def keys_to_try(memory, training, *, batch_size: int, device: torch.device, distributed: bool) -> List[str]:
    """The overrides that cut memory and are not on yet (of the run's ``memory`` and ``training`` sections, and
    its ``batch_size``), the cheapest in speed first (at most three)."""
    keys = []
    # The states in host memory, up for their step only: about 1.5 % slower on Llama2-7B, 4-5 GiB freed
    # (bench/results/llama2_7b_24gb_card_h200.json); one GPU, in backward.
    in_bwd = training.optimizer_in_bwd
    if in_bwd and not memory.stream_states and device.type == "cuda" and not distributed:
        keys.append("stream_optimizer_states=True")
    if batch_size > 1:  # the same samples per step, in twice the micro-batches
        half = f"batch_size={batch_size // 2}"
        keys.append(half if in_bwd else f"{half} gradient_accumulation_steps={training.accum * 2}")
    if memory.ac_every is None:
        keys.append("enable_activation_checkpointing=True")
    elif memory.ac_every > 1:
        keys.append("ac_mode=full")
    if "4bit" not in training.optimizer.path.lower() and not training.optimizer.cpu_offload:
        keys.append("optimizer=optimizers.AdamW4bit")
    if device.type == "cuda" and not distributed and not memory.offload_activations:
        keys.append("enable_activation_offloading=True")
    return keys[:3]


def out_of_memory_line(
    error: BaseException,
    *,
    where: str,
    argv: List[str],
    device: Optional[torch.device] = None,
    memory_limit_gib: Optional[float] = None,
    output_dir: Optional[Path] = None,
    keys: Sequence[str] = (),
) -> str:
    """The one line (without ``error: ``) for ``error``, a ``torch.OutOfMemoryError`` raised ``where`` ("during
    setup", "at step 12") in the run of command line ``argv`` on ``device`` (None: the settings were not read yet),
    capped at ``memory_limit_gib``, writing to ``output_dir``; ``keys``: ``keys_to_try``'s. Reads the allocator's
    peaks: call it before anything else allocates."""
    if device is None:
        return f"out of memory {where}: {first_line(error)}"
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        budget = memory_limit_gib or total
        peak = torch.cuda.max_memory_reserved(device) / 2**30
        reached = f"the GPU reached {peak:.1f} GiB reserved of {budget:.1f} GiB"
        if memory_limit_gib:
            reached += f" (device_memory_limit_gib={memory_limit_gib:g}; the card has {total:.1f} GiB)"
    else:
        budget = float("inf")
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        reached = f"the process reached {peak:.1f} GiB resident"
    smaller = smaller_class_config(config_path_of(argv[1:]), budget)
    if smaller is not None:
        fix = f"use --config {smaller}, the class that fits" + (f", or try {'; '.join(keys)}" if keys else "")
    elif keys:
        fix = f"try {'; '.join(keys)}"
    else:
        fix = "this model does not fit here with these settings: use a GPU with more memory, or a smaller model"
    latest = latest_checkpoint(output_dir)
    kept = (
        f"the last checkpoint, {latest}, is intact (resume_from_checkpoint={latest} with the change)"
        if latest is not None
        else "no checkpoint was written"
    )
    return f"out of memory {where}: {reached}; {fix}; {kept}"
