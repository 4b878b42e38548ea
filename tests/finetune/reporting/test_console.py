"""finetune/reporting/console.py's figures of a step."""

import gc

from finetune.reporting.console import CollectorTime


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
