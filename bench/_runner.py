"""What the end-to-end benchmarks share beyond bench/_harness.py: a row measured as a recipe run of a few steps, the
results file that keeps what was measured after every row, the footprint a run leaves on the card and the host (what
bench/configs_check.py and bench/moe_anchor.py sample), and the pool that deals jobs to the GPUs.

bench/e2e.py (Llama2-7B's rows, one after another) and bench/model_families.py (a job of rows per family, one worker
per GPU) measure a row the same way: a fresh recipe process, stopped once its last step is logged; the median
tokens/s of the steps after the warm-up, the peak memory, the losses, every step's speed. Each adds its own figures
(its MFU's parameter count, streaming, profiles) and its own table.
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import _harness as harness
from finetune import host_memory

PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM
# torchtune's stock recipe as both benchmarks run it: packed rows, compiled, batches of 16, no gradient clipping, the
# configs' learning rate (the setting that measured fastest for Llama2-7B; each row adds its optimizer and memory
# flags).
STOCK_PACKED = [
    "dataset.packed=True",
    "compile=True",
    "batch_size=16",
    "seed=42",
    "clip_grad_norm=null",
    "optimizer.lr=2e-5",
]


# -- a row ----------------------------------------------------------------------------------------------------------


def read_steps(kind: str, out: Path) -> List[dict]:
    """The steps a row logged: torchtune's stock recipe from its DiskLogger file, ours from metrics.jsonl (a figure it
    did not log, such as GPU memory on the CPU, is None)."""
    return harness.read_stock_log(out) if kind == "stock" else harness.read_metrics(out)


def measure(
    cmd: List[str],
    out: Path,
    kind: str,
    *,
    steps: int,
    timeout: float,
    env: Dict[str, str],
    watch: Optional[Callable[[List[dict]], bool]] = None,
) -> Tuple[harness.Run, List[dict], Optional[str]]:
    """Run a row's recipe command (its log: ``out``/log.txt) until ``steps`` steps are logged and ``watch`` (called
    at every poll with the steps logged so far) says it is done. Returns the run, the steps, and the error: None, or
    how many steps were logged and why no more."""

    def done() -> bool:
        records = read_steps(kind, out)
        return (watch(records) if watch is not None else True) and len(records) >= steps

    run = harness.run(cmd, out / "log.txt", timeout=timeout, env=env, until=done)
    records = read_steps(kind, out)
    if len(records) >= steps:
        return run, records, None
    why = run.error() or " / ".join(list(run.tail)[-3:])
    return run, records, f"{len(records)} of {steps} steps logged in {run.wall_s} s: " + why[-600:]


def figures(records: List[dict], steady: List[dict], parameters: float) -> dict:
    """A row's figures: the median tokens/s of the ``steady`` steps, the peaks (GiB), the MFU (6 x ``parameters`` x
    tokens/s over PEAK_FLOPS), the first step's wall time, and every step's loss and speed."""
    tok_s = statistics.median(r["tokens_per_second"] for r in steady)
    return dict(
        tok_s=round(tok_s, 1),
        peak_gib=harness.peak(records, "peak_memory_alloc_gib"),
        peak_reserved_gib=harness.peak(records, "peak_memory_reserved_gib"),
        mfu=round(6 * parameters * tok_s / PEAK_FLOPS, 3),
        first_step_s=round(records[0]["first_step_s"], 1) if "first_step_s" in records[0] else None,
        losses=[round(r["loss"], 5) for r in records],
        tok_s_per_step=[round(r["tokens_per_second"], 1) for r in records],
    )


# -- the footprint -----------------------------------------------------------------------------------------------------


class Footprint:
    """Samples, every ``every`` seconds while a run lives: MemAvailable's drop from its value at the start (bytes),
    the GPU memory nvidia-smi lists for the run's processes (MiB), the proportional set size of torch.compile's
    worker processes (GB: part of the host drop, which a machine with fewer cores pays less of), and two parts of the
    drop that are the kernel's rather than the run's own: file pages not yet written out (Dirty and Writeback, GB:
    a checkpoint on its way to the disk) and shared memory's change from the start (Shmem, GB: files in /dev/shm);
    last, MemTotal's change from the start (GB): a virtual machine whose memory grew mid-run would pay for the new
    pages' descriptors out of MemAvailable, a cost a desktop's fixed memory does not have (the device machines' did
    not change in the rows that recorded it). Each sample's whole /proc/meminfo is kept (``infos``) so that
    ``peaks`` can say which of the kernel's fields moved at each peak: the drop's part that is not the run's own."""

    def __init__(self, every: float = 0.5):
        # (seconds, host GB taken, GPU MiB, compile workers GB, dirty GB, shared memory GB, MemTotal's change GB)
        self.every, self.samples, self.infos = every, [], []
        self._stop = threading.Event()
        self._start_info = self._meminfo()
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def _meminfo() -> dict:
        """/proc/meminfo, read once a sample: the drop and the kernel's parts of it come from the same instant."""
        info = host_memory.meminfo()
        if info is None or "MemAvailable" not in info:
            raise RuntimeError("no MemAvailable in /proc/meminfo")
        return info

    @staticmethod
    def _gpu_mib() -> int:
        """The GPU memory of every compute process (the run and its children; nothing else runs on the machine)."""
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
            ).stdout
        except FileNotFoundError:  # (no NVIDIA driver: a CPU trial of this script)
            return 0
        return sum(int(line.split(",")[1]) for line in out.splitlines() if line.strip())

    @staticmethod
    def _compile_workers_gb() -> float:
        """Inductor compiles in a pool of subprocesses (``torch/_inductor/compile_worker``), one per core by default,
        kept for the whole run: their memory, each page shared between them counted once (Pss)."""
        total = 0
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and b"compile_worker" in (proc / "cmdline").read_bytes():
                    rollup = (proc / "smaps_rollup").read_text()
                    total += int(re.search(r"^Pss:\s+(\d+) kB", rollup, re.M).group(1)) * 1024
            except (OSError, AttributeError):  # (gone meanwhile, or not ours to read)
                continue
        return round(total / 1e9, 2)

    def _loop(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic() - self._start
            info = self._meminfo()
            taken = (self._start_info["MemAvailable"] - info["MemAvailable"]) / 1e9
            dirty = round((info.get("Dirty", 0) + info.get("Writeback", 0)) / 1e9, 2)
            shmem, total = round(self._since_start(info, "Shmem"), 2), round(self._since_start(info, "MemTotal"), 2)
            self.samples.append((round(t, 1), taken, self._gpu_mib(), self._compile_workers_gb(), dirty, shmem, total))
            self.infos.append(info)
            self._stop.wait(self.every)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def peaks(self, spans: List[tuple], trained: Optional[float] = None) -> dict:
        """Peak host GB and GPU MiB over the whole run, and the host peak while training and while saving: inside
        ``spans`` ((start, end) seconds: the saves), and from ``trained`` on (the second the last step was logged:
        the epoch's save and the exit, when nothing trains any more), is saving; the rest is training."""

        def within(t):
            return (trained is not None and t > trained) or any(a <= t <= b for a, b in spans)

        def peak(rows, i):
            return round(max((r[i] for r in rows), default=0.0), 2)

        saving = [s for s in self.samples if within(s[0])]
        training = [s for s in self.samples if not within(s[0])]
        before_saves = [s for s in training if not spans or s[0] < spans[0][0]]
        return {
            "host_gb_peak": peak(self.samples, 1),
            "host_gb_peak_training": peak(training, 1),
            "host_gb_peak_saving": peak(saving, 1) if saving else None,
            "gpu_mib_peak": int(peak(self.samples, 2)),
            "compile_workers_gb_peak": peak(self.samples, 3),
            "meminfo_change_gb": {
                name: self.meminfo_change(max(rows, key=lambda r: r[1]))
                for name, rows in (
                    ("training_peak", training),
                    ("training_peak_before_saves", before_saves),
                    ("saving_peak", saving),
                )
                if rows and len(self.infos) == len(self.samples)
            },
        }

    def _since_start(self, info: dict, field: str) -> float:
        """A /proc/meminfo field's change from the start (GB, signed)."""
        return (info.get(field, 0) - self._start_info.get(field, 0)) / 1e9

    def meminfo_change(self, sample: tuple, at_least: float = 0.01) -> dict:
        """The /proc/meminfo fields that moved by ``at_least`` GB or more from the start to ``sample`` (GB, signed,
        the sample's time beside them): where a peak's drop went (the run's anonymous and shared pages, page cache,
        slab, page tables, ...)."""
        info = self.infos[self.samples.index(sample)]
        change = {k: self._since_start(info, k) for k in info}
        return {"t": sample[0], **{k: round(v, 2) for k, v in change.items() if abs(v) >= at_least}}


# -- the results file -----------------------------------------------------------------------------------------------


class Results:
    """A benchmark's JSON: provenance first (bench/_harness.py; a dirty tree refuses here, before any work), the
    records of an earlier file a --merge run does not re-measure, then this run's, written whole after every row
    (a stopped run keeps what it measured)."""

    def __init__(self, script: str, argv: List[str], args, remeasured: Callable[[dict], bool], **fields) -> None:
        self.prov = harness.provenance(script, argv, args.allow_dirty)
        self.out = args.out
        old = harness.earlier(args.out, args.merge)
        self.kept = [r for r in old.get("records", []) if not remeasured(r)]
        self.records: List[dict] = []
        self.doc = {
            **self.prov,
            "commands": harness.commands(old, self.prov["command"]),
            **fields,
            "records": self.kept,
        }

    def write(self) -> None:
        self.doc["records"] = self.kept + self.records
        harness.write_json(self.out, self.doc)


# -- the pool -------------------------------------------------------------------------------------------------------


def gpus(cpu: bool) -> List[Optional[int]]:
    """The GPUs to deal jobs to: CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists (no CUDA context here); [None]
    on the CPU or where none is found."""
    if cpu:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [int(g) for g in visible.split(",") if g.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return list(range(len([ln for ln in listed.splitlines() if ln.startswith("GPU ")]))) or [None]
    except (OSError, subprocess.SubprocessError):
        return [None]


def run_pool(jobs: Sequence, devices: List[Optional[int]], cost: Callable, work: Callable) -> None:
    """``work(device, its jobs)`` in one thread per device. The costliest job first, each to the device with the
    least work so far: on as many GPUs as jobs, every job has its own; on one, they run one after another."""
    plan: Dict[Optional[int], list] = {g: [] for g in devices}
    for job in sorted(jobs, key=lambda j: -cost(j)):
        plan[min(devices, key=lambda g: sum(cost(j) for j in plan[g]))].append(job)
    threads = [threading.Thread(target=work, args=(g, js)) for g, js in plan.items() if js]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
