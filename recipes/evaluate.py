"""Score a checkpoint on truthfulqa_mc2 with lm-eval (docs/eval.md).

    tune run recipes/evaluate.py --config configs/eval/truthfulqa_mc2.yaml checkpoint_dir=/tmp/tiny/epoch_0
    tune run recipes/evaluate.py --config configs/eval/truthfulqa_mc2.yaml --help   # this text and the keys

The scoring is lm-eval's: its HF model class (HFLM) runs the loglikelihood requests, its truthfulqa_mc2 task
builds the prompt (0-shot, after a fixed QA prompt of six pairs) and the choices, and its `process_results_mc2`
turns them into the score. This recipe loads our checkpoint, hands it over, and reports.

Features (each behind a config key):
    - checkpoint_dir: an HF-format folder of Llama 2 / 3.x, Qwen 2.5 / 3 or Mistral (the fine-tune recipe's
      epoch_N/ or step_N/, or a downloaded model), loaded by transformers' AutoModelForCausalLM as lm-eval's `hf`
      path loads it. A missing, partial, foreign or non-finite checkpoint stops with one message and exit status 2
      (as the fine-tune recipe).
    - tokenizer_path: default the checkpoint's own tokenizer: its SentencePiece tokenizer.model (Llama 2), else its
      tokenizer.json (with tokenizer_config.json beside it).
    - data_source: `local` reads {data_dir}/truthfulqa/mc_task.json (no network) into lm-eval's own task;
      `hub` runs lm-eval's task as-is, downloading truthfulqa/truthful_qa. Same documents, prompt, choices.
    - tasks: [truthfulqa_mc2], the only task supported; any other name is an error.
    - add_bos: whether a BOS token starts every request. False (default) is the convention of the published
      Llama 2 truthfulqa_mc2 numbers (Open LLM Leaderboard), torchtune's eleuther_eval and lm-eval before 0.4.10;
      docs/eval.md, "BOS", has the evidence. It is passed to lm-eval explicitly, never left to the tokenizer.
    - device (auto/cpu/cuda), dtype (fp32/bf16), batch_size, limit (first N questions; null = all 817).
    - output_dir: where lm-eval's results JSON goes; default {checkpoint_dir}/../eval/{checkpoint name}/.
    - training_run: True (default): the scores go into the run that trained the checkpoint: the wandb run its
      run.json names (resumed by its id: `eval/truthfulqa_mc2` in its summary, `eval/...` in its history; offline
      without WANDB_API_KEY, beside the training run's, for `wandb sync`) and its run folder's summary.json.
      False: neither. A checkpoint without run.json (any HF folder) has no training run to go to.
    - wandb_project: a checkpoint without a wandb run of its own: the scores, task config and a results table go to
      a Weights & Biases run of their own (`eval-<checkpoint name>`) in this project.
The table, the score, the time taken and the results file are printed at the end; lm-eval shows a progress bar.
lm-eval's warning that HFLM got a loaded model rather than a name is dropped (we hand it one on purpose:
finetune/reporting/console.py, KNOWN_NOISE).
"""

import math
import sys
import time
from pathlib import Path
from typing import Optional

from omegaconf import DictConfig

from finetune.reporting import console

console.quiet_known_noise()  # before torchtune and lm-eval are imported (see console.KNOWN_NOISE)

from eval import harness
from eval.checkpoint import check_checkpoint, load_model, load_tokenizer, resolve_device, resolve_dtype
from eval.errors import EvalInputError
from eval.truthfulqa import DATA_FILE, TASK_DIR, TASK_NAME, check_tasks, task_spec
from finetune.run_files import METRICS_FILE, SUMMARY_FILE, read_json, read_run_file, update_summary
from finetune.settings import command_line

CONFIG_KEYS = (
    "checkpoint_dir",
    "tokenizer_path",
    "data_source",
    "data_dir",
    "tasks",
    "add_bos",
    "device",
    "dtype",
    "batch_size",
    "limit",
    "output_dir",
    "wandb_project",
    "training_run",
)


class EvalRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        # Cheap checks first, so a bad option fails before anything is loaded.
        self.tasks = check_tasks(cfg.get("tasks", [TASK_NAME]))
        self.device = resolve_device(cfg.get("device", "auto"))
        self.dtype = resolve_dtype(cfg.get("dtype", "fp32"))
        self.batch_size = int(cfg.get("batch_size", 8))
        self.limit = cfg.get("limit", None)
        self.add_bos = bool(cfg.get("add_bos", False))
        self.data_source = cfg.get("data_source", "local")
        self.data_dir = Path(cfg.get("data_dir", "../shared/data"))
        self.wandb_project = cfg.get("wandb_project", None)
        self.training_run = cfg.get("training_run", True)
        if self.training_run not in (True, False):
            raise EvalInputError(
                f"training_run={self.training_run!r} must be True (add the scores to the run that "
                "trained the checkpoint) or False"
            )
        self.checkpoint_dir, self.tokenizer_path = check_checkpoint(
            cfg.get("checkpoint_dir"), cfg.get("tokenizer_path")
        )
        default_output = self.checkpoint_dir.resolve().parent / "eval" / self.checkpoint_dir.resolve().name
        self.output_dir = Path(cfg.get("output_dir") or default_output)
        self.task = task_spec(self.data_source, self.data_dir)

    def setup(self) -> None:
        self.tokenizer = load_tokenizer(self.tokenizer_path, add_bos=self.add_bos)
        self.model = load_model(self.checkpoint_dir, self.device, self.dtype)
        print(
            f"Evaluating {self.checkpoint_dir} on {self.tasks} ({self.data_source} data, {self.device}, {self.dtype}, BOS {'on' if self.add_bos else 'off'})"
        )

    def evaluate(self) -> dict:
        start = time.perf_counter()
        try:
            results = harness.evaluate(
                self.model,
                self.tokenizer,
                self.task,
                add_bos=self.add_bos,
                batch_size=self.batch_size,
                limit=self.limit,
                task_dir=TASK_DIR,
            )
        except ConnectionError as e:  # `datasets` could not fetch lm-eval's dataset
            if self.data_source != "hub":
                raise
            raise EvalInputError(
                f"data_source=hub but the hub is out of reach ({e}): use data_source=local, which reads {self.data_dir / DATA_FILE}"
            )
        seconds = time.perf_counter() - start
        results["total_evaluation_time_seconds"] = str(seconds)  # the key (and string type) lm-eval's CLI writes
        results["recipe"] = {
            "checkpoint_dir": str(self.checkpoint_dir.resolve()),
            "tokenizer_path": str(self.tokenizer_path.resolve()),
            "data_source": self.data_source,
            "add_bos": self.add_bos,
            "device": str(self.device),
            "dtype": str(self.dtype),
            "batch_size": self.batch_size,
            "limit": self.limit,
        }
        path = harness.save(results, self.output_dir)

        print(harness.table(results))
        score = results["results"][TASK_NAME]["acc,none"]
        n = results["n-samples"][TASK_NAME]["effective"]
        if not math.isfinite(score):  # (finite weights can still overflow, e.g. in bf16)
            raise EvalInputError(
                f"{TASK_NAME} of {self.checkpoint_dir} is {score} (the model's log-likelihoods are "
                f"not finite; results kept in {path}): evaluate with dtype=fp32, or an earlier checkpoint"
            )
        print(f"{TASK_NAME}: {score:.4f} on {n} questions in {seconds:.1f} s; results: {path}")
        self.report(results, path)
        return results

    def report(self, results: dict, results_file: Path) -> None:
        """The scores into the training run (its wandb run, its folder's summary.json), or a wandb run of their own."""
        values = harness.scores(results, TASK_NAME)
        run = read_run_file(self.checkpoint_dir) if self.training_run else None
        wandb_run = (run or {}).get("wandb")
        folder = self.run_folder() if self.training_run else None
        where = {}
        if wandb_run and wandb_run.get("id"):
            summary = read_json(folder / SUMMARY_FILE) if folder else None
            where = harness.log_to_training_run(
                values,
                wandb_run,
                global_step=run.get("global_step"),
                next_step=int((summary or {}).get("wandb_next_step") or 0),
                fallback_dir=folder or self.output_dir,
            )
            sync = f"; upload it with the training run: `{where['wandb_sync']}`" if "wandb_sync" in where else ""
            print(
                f"wandb: the scores are in the training run {run.get('name')} (id {where['wandb_run_id']}), "
                f"{where['wandb_dir']}{sync}"
            )
        elif self.wandb_project:
            harness.log_to_wandb(
                results,
                project=self.wandb_project,
                run_name=f"eval-{self.checkpoint_dir.resolve().name}",
                values=values,
                folder=self.output_dir,
            )
        if folder is not None:
            extra = {
                "eval/checkpoint": self.checkpoint_dir.resolve().name,
                "eval/limit": self.limit,
                "eval/results_file": str(results_file.resolve()),
            }
            if run and run.get("global_step") is not None:
                extra["eval/global_step"] = run["global_step"]
            if "wandb_next_step" in where:
                extra["wandb_next_step"] = where["wandb_next_step"]
            print(f"summary: {update_summary(folder, {**values, **extra})}")

    def run_folder(self) -> Optional[Path]:
        """The fine-tune run folder the checkpoint sits in (it holds metrics.jsonl or summary.json), or None."""
        parent = self.checkpoint_dir.resolve().parent
        return parent if (parent / METRICS_FILE).is_file() or (parent / SUMMARY_FILE).is_file() else None


@command_line.parse
def recipe_main(cfg: DictConfig) -> int:
    try:
        recipe = EvalRecipe(cfg)
        recipe.setup()
        recipe.evaluate()
    except EvalInputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    console.print_help_if_asked(__doc__, CONFIG_KEYS)
    sys.exit(recipe_main())
