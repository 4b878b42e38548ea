"""Qwen3-30B-A3B's experts, forward and backward, in bf16 (what the config runs) against dynamic FP8: does FP8 pay?

    python bench/moe_experts.py --out bench/results/moe_experts_h100.json   # a GPU of compute capability 9.0+
    python bench/moe_experts.py --toy                                       # CPU: the machinery, no figures

The issue asks for an ``_fp8`` twin of the MoE config only if FP8 measures faster for the experts. This times just
them, in one process, at the model's shapes (128 experts of width 768 on a residual of 2048, 8 a token, one layer)
for the tokens a step routes (``--tokens``: 8,192 is the config's batch of 16 x 512):

- ``bf16``: ``finetune.model.moe.Experts`` with ``torch._grouped_mm``, the path the config trains with;
- ``fp8_rowwise``: torchao's dynamic float8 grouped GEMM (``torchao.prototype.moe_training``: the activations,
  weights and output gradients cast to float8 e4m3 with a scale per row, as ``fp8=rowwise`` does for the dense
  layers), the same function. Its kernel takes each expert's run of tokens at a multiple of 16 rows, so each run is
  padded with zero rows first (into a buffer of the largest size padding can reach, so the host never waits for
  the GPU's counts) and the outputs gathered back, inside the timed step: a path in the model would pay that too.
  Every pass casts the whole stacked weights again (1.2 GB of bf16 read per layer), the price it pays against the
  GEMMs' saving; more tokens a step amortise it.

The tokens are routed at random (each to 8 distinct experts, so the runs are roughly even, as a trained router's
load-balancing loss keeps them). Per path and token count: ``ms`` (median of ``--steps`` forward+backward passes timed
with CUDA events after ``--warmup``), ``tflops`` (18 x routed rows x 2048 x 768 over that: 6 for the forward's three
projections, twice that for backward), and the output's and gate/up gradient's error against bf16's, relative
(Frobenius) — FP8's numerics, beside its speed. The JSON opens with the command, hardware, versions, date and
commit (bench/_harness.py).

``--toy``: width-64 experts on the CPU, the FP8 path emulated in plain PyTorch (cast to float8 and back with the same
per-row scales, then the bf16 GEMM): the padding, the layouts and the comparison, checked by
tests/bench/test_moe_experts.py; no speed figure.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
from typing import Callable, List, Optional

import torch
import torch.nn.functional as F

import _harness as harness

# Qwen3-30B-A3B's config.json
DIM, WIDTH, EXPERTS, TOP_K = 2048, 768, 128, 8
# torch._scaled_grouped_mm takes each group's rows at a multiple of 16 (torchtitan pads its token groups alike)
ALIGN = 16
PATHS = ("bf16", "fp8_rowwise")


def route(tokens: int, experts: int, top_k: int, generator: torch.Generator) -> torch.Tensor:
    """Each token's ``top_k`` distinct experts at random; the count of routed rows per expert."""
    chosen = torch.rand(tokens, experts, generator=generator).topk(top_k, dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=experts)


def padded_rows(counts: torch.Tensor, routed: int, align: int = ALIGN) -> torch.Tensor:
    """Where each of the ``routed`` rows goes when every expert's run is padded up to a multiple of ``align`` rows
    (on the counts' device, with no wait for the GPU: ``routed`` is known from the batch)."""
    padded = (counts + align - 1) // align * align
    starts = padded.cumsum(0) - padded  # each run's first row, padded
    own = counts.cumsum(0) - counts  # each run's first row, unpadded
    arange = torch.arange(len(counts), device=counts.device)
    expert = torch.repeat_interleave(arange, counts, output_size=routed)
    return starts[expert] + torch.arange(routed, device=counts.device) - own[expert]


def fp8_grouped_mm_torchao() -> Callable:
    """torchao's differentiable dynamic rowwise float8 grouped GEMM (A row-major [rows, K], B column-major
    [E, K, N])."""
    from torchao.prototype.moe_training.conversion_utils import MoEScalingType
    from torchao.prototype.moe_training.scaled_grouped_mm import _quantize_then_scaled_grouped_mm

    def mm(a, b_t, offsets):
        return _quantize_then_scaled_grouped_mm(a, b_t, offsets, torch.bfloat16, MoEScalingType.FP8_ROWWISE)

    return mm


def fp8_grouped_mm_emulated() -> Callable:
    """The same function in plain PyTorch for the CPU: each operand cast to float8 e4m3 and back with a scale per row
    of A and per output column of B (power-of-two scales, as torchao's), then the grouped GEMM in the inputs' dtype."""

    def cast(t, dim):
        amax = t.detach().abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
        scale = torch.exp2(torch.floor(torch.log2(torch.finfo(torch.float8_e4m3fn).max / amax)))
        rounded = ((t.float() * scale).to(torch.float8_e4m3fn).float() / scale).to(t.dtype)
        return t + (rounded - t).detach()  # (the rounding in the forward; the gradient passes as through bf16)

    def mm(a, b_t, offsets):
        return torch._grouped_mm(cast(a, -1), cast(b_t, -2), offs=offsets)

    return mm


def fp8_experts(mm: Callable) -> Callable:
    """The experts' function (finetune/model/moe.py's Experts.forward) with ``mm`` for the GEMMs, each expert's run
    padded to ALIGN rows for the kernel and the rows gathered back after."""

    def forward(experts, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        where = padded_rows(counts, x.shape[0])
        padded = (counts + ALIGN - 1) // ALIGN * ALIGN
        # (rows past the last run's end are zeros the kernel leaves out: offsets end each run)
        rows = x.new_zeros(x.shape[0] + len(counts) * (ALIGN - 1), x.shape[1]).index_copy(0, where, x)
        offsets = padded.cumsum(0).to(torch.int32)
        gate, up = mm(rows, experts.gate_up_proj.transpose(-2, -1), offsets).chunk(2, dim=-1)
        return mm(F.silu(gate) * up, experts.down_proj.transpose(-2, -1), offsets).index_select(0, where)

    return forward


def time_path(run: Callable, x, grad, experts, steps: int, warmup: int, cuda: bool) -> float:
    """Median ms of a forward and backward (the gradients of the weights and the input)."""
    times = []
    for i in range(warmup + steps):
        for p in experts.parameters():
            p.grad = None
        x.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        run(x).backward(grad)
        if cuda:
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            ms = (time.perf_counter() - t) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def measure(tokens: int, args, cuda: bool) -> List[dict]:
    from finetune.model.moe import Experts

    device, dtype = "cuda" if cuda else "cpu", torch.bfloat16  # (the dtype the config trains in, on the CPU too)
    dim, width, n_experts = (64, 32, 8) if args.toy else (DIM, WIDTH, EXPERTS)
    top_k = 2 if args.toy else TOP_K
    g = torch.Generator().manual_seed(0)
    counts = route(tokens, n_experts, top_k, g).to(device)
    routed = int(counts.sum())
    experts = Experts(n_experts, dim, width).to(device=device, dtype=dtype)
    experts.path = "grouped_mm"
    x = (torch.randn(routed, dim, generator=g) * 0.5).to(device=device, dtype=dtype).requires_grad_()
    grad = (torch.randn(routed, dim, generator=g) * 1e-3).to(device=device, dtype=dtype)

    def make(path: str) -> Callable:
        if path == "bf16":
            return lambda inp: experts(inp, counts)
        fp8 = fp8_experts(fp8_grouped_mm_emulated() if args.toy else fp8_grouped_mm_torchao())
        return lambda inp: fp8(experts, inp, counts)

    reference = None
    records = []
    for path in args.paths:
        record = {"path": path, "tokens": tokens, "routed_rows": routed, "emulated": bool(args.toy and path != "bf16")}
        try:
            for p in experts.parameters():
                p.grad = None
            x.grad = None
            run = make(path)  # (torchao's prototype is imported here: a failed import is this row's error)
            out = run(x)
            out.backward(grad)
            got = (out.detach(), experts.gate_up_proj.grad.detach().clone(), x.grad.detach().clone())
            if path == "bf16":
                reference = got
            elif reference is not None:
                record["out_rel_err"] = round(rel_err(got[0], reference[0]), 5)
                record["gate_up_grad_rel_err"] = round(rel_err(got[1], reference[1]), 5)
                record["input_grad_rel_err"] = round(rel_err(got[2], reference[2]), 5)
            ms = time_path(run, x, grad, experts, args.steps, args.warmup, cuda)
            record["ms"] = round(ms, 3)
            record["tflops"] = round(18 * routed * dim * width / (ms / 1e3) / 1e12, 1)
        except Exception as e:  # a path that fails is a row, not a crash (torchao's prototype, a kernel's limits)
            traceback.print_exc()
            record["error"] = f"{type(e).__name__}: {e}"[:500]
        records.append(record)
        print(record, flush=True)
    bf16 = next((r for r in records if r["path"] == "bf16" and "ms" in r), None)
    for r in records:
        if bf16 and r is not bf16 and "ms" in r:
            r["vs_bf16"] = round(bf16["ms"] / r["ms"], 3)
    return records


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="8192,16384,32768", help="comma-separated: tokens a step routes")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of: {', '.join(PATHS)}")
    ap.add_argument("--steps", type=int, default=10, help="timed forward+backward passes per row")
    ap.add_argument("--warmup", type=int, default=3, help="passes before the timed ones")
    ap.add_argument("--toy", action="store_true", help="CPU, toy widths, FP8 emulated: the machinery, no figures")
    ap.add_argument("--out", default=harness.scratch("moe_experts.json"), help="the JSON written")
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.paths = args.paths.split(",")
    for p in args.paths:
        if p not in PATHS:
            ap.error(f"--paths: {p!r} is not one of {', '.join(PATHS)}")
    return args


def main(argv: Optional[List[str]] = None) -> List[dict]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    cuda = not args.toy
    if cuda and not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)):
        sys.exit("error: bench/moe_experts.py times the grouped GEMM kernels of a GPU of compute capability 9.0+; "
                 "--toy runs its machinery on the CPU")  # fmt: skip
    records = [r for tokens in args.tokens for r in measure(tokens, args, cuda)]
    print(
        "\n"
        + harness.table(
            ["path", "tokens", "ms", "TFLOP/s", "vs bf16", "out err", "grad err"],
            [
                [r["path"], str(r["tokens"])]
                + (
                    [f"failed: {r['error'][:60]}", "", "", "", ""]
                    if "error" in r
                    else [
                        f"{r['ms']:.2f}",
                        f"{r['tflops']:.0f}",
                        f"{r['vs_bf16']:.2f}x" if "vs_bf16" in r else "-",
                        str(r.get("out_rel_err", "-")),
                        str(r.get("gate_up_grad_rel_err", "-")),
                    ]
                )
                for r in records
            ],
        )
    )
    shapes = "toy: 8 experts of 32 on 64, 2 a token" if args.toy else "128 experts of 768 on 2048, 8 a token"
    harness.write_json(args.out, dict(prov, shapes=shapes, records=records))
    print(f"wrote {args.out}")
    return records


if __name__ == "__main__":
    main()
