"""finetune/host_memory.py: a storage seen as its bytes, and the host memory a run may still take."""

import os
import time
from pathlib import Path

import torch

from conftest import HANG_GUARD_S
from finetune import host_memory


def test_a_storage_as_bytes_covers_all_of_it_and_shares_its_memory():
    base = torch.arange(6, dtype=torch.float32)
    view = base[2:4]  # a view: its storage is the whole tensor's
    raw = host_memory.as_bytes(view.untyped_storage())
    assert raw.dtype == torch.uint8 and raw.numel() == base.numel() * 4
    raw.zero_()
    assert not base.any()


def test_available_host_bytes_keeps_the_reserve_back():
    free = host_memory.available_host_bytes()
    if not Path("/proc/meminfo").is_file():
        assert free is None
        return
    info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    reserve = max(host_memory.HOST_RESERVE_MIN, int(host_memory.HOST_RESERVE_FRACTION * info["MemTotal"]))
    # MemAvailable moves between the two reads: within 256 MiB of the figure read here
    assert abs(free - (info["MemAvailable"] - reserve)) < 2**28


def _compile_workers() -> list:
    """The processes below this one whose command line names inductor's compile worker."""
    children = {}
    for proc in Path("/proc").iterdir():
        try:
            stat = (proc / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            children.setdefault(ppid, []).append((int(proc.name), (proc / "cmdline").read_bytes()))
        except (OSError, ValueError):
            continue
    found, todo = [], [os.getpid()]
    while todo:
        for pid, cmdline in children.get(todo.pop(), []):
            todo.append(pid)
            if b"compile_worker" in cmdline:
                found.append(pid)
    return found


def test_the_compile_workers_end_and_a_later_compile_starts_them_again():
    """torch.compile's worker pool (one process per core, kept for the run) ends on request: a run under
    host_memory_limit_gib gives their memory back at a step boundary; a later compile starts a new pool."""
    from torch._inductor import async_compile
    from torch._inductor import config as inductor_config

    # (inductor's config module is patched its own way: monkeypatch's undo would delete the setting for the
    # tests after this one in the process)
    with inductor_config.patch(compile_threads=2):
        host_memory.end_compile_workers()  # (a clean start: no pool left by another test in this process)
        pool = async_compile.AsyncCompile.process_pool()
        pool.submit(abs, -1).result()  # (the pool's processes exist once a job has run)
        assert _compile_workers()
        assert host_memory.end_compile_workers() == 1
        deadline = time.monotonic() + HANG_GUARD_S
        while _compile_workers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _compile_workers()
        assert host_memory.end_compile_workers() == 0  # (nothing left to end)
        again = async_compile.AsyncCompile.process_pool()  # a later compile: a new pool
        assert again is not pool and again.submit(abs, -2).result() == 2
        assert host_memory.end_compile_workers() == 1


def test_compile_without_workers_sets_one_thread_unless_the_user_named_a_pool_size(monkeypatch):
    """A run under host_memory_limit_gib compiles in its own process (no pool's ~1 GB on top of its peak); a pool
    size the user set with TORCHINDUCTOR_COMPILE_THREADS stands."""
    from torch._inductor import config as inductor_config

    with inductor_config.patch(compile_threads=4):
        monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
        assert host_memory.compile_without_workers()
        assert inductor_config.compile_threads == 1
    with inductor_config.patch(compile_threads=4):
        monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "4")
        assert not host_memory.compile_without_workers()
        assert inductor_config.compile_threads == 4
