"""Checkpoints: what a step_N / epoch_E folder holds and how it is written (``finetune/checkpoint/resume.py``: how a run continues from
one).

A checkpoint is a Hugging Face model folder (``finetune/checkpoint/hf_format.py``: config.json, model.safetensors, the tokenizer) plus
the resume state: ``recipe_state.pt`` (progress, optimizer state, lr schedule, RNG, the run's settings) and, from the
distributed recipe, one ``recipe_state_rank{r}.pt`` per rank, each with its checksum beside it (``{name}.crc32``:
``finetune/checkpoint/state_file.py``, computed as the file is written); with a wandb logger, ``run.json`` names the run that
wrote it (``Checkpointer.run_info``). It is published whole or not at all through the run
folder (``finetune/checkpoint/run_folder.py``: temporary folder, fsync, atomic rename, ``.old-*`` recovery, one-line full-disk errors).

The calls a recipe makes:

- ``Checkpointer(folder, family, hf, tokenizer_path, background=...)``: ``save(name, weights=..., recipe_state=...,
  rank_state=...)``; with ``background=True`` (async_checkpoint, ``_async_save``) also ``prepare`` after the first
  step, ``poll`` at every step boundary, ``wait`` at the end (``settle`` on an error), ``metrics`` for the records
- reading one back to continue: ``finetune/checkpoint/resume.py`` (``read_resume``, the resume table)
- ``check_finite_weights(state, ...)`` before a save; ``rng_state`` / ``set_rng_state`` for exact resume
"""

import contextlib
import functools
import json
import random
import resource
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import numpy as np
import torch
from tqdm import tqdm

from finetune.base import NonFiniteStop, diverged_fix
from finetune.checkpoint import async_save, hf_format, state_file
from finetune.checkpoint.run_folder import RunFolder, ctrl_c_after, fsync_path
from finetune.run_files import RUN_FILE

RECIPE_STATE_FILE = "recipe_state.pt"
RANK_STATE_FILE = "recipe_state_rank{rank}.pt"
# A background save on a GPU takes spare GPU memory, sized from the peak the process's steps have reached by then. A
# compiled run's first steps peak lower than its steady ones (under a 24 GB card's cap: 17.6 GiB at step 1, 20.7 from
# step 3 on), so a save before its STEADY_STEP-th step is written synchronously: sized from those steps, its copy took
# the memory a later step needed (out of memory). Counted per process: a resumed run compiles again.
STEADY_STEP = 3


def check_finite_weights(
    state: Dict[str, torch.Tensor], final: Path, step: int, resumed_from: Optional[Path] = None
) -> None:
    """Refuse to write a checkpoint whose weights hold a NaN or inf: one reduction and one sync per device the
    weights live on (a model with streamed layers holds some in host memory and the rest on the GPU).
    ``resumed_from``: the checkpoint the run resumed from, where it has written none since (``diverged_fix``)."""
    by_device: Dict[torch.device, List[str]] = {}
    for k, v in state.items():
        by_device.setdefault(v.device, []).append(k)
    finite: Dict[str, bool] = {}
    for keys in by_device.values():
        finite.update(zip(keys, torch.stack([torch.isfinite(state[k]).all() for k in keys]).tolist()))
    bad = [k for k in state if not finite[k]]
    if bad:
        raise NonFiniteStop(
            f"the weights at step {step} are not finite ({', '.join(bad[:3])}): refused to write "
            f"{final}; {diverged_fix(resumed_from)}"
        )


def rng_state(cuda_device: Optional[torch.device] = None, all_cuda: bool = False) -> Dict[str, Any]:
    """The RNG states in types that ``weights_only`` loading accepts (numpy's key array stored as a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = None
    if cuda_device is not None and cuda_device.type == "cuda":
        cuda = torch.cuda.get_rng_state_all() if all_cuda else torch.cuda.get_rng_state(cuda_device)
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "cuda": cuda,
    }


def set_rng_state(rng: Dict[str, Any]) -> None:
    """Restore torch, python and numpy RNG from ``rng_state``'s dict (cuda is left to the caller)."""
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    name, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def _split(parts: dict, now: tuple) -> tuple:
    """``parts`` as (what the snapshot copies, what is written before training goes on): the names in ``now`` go to
    the second, the rest to the first; each leaves None where the other has a part."""
    return (
        {k: None if k in now else v for k, v in parts.items()},
        {k: v if k in now else None for k, v in parts.items()},
    )


class _InFlight:
    """The checkpoint a background job is writing: where, since when, and what training paid for it."""

    def __init__(self, name: str, tmp: Path, started: float, blocked: float, need_bytes: Callable[[], int]):
        self.name, self.tmp, self.started, self.blocked, self.need_bytes = name, tmp, started, blocked, need_bytes


def write_run_file(folder: Path, run_info: Optional[dict], recipe_state: dict) -> None:
    """``run.json``: the run that wrote the checkpoint (its identity and wandb run: finetune.run_files) with the
    checkpoint's global step, so the eval can add its scores to that run. Nothing without a run to name."""
    if run_info is not None:
        run = {**run_info, "global_step": recipe_state.get("global_step")}
        (folder / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")


def announce_saved(final: Path, started: float, background: Optional[tuple] = None) -> None:
    """The line that reports a checkpoint in place: its folder, size on disk and the time since its save began
    (bench/pipeline.py reads it); ``background=(write_s, blocked_s)`` for one written in the background (its writer's
    time, and what training waited; bench/checkpoint_save.py reads them)."""
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    line = f"Saved checkpoint {final} ({size / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s)"
    if background is not None:
        line += f"; written in the background ({background[0]:.1f} s), training blocked {background[1]:.2f} s"
    tqdm.write(line)


class Checkpointer:
    """Writes step_N / epoch_E folders into a claimed run folder, in one model family's HF format.

    Synchronous (``background=False``): ``save`` writes and publishes the folder before it returns. In the background
    (``async_checkpoint=True``, ``_async_save``): ``save`` copies the checkpoint's tensors into staging buffers and
    returns; a thread writes them into the temporary folder, and ``poll`` (every step boundary) or ``wait`` (before
    the next save, at the end) publishes it once every rank has written its part, or raises the write's error. At
    most one save is in flight. Both produce the same files.
    """

    def __init__(
        self,
        folder: RunFolder,
        family: hf_format.Family,
        hf: dict,
        tokenizer_path: Path,
        *,
        background: bool = False,
        device: Any = "cpu",
        memory_limit_gib: Optional[float] = None,
        host_limit_gib: Optional[float] = None,
        on_saved: Optional[Callable[[Path], None]] = None,
        log=None,
    ):
        self.folder, self.family, self.hf, self.tokenizer_path = folder, family, hf, Path(tokenizer_path)
        # The run that writes the checkpoints (its identity and wandb run: finetune.run_files), written into
        # each as run.json with the checkpoint's global step, so the eval can add its scores to that run.
        self.run_info: Optional[dict] = None
        self.background = background
        self._device = torch.device(device)
        if self._device.type == "cuda" and self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self._staging = (
            async_save.Staging(self._device, memory_limit_gib, host_limit_gib=host_limit_gib) if background else None
        )
        self._on_saved, self._log = on_saved, log
        self._job: Optional[async_save.Job] = None  # the background job: a staging allocation, or a write
        self._inflight: Optional[_InFlight] = None  # the save that job writes
        self._writes: List[async_save.Job] = []  # recent writes, to tell which steps ran beside one
        self._record: Dict[str, Any] = {}  # figures for the next metrics record
        self._stream, self._bounce, self._told = None, None, False
        self._steps = 0  # step boundaries this process has passed (``poll``)
        self._told_early = False

    # -- saving ------------------------------------------------------------------------------------

    def save(
        self,
        name: str,
        *,
        weights: Optional[Dict[str, Any]],
        recipe_state: Optional[dict],
        need_bytes: Callable[[], int],
        rank_state: Optional[dict] = None,
        started: Optional[float] = None,
    ) -> None:
        """``{output_dir}/{name}/``: rank 0 writes the HF folder from ``weights`` (full, torchtune names) and
        ``recipe_state``; with ``rank_state`` every rank also writes ``recipe_state_rank{r}.pt``. The parts may hold
        ``async_save.Gather`` (a weight gathered from the ranks' shards) and ``async_save.Owned`` (a private copy)
        leaves. Prints the "Saved checkpoint" line once the folder is in place; ``started``: when the recipe began
        the save (the time since is what training was blocked)."""
        started = time.perf_counter() if started is None else started
        parts = {"weights": weights, "recipe_state": recipe_state, "rank_state": rank_state}
        if self.background:
            self.wait()  # at most one save in flight: the previous one is published (or fails) first
            if self._device.type == "cuda" and self._steps < STEADY_STEP:
                if self._log is not None and not self._told_early:
                    self._log.info(
                        f"async_checkpoint=True: {name} is written before training goes on: a background save's "
                        f"share of GPU memory is sized from the steps' peak, which this process's steps reach from "
                        f"step {STEADY_STEP} on (torch.compile's first steps peak lower); later saves are written in "
                        "the background"
                    )
                    self._told_early = True
            else:
                self._staging.settle()  # (the GPU's share from the steps' peak so far, not the first step's)
                layout, now = self._plan(parts)
                if layout is not None and self._start(name, parts, layout, need_bytes, started, now):
                    return
        self._save_now(name, async_save.materialize(parts), need_bytes, started)

    def _write_now(self, tmp: Path, parts: dict) -> None:
        """This rank's files of ``parts`` (a part that is None is not written), on the calling thread."""
        ranks = self.folder.ranks
        if parts["rank_state"] is not None:
            state_file.save(parts["rank_state"], tmp / RANK_STATE_FILE.format(rank=ranks.rank))
        if ranks.main:
            if parts["weights"] is not None:
                weights = parts["weights"]
                hf_format.write_folder(
                    tmp, weights, self.hf, self.family, self.tokenizer_path, self._bounce_for(weights)
                )
            if parts["recipe_state"] is not None:
                state_file.save(parts["recipe_state"], tmp / RECIPE_STATE_FILE)
                write_run_file(tmp, self.run_info, parts["recipe_state"])

    def _save_now(self, name: str, parts: dict, need_bytes: Callable[[], int], started: float) -> None:
        ranks = self.folder.ranks
        final = self.folder.publish(name, lambda tmp: self._write_now(tmp, parts), need_bytes)
        seconds = time.perf_counter() - started
        if ranks.main:
            announce_saved(final, started)
        self._note(checkpoint_saved=name, checkpoint_blocked_s=seconds, checkpoint_write_s=seconds)
        if self._on_saved is not None:
            self._on_saved(final)

    def _plan(self, parts: dict) -> tuple:
        """Where this save's snapshot goes, and the parts to write before training goes on: the whole checkpoint
        staged, where every rank's host has the memory. In one process whose host has not, the larger of the
        checkpoint's two files (model.safetensors, recipe_state.pt) whose copy fits is staged, and the other written
        first from the live tensors: training waits for that file, not for both. (None, ()) where nothing fits: the
        save is synchronous."""
        layout = self._staging.plan(parts)
        if all(self.folder.ranks.gather(layout is not None)):
            return layout, ()
        if self.folder.ranks.world == 1:
            best, best_bytes = (None, ()), 0
            for now in (("weights",), ("recipe_state",)):
                part = self._staging.plan(_split(parts, now)[0])
                if part is not None and part.host_bytes + part.gpu_bytes > best_bytes:
                    best, best_bytes = (part, now), part.host_bytes + part.gpu_bytes
            if best[0] is not None:
                return best
        if self._log is not None and not self._told:
            limit = self._staging.host_limit
            if limit is not None:  # (a config's choice for a small machine: said, not warned)
                self._log.info(
                    f"async_checkpoint=True: no file of the checkpoint has room for its copy under "
                    f"host_memory_limit_gib={limit / 2**30:g} beside the run's own host memory, so checkpoints are "
                    "written synchronously (from where the tensors live, no copy); where the machine has the memory, "
                    "a larger host_memory_limit_gib writes them in the background"
                )
            else:
                self._log.warning(
                    "async_checkpoint=True: this host has not the memory to hold a snapshot of the checkpoint while "
                    "it is written (it would pin the part that does not fit in spare GPU memory), so checkpoints are "
                    "written synchronously and training waits for each; free host memory, or set "
                    "async_checkpoint=False"
                )
            self._told = True
        return None, ()

    def _start(
        self,
        name: str,
        parts: dict,
        layout: "async_save.Layout",
        need_bytes: Callable[[], int],
        started: float,
        now: tuple = (),
    ) -> bool:
        """Take the snapshot and start its writer; False where the GPU had not the memory after all (one process:
        the save is then synchronous, and later ones keep their snapshots in host memory). ``now``: the parts left
        out of the snapshot, written here first (training waits for them)."""
        staged, written_now = _split(parts, now)
        try:
            snap, ready = self._staging.snapshot(staged, layout)
        except torch.cuda.OutOfMemoryError:
            if self.folder.ranks.world > 1:
                raise
            self._staging.no_gpu()
            return False
        # From the temporary folder to the writer's start, a Ctrl-C takes effect after: the writer is then started
        # and known (pending), so the Ctrl-C path finishes and publishes it. Raised in between, it left a writer
        # thread nobody waited for, which the interpreter's exit then killed inside native code (abort, status -6).
        with ctrl_c_after() if self.folder.ranks.world == 1 else contextlib.nullcontext():
            tmp = self.folder.begin(name)
            if now:
                try:
                    self._write_now(tmp, async_save.materialize(written_now))
                except Exception as e:  # one line, the previous checkpoint kept: as a synchronous save's failure
                    self.folder.commit(name, tmp, e, need_bytes)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
            blocked = time.perf_counter() - started
            self._inflight = _InFlight(name, tmp, started, blocked, need_bytes)
            self._job = async_save.Job(functools.partial(self._write, tmp, snap, ready), "checkpoint-writer")
        self._writes = self._writes[-3:] + [self._job]  # (ranks that never log keep only the last few)
        self._note(
            checkpoint_blocked_s=blocked,
            checkpoint_staged_gpu_gib=layout.gpu_bytes / 2**30,
            checkpoint_staged_host_gib=layout.host_bytes / 2**30,
            host_pinned_gib=self._staging.pinned_bytes / 2**30,
        )
        if self._log is not None and not self._told:
            where = [
                f"{b / 2**30:.2f} GiB {what}"
                for b, what in (
                    (layout.gpu_bytes, "in spare GPU memory, freed once written"),
                    (
                        layout.host_bytes,
                        f"in host memory, {'pinned and ' if self._staging.pinned_bytes else ''}"
                        + ("given back once written" if self._staging.transient else "kept for the run"),
                    ),
                )
                if b
            ]
            if now:
                files = {"weights": hf_format.WEIGHTS_FILE, "recipe_state": RECIPE_STATE_FILE}
                self._log.warning(
                    f"async_checkpoint=True: this host has the memory to copy only part of the checkpoint, so each "
                    f"save writes {files[now[0]]} before training goes on and the rest ({' and '.join(where)}) in "
                    f"the background; training was blocked {blocked:.2f} s for {name}"
                )
            else:
                self._log.info(
                    f"async_checkpoint=True: each save copies the checkpoint's tensors "
                    f"({' and '.join(where)}; training was blocked {blocked:.2f} s for {name}) and writes "
                    "them in the background"
                )
            self._told = True
        return True

    def _write(self, tmp: Path, snap: dict, ready) -> None:
        """The writer thread: this rank's files of the checkpoint, from the snapshot, each fsynced (rank 0 renames
        the folder into place on its main thread, after every rank has written: ``commit``)."""
        ranks = self.folder.ranks
        own = RANK_STATE_FILE.format(rank=ranks.rank)
        with self._writer_stream(ready):
            if snap["rank_state"] is not None:
                state_file.save(snap["rank_state"], tmp / own, async_save.pinned_torch_save)
            weights = snap["weights"] if ranks.main else None
            if weights is not None:  # (None: written before training went on, ``_start``'s ``now``)
                hf_format.write_folder(
                    tmp, weights, self.hf, self.family, self.tokenizer_path, self._bounce_for(weights)
                )
            if ranks.main and snap["recipe_state"] is not None:
                state_file.save(snap["recipe_state"], tmp / RECIPE_STATE_FILE, async_save.pinned_torch_save)
                write_run_file(tmp, self.run_info, snap["recipe_state"])
        for f in tmp.iterdir():  # the flush to disk happens here, not on the training thread
            if f.name.startswith(own) or (ranks.main and not f.name.startswith("recipe_state_rank")):  # (+ .crc32)
                fsync_path(f)

    def _bounce_for(self, weights: Dict[str, Any]) -> Optional[torch.Tensor]:
        """The pinned buffer that weights held on the GPU are written through (made at the first such save), or None
        where every weight is in host memory."""
        if self._bounce is None and any(t.is_cuda for t in weights.values()):
            self._bounce = torch.empty(async_save.BOUNCE_BYTES, dtype=torch.uint8, pin_memory=True)
        return self._bounce

    @contextlib.contextmanager
    def _writer_stream(self, ready):
        """On a GPU: the writer's copies run on a stream of their own, after the snapshot's (``ready``), so they
        overlap the training stream's work instead of queueing behind it."""
        if ready is None:
            yield
            return
        torch.cuda.set_device(self._device)  # (the current device is per thread)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self._device)
        self._stream.wait_event(ready)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:  # its copies are done before the snapshot's GPU memory goes back to the training stream
            self._stream.synchronize()

    # -- the save in flight --------------------------------------------------------------------------

    def prepare(
        self, *, weights: Optional[Dict[str, Any]], recipe_state: Optional[dict], rank_state: Optional[dict] = None
    ) -> None:
        """Plan the staging for checkpoints shaped like these parts and allocate its host buffer on a background
        thread (pinning ~20 GB takes ~2 s, better not inside the first save). Call it once, after the first optimizer
        step (the optimizer state exists by then); every rank calls it."""
        if not self.background or self._job is not None or self._staging.transient:
            return  # (under a host memory limit each save allocates its buffer and gives it back once written)
        layout, _ = self._plan({"weights": weights, "recipe_state": recipe_state, "rank_state": rank_state})
        if layout is not None:
            self._job = async_save.Job(functools.partial(self._staging.allocate, layout), "checkpoint-staging")

    @property
    def pending(self) -> bool:
        """A checkpoint written in the background is not published yet (still being written, or written)."""
        return self._inflight is not None

    @property
    def writing(self) -> bool:
        """This rank's writer is still writing the checkpoint in flight."""
        return self._inflight is not None and not self._job.done

    @property
    def job_running(self) -> bool:
        """A background job of this checkpointer (a write, or a staging buffer's allocation) still runs on its
        thread: one a Ctrl-C abandoned, since every wait joins the thread."""
        return self._job is not None and self._job.alive

    def poll(self, all_written: Optional[bool] = None) -> None:
        """At a step boundary (every one: the process's steps are counted here, for STEADY_STEP): publish the
        checkpoint in flight if every rank has written its part, or raise the error of a write that failed.
        ``all_written``: the ranks' agreement (the distributed recipe folds ``writing`` into its step's all-reduce);
        left out, this process's own writer decides."""
        self._steps += 1
        if self._inflight is None:
            return
        if self._job.done if all_written is None else all_written:
            self._complete()

    def wait(self) -> None:
        """Until the background job is over, publishing the checkpoint it wrote (or raising its error). Every rank
        calls it at the same point: before a save, and at the end of training."""
        if self._job is None:
            return
        self._job.join()
        if self._inflight is not None:
            self._complete()
            return
        job, self._job = self._job, None  # a staging allocation: if it failed, the save allocates again
        if job.error is not None and self._log is not None:
            self._log.warning(
                f"could not allocate the checkpoint staging buffer in the background ({job.error!r}); "
                "the next save allocates it"
            )

    def settle(self) -> None:
        """Training stopped on an error: let the checkpoint in flight be published (it is a good one), reporting a
        failed write as a warning, since the error that stopped training is the one to show."""
        try:
            self.wait()
        except Exception as e:
            if self._log is not None:
                self._log.warning(f"the checkpoint being written in the background was lost too: {e}")

    def _complete(self) -> None:
        f, job = self._inflight, self._job
        job.join()
        error = job.error if job.error is None or isinstance(job.error, Exception) else RuntimeError(repr(job.error))
        # In place, announced and no longer in flight, or none of these: a Ctrl-C meanwhile takes effect after (one
        # process; ranks, which Ctrl-C stops each at once, must not wait in the commit's collectives for one another).
        with ctrl_c_after() if self.folder.ranks.world == 1 else contextlib.nullcontext():
            try:
                final = self.folder.commit(f.name, f.tmp, error, f.need_bytes)
            finally:
                self._inflight = self._job = None  # (a failed write is raised once, not again at the next wait)
            write_s = job.ended - job.started
            if self._staging.transient:
                self._staging.release()
            if self.folder.ranks.main:
                announce_saved(final, f.started, background=(write_s, f.blocked))
            self._note(checkpoint_saved=f.name, checkpoint_write_s=write_s)
            if self._on_saved is not None:
                self._on_saved(final)

    # -- figures ---------------------------------------------------------------------------------------

    def _note(self, **fields) -> None:
        blocked = self._record.get("checkpoint_blocked_s", 0.0)
        self._record.update(fields)
        if "checkpoint_blocked_s" in fields:  # (a save that waited for the previous one: both count)
            self._record["checkpoint_blocked_s"] = blocked + fields["checkpoint_blocked_s"]

    def metrics(self, since: float) -> Dict[str, Any]:
        """The checkpoint figures for the metrics record of a step that began at ``since`` (perf_counter): what the
        saves since the last record cost (``checkpoint_blocked_s``: training waited; ``checkpoint_write_s``: the
        write of ``checkpoint_saved``; where its snapshot was held), and ``checkpoint_writing: True`` when a
        background write ran during the step."""
        out, self._record = self._record, {}
        if out:
            out["peak_host_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        self._writes = [j for j in self._writes if not j.done or j.ended > since]
        if self._writes:
            out["checkpoint_writing"] = True
        return out

    def close(self) -> None:
        """The end of the run: give the staging buffer back (after an allocation still running; a write still
        running, after an interrupt, keeps the memory it reads until it dies with the process)."""
        if self._job is not None and self._inflight is None:
            self._job.join()
        if self._staging is not None:
            self._staging.release()
