"""The training data: the dataset built from its config section, its records checked before training, packed when
asked (``_packing.py``), and the seeded sampler and loader the training loop iterates.
"""

from functools import partial
from typing import Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config
from torchtune.data import padded_collate_packed, padded_collate_sft

from finetune_base import BadInput
from recipes import _packing
from recipes._settings import Settings, first_line

ALPACA_TEXT_FIELDS = ("instruction", "input", "output")
ALPACA_REQUIRED = ("instruction", "output")


def build_dataset(cfg_dataset: DictConfig, tokenizer, settings: Settings, log):
    """The samples (``dataset.packed=False``) or packed rows (``True``) the config names, every record checked."""
    where = cfg_dataset.get("data_files") or cfg_dataset.get("source")
    packed = cfg_dataset.get("packed", False)
    if packed not in (True, False):
        raise BadInput(f"dataset.packed={packed!r} must be True or False")
    # The samples are built unpacked and packed here (recipes/_packing.py: best-fit rows, a token cache).
    cfg_samples = OmegaConf.merge(cfg_dataset, {"packed": False})
    try:
        ds = config.instantiate(cfg_samples, tokenizer)
    except Exception as e:  # datasets wraps parse errors in several types; all mean bad data here
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise BadInput(
            f"could not load the dataset {where} ({first_line(cause)}); it must be a JSON list of records "
            "with instruction, input and output (or a hub name reachable from here)"
        ) from None
    if "alpaca" in cfg_dataset.get("_component_", ""):
        check_alpaca_records(ds, cfg_dataset.get("column_map") or {}, where)
    if not packed:
        return ds
    cache_parts = dict(dataset_cfg=OmegaConf.to_container(cfg_dataset, resolve=True), data_files=settings.data_files,
                       tokenizer_path=str(settings.tokenizer_path), tokenizer_cfg=settings.tokenizer_cfg)
    return _packing.pack_dataset(ds, max_seq_len=tokenizer.max_seq_len, padding_idx=tokenizer.pad_id,
                                 vocab_size=getattr(tokenizer, "vocab_size", None),
                                 cache_dir=settings.pack_cache_dir, cache_parts=cache_parts, log=log)


def check_alpaca_records(ds, column_map: dict, where) -> None:
    """Alpaca-style data: every record needs an instruction and an output, and its fields are text. The whole table
    is checked now (Arrow null counts, milliseconds) rather than fail at some step mid-run."""
    table = getattr(ds, "_data", None)
    if not hasattr(table, "column_names"):
        return
    for field in ALPACA_TEXT_FIELDS:  # text, not numbers or booleans
        column = column_map.get(field, field)
        if column not in table.column_names:
            continue
        feature = getattr(table, "features", {}).get(column)
        if getattr(feature, "dtype", None) in ("string", "large_string", "null"):
            continue  # an Arrow string column: every value is text or missing
        # Numbers, booleans, or a mix (datasets then stores the column as JSON): find the first non-text.
        bad = next(((i, v) for i, v in enumerate(table[column]) if v is not None and not isinstance(v, str)), None)
        if bad is not None:
            raise BadInput(
                f"record {bad[0]} of {where}: field '{column}' is {bad[1]!r} ({type(bad[1]).__name__}), not a "
                "string; fix or drop that record (instruction, input and output are text)")
    for field in ALPACA_REQUIRED:
        column = column_map.get(field, field)
        if column not in table.column_names:
            raise BadInput(f"the records in {where} have no '{column}' field; each needs instruction and output "
                           "(map other names with dataset.column_map)")
        values = table.data.column(column)
        if values.null_count:
            row = values.is_null().to_pylist().index(True)
            raise BadInput(f"record {row} of {where} has no '{column}'; fix or drop that record (each needs "
                           "instruction and output)")


def build_dataloader(ds, settings: Settings, *, pad_id: int, ignore_index: int, num_replicas: int = 1,
                     rank: int = 0) -> Tuple[DataLoader, StatefulDistributedSampler, int]:
    """The loader (rank r of N reads samples r, r+N, ... of one seeded permutation), its sampler, and the optimizer
    steps per epoch (``max_steps_per_epoch`` applied). Too little data for one step is a BadInput."""
    packed = isinstance(ds, _packing.PackedSFTDataset)
    sampler = StatefulDistributedSampler(ds, num_replicas=num_replicas, rank=rank, shuffle=settings.shuffle,
                                         seed=settings.seed)
    loader = DataLoader(
        ds,
        batch_size=settings.batch_size,
        sampler=sampler,
        collate_fn=padded_collate_packed if packed else partial(padded_collate_sft, padding_idx=pad_id,
                                                               ignore_idx=ignore_index),
        # A full last batch only: keeps shapes static for compile and steps comparable.
        drop_last=True,
        # Its own generator, so iterating the data does not consume the global RNG.
        generator=torch.Generator().manual_seed(settings.seed),
    )
    steps_per_epoch = len(loader) // settings.accum
    if settings.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, settings.max_steps_per_epoch)
    if steps_per_epoch == 0:
        ranks = f" x {num_replicas} ranks" if num_replicas > 1 else ""
        raise BadInput(
            f"the dataset has {len(ds)} samples, fewer than one optimizer step needs (batch_size={settings.batch_size}"
            f"{ranks} x gradient_accumulation_steps={settings.accum}); lower batch_size")
    return loader, sampler, steps_per_epoch


def skip_to(sampler: StatefulDistributedSampler, epoch: int, start_step: int, samples_per_step: int) -> None:
    """Point the sampler at ``epoch``, past the samples of its first ``start_step`` optimizer steps (a resumed epoch:
    checkpoints sit on step boundaries, so this is a whole number of micro-batches; each rank skips its share)."""
    sampler.set_epoch(epoch)
    if start_step:
        sampler.load_state_dict({"yielded": start_step * samples_per_step})
