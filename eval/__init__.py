"""truthfulqa_mc2 on our checkpoints, scored by lm-eval (docs/eval.md).

lm-eval does the scoring; this package adds what it lacks here: loading our HF-format checkpoint folders and the
SentencePiece tokenizer offline, the task read from a local mc_task.json, and clear errors for bad input.
"""

from eval.errors import EvalInputError
from eval.truthfulqa import SUPPORTED_TASKS, TASK_NAME

__all__ = ["EvalInputError", "SUPPORTED_TASKS", "TASK_NAME"]
