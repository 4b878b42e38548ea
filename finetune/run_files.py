"""The two small JSON files that tie a run folder, its checkpoints, its wandb run and its eval scores together.

- ``{output_dir}/summary.json``: the run's summary, flat, with the keys of its wandb summary (``name``, ``group``,
  ``tags``, ``tokens_per_second_median``, ``peak_memory_alloc_gib``, ..., ``final_loss``) plus the eval's
  ``eval/...`` keys. The fine-tune recipe writes it at the end of a run, the eval adds its scores, and
  ``bench/table.py`` builds the comparison table from it. Both merge into what is there (``update_summary``).
- ``{checkpoint}/run.json``: which run wrote the checkpoint: its name, group, tags, the global step, and its wandb
  run (id, project, entity, mode, folder) when it logged to wandb. The eval reads it to write its scores into that
  run; a checkpoint without it (any HF folder) gets a run of its own.

Both recipes/ and eval/ use these, so the file names (``metrics.jsonl``'s too, and the checkpoint folders' prefixes) and
their reading live here, once; the checkpoint and reporting components both name them, and neither imports the other.
"""

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Optional

METRICS_FILE = "metrics.jsonl"  # every step's record (finetune/reporting/metrics.py); it marks a run folder
SUMMARY_FILE = "summary.json"
RUN_FILE = "run.json"
CHECKPOINT_PREFIXES = ("step_", "epoch_")  # a checkpoint folder's name: step_N or epoch_E


def tag() -> str:
    """A suffix no other run can produce: this PID plus a random part (a PID alone is reused)."""
    return f"{os.getpid()}-{uuid.uuid4().hex[:8]}"


def read_json(path: Path) -> Optional[Dict[str, Any]]:
    """A JSON object from ``path``, or None when the file is missing or is not a JSON object (a partial copy)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def write_json(path: Path, data: Dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole or not at all (a temporary file renamed over it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{tag()}")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, allow_nan=False) + "\n")
    os.replace(tmp, path)


def update_summary(folder: Path, values: Dict[str, Any]) -> Path:
    """Merge ``values`` into ``{folder}/summary.json`` (created if missing) and return its path. Keys already there
    and not in ``values`` stay: the fine-tune's numbers and the eval's scores live side by side."""
    path = Path(folder) / SUMMARY_FILE
    write_json(path, {**(read_json(path) or {}), **values})
    return path


def read_run_file(checkpoint_dir: Path) -> Optional[Dict[str, Any]]:
    """``{checkpoint_dir}/run.json`` (None for a folder this repository's recipes did not write, or wrote without a
    metric logger)."""
    return read_json(Path(checkpoint_dir) / RUN_FILE)


def keep_wandb_logs_inside(run_dir: Path) -> None:
    """Replace the ``logs/debug-core.log`` of a finished wandb run folder by a copy of what it shows. wandb-core makes
    it an absolute symlink to its own log in ~/.cache/wandb, so a run folder moved to another machine (to upload it
    there) would carry a dangling link. Both the fine-tune's run and the eval's call this once their run is
    finished."""
    link = Path(run_dir) / "logs" / "debug-core.log"
    if link.is_symlink():
        target = link.resolve()
        link.unlink()
        if target.is_file():
            shutil.copyfile(target, link)
