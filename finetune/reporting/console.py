"""What a run tells its user on the terminal (log level, banner, ``--help``, known third-party noise, a bad-input
error under torchrun) and the figures its metrics records hold (step timing, memory, optimizer state). The records,
the summary and the metric logger are ``finetune/reporting/metrics.py`` and ``finetune/reporting/wandb_run.py``; the profiler ``_profiling.py``.

Nothing here changes training; both fine-tune recipes and the eval import it.
"""

import gc
import json
import logging
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from tqdm import tqdm

from finetune.host_memory import resident_bytes
from finetune.reporting.wandb_run import finish, push_summary

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------------------------------------
# the terminal
# ------------------------------------------------------------------------------------------------


class _DropMessage(logging.Filter):
    def __init__(self, *fragments: str):
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(f in message for f in self.fragments)


# Known third-party messages that say nothing to a user of these recipes, by the logger that emits them. Each is
# dropped by message, on that logger only, in the processes of our commands (their recipes and eval call this before
# importing the library); every other message of those libraries still shows.
#   torchao: its C++ extensions are built for another torch; nothing here uses them (they are CUDA/quantization ops).
#   bitsandbytes: an optional 4-bit CPU GEMM kernel from the hub; the 8-bit optimizers never use it.
#   lm-eval: we hand HFLM a loaded model on purpose (eval/harness.py), which is what the first two warn about; the
#     third, for any task that reads its data through a function (ours reads the local file, eval/truthfulqa.py),
#     points to a `--metadata` flag of lm-eval's own command, which our eval command does not have nor need.
KNOWN_NOISE = {
    "torchao": ("Skipping import of cpp extensions",),
    "bitsandbytes.backends.cpu.ops": ("pip install kernels",),
    "lm_eval.models.huggingface": (
        "`pretrained` model kwarg is not of type `str`",
        "Passed an already-initialized model through `pretrained`",
    ),
    "lm_eval.api.task": ("Custom kwargs can be passed to `--metadata`",),
}


def quiet_known_noise() -> None:
    """Drop the KNOWN_NOISE messages (a logging filter on each emitting logger; idempotent)."""
    for name, fragments in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropMessage) for f in logger.filters):
            logger.addFilter(_DropMessage(*fragments))


def set_log_level(log, cfg: DictConfig, show: bool = True) -> None:
    """``log_level``; at DEBUG the config is printed (torchtune's recipes print it always, 56 lines before any
    ``error:``). ``show=False`` (the distributed recipe's ranks other than 0): warnings only."""
    from finetune.base import BadInput

    level = str(cfg.get("log_level", "INFO")).upper()
    if level not in ("DEBUG", "INFO", "WARNING"):
        raise BadInput(
            f"log_level={cfg.get('log_level')!r} is not a level; use log_level=INFO (default), DEBUG (also "
            "prints the config) or WARNING"
        )
    log.setLevel(level if show else "WARNING")
    if not show and not any(isinstance(f, _AtLeast) for f in log.filters):
        # torchtune's logger is one logger shared by its modules, and several set it to DEBUG when imported
        # (metric_logging, checkpointing, ...), which the settings' checks of the config's components do after this
        # call. The other ranks' messages (torchtune's seed line, set before the process group exists, so that each
        # rank logged it as rank 0) then printed once per rank: a filter holds their floor whatever the level.
        log.addFilter(_AtLeast(logging.WARNING))
    log.debug("Config:\n" + OmegaConf.to_yaml(cfg))


class _AtLeast(logging.Filter):
    def __init__(self, level: int):
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level


def log_banner(log, recipe_path: str, output_dir: Path) -> None:
    """One line, once setup has passed every check, naming the recipe by its file: torchtune's own recipe of the
    same name (``tune run full_finetune_single_device``, no path) prints a "Running FullFinetuneRecipe..." dump."""
    log.info(f"Training with {recipe_path} (this repository's recipe; --help lists its config keys) into {output_dir}")


def epoch_label(epoch: int, total: int) -> str:
    """How an epoch is named in every message: by its checkpoint folder (0-based, as the ``epoch`` of the metrics
    records), with its place in the run: ``epoch_0 (1/2)``."""
    return f"epoch_{epoch} ({epoch + 1}/{total})"


def report_bad_input(e: BaseException, rank: int = 0) -> None:
    """The one ``error: ...`` line of a bad input, said once.

    Under torchrun (``TORCHELASTIC_ERROR_FILE`` set) every rank writes the line into its error file, in the format
    torch.distributed.elastic reads: torchrun's failure report then names it, and ``tune run`` prints it alone, last,
    with exit status 2, instead of that 30-line report (the launcher hook in finetune/tune_run.py). Every rank writes, so
    the line is there whichever rank the launcher sees fail first. Without torchrun, rank 0 prints it.
    """
    line = f"error: {e}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            Path(error_file).write_text(json.dumps(data))
            return
        except OSError:
            pass  # (then the terminal line below)
    if rank == 0:
        tqdm.write(line, file=sys.stderr)  # (on a line of its own, below any progress bar)


def stop_at_ctrl_c(recipe, closing: Callable[[], str], show: bool = True, settle: bool = True) -> None:
    """What a recipe does once Ctrl-C's KeyboardInterrupt reaches its ``recipe_main``, before it exits 130:

    1. ``settle``: a checkpoint being written in the background is a good one, so it is finished and published (a
       second Ctrl-C abandons it; the next start removes its temporary folder).
    2. ``show`` (rank 0), once a step was trained: summary.json and the wandb run's summary, as at the end of a run
       (the numbers of the steps trained, from metrics.jsonl).
    3. The metric logger is closed: wandb's run is finished now, recorded with exit code 130, and nothing is left to
       the interpreter's shutdown (finish there could wait forever: wandb_run.close_at_exit says why). A second
       Ctrl-C abandons that too.
    4. Progress bars are closed, then ``show``: ``closing()``, the run's summary and the checkpoint to continue from,
       printed last.
    """
    checkpointer = getattr(recipe, "_checkpointer", None)
    if settle and checkpointer is not None and checkpointer.pending:
        if show:
            tqdm.write("\nCtrl-C: finishing the checkpoint being written in the background (Ctrl-C again abandons it)")
        try:
            checkpointer.settle()
        except KeyboardInterrupt:
            pass
    logger, summary = getattr(recipe, "_logger", None), getattr(recipe, "_summary", None)
    if show and summary is not None and summary.first is not None:  # (before the first step: this run wrote nothing)
        try:
            summary.finish(recipe._identity, push=lambda values: push_summary(logger, values))
        except KeyboardInterrupt:  # (a second Ctrl-C: the closing lines still come)
            pass
    finish(logger, exit_code=130)
    for bar in list(getattr(tqdm, "_instances", ())):  # (else the epoch's bar, closed at exit, is drawn below them)
        bar.close()
    if show:
        tqdm.write("\n" + closing())


def exit_at_ctrl_c(recipe) -> None:
    """The recipe's exit after ``stop_at_ctrl_c``: the shell's 130 for SIGINT.

    Where a checkpoint's background job was abandoned (a second Ctrl-C, or a rank that does not wait for it), its
    daemon thread still runs, mostly inside torch's C++ code. The interpreter's shutdown stops such a thread where it next takes the
    GIL, inside a C++ call, and that aborts the process: "terminate called without an active exception", exit status
    -6 (SIGABRT), and a core file where the system writes them. So the process ends here instead, without that
    shutdown: the run's lock released (``recipe.release``) and the output flushed first; wandb is closed already, and
    the abandoned write's temporary folder is removed at the next start."""
    checkpointer = getattr(recipe, "_checkpointer", None)
    if checkpointer is None or not checkpointer.job_running:
        sys.exit(130)
    recipe.release()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(130)


# ------------------------------------------------------------------------------------------------
# --help
# ------------------------------------------------------------------------------------------------


def _flatten(node: Any, prefix: str = "") -> Iterable[tuple]:
    if OmegaConf.is_dict(node):
        for key in node.keys():
            yield from _flatten(node._get_node(key), f"{prefix}{key}.")
    else:
        value = node._value() if hasattr(node, "_value") else node
        if OmegaConf.is_list(node):
            value = OmegaConf.to_container(node, resolve=False)
        yield prefix[:-1], value


def manual(doc: str, page: Optional[str]) -> str:
    """A recipe's manual: its docs page (``docs/...md`` in the checkout) if there is one, then the docstring's key
    index. Without the page (an installed wheel) the docstring alone."""
    path = REPO_ROOT / page if page else None
    if path is not None and path.is_file():
        return path.read_text().rstrip() + "\n\n" + doc.strip()
    return doc.strip()


def config_path_of(argv: List[str]) -> Optional[str]:
    """The ``--config FILE`` (or ``--config=FILE``) of a command line, or None."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def recipe_help(doc: str, argv: List[str], known_keys: Iterable[str], page: Optional[str] = None) -> Optional[str]:
    """``--help`` / ``-h`` on a recipe's command line: the docstring's key index (each feature and the key behind
    it), where the manual is, and every config key with its value in the ``--config`` file; ``--help=all``: the whole
    manual (the docs page, some 600 lines) in place of the index. None when not asked for help. The recipe prints it
    and exits 0."""
    args = argv[1:]
    full = "--help=all" in args
    if not (full or "--help" in args or "-h" in args):
        return None
    path = REPO_ROOT / page if page else None
    if full:
        lines = [manual(doc, page), ""]
    else:
        lines = [doc.strip(), ""]
        if path is not None and path.is_file():
            lines += [f"The manual: {path} (--help=all prints it here).", ""]
    config_path = config_path_of(args)
    if config_path is None:
        lines.append("Give --config FILE (e.g. configs/tiny.yaml) with --help to list that config's keys and values.")
    elif not Path(config_path).is_file():
        lines.append(f"--config {config_path}: no such file (the configs are in configs/, e.g. configs/tiny.yaml)")
    else:
        cfg = OmegaConf.load(config_path)
        lines.append(f"Config keys and their values in {config_path} (override with key=value, delete with ~key):")
        items = list(_flatten(cfg))
        width = min(max(len(k) for k, _ in items), 40)
        yaml = {None: "null", True: "true", False: "false"}
        lines += [f"  {k:<{width}}  {yaml.get(v, v) if isinstance(v, (bool, type(None))) else v}" for k, v in items]
        unset = [k for k in sorted(set(known_keys)) if k not in cfg]
        if unset:
            lines += [
                "",
                "Also read by this recipe, not set in this config (their defaults are in the manual):",
                "  " + ", ".join(unset),
            ]
    return "\n".join(lines)


def print_help_if_asked(doc: str, known_keys: Iterable[str], page: Optional[str] = None) -> None:
    """A recipe's ``__main__``: on ``--help`` / ``-h`` / ``--help=all``, print recipe_help's text and exit 0."""
    text = recipe_help(doc, sys.argv, known_keys, page)
    if text is not None:
        print(text)
        sys.exit(0)


# ------------------------------------------------------------------------------------------------
# figures: step time, memory, optimizer state, compiled graphs
# ------------------------------------------------------------------------------------------------


class StepTimer:
    """Milliseconds of the work queued between ``start`` and ``stop``.

    On a GPU it records CUDA events; ``ms`` waits for the end event (the recipe reads it on log steps only: the step's
    one host sync, the loss and grad-norm check, comes before ``optimizer.step()``, so a log step also waits for the
    step's end, as every step did before that check). On the CPU it is the wall clock.
    """

    def __init__(self, device: torch.device):
        self._cuda = device.type == "cuda"
        if self._cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def start(self) -> "StepTimer":
        if self._cuda:
            self._start.record()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> None:
        if self._cuda:
            self._end.record()
        self._t1 = time.perf_counter()

    def ms(self) -> float:
        if self._cuda:
            self._end.synchronize()
            return self._start.elapsed_time(self._end)
        return (self._t1 - self._t0) * 1000


class CollectorTime:
    """Milliseconds Python's garbage collector ran since the last ``take()`` (every generation), and how many of
    those collections were full ones (generation 2).

    A full collection walks every tracked object: the model's modules, the compiled graphs, the data's records. On
    a 7-8B run it can stall the host thread feeding the GPU for a noticeable share of a step, so each step's record
    carries ``gc_ms`` and ``gc_full``: a slow step that shows them explains itself. Reading them costs a clock
    read per collection."""

    def __init__(self):
        self._start: Optional[float] = None
        self._ms, self._full = 0.0, 0
        gc.callbacks.append(self._on_collection)

    def _on_collection(self, phase: str, info: Dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self._ms += (time.perf_counter() - self._start) * 1000
            self._full += info.get("generation") == 2
            self._start = None

    def take(self) -> Dict[str, float]:
        out = {"gc_ms": self._ms, "gc_full": self._full}
        self._ms, self._full = 0.0, 0
        return out

    def close(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)


def host_memory_gib() -> Dict[str, float]:
    """The process's host memory: ``host_rss_gib`` now and ``peak_rss_gib`` at its peak (resident pages, pinned
    ones included: the optimizer states, streamed weights and staging buffers a small-card run keeps in host memory).
    Where /proc is missing (not Linux), the peak alone, from getrusage."""
    now, peak = resident_bytes(), resident_bytes(peak=True)
    if now is None or peak is None:
        return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # ru_maxrss is KiB
    return {"host_rss_gib": now / 2**30, "peak_rss_gib": peak / 2**30}


def memory_metrics(device: torch.device) -> Dict[str, float]:
    """Peak allocated and reserved GiB on a GPU; the process's host memory, now and at its peak, on either.

    On a GPU also ``alloc_retries``: how often so far the caching allocator found no room under the card (or under
    ``device_memory_limit_gib``), gave its cached blocks back and tried again. Each retry waits for the GPU to finish
    its queued work, so a count that grows step after step means the cap is too tight for the config's speed."""
    out = host_memory_gib()
    if device.type == "cuda":
        out["peak_memory_alloc_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        out["alloc_retries"] = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        pool = pinned_pool_gib()
        if pool is not None:
            out["pinned_pool_gib"] = pool
    return out


def pinned_pool_gib() -> Optional[float]:
    """Host memory torch's pinned allocator holds, in use or cached for reuse (each block rounded up to a power of
    two): activation offloading's buffers, torch.save's device-to-host copies, the small state slots' chunks. A
    cached block stays the process's until it ends, so a figure that rises at a save and stays shows host memory a
    save leaves behind. (Not the streamed weights' and states' exact regions: those are pinned in place, outside it.)
    None where torch keeps no such statistics."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    try:
        held = stats().get("allocated_bytes.current") if stats is not None else None
    except RuntimeError:  # (no CUDA runtime)
        return None
    return None if held is None else held / 2**30


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor reachable from ``optimizer.state``.

    Counts each storage once (states that are views into one flat buffer count the buffer once) and looks inside
    tensor subclasses such as torchao's quantized states (their inner tensors from ``__tensor_flatten__``).
    """
    seen = set()
    total = 0

    def visit(obj: Any) -> None:
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if is_traceable_wrapper_subclass(obj):
                names, _ = obj.__tensor_flatten__()
                for name in names:
                    visit(getattr(obj, name))
                return
            storage = obj.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes(), str(obj.device))
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
        elif isinstance(obj, dict):
            for v in obj.values():
                visit(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                visit(v)

    def inner(opt):
        # Wrappers without their own state (torchao's CPUOffloadOptimizer: one CPU optimizer per parameter, plus
        # an on-device one for small tensors) count their inner optimizers' states, wherever those live.
        if hasattr(opt, "optim_dict"):
            return list(opt.optim_dict.values()) + ([opt.d_opt] if getattr(opt, "d_opt", None) is not None else [])
        return [opt]

    for opt in optimizers:
        for o in inner(opt):
            visit(dict(o.state))
    return total


def checkpoint_bytes(model_sd: Dict[str, torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """About what one checkpoint takes on disk: the weights plus the optimizer state."""
    weights = sum(v.numel() * v.element_size() for v in model_sd.values() if isinstance(v, torch.Tensor))
    return weights + optimizer_state_bytes(optimizers)


def nonfinite_elements(optimizers: Iterable[torch.optim.Optimizer]) -> Optional[int]:
    """Our optimizers' count of non-finite gradient elements they skipped (None for other optimizers)."""
    counts = [o.nonfinite_count for o in optimizers if getattr(o, "nonfinite_count", None) is not None]
    return int(sum(int(c.sum()) for c in counts)) if counts else None


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process. Logged with compile=True: a number still growing after the
    first steps means recompiles (``TORCH_LOGS=recompiles`` says why)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
