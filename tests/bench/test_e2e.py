"""bench/e2e.py's link figures for a streamed row: what crosses the PCIe link per step, by direction, with
torchtune's activation offloading (which the recipe does not count) added from the config."""

import re
import sys

import pytest

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "bench"))
import e2e


def test_activation_offload_traffic_comes_from_the_config():
    per_way = 32 * 16 * 512 * 4096 * 2 / 1e9  # every layer's saved input, batch 16 x 512 tokens, bf16
    assert e2e.activation_offload_gb("7B_full_16gb_fp8", []) == pytest.approx(per_way)
    assert e2e.activation_offload_gb("7B_full_16gb_fp8", ["batch_size=8"]) == pytest.approx(per_way / 2)
    assert e2e.activation_offload_gb("7B_full_16gb_fp8", ["enable_activation_offloading=False"]) == 0.0
    assert e2e.activation_offload_gb("7B_full_80gb", []) == 0.0


def test_the_pcie4_projection_takes_the_busier_direction():
    """States cross once each way, streamed weights twice up and once down: with 12 GB of states, 12 of weights
    and 2 of activations each way, 6 + 8 + 2 = 16 GB go up per step: 0.64 s at 25 GB/s, longer than the step's
    0.5 s of compute, so the projection is link-bound."""
    steady = [
        dict(host_copy_gb=24.0, weights_copy_gb=12.0, copy_wait_ms=2.0, step_time_s=0.502, tokens=8000)
        for _ in range(3)
    ]
    out = e2e.streaming(steady, offload_gb=2.0)
    assert out["host_copy_gb_per_step"] == 24.0 and out["activation_offload_gb_per_step"] == 4.0
    assert out["link_gbps_up"] == pytest.approx(16 / 0.502, abs=0.1)
    assert out["pcie4_projected_tok_s"] == pytest.approx(8000 / 0.64, abs=1)
    # Without weights or activations: half the states up, compute-bound.
    out = e2e.streaming([dict(host_copy_gb=12.0, copy_wait_ms=2.0, step_time_s=0.502, tokens=8000)])
    assert out["pcie4_projected_tok_s"] == pytest.approx(8000 / 0.5, abs=1)


def test_every_row_the_docs_name_exists():
    """The commands the README and the docs give (``bench/e2e.py ... --rows a,b``) name rows the script still has, and
    each row's config is a file: a row dropped or renamed shows here, not on the next device call. (The results
    index quotes each file's command as it ran, renamed rows included: not checked.)"""
    sources = [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")]
    named = set()
    for path in sources:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # a command continued over lines, as one
        for command in re.findall(r"bench/e2e\.py[^\n`]*?--rows ([\w,]+)", text):
            named.update(command.split(","))
    assert named, "no bench/e2e.py --rows command found in the docs"
    assert sorted(named - set(e2e.ROWS)) == []
    for name, (kind, config, _, _) in e2e.ROWS.items():
        if kind == "ours":
            assert (REPO_ROOT / "configs/llama2" / f"{config}.yaml").is_file(), name
