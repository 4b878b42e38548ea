"""Plumbing shared by the fine-tune recipes and the eval: the bad-input error, safe loading of our state files,
the run folder's lock and checkpoint protocol, and the checks of config keys and hyper-parameters.

Nothing here knows about models or optimizers; the recipes call it around their own logic.
"""

import difflib
import errno
import json
import math
import os
import pickle
import random
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, Optional

import numpy as np
import torch


class BadInput(ValueError):
    """A config value, file or folder that cannot work. The message names it and the fix.

    recipe_main prints it as one line, ``error: ...``, and exits with status 2.
    """


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


def disk_full_error(e: OSError, folder: Path, what: str) -> Optional[BadInput]:
    """A one-line BadInput for a full disk (ENOSPC/EDQUOT) while writing ``what``; None for other errors."""
    if e.errno not in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        return None
    try:
        free = shutil.disk_usage(folder).free / 2**30
        space = f"{free:.2f} GiB free"
    except OSError:
        space = "free space unknown"
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
