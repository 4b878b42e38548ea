"""bench/resume_exact.py: a config's run saved at step N and resumed in fresh processes, under variants (environment
variables and overrides), on a toy folder on the CPU; how it counts a resume that parts from the run it continues; and
the variants it refuses."""

import json
import sys

import pytest

from conftest import DATA_DIR, REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import resume_exact
from finetune import toy_folder

TOY_CPU = ["device=cpu", "dtype=fp32", "compile=False", "batch_size=2", "tokenizer.max_seq_len=128", "fp8=null"]


def test_each_variants_resumes_equal_the_run_they_continue_on_a_toy_folder(tmp_path):
    """Two variants, one an environment variable and an override: run A saves at step 2 and stops at step 3 (no
    epoch save), two fresh resumes from step_2/ each take one step, and on the CPU every resume's loss equals A's
    third, bit for bit; the two variants' A runs (the same start, deterministic) saved the same bytes. The variant's
    environment reaches the runs (TQDM_DISABLE: no progress bar in their logs), the run folders go, the logs stay."""
    folder = tmp_path / "toy"
    toy_folder.make_toy_folder(folder, family="llama3_2", data_dir=DATA_DIR)
    out, logs = tmp_path / "exact.json", tmp_path / "logs"
    argv = ["--config", "llama3_2/3B_full_24gb", "--checkpoint", str(folder), "--data-dir", str(DATA_DIR)]
    argv += ["--work-dir", str(tmp_path / "work"), "--variant", "base"]
    argv += ["--variant", "sync:async_checkpoint=False,TQDM_DISABLE=1", "--save-at", "2", "--resumes", "2"]
    argv += ["--parallel", "2", "--logs-dir", str(logs), "--out", str(out), "--allow-dirty", "--timeout", "600"]
    argv += [a for o in [*TOY_CPU, "dataset.split=train[:200]"] for a in ("--set", o)]
    resume_exact.main(argv)
    doc = json.loads(out.read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"base", "sync"} and not any("error" in r for r in rows.values()), doc["rows"]
    for row in rows.values():
        assert len(row["a_losses"]) == 3 and row["expected"] == row["a_losses"][2]
        assert row["resumed_first"] == [row["expected"]] * 2 and row["exact"] == [True, True]
    assert rows["sync"]["env"] == {"TQDM_DISABLE": "1"} and rows["sync"]["overrides"] == ["async_checkpoint=False"]
    assert rows["base"]["step_sha"] == rows["sync"]["step_sha"]
    assert rows["base"]["a_blocked_s"] is not None  # (a background save's copy, from its log line)
    assert doc["summary"]["sync"] == {"exact": 2, "resumes": 2, "resumes_agree": 1, "samples": 1, "errors": 0}
    assert doc["weights"] == "random values" and doc["config"] == "llama3_2/3B_full_24gb"
    assert not list((tmp_path / "work").iterdir())
    assert {p.name for p in logs.iterdir()} >= {"sync_0_a.log", "sync_0_resumed_0.log", "sync_0_resumed_1.log"}
    # (the environment reached the runs: tqdm reads TQDM_DISABLE, so only base's log has the progress bar)
    assert "it/s" not in (logs / "sync_0_a.log").read_text() and "it/s" in (logs / "base_0_a.log").read_text()


def test_a_resume_that_parts_from_the_run_is_counted_and_told_from_resumes_that_disagree():
    """Resumes equal to each other but not to A (A's process chose otherwise) against resumes that disagree among
    themselves (each fresh process chose otherwise): both count as inexact; only the first agree."""
    a = [12.0, 11.9, 11.8]
    apart = {"variant": "v", **resume_exact.summarize(a, [11.7999, 11.7999], save_at=2)}
    scattered = {"variant": "v", **resume_exact.summarize(a, [11.8, 11.8001], save_at=2)}
    assert apart["exact"] == [False, False] and apart["rel_diff"][0] == pytest.approx(-0.0001 / 11.8)
    assert scattered["exact"] == [True, False]
    assert resume_exact.variant_summary([apart, scattered])["v"] == {
        "exact": 1,
        "resumes": 4,
        "resumes_agree": 1,
        "samples": 2,
        "errors": 0,
    }


@pytest.mark.parametrize(
    "spec, env, overrides",
    [
        ("base", {}, []),
        ("static:TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES=0", {"TORCH_DYNAMO_AUTOMATIC_DYNAMIC_SHAPES": "0"}, []),
        ("mix:compile=False,CUDA_LAUNCH_BLOCKING=1", {"CUDA_LAUNCH_BLOCKING": "1"}, ["compile=False"]),
    ],
)
def test_a_variants_items_go_to_the_environment_or_the_overrides_by_their_keys(spec, env, overrides):
    assert resume_exact.parse_variant(spec) == (spec.split(":")[0], env, overrides)


@pytest.mark.parametrize("spec", ["bad name", "v:compile", "v:=1"])
def test_a_variant_that_is_not_name_and_key_values_is_one_error_line(spec, capsys):
    with pytest.raises(SystemExit) as e:
        resume_exact.parse_variant(spec)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --variant") and repr(spec) in err[0]
