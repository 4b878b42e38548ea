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
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional

import torch.nn.functional as F

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

# The recipe override that selects each optimizer.
_OV = {
    "fused": ["optimizer=torch.optim.AdamW", "optimizer.fused=True"],
    "ours8": ["optimizer=optimizers.AdamW8bit"],
    "ours4": ["optimizer=optimizers.AdamW4bit"],
    "oursfp8": ["optimizer=optimizers.AdamWFp8"],
    "ours16": ["optimizer=optimizers.AdamW"],
    "bnb8": ["optimizer=bitsandbytes.optim.AdamW8bit"],
    "ao8": ["optimizer=torchao.optim.AdamW8bit"],
}

# (key, variant = _component_ path, dtype, optimizer overrides)
PARITY_VARIANTS = [
    ("ref", "torch.optim.AdamW(fused=True)", "fp32", _OV["fused"]),
    ("bf16", "torch.optim.AdamW(fused=True)", "bf16", _OV["fused"]),
    ("ours8", "optimizers.AdamW8bit", "bf16", _OV["ours8"]),
    ("ours4", "optimizers.AdamW4bit", "bf16", _OV["ours4"]),
    ("oursfp8", "optimizers.AdamWFp8", "bf16", _OV["oursfp8"]),
    ("ours16", "optimizers.AdamW", "bf16", _OV["ours16"]),
    ("bnb8", "bitsandbytes.optim.AdamW8bit", "bf16", _OV["bnb8"]),
    ("ao8", "torchao.optim.AdamW8bit", "bf16", _OV["ao8"]),
    # Extras (not in the default list): what the gap owes to bf16 weights rather than to the state format.
    ("ours8_fp32w", "optimizers.AdamW8bit", "fp32", _OV["ours8"]),
    ("ours4_fp32w", "optimizers.AdamW4bit", "fp32", _OV["ours4"]),
    ("ours8_sr", "optimizers.AdamW8bit", "bf16", _OV["ours8"] + ["optimizer.stochastic_round=True"]),
    ("ours4_sr", "optimizers.AdamW4bit", "bf16", _OV["ours4"] + ["optimizer.stochastic_round=True"]),
    # Since 2026-12-01 our defaults round bf16 weights stochastically (ours8 = ours8_sr); these are the nearest-rounded
    # runs the earlier records' plain "ours8" / "ours4" rows were.
    ("ours8_rtn", "optimizers.AdamW8bit", "bf16", _OV["ours8"] + ["optimizer.stochastic_round=False"]),
    ("ours4_rtn", "optimizers.AdamW4bit", "bf16", _OV["ours4"] + ["optimizer.stochastic_round=False"]),
    ("ours4_comp", "optimizers.AdamW4bit(compensate=True)", "bf16",
     _OV["ours4"] + ["optimizer.compensate=True"]),
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

    import textwrap

    many = len(records) > 8
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(14, 7.5 if many else 5), gridspec_kw={"width_ratios": [3, 2]})
    for r in records:
        if r.get("error") or not r.get("losses"):
            continue
        style = dict(color="black", linewidth=2.2) if r["reference"] else dict(linewidth=1.1)
        ax.plot(range(1, len(r["losses"]) + 1), moving_average(r["losses"], window), label=r["label"], **style)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss per step" + (f" ({window}-step moving average)" if window > 1 else ""))
    ax.set_title("\n".join(textwrap.wrap(title, 80)), fontsize=9)
    ax.grid(alpha=0.3)
    if many:  # below the axes: over the curves it would hide them
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
    else:
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
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _markdown(headers: List[str], records: List[dict], cells) -> str:
    """A Markdown table: one row per record, cells(r) after its label; a failed record shows its error."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in records:
        row = [r["label"]] + (["-"] * (len(headers) - 2) + [r["error"]] if r["error"] else cells(r))
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def markdown_table(records: List[dict]) -> str:
    return _markdown(["AdamW [weights]", "final train loss", "held-out loss", "gap vs ref",
                      "held-out response-only loss", "gap vs ref"], records,
                     lambda r: [f"{r['final_train_loss']:.4f}", f"{r['heldout_loss']:.4f}",
                                f"{100 * r['gap_vs_ref']:+.2f} %", f"{r['heldout_response_loss']:.4f}",
                                f"{100 * r['response_gap_vs_ref']:+.2f} %"])


def plot_title(steps: int) -> str:
    return f"Alpaca, Llama2 architecture 2 layers x 128, {steps} steps of batch 2 (CPU)"


# ---------------------------------------------------------------------------------------------------------------
# --setting width2048: the regime the mission runs in, on a GPU, in one process.
#
# A full fine-tune starts from a trained model and moves it by lr 2e-5 per step; with bf16 weights most of those
# updates are smaller than half a bf16 ulp of the weight and round away. A random-init CPU toy cannot show that, so
# this setting first pre-trains a Llama2-architecture model of real width (2048) in fp32-master mixed precision to
# a shared state, then fine-tunes that state once per variant on identical batches and scores held-out Alpaca
# records that no run trained on. Every run shares the model's tensors (weights are copied back in place), the
# batches (built once, on the device) and the held-out set, so the only difference between rows is the optimizer
# and the weights' dtype.

REGIME = dict(vocab_size=32000, num_layers=8, num_heads=16, num_kv_heads=16, embed_dim=2048, max_seq_len=512)


def _regime_opt(kind: str, **extra):
    """A builder (params, lr) -> optimizer for one row of the width-2048 table."""
    def build(params, lr):
        import torch

        if kind == "torch":
            return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, fused=True)
        if kind == "bnb":
            import bitsandbytes

            return bitsandbytes.optim.AdamW8bit(params, lr=lr, weight_decay=0.0)
        if kind.startswith("torchao."):
            import torchao.optim

            return getattr(torchao.optim, kind.split(".", 1)[1])(params, lr=lr, weight_decay=0.0, **extra)
        import optimizers

        return getattr(optimizers, kind)(params, lr=lr, weight_decay=0.0, **extra)
    return build


# (key, label, weights dtype, builder). Labels name the settings; our rows with their defaults say "defaults".
REGIME_VARIANTS = [
    ("ref", "torch.optim.AdamW(fused=True) [fp32 master weights, reference]", "fp32", _regime_opt("torch")),
    ("fused", "torch.optim.AdamW(fused=True) [bf16 weights]", "bf16", _regime_opt("torch")),
    ("ours16", "optimizers.AdamW [defaults]", "bf16", _regime_opt("AdamW")),
    ("ours8", "optimizers.AdamW8bit [defaults]", "bf16", _regime_opt("AdamW8bit")),
    ("ours4", "optimizers.AdamW4bit [defaults]", "bf16", _regime_opt("AdamW4bit")),
    ("oursfp8", "optimizers.AdamWFp8 [defaults]", "bf16", _regime_opt("AdamWFp8")),
    ("ours16_rtn", "optimizers.AdamW [stochastic_round=False]", "bf16", _regime_opt("AdamW", stochastic_round=False)),
    ("ours8_rtn", "optimizers.AdamW8bit [stochastic_round=False]", "bf16",
     _regime_opt("AdamW8bit", stochastic_round=False)),
    ("ours4_rtn", "optimizers.AdamW4bit [stochastic_round=False]", "bf16",
     _regime_opt("AdamW4bit", stochastic_round=False)),
    ("oursfp8_rtn", "optimizers.AdamWFp8 [stochastic_round=False]", "bf16",
     _regime_opt("AdamWFp8", stochastic_round=False)),
    ("ao8", "torchao.optim.AdamW8bit [defaults: bf16_stochastic_round=False]", "bf16",
     _regime_opt("torchao.AdamW8bit")),
    ("ao8_sr", "torchao.optim.AdamW8bit [bf16_stochastic_round=True]", "bf16",
     _regime_opt("torchao.AdamW8bit", bf16_stochastic_round=True)),
    ("ao4", "torchao.optim.AdamW4bit [defaults: bf16_stochastic_round=False]", "bf16",
     _regime_opt("torchao.AdamW4bit")),
    ("ao4_sr", "torchao.optim.AdamW4bit [bf16_stochastic_round=True]", "bf16",
     _regime_opt("torchao.AdamW4bit", bf16_stochastic_round=True)),
    ("bnb8", "bitsandbytes.optim.AdamW8bit [defaults]", "bf16", _regime_opt("bnb")),
    ("ours8_comp", "optimizers.AdamW8bit [compensate=True]", "bf16", _regime_opt("AdamW8bit", compensate=True)),
]


def _warmup(step: int, warmup: int, total: int, cosine: bool) -> float:
    import math

    if step < warmup:
        return (step + 1) / warmup
    if not cosine:
        return 1.0
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


class Regime:
    """The shared state of the width-2048 runs: data on the device, the pre-trained weights, the model."""

    def __init__(self, args, device):
        import torch
        from torchtune.data import padded_collate_packed, padded_collate_sft
        from torchtune.datasets import alpaca_dataset
        from torchtune.models.llama2 import llama2, llama2_tokenizer

        from recipes._packing import PackedSFTDataset, TokenizedSamples

        self.args, self.device = args, device
        shape = dict(REGIME, embed_dim=args.width, num_layers=args.layers, num_heads=args.width // 128,
                     num_kv_heads=args.width // 128, max_seq_len=args.seq_len)
        self.shape = shape
        data_dir = Path(args.data_dir).resolve()
        data_file = str(data_dir / "alpaca" / "alpaca_data.json")
        tok = llama2_tokenizer(str(data_dir / "llama2_tokenizer" / "tokenizer.model"), max_seq_len=args.seq_len,
                               prompt_template=None)
        def split(spec):
            return alpaca_dataset(tok, source="json", data_files=data_file, split=spec, train_on_input=True,
                                  packed=False)
        t = time.perf_counter()
        train = TokenizedSamples.from_dataset(split(f"train[:-{args.heldout}]"), desc="Tokenizing the training split")
        packed = PackedSFTDataset(train, args.seq_len, tok.pad_id)
        heldout = split(f"train[-{args.heldout}:]")
        self.tokenize_s = time.perf_counter() - t
        self.rows, self.fill = len(packed), packed.fill()

        def batches(n_steps, batch, seed):
            g = torch.Generator().manual_seed(seed)
            order = torch.cat([torch.randperm(len(packed), generator=g)
                               for _ in range(-(-n_steps * batch // len(packed)))])
            out = []
            for s in range(n_steps):
                b = padded_collate_packed([packed[int(i)] for i in order[s * batch:(s + 1) * batch]])
                out.append({k: v.to(device) if hasattr(v, "to") else v for k, v in b.items()})
            return out

        # Two different orders of the same rows: the fine-tune sees the pre-training data again, shuffled anew,
        # like a second epoch; every variant gets exactly these batches.
        self.pre_batches = batches(args.pretrain_steps, args.pretrain_batch, seed=1)
        self.ft_batches = batches(args.steps, args.batch, seed=2)
        items = sorted((heldout[i] for i in range(len(heldout))), key=lambda x: len(x["tokens"]))
        self.heldout = [
            {k: v.to(device) for k, v in padded_collate_sft(items[i:i + 64], padding_idx=tok.pad_id,
                                                            ignore_idx=-100).items()}
            for i in range(0, len(items), 64)
        ]
        self.heldout_tokens = sum(int((F.pad(b["labels"][:, 1:], (0, 1), value=-100) != -100).sum())
                                  for b in self.heldout)
        torch.manual_seed(args.seed)
        with torch.device(device):
            self.model = llama2(**shape)
        self.n_params = sum(p.numel() for p in self.model.parameters())
        self.dtype = torch.float32
        self.fp32_buffers = {name: buf.detach().clone() for name, buf in self.model.named_buffers()}

    def set_dtype(self, dtype):
        """Cast the model; back in fp32 the buffers (the RoPE table) are restored, not up-cast from bf16."""
        import torch

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
        import torch

        labels = F.pad(batch["labels"][:, 1:], (0, 1), value=-100)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.float32):
            logits = self.model(batch["tokens"], mask=batch.get("mask"), input_pos=batch.get("input_pos"))
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                               reduction=reduction)

    def heldout_loss(self) -> float:
        import torch

        self.model.eval()
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        with torch.no_grad():
            for b in self.heldout:
                total += self.loss(b, reduction="sum").double()
        self.model.train()
        return float(total) / self.heldout_tokens

    def train(self, opt, batches, warmup, cosine, clip=None):
        """Step `opt` over `batches`; returns the per-step losses and the mean wall time per step."""
        import torch

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _warmup(s, warmup, len(batches), cosine))
        losses = torch.zeros(len(batches), device=self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t = time.perf_counter()
        first = None
        for i, b in enumerate(batches):
            loss = self.loss(b)
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


def run_regime(args, argv) -> int:
    import torch

    device = torch.device(args.device)
    chosen = [v for v in REGIME_VARIANTS if v[0] == "ref" or v[0] in args.keys]
    started = time.perf_counter()
    print(f"[width{args.width}] tokenizing, packing, building {args.steps + args.pretrain_steps} batches", flush=True)
    reg = Regime(args, device)
    print(f"[width{args.width}] {reg.n_params / 1e9:.3f} B parameters; {reg.rows} packed rows "
          f"({100 * reg.fill:.1f} % full); {len(reg.heldout)} held-out batches, {reg.heldout_tokens} tokens", flush=True)

    # The shared starting point: fp32 master weights, bf16 autocast, fused AdamW.
    init_loss = reg.heldout_loss()
    opt = torch.optim.AdamW(reg.model.parameters(), lr=args.pretrain_lr, weight_decay=0.0, fused=device.type == "cuda")
    pre_losses, pre_step_s, _ = reg.train(opt, reg.pre_batches, warmup=30, cosine=True, clip=1.0)
    del opt
    state = {k: v.detach().clone() for k, v in reg.model.state_dict().items()}
    start_loss = {"fp32": reg.heldout_loss()}
    reg.set_dtype(torch.bfloat16)
    start_loss["bf16"] = reg.heldout_loss()
    print(f"[width{args.width}] pre-trained {args.pretrain_steps} steps ({pre_step_s * 1e3:.0f} ms/step): held-out "
          f"{init_loss:.4f} -> {start_loss['fp32']:.4f} (fp32), {start_loss['bf16']:.4f} (bf16 copy)", flush=True)

    out_path = Path(args.out)
    title = (f"Alpaca, Llama2 architecture {args.layers} x {args.width} ({reg.n_params / 1e9:.2f} B), fine-tuned at "
             f"lr {args.lr:g} from a pre-trained state: {args.steps} steps of {args.batch} x {args.seq_len} tokens")
    base = {
        "setting": "width2048",
        "title": title,
        "command": shlex.join(["python", "bench/loss_parity.py"] + list(argv)),
        "hardware": compare.hardware(),
        "versions": compare.versions(),
        "code": compare.code_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "model": dict(reg.shape, architecture="torchtune llama2 builder (Llama2: RMSNorm, RoPE, SwiGLU)",
                      intermediate_dim=reg.model.layers[0].mlp.w1.weight.shape[0]),
        "width": args.width,
        "parameters": reg.n_params,
        "steps": args.steps,
        "batch": f"{args.batch} packed rows x {args.seq_len} tokens per step",
        "fine_tune": {"lr": args.lr, "warmup_steps": 20, "schedule": "linear warm-up, then constant",
                      "weight_decay": 0.0, "betas": [0.9, 0.999], "eps": 1e-8, "clip_grad_norm": None},
        "pretrain": {"steps": args.pretrain_steps, "batch": args.pretrain_batch, "lr": args.pretrain_lr,
                     "schedule": "30 warm-up steps, cosine to 0", "clip_grad_norm": 1.0,
                     "optimizer": "torch.optim.AdamW(fused=True), fp32 weights and states, bf16 autocast",
                     "heldout_before": init_loss, "heldout_after_fp32": start_loss["fp32"],
                     "heldout_after_bf16": start_loss["bf16"], "ms_per_step": 1e3 * pre_step_s,
                     "losses": pre_losses[::10]},
        "data": f"alpaca_data.json: the first {52002 - args.heldout} records tokenized (train_on_input=True, "
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
    records = []
    for i, (key, label, dtype, build) in enumerate(chosen, 1):
        prefix = f"[{i}/{len(chosen)} {label}]"
        dt = torch.float32 if dtype == "fp32" else torch.bfloat16
        reg.set_dtype(dt)
        with torch.no_grad():
            for k, p in reg.model.state_dict().items():
                p.copy_(state[k])
        rec = {"key": key, "variant": label.split(" [")[0], "label": label, "dtype": dtype,
               "reference": key == "ref", "error": None, "heldout_start": start_loss[dtype]}
        try:
            opt = build(list(reg.model.parameters()), args.lr)
            losses, step_s, first = reg.train(opt, reg.ft_batches, warmup=20, cosine=False)
            rec.update(heldout_loss=reg.heldout_loss(), final_train_loss=sum(losses[-50:]) / len(losses[-50:]),
                       ms_per_step=1e3 * step_s, first_step_s=first, losses=[round(x, 4) for x in losses])
            nonfinite = getattr(opt, "nonfinite_count", None)
            if nonfinite is not None:
                rec["nonfinite_count"] = int(nonfinite)
            del opt
        except Exception as e:  # one failing anchor (a missing package) must not cost the other rows
            rec["error"] = f"{type(e).__name__}: {e}"
            records.append(rec)
            print(f"{prefix} failed: {rec['error']}", flush=True)
            continue
        finally:
            reg.model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        records.append(rec)
        ref = records[0] if records[0]["key"] == "ref" and not records[0]["error"] else None
        if ref is not None:
            for r in records:
                if r.get("heldout_loss") is not None:
                    r["gap_vs_ref"] = (r["heldout_loss"] - ref["heldout_loss"]) / ref["heldout_loss"]
                    gain_ref = ref["heldout_start"] - ref["heldout_loss"]
                    r["share_of_ref_gain"] = (r["heldout_start"] - r["heldout_loss"]) / gain_ref
        print(f"{prefix} held-out {rec['heldout_loss']:.4f}"
              + (f", gap {100 * rec['gap_vs_ref']:+.2f} %, share {rec['share_of_ref_gain']:.2f}"
                 if "gap_vs_ref" in rec else "")
              + f"; {rec['ms_per_step']:.0f} ms/step, first step {first:.1f} s; "
              f"{time.perf_counter() - started:.0f} s so far", flush=True)
        # Written after every row: a call that runs out of time keeps what it measured.
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(dict(base, records=records, wall_s=time.perf_counter() - started),
                                       indent=1) + "\n")
    if args.plot:
        plot(records, Path(args.plot), title, window=20)
    print("\n" + regime_table(records))
    print(f"wrote {out_path}" + (f", {args.plot}" if args.plot else ""))
    return 0


def regime_table(records: List[dict]) -> str:
    return _markdown(["AdamW [settings]", "weights", "held-out loss", "gap vs fp32 master", "share of its gain",
                      "ms/step"], records,
                     lambda r: [r["dtype"], f"{r['heldout_loss']:.4f}",
                                f"{100 * r['gap_vs_ref']:+.2f} %" if "gap_vs_ref" in r else "-",
                                f"{r['share_of_ref_gain']:.2f}" if "share_of_ref_gain" in r else "-",
                                f"{r['ms_per_step']:.0f}"])


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", choices=["tiny", "width2048"], default="tiny",
                        help="tiny: the recipe on a 2 x 128 model on the CPU, from random init (default); "
                             "width2048: a pre-trained 8 x 2048 model fine-tuned at lr 2e-5 on a GPU, in one process")
    parser.add_argument("--variants", default=None,
                        help="comma-separated keys (ref always runs). tiny: " + ", ".join(v[0] for v in PARITY_VARIANTS)
                             + f" (default {','.join(DEFAULT_KEYS)}); width2048: "
                             + ", ".join(v[0] for v in REGIME_VARIANTS) + " (default: all)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per variant (tiny 100, width2048 500)")
    parser.add_argument("--last-k", type=int, default=10, help="tiny: final_train_loss = mean of the last K steps")
    parser.add_argument("--heldout", type=int, default=None,
                        help="last N Alpaca records, left out of training (tiny 200, width2048 2000)")
    parser.add_argument("--data-dir", default=str(REPO_ROOT.parent / "shared" / "data"))
    parser.add_argument("--runs-dir", default="/tmp/loss_parity_runs", help="tiny: the recipe runs' folders")
    parser.add_argument("--out", default=None,
                        help="results JSON (tiny: bench/results/loss_parity.json, width2048: "
                             "bench/results/loss_parity_h200.json)")
    parser.add_argument("--plot", default=None,
                        help="plot PNG (tiny: docs/loss_parity.png, width2048: docs/loss_parity_h200.png)")
    parser.add_argument("--timeout", type=float, default=1200, help="tiny: seconds per recipe run")
    parser.add_argument("--merge", action="store_true",
                        help="tiny: add to the records in --out (re-running only the variants given; ref is reused)")
    parser.add_argument("--replot", metavar="JSON", default=None, help="run nothing: redraw --plot from a results JSON")
    g = parser.add_argument_group("width2048")
    g.add_argument("--width", type=int, default=2048, help="model width (heads of 128)")
    g.add_argument("--layers", type=int, default=8)
    g.add_argument("--seq-len", type=int, default=512, help="pack length")
    g.add_argument("--batch", type=int, default=16, help="packed rows per fine-tune step")
    g.add_argument("--lr", type=float, default=2e-5, help="fine-tune lr (20 warm-up steps, then constant)")
    g.add_argument("--pretrain-steps", type=int, default=300)
    g.add_argument("--pretrain-batch", type=int, default=16)
    g.add_argument("--pretrain-lr", type=float, default=1e-3)
    g.add_argument("--seed", type=int, default=0, help="the model's initialisation")
    g.add_argument("--device", default="cuda")
    parser.add_argument("overrides", nargs="*", help="tiny: extra key=value overrides for every run")
    args = parser.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    wide = args.setting == "width2048"
    args.steps = args.steps or (500 if wide else 100)
    args.heldout = args.heldout or (2000 if wide else 200)
    args.out = args.out or ("bench/results/loss_parity_h200.json" if wide else "bench/results/loss_parity.json")
    args.plot = args.plot or ("docs/loss_parity_h200.png" if wide else "docs/loss_parity.png")
    known = [v[0] for v in (REGIME_VARIANTS if wide else PARITY_VARIANTS)]
    keys = [k.strip() for k in (args.variants or ",".join(known if wide else DEFAULT_KEYS)).split(",") if k.strip()]
    unknown = set(keys) - set(known)
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(sorted(unknown))} for --setting {args.setting}")

    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        if result.get("setting", "tiny") == "tiny":
            plot(result["records"], Path(args.plot), plot_title(result["steps"]))
            print(markdown_table(result["records"]))
        else:
            plot(result["records"], Path(args.plot), result.get("title", ""), window=20)
            print(regime_table(result["records"]))
        print(f"wrote {args.plot}")
        return 0
    if wide:
        args.keys = keys
        return run_regime(args, argv)
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

    command = shlex.join(["python", "bench/loss_parity.py"] + argv)
    previous = json.loads(Path(args.out).read_text()) if old else {}
    commands = previous.get("commands", [previous["command"]] if previous else []) + [command]
    order = [v[0] for v in PARITY_VARIANTS]
    records = sorted(old + records, key=lambda r: order.index(r["key"]) if r["key"] in order else len(order))
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
