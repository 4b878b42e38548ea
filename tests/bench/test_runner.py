"""bench/_runner.py's footprint: which samples are the training's and which the saves'."""

import sys
import time

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import _runner as runner


def test_after_the_last_step_the_host_memory_counts_as_saving_not_training():
    """A save's span and everything after the last step (the epoch's save, the exit: pages a save leaves in the
    process until it ends) are saving; the rest, loading included, is training."""
    fp = runner.Footprint(every=60)
    fp.stop()
    # (seconds, host GB taken, GPU MiB, compile workers GB)
    fp.samples = [
        (0.0, 1.0, 10, 0.0),
        (5.0, 3.0, 30, 0.5),
        (6.0, 9.0, 20, 0.0),
        (8.0, 4.0, 30, 0.0),
        (12.0, 7.0, 5, 0.0),
    ]
    peaks = fp.peaks([(5.5, 6.5)], trained=10.0)
    assert (peaks["host_gb_peak"], peaks["host_gb_peak_training"], peaks["host_gb_peak_saving"]) == (9.0, 4.0, 9.0)
    assert peaks["gpu_mib_peak"] == 30 and peaks["compile_workers_gb_peak"] == 0.5
    assert fp.peaks([(5.5, 6.5)])["host_gb_peak_training"] == 7.0  # (no end given: the exit's samples train)
    assert fp.peaks([])["host_gb_peak_saving"] is None


def test_each_sample_holds_the_kernels_parts_of_the_drop_and_memtotals_change():
    """A real sample, read from /proc/meminfo: the drop, then the GPU (none here), the compile workers, the dirty
    pages, shared memory's change and MemTotal's change (a machine whose memory grows pays for the new pages'
    descriptors out of MemAvailable)."""
    fp = runner.Footprint(every=0.05)
    while len(fp.samples) < 2:
        time.sleep(0.05)
    fp.stop()
    for sample in fp.samples:
        assert len(sample) == 7 and sample[2] >= 0 and sample[4] >= 0
        assert all(isinstance(x, (int, float)) for x in sample)


def test_each_peak_names_the_meminfo_fields_that_moved_from_the_start():
    """Where a peak's drop went: the fields of /proc/meminfo at the training peak (before the first save and over the
    whole run) and at the saving peak, as changes from the start in GB; fields that moved less than 0.01 GB left out."""
    fp = runner.Footprint(every=60)
    fp.stop()
    gb = 10**9
    fp._start_info = {"MemAvailable": 50 * gb, "Cached": 2 * gb, "Slab": gb, "AnonPages": gb}
    fp.samples = [
        (t, gb_taken, 0, 0.0, 0.0, 0.0, 0.0) for t, gb_taken in ((0.0, 0.0), (4.0, 3.0), (6.0, 9.0), (8.0, 4.0))
    ]
    fp.infos = [
        dict(fp._start_info),
        {"MemAvailable": 47 * gb, "Cached": 2 * gb, "Slab": gb, "AnonPages": 4 * gb},
        {"MemAvailable": 41 * gb, "Cached": 8 * gb, "Slab": 2 * gb, "AnonPages": 4 * gb},
        {"MemAvailable": 46 * gb, "Cached": 2 * gb, "Slab": gb + 5 * 10**6, "AnonPages": 5 * gb},
    ]
    change = fp.peaks([(5.0, 7.0)])["meminfo_change_gb"]
    assert change["saving_peak"] == {"t": 6.0, "MemAvailable": -9.0, "Cached": 6.0, "Slab": 1.0, "AnonPages": 3.0}
    assert change["training_peak"] == {"t": 8.0, "MemAvailable": -4.0, "AnonPages": 4.0}  # (Slab's 5 MB left out)
    assert change["training_peak_before_saves"] == {"t": 4.0, "MemAvailable": -3.0, "AnonPages": 3.0}
    real = runner.Footprint(every=0.05)
    while len(real.samples) < 2:
        time.sleep(0.05)
    real.stop()
    assert set(real.peaks([])["meminfo_change_gb"]) == {"training_peak", "training_peak_before_saves"}
