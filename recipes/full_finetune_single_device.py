"""Full fine-tune of a Llama2-architecture model on one device (one GPU, or the CPU for tiny runs).

Launch from the repository root:

    tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml [key=value ...]

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
    - Activation checkpointing [enable_activation_checkpointing]: recompute each transformer layer
      in the backward pass; saves most activation memory for about 30 % more compute.
    - Compilation [compile]: ``torch.compile`` per transformer layer and on the loss; slow first
      step, faster after.
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
      steps and ``{output_dir}/epoch_{E}/`` at the end of each epoch, in Hugging Face format
      (config.json, model.safetensors, generation_config.json, tokenizer.model), with the resume
      state beside them in recipe_state.pt. Each is written to a temporary folder and renamed
      into place, so a crash never leaves a half-written checkpoint under a real name.
    - Initial weights [checkpoint_dir]: an HF checkpoint folder (e.g. Llama-2-7b-hf); ``null``
      keeps the random init (the tiny config).
    - Resume [resume_from_checkpoint]: a step_N or epoch_E folder; restores the weights, optimizer
      state, lr schedule, data position (epoch and step within it) and RNG, so the run continues
      with the losses it would have had without the interruption.
    - Metrics [log_every_n_steps, metric_logger]: every log step one record goes to stdout, to
      ``{output_dir}/metrics.jsonl`` and to ``metric_logger`` (wandb by default, offline when no
      WANDB_API_KEY is set; ``metric_logger=null`` turns it off). A tqdm bar shows progress.

Bad input (a path that does not exist, an optimizer that cannot be imported or rejects a kwarg,
malformed data, a non-positive lr or batch size, impossible flag combinations) stops the run
before training with one line naming the value and the fix, exit status 2, and nothing written
under existing checkpoints.
"""

import inspect
import json
import math
import os
import random
import resource
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config, modules, training, utils
from torchtune.config._utils import _get_component_from_path
from torchtune.data import padded_collate_sft
from torchtune.models import convert_weights
from tqdm import tqdm

log = utils.get_logger("INFO")

# Keyword arguments that only select torch.optim's implementation (not the math). Other
# optimizer libraries reject them; we drop them for a class that does not take them so that
# one config serves every optimizer. Any other rejected kwarg is a user error.
TORCH_BACKEND_FLAGS = ("fused", "foreach", "capturable", "differentiable")

# Loaders of HF `datasets` that read local files named in `data_files`.
LOCAL_DATASET_SOURCES = ("json", "csv", "parquet", "text", "arrow")

RECIPE_STATE_FILE = "recipe_state.pt"
WEIGHTS_FILE = "model.safetensors"


class BadInput(ValueError):
    """A config value that cannot work. The message names the value and the fix."""


def _positive(cfg: DictConfig, key: str, allow_none: bool = False, integer: bool = True):
    value = OmegaConf.select(cfg, key)
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
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


def _hf_weight_files(folder: Path) -> List[Path]:
    files = sorted(folder.glob("*.safetensors"))
    return files or sorted(folder.glob("pytorch_model*.bin"))


def load_hf_weights(model: modules.TransformerDecoder, folder: Path) -> None:
    """Load an HF Llama checkpoint folder (safetensors or .bin shards) into a torchtune model."""
    state: Dict[str, torch.Tensor] = {}
    for f in _hf_weight_files(folder):
        if f.suffix == ".safetensors":
            state.update(load_file(str(f)))
        else:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    attn = model.layers[0].attn
    state = convert_weights.hf_to_tune(
        state,
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        dim=model.tok_embeddings.weight.shape[1],
        head_dim=attn.head_dim,
    )
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        msg = " ".join(str(e).split())[:600]
        raise BadInput(
            f"the weights in {folder} do not fit the model config ({msg}); make the config's model section "
            "match the checkpoint (e.g. model._component_=torchtune.models.llama2.llama2_7b for Llama-2-7b-hf)"
        ) from None


def _replace_dir(tmp: Path, final: Path) -> None:
    """Move a finished checkpoint folder into place.

    rename(2) cannot replace a non-empty folder, so an existing one is first renamed aside and
    deleted only after the new one is in place: at every moment a complete checkpoint exists
    on disk (under its name, or under .old-* for the instant between the two renames).
    """
    if final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)


class FullFinetuneRecipeSingleDevice:
    """Full fine-tune on one device; the module docstring lists each feature and its flag."""

    def __init__(self, cfg: DictConfig) -> None:
        # Every scalar check runs here, before anything is built or written.
        dtype = cfg.get("dtype", "bf16")
        if dtype not in ("bf16", "fp32"):
            raise BadInput(f"dtype={dtype!r} is not supported; use dtype=bf16 or dtype=fp32")
        device = cfg.get("device", "cuda")
        if str(device).startswith("cuda") and not torch.cuda.is_available():
            raise BadInput(f"device={device} but no CUDA GPU is visible here; use device=cpu (slow beyond the tiny model)")
        self._device = utils.get_device(device=device)
        self._dtype = training.get_dtype(dtype, device=self._device)

        self._batch_size = _positive(cfg, "batch_size")
        self._total_epochs = _positive(cfg, "epochs")
        self._max_steps_per_epoch = _positive(cfg, "max_steps_per_epoch", allow_none=True)
        self._accum = _positive(cfg, "gradient_accumulation_steps")
        self._log_every = _positive(cfg, "log_every_n_steps")
        self._save_every = cfg.get("save_every_n_steps") or None
        if self._save_every is not None:
            self._save_every = _positive(cfg, "save_every_n_steps")
        self._clip = cfg.get("clip_grad_norm")
        if self._clip is not None:
            self._clip = _positive(cfg, "clip_grad_norm", integer=False)
        if OmegaConf.select(cfg, "optimizer.lr") is not None:
            _positive(cfg, "optimizer.lr", integer=False)

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

        self._seed = training.set_seed(seed=cfg.get("seed", 0))
        self._shuffle = bool(cfg.get("shuffle", True))
        self._ac = bool(cfg.get("enable_activation_checkpointing", False))
        self._compile = bool(cfg.get("compile", False))
        self._output_dir = Path(cfg.output_dir)

        # Position in training; overwritten by a resume.
        self._epoch = 0
        self._steps_in_epoch = 0
        self._global_step = 0

    # ----------------------------------------------------------------------------------------
    # setup: check every path, then build tokenizer, data, model, optimizer, schedule, loggers
    # ----------------------------------------------------------------------------------------

    def _setup_data(self, cfg_dataset: DictConfig, num_replicas: int, rank: int) -> None:
        """Dataset, sampler (rank r of N reads samples r, r+N, ...), dataloader and the steps per epoch."""
        self._dataset = self._setup_dataset(cfg_dataset)
        self._sampler = StatefulDistributedSampler(
            self._dataset, num_replicas=num_replicas, rank=rank, shuffle=self._shuffle, seed=self._seed
        )
        self._dataloader = DataLoader(
            self._dataset,
            batch_size=self._batch_size,
            sampler=self._sampler,
            collate_fn=partial(
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
                # its lr to all the others after each step.
                self._optim_wrapper.set_lr_scheduler(self._lr_scheduler)

        resume_state = None
        if self._resume_dir is not None:
            resume_state = self._load_resume_state(cfg)

        self._metric_logger = self._setup_metric_logger(cfg)
        self._metrics_path = self._output_dir / "metrics.jsonl"
        if resume_state is None and self._metrics_path.exists():
            self._metrics_path.unlink()  # a fresh run starts a fresh file; a resumed one appends
        if resume_state is not None:
            # RNG last, so nothing in setup shifts it after the restore.
            rng = resume_state["rng"]
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            if rng.get("cuda") is not None and self._device.type == "cuda":
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _check_paths(self, cfg: DictConfig) -> None:
        def fix_for(section: str, key: str, what: str) -> str:
            # Name the key the user actually sets: the folder the path is built from, if any.
            raw = str(OmegaConf.to_container(cfg[section], resolve=False).get(key, ""))
            if "${data_dir}" in raw:
                return f"set data_dir=DIR (the folder holding {what}, e.g. ../shared/data)"
            if "${checkpoint_dir}" in raw:
                return "set checkpoint_dir=DIR (the HF model folder, which holds tokenizer.model)"
            return f"set {section}.{key}=FILE"

        tok = Path(cfg.tokenizer.path)
        if not tok.is_file():
            raise BadInput(
                f"tokenizer.path={tok} does not exist; "
                + fix_for("tokenizer", "path", "llama2_tokenizer/tokenizer.model")
            )
        self._tokenizer_path = tok

        source = cfg.dataset.get("source")
        if source in LOCAL_DATASET_SOURCES:
            files = cfg.dataset.get("data_files")
            if files is None:
                raise BadInput(f"dataset.source={source} needs dataset.data_files=FILE")
            if isinstance(files, str):
                files = [files]
            elif OmegaConf.is_dict(files):
                files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
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
            if not self._checkpoint_dir.is_dir() or not _hf_weight_files(self._checkpoint_dir):
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

        try:
            self._output_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=self._output_dir, prefix=".write-test-"):
                pass
        except OSError as e:
            raise BadInput(
                f"output_dir={self._output_dir} is not writable ({e.strerror or e}); set output_dir=DIR to a folder you can write"
            ) from None

    def _setup_dataset(self, cfg_dataset: DictConfig):
        where = cfg_dataset.get("data_files") or cfg_dataset.get("source")
        if cfg_dataset.get("packed", False):
            raise BadInput("dataset.packed=True is not supported by this recipe; set dataset.packed=False")
        try:
            ds = config.instantiate(cfg_dataset, self._tokenizer)
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
        return ds

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
            training.set_activation_checkpointing(model, auto_wrap_policy={modules.TransformerSelfAttentionLayer})
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

    def _load_resume_state(self, cfg: DictConfig) -> dict:
        # Our own file, written by save_checkpoint: full unpickling is needed for the optimizer
        # states of bitsandbytes/torchao (tensor subclasses, python ints).
        state = torch.load(self._resume_dir / RECIPE_STATE_FILE, map_location="cpu", weights_only=False)
        saved = state["config"]
        if saved["optimizer"] != self._cfg_optimizer._component_ or saved["optimizer_in_bwd"] != self._optimizer_in_bwd:
            raise BadInput(
                f"resume_from_checkpoint={self._resume_dir} holds the state of optimizer={saved['optimizer']} "
                f"(optimizer_in_bwd={saved['optimizer_in_bwd']}); resume with those, or start a new run from its "
                "weights with checkpoint_dir=... and no resume_from_checkpoint"
            )
        for key, now in (
            ("batch_size", self._batch_size),
            ("gradient_accumulation_steps", self._accum),
            ("seed", self._seed),
            ("shuffle", self._shuffle),
            ("max_steps_per_epoch", self._max_steps_per_epoch),
            ("epochs", self._total_epochs),
        ):
            if saved.get(key) != now:
                log.warning(
                    f"{key}={now} differs from the checkpoint's {saved.get(key)}: the data order or lr schedule "
                    "will not match the interrupted run"
                )
        if self._optimizer_in_bwd:
            self._optim_wrapper.load_state_dict(state["optimizer"])
        else:
            self._optimizer.load_state_dict(state["optimizer"])
        if self._lr_scheduler is not None and state["lr_scheduler"] is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._epoch, self._steps_in_epoch = state["epoch"], state["steps_in_epoch"]
        self._global_step = state["global_step"]
        if self._steps_in_epoch >= self._steps_per_epoch:
            self._epoch, self._steps_in_epoch = self._epoch + 1, 0
        log.info(
            f"Resuming from {self._resume_dir}: epoch {self._epoch + 1}, step {self._steps_in_epoch} of the epoch, "
            f"global step {self._global_step}"
        )
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
        logger.log_config(cfg)
        return logger

    # ----------------------------------------------------------------------------------------
    # train
    # ----------------------------------------------------------------------------------------

    def _loss_step(self, batch: Dict[str, torch.Tensor]):
        """Forward and loss on one micro-batch; returns (mean loss, number of predicted tokens)."""
        labels = batch.pop("labels")
        # Token t predicts label t+1: shift left, pad the last position with the ignore index.
        labels = F.pad(labels[:, 1:], (0, 1), value=self._loss_fn.ignore_index)
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
            f.write(json.dumps(record) + "\n")
        if self._metric_logger is not None:
            self._metric_logger.log_dict({k: v for k, v in record.items() if k != "step" and v is not None},
                                         step=record["step"])

    def train(self) -> None:
        if self._compile:
            log.info("compile=True: the first steps compile and are slow")
        params = [p for p in self._model.parameters() if p.requires_grad]
        for epoch in range(self._epoch, self._total_epochs):
            self._sampler.set_epoch(epoch)
            start = self._steps_in_epoch if epoch == self._epoch else 0
            if start:
                # Skip the samples the interrupted run already trained on (checkpoints sit on
                # optimizer-step boundaries, so this is a whole number of micro-batches).
                self._sampler.load_state_dict({"yielded": start * self._accum * self._batch_size})
            step_in_epoch = start
            pbar = tqdm(total=self._steps_per_epoch, initial=start, desc=f"epoch {epoch + 1}/{self._total_epochs}",
                        dynamic_ncols=True)
            running_loss, num_tokens, micro = 0.0, 0, 0
            t0 = time.perf_counter()
            for batch in self._dataloader:
                utils.batch_to_device(batch, self._device)
                loss, ntok = self._loss_step(batch)
                if self._grads_final_in_backward:
                    # Each parameter steps (or its gradient leaves for the CPU) inside backward, so the
                    # gradient must already be the mean over tokens (accumulation is off in this mode).
                    loss.backward()
                else:
                    # Sum over tokens now, divide by all tokens of the step after the last micro-batch.
                    (loss * ntok).backward()
                running_loss += loss.detach() * ntok
                num_tokens += ntok
                micro += 1
                if micro % self._accum:
                    continue

                grad_norm, opt_ms = None, None
                if self._offload:
                    self._sync()
                    t_opt = time.perf_counter()
                    self._optimizer.step()  # waits for the gradient copies, steps on the CPU, copies weights back
                    self._sync()
                    opt_ms = (time.perf_counter() - t_opt) * 1000
                    self._optimizer.zero_grad(set_to_none=True)
                elif not self._optimizer_in_bwd:
                    training.scale_grads(self._model, 1 / num_tokens)
                    if self._clip is not None:
                        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=self._clip)
                    elif (self._global_step + 1) % self._log_every == 0:
                        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                    self._sync()
                    t_opt = time.perf_counter()
                    self._optimizer.step()
                    self._sync()
                    opt_ms = (time.perf_counter() - t_opt) * 1000
                    self._optimizer.zero_grad(set_to_none=True)
                lr = self._current_lr()  # the lr this step used
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                step_in_epoch += 1
                self._global_step += 1

                loss_value = (running_loss / num_tokens).item()
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_value:.4f}")
                if self._global_step % self._log_every == 0:
                    elapsed = time.perf_counter() - t0
                    record = {
                        "step": self._global_step,
                        "epoch": epoch,
                        "loss": loss_value,
                        "lr": lr,
                        "tokens_per_second": float(num_tokens) / elapsed,
                        **self._memory_metrics(),
                        "optimizer_step_ms": opt_ms,
                        "optimizer_state_bytes": optimizer_state_bytes(self._optimizers),
                        "grad_norm": None if grad_norm is None else float(grad_norm),
                    }
                    if not math.isfinite(loss_value):
                        log.warning(f"loss is {loss_value} at step {self._global_step}")
                    self._log(record)
                running_loss, num_tokens = 0.0, 0

                if step_in_epoch == self._steps_per_epoch:
                    break
                # A periodic checkpoint that falls on an epoch's last step is skipped: the epoch
                # checkpoint written just after holds the same state.
                if self._save_every and self._global_step % self._save_every == 0:
                    self.save_checkpoint(f"step_{self._global_step}", epoch, step_in_epoch)
                t0 = time.perf_counter()
            pbar.close()
            self.save_checkpoint(f"epoch_{epoch}", epoch, step_in_epoch)
            self._steps_in_epoch = 0

    # ----------------------------------------------------------------------------------------
    # checkpoints
    # ----------------------------------------------------------------------------------------

    def save_checkpoint(self, name: str, epoch: int, steps_in_epoch: int) -> None:
        """Write ``{output_dir}/{name}/`` atomically: build it in a temp folder, then rename."""
        final = self._output_dir / name
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=self._output_dir))
        try:
            attn = self._model.layers[0].attn
            state = convert_weights.tune_to_hf(
                self._model.state_dict(),
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
            rng = {
                "torch": torch.get_rng_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if self._device.type == "cuda" else None,
            }
            torch.save(
                {
                    "epoch": epoch,
                    "steps_in_epoch": steps_in_epoch,
                    "global_step": self._global_step,
                    "optimizer": (self._optim_wrapper if self._optimizer_in_bwd else self._optimizer).state_dict(),
                    # Callables are left out: the in-backward wrapper patches `step` on the scheduler.
                    "lr_scheduler": None if self._lr_scheduler is None else {
                        k: v for k, v in self._lr_scheduler.state_dict().items() if not callable(v)
                    },
                    "rng": rng,
                    "config": {
                        "optimizer": self._cfg_optimizer._component_,
                        "optimizer_in_bwd": self._optimizer_in_bwd,
                        "batch_size": self._batch_size,
                        "gradient_accumulation_steps": self._accum,
                        "seed": self._seed,
                        "shuffle": self._shuffle,
                        "max_steps_per_epoch": self._max_steps_per_epoch,
                        "epochs": self._total_epochs,
                    },
                },
                tmp / RECIPE_STATE_FILE,
            )
            # mkdtemp makes a private (0700) folder; give the checkpoint the usual umask modes.
            umask = os.umask(0)
            os.umask(umask)
            for f in tmp.iterdir():
                f.chmod(0o666 & ~umask)
            tmp.chmod(0o777 & ~umask)
            _replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        tqdm.write(f"Saved checkpoint {final}")

    def cleanup(self) -> None:
        if self._metric_logger is not None:
            self._metric_logger.close()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    config.log_config(recipe_name="FullFinetuneRecipeSingleDevice", cfg=cfg)
    try:
        recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
        recipe.setup(cfg=cfg)
    except BadInput as e:
        # One line, no traceback: the message already names the value and the fix.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())
