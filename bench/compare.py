"""Run a matrix of AdamW variants through the fine-tune recipe and compare them: table, plots, JSON.

    python bench/compare.py --config configs/tiny.yaml --steps 20 --out-dir outputs/bench_tiny
    python bench/compare.py --config configs/llama2/7B_full.yaml --variants fused,bnb8,ao8,ours8 --in-bwd \\
        --steps 15 --out bench/results/llama2_7b_h200.json checkpoint_dir=null tokenizer.path=...
    (docs/llama2_7b_h200.md has the exact H200 commands; bench/results/README.md indexes every result)

Each variant is one `python -m recipes.full_finetune_single_device --config CONFIG optimizer=... key=value ...` (with
--nproc N, `recipes.full_finetune_distributed` under torchrun) in a fresh process, so peak memory, compile caches and
allocator state never leak between variants. The `key=value` (or `~key`) arguments after the flags go to every run;
the variant's own optimizer keys come after them and win. The run is stopped once its last step is logged, before
the recipe's end-of-epoch checkpoint (--keep-checkpoints: not).

Per variant it reads `{output_dir}/metrics.jsonl` (docs/CONVENTIONS.md) and records:

    peak_gib       GPU peak allocated (peak_memory_alloc_gib) if logged, else the CPU peak RSS (peak_rss_gib)
    tok_s          median tokens_per_second over the steps after the first --skip-steps (default 2)
    tok_s_per_step every logged step's tokens_per_second (all steps)
    vs_fused_paired  median over the steady steps of this run's tokens/s divided by torch fused's at the same step
                   (every variant sees the same batches in the same order, so a step-by-step ratio cancels the
                   batches' different lengths; one slow step, e.g. a host hiccup, moves a median little)
    first_step_s   seconds from the end of the recipe's setup (its "Optimizer: ..." log line) to the first
                   metrics record: the first step with its compilation / autotuning and first batch
    opt_step_ms    median optimizer_step_ms over the same steady steps (null with optimizer-in-backward)
    losses         the loss of every logged step
    command        the recipe command the variant ran

A variant whose run fails (import error, bad kwarg, out of memory, crash) becomes a row with `error` set; the
other variants still run. Outputs: the JSON (`--out`, default `{out_dir}/compare.json`; with the command, hardware,
library versions, date and commit, see bench/_harness.py) and, in --out-dir (default: beside --out, else
outputs/bench/compare), `compare.md` (the table), `compare_loss.png` (loss curves overlaid) and
`compare_memory_speed.png` (three bar panels per variant: optimizer state GiB, peak memory GiB, tokens/s; the state is
what the variants change, the peak adds the model, gradients, activations and, on a CPU, the whole process). The
runs' own folders go to --runs-dir (default `{out_dir}/runs`, or outputs/bench/compare/runs when only --out is given:
a results folder holds results, not training runs).
With `--merge`, records already in `--out` for variants not run now are kept, so a long matrix can be run in
pieces (e.g. one device call per few variants) into one file; each record carries the `code` it ran.

The JSON records the load average before the first and after the last run (`load_average`: 1, 5 and 15 min). A
busy machine makes tokens/s and step times noise: when the load before the runs exceeds a quarter of the cores,
compare.py says so on the terminal, in the JSON (`busy_warning`) and above the table.

Variants (`--variants`, comma-separated short names or full names; `all` = every one), the third-party anchors:
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import textwrap
from pathlib import Path
from typing import Dict, List, Optional

import _harness as harness

RECIPE, DIST_RECIPE = "full_finetune_single_device", "full_finetune_distributed"
FUSED = harness.ANCHORS["fused"][0]
# Optimizer-in-backward: one optimizer per parameter, stepped in the gradient hook. The recipe refuses it with
# clipping or gradient accumulation, so the in-backward run turns clipping off (a config that accumulates
# gradients gets the recipe's error in that row rather than a silently smaller batch).
IN_BWD_SUFFIX = "+in_bwd"
IN_BWD_OVERRIDES = ["optimizer_in_bwd=True", "clip_grad_norm=null"]
STEP_LINE = re.compile(r"\bstep (\d+) \| epoch \d+ \| loss (\S+)")

__doc__ += (
    "\n".join(f"    {k:<8} {v[0]}" for k, v in harness.ANCHORS.items())
    + """
then ours, every key of `optimizers.VARIANTS` as registered when the variants are resolved (the end of --help lists
them), and any other dotted path, e.g. my.pkg.MyAdamW, run as optimizer=my.pkg.MyAdamW.

`--in-bwd` also runs every variant with optimizer_in_bwd=True clip_grad_norm=null (name + "+in_bwd");
`--in-bwd-only` runs just those.
"""
)


def variants() -> Dict[str, tuple]:
    """Every row by short name: (variant name, overrides), the anchors, then ours from ``optimizers.VARIANTS``."""
    return {**harness.ANCHORS, **{v.key: (v.component, v.overrides) for v in harness.ours()}}


def resolve_variants(spec: str, in_bwd=False) -> List[tuple]:
    """[(variant name, overrides)] for a comma-separated list of short names, full names or class paths.

    in_bwd: False, True/"also" (each variant, then it with optimizer-in-backward) or "only" (just the latter).
    """
    table = variants()
    by_name = {v[0]: v for v in table.values()}
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        if item == "all":
            out += list(table.values())
        elif item in table:
            out.append(table[item])
        elif item in by_name:
            out.append(by_name[item])
        elif "." in item:
            out.append((item, [f"optimizer={item}"]))
        else:
            raise SystemExit(f"error: unknown variant {item!r}; use one of {', '.join(table)}, all, or a class path")
    if in_bwd == "only":
        out = [(base[0] + IN_BWD_SUFFIX, base[1] + IN_BWD_OVERRIDES) for base in out]
    elif in_bwd:
        out = [v for base in out for v in (base, (base[0] + IN_BWD_SUFFIX, base[1] + IN_BWD_OVERRIDES))]
    return out


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("_")


def _median(values) -> Optional[float]:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(metrics: List[dict], skip_steps: int) -> dict:
    """The per-variant numbers from a run's metrics records (see the module docstring)."""
    if not metrics:
        return {"peak_gib": None, "peak_kind": None, "tok_s": None, "opt_step_ms": None, "losses": [], "steps": 0}
    last = metrics[-1]
    if last.get("peak_memory_alloc_gib") is not None:
        peak = max(m["peak_memory_alloc_gib"] for m in metrics)
        kind = "gpu_alloc"
    else:
        peak = max((m.get("peak_rss_gib") or 0.0) for m in metrics) or None
        kind = "cpu_rss"
    # Steady steps: skip the first ones (compilation, allocator warm-up), but keep at least one.
    steady = metrics[min(skip_steps, len(metrics) - 1) :]
    return {
        "peak_gib": peak,
        "peak_kind": kind,
        "peak_reserved_gib": max((m.get("peak_memory_reserved_gib") or 0.0) for m in metrics) or None,
        "tok_s": _median(m.get("tokens_per_second") for m in steady),
        # distributed runs (--nproc): throughput per GPU and each rank's peak
        "tok_s_per_gpu": _median(m.get("tokens_per_second_per_gpu") for m in steady),
        "peak_gib_per_rank": last.get("peak_memory_alloc_gib_per_rank") or last.get("peak_rss_gib_per_rank"),
        "world_size": last.get("world_size"),
        "opt_step_ms": _median(m.get("optimizer_step_ms") for m in steady),
        "opt_state_gib": (last.get("optimizer_state_bytes") or 0) / 2**30 or None,
        "losses": [m["loss"] for m in metrics],
        "tok_s_per_step": [m.get("tokens_per_second") for m in metrics],
        "steps": len(metrics),
    }


def paired_ratio(rec: dict, base: dict, skip_steps: int) -> Optional[float]:
    """Median over steady steps of rec's tokens/s over base's at the same step (see vs_fused_paired)."""
    a, b = rec.get("tok_s_per_step") or [], base.get("tok_s_per_step") or []
    n = min(len(a), len(b))
    ratios = [x / y for x, y in zip(a[skip_steps:n], b[skip_steps:n]) if x and y]
    return statistics.median(ratios) if ratios else None


def run_variant(name: str, overrides: List[str], args, run_dir: Path, log_prefix: str) -> dict:
    """Run the recipe once for a variant; return its record (error set on failure)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    settings = ["--config", args.config, f"output_dir={run_dir}", "epochs=1"]
    settings += [f"max_steps_per_epoch={args.steps}"] if args.steps else []
    settings += [] if args.wandb else ["metric_logger=null"]
    # The variant's keys last, so they win over the passthrough.
    cmd = harness.recipe_command(
        DIST_RECIPE if args.nproc else RECIPE, *settings, *args.overrides, *overrides, nproc=args.nproc
    )
    marks: Dict[str, float] = {}

    def on_line(line: str, t: float) -> None:
        if "setup" not in marks and "Optimizer: " in line:
            marks["setup"] = t
        m = STEP_LINE.search(line)
        if m:
            marks.setdefault("first_step", t)
            if not args.quiet:
                print(f"{log_prefix}   step {m.group(1)} loss {float(m.group(2)):.4f} ({t:.0f} s)", flush=True)

    def last_step_logged() -> bool:
        metrics = harness.read_metrics(run_dir)
        return bool(metrics) and metrics[-1].get("step", 0) >= args.steps

    print(f"{log_prefix} start: {' '.join(cmd)}", flush=True)
    until = last_step_logged if args.steps and not args.keep_checkpoints else None
    run = harness.run(cmd, run_dir / "run.log", timeout=args.timeout, until=until, on_line=on_line)
    metrics = harness.read_metrics(run_dir)
    record = {
        "variant": name,
        "overrides": overrides,
        "command": run.command,
        "returncode": run.returncode,
        "wall_s": run.wall_s,
        "stopped_before_checkpoint": run.stopped,
        "output_dir": str(run_dir),
        "error": run.error(),
    }
    record.update(summarize(metrics, args.skip_steps))
    record["first_step_s"] = marks["first_step"] - marks["setup"] if len(marks) == 2 else None
    if record["error"] is None and (not metrics or (args.steps and len(metrics) < args.steps and args.log_every_one)):
        record["error"] = f"logged {len(metrics)} of {args.steps} steps"
    if record["error"]:
        record["log_tail"] = list(run.tail)[-15:]
    if not args.keep_checkpoints:
        # Whatever checkpoint the recipe began (a run stopped early leaves a .tmp-* folder) or wrote.
        for ckpt in list(run_dir.glob("epoch_*")) + list(run_dir.glob("step_*")) + list(run_dir.glob(".tmp-*")):
            shutil.rmtree(ckpt, ignore_errors=True)
    status = (
        f"FAILED: {record['error']}"
        if record["error"]
        else (
            f"peak {_fmt(record['peak_gib'], 2)} GiB, {_fmt(record['tok_s'], 0)} tok/s, first step "
            f"{_fmt(record['first_step_s'], 1)} s, opt step {_fmt(record['opt_step_ms'], 1)} ms, "
            f"final loss {_fmt(record['losses'][-1], 4)}"
        )
    )
    print(f"{log_prefix} done in {run.wall_s:.0f} s: {status}", flush=True)
    return record


def _fmt(v, digits: int) -> str:
    if v is None:
        return "-"
    return f"{v:,.{digits}f}"


def _final_loss(r: dict):
    """The last step's loss; a record kept without per-step losses carries only ``final_loss``."""
    return r["losses"][-1] if r.get("losses") else r.get("final_loss")


def markdown_table(records: List[dict]) -> str:
    base = next((r for r in records if r["variant"] == FUSED and not r["error"]), None)
    kind = next((r["peak_kind"] for r in records if r.get("peak_kind")), "gpu_alloc")
    headers = [
        "AdamW",
        "peak GiB (GPU alloc)" if kind == "gpu_alloc" else "peak GiB (CPU RSS)",
        "tokens/s",
        "vs fused",
        "vs fused, paired",
        "first step s",
        "opt step ms",
        "state GiB",
        "final loss",
        "error",
    ]
    rows = []
    for r in records:
        if r["error"]:
            rows.append([r["variant"]] + ["-"] * 8 + [r["error"]])
            continue
        rel = f"{r['tok_s'] / base['tok_s']:.2f}x" if base and r["tok_s"] and base["tok_s"] else "-"
        paired = r.get("vs_fused_paired")
        rows.append(
            [
                r["variant"],
                _fmt(r["peak_gib"], 2),
                _fmt(r["tok_s"], 0),
                rel,
                "-" if paired is None else f"{paired:.3f}x",
                _fmt(r["first_step_s"], 1),
                _fmt(r["opt_step_ms"], 1),
                _fmt(r["opt_state_gib"], 2),
                _fmt(_final_loss(r), 4),
                "",
            ]
        )
    return harness.table(headers, rows)


def plot(records: List[dict], out_dir: Path, title: str, name: str = "compare") -> List[str]:
    """{name}_loss.png (loss per step, overlaid) and {name}_memory_speed.png; returns the paths."""
    plt = harness.pyplot()
    if plt is None:  # e.g. the device machine's image: plot here later with --replot FILE.json
        return []
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    ok = [r for r in records if not r["error"]]
    paths = []
    fig, ax = plt.subplots(figsize=(10, 5))
    in_bwd_drawn = False
    curves = [r for r in ok if r.get("losses")]  # a record kept from a summary line has no per-step losses
    palette = plt.get_cmap("tab10" if len(curves) <= 10 else "tab20").colors  # no two curves share a colour
    for i, r in enumerate(curves):
        in_bwd = r["variant"].endswith(IN_BWD_SUFFIX)
        in_bwd_drawn |= in_bwd
        ax.plot(
            range(1, len(r["losses"]) + 1),
            r["losses"],
            label=r["variant"],
            linestyle="--" if in_bwd else "-",
            linewidth=1.2,
            color=palette[i % len(palette)],
        )
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    note = " (dashed: optimizer in backward)" if in_bwd_drawn else ""
    ax.set_title(textwrap.fill(f"Loss per step: {title}{note}", 80), fontsize=10)
    ax.grid(alpha=0.3)
    if ax.lines:  # beside the axes, never over the curves
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    fig.tight_layout()
    paths.append(str(out_dir / f"{name}_loss.png"))
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    # One row per variant, three panels: the optimizer state (what the variants change), the peak memory (the state
    # plus model, gradients, activations; on a CPU the whole process's RSS), and tokens/s. Bars, not a scatter with
    # labels: nothing overlaps, and a state difference is not hidden by the rest of the memory.
    rows = [r for r in ok if r.get("tok_s") is not None or r.get("peak_gib") is not None]
    kind = next((r.get("peak_kind") for r in rows if r.get("peak_kind")), "gpu_alloc")
    panels = [
        ("opt_state_gib", "optimizer state, GiB", 2),
        (
            "peak_gib",
            "peak memory, GiB (" + ("GPU allocated" if kind == "gpu_alloc" else "CPU RSS, whole process") + ")",
            2,
        ),
        ("tok_s", "tokens/s (median, steady steps)", 0),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, max(2.6, 0.9 + 0.42 * len(rows))), sharey=True)
    labels = [r["variant"] for r in rows]
    colors = ["tab:orange" if lbl.startswith("optimizers.") else "tab:blue" for lbl in labels]
    hatches = ["//" if lbl.endswith(IN_BWD_SUFFIX) else "" for lbl in labels]
    for ax, (key, xlabel, digits) in zip(axes, panels):
        values = [r.get(key) or 0.0 for r in rows]
        bars = ax.barh(range(len(rows)), values, color=colors, hatch=hatches, edgecolor="white")
        for bar, r in zip(bars, rows):
            v = r.get(key)
            ax.annotate(
                "-" if v is None else f"{v:,.{digits}f}",
                (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                xytext=(3, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
            )
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_xlim(0, (max(values) if values and max(values) > 0 else 1) * 1.25)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[0].set_yticks(range(len(rows)), labels)
    axes[0].invert_yaxis()
    legend = [Patch(color="tab:blue", label="third-party"), Patch(color="tab:orange", label="ours (optimizers.*)")]
    if any(hatches):
        legend.append(Patch(facecolor="tab:gray", hatch="//", edgecolor="white", label="optimizer in backward"))
    axes[2].legend(handles=legend, fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0)
    fig.suptitle(textwrap.fill(f"Memory and speed: {title}", 100), fontsize=10)
    fig.tight_layout()
    paths.append(str(out_dir / f"{name}_memory_speed.png"))
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")  # (the legend sits right of the last panel)
    plt.close(fig)
    return paths


def config_title(config: str) -> str:
    """configs/llama2/7B_full.yaml -> llama2/7B_full"""
    return re.sub(r"^(\./)?configs/", "", config).removesuffix(".yaml")


def write_reports(result: dict, out_dir: Path, name: str, title: str) -> None:
    """{name}.md (the table with its provenance) and the two plots, from a results dict."""
    records = result["records"]
    table = markdown_table(records)
    commands = result.get("commands") or [result["command"]]
    warning = f"**Warning: {result['busy_warning']}**\n\n" if result.get("busy_warning") else ""
    (out_dir / f"{name}.md").write_text(
        f"{title}: {result['steps']} steps per variant, {result['hardware']}, {result['date']}\n\n"
        f"Command(s): {'; '.join(f'`{c}`' for c in commands)}\n\n" + warning + table
    )
    plots = plot(records, out_dir, title, name)
    print("\n" + table)
    print(f"wrote {out_dir / (name + '.md')}" + "".join(f", {p}" for p in plots))


def load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def busy_warning(load: Optional[List[float]], cores: Optional[int]) -> Optional[str]:
    """A warning when other work kept more than a quarter of the cores busy before the runs (1-minute load)."""
    if not load or not cores or load[0] <= max(0.5, cores / 4):
        return None
    return (
        f"the machine was busy before the runs (load average {load[0]:.2f} on {cores} cores): tokens/s, step "
        "times and first-step times are noise; rerun on an idle machine"
    )


def parse_args(argv: Optional[List[str]] = None):
    now = "\n".join(f"    {k:<8} {v[0]}" for k, v in variants().items())
    parser = argparse.ArgumentParser(
        description=__doc__ + f"\nRegistered now:\n{now}\n", formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", default="configs/tiny.yaml", help="recipe config (default configs/tiny.yaml)")
    parser.add_argument("--variants", default="all", help="comma-separated short names, full names or class paths")
    parser.add_argument("--in-bwd", action="store_true", help="also run each variant with optimizer_in_bwd=True")
    parser.add_argument("--in-bwd-only", action="store_true", help="run only the optimizer_in_bwd=True versions")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (max_steps_per_epoch)")
    parser.add_argument(
        "--nproc", type=int, default=0, help="run the distributed recipe (FSDP2) on this many processes / GPUs instead"
    )
    parser.add_argument("--skip-steps", type=int, default=2, help="steps left out of the tok/s and opt-step medians")
    parser.add_argument(
        "--out-dir",
        default=None,
        help="folder for the table, plots and runs (default: beside --out, else outputs/bench/compare)",
    )
    parser.add_argument("--out", default=None, help="JSON results file (default {out-dir}/compare.json)")
    parser.add_argument(
        "--runs-dir",
        default=None,
        help="where each variant's output_dir goes (default {out-dir}/runs; outputs/bench/compare/runs "
        "when only --out is given)",
    )
    parser.add_argument("--merge", action="store_true", help="keep records in --out of variants not run now")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="let each run write its epoch_0/ checkpoint and keep it (by default a run is stopped "
        "once its last step is logged, before the checkpoint)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="seconds per variant before it is killed")
    parser.add_argument("--wandb", action="store_true", help="keep the config's metric_logger (default: off)")
    parser.add_argument("--title", default=None, help="plot title (default: the config name)")
    parser.add_argument("--quiet", action="store_true", help="one line per variant instead of one per step")
    parser.add_argument("--name", default="compare", help="file stem of the table and plots (default compare)")
    parser.add_argument(
        "--replot",
        metavar="JSON",
        default=None,
        help="run nothing: write the table and plots of an existing results JSON into --out-dir "
        "(default outputs/bench/compare)",
    )
    harness.add_arguments(parser)
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to every run")
    args = parser.parse_args(argv)
    args.log_every_one = not any(o.startswith("log_every_n_steps=") for o in args.overrides)
    scratch = Path(harness.scratch("compare"))
    given_dir = args.out_dir
    args.out_dir = Path(given_dir or (Path(args.out).parent if args.out and not args.replot else scratch))
    args.out = Path(args.out or args.out_dir / "compare.json")
    # Training runs go into an --out-dir given, never beside a results file named by --out alone.
    args.runs_dir = Path(args.runs_dir or Path(given_dir or scratch) / "runs")
    for o in args.overrides:
        if not ("=" in o or o.startswith("~")):
            parser.error(f"override {o!r} is not key=value or ~key")
    if not args.replot and not (harness.REPO_ROOT / args.config).is_file() and not Path(args.config).is_file():
        parser.error(f"--config {args.config} does not exist")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        args.out_dir.mkdir(parents=True, exist_ok=True)
        write_reports(result, args.out_dir, args.name, args.title or config_title(result["config"]))
        return 0
    runs = resolve_variants(args.variants, "only" if args.in_bwd_only else args.in_bwd)
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    load_start = load_average()
    warning = busy_warning(load_start, os.cpu_count())
    if warning:
        print(f"compare: WARNING: {warning}", flush=True)
    records = []
    print(
        f"compare: {len(runs)} variant(s) on {args.config}, {args.steps} steps each; runs in {args.runs_dir}",
        flush=True,
    )
    for i, (name, overrides) in enumerate(runs, 1):
        prefix = f"[{i}/{len(runs)} {name}]"
        try:
            rec = run_variant(name, overrides, args, args.runs_dir / slug(name), prefix)
        except Exception as e:  # the harness itself failed for this variant: still a row, not a crash
            rec = {
                "variant": name,
                "overrides": overrides,
                "error": f"{type(e).__name__}: {e}",
                "losses": [],
                "peak_gib": None,
                "tok_s": None,
                "first_step_s": None,
                "opt_step_ms": None,
            }
            print(f"{prefix} FAILED: {rec['error']}", flush=True)
        rec["code"] = prov["code"]  # per record: a --merge file can hold rows of several commits
        records.append(rec)

    old = harness.earlier(args.out, args.merge)
    if old:
        now = {r["variant"] for r in records}
        order = [v[0] for v in variants().values()]

        def rank(r):
            base = r["variant"].removesuffix(IN_BWD_SUFFIX)
            return order.index(base) if base in order else len(order), r["variant"].endswith(IN_BWD_SUFFIX)

        records = sorted([r for r in old.get("records", []) if r["variant"] not in now] + records, key=rank)
    base = next((r for r in records if r["variant"] == FUSED and not r.get("error")), None)
    for r in records:
        r["vs_fused_paired"] = paired_ratio(r, base, args.skip_steps) if base and not r.get("error") else None
    result = {
        **prov,
        "commands": harness.commands(old, prov["command"]),
        "config": args.config,
        "overrides": list(args.overrides),
        "steps": args.steps,
        "skip_steps": args.skip_steps,
        "load_average": {"start": load_start, "end": load_average(), "cores": os.cpu_count()},
        "busy_warning": warning,
        "records": records,
    }
    harness.write_json(args.out, result)
    write_reports(result, args.out_dir, args.name, args.title or config_title(args.config))
    print(f"wrote {args.out}")
    failed = [r["variant"] for r in records if r["error"]]
    if failed:
        print(f"{len(failed)} variant(s) failed: {', '.join(failed)}")
    if warning:
        print(f"WARNING: {warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
