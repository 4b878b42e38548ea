"""The training data: the dataset built from its config section, its records checked before training, packed when
asked (``finetune/data/packing.py``), and the seeded sampler and loader the training loop iterates.

Three kinds of dataset, each torchtune's builder reading local JSON, JSONL or Parquet (``dataset.source: json`` or
``parquet``, ``dataset.data_files``) or a hub name:

- ``torchtune.datasets.alpaca_dataset``: instruction / input / output records, the Alpaca prompt as the template;
- ``torchtune.datasets.instruct_dataset``: input / output records (``dataset.column_map`` renames them);
- ``torchtune.datasets.chat_dataset``: conversations, a list of messages per record in
  ``dataset.conversation_column``, ``conversation_style: openai`` (``{role, content}``) or ``sharegpt``
  (``{from, value}``); the tokenizer's chat template formats them (``tokenizer.chat_template: True``).

Every record is checked when the dataset is built (``finetune/data/records.py``: readable UTF-8 and JSON, complete,
conversations in an order the tokenizer formats, tool messages included), so a bad one is one ``error:`` line naming
it (its file and line, or its index), before training. With a tokenizer that can refuse a record (a model's
``tokenizer.json``: its chat template, its pre-tokenizer regex) every record is also tokenized then, packed or not,
and served from those tokens (cached: ``finetune/data/packing.py``).
"""

import time
from functools import partial
from typing import Tuple

import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config
from torchtune.data import padded_collate_packed, padded_collate_sft

from finetune.base import BadInput, first_line
from finetune.data import records
from finetune.data.packing import SampleTable, pack_dataset, tokenized_samples
from finetune.data.records import ALPACA_REQUIRED, ALPACA_TEXT_FIELDS, CHAT_STYLES, INSTRUCT_FIELDS
from finetune.data.tokenizer import sentencepiece_text_bound
from finetune.model import attention
from finetune.sections import DataSettings, TrainingSettings

# The dataset kinds whose records are checked, by a name in dataset._component_, and what their records hold.
KINDS = {"alpaca": "alpaca", "instruct": "instruct_dataset", "chat": "chat_dataset"}
RECORDS = {
    "alpaca": "a JSON list of records with instruction, input and output",
    "instruct": "JSON, JSONL or Parquet records with input and output text (dataset.column_map renames columns)",
    "chat": "JSON, JSONL or Parquet records, each with a list of messages in dataset.conversation_column",
    None: "records the dataset builder reads",
}


def build_dataset(data: DataSettings, tokenizer, log):
    """The samples (``dataset.packed=False``) or packed rows (``True``) of ``data``'s section (the training set's, or
    the validation set's), every record checked."""
    cfg_dataset = data.section
    where = cfg_dataset.get("data_files") or cfg_dataset.get("source")
    component = str(cfg_dataset.get("_component_", ""))
    kind = next((k for k, name in KINDS.items() if name in component), None)
    if kind == "chat" and cfg_dataset.get("conversation_style") not in CHAT_STYLES:
        raise BadInput(
            f"{data.key}.conversation_style={cfg_dataset.get('conversation_style')!r} is not one of "
            f"{', '.join(CHAT_STYLES)}; set {data.key}.conversation_style=openai (messages of role and content) "
            "or sharegpt (from, value)"
        )
    # Local text files are read byte by byte first: a byte that is not UTF-8 would otherwise pass datasets' JSON
    # reader inside a string and fail when the sampler reaches its record, mid-run.
    text_files = records.local_text_files(cfg_dataset)
    for path in text_files:
        records.check_utf8(path, data.key)
    # The samples are built unpacked and packed here (finetune/data/packing.py: best-fit rows, a token cache).
    cfg_samples = OmegaConf.merge(cfg_dataset, {"packed": False})
    try:
        ds = config.instantiate(cfg_samples, tokenizer)
    except Exception as e:  # datasets wraps parse errors in several types; all mean bad data here
        if cfg_dataset.get("source") == "json":  # name the line datasets could not parse
            for path in text_files:
                problem = records.json_error(path, cfg_dataset.get("field"))
                if problem:
                    raise BadInput(f"{data.key}.data_files={path} {problem}; fix or drop that record") from None
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise BadInput(
            f"could not load the dataset {where} ({first_line(cause)}); it must be {RECORDS[kind]} (or a hub name "
            "reachable from here)"
        ) from None
    # How an error names a record (a line, or its place from 1) and the section's keys (dataset_val.column_map)
    names = records.RecordNames(where, cfg_dataset, text_files, data.key)
    if not text_files:  # Parquet, Arrow, the hub: their strings are checked as loaded
        records.check_table_utf8(ds, names)
    column_map = cfg_dataset.get("column_map") or {}
    if kind == "alpaca":
        records.check_text_records(ds, column_map, names, ALPACA_TEXT_FIELDS, ALPACA_REQUIRED)
    elif kind == "instruct":
        records.check_text_records(ds, column_map, names, INSTRUCT_FIELDS, INSTRUCT_FIELDS)
    elif kind == "chat":
        style = cfg_dataset.get("conversation_style")
        if style == "openai":  # tool messages and tool calls, formatted as transformers' apply_chat_template does
            records.chat_transform(ds, tokenizer, cfg_dataset)
        records.check_chat_records(
            ds,
            cfg_dataset.get("conversation_column"),
            style,
            bool(cfg_dataset.get("train_on_input", False)),
            names,
            templated=getattr(tokenizer, "chat_template", None) is not None,
        )
    bound = sentencepiece_text_bound(tokenizer)
    if bound is not None:  # (HFTokenizer bounds its texts itself, as it tokenizes them below)
        if kind == "chat":
            text_key = CHAT_STYLES[cfg_dataset.get("conversation_style")][1]
            records.check_text_lengths(ds, [cfg_dataset.get("conversation_column")], bound, names, text_key)
        elif kind is not None:
            fields = ALPACA_TEXT_FIELDS if kind == "alpaca" else INSTRUCT_FIELDS
            records.check_text_lengths(ds, [column_map.get(f, f) for f in fields], bound, names)
    if not data.packed and not getattr(tokenizer, "refuses_records", False):
        # A tokenizer that encodes any text (torchtune's SentencePiece): the checks above are all a record needs,
        # and each sample is tokenized when the loader reads it. Streaming Alpaca through it here would cost about
        # 6 s a run (2 CPU cores) for no check.
        return ds
    # Every sample tokenized now, once, before the first step: a record the tokenizer refuses stops the run here,
    # named, never when the sampler reaches it mid-epoch. The tokens are cached (the pack cache), so the next run
    # loads them in a second and the loader serves them without tokenizing again, packed or not.
    dataset_cfg = OmegaConf.to_container(cfg_dataset, resolve=True)
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint is not None:  # an HF tokenizer: its tokenizer_config.json (special tokens, chat template) counts
        dataset_cfg = {**dataset_cfg, "tokenizer": fingerprint}
    cache_parts = dict(
        dataset_cfg=dataset_cfg,
        data_files=list(data.files),
        tokenizer_path=str(data.tokenizer_path),
        tokenizer_cfg=data.tokenizer_cfg,
    )
    tokenized = dict(
        max_seq_len=tokenizer.max_seq_len,
        vocab_size=getattr(tokenizer, "vocab_size", None),
        cache_dir=data.pack_cache_dir,
        cache_parts=cache_parts,
        log=log,
        names=names,
    )
    if data.packed:
        return pack_dataset(ds, padding_idx=tokenizer.pad_id, **tokenized)
    t0 = time.perf_counter()
    samples, source = tokenized_samples(ds, **tokenized)
    log.info(f"Tokenized {len(samples)} samples, every record checked ({source} in {time.perf_counter() - t0:.1f} s)")
    return SampleTable(samples)


def collate_for(packed: bool, packed_attention: str, *, pad_id: int, ignore_index: int):
    """How a batch is made: samples padded to the longest, or packed rows with torchtune's block mask, or with the
    sample boundaries FlashAttention's varlen kernel takes (the validation loader makes its batches the same way)."""
    if not packed:
        return partial(padded_collate_sft, padding_idx=pad_id, ignore_idx=ignore_index)
    return attention.collate_varlen if packed_attention == "varlen" else padded_collate_packed


def build_dataloader(
    ds,
    data: DataSettings,
    training: TrainingSettings,
    *,
    pad_id: int,
    ignore_index: int,
    num_replicas: int = 1,
    rank: int = 0,
) -> Tuple[DataLoader, StatefulDistributedSampler, int]:
    """The training loader (rank r of N reads samples r, r+N, ... of one permutation, ``training``'s seed and
    shuffle), its sampler, and the optimizer steps per epoch (``training``'s accumulation and
    ``max_steps_per_epoch`` applied). Too little data for one step is a BadInput."""
    sampler = StatefulDistributedSampler(
        ds, num_replicas=num_replicas, rank=rank, shuffle=training.shuffle, seed=training.seed
    )
    loader = DataLoader(
        ds,
        batch_size=data.batch_size,
        sampler=sampler,
        collate_fn=collate_for(data.packed, data.packed_attention, pad_id=pad_id, ignore_index=ignore_index),
        # A full last batch only: keeps shapes static for compile and steps comparable.
        drop_last=True,
        # Its own generator, so iterating the data does not consume the global RNG.
        generator=torch.Generator().manual_seed(training.seed),
    )
    steps_per_epoch = len(loader) // training.accum
    if training.max_steps_per_epoch is not None:
        steps_per_epoch = min(steps_per_epoch, training.max_steps_per_epoch)
    if steps_per_epoch == 0:
        ranks = f" x {num_replicas} ranks" if num_replicas > 1 else ""
        raise BadInput(
            f"the dataset has {len(ds)} samples, fewer than one optimizer step needs (batch_size={data.batch_size}"
            f"{ranks} x gradient_accumulation_steps={training.accum}); lower batch_size"
        )
    return loader, sampler, steps_per_epoch


def skip_to(sampler: StatefulDistributedSampler, epoch: int, start_step: int, samples_per_step: int) -> None:
    """Point the sampler at ``epoch``, past the samples of its first ``start_step`` optimizer steps (a resumed epoch:
    checkpoints sit on step boundaries, so this is a whole number of micro-batches; each rank skips its share)."""
    sampler.set_epoch(epoch)
    if start_step:
        sampler.load_state_dict({"yielded": start_step * samples_per_step})
