"""Sample packing for the fine-tune recipes (``dataset.packed=True``).

An unpacked Alpaca batch is mostly padding: samples average ~136 tokens and a batch is padded to its longest, so a
batch of 16 at 512 tokens holds about 48 % real tokens. Packing concatenates samples into fixed-length rows
(``tokenizer.max_seq_len``) with a block-causal mask (no sample attends to another) and position ids that restart
at every sample, so almost every slot the GPU computes is a trained token.

How samples are packed matters as much as packing itself. torchtune's ``PackedDataset`` fills rows greedily in
dataset order and closes a row when the next sample does not fit: on Alpaca at 512 tokens that leaves 18 % of every
row as padding (16,410 rows for 6.9 M tokens). Here rows are filled best-fit-decreasing (longest sample first, each
into the fullest row it still fits), which on the same data leaves under 1 % padding, so the same GPU time trains
about 20 % more tokens. Every sample lands in exactly one row, whole; rows are then shuffled by the recipe's sampler
like samples are.

The loss sees the same tokens as unpacked training: the recipe predicts token t+1 at position t, so the first
label of every sample in a row is set to the ignore index (otherwise a sample's last token would be trained to
predict the next sample's first), and pack padding is ignored. ``count_trained_tokens`` counts them.

Tokenizing 52,002 Alpaca records takes ~20 s on two CPU cores; the tokenized samples are cached as a ``.npz``
file (plain arrays, never unpickled) under ``pack_cache_dir``, so the next run loads them in well under a second.
Unpacked data goes the same way where the tokenizer can refuse a record (``finetune/data/loading.py``): every sample
is tokenized at setup, so a refused record stops the run before the first step, and ``SampleTable`` serves the
samples from the same cache. The cache:

- key: everything that makes the tokens: the dataset section (but ``packed``), the data files' content, the
  tokenizer file's content and the whole tokenizer section (max_seq_len, prompt_template, ...).
- checked before use, and rebuilt when anything is off: the arrays' names, shapes and dtypes, a sha256 of them and
  the key stored beside them (a damaged file, or one copied under another key), token ids within the vocabulary,
  no sample longer than the pack, one sample per record, and a few samples tokenized afresh and compared (a cache
  that is consistent but not what this tokenizer makes of this data). The cache folder is trusted as far as the
  data is: whoever can write either decides what is trained on; these checks catch accidents and stale files.
- kept tidy: a file is written to a temporary name and renamed (those a killed run left are deleted after an
  hour); every use touches the file, and files unused for ``MAX_AGE_DAYS`` go, then the least recently used until
  the folder holds at most ``MAX_BYTES``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset
from torchtune.data import CROSS_ENTROPY_IGNORE_IDX
from tqdm import tqdm

from finetune.base import BadInput

# Bump when the cached arrays' meaning changes, so old cache files are not reused.
CACHE_FORMAT = 2
MAX_AGE_DAYS = 30  # a cache file unused this long is deleted
MAX_BYTES = 4 * 2**30  # then the least recently used go until the folder holds at most this
TMP_MAX_AGE_S = 3600  # a temporary file this old was left by a killed run
SPOT_CHECKS = 8  # samples tokenized afresh and compared with a cache file's
ARRAYS = {"tokens": np.int32, "labels": np.int32, "offsets": np.int64}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llm-finetune-recipes" / "packs"


_digests: Dict[tuple, str] = {}


def file_digest(path: Path) -> str:
    """sha256 of a file's content, remembered while its size and mtime stay the same (the resume check asks at
    every checkpoint)."""
    st = Path(path).stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        _digests[key] = h.hexdigest()
    return _digests[key]


def cache_key(
    dataset_cfg: dict,
    data_files: Sequence[str],
    tokenizer_path: str,
    max_seq_len: int,
    tokenizer_cfg: Optional[dict] = None,
) -> str:
    """A digest of everything the tokenized samples depend on (files by their content, not their path)."""
    parts = {
        "format": CACHE_FORMAT,
        # (packed or not, the samples are the same: the one cache serves both)
        "dataset": {k: v for k, v in dataset_cfg.items() if k not in ("data_files", "packed")},
        "data_files": [file_digest(Path(f)) for f in data_files],
        "tokenizer": file_digest(Path(tokenizer_path)),
        "tokenizer_cfg": {k: v for k, v in (tokenizer_cfg or {}).items() if k != "path"},
        "max_seq_len": max_seq_len,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _checksum(key: str, arrays: Dict[str, np.ndarray]) -> np.ndarray:
    h = hashlib.sha256(key.encode())
    for name in ARRAYS:
        h.update(np.ascontiguousarray(arrays[name]).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


def _sample_name(i: int) -> str:
    return f"sample {i + 1} (counting from 1)"


class TokenizedSamples:
    """Every sample's tokens and labels, concatenated, with each sample's start offset."""

    def __init__(self, tokens: np.ndarray, labels: np.ndarray, offsets: np.ndarray):
        self.tokens, self.labels, self.offsets = tokens, labels, offsets

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @classmethod
    def from_dataset(
        cls, ds: Dataset, desc: str = "Tokenizing", names: Callable[[int], str] = _sample_name
    ) -> "TokenizedSamples":
        """Every sample of ``ds`` tokenized, in order. A record the tokenizer refuses (a BadInput: its chat template
        refused the conversation, its regex could not split the text, the text is too long to tokenize) stops
        here, named by ``names(i)``."""
        n = len(ds)
        chunks = _Chunks(ds, size=512)
        # Worker processes share the tokenizing where there are cores to spare (a GPU host); each returns a chunk
        # of samples as three arrays, in order. On a small machine the main process does it alone.
        cores = os.cpu_count() or 1
        workers = min(8, cores - 2) if cores >= 4 and n >= 4 * chunks.size else 0
        # Its own generator: a DataLoader otherwise draws its workers' seed from the global RNG, and the model's
        # random init, built after the data, would then differ between a tokenizing run and a cached one.
        loader = torch.utils.data.DataLoader(
            chunks, batch_size=None, shuffle=False, num_workers=workers, generator=torch.Generator()
        )
        tokens, labels, lengths = [], [], [np.zeros(1, np.int64)]
        with tqdm(total=n, desc=desc, dynamic_ncols=True, mininterval=1.0) as bar:
            for chunk in loader:
                if len(chunk) == 2:  # (a refused record: its index and why)
                    raise BadInput(f"{names(int(chunk[0]))}: {chunk[1]}")
                tok, lab, length = chunk
                tokens.append(tok)
                labels.append(lab)
                lengths.append(length)
                bar.update(len(length))
        return cls(
            np.concatenate(tokens) if tokens else np.zeros(0, np.int32),
            np.concatenate(labels) if labels else np.zeros(0, np.int32),
            np.cumsum(np.concatenate(lengths)),
        )

    def save(self, path: Path, key: str = "") -> None:
        """Write atomically (a crash mid-write never leaves a truncated cache file under the real name), with a
        checksum of the arrays and ``key``."""
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {
            "tokens": self.tokens.astype(np.int32),
            "labels": self.labels.astype(np.int32),
            "offsets": self.offsets.astype(np.int64),
        }
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays, checksum=_checksum(key, arrays))
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: Path, key: str = "") -> Optional["TokenizedSamples"]:
        """The cached samples, or None if the file is unreadable, malformed or fails its checksum (it is then
        rebuilt)."""
        try:
            with np.load(path, allow_pickle=False) as z:
                if not isinstance(z, np.lib.npyio.NpzFile) or set(z.files) != {*ARRAYS, "checksum"}:
                    return None
                arrays = {name: z[name] for name in (*ARRAYS, "checksum")}
        except (OSError, ValueError, KeyError, EOFError, AttributeError, TypeError, zipfile.BadZipFile):
            return None  # (a .npy array has no __enter__: AttributeError)
        if any(arrays[n].dtype != t or arrays[n].ndim != 1 for n, t in ARRAYS.items()):
            return None
        if not np.array_equal(arrays["checksum"], _checksum(key, arrays)):
            return None
        out = cls(arrays["tokens"], arrays["labels"], arrays["offsets"])
        ok = (
            len(out.offsets) >= 1
            and out.offsets[0] == 0
            and out.offsets[-1] == len(out.tokens) == len(out.labels)
            and bool(np.all(np.diff(out.offsets) >= 0))
        )
        return out if ok else None


class SampleTable(Dataset):
    """The samples one by one (``dataset.packed=False``), read from the tokenized arrays: what the dataset's own
    ``__getitem__`` returns for the loss (tokens and labels), without tokenizing the record again."""

    def __init__(self, samples: TokenizedSamples):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Dict[str, List[int]]:
        a, b = int(self.samples.offsets[i]), int(self.samples.offsets[i + 1])
        return {"tokens": self.samples.tokens[a:b].tolist(), "labels": self.samples.labels[a:b].tolist()}


class _Chunks(Dataset):
    """Chunk c of a dataset as (tokens, labels, lengths) arrays: one item per worker round trip, not per sample."""

    def __init__(self, ds: Dataset, size: int):
        self.ds, self.size = ds, size

    def __len__(self) -> int:
        return (len(self.ds) + self.size - 1) // self.size

    def __getitem__(self, c: int):
        items = []
        for i in range(c * self.size, min(len(self.ds), (c + 1) * self.size)):
            try:
                items.append(self.ds[i])
            except BadInput as e:  # returned, not raised: a worker process's exception comes back as a traceback
                return i, str(e)
        return (
            np.fromiter((t for s in items for t in s["tokens"]), dtype=np.int32),
            np.fromiter((t for s in items for t in s["labels"]), dtype=np.int32),
            np.array([len(s["tokens"]) for s in items], dtype=np.int64),
        )


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> List[List[int]]:
    """Group sample indices into rows of at most ``capacity`` tokens, best-fit-decreasing.

    Samples are taken longest first (ties by index, so the result is deterministic); each goes into the open row
    with the least room that still holds it, or opens a new row. Rows are returned in the order they were opened,
    each listing its samples in the order they were placed.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: List[List[int]] = []
    room: List[tuple] = []  # sorted (free tokens, row id) of rows that still have space
    for i in order:
        n = int(lengths[i])
        if n > capacity:
            raise ValueError(f"sample {i} has {n} tokens, more than the pack length {capacity}")
        if n == 0:
            continue
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            free, r = room.pop(k)
        else:
            free, r = capacity, len(rows)
            rows.append([])
        rows[r].append(i)
        if free - n > 0:
            bisect.insort(room, (free - n, r))
    return rows


class PackedSFTDataset(Dataset):
    """Rows of ``max_seq_len`` tokens, each holding whole samples, in the format of torchtune's PackedDataset.

    An item is ``tokens``, ``labels``, ``input_pos`` (position within its sample) and ``seq_lens`` (the samples'
    lengths, then the padding's as one more segment), so torchtune's ``padded_collate_packed`` builds the
    block-causal mask from it (a flex-attention BlockMask on GPUs, a dense mask on the CPU).
    """

    def __init__(self, samples: TokenizedSamples, max_seq_len: int, padding_idx: int):
        self.samples = samples
        self.max_seq_len = max_seq_len
        self.padding_idx = padding_idx
        self.rows = best_fit_decreasing(samples.lengths.tolist(), max_seq_len)

    def __len__(self) -> int:
        return len(self.rows)

    def fill(self) -> float:
        """The share of slots holding sample tokens (the rest is pack padding)."""
        used = int(self.samples.lengths.sum())
        return used / max(1, len(self.rows) * self.max_seq_len)

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        s, S = self.samples, self.max_seq_len
        tokens = np.full(S, self.padding_idx, dtype=np.int64)
        labels = np.full(S, CROSS_ENTROPY_IGNORE_IDX, dtype=np.int64)
        input_pos = np.zeros(S, dtype=np.int64)
        seq_lens, at = [], 0
        for i in self.rows[idx]:
            a, b = int(s.offsets[i]), int(s.offsets[i + 1])
            n = b - a
            tokens[at : at + n] = s.tokens[a:b]
            labels[at : at + n] = s.labels[a:b]
            # Position t predicts label t+1 in the recipe: the sample's first label would be predicted from the
            # previous sample's last token, which unpacked training never does.
            labels[at] = CROSS_ENTROPY_IGNORE_IDX
            input_pos[at : at + n] = np.arange(n)
            seq_lens.append(n)
            at += n
        if at < S:
            # Padding: its own segment (it attends only to itself), positions counting on, clamped to the table.
            start = input_pos[at - 1] + 1 if at else 0
            input_pos[at:] = np.minimum(np.arange(start, start + S - at), S - 1)
            seq_lens.append(S - at)
        return {
            "tokens": torch.from_numpy(tokens),
            "labels": torch.from_numpy(labels),
            "input_pos": torch.from_numpy(input_pos),
            "seq_lens": torch.tensor(seq_lens, dtype=torch.long),
        }


def count_trained_tokens(labels: torch.Tensor, ignore_index: int = CROSS_ENTROPY_IGNORE_IDX) -> int:
    """Tokens the recipe trains on in a [batch, seq] label tensor: position t predicts label t+1."""
    return int((labels[..., 1:] != ignore_index).sum())


def _cache_problem(
    samples: TokenizedSamples,
    ds: Dataset,
    max_seq_len: Optional[int],
    vocab_size: Optional[int],
    ignore_index: int = CROSS_ENTROPY_IGNORE_IDX,
) -> Optional[str]:
    """Why cached samples (checksum passed) cannot serve for ``ds``, or None."""
    if len(samples) != len(ds):
        return f"{len(samples)} samples for a dataset of {len(ds)}"
    if len(samples) and max_seq_len is not None and int(samples.lengths.max()) > max_seq_len:
        return f"a sample of {int(samples.lengths.max())} tokens, longer than the pack ({max_seq_len})"
    labels = samples.labels[samples.labels != ignore_index]
    for name, ids in (("token", samples.tokens), ("label", labels)):
        if len(ids) and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
            return f"{name} ids outside the vocabulary [0, {vocab_size})"
    n = len(samples)
    for i in sorted({round(k * (n - 1) / max(1, SPOT_CHECKS - 1)) for k in range(SPOT_CHECKS)} if n else ()):
        a, b = int(samples.offsets[i]), int(samples.offsets[i + 1])
        fresh = ds[i]
        if not (
            np.array_equal(samples.tokens[a:b], fresh["tokens"])
            and np.array_equal(samples.labels[a:b], fresh["labels"])
        ):
            return f"sample {i} differs from what the tokenizer makes of its record"
    return None


def tidy_cache(cache_dir: Path, keep: Path, now: Optional[float] = None) -> None:
    """Delete temporary files a killed run left, cache files unused for MAX_AGE_DAYS, then the least recently used
    until the folder holds at most MAX_BYTES (``keep``, the file this run uses, always stays)."""
    now = time.time() if now is None else now
    try:
        entries = [(p, p.stat()) for p in cache_dir.iterdir() if p.is_file()]
    except OSError:
        return
    kept = []
    for p, st in entries:
        stale = (p.name.startswith(".tmp-") and now - st.st_mtime > TMP_MAX_AGE_S) or (
            p.name.startswith("samples-") and p != keep and now - st.st_mtime > MAX_AGE_DAYS * 86400
        )
        if stale:
            p.unlink(missing_ok=True)
        elif p.name.startswith("samples-") and p != keep:
            kept.append((st.st_mtime, st.st_size, p))
    total = sum(size for _, size, _ in kept) + (keep.stat().st_size if keep.is_file() else 0)
    for _, size, p in sorted(kept, key=lambda e: e[0]):  # least recently used first
        if total <= MAX_BYTES:
            break
        p.unlink(missing_ok=True)
        total -= size


def tokenized_samples(
    ds: Dataset,
    *,
    max_seq_len: Optional[int],
    cache_dir: Optional[Path],
    cache_parts: dict,
    log,
    vocab_size: Optional[int] = None,
    names: Callable[[int], str] = _sample_name,
) -> Tuple[TokenizedSamples, str]:
    """Every sample of ``ds`` tokenized once (a record the tokenizer refuses stops here, named by ``names``), or
    loaded from the cache; and where they came from ("cache" or "tokenized").

    ``cache_parts`` are what the samples depend on besides the data (``cache_key``'s arguments: the dataset config,
    the data files, the tokenizer file and section); ``cache_dir=None`` caches nothing. A cache file that fails any
    check is rebuilt (``_cache_problem``); one that cannot be written costs the next run time, nothing else.
    """
    samples, cache_file, key = None, None, ""
    if cache_dir is not None:
        key = cache_key(max_seq_len=max_seq_len, **cache_parts)
        cache_file = cache_dir / f"samples-{key}.npz"
        if cache_file.exists():
            samples = TokenizedSamples.load(cache_file, key) if cache_file.is_file() else None
            problem = (
                "unreadable, malformed or failed its checksum"
                if samples is None
                else _cache_problem(samples, ds, max_seq_len, vocab_size)
            )
            if problem is not None:
                log.warning(f"the pack cache {cache_file} is not usable ({problem}): tokenizing again")
                samples = None
    source = "cache" if samples is not None else "tokenized"
    if samples is None:
        samples = TokenizedSamples.from_dataset(ds, names=names)
        if cache_file is not None:
            try:
                samples.save(cache_file, key)
            except OSError as e:
                log.warning(f"could not write the pack cache {cache_file} ({e.strerror or e}); continuing")
    if cache_file is not None:
        try:
            os.utime(cache_file)  # (its mtime says when it was last used)
        except OSError:
            pass
        tidy_cache(cache_dir, cache_file)
    return samples, source


def pack_dataset(
    ds: Dataset,
    *,
    max_seq_len: Optional[int],
    padding_idx: int,
    cache_dir: Optional[Path],
    cache_parts: dict,
    log,
    vocab_size: Optional[int] = None,
    names: Callable[[int], str] = _sample_name,
) -> PackedSFTDataset:
    """``dataset.packed=True``: every sample tokenized once (or loaded from the cache: ``tokenized_samples``) and
    packed into rows of ``max_seq_len`` (the tokenizer's) tokens."""
    if max_seq_len is None:
        raise BadInput(
            "dataset.packed=True needs a pack length: set tokenizer.max_seq_len (e.g. 512); samples longer "
            "than it are truncated by the tokenizer"
        )
    t0 = time.perf_counter()
    samples, source = tokenized_samples(
        ds,
        max_seq_len=max_seq_len,
        cache_dir=cache_dir,
        cache_parts=cache_parts,
        log=log,
        vocab_size=vocab_size,
        names=names,
    )
    packed = PackedSFTDataset(samples, max_seq_len=max_seq_len, padding_idx=padding_idx)
    log.info(
        f"Packed {len(samples)} samples into {len(packed)} rows of {max_seq_len} tokens "
        f"({packed.fill():.1%} filled; {source} in {time.perf_counter() - t0:.1f} s)"
    )
    return packed
