"""Validation loss during training (``dataset_val``, ``run_val_every_n_steps``, ``batch_size_val``), run for real.

The validation set is the last 7 records of ../shared/data's Alpaca file, written into tmp_path (7: odd, so batches
of 2 end short and two ranks hold 4 and 3 samples). The training runs are FAST over two epochs of 3 steps, so
validation every 2 steps falls on steps 2, 4 and 6 and the end of epoch_0 (step 3) adds one.

What is asserted: where val_loss is recorded (metrics.jsonl, the terminal line, wandb's offline files read with
wandb's own reader, summary.json, bench/table.py); that validation changes nothing about training (the losses of a
run with it equal, to the bit, those of the same run without it); that val_loss is the token-weighted mean over the
whole set (the same for any batch_size_val, packed or not); that two ranks give one device's figure (each rank's
share reduced, the short share's padding counting no token); and that each bad value is one error line.
"""

import json
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from conftest import (
    DATA_DIR,
    REPO_ROOT,
    TINY_CONFIG,
    run_distributed,
    run_here,
    run_in_one_process,
)
from finetune.reporting.wandb_run import read_runs

VAL_RECORDS = 7
TWO_EPOCHS = ["epochs=2", "max_steps_per_epoch=3"]
VAL_STEPS = [2, 3, 4, 6]  # every 2 steps, and the end of each epoch (steps 3 and 6)


@pytest.fixture(scope="module")
def val_file(tmp_path_factory):
    records = json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[-VAL_RECORDS:]
    path = tmp_path_factory.mktemp("val") / "val.json"
    path.write_text(json.dumps(records))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, val_file):
    """The same FAST two-epoch run with and without validation every 2 steps, wandb on (offline).

    Both in one subprocess (support.run_batch: torch imported once), not in this process: wandb would start its
    service from, and take over the console of, the test process. Their stdout and stderr are the batch's: only the
    run with validation prints what the tests look for there."""
    root = tmp_path_factory.mktemp("runs")
    overrides = {
        "without": TWO_EPOCHS,
        "with": [*TWO_EPOCHS, f"dataset_val.data_files={val_file}", "run_val_every_n_steps=2"],
    }
    done = run_in_one_process({name: (root / name, o) for name, o in overrides.items()}, wandb=True)
    for run in done.values():
        assert run.ok, (run.stdout + run.stderr)[-3000:]
    return done


def val_losses(run):
    return {m["step"]: m["val_loss"] for m in run.metrics if "val_loss" in m}


def test_val_loss_every_n_steps_and_at_each_epoch_end_in_metrics_and_summary(runs):
    run = runs["with"]
    losses = val_losses(run)
    assert sorted(losses) == VAL_STEPS
    assert all(isinstance(v, float) and 0 < v < 20 for v in losses.values())
    assert losses[6] < losses[2]  # the model learns: the held-out loss falls
    summary = json.loads((run.output_dir / "summary.json").read_text())
    assert summary["val_loss"] == losses[6]
    assert f"validation loss {losses[6]:.4f}" in run.stdout + run.stderr  # the end-of-run paragraph
    # The terminal line of each validated step shows it (the tiny config prints every step).
    assert f"val_loss {losses[4]:.6g}" in run.stdout + run.stderr
    assert "Validation: 7 samples in batches of 2, every 2 steps and at the end of each epoch" in run.stderr


def test_validation_leaves_training_identical(runs):
    """Eval mode, no grad, its own loader and the RNG restored: the training losses and data order are untouched."""
    assert len(runs["with"].losses) == 6
    assert runs["with"].losses == runs["without"].losses
    assert [m["tokens"] for m in runs["with"].metrics] == [m["tokens"] for m in runs["without"].metrics]
    assert "val_loss" not in json.loads((runs["without"].output_dir / "summary.json").read_text())
    assert not val_losses(runs["without"])


def test_val_loss_in_the_offline_wandb_run(runs):
    run = runs["with"]
    (wandb_run,) = read_runs(run.output_dir).values()
    logged = {row["global_step"]: row["val_loss"] for row in wandb_run["history"] if "val_loss" in row}
    assert logged == pytest.approx(val_losses(run), rel=1e-12)
    assert wandb_run["summary"]["val_loss"] == pytest.approx(val_losses(run)[6], rel=1e-12)


def test_table_shows_val_loss_only_when_a_run_has_it(runs, tmp_path):
    out = tmp_path / "table"
    proc = subprocess.run(
        [sys.executable, "bench/table.py", str(runs["with"].output_dir), str(runs["without"].output_dir)]
        + ["--out-dir", str(out)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, _, with_row, without_row = (out / "table.md").read_text().splitlines()[:4]
    cells = [c.strip() for c in header.strip("|").split("|")]
    column = cells.index("val loss")
    assert [c.strip() for c in with_row.strip("|").split("|")][column] == f"{val_losses(runs['with'])[6]:.4f}"
    assert [c.strip() for c in without_row.strip("|").split("|")][column] == ""
    alone = subprocess.run(
        [sys.executable, "bench/table.py", str(runs["without"].output_dir), "--out-dir", str(tmp_path / "alone")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == 0 and "val loss" not in (tmp_path / "alone" / "table.md").read_text()


def test_val_loss_is_the_token_weighted_mean_for_any_batch_and_packing(tmp_path, val_file):
    """Batches of 1, of 3 (the last one short) and packed rows hold the same tokens: the same mean. (A mean of the
    batches' means would differ with the batch size: the samples have different lengths.)"""
    val = [f"dataset_val.data_files={val_file}", "run_val_every_n_steps=2", "max_steps_per_epoch=2"]
    found = {}
    for name, extra in (
        ("one", ["batch_size_val=1"]),
        ("three", ["batch_size_val=3"]),
        ("packed", ["dataset_val.packed=True"]),
    ):
        run = run_here(tmp_path / name, *val, *extra)
        assert run.ok, run.stderr[-3000:]
        found[name] = val_losses(run)
        assert sorted(found[name]) == [2]
    assert found["three"][2] == pytest.approx(found["one"][2], rel=1e-5)
    assert found["packed"][2] == pytest.approx(found["one"][2], rel=1e-4)


def test_distributed_val_loss_is_reduced_over_ranks(tmp_path, val_file):
    """2 ranks x batch_size=2 train as one device with batch_size=4 (tests/recipes/test_distributed.py); their
    validation over shares of 4 and 3 samples (the second padded with a masked copy) gives one device's val_loss."""
    val = [f"dataset_val.data_files={val_file}", "run_val_every_n_steps=2", *TWO_EPOCHS]
    ranks = run_distributed(tmp_path / "ranks", *val, "batch_size_val=2")
    assert ranks.ok, ranks.stderr[-3000:]
    one = run_here(tmp_path / "one", *val, "batch_size=4")
    assert one.ok, one.stderr[-3000:]
    assert sorted(val_losses(ranks)) == VAL_STEPS
    assert ranks.losses == pytest.approx(one.losses, rel=1e-4)
    assert val_losses(ranks) == pytest.approx(val_losses(one), rel=1e-4)
    assert json.loads((ranks.output_dir / "summary.json").read_text())["val_loss"] == val_losses(ranks)[6]


# ------------------------------------------------------------------------------------------------
# bad values: one error line each, before anything is built
# ------------------------------------------------------------------------------------------------


def settings_error(*overrides: str) -> str:
    from finetune.base import BadInput
    from finetune.settings import read_settings

    cfg = OmegaConf.merge(OmegaConf.load(REPO_ROOT / TINY_CONFIG), OmegaConf.from_dotlist([f"data_dir={DATA_DIR}"]))
    cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(list(overrides)))
    with pytest.raises(BadInput) as e:
        read_settings(cfg)
    return str(e.value)


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["run_val_every_n_steps=2"], ["run_val_every_n_steps=2 needs a validation set", "dataset_val.data_files="]),
        (["batch_size_val=8"], ["batch_size_val=8 needs a validation set", "~batch_size_val"]),
        (["dataset_val=val.json"], ["dataset_val='val.json' must be a dataset section", "dataset_val.data_files=FILE"]),
        (["dataset_val.data_files={val}", "run_val_every_n_steps=0"], ["run_val_every_n_steps=0 must be a positive"]),
        (["dataset_val.data_files={val}", "batch_size_val=-1"], ["batch_size_val=-1 must be a positive integer"]),
        (["dataset_val.data_files={val}", "dataset_val.packed=maybe"], ["dataset_val.packed='maybe' must be True"]),
        (["dataset_val.data_files=/no/such.json"], ["dataset_val.data_files=/no/such.json does not exist"]),
    ],
)
def test_bad_validation_values_are_refused_naming_the_key(overrides, words, val_file):
    message = settings_error(*(o.format(val=val_file) for o in overrides))
    for w in words:
        assert w in message


def test_validation_settings_are_read_once(val_file):
    from finetune.settings import read_settings

    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / TINY_CONFIG),
        OmegaConf.from_dotlist([f"data_dir={DATA_DIR}", f"dataset_val.data_files={val_file}"]),
    )
    s = read_settings(cfg)
    # Without a _component_ of its own, dataset_val is dataset's section with its own keys on top.
    val = s.validation.data
    assert val.section._component_ == "torchtune.datasets.alpaca_dataset" and val.section.train_on_input is True
    assert (s.validation.every, val.batch_size, val.packed, val.files) == (None, 4, False, (str(val_file),))
    # The tokenizer, the pack cache and the attention are the training set's; the training set is its own.
    assert (val.tokenizer_path, val.pack_cache_dir, val.packed_attention) == (
        s.data.tokenizer_path,
        s.data.pack_cache_dir,
        s.data.packed_attention,
    )
    assert s.data.files == (str(DATA_DIR / "alpaca" / "alpaca_data.json"),)
    plain = read_settings(OmegaConf.merge(OmegaConf.load(REPO_ROOT / TINY_CONFIG), {"data_dir": str(DATA_DIR)}))
    assert plain.validation is None


def test_bad_validation_value_is_one_error_line_from_the_recipe(tmp_path):
    run = run_here(tmp_path / "out", "run_val_every_n_steps=2")
    assert run.returncode == 2
    assert run.error.startswith("error: run_val_every_n_steps=2 needs a validation set")
    assert "Traceback" not in run.stderr and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_stop_signal_during_validation_ends_the_pass_and_saves_at_once(tmp_path, monkeypatch):
    """SIGTERM in the middle of a validation pass: the pass ends at the next batch (its record says val_stopped, no
    val_loss), and the step's checkpoint is written right after, as at any step boundary; the run exits 0. Before,
    the signal waited for the whole pass (6,000 samples: minutes on a CPU, past a scheduler's grace period)."""
    import os
    import signal

    from finetune import validation

    records = json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[-200:]
    big = tmp_path / "val.json"
    big.write_text(json.dumps(records))
    seen, count = [], validation.count_trained_tokens

    def count_and_signal(labels, ignore_index):
        seen.append(1)
        if len(seen) == 2:  # (the second validation batch: the stop comes mid-pass)
            os.kill(os.getpid(), signal.SIGTERM)
        return count(labels, ignore_index)

    monkeypatch.setattr(validation, "count_trained_tokens", count_and_signal)
    run = run_here(tmp_path / "out", f"dataset_val.data_files={big}", "run_val_every_n_steps=2", "batch_size_val=1")
    assert run.ok, run.stderr[-3000:]
    assert len(seen) == 2  # (of 200 batches)
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert run.metrics[-1].get("val_stopped") is True and "val_loss" not in run.metrics[-1]
    assert (run.output_dir / "step_2" / "model.safetensors").is_file()
    assert "Stopped by SIGTERM after step 2" in run.stderr + run.stdout


def test_ctrl_c_during_validation_keeps_the_trained_steps_record(tmp_path, monkeypatch, python_ctrl_c):
    """Ctrl-C in the middle of a validation pass stops the run at once (exit 130, as anywhere), and the step it
    follows, trained, keeps its record in metrics.jsonl (val_stopped, no val_loss): before, that record was lost.
    (python_ctrl_c: the Ctrl-C needs Python's SIGINT handler, which a process started with SIGINT ignored, as a
    shell's background job is, does not have.)"""
    import os
    import signal

    from finetune import validation

    seen, count = [], validation.count_trained_tokens

    def count_and_interrupt(labels, ignore_index):
        seen.append(1)
        if len(seen) == 2:  # (the second validation batch: the Ctrl-C comes mid-pass)
            os.kill(os.getpid(), signal.SIGINT)
        return count(labels, ignore_index)

    monkeypatch.setattr(validation, "count_trained_tokens", count_and_interrupt)
    big = tmp_path / "val.json"
    big.write_text(json.dumps(json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[-50:]))
    run = run_here(tmp_path / "out", f"dataset_val.data_files={big}", "run_val_every_n_steps=2", "batch_size_val=1")
    assert run.returncode == 130, run.stderr[-3000:]
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert run.metrics[-1].get("val_stopped") is True and "val_loss" not in run.metrics[-1]


@pytest.mark.parametrize("damage", ["utf8", "json"])
def test_an_unreadable_validation_file_is_named_by_its_own_key(tmp_path, val_file, damage):
    """A byte that is not UTF-8, or a line that is not JSON, in the validation file: the error names
    dataset_val.data_files (the key to fix), not the training set's dataset.data_files."""
    text = val_file.read_bytes()
    bad = tmp_path / "val.json"
    bad.write_bytes(text.replace(b"e", b"\xff", 1) if damage == "utf8" else text[:-2])
    run = run_here(tmp_path / "out", f"dataset_val.data_files={bad}")
    assert run.returncode == 2
    assert run.error.startswith(f"error: dataset_val.data_files={bad} line "), run.error
    assert ("is not valid UTF-8" if damage == "utf8" else "is not valid JSON") in run.error
    assert "Traceback" not in run.stderr and not (tmp_path / "out" / "metrics.jsonl").exists()


def test_a_validation_set_with_no_token_to_predict_is_refused_at_setup(tmp_path):
    """Prompts longer than tokenizer.max_seq_len (64 in FAST) with dataset_val.train_on_input=False: every label of
    the set is masked, and val_loss would be NaN at every pass without a word. One error line before training."""
    long_prompt = " ".join(["Describe the history of the city and its rivers in detail."] * 12)
    records = [{"instruction": long_prompt, "input": "", "output": f"Answer {i}."} for i in range(3)]
    val = tmp_path / "val.json"
    val.write_text(json.dumps(records))
    run = run_here(tmp_path / "out", f"dataset_val.data_files={val}", "dataset_val.train_on_input=False")
    assert run.returncode == 2, run.metrics
    assert run.error.startswith(f"error: dataset_val ({val}) has no token to predict"), run.error
    assert "tokenizer.max_seq_len=64" in run.error and "dataset_val.train_on_input=True" in run.error
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
