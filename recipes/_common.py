"""Plumbing shared by the fine-tune recipes and the eval: the bad-input error, safe loading of our state files,
the run folder's lock and checkpoint protocol, and the checks of config keys and hyper-parameters.

Nothing here knows about models or optimizers; the recipes call it around their own logic.
"""

import difflib
import errno
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
import torch


class BadInput(ValueError):
    """A config value, file or folder that cannot work. The message names it and the fix.

    recipe_main prints it as one line, ``error: ...``, and exits with status 2.
    """


# ------------------------------------------------------------------------------------------------
# an HF checkpoint folder (the one definition: the recipes' checkpoint_dir / resume folders and eval's)
# ------------------------------------------------------------------------------------------------

def hf_weight_files(folder: Path) -> List[Path]:
    """The weight files of an HF-format model folder, in load order; [] if it holds none.

    Safetensors first: ``model.safetensors``, else the shards ``model.safetensors.index.json`` lists (each must
    exist), else any ``*.safetensors``. Only without safetensors, ``pytorch_model*.bin`` (old HF downloads): those
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
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise BadInput(f"{folder} is missing weight shards {missing} listed in {index.name} (a partial copy?): "
                           "re-copy the checkpoint folder")
        return shards
    return sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))


# ------------------------------------------------------------------------------------------------
# config keys and hyper-parameters
# ------------------------------------------------------------------------------------------------


def check_config_keys(cfg, known: Iterable[str]) -> None:
    """Refuse a top-level key no recipe reads (a typo would otherwise be silently ignored).

    Component sections (optimizer.*, model.*) are checked by their instantiation; this looks at the top level only.
    """
    known = sorted(set(known))
    for key in cfg.keys():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"the known keys are: {', '.join(known)}"
            raise BadInput(f"{key} is not a config key of this recipe; {hint} (remove it with ~{key})")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_finite(name: str, value: Any, *, low: float, strict: bool, allow_none: bool = True) -> None:
    """``value`` is a finite number above ``low`` (``>= low`` when not strict), or None when allowed."""
    if value is None and allow_none:
        return
    ok = _number(value) and math.isfinite(value) and (value > low if strict else value >= low)
    if not ok:
        rule = f"> {low:g}" if strict else f">= {low:g}"
        raise BadInput(f"{name}={value!r} must be a finite number {rule}; set {name} to such a value")


# ------------------------------------------------------------------------------------------------
# safe loading of our own state files
# ------------------------------------------------------------------------------------------------


def load_state_file(path: Path, *, mmap: bool = False, fix: str = "") -> Any:
    """torch.load with ``weights_only=True``: tensors and plain values (dicts, lists, tuples, str, numbers,
    torch dtypes; torchao's optimizer-state subclasses, which torchao allowlists itself) and nothing else.

    A pickle that names any other callable (``os.system`` in a planted file) is refused before it runs. Every
    failure is one BadInput naming the file and ``fix``.
    """
    fix = fix or "point at a checkpoint folder this recipe wrote"
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        first = " ".join(str(e).split())
        found = re.search(r"unsupported global:? *(?:GLOBAL )?([\w.]+)", first, re.IGNORECASE)
        if found is None:  # garbage bytes read as a (broken) legacy pickle
            raise BadInput(f"{path} is unreadable ({first.split('.', 1)[0][:160]}; truncated or not a torch "
                           f"file?); {fix}") from None
        what = f"a reference to {found.group(1)}"
        raise BadInput(f"{path} holds {what}, which a recipe state file never does (it may be planted code): "
                       f"refused to load it; {fix}") from None
    except Exception as e:  # truncated zip, garbage, a folder: RuntimeError, EOFError, OSError, ValueError ...
        text = " ".join(str(e).split())[:200]
        raise BadInput(f"{path} is unreadable ({type(e).__name__}: {text}; truncated or not a torch file?); "
                       f"{fix}") from None


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


# ------------------------------------------------------------------------------------------------
# run folder: lock, reuse, checkpoint protocol
# ------------------------------------------------------------------------------------------------

LOCK_FILE = ".lock"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (field 22 of /proc/PID/stat), which tells a reused PID from the original."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _owner_alive(owner: Dict[str, Any]) -> bool:
    pid = owner.get("pid")
    if not isinstance(pid, int) or not _pid_alive(pid):
        return False
    started = owner.get("start")
    return started is None or _start_time(pid) in (None, started)


class OutputDirLock:
    """``{output_dir}/.lock``: one live run per folder. A lock left by a dead process is taken over."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False

    def acquire(self) -> None:
        me = {"pid": os.getpid(), "start": _start_time(os.getpid())}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    owner = json.loads(self.path.read_text())
                except (OSError, ValueError):
                    owner = {}
                if not isinstance(owner, dict):
                    owner = {}
                if owner.get("pid") == me["pid"]:  # this process (an in-process rerun): ours already
                    self.held = True
                    return
                if _owner_alive(owner):
                    raise BadInput(
                        f"output_dir={self.path.parent} is in use by a live run (PID {owner['pid']}, lock file "
                        f"{self.path}); wait for it, stop it, or set output_dir=DIR to another folder") from None
                # stale: its owner is dead. Remove it and try again (O_EXCL: only one taker wins).
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.held = True
            return
        raise BadInput(f"could not take the lock {self.path} (contended); retry, or set output_dir=DIR")

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            owner = json.loads(self.path.read_text())
            if owner.get("pid") == os.getpid():
                self.path.unlink()
        except (OSError, ValueError, AttributeError):
            pass


CHECKPOINT_PREFIXES = ("step_", "epoch_")


def used_run_folder(output_dir: Path) -> Optional[str]:
    """What marks ``output_dir`` as holding an earlier run's results (metrics.jsonl, step_*/epoch_*), or None."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return None
    found = [p.name for p in sorted(output_dir.iterdir())
             if p.name == "metrics.jsonl" or (p.is_dir() and p.name.startswith(CHECKPOINT_PREFIXES))]
    return ", ".join(found[:4]) + (" ..." if len(found) > 4 else "") if found else None


def clear_run_folder(output_dir: Path) -> None:
    """overwrite=True: remove the earlier run's metrics.jsonl and step_*/epoch_* checkpoints."""
    for p in Path(output_dir).iterdir():
        if p.name == "metrics.jsonl":
            p.unlink()
        elif p.is_dir() and p.name.startswith(CHECKPOINT_PREFIXES):
            shutil.rmtree(p)


def _tag() -> str:
    """A suffix no other run can produce: this PID plus a random part (a PID alone is reused)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def tmp_dir(output_dir: Path, name: str) -> Path:
    path = Path(output_dir) / f".tmp-{name}-{_tag()}"
    path.mkdir()
    return path


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def finish_dir(tmp: Path) -> None:
    """Give the files umask modes and flush them and the folder to disk, so a rename publishes complete data."""
    umask = os.umask(0)
    os.umask(umask)
    for f in tmp.iterdir():
        f.chmod(0o666 & ~umask)
        fsync_path(f)
    tmp.chmod(0o777 & ~umask)
    fsync_path(tmp)


def replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished checkpoint folder into place.

    rename(2) cannot replace a non-empty folder, so an existing one is first renamed aside (``.old-NAME-TAG``) and
    deleted only after the new one is in place: at every moment a complete checkpoint exists on disk, under its
    name or, for the instant between the two renames, under .old-*; recover_run_folder restores that one.
    """
    if final.exists():
        old = final.with_name(f".old-{final.name}-{_tag()}")
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_path(final.parent)


def _tag_pid(name: str, prefix: str) -> Optional[int]:
    # .tmp-{name}-{pid}-{hex} / .old-{name}-{pid}-{hex}
    parts = name[len(prefix):].rsplit("-", 2)
    try:
        return int(parts[-2]) if len(parts) == 3 else None
    except ValueError:
        return None


def recover_run_folder(output_dir: Path, log=None) -> None:
    """At the start of a run (the lock held): restore a checkpoint a kill left only under ``.old-*`` (between the
    two renames of replace_dir), and delete the ``.tmp-*`` / leftover ``.old-*`` folders of dead runs."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return
    for p in sorted(output_dir.iterdir()):
        for prefix in (".tmp-", ".old-"):
            if not (p.is_dir() and p.name.startswith(prefix)):
                continue
            pid = _tag_pid(p.name, prefix)
            if pid is not None and pid != os.getpid() and _pid_alive(pid):
                continue  # another live process's work (it cannot be a run on this folder: we hold the lock)
            name = p.name[len(prefix):].rsplit("-", 2)[0]
            final = output_dir / name
            if prefix == ".old-" and not final.exists():
                os.replace(p, final)
                if log is not None:
                    log.warning(f"restored {final} from {p.name} (a run was stopped between two renames)")
            else:
                shutil.rmtree(p, ignore_errors=True)


def disk_full_error(e: BaseException, folder: Path, what: str, need_bytes: int = 0) -> Optional[BadInput]:
    """A one-line BadInput for a full disk while writing ``what``; None for other errors.

    An OSError says so by its errno (ENOSPC/EDQUOT), but the writers of the weights and the state file do not
    raise OSError: torch.save's zip writer raises RuntimeError("... file write failed") and safetensors its own
    error, without an errno. So a failed write also counts as a full disk when, its temporary folder removed, the
    disk has less free space than the checkpoint needs (``need_bytes``).
    """
    try:
        free = shutil.disk_usage(folder).free
        space = f"{free / 2**30:.2f} GiB free"
    except OSError:
        free, space = None, "free space unknown"
    full = isinstance(e, OSError) and e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
    if not full and not (isinstance(e, Exception) and free is not None and need_bytes and free < need_bytes):
        return None
    if need_bytes:
        space += f", the checkpoint needs about {need_bytes / 2**30:.2f} GiB"
    return BadInput(f"no space left on the disk of {folder} while writing {what} ({space}); nothing was replaced: "
                    "free disk space, or set output_dir=DIR on a disk with room")


# ------------------------------------------------------------------------------------------------
# metrics
# ------------------------------------------------------------------------------------------------


def strict_json(record: Dict[str, Any]) -> str:
    """One metrics line as strict JSON: NaN and +-inf become null (json.dumps would write bare NaN)."""
    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps({k: clean(v) for k, v in record.items()}, allow_nan=False)


def truncate_metrics(path: Path, step: int) -> int:
    """A resume from global step ``step``: drop the records after it (the interrupted run's steps the resume trains
    again), so each step is in ``metrics.jsonl`` once. Returns the number of records dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            later = json.loads(line).get("step", 0) > step
        except (ValueError, AttributeError, TypeError):
            later = False  # a line we cannot read is kept as it was
        if later:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.{_tag()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


# ------------------------------------------------------------------------------------------------
# the terminal: help, third-party noise, the end-of-run summary
# ------------------------------------------------------------------------------------------------


def fresh_dir_name(output_dir: Path) -> Path:
    """The first of ``{output_dir}-2``, ``-3``, ... that does not exist (a name to suggest for a new run)."""
    output_dir = Path(output_dir)
    n = 2
    while output_dir.with_name(f"{output_dir.name}-{n}").exists():
        n += 1
    return output_dir.with_name(f"{output_dir.name}-{n}")


def _flatten(node: Any, prefix: str = "") -> Iterable[tuple]:
    from omegaconf import OmegaConf

    if OmegaConf.is_dict(node):
        for key in node.keys():
            yield from _flatten(node._get_node(key), f"{prefix}{key}.")
    else:
        value = node._value() if hasattr(node, "_value") else node
        if OmegaConf.is_list(node):
            value = OmegaConf.to_container(node, resolve=False)
        yield prefix[:-1], value


def print_help_if_asked(doc: str, known_keys: Iterable[str]) -> None:
    """A recipe's ``__main__``: on ``--help`` / ``-h``, print recipe_help's manual and exit 0."""
    import sys

    manual = recipe_help(doc, sys.argv, known_keys)
    if manual is not None:
        print(manual)
        sys.exit(0)


def recipe_help(doc: str, argv: List[str], known_keys: Iterable[str]) -> Optional[str]:
    """``--help`` / ``-h`` on a recipe's command line: its docstring (the manual) and every config key with its value
    in the ``--config`` file; None when not asked for help. The recipe prints it and exits 0."""
    from omegaconf import OmegaConf

    args = argv[1:]
    if not ("--help" in args or "-h" in args):
        return None
    lines = [doc.rstrip(), ""]
    config_path = None
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            config_path = args[i + 1]
        elif a.startswith("--config="):
            config_path = a.split("=", 1)[1]
    if config_path is None:
        lines.append("Give --config FILE (e.g. configs/tiny.yaml) with --help to list that config's keys and values.")
    elif not Path(config_path).is_file():
        lines.append(f"--config {config_path}: no such file (the configs are in configs/, e.g. configs/tiny.yaml)")
    else:
        cfg = OmegaConf.load(config_path)
        lines.append(f"Config keys and their values in {config_path} (override with key=value, delete with ~key):")
        items = list(_flatten(cfg))
        width = min(max(len(k) for k, _ in items), 40)
        yaml = {None: "null", True: "true", False: "false"}
        lines += [f"  {k:<{width}}  {yaml.get(v, v) if isinstance(v, (bool, type(None))) else v}" for k, v in items]
        unset = [k for k in sorted(set(known_keys)) if k not in cfg]
        if unset:
            lines += ["", "Also read by this recipe, not set in this config (their defaults are in the Features list):",
                      "  " + ", ".join(unset)]
    return "\n".join(lines)


class _DropMessage(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


# Known third-party messages that say nothing to a user of these recipes, by the logger that emits them. Each is
# dropped by message, on that logger only, in the processes of our commands (their recipes and eval call this before
# importing the library); every other message of those libraries still shows.
#   torchao: its C++ extensions are built for another torch; nothing here uses them (they are CUDA/quantization ops).
#   bitsandbytes: an optional 4-bit CPU GEMM kernel from the hub; the 8-bit optimizers never use it.
#   lm-eval: we hand HFLM a loaded model on purpose (eval/harness.py), which is what this warns about.
KNOWN_NOISE = {
    "torchao": ("Skipping import of cpp extensions",),
    "bitsandbytes.backends.cpu.ops": ("pip install kernels",),
    "lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",),
}


def quiet_known_noise() -> None:
    """Drop the KNOWN_NOISE messages (a logging filter on each emitting logger; idempotent)."""
    for name, fragments in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(*fragments))


def run_summary(*, seconds: float, first_step: Optional[int], last_step: Optional[int], first_loss: Optional[float],
                last_loss: Optional[float], skipped: int, stop: Optional[str], metrics_path: Path,
                checkpoints: List[Path], wandb_dir: Optional[Path], nothing_left: Optional[str]) -> str:
    """The paragraph printed at the end of a run: what was trained, in what time, and where its outputs are."""
    def fmt(s: float) -> str:
        return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"

    if nothing_left:
        parts = [f"Nothing trained: {nothing_left}, so there was nothing to train (raise epochs or "
                 f"max_steps_per_epoch to go on); finished in {fmt(seconds)}."]
    elif first_step is None:
        parts = [f"Stopped before the first step ({fmt(seconds)})."]
    else:
        n = last_step - first_step + 1
        loss = "" if first_loss is None else f"; loss {first_loss:.4f} at step {first_step} -> {last_loss:.4f} at " \
                                             f"step {last_step}"
        how = f"stopped by {stop}" if stop else "done"
        parts = [f"Run {how}: trained steps {first_step}-{last_step} ({n} step{'s' * (n != 1)}) in {fmt(seconds)}"
                 f"{loss}" + (f"; {skipped} non-finite step(s) skipped" if skipped else "") + "."]
    if Path(metrics_path).is_file():
        parts.append(f"Metrics: {metrics_path}.")
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints[:-1])
        parts.append(f"Checkpoints: {checkpoints[-1]}" + (f" (latest; also {names})" if names else "") + ".")
    if wandb_dir is not None:
        parts.append(f"wandb: {wandb_dir} (upload with `wandb sync {wandb_dir}`).")
    return " ".join(parts)
