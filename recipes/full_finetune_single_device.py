"""Full fine-tune of a Llama 2 / 3.x, Qwen 2.5 / 3 or Mistral model on one device (one GPU, or the CPU for tiny runs).

    tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml [key=value ...]
    tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml --help   # this index + keys

The manual is docs/recipes.md (--help=all prints it, then the config's keys). The keys, one line each:

    data_dir                         folder with alpaca/ and llama2_tokenizer/ (configs: ../shared/data)
    output_dir                       step_N/, epoch_E/, metrics.jsonl, wandb/; a used folder is refused
    overwrite                        True: delete the run already in output_dir first (default False)
    checkpoint_dir                   HF checkpoint folder to start from; null = random init
    resume_from_checkpoint           a step_N/ or epoch_E/ folder this recipe wrote; continues exactly
    model                            torchtune model builder (config.instantiate); its family: docs/models.md
    tokenizer                        Llama 2's SentencePiece, or the model's tokenizer.json (chat_template)
    dataset                          alpaca/instruct/chat_dataset; dataset.packed=True packs rows best-fit
    dataset_val                      held-out set, built like dataset (its keys under dataset's); null = none
    run_val_every_n_steps, batch_size_val  val_loss every N steps + epoch ends (null: ends only); its batch
    loss                             CEWithChunkedOutputLoss, or finetune.model.LinearCrossEntropyLoss (fused)
    optimizer                        any class: optimizer=optimizers.AdamW8bit swaps it; torch flags dropped
    lr_scheduler                     built with num_training_steps filled in; null = constant lr
    metric_logger                    wandb (offline without WANDB_API_KEY); .name/.group/.tags; null = off
    profiler                         torchtune's profiler: profiler.enabled=True, its schedule keys (default off)
    device                           cuda (default) or cpu
    dtype                            bf16 (default) or fp32; no mixed precision
    seed, shuffle                    data order and random init (default 0); reshuffle every epoch (default True)
    batch_size                       samples per micro-batch
    gradient_accumulation_steps      micro-batches per optimizer step
    epochs, max_steps_per_epoch      passes over the data; optimizer steps per epoch (null = the whole epoch)
    clip_grad_norm                   clip the global grad norm to this; null = no clipping
    optimizer_in_bwd                 step and free each gradient in backward (no clipping, no accumulation)
    stream_optimizer_states, resident_states_gib   with optimizer_in_bwd: states in host memory; N GiB stay on the GPU
    stream_layers                    with streamed states and AC: N layers' weights in host memory (default 0)
    compile                          torch.compile per layer and on the loss (default False)
    enable_activation_checkpointing  recompute layers in backward: less memory, ~1/3 more compute
    ac_mode, ac_option               full (default: every layer) or selective: one layer in ac_option
    fp8                              tensorwise / rowwise: FP8 matmuls (FP8 GPU + compile); null = bf16
    packed_attention                 flex (default) or varlen: packed rows' attention (FlashAttention, CUDA)
    enable_activation_offloading     saved activations to CPU memory (GPU only; default False)
    device_memory_limit_gib, host_memory_limit_gib   cap GPU memory / host memory (a save's copy, compile workers)
    pack_cache_dir                   cache of tokenized samples (packing, tokenizer.json); off = none
    save_every_n_steps               also write step_N/ every N steps; null = epoch_E/ only
    log_every_n_steps                a metrics line on the terminal every N steps (every step is recorded)
    async_checkpoint                 write checkpoints in the background (default True); False = training waits
    max_consecutive_skipped_steps    non-finite steps in a row that stop the run (default 10)
    log_level                        INFO (default); DEBUG also prints the config; WARNING
"""

import itertools
import math
import sys
import time
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from finetune.reporting import console

console.quiet_known_noise()  # before torchtune imports torchao (see console.KNOWN_NOISE)

from torchtune import config, modules, training, utils
from tqdm import tqdm

from finetune import streaming  # (its modules load when a config streams: streaming.stream_weights, ...)
from finetune.base import BadInput, NonFiniteStop
from finetune.checkpoint import hf_format, resume
from finetune.checkpoint.checkpointer import (
    RECIPE_STATE_FILE,
    check_finite_weights,
    rng_state,
    set_rng_state,
)
from finetune.checkpoint.optimizer_state import restore
from finetune.checkpoint.run_folder import RunFolder
from finetune.data.loading import skip_to
from finetune.data.packing import count_trained_tokens
from finetune.data.tokenizer import check_fits_model
from finetune.host_memory import compile_without_workers, end_compile_workers
from finetune.model.attention import use_varlen_attention
from finetune.model.loss import training_loss
from finetune.model.prepare import (
    apply_activation_checkpointing,
    convert_to_fp8,
    prepare_device,
    wire_loss,
)
from finetune.optimizer import warn_round_to_nearest
from finetune.reporting.console import StepTimer
from finetune.reporting.metrics import interrupted, step_record
from finetune.reporting.wandb_run import push_summary
from finetune.services import build_data, build_reporting, report_out_of_memory
from finetune.settings import KNOWN_CONFIG_KEYS, command_line, first_line, read_settings
from finetune.stops import SkipCounter, StopSignal

log = utils.get_logger("INFO")

RECIPE_PATH = "recipes/full_finetune_single_device.py"
MANUAL = "docs/recipes.md"


class FullFinetuneRecipeSingleDevice:
    """Full fine-tune on one device: ``setup``, ``train``, ``cleanup``; docs/recipes.md is the manual."""

    def __init__(self, cfg: DictConfig) -> None:
        # Every check of the config runs here, before anything is built or written.
        self.settings = s = read_settings(cfg)
        training.set_seed(seed=s.training.seed)
        prepare_device(s.device, s.memory.memory_limit_gib)
        self._device, self._dtype = s.device, s.dtype
        self._folder = RunFolder(s.output_dir)
        # Position in training; a resume overwrites it.
        self.epoch, self.steps_in_epoch, self.global_step = 0, 0, 0
        self._skips = SkipCounter(s.training.max_skips, log)
        self._stop = StopSignal()
        self.nothing_left: Optional[str] = None  # a resume from the end of training: the line it ends with

    # ----------------------------------------------------------------------------------------
    # setup: the run folder, then tokenizer, data, model, optimizer, schedule, resume state, metrics
    # ----------------------------------------------------------------------------------------

    def setup(self, cfg: DictConfig) -> None:
        s = self.settings
        self._folder.claim(log)
        data = build_data(cfg, s, log)
        self._tokenizer, self._loss_fn = data.tokenizer, data.loss_fn
        self._dataloader, self._sampler, self._steps_per_epoch = data.dataloader, data.sampler, data.steps_per_epoch

        self._model = self._setup_model(cfg)
        self._val = data.validation.using(self._model, self._loss_step)  # (dataset_val: finetune/validation.py)
        self._setup_optimizer()
        self._lr_scheduler = self._setup_lr_scheduler(cfg)
        check_fits_model(self._tokenizer, self._hf_config, self.settings.data.tokenizer_path)
        resume_state = self._load_resume_state() if s.checkpoint.resume_dir is not None else None
        if self.nothing_left:  # (before the folder's run is touched: the finished run keeps its summary and wandb run)
            return
        self._folder.refuse_reuse(resume_dir=s.checkpoint.resume_dir, overwrite=s.checkpoint.overwrite, log=log)
        # The checkpointer, profiler, metric logger (wandb), metrics.jsonl and the summary the run ends with.
        report = build_reporting(
            cfg,
            s,
            self._folder,
            self._family,
            self._hf_config,
            log=log,
            resume_step=None if resume_state is None else self.global_step,
        )
        self._checkpointer, self._profiler, self._identity = report.checkpointer, report.profiler, report.identity
        self._logger, self._metrics, self._summary = report.logger, report.metrics, report.summary
        if resume_state is not None:
            # RNG last, so nothing in setup shifts it after the restore.
            rng = resume_state["rng"]
            set_rng_state(rng)
            if rng.get("cuda") is not None and self._device.type == "cuda":
                torch.cuda.set_rng_state_all(rng["cuda"])

    def _setup_model(self, cfg: DictConfig) -> modules.TransformerDecoder:
        s = self.settings
        weights = s.checkpoint.resume_dir or s.checkpoint.checkpoint_dir
        # stream_layers: the model is never whole on the GPU (built with no memory, given the file's tensors)
        home = torch.device("meta" if weights else "cpu") if s.memory.stream_layers else self._device
        with training.set_default_dtype(self._dtype), home:
            model = config.instantiate(s.model.section)
        if s.model.note:
            log.info(s.model.note)
        # The HF config is read off the model before AC and compile wrap its layers.
        self._family = hf_format.FAMILIES[s.model.family]
        self._hf_config = hf_format.hf_config(model, self._dtype, s.model.source_config, self._family, self._tokenizer)
        if s.memory.stream_states or s.memory.stream_layers:  # (before 13-16 GB of weights are read)
            streaming.check_host_room(
                model,
                build=s.training.optimizer.build,
                states=s.memory.stream_states,
                layers=s.memory.stream_layers,
                device=self._device,
                resident=s.memory.resident_state_bytes,
            )
        if weights is not None:
            hf_format.load_weights(
                model,
                weights,
                self._hf_config,
                self._family,
                assign=home.type == "meta",
                config_json=s.model.source_path,
            )
            log.info(f"Loaded weights from {weights}")

        if s.memory.fp8 is not None:
            log.info(
                f"fp8={s.memory.fp8}: {convert_to_fp8(model, s.memory.fp8)} linear layers run their matmuls in FP8"
            )
        if s.data.packed_attention == "varlen":
            log.info(
                f"packed_attention=varlen: {use_varlen_attention(model)} attention layers use FlashAttention's "
                "variable-length kernel"
            )
        if s.memory.ac_every is not None:
            apply_activation_checkpointing(model, every_n=s.memory.ac_every)
        elif s.memory.offload_activations:
            log.warning(
                "enable_activation_offloading=True without activation checkpointing copies every activation "
                "to the CPU and back: usually slower than enable_activation_checkpointing=True"
            )
        self._weights = (
            streaming.stream_weights(model, s.memory.stream_layers, self._device) if s.memory.stream_layers else None
        )
        if self._weights:
            log.info(
                f"stream_layers={s.memory.stream_layers}: {self._weights.host_bytes / 2**30:.1f} GiB of weights in "
                "host memory"
            )
        self._activations_ctx = training.get_act_offloading_ctx_manager(model, s.memory.offload_activations)
        if s.memory.compile:
            if s.checkpoint.host_limit_gib is not None and compile_without_workers():
                log.info(
                    "host_memory_limit_gib is set: torch.compile compiles in this process, without its worker "
                    "processes (their ~1 GB would come on top of the run's host memory; the first step compiles slower)"
                )
            training.compile_model(model)
        wire_loss(model, self._loss_fn, compiled=s.memory.compile)
        training.validate_expected_param_dtype(model.named_parameters(), dtype=self._dtype)
        n_params = sum(p.numel() for p in model.parameters())
        log.info(f"Model: {n_params / 1e6:.1f}M parameters in {self._dtype} on {self._device}")
        return model

    def _setup_optimizer(self) -> None:
        spec = self.settings.training.optimizer
        self._streamed: Optional[streaming.StreamedStates] = None
        if self.settings.training.optimizer_in_bwd:
            # One optimizer per parameter, stepped by a hook as soon as that parameter's gradient is accumulated.
            optim_dict = {p: spec.build([p]) for p in self._model.parameters()}
            if (
                self.settings.memory.stream_states
            ):  # the same hooks, with each state fetched for its step and written back
                weights = self._weights  # (streamed weights share the copy streams and go down after each step)
                self._streamed = streaming.StreamedStates(
                    self._model,
                    optim_dict,
                    self._device,
                    resident_bytes=self.settings.memory.resident_state_bytes,
                    link=weights and weights.link,
                    after_step=weights and weights.after_step,
                )
            else:
                training.register_optim_in_bwd_hooks(model=self._model, optim_dict=optim_dict)
            self._optim_wrapper = training.create_optim_in_bwd_wrapper(model=self._model, optim_dict=optim_dict)
            self._optimizer = None
            self._optimizers = list(optim_dict.values())
        else:
            self._optimizer = spec.build(self._model.parameters())
            self._optimizers = [self._optimizer]
        log.info(
            f"Optimizer: {spec.path}"
            + (" (in backward, one per parameter)" if self.settings.training.optimizer_in_bwd else "")
            + (", states in host memory" if self._streamed else "")
            + (
                f" (up to {self.settings.memory.resident_state_bytes / 2**30:g} GiB of them kept on the GPU)"
                if self._streamed and self.settings.memory.resident_state_bytes
                else ""
            )
        )
        self._optim_state = self._streamed or (
            self._optim_wrapper if self.settings.training.optimizer_in_bwd else self._optimizer
        )
        warn_round_to_nearest(spec.path, self._dtype)

    def _setup_lr_scheduler(self, cfg: DictConfig):
        if self.settings.training.lr_scheduler is None:  # constant lr
            return None
        scheduler = config.instantiate(
            self.settings.training.lr_scheduler,
            self._optimizers[0],
            num_training_steps=self.settings.training.epochs * self._steps_per_epoch,
        )
        if self.settings.training.optimizer_in_bwd:
            # The scheduler drives the first per-parameter optimizer; the wrapper copies its lr to all the others
            # after each step. The scheduler already set the first step's lr (0 at the start of a warmup) on that one
            # optimizer: copy it now too, or every other parameter's first step would run at the full base lr.
            self._optim_wrapper.set_lr_scheduler(scheduler)
            first_lr = scheduler.get_last_lr()[0]
            for opt in self._optimizers:
                for group in opt.param_groups:
                    group["lr"] = first_lr
        return scheduler

    def _run_settings(self) -> Dict[str, Any]:
        """The settings recipe_state.pt keeps, for a resume to compare (``resume.RESUME_TABLE``)."""
        s = self.settings
        return resume.run_settings(s.training, s.data, dtype_name=s.dtype_name, fp8=s.memory.fp8)

    def _load_resume_state(self) -> dict:
        s = self.settings
        # (mapped, not read: a 7-8B model's 4-bit states are 8 GB, which a resume held in memory whole while streamed
        # states filled their pinned slots, 24.6-25 GB at its peak; mapped pages the kernel can drop again)
        state = resume.read_resume(s.checkpoint.resume_dir, now=self._run_settings(), mmap=True, log=log)
        try:
            self._optim_state.load_state_dict(
                restore(
                    state,
                    self._optimizers,
                    self._model,
                    now=s.training.optimizer.path,
                    in_bwd=s.training.optimizer_in_bwd,
                    log=log,
                    source=s.checkpoint.resume_dir / RECIPE_STATE_FILE,
                )
            )
        except BadInput:  # (a damaged state: restore's own line names the parameter and the fix)
            raise
        except (ValueError, KeyError, RuntimeError) as e:
            raise BadInput(
                f"the optimizer state in {s.checkpoint.resume_dir / RECIPE_STATE_FILE} does not fit this "
                f"model and optimizer ({first_line(e)}); resume with the config that wrote it"
            ) from None
        if self._lr_scheduler is not None and state["lr_scheduler"] is not None:
            self._lr_scheduler.load_state_dict(state["lr_scheduler"])
        self._skips.restore(state, resumed_from=s.checkpoint.resume_dir)
        log.info(
            f"Resuming from {s.checkpoint.resume_dir}: global step {state['global_step']}, "
            f"step {state['steps_in_epoch']} "
            f"of {self._steps_per_epoch} in epoch_{state['epoch']}"
        )
        self.epoch, self.steps_in_epoch, self.global_step = resume.progress_after(state, self._steps_per_epoch)
        if self.epoch >= s.training.epochs:
            self.nothing_left = resume.nothing_left(
                s.checkpoint.resume_dir, self.global_step, s.training.epochs, s.training.max_steps_per_epoch
            )
        return state

    # ----------------------------------------------------------------------------------------
    # train
    # ----------------------------------------------------------------------------------------

    def _loss_step(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        """Forward and loss on one micro-batch: the mean over its predicted tokens."""
        labels = batch.pop("labels")
        # Token t predicts label t+1: shift left, pad the last position with the ignore index.
        labels = F.pad(labels[:, 1:], (0, 1), value=self._loss_fn.ignore_index)
        with self._activations_ctx:
            logits = self._model(**batch)
        if not isinstance(logits, list):  # chunked CE takes the list of chunks and [b, s] labels
            logits, labels = logits.reshape(-1, logits.size(-1)), labels.reshape(-1)
        return self._loss_fn(logits, labels)

    def _current_lr(self) -> float:
        if self.settings.training.optimizer_in_bwd:
            return float(self._optim_wrapper.get_optim_key("lr"))
        return float(self._optimizer.param_groups[0]["lr"])

    def train(self) -> None:
        """The training loop. A stop signal (SIGTERM, SIGUSR1) ends it at the next step boundary, after a checkpoint.
        It returns once the last checkpoint is written (one written in the background too)."""
        with self._stop, self._profiler:
            try:
                self._train()
            except Exception:
                self._checkpointer.settle()  # a checkpoint still being written is a good one: publish it
                raise
            self._checkpointer.wait()

    def _train(self) -> None:
        s = self.settings
        if s.memory.compile:
            log.info("compile=True: the first steps compile and are slow")
        params = [p for p in self._model.parameters() if p.requires_grad]
        self._summary.training_started()  # (the first step's time counts from here: compile included)
        timer = StepTimer(self._device)
        self._collector = collector = console.CollectorTime()  # (each step's time in Python's garbage collector)
        for epoch in range(self.epoch, s.training.epochs):
            start = self.steps_in_epoch if epoch == self.epoch else 0
            skip_to(self._sampler, epoch, start, s.training.accum * s.data.batch_size)
            step_in_epoch = start
            pbar = tqdm(
                total=self._steps_per_epoch,
                initial=start,
                dynamic_ncols=True,
                desc=console.epoch_label(epoch, s.training.epochs),
            )
            running_loss, running_aux = 0.0, None
            t0 = time.perf_counter()
            batches = iter(self._dataloader)
            while True:
                micro_batches = list(itertools.islice(batches, s.training.accum))
                if len(micro_batches) < s.training.accum:
                    break
                # The step's trained tokens are counted from the labels before any forward pass, so each
                # micro-batch's gradient arrives already divided by the step's total: no pass over the
                # gradients to rescale them afterwards, and optimizer-in-backward sees final gradients.
                counts = [count_trained_tokens(b["labels"], self._loss_fn.ignore_index) for b in micro_batches]
                num_tokens = sum(counts)
                for batch, ntok in zip(micro_batches, counts):
                    utils.batch_to_device(batch, self._device)
                    # the mean over this micro-batch's tokens (with a mixture of experts' load-balancing term)
                    loss, aux = training_loss(self._model, self._loss_step(batch))
                    (loss if ntok == num_tokens else loss * (ntok / max(num_tokens, 1))).backward()
                    running_loss += loss.detach() * ntok
                    if aux is not None:
                        running_aux = aux * ntok + (0.0 if running_aux is None else running_aux)

                grad_norm, opt_timer, skipped = None, None, False
                loss_t = running_loss / max(num_tokens, 1)
                if not s.training.optimizer_in_bwd:
                    if s.training.clip is not None:  # (the settings refuse clipping with CPU offload)
                        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_norm=s.training.clip)
                    elif (
                        not s.training.optimizer.cpu_offload
                    ):  # (CPU offload: the gradients are on the CPU already: loss only)
                        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
                    # The step's one host sync: loss and norm are checked before the optimizer may touch weights or
                    # state.
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
                    self._skips.count(skipped, self.global_step + 1, loss_value, grad_norm, tokens=int(num_tokens))
                else:
                    loss_value = loss_t.item()  # waits for the step's GPU work
                    if not math.isfinite(loss_value):
                        raise NonFiniteStop(
                            f"loss is {loss_value} at step {self.global_step + 1} with optimizer_in_bwd=True: the "
                            "update was applied during backward and cannot be skipped; resume from the last "
                            "checkpoint with a lower optimizer.lr, or with optimizer_in_bwd=False (non-finite steps "
                            "are then skipped)"
                        )
                lr = self._current_lr()  # the lr this step used
                if self._lr_scheduler is not None:
                    self._lr_scheduler.step()
                step_in_epoch += 1
                self.global_step += 1

                if self._summary.step(self.global_step, loss_value):  # the first: the optimizer state exists now
                    self._checkpointer.prepare(**self._checkpoint_parts(epoch, step_in_epoch))  # (sizes the staging)
                # Every step is recorded (metrics.jsonl, the metric logger); the terminal gets a line every
                # log_every_n_steps (MetricsLog), the bar the loss and tokens/s.
                opt_ms = None if opt_timer is None else opt_timer.ms()  # (waits for the step's end on a GPU)
                elapsed = time.perf_counter() - t0
                mine = {
                    "elapsed": elapsed,
                    "opt_ms": opt_ms,
                    **console.memory_metrics(self._device),
                    "state_bytes": console.optimizer_state_bytes(self._optimizers),
                }
                record = step_record(
                    step=self.global_step,
                    epoch=epoch,
                    loss=loss_value,
                    lr=lr,
                    tokens=num_tokens,
                    ranks=[mine],
                    grad_norm=None if grad_norm is None else float(grad_norm),
                    skipped=self._skips.skipped,
                )
                nonfinite = console.nonfinite_elements(self._optimizers)
                if nonfinite is not None:
                    record["nonfinite_grad_elements"] = nonfinite
                if running_aux is not None:  # (the load-balancing loss, unscaled, beside the loss it is part of)
                    record["aux_loss"] = float(running_aux / max(num_tokens, 1))
                record.update(self._summary.first_step_field())  # (the first record of this process)
                if s.memory.compile:
                    record["compiled_graphs"] = console.compiled_graphs()
                record.update(collector.take())
                record.update(self._checkpointer.metrics(since=t0))
                if self._streamed is not None or self._weights is not None:  # (bytes moved, waits on copies)
                    record.update(streaming.step_metrics(self._streamed, self._weights))
                if not math.isfinite(loss_value):
                    log.warning(f"loss is {loss_value} at step {self.global_step}")
                pbar.update(1)
                pbar.set_postfix(loss=f"{loss_value:.4f}", tok_s=f"{record['tokens_per_second']:.0f}")
                # (val_loss: eval mode, no grad; a stop signal ends the pass, and the checkpoint below follows)
                try:
                    record.update(
                        self._val.after_step(self.global_step, step_in_epoch, stop=lambda: self._stop.received)
                    )
                except KeyboardInterrupt:  # (Ctrl-C mid-pass: the step trained, so its record stays, pass cut short)
                    self._metrics.write({**record, "val_stopped": True})
                    raise
                if s.memory.compile and s.checkpoint.host_limit_gib is not None and end_compile_workers():
                    log.info(  # (idle between compiles; a later compile starts them again)
                        "host_memory_limit_gib is set: torch.compile's worker processes ended once this step's "
                        "graphs were compiled (about 1 GB of host memory on a 16-core machine)"
                    )
                self._metrics.write(record)
                self._profiler.step(self.global_step)
                running_loss, running_aux = 0.0, None
                self._checkpointer.poll()  # a checkpoint written in the background is published (or fails) here
                self._stop.check_ctrl_c()

                if step_in_epoch == self._steps_per_epoch:
                    break
                # A stop signal: a last checkpoint at this step boundary, then stop.
                if self._stop.received:
                    self.save_checkpoint(f"step_{self.global_step}", epoch, step_in_epoch)
                    pbar.close()
                    log.info(
                        f"Stopped by {self._stop.name} after step {self.global_step}; continue with "
                        f"resume_from_checkpoint={s.output_dir / f'step_{self.global_step}'}"
                    )
                    return
                # A periodic checkpoint that falls on an epoch's last step is skipped: the epoch checkpoint written
                # just after holds the same state.
                if s.checkpoint.save_every and self.global_step % s.checkpoint.save_every == 0:
                    self.save_checkpoint(f"step_{self.global_step}", epoch, step_in_epoch)
                t0 = time.perf_counter()
            pbar.close()
            self.save_checkpoint(f"epoch_{epoch}", epoch, step_in_epoch)
            self.steps_in_epoch = 0
            if self._stop.received:
                log.info(f"Stopped by {self._stop.name} at the end of epoch_{epoch}")
                return

    def save_checkpoint(self, name: str, epoch: int, steps_in_epoch: int) -> None:
        """``{output_dir}/{name}/``: the HF folder and recipe_state.pt, published atomically (``_checkpoint``); with
        async_checkpoint, a copy of them is taken now and written while training goes on."""
        started, parts = time.perf_counter(), self._checkpoint_parts(epoch, steps_in_epoch)
        model_sd = parts["weights"]
        check_finite_weights(model_sd, self.settings.output_dir / name, self.global_step, self._skips.resumed_from)
        self._checkpointer.save(
            name, **parts, started=started, need_bytes=lambda: console.checkpoint_bytes(model_sd, self._optimizers)
        )
        self._skips.resumed_from = None  # (a checkpoint of this run's own now exists: a stop names no other)

    def _checkpoint_parts(self, epoch: int, steps_in_epoch: int) -> Dict[str, Any]:
        """What a checkpoint holds, as live references: the weights and the recipe state."""
        recipe_state = {
            "epoch": epoch,
            "steps_in_epoch": steps_in_epoch,
            "global_step": self.global_step,
            **self._skips.state(),  # skipped steps, in total and in a row
            "optimizer": self._optim_state.state_dict(),
            # Callables are left out: the in-backward wrapper patches `step` on the scheduler.
            "lr_scheduler": None
            if self._lr_scheduler is None
            else {k: v for k, v in self._lr_scheduler.state_dict().items() if not callable(v)},
            "rng": rng_state(self._device, all_cuda=True),
            "config": self._run_settings(),
        }
        return {"weights": self._model.state_dict(), "recipe_state": recipe_state}

    # -- the end of a run ------------------------------------------------------------------------

    def summary(self) -> str:
        """The profiler's paragraph (with profiler.enabled), then the run's: the steps trained, time, first and last
        loss, the summary's numbers, and where summary.json, metrics, checkpoints and wandb are."""
        self._summary.skipped, self._summary.stop = self._skips.skipped, self._stop.name
        return "\n".join(p for p in (self._profiler.text(), self._summary.text()) if p)

    def cleanup(self) -> None:
        self._summary.finish(self._identity, push=lambda values: push_summary(self._logger, values))
        self._metrics.close()

    def release(self) -> None:
        if getattr(self, "_collector", None) is not None:
            self._collector.close()
        if getattr(self, "_checkpointer", None) is not None:
            self._checkpointer.close()
        self._folder.release()


@command_line.parse
def recipe_main(cfg: DictConfig) -> None:
    recipe, training = None, False
    try:
        console.set_log_level(log, cfg)
        recipe = FullFinetuneRecipeSingleDevice(cfg=cfg)
        recipe.setup(cfg=cfg)
        if recipe.nothing_left:
            tqdm.write(recipe.nothing_left)
            return
        console.log_banner(log, RECIPE_PATH, recipe.settings.output_dir)
        training = True
        recipe.train()
        recipe.cleanup()
        tqdm.write(recipe.summary())
    except BadInput as e:
        # One line, no traceback: the message already names the value and the fix.
        tqdm.write(f"error: {e}", file=sys.stderr)  # (on a line of its own, below any progress bar)
        sys.exit(2)
    except torch.OutOfMemoryError as e:
        # One line too: where, the peak against the GPU's memory, the class that fits. train() has published a
        # checkpoint that was being written in the background; the last one is left as it was.
        where = f"at step {recipe.global_step + 1}" if training else "during setup"
        line = report_out_of_memory(getattr(recipe, "settings", None), e, where=where, argv=sys.argv)
        tqdm.write(f"error: {line}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        # Ctrl-C stops at once: the background write finished, wandb closed, then the summary and the checkpoint to
        # resume from, last (console.stop_at_ctrl_c), and the shell's exit status for SIGINT.
        out = recipe.settings.output_dir if recipe is not None else None
        console.stop_at_ctrl_c(recipe, lambda: interrupted(getattr(recipe, "_summary", None), out))
        console.exit_at_ctrl_c(recipe)
    finally:
        if recipe is not None:
            recipe.release()


if __name__ == "__main__":
    console.print_help_if_asked(__doc__, KNOWN_CONFIG_KEYS, MANUAL)
    sys.exit(recipe_main())
