"""Host memory as the background checkpoint (``finetune/checkpoint/async_save.py``) and streaming
(``finetune/streaming/``) both see it: how much a run may still take, and a storage as the bytes either one copies
between host and GPU. It sits below both so that neither imports the other.
"""

from typing import Optional

import torch

HOST_RESERVE_FRACTION, HOST_RESERVE_MIN = 0.05, 4 * 2**30  # host memory left to everything else


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage as a flat uint8 tensor over all of it (the unit a snapshot copies, and the states' streaming:
    a tensor's views and offsets come along)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def available_host_bytes() -> Optional[int]:
    """MemAvailable less a reserve for everything else (None where /proc/meminfo cannot tell)."""
    try:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in open("/proc/meminfo")}
        total, free = info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError, IndexError):
        return None
    return free - max(HOST_RESERVE_MIN, int(HOST_RESERVE_FRACTION * total))


def resident_bytes() -> int:
    """This process's resident set (VmRSS: pinned pages included), 0 where /proc cannot tell."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
