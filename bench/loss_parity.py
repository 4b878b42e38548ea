"""Loss parity on real Alpaca: each AdamW variant against an fp32-master reference, same model, seed and data.

    python bench/loss_parity.py --steps 60 --out bench/results/loss_parity.json --plot docs/loss_parity.png

A small Llama2-architecture model (configs/tiny.yaml made smaller by PARITY_OVERRIDES, so that the bf16 runs
are affordable on a 2-core CPU) is trained by the recipe for a fixed number of steps, once per variant, each in
a fresh process (bench/_harness.py): the same seed, hence the same init and data order. The training split leaves
out the last --heldout records of alpaca_data.json (`dataset.split=train[:-N]`); after training, the final
checkpoint (epoch_0/) is evaluated here on those N records with torchtune's tokenizer, alpaca_dataset and model
builder: token-weighted mean cross-entropy over the same tokens the recipe trains on (train_on_input=True,
truncated to the training max_seq_len), in fp32.

Rows (--variants, keys; `ref` always runs): the reference `ref` (fp32 weights, fp32 AdamW states:
torch.optim.AdamW(fused=True), dtype=fp32) and, with bf16 weights and gradients (dtype=bf16), `bf16` (plain torch
fused AdamW, bf16 states), ours (every key of optimizers.VARIANTS), `bnb8` and `ao8` (bitsandbytes' and torchao's
8-bit). Extras for each of ours, asked for by key: `{key}_fp32w` (fp32 weights: what a gap owes to bf16 weights
rather than to the state format), `{key}_sr` / `{key}_rtn` / `{key}_comp` (the bf16 weight write rounded
stochastically, our default, / to nearest / compensated). On the CPU our optimizers run their plain-PyTorch path,
which the Triton kernel matches in tests/optimizers/test_optimizers.py.

Per row: `final_train_loss` (mean loss of the last --last-k steps), `heldout_loss`, and `gap_vs_ref` (fraction:
(heldout - heldout_ref) / heldout_ref); also every step's loss for the plot. The JSON (--out, default
outputs/bench/loss_parity.json; the plot beside it unless --plot) opens with the command, hardware, versions, date and
commit. Its GPU sibling, a pre-trained model of real width fine-tuned at a real learning rate, is
bench/loss_parity_width2048.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import List, Optional

import _harness as harness
import _parity_report as report

CONFIG = "configs/tiny.yaml"
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
# The extras' settings of the bf16 weight write, per variant of ours: key suffix -> optimizer setting.
EXTRAS = {"sr": "stochastic_round=True", "rtn": "stochastic_round=False", "comp": "compensate=True"}


def rows() -> tuple:
    """([(key, variant, weights dtype, optimizer overrides, setting)], the default keys): see the module docstring."""
    (fused, fused_ov), ours = harness.ANCHORS["fused"], harness.ours()
    out = [("ref", fused, "fp32", fused_ov, ""), ("bf16", fused, "bf16", fused_ov, "")]
    out += [(v.key, v.component, "bf16", v.overrides, "") for v in ours]
    out += [(k, harness.ANCHORS[k][0], "bf16", harness.ANCHORS[k][1], "") for k in ("bnb8", "ao8")]
    defaults = [r[0] for r in out]
    for v in ours:
        out.append((f"{v.key}_fp32w", v.component, "fp32", v.overrides, ""))
        out += [
            (f"{v.key}_{suffix}", v.component, "bf16", v.overrides + [f"optimizer.{s}"], s)
            for suffix, s in EXTRAS.items()
        ]
    return out, defaults


def overrides_value(overrides: List[str], key: str) -> Optional[str]:
    value = None
    for o in overrides:
        if o.startswith(key + "="):
            value = o.split("=", 1)[1]
    return value


def heldout_loss(
    ckpt_dir: Path, data_file: Path, tokenizer_path: Path, max_seq_len: int, n_heldout: int, batch_size: int = 16
) -> dict:
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
        return alpaca_dataset(
            tokenizer,
            source="json",
            data_files=str(data_file),
            split=f"train[-{n_heldout}:]",
            train_on_input=train_on_input,
            packed=False,
        )

    with torch.device("cpu"):
        model = llama2(
            vocab_size=hf["vocab_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf["num_key_value_heads"],
            embed_dim=hf["hidden_size"],
            max_seq_len=hf["max_position_embeddings"],
        )
    state = convert_weights.hf_to_tune(
        load_file(str(ckpt_dir / "model.safetensors")),
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        dim=hf["hidden_size"],
        head_dim=hf.get("head_dim"),
    )
    model.load_state_dict({k: v.float() for k, v in state.items()})
    model.eval()

    def mean_ce(ds) -> tuple:
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(ds), batch_size):
                batch = padded_collate_sft(
                    [ds[j] for j in range(i, min(i + batch_size, len(ds)))],
                    padding_idx=tokenizer.pad_id,
                    ignore_idx=-100,
                )
                labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # token t predicts t+1, as the recipe
                logits = model(batch["tokens"]).float()
                total += F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction="sum"
                ).item()
                count += int((labels != -100).sum())
        return total / max(count, 1), count

    # All tokens (what the recipe trains on, train_on_input=True), and the response tokens only: with short
    # samples much of each one is Alpaca's fixed prompt preamble, which every variant learns quickly.
    loss, count = mean_ce(records(True))
    response_loss, response_count = mean_ce(records(False))
    return {
        "heldout_loss": loss,
        "heldout_tokens": count,
        "heldout_response_loss": response_loss,
        "heldout_response_tokens": response_count,
        "heldout_records": n_heldout,
    }


def markdown_table(records: List[dict]) -> str:
    return report.table(
        [
            "AdamW [weights]",
            "final train loss",
            "held-out loss",
            "gap vs ref",
            "held-out response-only loss",
            "gap vs ref",
        ],
        records,
        lambda r: [
            f"{r['final_train_loss']:.4f}",
            f"{r['heldout_loss']:.4f}",
            f"{100 * r['gap_vs_ref']:+.2f} %",
            f"{r['heldout_response_loss']:.4f}",
            f"{100 * r['response_gap_vs_ref']:+.2f} %",
        ],
    )


def plot_title(steps: int) -> str:
    return f"Alpaca, Llama2 architecture 2 layers x 128, {steps} steps of batch 2 (CPU)"


def run_row(row: tuple, args, base: List[str], prefix: str) -> dict:
    """Train one row through the recipe, then score its final checkpoint on the held-out records."""
    key, variant, dtype, opt_overrides, setting = row
    label = f"{variant} [{dtype}{', ' + setting if setting else ''}{', reference' if key == 'ref' else ''}]"
    run_dir = Path(args.runs_dir) / key
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cmd = harness.recipe_command(
        "full_finetune_single_device",
        "--config",
        CONFIG,
        f"output_dir={run_dir}",
        "epochs=1",
        f"max_steps_per_epoch={args.steps}",
        "metric_logger=null",
        *base,
        f"dtype={dtype}",
        *opt_overrides,
    )
    print(f"{prefix} start: {' '.join(cmd)}", flush=True)
    run = harness.run(cmd, run_dir / "run.log", timeout=args.timeout)
    losses = [m["loss"] for m in harness.read_metrics(run_dir)]
    rec = {
        "variant": variant,
        "dtype": dtype,
        "reference": key == "ref",
        "label": label,
        "key": key,
        "command": run.command,
        "error": run.error(),
        "losses": losses,
        "wall_s": run.wall_s,
        "final_train_loss": None,
        "heldout_loss": None,
        "gap_vs_ref": None,
    }
    if rec["error"] is None and len(losses) < args.steps:
        rec["error"] = f"logged {len(losses)} of {args.steps} steps"
    if not rec["error"]:
        k = min(args.last_k, len(losses))
        rec["final_train_loss"] = sum(losses[-k:]) / k
        data_dir = harness.repo_path(args.data_dir)
        try:
            rec.update(
                heldout_loss(
                    run_dir / "epoch_0",
                    data_dir / "alpaca" / "alpaca_data.json",
                    data_dir / "llama2_tokenizer" / "tokenizer.model",
                    int(overrides_value(base, "tokenizer.max_seq_len")),
                    args.heldout,
                )
            )
        except Exception as e:
            rec["error"] = f"held-out eval failed: {type(e).__name__}: {e}"
    shutil.rmtree(run_dir / "epoch_0", ignore_errors=True)
    print(
        f"{prefix} "
        + (
            f"FAILED: {rec['error']}"
            if rec["error"]
            else f"final train loss {rec['final_train_loss']:.4f}, held-out loss {rec['heldout_loss']:.4f}"
        ),
        flush=True,
    )
    return rec


def parse_args(argv: Optional[List[str]] = None):
    table, defaults = rows()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated keys (ref always runs), of: {', '.join(r[0] for r in table)} "
        f"(default {','.join(defaults)})",
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per variant")
    parser.add_argument("--last-k", type=int, default=10, help="final_train_loss = mean of the last K steps")
    parser.add_argument("--heldout", type=int, default=200, help="last N Alpaca records, left out of training")
    parser.add_argument("--data-dir", default=harness.DATA_DIR)
    parser.add_argument("--runs-dir", default="/tmp/loss_parity_runs", help="the recipe runs' folders")
    parser.add_argument(
        "--out",
        default=harness.scratch("loss_parity.json"),
        help="results JSON (default outputs/bench/loss_parity.json)",
    )
    parser.add_argument("--plot", default=None, help="plot PNG (default: beside --out)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per recipe run")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="add to the records in --out (re-running only the variants given; ref is reused)",
    )
    parser.add_argument("--replot", metavar="JSON", default=None, help="run nothing: redraw --plot from a results JSON")
    # The width-2048 benchmark was `--setting width2048` of this script; it is bench/loss_parity_width2048.py now.
    parser.add_argument("--setting", choices=["tiny", "width2048"], default="tiny", help=argparse.SUPPRESS)
    harness.add_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    if args.setting == "width2048":
        harness.refuse(
            "the width-2048 benchmark is its own script: python bench/loss_parity_width2048.py "
            "(the same flags, without --setting)"
        )
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    args.keys = harness.pick(parser, args.variants, [r[0] for r in table], "variants", defaults)
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        report.plot(result["records"], Path(args.plot), plot_title(result["steps"]))
        print(markdown_table(result["records"]))
        return 0
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    old = harness.earlier(args.out, args.merge)
    # Kept from --out: the rows not run now, the reference included (same seed and data: a deterministic CPU run).
    kept = [r for r in old.get("records", []) if r["key"] not in args.keys]
    have_ref = any(r["key"] == "ref" for r in kept)
    table, _ = rows()
    chosen = [r for r in table if (r[0] == "ref" and not have_ref) or (r[0] != "ref" and r[0] in args.keys)]
    base = PARITY_OVERRIDES + [f"data_dir={args.data_dir}", f"dataset.split=train[:-{args.heldout}]"] + args.overrides
    records = []
    for i, row in enumerate(chosen, 1):
        records.append(dict(run_row(row, args, base, f"[{i}/{len(chosen)} {row[0]}]"), code=prov["code"]))

    order = [r[0] for r in table]
    records = sorted(kept + records, key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))
    ref = next((r for r in records if r["key"] == "ref"), None)
    for r in records:
        if ref and r["heldout_loss"] is not None and ref["heldout_loss"] is not None:
            r["gap_vs_ref"] = (r["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"]
            r["train_gap_vs_ref"] = (r["final_train_loss"] - ref["final_train_loss"]) / ref["final_train_loss"]
            r["response_gap_vs_ref"] = (r["heldout_response_loss"] - ref["heldout_response_loss"]) / ref[
                "heldout_response_loss"
            ]
    harness.write_json(
        args.out,
        {
            **prov,
            "commands": harness.commands(old, prov["command"]),
            "config": CONFIG,
            "overrides": base + [f"max_steps_per_epoch={args.steps}", "epochs=1", "metric_logger=null"],
            "steps": args.steps,
            "last_k": args.last_k,
            "heldout": f"the last {args.heldout} records of alpaca_data.json (not in the training split), "
            f"train_on_input=True, max_seq_len {overrides_value(base, 'tokenizer.max_seq_len')}, "
            "token-weighted mean CE in fp32",
            "note": "Our optimizers take their plain-PyTorch path on a CPU (backend='auto' on CPU tensors), which "
            "the Triton kernel matches in tests/optimizers/test_optimizers.py. Reference: fp32 weights and fp32 "
            "AdamW states; every other variant trains bf16 weights, gradients and activations (dtype=bf16).",
            "records": records,
        },
    )
    report.plot(records, Path(args.plot), plot_title(args.steps))
    print("\n" + markdown_table(records))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
