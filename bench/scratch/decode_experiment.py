"""Scratch experiment (H200): does the 8-bit kernel pay for its table-gather decode?

Times optimizers.AdamW8bit at Llama2-7B shapes with (a) a table-gather decode and (b) the arithmetic decode of the
same code values (now the mainline's), in one process; checks (b) against (a) on a small problem first.
Measured 2026-11-30 on the H200, with an earlier log2-based encoder: (a) 101.0 ms, (b) 79.0 ms.
    PYTHONPATH=. python bench/scratch/decode_experiment.py
"""
import dataclasses
import statistics

import torch
import triton.language as tl

import optimizers
from optimizers import adamw8bit
from optimizers._triton import jit
from bench.optimizer_step import llama2_7b_shapes


@jit
def _load_table(codes, scale, qmap, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, SIGNED: tl.constexpr):
    """The first version: decode by a per-element gather from the 256-entry code table."""
    s = tl.load(scale + blk, mask=bmask, other=0.0)[:, None]
    c_lo = tl.load(codes + off_lo, mask=bmask[:, None], other=0).to(tl.int32)
    c_hi = tl.load(codes + off_hi, mask=bmask[:, None], other=0).to(tl.int32)
    return tl.load(qmap + c_lo) * s, tl.load(qmap + c_hi) * s


# The arithmetic decode won and moved into the mainline (optimizers/_dynamic_map.py: decode_tl); the table
# version is kept here to re-run the comparison.
TABLE = dataclasses.replace(adamw8bit.FORMAT, triton_load=_load_table)
ANALYTIC = adamw8bit.FORMAT


def bench(fmt, shapes, steps=10):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    opt = optimizers.AdamW8bit(ps, lr=1e-5, _format=fmt)
    for _ in range(3):
        opt.step()
    ts = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); opt.step(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


if __name__ == "__main__":
    small = [(1000, 300), (4096, 65), (5000,)]
    res = []
    for fmt in (TABLE, ANALYTIC):
        torch.manual_seed(1)
        ps = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in small]
        opt = optimizers.AdamW8bit(ps, lr=1e-2, _format=fmt)
        for _ in range(3):
            for p in ps:
                p.grad = torch.sin(p.detach() * 3)
            opt.step()
        res.append([p.detach().clone() for p in ps])
    print("analytic vs table decode, max param diff:", max((a - b).abs().max().item() for a, b in zip(*res)))
    shapes = llama2_7b_shapes()
    print(f"8-bit step at Llama2-7B shapes: table decode {bench(TABLE, shapes):.1f} ms, "
          f"arithmetic decode {bench(ANALYTIC, shapes):.1f} ms")
