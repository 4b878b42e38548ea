"""Checkpoints: what a step_N / epoch_E folder holds, how it is written, and how a run resumes from one.

A checkpoint is a Hugging Face model folder (``_hf_format.py``: config.json, model.safetensors, the tokenizer) plus
the resume state: ``recipe_state.pt`` (progress, optimizer state, lr schedule, RNG, the run's settings) and, from the
distributed recipe, one ``recipe_state_rank{r}.pt`` per rank; with a wandb logger, ``run.json`` names the run that
wrote it (``Checkpointer.run_info``). It is published whole or not at all through the run
folder (``_run_folder.py``: temporary folder, fsync, atomic rename, ``.old-*`` recovery, one-line full-disk errors).

The calls a recipe makes:

- ``Checkpointer(folder, family, hf, tokenizer_path).save(name, weights=..., recipe_state=..., rank_state=...)``
- ``read_resume(folder, now=...)``: the state file, read ``weights_only``, checked against this run's settings
- ``check_finite_weights(state, ...)`` before a save; ``rng_state`` / ``set_rng_state`` for exact resume
"""

import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import numpy as np
import torch

from finetune_base import BadInput, load_state_file
from finetune_base.run_files import RUN_FILE
from recipes import _hf_format
from recipes._reporting import announce_saved
from recipes._run_folder import RunFolder

RECIPE_STATE_FILE = "recipe_state.pt"
RANK_STATE_FILE = "recipe_state_rank{rank}.pt"

# The settings a resume must share with its checkpoint, and why. The data order and each step's samples depend on
# the first five (the distributed recipe compares the global batch, batch_size x ranks); the saved lr schedule
# continues, so a new lr means a new run from the checkpoint's weights.
RESUME_MUST_MATCH = {
    "batch_size": "the data order and each step's samples would not match the interrupted run",
    "gradient_accumulation_steps": "the data order and each step's samples would not match the interrupted run",
    "seed": "the data order and each step's samples would not match the interrupted run",
    "shuffle": "the data order and each step's samples would not match the interrupted run",
    "packed": "the data order and each step's samples would not match the interrupted run",
    "lr": "a resume continues the saved lr schedule",
}
# May change, with a warning: the lr schedule's length follows them.
RESUME_MAY_CHANGE = ("max_steps_per_epoch", "epochs")
CONFIG_NAMES = {"packed": "dataset.packed", "lr": "optimizer.lr"}


class NonFiniteStop(BadInput):
    """Training cannot go on: too many non-finite steps in a row, or one that was already applied."""


def check_finite_weights(state: Dict[str, torch.Tensor], final: Path, step: int) -> None:
    """Refuse to write a checkpoint whose weights hold a NaN or inf (one device-side reduction, one sync)."""
    bad = [k for k, ok in zip(state, torch.stack([torch.isfinite(v).all() for v in state.values()]).tolist())
           if not ok] if state else []
    if bad:
        raise NonFiniteStop(f"the weights at step {step} are not finite ({', '.join(bad[:3])}): refused to write "
                            f"{final}; resume from the last checkpoint with a lower optimizer.lr or clip_grad_norm=1.0")


def rng_state(cuda_device: Optional[torch.device] = None, all_cuda: bool = False) -> Dict[str, Any]:
    """The RNG states in types that ``weights_only`` loading accepts (numpy's key array stored as a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = None
    if cuda_device is not None and cuda_device.type == "cuda":
        cuda = torch.cuda.get_rng_state_all() if all_cuda else torch.cuda.get_rng_state(cuda_device)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "cuda": cuda,
    }


def set_rng_state(rng: Dict[str, Any]) -> None:
    """Restore torch, python and numpy RNG from ``rng_state``'s dict (cuda is left to the caller)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class Checkpointer:
    """Writes step_N / epoch_E folders into a claimed run folder, in one model family's HF format."""

    def __init__(self, folder: RunFolder, family: _hf_format.Family, hf: dict, tokenizer_path: Path):
        self.folder, self.family, self.hf, self.tokenizer_path = folder, family, hf, Path(tokenizer_path)
        # The run that writes the checkpoints (its identity and wandb run: finetune_base.run_files), written into
        # each as run.json with the checkpoint's global step, so the eval can add its scores to that run.
        self.run_info: Optional[dict] = None

    def save(self, name: str, *, weights: Optional[Dict[str, torch.Tensor]], recipe_state: Optional[dict],
             need_bytes: Callable[[], int], rank_state: Optional[dict] = None,
             started: Optional[float] = None) -> Path:
        """``{output_dir}/{name}/``: rank 0 writes the HF folder from ``weights`` (full, torchtune names) and
        ``recipe_state``; with ``rank_state`` every rank also writes ``recipe_state_rank{r}.pt``. Prints the
        "Saved checkpoint" line with its size and the time since ``started`` (the recipe's start of the save)."""
        started = time.perf_counter() if started is None else started
        ranks = self.folder.ranks

        def write(tmp: Path) -> None:
            if rank_state is not None:
                torch.save(rank_state, tmp / RANK_STATE_FILE.format(rank=ranks.rank))
            if ranks.main:
                _hf_format.write_folder(tmp, weights, self.hf, self.family, self.tokenizer_path)
                torch.save(recipe_state, tmp / RECIPE_STATE_FILE)
                if self.run_info is not None:
                    run = {**self.run_info, "global_step": recipe_state.get("global_step")}
                    (tmp / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")

        final = self.folder.publish(name, write, need_bytes)
        if ranks.main:
            announce_saved(final, started)
        return final


def read_state_file(path: Path, mmap: bool = False) -> dict:
    """A recipe_state*.pt file, loaded weights_only (tensors and plain values only: see finetune_base)."""
    fix = (f"resume from another checkpoint (an earlier step_N or epoch_E), or start a new run from its weights "
           f"with checkpoint_dir={path.parent} and no resume_from_checkpoint")
    state = load_state_file(path, mmap=mmap, fix=fix)
    if not isinstance(state, dict) or "optimizer" not in state or (path.name == RECIPE_STATE_FILE
                                                                   and "config" not in state):
        raise BadInput(f"{path} is not a recipe state file this recipe wrote; {fix}")
    return state


def read_resume(folder: Path, *, now: Dict[str, Any], mmap: bool = False, log=None) -> dict:
    """``{folder}/recipe_state.pt``, checked against this run's settings ``now`` (check_resume)."""
    state = read_state_file(Path(folder) / RECIPE_STATE_FILE, mmap=mmap)
    check_resume(state, folder, now=now, log=log)
    return state


def check_resume(state: dict, folder: Path, *, now: Dict[str, Any], log=None) -> None:
    """A recipe state against this run's settings ``now`` (the keys of RESUME_MUST_MATCH plus ``optimizer``,
    ``optimizer_in_bwd`` and RESUME_MAY_CHANGE): a mismatch is a BadInput naming the key and the fix."""
    saved = state["config"]
    if saved["optimizer"] != now["optimizer"] or saved.get("optimizer_in_bwd", False) != now["optimizer_in_bwd"]:
        raise BadInput(
            f"resume_from_checkpoint={folder} holds the state of optimizer={saved['optimizer']} "
            f"(optimizer_in_bwd={saved.get('optimizer_in_bwd', False)}); resume with those, or start a new run from "
            "its weights with checkpoint_dir=... and no resume_from_checkpoint")
    if "world_size" in now:  # the distributed recipe: the global batch must match (batch_size is per rank)
        saved = dict(saved, batch_size=saved.get("world_size", 1) * saved["batch_size"])
        now = dict(now, batch_size=now["world_size"] * now["batch_size"])
    for key, why in RESUME_MUST_MATCH.items():
        if key not in saved or saved[key] == now[key]:  # (a key missing: a checkpoint from before the check)
            continue
        name = CONFIG_NAMES.get(key, key)
        raise BadInput(
            f"{name}={now[key]} differs from the checkpoint's {saved[key]} (resume_from_checkpoint={folder}): {why}; "
            f"resume with {name}={saved[key]}, or start a new run from its weights with checkpoint_dir=... and no "
            "resume_from_checkpoint")
    for key in RESUME_MAY_CHANGE:
        if saved.get(key) != now[key] and log is not None:
            log.warning(f"{key}={now[key]} differs from the checkpoint's {saved.get(key)}: the lr schedule will not "
                        "match the interrupted run")


def progress_after(state: dict, steps_per_epoch: int) -> tuple:
    """(epoch, steps into it, global step) a resume from ``state`` starts at: a checkpoint at an epoch's last
    step continues with the next epoch."""
    epoch, steps = state["epoch"], state["steps_in_epoch"]
    if steps >= steps_per_epoch:
        epoch, steps = epoch + 1, 0
    return epoch, steps, state["global_step"]


def nothing_left(resume_dir: Path, global_step: int, epochs: int, max_steps_per_epoch: Optional[int],
                 log) -> str:
    """A resume from the end of training: says so (warning) and returns the phrase the summary uses."""
    phrase = (f"resume_from_checkpoint={resume_dir} is at global step {global_step}, already the end of training "
              f"with epochs={epochs}, max_steps_per_epoch={max_steps_per_epoch}")
    log.warning(f"{phrase}: nothing to train, nothing will be written. To train further, raise epochs or "
                "max_steps_per_epoch (the lr schedule then differs from the finished run's)")
    return phrase
