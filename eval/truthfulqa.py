"""truthfulqa_mc2 exactly as lm-eval defines it, read from a local mc_task.json when the hub is out of reach.

lm-eval's task reads the hub dataset `truthfulqa/truthful_qa` ("multiple_choice", validation split, 817 rows
{question, mc1_targets: {choices, labels}, mc2_targets: {choices, labels}}). The hub builds those rows from
TruthfulQA's mc_task.json by turning each {answer: label} map into two parallel lists, in the map's order.
We make the same rows from the local file and hand lm-eval its own task config (0-shot after a fixed QA prompt,
choices, `process_results_mc2`, version) with only the dataset source swapped. Nothing here scores anything.
"""

import json
from pathlib import Path

import datasets
import lm_eval.tasks
from lm_eval.tasks._yaml_loader import load_yaml

from eval.errors import EvalInputError

TASK_NAME = "truthfulqa_mc2"
TASK_DIR = Path(lm_eval.tasks.__file__).parent / "truthfulqa"  # lm-eval's YAMLs of the truthfulqa tasks
SUPPORTED_TASKS = (TASK_NAME,)
DATA_FILE = Path("truthfulqa") / "mc_task.json"  # inside data_dir
DATA_SOURCES = ("local", "hub")
FIX_DATA = "point data_dir at the folder that holds truthfulqa/mc_task.json (default ../shared/data)"


def check_tasks(tasks) -> list[str]:
    """The requested task names, or an error for any we don't support."""
    names = [tasks] if isinstance(tasks, str) else list(tasks or [])
    unsupported = [name for name in names if name not in SUPPORTED_TASKS]
    if not names or unsupported:
        raise EvalInputError(
            f"tasks={names}: unsupported task {unsupported or '(none given)'}; "
            f"this recipe runs only {list(SUPPORTED_TASKS)}: set tasks=[{TASK_NAME}]"
        )
    return names


def lm_eval_task_config(name: str = TASK_NAME) -> dict:
    """lm-eval's own config for `name` (its YAML with `include` merged and `!function` imported)."""
    return load_yaml(TASK_DIR / f"{name}.yaml", resolve_func=True)


def read_mc_task(path) -> list[dict]:
    """TruthfulQA's mc_task.json as the hub's rows, in the file's order; a clear error if it is missing or malformed."""
    path = Path(path)
    if not path.is_file():
        raise EvalInputError(f"data file {path} not found: {FIX_DATA}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EvalInputError(
            f"data file {path} is not valid JSON ({e}): restore TruthfulQA's mc_task.json there, or {FIX_DATA}"
        )
    if not isinstance(raw, list) or not raw:
        raise EvalInputError(
            f"data file {path} should hold a non-empty JSON list of questions: restore TruthfulQA's mc_task.json, or {FIX_DATA}"
        )
    return [_hub_row(item, i, path) for i, item in enumerate(raw)]


def _hub_row(item, i: int, path: Path) -> dict:
    def bad(what):
        return EvalInputError(
            f"data file {path}, question {i}: {what}; restore TruthfulQA's mc_task.json, or {FIX_DATA}"
        )

    if not isinstance(item, dict) or not isinstance(item.get("question"), str):
        raise bad("expected {question, mc1_targets, mc2_targets} with a string question")
    row = {"question": item["question"]}
    for key in ("mc1_targets", "mc2_targets"):
        targets = item.get(key)
        if not isinstance(targets, dict) or not targets:
            raise bad(f"{key} should be a non-empty {{answer: label}} map")
        labels = list(targets.values())
        if any(type(label) is not int or label not in (0, 1) for label in labels) or 1 not in labels:
            raise bad(f"{key} labels should be 0/1 with at least one 1, got {labels}")
        row[key] = {"choices": list(targets), "labels": labels}
    return row


def load_local_dataset(data_file: str, **_task_metadata) -> datasets.DatasetDict:
    """lm-eval `custom_dataset` hook: the local file as the hub's validation split (lm-eval passes the task
    metadata as keyword arguments too; they are not needed here)."""
    return datasets.DatasetDict({"validation": datasets.Dataset.from_list(read_mc_task(data_file))})


def local_task_config(data_file) -> dict:
    """lm-eval's truthfulqa_mc2 config reading `data_file` instead of the hub; same name, prompt, choices and scoring."""
    cfg = lm_eval_task_config(TASK_NAME)
    cfg.update(
        dataset_path=str(data_file),  # recorded in the results JSON; loading goes through custom_dataset
        dataset_name=None,
        dataset_kwargs={"data_file": str(data_file)},
        custom_dataset=load_local_dataset,
    )
    cfg["metadata"] = {**cfg.get("metadata", {}), "data_source": "local"}
    return cfg


def task_spec(data_source: str, data_dir):
    """What to hand lm_eval.simple_evaluate: the task name (hub) or the local task config (local)."""
    if data_source == "hub":
        return TASK_NAME
    if data_source == "local":
        data_file = Path(data_dir) / DATA_FILE
        read_mc_task(data_file)  # fail now, with our message, rather than inside lm-eval
        return local_task_config(data_file.resolve())
    raise EvalInputError(
        f"data_source={data_source!r} is not one of {list(DATA_SOURCES)}: set data_source=local (offline) or data_source=hub"
    )
