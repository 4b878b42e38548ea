"""finetune/host_memory.py: a storage seen as its bytes, and the host memory a run may still take."""

from pathlib import Path

import torch

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
