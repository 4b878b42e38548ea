"""The settings of a run, one frozen section per component (torchtitan's config-per-component shape).

Each section is read and checked once by its own reader (finetune/settings/read.py) and is what its component takes:
the data loaders take ``DataSettings``, validation ``ValidationSettings``, the model's preparation the few values of
``MemorySettings`` it needs, and so on. Only the recipes and ``finetune/services.py``, which compose the components,
hold the whole ``Settings``. A section is frozen: a second dataset is a second section built by its reader, never a
copy of the first with fields swapped. This module imports no other part of the library but the optimizer's spec, so
every component can import the section it takes.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Tuple

import torch
from omegaconf import DictConfig

from finetune.optimizer import OptimizerSpec


@dataclass(frozen=True)
class TrainingSettings:
    """How the model learns: the steps, the data order, the optimizer and its schedule."""

    epochs: int
    max_steps_per_epoch: Optional[int]  # None: the whole epoch
    accum: int  # gradient_accumulation_steps: micro-batches per optimizer step
    clip: Optional[float]  # clip_grad_norm; None = no clipping
    max_skips: int  # max_consecutive_skipped_steps
    seed: int  # random init and the data order
    shuffle: bool
    optimizer: OptimizerSpec
    optimizer_in_bwd: bool  # one optimizer per parameter, stepped in backward
    lr_scheduler: Optional[DictConfig]  # None: constant lr (lr_scheduler=null on the command line)


@dataclass(frozen=True)
class DataSettings:
    """One dataset as it is built and batched: the training set (``dataset``) or the validation set
    (``dataset_val``). The tokenizer's file and section are the pack cache's key (with the dataset's files), and the
    attention of packed rows decides how a batch is collated; both are the run's, the same in either dataset."""

    section: DictConfig  # the dataset section to instantiate (dataset_val: dataset's keys under its own)
    key: str  # the section's config key, "dataset" or "dataset_val": what an error about its data names
    packed: bool  # samples packed into rows of tokenizer.max_seq_len (finetune/data/packing.py)
    files: Tuple[str, ...]  # the local files the dataset reads (the pack cache's key hashes them); () for the hub
    batch_size: int  # samples (or packed rows) per micro-batch: batch_size, or batch_size_val
    tokenizer_path: Path
    tokenizer_cfg: dict  # the tokenizer section, resolved to plain values
    pack_cache_dir: Optional[Path]  # None: no cache of tokenized samples
    packed_attention: str  # packed rows' attention: "flex" (torchtune's block mask) or "varlen" (FlashAttention)


@dataclass(frozen=True)
class ValidationSettings:
    """The validation loss (finetune/validation.py): its dataset, built as the training set is, and how often."""

    data: DataSettings
    every: Optional[int]  # run_val_every_n_steps; None: at the end of each epoch only


@dataclass(frozen=True)
class MemorySettings:
    """What trades speed for device memory, and how the step's kernels run (none of it changes what a step
    computes, FP8 aside): activation checkpointing and offloading, streamed states and weights, the memory cap,
    compile, FP8 matmuls, FSDP2's resharding."""

    ac_every: Optional[int]  # activation checkpointing: one layer in every N; None = off
    offload_activations: bool
    stream_states: bool  # optimizer states in host memory, streamed around each step in backward
    stream_layers: int  # transformer layers whose weights live in host memory (finetune/streaming/weights.py)
    resident_state_bytes: int  # resident_states_gib: of the streamed states, what stays on the GPU; 0 = none
    memory_limit_gib: Optional[float]  # device_memory_limit_gib: the CUDA allocator's cap; None = the whole card
    compile: bool
    fp8: Optional[str]  # FP8 matmuls in the transformer layers: None (bf16), "tensorwise" or "rowwise"
    reshard_after_forward: bool  # the distributed recipe's FSDP2 policy


@dataclass(frozen=True)
class ModelSettings:
    """The model to build: the config's model section, or with checkpoint_dir the folder's model read from its
    config.json."""

    section: Any  # the model section the recipes instantiate
    family: str  # its hf_format.FAMILIES key
    note: Optional[str]  # the line the recipes log when the model is the folder's
    source_config: Optional[dict]  # checkpoint_dir's config.json, read once
    source_path: Optional[Path] = None  # that file, named when weights do not fit the model it describes


@dataclass(frozen=True)
class CheckpointSettings:
    """Where the weights come from and how the run's checkpoints are written."""

    checkpoint_dir: Optional[Path]  # an HF model folder to start from; None = random init
    resume_dir: Optional[Path]  # resume_from_checkpoint: a step_N or epoch_E folder this recipe wrote
    overwrite: bool  # delete the run already in output_dir first
    save_every: Optional[int]  # save_every_n_steps; None = epoch_E only
    background: bool  # async_checkpoint: written while training goes on (finetune/checkpoint/async_save.py)
    host_limit_gib: Optional[float]  # host_memory_limit_gib: what a background save's copy may fill; None = no cap


@dataclass(frozen=True)
class Settings:
    """Every scalar and path a fine-tune recipe reads, checked, in its sections; the run-wide values beside them.
    Components the config names (tokenizer, loss, metric_logger, profiler) stay config sections, built with
    ``config.instantiate``."""

    device: torch.device
    dtype: torch.dtype
    dtype_name: str  # "bf16" or "fp32", as the config names it (a checkpoint records it)
    output_dir: Path
    log_every: int  # log_every_n_steps: a metrics line on the terminal every N steps
    training: TrainingSettings
    data: DataSettings
    validation: Optional[ValidationSettings]  # None: no dataset_val
    memory: MemorySettings
    model: ModelSettings
    checkpoint: CheckpointSettings
