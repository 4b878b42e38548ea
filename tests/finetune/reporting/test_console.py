"""finetune/reporting/console.py's figures of a step."""

import gc

import torch

from finetune.reporting.console import CollectorTime, pinned_pool_gib


def test_the_collector_time_counts_each_collection_once_and_full_ones_apart():
    collector = CollectorTime()
    try:
        collector.take()  # (whatever ran before)
        gc.collect(0)
        gc.collect(2)
        first = collector.take()
        assert first["gc_full"] == 1 and first["gc_ms"] > 0
        assert collector.take() == {"gc_ms": 0.0, "gc_full": 0}  # read once: the next step starts from nothing
    finally:
        collector.close()
    gc.collect(2)
    assert collector.take()["gc_full"] == 0  # closed: no longer counting


def test_the_pinned_pool_is_what_torchs_pinned_allocator_holds_and_absent_without_its_statistics(monkeypatch):
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {"allocated_bytes.current": 3 * 2**29})
    assert pinned_pool_gib() == 1.5
    monkeypatch.setattr(torch.cuda, "host_memory_stats", lambda: {})  # (CUDA never initialised: no figures)
    assert pinned_pool_gib() is None

    def no_runtime():
        raise RuntimeError("no CUDA runtime")

    monkeypatch.setattr(torch.cuda, "host_memory_stats", no_runtime)
    assert pinned_pool_gib() is None
