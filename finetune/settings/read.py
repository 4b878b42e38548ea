"""The config, checked once into one ``Settings`` object before anything is built or written (``read_settings``).

Flag combinations, the optimizer (its class imported once, its kwargs checked against its signature, a wrapper's
inner class), activation checkpointing and the model (the folder's, with checkpoint_dir) are read here; the key and
number vocabulary is in checks.py, the machine-dependent keys in hardware.py, the paths in paths.py.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import training, utils

from finetune.base import BadInput
from finetune.checkpoint import hf_format
from finetune.checkpoint.run_folder import fresh_dir_name, inputs_overwrite_would_delete, resumes_in_place
from finetune.data import packing
from finetune.optimizer import OptimizerSpec, resolve_optimizer
from finetune.settings.checks import check_component_keys, check_config_keys, check_sentencepiece_file, flag, number
from finetune.settings.hardware import read_fp8, read_packed_attention
from finetune.settings.paths import check_paths, dataset_files

# Every top-level key the fine-tune recipes read (unknown ones are refused, with the closest of these suggested).
KNOWN_CONFIG_KEYS = (
    "data_dir",
    "output_dir",
    "checkpoint_dir",
    "resume_from_checkpoint",
    "overwrite",
    "model",
    "tokenizer",
    "dataset",
    "loss",
    "optimizer",
    "lr_scheduler",
    "metric_logger",
    "device",
    "dtype",
    "seed",
    "shuffle",
    "batch_size",
    "gradient_accumulation_steps",
    "epochs",
    "max_steps_per_epoch",
    "clip_grad_norm",
    "optimizer_in_bwd",
    "compile",
    "enable_activation_checkpointing",
    "ac_mode",
    "ac_option",
    "enable_activation_offloading",
    "stream_optimizer_states",
    "stream_layers",
    "device_memory_limit_gib",
    "host_memory_limit_gib",
    "pack_cache_dir",
    "save_every_n_steps",
    "async_checkpoint",
    "log_every_n_steps",
    "max_consecutive_skipped_steps",
    "log_level",
    "fp8",
    "profiler",
    "packed_attention",
    "dataset_val",
    "run_val_every_n_steps",
    "batch_size_val",
)
DISTRIBUTED_CONFIG_KEYS = KNOWN_CONFIG_KEYS + ("fsdp_reshard_after_forward",)

MAX_LR = 1.0
# The model's sizes, each a positive integer when the config sets it: an example, and a bound far above any released
# model's (Llama 3.1 405B: 126 layers, width 16384, 128 heads, 53248 hidden; vocabularies to 262144; Llama 4 Scout:
# 10M tokens of context) and far below what breaks the build (max_seq_len=1e12 asks for a 4 TB RoPE cache).
MODEL_SIZES = {
    "model.num_layers": (2, 1024),
    "model.embed_dim": (128, 2**16),
    "model.num_heads": (4, 1024),
    "model.num_kv_heads": (4, 1024),
    "model.vocab_size": (32000, 2**22),
    "model.max_seq_len": (512, 2**24),
    "model.intermediate_dim": (512, 2**18),
}

AC_MODES = ("full", "selective")


@dataclass
class Settings:
    """Every scalar and path a fine-tune recipe reads, checked. Components (model, tokenizer, dataset, loss,
    lr_scheduler, metric_logger) stay config sections, built with ``config.instantiate``; the model's is ``model``:
    the config's, or with checkpoint_dir the folder's model read from its config.json (``resolve_model``)."""

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
    host_limit_gib: Optional[float]  # host_memory_limit_gib: what a background checkpoint's copy may add up to
    output_dir: Path
    tokenizer_path: Path
    data_files: List[str]  # the local files the dataset reads (the pack cache's key hashes them)
    checkpoint_dir: Optional[Path]
    resume_dir: Optional[Path]
    optimizer: OptimizerSpec
    model_component: str
    stream_states: bool = False  # optimizer states in host memory, streamed around each step in backward
    stream_layers: int = 0  # transformer layers whose weights live in host memory (finetune/streaming/weights.py)
    fp8: Optional[str] = None  # FP8 matmuls in the transformer layers: None (bf16), "tensorwise" or "rowwise"
    lr_scheduler: Optional[DictConfig] = None  # None: constant lr (lr_scheduler=null on the command line)
    dtype_name: str = "bf16"
    # The sections that make the tokens, resolved to plain values (the pack cache's key and the resume check read
    # them): the tokenizer's and the dataset's.
    tokenizer_cfg: Optional[dict] = None
    dataset_cfg: Optional[dict] = None
    reshard_after_forward: bool = True  # the distributed recipe's FSDP2 policy
    async_checkpoint: bool = True  # write checkpoints in the background (finetune/checkpoint/async_save.py)
    packed: bool = False  # dataset.packed: samples packed into rows of tokenizer.max_seq_len
    source_config: Optional[dict] = None  # checkpoint_dir's config.json, read once
    packed_attention: str = (
        "flex"  # packed rows' attention: torchtune's flex BlockMask, or "varlen" (finetune/model/attention.py)
    )
    model: Any = None  # the model section the recipes instantiate (resolve_model)
    family: str = hf_format.DEFAULT_FAMILY  # its hf_format.FAMILIES key
    model_note: Optional[str] = None  # the line the recipes log when the model is the folder's
    # Validation (finetune/validation.py): the dataset_val section as built (dataset's keys under its own when it
    # names no _component_), None = no validation; every N steps (None: at the end of each epoch only).
    dataset_val: Optional[DictConfig] = None
    val_every: Optional[int] = None
    batch_size_val: Optional[int] = None
    val_packed: bool = False
    val_data_files: List[str] = field(default_factory=list)


def activation_checkpointing(cfg: DictConfig) -> Optional[int]:
    """One layer in every N to checkpoint (``ac_mode=full``: N=1; ``selective``: N=``ac_option``), None when
    ``enable_activation_checkpointing`` is off."""
    mode = cfg.get("ac_mode", "full")
    if mode not in AC_MODES:
        raise BadInput(
            f"ac_mode={mode!r} is not an activation checkpointing mode; use ac_mode=full (every layer) "
            "or ac_mode=selective ac_option=N (every Nth layer)"
        )
    every = 1
    if mode == "selective":
        option = cfg.get("ac_option")
        if not (isinstance(option, int) and not isinstance(option, bool) and option >= 1):
            raise BadInput(
                f"ac_mode=selective needs ac_option=N, a positive integer (checkpoint every Nth layer); "
                f"got ac_option={option!r}"
            )
        every = option
    return every if cfg.get("enable_activation_checkpointing", False) else None


def read_settings(cfg: DictConfig, *, distributed: bool = False) -> Settings:
    """Check the whole config (no side effects: nothing is built, written or seeded) and return the settings."""
    check_config_keys(cfg, DISTRIBUTED_CONFIG_KEYS if distributed else KNOWN_CONFIG_KEYS)
    check_component_keys(cfg)
    dtype_name = cfg.get("dtype", "bf16")
    if dtype_name not in ("bf16", "fp32"):
        raise BadInput(f"dtype={dtype_name!r} is not supported; use dtype=bf16 or dtype=fp32")
    device_name = cfg.get("device", "cuda")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device_name)):
        raise BadInput(f"device={device_name} is not supported by these recipes; use device=cuda (a GPU) or device=cpu")
    if str(device_name).startswith("cuda") and not torch.cuda.is_available():
        raise BadInput(
            f"device={device_name} but no CUDA GPU is visible here; use device=cpu (slow beyond the tiny model)"
        )
    device = utils.get_device(device=device_name)

    def positive(key, allow_none=False, integer=True):
        return number(cfg, key, integer=integer, low=0, strict=True, allow_none=allow_none)

    batch_size, epochs = positive("batch_size"), positive("epochs")
    max_steps = positive("max_steps_per_epoch", allow_none=True)
    accum, log_every = positive("gradient_accumulation_steps"), positive("log_every_n_steps")
    save_every = positive("save_every_n_steps", allow_none=True)  # null turns them off; 0 is refused, not "off"
    clip = positive("clip_grad_norm", allow_none=True, integer=False)
    max_skips = number(cfg, "max_consecutive_skipped_steps", integer=True, low=0, strict=True, default=10, example=10)
    # Finite and in range before anything is built (a NaN lr would otherwise train a NaN model). No fine-tuning lr
    # is above 1 (Adam's are near 1e-5); parameter-free optimizers take 1.0 as a multiplier.
    if OmegaConf.select(cfg, "optimizer.lr") is not None:
        number(
            cfg,
            "optimizer.lr",
            integer=False,
            low=0,
            strict=True,
            high=MAX_LR,
            example=2e-5,
            why_high="a fine-tuning lr is near 1e-5; parameter-free optimizers take 1.0",
        )
    for key, strict in (
        ("optimizer.weight_decay", False),
        ("optimizer.eps", True),
        ("lr_scheduler.num_warmup_steps", False),
    ):
        number(cfg, key, integer=False, low=0, strict=strict, allow_none=True)
    for key, (example, high) in MODEL_SIZES.items():  # (in a config that builds the model from its sizes, as tiny)
        if OmegaConf.select(cfg, key) is not None:
            why = "larger than any model's; the model's buffers would be built at this size"
            number(cfg, key, integer=True, low=0, strict=True, example=example, high=high, why_high=why)
    heads, kv_heads, width = (
        OmegaConf.select(cfg, k) for k in ("model.num_heads", "model.num_kv_heads", "model.embed_dim")
    )
    if heads and width and width % heads:
        raise BadInput(
            f"model.embed_dim={width} must be a multiple of model.num_heads={heads}; set e.g. "
            f"model.embed_dim={heads * max(1, round(width / heads))}"
        )
    if heads and kv_heads and heads % kv_heads:
        raise BadInput(
            f"model.num_heads={heads} must be a multiple of model.num_kv_heads={kv_heads}; set e.g. "
            f"model.num_kv_heads={heads}"
        )
    number(cfg, "tokenizer.max_seq_len", integer=True, low=0, strict=True, allow_none=True, example=512)
    overwrite = flag(cfg, "overwrite")
    async_checkpoint = flag(cfg, "async_checkpoint", default=True)

    optimizer_in_bwd = bool(cfg.get("optimizer_in_bwd", False))
    if optimizer_in_bwd and accum > 1:
        raise BadInput(
            f"optimizer_in_bwd=True cannot accumulate gradients (gradient_accumulation_steps={accum}): each gradient "
            "is applied and freed during backward; set gradient_accumulation_steps=1 or optimizer_in_bwd=False"
        )
    if optimizer_in_bwd and clip is not None:
        raise BadInput(
            f"optimizer_in_bwd=True cannot clip gradients (clip_grad_norm={clip}): the global norm is only known "
            "after every parameter has already stepped; set clip_grad_norm=null or optimizer_in_bwd=False"
        )
    stream_states = flag(cfg, "stream_optimizer_states")
    if stream_states and not optimizer_in_bwd:
        raise BadInput(
            "stream_optimizer_states=True brings each parameter's optimizer state to the GPU for its step in "
            "backward and needs optimizer_in_bwd=True (with gradient_accumulation_steps=1 clip_grad_norm=null)"
        )
    optimizer = resolve_optimizer(cfg.optimizer)
    # torchao's CPUOffloadOptimizer copies each gradient to the CPU inside backward (a post-accumulate hook), so the
    # gradient must be final there: no accumulation, no clipping afterwards, mean loss backward.
    if optimizer.cpu_offload and (accum > 1 or clip is not None or optimizer_in_bwd):
        raise BadInput(
            f"optimizer=torchao.optim.CPUOffloadOptimizer copies gradients to the CPU during backward, so it cannot "
            f"accumulate (gradient_accumulation_steps={accum}), clip (clip_grad_norm={clip}) or run in backward "
            f"(optimizer_in_bwd={optimizer_in_bwd}); set gradient_accumulation_steps=1 clip_grad_norm=null "
            "optimizer_in_bwd=False"
        )

    seed = number(cfg, "seed", integer=True, low=0, strict=False, default=0, example=42)
    ac_every = activation_checkpointing(cfg)
    stream_layers = number(cfg, "stream_layers", integer=True, low=0, strict=False, default=0, example=12)
    if stream_layers and not (stream_states and ac_every == 1):
        raise BadInput(
            f"stream_layers={stream_layers} brings those layers' weights to the GPU for their forward and backward "
            "only, and needs stream_optimizer_states=True (each weight is written back right after its step) and "
            "enable_activation_checkpointing=True with ac_option=1 (no saved tensor may hold a streamed weight)"
        )
    offload_activations = bool(cfg.get("enable_activation_offloading", False))
    if offload_activations and device.type != "cuda":
        raise BadInput(
            "enable_activation_offloading=True moves activations to CPU memory during the forward pass "
            f"and needs a GPU (device={device_name}); set enable_activation_offloading=False"
        )
    cache = cfg.get("pack_cache_dir", "default")
    pack_cache_dir = (
        None
        if cache in (None, False, "off")
        else (packing.default_cache_dir() if cache == "default" else Path(str(cache)).expanduser())
    )
    memory_limit = positive("device_memory_limit_gib", allow_none=True, integer=False)
    if memory_limit is not None:
        if device.type != "cuda":
            raise BadInput(
                f"device_memory_limit_gib={memory_limit} caps GPU memory and needs device=cuda; set "
                "device_memory_limit_gib=null"
            )
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        if memory_limit > total:
            raise BadInput(
                f"device_memory_limit_gib={memory_limit} is more than this GPU's {total:.1f} GiB; set a "
                "smaller value or null"
            )

    host_limit = positive("host_memory_limit_gib", allow_none=True, integer=False)

    packed = OmegaConf.select(cfg, "dataset.packed", default=False)
    if packed not in (True, False):
        raise BadInput(f"dataset.packed={packed!r} must be True or False")
    compile_ = bool(cfg.get("compile", False))
    fp8 = read_fp8(cfg, device, compile_=compile_)
    packed_attention = read_packed_attention(cfg, device, packed=packed)

    if distributed:
        if optimizer_in_bwd:
            raise BadInput(
                "optimizer_in_bwd=True is not supported by the distributed recipe; set "
                "optimizer_in_bwd=False (FSDP2 already shards the gradients N ways)"
            )
        if offload_activations:
            raise BadInput(
                "enable_activation_offloading=True is for one GPU; the distributed recipe shards weights, "
                "gradients and states instead: set enable_activation_offloading=False"
            )
        if optimizer.cpu_offload:
            raise BadInput(
                "optimizer=torchao.optim.CPUOffloadOptimizer is for one GPU; the distributed recipe shards "
                "the optimizer state across GPUs instead: use the single-device recipe or another optimizer"
            )

    paths = check_paths(cfg)
    check_sentencepiece_file(cfg)  # (after check_paths: the file exists)
    validation = read_validation(cfg, batch_size, packed_attention)
    if optimizer.cpu_offload and device.type != "cuda":  # (torchao's own check: an AssertionError in its constructor)
        raise BadInput(
            f"optimizer=torchao.optim.CPUOffloadOptimizer moves the optimizer state from the GPU to the "
            f"CPU and needs device=cuda (device={device_name}); on the CPU the state is in CPU memory "
            "already: use optimizer=torch.optim.AdamW (or another optimizer)"
        )
    output_dir = Path(cfg.output_dir)
    if overwrite and not resumes_in_place(output_dir, paths["resume_dir"]):
        inputs = [
            ("checkpoint_dir", paths["checkpoint_dir"]),
            ("tokenizer.path", paths["tokenizer_path"]),
            ("resume_from_checkpoint", paths["resume_dir"]),
        ]
        doomed = inputs_overwrite_would_delete(
            output_dir,
            [(k, p) for k, p in inputs if p is not None]
            + [("dataset.data_files", f) for f in paths["data_files"]]
            + [("dataset_val.data_files", f) for f in validation.get("val_data_files", [])],
        )
        if doomed is not None:
            key, path, result = doomed
            raise BadInput(
                f"overwrite=True would delete {result}, which this run reads ({key}={path}); copy it out "
                f"of output_dir first (e.g. cp -r {result} {fresh_dir_name(output_dir)}-start) and point "
                f"{key} there, or set output_dir to a new folder (e.g. output_dir="
                f"{fresh_dir_name(output_dir)}) and keep overwrite=False"
            )
    model, family, model_note = resolve_model(cfg, paths["checkpoint_dir"], paths["source_config"])
    return Settings(
        device=device,
        dtype=training.get_dtype(dtype_name, device=device),
        batch_size=batch_size,
        epochs=epochs,
        max_steps_per_epoch=max_steps,
        accum=accum,
        log_every=log_every,
        save_every=save_every,
        clip=clip,
        max_skips=max_skips,
        overwrite=overwrite,
        optimizer_in_bwd=optimizer_in_bwd,
        stream_states=stream_states,
        stream_layers=stream_layers,
        seed=seed,
        shuffle=bool(cfg.get("shuffle", True)),
        ac_every=ac_every,
        offload_activations=offload_activations,
        compile=compile_,
        pack_cache_dir=pack_cache_dir,
        memory_limit_gib=memory_limit,
        host_limit_gib=host_limit,
        output_dir=output_dir,
        **paths,
        optimizer=optimizer,
        fp8=fp8,
        model_component=str(OmegaConf.select(cfg, "model._component_") or ""),
        lr_scheduler=lr_scheduler(cfg),
        dtype_name=dtype_name,
        tokenizer_cfg=OmegaConf.to_container(cfg.tokenizer, resolve=True),
        dataset_cfg=OmegaConf.to_container(cfg.dataset, resolve=True),
        reshard_after_forward=bool(cfg.get("fsdp_reshard_after_forward", True)),
        async_checkpoint=async_checkpoint,
        packed=packed,
        packed_attention=packed_attention,
        model=model,
        family=family,
        model_note=model_note,
        **validation,
    )


def read_validation(cfg: DictConfig, batch_size: int, packed_attention: str) -> dict:
    """``dataset_val``, ``run_val_every_n_steps`` and ``batch_size_val`` as Settings fields ({} without dataset_val).

    ``dataset_val`` is a dataset section built as ``dataset`` is, with the same tokenizer. One that names no
    ``_component_`` takes dataset's keys under its own (``dataset_val.data_files=val.json`` is a held-out file of the
    same format); one that names a component stands alone."""
    section = cfg.get("dataset_val")
    if section is None:
        for key in ("run_val_every_n_steps", "batch_size_val"):
            if cfg.get(key) is not None:
                raise BadInput(
                    f"{key}={cfg.get(key)!r} needs a validation set; set dataset_val (e.g. "
                    f"dataset_val.data_files=FILE: a file of the training data's format), or remove it with ~{key}"
                )
        return {}
    if not OmegaConf.is_dict(section):
        raise BadInput(
            f"dataset_val={section!r} must be a dataset section like dataset's; set e.g. "
            "dataset_val.data_files=FILE (the rest is taken from dataset), or dataset_val=null for no validation"
        )
    own = OmegaConf.to_container(section, resolve=True)  # (resolved here: ${data_dir} needs the whole config)
    section = OmegaConf.create(
        own if own.get("_component_") else {**OmegaConf.to_container(cfg.dataset, resolve=True), **own}
    )
    packed = section.get("packed", False)
    if packed not in (True, False):
        raise BadInput(f"dataset_val.packed={packed!r} must be True or False")
    if packed_attention == "varlen" and not packed:
        raise BadInput(
            "packed_attention=varlen points the attention at packed rows only, and dataset_val is not packed; set "
            "dataset_val.packed=True, or packed_attention=flex"
        )
    every = number(cfg, "run_val_every_n_steps", integer=True, low=0, strict=True, allow_none=True, example=100)
    size = batch_size  # (null: batch_size)
    if cfg.get("batch_size_val") is not None:
        size = number(cfg, "batch_size_val", integer=True, low=0, strict=True, example=batch_size)
    return dict(
        dataset_val=section,
        val_every=every,
        batch_size_val=size,
        val_packed=packed,
        val_data_files=dataset_files(cfg, "dataset_val", section),
    )


def resolve_model(cfg: DictConfig, checkpoint_dir: Optional[Path], source: Optional[dict]):
    """(the model section to instantiate, its family, the line to log). With checkpoint_dir's config.json, the
    folder's model: every architecture field of config.json is what the model is built with, or one BadInput
    naming it (hf_format.resolve_model); ``model._component_`` is optional there, and checked against the folder's
    family when given. Without one, the config's model section, as written."""
    section = cfg.get("model")
    given = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_dict(section) else {}
    if source is None:
        if not given.get("_component_"):
            raise BadInput(
                "model._component_ is not set; name a model builder (e.g. "
                "model._component_=torchtune.models.llama2.llama2_7b), or set checkpoint_dir=DIR (a Hugging "
                "Face model folder: its config.json describes the model)"
            )
        return section, hf_format.family_of(given["_component_"]).name, None
    family, built = hf_format.resolve_model(source, given)
    note = (
        f"Model: {family.name} built from {checkpoint_dir / 'config.json'}: {built['num_layers']} layers of "
        f"width {built['embed_dim']}, {built['num_heads']} heads ({built['num_kv_heads']} key/value) of "
        f"{built['head_dim']}, vocabulary {built['vocab_size']}, RoPE base {built['rope_base']:g}"
        f"{' (Llama 3.1 scaling)' if built.get('rope_scaling') else ''}, norm eps {built['norm_eps']:g}"
        f"{', tied embeddings' if built['tie_word_embeddings'] else ''}"
    )
    return OmegaConf.create(built), family.name, note


def lr_scheduler(cfg: DictConfig) -> Optional[DictConfig]:
    """The lr_scheduler section, or None for a constant lr: ``lr_scheduler: null`` in a config, or
    ``lr_scheduler=null`` on the command line (which sets only its ``_component_`` to null)."""
    section = cfg.get("lr_scheduler")
    if section is None or not section.get("_component_"):
        return None
    return section
