"""The profiler (finetune/reporting/profiler.py): off by default, and on the CPU a run with profiler.enabled=True writes a
trace and ends with the paragraph of where its recorded steps' time went; both recipes.

Each recipe runs once in this process (FAST, 6 steps, steps 3-4 recorded): about 10 s on 2 cores.
"""

import contextlib
import gzip
import io
import json
import re
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import DATA_DIR, FAST, REPO_ROOT, TINY_CONFIG, read_metrics

PROFILE = [
    "profiler.enabled=True",
    "profiler.wait_steps=1",
    "profiler.warmup_steps=1",
    "profiler.active_steps=2",
    "profiler.num_cycles=1",
]


def run_in_process(recipe: str, out: Path, *overrides: str):
    """``tune run recipes/<recipe>.py --config configs/tiny.yaml ...`` in this process: (exit status, stdout)."""
    module = __import__(f"recipes.{recipe}", fromlist=["recipe_main"])
    argv = [
        f"recipes/{recipe}.py",
        "--config",
        TINY_CONFIG,
        f"data_dir={DATA_DIR}",
        f"output_dir={out}",
        *FAST,
        "metric_logger=null",
        "pack_cache_dir=off",
        *overrides,
    ]
    stdout, code = io.StringIO(), 0
    with mock.patch.object(sys, "argv", argv), contextlib.chdir(REPO_ROOT), contextlib.redirect_stdout(stdout):
        try:
            module.recipe_main()
        except SystemExit as e:
            code = e.code or 0
    return code, stdout.getvalue()


def shares(paragraph: str) -> dict:
    """Category -> percent ("<1 %", a share that rounds to 0 but is there: 0.5)."""
    return {name: 0.5 if pct == "<1" else int(pct) for name, pct in re.findall(r"(\w+) (<1|\d+) %", paragraph)}


def test_a_cpu_run_writes_a_trace_and_says_where_the_time_went(tmp_path):
    code, stdout = run_in_process("full_finetune_single_device", tmp_path / "out", *PROFILE)
    assert code == 0, stdout[-3000:]
    assert [m["step"] for m in read_metrics(tmp_path / "out")] == [1, 2, 3, 4, 5, 6]
    (trace,) = (tmp_path / "out" / "profiler" / "iteration_4").glob("*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"ProfilerStep#2", "ProfilerStep#3"} <= names and "aten::mm" in names  # steps 3-4 (from 0)
    assert any(n.startswith("Optimizer.step#AdamW") for n in names)
    assert (tmp_path / "out" / "profiler" / "iteration_4" / "rank0_key_averages.txt").is_file()

    paragraph, summary = stdout.strip().splitlines()[-2:]
    assert summary.startswith("Run done: trained steps 1-6")
    assert paragraph.startswith("Profiler: steps 3-4 (2 recorded, ") and "CPU time (by PyTorch op" in paragraph
    assert f"Trace: {tmp_path / 'out' / 'profiler' / 'iteration_4'}" in paragraph
    got = shares(paragraph)
    assert list(got) == ["matmuls", "attention", "elementwise", "optimizer", "copies", "communication", "idle"]
    assert 97 <= sum(got.values()) <= 103 and got["matmuls"] > 0 and got["optimizer"] > 0
    assert got["elementwise"] > 0 and got["communication"] == 0

    # The same sums, for scripts: steps recorded, milliseconds per step by category, wall per step.
    saved = json.loads((tmp_path / "out" / "profiler" / "rank0_summary.json").read_text())
    assert saved["steps"] == [3, 4] and saved["recorded"] == 2 and saved["gpu"] is False
    assert f"{saved['wall_ms_per_step']:.1f} ms each" in paragraph
    for name, pct in got.items():
        share = 100 * saved["ms_per_step"][name] / saved["wall_ms_per_step"]
        assert share == pytest.approx(pct, abs=0.5) or (pct == 0.5 and 0 < share < 0.5), (name, share, pct)


def test_the_distributed_recipe_profiles_too(tmp_path, monkeypatch):
    """A world of one (no torchrun): every rank records; rank 0 prints the paragraph."""
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(key, "")  # unset now, and again after the test: the recipe sets them in this process
        monkeypatch.delenv(key)
    code, stdout = run_in_process("full_finetune_distributed", tmp_path / "out", *PROFILE)
    assert code == 0, stdout[-3000:]
    paragraph = stdout.strip().splitlines()[-2]
    assert paragraph.startswith("Profiler: steps 3-4 (2 recorded, ")
    assert list((tmp_path / "out" / "profiler" / "iteration_4").glob("*.pt.trace.json.gz"))


def test_off_by_default_it_builds_nothing(tmp_path):
    from omegaconf import OmegaConf

    from finetune.reporting.profiler import Profiler

    for cfg in (None, OmegaConf.load(REPO_ROOT / TINY_CONFIG).profiler):
        profiler = Profiler(cfg, output_dir=tmp_path, device=torch.device("cpu"))
        with profiler:
            profiler.step(1)
        assert profiler._prof is None and profiler.text() is None
    assert not list(tmp_path.iterdir())


def test_kernels_and_ops_are_sorted_by_name():
    from finetune.reporting.profiler import breakdown, classify

    expected = {
        "matmuls": [
            "aten::mm",
            "aten::addmm",
            "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn",
            "nvjet_tst_192x192",
            "sm90_xmma_gemm_bf16bf16_bf16f32",
            "triton_tem_fused_mm_0",
        ],
        "attention": [
            "aten::_scaled_dot_product_flash_attention",
            "flash_fwd_kernel",
            "aten::_softmax",
            "triton_tem_fused_flex_attention_0",
        ],
        # (inductor's fused kernels compute unless they only cast, concatenate or move: RoPE, RMSNorm, a transpose)
        "elementwise": [
            "aten::mul",
            "aten::_log_softmax",
            "triton_poi_fused_add_mul_0",
            "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
            "triton_poi_fused__to_copy_add_index_mul_neg_select_select_backward_transpose_view_1",
            "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0",
        ],
        "copies": [
            "aten::copy_",
            "aten::_to_copy",
            "Memcpy HtoD (Pageable -> Device)",
            "Memset (Device)",
            "aten::cat",
            "triton_poi_fused_cat_4",
            "triton_poi_fused__unsafe_view_clone_transpose_view_0",
        ],
        "communication": ["nccl:all_reduce", "ncclDevKernel_AllGather_RING_LL", "gloo:all_reduce"],
    }
    assert {c: [classify(n) for n in names] for c, names in expected.items()} == {
        c: [c] * len(names) for c, names in expected.items()
    }

    # Real events: a step of a small attention model under the profiler, its optimizer step counted as one.
    model = torch.nn.Linear(32, 96)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(4, 16, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("ProfilerStep#0"):
            q, k, v = model(x).chunk(3, dim=-1)
            torch.nn.functional.scaled_dot_product_attention(q, k, v).square().mean().backward()
            optimizer.step()
    got = breakdown(prof.events())
    assert not got["gpu"] and got["steps"] == 1
    assert all(got["us"][c] > 0 for c in ("matmuls", "attention", "elementwise", "optimizer"))
    assert sum(got["us"].values()) == pytest.approx(got["wall_us"], rel=1e-6)


def test_gpu_kernels_are_counted_once_by_the_op_that_launched_them():
    """The shape of a GPU cycle's events as torch's profiler gives them (seen on an H200): each CPU op carries the
    kernels it launched, ProfilerStep and Optimizer.step also appear as device-side annotations, and an optimizer
    stepped in backward sits under an Optimizer.step range on the autograd thread."""
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType

    from finetune.reporting.profiler import breakdown

    def event(name, start, end, parent=None, kernels=(), device=DeviceType.CPU, annotation=False):
        return Event(
            name=name,
            device_type=device,
            is_async=False,
            cpu_parent=parent,
            is_user_annotation=annotation,
            kernels=[Event(name=k, duration=us) for k, us in kernels],
            self_cpu_time_total=0.0,
            time_range=Event(elapsed_us=lambda: end - start),
        )

    step = event("ProfilerStep#3", 0, 1000, annotation=True)
    optimizer_step = event("Optimizer.step#AdamW4bit.step", 700, 800, step, annotation=True)
    events = [
        step,
        event("ProfilerStep#3", 0, 900, device=DeviceType.CUDA, annotation=True),
        event("aten::mm", 10, 20, step, [("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_NTN", 300)]),
        event("aten::_scaled_dot_product_cudnn_attention", 20, 30, step, [("cudnn_generated_sdpa_fprop", 100)]),
        event("aten::_softmax", 30, 40, step, [("cunn_SoftMaxForward<4, float>", 50)]),  # (by its op)
        event("aten::mul", 40, 50, step, [("vectorized_elementwise_kernel<4, MulFunctor>", 100)]),
        event("aten::copy_", 50, 60, step, [("direct_copy_kernel_cuda", 50)]),
        optimizer_step,
        event("Optimizer.step#AdamW4bit.step", 700, 800, device=DeviceType.CUDA, annotation=True),
        event("triton_", 710, 790, optimizer_step, [("_adamw_lowbit_kernel", 200)]),
    ]
    got = breakdown(events)
    assert got["gpu"] and got["steps"] == 1 and got["wall_us"] == 1000
    assert got["us"] == {
        "matmuls": 300,
        "attention": 150,
        "elementwise": 100,
        "optimizer": 200,
        "copies": 50,
        "communication": 0,
        "idle": 200,
    }
