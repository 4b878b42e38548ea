"""The run folder (``output_dir``): one live run per folder, no silent reuse, and checkpoints that appear only whole.

Part of the checkpoint component (``finetune/checkpoint/checkpointer.py`` writes through ``RunFolder.publish``). The protocol:

- ``claim``: create the folder, check it is writable, take ``.lock`` (``finetune/checkpoint/lock.py``: one live run per folder across
  containers and hosts), and repair what a killed run left: a checkpoint that exists only under ``.old-*`` is
  restored, dead runs' ``.tmp-*`` folders are deleted (only names this module makes: ``.tmp-step_N-PID-HEX``).
- ``refuse_reuse``: a run refuses a folder that holds another run's results (``metrics.jsonl``, ``step_*`` /
  ``epoch_*``) unless ``overwrite=True`` (which deletes them); a resume continues its own run in the checkpoint's
  folder, or starts over in an unused one.
- ``publish``: a checkpoint is written into ``.tmp-NAME-PID-RANDOM``, every file and the folder fsynced, then
  renamed into place; an existing folder of that name is renamed aside first and deleted only after, so at every
  moment a complete checkpoint exists on disk. A full disk is one ``error:`` line and replaces nothing.

Several processes (the distributed recipe's ranks) agree through a ``Ranks`` object: rank 0 owns the folder and
every rank learns the outcome, so no rank waits in a collective for one that failed. ``Ranks()`` is one process.
"""

import atexit
import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, List, Optional

from finetune.base import BadInput
from finetune.checkpoint.lock import (  # noqa: F401 (LOCK_FILE: part of this interface)
    LOCK_FILE,
    OutputDirLock,
    pid_alive,
)
from finetune.run_files import CHECKPOINT_PREFIXES, METRICS_FILE, tag


class Ranks:
    """How the processes of one run agree. This one is a single process; ``DistributedRanks`` spans a group."""

    rank, world = 0, 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        return value

    def gather(self, value: Any) -> List[Any]:
        """Every rank's ``value``, in rank order, on every rank."""
        return [value]

    def agree(self, error: Optional[str]) -> None:
        """Raise ``BadInput(error)`` on every rank if rank 0 found one (the others pass None)."""
        error = self.broadcast(error)
        if error:
            raise BadInput(error)

    def agree_any(self, error: Optional[str]) -> None:
        """Raise ``BadInput`` on every rank if any rank found an error (the lowest such rank's message), so no rank
        goes on into a collective that another one has left."""
        failed = [e for e in self.gather(error) if e]
        if failed:
            raise BadInput(failed[0])


class DistributedRanks(Ranks):
    """The ranks of the default ``torch.distributed`` process group (objects travel pickled between our own
    processes only)."""

    def __init__(self):
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def broadcast(self, value: Any) -> Any:
        box = [value]
        self._dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> List[Any]:
        every: List[Any] = [None] * self.world
        self._dist.all_gather_object(every, value)
        return every


class CheckpointWriteError(BadInput):
    """A rank could not write its part of a checkpoint (every rank raises it, with the same message)."""


# ------------------------------------------------------------------------------------------------
# folders: reuse, temporary names, publishing, recovery
# ------------------------------------------------------------------------------------------------


def run_results(output_dir: Path) -> List[Path]:
    """An earlier run's results in ``output_dir``: metrics.jsonl and the step_*/epoch_* checkpoints (what
    overwrite=True deletes)."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return []
    return [
        p
        for p in sorted(output_dir.iterdir())
        if p.name == METRICS_FILE or (p.is_dir() and p.name.startswith(CHECKPOINT_PREFIXES))
    ]


def used_run_folder(output_dir: Path) -> Optional[str]:
    """What marks ``output_dir`` as holding an earlier run's results (metrics.jsonl, step_*/epoch_*), or None."""
    found = [p.name for p in run_results(output_dir)]
    return ", ".join(found[:4]) + (" ..." if len(found) > 4 else "") if found else None


def clear_run_folder(output_dir: Path) -> None:
    """overwrite=True: remove the earlier run's metrics.jsonl and step_*/epoch_* checkpoints."""
    for p in run_results(output_dir):
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


def same_folder(a: Path, b: Path) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def resumes_in_place(output_dir: Path, resume_dir: Optional[Path]) -> bool:
    """A resume that continues its run in the checkpoint's own folder (output_dir=the folder holding step_N)."""
    return resume_dir is not None and same_folder(Path(resume_dir).parent, output_dir)


def inputs_overwrite_would_delete(output_dir: Path, inputs: Iterable[tuple]) -> Optional[tuple]:
    """The first (key, path, result folder) where an input the run reads (``inputs``: (key, path) pairs) lies in
    a result of ``output_dir`` that overwrite=True would delete; None if there is none."""
    doomed = [(p, os.path.realpath(p)) for p in run_results(output_dir)]
    for key, path in inputs:
        real = os.path.realpath(path)
        for result, where in doomed:
            if real == where or real.startswith(where + os.sep):
                return key, Path(path), result
    return None


def fresh_dir_name(output_dir: Path) -> Path:
    """The first of ``{output_dir}-2``, ``-3``, ... that does not exist (a name to suggest for a new run)."""
    output_dir = Path(output_dir)
    n = 2
    while output_dir.with_name(f"{output_dir.name}-{n}").exists():
        n += 1
    return output_dir.with_name(f"{output_dir.name}-{n}")


def tmp_dir(output_dir: Path, name: str) -> Path:
    path = Path(output_dir) / f".tmp-{name}-{tag()}"
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
        old = final.with_name(f".old-{final.name}-{tag()}")
        os.replace(final, old)
        os.replace(tmp, final)
        fsync_path(final.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
        fsync_path(final.parent)


@contextlib.contextmanager
def ctrl_c_after():
    """Ctrl-C (SIGINT) that arrives inside the block takes effect at its end: publishing a checkpoint and recording
    that it is published happen both or neither. (A Ctrl-C while a checkpoint is published would otherwise leave a
    folder on disk that the run's bookkeeping still calls in flight, or the reverse.) Off the main thread, where
    Python delivers no signal, it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        if callable(previous):  # (Python's default handler raises KeyboardInterrupt here)
            previous(signal.SIGINT, received[0])
        elif previous == signal.SIG_DFL:
            os.kill(os.getpid(), signal.SIGINT)


# What tmp_dir and replace_dir name a folder: .tmp-NAME-PID-HEX / .old-NAME-PID-HEX, NAME a checkpoint's name.
# Recovery touches nothing else: a user's own .tmp-notes or .old-results in output_dir are theirs.
WORK_NAME = re.compile(r"^\.(tmp|old)-((?:%s).+)-(\d+)-([0-9a-f]{8})$" % "|".join(CHECKPOINT_PREFIXES))


def recover_run_folder(output_dir: Path, log=None) -> None:
    """At the start of a run (the lock held): restore a checkpoint a kill left only under ``.old-*`` (between the
    two renames of replace_dir), and delete the ``.tmp-*`` / leftover ``.old-*`` folders of dead runs."""
    output_dir = Path(output_dir)
    if not output_dir.is_dir():
        return
    for p in sorted(output_dir.iterdir()):
        found = WORK_NAME.match(p.name)
        if found is None or not p.is_dir():
            continue
        kind, name, pid = found.group(1), found.group(2), int(found.group(3))
        if pid != os.getpid() and pid_alive(pid):
            continue  # another live process's work (it cannot be a run on this folder: we hold the lock)
        final = output_dir / name
        if kind == "old" and not final.exists():
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
    return BadInput(
        f"no space left on the disk of {folder} while writing {what} ({space}); nothing was replaced: "
        "free disk space, or set output_dir=DIR on a disk with room"
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _write_error(e: BaseException, name: str, ranks: "Ranks") -> BadInput:
    """A checkpoint that could not be written for another reason than a full disk (permissions, say)."""
    who = f"rank {ranks.rank} " if ranks.world > 1 else ""
    return BadInput(
        f"{who}could not write {name} ({_first_line(e)}); nothing was replaced: fix the cause, or set "
        "output_dir=DIR to another folder"
    )


class RunFolder:
    """``output_dir`` as one run owns it: ``claim`` it, ``refuse_reuse``, ``publish`` checkpoints, ``release``."""

    def __init__(self, path: Path, ranks: Ranks = Ranks()):
        self.path = Path(path)
        self.ranks = ranks
        self._lock: Optional[OutputDirLock] = None

    def claim(self, log=None) -> None:
        """Rank 0 creates the folder, checks it is writable, takes its lock and repairs it; every rank learns
        whether that failed."""
        error = None
        if self.ranks.main:
            try:
                self._claim(log)
            except BadInput as e:
                error = str(e)
        self.ranks.agree(error)

    def _claim(self, log) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self.path, prefix=".write-test-"):
                pass
        except OSError as e:
            raise BadInput(
                f"output_dir={self.path} is not writable ({e.strerror or e}); set output_dir=DIR to a "
                "folder you can write"
            ) from None
        self._lock = OutputDirLock(self.path)
        self._lock.acquire()
        atexit.register(self._lock.release)
        recover_run_folder(self.path, log)

    def refuse_reuse(self, *, resume_dir: Optional[Path], overwrite: bool, log=None) -> None:
        """A run into a folder holding another run's results: refused, or that run cleared with overwrite=True. A
        resume continues its own run in the checkpoint's folder (``resume_dir``'s parent); into any other folder it
        is a run of its own there, and an unused folder is what it needs."""
        error = None
        if self.ranks.main and not resumes_in_place(self.path, resume_dir):
            used = used_run_folder(self.path)
            if used is not None and overwrite:
                clear_run_folder(self.path)
                if log is not None:
                    log.info(f"overwrite=True: deleted the earlier run's {used} in {self.path}")
            elif used is not None and resume_dir is None:
                error = (
                    f"output_dir={self.path} already holds a run ({used}); set a new folder (e.g. output_dir="
                    f"{fresh_dir_name(self.path)}), overwrite=True to replace it, or "
                    f"resume_from_checkpoint={self.path}/step_N (or epoch_E) to continue it"
                )
            elif used is not None:
                error = (
                    f"output_dir={self.path} already holds another run ({used}), and resuming "
                    f"{resume_dir} there would mix the two runs' checkpoints and metrics; continue in the "
                    f"checkpoint's own folder (output_dir={Path(resume_dir).parent}), in a new one (e.g. "
                    f"output_dir={fresh_dir_name(self.path)}), or set overwrite=True to replace that run"
                )
        self.ranks.agree(error)

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()

    def publish(self, name: str, write: Callable[[Path], None], need_bytes: Callable[[], int]) -> Path:
        """``{path}/{name}/``, built by every rank's ``write(tmp)`` in one temporary folder and renamed into place
        by rank 0, or nothing at all. A failure on any rank is the same error on every rank, raised after each has
        finished its own part; the temporary folder is removed and nothing under ``name`` is replaced.
        ``need_bytes()`` (this rank's share of the checkpoint) is asked only to tell a full disk."""
        tmp = self.begin(name)
        error = None
        try:
            write(tmp)
        except Exception as e:
            error = e
        except BaseException:  # Ctrl-C mid-write: leave no temporary folder behind
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return self.commit(name, tmp, error, need_bytes)

    # publish in two halves, for a checkpoint written in the background (``checkpointer.Checkpointer``): ``begin`` at
    # the save, the ranks' writes on their writer threads, ``commit`` at a later step boundary. Both halves run
    # collectives, so every rank calls them from its main thread, at the same point of training.

    def begin(self, name: str) -> Path:
        """The temporary folder every rank writes its part of ``name`` into (rank 0 creates it)."""
        path, error = None, None
        if self.ranks.main:
            try:
                path = str(tmp_dir(self.path, name))
            except OSError as e:  # (a full disk, a folder made read-only under the run)
                error = str(disk_full_error(e, self.path, name) or _write_error(e, name, self.ranks))
        path, error = self.ranks.broadcast((path, error))
        if error:
            raise CheckpointWriteError(error)
        return Path(path)

    def commit(self, name: str, tmp: Path, error: Optional[Exception], need_bytes: Callable[[], int]) -> Path:
        """Every rank has finished writing into ``tmp`` (``error``: how its part failed, or None): rank 0 fsyncs the
        folder and renames it to ``{path}/{name}``, or every rank raises the first rank's error."""
        final = self.path / name
        self._agree_written(error, tmp, final, need_bytes)  # every rank's file is written, or all raise
        error = None
        if self.ranks.main:
            try:
                finish_dir(tmp)  # umask modes, fsync of every file and the folder
                replace_dir(tmp, final)
            except Exception as e:
                error = e
        self._agree_written(error, tmp, final, need_bytes)  # nobody reads or overwrites it before it is in place
        return final

    def _agree_written(self, error: Optional[Exception], tmp: Path, final: Path, need_bytes: Callable[[], int]) -> None:
        message, full = None, None
        if error is not None:
            if self.ranks.main:
                shutil.rmtree(tmp, ignore_errors=True)  # (first: its bytes would hide how full the disk is)
            full = disk_full_error(error, self.path, final.name, need_bytes())
            if full is None and self.ranks.world == 1 and not isinstance(error, OSError):
                raise error  # one process: an unexpected failure (not the system's) keeps its traceback
            message = str(full if full is not None else _write_error(error, final.name, self.ranks))
        failed = [m for m in self.ranks.gather(message) if m]
        if failed:
            if self.ranks.main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(failed[0]) from None
