"""A run's metrics: one record per step (``metrics.jsonl``, the metric logger, a console line every
``log_every_n_steps``), the numbers a dashboard tabulates (``summary_metrics``: median tokens/s over the steady
steps, peak memory, optimizer state, first-step seconds, epoch time, final loss, skipped steps) and the end of the
run: ``summary.json`` and the paragraph printed last.

Nothing here changes training. The summary is computed from ``metrics.jsonl``, the one record of every step, so
a resumed run's summary covers the whole run, and ``bench/table.py`` recomputes the same numbers for a folder that
has no ``summary.json``.
"""

import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from tqdm import tqdm

from finetune.run_files import CHECKPOINT_PREFIXES, METRICS_FILE, SUMMARY_FILE, read_json, tag, update_summary

# The first steps of each process compile, autotune and warm the allocator: the summary's medians skip them, as
# bench/compare.py does (--skip-steps 2).
WARMUP_STEPS = 2


def strict_json(record: Dict[str, Any]) -> str:
    """One metrics line as strict JSON: NaN and +-inf become null (json.dumps would write bare NaN)."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return json.dumps({k: clean(v) for k, v in record.items()}, allow_nan=False)


def step_record(
    *,
    step: int,
    epoch: int,
    loss: float,
    lr: float,
    tokens: int,
    ranks: List[Dict[str, Any]],
    grad_norm: Optional[float],
    skipped: int,
    world: Optional[int] = None,
) -> Dict[str, Any]:
    """A step's metrics record, in the one shape both recipes write.

    ``ranks``: each rank's own figures, ``{"elapsed": s, "opt_ms": ms or None, "state_bytes": n, **memory_metrics}``
    (one entry on one device). The step takes as long as its slowest rank; memory (and the allocator's retries) is
    the largest rank's and the optimizer state the sum. With ``world`` (the distributed recipe) the record also
    keeps each rank's figures (``..._per_rank``), tokens/s per GPU and the world size.
    """
    wall = max(r["elapsed"] for r in ranks)
    record: Dict[str, Any] = {
        "step": step,
        "epoch": epoch,
        "loss": loss,
        "lr": lr,
        "tokens": int(tokens),
        "tokens_per_second": float(tokens) / wall,
    }
    if world is not None:
        record["tokens_per_second_per_gpu"] = float(tokens) / wall / world
    record["step_time_s"] = wall
    for key in ranks[0]:
        if key.startswith(("peak_", "host_rss", "alloc_retries", "pinned_pool")):
            record[key] = max(r[key] for r in ranks)
            if world is not None:
                record[key + "_per_rank"] = [r[key] for r in ranks]
    record["optimizer_step_ms"] = None if ranks[0]["opt_ms"] is None else max(r["opt_ms"] for r in ranks)
    record["optimizer_state_bytes"] = sum(r["state_bytes"] for r in ranks)
    if world is not None:
        record["optimizer_state_bytes_per_rank"] = [r["state_bytes"] for r in ranks]
    record["grad_norm"] = grad_norm
    record["skipped_steps"] = skipped
    if world is not None:
        record["world_size"] = world
    return record


def read_records(path: Path) -> List[Dict[str, Any]]:
    """The records of a ``metrics.jsonl`` ([] if it is missing); a line that does not parse is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def truncate_metrics(path: Path, step: int) -> int:
    """A resume from global step ``step``: drop the records after it (the interrupted run's steps the resume trains
    again), so each step is in ``metrics.jsonl`` once. Returns the number of records dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            later = json.loads(line).get("step", 0) > step
        except (ValueError, AttributeError, TypeError):
            later = False  # a line we cannot read is kept as it was
        if later:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = path.with_name(f".{path.name}.{tag()}")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


class MetricsLog:
    """Every step's record to ``{output_dir}/metrics.jsonl`` (strict JSON) and the metric logger; a line on the
    terminal for the first step of the process, every ``console_every`` steps and every step that validated.

    A fresh run starts a fresh file; a resume keeps the records up to its checkpoint's step and appends, so each
    step is recorded once. Per-rank lists (the distributed recipe's) stay off the terminal line and go to the
    logger as ``key/rank{r}``.
    """

    def __init__(self, output_dir: Path, logger, log, console_every: int = 1):
        self.path = Path(output_dir) / METRICS_FILE
        self.logger, self.log, self.console_every = logger, log, console_every

    def start(self, resume_step: Optional[int]) -> None:
        if resume_step is None:
            for stale in (self.path, self.path.with_name(SUMMARY_FILE)):  # (overwrite=True: the old run's)
                if stale.exists():
                    stale.unlink()
            return
        dropped = truncate_metrics(self.path, resume_step)
        if dropped:
            self.log.info(
                f"metrics.jsonl: dropped {dropped} record(s) after step {resume_step}, which this resume trains again"
            )

    def write(self, record: Dict[str, Any]) -> None:
        if "first_step_s" in record or "val_loss" in record or record["step"] % self.console_every == 0:
            tqdm.write(
                " | ".join(
                    f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in record.items()
                    if not isinstance(v, list)
                )
            )
        with open(self.path, "a") as f:
            f.write(strict_json(record) + "\n")
        if self.logger is not None:
            flat = {}
            for k, v in record.items():
                if isinstance(v, list):
                    flat.update({f"{k}/rank{r}": x for r, x in enumerate(v)})
                elif k != "step" and v is not None:
                    flat[k] = v
            self.logger.log_dict(flat, step=record["step"])

    def close(self) -> None:
        if self.logger is not None:
            self.logger.close()


# ------------------------------------------------------------------------------------------------
# the numbers a dashboard tabulates
# ------------------------------------------------------------------------------------------------


def steady_records(records: List[Dict[str, Any]], skip: int = WARMUP_STEPS) -> List[Dict[str, Any]]:
    """The records after the first ``skip`` of each process (a record with ``first_step_s`` starts one: the run,
    and each resume), or the last record if that leaves none."""
    steady, left = [], 0
    for i, record in enumerate(records):
        if i == 0 or "first_step_s" in record:
            left = skip
        if left > 0:
            left -= 1
            continue
        steady.append(record)
    return steady or records[-1:]


def _median(values) -> Optional[float]:
    values = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return float(statistics.median(values)) if values else None


def _max(records, key) -> Optional[float]:
    values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
    return float(max(values)) if values else None


def summary_metrics(records: List[Dict[str, Any]]) -> Dict[str, Any]:
    """A run's summary from its metrics records (every step, as ``metrics.jsonl`` holds them); keys whose value
    is unknown (a GPU figure on the CPU, no steps) are left out.

        steps, last_step             records, and the global step of the last one
        tokens_per_second_median     median over the steady steps (after the first WARMUP_STEPS of each process)
        tokens_per_second_per_gpu_median   (distributed)
        peak_memory_alloc_gib, peak_memory_reserved_gib   the largest over the run (GPU)
        peak_rss_gib                 the process's host memory at its peak (on a GPU too: pinned states and weights)
        alloc_retries                the caching allocator's retries over the run, each a wait for the GPU (GPU)
        optimizer_state_gib          the optimizer state at the last step
        optimizer_step_ms_median     median over the steady steps (null with optimizer_in_bwd)
        first_step_s                 the run's first step, compilation included
        epoch_time_s                 the summed step times of the last epoch trained (checkpoint writes excluded)
        final_loss, skipped_steps    at the last step
        val_loss                     the last validation's (with dataset_val)
    """
    if not records:
        return {"steps": 0}
    steady, last = steady_records(records), records[-1]
    out: Dict[str, Any] = {"steps": len(records), "last_step": last.get("step")}
    out["tokens_per_second_median"] = _median(r.get("tokens_per_second") for r in steady)
    out["tokens_per_second_per_gpu_median"] = _median(r.get("tokens_per_second_per_gpu") for r in steady)
    for key in ("peak_memory_alloc_gib", "peak_memory_reserved_gib", "peak_rss_gib"):
        out[key] = _max(records, key)
    out["alloc_retries"] = last.get("alloc_retries")
    state = last.get("optimizer_state_bytes")
    out["optimizer_state_gib"] = state / 2**30 if isinstance(state, (int, float)) else None
    out["optimizer_step_ms_median"] = _median(r.get("optimizer_step_ms") for r in steady)
    out["first_step_s"] = next((r["first_step_s"] for r in records if r.get("first_step_s") is not None), None)
    last_epoch = [r for r in records if r.get("epoch") == last.get("epoch")]
    times = [r.get("step_time_s") for r in last_epoch]
    out["epoch_time_s"] = float(sum(times)) if times and all(isinstance(t, (int, float)) for t in times) else None
    out["final_loss"] = last.get("loss")
    out["skipped_steps"] = last.get("skipped_steps")
    out["val_loss"] = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
    out["world_size"] = last.get("world_size")
    return {k: v for k, v in out.items() if v is not None}


def summary_sentence(numbers: Dict[str, Any]) -> str:
    """The summary's numbers as the end-of-run paragraph states them ("" without steps)."""
    if not numbers.get("steps"):
        return ""

    def gib(key):
        return f"{numbers[key]:.2f} GiB" if key in numbers else None

    parts = []
    if "tokens_per_second_median" in numbers:
        parts.append(f"{numbers['tokens_per_second_median']:,.0f} tokens/s (median of the steady steps)")
    if "peak_memory_alloc_gib" in numbers:
        parts.append(f"peak {gib('peak_memory_alloc_gib')} allocated, {gib('peak_memory_reserved_gib')} reserved")
    if numbers.get("alloc_retries"):
        parts.append(f"{numbers['alloc_retries']} allocator retries (GPU memory ran short; each waited for the GPU)")
    if "peak_rss_gib" in numbers:
        parts.append(
            f"host memory peak {gib('peak_rss_gib')}"
            if "peak_memory_alloc_gib" in numbers
            else f"peak RSS {gib('peak_rss_gib')}"
        )
    if "optimizer_state_gib" in numbers:
        parts.append(f"optimizer state {gib('optimizer_state_gib')}")
    if "first_step_s" in numbers:
        parts.append(f"first step {numbers['first_step_s']:.1f} s")
    if "epoch_time_s" in numbers:
        parts.append(f"last epoch {numbers['epoch_time_s']:.1f} s")
    if numbers.get("final_loss") is not None:
        parts.append(f"final loss {numbers['final_loss']:.4f}")
    if numbers.get("val_loss") is not None:
        parts.append(f"validation loss {numbers['val_loss']:.4f}")
    parts.append(f"{numbers.get('skipped_steps', 0)} skipped step(s)")
    return "Summary: " + ", ".join(parts) + "."


# ------------------------------------------------------------------------------------------------
# the end of a run
# ------------------------------------------------------------------------------------------------


class RunSummary:
    """What the run did, collected as it goes, and the paragraph printed at its end."""

    def __init__(self, metrics_path: Path, wandb_dir: Optional[Path] = None, wandb_run: Optional[str] = None):
        self.t_start = time.perf_counter()
        self.metrics_path, self.wandb_dir, self.wandb_run = Path(metrics_path), wandb_dir, wandb_run
        self.first: Optional[tuple] = None  # (step, loss) of the first and last step this process trained
        self.last: Optional[tuple] = None
        self.first_step_s: Optional[float] = None  # the first step's time, from training_started (compile included)
        self._t_train: Optional[float] = None
        self._first_step_recorded = False
        self.saved: List[Path] = []
        self.skipped = 0
        self.stop: Optional[str] = None  # the signal that stopped the run
        self.numbers: Dict[str, Any] = {}  # summary_metrics, once written
        self.summary_path: Optional[Path] = None
        self.resume_from: Optional[Path] = None  # stopped without a checkpoint of its own: where to continue from

    def training_started(self) -> None:
        """The training loop begins: the first step's time (``first_step_s``) counts from here."""
        self._t_train = time.perf_counter()

    def step(self, step: int, loss: float) -> bool:
        """A step trained. Returns True for this process's first (the optimizer state exists from then on)."""
        self.last = (step, loss)
        if self.first is not None:
            return False
        self.first = self.last
        self.first_step_s = time.perf_counter() - (self._t_train or self.t_start)
        return True

    def first_step_field(self) -> Dict[str, float]:
        """``{"first_step_s": ...}`` for the first metrics record this process writes, {} for the others: the
        summary's "first step" figure is read from that record (``summary_metrics``)."""
        if self._first_step_recorded or self.first_step_s is None:
            return {}
        self._first_step_recorded = True
        return {"first_step_s": self.first_step_s}

    def saved_checkpoint(self, folder: Path) -> None:
        self.saved = [p for p in self.saved if p != folder] + [folder]

    def finish(self, identity: Dict[str, Any], push=None) -> Dict[str, Any]:
        """The summary: ``summary_metrics`` of ``metrics.jsonl`` plus the run's identity, merged into
        ``summary.json`` beside it, after ``push`` (to the metric logger's summary; what it returns is added). Returns
        it. Each resume logs to a new wandb run (wandb_run_id, as run.json names it): the runs before it stay named,
        in ``wandb_earlier_run_ids``, oldest first."""
        self.numbers = summary_metrics(read_records(self.metrics_path))
        values = {**identity, **self.numbers}
        if push is not None:
            values.update(push(values))
        before = read_json(self.metrics_path.with_name(SUMMARY_FILE)) or {}
        earlier = list(before.get("wandb_earlier_run_ids") or [])
        if values.get("wandb_run_id") and before.get("wandb_run_id") not in (None, values["wandb_run_id"], *earlier):
            values["wandb_earlier_run_ids"] = earlier + [before["wandb_run_id"]]
        self.summary_path = update_summary(self.metrics_path.parent, values)
        return values

    def text(self) -> str:
        def fmt(s: float) -> str:
            return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"

        seconds = time.perf_counter() - self.t_start
        if self.first is None:
            parts = [f"Stopped before the first step ({fmt(seconds)})."]
        else:
            (first_step, first_loss), (last_step, last_loss) = self.first, self.last
            n = last_step - first_step + 1
            loss = f"; loss {first_loss:.4f} at step {first_step} -> {last_loss:.4f} at step {last_step}"
            how = f"stopped by {self.stop}" if self.stop else "done"
            parts = [
                f"Run {how}: trained steps {first_step}-{last_step} ({n} step{'s' * (n != 1)}) in {fmt(seconds)}"
                f"{loss}" + (f"; {self.skipped} non-finite step(s) skipped" if self.skipped else "") + "."
            ]
        sentence = summary_sentence(self.numbers)
        if sentence:
            parts.append(sentence[:-1] + f" ({self.summary_path}).")
        if self.metrics_path.is_file():
            parts.append(f"Metrics: {self.metrics_path}.")
        if self.saved:
            names = ", ".join(p.name for p in self.saved[:-1])
            parts.append(f"Checkpoints: {self.saved[-1]}" + (f" (latest; also {names})" if names else "") + ".")
        if self.wandb_dir is not None:
            about = [f"run {self.wandb_run}"] if self.wandb_run else []
            if self.wandb_dir.name.startswith("offline-"):  # (the eval's scores land beside it: sync the folder)
                about.append(f"upload with `wandb sync {self.wandb_dir.parent}`")
            parts.append(f"wandb: {self.wandb_dir}" + (f" ({'; '.join(about)})" if about else "") + ".")
        if self.resume_from is not None:
            parts.append(f"Continue with resume_from_checkpoint={self.resume_from}.")
        return " ".join(parts)


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    """The most recently published checkpoint folder of ``output_dir`` (step_* / epoch_* holding a recipe_state.pt;
    a folder appears only complete), or None."""
    output_dir = Path(output_dir)
    found = (
        [
            p
            for p in output_dir.iterdir()
            if p.is_dir() and p.name.startswith(CHECKPOINT_PREFIXES) and (p / "recipe_state.pt").is_file()
        ]
        if output_dir.is_dir()
        else []
    )
    return max(found, key=lambda p: p.stat().st_mtime_ns, default=None)


def interrupted(summary: Optional[RunSummary], output_dir: Optional[Path]) -> str:
    """What Ctrl-C prints (it stops at once, without a new checkpoint: SIGTERM is the signal that saves first)."""
    latest = latest_checkpoint(output_dir) if output_dir is not None else None
    if summary is None:
        text = "Stopped by Ctrl-C during setup: nothing was trained."
        return text + (f" Continue with resume_from_checkpoint={latest}." if latest is not None else "")
    summary.stop, summary.resume_from = "Ctrl-C", latest
    if latest is None:
        return summary.text() + " No checkpoint was written (save_every_n_steps=N writes them as the run goes)."
    return summary.text()
