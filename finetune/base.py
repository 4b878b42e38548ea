"""The bottom layer that ``recipes/`` and ``eval/`` both import: the bad-input error (and its kin, the stop that a
run's non-finite weights or steps force: the checkpointer and the step counter both raise it), what a Hugging Face model
folder is, and how a torch file someone hands us is read (``weights_only``). It imports nothing of this repository,
so the arrows point one way: recipes and eval down to here.
"""

import json
import pickle
import re
from pathlib import Path
from typing import Any, List, Optional

import torch


class BadInput(ValueError):
    """A config value, file or folder that cannot work. The message names it and the fix.

    Every entry point (the fine-tune recipes, the eval) prints it as one line, ``error: ...``, and exits with
    status 2.
    """


class NonFiniteStop(BadInput):
    """Training cannot go on: too many non-finite steps in a row, or one that was already applied."""


def diverged_fix(resumed_from: Optional[Path] = None) -> str:
    """The way out of a NonFiniteStop. ``resumed_from``: the checkpoint this run resumed from, where it has written
    none since; its optimizer state may then be the cause (a resume checks its checksum, structure and scales, not
    every moment), and a lower lr would not help."""
    fix = "resume from the last checkpoint with a lower optimizer.lr or clip_grad_norm=1.0"
    if resumed_from is None:
        return fix
    return (
        f"this run resumed from {resumed_from} and has written no checkpoint since: if its optimizer state is "
        f"damaged, resume from an earlier checkpoint; if training diverged, {fix}"
    )


def first_line(e: BaseException) -> str:
    """An exception as one line for an ``error:`` message: its type and the first line of its text."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def hf_weight_files(folder: Path) -> List[Path]:
    """The weight files of an HF-format model folder, in load order; [] if it holds none.

    Safetensors first: ``model.safetensors``, else the shards ``model.safetensors.index.json`` lists (each must
    exist and sit inside the folder), else any ``*.safetensors``. Only without safetensors, ``pytorch_model*.bin`` (old HF downloads): those
    are pickles, which every reader here loads with ``weights_only=True`` (plain tensors, no code). A malformed
    index or a missing shard is a BadInput naming the folder.
    """
    folder = Path(folder)
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            names = json.loads(index.read_text())["weight_map"].values()
            shards = sorted({folder / str(name) for name in names})
        except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
            raise BadInput(f"{index} is malformed ({e!r}; a partial copy?): re-copy the checkpoint folder") from None
        root = folder.resolve()
        outside = [str(s.relative_to(folder)) for s in shards if not s.resolve().is_relative_to(root)]
        if outside:
            raise BadInput(
                f"{index} names weight files outside {folder} ({outside[0]}; a checkpoint's shards sit in "
                "its own folder): refused; re-copy the checkpoint folder"
            )
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise BadInput(
                f"{folder} is missing weight shards {missing} listed in {index.name} (a partial copy?): "
                "re-copy the checkpoint folder"
            )
        return shards
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


def load_state_file(path: Path, *, mmap: bool = False, fix: str = "", kind: str = "a weights file") -> Any:
    """torch.load with ``weights_only=True``: tensors and plain values (dicts, lists, tuples, str, numbers,
    torch dtypes; torchao's optimizer-state subclasses, which torchao allowlists itself) and nothing else.

    A pickle that names any other callable (``os.system`` in a planted file) is refused before it runs. Every
    failure is one BadInput naming the file and ``fix``; ``kind``: what the file should be (a weights file, as
    pytorch_model.bin is, or a recipe state file), for the refusal of a planted reference.
    """
    fix = fix or "point at a checkpoint folder this recipe wrote"
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = " ".join(str(e).split())
        found = re.search(r"unsupported global:? *(?:GLOBAL )?([\w.]+)", first, re.IGNORECASE)
        if found is None:  # garbage bytes read as a (broken) legacy pickle
            raise BadInput(
                f"{path} is unreadable ({first.split('.', 1)[0][:160]}; truncated or not a torch file?); {fix}"
            ) from None
        what = f"a reference to {found.group(1)}"
        raise BadInput(
            f"{path} holds {what}, which {kind} never does (it may be planted code): refused to load it; {fix}"
        ) from None
    except Exception as e:  # truncated zip, garbage, a folder: RuntimeError, EOFError, OSError, ValueError ...
        text = " ".join(str(e).split())[:200]
        raise BadInput(
            f"{path} is unreadable ({type(e).__name__}: {text}; truncated or not a torch file?); {fix}"
        ) from None
