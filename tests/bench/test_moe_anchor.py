"""bench/moe_anchor.py: its CPU toy mode end to end (the streamed folders, transformers' anchor row, our config at the
anchor's depth and at full depth, the JSON with vs_anchor and the footprints), the flags it refuses, and the active
parameter count its MFU uses."""

import json
import os
import sys

import pytest

from conftest import DATA_DIR, REPO_ROOT, recipe_env

sys.path.insert(0, str(REPO_ROOT / "bench"))
import moe_anchor
import support
from finetune import toy_folder


@pytest.fixture
def one_thread(monkeypatch):
    """main() runs in the test; each row is still a fresh process, with recipe_env's environment and one thread."""
    env = recipe_env(OMP_NUM_THREADS="1")
    for key in set(os.environ) - set(env):
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_toy_mode_runs_the_anchor_and_ours_at_both_depths(tmp_path, one_thread):
    """With a --variant row beside them: our config at the anchor's depth with its own overrides and batch."""
    out, work = tmp_path / "anchor.json", tmp_path / "work"
    argv = ["--toy", "--data-dir", str(DATA_DIR), "--work-dir", str(work), "--out", str(out), "--allow-dirty"]
    moe_anchor.main([*argv, "--variant", "three_rows:batch_size=3,optimizer.weight_decay=0.1"])
    doc = json.loads(out.read_text())
    lead = support.command_lead(doc)
    assert doc["command"].startswith(lead + "python bench/moe_anchor.py --toy") and doc["hardware"] and doc["date"]
    rows = {r["name"]: r for r in doc["records"]}
    assert list(rows) == ["anchor", "ours_depth", "ours_depth+three_rows", "ours_full"], rows
    for r in rows.values():
        assert not r.get("error") and r["tok_s"] > 0 and len(r["losses"]) == 3, r
        assert r["host_gb_peak"] is not None and r["gpu_mib_peak"] == 0  # (sampled; no GPU here)
        # the same tokens a step, give or take the packing's padding (2 rows of 128 tokens; the variant's 3)
        low, high = (300, 384) if r["name"].endswith("three_rows") else (200, 256)
        assert all(low <= t <= high for t in r["tokens_per_step"]), r["tokens_per_step"]
    variant = rows["ours_depth+three_rows"]
    assert (
        variant["depth"] == 1 and variant["batch_size"] == 3 and variant["overrides"] == ["optimizer.weight_decay=0.1"]
    )
    assert " batch_size=3 " in variant["command"] and " batch_size=2 " not in variant["command"]
    assert variant["command"].endswith("optimizer.weight_decay=0.1")
    assert variant["vs_anchor"] == pytest.approx(variant["tok_s"] / rows["anchor"]["tok_s"], rel=1e-2)
    anchor, ours, full = rows["anchor"], rows["ours_depth"], rows["ours_full"]
    assert (anchor["depth"], ours["depth"], full["depth"]) == (1, 1, 2)
    assert anchor["experts_path"] and "--anchor-run" in anchor["command"] and anchor["config"] is None
    assert "configs/qwen3_moe/30B_A3B_full_80gb.yaml" in ours["command"] and "folder_1_layers" in ours["command"]
    assert "folder_2_layers" in full["command"]
    assert ours["vs_anchor"] == pytest.approx(ours["tok_s"] / anchor["tok_s"], rel=1e-2) and "vs_anchor" not in full
    assert not list(work.glob("folder_*"))  # (each deleted after its last row: the device disk holds one)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--depth", "49"], "--depth 49 is not between 1 and 48 layers"),
        (["--rows", "ours,anchor"], "unknown rows ['ours']"),
        (["--steps", "4"], "--skip-steps 4 leaves none of --steps 4"),
        (["--variant", "resident"], "--variant 'resident': give NAME:KEY=VALUE"),
        (["--variant", "a b:compile=True"], "--variant 'a b:compile=True': give NAME:KEY=VALUE"),
        (["--variant", "x:compile=True", "--variant", "x:compile=False"], "a name of letters, digits and _ used once"),
        (["--variant", "big:batch_size=lots"], "batch_size takes a whole number of rows"),
    ],
)
def test_bad_flags_are_one_error_line(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        moe_anchor.parse_args(argv)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_mfu_counts_the_active_parameters():
    """Qwen3-30B-A3B's 3.3B parameters a token (8 of 128 experts, attention, router, embedding and output layer)."""
    hf = toy_folder.MODELS["qwen3_moe"]["hf"]
    assert 3.3e9 < moe_anchor.active_params(hf) < 3.4e9
    # a layer: attention 18.9M, 8 experts of 3 x 2048 x 768 (37.7M), the router 0.26M, two norms
    per_layer = (moe_anchor.active_params(hf) - moe_anchor.active_params({**hf, "num_hidden_layers": 8})) / 40
    assert per_layer == 2048 * (4096 * 2 + 512 * 2 + 8 * 3 * 768 + 128 + 2) + 2 * 128


def test_gpu_rows_of_ours_run_as_on_an_80gb_card(tmp_path):
    """On an H200 an uncapped row would take memory an 80 GB card lacks: ours carry the class's cap, toy rows none."""
    gpu = moe_anchor.parse_args(["--data-dir", str(DATA_DIR)])
    for row in ("ours_depth", "ours_full"):
        assert "device_memory_limit_gib=78" in moe_anchor.row_command(row, tmp_path / "f", tmp_path / "o", gpu)
    toy = moe_anchor.parse_args(["--toy", "--data-dir", str(DATA_DIR)])
    assert not any("device_memory_limit_gib" in a for a in moe_anchor.row_command("ours_full", tmp_path, tmp_path, toy))


def test_a_setting_to_try_reaches_our_rows_last_and_not_the_anchor(tmp_path):
    args = moe_anchor.parse_args(["--data-dir", str(DATA_DIR), "--set", "stream_optimizer_states=False"])
    ours = moe_anchor.row_command("ours_depth", tmp_path / "f", tmp_path / "o", args)
    assert ours[-1] == "stream_optimizer_states=False"  # (after the config's and the cap's: it wins)
    anchor = moe_anchor.row_command("anchor", tmp_path / "f", tmp_path / "o", args)
    assert not any("stream_optimizer_states" in a for a in anchor)


def test_the_anchor_can_take_its_own_batch(tmp_path):
    """Each side at the batch it fits at a depth: --anchor-batch-size reaches the anchor's process only, and each
    row records its rows a step."""
    args = moe_anchor.parse_args(["--data-dir", str(DATA_DIR), "--batch-size", "64", "--anchor-batch-size", "16"])
    anchor = moe_anchor.row_command("anchor", tmp_path / "f", tmp_path / "o", args)
    assert anchor[anchor.index("--batch-size") + 1] == "16"
    assert "batch_size=64" in moe_anchor.row_command("ours_depth", tmp_path / "f", tmp_path / "o", args)
    assert [moe_anchor.batch_size(r, args) for r in moe_anchor.ROWS] == [16, 64, 64]
    same = moe_anchor.parse_args(["--data-dir", str(DATA_DIR), "--batch-size", "32"])
    assert [moe_anchor.batch_size(r, same) for r in moe_anchor.ROWS] == [32, 32, 32]
