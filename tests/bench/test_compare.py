"""bench/compare.py on the tiny config: the outputs have their structure and their numbers come from the runs.

bench/_harness.py (provenance, the dirty-tree refusal, default output folders) and the other benchmarks' smoke runs
are tested in test_harness.py beside this file."""

import contextlib
import dataclasses
import io
import json
import os
import statistics
import sys

import pytest

from conftest import DATA_DIR, FAST, REPO_ROOT, THROWAWAY_COMPONENT, THROWAWAY_KEY, read_metrics, recipe_env

sys.path.insert(0, str(REPO_ROOT / "bench"))
import _harness as harness
import compare
import support

# Ours at 16 bits: its CPU (plain-PyTorch) step is the quickest of our formats.
FUSED, OURS = "torch.optim.AdamW(fused=True)", "optimizers.AdamW"
STEPS = 4
BROKEN = "no_such_package.AdamW"


@dataclasses.dataclass
class BenchRun:
    returncode: int
    stdout: str


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """bench/compare.py's main() in this process: each variant is still a fresh recipe process, stopped once its last
    step is logged, with recipe_env's environment (set here, for the rows to inherit); a process of the benchmark's
    own would only add its imports. Its printed progress is kept for the tests."""
    out_dir = tmp_path_factory.mktemp("bench")
    argv = ["--config", "configs/tiny.yaml", "--variants", f"fused,ours16,{BROKEN}", "--steps", str(STEPS)]
    # --allow-dirty: the suite runs on a working tree, committed or not
    argv += ["--out-dir", str(out_dir), "--allow-dirty", f"data_dir={DATA_DIR}"]
    argv += [o for o in FAST if not o.startswith("max_steps_per_epoch=")]
    env, stdout = recipe_env(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(stdout):
        for key in set(os.environ) - set(env):
            patch.delenv(key)
        for key, value in env.items():
            if os.environ.get(key) != value:
                patch.setenv(key, value)
        returncode = compare.main(argv)
    return BenchRun(returncode, stdout.getvalue()), out_dir


def test_compare_runs_and_reports(bench_run):
    run, out_dir = bench_run
    assert run.returncode == 0, run.stdout
    # Progress while it runs: a start and a done line per variant, and step lines.
    for name in (FUSED, OURS, BROKEN):
        assert f"{name}] start:" in run.stdout and f"{name}] done in" in run.stdout
    assert f"step {STEPS} loss" in run.stdout

    result = json.loads((out_dir / "compare.json").read_text())
    for key in ("command", "hardware", "versions", "date", "code", "records", "config", "steps"):
        assert key in result
    assert result["versions"]["torch"]
    lead = support.command_lead(result)
    assert result["command"].startswith(lead + "python bench/compare.py --config configs/tiny.yaml")
    assert [r["variant"] for r in result["records"]] == [FUSED, OURS, BROKEN]
    # each record: the recipe command it ran, and the code (a --merge file can mix commits)
    for rec in result["records"]:
        assert rec["code"] == result["code"]
        assert rec["command"].startswith("python -m recipes.full_finetune_single_device --config configs/tiny.yaml")


@pytest.mark.parametrize("variant", [FUSED, OURS])
def test_numbers_come_from_the_run(bench_run, variant):
    _, out_dir = bench_run
    rec = next(r for r in json.loads((out_dir / "compare.json").read_text())["records"] if r["variant"] == variant)
    assert rec["error"] is None
    metrics = read_metrics(out_dir / "runs" / compare.slug(variant))
    assert len(metrics) == STEPS
    assert rec["losses"] == [m["loss"] for m in metrics]
    assert rec["peak_kind"] == "cpu_rss"
    assert rec["peak_gib"] == max(m["peak_rss_gib"] for m in metrics)
    assert rec["tok_s"] == statistics.median(m["tokens_per_second"] for m in metrics[2:])
    assert rec["opt_step_ms"] == statistics.median(m["optimizer_step_ms"] for m in metrics[2:])
    assert rec["opt_state_gib"] == metrics[-1]["optimizer_state_bytes"] / 2**30
    assert rec["tok_s_per_step"] == [m["tokens_per_second"] for m in metrics]
    fused = read_metrics(out_dir / "runs" / compare.slug(FUSED))
    assert rec["vs_fused_paired"] == statistics.median(
        m["tokens_per_second"] / f["tokens_per_second"] for m, f in zip(metrics[2:], fused[2:])
    )
    assert 0 < rec["first_step_s"] < rec["wall_s"]
    # The run is stopped once its last step is logged, before the end-of-epoch checkpoint, and anything the
    # recipe had begun writing is removed (--keep-checkpoints lets it finish and keeps it).
    assert rec["stopped_before_checkpoint"]
    run_dir = out_dir / "runs" / compare.slug(variant)
    assert not list(run_dir.glob("epoch_*")) and not list(run_dir.glob(".tmp-*"))


def test_broken_variant_is_a_failed_row(bench_run):
    _, out_dir = bench_run
    rec = next(r for r in json.loads((out_dir / "compare.json").read_text())["records"] if r["variant"] == BROKEN)
    assert rec["returncode"] == 2
    assert "cannot be imported" in rec["error"]
    assert rec["losses"] == [] and rec["tok_s"] is None and rec["vs_fused_paired"] is None
    table = (out_dir / "compare.md").read_text()
    assert f"| {BROKEN} | - |" in table and "cannot be imported" in table
    assert f"| {FUSED} |" in table and "| 1.00x | 1.000x |" in table


def test_plots_written(bench_run):
    _, out_dir = bench_run
    for name in ("compare_loss.png", "compare_memory_speed.png"):
        data = (out_dir / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_nproc_launches_the_distributed_recipe():
    single = harness.recipe_command(compare.RECIPE, "--config", "c.yaml")
    dist = harness.recipe_command(compare.DIST_RECIPE, "--config", "c.yaml", nproc=2)
    assert single[1:] == ["-m", "recipes.full_finetune_single_device", "--config", "c.yaml"]
    assert any("full_finetune_distributed" in a for a in dist) and not any("single_device" in a for a in dist)
    assert dist[dist.index("--nproc_per_node") + 1] == "2" and dist[-2:] == ["--config", "c.yaml"]
    # a recipe file (torchtune's stock one, or ours by path) runs as a script
    assert harness.recipe_command("/x/recipes/full_finetune_single_device.py")[1:] == [
        "/x/recipes/full_finetune_single_device.py"
    ]


def test_variant_names_and_in_bwd_overrides():
    variants = compare.resolve_variants("fused,ours4,torchao.optim.AdamW8bit", in_bwd=True)
    names = [v[0] for v in variants]
    assert names == [
        FUSED,
        FUSED + "+in_bwd",
        "optimizers.AdamW4bit",
        "optimizers.AdamW4bit+in_bwd",
        "torchao.optim.AdamW8bit",
        "torchao.optim.AdamW8bit+in_bwd",
    ]
    assert variants[1][1] == [
        "optimizer=torch.optim.AdamW",
        "optimizer.fused=True",
        "optimizer_in_bwd=True",
        "clip_grad_norm=null",
    ]
    assert [v[0] for v in compare.resolve_variants("bnb8", in_bwd="only")] == ["bitsandbytes.optim.AdamW8bit+in_bwd"]


def test_our_rows_come_from_the_registry_at_call_time(monkeypatch):
    """The anchors, then every optimizers.VARIANTS entry as registered when resolved: one registered at runtime is in
    `all` and has its key; bench/ has no list of ours of its own, so an empty registry leaves only the anchors."""
    import optimizers

    ours = [(v.component, v.overrides) for v in optimizers.VARIANTS.values()]
    assert compare.resolve_variants("all") == list(harness.ANCHORS.values()) + ours
    extra = dataclasses.replace(next(iter(optimizers.VARIANTS.values())), key="ours_test", component="my.pkg.AdamW")
    optimizers.register(extra)
    try:
        assert compare.resolve_variants("all")[-1] == ("my.pkg.AdamW", ["optimizer=my.pkg.AdamW"])
        assert compare.resolve_variants("ours_test") == [("my.pkg.AdamW", ["optimizer=my.pkg.AdamW"])]
    finally:
        optimizers.VARIANTS.pop("ours_test", None)
    monkeypatch.setattr(optimizers, "VARIANTS", {})
    assert compare.resolve_variants("all") == list(harness.ANCHORS.values())
    with pytest.raises(SystemExit, match="unknown variant 'ours8'"):
        compare.resolve_variants("ours8")


def test_compare_resolves_registered_variants(throwaway):
    """bench/compare.py --variants reads optimizers.VARIANTS at call time: by short key and by config path."""
    for name in (THROWAWAY_KEY, THROWAWAY_COMPONENT):
        ((variant, overrides),) = compare.resolve_variants(name)
        assert variant == THROWAWAY_COMPONENT and f"optimizer={THROWAWAY_COMPONENT}" in overrides
    assert [v[0] for v in compare.resolve_variants("ours8,ours4")] == ["optimizers.AdamW8bit", "optimizers.AdamW4bit"]


def test_busy_machine_is_recorded_and_warned(bench_run):
    _, out_dir = bench_run
    result = json.loads((out_dir / "compare.json").read_text())
    assert len(result["load_average"]["start"]) == 3 and result["load_average"]["cores"] >= 1
    assert compare.busy_warning([0.1, 0.1, 0.1], 2) is None
    assert "busy before the runs (load average 3.00 on 2 cores)" in compare.busy_warning([3.0, 2.0, 1.0], 2)
    table = (out_dir / "compare.md").read_text()
    assert ("**Warning: " in table) == (result["busy_warning"] is not None)


def test_summary_prefers_gpu_peak():
    metrics = [
        {
            "loss": 3.0 - i,
            "tokens_per_second": 100.0 * (i + 1),
            "peak_memory_alloc_gib": 10.0 + i,
            "peak_memory_reserved_gib": 12.0 + i,
            "optimizer_step_ms": None,
            "optimizer_state_bytes": 2**30,
        }
        for i in range(4)
    ]
    s = compare.summarize(metrics, skip_steps=2)
    assert s["peak_kind"] == "gpu_alloc" and s["peak_gib"] == 13.0 and s["peak_reserved_gib"] == 15.0
    assert s["tok_s"] == 350.0 and s["opt_step_ms"] is None and s["losses"] == [3.0, 2.0, 1.0, 0.0]


def test_replot_keeps_a_record_without_per_step_losses(bench_run, tmp_path):
    # A record kept from a runner's summary line (no per-step losses, only final_loss) still gets its table row and
    # its memory/speed point; the loss plot skips it.
    _, out_dir = bench_run
    result = json.loads((out_dir / "compare.json").read_text())
    kept = dict(
        next(r for r in result["records"] if r["variant"] == FUSED),
        variant=FUSED + "+in_bwd",
        losses=None,
        final_loss=1.2345,
        opt_step_ms=None,
    )
    result["records"].append(kept)
    path = tmp_path / "kept.json"
    path.write_text(json.dumps(result))
    assert compare.main(["--replot", str(path), "--out-dir", str(tmp_path)]) == 0
    row = next(
        line for line in (tmp_path / "compare.md").read_text().splitlines() if line.startswith(f"| {FUSED}+in_bwd |")
    )
    assert "1.2345" in row
    assert (tmp_path / "compare_memory_speed.png").read_bytes()[:4] == b"\x89PNG"
