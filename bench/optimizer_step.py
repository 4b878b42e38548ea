"""Time one AdamW step at Llama2-7B shapes for our variants and the field's, in one process.

    python bench/optimizer_step.py --out bench/results/optimizer_step_h200.json

The default variants are torch's AdamW, every variant registered in ``optimizers.VARIANTS`` (their config paths, in
registration order) and the field's 8-bit, 4-bit and FP8 AdamWs; ``--variants`` takes any of those names, a
registered short key (``ours8``) or ``optimizers.AdamW8bit(tile_blocks=2)``-style names with keyword arguments. The
JSON (``--out``, default outputs/bench/optimizer_step.json) opens with the command, hardware, versions, date and
commit (bench/_harness.py).

Parameters are the 291 tensors of Llama2-7B (6.738 B) in bf16 at random values with random bf16 gradients
(no weights are needed to time an optimizer). For each variant, in this order, in the same process: build the
optimizer, time the first step (wall clock, includes Triton / torch.compile compilation), run warm-up steps,
then time ``--steps`` steps with CUDA events and report the median (``step_ms``: the GPU idles while the host
prepares each step, so the host's share counts) and again with the GPU kept busy before each step (``device_ms``:
the step's device time alone, as in training, where the host prepares the step while backward still runs on the
GPU; ``host_ms``: the host's time to queue the step, meanwhile). State bytes are the growth of
``torch.cuda.memory_allocated`` across the first step, i.e. what the optimizer really allocated.

Variants that fail (missing library, error) are recorded with their error instead of stopping the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import traceback

import torch

import _harness as harness


def llama2_7b_shapes() -> list[tuple[int, ...]]:
    dim, hidden, vocab, layers = 4096, 11008, 32000, 32
    shapes = [(vocab, dim)]
    for _ in range(layers):
        shapes += [(dim, dim)] * 4 + [(hidden, dim), (dim, hidden), (hidden, dim)] + [(dim,)] * 2
    return shapes + [(dim,), (vocab, dim)]


def small_shapes() -> list[tuple[int, ...]]:
    return [(512, 256), (256,), (1000, 77), (4096,), (33, 129)]


def make_variant(name: str, params):
    """name -> optimizer over params. The name is the config's `_component_` path (plus kwargs) or a registered key."""
    return harness.make_optimizer(name, params, lr=1e-5)


def time_variant(name, shapes, steps, warmup, device):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device=device, dtype=torch.bfloat16) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    opt = make_variant(name, params)
    t0 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    state = torch.cuda.memory_allocated() - base
    for _ in range(warmup):
        opt.step()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        opt.step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    # The same steps with the GPU kept busy (a ~10 ms sleep kernel) while the host prepares the step, as it is
    # after backward in training: the events then bracket the step's device work alone, not the host's.
    busy, host = [], []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(20_000_000)
        a.record()
        h = time.perf_counter()
        opt.step()  # returns once the step is queued: the host's own time (the GPU is still asleep)
        host.append((time.perf_counter() - h) * 1e3)
        b.record()
        b.synchronize()
        busy.append(a.elapsed_time(b))
    finite = all(bool(torch.isfinite(p).all()) for p in params[:3])
    rec = dict(
        variant=name,
        step_ms=statistics.median(times),
        step_ms_min=min(times),
        device_ms=statistics.median(busy),
        host_ms=statistics.median(host),
        first_step_s=first,
        state_gib=state / 2**30,
        finite_after=finite,
    )
    del opt, params
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def default_variants() -> list[str]:
    """torch's AdamW, then ours (``optimizers.VARIANTS``, read now), then the field's."""
    anchors = [harness.ANCHORS[k][0] for k in ("fused", "foreach", "ao8", "ao4", "aofp8", "bnb8")]
    return anchors[:2] + [v.component for v in harness.ours()] + anchors[2:]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="*", default=None, help="default: see default_variants()")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--shapes", choices=["llama2_7b", "small"], default="llama2_7b")
    ap.add_argument(
        "--out",
        default=harness.scratch("optimizer_step.json"),
        help="write the JSON here (default outputs/bench/optimizer_step.json)",
    )
    harness.add_arguments(ap)
    return ap.parse_args(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    if args.variants is None:
        args.variants = default_variants()
    if not torch.cuda.is_available():
        sys.exit("bench/optimizer_step.py needs a CUDA GPU (it times device kernels)")
    shapes = llama2_7b_shapes() if args.shapes == "llama2_7b" else small_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    print(f"{len(shapes)} tensors, {n / 1e9:.3f} B params, bf16, on {torch.cuda.get_device_name()}", flush=True)
    records = []
    for name in args.variants:
        try:
            rec = time_variant(name, shapes, args.steps, args.warmup, "cuda")
        except Exception as e:  # a failed variant is a row, not a crash
            traceback.print_exc()
            rec = dict(variant=name, error=f"{type(e).__name__}: {e}"[:500])
            gc.collect()
            torch.cuda.empty_cache()
        records.append(rec)
        print(json.dumps(rec), flush=True)
    print(
        "\n"
        + harness.table(
            ["variant", "step ms", "device ms", "host ms", "first step s", "state GiB"],
            [
                [r["variant"], f"failed: {r['error'][:60]}", "", "", "", ""]
                if "error" in r
                else [
                    r["variant"],
                    f"{r['step_ms']:.1f}",
                    f"{r['device_ms']:.1f}",
                    f"{r['host_ms']:.1f}",
                    f"{r['first_step_s']:.1f}",
                    f"{r['state_gib']:.2f}",
                ]
                for r in records
            ],
        )
    )
    harness.write_json(
        args.out,
        dict(
            prov,
            params=n,
            tensors=len(shapes),
            param_dtype="bfloat16",
            note="Llama2-7B parameter shapes at random values (no weights needed to time an optimizer step).",
            records=records,
        ),
    )
    print(f"wrote {args.out}")
    return records


if __name__ == "__main__":
    main()
