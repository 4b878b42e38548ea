"""One transformer layer's forward and backward under torch.compile, per fusion option (recipes/_fusion.py).

    python bench/layer_fusion.py --out bench/results/layer_fusion_h200.json      # on a CUDA GPU

A Llama2-7B layer (dim 4096, 32 heads, MLP 11008) in bf16 on 16 packed rows of 512 tokens, compiled per layer as the
recipes compile it, timed over ``--iters`` forward+backward passes after ``--warmup`` (CUDA events, median). The
rows hold samples of random lengths (``--min-len``-``--max-len`` tokens, packed best-fit as the recipes pack), the
same lengths for every variant. Each variant's output and input gradient are compared with the baseline's (flex
attention, separate projections): the fused forms compute the same sums in another order, so they differ by bf16
rounding only. ``x 32`` is the layer's time times the model's 32 layers: the share of a 7B step the option touches
(the output layer, the loss and the optimizer are not in it).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

import _harness as harness

VARIANTS = {  # name -> (fuse_projections, packed_attention)
    "baseline": (False, "flex"),
    "fused": (True, "flex"),
    "varlen": (False, "varlen"),
    "fused_varlen": (True, "varlen"),
}


def seq_lens(rows: int, seq_len: int, lo: int, hi: int, seed: int) -> List[List[int]]:
    """Each row's segment lengths: samples of random length packed best-fit, then the padding's segment."""
    sys.path.insert(0, str(harness.REPO_ROOT))
    from recipes._packing import best_fit_decreasing

    rng = random.Random(seed)
    lengths = [rng.randint(lo, hi) for _ in range(rows * seq_len // ((lo + hi) // 2) * 2)]
    packed = best_fit_decreasing(lengths, seq_len)[:rows]
    out = []
    for row in packed:
        segs = [lengths[i] for i in row]
        if sum(segs) < seq_len:
            segs.append(seq_len - sum(segs))
        out.append(segs)
    return out


def time_layer(layer, x, mask, input_pos, iters: int, warmup: int) -> Dict[str, object]:
    import torch

    grad = torch.randn_like(x)
    times = []
    for i in range(warmup + iters):
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = layer(x, mask=mask, input_pos=input_pos)
        out.backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return {"ms": statistics.median(times), "out": out.detach(), "dx": x.grad.detach().clone()}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--min-len", type=int, default=40, help="shortest sample (tokens)")
    ap.add_argument("--max-len", type=int, default=400, help="longest sample (tokens)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=harness.scratch("layer_fusion.json"))
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    doc = harness.provenance(__file__, argv, args.allow_dirty)

    import torch
    from torchtune.models.llama2._component_builders import llama2
    from torchtune.modules.attention_utils import packed_block_causal_mask

    sys.path.insert(0, str(harness.REPO_ROOT))
    from recipes import _fusion

    if not torch.cuda.is_available():
        sys.exit("layer_fusion.py measures GPU kernels: run it on a CUDA GPU")
    torch.manual_seed(args.seed)
    with torch.device("cuda"):
        base = llama2(vocab_size=128, num_layers=1, num_heads=32, num_kv_heads=32, embed_dim=4096,
                      max_seq_len=4096, intermediate_dim=11008).layers[0].to(torch.bfloat16)
    lens = seq_lens(args.rows, args.seq_len, args.min_len, args.max_len, args.seed)
    items = [{"tokens": torch.zeros(args.seq_len, dtype=torch.long), "labels": torch.zeros(args.seq_len, dtype=torch.long),
              "input_pos": torch.cat([torch.arange(n) for n in row]), "seq_lens": torch.tensor(row)} for row in lens]
    varlen_batch = _fusion.collate_varlen(items)
    input_pos = varlen_batch["input_pos"].cuda()
    masks = {"flex": packed_block_causal_mask([torch.tensor(row) for row in lens]),
             "varlen": {"cu_seqlens": varlen_batch["mask"]["cu_seqlens"].cuda()}}
    x = torch.randn(args.rows, args.seq_len, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    records, reference = [], None
    for name in args.variants.split(","):
        fuse, attention = VARIANTS[name]
        layer = copy.deepcopy(base)
        if fuse:
            _fusion.fuse_projections(layer)
        if attention == "varlen":
            _fusion.use_varlen_attention(layer)
        torch._dynamo.reset()
        layer.compile()
        result = time_layer(layer, x, masks[attention], input_pos, args.iters, args.warmup)
        record = {"variant": name, "fuse_projections": fuse, "packed_attention": attention,
                  "layer_ms": round(result["ms"], 3), "x32_ms": round(32 * result["ms"], 1)}
        if reference is None:
            reference = result
        else:
            for key in ("out", "dx"):
                diff = (result[key].float() - reference[key].float()).abs().max().item()
                record[f"max_abs_diff_{key}"] = diff
                record[f"ref_abs_max_{key}"] = reference[key].float().abs().max().item()
            record["vs_baseline"] = round(reference["ms"] / result["ms"], 3)
        records.append(record)
        print(record, flush=True)
        del layer
        doc.update(rows=args.rows, seq_len=args.seq_len, segments=sum(len(row) for row in lens), records=records)
        harness.write_json(Path(args.out), doc)


if __name__ == "__main__":
    main()
