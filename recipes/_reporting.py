"""What a run tells its user: the terminal (log level, banner, ``--help``, known third-party noise), the metrics
(``metrics.jsonl``, the metric logger, step timing, memory and optimizer-state figures) and the end-of-run summary.

Nothing here changes training; both fine-tune recipes and the eval import it.
"""

import json
import logging
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from tqdm import tqdm

from recipes._run_folder import METRICS_FILE, tag

REPO_ROOT = Path(__file__).resolve().parents[1]


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
#   lm-eval: we hand HFLM a loaded model on purpose (eval/harness.py), which is what this warns about.
KNOWN_NOISE = {
    "torchao": ("Skipping import of cpp extensions",),
    "bitsandbytes.backends.cpu.ops": ("pip install kernels",),
    "lm_eval.models.huggingface": ("`pretrained` model kwarg is not of type `str`",),
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
    from finetune_base import BadInput

    level = str(cfg.get("log_level", "INFO")).upper()
    if level not in ("DEBUG", "INFO", "WARNING"):
        raise BadInput(f"log_level={cfg.get('log_level')!r} is not a level; use log_level=INFO (default), DEBUG (also "
                       "prints the config) or WARNING")
    log.setLevel(level if show else "WARNING")
    log.debug("Config:\n" + OmegaConf.to_yaml(cfg))


def log_banner(log, recipe_path: str, output_dir: Path) -> None:
    """One line, once setup has passed every check, naming the recipe by its file: torchtune's own recipe of the
    same name (``tune run full_finetune_single_device``, no path) prints a "Running FullFinetuneRecipe..." dump."""
    log.info(f"Training with {recipe_path} (this repository's recipe; --help lists its config keys) into {output_dir}")


def epoch_label(epoch: int, total: int) -> str:
    """How an epoch is named in every message: by its checkpoint folder (0-based, as the ``epoch`` of the metrics
    records), with its place in the run: ``epoch_0 (1/2)``."""
    return f"epoch_{epoch} ({epoch + 1}/{total})"


def announce_saved(final: Path, started: float, background: Optional[tuple] = None) -> None:
    """The line that reports a checkpoint in place: its folder, size on disk and the time since its save began
    (bench/pipeline.py reads it); ``background=(write_s, blocked_s)`` for one written in the background (its writer's
    time, and what training waited; bench/checkpoint_save.py reads them)."""
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    line = f"Saved checkpoint {final} ({size / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s)"
    if background is not None:
        line += f"; written in the background ({background[0]:.1f} s), training blocked {background[1]:.2f} s"
    tqdm.write(line)


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


def recipe_help(doc: str, argv: List[str], known_keys: Iterable[str], page: Optional[str] = None) -> Optional[str]:
    """``--help`` / ``-h`` on a recipe's command line: its manual and every config key with its value in the
    ``--config`` file; None when not asked for help. The recipe prints it and exits 0."""
    args = argv[1:]
    if not ("--help" in args or "-h" in args):
        return None
    lines = [manual(doc, page), ""]
    config_path = None
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            config_path = args[i + 1]
        elif a.startswith("--config="):
            config_path = a.split("=", 1)[1]
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
            lines += ["", "Also read by this recipe, not set in this config (their defaults are in the manual above):",
                      "  " + ", ".join(unset)]
    return "\n".join(lines)


def print_help_if_asked(doc: str, known_keys: Iterable[str], page: Optional[str] = None) -> None:
    """A recipe's ``__main__``: on ``--help`` / ``-h``, print recipe_help's manual and exit 0."""
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


def memory_metrics(device: torch.device) -> Dict[str, float]:
    """Peak allocated and reserved GiB on a GPU; the process's peak resident set on the CPU."""
    if device.type == "cuda":
        return {
            "peak_memory_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
            "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
        }
    return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # ru_maxrss is KiB


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


# ------------------------------------------------------------------------------------------------
# metrics: metrics.jsonl, the metric logger
# ------------------------------------------------------------------------------------------------


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


def log_config(logger, cfg: DictConfig) -> Optional[Path]:
    """The run's config to the metric logger; for wandb, returns the run's folder.

    torchtune's WandBLogger.log_config writes ``{output_dir}/torchtune_config.yaml`` and ``wandb.save``s it, which
    puts an absolute symlink to it into the run's files/ (and warns "Symlinked 1 file"): a later run into the same
    folder overwrites what that link shows. Here the run's folder gets a copy of its own config instead.
    """
    if type(logger).__name__ != "WandBLogger":
        logger.log_config(cfg)
        return None
    import wandb

    if wandb.run is None:
        return None
    resolved = OmegaConf.to_container(cfg, resolve=True)
    wandb.run.config.update(resolved, allow_val_change=logger.config_allow_val_change)
    # Files in the run's files/ folder are uploaded with the run (at its end, or by `wandb sync`).
    (Path(wandb.run.dir) / "torchtune_config.yaml").write_text(OmegaConf.to_yaml(resolved))
    return Path(wandb.run.dir).parent


def metric_logger(cfg: DictConfig, log):
    """``metric_logger`` built (None when off: ``metric_logger=null`` on the CLI sets only its _component_ to null),
    and the wandb run folder if it is wandb. Without WANDB_API_KEY (and no ``mode``), wandb logs offline."""
    from torchtune import config

    cfg_logger = cfg.get("metric_logger")
    if cfg_logger is None or not cfg_logger.get("_component_"):
        return None, None
    cfg_logger = OmegaConf.create(OmegaConf.to_container(cfg_logger, resolve=True))
    if cfg_logger._component_.endswith("WandBLogger") and "mode" not in cfg_logger:
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            # No key: log offline into {log_dir}/wandb/offline-run-*; `wandb sync DIR` uploads it later.
            cfg_logger.mode = "offline"
            log.info("wandb: no WANDB_API_KEY, logging offline (upload later with `wandb sync`)")
    logger = config.instantiate(cfg_logger)
    return logger, log_config(logger, cfg)


class MetricsLog:
    """One record per log step to the terminal, ``{output_dir}/metrics.jsonl`` (strict JSON) and the metric logger.

    A fresh run starts a fresh file; a resume keeps the records up to its checkpoint's step and appends, so each
    step is recorded once. Per-rank lists (the distributed recipe's) stay off the terminal line and go to the
    logger as ``key/rank{r}``.
    """

    def __init__(self, output_dir: Path, logger, log):
        self.path = Path(output_dir) / METRICS_FILE
        self.logger, self.log = logger, log

    def start(self, resume_step: Optional[int]) -> None:
        if resume_step is None:
            if self.path.exists():
                self.path.unlink()
            return
        dropped = truncate_metrics(self.path, resume_step)
        if dropped:
            self.log.info(f"metrics.jsonl: dropped {dropped} record(s) after step {resume_step}, which this resume "
                          "trains again")

    def write(self, record: Dict[str, Any]) -> None:
        tqdm.write(" | ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                              for k, v in record.items() if not isinstance(v, list)))
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
# the end of a run
# ------------------------------------------------------------------------------------------------


class RunSummary:
    """What the run did, collected as it goes, and the paragraph printed at its end."""

    def __init__(self, metrics_path: Path, wandb_dir: Optional[Path] = None):
        self.t_start = time.perf_counter()
        self.metrics_path, self.wandb_dir = Path(metrics_path), wandb_dir
        self.first: Optional[tuple] = None  # (step, loss) of the first and last step this process trained
        self.last: Optional[tuple] = None
        self.saved: List[Path] = []
        self.skipped = 0
        self.stop: Optional[str] = None  # the signal that stopped the run
        self.nothing_left: Optional[str] = None  # a resume from the end of training

    def step(self, step: int, loss: float) -> None:
        self.last = (step, loss)
        self.first = self.first or self.last

    def saved_checkpoint(self, folder: Path) -> None:
        self.saved = [p for p in self.saved if p != folder] + [folder]

    def text(self) -> str:
        def fmt(s: float) -> str:
            return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"

        seconds = time.perf_counter() - self.t_start
        if self.nothing_left:
            parts = [f"Nothing trained: {self.nothing_left}, so there was nothing to train (raise epochs or "
                     f"max_steps_per_epoch to go on); finished in {fmt(seconds)}."]
        elif self.first is None:
            parts = [f"Stopped before the first step ({fmt(seconds)})."]
        else:
            (first_step, first_loss), (last_step, last_loss) = self.first, self.last
            n = last_step - first_step + 1
            loss = f"; loss {first_loss:.4f} at step {first_step} -> {last_loss:.4f} at step {last_step}"
            how = f"stopped by {self.stop}" if self.stop else "done"
            parts = [f"Run {how}: trained steps {first_step}-{last_step} ({n} step{'s' * (n != 1)}) in {fmt(seconds)}"
                     f"{loss}" + (f"; {self.skipped} non-finite step(s) skipped" if self.skipped else "") + "."]
        if self.metrics_path.is_file():
            parts.append(f"Metrics: {self.metrics_path}.")
        if self.saved:
            names = ", ".join(p.name for p in self.saved[:-1])
            parts.append(f"Checkpoints: {self.saved[-1]}" + (f" (latest; also {names})" if names else "") + ".")
        if self.wandb_dir is not None:
            parts.append(f"wandb: {self.wandb_dir} (upload with `wandb sync {self.wandb_dir}`).")
        return " ".join(parts)
