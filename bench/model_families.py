"""Fine-tune speed and memory of every model family's configs, each against torchtune's stock recipe, one GPU a family.

    python bench/model_families.py --data-dir /tmp/data --stock-dir .devsite/site/recipes \\
        --out bench/results/model_families_e2e_h200.json            # every family, over every visible GPU
    python bench/model_families.py --families qwen3_8b,mistral_7b --only ours_80gb,stock ...   # a subset
    python bench/model_families.py --families llama3_1_8b --classes 80gb ...   # one class: its bf16, FP8, stock rows
    python bench/model_families.py ... --loss-rows --candidates   # also the loss paths, the configs' alternatives
    python bench/model_families.py --toy --stock-dir <torchtune's recipes folder>           # CPU: tiny models, seconds

Per family (``SPECS``; the families and what each family x class row runs are bench/_family_rows.py's), in its own
worker on its own GPU (families are dealt round-robin to the visible GPUs by bench/_runner.py's pool, so six families
on an 8-GPU host run side by side; on one GPU they run one after another):

1. a Hugging Face checkpoint with random values, made by transformers from the family's real config.json (its
   ``SPECS`` entry: sizes, RoPE, tying, token ids) on the GPU, in 5 GB shards (finetune/toy_folder.py's
   builder), with a stand-in tokenizer: a byte-level BPE trained on the Alpaca file (no model hub here), saved by
   transformers as the family's tokenizer.json + tokenizer_config.json for our recipe and in the format torchtune's
   stock tokenizer for the family reads (Llama 3's tiktoken file, Qwen's vocab.json + merges.txt; Mistral's stock
   tokenizer reads Llama 2's SentencePiece file). The same BPE in every format, so both recipes train on the same
   tokens;
2. the rows, each one fresh process for ``--steps`` optimizer steps, stopped once its last step is logged (as
   bench/e2e.py does): ours, ``configs/<family>/<size>_full_<class>.yaml`` capped at its class
   (``device_memory_limit_gib``), and its FP8 twin ``<size>_full_<class>_fp8.yaml`` (FP8 matmuls and varlen
   attention; row ``ours_<class>_fp8``) at the same cap; the stock row, torchtune 0.6.1's own single-device recipe and
   config for the family at the flags that fit 80 GB (``STOCK_ROWS``); and with ``--loss-rows``, the smaller-class
   config with each loss (``finetune.model.LinearCrossEntropyLoss`` impl cce / liger / torch, and torchtune's
   ``CEWithChunkedOutputLoss``), uncapped, on a GPU of their own;
3. the checkpoint is deleted before the worker's next family (a 7-8B one is 15-16 GB; the device disk is 64 GB),
   unless ``--keep-checkpoints`` (bench/configs_check.py then checks the configs on it, the stock row its anchor).

The JSON (``--out``; rewritten after every row) opens with the command, hardware, versions, date and commit
(bench/_harness.py); per row: ``family``, ``config``, ``memory_class``, ``device_memory_limit_gib``, ``kind`` (ours /
stock / loss), ``variant`` (the AdamW and the loss), ``tok_s`` (median trained tokens/s of the steps after
``--skip-steps``), ``peak_gib`` / ``peak_reserved_gib``, ``mfu`` (6 x parameters x tok_s / 989 TFLOP/s),
``vs_stock`` (over the family's stock row of the same invocation), ``vs_bf16`` (an FP8 row: over the bf16 row of its
class in the same invocation), ``first_step_s``, ``losses``, ``tok_s_per_step`` (every step, the skipped ones too:
a row whose median moves between runs shows here whether a few steps or all of them were slow), ``command``; with
``--profile``, our rows' ``profile`` (finetune/reporting/profiler.py's summary of the last two steps: milliseconds
per step by category, idle being the GPU's gaps between kernels, a step bound by the CPU that launches it shows
there) and ``profiled_steps`` (the last three, left out of ``tok_s``).

``--toy`` is the same pipeline on the CPU with 2-layer width-64 models and 3 steps (tests/bench/test_model_families.py
runs it): a check of the machinery, not a measurement (flex attention, since varlen is CUDA's; the FP8 rows' matmuls
emulated, and at width 64 no layer is large enough to convert).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import _harness as harness
import _runner as runner
from finetune.reporting import console

console.quiet_known_noise()  # (before finetune.model imports torchtune, and torchtune torchao, with its noise: console.KNOWN_NOISE)
from _family_rows import (  # noqa: E402
    CLASS_GIB,
    FP8,
    SPECS,
    STOCK_COMMON,
    Row,
    Spec,
    n_params,
    rows_of,
)
from finetune import toy_folder  # noqa: E402
from finetune.model.toy_tokenizer import alpaca_texts, train_bpe  # noqa: E402

REPO_ROOT = harness.REPO_ROOT
ALPACA = Path("alpaca") / "alpaca_data.json"  # inside --data-dir
LLAMA2_TOKENIZER = Path("llama2_tokenizer") / "tokenizer.model"
PROFILED = 3  # --profile: the last steps of our rows, one warming the profiler up and two recorded
# --toy: on the CPU, in fp32, a short batch; the model built from the toy folder's config.json by its sizes builder
TOY_CPU = ["device=cpu", "dtype=fp32", "compile=False", "batch_size=2", "tokenizer.max_seq_len=128"]
# A toy's layers are all too small for FP8 to convert, which the recipe refuses: a toy row runs its FP8 twin's other
# settings in bf16 matmuls, and its record's variant is still its config's (``variant`` leaves this override out).
TOY_NO_FP8 = "fp8=null"


# -- the stand-in tokenizer in the stock recipe's formats ------------------------------------------------------------


def write_stock_tokenizer(folder: Path, spec: Spec, bpe, data_dir) -> List[str]:
    """The same BPE in the format torchtune's own tokenizer for the family reads; returns the stock recipe's
    tokenizer overrides."""
    if spec.family == "llama3":  # tiktoken: base64 of each token's bytes, and its rank (= its BPE id)
        import base64

        byte_of = _gpt2_unicode_to_byte()
        lines = [
            f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {i}"
            for token, i in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
        ]
        (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
        return [f"tokenizer.path={folder / 'tiktoken.model'}"]
    if spec.family in ("qwen2", "qwen3"):
        bpe.model.save(str(folder))  # vocab.json, merges.txt
        return [f"tokenizer.path={folder / 'vocab.json'}", f"tokenizer.merges_file={folder / 'merges.txt'}"]
    return [f"tokenizer.path={Path(data_dir) / LLAMA2_TOKENIZER}", "tokenizer.prompt_template=null"]


def _gpt2_unicode_to_byte() -> Dict[str, int]:
    """The byte-level BPE's printable character for each byte (GPT-2's table), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# -- the checkpoint ---------------------------------------------------------------------------------------------------


def make_family_checkpoint(spec: Spec, folder: Path, bpe, args) -> None:
    """The family's checkpoint: the library's random model (finetune/toy_folder.py: transformers' model for the
    family's real config.json, or with --toy at its tiny sizes, with uniform random values, bit-identical on every
    CPU; bf16 on the GPU, in 5 GB shards) and the stand-in tokenizer, then the stock recipe's tokenizer files for it
    (``--make-checkpoint`` runs it in a process of its own, so the GPU memory it took is freed after)."""
    import torch

    hf = toy_folder.tiny(spec.hf, spec.builder_extra.get("head_dim")) if args.toy else spec.hf
    toy_folder.save_toy(
        folder,
        {"model_type": spec.model_type, **hf},
        bpe,
        spec.stand_in,
        template_file=False,
        device="cpu" if args.toy else "cuda",
        dtype=torch.float32 if args.toy else torch.bfloat16,
        scale=toy_folder.TINY_SCALE if args.toy else 0.02,
        max_shard_size="5GB",
    )
    stock = write_stock_tokenizer(folder, spec, bpe, args.data_dir) if spec.stock else []
    if spec.stock and spec.family != "mistral":
        stock.append(f"tokenizer.special_tokens_path={folder / 'tokenizer.json'}")
    (folder / "stock_tokenizer.args").write_text("\n".join(stock))


def model_overrides(spec: Spec, ck: Path) -> List[str]:
    """--toy: the overrides that build the model of the checkpoint's config.json with the spec's sizes builder."""
    hf = json.loads((ck / "config.json").read_text())
    return toy_folder.sizes_overrides(spec.sizes_builder, hf, **spec.builder_extra)


# -- a row ------------------------------------------------------------------------------------------------------------


def command(row: Row, spec: Spec, ck: Path, out: Path, args) -> List[str]:
    data, steps, split = Path(args.data_dir), f"max_steps_per_epoch={args.steps}", f"dataset.split={args.split}"
    if row.kind == "stock":
        stock = Path(args.stock_dir)
        shards = sorted(p.name for p in ck.glob("*.safetensors"))
        extra = [] if not args.toy else [*TOY_CPU, "log_peak_memory_stats=False", *model_overrides(spec, ck)]
        return harness.recipe_command(
            stock / "full_finetune_single_device.py",
            "--config",
            str(stock / "configs" / f"{row.config}.yaml"),
            f"output_dir={out}",
            f"checkpointer.checkpoint_dir={ck}",
            f"checkpointer.checkpoint_files=[{','.join(shards)}]",
            "dataset._component_=torchtune.datasets.alpaca_dataset",
            "dataset.source=json",
            split,
            f"dataset.data_files={data / ALPACA}",
            "log_every_n_steps=1",
            f"metric_logger.log_dir={out / 'logs'}",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
            steps,
            *spec.stock[1],
            *STOCK_COMMON,
            *row.overrides,
            *(ck / "stock_tokenizer.args").read_text().split("\n"),
            *extra,
        )
    cap = [] if args.toy or row.cap is None else [f"device_memory_limit_gib={row.cap}"]
    profile = (
        []
        if not args.profile
        else [  # the last 3 steps: one to warm the profiler up, two recorded (profiled_steps)
            "profiler.enabled=True",
            f"profiler.wait_steps={args.steps - PROFILED}",
            "profiler.warmup_steps=1",
            f"profiler.active_steps={PROFILED - 1}",
            "profiler.num_cycles=1",
            f"profiler.output_dir={out / 'profiler'}",
        ]
    )
    extra = (
        []
        if not args.toy
        else [
            *TOY_CPU,
            "packed_attention=flex",  # (varlen is CUDA's)
            "enable_activation_offloading=False",  # (the 12 GB configs': it needs a GPU)
            TOY_NO_FP8,
            *model_overrides(spec, ck),
        ]
    )
    return harness.recipe_command(
        "full_finetune_single_device",
        "--config",
        f"configs/{row.config}.yaml",
        f"checkpoint_dir={ck}",
        f"data_dir={data}",
        f"output_dir={out}",
        "metric_logger=null",
        f"pack_cache_dir={args.work_dir}/pack_cache",
        "log_every_n_steps=1",
        steps,
        split,
        *cap,
        *row.overrides,
        *profile,
        *extra,
    )


def variant(row: Row, cmd: List[str]) -> str:
    """The AdamW and the loss the row ran (its config's, or the overrides'), and its FP8 recipe and attention where
    they are not bf16 matmuls and flex attention."""
    from omegaconf import OmegaConf

    if row.kind == "stock":
        opt = next(o.split("=", 1)[1] for o in row.overrides if o.startswith("optimizer="))
        return f"{opt} + CEWithChunkedOutputLoss"
    cfg = OmegaConf.load(REPO_ROOT / "configs" / f"{row.config}.yaml")
    cfg = OmegaConf.merge(
        cfg,
        OmegaConf.from_dotlist(
            [
                o
                for o in cmd
                if "=" in o
                and not o.startswith("~")
                and o != TOY_NO_FP8
                and o.split("=")[0].startswith(("optimizer", "loss", "fp8", "packed_attention"))
            ]
        ),
    )
    for deleted in [o[1:] for o in cmd if o.startswith("~loss.")]:
        cfg.loss.pop(deleted.split(".", 1)[1], None)
    loss = cfg.loss._component_.rsplit(".", 1)[1] + (f"({cfg.loss.impl})" if cfg.loss.get("impl") else "")
    extras = [f"fp8={cfg.fp8}"] if cfg.get("fp8") else []
    extras += [f"packed_attention={cfg.packed_attention}"] if cfg.get("packed_attention", "flex") != "flex" else []
    return f"{cfg.optimizer._component_} + {loss}" + "".join(f" + {e}" for e in extras)


def run_row(row: Row, spec: Spec, ck: Path, gpu: Optional[int], args) -> dict:
    out = Path(args.work_dir) / "runs" / spec.key / row.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = command(row, spec, ck, out, args)
    kind = "stock" if row.kind == "stock" else "ours"
    record = {
        "family": spec.key,
        "name": row.name,
        "kind": row.kind,
        "config": row.config,
        "memory_class": row.memory_class,
        "device_memory_limit_gib": row.cap,
        "overrides": row.overrides,
    }
    env = {"WANDB_MODE": "disabled"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        record["gpu"] = gpu
    summary = out / "profiler" / "rank0_summary.json"  # (our rows with --profile: written once the trace is)
    profiled = args.profile and kind == "ours"
    run, records, error = runner.measure(
        cmd,
        out,
        kind,
        steps=args.steps,
        timeout=args.timeout,
        env=env,
        watch=lambda _: not profiled or summary.is_file(),
    )
    record.update(command=run.command, wall_s=run.wall_s)
    if error:
        record["error"] = error
        return record
    if profiled and not summary.is_file():
        record["error"] = f"--profile: no {summary} after {run.wall_s} s: " + " / ".join(list(run.tail)[-3:])[-600:]
        return record
    if profiled:
        record.update(
            profile=json.loads(summary.read_text()),
            profiled_steps=list(range(args.steps - PROFILED + 1, args.steps + 1)),
        )
    # The median leaves the profiled steps out: recording slows them.
    steady = records[args.skip_steps : args.steps - (PROFILED if profiled else 0)]
    record.update(variant=variant(row, cmd), **runner.figures(records, steady, n_params(spec)))
    return record


# -- one worker per GPU ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """Rows of one family that run one after another on one GPU, on a checkpoint of their own."""

    name: str
    spec: Spec
    rows: List[Row]

    @property
    def cost(self) -> int:
        return n_params(self.spec) * (len(self.rows) + 1)


def jobs_of(args) -> List[Job]:
    """One job per family (its ours, FP8 and stock rows); --loss-rows add one per loss family, on a GPU of its own."""
    jobs = []
    for key in args.names:
        spec = SPECS[key]
        rows = [
            r
            for r in rows_of(spec, args.kinds, False, args.candidates)
            if (not args.only or r.name in args.only)
            and (not args.classes or r.kind != "ours" or r.memory_class in args.classes)
        ]
        if rows:
            jobs.append(Job(key, spec, rows))
        if args.loss_rows and key in args.loss_families:
            jobs.append(Job(f"{key}_losses", spec, rows_of(spec, [], True)))
    return sorted(jobs, key=lambda j: -j.cost)


def worker(gpu: Optional[int], jobs: List[Job], bpe_file: Path, args, results: runner.Results, lock) -> None:
    """The jobs dealt to one GPU, one after another: each family's checkpoint, then its rows, each recorded (and the
    results file rewritten) as it ends."""
    for job in jobs:
        ck = Path(args.work_dir) / "checkpoints" / job.name
        shutil.rmtree(ck, ignore_errors=True)
        if args.toy:  # (the CPU: no GPU memory to free, so no process of its own)
            from tokenizers import Tokenizer

            t = time.monotonic()
            make_family_checkpoint(job.spec, ck, Tokenizer.from_file(str(bpe_file)), args)
            error, wall = None, round(time.monotonic() - t, 1)
        else:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--make-checkpoint",
                str(ck),
                "--families",
                job.spec.key,
                "--bpe",
                str(bpe_file),
                "--data-dir",
                args.data_dir,
                "--rows",
                "ours",
            ]
            made = harness.run(
                cmd,
                Path(args.work_dir) / f"make_{job.name}.log",
                timeout=args.timeout,
                env={"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {},
            )
            error, wall = made.error(), made.wall_s
        if error:
            with lock:
                results.records.append({"family": job.spec.key, "name": "checkpoint", "kind": "setup", "error": error})
            continue
        print(f"{job.name}: checkpoint made in {wall} s (gpu {gpu})", flush=True)
        for row in job.rows:
            try:
                record = run_row(row, job.spec, ck, gpu, args)
            except Exception as e:  # (one row's surprise must not cost the others)
                record = {"family": job.spec.key, "name": row.name, "kind": row.kind, "error": repr(e)[:500]}
            print(
                f"{job.spec.key} {row.name}: "
                + (
                    f"error {record['error']}"
                    if record.get("error")
                    else f"{record['tok_s']:,.0f} tok/s, {record['peak_reserved_gib']} GiB reserved"
                ),
                flush=True,
            )
            with lock:
                results.records.append(record)
                finish(results.records)
                results.write()
        if not args.keep_checkpoints:
            shutil.rmtree(ck, ignore_errors=True)  # (the device disk holds about four 7-8B checkpoints)


def finish(records: List[dict]) -> None:
    """vs_stock: over the stock row of the row's own class where the run has one (torchtune's low-memory row beside
    the 16 GB and 12 GB configs), else over the fastest stock row of the family that finished within the 80 GB
    class's cap; vs_bf16 (an FP8 row): over the bf16 row of its class (ours_<class>_fp8[_<candidate>] over
    ours_<class>)."""
    for r in records:
        if FP8 in r.get("name", "") and not r.get("error"):
            bf16 = f"ours_{r['memory_class']}"
            base = [s for s in records if s["family"] == r["family"] and s.get("name") == bf16 and not s.get("error")]
            if base:
                r["vs_bf16"] = round(r["tok_s"] / base[0]["tok_s"], 3)
    for r in records:
        stock = [
            s
            for s in records
            if s["family"] == r["family"]
            and s["kind"] == "stock"
            and not s.get("error")
            and (s.get("peak_reserved_gib") or 0) <= CLASS_GIB["80gb"]
        ]
        if stock and not r.get("error"):
            own_class = [s for s in stock if s["memory_class"] == r["memory_class"]]
            anchor = max(own_class or stock, key=lambda s: s["tok_s"])
            r["vs_stock"], r["anchor"] = round(r["tok_s"] / anchor["tok_s"], 3), anchor["name"]


def table(records: List[dict]) -> str:
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["family"], r.get("name", ""), "", f"error: {r['error'][:100]}", "", "", "", ""])
            continue
        rows.append(
            [
                r["family"],
                r["name"],
                r["variant"],
                f"{r['tok_s']:,.0f}",
                f"{r['vs_stock']:.2f}x" if r.get("vs_stock") else "-",
                f"{r['vs_bf16']:.2f}x" if r.get("vs_bf16") else "-",
                f"{r['mfu']:.2f}",
                f"{r['peak_gib']} / {r['peak_reserved_gib']} (cap {r['device_memory_limit_gib']})",
            ]
        )
    return harness.table(
        ["family", "row", "AdamW + loss", "tokens/s", "vs stock", "vs bf16", "MFU", "peak alloc / reserved GiB"], rows
    )


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(SPECS), help=f"comma-separated, of: {', '.join(SPECS)}")
    ap.add_argument(
        "--rows",
        default="ours,fp8,stock",
        help="ours (the bf16 configs), fp8 (their _fp8 twins), stock; comma-separated",
    )
    ap.add_argument(
        "--classes",
        default="",
        help="only our rows of these memory classes (e.g. 80gb or 32gb,24gb); default all. Stock rows are not filtered",
    )
    ap.add_argument(
        "--loss-rows",
        action="store_true",
        help="also the smaller-class config with each loss (LOSSES), on a GPU of their own",
    )
    ap.add_argument("--loss-families", default="llama3_1_8b", help="the families that get --loss-rows")
    ap.add_argument("--only", default="", help="only these row names (e.g. ours_80gb,stock); default all")
    ap.add_argument("--candidates", action="store_true", help="also the alternatives in CANDIDATES")
    ap.add_argument("--data-dir", default=harness.DATA_DIR, help="holds alpaca/alpaca_data.json and llama2_tokenizer/")
    ap.add_argument("--stock-dir", help="torchtune's recipes folder (its full_finetune_single_device.py, configs/)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per row")
    ap.add_argument(
        "--split",
        default="train[:4000]",
        help="the Alpaca records every row reads (tokenized and packed before its first step: the first "
        "4,000, about 1,100 rows of 512 tokens, hold the steps; the whole file costs each row a "
        "minute)",
    )
    ap.add_argument("--skip-steps", type=int, default=4, help="steps left out of the median (compile, warm-up)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per row before it is stopped as an error")
    ap.add_argument("--bpe-size", type=int, default=32000, help="tokens of the stand-in BPE")
    ap.add_argument("--work-dir", default="/tmp/model_families", help="checkpoints, runs, pack cache")
    ap.add_argument("--out", default=harness.scratch("model_families_e2e.json"), help="the JSON written")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows that this run does not re-measure")
    ap.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each family's checkpoint (--work-dir/checkpoints/<family>), e.g. for bench/configs_check.py "
        "beside its stock row",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help=f"our rows record their last {PROFILED} steps with torch.profiler (left out of the median): each gets "
        "profile, milliseconds per step by category (idle: the GPU's gaps between kernels)",
    )
    ap.add_argument("--toy", action="store_true", help="tiny models on the CPU, 3 steps: the machinery, no figures")
    ap.add_argument("--make-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--bpe", help=argparse.SUPPRESS)
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    args.names = harness.pick(ap, args.families, SPECS, "families")
    args.kinds = [k for k in args.rows.split(",") if k]
    args.loss_families = args.loss_families.split(",")
    args.only = [r for r in args.only.split(",") if r]
    args.classes = [c for c in args.classes.split(",") if c]
    unknown = sorted(set(args.classes) - set(CLASS_GIB)) + sorted(set(args.kinds) - {"ours", "fp8", "stock"})
    if unknown:
        ap.error(
            f"unknown --classes / --rows value(s) {', '.join(unknown)}: "
            f"classes {', '.join(CLASS_GIB)}; rows ours, fp8, stock"
        )
    if args.toy:
        toy_steps = 3 + (PROFILED if args.profile else 0)
        args.steps, args.skip_steps, args.bpe_size, args.split = (
            min(args.steps, toy_steps),
            1,
            toy_folder.TINY_BPE_SIZE,
            "train[:200]",
        )
    if args.profile and args.steps - PROFILED <= args.skip_steps:
        ap.error(
            f"--profile records the last {PROFILED} steps and leaves them out of the median: --steps {args.steps} "
            f"leaves none after --skip-steps {args.skip_steps}; use --steps {args.skip_steps + PROFILED + 4} or more"
        )
    if "stock" in args.kinds and not args.stock_dir and not args.make_checkpoint:
        ap.error("stock rows need --stock-dir (torchtune's recipes folder), or --rows ours")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.make_checkpoint:
        from tokenizers import Tokenizer

        make_family_checkpoint(SPECS[args.names[0]], Path(args.make_checkpoint), Tokenizer.from_file(args.bpe), args)
        return
    jobs = jobs_of(args)
    measured = {(j.spec.key, r.name) for j in jobs for r in j.rows}
    results = runner.Results(
        __file__,
        argv,
        args,
        lambda r: (r["family"], r.get("name")) in measured,
        steps=args.steps,
        skip_steps=args.skip_steps,
        weights="random values: HF checkpoints made by transformers from each family's real config.json; "
        f"a {args.bpe_size}-token byte-level BPE trained on Alpaca stands in for its tokenizer",
    )
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    bpe_file = work / f"bpe_{args.bpe_size}.json"
    if not bpe_file.is_file():
        t = time.monotonic()
        train_bpe(alpaca_texts(args.data_dir), args.bpe_size).save(str(bpe_file))
        print(f"stand-in BPE of {args.bpe_size} tokens trained in {time.monotonic() - t:.0f} s", flush=True)
    lock = threading.Lock()
    runner.run_pool(
        jobs, runner.gpus(args.toy), lambda j: j.cost, lambda g, js: worker(g, js, bpe_file, args, results, lock)
    )
    finish(results.records)
    results.write()
    print(table(results.doc["records"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
