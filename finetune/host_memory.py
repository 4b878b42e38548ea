"""Host memory as the background checkpoint (``finetune/checkpoint/async_save.py``) and streaming
(``finetune/streaming/``) both see it: how much a run may still take, and a storage as the bytes either one copies
between host and GPU. It sits below both so that neither imports the other.
"""

from typing import Dict, Optional

import torch

HOST_RESERVE_FRACTION, HOST_RESERVE_MIN = 0.05, 4 * 2**30  # host memory left to everything else


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage as a flat uint8 tensor over all of it (the unit a snapshot copies, and the states' streaming:
    a tensor's views and offsets come along)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def meminfo() -> Optional[Dict[str, int]]:
    """/proc/meminfo's fields in bytes (None where it cannot be read: not Linux)."""
    try:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
    except (OSError, ValueError, IndexError):
        return None


def available_host_bytes() -> Optional[int]:
    """MemAvailable less a reserve for everything else (None where /proc/meminfo cannot tell)."""
    info = meminfo()
    if info is None or "MemTotal" not in info or "MemAvailable" not in info:
        return None
    return info["MemAvailable"] - max(HOST_RESERVE_MIN, int(HOST_RESERVE_FRACTION * info["MemTotal"]))


def process_status(pid: str = "self") -> Optional[Dict[str, int]]:
    """The memory fields of /proc/PID/status (those counted in kB: VmRSS, VmHWM, RssAnon, RssFile, ...) in bytes; None
    where it cannot be read (not Linux, or the process is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f) if v.endswith(" kB\n")}
    except (OSError, ValueError):
        return None


def resident_bytes(peak: bool = False) -> Optional[int]:
    """This process's resident set now (VmRSS) or at its peak (VmHWM), pinned pages included; None where
    /proc/self/status cannot tell."""
    return (process_status() or {}).get("VmHWM" if peak else "VmRSS")


def compile_without_workers() -> bool:
    """Have torch.compile compile in this process, without its pool of worker processes; False (nothing changed)
    where TORCHINDUCTOR_COMPILE_THREADS names a pool size: the user's choice stands.

    The pool (one process per core, up to 32) holds 0.5-0.9 GB of host memory while the first steps compile, on top
    of everything a small-card run has pinned: the peak a 32 GB desktop must hold. Without it the first step
    compiles one kernel at a time (slower: the first step's time, once a run). Called before compiling."""
    import os

    if "TORCHINDUCTOR_COMPILE_THREADS" in os.environ:
        return False
    from torch._inductor import config as inductor_config  # (lazy: a run without compile never imports inductor)

    inductor_config.compile_threads = 1
    return True


def end_compile_workers() -> int:
    """End torch.compile's pool of compile worker processes, if one is running; returns how many pools ended.

    Inductor compiles in a pool of worker processes, one per core (up to 32), and keeps it for the whole run: 0.55 to
    1.34 GB of host memory measured on a 16-core machine (bench/results/configs_check_h100.json,
    compile_workers_gb_peak), idle once the first step has compiled. A run under host_memory_limit_gib has no pool
    (``compile_without_workers``) unless TORCHINDUCTOR_COMPILE_THREADS asks for one; then it ends the pool at a step
    boundary, and a later compile (a validation pass's graphs, a smaller last batch) starts a new one, whose start
    costs a second or two, and ends it again."""
    from torch._inductor import async_compile  # (lazy: a run without compile never imports inductor here)

    pools = len(getattr(async_compile, "_pool_set", ()))  # (private to torch: a release without it ends nothing)
    if pools and hasattr(async_compile, "shutdown_compile_workers"):
        async_compile.shutdown_compile_workers()
        return pools
    return 0
