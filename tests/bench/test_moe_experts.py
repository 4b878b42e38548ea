"""bench/moe_experts.py on the CPU: the padding of each expert's run for the FP8 kernel, and the two paths computing
the same function (FP8 emulated), forward and backward."""

import json
import sys

import torch

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))

import moe_experts


def test_each_experts_run_is_padded_to_sixteen_rows_in_order():
    counts = torch.tensor([3, 0, 16, 17, 1])
    where = moe_experts.padded_rows(counts, int(counts.sum()))
    # runs start at 0, 16 (the empty expert takes no rows), 16, 32, 64 in the padded layout
    expected = [0, 1, 2] + list(range(16, 32)) + list(range(32, 49)) + [64]
    assert where.tolist() == expected


def test_fp8_and_bf16_paths_agree_within_fp8s_rounding(tmp_path):
    out = tmp_path / "experts.json"
    argv = ["--toy", "--tokens", "48,96", "--steps", "2", "--warmup", "1", "--out", str(out), "--allow-dirty"]
    moe_experts.main(argv)
    records = json.loads(out.read_text())["records"]
    assert [(r["path"], r["tokens"]) for r in records] == [
        ("bf16", 48),
        ("fp8_rowwise", 48),
        ("bf16", 96),
        ("fp8_rowwise", 96),
    ]
    for r in records:
        assert "error" not in r, r
        assert r["ms"] > 0 and r["routed_rows"] == 2 * r["tokens"]
    for r in records[1::2]:
        # e4m3's 3 mantissa bits: a few percent; a wrong layout or scale axis would be of the order of 1
        assert r["emulated"] and 0 < r["out_rel_err"] < 0.1 and 0 < r["gate_up_grad_rel_err"] < 0.1
        assert 0 < r["input_grad_rel_err"] < 0.1 and r["vs_bf16"] > 0


def test_a_path_that_fails_is_a_row_with_its_error(tmp_path, monkeypatch):
    """torchao's float8 grouped GEMM is a prototype: where it cannot be imported or run, the row says why and the
    bf16 row stands."""

    def broken():
        raise ImportError("no float8 grouped GEMM here")

    monkeypatch.setattr(moe_experts, "fp8_grouped_mm_emulated", broken)
    out = tmp_path / "experts.json"
    argv = ["--toy", "--tokens", "32", "--steps", "1", "--warmup", "0", "--out", str(out), "--allow-dirty"]
    bf16, fp8 = moe_experts.main(argv)
    assert bf16["ms"] > 0 and "error" not in bf16
    assert fp8["error"] == "ImportError: no float8 grouped GEMM here" and "ms" not in fp8
