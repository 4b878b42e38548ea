"""Loss parity on real Alpaca: each AdamW variant against an fp32-master reference, same model, seed and data.

    python bench/loss_parity.py --out bench/results/loss_parity.json --plot docs/loss_parity.png

A small Llama2-architecture model (configs/tiny.yaml made smaller by PARITY_OVERRIDES, so that the bf16 runs
are affordable on a 2-core CPU) is trained by the recipe for a fixed number of steps, once per variant, each in
a fresh process through bench/compare.py's runner: the same seed, hence the same init and data order. The
training split leaves out the last --heldout records of alpaca_data.json (`dataset.split=train[:-N]`); after
training, the final checkpoint (epoch_0/) is evaluated here on those N records with torchtune's tokenizer,
alpaca_dataset and model builder: token-weighted mean cross-entropy over the same tokens the recipe trains on
(train_on_input=True, truncated to the training max_seq_len), in fp32.

Variants: the reference (fp32 weights, fp32 AdamW states: torch.optim.AdamW(fused=True), dtype=fp32) and, with
bf16 weights and gradients (dtype=bf16), plain torch.optim.AdamW (bf16 states), optimizers.AdamW8bit / AdamW4bit /
AdamWFp8 / AdamW, bitsandbytes.optim.AdamW8bit and torchao.optim.AdamW8bit. On the CPU our optimizers run their
plain-PyTorch path, which the Triton kernel matches in tests/test_optimizers.py.

Per variant: `final_train_loss` (mean loss of the last --last-k steps), `heldout_loss`, and `gap_vs_ref`
(fraction: (heldout - heldout_ref) / heldout_ref); also every step's loss for the plot.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare  # noqa: E402  (bench/compare.py: the per-variant runner)

REPO_ROOT = compare.REPO_ROOT

# configs/tiny.yaml, smaller: bf16 matmuls on this CPU (no bf16 units) are ~25x slower than fp32, so the model
# is 2 layers of width 128 (the real 32000-token vocabulary, which dominates the cost) on 64-token samples. Width
# 128 = one 4-bit quantization block per embedding row, as at any real width (a 64-wide model puts two rows with
# very different gradient scales in one block: a toy artefact, see docs/benchmarks.md).
PARITY_OVERRIDES = [
    "model.num_layers=2",
    "model.embed_dim=128",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "tokenizer.max_seq_len=64",
    "batch_size=2",
    "optimizer.lr=3e-3",
    "optimizer.weight_decay=0.01",
    "lr_scheduler.num_warmup_steps=10",
    "clip_grad_norm=1.0",
    "seed=42",
    "shuffle=True",
]

# (key, variant = _component_ path, dtype, optimizer overrides)
PARITY_VARIANTS = [
    ("ref", "torch.optim.AdamW(fused=True)", "fp32", compare.VARIANTS["fused"][1]),
    ("bf16", "torch.optim.AdamW(fused=True)", "bf16", compare.VARIANTS["fused"][1]),
    ("ours8", "optimizers.AdamW8bit", "bf16", compare.VARIANTS["ours8"][1]),
    ("ours4", "optimizers.AdamW4bit", "bf16", compare.VARIANTS["ours4"][1]),
    ("oursfp8", "optimizers.AdamWFp8", "bf16", compare.VARIANTS["oursfp8"][1]),
    ("ours16", "optimizers.AdamW", "bf16", compare.VARIANTS["ours16"][1]),
    ("bnb8", "bitsandbytes.optim.AdamW8bit", "bf16", compare.VARIANTS["bnb8"][1]),
    ("ao8", "torchao.optim.AdamW8bit", "bf16", compare.VARIANTS["ao8"][1]),
    # Extras (not in the default list): what the gap owes to bf16 weights rather than to the state format.
    ("ours8_fp32w", "optimizers.AdamW8bit", "fp32", compare.VARIANTS["ours8"][1]),
    ("ours4_fp32w", "optimizers.AdamW4bit", "fp32", compare.VARIANTS["ours4"][1]),
    ("ours8_sr", "optimizers.AdamW8bit", "bf16", compare.VARIANTS["ours8"][1] + ["optimizer.stochastic_round=True"]),
    ("ours4_sr", "optimizers.AdamW4bit", "bf16", compare.VARIANTS["ours4"][1] + ["optimizer.stochastic_round=True"]),
    # Since 2026-12-01 our defaults round bf16 weights stochastically (ours8 = ours8_sr); these are the nearest-rounded
    # runs the earlier records' plain "ours8" / "ours4" rows were.
    ("ours8_rtn", "optimizers.AdamW8bit", "bf16", compare.VARIANTS["ours8"][1] + ["optimizer.stochastic_round=False"]),
    ("ours4_rtn", "optimizers.AdamW4bit", "bf16", compare.VARIANTS["ours4"][1] + ["optimizer.stochastic_round=False"]),
    ("ours4_comp", "optimizers.AdamW4bit(compensate=True)", "bf16",
     compare.VARIANTS["ours4"][1] + ["optimizer.compensate=True"]),
    # the 4-bit second moment on the dynamic map (the default before 4bit.v3) and on the paper's linear map
    ("ours4_dynv", "optimizers.AdamW4bit(second_moment=dynamic)", "bf16",
     compare.VARIANTS["ours4"][1] + ["optimizer.second_moment=dynamic"]),
    ("ours4_linv", "optimizers.AdamW4bit(second_moment=linear)", "bf16",
     compare.VARIANTS["ours4"][1] + ["optimizer.second_moment=linear"]),
    ("ours4_linv_fp32w", "optimizers.AdamW4bit(second_moment=linear)", "fp32",
     compare.VARIANTS["ours4"][1] + ["optimizer.second_moment=linear"]),
]
DEFAULT_KEYS = ["ref", "bf16", "ours8", "ours4", "oursfp8", "ours16", "bnb8", "ao8"]


def overrides_value(overrides: List[str], key: str) -> Optional[str]:
    value = None
    for o in overrides:
        if o.startswith(key + "="):
            value = o.split("=", 1)[1]
    return value


def heldout_loss(ckpt_dir: Path, data_file: Path, tokenizer_path: Path, max_seq_len: int, n_heldout: int,
                 batch_size: int = 16) -> dict:
    """Token-weighted mean CE of a recipe checkpoint on the last n_heldout Alpaca records, in fp32."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from torchtune.data import padded_collate_sft
    from torchtune.datasets import alpaca_dataset
    from torchtune.models import convert_weights
    from torchtune.models.llama2 import llama2, llama2_tokenizer

    hf = json.loads((ckpt_dir / "config.json").read_text())
    tokenizer = llama2_tokenizer(str(tokenizer_path), max_seq_len=max_seq_len, prompt_template=None)
    def records(train_on_input: bool):
        return alpaca_dataset(tokenizer, source="json", data_files=str(data_file), split=f"train[-{n_heldout}:]",
                              train_on_input=train_on_input, packed=False)

    with torch.device("cpu"):
        model = llama2(vocab_size=hf["vocab_size"], num_layers=hf["num_hidden_layers"],
                       num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                       embed_dim=hf["hidden_size"], max_seq_len=hf["max_position_embeddings"])
    state = convert_weights.hf_to_tune(load_file(str(ckpt_dir / "model.safetensors")),
                                       num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                                       dim=hf["hidden_size"], head_dim=hf.get("head_dim"))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()

    def mean_ce(ds) -> tuple:
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(ds), batch_size):
                batch = padded_collate_sft([ds[j] for j in range(i, min(i + batch_size, len(ds)))],
                                           padding_idx=tokenizer.pad_id, ignore_idx=-100)
                labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # token t predicts t+1, as the recipe
                logits = model(batch["tokens"]).float()
                total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                         ignore_index=-100, reduction="sum").item()
                count += int((labels != -100).sum())
        return total / max(count, 1), count

    # All tokens (what the recipe trains on, train_on_input=True), and the response tokens only: with short
    # samples much of each one is Alpaca's fixed prompt preamble, which every variant learns quickly.
    loss, count = mean_ce(records(True))
    response_loss, response_count = mean_ce(records(False))
    return {"heldout_loss": loss, "heldout_tokens": count, "heldout_response_loss": response_loss,
            "heldout_response_tokens": response_count, "heldout_records": n_heldout}


def moving_average(values: List[float], window: int) -> List[float]:
    """Trailing mean over up to `window` steps (the per-step loss of a batch of 2 is noisy)."""
    return [sum(values[max(0, i + 1 - window):i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(values))]


def plot(records: List[dict], path: Path, title: str, window: int = 1) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    for r in records:
        if r.get("error") or not r.get("losses"):
            continue
        style = dict(color="black", linewidth=2.2) if r["reference"] else dict(linewidth=1.1)
        ax.plot(range(1, len(r["losses"]) + 1), moving_average(r["losses"], window), label=r["label"], **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss per step" + (f" ({window}-step moving average)" if window > 1 else ""))
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ok = [r for r in records if r.get("heldout_loss") is not None]
    ax2.barh([r["label"] for r in ok][::-1], [100 * r["gap_vs_ref"] for r in ok][::-1],
             color=["black" if r["reference"] else "tab:blue" for r in ok][::-1])
    for i, r in enumerate(ok[::-1]):
        ax2.annotate(f"{100 * r['gap_vs_ref']:+.1f} %", (max(100 * r["gap_vs_ref"], 0), i), fontsize=7,
                     xytext=(3, -3), textcoords="offset points")
    for x in (-1, 1):
        ax2.axvline(x, color="red", linestyle=":", linewidth=1)
    ax2.set_xlabel("held-out loss gap vs fp32 reference, % (red: +-1 %)")
    ax2.tick_params(axis="y", labelsize=7)
    ax2.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown_table(records: List[dict]) -> str:
    lines = ["| AdamW [weights] | final train loss | held-out loss | gap vs ref | held-out response-only loss | gap vs ref |",
             "|---|---|---|---|---|---|"]
    for r in records:
        if r["error"]:
            lines.append(f"| {r['label']} | - | - | - | - | {r['error']} |")
        else:
            lines.append(f"| {r['label']} | {r['final_train_loss']:.4f} | {r['heldout_loss']:.4f} | "
                         f"{100 * r['gap_vs_ref']:+.2f} % | {r['heldout_response_loss']:.4f} | "
                         f"{100 * r['response_gap_vs_ref']:+.2f} % |")
    return "\n".join(lines) + "\n"


def plot_title(steps: int) -> str:
    return f"Alpaca, Llama2 architecture 2 layers x 128, {steps} steps of batch 2 (CPU)"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(DEFAULT_KEYS),
                        help="comma-separated keys: " + ", ".join(v[0] for v in PARITY_VARIANTS) + " (ref always runs)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--last-k", type=int, default=10, help="final_train_loss = mean of the last K steps")
    parser.add_argument("--heldout", type=int, default=200, help="last N Alpaca records, left out of training")
    parser.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "data"))
    parser.add_argument("--runs-dir", default="/tmp/loss_parity_runs")
    parser.add_argument("--out", default="bench/results/loss_parity.json")
    parser.add_argument("--plot", default="docs/loss_parity.png")
    parser.add_argument("--timeout", type=float, default=1200)
    parser.add_argument("--merge", action="store_true",
                        help="add to the records in --out (re-running only the variants given; ref is reused)")
    parser.add_argument("--replot", metavar="JSON", default=None, help="run nothing: redraw --plot from a results JSON")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run (after PARITY_OVERRIDES)")
    args = parser.parse_args(argv)

    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        plot(result["records"], Path(args.plot), plot_title(result["steps"]))
        print(markdown_table(result["records"]))
        print(f"wrote {args.plot}")
        return 0
    keys = [k.strip() for k in args.variants.split(",") if k.strip()]
    unknown = set(keys) - {v[0] for v in PARITY_VARIANTS}
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(sorted(unknown))}")
    old = []
    if args.merge and Path(args.out).exists():
        # Keep the earlier records (the reference included: same seed, same data, a deterministic CPU run).
        old = [r for r in json.loads(Path(args.out).read_text())["records"] if r["key"] not in keys]
    have_ref = any(r["key"] == "ref" for r in old)
    chosen = [v for v in PARITY_VARIANTS if (v[0] == "ref" and not have_ref) or (v[0] != "ref" and v[0] in keys)]
    data_dir = Path(args.data_dir).resolve()
    data_file = data_dir / "alpaca" / "alpaca_data.json"
    tokenizer_path = data_dir / "llama2_tokenizer" / "tokenizer.model"
    base = PARITY_OVERRIDES + [f"data_dir={data_dir}", f"dataset.split=train[:-{args.heldout}]"] + args.overrides
    max_seq_len = int(overrides_value(base, "tokenizer.max_seq_len"))
    runner_args = SimpleNamespace(config="configs/tiny.yaml", steps=args.steps, skip_steps=2, wandb=False,
                                  quiet=True, timeout=args.timeout, keep_checkpoints=True, log_every_one=True)
    runs_dir = Path(args.runs_dir)
    records = []
    for i, (key, variant, dtype, opt_overrides) in enumerate(chosen, 1):
        extra = "".join(f", {o.split('.')[-1]}" for o in opt_overrides if o.startswith("optimizer.stochastic"))
        label = f"{variant} [{dtype}{extra}{', reference' if key == 'ref' else ''}]"
        prefix = f"[{i}/{len(chosen)} {label}]"
        run_dir = runs_dir / key
        rec = compare.run_variant(variant, [f"dtype={dtype}"] + opt_overrides, runner_args, base, run_dir, prefix)
        out = {"variant": variant, "dtype": dtype, "reference": key == "ref", "label": label, "key": key,
               "error": rec["error"], "losses": rec["losses"], "wall_s": rec.get("wall_s"),
               "final_train_loss": None, "heldout_loss": None, "gap_vs_ref": None}
        if not rec["error"]:
            k = min(args.last_k, len(rec["losses"]))
            out["final_train_loss"] = sum(rec["losses"][-k:]) / k
            try:
                out.update(heldout_loss(run_dir / "epoch_0", data_file, tokenizer_path, max_seq_len, args.heldout))
            except Exception as e:
                out["error"] = f"held-out eval failed: {type(e).__name__}: {e}"
            print(f"{prefix} final train loss {out['final_train_loss']:.4f}, held-out loss "
                  f"{out['heldout_loss'] if out['heldout_loss'] is None else round(out['heldout_loss'], 4)}",
                  flush=True)
        shutil.rmtree(run_dir / "epoch_0", ignore_errors=True)
        records.append(out)

    command = shlex.join(["python", "bench/loss_parity.py"] + (argv if argv is not None else sys.argv[1:]))
    previous = json.loads(Path(args.out).read_text()) if old else {}
    commands = previous.get("commands", [previous["command"]] if previous else []) + [command]
    order = [v[0] for v in PARITY_VARIANTS]
    records = sorted(old + records, key=lambda r: order.index(r["key"]))
    ref = records[0]
    for r in records:
        if r["heldout_loss"] is not None and ref["heldout_loss"] is not None:
            r["gap_vs_ref"] = (r["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"]
            r["train_gap_vs_ref"] = (r["final_train_loss"] - ref["final_train_loss"]) / ref["final_train_loss"]
            r["response_gap_vs_ref"] = ((r["heldout_response_loss"] - ref["heldout_response_loss"])
                                        / ref["heldout_response_loss"])
    result = {
        "command": " && ".join(commands),
        "commands": commands,
        "hardware": compare.hardware(),
        "versions": compare.versions(),
        "code": compare.code_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "config": "configs/tiny.yaml",
        "overrides": base + [f"max_steps_per_epoch={args.steps}", "epochs=1", "metric_logger=null"],
        "steps": args.steps,
        "last_k": args.last_k,
        "heldout": f"the last {args.heldout} records of alpaca_data.json (not in the training split), "
                   f"train_on_input=True, max_seq_len {max_seq_len}, token-weighted mean CE in fp32",
        "note": "CPU run: our optimizers take their plain-PyTorch path here (backend='auto' on CPU tensors), which "
                "the Triton kernel matches in tests/test_optimizers.py. Reference: fp32 weights and fp32 AdamW "
                "states; every other variant trains bf16 weights, gradients and activations (dtype=bf16).",
        "records": records,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(records, Path(args.plot), plot_title(args.steps))
    print("\n" + markdown_table(records))
    print(f"wrote {args.out}, {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
