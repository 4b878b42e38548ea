"""End-to-end fine-tune speed per memory class: torchtune's stock recipe as the anchor, then our configs.

    python bench/e2e.py --make-checkpoint /tmp/llama2-7b-random          # HF-format Llama2-7B, random values
    python bench/e2e.py --checkpoint-dir /tmp/llama2-7b-random --data-dir /tmp/data \\
        --stock-dir .devsite/site/recipes --rows stock_80gb,ours_80gb,ours_80gb_8bit \\
        --steps 20 --skip-steps 5 --out bench/results/llama2_7b_e2e_h200.json --merge

Each row is one fresh process (no compile cache, allocator state or peak counter leaks between rows), run for
``--steps`` optimizer steps on the same HF checkpoint and Alpaca file and stopped once its last step is logged
(no end-of-epoch checkpoint). Our rows run ``python -m recipes.full_finetune_single_device`` with a config from
``configs/llama2/``; the stock rows run torchtune's own ``full_finetune_single_device.py`` with its
``7B_full_low_memory.yaml`` and the flags named in ROWS (``--stock-dir`` is torchtune's ``recipes`` folder; its
``tune`` CLI is not needed). The JSON (``--out``, default outputs/bench/llama2_7b_e2e.json; rewritten after every
row) opens with the command, hardware, versions, date and commit (bench/_harness.py); per row it keeps compare.py's
keys (``variant``, ``tok_s``, ``peak_gib``, ``peak_reserved_gib``) plus:

    name, config, memory_class  the row, the config file it ran (stem) and its class (80gb, 24gb, seed)
    command, code, measured_at  the row's recipe command, and the commit and date of the run that measured it
    vs_stock                    tok_s over the same class's stock row measured in the same invocation
    first_step_s                wall time of the first step (compilation included)
    mfu                         6 x 6.738e9 x tok_s / 989e12 (dense bf16 peak of an H100/H200)
    epoch_hours                 one Alpaca epoch's trained tokens / tok_s
    losses, tok_s_per_step, compiled_graphs (ours with compile: torch.compile's graph count after each step;
    flat after the first steps = no recompiles)

tokens/s counts trained tokens (labels the loss sees). torchtune's stock recipe also counts each packed sample's
first label, which it trains on from the previous sample's last token (0.7 % more tokens on Alpaca).
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import _harness as harness
import _runner as runner

REPO_ROOT = harness.REPO_ROOT
N_PARAMS = 6.738e9  # Llama2-7B

STOCK_COMMON = runner.STOCK_PACKED
# torchao's CPUOffloadOptimizer as docs/recipes.md gives it for a card below the 24 GiB config.
CPU_OFFLOAD = [
    "optimizer=torchao.optim.CPUOffloadOptimizer",
    "optimizer.offload_gradients=True",
    "optimizer_in_bwd=False",
    "enable_activation_offloading=True",
    "stream_optimizer_states=False",  # (the 24 GiB config streams its states; torchao's optimizer offloads them)
]
CAP = harness.CAP  # (each class's cap as an override: what a card of it leaves a run)
# The 24 GiB configs as they were measured before 2026-12-04 (rows ours_24gb* of llama2_7b_e2e_h200.json).
STATES_ON_GPU = ["stream_optimizer_states=False"]
FUSED_CE = ["loss._component_=finetune.model.LinearCrossEntropyLoss", "~loss.num_output_chunks", "loss.impl=auto"]
# torchtune's recipe file for each stock config: the distributed one runs as one process under torchrun.
STOCK_RECIPES = {
    "7B_full_low_memory": ("full_finetune_single_device.py", 0),
    "7B_full": ("full_finetune_distributed.py", 1),
}
# name -> (kind, config, overrides, memory class). Stock rows: torchtune's recipe at its best flags per class.
ROWS: Dict[str, tuple] = {
    "stock_80gb": (
        "stock",
        "7B_full_low_memory",
        STOCK_COMMON
        + [
            "optimizer=torch.optim.AdamW",
            "optimizer.fused=True",
            "optimizer_in_bwd=False",
            "enable_activation_checkpointing=False",
            "enable_activation_offloading=False",
        ],
        "80gb",
    ),
    "stock_low_memory": (
        "stock",
        "7B_full_low_memory",
        STOCK_COMMON
        + [
            "optimizer=bitsandbytes.optim.PagedAdamW8bit",
            "optimizer_in_bwd=True",
            "enable_activation_checkpointing=True",
            "enable_activation_offloading=True",
        ],
        "24gb",
    ),
    # The engines that exist for a card that cannot hold weights and states (issue: the 16 GB and 12 GB classes),
    # measured before building our own streaming: FSDP2's CPUOffloadPolicy on one GPU (torchtune's distributed
    # recipe: parameters, gradients and the AdamW step on the host), and torchao's CPUOffloadOptimizer under our
    # 24 GiB config capped at 16 (states and step on the host, gradients copied out in backward).
    "stock_fsdp_cpu_offload": (
        "stock",
        "7B_full",
        STOCK_COMMON
        + [
            "fsdp_cpu_offload=True",
            "optimizer=torch.optim.AdamW",
            "optimizer.fused=True",
            "enable_activation_checkpointing=True",
        ],
        "16gb",
    ),
    "ours_16gb_cpu_offload": ("ours", "7B_full_24gb", ["device_memory_limit_gib=16", *CPU_OFFLOAD], "16gb"),
    "ours_16gb_cpu_offload_fp8": (
        "ours",
        "7B_full_24gb",
        ["device_memory_limit_gib=16", "fp8=tensorwise", *CPU_OFFLOAD],
        "16gb",
    ),
    # Our 16 GB class: the 24 GiB config with the states in host memory (stream_optimizer_states) and the saved
    # activations offloaded, capped at 14.2 GiB in the config itself.
    "ours_16gb": ("ours", "7B_full_16gb", [], "16gb"),
    "ours_16gb_fp8": ("ours", "7B_full_16gb_fp8", [], "16gb"),
    # the same with the fused output loss (measured slower than the configs' chunked one)
    "ours_16gb_fused_ce": ("ours", "7B_full_16gb", FUSED_CE, "16gb"),
    "ours_16gb_fp8_fused_ce": ("ours", "7B_full_16gb_fp8", FUSED_CE, "16gb"),
    # Weights in host memory too (stream_layers): the 12 GB class and what it was chosen against (12 layers ran out
    # of memory); at 16 GB 6 layers, which the configs set since (the _s6 rows: the names
    # bench/results/llama2_7b_streamed_weights_h200.json ran), and the same with the activations kept on the GPU
    # instead of offloaded (out of memory).
    "ours_12gb_fp8": ("ours", "7B_full_12gb_fp8", [], "12gb"),
    "ours_12gb_fp8_s12": ("ours", "7B_full_12gb_fp8", ["stream_layers=12"], "12gb"),
    "ours_16gb_fp8_s6": ("ours", "7B_full_16gb_fp8", ["stream_layers=6"], "16gb"),
    "ours_16gb_s6": ("ours", "7B_full_16gb", ["stream_layers=6"], "16gb"),
    "ours_16gb_fp8_s6_resident_acts": (
        "ours",
        "7B_full_16gb_fp8",
        ["stream_layers=6", "enable_activation_offloading=False"],
        "16gb",
    ),
    # device_memory_limit_gib caps the allocator at what a card of the class leaves a run (an 80 GB card reports about
    # 79.1 GiB, a 24 GB one 23.6, less the CUDA context and a display; harness.CLASS_GIB): a row
    # that completes fits that card. Rows measured before 2026-12-04 ran at 80 and 24 GiB (their overrides say so).
    "ours_80gb": ("ours", "7B_full_80gb", [CAP["80gb"]], "80gb"),
    "ours_80gb_8bit": (
        "ours",
        "7B_full_80gb",
        [CAP["80gb"], "optimizer=optimizers.AdamW8bit"],
        "80gb",
    ),
    # The alternatives the 80 GB config was chosen against: a separate optimizer step, twice the batch.
    "ours_80gb_no_inbwd": ("ours", "7B_full_80gb", ["optimizer_in_bwd=False"], "80gb"),
    "ours_80gb_bs32": ("ours", "7B_full_80gb", ["batch_size=32"], "80gb"),
    "ours_24gb": ("ours", "7B_full_24gb", [CAP["24gb"]], "24gb"),
    # What a 24 GB card leaves: about 23.6 GiB reported (an RTX 4090), less the CUDA context and the display. The
    # configs as they were (states on the GPU, 23.1 GiB reserved) ran out of memory there; what would make them fit:
    # a smaller batch, the states in host memory (the configs since), the activations offloaded.
    "ours_24gb_card": ("ours", "7B_full_24gb", [CAP["24gb"], *STATES_ON_GPU], "24gb"),
    "ours_24gb_fp8_card": ("ours", "7B_full_24gb_fp8", [CAP["24gb"], *STATES_ON_GPU], "24gb"),
    "ours_24gb_card_bs12": (
        "ours",
        "7B_full_24gb",
        [CAP["24gb"], "batch_size=12", *STATES_ON_GPU],
        "24gb",
    ),
    "ours_24gb_fp8_card_bs12": (
        "ours",
        "7B_full_24gb_fp8",
        [CAP["24gb"], "batch_size=12", *STATES_ON_GPU],
        "24gb",
    ),
    # (the configs as they are since, the same as ours_24gb and ours_24gb_fp8 now; kept for the recorded commands)
    "ours_24gb_card_streamed_states": ("ours", "7B_full_24gb", [CAP["24gb"]], "24gb"),
    "ours_24gb_fp8_card_streamed_states": ("ours", "7B_full_24gb_fp8", [CAP["24gb"]], "24gb"),
    "ours_24gb_fp8_card_offloaded_acts": (
        "ours",
        "7B_full_24gb_fp8",
        [CAP["24gb"], "enable_activation_offloading=True", *STATES_ON_GPU],
        "24gb",
    ),
    # FP8 matmuls in the transformer layers (torchao float8 training, dynamic scaling), the rest as the class config.
    "ours_80gb_fp8": ("ours", "7B_full_80gb", [CAP["80gb"], "fp8=tensorwise"], "80gb"),
    "ours_80gb_fp8_rowwise": ("ours", "7B_full_80gb", [CAP["80gb"], "fp8=rowwise"], "80gb"),
    "ours_24gb_fp8": ("ours", "7B_full_24gb", [CAP["24gb"], "fp8=tensorwise"], "24gb"),
    # The configs' attention of packed rows is FlashAttention's varlen kernel; torchtune's flex attention is what
    # it was chosen against (finetune/model/attention.py).
    "ours_80gb_flex": ("ours", "7B_full_80gb", [CAP["80gb"], "packed_attention=flex"], "80gb"),
    "ours_24gb_fp8_flex": (
        "ours",
        "7B_full_24gb",
        [CAP["24gb"], "fp8=tensorwise", "packed_attention=flex"],
        "24gb",
    ),
    # The seed's reference setting (unpacked, AC, fused), and the same with our 8-bit AdamW: the unpacked half of
    # the packed-vs-unpacked loss check.
    "seed_fused": ("ours", "7B_full", ["tokenizer.max_seq_len=512", "clip_grad_norm=null"], "seed"),
    "seed_ours_8bit": (
        "ours",
        "7B_full",
        ["tokenizer.max_seq_len=512", "clip_grad_norm=null", "optimizer=optimizers.AdamW8bit"],
        "seed",
    ),
}
# The stock row each class is compared with: torchtune's low-memory recipe (14.9 GiB reserved) for 16 GB too.
ANCHOR = {"80gb": "stock_80gb", "24gb": "stock_low_memory", "16gb": "stock_low_memory", "12gb": "stock_low_memory"}


def make_checkpoint(folder: Path, tokenizer: Path) -> None:
    """An HF-format Llama2-7B with random values (transformers' init), in 5 GB shards, on the GPU (~15 s)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="5GB")
    shutil.copyfile(tokenizer, folder / "tokenizer.model")


def command(name: str, args, out: Path) -> List[str]:
    kind, config, overrides, _ = ROWS[name]
    ck, data = Path(args.checkpoint_dir), Path(args.data_dir)
    common = [f"tokenizer.path={ck / 'tokenizer.model'}", f"max_steps_per_epoch={args.steps}"]
    if kind == "stock":
        shards = sorted(p.name for p in ck.glob("*.safetensors"))
        stock = Path(args.stock_dir)
        recipe, nproc = STOCK_RECIPES[config]
        return harness.recipe_command(
            stock / recipe,
            "--config",
            str(stock / "configs" / "llama2" / f"{config}.yaml"),
            f"output_dir={out}",
            f"checkpointer.checkpoint_dir={ck}",
            f"checkpointer.checkpoint_files=[{','.join(shards)}]",
            "tokenizer.max_seq_len=512",
            "dataset.source=json",
            "dataset.split=train",
            f"dataset.data_files={data / 'alpaca' / 'alpaca_data.json'}",
            "log_every_n_steps=1",
            f"metric_logger.log_dir={out / 'logs'}",
            *common,
            *overrides,
            nproc=nproc,
        )
    return harness.recipe_command(
        "full_finetune_single_device",
        "--config",
        f"configs/llama2/{config}.yaml",
        f"output_dir={out}",
        f"checkpoint_dir={ck}",
        f"data_dir={data}",
        "metric_logger=null",
        f"pack_cache_dir={args.pack_cache_dir}",
        "log_every_n_steps=1",
        *common,
        *overrides,
    )


def run_row(name: str, args, runs: Path) -> dict:
    kind, config, overrides, memory_class = ROWS[name]
    out = runs / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = command(name, args, out)
    row = {"name": name, "kind": kind, "config": config, "memory_class": memory_class, "overrides": overrides}
    t0 = time.monotonic()
    first_at = None

    def watch(records: List[dict]) -> bool:  # when the first step was logged
        nonlocal first_at
        if records and first_at is None:
            first_at = time.monotonic()
        return True

    run, records, error = runner.measure(
        cmd, out, kind, steps=args.steps, timeout=args.timeout, env={"WANDB_MODE": "disabled"}, watch=watch
    )
    row["command"], row["wall_s"] = run.command, run.wall_s
    if error:
        row["error"] = error
        return row
    steady = records[args.skip_steps :]
    row.update(
        variant=_optimizer_of(kind, config, overrides),
        **runner.figures(records, steady, N_PARAMS),
        tokens_per_step=statistics.median(r["tokens"] for r in records) if "tokens" in records[0] else None,
    )
    # Ours log the first step's wall time (first_step_s); for both kinds, the time from the process's start to its
    # first step.
    row["start_to_first_step_s"] = round(first_at - t0, 1) if first_at else None
    if "compiled_graphs" in records[0]:
        graphs = [r["compiled_graphs"] for r in records]
        row["compiled_graphs"] = graphs
        row["recompiles_after_step_2"] = graphs[-1] - graphs[min(1, len(graphs) - 1)]
    if "host_copy_gb" in records[-1]:  # streamed states: what crossed the link, and what the GPU waited for it
        row.update(streaming(steady, activation_offload_gb(config, overrides)))
    log_text = (out / "log.txt").read_text(errors="replace")
    m = re.search(r"Packed (\d+) samples into (\d+) rows of (\d+) tokens \(([\d.]+)% filled", log_text)
    if m:
        row["pack_rows"], row["pack_fill"] = int(m.group(2)), float(m.group(4)) / 100
    return row


PCIE4_GBPS = 25.0  # PCIe 4.0 x16, each way (a 4080, a 4060 Ti's x8 link is half that)


LAYERS, DIM = 32, 4096  # Llama2-7B


def activation_offload_gb(config: str, overrides: List[str]) -> float:
    """GB that torchtune's activation offloading moves each way per step for one of our rows: with every layer
    checkpointed, each layer's saved input (batch x sequence x dim, bf16) goes to the host in forward and back in
    backward. Computed from the config (the recipe does not count torchtune's copies); 0 without offloading."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs" / "llama2" / f"{config}.yaml"),
        OmegaConf.from_dotlist([o for o in overrides if "=" in o and not o.startswith("~")]),
    )
    if not (cfg.get("enable_activation_offloading") and cfg.get("enable_activation_checkpointing")):
        return 0.0
    return LAYERS * cfg.batch_size * cfg.tokenizer.max_seq_len * DIM * 2 / 1e9


def streaming(steady: List[dict], offload_gb: float = 0.0) -> dict:
    """A streamed row's link figures (medians over the steady steps): GB copied per step (both ways), the ms the GPU
    waited on copies, and the step time projected at PCIe 4.0 x16. The projection takes the step's own compute (step
    time less the wait) and the busier direction's copies (host to GPU) at 25 GB/s, and assumes, as on
    the measured link, that copies overlap compute: step = max(compute, copy). torchtune's activation offloading
    (``offload_gb`` each way, computed from the config: ``activation_offload_gb``) shares the link and is added."""
    med = lambda key: statistics.median(r.get(key, 0.0) for r in steady)  # noqa: E731
    gb, wait_s, step_s = med("host_copy_gb"), med("copy_wait_ms") / 1e3, med("step_time_s")
    # States cross once each way; streamed weights (stream_layers) twice up (forward, backward) and once down.
    weights_gb = med("weights_copy_gb")
    up_gb = (gb - weights_gb) / 2 + weights_gb * 2 / 3 + offload_gb
    compute_s = step_s - wait_s
    pcie4_s = max(compute_s, up_gb / PCIE4_GBPS)
    return {
        "host_copy_gb_per_step": round(gb, 2),
        "weights_copy_gb_per_step": round(weights_gb, 2),
        "activation_offload_gb_per_step": round(2 * offload_gb, 2),  # (both ways; not in host_copy_gb)
        "copy_wait_ms_per_step": round(wait_s * 1e3, 1),
        "link_gbps_up": round(up_gb / step_s, 1),
        "pcie4_projected_tok_s": round(med("tokens") / pcie4_s, 1),
    }


def _optimizer_of(kind: str, config: str, overrides: List[str]) -> str:
    for o in overrides:
        if o.startswith("optimizer="):
            return o.split("=", 1)[1]
    if kind == "stock":
        return "bitsandbytes.optim.PagedAdamW"
    text = (REPO_ROOT / "configs" / "llama2" / f"{config}.yaml").read_text()
    return re.search(r"optimizer:\n\s+_component_: (\S+)", text).group(1)


def epoch_tokens(args) -> Optional[int]:
    """Trained tokens of one Alpaca epoch at 512 tokens: every sample's tokens but its first label."""
    try:
        from torchtune.datasets import alpaca_dataset
        from torchtune.models.llama2 import llama2_tokenizer

        from finetune.data import packing

        tok_path = harness.repo_path(args.checkpoint_dir) / "tokenizer.model"
        data = str(harness.repo_path(args.data_dir) / "alpaca" / "alpaca_data.json")
        tok = llama2_tokenizer(str(tok_path), max_seq_len=512, prompt_template=None)
        ds = alpaca_dataset(tok, source="json", data_files=data, split="train", train_on_input=True)
        samples = packing.TokenizedSamples.from_dataset(ds)
        return int(samples.lengths.sum() - len(samples))
    except Exception as e:  # the table still has every other column
        print(f"epoch tokens not counted: {e}", file=sys.stderr)
        return None


def table(records: List[dict]) -> str:
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["name"], r["config"], "", f"error: {r['error'][:120]}", "", "", "", "", ""])
            continue
        rows.append(
            [
                r["name"],
                r["config"],
                r["variant"],
                f"{r['tok_s']:,.0f}",
                f"{r['vs_stock']:.2f}x" if r.get("vs_stock") else "-",
                f"{r['mfu']:.2f}",
                f"{r['peak_gib']:.1f} / {r['peak_reserved_gib']:.1f}",
                f"{r['first_step_s']:.0f}" if r.get("first_step_s") is not None else "-",
                f"{r['epoch_hours']:.2f}" if r.get("epoch_hours") else "-",
            ]
        )
    return harness.table(
        [
            "row",
            "config",
            "AdamW",
            "tokens/s",
            "vs stock",
            "MFU",
            "peak alloc / reserved GiB",
            "first step s",
            "epoch h",
        ],
        rows,
    )


def plot(records: List[dict], path: Path, hardware: str) -> None:
    plt = harness.pyplot()
    ok = [r for r in records if not r.get("error")]
    if plt is None or not ok:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    colors = {"80gb": "tab:blue", "24gb": "tab:green", "seed": "tab:gray"}
    names = [r["name"] for r in ok]
    bars = ax1.barh(
        names,
        [r["tok_s"] for r in ok],
        color=[colors.get(r["memory_class"], "tab:purple") for r in ok],
        hatch=None,
        edgecolor=["black" if r["kind"] == "stock" else "none" for r in ok],
    )
    for bar, r in zip(bars, ok):
        ax1.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f" {r['tok_s']:,.0f}  ({r['peak_reserved_gib']:.0f} GiB)",
            va="center",
            fontsize=8,
        )
    ax1.invert_yaxis()
    ax1.set_xlabel("trained tokens / s (median of steady steps)")
    ax1.set_title(f"Llama2-7B, {hardware.split(',')[0]} (outlined: torchtune stock); color = memory class", fontsize=9)
    ax1.set_xlim(0, max(r["tok_s"] for r in ok) * 1.35)
    for r in ok:
        steps = range(1, len(r["losses"]) + 1)
        ax2.plot(steps, r["losses"], label=r["name"], linestyle="--" if r["kind"] == "stock" else "-")
    ax2.set_xlabel("step")
    ax2.set_ylabel("training loss")
    ax2.xaxis.get_major_locator().set_params(integer=True)
    ax2.set_title("loss per step (packed rows and unpacked batches)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--make-checkpoint", metavar="DIR", help="write an HF-format Llama2-7B with random values and exit")
    ap.add_argument(
        "--tokenizer",
        default=f"{harness.DATA_DIR}/llama2_tokenizer/tokenizer.model",
        help="tokenizer.model copied into --make-checkpoint's folder",
    )
    ap.add_argument("--checkpoint-dir", help="the HF checkpoint every row loads")
    ap.add_argument("--data-dir", default=harness.DATA_DIR, help="holds alpaca/alpaca_data.json")
    ap.add_argument("--stock-dir", help="torchtune's recipes folder (its full_finetune_single_device.py, configs/)")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per row")
    ap.add_argument("--skip-steps", type=int, default=5, help="steps left out of the median (compile, warm-up)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per row before it is stopped as an error")
    ap.add_argument("--runs-dir", default="/tmp/e2e_runs", help="output_dir of each row")
    ap.add_argument("--pack-cache-dir", default="/tmp/e2e_pack_cache", help="our rows' pack cache (shared)")
    ap.add_argument(
        "--out",
        default=harness.scratch("llama2_7b_e2e.json"),
        help="the JSON written (default outputs/bench/llama2_7b_e2e.json)",
    )
    ap.add_argument("--plot", help="PNG of tokens/s and loss curves (default: beside --out)")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows that this run does not re-measure")
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    args.plot = args.plot or str(Path(args.out).with_suffix(".png"))
    if args.make_checkpoint:
        return args
    if not args.checkpoint_dir:
        ap.error("--checkpoint-dir is required (make one with --make-checkpoint DIR)")
    args.names = harness.pick(ap, args.rows, ROWS, "rows")
    if any(ROWS[n][0] == "stock" for n in args.names) and not args.stock_dir:
        ap.error("stock rows need --stock-dir (torchtune's recipes folder)")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.make_checkpoint:
        make_checkpoint(Path(args.make_checkpoint), harness.repo_path(args.tokenizer))
        return
    results = runner.Results(
        __file__,
        argv,
        args,
        lambda r: r["name"] in args.names,
        weights="random values (HF-format Llama2-7B made by transformers; no real weights on this machine)",
        steps=args.steps,
        skip_steps=args.skip_steps,
        epoch_trained_tokens=None,
    )
    for name in args.names:
        row = run_row(name, args, Path(args.runs_dir))
        row["measured_at"], row["code"] = results.prov["date"], results.prov["code"]
        results.records.append(row)
        print(
            f"{name}: "
            + (
                f"error {row['error']}"
                if row.get("error")
                else f"{row['tok_s']:,.0f} tok/s, {row['peak_gib']} / {row['peak_reserved_gib']} GiB, "
                f"first step {row.get('first_step_s')} s, wall {row['wall_s']} s"
            ),
            flush=True,
        )
        _finish(results, None)
        results.write()  # after every row: a stopped run keeps what it measured
    _finish(results, epoch_tokens(args))
    results.write()
    print(table(results.doc["records"]))
    print(f"wrote {args.out}")
    plot(results.doc["records"], Path(args.plot), results.prov["hardware"])


def _finish(results: runner.Results, tokens: Optional[int]) -> None:
    """Ratios to the same class's stock row of this invocation, projected epoch times."""
    records = results.records
    for r in records:
        anchor = next((a for a in records if a["name"] == ANCHOR.get(r["memory_class"]) and not a.get("error")), None)
        if not r.get("error"):
            if anchor is not None:
                r["vs_stock"] = round(r["tok_s"] / anchor["tok_s"], 3)
                r["anchor"] = anchor["name"]
            if tokens:
                r["epoch_hours"] = round(tokens / r["tok_s"] / 3600, 3)
    results.doc["epoch_trained_tokens"] = tokens or results.doc["epoch_trained_tokens"]


if __name__ == "__main__":
    main()
