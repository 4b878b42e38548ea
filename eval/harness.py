"""Hand a loaded model to lm-eval and keep what it returns: lm-eval's HFLM wrapper, simple_evaluate, table and
results JSON. We add no scoring of our own; only where the scores go: the results file, the training run that wrote
the checkpoint (its wandb run and its folder's summary.json), or a wandb run of their own."""

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Dict, Optional

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

from finetune.run_files import keep_wandb_logs_inside

try:
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # lm-eval installs its HF backend's dependencies only with the `lm_eval[hf]` extra
    raise ImportError(
        f"lm-eval's HF model class cannot be imported ({e}): pip install accelerate (or 'lm_eval[hf]')"
    ) from e


def evaluate(
    model, tokenizer, task, *, add_bos: bool, batch_size: int, limit: int | None, task_dir: Path | None = None
) -> dict:
    """lm_eval.simple_evaluate on an in-memory model, with lm-eval's own HF model class doing the requests. ``task``:
    a task config, or the name of one of lm-eval's tasks, looked up in ``task_dir`` when given."""
    lm = HFLM(pretrained=model, tokenizer=tokenizer, add_bos_token=add_bos, batch_size=batch_size)
    # Indexing all of lm-eval's ~10k task YAMLs takes 15-18 s. A task config needs no index, and a named task only
    # that of the folder that defines it.
    index_all = isinstance(task, str) and task_dir is None
    task_manager = TaskManager(include_defaults=index_all, include_path=str(task_dir) if task_dir else None)
    return lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=task_manager, limit=limit, log_samples=False)


def table(results: dict) -> str:
    return make_table(results)


def save(results: dict, output_dir) -> Path:
    """Write the results as lm-eval's CLI does (results_<timestamp>.json) into output_dir."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / f"results_{datetime.now().isoformat().replace(':', '-')}.json"
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False))
    return path


def log_to_wandb(
    results: dict, project: str, run_name: str, values: Optional[Dict[str, Any]] = None, folder: Optional[Path] = None
) -> None:
    """Scores, task config and a results table to a W&B run of their own, through lm-eval's own W&B logger, and
    ``values`` (the ``eval/...`` keys) into its summary, where a training run keeps them. The run's files go to
    ``$WANDB_DIR/wandb`` if set, else ``{folder}/wandb`` (beside the results file)."""
    from lm_eval.loggers import WandbLogger

    try:
        import wandb  # noqa: F401  (an optional dependency; WandbLogger imports it too)
    except ImportError as e:
        raise ImportError(
            f"wandb logging needs the wandb package ({e}): pip install wandb, or unset wandb_project"
        ) from e
    mode = wandb_mode(None)  # (offline without WANDB_API_KEY, as the fine-tune recipe)
    where = os.environ.get("WANDB_DIR") or folder
    logger = WandbLogger(
        init_args={
            "project": project,
            "name": run_name,
            "job_type": "eval",
            **({"mode": mode} if mode else {}),
            **({"dir": str(where)} if where else {}),
        }
    )
    logger.post_init(results)
    logger.log_eval_result()
    logger.run.summary.update(values or {})
    finish(logger.run)


def scores(results: dict, task: str) -> Dict[str, Any]:
    """The task's numbers under the ``eval/`` keys a training run's summary and history hold them by."""
    metrics = results["results"][task]
    out = {
        f"eval/{task}": metrics["acc,none"],
        f"eval/{task}_stderr": metrics.get("acc_stderr,none"),
        "eval/questions": results["n-samples"][task]["effective"],
    }
    return {k: v for k, v in out.items() if isinstance(v, (int, float))}


def wandb_mode(training_mode: Optional[str]) -> Optional[str]:
    """The mode of the eval's wandb run: WANDB_MODE if set, else offline when the training run was offline or there
    is no WANDB_API_KEY (as the fine-tune recipe decides), else wandb's default (online). Passed to wandb.init
    explicitly: wandb reads the environment once per process, and the eval may run after a training run in one."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if training_mode == "offline" or not os.environ.get("WANDB_API_KEY"):
        return "offline"
    return None


def log_to_training_run(
    values: Dict[str, Any], wandb_run: Dict[str, Any], *, global_step: Optional[int], next_step: int, fallback_dir: Path
) -> Dict[str, Any]:
    """``values`` (the ``eval/...`` scores) into the wandb run that trained the checkpoint, resumed by its id: a
    history row (at ``global_step`` on the run's x-axis) and the run's summary. Returns where it went.

    Online, wandb resumes the run on the server: its summary and config are kept and the row is appended after its
    last step. Offline (the default without WANDB_API_KEY, or when the training run was offline), wandb writes a
    new ``offline-run-*`` folder for the same id beside the training run's, recording that it resumes it; `wandb
    sync` on the folder holding both uploads the training run first (same run, earlier start) and appends this one
    to it, the summary merged (wandb 0.31). The row's step is the history's next (``next_step``, from the training
    run's summary.json) or wandb's, whichever is later: a step at or before the last is dropped by wandb.
    """
    import wandb

    folder = Path(wandb_run.get("dir") or "")
    if not (wandb_run.get("dir") and folder.is_dir()):  # (a copied or moved checkpoint: beside its run folder)
        folder = Path(fallback_dir)
    folder.mkdir(parents=True, exist_ok=True)
    mode = wandb_mode(wandb_run.get("mode"))
    run = wandb.init(
        id=wandb_run["id"],
        project=wandb_run.get("project"),
        entity=wandb_run.get("entity"),
        resume="allow",
        dir=str(folder),
        **({"mode": mode} if mode else {}),
        **quiet_settings(mode),
    )
    step = max(int(run.step), int(next_step))
    run.log({**values, **({"global_step": global_step} if global_step is not None else {})}, step=step)
    run.summary.update(values)
    where = {"wandb_run_id": run.id, "wandb_dir": str(Path(run.dir).parent), "wandb_next_step": step + 1}
    if str(run.settings.mode) == "offline":
        # The folder holding both runs' files (docs/wandb.md, "Offline"): wandb's own hint names this run's folder
        # alone, whose upload before the training run's breaks the merge.
        where["wandb_sync"] = f"wandb sync {Path(run.dir).parent.parent}"
    finish(run)
    return where


def finish(run) -> None:
    """Finish the eval's wandb run and leave its folder complete and self-contained.

    ``run.finish()`` returns once wandb-core has taken the run's last records, but it only informs the service that
    the run is done (a message, not a request it waits on): the service writes the run-*.wandb file's last records
    and closes it a moment later. A reader right after the eval, in the same process, could then find the history
    without the score row (seen under load: a file of 7 bytes, its header only, when finish returned). Stopping the
    service, once no other run of this process is active, waits for it to close every run's files; the next
    wandb.init starts a new one (about a second). Then the folder's one link out (``keep_wandb_logs_inside``)
    becomes a copy."""
    import wandb

    run_dir = Path(run.dir).parent
    run.finish()
    if wandb.run is None:
        wandb.teardown()
    keep_wandb_logs_inside(run_dir)


def quiet_settings(mode: Optional[str]) -> Dict[str, Any]:
    """wandb.init's ``settings`` for the eval's run: silent offline (its ~15 lines end in a `wandb sync` of the
    eval's folder alone, the upload that breaks the merge; the eval prints the right one), quiet online (the run's
    URL still shows). WANDB_SILENT or WANDB_QUIET in the environment decide instead."""
    if os.environ.get("WANDB_SILENT") or os.environ.get("WANDB_QUIET"):
        return {}
    import wandb

    return {"settings": wandb.Settings(**({"silent": True} if mode in ("offline", "disabled") else {"quiet": True}))}
