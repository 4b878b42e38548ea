"""Qwen3-30B-A3B on one GPU: transformers' own training at a depth where it fits, against our config at that depth and
at full depth, in one call.

    python bench/moe_anchor.py --data-dir /tmp/data --depth 8 --out bench/results/moe_anchor_h100.json
    python bench/moe_anchor.py ... --rows ours_full --merge      # a row in a later call, the others kept
    python bench/moe_anchor.py --toy                             # CPU: the whole pipeline at toy sizes, seconds

The rows, each a fresh process stopped once its last step is logged (bench/_runner.py), on a random-valued folder of
the model's real config.json written tensor by tensor on the GPU (``python -m finetune.toy_folder --sizes full
--stream-shards``: 61 GB at full depth, 1.25 GB a layer), with ``num_hidden_layers`` set to the row's depth:

- ``anchor``: transformers' ``Qwen3MoeForCausalLM`` as installed (transformers 5's default experts path is grouped
  GEMM, ``experts_path`` in the record; transformers 4 loops over the experts; the result's ``versions`` say which
  ran) trained with torch's fused AdamW in bf16 (its states take the weights' dtype: 8 bytes a parameter with the
  gradients, which is what fits 80 GB at a reduced depth), gradient checkpointing on, the load-balancing loss on
  (``output_router_logits``, as ours always trains), on ``--batch-size`` rows of ``--seq-len`` tokens of Alpaca,
  tokenized with the folder's tokenizer and concatenated: the same records and tokens a step as our packed rows (ours
  packs best-fit and masks attention at the documents' ends; at 512 tokens that is a small share of a step);
- ``ours_depth``: ``configs/qwen3_moe/30B_A3B_full_80gb.yaml`` on the same depth's folder;
- ``ours_full``: the same config on the 48-layer folder.

``--set KEY=VALUE`` overrides our config in our rows (each row records its ``overrides``): a setting to try, such as
``stream_optimizer_states=False`` where a reduced depth's states fit the GPU, or a larger ``--batch-size`` (both
rows): a speed figure of that setting, not of the shipped config. ``--anchor-batch-size`` gives the anchor its own:
each side at the batch it fits at that depth (the anchor's 8 bytes a parameter leave it less room for a step's
tokens than ours), so ``vs_anchor`` then says what the memory buys; each row records its ``batch_size``.

``--variant NAME:KEY=VALUE[,KEY=VALUE...]`` (repeatable) adds a row ``ours_depth+NAME``: our config at the anchor's
depth with these overrides after --set's (``batch_size=N`` among them is the row's batch), so that one call measures
several settings beside one anchor row, e.g. ``--variant compiled:compile=True --variant resident:compile=True,
stream_optimizer_states=False``.

Per row: ``tok_s`` (median trained tokens/s of the steps after ``--skip-steps``), ``peak_gib`` / ``peak_reserved_gib``
(torch's allocator), ``gpu_mib_peak`` (nvidia-smi, the CUDA context included) and ``host_gb_peak`` (MemAvailable's
drop), sampled by bench/_runner.py's Footprint; ``vs_anchor``: over the anchor row of the same depth. The
folders go after their rows (the device disk holds one 61 GB folder; ``--keep-folders`` keeps them).

``--toy``: 2-layer width-128 folders on the CPU, depth 1 for the anchor, fp32, 3 steps: a check of the machinery
(tests/bench/test_moe_anchor.py), not a measurement.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import List, Optional

import _harness as harness
import _runner as runner

ROWS = ("anchor", "ours_depth", "ours_full")
VARIANT = "ours_depth+"  # (a --variant row's name: this, then the variant's)
CONFIG = "qwen3_moe/30B_A3B_full_80gb"
FULL_DEPTH = 48
# 8 layers: 5.6B parameters, 45 GB of bf16 weights, gradients and AdamW states for the anchor, with room for its
# activations on an 80 GB card (12 layers would leave ~10 GB).
DEFAULT_DEPTH = 8
# Every GPU row runs as on an 80 GB card (bench/_harness.py's CLASS_GIB): on an H200 (139 GiB) uncapped, the anchor's
# depth and our config's background save would use memory an 80 GB card does not have.
CARD_GIB = harness.CLASS_GIB["80gb"]
# --toy: as bench/model_families.py's, the CPU settings of our config's GPU-only ones
TOY_OURS = ["device=cpu", "dtype=fp32", "compile=False", "packed_attention=flex"]


def folder_command(folder: Path, depth: int, args) -> List[str]:
    sizes = ["--sizes", "toy"] if args.toy else ["--sizes", "full"]
    return [
        sys.executable, "-m", "finetune.toy_folder", "--family", "qwen3_moe", *sizes, "--stream-shards",
        "--set", f"num_hidden_layers={depth}", "--data-dir", args.data_dir, "--out", str(folder),
    ]  # fmt: skip


def row_command(row: str, folder: Path, out: Path, args) -> List[str]:
    if row == "anchor":
        return [
            sys.executable, str(Path(__file__).resolve()), "--anchor-run", str(folder), "--anchor-out", str(out),
            "--data-dir", args.data_dir, "--steps", str(args.steps), "--batch-size", str(batch_size(row, args)),
            "--seq-len", str(args.seq_len), *(["--toy"] if args.toy else []),
        ]  # fmt: skip
    return harness.recipe_command(
        Path("recipes") / "full_finetune_single_device.py",
        "--config",
        f"configs/{CONFIG}.yaml",
        f"checkpoint_dir={folder}",
        f"data_dir={args.data_dir}",
        f"output_dir={out}",
        "metric_logger=null",
        f"pack_cache_dir={args.work_dir}/pack_cache",
        "log_every_n_steps=1",
        f"max_steps_per_epoch={args.steps}",
        f"dataset.split={args.split}",
        f"batch_size={batch_size(row, args)}",
        f"tokenizer.max_seq_len={args.seq_len}",
        *(TOY_OURS if args.toy else [harness.CAP["80gb"]]),
        *overrides(row, args),
    )


def own_overrides(row: str, args) -> List[str]:
    """A --variant row's own overrides as given (none for the other rows)."""
    return args.variants.get(row[len(VARIANT) :], []) if row.startswith(VARIANT) else []


def overrides(row: str, args) -> List[str]:
    """Our row's overrides of the config: --set's, then a --variant row's own (its batch_size is the command's)."""
    return [*args.set, *(o for o in own_overrides(row, args) if not o.startswith("batch_size="))]


def batch_size(row: str, args) -> int:
    """The rows a step of ``row``: the anchor's own where --anchor-batch-size gives one, a --variant row's where its
    overrides give one."""
    if row == "anchor":
        return args.anchor_batch_size or args.batch_size
    given = [int(o.split("=", 1)[1]) for o in own_overrides(row, args) if o.startswith("batch_size=")]
    return given[-1] if given else args.batch_size


def depth_of(row: str, args) -> int:
    return args.full_depth if row == "ours_full" else args.depth


def run_row(row: str, args) -> dict:
    """The row's folder (made unless it is there already), then the row, its footprint sampled."""
    depth = depth_of(row, args)
    folder = Path(args.work_dir) / f"folder_{depth}_layers"
    record = {"name": row, "kind": "anchor" if row == "anchor" else "ours", "depth": depth}
    record["batch_size"] = batch_size(row, args)
    if not (folder / "config.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
        made = harness.run(folder_command(folder, depth, args), Path(args.work_dir) / f"make_{depth}.log")
        if made.error():
            return {**record, "error": f"folder: {made.error()}"}
        record["folder_s"] = made.wall_s
        print(f"folder of {depth} layers made in {made.wall_s} s", flush=True)
    hf = json.loads((folder / "config.json").read_text())
    out = Path(args.work_dir) / "runs" / row
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    footprint = runner.Footprint()
    run, records, error = runner.measure(
        row_command(row, folder, out, args), out, "ours", steps=args.steps, timeout=args.timeout, env={}
    )
    footprint.stop()
    peaks = footprint.peaks([])
    record.update(
        command=run.command,
        wall_s=run.wall_s,
        config=None if row == "anchor" else CONFIG,
        overrides=None if row == "anchor" else overrides(row, args),
        gpu_mib_peak=peaks["gpu_mib_peak"],
        host_gb_peak=peaks["host_gb_peak"],
    )
    if error:
        return {**record, "error": error}
    steady = records[args.skip_steps : args.steps]
    record.update(runner.figures(records, steady, active_params(hf)), tokens_per_step=[r["tokens"] for r in records])
    record["experts_path"] = records[-1].get("experts_path") if row == "anchor" else None
    return record


def active_params(hf: dict) -> int:
    """The parameters a token runs through (its experts only), for the MFU: 6 x active x tokens/s over the peak."""
    d, heads, kv, hd = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    attn = d * heads * hd * 2 + d * kv * hd * 2 + 2 * hd
    experts = hf["num_experts_per_tok"] * 3 * d * hf["moe_intermediate_size"]
    layer = attn + experts + d * hf.get("num_local_experts", hf.get("num_experts", 0)) + 2 * d
    return 2 * hf["vocab_size"] * d + hf["num_hidden_layers"] * layer + d


def finish(records: List[dict]) -> None:
    """vs_anchor: each of our rows over the anchor row of its depth (the same invocation or a merged earlier one)."""
    anchors = {r["depth"]: r for r in records if r.get("kind") == "anchor" and not r.get("error")}
    for r in records:
        if r.get("kind") == "ours" and not r.get("error") and r["depth"] in anchors:
            r["vs_anchor"] = round(r["tok_s"] / anchors[r["depth"]]["tok_s"], 3)


def table(records: List[dict]) -> str:
    rows = [
        [r["name"], str(r["depth"]), str(r.get("batch_size", ""))]
        + (
            [f"error: {r['error'][:100]}", "", "", "", ""]
            if r.get("error")
            else [
                f"{r['tok_s']:,.0f}",
                f"{r['vs_anchor']:.2f}x" if r.get("vs_anchor") else "-",
                f"{r['peak_gib']} / {r['peak_reserved_gib']}",
                str(r["gpu_mib_peak"]),
                str(r["host_gb_peak"]),
            ]
        )
        for r in records
    ]
    headers = [
        "row",
        "layers",
        "rows a step",
        "tokens/s",
        "vs anchor",
        "peak alloc / reserved GiB",
        "nvidia-smi MiB",
        "host GB",
    ]
    return harness.table(headers, rows)


# -- the anchor row's process -----------------------------------------------------------------------------------------


def anchor_run(args) -> None:
    """transformers' model and torch's fused AdamW on the folder ``--anchor-run``, one metrics.jsonl line a step in
    our recipes' shape (loss, tokens, tokens_per_second, peak memory), which bench/_runner.py reads."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    from finetune.data import HFTokenizer
    from finetune.model.toy_tokenizer import alpaca_texts

    cuda = torch.cuda.is_available() and not args.toy
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    folder, out = Path(args.anchor_run), Path(args.anchor_out)
    torch.manual_seed(42)
    # (loaded on the host, then moved and cast: transformers 4's from_pretrained takes torch_dtype, 5's dtype, and
    # device_map needs accelerate, which the GPU image may lack; an 8-layer folder is 11 GB of host memory)
    if cuda:  # (as our rows' device_memory_limit_gib: an 80 GB card's share of whatever GPU this is)
        torch.cuda.set_per_process_memory_fraction(min(1.0, CARD_GIB * 2**30 / torch.cuda.mem_get_info()[1]))
    model = Qwen3MoeForCausalLM.from_pretrained(folder).to(device=device, dtype=dtype)
    model.config.output_router_logits, model.config.use_cache = True, False
    model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.0, fused=cuda)
    tokenizer = HFTokenizer(str(folder / "tokenizer.json"))
    need = args.steps * args.batch_size * args.seq_len
    stream: List[int] = []
    for text in alpaca_texts(args.data_dir):
        stream += tokenizer.encode(text)
        if len(stream) >= need:
            break
    rows = torch.tensor(stream[:need]).view(args.steps, args.batch_size, args.seq_len)
    experts_path = getattr(model.config, "_experts_implementation", None)
    with open(out / "metrics.jsonl", "w") as f:
        for step in range(args.steps):
            batch = rows[step].to(device)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
            tokens = args.batch_size * (args.seq_len - 1)  # (the predicted tokens: each row's first has no label)
            record = {"step": step + 1, "loss": loss.item(), "tokens": tokens, "tokens_per_second": tokens / wall}
            record["experts_path"] = experts_path
            if cuda:
                record["peak_memory_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
                record["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
            f.write(json.dumps(record) + "\n")
            f.flush()


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    ap.add_argument("--depth", type=int, default=None, help=f"the anchor's layers (default {DEFAULT_DEPTH}; toy 1)")
    ap.add_argument("--data-dir", default=harness.DATA_DIR, help="holds alpaca/alpaca_data.json")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per row")
    ap.add_argument("--skip-steps", type=int, default=4, help="steps left out of the median (warm-up)")
    ap.add_argument("--batch-size", type=int, default=16, help="rows a step (the config's)")
    ap.add_argument(
        "--anchor-batch-size", type=int, default=None, help="the anchor's rows a step (default: --batch-size)"
    )
    ap.add_argument("--seq-len", type=int, default=512, help="tokens a row (the config's pack length)")
    ap.add_argument("--split", default="train[:4000]", help="the Alpaca records our rows pack")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override of our config in our rows (e.g. stream_optimizer_states=False at a depth whose states fit "
        "the GPU); recorded in each row's overrides. Give such rows an --out of their own",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,...",
        help="a row ours_depth+NAME: our config at the anchor's depth with these overrides after --set's "
        "(batch_size=N: its rows a step); repeat for more",
    )
    ap.add_argument("--timeout", type=float, default=900, help="seconds per row before it is stopped as an error")
    ap.add_argument("--work-dir", default="/tmp/moe_anchor", help="folders, runs, pack cache")
    ap.add_argument("--keep-folders", action="store_true", help="keep the random folders after their rows")
    ap.add_argument("--out", default=harness.scratch("moe_anchor.json"), help="the JSON written")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows that this run does not re-measure")
    ap.add_argument("--toy", action="store_true", help="toy sizes on the CPU, 3 steps: the machinery, no figures")
    ap.add_argument("--anchor-run", metavar="FOLDER", help=argparse.SUPPRESS)
    ap.add_argument("--anchor-out", help=argparse.SUPPRESS)
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    args.names = harness.pick(ap, args.rows, ROWS, "rows")
    args.variants = {}
    for v in args.variant:
        name, _, settings = v.partition(":")
        given = [o.strip() for o in settings.split(",") if o.strip()]
        if (
            not re.fullmatch(r"[A-Za-z0-9_]+", name)
            or name in args.variants
            or not given
            or not all(re.fullmatch(r"[A-Za-z_][\w.]*=.+", o) for o in given)
        ):
            ap.error(
                f"--variant {v!r}: give NAME:KEY=VALUE[,KEY=VALUE...], a name of letters, digits and _ used once, "
                "e.g. --variant resident:stream_optimizer_states=False"
            )
        if any(o.startswith("batch_size=") and not o.split("=", 1)[1].isdigit() for o in given):
            ap.error(f"--variant {v!r}: batch_size takes a whole number of rows, e.g. batch_size=64")
        args.variants[name] = given
    args.names += [VARIANT + name for name in args.variants]
    args.full_depth = 2 if args.toy else FULL_DEPTH
    args.depth = args.depth or (1 if args.toy else DEFAULT_DEPTH)
    if not 1 <= args.depth <= args.full_depth:
        ap.error(f"--depth {args.depth} is not between 1 and {args.full_depth} layers; e.g. --depth {DEFAULT_DEPTH}")
    if args.toy:
        args.steps, args.skip_steps, args.batch_size, args.seq_len = min(args.steps, 3), 1, 2, 128
        args.split = "train[:200]"
    if args.skip_steps >= args.steps:
        ap.error(f"--skip-steps {args.skip_steps} leaves none of --steps {args.steps} for the median; use fewer")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.anchor_run:
        anchor_run(args)
        return
    results = runner.Results(
        __file__,
        argv,
        args,
        lambda r: r.get("name") in args.names,
        steps=args.steps,
        skip_steps=args.skip_steps,
        weights="random values: bf16 normal(0, 0.02), norms ones, written by finetune/toy_folder.py --stream-shards "
        "from Qwen3-30B-A3B's config.json; its stand-in tokenizer (a BPE of 1,024 tokens trained on Alpaca)",
    )
    Path(args.work_dir).mkdir(parents=True, exist_ok=True)
    # The rows in depth order: the reduced-depth folder serves the anchor and ours, then goes before the full one.
    order = sorted(args.names, key=lambda r: (depth_of(r, args), ROWS.index(r) if r in ROWS else len(ROWS)))
    for i, row in enumerate(order):
        depth = depth_of(row, args)
        try:
            record = run_row(row, args)
        except Exception as e:  # (one row's surprise must not cost the others)
            record = {"name": row, "kind": row, "depth": depth, "error": repr(e)[:500]}
        print(f"{row}: " + (record.get("error") or f"{record['tok_s']:,.0f} tok/s"), flush=True)
        results.records.append(record)
        finish(results.kept + results.records)
        results.write()
        if not args.keep_folders and all(depth_of(r, args) != depth for r in order[i + 1 :]):
            shutil.rmtree(Path(args.work_dir) / f"folder_{depth}_layers", ignore_errors=True)
    print(table(results.doc["records"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
