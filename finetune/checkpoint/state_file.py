"""A recipe state file (``recipe_state.pt``, ``recipe_state_rank{r}.pt``) written with its checksum, and checked
against it before a resume reads it. Part of the checkpoint component (``checkpointer.py`` writes through ``save``,
``resume.py`` reads through ``verify``).

torch.load does not check its zip records' CRCs (with mmap it reads nothing until a tensor is touched), and a file
that was edited and saved again by torch.save has consistent CRCs of its own. So the CRC-32 of the whole file is
computed while torch.save writes it, as the bytes pass to the file on the writer's thread (no second read of a
multi-GB file), and kept beside it in ``{name}.crc32`` (JSON: the checksum and the size). A resume reads the file
once, sequentially, and compares before anything is unpickled.

Why CRC-32 and not SHA-256: what this guards against is damage (a failing disk, a partial copy, flipped bytes, an
edit), not an attacker. Whoever can rewrite the file can rewrite its checksum beside it, and what a file can do when
loaded is bounded by ``weights_only`` loading anyway. CRC-32 detects every burst of up to 32 bits and misses random
damage with probability 2^-32. zlib.crc32 ran at 6.9 GB/s on the 2-core CI CPU (AMD EPYC, 256 MiB buffer), SHA-256
at 2.0 GB/s: for a 7 GB 4-bit state that is about 1 s of the background writer and of the resume's read, against
3.5 s. Through the checksumming file object torch.save wrote 1 GiB at the speed of writing it by path
(0.37 s, page cache), plus 0.18 s of CRC.

A file without a checksum beside it (a checkpoint written before checksums, or copied without its ``.crc32``) still
resumes, with a warning: its zip records' own CRCs (written by torch.save) are checked instead, which finds damaged
bytes but not an edit saved again by torch.save.
"""

import json
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from finetune.base import BadInput, first_line

CHECKSUM_SUFFIX = ".crc32"
_CHUNK = 16 * 2**20  # the resume's read: large enough to run at the disk's speed, small next to any state


def checksum_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + CHECKSUM_SUFFIX)


def resume_elsewhere(folder: Path) -> str:
    """What to do with a checkpoint whose state cannot be trusted: the fix every refusal of one names."""
    return (
        f"resume from another checkpoint (an earlier step_N or epoch_E), or start a new run from its weights with "
        f"checkpoint_dir={folder} and no resume_from_checkpoint"
    )


class _Summing:
    """A file object that passes every write on to ``f`` and keeps the CRC-32 and size of what went through."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def __repr__(self) -> str:  # (the file's, as torch.save's callers may read it: "<... name='PATH'>")
        return f"<checksummed {self.f!r}>"

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)  # (releases the GIL on large buffers, as the file write does)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save(obj: Any, path: Path, save_fn: Optional[Callable[[Any, Any], None]] = None) -> None:
    """``save_fn(obj, file)`` (torch.save, looked up at the call, or a variant with its signature) into ``path``, and
    its checksum beside it."""
    with open(path, "wb") as f:
        out = _Summing(f)
        (save_fn or torch.save)(obj, out)
    record = {"crc32": f"{out.crc:08x}", "bytes": out.size}
    checksum_path(path).write_text(json.dumps(record) + "\n")


def verify(path: Path, fix: str) -> bool:
    """Check ``path`` against the checksum saved beside it: True if it matched, False where it has none (then its
    zip records' CRCs were checked). A mismatch, a damaged record or an unreadable checksum file is a BadInput
    naming the file and ``fix``."""
    path, kept = Path(path), checksum_path(path)
    if not kept.is_file():
        _check_records(path, fix)
        return False
    try:
        record = json.loads(kept.read_text())
        want, size = int(record["crc32"], 16), int(record["bytes"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise BadInput(f"{kept} is not a checksum this recipe wrote ({first_line(e)}); {fix}") from None
    crc, got = 0, 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                crc, got = zlib.crc32(chunk, crc), got + len(chunk)
    except OSError as e:
        raise BadInput(f"{path} is unreadable ({first_line(e)}); {fix}") from None
    if (crc, got) != (want, size):
        raise BadInput(
            f"{path} does not match the checksum saved with it in {kept.name} (CRC-32 {want:08x} of {size} bytes; "
            f"the file: {crc:08x} of {got} bytes): it was damaged or edited after it was written; {fix} (to resume "
            f"from an edited file on purpose, delete {kept.name}: it is then read unverified)"
        )
    return True


def _check_records(path: Path, fix: str) -> None:
    """The CRC of every record of a torch zip file (what torch.load skips); a file that is not a zip is left to
    torch.load, which names what it is."""
    try:
        with zipfile.ZipFile(path) as z:
            bad: Optional[str] = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError):
        return
    except Exception as e:  # (a record whose header is damaged: zipfile's own errors vary)
        raise BadInput(f"{path} is damaged ({first_line(e)}); {fix}") from None
    if bad is not None:
        raise BadInput(f"{path} is damaged: its record {bad} fails its CRC check; {fix}")
