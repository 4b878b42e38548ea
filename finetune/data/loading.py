"""The training data: the dataset built from its config section, its records checked before training, packed when
asked (``finetune/data/packing.py``), and the seeded sampler and loader the training loop iterates.

Three kinds of dataset, each torchtune's builder reading local JSON, JSONL or Parquet (``dataset.source: json`` or
``parquet``, ``dataset.data_files``) or a hub name:

- ``torchtune.datasets.alpaca_dataset``: instruction / input / output records, the Alpaca prompt as the template;
- ``torchtune.datasets.instruct_dataset``: input / output records (``dataset.column_map`` renames them);
- ``torchtune.datasets.chat_dataset``: conversations, a list of messages per record in
  ``dataset.conversation_column``, ``conversation_style: openai`` (``{role, content}``) or ``sharegpt``
  (``{from, value}``); the tokenizer's chat template formats them (``tokenizer.chat_template: True``).

Every record is checked when the dataset is built, so a bad one is one ``error:`` line naming it, before training.
"""

from functools import partial
from typing import Tuple

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader.sampler import StatefulDistributedSampler
from torchtune import config
from torchtune.data import padded_collate_packed, padded_collate_sft

from finetune.base import BadInput
from finetune.data.packing import pack_dataset
from finetune.model import attention
from finetune.settings import Settings, first_line

ALPACA_TEXT_FIELDS = ("instruction", "input", "output")
ALPACA_REQUIRED = ("instruction", "output")
INSTRUCT_FIELDS = ("input", "output")
# The dataset kinds whose records are checked, by a name in dataset._component_, and what their records hold.
KINDS = {"alpaca": "alpaca", "instruct": "instruct_dataset", "chat": "chat_dataset"}
RECORDS = {
    "alpaca": "a JSON list of records with instruction, input and output",
    "instruct": "JSON, JSONL or Parquet records with input and output text (dataset.column_map renames columns)",
    "chat": "JSON, JSONL or Parquet records, each with a list of messages in dataset.conversation_column",
    None: "records the dataset builder reads",
}
# Per conversation_style: the keys of a message, and the roles it may have.
CHAT_STYLES = {
    "openai": ("role", "content", ("system", "user", "assistant", "ipython", "tool")),
    "sharegpt": ("from", "value", ("system", "human", "gpt")),
}


def build_dataset(cfg_dataset: DictConfig, tokenizer, settings: Settings, log):
    """The samples (``dataset.packed=False``) or packed rows (``True``) the config names, every record checked."""
    where = cfg_dataset.get("data_files") or cfg_dataset.get("source")
    component = str(cfg_dataset.get("_component_", ""))
    kind = next((k for k, name in KINDS.items() if name in component), None)
    if kind == "chat" and cfg_dataset.get("conversation_style") not in CHAT_STYLES:
        raise BadInput(
            f"dataset.conversation_style={cfg_dataset.get('conversation_style')!r} is not one of "
            f"{', '.join(CHAT_STYLES)}; set dataset.conversation_style=openai (messages of role and content) "
            "or sharegpt (from, value)"
        )
    # The samples are built unpacked and packed here (finetune/data/packing.py: best-fit rows, a token cache).
    cfg_samples = OmegaConf.merge(cfg_dataset, {"packed": False})
    try:
        ds = config.instantiate(cfg_samples, tokenizer)
    except Exception as e:  # datasets wraps parse errors in several types; all mean bad data here
        cause = e
        while cause.__cause__ is not None or cause.__context__ is not None:
            cause = cause.__cause__ or cause.__context__
        raise BadInput(
            f"could not load the dataset {where} ({first_line(cause)}); it must be {RECORDS[kind]} (or a hub name "
            "reachable from here)"
        ) from None
    column_map = cfg_dataset.get("column_map") or {}
    if kind == "alpaca":
        check_text_records(ds, column_map, where, ALPACA_TEXT_FIELDS, ALPACA_REQUIRED)
    elif kind == "instruct":
        check_text_records(ds, column_map, where, INSTRUCT_FIELDS, INSTRUCT_FIELDS)
    elif kind == "chat":
        check_chat_records(
            ds,
            cfg_dataset.get("conversation_column"),
            cfg_dataset.get("conversation_style"),
            bool(cfg_dataset.get("train_on_input", False)),
            where,
        )
    if not settings.packed:
        return ds
    dataset_cfg = OmegaConf.to_container(cfg_dataset, resolve=True)
    fingerprint = getattr(tokenizer, "fingerprint", None)
    if fingerprint is not None:  # an HF tokenizer: its tokenizer_config.json (special tokens, chat template) counts
        dataset_cfg = {**dataset_cfg, "tokenizer": fingerprint}
    cache_parts = dict(
        dataset_cfg=dataset_cfg,
        data_files=settings.data_files,
        tokenizer_path=str(settings.tokenizer_path),
        tokenizer_cfg=settings.tokenizer_cfg,
    )
    return pack_dataset(
        ds,
        max_seq_len=tokenizer.max_seq_len,
        padding_idx=tokenizer.pad_id,
        vocab_size=getattr(tokenizer, "vocab_size", None),
        cache_dir=settings.pack_cache_dir,
        cache_parts=cache_parts,
        log=log,
    )


def check_text_records(ds, column_map: dict, where, fields=ALPACA_TEXT_FIELDS, required=ALPACA_REQUIRED) -> None:
    """Instruction data (Alpaca's instruction, input and output; instruct_dataset's input and output): the
    ``required`` fields are present in every record, and ``fields`` are text. The whole table is checked now (Arrow
    null counts, milliseconds) rather than fail at some step mid-run."""
    table = getattr(ds, "_data", None)
    if not hasattr(table, "column_names"):
        return
    needs = " and ".join(required)
    for field in fields:  # text, not numbers or booleans
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
                f"string; fix or drop that record ({', '.join(fields)} are text)"
            )
    for field in required:
        column = column_map.get(field, field)
        if column not in table.column_names:
            raise BadInput(
                f"the records in {where} have no '{column}' field; each needs {needs} (map other names "
                "with dataset.column_map)"
            )
        values = table.data.column(column)
        if values.null_count:
            row = values.is_null().to_pylist().index(True)
            raise BadInput(f"record {row} of {where} has no '{column}'; fix or drop that record (each needs {needs})")


def check_chat_records(ds, column, style, train_on_input: bool, where) -> None:
    """Conversations: every record's ``column`` is a non-empty list of messages with the style's keys, text
    content and a known role, and (unless ``train_on_input``) an assistant message, so there is something to train
    on. Read once in Python (about a second per 50,000 conversations)."""
    table = getattr(ds, "_data", None)
    if not hasattr(table, "column_names"):
        return
    role_key, text_key, roles = CHAT_STYLES[style]
    trained_role = "assistant" if style == "openai" else "gpt"
    if column not in table.column_names:
        raise BadInput(
            f"the records in {where} have no '{column}' field (dataset.conversation_column); its columns "
            f"are {', '.join(table.column_names)}: set dataset.conversation_column to the one that holds "
            "the messages"
        )
    for i, conversation in enumerate(table[column]):
        if not isinstance(conversation, list) or not conversation:
            raise BadInput(
                f"record {i} of {where}: '{column}' is {str(conversation)[:80]!r}, not a list of "
                "messages; fix or drop that record"
            )
        for j, message in enumerate(conversation):
            role = message.get(role_key) if isinstance(message, dict) else None
            text = message.get(text_key) if isinstance(message, dict) else None
            if role not in roles:
                raise BadInput(
                    f"record {i} of {where}: message {j} has {role_key}={role!r}; use one of "
                    f"{', '.join(roles)} ({style} style), or fix or drop that record"
                )
            if not (isinstance(text, str) or (style == "openai" and isinstance(text, list))):
                raise BadInput(
                    f"record {i} of {where}: message {j} ({role}) has {text_key}={str(text)[:80]!r}, "
                    "not text; fix or drop that record"
                )
        if not train_on_input and not any(m[role_key] == trained_role for m in conversation):
            raise BadInput(
                f"record {i} of {where} has no {trained_role} message, so nothing to train on; fix or drop "
                "that record (or set dataset.train_on_input=True)"
            )
        turn_error = _turn_order([TORCHTUNE_ROLES.get(m[role_key], m[role_key]) for m in conversation])
        if turn_error:
            raise BadInput(
                f"record {i} of {where}: {turn_error} (torchtune's conversation rules); fix or drop that record"
            )


# ShareGPT's roles as torchtune's messages name them.
TORCHTUNE_ROLES = {"human": "user", "gpt": "assistant"}


def _turn_order(roles) -> str:
    """What torchtune's validate_messages would refuse in a conversation (it checks each sample only when it is
    read: mid-run, or while packing), or "" when the order is fine."""
    if len(roles) < 2:
        return f"{len(roles)} message, at least a user and an assistant message are needed"
    last = "assistant"
    for j, role in enumerate(roles):
        if role == "assistant" and last != "user":
            return f"message {j} is an assistant message that follows no user message"
        if role == "user" and last == "user":
            return f"messages {j - 1} and {j} are both user messages"
        if role == "system" and j > 0:
            return f"message {j} is a system message after the first"
        last = role
    return ""


def build_dataloader(
    ds, settings: Settings, *, pad_id: int, ignore_index: int, num_replicas: int = 1, rank: int = 0
) -> Tuple[DataLoader, StatefulDistributedSampler, int]:
    """The loader (rank r of N reads samples r, r+N, ... of one seeded permutation), its sampler, and the optimizer
    steps per epoch (``max_steps_per_epoch`` applied). Too little data for one step is a BadInput."""
    sampler = StatefulDistributedSampler(
        ds, num_replicas=num_replicas, rank=rank, shuffle=settings.shuffle, seed=settings.seed
    )
    loader = DataLoader(
        ds,
        batch_size=settings.batch_size,
        sampler=sampler,
        # (packed rows: torchtune's block mask, or the sample boundaries FlashAttention's varlen kernel takes)
        collate_fn=(attention.collate_varlen if settings.packed_attention == "varlen" else padded_collate_packed)
        if settings.packed
        else partial(padded_collate_sft, padding_idx=pad_id, ignore_idx=ignore_index),
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
            f"{ranks} x gradient_accumulation_steps={settings.accum}); lower batch_size"
        )
    return loader, sampler, steps_per_epoch


def skip_to(sampler: StatefulDistributedSampler, epoch: int, start_step: int, samples_per_step: int) -> None:
    """Point the sampler at ``epoch``, past the samples of its first ``start_step`` optimizer steps (a resumed epoch:
    checkpoints sit on step boundaries, so this is a whole number of micro-batches; each rank skips its share)."""
    sampler.set_epoch(epoch)
    if start_step:
        sampler.load_state_dict({"yielded": start_step * samples_per_step})
