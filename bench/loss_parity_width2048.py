"""Accuracy where a real fine-tune runs: a pre-trained model of real width, fine-tuned at lr 2e-5 per AdamW variant.

    python bench/loss_parity_width2048.py --data-dir /tmp/data \\
        --out bench/results/loss_parity_h200.json --plot docs/loss_parity_h200.png
    python bench/loss_parity_width2048.py --arch qwen3 --variants ours4_fp8 --data-dir /tmp/data \\
        --out bench/results/loss_parity_width2048_qwen3_h200.json     # FP8 matmuls on a Qwen3-shaped model

A full fine-tune starts from a trained model and moves it by lr 2e-5 per step; with bf16 weights most of those
updates are smaller than half a bf16 ulp of the weight and round away. A random-init CPU toy (bench/loss_parity.py)
cannot show that, so this benchmark first pre-trains a Llama2-architecture model of real width (8 layers x 2048 by
default, 0.54 B parameters, the real vocabulary) in fp32-master mixed precision to a shared state, then fine-tunes
that state once per row on identical batches and scores held-out Alpaca records that no run trained on. Every run
shares the model's tensors (weights are copied back in place), the batches (built once, on the device) and the
held-out set, so the only difference between rows is the optimizer and the weights' dtype. It runs in one process,
on a GPU (--device; a CPU does for a toy size such as the test's).

``--arch`` picks the layer (``ARCHS``; the vocabulary stays Llama 2's 32,000, the data's tokenizer): ``llama2`` (the
default: multi-head attention, heads of 128, the llama2 builder's MLP), or, at the same width and depth, the layer of
a real model of that width in the families of configs/: ``llama3`` (Llama 3.2 1B's: 32 heads of 64 in 8 key/value
groups, MLP 8,192, RoPE base 500,000 with Llama 3's scaling, tied embeddings), ``qwen3`` (Qwen3 1.7B's: 16 heads of 128
in 8 groups, an RMSNorm over each head's query and key, MLP 6,144, base 1e6, tied), ``qwen2`` (Qwen2.5 3B's: 16 heads
of 128 in 2 groups, biases on q/k/v, MLP 11,008, base 1e6, tied), ``qwen3_moe`` (Qwen3-30B-A3B's: 32 heads of 128 in 4
groups, q/k norms, with 16 experts of 768 and 4 a token instead of its 128 and 8, so the model stays near the others'
size; the trained loss adds 0.001 x the load-balancing loss, as the recipes do, the held-out loss is the
cross-entropy). As in the 7-8B models, the grouped-query key/value
projections are small enough that FP8 leaves them in bf16.

Rows (--variants, keys; `ref` always runs; default: all but the `_comp`, `_fp8` and `_fp8rw` extras): `ref` (torch fused AdamW, fp32
master weights), `fused` (the same on bf16 weights), ours (every key of optimizers.VARIANTS, with their defaults),
`{key}_rtn` for each of ours (stochastic_round=False: the bf16 weight write rounded to nearest), torchao's 8- and 4-bit
(`ao8`, `ao4`: their default rounds to nearest; `ao8_sr`, `ao4_sr`: bf16_stochastic_round=True), `bnb8`; extras:
`{key}_comp` for each of ours (compensate=True), `{key}_fp8` / `{key}_fp8rw` for each of ours with FP8 matmuls in the
transformer layers (the recipes' fp8=tensorwise / rowwise: finetune/model/prepare.py's convert_to_fp8 on a copy of the
model, eager).

Per row: `heldout_loss`, `gap_vs_ref` ((heldout - heldout_ref) / heldout_ref), `share_of_ref_gain` (the part of the
reference's held-out improvement the row achieved), `ms_per_step` (the whole training step of this model),
`first_step_s` and every step's loss. The JSON (--out, default outputs/bench/loss_parity_width2048.json; rewritten
after every row; the plot beside it unless --plot) opens with the command, hardware, versions, date and commit.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

import _harness as harness
import _parity_report as report
from finetune.model.loss import training_loss

REGIME = dict(vocab_size=32000, num_layers=8, num_heads=16, num_kv_heads=16, embed_dim=2048, max_seq_len=512)
# --arch: (builder, its keywords beyond the vocabulary, depth and width, which --width and --layers set; a description)
ARCHS = {
    "llama2": ("torchtune.models.llama2.llama2", {}, "torchtune llama2 builder (Llama2: RMSNorm, RoPE, SwiGLU)"),
    "llama3": (
        "torchtune.models.llama3_2.llama3_2",
        dict(num_heads=32, num_kv_heads=8, intermediate_dim=8192, rope_base=500000, scale_factor=32),
        "torchtune llama3_2 builder at Llama 3.2 1B's layer (GQA 32/8 heads of 64, RoPE 500,000 scaled, tied)",
    ),
    "qwen3": (
        "finetune.model.builders.qwen3",
        dict(num_heads=16, num_kv_heads=8, head_dim=128, intermediate_dim=6144, tie_word_embeddings=True),
        "our qwen3 builder at Qwen3 1.7B's layer (GQA 16/8 heads of 128, q/k RMSNorm before RoPE, base 1e6, tied)",
    ),
    "qwen2": (
        "torchtune.models.qwen2.qwen2",
        dict(num_heads=16, num_kv_heads=2, intermediate_dim=11008, tie_word_embeddings=True),
        "torchtune qwen2 builder at Qwen2.5 3B's layer (GQA 16/2 heads of 128, q/k/v biases, base 1e6, tied)",
    ),
    "qwen3_moe": (
        "finetune.model.builders.qwen3_moe",
        dict(
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            intermediate_dim=6144,
            moe_intermediate_dim=768,
            num_experts=16,
            num_experts_per_tok=4,
        ),
        "our qwen3_moe builder at Qwen3-30B-A3B's layer with 16 experts of 768, 4 a token (GQA 32/4 heads of 128, "
        "q/k RMSNorm, renormalised top-k, load-balancing loss x 0.001 in the trained loss)",
    ),
}


ARCH_NAMES = {"llama2": "Llama2", "llama3": "Llama 3", "qwen3": "Qwen3", "qwen2": "Qwen2.5", "qwen3_moe": "Qwen3-MoE"}


def rows() -> tuple:
    """([(key, label, weights dtype, optimizer name)], the default keys); names as harness.make_optimizer reads them.
    Labels name the settings; ours with their defaults say "defaults"."""
    fused, ours = harness.ANCHORS["fused"][0], harness.ours()
    out = [
        ("ref", f"{fused} [fp32 master weights, reference]", "fp32", fused),
        ("fused", f"{fused} [bf16 weights]", "bf16", fused),
    ]
    out += [(v.key, f"{v.component} [defaults]", "bf16", v.component) for v in ours]
    out += [
        (f"{v.key}_rtn", f"{v.component} [stochastic_round=False]", "bf16", f"{v.component}(stochastic_round=False)")
        for v in ours
    ]
    for key in ("ao8", "ao4"):
        name = harness.ANCHORS[key][0]
        out += [
            (key, f"{name} [defaults: bf16_stochastic_round=False]", "bf16", name),
            (f"{key}_sr", f"{name} [bf16_stochastic_round=True]", "bf16", f"{name}(bf16_stochastic_round=True)"),
        ]
    out.append(("bnb8", f"{harness.ANCHORS['bnb8'][0]} [defaults]", "bf16", harness.ANCHORS["bnb8"][0]))
    defaults = [r[0] for r in out]
    out += [
        (f"{v.key}_comp", f"{v.component} [compensate=True]", "bf16", f"{v.component}(compensate=True)") for v in ours
    ]
    # FP8 matmuls (the recipes' fp8=...): the transformer layers' linear layers through torchao's float8 training,
    # weights, gradients and optimizer as in the bf16 rows.
    for recipe, suffix in (("tensorwise", "fp8"), ("rowwise", "fp8rw")):
        out += [
            (f"{v.key}_{suffix}", f"{v.component} [defaults, fp8={recipe}]", "bf16", v.component, recipe) for v in ours
        ]
    return [r if len(r) == 5 else (*r, None) for r in out], defaults


def _warmup(step: int, warmup: int, total: int, cosine: bool) -> float:
    if step < warmup:
        return (step + 1) / warmup
    if not cosine:
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


class Regime:
    """The shared state of the runs: data on the device, the pre-trained weights, the model."""

    def __init__(self, args, device):
        from torchtune.config._utils import _get_component_from_path
        from torchtune.data import padded_collate_packed, padded_collate_sft
        from torchtune.datasets import alpaca_dataset
        from torchtune.models.llama2 import llama2_tokenizer
        from torchtune.modules import TiedLinear

        from finetune.data.packing import PackedSFTDataset, TokenizedSamples

        self.args, self.device = args, device
        builder, arch, _ = ARCHS[args.arch]
        shape = {
            **REGIME,
            "embed_dim": args.width,
            "num_layers": args.layers,
            "num_heads": args.width // 128,
            "num_kv_heads": args.width // 128,
            "max_seq_len": args.seq_len,
            **arch,
        }
        self.shape = shape
        data_dir = harness.repo_path(args.data_dir)
        data_file = str(data_dir / "alpaca" / "alpaca_data.json")
        tok = llama2_tokenizer(
            str(data_dir / "llama2_tokenizer" / "tokenizer.model"), max_seq_len=args.seq_len, prompt_template=None
        )

        def split(spec):
            return alpaca_dataset(
                tok, source="json", data_files=data_file, split=spec, train_on_input=True, packed=False
            )

        t = time.perf_counter()
        train = split(f"train[:-{args.heldout}]")
        if args.train_records:  # a smaller run (a smoke test): the first N records only
            train = torch.utils.data.Subset(train, range(min(args.train_records, len(train))))
        self.train_records = len(train)
        train = TokenizedSamples.from_dataset(train, desc="Tokenizing the training split")
        packed = PackedSFTDataset(train, args.seq_len, tok.pad_id)
        heldout = split(f"train[-{args.heldout}:]")
        self.tokenize_s = time.perf_counter() - t
        self.rows, self.fill = len(packed), packed.fill()

        def batches(n_steps, batch, seed):
            g = torch.Generator().manual_seed(seed)
            order = torch.cat(
                [torch.randperm(len(packed), generator=g) for _ in range(-(-n_steps * batch // len(packed)))]
            )
            out = []
            for s in range(n_steps):
                b = padded_collate_packed([packed[int(i)] for i in order[s * batch : (s + 1) * batch]])
                out.append({k: v.to(device) if hasattr(v, "to") else v for k, v in b.items()})
            return out

        # Two different orders of the same rows: the fine-tune sees the pre-training data again, shuffled anew,
        # like a second epoch; every variant gets exactly these batches.
        self.pre_batches = batches(args.pretrain_steps, args.pretrain_batch, seed=1)
        self.ft_batches = batches(args.steps, args.batch, seed=2)
        items = sorted((heldout[i] for i in range(len(heldout))), key=lambda x: len(x["tokens"]))
        self.heldout = [
            {
                k: v.to(device)
                for k, v in padded_collate_sft(items[i : i + 64], padding_idx=tok.pad_id, ignore_idx=-100).items()
            }
            for i in range(0, len(items), 64)
        ]
        self.heldout_tokens = sum(
            int((F.pad(b["labels"][:, 1:], (0, 1), value=-100) != -100).sum()) for b in self.heldout
        )
        torch.manual_seed(args.seed)
        with torch.device(device):
            self.model = _get_component_from_path(builder)(**shape)
        if isinstance(getattr(self.model, "output", None), TiedLinear):
            # A tied output projection is the embedding table, and nn.Embedding starts at N(0, 1): logits of std
            # sqrt(width), a held-out loss near 1,800 before pre-training and 7.4 after it, so the fine-tune would
            # start from a barely trained state. Real checkpoints of these families are initialised at std 0.02
            # (their initializer_range); the untied llama2 default keeps its init (and its recorded results).
            torch.nn.init.normal_(self.model.tok_embeddings.weight, std=0.02)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.dtype = torch.float32
        self.fp32_buffers = {name: buf.detach().clone() for name, buf in self.model.named_buffers()}

    def set_dtype(self, dtype):
        """Cast the model; back in fp32 the buffers (the RoPE table) are restored, not up-cast from bf16."""
        if dtype != self.dtype:
            self.model.to(dtype)
            self.dtype = dtype
            if dtype == torch.float32:
                with torch.no_grad():
                    for name, buf in self.model.named_buffers():
                        buf.copy_(self.fp32_buffers[name])

    def loss(self, batch, reduction: str = "mean"):
        """Cross-entropy of a batch as the recipe computes it (token t predicts t+1), logits in fp32; fp32 weights
        run under bf16 autocast. Packed batches carry their block mask and positions, unpacked ones neither."""
        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.float32):
            logits = self.model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"))
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction=reduction
        )

    def heldout_loss(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        with torch.no_grad():
            for b in self.heldout:
                total += self.loss(b, reduction="sum").double()
        self.model.train()
        return float(total) / self.heldout_tokens

    def train(self, opt, batches, warmup, cosine, clip=None):
        """Step `opt` over `batches`; returns the per-step losses and the mean wall time per step."""
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _warmup(s, warmup, len(batches), cosine))
        losses = torch.zeros(len(batches), device=self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        first = None
        for i, b in enumerate(batches):
            loss, _ = training_loss(self.model, self.loss(b))  # (a mixture of experts': + its routers' loss)
            loss.backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            losses[i] = loss.detach()
            if i == 0:
                sync()
                first = time.perf_counter() - t
                t = time.perf_counter()
        sync()
        per_step = (time.perf_counter() - t) / max(1, len(batches) - 1)
        return losses.tolist(), per_step, first


def table(records: List[dict]) -> str:
    return report.table(
        ["AdamW [settings]", "weights", "held-out loss", "gap vs fp32 master", "share of its gain", "ms/step"],
        records,
        lambda r: [
            r["dtype"],
            f"{r['heldout_loss']:.4f}",
            f"{100 * r['gap_vs_ref']:+.2f} %" if r.get("gap_vs_ref") is not None else "-",
            f"{r['share_of_ref_gain']:.2f}" if "share_of_ref_gain" in r else "-",
            f"{r['ms_per_step']:.0f}",
        ],
    )


def parse_args(argv: Optional[List[str]] = None):
    table_rows, defaults = rows()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated keys (ref always runs), of: {', '.join(r[0] for r in table_rows)} "
        "(default: all but the _comp rows)",
    )
    parser.add_argument("--steps", type=int, default=500, help="fine-tune steps per variant")
    parser.add_argument("--heldout", type=int, default=2000, help="last N Alpaca records, left out of training")
    parser.add_argument(
        "--train-records",
        type=int,
        default=None,
        help="train on the first N records only (default: all but the held-out ones; for tests)",
    )
    parser.add_argument("--data-dir", default=harness.DATA_DIR)
    parser.add_argument(
        "--out",
        default=harness.scratch("loss_parity_width2048.json"),
        help="results JSON (default outputs/bench/loss_parity_width2048.json)",
    )
    parser.add_argument("--plot", default=None, help="plot PNG (default: beside --out)")
    parser.add_argument("--replot", metavar="JSON", default=None, help="run nothing: redraw --plot from a results JSON")
    parser.add_argument("--arch", default="llama2", choices=list(ARCHS), help="the layer's shape (ARCHS)")
    parser.add_argument("--width", type=int, default=2048, help="model width (llama2: heads of 128)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512, help="pack length")
    parser.add_argument("--batch", type=int, default=16, help="packed rows per fine-tune step")
    parser.add_argument("--lr", type=float, default=2e-5, help="fine-tune lr (20 warm-up steps, then constant)")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--pretrain-batch", type=int, default=16)
    parser.add_argument("--pretrain-lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation")
    parser.add_argument("--device", default="cuda")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    args.keys = harness.pick(parser, args.variants, [r[0] for r in table_rows], "variants", defaults)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        report.plot(result["records"], Path(args.plot), result.get("title", ""), window=20)
        print(table(result["records"]))
        return 0
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    device = torch.device(args.device)
    chosen = [r for r in rows()[0] if r[0] == "ref" or r[0] in args.keys]
    started = time.perf_counter()
    tag = f"[width{args.width}]"
    print(f"{tag} tokenizing, packing, building {args.steps + args.pretrain_steps} batches", flush=True)
    reg = Regime(args, device)
    print(
        f"{tag} {reg.n_params / 1e9:.3f} B parameters; {reg.rows} packed rows ({100 * reg.fill:.1f} % full); "
        f"{len(reg.heldout)} held-out batches, {reg.heldout_tokens} tokens",
        flush=True,
    )

    # The shared starting point: fp32 master weights, bf16 autocast, fused AdamW.
    init_loss = reg.heldout_loss()
    opt = torch.optim.AdamW(reg.model.parameters(), lr=args.pretrain_lr, weight_decay=0.0, fused=device.type == "cuda")
    pre_losses, pre_step_s, _ = reg.train(opt, reg.pre_batches, warmup=30, cosine=True, clip=1.0)
    del opt
    state = {k: v.detach().clone() for k, v in reg.model.state_dict().items()}
    start_loss = {"fp32": reg.heldout_loss()}
    reg.set_dtype(torch.bfloat16)
    start_loss["bf16"] = reg.heldout_loss()
    print(
        f"{tag} pre-trained {args.pretrain_steps} steps ({pre_step_s * 1e3:.0f} ms/step): held-out "
        f"{init_loss:.4f} -> {start_loss['fp32']:.4f} (fp32), {start_loss['bf16']:.4f} (bf16 copy)",
        flush=True,
    )

    title = (
        f"Alpaca, {ARCH_NAMES[args.arch]} architecture {args.layers} x {args.width} ({reg.n_params / 1e9:.2f} B), "
        f"fine-tuned at lr {args.lr:g} from a pre-trained state: {args.steps} steps of {args.batch} x {args.seq_len} "
        "tokens"
    )
    doc = {
        **prov,
        "title": title,
        "model": dict(
            reg.shape,
            architecture=ARCHS[args.arch][2],
            # (the dense MLP's width, or for a mixture of experts the dense width its builder was given)
            intermediate_dim=getattr(reg.model, "moe_fields", {}).get("intermediate_size")
            or reg.model.layers[0].mlp.w1.weight.shape[0],
        ),
        "arch": args.arch,
        "width": args.width,
        "parameters": reg.n_params,
        "steps": args.steps,
        "batch": f"{args.batch} packed rows x {args.seq_len} tokens per step",
        "fine_tune": {
            "lr": args.lr,
            "warmup_steps": 20,
            "schedule": "linear warm-up, then constant",
            "weight_decay": 0.0,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
            "clip_grad_norm": None,
        },
        "pretrain": {
            "steps": args.pretrain_steps,
            "batch": args.pretrain_batch,
            "lr": args.pretrain_lr,
            "schedule": "30 warm-up steps, cosine to 0",
            "clip_grad_norm": 1.0,
            "optimizer": "torch.optim.AdamW(fused=True), fp32 weights and states, bf16 autocast",
            "heldout_before": init_loss,
            "heldout_after_fp32": start_loss["fp32"],
            "heldout_after_bf16": start_loss["bf16"],
            "ms_per_step": 1e3 * pre_step_s,
            "losses": pre_losses[::10],
        },
        "data": f"alpaca_data.json: the first {reg.train_records} records tokenized (train_on_input=True, "
        f"max_seq_len {args.seq_len}) and packed best-fit into {reg.rows} rows "
        f"({100 * reg.fill:.1f} % full, block-causal); two seeded orders of those rows for pre-training "
        f"and fine-tuning",
        "heldout": f"the last {args.heldout} records of alpaca_data.json (never trained on), unpacked, "
        f"{reg.heldout_tokens} tokens, token-weighted mean CE, logits in fp32",
        "share": "share = (heldout_start - heldout) / (heldout_start - heldout_ref): the part of the fp32-master "
        "reference's held-out improvement a variant achieved (heldout_start: the pre-trained state, "
        "in the run's weight dtype)",
        "records": [],
    }
    records = doc["records"]
    base_model = reg.model
    for i, (key, label, dtype, name, fp8) in enumerate(chosen, 1):
        prefix = f"[{i}/{len(chosen)} {label}]"
        reg.model = base_model
        reg.set_dtype(torch.float32 if dtype == "fp32" else torch.bfloat16)
        with torch.no_grad():
            for k, p in reg.model.state_dict().items():
                p.copy_(state[k])
        rec = {
            "key": key,
            "variant": label.split(" [")[0],
            "label": label,
            "dtype": dtype,
            "fp8": fp8,
            "reference": key == "ref",
            "error": None,
            "heldout_start": start_loss[dtype],
        }
        records.append(rec)
        if fp8 is not None:  # a converted copy: the next rows start from the plain model again
            from finetune.model.prepare import convert_to_fp8

            reg.model = copy.deepcopy(base_model)
            rec["fp8_layers"] = convert_to_fp8(reg.model, fp8)
        try:
            opt = harness.make_optimizer(name, list(reg.model.parameters()), lr=args.lr, weight_decay=0.0)
            losses, step_s, first = reg.train(opt, reg.ft_batches, warmup=20, cosine=False)
            rec.update(
                heldout_loss=reg.heldout_loss(),
                final_train_loss=sum(losses[-50:]) / len(losses[-50:]),
                ms_per_step=1e3 * step_s,
                first_step_s=first,
                losses=[round(x, 4) for x in losses],
            )
            nonfinite = getattr(opt, "nonfinite_count", None)
            if nonfinite is not None:
                rec["nonfinite_count"] = int(nonfinite)
            del opt
        except Exception as e:  # one failing anchor (a missing package) must not cost the other rows
            rec["error"] = f"{type(e).__name__}: {e}"
            print(f"{prefix} failed: {rec['error']}", flush=True)
            continue
        finally:
            reg.model.zero_grad(set_to_none=True)
            reg.model = base_model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        ref = records[0] if records[0]["key"] == "ref" and not records[0]["error"] else None
        if ref is not None:
            for r in records:
                if r.get("heldout_loss") is not None:
                    r["gap_vs_ref"] = (r["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"]
                    r["share_of_ref_gain"] = (r["heldout_start"] - r["heldout_loss"]) / (
                        ref["heldout_start"] - ref["heldout_loss"]
                    )
        print(
            f"{prefix} held-out {rec['heldout_loss']:.4f}"
            + (
                f", gap {100 * rec['gap_vs_ref']:+.2f} %, share {rec['share_of_ref_gain']:.2f}"
                if "gap_vs_ref" in rec
                else ""
            )
            + f"; {rec['ms_per_step']:.0f} ms/step, first step {first:.1f} s; "
            f"{time.perf_counter() - started:.0f} s so far",
            flush=True,
        )
        # Written after every row: a call that runs out of time keeps what it measured.
        harness.write_json(args.out, dict(doc, wall_s=time.perf_counter() - started))
    harness.write_json(args.out, dict(doc, wall_s=time.perf_counter() - started))
    report.plot(records, Path(args.plot), title, window=20)
    print("\n" + table(records))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
