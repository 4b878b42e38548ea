"""bench/_harness.py and the benchmarks that had no test: provenance, the dirty-tree refusal, where results go by
default, the subprocess runner, and CPU smoke runs of bench/pipeline.py, bench/checkpoint_save.py and
bench/loss_parity_width2048.py."""

import argparse
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import (
    DATA_DIR,
    FAST,
    HANG_GUARD_S,
    REPO_ROOT,
    THROWAWAY_COMPONENT,
    THROWAWAY_KEY,
    ThrowawayAdamW,
    recipe_env,
)

sys.path.insert(0, str(REPO_ROOT / "bench"))
import _harness as harness
from support import git

SCRIPTS = ["compare", "e2e", "pipeline", "loss_parity", "loss_parity_width2048", "optimizer_step", "checkpoint_save"]
# The fewest arguments each script needs to start a run (compare's config: the real one, by absolute path, so that
# the copy below finds it).
MINIMAL = {
    "compare": ["--config", str(REPO_ROOT / "configs" / "tiny.yaml"), "--variants", "fused"],
    "e2e": ["--checkpoint-dir", "/nonexistent", "--rows", "ours_24gb"],
    "checkpoint_save": ["--toy"],
}


@pytest.fixture
def repo(tmp_path):
    """A git repository with bench/ (this checkout's scripts), a recipe and a committed result: clean."""
    root = tmp_path / "repo"
    (root / "recipes").mkdir(parents=True)
    (root / "recipes" / "r.py").write_text("x = 1\n")
    shutil.copytree(REPO_ROOT / "bench", root / "bench", ignore=shutil.ignore_patterns("__pycache__", "results"))
    (root / "bench" / "results").mkdir()
    (root / "bench" / "results" / "r.json").write_text("{}\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-q", "-m", "init")
    return root


def test_clean_tree_records_the_commit(repo):
    assert harness.code_version(repo) == (git(repo, "rev-parse", "HEAD"), None)


def test_dirty_tree_is_refused_unless_allowed(repo):
    head = git(repo, "rev-parse", "HEAD")
    (repo / "recipes" / "r.py").write_text("x = 2\n")
    with pytest.raises(harness.DirtyTree, match=r"uncommitted changes in recipes/r.py: .*--allow-dirty"):
        harness.code_version(repo)
    assert harness.code_version(repo, allow_dirty=True) == (head + "+dirty", None)
    git(repo, "add", "recipes/r.py")  # staged is still uncommitted
    with pytest.raises(harness.DirtyTree):
        harness.code_version(repo)


def test_results_and_untracked_files_do_not_make_a_tree_dirty(repo):
    (repo / "bench" / "results" / "r.json").write_text('{"records": []}\n')  # what a --merge run does
    (repo / "recipes" / "new.py").write_text("")
    assert harness.code_version(repo) == (git(repo, "rev-parse", "HEAD"), None)


def test_the_code_tree_names_the_files_whatever_commit_the_git_copy_records(repo):
    """The GPU machine's copy of the tree sits over an older .git: HEAD and the index lag the files it was given.
    The fingerprint of the files is the one of the commit that holds them, not of the commit recorded."""
    first = git(repo, "rev-parse", "HEAD")
    assert harness.code_tree(repo) == harness.commit_code_tree(first, repo)
    (repo / "recipes" / "r.py").write_text("x = 2\n")
    (repo / "recipes" / "new.py").write_text("y = 1\n")
    (repo / "bench" / "results" / "r.json").write_text('{"more": 1}\n')  # (results are not code)
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "second")
    second = git(repo, "rev-parse", "HEAD")
    git(repo, "reset", "-q", "--mixed", first)  # the lagging .git: HEAD and index at the first commit
    assert harness.code_version(repo, allow_dirty=True) == (first + "+dirty", None)
    assert harness.code_tree(repo) == harness.commit_code_tree(second, repo) != harness.commit_code_tree(first, repo)
    (repo / "recipes" / "r.py").write_text("x = 3\n")  # files of no commit
    assert harness.code_tree(repo) not in (harness.commit_code_tree(c, repo) for c in (first, second))
    assert harness.commit_code_tree("f" * 40, repo) is None


def test_code_is_null_with_a_reason_where_git_cannot_tell(repo, tmp_path, monkeypatch):
    code, note = harness.code_version(tmp_path / "copied_tree")
    assert code is None and "no .git" in note
    with monkeypatch.context() as m:
        m.setenv("PATH", str(tmp_path / "no_bin"))  # no git program
        code, note = harness.code_version(repo)
    assert code is None and note.startswith("git failed")
    (repo / ".git" / "HEAD").write_text("garbage\n")  # a broken repository
    code, note = harness.code_version(repo)
    assert code is None and note.startswith("git failed: ")


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_benchmark_refuses_a_dirty_tree(repo, script):
    """Each script asks before any work: in a copy whose bench/ has an uncommitted change, it stops with one line."""
    with open(repo / "bench" / "_harness.py", "a") as f:
        f.write("# an uncommitted edit\n")
    proc = subprocess.run(
        [sys.executable, f"bench/{script}.py", *MINIMAL.get(script, [])],
        cwd=repo,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: uncommitted changes in bench/_harness.py: commit them so "
        "the result names the code it ran, or pass --allow-dirty"
    )
    assert not (repo / "outputs").exists()


def test_provenance_fields(monkeypatch):
    for name in harness.steering_env():  # (the test session's own, e.g. TRITON_INTERPRET)
        monkeypatch.delenv(name)
    prov = harness.provenance(str(REPO_ROOT / "bench" / "e2e.py"), ["--rows", "a b"], allow_dirty=True)
    assert prov["command"] == "python bench/e2e.py --rows 'a b'" and "env" not in prov
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", prov["date"])
    assert re.search(r"\d+ CPU cores$", prov["hardware"])
    if not torch.cuda.is_available():
        assert prov["hardware"].startswith("CPU only: ")
    assert list(prov["versions"]) == ["python"] + harness.PACKAGES
    assert prov["versions"]["torch"] == torch.__version__
    assert prov["versions"]["torchtune"] == "0.6.1"
    if prov["code"] is None:  # e.g. a copied tree without .git
        assert prov["code_note"]
    else:
        assert re.fullmatch(r"[0-9a-f]{40}(\+dirty)?", prov["code"]) and "code_note" not in prov

    def dirty(root, allow_dirty):
        raise harness.DirtyTree("uncommitted changes")

    monkeypatch.setattr(harness, "code_version", dirty)
    with pytest.raises(SystemExit) as e:
        harness.provenance(str(REPO_ROOT / "bench" / "e2e.py"), [], allow_dirty=False)
    assert e.value.code == 2


def test_provenance_names_the_environment_that_steered_the_runs(monkeypatch):
    """A result measured with an exported variable that changes the computation (Inductor's deterministic mode
    off, say) names it, and its command carries it: otherwise two results told apart only by the variable read
    as the same command. Where caches and tools live, an image's versions and the machine's own switches are not
    such variables."""
    for name in harness.steering_env():
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCHINDUCTOR_DETERMINISTIC", "0")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:512")
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor")
    monkeypatch.setenv("TRITON_HOME", "/tmp/triton")
    monkeypatch.setenv("CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setenv("NCCL_VERSION", "2.27.3")  # (an image's build, and the GPU machine's multicast switch)
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    prov = harness.provenance(str(REPO_ROOT / "bench" / "e2e.py"), ["--rows", "a"], allow_dirty=True)
    assert prov["env"] == {
        "CUDA_LAUNCH_BLOCKING": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512",
        "TORCHINDUCTOR_DETERMINISTIC": "0",
    }
    assert prov["command"] == (
        "CUDA_LAUNCH_BLOCKING=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:512 "
        "TORCHINDUCTOR_DETERMINISTIC=0 python bench/e2e.py --rows a"
    )
    assert shlex.split(prov["command"])[:3] == [f"{k}={v}" for k, v in prov["env"].items()]


def _paths(args) -> list:
    return [Path(v).resolve() for v in vars(args).values() if isinstance(v, (str, Path)) and "/" in str(v)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_benchmark_writes_into_results_or_docs_by_default(script):
    """With no --out, every file a benchmark writes (its JSON, plot, run folders) lies outside bench/results/ and
    docs/: a trial run never overwrites a committed figure. Only an explicit --out bench/results/... writes there."""
    module = __import__(script)
    args = module.parse_args(MINIMAL.get(script, []))
    assert Path(args.out).resolve().is_relative_to(harness.SCRATCH)
    for path in _paths(args):
        assert not path.is_relative_to(harness.RESULTS) and not path.is_relative_to(REPO_ROOT / "docs"), path
    told = module.parse_args(MINIMAL.get(script, []) + ["--out", "bench/results/x.json"])
    assert Path(told.out) == Path("bench/results/x.json")


def test_compare_puts_runs_in_scratch_when_only_out_is_given():
    import compare

    args = compare.parse_args(["--out", "bench/results/x.json"])
    assert args.out_dir == Path("bench/results") and args.runs_dir.resolve().is_relative_to(harness.SCRATCH)
    assert compare.parse_args(["--out-dir", "/tmp/o"]).runs_dir == Path("/tmp/o/runs")


def test_run_streams_stops_and_times_out(tmp_path):
    lines = []
    script = "import time\nfor i in range(100):\n    print('line', i, flush=True)\n    time.sleep(0.05)\n"
    run = harness.run(
        [sys.executable, "-c", script],
        tmp_path / "a.log",
        on_line=lambda line, t: lines.append(line),
        until=lambda: len(lines) >= 3,
    )
    assert run.stopped and run.error() is None and run.returncode != 0  # killed, but its work was done
    assert lines[:3] == ["line 0", "line 1", "line 2"] and "line 0" in (tmp_path / "a.log").read_text()
    assert run.command.startswith("python -c ")  # the interpreter's path is this machine's: not recorded

    run = harness.run([sys.executable, "-c", script], tmp_path / "b.log", timeout=1)
    assert run.timed_out and run.error() == "timed out after 1 s"

    fail = "print('working'); print('error: the config says x; set y', flush=True); raise SystemExit(2)"
    run = harness.run([sys.executable, "-c", fail], tmp_path / "c.log")
    assert run.returncode == 2 and run.error() == "error: the config says x; set y"
    run = harness.run([sys.executable, "-c", "import no_such_module"], tmp_path / "d.log")
    assert run.error() == "ModuleNotFoundError: No module named 'no_such_module'"
    # Under torchrun the rank's exception comes before the launcher's report, whose last lines say nothing.
    torchrun = (
        "import sys; print('[rank0]: RuntimeError: Expected all tensors to be on the same device'); "
        "print('torch.distributed.elastic.multiprocessing.errors.ChildFailedError: '); print('=' * 60); sys.exit(1)"
    )
    run = harness.run([sys.executable, "-c", torchrun], tmp_path / "e.log")
    assert run.error() == "[rank0]: RuntimeError: Expected all tensors to be on the same device"


def test_make_optimizer_reads_names_and_the_registry():
    import optimizers

    p = [torch.nn.Parameter(torch.zeros(8))]
    opt = harness.make_optimizer("torch.optim.AdamW(fused=True, betas=(0.8, 0.9))", p, lr=0.5)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] and opt.defaults["betas"] == (0.8, 0.9)
    assert opt.defaults["lr"] == 0.5
    for v in optimizers.VARIANTS.values():
        assert type(harness.make_optimizer(v.key, p)) is v.cls
        assert harness.make_optimizer(f"{v.component}(stochastic_round=False)", p).stochastic_round is False
    assert [v.key for v in harness.ours()] == list(optimizers.VARIANTS)


def test_optimizer_step_picks_up_a_registered_variant(throwaway):
    """bench/optimizer_step.py times every registered variant by default and makes one by key."""
    import optimizer_step

    assert THROWAWAY_COMPONENT in optimizer_step.default_variants()
    assert isinstance(optimizer_step.make_variant(THROWAWAY_KEY, [torch.nn.Parameter(torch.zeros(8))]), ThrowawayAdamW)


@pytest.fixture(scope="module")
def pipeline_result(tmp_path_factory):
    """bench/pipeline.py on the tiny config without its two eval stages (with them it takes about a minute of CPU,
    lm-eval's start-up mostly): train with a step and an epoch checkpoint, then resume. Its JSON."""
    tmp_path = tmp_path_factory.mktemp("pipeline")
    out = tmp_path / "pipeline.json"
    overrides = [o for o in FAST if not o.startswith("max_steps_per_epoch=")]
    proc = subprocess.run(
        [
            sys.executable,
            "bench/pipeline.py",
            "--config",
            "configs/tiny.yaml",
            "--data-dir",
            str(DATA_DIR),
            "--work",
            str(tmp_path / "work"),
            "--steps",
            "4",
            "--save-every",
            "2",
            "--no-eval",
            "--timeout",
            str(HANG_GUARD_S),  # (the harness's own limit per row: a run that should finish)
            "--out",
            str(out),
            "--allow-dirty",
            *overrides,
        ],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_pipeline_smoke(pipeline_result):
    """The fine-tune's losses reproduced by the resume from its step checkpoint, and the provenance."""
    result = pipeline_result
    assert result["ok"] and result["loss_max_abs_diff"] == 0.0
    assert list(result["stages"]) == ["train", "resume"]
    train = result["stages"]["train"]
    assert train["rc"] == 0 and sorted(train["losses"]) == ["1", "2", "3", "4"]
    assert set(train["checkpoints"]) == {"step_2", "epoch_0"}
    assert [Path(s["path"]).name for s in train["saves"]] == ["step_2", "epoch_0"]
    assert result["stages"]["resume"]["steps_compared"] == 2
    assert result["stages"]["resume"]["command"].startswith("python recipes/full_finetune_single_device.py")
    for key in ("command", "hardware", "versions", "date", "code"):
        assert key in result


def test_the_recipes_saved_lines_give_size_and_time(pipeline_result):
    """Each checkpoint the recipe saves is announced with its size and write time, in the form bench/pipeline.py
    reads (its SAVED pattern): the sizes are the folders' on disk."""
    train = pipeline_result["stages"]["train"]
    for save in train["saves"]:
        assert save["gb"] is not None and save["save_s"] is not None and save["save_s"] >= 0, save["line"]
        on_disk = train["checkpoints"][Path(save["path"]).name]["bytes"]
        assert save["gb"] == pytest.approx(on_disk / 1e9, abs=0.006), save["line"]


def test_checkpoint_bench_toy_rows(tmp_path):
    """bench/checkpoint_save.py on the tiny config: a synchronous row saving once, an asynchronous row saving twice,
    each stopped once its saves are measured; the per-save figures come from the recipe's lines and records."""
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "bench/checkpoint_save.py",
            "--toy",
            "--data-dir",
            str(DATA_DIR),
            "--runs-dir",
            str(tmp_path / "runs"),
            "--pack-cache-dir",
            "off",
            "--out",
            str(out),
            "--allow-dirty",
        ],
        cwd=REPO_ROOT,
        env=recipe_env(),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert {"command", "hardware", "versions", "date", "code"} <= set(doc)
    sync, background = doc["rows"]
    assert not sync.get("error") and not background.get("error"), (sync.get("error"), background.get("error"))
    # A row is stopped once its saves are measured; on a loaded machine the stop can land after one more save, so
    # the measured saves are the first ones (a later one is the same kind of save, at the row's interval).
    assert [s["name"] for s in sync["saves"]][:1] == ["step_2"] and not sync["async_checkpoint"]
    assert all(s["name"] == f"step_{2 * (i + 1)}" for i, s in enumerate(sync["saves"]))
    assert sync["saves"][0]["blocked_s"] == sync["saves"][0]["write_s"] == sync["saves"][0]["total_s"]
    assert [s["name"] for s in background["saves"]][:2] == ["step_3", "step_6"] and background["async_checkpoint"]
    assert all(s["blocked_s"] <= s["total_s"] for s in background["saves"])
    assert background["staged_host_gib"] > 0 and background["peak_host_rss_gib"] > 0
    assert len(background["writing_per_step"]) == len(background["tok_s_per_step"]) >= 7
    assert not list((tmp_path / "runs").glob("*/step_*"))  # a row's checkpoints go with it


def test_loss_parity_width2048_smoke(tmp_path):
    """The width-2048 benchmark at toy size on the CPU (width 128, 1 layer, 32 training records, 2 + 3 steps): it
    pre-trains, fine-tunes the reference and two of ours from the same state, scores, and writes its JSON and plot.
    One run for the CI time, on --arch qwen3 (grouped-query heads of 128, q/k norms; llama2, the default, differs
    only in the model it builds) with FP8 matmuls on the CPU (emulated) in one row: at width 128 the MLP converts, and
    Qwen3's 2,048-wide query projection; the key/value projections stay bf16, as in the 7-8B models.

    The benchmark runs in one process of its own making, so its main() runs here: a subprocess would add its imports,
    and recipe_env's AVX2 pins, which nothing here needs (no recorded numbers are compared), slow its bf16 matmuls
    several times over on an AVX-512 machine."""
    import loss_parity_width2048

    out = tmp_path / "w.json"
    # (short rows and few held-out records: torch's float8 matmul on the CPU takes seconds a call)
    argv = "--device cpu --width 128 --layers 1 --seq-len 32 --batch 1 --steps 3 --pretrain-steps 2 --pretrain-batch 2"
    argv += " --heldout 4 --train-records 32 --variants ours16,ours4_fp8 --arch qwen3"
    status = loss_parity_width2048.main(
        [*argv.split(), "--data-dir", str(DATA_DIR), "--out", str(out), "--allow-dirty"]
    )
    assert status == 0
    result = json.loads(out.read_text())
    assert [r["key"] for r in result["records"]] == ["ref", "ours16", "ours4_fp8"]
    ref, ours, fp8 = result["records"]
    assert ref["reference"] and ref["gap_vs_ref"] == 0.0 and ref["share_of_ref_gain"] == 1.0
    assert ours["error"] is None and len(ours["losses"]) == 3 and ours["dtype"] == "bf16"
    assert ours["gap_vs_ref"] == (ours["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"]
    assert "the first 32 records" in result["data"]
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    assert result["arch"] == "qwen3" and result["title"].startswith("Alpaca, Qwen3")
    assert result["model"]["num_kv_heads"] == 8 and result["model"]["vocab_size"] == 32000
    # Qwen3's output is tied to the embedding, initialised at std 0.02 as the real families are: the untrained model
    # scores near ln(32,000) = 10.4, not the ~50 of nn.Embedding's N(0, 1) table (1,800 at width 2048).
    assert result["pretrain"]["heldout_before"] < 1.5 * math.log(32000)
    assert fp8["fp8"] == "tensorwise" and fp8["fp8_layers"] == 4
    assert fp8["error"] is None and math.isfinite(fp8["heldout_loss"]) and fp8["gap_vs_ref"] is not None


# Stands in for torchtune's full_finetune_single_device.py: logs as its DiskLogger does, then never ends (as a recipe
# writing its end-of-epoch checkpoint), or fails first when asked.
FAKE_STOCK = """
import pathlib, sys, time
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
if "fail=True" in sys.argv:
    raise ValueError("no such optimizer")
log_dir = pathlib.Path(args["metric_logger.log_dir"])
log_dir.mkdir(parents=True)
with open(log_dir / "log_1.txt", "w") as f:
    for step in range(1, int(args["max_steps_per_epoch"]) + 1):
        f.write(f"Step {step} | loss:{3 - step / 10} lr:2e-05 tokens_per_second_per_gpu:{1000 * step}.0 "
                "peak_memory_alloc:tensor(10.5, device='cuda:0') peak_memory_reserved:12.0\\n")
        f.flush()
time.sleep(600)
"""


def test_e2e_stock_row_stops_once_its_steps_are_logged(tmp_path, monkeypatch):
    """bench/e2e.py's stock rows read torchtune's log file; the row is stopped once every step is there (well before
    the fake's 600 s, which the 120 s timeout would otherwise turn into an error)."""
    import e2e

    stock = tmp_path / "stock"
    (stock / "configs" / "llama2").mkdir(parents=True)
    (stock / "full_finetune_single_device.py").write_text(FAKE_STOCK)
    args = argparse.Namespace(
        checkpoint_dir=str(tmp_path / "ck"),
        data_dir=str(DATA_DIR),
        stock_dir=str(stock),
        steps=3,
        skip_steps=1,
        timeout=120,
        pack_cache_dir=str(tmp_path / "packs"),
    )
    row = e2e.run_row("stock_80gb", args, tmp_path / "runs")
    assert "error" not in row, row
    assert row["losses"] == [2.9, 2.8, 2.7] and row["tok_s_per_step"] == [1000.0, 2000.0, 3000.0]
    assert row["tok_s"] == 2500.0 and row["peak_gib"] == 10.5 and row["peak_reserved_gib"] == 12.0
    assert row["command"].startswith(f"python {stock / 'full_finetune_single_device.py'} --config ")

    monkeypatch.setitem(e2e.ROWS, "stock_fails", ("stock", "7B_full_low_memory", ["fail=True"], "80gb"))
    row = e2e.run_row("stock_fails", args, tmp_path / "runs")
    assert row["error"].startswith("0 of 3 steps logged in ") and "ValueError: no such optimizer" in row["error"]
