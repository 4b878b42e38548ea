"""The config, checked once into the frozen sections of ``Settings`` before anything is built or written.

``read_settings`` composes the sections, each read and checked by its own reader here (``read_training``,
``read_memory``, ``read_data``, ``read_validation``, ``read_checkpoint``, ``read_model``), then checks the rules that
join sections. The key and number vocabulary is in checks.py, the machine-dependent keys in hardware.py, the paths in
paths.py, the sections themselves in sections.py.
"""

import re
from pathlib import Path
from typing import Optional, Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import training as training_utils
from torchtune import utils

from finetune.base import BadInput, hf_weight_files
from finetune.checkpoint import hf_format
from finetune.checkpoint.hf_format import read_source_config
from finetune.checkpoint.run_folder import fresh_dir_name, inputs_overwrite_would_delete, resumes_in_place
from finetune.data import packing
from finetune.optimizer import resolve_optimizer
from finetune.sections import (
    CheckpointSettings,
    DataSettings,
    MemorySettings,
    ModelSettings,
    Settings,
    TrainingSettings,
    ValidationSettings,
)
from finetune.settings.checks import (
    check_component_keys,
    check_config_keys,
    check_required_sections,
    check_sentencepiece_file,
    flag,
    number,
)
from finetune.settings.hardware import read_fp8, read_packed_attention
from finetune.settings.paths import checkpoint_folders, dataset_files, tokenizer_file
from finetune.weight_shapes import SIZE_LIMITS, check_folder

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
    "resident_states_gib",
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
# The model's sizes, each a positive integer when the config sets it: an example, and the bound of the config.json
# field it stands for (finetune/weight_shapes.py: far above any released model's, far below what breaks the build).
MODEL_SIZES = {
    "model.num_layers": (2, SIZE_LIMITS["num_hidden_layers"]),
    "model.embed_dim": (128, SIZE_LIMITS["hidden_size"]),
    "model.num_heads": (4, SIZE_LIMITS["num_attention_heads"]),
    "model.num_kv_heads": (4, SIZE_LIMITS["num_key_value_heads"]),
    "model.vocab_size": (32000, SIZE_LIMITS["vocab_size"]),
    "model.max_seq_len": (512, SIZE_LIMITS["max_position_embeddings"]),
    "model.intermediate_dim": (512, SIZE_LIMITS["intermediate_size"]),
}
# An unreadable weights file of checkpoint_dir, found while its sizes are read.
FIX_WEIGHTS = "re-copy or re-download the folder, or point checkpoint_dir at another"

AC_MODES = ("full", "selective")


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
    """Check the whole config (no side effects: nothing is built, written or seeded) and return the settings: each
    section read by its own reader, then the rules that join sections."""
    check_config_keys(cfg, DISTRIBUTED_CONFIG_KEYS if distributed else KNOWN_CONFIG_KEYS)
    check_required_sections(cfg)
    check_component_keys(cfg)
    device, dtype_name = read_device(cfg)
    training = read_training(cfg, device)
    log_every = number(cfg, "log_every_n_steps", integer=True, low=0, strict=True)
    memory = read_memory(cfg, device, optimizer_in_bwd=training.optimizer_in_bwd)
    if distributed:
        refuse_one_device_features(training, memory)
    data = read_data(cfg, device)
    validation = read_validation(cfg, data)
    checkpoint = read_checkpoint(cfg)
    output_dir = read_output_dir(cfg)
    if checkpoint.overwrite:
        check_overwrite_keeps_inputs(output_dir, checkpoint, [data] + ([validation.data] if validation else []))
    model = read_model(cfg, checkpoint.checkpoint_dir)
    if distributed and model.family == "qwen3_moe":
        # (its loop reduces the loss over ranks, and the load-balancing loss, its metric and expert sharding are not
        # in it yet: refused rather than trained without the routers' loss)
        raise BadInput(
            "the distributed recipe does not train a mixture of experts (qwen3_moe) yet; fine-tune it with "
            "recipes/full_finetune_single_device.py"
        )
    return Settings(
        device=device,
        dtype=training_utils.get_dtype(dtype_name, device=device),
        dtype_name=dtype_name,
        output_dir=output_dir,
        log_every=log_every,
        training=training,
        data=data,
        validation=validation,
        memory=memory,
        model=model,
        checkpoint=checkpoint,
    )


def refuse_one_device_features(training: TrainingSettings, memory: MemorySettings) -> None:
    """What the distributed recipe does not take: the features that stand in for sharding on one GPU."""
    if training.optimizer_in_bwd:
        raise BadInput(
            "optimizer_in_bwd=True is not supported by the distributed recipe; set "
            "optimizer_in_bwd=False (FSDP2 already shards the gradients N ways)"
        )
    if memory.offload_activations:
        raise BadInput(
            "enable_activation_offloading=True is for one GPU; the distributed recipe shards weights, "
            "gradients and states instead: set enable_activation_offloading=False"
        )
    if training.optimizer.cpu_offload:
        raise BadInput(
            "optimizer=torchao.optim.CPUOffloadOptimizer is for one GPU; the distributed recipe shards "
            "the optimizer state across GPUs instead: use the single-device recipe or another optimizer"
        )


def read_output_dir(cfg: DictConfig) -> Path:
    """``output_dir``: the run's folder, a non-empty path (null, empty or removed: one line, not a traceback) where no
    file stands (the folder, or one above it: the OS would say "File exists" or "Not a directory")."""
    value = OmegaConf.select(cfg, "output_dir", default=None)
    if not isinstance(value, (str, Path)) or not str(value).strip():
        raise BadInput(
            f"output_dir={'null' if value is None else repr(value)} names no folder for the run's checkpoints and "
            "metrics; set output_dir=outputs/<run name>"
        )
    path = Path(str(value)).expanduser()
    file = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
    if file is not None:
        what = "is a file" if file == path else f"lies below {file}, which is a file"
        raise BadInput(f"output_dir={path} {what}, not a folder; set output_dir=DIR to a folder (made if missing)")
    return path


def check_overwrite_keeps_inputs(output_dir: Path, checkpoint: CheckpointSettings, datasets) -> None:
    """``overwrite=True`` deletes the run in output_dir: refused when that would delete a file this run reads (its
    start or resume checkpoint, its tokenizer, a data file of ``datasets``)."""
    if resumes_in_place(output_dir, checkpoint.resume_dir):
        return
    inputs = [
        ("checkpoint_dir", checkpoint.checkpoint_dir),
        ("tokenizer.path", datasets[0].tokenizer_path),
        ("resume_from_checkpoint", checkpoint.resume_dir),
    ]
    doomed = inputs_overwrite_would_delete(
        output_dir,
        [(k, p) for k, p in inputs if p is not None]
        + [(f"{key}.data_files", f) for key, data in zip(("dataset", "dataset_val"), datasets) for f in data.files],
    )
    if doomed is not None:
        key, path, result = doomed
        raise BadInput(
            f"overwrite=True would delete {result}, which this run reads ({key}={path}); copy it out "
            f"of output_dir first (e.g. cp -r {result} {fresh_dir_name(output_dir)}-start) and point "
            f"{key} there, or set output_dir to a new folder (e.g. output_dir="
            f"{fresh_dir_name(output_dir)}) and keep overwrite=False"
        )


def read_device(cfg: DictConfig) -> Tuple[torch.device, str]:
    """(the device, the dtype's name): ``device`` (cpu, or cuda with a GPU visible) and ``dtype`` (bf16 or fp32)."""
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
    return utils.get_device(device=device_name), dtype_name


def read_training(cfg: DictConfig, device: torch.device) -> TrainingSettings:
    """The steps (epochs, max_steps_per_epoch, gradient_accumulation_steps, clip_grad_norm, the skip limit), the data
    order (seed, shuffle), the optimizer (its numbers in range, its class imported, in backward or not) and the lr
    schedule; and the rules among them (in backward: no accumulation, no clipping; torchao's CPU offload likewise)."""
    epochs = number(cfg, "epochs", integer=True, low=0, strict=True)
    max_steps = number(cfg, "max_steps_per_epoch", integer=True, low=0, strict=True, allow_none=True)
    accum = number(cfg, "gradient_accumulation_steps", integer=True, low=0, strict=True)
    clip = number(cfg, "clip_grad_norm", integer=False, low=0, strict=True, allow_none=True)
    max_skips = number(cfg, "max_consecutive_skipped_steps", integer=True, low=0, strict=True, default=10, example=10)
    # Finite and in range before anything is built (a NaN lr would otherwise train a NaN model). No fine-tuning lr
    # is above 1 (Adam's are near 1e-5); parameter-free optimizers take 1.0 as a multiplier.
    if OmegaConf.select(cfg, "optimizer.lr") is not None:
        why = "a fine-tuning lr is near 1e-5; parameter-free optimizers take 1.0"
        number(cfg, "optimizer.lr", integer=False, low=0, strict=True, high=MAX_LR, example=2e-5, why_high=why)
    for key, strict in (
        ("optimizer.weight_decay", False),
        ("optimizer.eps", True),
        ("lr_scheduler.num_warmup_steps", False),
    ):
        number(cfg, key, integer=False, low=0, strict=strict, allow_none=True)
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
    if optimizer.cpu_offload and device.type != "cuda":  # (torchao's own check: an AssertionError in its constructor)
        raise BadInput(
            f"optimizer=torchao.optim.CPUOffloadOptimizer moves the optimizer state from the GPU to the "
            f"CPU and needs device=cuda (device={cfg.get('device', 'cuda')}); on the CPU the state is in CPU memory "
            "already: use optimizer=torch.optim.AdamW (or another optimizer)"
        )
    return TrainingSettings(
        epochs=epochs,
        max_steps_per_epoch=max_steps,
        accum=accum,
        clip=clip,
        max_skips=max_skips,
        seed=number(cfg, "seed", integer=True, low=0, strict=False, default=0, example=42),
        shuffle=bool(cfg.get("shuffle", True)),
        optimizer=optimizer,
        optimizer_in_bwd=optimizer_in_bwd,
        lr_scheduler=lr_scheduler(cfg),
    )


def read_memory(cfg: DictConfig, device: torch.device, *, optimizer_in_bwd: bool) -> MemorySettings:
    """Activation checkpointing and offloading, streamed states and layers, the memory cap, compile, FP8 and FSDP2's
    resharding, checked against the device (and ``optimizer_in_bwd``, which streamed states step in)."""
    stream_states = flag(cfg, "stream_optimizer_states")
    if stream_states and not optimizer_in_bwd:
        raise BadInput(
            "stream_optimizer_states=True brings each parameter's optimizer state to the GPU for its step in "
            "backward and needs optimizer_in_bwd=True (with gradient_accumulation_steps=1 clip_grad_norm=null)"
        )
    resident = number(cfg, "resident_states_gib", integer=False, low=0, strict=False, default=0, example=10)
    if resident and not stream_states:
        raise BadInput(
            f"resident_states_gib={resident:g} keeps that much of the streamed optimizer states on the GPU; without "
            "stream_optimizer_states=True every state is on the GPU already: set resident_states_gib=0"
        )
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
            f"and needs a GPU (device={cfg.get('device', 'cuda')}); set enable_activation_offloading=False"
        )
    memory_limit = number(cfg, "device_memory_limit_gib", integer=False, low=0, strict=True, allow_none=True)
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
    if memory_limit is not None and resident >= memory_limit:
        raise BadInput(
            f"resident_states_gib={resident:g} is not less than device_memory_limit_gib={memory_limit}, which must also "
            "hold the weights and a step's activations: set a smaller resident_states_gib"
        )
    compile_ = bool(cfg.get("compile", False))
    return MemorySettings(
        ac_every=ac_every,
        offload_activations=offload_activations,
        stream_states=stream_states,
        stream_layers=stream_layers,
        resident_state_bytes=int(resident * 2**30),
        memory_limit_gib=memory_limit,
        compile=compile_,
        fp8=read_fp8(cfg, device, compile_=compile_),
        reshard_after_forward=bool(cfg.get("fsdp_reshard_after_forward", True)),
    )


def read_packed(key: str, node: DictConfig) -> bool:
    packed = node.get("packed", False)
    if packed not in (True, False):
        raise BadInput(f"{key}.packed={packed!r} must be True or False")
    return packed


def read_data(cfg: DictConfig, device: torch.device) -> DataSettings:
    """The training set (``dataset``, its local files checked to exist) and what every dataset of the run shares:
    the tokenizer (its file checked, and read when it is a SentencePiece model), the pack cache and the attention
    of packed rows (checked against the device)."""
    batch_size = number(cfg, "batch_size", integer=True, low=0, strict=True)
    packed = read_packed("dataset", cfg.dataset)
    packed_attention = read_packed_attention(cfg, device, packed=packed)
    number(cfg, "tokenizer.max_seq_len", integer=True, low=0, strict=True, allow_none=True, example=512)
    cache = cfg.get("pack_cache_dir", "default")
    tokenizer_path = tokenizer_file(cfg)
    files = dataset_files(cfg, "dataset", cfg.dataset)
    check_sentencepiece_file(cfg)  # (after tokenizer_file: the file exists)
    return DataSettings(
        section=cfg.dataset,
        key="dataset",
        packed=packed,
        files=tuple(files),
        batch_size=batch_size,
        tokenizer_path=tokenizer_path,
        tokenizer_cfg=OmegaConf.to_container(cfg.tokenizer, resolve=True),
        pack_cache_dir=(
            None
            if cache in (None, False, "off")
            else (packing.default_cache_dir() if cache == "default" else Path(str(cache)).expanduser())
        ),
        packed_attention=packed_attention,
    )


def read_validation(cfg: DictConfig, data: DataSettings) -> Optional[ValidationSettings]:
    """``dataset_val``, ``run_val_every_n_steps`` and ``batch_size_val`` (None without dataset_val).

    ``dataset_val`` is a dataset section built as ``dataset`` is, with the same tokenizer, pack cache and attention
    (those of ``data``, the training set's). One that names no ``_component_`` takes dataset's keys under its own
    (``dataset_val.data_files=val.json`` is a held-out file of the same format); one that names a component stands
    alone."""
    section = cfg.get("dataset_val")
    if section is None:
        for key in ("run_val_every_n_steps", "batch_size_val"):
            if cfg.get(key) is not None:
                raise BadInput(
                    f"{key}={cfg.get(key)!r} needs a validation set; set dataset_val (e.g. "
                    f"dataset_val.data_files=FILE: a file of the training data's format), or remove it with ~{key}"
                )
        return None
    if not OmegaConf.is_dict(section):
        raise BadInput(
            f"dataset_val={section!r} must be a dataset section like dataset's; set e.g. "
            "dataset_val.data_files=FILE (the rest is taken from dataset), or dataset_val=null for no validation"
        )
    own = OmegaConf.to_container(section, resolve=True)  # (resolved here: ${data_dir} needs the whole config)
    section = OmegaConf.create(
        own if own.get("_component_") else {**OmegaConf.to_container(cfg.dataset, resolve=True), **own}
    )
    packed = read_packed("dataset_val", section)
    if data.packed_attention == "varlen" and not packed:
        raise BadInput(
            "packed_attention=varlen points the attention at packed rows only, and dataset_val is not packed; set "
            "dataset_val.packed=True, or packed_attention=flex"
        )
    every = number(cfg, "run_val_every_n_steps", integer=True, low=0, strict=True, allow_none=True, example=100)
    size = data.batch_size  # (null: batch_size)
    if cfg.get("batch_size_val") is not None:
        size = number(cfg, "batch_size_val", integer=True, low=0, strict=True, example=data.batch_size)
    own_data = DataSettings(
        section=section,
        key="dataset_val",
        packed=packed,
        files=tuple(dataset_files(cfg, "dataset_val", section)),
        batch_size=size,
        tokenizer_path=data.tokenizer_path,
        tokenizer_cfg=data.tokenizer_cfg,
        pack_cache_dir=data.pack_cache_dir,
        packed_attention=data.packed_attention,
    )
    return ValidationSettings(data=own_data, every=every)


def read_checkpoint(cfg: DictConfig) -> CheckpointSettings:
    """``checkpoint_dir`` and ``resume_from_checkpoint`` (folders that hold what they must), ``overwrite``,
    ``save_every_n_steps`` (null turns them off; 0 is refused, not "off") and ``async_checkpoint``."""
    save_every = number(cfg, "save_every_n_steps", integer=True, low=0, strict=True, allow_none=True)
    overwrite = flag(cfg, "overwrite")
    background = flag(cfg, "async_checkpoint", default=True)
    host_limit = number(cfg, "host_memory_limit_gib", integer=False, low=0, strict=True, allow_none=True)
    checkpoint_dir, resume_dir = checkpoint_folders(cfg)
    return CheckpointSettings(
        checkpoint_dir=checkpoint_dir,
        resume_dir=resume_dir,
        overwrite=overwrite,
        save_every=save_every,
        background=background,
        host_limit_gib=host_limit,
    )


def read_model(cfg: DictConfig, checkpoint_dir: Optional[Path]) -> ModelSettings:
    """The model section's sizes (in a config that builds the model from its sizes, as tiny does), then the model:
    with ``checkpoint_dir``, the folder's, from its config.json (read here, once, and its sizes checked against the
    weight files' headers: finetune/weight_shapes.py); else the config's."""
    for key, (example, high) in MODEL_SIZES.items():
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
    source_config = read_source_config(checkpoint_dir)
    if source_config is not None:
        # Before anything is built (the data included): a config.json whose sizes are not its weights' would build a
        # model of those sizes first (100,000 layers: minutes, then the allocator gives up). A model_type of no family
        # is named first, as such.
        hf_format.source_family(source_config)
        check_folder(checkpoint_dir, source_config, hf_weight_files(checkpoint_dir), FIX_WEIGHTS)
    section, family, note = resolve_model(cfg, checkpoint_dir, source_config)
    source_path = None if source_config is None else checkpoint_dir / "config.json"
    return ModelSettings(
        section=section, family=family, note=note, source_config=source_config, source_path=source_path
    )


def resolve_model(cfg: DictConfig, checkpoint_dir: Optional[Path], source: Optional[dict]):
    """(the model section to instantiate, its family, the line to log). With checkpoint_dir's config.json, the
    folder's model: every architecture field of config.json is what the model is built with, or one BadInput
    naming it (hf_format.resolve_model); ``model._component_`` is optional there, and checked against the folder's
    family when given. Without one, the config's model section, as written."""
    section = cfg.get("model")
    given = OmegaConf.to_container(section, resolve=True) if OmegaConf.is_dict(section) else {}
    if source is None:
        if not given.get("_component_"):  # (a section removed with ~model, or one of sizes only)
            raise BadInput(
                "model._component_ is not set, and without checkpoint_dir the model section is required; name a "
                "model builder (e.g. model._component_=torchtune.models.llama2.llama2_7b; the config file's model "
                "section, without ~model), or set checkpoint_dir=DIR (a Hugging Face model folder: its config.json "
                "describes the model)"
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
