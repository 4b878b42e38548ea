"""Every shipped config, end to end on a GPU, as a user runs it: a config without a passing row is not shipped.

    python bench/configs_check.py --checkpoint llama2=/dev/shm/llama2-7b --data-dir /tmp/data \\
        --configs llama2/7B_full_16gb_fp8,llama2/7B_full_12gb_fp8 --out bench/results/configs_check_h100.json

Per config, with the config's own settings and only checkpoint_dir, data_dir, output_dir and the run's length
overridden (plus the overrides of --set, and the class's cap where the config sets none: the 24, 32 and 80 GB
configs run as on a card of their class, ``device_memory_limit_gib`` at bench/_harness.py's CLASS_GIB):

1. a short run that writes ``step_{save_every}/`` and ``epoch_0/`` in the config's save mode (async_checkpoint);
2. a resume from ``step_{save_every}/`` in the other save mode, to its own ``epoch_0/``: its first loss must equal
   the first run's (at most FIRST_STEP_ULPS float32 steps apart: the loss kernel's own spread), its later losses
   follow the first run's as closely as a run follows itself (RESUME_RTOL), and whether its ``model.safetensors``
   equals the first run's byte for byte is recorded;
3. transformers' AutoModelForCausalLM loads the first run's ``epoch_0/``: every tensor of the file, as loaded, equals
   the file's;
4. ``recipes/evaluate.py`` scores that folder on truthfulqa_mc2 with ``limit=`` (a score in [0, 1]; the weights are
   random values, so the score says only that the folder evaluates). Steps 2-4 run side by side (the eval after the
   resume where the two would not fit the GPU together): they read what the first run wrote, nothing of each
   other's, and a row costs the device the longest of them rather than their sum;
5. the footprints of the first run: tokens/s (median of the steps after --skip-steps), the GPU memory nvidia-smi
   reports for the process (the CUDA context included: what a card must hold, not the allocator's reserved bytes),
   and the host memory it took, as the drop of MemAvailable from just before the run (what a desktop must have
   free), both sampled every half second, and the peaks while training and while a checkpoint was written (the
   epoch's save and the exit after the last step count as saving; ``phases_s`` keeps the step and save times).
   Of the resume, whose host memory is not sampled (the eval may run beside it), its process's peak resident set
   (``resumed_peak_rss_gib``, from its metrics): reading a checkpoint back is a desktop's peak too. Of both
   processes, their own memory and their mapped file pages at their peaks (``own_gib_peak``, ``file_gib_peak`` and
   the ``resumed_`` pair, sampled from /proc: bench/_harness.py's Run), which tell a memory need from pages the
   kernel can drop; the first run's over time too (``own_series``: seconds, own GiB, mapped GiB), on the clock of
   ``series``, whose samples end with MemTotal's change: set beside the drop, they tell the run's share of it from
   the kernel's and the machine's; and at the training and saving peaks, the /proc/meminfo fields that moved
   (``meminfo_change_gb``): where the part of the drop that is not the run's own went.

A row passes when all of that holds; ``limits`` (the class's card, --gpu-limit-mib/--host-limit-gb) are recorded
beside the figures and a footprint over them fails the row. The checkpoint folders are deleted after each config
(a 7B run writes ~20 GB a checkpoint). Each recipe is run as a file with ``python`` (the GPU machine has no `tune`).

``--folders DIR`` makes each model's random-valued folder when no ``--checkpoint`` names it, and ``--budget-s``
starts only the configs that should end in time, printing the rest as the next call's ``--configs``; a row whose
checkpoints would not fit where they go is refused before it runs (``disk_shortfall``; docs/benchmarks.md, "Every
shipped config, end to end").

Each row names the repository files its runs imported (``imported``: the recipes and every module of finetune/,
optimizers/ and eval/ that the run, the resume or the eval loaded, from Python's ``PYTHONPROFILEIMPORTTIME`` lines in
their logs and from each process's modules at its exit, which bench/module_record/sitecustomize.py writes: the lines
leave out a module importlib.import_module loads): bench/configs_shipped.py keeps a row current across changes to
files its runs never loaded (the MoE blocks, for a dense config).

``--speed-only`` runs only the first run, without saves, stopped once its last step is logged, and records item 5's
figures: to choose a setting (e.g. ``--set stream_layers=14``) by its tokens/s and footprints. Such a row is marked
``speed_only`` and never passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import yaml

import _harness as harness
import _runner as runner
from configs_shipped import RUN_PATHS

RECIPE = "recipes/full_finetune_single_device.py"
EVAL_RECIPE = "recipes/evaluate.py"
# Python writes a line per module a process imports, on its stderr, when this is set (children inherit it): the
# rows' runs set it so that each row can name the files they loaded. (A line may follow a progress bar's \r on the
# same line of the log: searched for, not matched from the start.)
IMPORT_TIMES = {"PYTHONPROFILEIMPORTTIME": "1"}
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+\d+ \|\s*([\w.]+)")
# Those lines leave out a module that importlib.import_module loads (finetune.streaming's lazy attributes, a config's
# _component_): the rows' runs also carry bench/module_record/ on their path, whose sitecustomize writes each
# process's modules at its exit into the folder beside the run's log (LOG.modules/).
MODULE_RECORD = Path(__file__).resolve().parent / "module_record"
IMPORTED_FROM = "import-time lines and each process's modules at exit"  # (rows before it: the lines alone)


def run_env(log: Path) -> Dict[str, str]:
    """The environment of a row's run whose output goes to ``log``: import-time lines on, and the module record on
    the path, writing into ``log``'s .modules folder."""
    path = os.pathsep.join(p for p in (str(MODULE_RECORD), os.environ.get("PYTHONPATH", "")) if p)
    return {**IMPORT_TIMES, "PYTHONPATH": path, "FINETUNE_MODULES_DIR": str(log.with_suffix(".modules"))}


# What a card of each class holds per process, by nvidia-smi (MiB), and the host memory a run of the class may take
# (GB): a 16 GB card has 16,376 MiB less the driver's and a display's share; the desktops that carry 12-16 GB cards
# mostly have 32 GB of RAM, of which the system and a desktop keep some. The 24 and 32 GB classes' cards (an RTX
# 4090, a 5090: 23.6 and 31.4 GiB to CUDA) are taken whole, as the 80 GB class's (an H100's 81,559 MiB).
GPU_LIMIT_MIB = {"16gb": 15_400, "12gb": 11_400, "24gb": 24_166, "32gb": 32_153, "80gb": 81_559}
HOST_LIMIT_GB = {"16gb": 24.0, "12gb": 24.0}
EVAL_WORK_GIB = 4  # the eval's GPU memory beside its weights (activations of a batch of choices, the CUDA context)
RESUME_RTOL = 2e-3  # (the run-to-run spread of a 7B config's loss over its first steps: 7e-4 measured)
# The first resumed step's loss is the restored weights' forward on the batch the first run took next: equal, but for
# the loss kernel's own spread. cut-cross-entropy (loss impl cce, most configs) adds the log-sum-exps of a row's
# vocabulary blocks in the order the blocks take a lock, so one forward of the same weights can land a float32 step
# away: Mistral 7B's 16 GB FP8 row at 623ba40 resumed at 9.6187172 against 9.6187162, 2**-20 apart, one step; at
# 3aecf9c the same config had resumed bit for bit. A resume that restored anything else (weights, the data's place,
# the RNG) moves a 7B model's loss by 1e-5 or more of itself, ~100 float32 steps.
FIRST_STEP_ULPS = 2
# A row's wall time by class on one H100 (configs_check rows' wall_s, 2026-12-06 and 07: 3B 12 GB 103-152 s, 3B 24 GB
# 99-141 s, 3B 80 GB 99-107 s for Llama 3.2 while Qwen2.5's 80 GB FP8 row did not end within ~170 s, 7-8B 16 GB
# 187-276 s; the 7-8B 32 and 80 GB figures are estimates from the runs' lengths), and a 7-8B folder's making (35 s, and
# the BPE's 18 s once): what --budget-s plans with until a row of the class and size has run. A 3B row takes about half
# a 7-8B one (its saves, loads and eval move 6 GB, not 15), so the two are planned apart.
ROW_SECONDS = {"12gb": 120, "16gb": 230, "24gb": 180, "32gb": 240, "80gb": 300}
ROW_SECONDS_3B = {"12gb": 155, "24gb": 145, "80gb": 190}
FOLDER_SECONDS = 60
MADE_MARK = ".made_by_configs_check"  # (in each folder --folders wrote: the only folders it ever removes)
BPE_FILE = "stand_in_bpe.json"  # (under --folders: the 7-8B folders' tokenizer, trained once)
# A checkpoint beyond its weights and optimizer state (recipe_state.pt's other entries, the tokenizer's files, the
# filesystem's own blocks): Qwen2.5 3B's 4-bit checkpoint wrote 9.46 GB, its weights and states 9.45 GB by checkpoint_gb.
DISK_MARGIN = 1.02
SAVE_FIGURES = ("checkpoint_blocked_s", "checkpoint_staged_gpu_gib", "checkpoint_staged_host_gib", "host_pinned_gib")
STEP_LINE = re.compile(r"\bstep (\d+) \| epoch")
SAVED_LINE = re.compile(r"Saved checkpoint \S*/((?:step|epoch)_\d+) ")


def card_class(config: str) -> Optional[str]:
    return next((c for c in ("16gb", "12gb", "24gb", "32gb", "80gb") if f"_{c}" in config), None)


def class_card(config: str, args) -> List[str]:
    """The override that makes this GPU a card of the config's class where the config sets no cap of its own:
    ``device_memory_limit_gib`` at the class's cap (bench/_harness.py's CLASS_GIB). Uncapped, an 80 GB GPU lends a
    24 GB config what its card would not have: a background save then copies the checkpoint into spare GPU memory
    (9 GiB for a 3B model) where a 24 GB card copies it into host memory, and the footprints are not the card's.
    Nothing where --set names a cap or a device other than CUDA (the CPU tests)."""
    cls = card_class(config)
    elsewhere = [o for o in args.set if o.startswith("device=") and not o.startswith("device=cuda")]
    if cls is None or elsewhere or setting(config, args, "device_memory_limit_gib") is not None:
        return []
    return [harness.CAP[cls]]


def setting(config: str, args, key: str):
    """A config's top-level value as this call runs it: its last --set (``key=`` or ``key._component_=``), else the
    file's (a component's ``_component_``); None where neither sets it."""
    for o in reversed(args.set):
        name, _, value = o.partition("=")
        if name in (key, f"{key}._component_"):
            return value
    value = (yaml.safe_load((harness.REPO_ROOT / "configs" / f"{config}.yaml").read_text()) or {}).get(key)
    return value.get("_component_") if isinstance(value, dict) else value


def recipe_command(config: str, folder, out: Path, args, steps: int, save_every, extra: List[str]) -> List[str]:
    """The recipe run of ``config`` on ``folder`` into ``out`` as a user types it: only the folders, the run's length
    and its saves set, metrics every step and no logger, on a card of the config's class, then --set and ``extra``."""
    cmd = [sys.executable, RECIPE, "--config", f"configs/{config}.yaml"]
    cmd += [f"checkpoint_dir={folder}", f"data_dir={args.data_dir}", f"output_dir={out}"]
    cmd += [f"max_steps_per_epoch={steps}", f"save_every_n_steps={save_every}", "log_every_n_steps=1"]
    return cmd + ["metric_logger=null", *class_card(config, args), *args.set, *extra]


def recipe_run(config: str, out: Path, args, extra: List[str], log: Path, saves: bool = True):
    """One recipe run with the footprint sampled; the save spans from its output ("Saved checkpoint" lines mark their
    ends; a save starts at the step before). ``saves=False``: no step save, and the run is stopped once its last
    step is logged, before the epoch's save."""
    save_every = args.save_every if saves else "null"
    cmd = recipe_command(config, args.resolved[config], out, args, args.steps, save_every, extra)
    lines: List[tuple] = []
    fp = runner.Footprint()
    until = None if saves else (lambda: len(harness.read_metrics(out)) >= args.steps)
    result = harness.run(
        cmd, log, timeout=args.timeout, until=until, on_line=lambda line, t: lines.append((t, line)), env=run_env(log)
    )
    fp.stop()
    metrics = harness.read_metrics(out)
    # A save runs (blocking, or beside the next steps) from the terminal line of the step it follows to its "Saved
    # checkpoint" line.
    steps = {int(m.group(1)): t for t, line in lines if (m := STEP_LINE.search(line))}
    spans = []
    for t, line in lines:
        saved = SAVED_LINE.search(line)
        if saved and steps:
            name = saved.group(1)
            step = int(name[5:]) if name.startswith("step_") else max(steps)
            spans.append((steps.get(step, 0.0), t))
    # What follows the last step (the epoch's save, the exit) is not training: a save's pages the process keeps until
    # it ends would otherwise count as the training peak.
    trained = max(steps.values()) if steps else None
    phases = {"steps": sorted(steps.items()), "saves": spans, "trained": trained}  # (seconds, as the series')
    series = fp.samples[:: max(1, len(fp.samples) // 400)]
    return result, metrics, {**fp.peaks(spans, trained), "series": series, "phases_s": phases}


def check_config(config: str, args) -> dict:
    work = Path(args.work_dir) / config.replace("/", "_")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    row: dict = {"config": config, "class": card_class(config), "checks": {}}
    checks = row["checks"]
    if args.speed_only:
        return speed_row(config, row, work, args)
    first, metrics, footprint = recipe_run(config, work / "run", args, [], work / "run.log")
    row["command"] = first.command
    row.update(footprint)
    if first.error():
        row["error"] = f"run: {first.error()}"
        _clean_up(config, work, args)  # (its log says why; a 7B run's step save would fill the disk of the next rows)
        return row
    _speed_figures(row, metrics, config, args)
    row["peak_rss_gib"] = harness.peak(metrics, "peak_rss_gib")
    row["own_gib_peak"], row["file_gib_peak"] = first.own_gib_peak, first.file_gib_peak
    row["own_series"] = first.memory_series[:: max(1, len(first.memory_series) // 400)]
    step = f"step_{args.save_every}"
    checks["saved"] = all((work / "run" / n / "model.safetensors").is_file() for n in (step, "epoch_0"))
    # The resume, in the other save mode: both modes write a step and an epoch checkpoint between the two runs.
    background = "async_checkpoint=False" not in args.set
    other = f"async_checkpoint={not background}"
    again_dir = Path(args.resume_dir or work) / (config.replace("/", "_") + "_resumed")
    shutil.rmtree(again_dir, ignore_errors=True)
    epoch_dir = work / "run" / "epoch_0"
    epoch = epoch_dir / "model.safetensors"

    def resume():
        extra = [other, f"resume_from_checkpoint={work / 'run' / step}"]
        return recipe_run(config, again_dir, args, extra, work / "resumed.log")

    def evaluation():
        return evaluate(epoch_dir, args, work / "eval.log") if epoch.is_file() else None

    # The resume, transformers' load and the eval read what the first run wrote and nothing of each other's: they
    # run side by side (the first run's footprints are measured already; the resume's are not recorded). The eval
    # waits for the resume where both would not fit the GPU together (an 80 GB config).
    with ThreadPoolExecutor(max_workers=3) as pool:
        resumed_f = pool.submit(resume)
        loads_f = pool.submit(lambda: transformers_loads(epoch_dir) if epoch.is_file() else False)
        beside = eval_fits_beside(row["class"], args.resolved[config])
        eval_f = pool.submit(evaluation) if beside else None
        second, resumed, _ = resumed_f.result()
        row["eval"] = eval_f.result() if eval_f else evaluation()
        checks["transformers_loads"] = loads_f.result()
    row["eval_beside_resume"] = beside
    # The first resumed step's loss is the restored weights' forward: equal, but for the loss kernel's spread
    # (FIRST_STEP_ULPS). Later steps follow the uninterrupted run as closely as that run follows itself:
    # FlashAttention's backward (packed_attention=varlen) sums in an order that varies from run to run, so two
    # uninterrupted 7B runs differ from their third step (by 7e-4 of the loss at step 4 on an H100); the weights
    # written at the end differ likewise.
    again_losses = [m["loss"] for m in resumed]
    expected = row["losses"][args.save_every :]
    row["resumed_first_step_ulps"] = float32_steps(again_losses[0], expected[0]) if again_losses and expected else None
    checks["resumed_first_step_equal"] = not second.error() and first_step_equal(again_losses, expected)
    row["resumed_losses"] = again_losses
    row["resumed_compiled_graphs"] = [m.get("compiled_graphs") for m in resumed]
    row["resumed_peak_rss_gib"] = harness.peak(resumed, "peak_rss_gib")  # (the load's peak included)
    row["resumed_own_gib_peak"], row["resumed_file_gib_peak"] = second.own_gib_peak, second.file_gib_peak
    row["resumed_max_rel_diff"] = max((abs(a - b) / abs(b) for a, b in zip(again_losses, expected)), default=None)
    checks["resumed_within_repeatability"] = (
        len(again_losses) == len(expected) and row["resumed_max_rel_diff"] <= RESUME_RTOL
    )
    again = again_dir / "epoch_0" / "model.safetensors"
    checks["resumed_saved"] = again.is_file()
    row["resumed_weights_equal"] = again.is_file() and epoch.is_file() and again.read_bytes() == epoch.read_bytes()
    if second.error():
        row["resume_error"] = second.error()
    checks["evaluates"] = bool(row["eval"]) and 0.0 <= row["eval"].get("truthfulqa_mc2", -1) <= 1.0
    row["imported"] = imported_files([work / "run.log", work / "resumed.log", work / "eval.log"])
    row["imported_from"] = IMPORTED_FROM
    _check_limits(row)
    row["passed"] = all(checks.values())
    _clean_up(config, work, args, again_dir)
    return row


def float32_steps(a: float, b: float) -> float:
    """How many float32 steps (units in the last place, at ``b``) apart two losses are: the recipe computes its loss
    in float32 and logs it as a Python float."""
    b32 = np.float32(b)
    return abs(float(np.float32(a)) - float(b32)) / float(np.spacing(abs(b32)))


def first_step_equal(resumed: List[float], expected: List[float]) -> bool:
    """The resume's first loss against the uninterrupted run's at the same step: at most FIRST_STEP_ULPS float32 steps
    apart (both present)."""
    return bool(resumed and expected) and float32_steps(resumed[0], expected[0]) <= FIRST_STEP_ULPS


def speed_row(config: str, row: dict, work: Path, args) -> dict:
    """--speed-only: one run of --steps steps without a save (stopped once the last step is logged), its tokens/s and
    footprints against the class's limits. A setting to choose between (--set stream_layers=N), not a config's proof:
    such a row never passes."""
    run, metrics, footprint = recipe_run(config, work / "run", args, [], work / "run.log", saves=False)
    row.update({"speed_only": True, "command": run.command, **footprint})
    if len(metrics) < args.steps:
        row["error"] = f"run: {run.error() or f'{len(metrics)} of {args.steps} steps logged'}"
        _clean_up(config, work, args)
        return row
    _speed_figures(row, metrics, config, args)
    row["peak_allocated_gib"] = harness.peak(metrics, "peak_memory_alloc_gib")
    _check_limits(row)
    _clean_up(config, work, args)
    return row


def _speed_figures(row: dict, metrics: List[dict], config: str, args) -> None:
    """A run's tokens/s (the median of the steps after --skip-steps, and every step's: a save slows the steps beside
    it), losses, peak reserved bytes, the allocator's retries, and its ratio to the family's anchor."""
    steady = [m["tokens_per_second"] for m in metrics if m["step"] > args.skip_steps]
    row["tok_s"] = round(statistics.median(steady)) if steady else None
    row["tok_s_per_step"] = [round(m["tokens_per_second"]) for m in metrics]
    # (a step slower than its neighbours: was the host thread in Python's garbage collector?)
    row["gc_ms_per_step"] = [round(m["gc_ms"]) if m.get("gc_ms") is not None else None for m in metrics]
    # (host memory a save leaves behind in torch's pinned pool: a rise after the step's save that stays)
    row["pinned_pool_gib_per_step"] = [m.get("pinned_pool_gib") for m in metrics]
    # (graphs torch.compile has built by each step, None without compile: a count still growing after step 1 means a
    # recompile, so a resumed process's first step may run another graph than the run it continues ran there)
    row["compiled_graphs_per_step"] = [m.get("compiled_graphs") for m in metrics]
    row["losses"] = [m["loss"] for m in metrics]
    # (what each step save cost training, from the record of the step after it: the snapshot's copy, and where it went;
    # a save whose host buffer the first step's plan did not fit allocates and pins one while training waits)
    row["saves_blocked_s"] = {
        m["step"] - 1: {k: m.get(k) for k in SAVE_FIGURES} for m in metrics if m.get("checkpoint_blocked_s") is not None
    }
    row["peak_reserved_gib"] = harness.peak(metrics, "peak_memory_reserved_gib")
    row["alloc_retries"] = metrics[-1].get("alloc_retries")  # a count that grows: the memory cap slows the steps
    anchor = args.anchors.get(config.split("/")[0])
    if anchor and row["tok_s"]:
        row["anchor"], row["vs_stock"] = anchor, round(row["tok_s"] / anchor["tok_s"], 3)


def imported_files(logs: List[Path]) -> List[str]:
    """The repository files the runs of these logs loaded: the recipes they ran as scripts, each module of the
    library's packages that a ``PYTHONPROFILEIMPORTTIME`` line names (its file, or its package's ``__init__.py``), and
    each such file that a process of theirs held at its exit (the module record, ``LOG.modules/``)."""
    found = {RECIPE}
    root = harness.REPO_ROOT.resolve()
    for log in logs:
        if not log.is_file():
            continue
        if log.name.endswith("eval.log"):
            found.add(EVAL_RECIPE)
        for module in IMPORT_LINE.findall(log.read_text(errors="replace")):
            if module.split(".")[0] not in RUN_PATHS:  # (what a row's code is judged by: folders, as packages)
                continue
            base = harness.REPO_ROOT / module.replace(".", "/")
            for path in (base.with_name(base.name + ".py"), base / "__init__.py"):
                if path.is_file():
                    found.add(str(path.relative_to(harness.REPO_ROOT)))
        for record in sorted(log.with_suffix(".modules").glob("*.txt")):
            for line in record.read_text(errors="replace").splitlines():
                path = Path(line).resolve()
                if path.suffix == ".py" and path.is_relative_to(root) and path.relative_to(root).parts[0] in RUN_PATHS:
                    found.add(str(path.relative_to(root)))
    return sorted(found)


def _check_limits(row: dict) -> None:
    cls, checks = row["class"], row["checks"]
    row["limits"] = {"gpu_mib": GPU_LIMIT_MIB.get(cls), "host_gb": HOST_LIMIT_GB.get(cls)}
    if row["limits"]["gpu_mib"] is not None:
        checks["gpu_within_card"] = row["gpu_mib_peak"] <= row["limits"]["gpu_mib"]
    if row["limits"]["host_gb"] is not None:
        checks["host_within_desktop"] = row["host_gb_peak"] <= row["limits"]["host_gb"]


def _clean_up(config: str, work: Path, args, *more: Path) -> None:
    """The run folders go (unless --keep); their logs, which tell why a row failed, are kept under --logs-dir."""
    if args.logs_dir:
        logs = Path(args.logs_dir)
        logs.mkdir(parents=True, exist_ok=True)
        for log in work.glob("*.log"):
            shutil.copyfile(log, logs / f"{config.replace('/', '_')}_{log.name}")
    if not args.keep:
        for folder in (work, *more):
            shutil.rmtree(folder, ignore_errors=True)


# transformers 5 holds a mixture of experts' per-expert tensors of the file stacked (``mlp.experts.gate_up_proj``
# [E, 2I, H], gate first; ``mlp.experts.down_proj`` [E, H, I]): a file's expert tensor is compared with its slice.
_HELD = """
def held(m, k):
    e = re.match(r'(.*[.]mlp[.]experts)[.](\\d+)[.](gate|up|down)_proj[.]weight$', k)
    if k in m or not e or e.group(1) + '.down_proj' not in m:
        return m.get(k)
    base, j, part = e.group(1), int(e.group(2)), e.group(3)
    if part == 'down':
        return m[base + '.down_proj'][j]
    both = m[base + '.gate_up_proj'][j]
    return both[: both.shape[0] // 2] if part == 'gate' else both[both.shape[0] // 2 :]
"""


# -- the folders: given (--checkpoint), or made under --folders as the committed rows' were ---------------------------


def model_key(config: str) -> str:
    """The model a config trains, as bench/model_families.py names it: llama3_1/8B_full_16gb_fp8 -> llama3_1_8b."""
    family, name = config.split("/")
    return f"{family}_{name.split('_')[0].lower()}"


def given_folder(config: str, args) -> Optional[str]:
    """--checkpoint's folder for the config: by its model (qwen2_5_3b=DIR), else by its configs/ folder (qwen2_5=DIR,
    which holds for every size of the family)."""
    return args.folders.get(model_key(config)) or args.folders.get(config.split("/")[0])


def folder_command(key: str, folder: Path, args) -> Optional[List[str]]:
    """The command that writes the model's random-valued HF folder, None for a model no tool here makes: Llama2-7B by
    bench/e2e.py (Llama 2's own tokenizer), the other families' by bench/model_families.py from their real
    config.json (a 32,000-token BPE trained on Alpaca as the tokenizer: one, shared, under --folders)."""
    bench = harness.REPO_ROOT / "bench"
    if key == "llama2_7b":
        tokenizer = Path(args.data_dir) / "llama2_tokenizer" / "tokenizer.model"
        return [sys.executable, str(bench / "e2e.py"), "--make-checkpoint", str(folder), "--tokenizer", str(tokenizer)]
    if key not in family_specs():
        return None
    cmd = [sys.executable, str(bench / "model_families.py"), "--make-checkpoint", str(folder), "--families", key]
    cmd += ["--bpe", str(folder.parent / BPE_FILE), "--data-dir", args.data_dir, "--rows", "ours"]
    return cmd + (["--toy"] if args.toy_folders else [])


def family_specs() -> dict:
    from _family_rows import SPECS  # (lazy: it imports the model code, which --checkpoint alone never needs)

    return SPECS


def ensure_folder(config: str, args) -> Optional[str]:
    """Sets ``args.resolved[config]``: --checkpoint's folder, or --folders/<model>, written first where it is missing.
    Unless --keep-folders, the folders this tool made there for other models go first (a 7-8B folder is 15-16 GB);
    nothing it did not make is removed. An error, or None."""
    given = given_folder(config, args)
    if given:
        args.resolved[config] = given
        return None
    key = model_key(config)
    root = Path(args.folders_dir)
    folder = root / key
    if (folder / "config.json").is_file():
        args.resolved[config] = str(folder)
        return None
    if folder.exists():
        return f"{folder} exists without a config.json and this tool did not make it: remove it, or give --checkpoint"
    root.mkdir(parents=True, exist_ok=True)
    if not args.keep_folders:
        for other in root.iterdir():
            if other.is_dir() and (other / MADE_MARK).is_file():
                shutil.rmtree(other)
    if key != "llama2_7b" and not (root / BPE_FILE).is_file():  # (as bench/model_families.py trains its own)
        from finetune.base import BadInput
        from finetune.model.toy_tokenizer import alpaca_texts, train_bpe
        from finetune.toy_folder import TINY_BPE_SIZE  # (a toy's vocabulary: the 1,024 of its config.json)

        try:
            train_bpe(alpaca_texts(args.data_dir), TINY_BPE_SIZE if args.toy_folders else 32000).save(
                str(root / BPE_FILE)
            )
        except BadInput as e:  # (no Alpaca under --data-dir: the row says so, the next config runs)
            return f"the stand-in tokenizer: {e}"
    # Written under another name, marked as this tool's, then renamed: an interrupted write leaves no folder that a
    # later call would take for a whole one, and the mark is what lets a later call remove it.
    partial = root / f"{key}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    made = harness.run(folder_command(key, partial, args), root / f"make_{key}.log", timeout=args.timeout)
    if made.error():
        shutil.rmtree(partial, ignore_errors=True)
        return f"{key}'s folder: {made.error()}"
    (partial / MADE_MARK).write_text("a random-valued folder written by bench/configs_check.py --folders\n")
    partial.rename(folder)
    print(f"{key}: random-valued folder written in {made.wall_s:.0f} s", flush=True)
    args.resolved[config] = str(folder)
    return None


def row_kind(config: str) -> tuple:
    """What a row's wall time is planned by: its class, and whether its model is a 3B one."""
    return card_class(config), "/3B_" in f"/{config}"


def budget_left(config: str, args, started: float, walls: Dict[tuple, float]) -> bool:
    """Whether --budget-s leaves time for the config's row: the longest row of its class and size so far (else
    ROW_SECONDS, ROW_SECONDS_3B), and FOLDER_SECONDS more where its folder is still to be made."""
    if args.budget_s is None:
        return True
    cls, small = row_kind(config)
    default = (ROW_SECONDS_3B if small else ROW_SECONDS).get(cls or "80gb", 300)
    need = walls.get((cls, small), default)
    if not given_folder(config, args) and not (Path(args.folders_dir) / model_key(config) / "config.json").is_file():
        need += FOLDER_SECONDS
    return time.monotonic() - started + need <= args.budget_s


def eval_fits_beside(cls: Optional[str], folder: str) -> bool:
    """Whether the eval (the folder's weights in fp32, as it scores, and a few GiB of work) fits the GPU beside a run
    of the class (its cap): on the CPU, or with no GPU to ask, it does."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout.split()
    except FileNotFoundError:
        return True
    if not out:
        return True
    fp32_gib = 2 * sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**30  # (the eval: dtype fp32)
    return harness.CLASS_GIB.get(cls or "80gb", 78) + fp32_gib + EVAL_WORK_GIB <= int(out[0]) / 1024


def checkpoint_gb(config: str, args) -> float:
    """About what one checkpoint of the config's run takes on disk (GB): per parameter of the folder (counted from
    its safetensors headers by finetune/weight_shapes.py's reader), its weight in the config's dtype and its optimizer
    state: the registered bytes of our variants (optimizers.VARIANTS: 4-bit AdamW 1.06 bytes, block scales included),
    else both moments in the weights' dtype (torch's AdamW)."""
    from finetune.weight_shapes import read_shapes  # (lazy: torch, for a row that runs)
    from optimizers import VARIANTS

    folder = Path(args.resolved[config])
    shapes = read_shapes(folder, sorted(folder.glob("*.safetensors")), fix="make the folder again (--folders)")
    elements = sum(math.prod(shape) for shape, _ in shapes.values())
    weight = 4 if str(setting(config, args, "dtype")) in ("fp32", "float32") else 2
    ours = [v for v in VARIANTS.values() if v.component == setting(config, args, "optimizer")]
    return elements * (weight + (ours[0].bytes_per_param if ours else 2 * weight)) / 1e9


def disk_shortfall(config: str, args) -> Optional[str]:
    """Why the row's checkpoints would not fit where they go, or None: the first run's step and epoch saves in
    --work-dir and the resume's epoch save in --resume-dir (all three where the two share a filesystem), each
    checkpoint_gb, against the free space there. A row that would fill the disk at its epoch save spends minutes of
    the device call and fails; Llama2-7B's 80 GB config with torch's AdamW writes 40 GB a checkpoint."""
    one = checkpoint_gb(config, args)
    need: Dict[int, list] = {}  # filesystem -> [a folder on it, GB, what goes there]
    for folder, saves, what in (
        (args.work_dir, 2, "the run's step and epoch saves"),
        (args.resume_dir, 1, "the resume's epoch save"),
    ):
        where = Path(folder or args.work_dir).absolute()
        while not where.exists():
            where = where.parent
        entry = need.setdefault(where.stat().st_dev, [where, 0.0, []])
        entry[1] += saves * one
        entry[2].append(what)
    for where, gb, what in need.values():
        free = shutil.disk_usage(where).free / 1e9
        if gb * DISK_MARGIN > free:
            return (
                f"{' and '.join(what)} take about {gb:.0f} GB ({one:.1f} GB a checkpoint) and {where} has {free:.0f} GB "
                "free: give --work-dir or --resume-dir on a filesystem with room (on the GPU machine /dev/shm holds what "
                "its disk does not)"
            )
    return None


def transformers_loads(folder: Path) -> bool:
    """In a process of its own (its memory is not the run's): transformers loads the folder, and every tensor the
    file holds equals the model's, bit for bit."""
    code = (
        "import re, sys, torch; from safetensors.torch import load_file; from transformers import AutoModelForCausalLM\n"
        + _HELD
        + "f = sys.argv[1]; m = AutoModelForCausalLM.from_pretrained(f, dtype='auto').state_dict()\n"
        "s = load_file(f + '/model.safetensors')\n"
        "bad = [k for k in s if held(m, k) is None or not torch.equal(held(m, k), s[k])]\n"
        "print('mismatch', bad[:5]) if bad else print('equal', len(s)); sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(folder)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"transformers could not load {folder} as written: {(proc.stdout + proc.stderr)[-1500:]}", flush=True)
    return proc.returncode == 0


def evaluate(folder: Path, args, log: Path) -> Optional[Dict[str, float]]:
    cmd = [sys.executable, EVAL_RECIPE, "--config", "configs/eval/truthfulqa_mc2.yaml", f"checkpoint_dir={folder}"]
    cmd += [f"data_dir={args.data_dir}", f"limit={args.eval_limit}", "training_run=False", f"output_dir={log.parent}"]
    cmd += args.eval_set
    result = harness.run(cmd, log, timeout=args.timeout, env=run_env(log))
    if result.error():
        return {"error": result.error()}
    found = sorted(log.parent.rglob("results*.json"))
    if not found:
        return {"error": "no results file"}
    scores = json.loads(found[-1].read_text())["results"]["truthfulqa_mc2"]
    return {"truthfulqa_mc2": next(v for k, v in scores.items() if k.startswith("acc") and "stderr" not in k)}


# The host link's copy rates, pinned memory to the GPU and back: a streamed config moves its weights over this link
# every step, so its tokens/s follows the machine's link (the lent machines' PCIe 5.0 x16 gave ~55 GB/s, but rows of
# one config on two machines have differed by 2x): each row keeps the rates its call measured.
_LINK = """
import json, time, torch
x = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
y = torch.empty_like(x, device="cuda")
rates = {}
for name, dst, src in (("host_to_gpu_gbs", y, x), ("gpu_to_host_gbs", x, y)):
    dst.copy_(src, non_blocking=True); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(4):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rates[name] = round(4 * x.numel() / (time.perf_counter() - t) / 1e9, 1)
print(json.dumps(rates))
"""


def link_rates(args) -> Optional[Dict[str, float]]:
    """The copy rates of this machine's host link (_LINK), measured in a process of its own before the rows; None off
    CUDA (--set device=cpu) or where the measurement fails (a row does not depend on it)."""
    if any(o.startswith("device=") and not o.startswith("device=cuda") for o in args.set):
        return None
    try:
        proc = subprocess.run([sys.executable, "-c", _LINK], capture_output=True, text=True, timeout=120)
        return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def read_anchor(family: str, path: Path) -> dict:
    """The stock low-memory row of a results file measured in the same device call (bench/e2e.py's rows are Llama2's;
    bench/model_families.py's name their family, e.g. llama3_1_8b for configs/llama3_1/)."""
    try:
        records = json.loads(path.read_text())["records"]
    except (OSError, ValueError, KeyError) as e:
        harness.refuse(f"--anchor {family}={path}: not a results file with records ({e})")
    for r in records:
        if r.get("name") == "stock_low_memory" and r.get("tok_s") and str(r.get("family") or family).startswith(family):
            return {"tok_s": r["tok_s"], "command": r.get("command"), "file": path.name}
    harness.refuse(f"--anchor {family}={path}: no measured stock_low_memory row of {family} in it")


def parse_args(argv: List[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", required=True, help="comma-separated, as under configs/ without .yaml")
    ap.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="a model's HF folder, by model (qwen2_5_3b=DIR) or by configs/ folder (qwen2_5=DIR: every size)",
    )
    ap.add_argument(
        "--folders",
        dest="folders_dir",
        metavar="DIR",
        help="where the models that --checkpoint does not name get their random-valued folders, made when missing "
        "(one at a time unless --keep-folders; /dev/shm on the GPU machine keeps the disk for the checkpoints)",
    )
    ap.add_argument("--keep-folders", action="store_true", help="keep the other models' folders under --folders")
    ap.add_argument("--toy-folders", action="store_true", help=argparse.SUPPRESS)  # (tests: toy sizes, on the CPU)
    ap.add_argument(
        "--budget-s",
        type=float,
        help="start a config only where its row (and its folder) should end within this many seconds of the start; "
        "the configs left are printed as the next call's --configs",
    )
    ap.add_argument("--data-dir", default=harness.DATA_DIR)
    ap.add_argument("--work-dir", default=harness.scratch("configs_check"))
    ap.add_argument(
        "--resume-dir",
        help="where the resumed run writes (default: --work-dir; a second disk keeps a 7B's 60 GB apart)",
    )
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--skip-steps", type=int, default=2, help="steps left out of the tokens/s median")
    ap.add_argument("--eval-limit", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--set", action="append", default=[], help="an override for every training run (key=value)")
    ap.add_argument("--eval-set", action="append", default=[], help="an override for every eval (key=value)")
    ap.add_argument(
        "--anchor",
        action="append",
        default=[],
        metavar="FAMILY=JSON",
        help="bench/e2e.py's or bench/model_families.py's results of the same call: its stock_low_memory row is the "
        "family's anchor (each row's vs_stock)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the run folders")
    ap.add_argument(
        "--speed-only",
        action="store_true",
        help="one run per config without saves, stopped after --steps: tokens/s and footprints only (a setting to "
        "choose between; such a row never passes)",
    )
    ap.add_argument("--logs-dir", help="copy each config's run, resume and eval logs here")
    ap.add_argument("--out", default=harness.scratch("configs_check.json"))
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    args.folders = dict(item.split("=", 1) for item in args.checkpoint)
    args.resolved = {}  # config -> the folder it runs on (ensure_folder)
    args.anchors = {family: read_anchor(family, Path(path)) for family, path in (a.split("=", 1) for a in args.anchor)}
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if not (harness.REPO_ROOT / "configs" / f"{c}.yaml").is_file():
            harness.refuse(f"--configs: no configs/{c}.yaml")
        if given_folder(c, args):
            continue
        if not args.folders_dir:
            harness.refuse(f"--configs {c}: give its HF folder with --checkpoint {model_key(c)}=DIR, or --folders DIR")
        if folder_command(model_key(c), Path(args.folders_dir) / model_key(c), args) is None:
            harness.refuse(
                f"--configs {c}: no tool here makes {model_key(c)}'s folder; give it with --checkpoint {model_key(c)}=DIR"
            )
    if args.folders_dir:  # (each model's configs one after another: its folder is made once)
        order = list(dict.fromkeys(model_key(c) for c in args.configs))
        args.configs.sort(key=lambda c: order.index(model_key(c)))
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    doc = {**harness.provenance(__file__, argv, args.allow_dirty), "weights": "random values", "rows": []}
    started, walls, not_run = time.monotonic(), {}, []
    link = link_rates(args)
    if link:
        doc["link"] = link
    for config in args.configs:
        if not_run or not budget_left(config, args, started, walls):
            not_run.append(config)  # (in order: the next call starts where this one stopped)
            continue
        start = time.monotonic()
        error = ensure_folder(config, args)
        folder_s, start = time.monotonic() - start, time.monotonic()
        if error:
            row = {"config": config, "class": card_class(config), "checks": {}, "error": f"folder: {error}"}
        elif not args.speed_only and (short := disk_shortfall(config, args)):
            row = {"config": config, "class": card_class(config), "checks": {}, "error": f"disk: {short}"}
        else:
            row = check_config(config, args)
        if doc.get("env"):  # (a row merged into another file keeps what steered it)
            row["env"] = doc["env"]
        if link:  # (and its call's host link: a streamed config's tokens/s follows it)
            row["link"] = link
        row["wall_s"] = round(time.monotonic() - start)  # the whole check: what a device call must budget for it
        row["folder_s"] = round(folder_s)  # (its model's folder made first: 0 where it was there)
        kind = row_kind(config)
        walls[kind] = max(walls.get(kind, 0), row["wall_s"])
        doc["rows"].append(row)
        harness.write_json(args.out, doc)
        verdict = "PASS" if row.get("passed") else f"FAIL {row.get('error') or row['checks']}"
        if row.get("speed_only") and not row.get("error"):
            verdict = f"speed only, {row['checks']}"
        print(
            f"{config}: {verdict}; {row.get('tok_s')} tok/s ({row.get('vs_stock')}x stock), GPU {row.get('gpu_mib_peak')} MiB, host "
            f"{row.get('host_gb_peak')} GB (training {row.get('host_gb_peak_training')}, saving "
            f"{row.get('host_gb_peak_saving')}; compile workers {row.get('compile_workers_gb_peak')}), "
            f"eval {row.get('eval')}; allocator retries {row.get('alloc_retries')}; {row['wall_s']} s",
            flush=True,
        )
    if not_run:
        doc["not_run"] = not_run
        harness.write_json(args.out, doc)
        print(f"not run within --budget-s {args.budget_s:.0f}: --configs {','.join(not_run)}", flush=True)


if __name__ == "__main__":
    main()
