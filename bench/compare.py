"""Run a matrix of AdamW variants through the fine-tune recipe and compare them: table, plots, JSON.

    python bench/compare.py --config configs/tiny.yaml --steps 20 --out-dir outputs/bench_tiny
    python bench/compare.py --config configs/llama2/7B_full.yaml --variants fused,bnb8,ao8,ours8 --in-bwd \\
        --steps 15 --out bench/results/llama2_7b_h200.json checkpoint_dir=null tokenizer.path=...
    (docs/llama2_7b_h200.md has the exact H200 commands; bench/results/README.md indexes every result)

Each variant is one `tune run recipes/full_finetune_single_device.py --config CONFIG optimizer=... key=value ...`
in a fresh subprocess (so peak memory, compile caches and allocator state never leak between variants), or
`python -m recipes.full_finetune_single_device ...` where there is no `tune` script. The `key=value` (or `~key`)
arguments after the flags go to every run; the variant's own optimizer keys come after them and win. The run is
stopped once its last step is logged, before the recipe's end-of-epoch checkpoint (--keep-checkpoints: not).

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

A variant whose run fails (import error, bad kwarg, out of memory, crash) becomes a row with `error` set; the
other variants still run. Outputs, under --out-dir (or beside --out): the JSON (`--out`, default
`{out_dir}/compare.json`, with command, hardware, library versions and date), `compare.md` (the table),
`compare_loss.png` (loss curves overlaid) and `compare_memory_speed.png` (three bar panels per variant: optimizer
state GiB, peak memory GiB, tokens/s; the state is what the variants change, the peak adds the model, gradients,
activations and, on a CPU, the whole process).
With `--merge`, records already in `--out` for variants not run now are kept, so a long matrix can be run in
pieces (e.g. one device call per few variants) into one file.

The JSON records the load average before the first and after the last run (`load_average`: 1, 5 and 15 min). A
busy machine makes tokens/s and step times noise: when the load before the runs exceeds a quarter of the cores,
compare.py says so on the terminal, in the JSON (`busy_warning`) and above the table.

Variants (`--variants`, comma-separated short names or full names; `all` = every one): the third-party anchors
below, then ours, read from `optimizers.VARIANTS` when the variants are resolved (a variant registered with
`optimizers.register(...)` before that is in `all` and has its key):
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/full_finetune_single_device.py"
DIST_RECIPE = "recipes/full_finetune_distributed.py"

# The third-party anchors: short name -> (variant name = the _component_ path, with torch's backend in brackets;
# overrides). Our variants come from the registry, optimizers.VARIANTS (see variants()).
ANCHORS: Dict[str, tuple] = {
    "fused": ("torch.optim.AdamW(fused=True)", ["optimizer=torch.optim.AdamW", "optimizer.fused=True"]),
    "foreach": ("torch.optim.AdamW(foreach=True)",
                ["optimizer=torch.optim.AdamW", "optimizer.fused=False", "optimizer.foreach=True"]),
    "bnb8": ("bitsandbytes.optim.AdamW8bit", ["optimizer=bitsandbytes.optim.AdamW8bit"]),
    "ao8": ("torchao.optim.AdamW8bit", ["optimizer=torchao.optim.AdamW8bit"]),
    "ao4": ("torchao.optim.AdamW4bit", ["optimizer=torchao.optim.AdamW4bit"]),
    "aofp8": ("torchao.optim.AdamWFp8", ["optimizer=torchao.optim.AdamWFp8"]),
}
FUSED = ANCHORS["fused"][0]
# Ours when the registry cannot be read (an optimizers package without VARIANTS, or none importable).
OURS_FALLBACK: Dict[str, tuple] = {
    "ours8": ("optimizers.AdamW8bit", ["optimizer=optimizers.AdamW8bit"]),
    "ours4": ("optimizers.AdamW4bit", ["optimizer=optimizers.AdamW4bit"]),
    "oursfp8": ("optimizers.AdamWFp8", ["optimizer=optimizers.AdamWFp8"]),
    "ours16": ("optimizers.AdamW", ["optimizer=optimizers.AdamW"]),
}


def variants() -> Dict[str, tuple]:
    """Every row by short name: the anchors, then ours from ``optimizers.VARIANTS`` as it is now (read at each call,
    so a variant registered at runtime is included)."""
    try:
        import optimizers
    except ImportError:
        optimizers = None
    registry = getattr(optimizers, "VARIANTS", None)
    if not registry:
        return {**ANCHORS, **OURS_FALLBACK}
    ours = {key: (v.component, list(getattr(v, "overrides", None) or [f"optimizer={v.component}"]))
            for key, v in registry.items()}
    return {**ANCHORS, **ours}
# Optimizer-in-backward: one optimizer per parameter, stepped in the gradient hook. The recipe refuses it with
# clipping or gradient accumulation, so the in-backward run turns clipping off (a config that accumulates
# gradients gets the recipe's error in that row rather than a silently smaller batch).
IN_BWD_SUFFIX = "+in_bwd"
IN_BWD_OVERRIDES = ["optimizer_in_bwd=True", "clip_grad_norm=null"]

__doc__ += "\n".join(f"    {k:<8} {v[0]}" for k, v in ANCHORS.items()) + """
    ours16, ours8, ours4, oursfp8, ...: every key of optimizers.VARIANTS (--help lists them as registered now)
    any other dotted path, e.g. my.pkg.MyAdamW: run as optimizer=my.pkg.MyAdamW

`--in-bwd` also runs every variant with optimizer_in_bwd=True clip_grad_norm=null (name + "+in_bwd");
`--in-bwd-only` runs just those.
"""


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


def recipe_launcher(nproc: int = 0) -> List[str]:
    """`tune run recipes/...py`, or, where torchtune is on PYTHONPATH without its `tune` script (the device
    machine's copied site folder), `python -m recipes.full_finetune_single_device`, which parses the same args.
    With nproc >= 1: the distributed recipe on nproc processes (`tune run --nproc_per_node N`, or torchrun)."""
    recipe = DIST_RECIPE if nproc else RECIPE
    exe = Path(sys.executable).with_name("tune")
    tune = str(exe) if exe.exists() else shutil.which("tune")
    if tune:
        return [tune, "run"] + (["--nproc_per_node", str(nproc)] if nproc else []) + [recipe]
    module = recipe[:-3].replace("/", ".")
    if nproc:
        return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "-m", module]
    return [sys.executable, "-m", module]


def read_metrics(output_dir: Path) -> List[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    steady = metrics[min(skip_steps, len(metrics) - 1):]
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


def run_variant(name: str, overrides: List[str], args, passthrough: List[str], run_dir: Path, log_prefix: str) -> dict:
    """Run the recipe once for a variant; return its record (error set on failure)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = recipe_launcher(getattr(args, "nproc", 0)) + ["--config", args.config, f"output_dir={run_dir}", "epochs=1"]
    if args.steps:
        cmd.append(f"max_steps_per_epoch={args.steps}")
    if not args.wandb:
        cmd.append("metric_logger=null")
    # The variant's keys last, so they win over the passthrough.
    cmd += passthrough + overrides
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    log_path = run_dir / "run.log"
    t_start = time.perf_counter()
    t_setup_done, t_first_record = None, None
    tail: List[str] = []
    print(f"{log_prefix} start: {shlex.join(cmd)}", flush=True)
    timed_out = stopped = False
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1)
        timer = None
        if args.timeout:
            def kill():
                nonlocal timed_out
                timed_out = True
                proc.kill()
            timer = threading.Timer(args.timeout, kill)
            timer.start()
        for line in proc.stdout:  # text mode splits tqdm's \r updates into lines too
            now = time.perf_counter()
            log.write(line)
            line = line.rstrip("\n")
            if "epoch " in line and "it/s" in line or "s/it" in line:
                continue  # tqdm bar updates: in the log file, not in the tail or the console
            tail = (tail + [line])[-40:]
            if t_setup_done is None and "Optimizer: " in line:
                t_setup_done = now
            m = re.search(r"\bstep (\d+) \| epoch \d+ \| loss (\S+)", line)
            if m:
                if t_first_record is None:
                    t_first_record = now
                if not args.quiet:
                    print(f"{log_prefix}   step {m.group(1)} loss {float(m.group(2)):.4f}"
                          f" ({now - t_start:.0f} s)", flush=True)
                if args.steps and int(m.group(1)) == args.steps and not args.keep_checkpoints:
                    # Every number is logged: stop the run before its end-of-epoch checkpoint (for Llama2-7B
                    # about 40 GB and minutes of writing). The recipe prints the record before it appends it
                    # to metrics.jsonl, so wait for the file first.
                    deadline = time.perf_counter() + 30
                    while len(read_metrics(run_dir)) < args.steps and time.perf_counter() < deadline:
                        time.sleep(0.1)
                    stopped = True
                    proc.terminate()
        proc.wait()
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - t_start
    metrics = read_metrics(run_dir)
    record = {"variant": name, "overrides": overrides, "returncode": proc.returncode, "wall_s": wall,
              "stopped_before_checkpoint": stopped,
              "output_dir": str(run_dir), "error": None}
    record.update(summarize(metrics, args.skip_steps))
    record["first_step_s"] = (t_first_record - t_setup_done) if (t_setup_done and t_first_record) else None
    expected = args.steps
    if (proc.returncode != 0 and not stopped) or timed_out or not metrics or (expected and len(metrics) < expected
                                                            and args.log_every_one):
        error_lines = [ln for ln in tail if ln.startswith("error:")]
        error_lines = error_lines or [ln for ln in tail if re.match(r"^\w*(Error|Exception)\b", ln)]
        if timed_out:
            msg = f"timed out after {args.timeout:.0f} s"
        elif error_lines:
            msg = error_lines[-1]
        elif proc.returncode != 0:
            msg = f"exit status {proc.returncode}: " + (tail[-1] if tail else "")
        else:
            msg = f"logged {len(metrics)} of {expected} steps"
        record["error"] = msg[:500]
        record["log_tail"] = tail[-15:]
    if not args.keep_checkpoints:
        # Whatever checkpoint the recipe began (a run stopped early leaves a .tmp-* folder) or wrote.
        for ckpt in list(run_dir.glob("epoch_*")) + list(run_dir.glob("step_*")) + list(run_dir.glob(".tmp-*")):
            shutil.rmtree(ckpt, ignore_errors=True)
    status = f"FAILED: {record['error']}" if record["error"] else (
        f"peak {_fmt(record['peak_gib'], 2)} GiB, {_fmt(record['tok_s'], 0)} tok/s, first step "
        f"{_fmt(record['first_step_s'], 1)} s, opt step {_fmt(record['opt_step_ms'], 1)} ms, "
        f"final loss {_fmt(record['losses'][-1], 4)}")
    print(f"{log_prefix} done in {wall:.0f} s: {status}", flush=True)
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
    mem = "peak GiB (GPU alloc)" if kind == "gpu_alloc" else "peak GiB (CPU RSS)"
    lines = [f"| AdamW | {mem} | tokens/s | vs fused | vs fused, paired | first step s | opt step ms | state GiB | "
             "final loss | error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["error"]:
            lines.append(f"| {r['variant']} | - | - | - | - | - | - | - | - | {r['error'].replace('|', '/')} |")
            continue
        rel = f"{r['tok_s'] / base['tok_s']:.2f}x" if base and r["tok_s"] and base["tok_s"] else "-"
        paired = r.get("vs_fused_paired")
        lines.append(
            f"| {r['variant']} | {_fmt(r['peak_gib'], 2)} | {_fmt(r['tok_s'], 0)} | {rel} | "
            f"{'-' if paired is None else f'{paired:.3f}x'} | {_fmt(r['first_step_s'], 1)} | "
            f"{_fmt(r['opt_step_ms'], 1)} | {_fmt(r['opt_state_gib'], 2)} | {_fmt(_final_loss(r), 4)} | |")
    return "\n".join(lines) + "\n"


def plot(records: List[dict], out_dir: Path, title: str, name: str = "compare") -> List[str]:
    """{name}_loss.png (loss per step, overlaid) and {name}_memory_speed.png; returns the paths."""
    try:
        import matplotlib
    except ImportError:  # e.g. the device machine's image: plot here later with --replot FILE.json
        print("matplotlib is not installed: no plots (make them elsewhere with --replot FILE.json)")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
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
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=r["variant"], linestyle="--" if in_bwd else "-",
                linewidth=1.2, color=palette[i % len(palette)])
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
    panels = [("opt_state_gib", "optimizer state, GiB", 2), ("peak_gib", "peak memory, GiB (" +
              ("GPU allocated" if kind == "gpu_alloc" else "CPU RSS, whole process") + ")", 2),
              ("tok_s", "tokens/s (median, steady steps)", 0)]
    fig, axes = plt.subplots(1, 3, figsize=(12, max(2.6, 0.9 + 0.42 * len(rows))), sharey=True)
    labels = [r["variant"] for r in rows]
    colors = ["tab:orange" if lbl.startswith("optimizers.") else "tab:blue" for lbl in labels]
    hatches = ["//" if lbl.endswith(IN_BWD_SUFFIX) else "" for lbl in labels]
    for ax, (key, xlabel, digits) in zip(axes, panels):
        values = [r.get(key) or 0.0 for r in rows]
        bars = ax.barh(range(len(rows)), values, color=colors, hatch=hatches, edgecolor="white")
        for bar, r in zip(bars, rows):
            v = r.get(key)
            ax.annotate("-" if v is None else f"{v:,.{digits}f}", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=7)
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
        f"Command(s): {'; '.join(f'`{c}`' for c in commands)}\n\n" + warning + table)
    plots = plot(records, out_dir, title, name)
    print("\n" + table)
    print(f"wrote {out_dir / (name + '.md')}" + "".join(f", {p}" for p in plots))


def code_version() -> str:
    """The repository commit the runs used, with "+dirty" if recipes/ or optimizers/ had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "recipes", "optimizers"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if dirty else "")


def hardware() -> str:
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{torch.cuda.device_count()}x {p.name} ({p.total_memory / 2**30:.0f} GiB), {os.cpu_count()} CPU cores"
    return f"CPU only: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("torch", "torchtune", "torchao", "bitsandbytes", "triton"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            try:  # a copied site folder (the device) may lack dist-info
                out[pkg] = getattr(__import__(pkg), "__version__", None)
            except Exception:
                out[pkg] = None
    return out


def load_average() -> Optional[List[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def busy_warning(load: Optional[List[float]], cores: Optional[int]) -> Optional[str]:
    """A warning when other work kept more than a quarter of the cores busy before the runs (1-minute load)."""
    if not load or not cores or load[0] <= max(0.5, cores / 4):
        return None
    return (f"the machine was busy before the runs (load average {load[0]:.2f} on {cores} cores): tokens/s, step "
            "times and first-step times are noise; rerun on an idle machine")


def main(argv: Optional[List[str]] = None) -> int:
    now = "\n".join(f"    {k:<8} {v[0]}" for k, v in variants().items())
    parser = argparse.ArgumentParser(description=__doc__ + f"\nRegistered now:\n{now}\n",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/tiny.yaml", help="recipe config (default configs/tiny.yaml)")
    parser.add_argument("--variants", default="all", help="comma-separated short names, full names or class paths")
    parser.add_argument("--in-bwd", action="store_true", help="also run each variant with optimizer_in_bwd=True")
    parser.add_argument("--in-bwd-only", action="store_true", help="run only the optimizer_in_bwd=True versions")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run (max_steps_per_epoch)")
    parser.add_argument("--nproc", type=int, default=0,
                        help="run the distributed recipe (FSDP2) on this many processes / GPUs instead")
    parser.add_argument("--skip-steps", type=int, default=2, help="steps left out of the tok/s and opt-step medians")
    parser.add_argument("--out-dir", default=None, help="folder for the table, plots and runs (default: beside --out)")
    parser.add_argument("--out", default=None, help="JSON results file (default {out-dir}/compare.json)")
    parser.add_argument("--runs-dir", default=None, help="where each variant's output_dir goes (default {out-dir}/runs)")
    parser.add_argument("--merge", action="store_true", help="keep records in --out of variants not run now")
    parser.add_argument("--keep-checkpoints", action="store_true",
                        help="let each run write its epoch_0/ checkpoint and keep it (by default a run is stopped "
                             "once its last step is logged, before the checkpoint)")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per variant before it is killed")
    parser.add_argument("--wandb", action="store_true", help="keep the config's metric_logger (default: off)")
    parser.add_argument("--title", default=None, help="plot title (default: the config name)")
    parser.add_argument("--quiet", action="store_true", help="one line per variant instead of one per step")
    parser.add_argument("--name", default="compare", help="file stem of the table and plots (default compare)")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="run nothing: write the table and plots of an existing results JSON into --out-dir")
    parser.add_argument("overrides", nargs="*", help="key=value overrides passed to every run")
    args = parser.parse_args(argv)
    args.log_every_one = not any(o.startswith("log_every_n_steps=") for o in args.overrides)

    if args.replot:
        result = json.loads(Path(args.replot).read_text())
        out_dir = Path(args.out_dir or Path(args.replot).parent)
        out_dir.mkdir(parents=True, exist_ok=True)
        write_reports(result, out_dir, args.name, args.title or config_title(result["config"]))
        return 0
    if args.out is None and args.out_dir is None:
        parser.error("give --out-dir DIR or --out FILE.json")
    out_dir = Path(args.out_dir) if args.out_dir else Path(args.out).parent
    out_path = Path(args.out) if args.out else out_dir / "compare.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    runs_dir = Path(args.runs_dir) if args.runs_dir else out_dir / "runs"
    for o in args.overrides:
        if not ("=" in o or o.startswith("~")):
            parser.error(f"override {o!r} is not key=value or ~key")
    runs = resolve_variants(args.variants, "only" if args.in_bwd_only else args.in_bwd)
    if not (REPO_ROOT / args.config).is_file() and not Path(args.config).is_file():
        parser.error(f"--config {args.config} does not exist")

    command = shlex.join(["python", "bench/compare.py"] + (argv if argv is not None else sys.argv[1:]))
    load_start = load_average()
    warning = busy_warning(load_start, os.cpu_count())
    if warning:
        print(f"compare: WARNING: {warning}", flush=True)
    records = []
    print(f"compare: {len(runs)} variant(s) on {args.config}, {args.steps} steps each; runs in {runs_dir}", flush=True)
    for i, (name, overrides) in enumerate(runs, 1):
        prefix = f"[{i}/{len(runs)} {name}]"
        try:
            rec = run_variant(name, overrides, args, list(args.overrides), runs_dir / slug(name), prefix)
        except Exception as e:  # the harness itself failed for this variant: still a row, not a crash
            rec = {"variant": name, "overrides": overrides, "error": f"{type(e).__name__}: {e}", "losses": [],
                   "peak_gib": None, "tok_s": None, "first_step_s": None, "opt_step_ms": None}
            print(f"{prefix} FAILED: {rec['error']}", flush=True)
        records.append(rec)

    if args.merge and out_path.exists():
        old = json.loads(out_path.read_text())
        now = {r["variant"] for r in records}
        kept = [r for r in old.get("records", []) if r["variant"] not in now]
        order = [v[0] for v in variants().values()]
        rank = lambda r: (order.index(r["variant"].replace(IN_BWD_SUFFIX, "")) if r["variant"].replace(  # noqa: E731
            IN_BWD_SUFFIX, "") in order else len(order), r["variant"].endswith(IN_BWD_SUFFIX))
        records = sorted(kept + records, key=rank)
        commands = old.get("commands", [old.get("command")]) + [command]
    else:
        commands = [command]

    base = next((r for r in records if r["variant"] == FUSED and not r.get("error")), None)
    for r in records:
        r["vs_fused_paired"] = paired_ratio(r, base, args.skip_steps) if base and not r.get("error") else None
    title = args.title or config_title(args.config)
    result = {
        "command": command,
        "commands": commands,
        "config": args.config,
        "overrides": list(args.overrides),
        "steps": args.steps,
        "skip_steps": args.skip_steps,
        "hardware": hardware(),
        "versions": versions(),
        "code": code_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_average": {"start": load_start, "end": load_average(), "cores": os.cpu_count()},
        "busy_warning": warning,
        "records": records,
    }
    out_path.write_text(json.dumps(result, indent=1) + "\n")
    write_reports(result, out_dir, args.name, title)
    print(f"wrote {out_path}")
    failed = [r["variant"] for r in records if r["error"]]
    if failed:
        print(f"{len(failed)} variant(s) failed: {', '.join(failed)}")
    if warning:
        print(f"WARNING: {warning}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
