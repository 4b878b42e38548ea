"""Hand a loaded model to lm-eval and keep what it returns: lm-eval's HFLM wrapper, simple_evaluate, table and
results JSON. We add no scoring of our own."""

import json
from datetime import datetime
from pathlib import Path

import lm_eval
from lm_eval.tasks import TaskManager
from lm_eval.utils import handle_non_serializable, make_table

try:
    from lm_eval.models.huggingface import HFLM
except ImportError as e:  # lm-eval installs its HF backend's dependencies only with the `lm_eval[hf]` extra
    raise ImportError(f"lm-eval's HF model class cannot be imported ({e}): pip install accelerate (or 'lm_eval[hf]')") from e


def evaluate(model, tokenizer, task, *, add_bos: bool, batch_size: int, limit: int | None) -> dict:
    """lm_eval.simple_evaluate on an in-memory model, with lm-eval's own HF model class doing the requests."""
    lm = HFLM(pretrained=model, tokenizer=tokenizer, add_bos_token=add_bos, batch_size=batch_size)
    # A task config (offline) needs no index of lm-eval's ~10k task YAMLs, which takes ~15 s to build.
    task_manager = TaskManager(include_defaults=isinstance(task, str))
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


def log_to_wandb(results: dict, project: str, run_name: str) -> None:
    """Scores, task config and a results table to a W&B run, through lm-eval's own W&B logger."""
    from lm_eval.loggers import WandbLogger

    try:
        import wandb  # noqa: F401  (an optional dependency; WandbLogger imports it too)
    except ImportError as e:
        raise ImportError(f"wandb logging needs the wandb package ({e}): pip install wandb, or unset wandb_project") from e
    logger = WandbLogger(init_args={"project": project, "name": run_name, "job_type": "eval"})
    logger.post_init(results)
    logger.log_eval_result()
    logger.run.finish()
