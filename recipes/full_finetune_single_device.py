"""Full fine-tune of a Llama2-architecture model on one device (one GPU, or the CPU for tiny runs).

Launch from the repository root, by the file's path:

    tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml [key=value ...]
    tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml --help   # this text and the keys

(``tune run full_finetune_single_device``, without the path, and ``tune ls`` are torchtune's own recipe of that
name, which does not read these configs' keys the same way: always give the path.)

Features (each behind the config key in brackets):

    - Precision [dtype]: ``bf16`` (weights, grads, optimizer states and activations all in
      bfloat16, about half the memory of fp32) or ``fp32``. There is no mixed precision and no fp16.
    - Batching [batch_size, gradient_accumulation_steps]: one optimizer step sees
      ``batch_size * gradient_accumulation_steps`` samples; the loss is averaged over all unmasked
      tokens of those micro-batches, so accumulation gives the same update as one big batch.
    - Length of training [epochs, max_steps_per_epoch]: ``max_steps_per_epoch`` (optimizer steps)
      cuts each epoch short, as in torchtune; ``null`` runs the whole epoch.
    - Data order [seed, shuffle]: a seeded sampler, reshuffled per epoch, so a resumed run sees the
      same samples in the same order.
    - Gradient clipping [clip_grad_norm]: clip the global grad norm to this value; ``null`` does not
      clip (the norm is still logged).
    - Learning-rate schedule [lr_scheduler]: any scheduler built by ``config.instantiate`` with
      ``num_training_steps`` filled in by the recipe, e.g. torchtune's
      ``get_cosine_schedule_with_warmup`` (linear warmup over ``num_warmup_steps``, then cosine to 0);
      ``null`` keeps the lr constant.
    - Packing [dataset.packed, tokenizer.max_seq_len, pack_cache_dir]: ``True`` packs whole samples into
      rows of ``tokenizer.max_seq_len`` tokens, best-fit-decreasing (98.5 % of the slots real tokens on
      Alpaca at 512, against 82 % for torchtune's greedy PackedDataset and about half in unpacked
      batches), with a block-causal mask (no sample attends to another; flex attention on a GPU) and
      positions restarting per sample. The loss sees exactly the unpacked tokens: no sample's first
      token is predicted from the previous sample, pack padding is ignored. Samples are tokenized once
      and cached as plain arrays in ``pack_cache_dir`` (default ``~/.cache/llm-finetune-recipes/packs``,
      ``off`` for none): 52,002 Alpaca records take ~20 s on two cores the first time, under 1 s after.
      recipes/_packing.py explains the rest.
    - Activation checkpointing [enable_activation_checkpointing, ac_mode, ac_option]: recompute
      transformer layers in the backward pass; ``ac_mode=full`` (default) checkpoints every layer (most
      activation memory saved, about a third more compute), ``ac_mode=selective ac_option=N`` one layer
      in every N (between the two in memory and speed).
    - Activation offloading [enable_activation_offloading]: torchtune's offloading of saved activations
      to CPU memory during the forward pass, copied back in the backward (GPU only; with checkpointing
      on, only the layer inputs travel). Less GPU memory for PCIe traffic: use it when checkpointing alone
      does not fit.
    - Compilation [compile]: ``torch.compile`` per transformer layer and on the loss; the first step
      compiles (20-30 s at 7B on an H200), the rest are faster; shapes are static with packing, so
      nothing recompiles (``compiled_graphs`` in the metrics stays flat).
    - GPU memory [device_memory_limit_gib, PYTORCH_CUDA_ALLOC_CONF]: the CUDA allocator uses expandable
      segments unless ``PYTORCH_CUDA_ALLOC_CONF`` is set (reserved memory, what runs out on a card, then
      stays close to allocated); ``device_memory_limit_gib=24`` caps the process at 24 GiB, to prove on a
      large card that a run fits a smaller one. Peak allocated and reserved are both logged.
    - Optimizer [optimizer]: whatever ``optimizer._component_`` names; ``optimizer=PATH`` on the CLI
      swaps it (torch.optim.AdamW, bitsandbytes.optim.AdamW8bit / PagedAdamW8bit,
      torchao.optim.AdamW8bit / AdamW4bit / AdamWFp8, optimizers.AdamW8bit / AdamW4bit / AdamWFp8 /
      AdamW). torch's backend flags (fused, foreach, capturable, differentiable) are dropped for a
      class that does not take them, so the swap needs no ``~optimizer.fused``.
    - Optimizer in backward [optimizer_in_bwd]: step each parameter as soon as its gradient is
      ready and free that gradient, saving the memory of a full set of gradients. Needs
      ``gradient_accumulation_steps=1`` and ``clip_grad_norm=null`` (the recipe says so if not);
      grad_norm and optimizer_step_ms are then not logged.
    - CPU offload of the optimizer [optimizer=torchao.optim.CPUOffloadOptimizer]: states and the step on
      the CPU (``optimizer.optimizer_class`` names the CPU optimizer, default torch.optim.AdamW;
      ``optimizer.offload_gradients=True`` also frees each GPU gradient once copied). Gradients are
      copied out during backward, so like optimizer-in-backward it needs
      ``gradient_accumulation_steps=1`` and ``clip_grad_norm=null``.
    - Checkpoints [save_every_n_steps, output_dir]: ``{output_dir}/step_{N}/`` every N optimizer
      steps (``null``, the tiny config's default: none) and ``{output_dir}/epoch_{E}/`` at the end of each
      epoch, in Hugging Face format
      (config.json, model.safetensors, generation_config.json, tokenizer.model), with the resume
      state beside them in recipe_state.pt. Each is written to a temporary folder and renamed
      into place, so a crash never leaves a half-written checkpoint under a real name.
    - Initial weights [checkpoint_dir]: an HF checkpoint folder (e.g. Llama-2-7b-hf); ``null``
      keeps the random init (the tiny config).
    - Resume [resume_from_checkpoint]: a step_N or epoch_E folder; restores the weights, optimizer
      state, lr schedule, data position (epoch and step within it) and RNG, so the run continues
      with the losses it would have had without the interruption. ``metrics.jsonl`` keeps its records up
      to the checkpoint's step and the resume appends the rest, so each step is recorded once. A
      checkpoint already at the end of training (the last epoch_E) trains nothing, writes nothing and
      says so (raise ``epochs`` or ``max_steps_per_epoch`` to go on).
    - Metrics [log_every_n_steps, metric_logger]: every log step one record goes to stdout, to
      ``{output_dir}/metrics.jsonl`` (strict JSON: a NaN or inf is written as null) and to
      ``metric_logger`` (wandb by default, offline when no WANDB_API_KEY is set; ``metric_logger=null``
      turns it off). The wandb run folder holds a copy of the run's resolved config
      (``files/torchtune_config.yaml``), so it stays self-contained. A tqdm bar shows progress; at the end
      one paragraph sums the run up: steps trained, time, first and last loss, and where metrics.jsonl,
      the checkpoints and the wandb folder are. Epochs are named by their checkpoint folders everywhere,
      from 0 (``epoch_0``, the records' ``epoch: 0``); the bar adds the place in the run, ``epoch_0 (1/2)``.
    - Terminal output [log_level]: once setup has passed its checks, one line names the recipe file and
      output_dir (bad input prints only its ``error:`` line); ``log_level=DEBUG`` also prints the config, ``WARNING`` leaves only warnings and errors. Known third-party messages
      that say nothing here (torchao's skipped C++ extensions, bitsandbytes' optional CPU kernel) are
      filtered by message (recipes/_common.py: KNOWN_NOISE). ``--help`` prints this manual and every key of
      the ``--config`` file with its value.
    - Non-finite steps [max_consecutive_skipped_steps]: a step whose loss or global grad norm is not
      finite is skipped (no optimizer step, gradients zeroed, weights and optimizer state untouched; the
      lr schedule and data move on) and counted (``skipped_steps`` in the metrics record; our optimizers'
      own count of skipped non-finite gradient elements as ``nonfinite_grad_elements``). That many
      skips in a row (default 10) stop the run with an error. The check is the step's one host sync,
      moved from after ``optimizer.step()`` to before it (loss and grad norm in one read; without clipping
      the norm is now computed every step, one read of the gradients); on log steps the recipe also waits
      for the step's end to read optimizer_step_ms on a GPU (measured at 7B, unpacked, no clipping: 1.4 %
      slower than without these checks). With ``optimizer_in_bwd`` (and CPU offload) the gradients are consumed during
      backward, so only the loss is checked, after the step: a non-finite loss there stops the run at
      once (the update cannot be undone; resume from the last checkpoint). A checkpoint is never
      written with non-finite weights.
    - Run folder [output_dir, overwrite, resume_from_checkpoint]: ``{output_dir}/.lock`` keeps a
      second live run out (it is told the first's PID; a lock left by a dead process is taken over). A
      fresh run refuses a folder that already holds metrics.jsonl or step_*/epoch_* checkpoints (running
      the same command twice: the error suggests a fresh name, ``{output_dir}-2``) unless
      ``overwrite=True`` (which deletes them first) or it resumes (``resume_from_checkpoint``). A full
      disk while saving is one ``error:`` line and leaves the previous checkpoints as they were. At start
      a checkpoint left only under ``.old-*`` by a kill is restored and dead runs' ``.tmp-*`` are deleted.
    - Stop on a signal [SIGTERM, SIGUSR1]: the run saves ``step_N`` at the next step boundary and exits
      0; resuming from it continues with the uninterrupted run's losses.
    - Config keys: an unknown top-level key is refused with the closest known one suggested.

Bad input (a path that does not exist, an optimizer that cannot be imported or rejects a kwarg,
malformed data, a non-positive or non-finite hyper-parameter, impossible flag combinations, a corrupt or
foreign checkpoint or state file, a resume whose batch_size, gradient_accumulation_steps, seed, shuffle,
dataset.packed or optimizer.lr differ from the checkpoint's) stops the run before training with one line
naming the value and the fix, exit status 2, and nothing written under existing checkpoints. A resume
refuses a changed optimizer.lr rather than silently keep the saved one: the saved schedule continues,
so a new lr means a new run from the checkpoint's weights (checkpoint_dir=...). recipe_state.pt is loaded
with ``weights_only=True``: a file holding anything but tensors and plain values is refused unread.
"""

import atexit
import inspect
import itertools
import json
import math
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from recipes import _common

_common.quiet_known_noise()  # before torchtune imports torchao (see _common.KNOWN_NOISE)

from safetensors.torch import load_file, save_file
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_packed, padded_collate_sft
from torchtune.models import convert_weights
from tqdm import tqdm

from recipes import _packing
from recipes._common import BadInput, check_config_keys, check_finite, load_state_file
from recipes._packing import PackedSFTDataset, count_trained_tokens

log = utils.get_logger("INFO")

# Keyword arguments that only select torch.optim's implementation (not the math). Other
# optimizer libraries reject them; we drop them for a class that does not take them so that
# one config serves every optimizer. Any other rejected kwarg is a user error.
TORCH_BACKEND_FLAGS = ("fused", "foreach", "capturable", "differentiable")

# Loaders of HF `datasets` that read local files named in `data_files`.
LOCAL_DATASET_SOURCES = ("json", "csv", "parquet", "text", "arrow")

RECIPE_STATE_FILE = "recipe_state.pt"
WEIGHTS_FILE = "model.safetensors"


# Every top-level key the recipe reads (unknown ones are refused, with the closest of these suggested).
KNOWN_CONFIG_KEYS = (
    "data_dir", "output_dir", "checkpoint_dir", "resume_from_checkpoint", "overwrite",
    "model", "tokenizer", "dataset", "loss", "optimizer", "lr_scheduler", "metric_logger",
    "device", "dtype", "seed", "shuffle", "batch_size", "gradient_accumulation_steps", "epochs",
    "max_steps_per_epoch", "clip_grad_norm", "optimizer_in_bwd", "compile", "enable_activation_checkpointing",
    "ac_mode", "ac_option", "enable_activation_offloading", "device_memory_limit_gib", "pack_cache_dir",
    "save_every_n_steps", "log_every_n_steps", "max_consecutive_skipped_steps", "log_level",
)

RECIPE_PATH = "recipes/full_finetune_single_device.py"

# The settings a resume must share with its checkpoint (the data order and the step's samples depend on them).
RESUME_MUST_MATCH = ("batch_size", "gradient_accumulation_steps", "seed", "shuffle", "packed", "lr")


class NonFiniteStop(BadInput):
    """Training cannot go on: too many non-finite steps in a row, or one that was already applied."""


def _positive(cfg: DictConfig, key: str, allow_none: bool = False, integer: bool = True):
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    if integer:
        ok = ok and float(value).is_integer()
    if not ok:
        kind = "a positive integer" if integer else "a positive number"
        extra = " or null" if allow_none else ""
        raise BadInput(f"{key}={value!r} must be {kind}{extra}; set e.g. {key}=1")
    return int(value) if integer else float(value)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def resolve_optimizer(cfg_optimizer: DictConfig) -> DictConfig:
    """Check the optimizer's class and kwargs; return the config to instantiate.

    Drops torch's backend flags (TORCH_BACKEND_FLAGS) that the class does not accept; any
    other unaccepted kwarg is bad input. Nothing is built here, so this runs before the model.
    """
    path = cfg_optimizer.get("_component_")
    if not path:
        raise BadInput("optimizer._component_ is missing; set optimizer=torch.optim.AdamW (or another class path)")
    try:
        cls = _get_component_from_path(path)
    except Exception as e:  # InstantiationError, ValueError: the path does not import
        hint = " (install it with: pip install -e '.[bnb]')" if path.startswith("bitsandbytes") else ""
        raise BadInput(
            f"optimizer={path} cannot be imported{hint} ({_first_line(e.__cause__ or e)}); use a class path such as "
            "torch.optim.AdamW, bitsandbytes.optim.AdamW8bit, torchao.optim.AdamW8bit or optimizers.AdamW8bit"
        ) from None
    if not callable(cls):
        raise BadInput(f"optimizer={path} is not a class or function; use a class path such as torch.optim.AdamW")
    inner = cfg_optimizer.get("optimizer_class")
    if isinstance(inner, str):
        try:
            _get_component_from_path(inner)
        except Exception as e:
            raise BadInput(f"optimizer.optimizer_class={inner} cannot be imported ({_first_line(e.__cause__ or e)}); "
                           "use a class path such as torch.optim.AdamW") from None
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # builtins without a signature: let instantiate decide
        return cfg_optimizer
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keep = OmegaConf.create({"_component_": path})
    dropped = []
    for key, value in cfg_optimizer.items():
        if key == "_component_":
            continue
        if takes_any or key in params:
            keep[key] = value
        elif key in TORCH_BACKEND_FLAGS:
            dropped.append(f"{key}={value}")
        else:
            accepted = ", ".join(k for k in params if k not in ("self", "params"))
            raise BadInput(
                f"optimizer.{key}={value} is not accepted by {path} (it takes: {accepted}); "
                f"remove it with ~optimizer.{key}"
            )
    if dropped:
        log.info(f"{path} does not take torch.optim's backend flag(s) {', '.join(dropped)}: dropped them")
    return keep


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor reachable from ``optimizer.state``.

    Counts each storage once (states that are views into one flat buffer count the buffer once)
    and looks inside tensor subclasses such as torchao's quantized states (their inner tensors
    from ``__tensor_flatten__``), per docs/CONVENTIONS.md.
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


def model_hf_config(model: modules.TransformerDecoder, dtype: torch.dtype, base: Optional[dict]) -> dict:
    """config.json for transformers' LlamaForCausalLM, read off the built model's shapes.

    ``base`` (the source checkpoint's config.json, if any) is kept for keys we do not derive,
    such as bos/eos ids.
    """
    layer = model.layers[0]
    attn = layer.attn
    hf = dict(base or {})
    hf.update(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=model.tok_embeddings.weight.shape[0],
        hidden_size=model.tok_embeddings.weight.shape[1],
        intermediate_size=layer.mlp.w1.weight.shape[0],
        num_hidden_layers=len(model.layers),
        num_attention_heads=attn.num_heads,
        num_key_value_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm.eps,
        rope_theta=float(attn.pos_embeddings.base),
        hidden_act="silu",
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        torch_dtype={torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype],
    )
    hf.setdefault("bos_token_id", 1)
    hf.setdefault("eos_token_id", 2)
    hf.setdefault("initializer_range", 0.02)
    return hf


def read_hf_weight_files(folder: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF folder's weight files; an unreadable file is one BadInput naming it."""
    fix = ("re-copy or re-download it, or point checkpoint_dir / resume_from_checkpoint at another folder "
           "(an earlier step_N or epoch_E)")
    state: Dict[str, torch.Tensor] = {}
    for f in _common.hf_weight_files(folder):
        if f.suffix == ".safetensors":
            try:
                state.update(load_file(str(f)))
            except Exception as e:  # safetensors' own error for truncated headers, OSError, ...
                text = " ".join(str(e).split())[:200]
                raise BadInput(f"{f} is not a readable safetensors file ({type(e).__name__}: {text}; truncated or "
                               f"garbage?); {fix}") from None
        else:
            state.update(load_state_file(f, fix=fix))
    return state


def load_hf_weights(model: modules.TransformerDecoder, folder: Path) -> None:
    """Load an HF Llama checkpoint folder (safetensors or .bin shards) into a torchtune model."""
    state = read_hf_weight_files(folder)
    attn = model.layers[0].attn
    try:  # (a checkpoint of another size fails in the q/k permutation already, or in load_state_dict)
        state = convert_weights.hf_to_tune(
            state,
            num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            dim=model.tok_embeddings.weight.shape[1],
            head_dim=attn.head_dim,
        )
        model.load_state_dict(state)
    except (RuntimeError, KeyError) as e:
        msg = " ".join(str(e).split())[:600]
        raise BadInput(
            f"the weights in {folder} do not fit the model config ({msg}); make the config's model section "
            "match the checkpoint (e.g. model._component_=torchtune.models.llama2.llama2_7b for Llama-2-7b-hf)"
        ) from None


def apply_activation_checkpointing(model: modules.TransformerDecoder, every_n: int = 1) -> int:
    """Recompute the activations of one transformer layer in every ``every_n`` in the backward pass.

    Layers every_n - 1, 2 * every_n - 1, ... (0-based) are wrapped; every_n=1 wraps all of them. Each checkpointed
    layer keeps only its input (tokens x dim) instead of every intermediate, for one more forward pass of that layer
    in the backward. Returns the number of layers checkpointed.
    """
    count = 0
    for i, layer in enumerate(model.layers):
        if (i + 1) % every_n == 0:
            model.layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                 preserve_rng_state=False)
            count += 1
    return count


def warn_round_to_nearest(path: str, dtype: torch.dtype) -> None:
    """One line for a torch.optim Adam/AdamW run on bf16 weights: its updates round to the nearest bf16 value."""
    if dtype == torch.bfloat16 and path in ("torch.optim.AdamW", "torch.optim.Adam"):
        log.warning(
            f"{path} on bf16 weights rounds every update to the nearest bf16 value: at fine-tuning learning rates "
            "most updates are below half a bf16 step and vanish (measured: ~0.27 of the fp32-master improvement kept "
            "at lr 2e-5). optimizer=optimizers.AdamW8bit (or AdamW4bit, AdamW) rounds stochastically and keeps it "
            "(docs/optimizers.md)"
        )


def check_finite_weights(state: Dict[str, torch.Tensor], final: Path, step: int) -> None:
    """Refuse to write a checkpoint whose weights hold a NaN or inf (one device-side reduction, one sync)."""
    bad = [k for k, ok in zip(state, torch.stack([torch.isfinite(v).all() for v in state.values()]).tolist())
           if not ok] if state else []
    if bad:
        raise NonFiniteStop(f"the weights at step {step} are not finite ({', '.join(bad[:3])}): refused to write "
                            f"{final}; resume from the last checkpoint with a lower optimizer.lr or clip_grad_norm=1.0")


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process. Logged with compile=True: a number still growing after the
    first steps means recompiles (``TORCH_LOGS=recompiles`` says why)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def epoch_label(epoch: int, total: int) -> str:
    """How an epoch is named in every message: by its checkpoint folder (0-based, as the ``epoch`` of the metrics
    records), with its place in the run: ``epoch_0 (1/2)``."""
    return f"epoch_{epoch} ({epoch + 1}/{total})"


def checkpoint_bytes(model_sd: Dict[str, torch.Tensor], optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """About what one checkpoint takes on disk: the weights plus the optimizer state."""
    weights = sum(v.numel() * v.element_size() for v in model_sd.values() if isinstance(v, torch.Tensor))
    return weights + optimizer_state_bytes(optimizers)


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


def announce_saved(final: Path, started: float) -> None:
    """The line that reports a checkpoint in place: its folder, size on disk and write time (bench/pipeline.py
    reads it)."""
    size = sum(f.stat().st_size for f in final.iterdir() if f.is_file())
    tqdm.write(f"Saved checkpoint {final} ({size / 1e9:.2f} GB in {time.perf_counter() - started:.1f} s)")


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished checkpoint folder into place.

    rename(2) cannot replace a non-empty folder, so an existing one is first renamed aside and
    deleted only after the new one is in place: at every moment a complete checkpoint exists
    on disk (under its name, or under .old-* for the instant between the two renames).
    """
    _common.replace_dir(tmp, final)


def set_cuda_allocator_defaults() -> None:
    """Expandable segments unless the user configured the allocator (``PYTORCH_CUDA_ALLOC_CONF``).

    Without them, a training step's changing allocation sizes leave the caching allocator holding far more than it
    uses (98 GiB reserved for 71 GiB allocated, measured at 7B with AC off): reserved memory is what runs out on a
    card. Set before the first allocation; any setting of the variable, even an empty one, is left alone.
    """
    if "PYTORCH_CUDA_ALLOC_CONF" not in os.environ and "PYTORCH_ALLOC_CONF" not in os.environ:
        torch.cuda.memory._set_allocator_settings("expandable_segments:True")


AC_MODES = ("full", "selective")


def activation_checkpointing_mode(cfg: DictConfig):
    """(mode, every_n) from ``ac_mode`` / ``ac_option``: ``full`` checkpoints every layer, ``selective`` one layer
    in every ``ac_option``. Only read when enable_activation_checkpointing=True."""
    mode = cfg.get("ac_mode", "full")
    if mode not in AC_MODES:
        raise BadInput(f"ac_mode={mode!r} is not an activation checkpointing mode; use ac_mode=full (every layer) "
                       "or ac_mode=selective ac_option=N (every Nth layer)")
    option = cfg.get("ac_option")
    if mode == "selective":
        if not (isinstance(option, int) and not isinstance(option, bool) and option >= 1):
            raise BadInput(f"ac_mode=selective needs ac_option=N, a positive integer (checkpoint every Nth layer); "
                           f"got ac_option={option!r}")
        return mode, option
    return mode, 1


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


class FullFinetuneRecipeSingleDevice:
    """Full fine-tune on one device; the module docstring lists each feature and its flag."""

    known_config_keys = KNOWN_CONFIG_KEYS

    def __init__(self, cfg: DictConfig) -> None:
        # Every scalar check runs here, before anything is built or written.
        check_config_keys(cfg, self.known_config_keys)
        dtype = cfg.get("dtype", "bf16")
        if dtype not in ("bf16", "fp32"):
            raise BadInput(f"dtype={dtype!r} is not supported; use dtype=bf16 or dtype=fp32")
        device = cfg.get("device", "cuda")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise BadInput(f"device={device} but no CUDA GPU is visible here; use device=cpu (slow beyond the tiny model)")
        if str(device).startswith("cuda"):
            set_cuda_allocator_defaults()
        self._device = utils.get_device(device=device)
        self._dtype = training.get_dtype(dtype, device=self._device)

        self._batch_size = _positive(cfg, "batch_size")
        self._total_epochs = _positive(cfg, "epochs")
        self._max_steps_per_epoch = _positive(cfg, "max_steps_per_epoch", allow_none=True)
        self._accum = _positive(cfg, "gradient_accumulation_steps")
        self._log_every = _positive(cfg, "log_every_n_steps")
        # null turns periodic checkpoints off; 0 is refused rather than read as "off".
        self._save_every = _positive(cfg, "save_every_n_steps", allow_none=True)
        self._clip = _positive(cfg, "clip_grad_norm", allow_none=True, integer=False)
        self._max_skips = _positive(cfg, "max_consecutive_skipped_steps", allow_none=True) or 10
        if cfg.get("max_consecutive_skipped_steps", 10) is None:
            raise BadInput("max_consecutive_skipped_steps=null: set a positive integer (default 10)")
        self._check_hyperparameters(cfg)
        self._overwrite = cfg.get("overwrite", False)
        if self._overwrite not in (True, False):
            raise BadInput(f"overwrite={self._overwrite!r} must be True or False")

        self._optimizer_in_bwd = bool(cfg.get("optimizer_in_bwd", False))
        if self._optimizer_in_bwd and self._accum > 1:
            raise BadInput(
                f"optimizer_in_bwd=True cannot accumulate gradients (gradient_accumulation_steps={self._accum}): "
                "each gradient is applied and freed during backward; set gradient_accumulation_steps=1 "
                "or optimizer_in_bwd=False"
            )
        if self._optimizer_in_bwd and self._clip is not None:
            raise BadInput(
                f"optimizer_in_bwd=True cannot clip gradients (clip_grad_norm={self._clip}): the global norm is only "
                "known after every parameter has already stepped; set clip_grad_norm=null or optimizer_in_bwd=False"
            )

        # torchao's CPUOffloadOptimizer copies each gradient to the CPU inside backward (a post-accumulate hook),
        # so the gradient must be final there: no accumulation, no clipping afterwards, mean loss backward.
        self._offload = str(OmegaConf.select(cfg, "optimizer._component_") or "").endswith("CPUOffloadOptimizer")
        if self._offload and (self._accum > 1 or self._clip is not None or self._optimizer_in_bwd):
            raise BadInput(
                f"optimizer=torchao.optim.CPUOffloadOptimizer copies gradients to the CPU during backward, so it cannot "
                f"accumulate (gradient_accumulation_steps={self._accum}), clip (clip_grad_norm={self._clip}) or run "
                f"in backward (optimizer_in_bwd={self._optimizer_in_bwd}); set gradient_accumulation_steps=1 "
                "clip_grad_norm=null optimizer_in_bwd=False"
            )
        self._grads_final_in_backward = self._optimizer_in_bwd or self._offload

        seed = cfg.get("seed", 0)
        if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
            raise BadInput(f"seed={seed!r} must be a non-negative integer; set e.g. seed=42")
        self._seed = training.set_seed(seed=seed)
        self._shuffle = bool(cfg.get("shuffle", True))
        self._ac = bool(cfg.get("enable_activation_checkpointing", False))
        self._ac_mode, self._ac_option = activation_checkpointing_mode(cfg)
        self._offload_activations = bool(cfg.get("enable_activation_offloading", False))
        if self._offload_activations and self._device.type != "cuda":
            raise BadInput("enable_activation_offloading=True moves activations to CPU memory during the forward pass "
                           f"and needs a GPU (device={device}); set enable_activation_offloading=False")
        self._compile = bool(cfg.get("compile", False))
        cache = cfg.get("pack_cache_dir", "default")
        self._pack_cache_dir = None if cache in (None, False, "off") else (
            _packing.default_cache_dir() if cache == "default" else Path(str(cache)).expanduser())
        self._memory_limit_gib = _positive(cfg, "device_memory_limit_gib", allow_none=True, integer=False)
        if self._memory_limit_gib is not None:
            if self._device.type != "cuda":
                raise BadInput(f"device_memory_limit_gib={self._memory_limit_gib} caps GPU memory and needs device=cuda; "
                               "set device_memory_limit_gib=null")
            total = torch.cuda.get_device_properties(self._device).total_memory / 2**30
            if self._memory_limit_gib > total:
                raise BadInput(f"device_memory_limit_gib={self._memory_limit_gib} is more than this GPU's "
                               f"{total:.1f} GiB; set a smaller value or null")
            # The caching allocator refuses to grow past this share of the card: a run that fits here fits a card
            # of that size (the CUDA context, ~0.5 GiB, comes on top on a real card).
            torch.cuda.set_per_process_memory_fraction(self._memory_limit_gib / total, self._device)
        self._output_dir = Path(cfg.output_dir)

        # Position in training; overwritten by a resume.
        self._epoch = 0
        self._steps_in_epoch = 0
        self._global_step = 0
        self._skipped_steps = 0  # non-finite steps skipped so far (kept across a resume)
        self._consecutive_skips = 0
        self._stop_signal: Optional[int] = None  # SIGTERM/SIGUSR1 received: save at the next step boundary
        # For the end-of-run summary: (step, loss) of the first and last step this process trained, checkpoints.
        self._t_start = time.perf_counter()
        self._first_trained: Optional[tuple] = None
        self._last_trained: Optional[tuple] = None
        self._saved: List[Path] = []
        self._wandb_dir: Optional[Path] = None
        self._nothing_left: Optional[str] = None

    @staticmethod
    def _check_hyperparameters(cfg: DictConfig) -> None:
        """Finite and in range, before anything is built (a NaN lr would otherwise train a NaN model)."""
        if OmegaConf.select(cfg, "optimizer.lr") is not None:
            _positive(cfg, "optimizer.lr", integer=False)
        for key, low, strict in (("optimizer.weight_decay", 0, False), ("optimizer.eps", 0, True),
                                 ("lr_scheduler.num_warmup_steps", 0, False)):
            check_finite(key, OmegaConf.select(cfg, key), low=low, strict=strict)
        layers = OmegaConf.select(cfg, "model.num_layers")
        if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool) and layers >= 1):
            raise BadInput(f"model.num_layers={layers!r} must be an integer >= 1; set e.g. model.num_layers=2")

    # ----------------------------------------------------------------------------------------
    # setup: check every path, then build tokenizer, data, model, optimizer, schedule, loggers
    # ----------------------------------------------------------------------------------------

    def _setup_data(self, cfg_dataset: DictConfig, num_replicas: int, rank: int) -> None:
        """Dataset, sampler (rank r of N reads samples r, r+N, ...), dataloader and the steps per epoch."""
        self._dataset = self._setup_dataset(cfg_dataset)
        self._packed = isinstance(self._dataset, PackedSFTDataset)
        self._sampler = StatefulDistributedSampler(
            self._dataset, num_replicas=num_replicas, rank=rank, shuffle=self._shuffle, seed=self._seed
        )
        self._dataloader = DataLoader(
            self._dataset,
            batch_size=self._batch_size,
            sampler=self._sampler,
            collate_fn=padded_collate_packed if self._packed else partial(
                padded_collate_sft, padding_idx=self._tokenizer.pad_id, ignore_idx=self._loss_fn.ignore_index
            ),
            # A full last batch only: keeps shapes static for compile and steps comparable.
            drop_last=True,
            # Its own generator, so iterating the data does not consume the global RNG.
            generator=torch.Generator().manual_seed(self._seed),
        )
        self._steps_per_epoch = len(self._dataloader) // self._accum
        if self._max_steps_per_epoch is not None:
            self._steps_per_epoch = min(self._steps_per_epoch, self._max_steps_per_epoch)
        if self._steps_per_epoch == 0:
            ranks = f" x {num_replicas} ranks" if num_replicas > 1 else ""
            raise BadInput(
                f"the dataset has {len(self._dataset)} samples, fewer than one optimizer step needs "
                f"(batch_size={self._batch_size}{ranks} x gradient_accumulation_steps={self._accum}); lower batch_size"
            )

    def setup(self, cfg: DictConfig) -> None:
        self._check_paths(cfg)
        self._cfg_optimizer = resolve_optimizer(cfg.optimizer)

        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        self._setup_data(cfg.dataset, num_replicas=1, rank=0)

        self._model = self._setup_model(cfg)
        self._setup_optimizer()
        self._lr_scheduler = None
        if cfg.get("lr_scheduler") is not None:
            self._lr_scheduler = config.instantiate(
                cfg.lr_scheduler,
                self._optimizers[0],
                num_training_steps=self._total_epochs * self._steps_per_epoch,
            )
            if self._optimizer_in_bwd:
                # The scheduler drives the first per-parameter optimizer; the wrapper copies
                # its lr to all the others after each step. The scheduler already set the first
                # step's lr (0 at the start of a warmup) on that one optimizer: copy it now too, or
                # every other parameter's first step would run at the full base lr.
                self._optim_wrapper.set_lr_scheduler(self._lr_scheduler)
                first_lr = self._lr_scheduler.get_last_lr()[0]
                for opt in self._optimizers:
                    for group in opt.param_groups:
                        group["lr"] = first_lr

        self._check_tokenizer_fits_model()
        resume_state = None
        if self._resume_dir is not None:
            resume_state = self._load_resume_state(cfg)
        self._check_run_folder()

        self._metric_logger = self._setup_metric_logger(cfg)
        self._metrics_path = self._output_dir / "metrics.jsonl"
        if resume_state is None and self._metrics_path.exists():
            self._metrics_path.unlink()  # a fresh run starts a fresh file
        if resume_state is not None:
            self._trim_metrics_for_resume()
            # RNG last, so nothing in setup shifts it after the restore.
            rng = resume_state["rng"]
            _common.set_rng_state(rng)
            if rng.get("cuda") is not None and self._device.type == "cuda":
                torch.cuda.set_rng_state_all(rng["cuda"])

    # -- the run folder ------------------------------------------------------------------------

    def _claim_output_dir(self) -> None:
        """Create output_dir, check it is writable, take its lock, repair what a killed run left."""
        try:
            self._output_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self._output_dir, prefix=".write-test-"):
                pass
        except OSError as e:
            raise BadInput(
                f"output_dir={self._output_dir} is not writable ({e.strerror or e}); set output_dir=DIR to a folder you can write"
            ) from None
        self._lock = _common.OutputDirLock(self._output_dir)
        self._lock.acquire()
        atexit.register(self._lock.release)
        _common.recover_run_folder(self._output_dir, log)

    def _used_folder_error(self) -> Optional[str]:
        """The refusal of a fresh run into a folder holding an earlier run's results (None: go ahead)."""
        if self._resume_dir is not None:
            return None  # a resume continues its run, in the same folder or a new one
        used = _common.used_run_folder(self._output_dir)
        if used is None:
            return None
        if self._overwrite:
            _common.clear_run_folder(self._output_dir)
            log.info(f"overwrite=True: deleted the earlier run's {used} in {self._output_dir}")
            return None
        return (f"output_dir={self._output_dir} already holds a run ({used}); set a new folder (e.g. output_dir="
                f"{_common.fresh_dir_name(self._output_dir)}), overwrite=True to replace it, or "
                f"resume_from_checkpoint={self._output_dir}/step_N (or epoch_E) to continue it")

    def _check_run_folder(self) -> None:
        error = self._used_folder_error()
        if error:
            raise BadInput(error)

    def release_output_dir(self) -> None:
        lock = getattr(self, "_lock", None)
        if lock is not None:
            lock.release()

    def _check_tokenizer_fits_model(self) -> None:
        tok_len, model_len = self._tokenizer.max_seq_len, self._hf_config.get("max_position_embeddings")
        if tok_len is not None and model_len is not None and tok_len > model_len:
            raise BadInput(f"tokenizer.max_seq_len={tok_len} is longer than the model's max_seq_len={model_len} "
                           f"(its position embeddings); set tokenizer.max_seq_len={model_len} or lower, or raise "
                           "model.max_seq_len")

    def _check_paths(self, cfg: DictConfig) -> None:
        def fix_for(section: str, key: str, what: str) -> str:
            # Name the key the user actually sets: the folder the path is built from, if any.
            raw = str(OmegaConf.to_container(cfg[section], resolve=False).get(key, ""))
            if "${data_dir}" in raw:
                return f"set data_dir=DIR (the folder holding {what}, e.g. ../shared/data)"
            if "${checkpoint_dir}" in raw:
                return "set checkpoint_dir=DIR (the HF model folder, which holds tokenizer.model)"
            return f"set {section}.{key}=FILE"

        self._claim_output_dir()
        tok = Path(cfg.tokenizer.path)
        if not tok.is_file():
            raise BadInput(
                f"tokenizer.path={tok} does not exist; "
                + fix_for("tokenizer", "path", "llama2_tokenizer/tokenizer.model")
            )
        self._tokenizer_path = tok

        source = cfg.dataset.get("source")
        self._data_files: List[str] = []  # the local files the dataset reads (the pack cache's key hashes them)
        if source in LOCAL_DATASET_SOURCES:
            files = cfg.dataset.get("data_files")
            if files is None:
                raise BadInput(f"dataset.source={source} needs dataset.data_files=FILE")
            if isinstance(files, str):
                files = [files]
            elif OmegaConf.is_dict(files):
                files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
            self._data_files = [str(f) for f in files]
            for f in files:
                if not Path(f).is_file():
                    raise BadInput(
                        f"dataset.data_files={f} does not exist; "
                        + fix_for("dataset", "data_files", "alpaca/alpaca_data.json")
                        + ", or take Alpaca from the hub with dataset.source=tatsu-lab/alpaca ~dataset.data_files"
                    )

        ckpt = cfg.get("checkpoint_dir")
        self._checkpoint_dir = Path(ckpt) if ckpt else None
        if self._checkpoint_dir is not None:
            if not self._checkpoint_dir.is_dir() or not _common.hf_weight_files(self._checkpoint_dir):
                raise BadInput(
                    f"checkpoint_dir={ckpt} is not a folder with HF weights (*.safetensors or pytorch_model*.bin); "
                    "point it at the downloaded model (e.g. Llama-2-7b-hf), or set checkpoint_dir=null for random init"
                )

        resume = cfg.get("resume_from_checkpoint")
        self._resume_dir = Path(resume) if resume else None
        if self._resume_dir is not None:
            missing = [f for f in (WEIGHTS_FILE, RECIPE_STATE_FILE) if not (self._resume_dir / f).is_file()]
            if missing:
                raise BadInput(
                    f"resume_from_checkpoint={resume} lacks {', '.join(missing)}; point it at a step_N or epoch_E "
                    "folder this recipe wrote (or use checkpoint_dir=... to start a new run from its weights)"
                )

    def _setup_dataset(self, cfg_dataset: DictConfig):
        where = cfg_dataset.get("data_files") or cfg_dataset.get("source")
        packed = cfg_dataset.get("packed", False)
        if packed not in (True, False):
            raise BadInput(f"dataset.packed={packed!r} must be True or False")
        # The samples are built unpacked and packed here (recipes/_packing.py: best-fit rows, a token cache).
        cfg_samples = OmegaConf.merge(cfg_dataset, {"packed": False})
        try:
            ds = config.instantiate(cfg_samples, self._tokenizer)
        except Exception as e:  # datasets wraps parse errors in several types; all mean bad data here
            cause = e
            while cause.__cause__ is not None or cause.__context__ is not None:
                cause = cause.__cause__ or cause.__context__
            raise BadInput(
                f"could not load the dataset {where} ({_first_line(cause)}); it must be a JSON list of records "
                "with instruction, input and output (or a hub name reachable from here)"
            ) from None
        # Alpaca-style data: every record needs an instruction and an output. Check the whole
        # table now (Arrow null counts, milliseconds) rather than fail at some step mid-run.
        component = cfg_dataset.get("_component_", "")
        table = getattr(ds, "_data", None)
        if "alpaca" in component and hasattr(table, "column_names"):
            column_map = cfg_dataset.get("column_map") or {}
            for field in ("instruction", "input", "output"):  # text, not numbers or booleans
                column = column_map.get(field, field)
                if column not in table.column_names:
                    continue
                feature = getattr(table, "features", {}).get(column)
                if getattr(feature, "dtype", None) in ("string", "large_string", "null"):
                    continue  # an Arrow string column: every value is text or missing
                # Numbers, booleans, or a mix (datasets then stores the column as JSON): find the first non-text.
                bad = next(((i, v) for i, v in enumerate(table[column]) if v is not None and not isinstance(v, str)),
                           None)
                if bad is not None:
                    raise BadInput(
                        f"record {bad[0]} of {where}: field '{column}' is {bad[1]!r} ({type(bad[1]).__name__}), not a "
                        "string; fix or drop that record (instruction, input and output are text)")
            for field in ("instruction", "output"):
                column = column_map.get(field, field)
                if column not in table.column_names:
                    raise BadInput(
                        f"the records in {where} have no '{column}' field; each needs instruction and output "
                        "(map other names with dataset.column_map)"
                    )
                values = table.data.column(column)
                if values.null_count:
                    row = values.is_null().to_pylist().index(True)
                    raise BadInput(
                        f"record {row} of {where} has no '{column}'; fix or drop that record "
                        "(each needs instruction and output)"
                    )
        if packed:
            ds = self._pack(ds, cfg_dataset)
        return ds

    def _pack(self, ds, cfg_dataset: DictConfig) -> PackedSFTDataset:
        """Tokenize every sample once (or load them from the cache) and pack them into rows of max_seq_len."""
        pack_len = self._tokenizer.max_seq_len
        if pack_len is None:
            raise BadInput("dataset.packed=True needs a pack length: set tokenizer.max_seq_len (e.g. 512); "
                           "samples longer than it are truncated by the tokenizer")
        cache_dir = self._pack_cache_dir
        samples, t0 = None, time.perf_counter()
        if cache_dir is not None:
            key = _packing.cache_key(OmegaConf.to_container(cfg_dataset, resolve=True), self._data_files,
                                     str(self._tokenizer_path), pack_len)
            cache_file = cache_dir / f"samples-{key}.npz"
            samples = _packing.TokenizedSamples.load(cache_file) if cache_file.is_file() else None
            if samples is not None and len(samples) != len(ds):
                samples = None
        source = "cache" if samples is not None else "tokenized"
        if samples is None:
            samples = _packing.TokenizedSamples.from_dataset(ds)
            if cache_dir is not None:
                try:
                    samples.save(cache_file)
                except OSError as e:  # a read-only or full cache folder costs the next run time, nothing else
                    log.warning(f"could not write the pack cache {cache_file} ({e.strerror or e}); continuing")
        packed = PackedSFTDataset(samples, max_seq_len=pack_len, padding_idx=self._tokenizer.pad_id)
        log.info(
            f"Packed {len(samples)} samples into {len(packed)} rows of {pack_len} tokens "
            f"({packed.fill():.1%} filled; {source} in {time.perf_counter() - t0:.1f} s)"
        )
        return packed

    def _setup_model(self, cfg: DictConfig) -> modules.TransformerDecoder:
        with training.set_default_dtype(self._dtype), self._device:
            model = config.instantiate(cfg.model)
        weights = self._resume_dir or self._checkpoint_dir
        if weights is not None:
            load_hf_weights(model, weights)
            log.info(f"Loaded weights from {weights}")
        self._source_hf_config = None
        if self._checkpoint_dir is not None and (self._checkpoint_dir / "config.json").is_file():
            self._source_hf_config = json.loads((self._checkpoint_dir / "config.json").read_text())
        # The HF config is read off the model before AC/compile wrap its layers.
        self._hf_config = model_hf_config(model, self._dtype, self._source_hf_config)

        if self._ac:
            self._checkpointed_layers = apply_activation_checkpointing(model, every_n=self._ac_option)
        elif self._offload_activations:
            log.warning("enable_activation_offloading=True without activation checkpointing copies every activation "
                        "to the CPU and back: usually slower than enable_activation_checkpointing=True")
        self._activations_ctx = training.get_act_offloading_ctx_manager(model, self._offload_activations)
        if self._compile:
            training.compile_model(model)
            training.compile_loss(self._loss_fn)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        n_params = sum(p.numel() for p in model.parameters())
        log.info(f"Model: {n_params / 1e6:.1f}M parameters in {self._dtype} on {self._device}")
        return model

    def _setup_optimizer(self) -> None:
        path = self._cfg_optimizer._component_

        cfg_opt, extra = self._cfg_optimizer, {}
        if isinstance(cfg_opt.get("optimizer_class"), str):  # a wrapper's inner class (CPUOffloadOptimizer): import it
            extra["optimizer_class"] = _get_component_from_path(cfg_opt.optimizer_class)
            cfg_opt = OmegaConf.create({k: v for k, v in cfg_opt.items() if k != "optimizer_class"})

        def build(params):
            try:
                return config.instantiate(cfg_opt, params, **extra)
            except (TypeError, ValueError) as e:
                raise BadInput(f"optimizer={path} rejected its arguments ({_first_line(e)}); fix the optimizer.* keys") from None

        if self._optimizer_in_bwd:
            optim_dict = {p: build([p]) for p in self._model.parameters()}
            training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
            self._optim_wrapper = training.create_optim_in_bwd_wrapper(model=self._model, optim_dict=optim_dict)
            self._optimizer = None
            self._optimizers = list(optim_dict.values())
        else:
            self._optimizer = build(self._model.parameters())
            self._optimizers = [self._optimizer]
        log.info(f"Optimizer: {path}" + (" (in backward, one per parameter)" if self._optimizer_in_bwd else ""))
        warn_round_to_nearest(path, self._dtype)

    def _read_state_file(self, path: Path, mmap: bool = False) -> dict:
        """A recipe_state*.pt file, loaded weights_only (tensors and plain values only: see _common)."""
        fix = (f"resume from another checkpoint (an earlier step_N or epoch_E), or start a new run from its weights "
               f"with checkpoint_dir={path.parent} and no resume_from_checkpoint")
        state = load_state_file(path, mmap=mmap, fix=fix)
        if not isinstance(state, dict) or "optimizer" not in state or (path.name == RECIPE_STATE_FILE
                                                                       and "config" not in state):
            raise BadInput(f"{path} is not a recipe state file this recipe wrote; {fix}")
        return state

    def _resume_settings(self) -> Dict[str, Any]:
        """What RESUME_MUST_MATCH compares, for this run (saved under the same names in recipe_state.pt)."""
        return {"batch_size": self._batch_size, "gradient_accumulation_steps": self._accum, "seed": self._seed,
                "shuffle": self._shuffle, "packed": self._packed, "lr": self._cfg_optimizer.get("lr")}

    def _trim_metrics_for_resume(self) -> None:
        """A resumed run keeps the records up to its checkpoint's step and appends: each step is logged once."""
        dropped = _common.truncate_metrics(self._metrics_path, self._global_step)
        if dropped:
            log.info(f"metrics.jsonl: dropped {dropped} record(s) after step {self._global_step}, which this resume "
                     "trains again")

    def _saved_config(self) -> Dict[str, Any]:
        """The run's settings as recipe_state.pt keeps them: what a resume checks, plus what it reports.
        batch_size is this process's (the distributed recipe adds world_size and compares the global batch)."""
        return {**self._resume_settings(), "batch_size": self._batch_size,
                "optimizer": self._cfg_optimizer._component_, "optimizer_in_bwd": self._optimizer_in_bwd,
                "max_steps_per_epoch": self._max_steps_per_epoch, "epochs": self._total_epochs}

    def _check_resume_settings(self, saved: Dict[str, Any]) -> None:
        now = self._resume_settings()
        for key in RESUME_MUST_MATCH:
            if key not in saved or saved[key] == now[key]:  # (a key missing: a checkpoint from before the check)
                continue
            name = {"packed": "dataset.packed", "lr": "optimizer.lr"}.get(key, key)
            why = ("a resume continues the saved lr schedule" if key == "lr" else
                   "the data order and each step's samples would not match the interrupted run")
            raise BadInput(
                f"{name}={now[key]} differs from the checkpoint's {saved[key]} (resume_from_checkpoint="
                f"{self._resume_dir}): {why}; resume with {name}={saved[key]}, or start a new run from its weights "
                "with checkpoint_dir=... and no resume_from_checkpoint")

    def _log_nothing_left(self) -> None:
        if self._epoch >= self._total_epochs:
            self._nothing_left = (
                f"resume_from_checkpoint={self._resume_dir} is at global step {self._global_step}, already the end of "
                f"training with epochs={self._total_epochs}, max_steps_per_epoch={self._max_steps_per_epoch}")
            log.warning(f"{self._nothing_left}: nothing to train, nothing will be written. To train further, raise "
                        "epochs or max_steps_per_epoch (the lr schedule then differs from the finished run's)")

    def _load_resume_state(self, cfg: DictConfig) -> dict:
        state = self._read_state_file(self._resume_dir / RECIPE_STATE_FILE)
        saved = state["config"]
        if saved["optimizer"] != self._cfg_optimizer._component_ or saved["optimizer_in_bwd"] != self._optimizer_in_bwd:
            raise BadInput(
                f"resume_from_checkpoint={self._resume_dir} holds the state of optimizer={saved['optimizer']} "
                f"(optimizer_in_bwd={saved['optimizer_in_bwd']}); resume with those, or start a new run from its "
                "weights with checkpoint_dir=... and no resume_from_checkpoint"
            )
        self._check_resume_settings(saved)
        for key, now in (("max_steps_per_epoch", self._max_steps_per_epoch), ("epochs", self._total_epochs)):
            if saved.get(key) != now:
                log.warning(f"{key}={now} differs from the checkpoint's {saved.get(key)}: the lr schedule will not "
                            "match the interrupted run")
        try:
            if self._optimizer_in_bwd:
                self._optim_wrapper.load_state_dict(state["optimizer"])
            else:
                self._optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, RuntimeError) as e:
            raise BadInput(f"the optimizer state in {self._resume_dir / RECIPE_STATE_FILE} does not fit this model and "
                           f"optimizer ({_first_line(e)}); resume with the config that wrote it") from None
        if self._lr_scheduler is not None and state["lr_scheduler"] is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._epoch, self._steps_in_epoch = state["epoch"], state["steps_in_epoch"]
        self._global_step = state["global_step"]
        self._skipped_steps = int(state.get("skipped_steps", 0))
        log.info(f"Resuming from {self._resume_dir}: global step {self._global_step}, step {self._steps_in_epoch} "
                 f"of {self._steps_per_epoch} in epoch_{self._epoch}")
        if self._steps_in_epoch >= self._steps_per_epoch:
            self._epoch, self._steps_in_epoch = self._epoch + 1, 0
        self._log_nothing_left()
        return state

    def _setup_metric_logger(self, cfg: DictConfig):
        cfg_logger = cfg.get("metric_logger")
        # `metric_logger=null` on the CLI sets only its _component_ to null: both mean "off".
        if cfg_logger is None or not cfg_logger.get("_component_"):
            return None
        cfg_logger = OmegaConf.create(OmegaConf.to_container(cfg_logger, resolve=True))
        if cfg_logger._component_.endswith("WandBLogger") and "mode" not in cfg_logger:
            if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
                # No key: log offline into {log_dir}/wandb/offline-run-*; `wandb sync DIR` uploads it later.
                cfg_logger.mode = "offline"
                log.info("wandb: no WANDB_API_KEY, logging offline (upload later with `wandb sync`)")
        logger = config.instantiate(cfg_logger)
        self._wandb_dir = log_config(logger, cfg)
        return logger

    # ----------------------------------------------------------------------------------------
    # train
    # ----------------------------------------------------------------------------------------

    def _loss_step(self, batch: Dict[str, torch.Tensor]):
        """Forward and loss on one micro-batch; returns (mean loss, number of predicted tokens)."""
        labels = batch.pop("labels")
        # Token t predicts label t+1: shift left, pad the last position with the ignore index.
        labels = F.pad(labels[:, 1:], (0, 1), value=self._loss_fn.ignore_index)
        with self._activations_ctx:
            logits = self._model(**batch)
        if not isinstance(logits, list):  # chunked CE takes the list of chunks and [b, s] labels
            logits = logits.reshape(-1, logits.size(-1))
            labels_for_loss = labels.reshape(-1)
        else:
            labels_for_loss = labels
        loss = self._loss_fn(logits, labels_for_loss)
        return loss, (labels != self._loss_fn.ignore_index).sum()

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize()


    def _memory_metrics(self) -> Dict[str, float]:
        if self._device.type == "cuda":
            return {
                "peak_memory_alloc_gib": torch.cuda.max_memory_allocated(self._device) / 2**30,
                "peak_memory_reserved_gib": torch.cuda.max_memory_reserved(self._device) / 2**30,
            }
        return {"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # ru_maxrss is KiB

    def _current_lr(self) -> float:
        if self._optimizer_in_bwd:
            return float(self._optim_wrapper.get_optim_key("lr"))
        return float(self._optimizer.param_groups[0]["lr"])

    def _log(self, record: Dict[str, Any]) -> None:
        tqdm.write(" | ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()))
        with open(self._metrics_path, "a") as f:
            f.write(_common.strict_json(record) + "\n")
        if self._metric_logger is not None:
            self._metric_logger.log_dict({k: v for k, v in record.items() if k != "step" and v is not None},
                                         step=record["step"])

    # -- non-finite steps and stop signals ---------------------------------------------------------

    def _count_skip(self, skipped: bool, loss_value: float, grad_norm: Optional[float]) -> None:
        """Count a skipped (non-finite) step; too many in a row stop the run."""
        if not skipped:
            self._consecutive_skips = 0
            return
        self._skipped_steps += 1
        self._consecutive_skips += 1
        log.warning(f"step {self._global_step + 1}: loss {loss_value}, grad norm {grad_norm}: not finite, step "
                    f"skipped (no optimizer update; {self._consecutive_skips} in a row)")
        if self._consecutive_skips >= self._max_skips:
            raise NonFiniteStop(
                f"{self._consecutive_skips} steps in a row had a non-finite loss or gradient (last: step "
                f"{self._global_step + 1}, loss {loss_value}, grad norm {grad_norm}): training diverged; resume from "
                "the last checkpoint with a lower optimizer.lr or clip_grad_norm=1.0 (max_consecutive_skipped_steps="
                f"{self._max_skips} sets the limit)")

    def _nonfinite_elements(self) -> Optional[int]:
        """Our optimizers' count of non-finite gradient elements they skipped (None for other optimizers)."""
        counts = [o.nonfinite_count for o in self._optimizers if getattr(o, "nonfinite_count", None) is not None]
        return int(sum(int(c.sum()) for c in counts)) if counts else None

    def _on_signal(self, signum, frame) -> None:
        self._stop_signal = signum
        tqdm.write(f"{signal.Signals(signum).name}: saving a checkpoint at the end of this step, then stopping")

    def _install_signal_handlers(self) -> Dict[int, Any]:
        previous = {}
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            try:
                previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread
                pass
        return previous

    def train(self) -> None:
        """The training loop; SIGTERM/SIGUSR1 stop it at the next step boundary, after a checkpoint."""
        previous = self._install_signal_handlers()
        try:
            self._train()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _begin_epoch(self, epoch: int) -> int:
        """Point the sampler at `epoch`; in a resumed epoch, skip the samples the interrupted run already trained
        on (checkpoints sit on optimizer-step boundaries, so this is a whole number of micro-batches; with
        several ranks, each skips its own share). Returns the step the epoch starts from."""
        self._sampler.set_epoch(epoch)
        start = self._steps_in_epoch if epoch == self._epoch else 0
        if start:
            self._sampler.load_state_dict({"yielded": start * self._accum * self._batch_size})
        return start

    def _train(self) -> None:
        if self._compile:
            log.info("compile=True: the first steps compile and are slow")
        params = [p for p in self._model.parameters() if p.requires_grad]
        t_start, first_step_s, first_logged = time.perf_counter(), None, False
        timer = StepTimer(self._device)
        for epoch in range(self._epoch, self._total_epochs):
            start = self._begin_epoch(epoch)
            step_in_epoch = start
            pbar = tqdm(total=self._steps_per_epoch, initial=start, desc=epoch_label(epoch, self._total_epochs),
                        dynamic_ncols=True)
            running_loss = 0.0
            t0 = time.perf_counter()
            batches = iter(self._dataloader)
            while True:
                micro_batches = list(itertools.islice(batches, self._accum))
                if len(micro_batches) < self._accum:
                    break
                # The step's trained tokens are counted from the labels before any forward pass, so each
                # micro-batch's gradient arrives already divided by the step's total: no pass over the
                # gradients to rescale them afterwards, and optimizer-in-backward sees final gradients.
                counts = [count_trained_tokens(b["labels"], self._loss_fn.ignore_index) for b in micro_batches]
                num_tokens = sum(counts)
                for batch, ntok in zip(micro_batches, counts):
                    utils.batch_to_device(batch, self._device)
                    loss, _ = self._loss_step(batch)  # the mean over this micro-batch's tokens
                    (loss if ntok == num_tokens else loss * (ntok / max(num_tokens, 1))).backward()
                    running_loss += loss.detach() * ntok

                grad_norm, opt_timer, skipped = None, None, False
                loss_t = running_loss / max(num_tokens, 1)
                if not self._optimizer_in_bwd:
                    if self._clip is not None:  # (the recipe refuses clipping with CPU offload)
                        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=self._clip)
                    elif not self._offload:  # (CPU offload: the gradients are on the CPU already: loss only)
                        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                    # The step's one host sync (the loss .item() after the step before): loss and norm are checked
                    # before the optimizer may touch weights or state.
                    checked = [loss_t] + ([grad_norm] if grad_norm is not None else [])
                    values = torch.stack([t.detach().float().reshape(()) for t in checked]).tolist()
                    loss_value, grad_norm = values[0], (values[1] if grad_norm is not None else None)
                    skipped = not all(math.isfinite(v) for v in values)
                    if not skipped:
                        opt_timer = timer.start()
                        # (CPU offload: waits for the gradient copies, steps on the CPU, copies the weights back)
                        self._optimizer.step()
                        opt_timer.stop()
                    self._optimizer.zero_grad(set_to_none=True)
                    self._count_skip(skipped, loss_value, grad_norm)
                else:
                    loss_value = loss_t.item()  # waits for the step's GPU work
                    if not math.isfinite(loss_value):
                        raise NonFiniteStop(
                            f"loss is {loss_value} at step {self._global_step + 1} with optimizer_in_bwd=True: the "
                            "update was applied during backward and cannot be skipped; resume from the last "
                            "checkpoint with a lower optimizer.lr, or with optimizer_in_bwd=False (non-finite steps "
                            "are then skipped)")
                lr = self._current_lr()  # the lr this step used
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                step_in_epoch += 1
                self._global_step += 1

                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_value:.4f}")
                self._note_step(loss_value)
                if first_step_s is None:
                    first_step_s = time.perf_counter() - t_start
                if self._global_step % self._log_every == 0:
                    opt_ms = None if opt_timer is None else opt_timer.ms()
                    elapsed = time.perf_counter() - t0
                    record = {
                        "step": self._global_step,
                        "epoch": epoch,
                        "loss": loss_value,
                        "lr": lr,
                        "tokens": int(num_tokens),
                        "tokens_per_second": float(num_tokens) / elapsed,
                        **self._memory_metrics(),
                        "optimizer_step_ms": opt_ms,
                        "optimizer_state_bytes": optimizer_state_bytes(self._optimizers),
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                        "skipped_steps": self._skipped_steps,
                    }
                    nonfinite = self._nonfinite_elements()
                    if nonfinite is not None:
                        record["nonfinite_grad_elements"] = nonfinite
                    if first_step_s is not None and not first_logged:
                        record["first_step_s"] = first_step_s  # the first step of this process: compile included
                        first_logged = True
                    if self._compile:
                        record["compiled_graphs"] = compiled_graphs()
                    if not math.isfinite(loss_value):
                        log.warning(f"loss is {loss_value} at step {self._global_step}")
                    self._log(record)
                running_loss = 0.0

                if step_in_epoch == self._steps_per_epoch:
                    break
                # A periodic checkpoint that falls on an epoch's last step is skipped: the epoch
                # checkpoint written just after holds the same state.
                if self._step_checkpoint(epoch, step_in_epoch, pbar, stop=self._stop_signal is not None):
                    return
                t0 = time.perf_counter()
            pbar.close()
            self.save_checkpoint(f"epoch_{epoch}", epoch, step_in_epoch)
            self._steps_in_epoch = 0
            if self._stop_signal is not None:
                self._log_info(f"Stopped by {self._signal_name()} at the end of epoch_{epoch}")
                return

    # ----------------------------------------------------------------------------------------
    # checkpoints
    # ----------------------------------------------------------------------------------------

    def _step_checkpoint(self, epoch: int, step_in_epoch: int, pbar, *, stop: bool) -> bool:
        """At a step boundary: the periodic step_N checkpoint, or on a stop signal a last one and True (stop)."""
        name = f"step_{self._global_step}"
        if stop:
            self.save_checkpoint(name, epoch, step_in_epoch)
            pbar.close()
            self._log_info(f"Stopped by {self._signal_name()} after step {self._global_step}; continue with "
                           f"resume_from_checkpoint={self._output_dir / name}")
            return True
        if self._save_every and self._global_step % self._save_every == 0:
            self.save_checkpoint(name, epoch, step_in_epoch)
        return False

    def _signal_name(self) -> str:
        return signal.Signals(self._stop_signal).name if self._stop_signal is not None else "a signal"

    def _log_info(self, message: str) -> None:
        log.info(message)

    def save_checkpoint(self, name: str, epoch: int, steps_in_epoch: int) -> None:
        """Write ``{output_dir}/{name}/`` atomically: build it in a temp folder, then rename."""
        started = time.perf_counter()
        final = self._output_dir / name
        model_sd = self._model.state_dict()
        check_finite_weights(model_sd, final, self._global_step)
        tmp = _common.tmp_dir(self._output_dir, name)
        try:
            attn = self._model.layers[0].attn
            state = convert_weights.tune_to_hf(
                model_sd,
                num_heads=self._hf_config["num_attention_heads"],
                num_kv_heads=self._hf_config["num_key_value_heads"],
                dim=self._hf_config["hidden_size"],
                head_dim=attn.head_dim,
            )
            state = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
            save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
            (tmp / "config.json").write_text(json.dumps(self._hf_config, indent=2))
            generation = {"bos_token_id": self._hf_config["bos_token_id"], "eos_token_id": self._hf_config["eos_token_id"]}
            (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
            shutil.copyfile(self._tokenizer_path, tmp / "tokenizer.model")
            rng = _common.rng_state(self._device, all_cuda=True)
            torch.save(
                {
                    "epoch": epoch,
                    "steps_in_epoch": steps_in_epoch,
                    "global_step": self._global_step,
                    "skipped_steps": self._skipped_steps,
                    "optimizer": (self._optim_wrapper if self._optimizer_in_bwd else self._optimizer).state_dict(),
                    # Callables are left out: the in-backward wrapper patches `step` on the scheduler.
                    "lr_scheduler": None if self._lr_scheduler is None else {
                        k: v for k, v in self._lr_scheduler.state_dict().items() if not callable(v)
                    },
                    "rng": rng,
                    "config": self._saved_config(),
                },
                tmp / RECIPE_STATE_FILE,
            )
            _common.finish_dir(tmp)  # umask modes, fsync of every file and the folder
            _replace_dir(tmp, final)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            full = _common.disk_full_error(e, self._output_dir, final.name, checkpoint_bytes(model_sd, self._optimizers))
            if full is not None:
                raise full from None
            raise
        self._note_saved(final)
        announce_saved(final, started)

    # -- the end of a run ------------------------------------------------------------------------

    def _note_step(self, loss: float) -> None:
        self._last_trained = (self._global_step, loss)
        self._first_trained = self._first_trained or self._last_trained

    def _note_saved(self, folder: Path) -> None:
        self._saved = [p for p in self._saved if p != folder] + [folder]

    def summary(self) -> str:
        """One paragraph: the steps trained, time, first and last loss, and where metrics, checkpoints, wandb are."""
        first, last = self._first_trained or (None, None), self._last_trained or (None, None)
        stop = signal.Signals(self._stop_signal).name if self._stop_signal is not None else None
        return _common.run_summary(
            seconds=time.perf_counter() - self._t_start, first_step=first[0], last_step=last[0], first_loss=first[1],
            last_loss=last[1], skipped=self._skipped_steps, stop=stop, metrics_path=self._metrics_path,
            checkpoints=self._saved, wandb_dir=self._wandb_dir, nothing_left=self._nothing_left)

    def cleanup(self) -> None:
        if self._metric_logger is not None:
            self._metric_logger.close()


def set_log_level(cfg: DictConfig, show: bool = True) -> None:
    """``log_level``; at DEBUG the config is printed (torchtune's recipes print it always, 56 lines before any
    ``error:``). ``show=False`` (the distributed recipe's ranks other than 0): warnings only."""
    level = str(cfg.get("log_level", "INFO")).upper()
    if level not in ("DEBUG", "INFO", "WARNING"):
        raise BadInput(f"log_level={cfg.get('log_level')!r} is not a level; use log_level=INFO (default), DEBUG (also "
                       "prints the config) or WARNING")
    log.setLevel(level if show else "WARNING")
    log.debug("Config:\n" + OmegaConf.to_yaml(cfg))


def log_banner(recipe_path: str, output_dir: Path) -> None:
    """One line, once setup has passed every check, naming the recipe by its file: torchtune's own recipe of the
    same name (``tune run full_finetune_single_device``, no path) prints a "Running FullFinetuneRecipe..." dump."""
    log.info(f"Training with {recipe_path} (this repository's recipe; --help lists its config keys) into {output_dir}")


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = None
    try:
        set_log_level(cfg)
        recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
        recipe.setup(cfg=cfg)
        log_banner(RECIPE_PATH, recipe._output_dir)
        recipe.train()
        recipe.cleanup()
        tqdm.write(recipe.summary())
    except BadInput as e:
        # One line, no traceback: the message already names the value and the fix.
        tqdm.write(f"error: {e}", file=sys.stderr)  # (on a line of its own, below any progress bar)
        sys.exit(2)
    finally:
        if recipe is not None:
            recipe.release_output_dir()


if __name__ == "__main__":
    _common.print_help_if_asked(__doc__, KNOWN_CONFIG_KEYS)
    sys.exit(recipe_main())
