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


def resident_bytes(peak: bool = False) -> Optional[int]:
    """This process's resident set now (VmRSS) or at its peak (VmHWM), pinned pages included; None where
    /proc/self/status cannot tell."""
    field = "VmHWM:" if peak else "VmRSS:"
    try:
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
