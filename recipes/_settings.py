"""The config, checked once into one ``Settings`` object before anything is built or written.

Every check a config value gets lives here: unknown keys, numbers (one vocabulary: "a positive integer", "a positive
number", "a non-negative integer", "a finite number >= 0"), flag combinations, paths, the optimizer (its class
imported once, its kwargs checked against its signature, a wrapper's inner class), activation checkpointing. A bad
value is one ``BadInput`` naming the key and the fix; the recipes print it as ``error: ...`` and exit 2.
Checks that need something built (the tokenizer's length against the model's, the dataset's records) are in the
component that builds it.
"""

import difflib
import inspect
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, training, utils
from torchtune.config._utils import _get_component_from_path

from finetune_base import BadInput, hf_weight_files
from recipes import _packing
from recipes._checkpoint import RECIPE_STATE_FILE
from recipes._hf_format import WEIGHTS_FILE

log = utils.get_logger("INFO")

# Every top-level key the fine-tune recipes read (unknown ones are refused, with the closest of these suggested).
KNOWN_CONFIG_KEYS = (
    "data_dir", "output_dir", "checkpoint_dir", "resume_from_checkpoint", "overwrite",
    "model", "tokenizer", "dataset", "loss", "optimizer", "lr_scheduler", "metric_logger",
    "device", "dtype", "seed", "shuffle", "batch_size", "gradient_accumulation_steps", "epochs",
    "max_steps_per_epoch", "clip_grad_norm", "optimizer_in_bwd", "compile", "enable_activation_checkpointing",
    "ac_mode", "ac_option", "enable_activation_offloading", "device_memory_limit_gib", "pack_cache_dir",
    "save_every_n_steps", "log_every_n_steps", "max_consecutive_skipped_steps", "log_level",
)
DISTRIBUTED_CONFIG_KEYS = KNOWN_CONFIG_KEYS + ("fsdp_reshard_after_forward",)

# Keyword arguments that only select torch.optim's implementation (not the math). Other optimizer libraries reject
# them; they are dropped for a class that does not take them, so one config serves every optimizer. Any other
# rejected kwarg is a user error.
TORCH_BACKEND_FLAGS = ("fused", "foreach", "capturable", "differentiable")

# Loaders of HF `datasets` that read local files named in `data_files`.
LOCAL_DATASET_SOURCES = ("json", "csv", "parquet", "text", "arrow")

AC_MODES = ("full", "selective")


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def check_config_keys(cfg: DictConfig, known) -> None:
    """Refuse a top-level key no recipe reads (a typo would otherwise be silently ignored).

    Component sections (optimizer.*, model.*) are checked by their instantiation; this looks at the top level only.
    """
    known = sorted(set(known))
    for key in cfg.keys():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"the known keys are: {', '.join(known)}"
            raise BadInput(f"{key} is not a config key of this recipe; {hint} (remove it with ~{key})")


# ------------------------------------------------------------------------------------------------
# numbers: one vocabulary
# ------------------------------------------------------------------------------------------------


def number(cfg: DictConfig, key: str, *, integer: bool, low: float, strict: bool, allow_none: bool = False,
           default: Any = None, example: Any = 1):
    """``cfg[key]`` (a dotted path; ``default`` when absent) checked as a finite number (``integer``: a whole one)
    above ``low`` (``>= low`` when not ``strict``), or None when ``allow_none``. Booleans are not numbers."""
    value = OmegaConf.select(cfg, key, default=default)
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if strict else value >= low) and (not integer or float(value).is_integer())
    if not ok:
        if integer:
            rule = {(0, True): "a positive integer", (0, False): "a non-negative integer"}.get(
                (low, strict), f"an integer {'>' if strict else '>='} {low:g}")
        else:
            rule = "a positive number" if (low, strict) == (0, True) else \
                f"a finite number {'>' if strict else '>='} {low:g}"
        raise BadInput(f"{key}={value!r} must be {rule}{' or null' if allow_none else ''}; set e.g. {key}={example}")
    return int(value) if integer else float(value)


def flag(cfg: DictConfig, key: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if value not in (True, False):
        raise BadInput(f"{key}={value!r} must be True or False")
    return bool(value)


# ------------------------------------------------------------------------------------------------
# the optimizer
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer as the config names it, resolved once: its class, the kwargs to build it with (torch's backend
    flags dropped for a class that lacks them), and a wrapper's inner class (``optimizer_class``), imported."""

    path: str
    cls: Any
    kwargs: DictConfig  # without _component_ and optimizer_class
    inner: Any = None

    @property
    def cpu_offload(self) -> bool:
        """torchao's CPUOffloadOptimizer: states and step on the CPU, gradients copied out during backward."""
        return getattr(self.cls, "__name__", "") == "CPUOffloadOptimizer"

    @property
    def lr(self) -> Any:
        return self.kwargs.get("lr")

    def build(self, params) -> torch.optim.Optimizer:
        extra = {} if self.inner is None else {"optimizer_class": self.inner}
        try:
            return config.instantiate(OmegaConf.merge({"_component_": self.path}, self.kwargs), params, **extra)
        except (TypeError, ValueError) as e:
            raise BadInput(f"optimizer={self.path} rejected its arguments ({first_line(e)}); fix the optimizer.* "
                           "keys") from None


def _import(path: str, key: str):
    try:
        return _get_component_from_path(path)
    except Exception as e:  # InstantiationError, ValueError: the path does not import
        hint = " (install it with: pip install -e '.[bnb]')" if path.startswith("bitsandbytes") else ""
        more = (", bitsandbytes.optim.AdamW8bit, torchao.optim.AdamW8bit or optimizers.AdamW8bit"
                if key == "optimizer" else "")
        raise BadInput(f"{key}={path} cannot be imported{hint} ({first_line(e.__cause__ or e)}); use a class path "
                       f"such as torch.optim.AdamW{more}") from None


def resolve_optimizer(cfg_optimizer: DictConfig) -> OptimizerSpec:
    """Import the optimizer's class and check its kwargs against its signature; nothing is built here."""
    path = cfg_optimizer.get("_component_")
    if not path:
        raise BadInput("optimizer._component_ is missing; set optimizer=torch.optim.AdamW (or another class path)")
    cls = _import(path, "optimizer")
    if not callable(cls):
        raise BadInput(f"optimizer={path} is not a class or function; use a class path such as torch.optim.AdamW")
    inner = cfg_optimizer.get("optimizer_class")
    inner = _import(inner, "optimizer.optimizer_class") if isinstance(inner, str) else inner
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        params = None
    takes_any = params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keep = OmegaConf.create({})
    dropped = []
    for key, value in cfg_optimizer.items():
        if key in ("_component_", "optimizer_class"):
            continue
        if takes_any or key in params:
            keep[key] = value
        elif key in TORCH_BACKEND_FLAGS:
            dropped.append(f"{key}={value}")
        else:
            accepted = ", ".join(k for k in params if k not in ("self", "params"))
            raise BadInput(f"optimizer.{key}={value} is not accepted by {path} (it takes: {accepted}); remove it "
                           f"with ~optimizer.{key}")
    if dropped:
        log.info(f"{path} does not take torch.optim's backend flag(s) {', '.join(dropped)}: dropped them")
    return OptimizerSpec(path=path, cls=cls, kwargs=keep, inner=inner)


def warn_round_to_nearest(path: str, dtype: torch.dtype) -> None:
    """One line for a torch.optim Adam/AdamW run on bf16 weights: its updates round to the nearest bf16 value."""
    if dtype == torch.bfloat16 and path in ("torch.optim.AdamW", "torch.optim.Adam"):
        log.warning(
            f"{path} on bf16 weights rounds every update to the nearest bf16 value: at fine-tuning learning rates "
            "most updates are below half a bf16 step and vanish (measured: ~0.27 of the fp32-master improvement kept "
            "at lr 2e-5). optimizer=optimizers.AdamW8bit (or AdamW4bit, AdamW) rounds stochastically and keeps it "
            "(docs/optimizers.md)"
        )


# ------------------------------------------------------------------------------------------------
# the settings
# ------------------------------------------------------------------------------------------------


@dataclass
class Settings:
    """Every scalar and path a fine-tune recipe reads, checked. Components (model, tokenizer, dataset, loss,
    lr_scheduler, metric_logger) stay config sections, built with ``config.instantiate``."""

    device: torch.device
    dtype: torch.dtype
    batch_size: int
    epochs: int
    max_steps_per_epoch: Optional[int]
    accum: int
    log_every: int
    save_every: Optional[int]
    clip: Optional[float]
    max_skips: int
    overwrite: bool
    optimizer_in_bwd: bool
    seed: int
    shuffle: bool
    ac_every: Optional[int]  # activation checkpointing: one layer in every N; None = off
    offload_activations: bool
    compile: bool
    pack_cache_dir: Optional[Path]
    memory_limit_gib: Optional[float]
    output_dir: Path
    tokenizer_path: Path
    data_files: List[str]  # the local files the dataset reads (the pack cache's key hashes them)
    checkpoint_dir: Optional[Path]
    resume_dir: Optional[Path]
    optimizer: OptimizerSpec
    model_component: str
    reshard_after_forward: bool = True  # the distributed recipe's FSDP2 policy


def activation_checkpointing(cfg: DictConfig) -> Optional[int]:
    """One layer in every N to checkpoint (``ac_mode=full``: N=1; ``selective``: N=``ac_option``), None when
    ``enable_activation_checkpointing`` is off."""
    mode = cfg.get("ac_mode", "full")
    if mode not in AC_MODES:
        raise BadInput(f"ac_mode={mode!r} is not an activation checkpointing mode; use ac_mode=full (every layer) "
                       "or ac_mode=selective ac_option=N (every Nth layer)")
    every = 1
    if mode == "selective":
        option = cfg.get("ac_option")
        if not (isinstance(option, int) and not isinstance(option, bool) and option >= 1):
            raise BadInput(f"ac_mode=selective needs ac_option=N, a positive integer (checkpoint every Nth layer); "
                           f"got ac_option={option!r}")
        every = option
    return every if cfg.get("enable_activation_checkpointing", False) else None


def read_settings(cfg: DictConfig, *, distributed: bool = False) -> Settings:
    """Check the whole config (no side effects: nothing is built, written or seeded) and return the settings."""
    check_config_keys(cfg, DISTRIBUTED_CONFIG_KEYS if distributed else KNOWN_CONFIG_KEYS)
    dtype_name = cfg.get("dtype", "bf16")
    if dtype_name not in ("bf16", "fp32"):
        raise BadInput(f"dtype={dtype_name!r} is not supported; use dtype=bf16 or dtype=fp32")
    device_name = cfg.get("device", "cuda")
    if str(device_name).startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(f"device={device_name} but no CUDA GPU is visible here; use device=cpu (slow beyond the tiny "
                       "model)")
    device = utils.get_device(device=device_name)

    def positive(key, allow_none=False, integer=True):
        return number(cfg, key, integer=integer, low=0, strict=True, allow_none=allow_none)

    batch_size, epochs = positive("batch_size"), positive("epochs")
    max_steps = positive("max_steps_per_epoch", allow_none=True)
    accum, log_every = positive("gradient_accumulation_steps"), positive("log_every_n_steps")
    save_every = positive("save_every_n_steps", allow_none=True)  # null turns them off; 0 is refused, not "off"
    clip = positive("clip_grad_norm", allow_none=True, integer=False)
    max_skips = number(cfg, "max_consecutive_skipped_steps", integer=True, low=0, strict=True, default=10,
                       example=10)
    # Finite and in range before anything is built (a NaN lr would otherwise train a NaN model).
    if OmegaConf.select(cfg, "optimizer.lr") is not None:
        positive("optimizer.lr", integer=False)
    for key, strict in (("optimizer.weight_decay", False), ("optimizer.eps", True),
                        ("lr_scheduler.num_warmup_steps", False)):
        number(cfg, key, integer=False, low=0, strict=strict, allow_none=True)
    number(cfg, "model.num_layers", integer=True, low=0, strict=True, allow_none=True, example=2)
    overwrite = flag(cfg, "overwrite")

    optimizer_in_bwd = bool(cfg.get("optimizer_in_bwd", False))
    if optimizer_in_bwd and accum > 1:
        raise BadInput(
            f"optimizer_in_bwd=True cannot accumulate gradients (gradient_accumulation_steps={accum}): each gradient "
            "is applied and freed during backward; set gradient_accumulation_steps=1 or optimizer_in_bwd=False")
    if optimizer_in_bwd and clip is not None:
        raise BadInput(
            f"optimizer_in_bwd=True cannot clip gradients (clip_grad_norm={clip}): the global norm is only known "
            "after every parameter has already stepped; set clip_grad_norm=null or optimizer_in_bwd=False")
    # torchao's CPUOffloadOptimizer copies each gradient to the CPU inside backward (a post-accumulate hook), so the
    # gradient must be final there: no accumulation, no clipping afterwards, mean loss backward.
    if str(OmegaConf.select(cfg, "optimizer._component_") or "").endswith("CPUOffloadOptimizer") and (
            accum > 1 or clip is not None or optimizer_in_bwd):
        raise BadInput(
            f"optimizer=torchao.optim.CPUOffloadOptimizer copies gradients to the CPU during backward, so it cannot "
            f"accumulate (gradient_accumulation_steps={accum}), clip (clip_grad_norm={clip}) or run in backward "
            f"(optimizer_in_bwd={optimizer_in_bwd}); set gradient_accumulation_steps=1 clip_grad_norm=null "
            "optimizer_in_bwd=False")

    seed = number(cfg, "seed", integer=True, low=0, strict=False, default=0, example=42)
    ac_every = activation_checkpointing(cfg)
    offload_activations = bool(cfg.get("enable_activation_offloading", False))
    if offload_activations and device.type != "cuda":
        raise BadInput("enable_activation_offloading=True moves activations to CPU memory during the forward pass "
                       f"and needs a GPU (device={device_name}); set enable_activation_offloading=False")
    cache = cfg.get("pack_cache_dir", "default")
    pack_cache_dir = None if cache in (None, False, "off") else (
        _packing.default_cache_dir() if cache == "default" else Path(str(cache)).expanduser())
    memory_limit = positive("device_memory_limit_gib", allow_none=True, integer=False)
    if memory_limit is not None:
        if device.type != "cuda":
            raise BadInput(f"device_memory_limit_gib={memory_limit} caps GPU memory and needs device=cuda; set "
                           "device_memory_limit_gib=null")
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        if memory_limit > total:
            raise BadInput(f"device_memory_limit_gib={memory_limit} is more than this GPU's {total:.1f} GiB; set a "
                           "smaller value or null")

    if distributed:
        if optimizer_in_bwd:
            raise BadInput("optimizer_in_bwd=True is not supported by the distributed recipe; set "
                           "optimizer_in_bwd=False (FSDP2 already shards the gradients N ways)")
        if offload_activations:
            raise BadInput("enable_activation_offloading=True is for one GPU; the distributed recipe shards weights, "
                           "gradients and states instead: set enable_activation_offloading=False")
        if str(OmegaConf.select(cfg, "optimizer._component_") or "").endswith("CPUOffloadOptimizer"):
            raise BadInput("optimizer=torchao.optim.CPUOffloadOptimizer is for one GPU; the distributed recipe shards "
                           "the optimizer state across GPUs instead: use the single-device recipe or another optimizer")

    paths = _check_paths(cfg)
    return Settings(
        device=device, dtype=training.get_dtype(dtype_name, device=device), batch_size=batch_size, epochs=epochs,
        max_steps_per_epoch=max_steps, accum=accum, log_every=log_every, save_every=save_every, clip=clip,
        max_skips=max_skips, overwrite=overwrite, optimizer_in_bwd=optimizer_in_bwd, seed=seed,
        shuffle=bool(cfg.get("shuffle", True)), ac_every=ac_every, offload_activations=offload_activations,
        compile=bool(cfg.get("compile", False)), pack_cache_dir=pack_cache_dir, memory_limit_gib=memory_limit,
        output_dir=Path(cfg.output_dir), **paths, optimizer=resolve_optimizer(cfg.optimizer),
        model_component=str(OmegaConf.select(cfg, "model._component_") or ""),
        reshard_after_forward=bool(cfg.get("fsdp_reshard_after_forward", True)))


def _check_paths(cfg: DictConfig) -> dict:
    """The tokenizer file, the dataset's local files, checkpoint_dir and resume_from_checkpoint exist and look right."""
    def fix_for(section: str, key: str, what: str) -> str:
        # Name the key the user actually sets: the folder the path is built from, if any.
        raw = str(OmegaConf.to_container(cfg[section], resolve=False).get(key, ""))
        if "${data_dir}" in raw:
            return f"set data_dir=DIR (the folder holding {what}, e.g. ../shared/data)"
        if "${checkpoint_dir}" in raw:
            return f"set checkpoint_dir=DIR (the HF model folder, which holds {Path(raw).name})"
        return f"set {section}.{key}=FILE"

    tok = Path(cfg.tokenizer.path)
    if not tok.is_file():
        raise BadInput(f"tokenizer.path={tok} does not exist; "
                       + fix_for("tokenizer", "path", "llama2_tokenizer/tokenizer.model"))

    source, data_files = cfg.dataset.get("source"), []
    if source in LOCAL_DATASET_SOURCES:
        files = cfg.dataset.get("data_files")
        if files is None:
            raise BadInput(f"dataset.source={source} needs dataset.data_files=FILE")
        if isinstance(files, str):
            files = [files]
        elif OmegaConf.is_dict(files):
            files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
        data_files = [str(f) for f in files]
        for f in data_files:
            if not Path(f).is_file():
                raise BadInput(f"dataset.data_files={f} does not exist; "
                               + fix_for("dataset", "data_files", "alpaca/alpaca_data.json")
                               + ", or take Alpaca from the hub with dataset.source=tatsu-lab/alpaca ~dataset.data_files")

    ckpt = cfg.get("checkpoint_dir")
    checkpoint_dir = Path(ckpt) if ckpt else None
    if checkpoint_dir is not None and (not checkpoint_dir.is_dir() or not hf_weight_files(checkpoint_dir)):
        raise BadInput(f"checkpoint_dir={ckpt} is not a folder with HF weights (*.safetensors or pytorch_model*.bin); "
                       "point it at the downloaded model (e.g. Llama-2-7b-hf), or set checkpoint_dir=null for random "
                       "init")

    resume = cfg.get("resume_from_checkpoint")
    resume_dir = Path(resume) if resume else None
    if resume_dir is not None:
        missing = [f for f in (WEIGHTS_FILE, RECIPE_STATE_FILE) if not (resume_dir / f).is_file()]
        if missing:
            raise BadInput(f"resume_from_checkpoint={resume} lacks {', '.join(missing)}; point it at a step_N or "
                           "epoch_E folder this recipe wrote (or use checkpoint_dir=... to start a new run from its "
                           "weights)")
    return dict(tokenizer_path=tok, data_files=data_files, checkpoint_dir=checkpoint_dir, resume_dir=resume_dir)
