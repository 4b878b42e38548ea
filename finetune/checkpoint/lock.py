"""``{output_dir}/.lock``: one live run per output folder, wherever the runs are: other processes, other containers
(PID namespaces) on this host, other hosts on a shared file system.

How a run holds it. The run keeps an fcntl lock on the file for as long as it lives. The kernel (for a network file
system, its lock service) drops that lock when the process dies, however it dies, so taking the file is atomic (of
several runs that try at once, exactly one gets it) and a lock whose holder is gone is free at once. The file's
content names the holder (host, boot id, PID namespace, PID and start time, a random token) for the message another
run gets, and the live run touches the file every ``HEARTBEAT_S`` seconds (a lease).

When the fcntl lock is free, the content gets a second look before the file is taken, for holders the fcntl lock
cannot speak for (a run of an older version of these recipes, a mount without shared locking such as NFS with
``nolock``): a holder on this host, boot and PID namespace is alive if its PID is, with the same start time; a holder
anywhere else is alive while its lease is fresh (the file touched within ``LEASE_S`` seconds, by the file system's
clock). On a file system with no fcntl locks at all, the file is created with O_EXCL and a stale one is replaced
by exactly one taker (the first to create ``.lock.takeover-TOKEN``). In every case only the holder removes the file.
"""

import errno
import fcntl
import json
import os
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from finetune.base import BadInput

LOCK_FILE = ".lock"
HEARTBEAT_S = 30.0  # the live run touches its lock this often
LEASE_S = 300.0  # a holder elsewhere whose lock was not touched for this long is gone
NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # fcntl locks unsupported here


def _read(path: str) -> Optional[str]:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _start_time(pid: int) -> Optional[str]:
    """The process's start time (field 22 of /proc/PID/stat), which tells a reused PID from the original."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def identity() -> Dict[str, Any]:
    """Who this process is, in terms another process on any host can compare with its own."""
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = None
    return {
        "host": socket.gethostname(),
        "boot_id": _read("/proc/sys/kernel/random/boot_id"),
        "pid_ns": pid_ns,
        "pid": os.getpid(),
        "start": _start_time(os.getpid()),
        "token": uuid.uuid4().hex,
    }


def same_kernel_and_pids(owner: Dict[str, Any], me: Dict[str, Any]) -> bool:
    """Whether ``owner``'s PID means the same process here: same host, boot and PID namespace. A lock file without
    a host (written by an older version of these recipes) is taken to be from here, as that version did."""
    if "host" not in owner:
        return True
    return all(owner.get(k) == me[k] for k in ("host", "boot_id", "pid_ns"))


def holder_alive(
    owner: Dict[str, Any], me: Dict[str, Any], age_s: Callable[[], Optional[float]], kernel_lock: bool
) -> bool:
    """Whether the run a lock file names may still be alive, its fcntl lock being free (``kernel_lock``: we now
    hold it) or not to be had on this file system."""
    if same_kernel_and_pids(owner, me):
        pid = owner.get("pid")
        if not isinstance(pid, int) or pid == me["pid"] or not pid_alive(pid):
            return False  # (this very process: a lock it did not release, e.g. an earlier run in-process)
        started = owner.get("start")
        return started is None or _start_time(pid) in (None, started)
    if kernel_lock and owner.get("boot_id") == me["boot_id"]:
        return False  # another container on this kernel: were it alive, it would hold the fcntl lock
    age = age_s()
    return age is None or age < LEASE_S


def describe(owner: Dict[str, Any], me: Dict[str, Any]) -> str:
    where = (
        ""
        if same_kernel_and_pids(owner, me)
        else (f" on {owner.get('host')}" + (", another container" if owner.get("boot_id") == me["boot_id"] else ""))
    )
    return f"PID {owner.get('pid')}{where}"


class OutputDirLock:
    """``{output_dir}/.lock``: ``acquire`` (a BadInput naming the live holder), ``release`` (only by the holder)."""

    def __init__(self, output_dir: Path):
        self.path = Path(output_dir) / LOCK_FILE
        self.held = False
        self.me: Dict[str, Any] = {}
        self._fd: Optional[int] = None  # the fcntl-locked file; closing any descriptor of it would drop the lock
        self._markers: List[Path] = []
        self._stop_heartbeat = threading.Event()

    # -- judging the file ----------------------------------------------------------------------

    def _owner(self, fd: Optional[int] = None) -> Dict[str, Any]:
        try:
            if fd is not None:  # (read through our descriptor: opening another one and closing it drops the lock)
                text = os.pread(fd, 1 << 16, 0).decode()
            else:
                text = self.path.read_text()
            owner = json.loads(text) if text.strip() else {}
        except (OSError, ValueError, UnicodeDecodeError):
            owner = {}
        return owner if isinstance(owner, dict) else {}

    def _age_s(self) -> Optional[float]:
        """Seconds since the lock file was last touched, by the file system's clock (a file written now is the
        reference, so two hosts' clocks need not agree); None if it cannot be told."""
        try:
            with tempfile.NamedTemporaryFile(dir=self.path.parent, prefix=".lock-clock-") as probe:
                now = os.fstat(probe.fileno()).st_mtime
            return now - self.path.stat().st_mtime
        except OSError:
            return None

    def _refuse(self, owner: Dict[str, Any]) -> BadInput:
        lease = (
            ""
            if same_kernel_and_pids(owner, self.me)
            else (f"; if that run is gone, its lease ends {LEASE_S:.0f} s after it last touched the lock, or delete it")
        )
        return BadInput(
            f"output_dir={self.path.parent} is in use by a live run ({describe(owner, self.me)}, lock "
            f"file {self.path}{lease}); wait for it, stop it, or set output_dir=DIR to another folder"
        )

    # -- taking and giving back ----------------------------------------------------------------

    def acquire(self) -> None:
        self.me = identity()
        for _ in range(10):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in NO_LOCKS:
                    return self._acquire_without_locks()
                if e.errno in (errno.EACCES, errno.EAGAIN):
                    raise self._refuse(self._owner()) from None
                raise
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if not same_file:  # its holder removed it as we opened it: take the new one
                os.close(fd)
                continue
            owner = self._owner(fd)
            if owner and holder_alive(owner, self.me, self._age_s, kernel_lock=True):
                os.close(fd)
                raise self._refuse(owner)
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.me).encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return self._held()
        raise BadInput(f"could not take the lock {self.path} (contended); retry, or set output_dir=DIR")

    def _acquire_without_locks(self) -> None:
        """No fcntl locks on this file system: O_EXCL creation; a stale file is replaced by one taker only."""
        for _ in range(50):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if holder_alive(owner, self.me, self._age_s, kernel_lock=False):
                    raise self._refuse(owner) from None
                stale = owner.get("token") or f"{owner.get('pid')}-{owner.get('start')}"
                marker = self.path.with_name(f"{LOCK_FILE}.takeover-{stale}")
                try:
                    os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                except FileExistsError:  # another run is replacing this stale lock: look at what it wrote
                    time.sleep(0.05)
                    continue
                self._markers.append(marker)  # (removed on release: the stale token can never win again meanwhile)
                tmp = self.path.with_name(f"{LOCK_FILE}.new-{self.me['token']}")
                tmp.write_text(json.dumps(self.me))
                os.replace(tmp, self.path)
                return self._held()
            with os.fdopen(fd, "w") as f:
                json.dump(self.me, f)
            return self._held()
        raise BadInput(f"could not take the lock {self.path} (contended); retry, or set output_dir=DIR")

    def _held(self) -> None:
        self.held = True
        self._stop_heartbeat.clear()
        threading.Thread(target=self._heartbeat, name="output-dir-lock", daemon=True).start()

    def _heartbeat(self) -> None:
        while not self._stop_heartbeat.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)  # (by path: no descriptor to open and close)
            except OSError:
                pass

    def release(self) -> None:
        """Remove the lock file if it is still this run's (the same file, with this run's token)."""
        if not self.held:
            return
        self.held = False
        self._stop_heartbeat.set()
        try:
            if self._fd is not None:
                ours = (
                    os.fstat(self._fd).st_ino == os.stat(self.path).st_ino
                    and self._owner(self._fd).get("token") == self.me["token"]
                )
            else:
                ours = self._owner().get("token") == self.me["token"]
            if ours:
                self.path.unlink()
        except OSError:
            pass
        finally:
            if self._fd is not None:
                os.close(self._fd)  # (after the unlink: a run waiting on this file sees it is gone, and retries)
                self._fd = None
            for marker in self._markers:
                marker.unlink(missing_ok=True)
            self._markers = []
