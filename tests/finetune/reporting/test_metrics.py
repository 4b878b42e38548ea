"""finetune/reporting/metrics.py's run summary: across resumes, each resume's wandb run is a new one and summary.json
keeps the earlier ones named (docs/wandb.md, "A resumed run is a new wandb run"); the numbers it states."""

import json

from finetune.reporting.metrics import RunSummary, step_record, summary_metrics, summary_sentence


def test_summary_json_names_the_wandb_runs_of_earlier_resumes(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "epoch": 0, "loss": 1.0 / s}) + "\n" for s in (1, 2, 3)))

    def finish(run_id):
        wandb = {} if run_id is None else {"wandb_run_id": run_id, "wandb_next_step": 4}
        RunSummary(metrics).finish({"name": "tiny"}, push=lambda values: wandb)
        return json.loads((tmp_path / "summary.json").read_text())

    assert "wandb_earlier_run_ids" not in finish("first")
    assert finish("first").get("wandb_earlier_run_ids") is None  # (the same run's summary written again)
    assert finish("second")["wandb_earlier_run_ids"] == ["first"]
    summary = finish("third")
    assert summary["wandb_run_id"] == "third" and summary["wandb_earlier_run_ids"] == ["first", "second"]
    # a resume without wandb starts no wandb run: the ids stay as they were
    summary = finish(None)
    assert summary["wandb_run_id"] == "third" and summary["wandb_earlier_run_ids"] == ["first", "second"]
    assert summary["last_step"] == 3 and summary["name"] == "tiny"


def test_the_summary_names_the_allocators_retries_only_where_there_were_any():
    def records(retries):  # each step's record as the recipes build it, from one rank's memory_metrics
        def rank(r):
            return {"elapsed": 1.0, "opt_ms": None, "state_bytes": 0, "peak_memory_alloc_gib": 12.0, "alloc_retries": r}

        return [
            step_record(step=s, epoch=0, loss=1.0, lr=1e-5, tokens=8, ranks=[rank(r)], grad_norm=None, skipped=0)
            for s, r in enumerate(retries, 1)
        ]

    # the count is cumulative: the run's total is the last step's
    numbers = summary_metrics(records([0, 3, 7]))
    assert numbers["alloc_retries"] == 7
    assert "7 allocator retries" in summary_sentence(numbers)
    quiet = summary_metrics(records([0, 0, 0]))
    assert quiet["alloc_retries"] == 0 and "retries" not in summary_sentence(quiet)
    assert "alloc_retries" not in summary_metrics([{"step": 1, "epoch": 0, "loss": 1.0}])  # on the CPU
