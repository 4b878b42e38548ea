"""Launch the distributed recipe on N processes so that a stop signal saves and the launch exits 0.

    python -m recipes.launch --nproc_per_node 2 recipes/full_finetune_distributed.py --config configs/tiny.yaml [k=v ...]

The arguments are `tune run`'s (torchrun's options, then the recipe, its config and overrides), and this runs
`tune run` in this process, with one difference: SIGTERM and SIGUSR1 (what Slurm and Kubernetes send before they
stop a job) are this launcher's, not torchrun's. docs/distributed.md, "Stopping a run", says what each does.

Why. torchrun (``torch.distributed.run``, which `tune run --nproc_per_node` calls) turns SIGTERM into an exception in
its agent: it sends SIGTERM to every rank, SIGKILLs the ones still running ``--shutdown-timeout`` seconds later (30
by default: a 7B stop save takes about as long) and then re-raises, so the launch exits 1 with a traceback even when
every rank saved and exited 0. SIGUSR1 is not among the signals it handles (``--signals-to-handle``), so it dies of
it at once and the ranks train on without it.

What this does instead. torchrun is told to handle only SIGINT, SIGHUP and SIGQUIT (its usual handling, Ctrl-C
included). On the first SIGTERM or SIGUSR1 the launcher passes that signal to each rank as soon as the rank listens
for it (its ``SigCgt`` mask in /proc says so: a signal during start-up waits rather than kills), and keeps waiting,
with no deadline, while the ranks save at the next step boundary and exit 0. torchrun then sees its workers succeed
and the launch exits 0. A second stop signal is torchrun's own shutdown: the signal to every rank, SIGKILL
``--shutdown-timeout`` seconds later, exit 1. Each rank also asks the kernel for SIGTERM should the launcher die
outright (``follow_launcher``, below), so no rank outlives it for longer than its stop save.
"""

import ctypes
import os
import signal
import sys
import threading
from typing import List, Optional, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")  # torchrun's default --signals-to-handle
SIGNALS_FLAGS = ("--signals-to-handle", "--signals_to_handle")
NPROC_FLAGS = ("--nproc_per_node", "--nproc-per-node")


def _proc_stat(pid: int) -> Optional[List[str]]:
    """The fields of /proc/PID/stat after the command name (state, ppid, pgrp, session, ...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def rank_pids(parent: Optional[int] = None) -> List[int]:
    """The ranks torchrun started from ``parent`` (this process): its children that lead their own session (torchrun
    starts each worker with ``start_new_session``) and carry ``TORCHELASTIC_RUN_ID`` (torchrun's worker environment).
    Other children, a multiprocessing helper or a service that also leads its own session (wandb's), are not ranks
    and never get a stop signal from here."""
    parent = os.getpid() if parent is None else parent
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            fields = _proc_stat(int(name))
            if (
                fields is not None
                and int(fields[1]) == parent
                and int(fields[3]) == int(name)
                and _is_torchrun_worker(int(name))
            ):
                pids.append(int(name))
    return sorted(pids)


def _is_torchrun_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0TORCHELASTIC_RUN_ID=" in b"\0" + f.read()
    except OSError:
        return False


def listens(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (bit sig-1 of SigCgt in /proc/PID/status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(line.split()[1] for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, IndexError):
        return False
    return bool(int(mask, 16) >> (sig - 1) & 1)


class StopForwarder:
    """The launcher's handler for SIGTERM and SIGUSR1: the first is passed to every rank once it listens; a second
    one is handed to torchrun's own handler (its shutdown with a deadline)."""

    def __init__(self, poll_s: float = 0.1):
        self.signum: Optional[int] = None
        self.poll_s = poll_s
        self.sent: set = set()
        self._stopped = threading.Event()

    def stop(self) -> None:
        """No more forwarding (the launcher never needs it: its process ends with the ranks)."""
        self._stopped.set()

    def install(self) -> "StopForwarder":
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum, frame) -> None:
        if self.signum is not None:
            from torch.distributed.elastic.multiprocessing.api import _terminate_process_handler

            sys.stderr.write(
                f"launcher: a second stop signal ({signal.Signals(signum).name}): torchrun stops the "
                "ranks (SIGKILL after --shutdown-timeout)\n"
            )
            _terminate_process_handler(signum, frame)  # raises torchrun's SignalException
        self.signum = signum
        sys.stderr.write(
            f"launcher: {signal.Signals(signum).name}: every rank saves a checkpoint at the next step "
            "boundary and stops; waiting for them (a second signal stops them without waiting)\n"
        )
        threading.Thread(target=self._forward, name="stop-forwarder", daemon=True).start()

    def _forward(self) -> None:
        # Ranks that start after the signal, or have not yet installed their handler, get it once they listen.
        while not self._stopped.is_set():
            for pid in rank_pids():
                if pid not in self.sent and listens(pid, self.signum):
                    try:
                        os.kill(pid, self.signum)
                    except ProcessLookupError:
                        pass
                    self.sent.add(pid)
            self._stopped.wait(self.poll_s)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_PARENT_AT_IMPORT = os.getppid()  # for a rank, its launcher


def follow_launcher(sig: int = signal.SIGTERM) -> bool:
    """In a rank torchrun started (``TORCHELASTIC_RUN_ID`` set): have the kernel send this process ``sig`` should its
    launcher die (prctl PR_SET_PDEATHSIG). A launcher killed outright (SIGKILL, or plain torchrun killed by a SIGUSR1
    it does not handle) then leaves no rank training on alone: each gets ``sig``, saves at the next step boundary
    with the others and exits. Returns whether it was set (Linux only; elsewhere, or without torchrun, nothing)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != _PARENT_AT_IMPORT:  # the launcher died before the request: act on it now
        os.kill(os.getpid(), sig)
    return True


def torchrun_signals(args: Sequence[str]) -> tuple:
    """``args`` without a --signals-to-handle option, and the signals torchrun is to handle: the user's list (or
    torchrun's default) less SIGTERM and SIGUSR1."""
    rest, chosen = [], ",".join(TORCHRUN_SIGNALS)
    it = iter(args)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in SIGNALS_FLAGS:
            chosen = value if eq else next(it, "")
            continue
        rest.append(arg)
    stops = {s.name for s in STOP_SIGNALS}
    kept = [s.strip() for s in chosen.split(",") if s.strip() and s.strip() not in stops]
    return rest, ",".join(kept)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.partition("=")[0] in NPROC_FLAGS for a in args):
        sys.stderr.write(
            "error: python -m recipes.launch starts N ranks: give --nproc_per_node N before the recipe "
            "(for one process, run tune run recipes/... directly)\n"
        )
        sys.exit(2)
    rest, handled = torchrun_signals(args)
    StopForwarder().install()
    from torchtune._cli.tune import main as tune_main

    sys.argv = ["tune", "run", *SIGNALS_FLAGS[:1], handled, *rest]
    tune_main()


if __name__ == "__main__":
    main()
