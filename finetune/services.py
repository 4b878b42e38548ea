"""The services both fine-tune recipes wire the same way around their training story.

``build_data``: the tokenizer, the loss, the dataset (every record checked, packed when asked) and its seeded loader,
and the validation set (``dataset_val``, built the same way) with its own loader (``finetune/validation.py``).
``build_reporting``: the checkpointer, the profiler, the run's identity and metric logger (wandb), the metrics log and
the summary the run ends with. ``report_out_of_memory``: the line a run that runs out of device memory ends with.
Each recipe keeps its own model, optimizer and loop; where the two differ (one device, or N ranks of which rank 0
reports) ``ranks`` says so. These compose the components, so they take the whole ``Settings`` and hand each
component its section.
"""

from dataclasses import dataclass
from typing import Any, List, Optional

from omegaconf import DictConfig
from torch.utils.data import DataLoader
from torchtune import config

from finetune.checkpoint.checkpointer import Checkpointer
from finetune.checkpoint.run_folder import DistributedRanks, RunFolder
from finetune.data import loading
from finetune.reporting.metrics import MetricsLog, RunSummary
from finetune.reporting.out_of_memory import keys_to_try, out_of_memory_line
from finetune.reporting.profiler import Profiler
from finetune.reporting.wandb_run import metric_logger, run_file, run_identity, wandb_run_info
from finetune.sections import Settings
from finetune.validation import Validation


@dataclass
class Data:
    tokenizer: Any
    loss_fn: Any
    dataloader: DataLoader
    sampler: Any  # StatefulDistributedSampler: its epoch and position are what a resume restores
    steps_per_epoch: int
    validation: Validation  # (off without dataset_val: it then never validates)


def build_data(cfg: DictConfig, s: Settings, log, ranks: Optional[DistributedRanks] = None) -> Data:
    """The tokenizer and loss the config names, the dataset and the loader (rank r of N reads its share), and the
    validation set, built like the dataset with the same tokenizer (packed per dataset_val.packed)."""
    tokenizer = config.instantiate(cfg.tokenizer)
    loss_fn = config.instantiate(cfg.loss)
    dataset = loading.build_dataset(s.data, tokenizer, log)
    share = {} if ranks is None else {"num_replicas": ranks.world, "rank": ranks.rank}
    dataloader, sampler, steps_per_epoch = loading.build_dataloader(
        dataset, s.data, s.training, pad_id=tokenizer.pad_id, ignore_index=loss_fn.ignore_index, **share
    )
    validation = Validation.off(s.device)
    if s.validation is not None:
        val_set = loading.build_dataset(s.validation.data, tokenizer, log)  # (its own packing and pack cache key)
        validation = Validation(
            s.validation,
            s.device,
            val_set,
            steps_per_epoch=steps_per_epoch,
            pad_id=tokenizer.pad_id,
            ignore_index=loss_fn.ignore_index,
            **({} if ranks is None else {"rank": ranks.rank, "world": ranks.world}),
            log=log if ranks is None or ranks.main else None,
        )
    return Data(tokenizer, loss_fn, dataloader, sampler, steps_per_epoch, validation)


@dataclass
class Reporting:
    checkpointer: Checkpointer
    profiler: Profiler
    identity: dict  # the run's name, group and tags (wandb's, and run.json's)
    logger: Any  # the metric logger; None on ranks other than 0
    metrics: MetricsLog
    summary: RunSummary


def build_reporting(
    cfg: DictConfig,
    s: Settings,
    folder: RunFolder,
    family,
    hf_config: dict,
    *,
    log,
    resume_step: Optional[int],
    ranks: Optional[DistributedRanks] = None,
) -> Reporting:
    """What saves and reports the run. Rank 0 (or the one device) talks to the terminal and wandb and writes the
    metrics; every rank writes its part of a checkpoint. ``resume_step``: the step a resumed run continues after."""
    main = ranks is None or ranks.main
    summary: Optional[RunSummary] = None  # (made last; the checkpointer reports each save to it)
    checkpointer = Checkpointer(
        folder,
        family,
        hf_config,
        s.data.tokenizer_path,
        background=s.checkpoint.background,
        device=s.device,
        memory_limit_gib=s.memory.memory_limit_gib,
        host_limit_gib=s.checkpoint.host_limit_gib,
        log=log if main else None,
        on_saved=lambda saved: summary.saved_checkpoint(saved),
    )
    profiler = Profiler(
        cfg.get("profiler"), output_dir=s.output_dir, device=s.device, **({} if ranks is None else {"rank": ranks.rank})
    )
    identity = identity_of(cfg, s, ranks)
    logger, wandb_dir = metric_logger(cfg, log, identity) if main else (None, None)
    wandb_run = wandb_run_info(logger)
    if wandb_run is not None:  # each checkpoint names its wandb run (run.json, rank 0 writes it), for the eval
        checkpointer.run_info = {**run_file(identity), "wandb": wandb_run}
    metrics = MetricsLog(s.output_dir, logger, log, console_every=s.log_every)
    if main:
        metrics.start(resume_step=resume_step)
    summary = RunSummary(metrics.path, wandb_dir, wandb_run and f"{identity['name']}, id {wandb_run['id']}")
    return Reporting(checkpointer, profiler, identity, logger, metrics, summary)


def identity_of(cfg: DictConfig, s: Settings, ranks: Optional[DistributedRanks] = None) -> dict:
    """The run's name, group and tags for the metric logger and run.json (wandb_run.run_identity), from what the
    settings say is on: the optimizer, the device and its cap, packing, compile, the step in backward, the ranks."""
    return run_identity(
        cfg,
        optimizer=s.training.optimizer.path,
        device=s.device,
        memory_limit_gib=s.memory.memory_limit_gib,
        packed=s.data.packed,
        compiled=s.memory.compile,
        in_backward=s.training.optimizer_in_bwd,
        **({} if ranks is None else {"world": ranks.world}),
    )


def report_out_of_memory(
    s: Optional[Settings], error: BaseException, *, where: str, argv: List[str], distributed: bool = False
) -> str:
    """The one line (without ``error: ``) for running out of device memory ``where`` ("during setup", "at step 12")
    in a run with settings ``s`` (None: not read yet): the peak, the class that fits, the keys to try
    (finetune/reporting/out_of_memory.py), the last checkpoint."""
    if s is None:
        return out_of_memory_line(error, where=where, argv=argv)
    keys = keys_to_try(s.memory, s.training, batch_size=s.data.batch_size, device=s.device, distributed=distributed)
    return out_of_memory_line(
        error,
        where=where,
        argv=argv,
        device=s.device,
        memory_limit_gib=s.memory.memory_limit_gib,
        output_dir=s.output_dir,
        keys=keys,
    )
