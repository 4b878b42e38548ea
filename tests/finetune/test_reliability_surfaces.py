"""Reliability of the newer surfaces, at the level of their components: the output-folder lock across containers
and hosts, start-up repair, the pack cache, the launcher's stop signals and a rank whose launcher dies, and a stop
signal during the distributed recipe's setup.

Everything runs in this process or in small helper processes that import nothing heavy (a few import torch through
finetune.stops); the recipe-level cases are in test_reliability.py and, on two ranks, in test_distributed.py.
"""

import errno
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import DATA_DIR, FAST, LOCK_HOLDER, REPO_ROOT, TINY_CONFIG
from finetune.checkpoint import lock as _lock
from finetune.checkpoint import run_folder
from finetune.checkpoint.lock import OutputDirLock
from finetune.data import packing


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def wait_for(predicate, timeout=60.0, what="a condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# ------------------------------------------------------------------------------------------------
# the output-folder lock
# ------------------------------------------------------------------------------------------------

# A run elsewhere (another container or host) holding the lock: its PID means nothing here (this one is dead here),
# it holds the fcntl lock as a live run of these recipes does (conftest.LOCK_HOLDER), and it never touches this
# test's process.


@pytest.fixture
def holder_elsewhere(tmp_path):
    """A live run in another PID namespace on another host, holding ``tmp_path/out/.lock``."""
    out = tmp_path / "out"
    out.mkdir()
    owner = {
        "host": "node-b",
        "boot_id": "another-boot",
        "pid_ns": "pid:[1]",
        "pid": dead_pid(),
        "start": "1",
        "token": "theirs",
    }
    proc = subprocess.Popen(
        [sys.executable, "-c", LOCK_HOLDER, str(out / ".lock"), json.dumps(owner)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "holding"
    yield out, owner
    proc.kill()
    proc.wait()


def test_a_live_run_in_another_namespace_keeps_its_lock(holder_elsewhere):
    """Its PID is dead here, which is all a PID-only lock looked at: it must still count as live, and a second
    run must neither take the lock nor remove it."""
    out, owner = holder_elsewhere
    lock = OutputDirLock(out)
    with pytest.raises(run_folder.BadInput, match=rf"in use by a live run \(PID {owner['pid']} on node-b"):
        lock.acquire()
    lock.release()
    assert json.loads((out / ".lock").read_text()) == owner


def _racer(folders, start, tried, holders) -> None:
    for i, folder in enumerate(folders):
        lock = OutputDirLock(folder)
        start.wait()
        try:
            lock.acquire()
            with holders.get_lock():
                holders[i] += 1
        except run_folder.BadInput:
            pass
        tried.wait()  # every taker has tried before any holder lets go
        lock.release()
    os._exit(0)


@pytest.mark.parametrize("kernel_locks", [True, False], ids=["fcntl", "no-fcntl"])
def test_racing_takers_of_a_stale_lock_end_with_one_holder(tmp_path, monkeypatch, kernel_locks):
    """6 processes find the same stale lock (its holder dead) at the same moment, 100 times over: each time exactly
    one takes it (and removes it when it is done)."""
    if not kernel_locks:  # a file system without fcntl locks: O_EXCL and one takeover marker per stale lock

        def no_locks(*args):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(_lock.fcntl, "lockf", no_locks)
    ctx, trials, n = multiprocessing.get_context("fork"), 100, 6
    stale = json.dumps({"pid": dead_pid(), "start": "1"})
    folders = [tmp_path / f"t{i}" for i in range(trials)]
    for folder in folders:
        folder.mkdir()
        (folder / ".lock").write_text(stale)
    start, tried, holders = ctx.Barrier(n), ctx.Barrier(n), ctx.Array("i", trials)
    procs = [ctx.Process(target=_racer, args=(folders, start, tried, holders)) for _ in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * n
    assert list(holders) == [1] * trials, f"trials with other than one holder: {[h for h in holders if h != 1]}"
    assert not [f for f in folders if (f / ".lock").exists()]  # each holder removed it on release; nobody else did


def test_only_the_holder_removes_the_lock(tmp_path):
    """A lock file that is no longer this run's (replaced by another run with the same PID number, in another
    container) stays when this run releases."""
    lock = OutputDirLock(tmp_path)
    lock.acquire()
    theirs = {"host": socket.gethostname(), "pid_ns": "pid:[2]", "pid": os.getpid(), "token": "another-run"}
    (tmp_path / ".lock.new").write_text(json.dumps(theirs))
    os.replace(tmp_path / ".lock.new", tmp_path / ".lock")
    lock.release()
    assert json.loads((tmp_path / ".lock").read_text())["token"] == "another-run"


def test_without_fcntl_locks_a_holder_elsewhere_is_live_while_its_lease_is_fresh(tmp_path, monkeypatch):
    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_lock.fcntl, "lockf", no_locks)
    me = _lock.identity()
    elsewhere = {
        "host": "node-b",
        "boot_id": "b",
        "pid_ns": me["pid_ns"],
        "pid": os.getpid(),
        "start": me["start"],
        "token": "theirs",
    }
    (tmp_path / ".lock").write_text(json.dumps(elsewhere))
    with pytest.raises(run_folder.BadInput, match="on node-b.*its lease ends 300 s after"):
        OutputDirLock(tmp_path).acquire()
    old = time.time() - _lock.LEASE_S - 60  # not touched for longer than the lease: that run is gone
    os.utime(tmp_path / ".lock", (old, old))
    lock = OutputDirLock(tmp_path)
    lock.acquire()
    assert json.loads((tmp_path / ".lock").read_text())["token"] == lock.me["token"]
    lock.release()
    assert not (tmp_path / ".lock").exists()


# ------------------------------------------------------------------------------------------------
# a resume file only one rank reads
# ------------------------------------------------------------------------------------------------


def _read_rank_file(rank: int, folder: Path, port: int) -> None:
    import torch.distributed as dist

    from finetune.checkpoint import resume as _resume

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        _resume.read_rank_state(folder, run_folder.DistributedRanks(), required=False)
        result = "read"
    except run_folder.BadInput as e:
        result = f"error: {e}"
    (folder / f"result-{rank}").write_text(result)
    dist.barrier()  # (both still connected: neither rank was left waiting in a collective)
    dist.destroy_process_group()
    os._exit(0)


def test_an_unreadable_rank_file_is_the_same_error_on_every_rank(tmp_path):
    """Two gloo ranks resume; rank 1's recipe_state_rank1.pt is garbage. Both raise rank 1's one-line error, so rank
    0 prints it and exits 2 with the others, rather than wait in its next collective for a rank that has left."""
    import torch

    torch.save({"optimizer": None, "rng": None}, tmp_path / "recipe_state_rank0.pt")
    (tmp_path / "recipe_state_rank1.pt").write_bytes(b"garbage" * 100)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_read_rank_file, args=(rank, tmp_path, port)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    results = [(tmp_path / f"result-{rank}").read_text() for rank in (0, 1)]
    assert results[0] == results[1] and results[0].startswith(
        f"error: {tmp_path / 'recipe_state_rank1.pt'} is unreadable"
    )


# ------------------------------------------------------------------------------------------------
# start-up repair
# ------------------------------------------------------------------------------------------------


def test_repair_touches_only_the_folders_a_run_makes(tmp_path):
    dead = dead_pid()
    for name in (".tmp-notes", ".old-notes", ".tmp-step_x", f".old-results-{dead}-abcd1234"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text("keep")
    (tmp_path / f".tmp-step_4-{dead}-abcd1234").mkdir()
    (tmp_path / f".old-epoch_0-{dead}-abcd1234").mkdir()
    run_folder.recover_run_folder(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".tmp-notes", ".old-notes", ".tmp-step_x", f".old-results-{dead}-abcd1234", "epoch_0"]
    )
    assert (tmp_path / ".tmp-notes" / "mine.txt").read_text() == "keep"


# ------------------------------------------------------------------------------------------------
# the pack cache
# ------------------------------------------------------------------------------------------------


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, msg):
        self.lines.append(msg)

    warning = info


@pytest.fixture(scope="module")
def small_ds():
    from torchtune.datasets import alpaca_dataset
    from torchtune.models.llama2 import llama2_tokenizer

    tok = llama2_tokenizer(str(DATA_DIR / "llama2_tokenizer" / "tokenizer.model"), max_seq_len=64, prompt_template=None)
    ds = alpaca_dataset(
        tok,
        source="json",
        data_files=str(DATA_DIR / "alpaca" / "alpaca_data.json"),
        split="train[:24]",
        train_on_input=True,
    )
    return ds, tok, packing.TokenizedSamples.from_dataset(ds)


def _pack(ds, tok, cache_dir, log):
    parts = dict(
        dataset_cfg={"split": "train[:24]"},
        data_files=[],
        tokenizer_path=str(DATA_DIR / "llama2_tokenizer" / "tokenizer.model"),
        tokenizer_cfg={"max_seq_len": 64},
    )
    return packing.pack_dataset(
        ds,
        max_seq_len=64,
        padding_idx=tok.pad_id,
        cache_dir=cache_dir,
        cache_parts=parts,
        log=log,
        vocab_size=tok.vocab_size,
    ), parts


def _craft(kind: str, good: "packing.TokenizedSamples", path: Path, key: str) -> None:
    tokens, labels, offsets = good.tokens.copy(), good.labels.copy(), good.offsets.copy()
    if kind == "npy":  # an array file under the cache's name
        with open(path, "wb") as f:
            np.save(f, tokens)
        return
    if kind == "out-of-vocab":
        tokens[5] = 10**6
    elif kind == "longer-than-the-pack":  # the first two samples as one of more than 64 tokens
        offsets = np.delete(offsets, 1)
    elif kind == "poisoned":  # consistent arrays, a valid checksum: other tokens than the tokenizer makes
        tokens = (tokens + 1) % 32000
    crafted = packing.TokenizedSamples(tokens, labels, offsets)
    crafted.save(path, key if kind != "other-key" else "another key")


@pytest.mark.parametrize("kind", ["npy", "out-of-vocab", "longer-than-the-pack", "poisoned", "other-key"])
def test_a_crafted_pack_cache_is_rebuilt(small_ds, tmp_path, kind):
    ds, tok, good = small_ds
    _, parts = _pack(ds, tok, None, _Log())
    key = packing.cache_key(max_seq_len=64, **parts)
    path = tmp_path / f"samples-{key}.npz"
    if kind == "longer-than-the-pack":
        assert good.lengths[0] + good.lengths[1] > 64
    _craft(kind, good, path, key)
    log = _Log()
    packed, _ = _pack(ds, tok, tmp_path, log)
    assert any("is not usable" in line for line in log.lines), log.lines
    assert np.array_equal(packed.samples.tokens, good.tokens) and np.array_equal(packed.samples.offsets, good.offsets)
    again = packing.TokenizedSamples.load(path, key)  # rewritten with the right samples
    assert again is not None and np.array_equal(again.tokens, good.tokens)


def test_the_pack_cache_cleans_up_and_evicts(small_ds, tmp_path, monkeypatch):
    """A killed run's temporary file goes after an hour, a cache file unused for 30 days goes, and then the least
    recently used until the folder fits MAX_BYTES; the file in use and a temporary file being written stay."""
    ds, tok, good = small_ds
    _pack(ds, tok, tmp_path, _Log())
    (current,) = tmp_path.glob("samples-*.npz")
    now = time.time()

    def aged(name, seconds, size=10):
        p = tmp_path / name
        p.write_bytes(b"x" * size)
        os.utime(p, (now - seconds, now - seconds))
        return p

    leftover = aged(".tmp-abc123.npz", 2 * 3600)  # a killed run's temporary file
    writing = aged(".tmp-def456.npz", 10)  # another run writing right now
    unused = aged("samples-0123456789abcdef01234567.npz", 40 * 86400)
    big_old = aged("samples-aaaaaaaaaaaaaaaaaaaaaaaa.npz", 2 * 86400, size=3000)
    big_new = aged("samples-bbbbbbbbbbbbbbbbbbbbbbbb.npz", 1 * 86400, size=3000)
    monkeypatch.setattr(packing, "MAX_BYTES", current.stat().st_size + 3500)  # room for one of the two big ones
    _pack(ds, tok, tmp_path, _Log())
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([writing.name, big_new.name, current.name])
    assert not any(p.exists() for p in (leftover, unused, big_old))


# ------------------------------------------------------------------------------------------------
# the launcher's stop signals, and a rank whose launcher dies
# ------------------------------------------------------------------------------------------------

# A stand-in for a rank: its own session (as torchrun starts ranks), a SIGTERM handler installed only after a
# while (a rank importing torch), then waiting for the signal. Its exit code says what happened: 0 = the signal came
# to its handler, -15 = it came too early and killed it.
LATE_LISTENER = r"""
import signal, sys, time
time.sleep(float(sys.argv[1]))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("listening", flush=True)
time.sleep(60)
sys.exit(3)
"""


def test_the_launcher_passes_a_stop_signal_to_each_rank_once_it_listens():
    from finetune.launch import StopForwarder, rank_pids

    worker_env = {**os.environ, "TORCHELASTIC_RUN_ID": "test"}  # (torchrun's worker environment)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LATE_LISTENER, delay],
            start_new_session=True,
            env=worker_env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for delay in ("0", "1.5")
    ]
    # Not ranks: a helper in the launcher's session, and a service in a session of its own (as wandb starts
    # wandb-core) that listens for SIGTERM too.
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    service = subprocess.Popen(
        [sys.executable, "-c", LATE_LISTENER, "0"], start_new_session=True, stdout=subprocess.PIPE, text=True
    )
    forwarder = StopForwarder(poll_s=0.05)
    try:
        wait_for(lambda: set(rank_pids()) >= {r.pid for r in ranks}, what="the ranks to start")
        assert service.stdout.readline() == "listening\n"
        assert helper.pid not in rank_pids() and service.pid not in rank_pids()
        forwarder._on_signal(signal.SIGTERM, None)  # what the launcher's handler runs on SIGTERM
        codes = [r.wait(30) for r in ranks]
        assert codes == [0, 0]  # both got it, in their handler (the late one was not killed by an early signal)
        time.sleep(0.2)  # (a few more rounds of the forwarder)
        assert helper.poll() is None and service.poll() is None  # the launcher's other children are left alone
    finally:
        forwarder.stop()  # (its thread would go on signalling this test process's children)
        for p in ranks + [helper, service]:
            if p.poll() is None:
                p.kill()
            p.wait()


def test_the_launcher_keeps_stop_signals_from_torchrun():
    from finetune.launch import main, torchrun_signals

    assert torchrun_signals(["--nproc_per_node", "2", "r.py"]) == (
        ["--nproc_per_node", "2", "r.py"],
        "SIGINT,SIGHUP,SIGQUIT",
    )
    rest, handled = torchrun_signals(["--signals-to-handle=SIGTERM,SIGUSR1,SIGUSR2", "--nproc_per_node", "2", "r.py"])
    assert rest == ["--nproc_per_node", "2", "r.py"] and handled == "SIGUSR2"
    with pytest.raises(SystemExit) as stop:
        main(["recipes/full_finetune_distributed.py", "--config", TINY_CONFIG])
    assert stop.value.code == 2


# A launcher (P) that starts a rank (C) and then is killed outright; C asks for SIGTERM on its launcher's death.
ORPHAN = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[2])
marker = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *a: (open(marker, "w").write("stopped"), sys.exit(0)))
from finetune.launch import follow_launcher
assert follow_launcher()
print("ready", flush=True)
time.sleep(60)
"""
LAUNCHER = r"""
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], stdout=subprocess.PIPE,
                         text=True)
print(child.stdout.readline().strip(), child.pid, flush=True)
time.sleep(60)
"""


def test_a_rank_whose_launcher_dies_is_told_to_stop(tmp_path):
    marker = tmp_path / "stopped"
    env = dict(os.environ, TORCHELASTIC_RUN_ID="test")
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ORPHAN, str(marker), str(REPO_ROOT)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    ready, rank = launcher.stdout.readline().split()
    assert ready == "ready"
    launcher.kill()  # SIGKILL: nothing of the launcher runs
    launcher.wait()
    wait_for(marker.exists, timeout=30, what="the rank to get SIGTERM")
    wait_for(
        lambda: not Path(f"/proc/{rank}").exists() or "Z" in Path(f"/proc/{rank}/stat").read_text().split()[2],
        timeout=30,
        what="the rank to exit",
    )


def test_a_stop_signal_during_setup_stops_the_distributed_recipe_before_training(tmp_path, monkeypatch, capsys, caplog):
    """The signal comes while the recipe builds its loss (the distributed recipe in this process, a world of one):
    nothing is trained or written, and it exits 0."""
    from recipes.full_finetune_distributed import recipe_main

    got = []
    previous = signal.signal(signal.SIGTERM, lambda *a: got.append("test"))  # (a guard: never kill this process)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)).items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "out"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "recipes/full_finetune_distributed.py",
            "--config",
            TINY_CONFIG,
            f"data_dir={DATA_DIR}",
            f"output_dir={out}",
            *FAST,
            "metric_logger=null",
            "pack_cache_dir=off",
            f"loss._component_={__name__}.SignalledLoss",
        ],
    )
    monkeypatch.chdir(REPO_ROOT)
    try:
        code = 0
        try:
            recipe_main()
        except SystemExit as e:
            code = e.code or 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "Stopped before the first step" in captured.out
    assert "Stopped by a signal during setup" in caplog.text
    assert not got  # the recipe's handler had it, not the guard
    assert not [p for p in out.iterdir() if p.name.startswith(("step_", "epoch_"))]
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()


class SignalledLoss:
    """The tiny config's loss, built while a SIGTERM arrives (what a launcher forwards during a rank's setup)."""

    def __new__(cls, *args, **kwargs):
        from torchtune.modules.loss import CEWithChunkedOutputLoss

        os.kill(os.getpid(), signal.SIGTERM)
        return CEWithChunkedOutputLoss(*args, **kwargs)
