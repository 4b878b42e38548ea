"""Full fine-tune of a Llama 2 / 3.x, Qwen 2.5 / 3 or Mistral model sharded over N processes with FSDP2.

    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py --config configs/tiny.yaml [key=value ...]
    tune run --nproc_per_node 2 recipes/full_finetune_distributed.py --config configs/llama2/7B_full_distributed.yaml
    python -m recipes.launch --nproc_per_node 2 recipes/full_finetune_distributed.py ...  # SIGTERM/SIGUSR1 save, exit 0

One process per GPU (on the CPU, N processes over gloo). It reads every key of
recipes/full_finetune_single_device.py with the same meaning; the manual is docs/recipes.md, "The distributed
recipe: what changes" (--help=all prints it, then the config's keys), and docs/distributed.md how it shards.
The keys that differ:

    fsdp_reshard_after_forward       True (default): free gathered layers after forward; False: keep them
    device                           cuda: NCCL, one GPU per process (LOCAL_RANK); cpu: gloo
    batch_size                       per rank: a step sees batch_size x N x gradient_accumulation_steps
    checkpoint_dir                   rank 0 reads it (or builds the random init) and scatters it
    resume_from_checkpoint           any N's or the single-device recipe's checkpoint (same samples per step)
    metric_logger                    rank 0 logs, reduced over ranks (+ *_per_rank lists, world_size)
    dataset_val                      each rank validates its share; val_loss reduced over ranks
    profiler                         every rank records (a trace per rank); rank 0 prints the summary
    optimizer_in_bwd                 not supported (refused)
    enable_activation_offloading     not supported (refused)
    optimizer                        as single-device; torchao.optim.CPUOffloadOptimizer refused
    fp8                              as single-device: FP8 matmuls; the FSDP2 all-gathers stay in bf16
    packed_attention                 as single-device
    async_checkpoint                 each rank snapshots its part; the ranks agree in the step's all-reduce
"""

import contextlib
import math
import os
import sys
import time
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig

from finetune.reporting import console

console.quiet_known_noise()  # before torchtune imports torchao, in each rank (see console.KNOWN_NOISE)

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torchtune import config, modules, training, utils
from tqdm import tqdm

from finetune.base import BadInput, NonFiniteStop, diverged_fix
from finetune.checkpoint import hf_format, resume
from finetune.checkpoint.async_save import Gather, Owned
from finetune.checkpoint.checkpointer import RECIPE_STATE_FILE, rng_state, set_rng_state
from finetune.checkpoint.optimizer_state import gather_full, load_full, restore
from finetune.checkpoint.run_folder import DistributedRanks, RunFolder
from finetune.data.loading import skip_to
from finetune.data.tokenizer import check_fits_model
from finetune.launch import follow_launcher
from finetune.model.attention import use_varlen_attention
from finetune.model.prepare import (
    apply_activation_checkpointing,
    convert_to_fp8,
    prepare_device,
    wire_loss,
)
from finetune.model.sharding import init_process_group, scatter_full_weights
from finetune.optimizer import warn_round_to_nearest
from finetune.reporting.console import StepTimer
from finetune.reporting.metrics import interrupted, step_record
from finetune.reporting.wandb_run import push_summary
from finetune.services import build_data, build_reporting, report_out_of_memory
from finetune.settings import DISTRIBUTED_CONFIG_KEYS, command_line, first_line, read_settings
from finetune.stops import SkipCounter, StopSignal

log = utils.get_logger("INFO")

RECIPE_PATH = "recipes/full_finetune_distributed.py"
MANUAL = "docs/recipes.md"


class FullFinetuneRecipeDistributed:
    """FSDP2 full fine-tune: ``setup``, ``train``, ``cleanup``; docs/distributed.md is the manual."""

    def __init__(self, cfg: DictConfig) -> None:
        # Every check of the config runs first, and the seed is set before the process group exists, so every rank
        # is seeded with `seed` itself.
        self.settings = s = read_settings(cfg, distributed=True)
        training.set_seed(seed=s.training.seed)
        prepare_device(s.device, s.memory.memory_limit_gib)
        self._device, self._dtype = s.device, s.dtype
        init_process_group(self._device)
        self._ranks = DistributedRanks()
        self._world, self._rank, self._rank0 = self._ranks.world, self._ranks.rank, self._ranks.main
        self._folder = RunFolder(s.output_dir, self._ranks)
        self.epoch, self.steps_in_epoch, self.global_step = 0, 0, 0
        self._skips = SkipCounter(s.training.max_skips, log)
        self._stop = StopSignal()
        self.nothing_left: Optional[str] = None  # a resume from the end of training: the line it ends with

    # ----------------------------------------------------------------------------------------
    # setup
    # ----------------------------------------------------------------------------------------

    def setup(self, cfg: DictConfig) -> None:
        s = self.settings
        # Listen for a stop signal from here on (recipes/launch.py passes one on only once this rank listens): one
        # that arrives during setup stops the run after it: nothing trained, no checkpoint written.
        self._stop.install()
        follow_launcher()  # a launcher that dies outright sends this rank SIGTERM: no rank trains on alone
        self._folder.claim(log)
        data = build_data(cfg, s, log, ranks=self._ranks)
        self._tokenizer, self._loss_fn = data.tokenizer, data.loss_fn
        self._dataloader, self._sampler, self._steps_per_epoch = data.dataloader, data.sampler, data.steps_per_epoch

        self._model = self._setup_model(cfg)
        self._val = data.validation.using(self._model, self._loss_step)  # (dataset_val: finetune/validation.py)
        self._optimizer = s.training.optimizer.build(self._model.parameters())
        self._optimizers = [self._optimizer]
        utils.log_rank_zero(log, f"Optimizer: {s.training.optimizer.path}")
        if self._rank0:
            warn_round_to_nearest(s.training.optimizer.path, self._dtype)
        self._lr_scheduler = None
        if s.training.lr_scheduler is not None:  # (None: constant lr)
            self._lr_scheduler = config.instantiate(
                s.training.lr_scheduler, self._optimizer, num_training_steps=s.training.epochs * self._steps_per_epoch
            )

        check_fits_model(self._tokenizer, self._hf_config, self.settings.data.tokenizer_path)
        resume_rng = self._load_resume_state() if s.checkpoint.resume_dir is not None else None
        if self.nothing_left:  # (every rank: before the folder's run is touched, as the single-device recipe)
            return
        self._folder.refuse_reuse(resume_dir=s.checkpoint.resume_dir, overwrite=s.checkpoint.overwrite, log=log)
        # The checkpointer (every rank writes its part), profiler, and on rank 0 the metric logger (wandb),
        # metrics.jsonl and the summary the run ends with.
        report = build_reporting(
            cfg,
            s,
            self._folder,
            self._family,
            self._hf_config,
            log=log,
            resume_step=None if s.checkpoint.resume_dir is None else self.global_step,
            ranks=self._ranks,
        )
        self._checkpointer, self._profiler, self._identity = report.checkpointer, report.profiler, report.identity
        self._logger, self._metrics, self._summary = report.logger, report.metrics, report.summary
        dist.barrier()
        if resume_rng is not None:
            set_rng_state(resume_rng)
            if resume_rng.get("cuda") is not None and self._device.type == "cuda":
                torch.cuda.set_rng_state(resume_rng["cuda"], self._device)

    def _setup_model(self, cfg: DictConfig) -> modules.TransformerDecoder:
        # Build on the meta device (no memory), shard, then fill the shards from rank 0's full weights.
        s = self.settings
        with training.set_default_dtype(self._dtype), torch.device("meta"):
            model = config.instantiate(s.model.section)
        if s.model.note:
            utils.log_rank_zero(log, s.model.note)
        self._family = hf_format.FAMILIES[s.model.family]
        self._hf_config = hf_format.hf_config(model, self._dtype, s.model.source_config, self._family, self._tokenizer)
        meta_sd = model.state_dict()

        if s.memory.fp8 is not None:  # (the all-gathers stay bf16: FP8 is in the matmuls)
            utils.log_rank_zero(
                log, f"fp8={s.memory.fp8}: {convert_to_fp8(model, s.memory.fp8)} linear layers run their matmuls in FP8"
            )
        if s.data.packed_attention == "varlen":
            utils.log_rank_zero(
                log,
                f"packed_attention=varlen: {use_varlen_attention(model)} attention layers use "
                "FlashAttention's variable-length kernel",
            )
        if s.memory.ac_every is not None:
            apply_activation_checkpointing(model, every_n=s.memory.ac_every)
        self._activations_ctx = contextlib.nullcontext()
        if s.memory.compile:
            training.compile_model(model, verbose=self._rank0)
        mesh = init_device_mesh(self._device.type, (self._world,), mesh_dim_names=("dp",))
        training.shard_model(
            model=model,
            shard_conditions=[lambda name, m: isinstance(m, modules.TransformerSelfAttentionLayer)],
            cpu_offload=False,
            reshard_after_forward=s.memory.reshard_after_forward,
            dp_mesh=mesh["dp"],
        )
        # The root (embeddings, final norm, output layer) stays gathered from its forward to its backward, as FSDP2
        # does by default for a root: a loss that applies the output layer itself (finetune.model
        # .LinearCrossEntropyLoss) reads its weight after the forward, and a resharded weight's full_tensor() gives
        # each rank the gradient of its own tokens only, never reduced over the ranks. (Backward would gather the
        # root again at once anyway: the cost is one all-gather less, not more memory at the peak.)
        model.set_reshard_after_forward(False, recurse=False)
        scatter_full_weights(model, self._full_state_dict(cfg, meta_sd), main=self._rank0, device=self._device)
        with training.set_default_dtype(self._dtype), self._device:
            for m in model.modules():
                if hasattr(m, "rope_init"):  # RoPE's cache is a buffer outside the state dict
                    m.rope_init()
        training.validate_no_params_on_meta_device(model)
        wire_loss(model, self._loss_fn, compiled=s.memory.compile, verbose=self._rank0)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        n_params = sum(p.numel() for p in model.parameters())
        utils.log_rank_zero(
            log,
            f"Model: {n_params / 1e6:.1f}M parameters in {self._dtype}, sharded over "
            f"{self._world} x {self._device.type} ({dist.get_backend()})",
        )
        return model

    def _full_state_dict(self, cfg: DictConfig, meta_sd: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Rank 0's full (unsharded) weights: from an HF folder, or a fresh init like the single-device recipe's.

        Other ranks return {}: the shards are scattered from rank 0.
        """
        if not self._rank0:
            self._ranks.agree(None)
            return {}
        s = self.settings
        weights = s.checkpoint.resume_dir or s.checkpoint.checkpoint_dir
        error, sd = None, {}
        if weights is None:
            with training.set_default_dtype(self._dtype), self._device:
                full = config.instantiate(s.model.section)
            sd = {k: v.detach() for k, v in full.state_dict().items()}
            del full
        else:
            try:
                sd = hf_format.read_weights(weights)
                sd = hf_format.to_tune(sd, self._hf_config, self._family)
            except BadInput as e:
                error = str(e)
            except (RuntimeError, KeyError) as e:  # a checkpoint of another size fails in the q/k permutation
                detail = " ".join(str(e).split())[:600]
                error = str(hf_format.misfit_error(weights, detail, config_json=s.model.source_path))
            if error is None:
                bad = sorted(set(sd) ^ set(meta_sd))
                bad += [k for k in sd if k in meta_sd and tuple(sd[k].shape) != tuple(meta_sd[k].shape)]
                if bad:
                    detail = f"keys or shapes differ: {', '.join(bad[:5])}"
                    error = str(hf_format.misfit_error(weights, detail, config_json=s.model.source_path))
            log.info(f"Loading weights from {weights}")
        self._ranks.agree(error)
        return sd

    def _run_settings(self) -> Dict[str, Any]:
        """The settings recipe_state.pt keeps (``resume.RESUME_TABLE``), with the rank count: a resume compares
        the samples per step (batch_size x gradient_accumulation_steps x ranks), so another rank count with the same
        global batch resumes exactly."""
        s = self.settings
        return resume.run_settings(
            s.training, s.data, dtype_name=s.dtype_name, fp8=s.memory.fp8, world_size=self._world
        )

    def _load_resume_state(self) -> Optional[dict]:
        """Restore optimizer, schedule and data position; return this rank's RNG state (restored last)."""
        s = self.settings
        state = resume.read_resume(
            s.checkpoint.resume_dir, now=self._run_settings(), mmap=True, log=log if self._rank0 else None
        )
        saved_world = state["config"].get("world_size", 1)
        layout = state.get("optimizer_layout", "full")  # (per_rank: read_resume refused another rank count)
        # Every rank reads its own file and loads its own shard; any rank's failure stops all of them together.
        rank_state = resume.read_rank_state(s.checkpoint.resume_dir, self._ranks, required=layout == "per_rank")
        error = None
        try:
            if layout == "per_rank":
                self._optimizer.load_state_dict(rank_state["optimizer"])
            else:  # (any rank count's, or one device's; another optimizer class's converted first)
                full = restore(
                    state,
                    self._optimizers,
                    self._model,
                    now=s.training.optimizer.path,
                    log=self._rank0 and log,
                    source=s.checkpoint.resume_dir / RECIPE_STATE_FILE,
                )
                load_full(self._model, self._optimizer, full, self._device)
        except BadInput as e:  # (a damaged state: restore's own line, the same on every rank)
            error = str(e)
        except (ValueError, KeyError, RuntimeError) as e:
            error = (
                f"the optimizer state in {s.checkpoint.resume_dir} does not fit this model and optimizer "
                f"({first_line(e)}); resume with the config that wrote it"
            )
        self._ranks.agree_any(error)
        if self._lr_scheduler is not None and state["lr_scheduler"] is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._skips.restore(state, resumed_from=s.checkpoint.resume_dir)
        utils.log_rank_zero(
            log,
            f"Resuming from {s.checkpoint.resume_dir} on {self._world} ranks: global step "
            f"{state['global_step']}, step {state['steps_in_epoch']} of {self._steps_per_epoch} "
            f"in epoch_{state['epoch']}",
        )
        self.epoch, self.steps_in_epoch, self.global_step = resume.progress_after(state, self._steps_per_epoch)
        if self.epoch >= s.training.epochs:
            self.nothing_left = resume.nothing_left(
                s.checkpoint.resume_dir, self.global_step, s.training.epochs, s.training.max_steps_per_epoch
            )
        return rank_state.get("rng") if saved_world == self._world else None

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
        ntok = (labels != self._loss_fn.ignore_index).sum()
        if not isinstance(logits, list):  # chunked CE takes the list of chunks and [b, s] labels
            logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        return self._loss_fn(logits, labels), ntok

    def _reduced_record(self, step, epoch, loss, lr, num_tokens, elapsed, opt_ms, grad_norm) -> Dict[str, Any]:
        """One metrics record with every rank's numbers (called on all ranks: it gathers); opt_ms and grad_norm may
        be None."""
        mine = {
            "elapsed": elapsed,
            "opt_ms": opt_ms,
            "state_bytes": console.optimizer_state_bytes(self._optimizers),
            **console.memory_metrics(self._device),
        }
        return step_record(
            step=step,
            epoch=epoch,
            loss=loss,
            lr=lr,
            tokens=num_tokens,
            ranks=self._ranks.gather(mine),
            grad_norm=grad_norm,
            skipped=self._skips.skipped,
            world=self._world,
        )

    def train(self) -> None:
        """The training loop. A stop signal on any rank ends it on every rank at one step boundary, after a
        checkpoint (the signal is folded into the step's all-reduce of the loss); one that came during setup ends
        it before the first step. It returns once the last checkpoint is written by every rank."""
        if self._any_rank(self._stop.received):
            utils.log_rank_zero(log, "Stopped by a signal during setup: nothing trained, no checkpoint written")
            self._summary.stop = self._stop.name or "SIGTERM"
            return
        with self._profiler:
            try:
                self._train()
            except BadInput:  # (raised on every rank at the same point: they can still agree on the write)
                self._checkpointer.settle()
                raise
            self._checkpointer.wait()

    def _train(self) -> None:
        s = self.settings
        params = [p for p in self._model.parameters() if p.requires_grad]
        self._summary.training_started()
        for epoch in range(self.epoch, s.training.epochs):
            start = self.steps_in_epoch if epoch == self.epoch else 0
            skip_to(
                self._sampler, epoch, start, s.training.accum * s.data.batch_size
            )  # (each rank skips its own share)
            step_in_epoch = start
            pbar = tqdm(
                total=self._steps_per_epoch,
                initial=start,
                desc=console.epoch_label(epoch, s.training.epochs),
                dynamic_ncols=True,
                disable=not self._rank0,
            )
            running_loss, num_tokens, micro = 0.0, 0, 0
            t0 = time.perf_counter()
            for batch in self._dataloader:
                utils.batch_to_device(batch, self._device)
                loss, ntok = self._loss_step(batch)
                (loss * ntok).backward()  # summed over tokens; divided by all ranks' tokens below
                running_loss += loss.detach() * ntok
                num_tokens += ntok
                micro += 1
                if micro % s.training.accum:
                    continue

                # Without clipping, the norm of the unscaled gradients (the same on every rank) rides in the
                # all-reduce below, so checking it costs no host sync of its own.
                raw_norm = None
                if s.training.clip is None:
                    raw_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                    if isinstance(raw_norm, DTensor):
                        raw_norm = raw_norm.full_tensor()
                # Loss and token count over all ranks. FSDP2 averages the gradient shards over ranks, so
                # the sum over all tokens is world/num_tokens times that average. (A signal on any rank stops all.)
                # (torch.full fills on the device from a kernel argument: no host-to-device copy)
                # (So do the ranks still writing a checkpoint in the background: published once none is.)
                f64 = dict(dtype=torch.float64, device=self._device)
                totals = torch.stack(
                    [
                        torch.as_tensor(running_loss, **f64),
                        torch.as_tensor(num_tokens, **f64),
                        torch.full((), float(self._stop.received), **f64),
                        torch.full((), 0.0, **f64) if raw_norm is None else raw_norm.to(**f64),
                        torch.full((), float(self._checkpointer.writing), **f64),
                    ]
                )
                dist.all_reduce(totals)
                total_loss, total_tokens, stop, norm_sum, writing = totals.tolist()
                # Every rank decides from the reduced flag, never from its own: a signal that lands on one rank after
                # this all-reduce is folded into the next step's, so all ranks stop at the same boundary.
                stop_now = bool(stop)
                scale = self._world / max(total_tokens, 1)
                grad_norm = None
                if s.training.clip is not None:
                    training.scale_grads(self._model, torch.tensor(scale, dtype=torch.float32))
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=s.training.clip)
                    if isinstance(grad_norm, DTensor):
                        grad_norm = grad_norm.full_tensor()
                    grad_norm = float(grad_norm)  # one host sync per step: acceptable with clipping
                else:
                    grad_norm = norm_sum / self._world * scale
                skipped = not (math.isfinite(total_loss) and math.isfinite(grad_norm))
                opt_ms = None
                if not skipped:
                    if s.training.clip is None:
                        training.scale_grads(self._model, torch.tensor(scale, dtype=torch.float32))
                    timer = StepTimer(self._device).start()  # (CUDA events: no host sync before the step)
                    self._optimizer.step()
                    timer.stop()
                    opt_ms = timer.ms()
                self._optimizer.zero_grad(set_to_none=True)
                self._skips.count(
                    skipped,
                    self.global_step + 1,
                    total_loss / max(total_tokens, 1),
                    grad_norm,
                    tokens=int(total_tokens),
                )
                lr = float(self._optimizer.param_groups[0]["lr"])
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                step_in_epoch += 1
                self.global_step += 1

                loss_value = total_loss / total_tokens
                if self._summary.step(self.global_step, loss_value):  # the first: size the checkpoint staging
                    self._checkpointer.prepare(**self._checkpoint_parts(epoch, step_in_epoch, gather_optimizer=False))
                # Every step is recorded by rank 0 (the terminal gets a line every log_every_n_steps: MetricsLog).
                record = self._reduced_record(
                    self.global_step,
                    epoch,
                    loss_value,
                    lr,
                    int(total_tokens),
                    time.perf_counter() - t0,
                    opt_ms,
                    grad_norm,
                )
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{record['tokens_per_second']:.0f}")
                record.update(self._val.after_step(self.global_step, step_in_epoch))  # (every rank: reduced)
                if self._rank0:
                    record.update(self._checkpointer.metrics(since=t0), **self._summary.first_step_field())
                    self._metrics.write(record)
                self._profiler.step(self.global_step)
                running_loss, num_tokens = 0.0, 0
                self._checkpointer.poll(all_written=writing == 0)  # every rank has written: published here
                self._stop.check_ctrl_c()

                if step_in_epoch == self._steps_per_epoch:
                    break
                if stop_now:
                    self.save_checkpoint(f"step_{self.global_step}", epoch, step_in_epoch)
                    pbar.close()
                    utils.log_rank_zero(
                        log,
                        f"Stopped by a signal after step {self.global_step}; continue with "
                        f"resume_from_checkpoint={s.output_dir / f'step_{self.global_step}'}",
                    )
                    self._summary.stop = self._stop.name or "SIGTERM"  # (it may have reached another rank only)
                    return
                if s.checkpoint.save_every and self.global_step % s.checkpoint.save_every == 0:
                    self.save_checkpoint(f"step_{self.global_step}", epoch, step_in_epoch)
                t0 = time.perf_counter()
            pbar.close()
            self.save_checkpoint(f"epoch_{epoch}", epoch, step_in_epoch)
            self.steps_in_epoch = 0
            if self._any_rank(self._stop.received):
                utils.log_rank_zero(log, f"Stopped by a signal at the end of epoch_{epoch}")
                self._summary.stop = self._stop.name or "SIGTERM"
                return

    def _any_rank(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any (one small all-reduce)."""
        t = torch.tensor(float(flag), device=self._device)
        dist.all_reduce(t)
        return bool(t.item())

    def save_checkpoint(self, name: str, epoch: int, steps_in_epoch: int) -> None:
        """Every rank calls this. Rank 0 writes the HF weights and recipe_state.pt, each rank its own
        recipe_state_rank{r}.pt, all into one temporary folder that rank 0 renames into place (with
        async_checkpoint, from copies taken now, written while training goes on)."""
        started, final = time.perf_counter(), self.settings.output_dir / name
        local = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in self._model.state_dict().items()}
        bad = torch.tensor(
            float(not all(torch.isfinite(v).all() for v in local.values() if v.numel())), device=self._device
        )
        dist.all_reduce(bad)  # every rank refuses together
        if bad.item():
            raise NonFiniteStop(
                f"the weights at step {self.global_step} are not finite: refused to write {final}; "
                f"{diverged_fix(self._skips.resumed_from)}"
            )

        def need_bytes() -> int:
            # rank 0: the full weights and (torch's layout) the gathered optimizer state; the others their shard
            opt = console.optimizer_state_bytes(self._optimizers)
            return console.checkpoint_bytes(self._model.state_dict(), []) + opt * self._world if self._rank0 else opt

        self._checkpointer.save(
            name, **self._checkpoint_parts(epoch, steps_in_epoch), need_bytes=need_bytes, started=started
        )
        self._skips.resumed_from = None  # (a checkpoint of this run's own now exists: a stop names no other)

    def _checkpoint_parts(self, epoch: int, steps_in_epoch: int, gather_optimizer: bool = True) -> Dict[str, Any]:
        """What a checkpoint holds. The full weights are gathered from the shards as the checkpoint takes them
        (``Gather``: rank 0 keeps them); the optimizer state is gathered whole to rank 0's host memory now, in the
        format one device writes (``gather_full``; ``Owned``: a copy already; left out with ``gather_optimizer=False``,
        for sizing the staging); the rest are live references."""
        full_optimizer = None
        if gather_optimizer:
            full_optimizer = gather_full(self._model, self._optimizer, main=self._rank0, device=self._device)
        recipe_state = None
        if self._rank0:
            recipe_state = {
                "epoch": epoch,
                "steps_in_epoch": steps_in_epoch,
                "global_step": self.global_step,
                **self._skips.state(),  # skipped steps, in total and in a row
                "optimizer_layout": "full",
                "optimizer": Owned(full_optimizer),
                "lr_scheduler": None if self._lr_scheduler is None else self._lr_scheduler.state_dict(),
                "rng": rng_state(self._device),
                "config": self._run_settings(),
            }
        rank_state = {"optimizer": None, "rng": rng_state(self._device)}  # (a per-rank optimizer: older checkpoints)
        weights = {k: Gather(v, keep=self._rank0) for k, v in self._model.state_dict().items()}
        return {"weights": weights, "recipe_state": recipe_state, "rank_state": rank_state}

    # -- the end of a run ------------------------------------------------------------------------

    def summary(self) -> str:
        """Rank 0's: the profiler's paragraph (with profiler.enabled), then the run's (see the single-device
        recipe)."""
        self._summary.skipped = self._skips.skipped
        return "\n".join(p for p in (self._profiler.text(), self._summary.text()) if p)

    def cleanup(self) -> None:
        if self._rank0:
            self._summary.finish(self._identity, push=lambda values: push_summary(self._logger, values))
        self._metrics.close()
        dist.destroy_process_group()

    def release(self) -> None:
        if getattr(self, "_checkpointer", None) is not None:
            self._checkpointer.close()
        self._folder.release()
        self._stop.uninstall()


@command_line.parse
def recipe_main(cfg: DictConfig) -> None:
    rank = int(os.environ.get("RANK", "0"))
    recipe, training = None, False
    try:
        console.set_log_level(log, cfg, show=rank == 0)  # one banner and one set of progress lines, from rank 0
        recipe = FullFinetuneRecipeDistributed(cfg=cfg)
        recipe.setup(cfg=cfg)
        if recipe.nothing_left:
            if rank == 0:
                tqdm.write(recipe.nothing_left)
            dist.destroy_process_group()
            return
        if rank == 0:
            console.log_banner(log, RECIPE_PATH, recipe.settings.output_dir)
        training = True
        recipe.train()
        recipe.cleanup()
        if rank == 0:
            tqdm.write(recipe.summary())
    except BadInput as e:
        # One line (every rank finds the same error), no traceback: under torchrun in the ranks' error files, which
        # `tune run` prints once, last; without torchrun from rank 0 (console.report_bad_input).
        console.report_bad_input(e, rank)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)
    except torch.OutOfMemoryError as e:  # the rank that ran out says so in one line (the launcher stops the rest)
        where = f"at step {recipe.global_step + 1}" if training else "during setup"
        s = getattr(recipe, "settings", None)
        console.report_bad_input(
            BadInput(report_out_of_memory(s, e, where=where, argv=sys.argv, distributed=True)), rank
        )
        sys.exit(2)
    except KeyboardInterrupt:
        # Ctrl-C reaches every rank (the terminal's process group): each stops at once (no collective: a background
        # write is left to the next start); rank 0 closes wandb, then sums up, last (console.stop_at_ctrl_c).
        out = recipe.settings.output_dir if recipe is not None else None
        closing = lambda: interrupted(getattr(recipe, "_summary", None), out)  # noqa: E731
        console.stop_at_ctrl_c(recipe, closing, show=rank == 0, settle=False)
        console.exit_at_ctrl_c(recipe)
    finally:
        if recipe is not None:
            recipe.release()


if __name__ == "__main__":
    console.print_help_if_asked(__doc__, DISTRIBUTED_CONFIG_KEYS, MANUAL)
    sys.exit(recipe_main())
