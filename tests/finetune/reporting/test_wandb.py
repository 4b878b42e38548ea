"""wandb, summary.json and the comparison table (docs/wandb.md), read back from the files a user would upload.

Two FAST fine-tunes (torch's AdamW and optimizers.AdamW8bit, 4 steps, wandb offline as without an API key) and
one eval of each run's last checkpoint run once in this process (module fixture, about 40 s on 2 cores). The
offline runs are read with wandb's own reader (``wandb leet inspect --json``, through the library's
finetune.reporting.wandb_run.read_runs, as bench/table.py reads them), never by the code that wrote them;
bench/table.py makes its table from them as a user runs it.
"""

import contextlib
import io
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from omegaconf import OmegaConf

from conftest import DATA_DIR, EVAL_CONFIG, FAST, RECIPE, REPO_ROOT, TINY_CONFIG, RecipeRun, read_metrics
from finetune.reporting.wandb_run import read_runs

# lm-eval's environment report is left out of the evaluations run in this process (conftest).
pytestmark = pytest.mark.usefixtures("no_environment_report")

VARIANTS = {"torch.optim.AdamW": "torch.AdamW", "optimizers.AdamW8bit": "AdamW8bit"}
STEPS = 4
# The numbers every run's summary holds, in summary.json and in its wandb run alike (finetune/reporting/metrics.py).
SUMMARY_KEYS = (
    "steps",
    "last_step",
    "tokens_per_second_median",
    "peak_rss_gib",
    "optimizer_state_gib",
    "first_step_s",
    "epoch_time_s",
    "final_loss",
    "skipped_steps",
)


@contextlib.contextmanager
def user_env(**extra):
    """A user's shell without a wandb API key (so wandb logs offline), quiet."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DIR")}
    with mock.patch.dict(os.environ, {**env, "WANDB_SILENT": "true", **extra}, clear=True):
        yield


def train(out: Path, *overrides: str) -> RecipeRun:
    """``tune run recipes/full_finetune_single_device.py --config configs/tiny.yaml ...``, in this process."""
    from recipes.full_finetune_single_device import recipe_main

    argv = [
        RECIPE,
        "--config",
        TINY_CONFIG,
        f"data_dir={DATA_DIR}",
        f"output_dir={out}",
        *FAST,
        f"max_steps_per_epoch={STEPS}",
        "pack_cache_dir=off",
        *overrides,
    ]
    stdout, code = io.StringIO(), 0
    with (
        user_env(),
        mock.patch.object(sys, "argv", argv),
        contextlib.chdir(REPO_ROOT),
        contextlib.redirect_stdout(stdout),
    ):
        try:
            recipe_main()
        except SystemExit as e:
            code = e.code or 0
    return RecipeRun(code, stdout.getvalue(), "", out, read_metrics(out))


def evaluate(checkpoint: Path, **overrides) -> str:
    """``tune run recipes/evaluate.py --config configs/eval/truthfulqa_mc2.yaml checkpoint_dir=... limit=2``."""
    from recipes import evaluate as eval_recipe

    cfg = OmegaConf.merge(
        OmegaConf.load(EVAL_CONFIG),
        {"checkpoint_dir": str(checkpoint), "data_dir": str(DATA_DIR), "device": "cpu", "limit": 2, **overrides},
    )
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        assert eval_recipe.recipe_main.__wrapped__(cfg) == 0
    return stdout.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per variant: the training run, its eval's output, and its offline wandb runs as wandb's reader reads them."""
    base = tmp_path_factory.mktemp("wandb")
    out = {}
    for optimizer in VARIANTS:
        folder = base / optimizer.replace(".", "_")
        run = train(folder, f"optimizer={optimizer}", "save_every_n_steps=2")
        assert run.ok, run.stdout[-3000:]
        with user_env():
            eval_out = evaluate(folder / "epoch_0")
        out[optimizer] = {"run": run, "eval": eval_out, "wandb": read_runs(folder)}
    return out


def test_run_name_group_tags_and_summary_read_back_from_the_offline_files(runs):
    for optimizer, variant in VARIANTS.items():
        run, (wandb_run,) = runs[optimizer]["run"], runs[optimizer]["wandb"].values()
        assert wandb_run["name"] == f"tiny-{variant}" and wandb_run["group"] == "tiny"
        assert wandb_run["tags"] == ["cpu", variant]
        # The summary a dashboard tabulates: the same numbers in the wandb run and in summary.json, computed from
        # every step's record.
        summary = json.loads((run.output_dir / "summary.json").read_text())
        assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
        for key in SUMMARY_KEYS:
            assert wandb_run["summary"][key] == summary[key], key
        assert summary["final_loss"] == run.losses[-1] and summary["steps"] == STEPS
        assert summary["peak_rss_gib"] == max(m["peak_rss_gib"] for m in run.metrics)
        assert summary["first_step_s"] == run.metrics[0]["first_step_s"]
        assert (
            summary["tokens_per_second_median"]
            == pytest.approx(  # the steps after the first 2
                statistics.median(m["tokens_per_second"] for m in run.metrics[2:])
            )
        )
        assert summary["epoch_time_s"] == pytest.approx(sum(m["step_time_s"] for m in run.metrics))
        assert summary["optimizer_state_gib"] == run.metrics[-1]["optimizer_state_bytes"] / 2**30
        assert (summary["name"], summary["group"], summary["tags"]) == (wandb_run["name"], "tiny", ["cpu", variant])
        # ... and in the end-of-run paragraph.
        last_line = run.stdout.strip().splitlines()[-1]
        assert f"{summary['tokens_per_second_median']:,.0f} tokens/s" in last_line
        assert f"final loss {summary['final_loss']:.4f}" in last_line and "summary.json" in last_line


def test_each_checkpoint_names_its_wandb_run(runs):
    for optimizer in VARIANTS:
        run, (run_id,) = runs[optimizer]["run"], runs[optimizer]["wandb"]
        for name, step in (("step_2", 2), ("epoch_0", STEPS)):
            stored = json.loads((run.output_dir / name / "run.json").read_text())
            assert stored["wandb"]["id"] == run_id and stored["wandb"]["mode"] == "offline"
            assert stored["global_step"] == step and stored["name"] == runs[optimizer]["wandb"][run_id]["name"]


def test_eval_score_lands_in_the_training_run(runs):
    for optimizer in VARIANTS:
        run, (wandb_run,) = runs[optimizer]["run"], runs[optimizer]["wandb"].values()
        (results_file,) = (run.output_dir / "eval" / "epoch_0").glob("results_*.json")
        score = json.loads(results_file.read_text())["results"]["truthfulqa_mc2"]["acc,none"]
        # Offline, the eval resumed the run by its id: a second run file of the same id, beside the first, which
        # `wandb sync` appends to it; merged as sync merges them, the training keys and the score share a summary.
        assert len(wandb_run["files"]) == 2 and all(
            Path(f).parent == run.output_dir / "wandb" for f in wandb_run["files"]
        )
        assert wandb_run["summary"]["eval/truthfulqa_mc2"] == score and "final_loss" in wandb_run["summary"]
        eval_rows = [row for row in wandb_run["history"] if "eval/truthfulqa_mc2" in row]
        assert eval_rows == [
            pytest.approx({**eval_rows[0], "eval/truthfulqa_mc2": score, "global_step": STEPS, "_step": STEPS})
        ]  # after the training rows' _step 0..3
        summary = json.loads((run.output_dir / "summary.json").read_text())
        assert summary["eval/truthfulqa_mc2"] == score and summary["eval/checkpoint"] == "epoch_0"
        assert (
            f"the scores are in the training run {wandb_run['name']} (id {wandb_run['id']})" in runs[optimizer]["eval"]
        )


def table(folders, source: str, out_dir: Path) -> dict:
    """``python bench/table.py --from SOURCE FOLDERS --out-dir OUT_DIR``, as a user runs it: its table.json."""
    proc = subprocess.run(
        [sys.executable, "bench/table.py", "--from", source, *map(str, folders), "--out-dir", str(out_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return json.loads((out_dir / "table.json").read_text())


def test_table_from_run_folders_equals_the_table_from_wandb(runs, tmp_path):
    folders = [runs[o]["run"].output_dir for o in VARIANTS]
    from_folders = table(folders, "folders", tmp_path / "folders")
    from_wandb = table(folders, "wandb", tmp_path / "wandb")
    names = [f"tiny-{v}" for v in VARIANTS.values()]
    assert [r["name"] for r in from_folders["rows"]] == [r["name"] for r in from_wandb["rows"]] == names
    text = (tmp_path / "folders" / "table.md").read_text()
    assert text == (tmp_path / "wandb" / "table.md").read_text()  # one source: the numbers agree to the digit
    for row, optimizer in zip(from_folders["rows"], VARIANTS):
        score = json.loads((runs[optimizer]["run"].output_dir / "summary.json").read_text())["eval/truthfulqa_mc2"]
        assert math.isfinite(score) and f"| {row['name']} |" in text and f"{score:.4f} (2 q.) |" in text
    for doc in (from_folders, from_wandb):
        assert sorted(Path(p).name for p in doc["plots"]) == ["table_loss.png", "table_memory_speed.png"]
        assert all(Path(p).stat().st_size > 0 for p in doc["plots"])


def test_a_checkpoint_without_a_run_id_still_evaluates(runs, tmp_path):
    """Any HF folder (here a copy without run.json, outside a run folder) gets a wandb run of its own."""
    checkpoint = Path(shutil.copytree(runs["torch.optim.AdamW"]["run"].output_dir / "epoch_0", tmp_path / "ckpt"))
    (checkpoint / "run.json").unlink()
    with user_env(WANDB_DIR=str(tmp_path)):
        evaluate(checkpoint, output_dir=str(tmp_path / "out"), wandb_project="evals")
    (results_file,) = (tmp_path / "out").glob("results_*.json")
    score = json.loads(results_file.read_text())["results"]["truthfulqa_mc2"]["acc,none"]
    (own,) = read_runs(tmp_path).values()
    assert own["name"] == "eval-ckpt" and len(own["files"]) == 1
    assert own["summary"]["eval/truthfulqa_mc2"] == score
    assert [row["truthfulqa_mc2/acc"] for row in own["history"] if "truthfulqa_mc2/acc" in row] == [score]
    assert not (tmp_path / "summary.json").exists()


def test_metric_logger_name_group_tags_override_the_defaults():
    from finetune.reporting.wandb_run import variant_label
    from finetune.services import identity_of
    from finetune.settings import read_settings

    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / TINY_CONFIG),
        OmegaConf.from_dotlist(
            [
                f"data_dir={DATA_DIR}",
                "metric_logger.name=mine",
                "metric_logger.tags=[a,b]",
                "compile=True",
                "dataset.packed=True",
            ]
        ),
    )
    s = read_settings(cfg)  # (build_reporting's identity: the optimizer, the device and cap, and what is on)
    with mock.patch.object(sys, "argv", [RECIPE, "--config", "configs/llama2/7B_full_24gb.yaml"]):
        identity = identity_of(cfg, s)
    assert (identity["name"], identity["group"], identity["tags"]) == ("mine", "7B_full_24gb", ["a", "b"])
    cfg.metric_logger.pop("tags")
    with mock.patch.object(sys, "argv", [RECIPE, "--config", "configs/llama2/7B_full_24gb.yaml"]):
        identity = identity_of(cfg, s)
    assert identity["tags"] == ["24gb", "torch.AdamW", "packed", "compiled"]
    assert [
        variant_label(p)
        for p in (
            "optimizers.AdamW4bit",
            "torchao.optim.AdamW8bit",
            "bitsandbytes.optim.PagedAdamW8bit",
            "my.pkg.MyAdamW",
        )
    ] == ["AdamW4bit", "ao.AdamW8bit", "bnb.PagedAdamW8bit", "my.MyAdamW"]


def test_the_wandb_folders_hold_no_link_out_of_them(runs):
    """wandb-core links logs/debug-core.log to its log in ~/.cache/wandb by absolute path; a run folder moved to
    another machine would carry a dangling link. The training run's folder and the eval's beside it hold a copy."""
    for optimizer in VARIANTS:
        folders = sorted((runs[optimizer]["run"].output_dir / "wandb").glob("offline-run-*"))
        assert len(folders) == 2  # the training run's and the eval's (same run id)
        for folder in folders:
            assert [p for p in folder.rglob("*") if p.is_symlink()] == []
            core_log = folder / "logs" / "debug-core.log"
            assert core_log.is_file() and core_log.stat().st_size > 0


def test_wandb_is_silent_offline_and_quiet_online_unless_the_environment_says(monkeypatch):
    """wandb's own ~25 lines around a run (banner, sparklines, a sync hint for one folder) are off; the user's
    WANDB_SILENT / WANDB_QUIET, or metric_logger.settings, decide instead; other loggers get nothing."""
    from finetune.reporting.wandb_run import quiet_settings

    monkeypatch.delenv("WANDB_SILENT", raising=False)
    monkeypatch.delenv("WANDB_QUIET", raising=False)
    wandb_logger = {"_component_": "torchtune.training.metric_logging.WandBLogger"}

    def settings(**extra):
        return quiet_settings(OmegaConf.create({**wandb_logger, **extra}))

    assert settings(mode="offline")["settings"].silent and not settings()["settings"].silent
    assert settings()["settings"].quiet  # online: quiet, the run's URL still shows
    assert settings(settings={"silent": False}) == {}
    assert quiet_settings(OmegaConf.create({"_component_": "torchtune.training.metric_logging.DiskLogger"})) == {}
    monkeypatch.setenv("WANDB_SILENT", "false")
    assert settings(mode="offline") == {}
