"""Full fine-tune of a Llama2-architecture model sharded over several devices with FSDP2.

Launch from the repository root (N processes, one per GPU; on the CPU, N processes over gloo):

    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py --config configs/tiny.yaml [key=value ...]
    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py --config configs/llama2/7B_full_distributed.yaml

It takes the single-device recipe's configs and overrides unchanged (tiny.yaml works as is) and shares that
recipe's config checks, data loading, loss and logging: this file holds only what sharding changes. Read
recipes/full_finetune_single_device.py for the features both have; here is what differs.

Features (each behind the config key in brackets):

    - Sharding (FSDP2) [fsdp_reshard_after_forward]: every transformer layer, then the whole model, goes
      through ``torch.distributed.fsdp.fully_shard`` (torchtune's ``training.shard_model``). Each rank holds
      1/N of every weight, gradient and optimizer state (rows split as evenly as possible, the last shard may
      be shorter or empty); a layer's full weights exist only while it computes. ``True`` (default) frees
      them after the forward and gathers them again in the backward (FULL_SHARD); ``False`` keeps them until
      the backward (SHARD_GRAD_OP: more memory, one all-gather fewer).
    - Backend [device]: ``cuda`` uses NCCL with one GPU per process (LOCAL_RANK); ``cpu`` uses gloo.
      Nothing here touches NCCL's environment. Launched without torchrun, the recipe runs as one rank.
    - Batching [batch_size, gradient_accumulation_steps]: ``batch_size`` is per rank, so one optimizer step
      sees ``batch_size * N * gradient_accumulation_steps`` samples. The loss is the mean over every
      unmasked token of the step on all ranks (token counts are all-reduced before the gradients are scaled),
      so 2 ranks x batch b give the update of one device with batch 2b.
    - Data order [seed, shuffle]: torchdata's StatefulDistributedSampler over one seeded permutation, rank r
      taking samples r, r+N, r+2N, ...; together the ranks read the same samples per step as the
      single-device recipe with the same global batch.
    - Gradient clipping [clip_grad_norm]: the norm over all ranks' gradient shards (DTensor
      ``clip_grad_norm_``), then each rank scales its shard.
    - Optimizer [optimizer]: as in the single-device recipe (``optimizer=optimizers.AdamW8bit`` etc., torch's
      backend flags dropped for classes without them). It receives the DTensor parameters; ``optimizers.*``
      quantize each rank's local shard (blocks never straddle ranks).
    - Random init [checkpoint_dir: null]: rank 0 builds the model exactly as the single-device recipe would
      (same seed, same device) and broadcasts it, so every rank count starts from the same weights.
    - Metrics [log_every_n_steps, metric_logger]: rank 0 logs one record per log step with the single-device
      keys, reduced over ranks: ``loss`` (mean over all ranks' tokens), ``tokens_per_second`` (all ranks) and
      ``tokens_per_second_per_gpu`` (that / N, per rank on a CPU), peak memory (the largest rank, plus
      ``..._per_rank`` lists), ``optimizer_step_ms`` (slowest rank), ``optimizer_state_bytes`` (sum over ranks,
      plus a per-rank list) and ``world_size``.
    - Checkpoints [save_every_n_steps, output_dir]: rank 0 gathers the full weights and writes the same Hugging
      Face folder as the single-device recipe. Resume state: ``recipe_state.pt`` (rank 0: progress, lr
      schedule, settings, and torch.optim's state gathered in full) plus ``recipe_state_rank{r}.pt`` per rank
      (that rank's RNG, and its shard of a quantized optimizer state, which cannot be gathered: see below).
    - Resume [resume_from_checkpoint]: restores weights, optimizer, lr schedule, data position and RNG; the
      run continues with the losses of an uninterrupted run. A state saved per rank (``optimizers.*``:
      quantization blocks live inside each rank's shard) resumes only on the same number of ranks; torch's
      AdamW state (saved in full) resumes on any number, with the same global batch for the same data order.

Packing (``dataset.packed=True``), activation checkpointing (``ac_mode``, ``ac_option``) and ``compile`` work as in
the single-device recipe; every rank packs the same rows and reads its share of them.

Non-finite steps (``max_consecutive_skipped_steps``), the run folder's lock and reuse rules (``overwrite``), strict
JSON metrics, SIGTERM/SIGUSR1 (every rank saves ``step_N`` at the same step boundary: the signal is folded into the
step's all-reduce of the loss) and the unknown-key check work as in the single-device recipe. The non-finite check
costs no extra host sync without clipping (the grad norm rides in the loss all-reduce, which is read on the host
anyway); with clipping it reads the clipped norm once per step.

A failure to write a checkpoint on any rank (a full disk on one node) is the same one-line error on every rank,
after each has finished its own part (an all-gather of each rank's outcome around the writes and around rank 0's
rename): no rank is left waiting for a crashed one, and nothing under the checkpoint's name is replaced. A stop
signal on one rank is acted on at the step boundary where the all-reduced flag shows it, the same on every rank.
The banner, ``--help``, ``log_level`` and the end-of-run summary work as in the single-device recipe, from rank 0.

Not supported here (each refused before training with one line): ``optimizer_in_bwd=True``,
``enable_activation_offloading=True``.
"""

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from recipes import _common

_common.quiet_known_noise()  # before torchtune imports torchao, in each rank (see _common.KNOWN_NOISE)

from safetensors.torch import save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtune import config, modules, training, utils
from torchtune.models import convert_weights
from tqdm import tqdm

from recipes.full_finetune_single_device import (
    KNOWN_CONFIG_KEYS,
    RECIPE_STATE_FILE,
    WEIGHTS_FILE,
    BadInput,
    FullFinetuneRecipeSingleDevice,
    NonFiniteStop,
    _first_line,
    _replace_dir,
    announce_saved,
    apply_activation_checkpointing,
    checkpoint_bytes,
    epoch_label,
    log_banner,
    set_log_level,
    model_hf_config,
    optimizer_state_bytes,
    read_hf_weight_files,
    resolve_optimizer,
    warn_round_to_nearest,
)

log = utils.get_logger("INFO")

RANK_STATE_FILE = "recipe_state_rank{rank}.pt"
RECIPE_PATH = "recipes/full_finetune_distributed.py"


def _init_process_group(device: torch.device) -> None:
    """NCCL for GPUs, gloo for the CPU. Without torchrun's variables, a world of one (handy for debugging)."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(training.get_distributed_backend(device.type))


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def optimizer_state_layout(optimizer: torch.optim.Optimizer) -> str:
    """``"full"`` if the state can be gathered into one unsharded state dict, else ``"per_rank"``.

    torch.optim keeps states shaped like the parameter (DTensors here), which torch's distributed state-dict
    utilities gather and re-shard for any rank count. Quantized states (ours: codes and block scales of the local
    shard, in flat buffers) are plain per-rank tensors with no global shape: only the rank that made them can
    load them.
    """
    for t in _tensors(dict(optimizer.state)):
        if t.dim() > 0 and not isinstance(t, DTensor):
            return "per_rank"
    return "full"


class CheckpointWriteError(BadInput):
    """A rank could not write its part of a checkpoint (every rank raises it: see _agree_written)."""


def _rng_state(device: torch.device) -> dict:
    return _common.rng_state(device)


class FullFinetuneRecipeDistributed(FullFinetuneRecipeSingleDevice):
    """FSDP2 full fine-tune; the module docstring lists what differs from the single-device recipe."""

    known_config_keys = KNOWN_CONFIG_KEYS + ("fsdp_reshard_after_forward",)

    def __init__(self, cfg: DictConfig) -> None:
        # The single-device checks (dtype, device, positive sizes, flag combinations) run first, and its
        # training.set_seed runs before the process group exists, so every rank is seeded with `seed` itself.
        super().__init__(cfg)
        if self._optimizer_in_bwd:
            raise BadInput("optimizer_in_bwd=True is not supported by the distributed recipe; set "
                           "optimizer_in_bwd=False (FSDP2 already shards the gradients N ways)")
        if self._offload_activations:
            raise BadInput("enable_activation_offloading=True is for one GPU; the distributed recipe shards weights, "
                           "gradients and states instead: set enable_activation_offloading=False")
        if self._offload:
            raise BadInput("optimizer=torchao.optim.CPUOffloadOptimizer is for one GPU; the distributed recipe shards "
                           "the optimizer state across GPUs instead: use the single-device recipe or another optimizer")
        _init_process_group(self._device)
        self._world, self._rank = dist.get_world_size(), dist.get_rank()
        self._rank0 = self._rank == 0
        self._reshard = bool(cfg.get("fsdp_reshard_after_forward", True))

    # ----------------------------------------------------------------------------------------
    # setup
    # ----------------------------------------------------------------------------------------

    def _agree(self, error: Optional[str]) -> None:
        """Raise BadInput on every rank if rank 0 found one (so no rank waits in a collective forever)."""
        box = [error]
        dist.broadcast_object_list(box, src=0)
        if box[0]:
            raise BadInput(box[0])

    def _claim_output_dir(self) -> None:
        """Rank 0 takes the folder's lock and repairs it; every rank learns whether that failed."""
        error = None
        if self._rank0:
            try:
                super()._claim_output_dir()
            except BadInput as e:
                error = str(e)
        self._agree(error)

    def _check_run_folder(self) -> None:
        self._agree(self._used_folder_error() if self._rank0 else None)

    def _resume_settings(self) -> Dict[str, Any]:
        # The global batch must match (another rank count with the same global batch resumes exactly).
        return dict(super()._resume_settings(), batch_size=self._world * self._batch_size)

    def _check_resume_settings(self, saved: Dict[str, Any]) -> None:
        super()._check_resume_settings(dict(saved, batch_size=saved.get("world_size", 1) * saved["batch_size"]))

    def setup(self, cfg: DictConfig) -> None:
        self._check_paths(cfg)
        self._cfg_optimizer = resolve_optimizer(cfg.optimizer)
        if self._resume_dir is not None:
            self._resume_state = self._read_resume_state()

        self._tokenizer = config.instantiate(cfg.tokenizer)
        self._loss_fn = config.instantiate(cfg.loss)
        self._setup_data(cfg.dataset, num_replicas=self._world, rank=self._rank)

        self._model = self._setup_model(cfg)
        self._setup_optimizer()
        self._lr_scheduler = None
        if cfg.get("lr_scheduler") is not None:
            self._lr_scheduler = config.instantiate(
                cfg.lr_scheduler, self._optimizer, num_training_steps=self._total_epochs * self._steps_per_epoch
            )

        self._check_tokenizer_fits_model()
        resume_rng = None
        if self._resume_dir is not None:
            resume_rng = self._load_resume_state(cfg)
        self._check_run_folder()

        self._metric_logger = self._setup_metric_logger(cfg) if self._rank0 else None
        self._metrics_path = self._output_dir / "metrics.jsonl"
        if self._rank0 and resume_rng is None and self._resume_dir is None and self._metrics_path.exists():
            self._metrics_path.unlink()
        if self._rank0 and self._resume_dir is not None:
            self._trim_metrics_for_resume()
        dist.barrier()
        if resume_rng is not None:
            _common.set_rng_state(resume_rng)
            if resume_rng.get("cuda") is not None and self._device.type == "cuda":
                torch.cuda.set_rng_state(resume_rng["cuda"], self._device)

    def _full_state_dict(self, cfg: DictConfig, meta_sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Rank 0's full (unsharded) weights: from an HF folder, or a fresh init like the single-device recipe's.

        Other ranks return {}: torch's set_model_state_dict broadcasts from rank 0.
        """
        if not self._rank0:
            self._agree(None)
            return {}
        weights = self._resume_dir or self._checkpoint_dir
        error = None
        if weights is None:
            with training.set_default_dtype(self._dtype), self._device:
                full = config.instantiate(cfg.model)
            sd = {k: v.detach() for k, v in full.state_dict().items()}
            del full
        else:
            try:
                sd = read_hf_weight_files(weights)
            except BadInput as e:
                self._agree(str(e))
            hf = self._hf_config
            try:
                sd = convert_weights.hf_to_tune(sd, num_heads=hf["num_attention_heads"],
                                                num_kv_heads=hf["num_key_value_heads"], dim=hf["hidden_size"],
                                                head_dim=hf["head_dim"])
            except (RuntimeError, KeyError) as e:  # a checkpoint of another size fails in the q/k permutation
                sd = {"(unconvertible)": torch.empty(0)}
                log.warning(f"could not convert the weights in {weights}: {e}")
            bad = sorted(set(sd) ^ set(meta_sd))
            bad += [k for k in sd if k in meta_sd and tuple(sd[k].shape) != tuple(meta_sd[k].shape)]
            if bad:
                error = (f"the weights in {weights} do not fit the model config (keys or shapes differ: "
                         f"{', '.join(bad[:5])}); make the config's model section match the checkpoint (e.g. "
                         "model._component_=torchtune.models.llama2.llama2_7b for Llama-2-7b-hf)")
            log.info(f"Loading weights from {weights}")
        self._agree(error)
        return sd

    def _load_full_weights(self, model: torch.nn.Module, full_sd: Dict[str, torch.Tensor]) -> None:
        """Scatter rank 0's full weights into the shards, one tensor at a time.

        The other ranks pass an empty tensor of the full shape, which distribute_tensor ignores (it scatters
        rank 0's data), so no rank but 0 ever holds more than one full tensor.
        """
        sharded = {}
        for name, meta in model.state_dict().items():
            full = full_sd.pop(name) if self._rank0 else torch.empty(meta.shape, dtype=meta.dtype, device=self._device)
            full = full.to(self._device, meta.dtype)
            sharded[name] = torch.nn.Parameter(
                distribute_tensor(full, meta.device_mesh, meta.placements, src_data_rank=0), requires_grad=True
            )
            del full
        model.load_state_dict(sharded, strict=True, assign=True)

    def _setup_model(self, cfg: DictConfig) -> modules.TransformerDecoder:
        # Build on the meta device (no memory), shard, then fill the shards from rank 0's full weights.
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(cfg.model)
        self._source_hf_config = None
        if self._checkpoint_dir is not None and (self._checkpoint_dir / "config.json").is_file():
            self._source_hf_config = json.loads((self._checkpoint_dir / "config.json").read_text())
        self._hf_config = model_hf_config(model, self._dtype, self._source_hf_config)
        meta_sd = model.state_dict()

        if self._ac:
            apply_activation_checkpointing(model, every_n=self._ac_option)
        self._activations_ctx = contextlib.nullcontext()
        if self._compile:
            training.compile_model(model, verbose=self._rank0)
        mesh = init_device_mesh(self._device.type, (self._world,), mesh_dim_names=("dp",))
        training.shard_model(
            model=model,
            shard_conditions=[lambda name, m: isinstance(m, modules.TransformerSelfAttentionLayer)],
            cpu_offload=False,
            reshard_after_forward=self._reshard,
            dp_mesh=mesh["dp"],
        )
        self._load_full_weights(model, self._full_state_dict(cfg, meta_sd))
        with training.set_default_dtype(self._dtype), self._device:
            for m in model.modules():
                if hasattr(m, "rope_init"):  # RoPE's cache is a buffer outside the state dict
                    m.rope_init()
        training.validate_no_params_on_meta_device(model)
        if self._compile:
            training.compile_loss(self._loss_fn, verbose=self._rank0)
        if self._loss_fn.__class__.__name__ == "CEWithChunkedOutputLoss":
            model.set_num_output_chunks(self._loss_fn.num_output_chunks)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        n_params = sum(p.numel() for p in model.parameters())
        utils.log_rank_zero(log, f"Model: {n_params / 1e6:.1f}M parameters in {self._dtype}, sharded over "
                                 f"{self._world} x {self._device.type} ({dist.get_backend()})")
        return model

    def _setup_optimizer(self) -> None:
        path = self._cfg_optimizer._component_
        try:
            self._optimizer = config.instantiate(self._cfg_optimizer, self._model.parameters())
        except (TypeError, ValueError) as e:
            raise BadInput(f"optimizer={path} rejected its arguments ({str(e).splitlines()[0]}); "
                           "fix the optimizer.* keys") from None
        self._optimizers = [self._optimizer]
        utils.log_rank_zero(log, f"Optimizer: {path}")
        if self._rank0:
            warn_round_to_nearest(path, self._dtype)

    def _read_resume_state(self) -> dict:
        """recipe_state.pt (memory-mapped), checked against this run before anything is built."""
        state = self._read_state_file(self._resume_dir / RECIPE_STATE_FILE, mmap=True)
        saved = state["config"]
        if saved["optimizer"] != self._cfg_optimizer._component_:
            raise BadInput(
                f"resume_from_checkpoint={self._resume_dir} holds the state of optimizer={saved['optimizer']}; "
                "resume with that, or start a new run from its weights with checkpoint_dir=... "
            )
        saved_world = saved.get("world_size", 1)
        layout = state.get("optimizer_layout", "full")
        if layout == "per_rank" and saved_world != self._world:
            raise BadInput(
                f"resume_from_checkpoint={self._resume_dir} was saved by {saved_world} ranks and its optimizer state "
                f"({saved['optimizer']}) is quantized per rank shard; resume with --nproc_per_node {saved_world}, "
                "or start a new run from its weights with checkpoint_dir=..."
            )
        rank_file = self._resume_dir / RANK_STATE_FILE.format(rank=self._rank)
        if not rank_file.is_file() and layout == "per_rank":
            raise BadInput(f"resume_from_checkpoint={self._resume_dir} lacks {rank_file.name}")
        return state

    def _load_resume_state(self, cfg: DictConfig) -> dict:
        """Restore optimizer, schedule and data position; return this rank's RNG state (restored last)."""
        state = self._resume_state
        saved, layout = state["config"], state.get("optimizer_layout", "full")
        saved_world = saved.get("world_size", 1)
        rank_file = self._resume_dir / RANK_STATE_FILE.format(rank=self._rank)
        self._check_resume_settings(saved)  # (the same on every rank: each read the same file)
        for key, now in (("max_steps_per_epoch", self._max_steps_per_epoch), ("epochs", self._total_epochs)):
            if saved.get(key) != now:
                utils.log_rank_zero(log, f"{key}={now} differs from the checkpoint's {saved.get(key)}: the lr "
                                         "schedule will not match the interrupted run")
        rank_state = self._read_state_file(rank_file) if rank_file.is_file() else {}
        try:
            if layout == "per_rank":
                self._optimizer.load_state_dict(rank_state["optimizer"])
            else:
                training.load_from_full_optimizer_state_dict(self._model, self._optimizer, state["optimizer"],
                                                             self._device)
        except (ValueError, KeyError, RuntimeError) as e:
            raise BadInput(f"the optimizer state in {self._resume_dir} does not fit this model and optimizer "
                           f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); resume with the config "
                           "that wrote it") from None
        if self._lr_scheduler is not None and state["lr_scheduler"] is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._epoch, self._steps_in_epoch = state["epoch"], state["steps_in_epoch"]
        self._global_step = state["global_step"]
        self._skipped_steps = int(state.get("skipped_steps", 0))
        utils.log_rank_zero(log, f"Resuming from {self._resume_dir} on {self._world} ranks: global step "
                                 f"{self._global_step}, step {self._steps_in_epoch} of {self._steps_per_epoch} in "
                                 f"epoch_{self._epoch}")
        if self._steps_in_epoch >= self._steps_per_epoch:
            self._epoch, self._steps_in_epoch = self._epoch + 1, 0
        if self._rank0:
            self._log_nothing_left()
        return rank_state.get("rng") if saved_world == self._world else None

    # ----------------------------------------------------------------------------------------
    # train
    # ----------------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _log(self, record: Dict[str, Any]) -> None:
        line = " | ".join(f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"
                          for k, v in record.items() if not isinstance(v, list))
        tqdm.write(line)
        with open(self._metrics_path, "a") as f:
            f.write(_common.strict_json(record) + "\n")
        if self._metric_logger is not None:
            flat = {}
            for k, v in record.items():
                if isinstance(v, list):  # per-rank lists become key/rank{r}
                    flat.update({f"{k}/rank{r}": x for r, x in enumerate(v)})
                elif k != "step" and v is not None:
                    flat[k] = v
            self._metric_logger.log_dict(flat, step=record["step"])

    def _reduced_record(self, step: int, epoch: int, loss: float, lr: float, num_tokens: int, elapsed: float,
                        opt_ms: Optional[float], grad_norm: Optional[float]) -> Dict[str, Any]:
        """One metrics record with every rank's numbers (called on all ranks: it gathers)."""
        mine = {"elapsed": elapsed, "opt_ms": opt_ms, "state_bytes": optimizer_state_bytes(self._optimizers),
                **self._memory_metrics()}
        every: List[dict] = [None] * self._world  # type: ignore[list-item]
        dist.all_gather_object(every, mine)
        wall = max(r["elapsed"] for r in every)
        record: Dict[str, Any] = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "tokens": int(num_tokens),
            "tokens_per_second": num_tokens / wall,
            "tokens_per_second_per_gpu": num_tokens / wall / self._world,
        }
        for key in mine:
            if key.startswith("peak_"):
                record[key] = max(r[key] for r in every)
                record[key + "_per_rank"] = [r[key] for r in every]
        record["optimizer_step_ms"] = None if opt_ms is None else max(r["opt_ms"] for r in every)
        record["optimizer_state_bytes"] = sum(r["state_bytes"] for r in every)
        record["optimizer_state_bytes_per_rank"] = [r["state_bytes"] for r in every]
        record["grad_norm"] = grad_norm
        record["skipped_steps"] = self._skipped_steps
        record["world_size"] = self._world
        return record

    def _train(self) -> None:
        params = [p for p in self._model.parameters() if p.requires_grad]
        for epoch in range(self._epoch, self._total_epochs):
            start = self._begin_epoch(epoch)  # (each rank skips its own share of the samples already trained on)
            step_in_epoch = start
            pbar = tqdm(total=self._steps_per_epoch, initial=start, desc=epoch_label(epoch, self._total_epochs),
                        dynamic_ncols=True, disable=not self._rank0)
            running_loss, num_tokens, micro = 0.0, 0, 0
            t0 = time.perf_counter()
            for batch in self._dataloader:
                utils.batch_to_device(batch, self._device)
                loss, ntok = self._loss_step(batch)
                (loss * ntok).backward()  # summed over tokens; divided by all ranks' tokens below
                running_loss += loss.detach() * ntok
                num_tokens += ntok
                micro += 1
                if micro % self._accum:
                    continue

                # Without clipping, the norm of the unscaled gradients (the same on every rank) rides in the
                # all-reduce below, so checking it costs no host sync of its own.
                raw_norm = None
                if self._clip is None:
                    raw_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                    if isinstance(raw_norm, DTensor):
                        raw_norm = raw_norm.full_tensor()
                # Loss and token count over all ranks. FSDP2 averages the gradient shards over ranks, so
                # the sum over all tokens is world/num_tokens times that average. (A signal on any rank stops all.)
                # (torch.full fills on the device from a kernel argument: no host-to-device copy)
                f64 = dict(dtype=torch.float64, device=self._device)
                totals = torch.stack([torch.as_tensor(running_loss, **f64), torch.as_tensor(num_tokens, **f64),
                                      torch.full((), float(self._stop_signal is not None), **f64),
                                      torch.full((), 0.0, **f64) if raw_norm is None else raw_norm.to(**f64)])
                dist.all_reduce(totals)
                total_loss, total_tokens, stop, norm_sum = totals.tolist()
                # Every rank decides from the reduced flag, never from its own: a signal that lands on one rank after
                # this all-reduce is folded into the next step's, so all ranks stop at the same boundary.
                stop_now = bool(stop)
                if stop_now and self._stop_signal is None:
                    self._stop_signal = signal.SIGTERM  # another rank's signal
                scale = self._world / max(total_tokens, 1)
                grad_norm = None
                if self._clip is not None:
                    training.scale_grads(self._model, torch.tensor(scale, dtype=torch.float32))
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=self._clip)
                    if isinstance(grad_norm, DTensor):
                        grad_norm = grad_norm.full_tensor()
                    grad_norm = float(grad_norm)  # one host sync per step: acceptable with clipping
                else:
                    grad_norm = norm_sum / self._world * scale
                skipped = not (math.isfinite(total_loss) and math.isfinite(grad_norm))
                opt_ms = None
                if not skipped:
                    if self._clip is None:
                        training.scale_grads(self._model, torch.tensor(scale, dtype=torch.float32))
                    self._sync()
                    t_opt = time.perf_counter()
                    self._optimizer.step()
                    self._sync()
                    opt_ms = (time.perf_counter() - t_opt) * 1000
                self._optimizer.zero_grad(set_to_none=True)
                self._count_skip(skipped, total_loss / max(total_tokens, 1), grad_norm)
                lr = float(self._optimizer.param_groups[0]["lr"])
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                step_in_epoch += 1
                self._global_step += 1

                loss_value = total_loss / total_tokens
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_value:.4f}")
                self._note_step(loss_value)
                if self._global_step % self._log_every == 0:
                    record = self._reduced_record(
                        self._global_step, epoch, loss_value, lr, int(total_tokens), time.perf_counter() - t0, opt_ms,
                        grad_norm)
                    if self._rank0:
                        self._log(record)
                running_loss, num_tokens = 0.0, 0

                if step_in_epoch == self._steps_per_epoch:
                    break
                if self._step_checkpoint(epoch, step_in_epoch, pbar, stop=stop_now):
                    return
                t0 = time.perf_counter()
            pbar.close()
            self.save_checkpoint(f"epoch_{epoch}", epoch, step_in_epoch)
            self._steps_in_epoch = 0
            if self._any_rank(self._stop_signal is not None):
                self._log_info(f"Stopped by {self._signal_name()} at the end of epoch_{epoch}")
                return

    # ----------------------------------------------------------------------------------------
    # checkpoints
    # ----------------------------------------------------------------------------------------

    def _log_info(self, message: str) -> None:
        utils.log_rank_zero(log, message)

    def _signal_name(self) -> str:
        return "a signal"  # (it may have reached another rank: every rank stops on the all-reduced flag)

    def save_checkpoint(self, name: str, epoch: int, steps_in_epoch: int) -> None:
        """Every rank calls this. Rank 0 writes the HF weights and recipe_state.pt, each rank its own
        recipe_state_rank{r}.pt, all into one temporary folder that rank 0 renames into place."""
        started = time.perf_counter()
        final = self._output_dir / name
        local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in self._model.state_dict().items()}
        bad = torch.tensor(float(not all(torch.isfinite(v).all() for v in local.values() if v.numel())),
                           device=self._device)
        dist.all_reduce(bad)  # every rank refuses together
        if bad.item():
            raise NonFiniteStop(f"the weights at step {self._global_step} are not finite: refused to write {final}; "
                                "resume from the last checkpoint with a lower optimizer.lr or clip_grad_norm=1.0")
        full_weights = training.gather_cpu_state_dict(self._model, self._rank0, self._device)
        layout = optimizer_state_layout(self._optimizer)
        full_optimizer = None
        if layout == "full":
            full_optimizer = training.get_full_optimizer_state_dict(self._model, self._optimizer, self._rank0,
                                                                   self._device)
        box = [str(_common.tmp_dir(self._output_dir, name)) if self._rank0 else None]
        dist.broadcast_object_list(box, src=0)
        tmp = Path(box[0])
        # Each rank writes its part; a failure on any rank (a full disk on one node) becomes the same error on all,
        # after the others have written theirs: no rank waits for a crashed one in a collective.
        error = None
        try:
            torch.save({"optimizer": self._optimizer.state_dict() if layout == "per_rank" else None,
                        "rng": _rng_state(self._device)},
                       tmp / RANK_STATE_FILE.format(rank=self._rank))
            if self._rank0:
                hf = self._hf_config
                state = convert_weights.tune_to_hf(full_weights, num_heads=hf["num_attention_heads"],
                                                   num_kv_heads=hf["num_key_value_heads"], dim=hf["hidden_size"],
                                                   head_dim=hf["head_dim"])
                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / WEIGHTS_FILE),
                          metadata={"format": "pt"})
                del state, full_weights
                (tmp / "config.json").write_text(json.dumps(hf, indent=2))
                generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
                (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
                shutil.copyfile(self._tokenizer_path, tmp / "tokenizer.model")
                torch.save(
                    {
                        "epoch": epoch,
                        "steps_in_epoch": steps_in_epoch,
                        "global_step": self._global_step,
                        "skipped_steps": self._skipped_steps,
                        "optimizer_layout": layout,
                        "optimizer": full_optimizer,
                        "lr_scheduler": None if self._lr_scheduler is None else self._lr_scheduler.state_dict(),
                        "rng": _rng_state(self._device),
                        "config": dict(self._saved_config(), optimizer_in_bwd=False, world_size=self._world),
                    },
                    tmp / RECIPE_STATE_FILE,
                )
        except Exception as e:
            error = e
        self._agree_written(error, tmp, final)  # every rank's file is written, or all raise
        error = None
        if self._rank0:
            try:
                _common.finish_dir(tmp)  # umask modes, fsync of every file and the folder
                _replace_dir(tmp, final)
            except Exception as e:
                error = e
        self._agree_written(error, tmp, final)  # nobody reads or overwrites it before it is in place
        self._note_saved(final)
        if self._rank0:
            announce_saved(final, started)

    def _agree_written(self, error: Optional[BaseException], tmp: Path, final: Path) -> None:
        """All ranks learn whether any failed to write; if one did, rank 0 removes the temporary folder and every
        rank raises the same one-line error (a full disk named as such). Nothing under ``final`` was touched."""
        message = None
        if error is not None:
            # rank 0: the full weights and (torch's layout) the gathered optimizer state; the others their shard
            opt = optimizer_state_bytes(self._optimizers)
            need = checkpoint_bytes(self._model.state_dict(), []) + opt * self._world if self._rank0 else opt
            full = _common.disk_full_error(error, self._output_dir, final.name, need)
            message = str(full) if full is not None else (
                f"rank {self._rank} could not write {final.name} ({_first_line(error)}); nothing was replaced: fix "
                f"the cause, or set output_dir=DIR to another folder")
        every: List[Optional[str]] = [None] * self._world
        dist.all_gather_object(every, message)
        failed = [m for m in every if m]
        if failed:
            if self._rank0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointWriteError(failed[0])

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (one small all-reduce)."""
        t = torch.tensor(float(flag), device=self._device)
        dist.all_reduce(t)
        return bool(t.item())

    def cleanup(self) -> None:
        super().cleanup()
        dist.destroy_process_group()


@config.parse
def recipe_main(cfg: DictConfig) -> None:
    rank = int(os.environ.get("RANK", "0"))
    recipe = None
    try:
        set_log_level(cfg, show=rank == 0)  # one banner and one set of progress lines, from rank 0
        recipe = FullFinetuneRecipeDistributed(cfg=cfg)
        recipe.setup(cfg=cfg)
        if rank == 0:
            log_banner(RECIPE_PATH, recipe._output_dir)
        recipe.train()
        recipe.cleanup()
        if rank == 0:
            tqdm.write(recipe.summary())
    except BadInput as e:
        # One line from rank 0 (every rank finds the same error), no traceback.
        if rank == 0:
            tqdm.write(f"error: {e}", file=sys.stderr)  # (on a line of its own, below any progress bar)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)
    finally:
        if recipe is not None:
            recipe.release_output_dir()


if __name__ == "__main__":
    _common.print_help_if_asked(__doc__, FullFinetuneRecipeDistributed.known_config_keys)
    sys.exit(recipe_main())
