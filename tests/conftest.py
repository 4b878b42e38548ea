"""Shared test helpers: run the real recipe (in a subprocess, under torchrun, or in this process) and read back
what it logged; the test-only optimizer variant. Toy model folders and other builders are in support.py.

Use from any test module (in any folder under tests/):

    from conftest import FAST, run_recipe

    def test_my_optimizer(tmp_path):
        run = run_recipe(tmp_path, "optimizer=optimizers.AdamW8bit")
        assert run.ok, run.stderr
        assert run.losses == pytest.approx(EXPECTED, rel=1e-4)

or take the ``recipe_runner`` fixture, which fills in a fresh output_dir.
"""

import contextlib
import importlib.util
import io
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import pytest
import torch

# Triton reads TRITON_INTERPRET once, when it is first imported, and torchtune (imported by
# several test modules at collection) imports it. So set it here, before any test module
# loads: without CUDA, Triton kernels (the optimizers' tests) then run in the interpreter.
_SET_TRITON_INTERPRET = not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ
if _SET_TRITON_INTERPRET:
    os.environ["TRITON_INTERPRET"] = "1"

import optimizers  # after TRITON_INTERPRET: it imports Triton
from finetune.reporting.metrics import read_records
from finetune.run_files import METRICS_FILE

REPO_ROOT = Path(__file__).resolve().parents[1]
# The data folder beside the checkout (alpaca/, llama2_tokenizer/, truthfulqa/); TEST_DATA_DIR points elsewhere (a GPU
# machine that holds the data under another path).
DATA_DIR = Path(os.environ.get("TEST_DATA_DIR") or REPO_ROOT.parent / "shared" / "data")
RECIPE = "recipes/full_finetune_single_device.py"
DISTRIBUTED_RECIPE = "recipes/full_finetune_distributed.py"
TINY_CONFIG = "configs/tiny.yaml"
EVAL_CONFIG = REPO_ROOT / "configs" / "eval" / "truthfulqa_mc2.yaml"
LLAMA2_TOKENIZER = DATA_DIR / "llama2_tokenizer" / "tokenizer.model"
TUNE = str(Path(sys.executable).with_name("tune"))


# How long a test waits for a subprocess. A wait that runs out fails the test, so a limit measures the machine's load,
# not the code: on a loaded 2-core machine a recipe run of one minute alone took over the 600 s it was once given. A
# run that should finish is therefore waited for without a limit (CI's job timeout stops a true hang); only a test
# whose subject is a hang (a process that must exit after a signal, ranks that must not deadlock) keeps a guard, and
# that guard is this: far above any run under load, still a bound.
HANG_GUARD_S = 1800


def run_command(recipe: str) -> List[str]:
    """How a test starts a recipe: ``tune run <recipe>`` through the `tune` beside this Python, as a user types it;
    where there is none (a GPU machine whose image lacks torchtune's script), the recipe file by this Python."""
    return [TUNE, "run", recipe] if Path(TUNE).is_file() else [sys.executable, recipe]


# The tiny config made smaller still, so a test run takes seconds: 1 layer of width 64,
# 64-token samples, 2 per batch, 6 optimizer steps at lr 1e-2 (large, so optimizers differ visibly) on a cosine with no warmup,
# and no wandb (ask for it with run_recipe(..., wandb=True)).
FAST = [
    "model.num_layers=1",
    "model.embed_dim=64",
    "model.num_heads=2",
    "model.num_kv_heads=2",
    "tokenizer.max_seq_len=64",
    "batch_size=2",
    "max_steps_per_epoch=6",
    "optimizer.lr=1e-2",
    "lr_scheduler.num_warmup_steps=0",
]

# FAST's losses with torch.optim.AdamW (6 steps, lr 1e-2, clip 1.0, fp32), recorded from a trusted run on the 2-core
# CPU machine (torch 2.13.0+cpu, OMP_NUM_THREADS=2): the reference the recipe tests and the loss tests compare with.
TORCH_ADAMW_LOSSES = [
    10.581151008605957,
    9.888405799865723,
    9.055519104003906,
    8.488167762756348,
    8.539437294006348,
    7.893115043640137,
]


@dataclass
class RecipeRun:
    returncode: int
    stdout: str
    stderr: str
    output_dir: Path
    metrics: List[Dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def losses(self) -> List[float]:
        return [m["loss"] for m in self.metrics]

    @property
    def error(self) -> str:
        """The run's one ``error: ...`` line (asserting there is exactly one)."""
        errors = [line for line in self.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, self.stderr[-3000:]
        return errors[0]


# A process holding an output folder's lock as a live run of the recipes does: ``python -c LOCK_HOLDER LOCK TEXT``
# takes the fcntl lock on LOCK, writes TEXT (the owner record) into it, says "holding" and keeps it for two minutes.
LOCK_HOLDER = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.lockf(fd, fcntl.LOCK_EX)
os.write(fd, sys.argv[2].encode())
print("holding", flush=True)
time.sleep(120)
"""


# Ctrl-C as a terminal's foreground job has it. A test run started as a shell's background job (`cmd &`) ignores
# SIGINT, and its children inherit that (Python in them then installs no KeyboardInterrupt handler): tests that
# Ctrl-C a recipe set it up as in a shell, ``preexec_fn=ctrl_c_as_in_a_shell`` for a child, ``python_ctrl_c`` here.
def ctrl_c_as_in_a_shell() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def python_ctrl_c():
    """This process's SIGINT raises KeyboardInterrupt (Python's default handler) during the test."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def read_metrics(output_dir: Path) -> List[Dict]:
    """The run's ``metrics.jsonl``, read by the library's one reader ([] before the first step)."""
    return read_records(Path(output_dir) / METRICS_FILE)


def pinned_inductor_cache(isa: str, unpinned: Optional[str] = None) -> str:
    """The TorchInductor cache of subprocesses pinned to ``isa``: beside the unpinned one (torch's default unless
    given), never it."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = (unpinned or default_cache_dir()).rstrip("/")
    return base if base.endswith(f"_pinned_{isa}") else f"{base}_pinned_{isa}"


def recipe_env(**extra: str) -> Dict[str, str]:
    env = dict(os.environ)
    # Same thread count everywhere, so recorded losses do not depend on the machine's core count.
    env.setdefault("OMP_NUM_THREADS", "2")
    # Same vector code everywhere: the recorded losses come from an AVX2 machine, and AVX-512 kernels (ATen's own,
    # MKL's GEMMs, oneDNN's) sum in another order, which moved some recorded losses past 1e-4 on such a machine.
    # Each variable caps the code path at AVX2 (MKL_CBWR is MKL's reproducibility mode for that), which any x86-64
    # CPU of the last decade runs.
    env.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    env.setdefault("MKL_CBWR", "AVX2")
    env.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    # ... and its own TorchInductor cache. Inductor's cache key does not include these pins: code compiled under them
    # and reused by a later unpinned run on an AVX-512 machine (a user's run after the tests) aborted with "double
    # free or corruption". Pinned runs compile into a folder named by the pin; unpinned runs keep torch's default.
    # (Always a folder of its own: torch writes TORCHINDUCTOR_CACHE_DIR into this process's environment once Inductor
    # is imported, so the variable being set says nothing about the user.)
    env["TORCHINDUCTOR_CACHE_DIR"] = pinned_inductor_cache(
        env["ATEN_CPU_CAPABILITY"], env.get("TORCHINDUCTOR_CACHE_DIR")
    )
    if _SET_TRITON_INTERPRET:
        # Set above for the in-process kernel tests only; a recipe run takes its normal path
        # (pass TRITON_INTERPRET="1" here to run Triton kernels interpreted inside the recipe).
        env.pop("TRITON_INTERPRET", None)
    env.pop("WANDB_API_KEY", None)
    env.pop("WANDB_MODE", None)
    env["WANDB_SILENT"] = "true"
    env.update(extra)
    return env


def recipe_command(
    output_dir: Path, *overrides: str, config: str = TINY_CONFIG, fast: bool = True, wandb: bool = False
) -> List[str]:
    args = [*run_command(RECIPE), "--config", config, f"data_dir={DATA_DIR}", f"output_dir={output_dir}"]
    if fast:
        args += FAST
    if not wandb:
        args.append("metric_logger=null")
    return args + list(overrides)


def run_recipe(
    output_dir: Path,
    *overrides: str,
    config: str = TINY_CONFIG,
    fast: bool = True,
    wandb: bool = False,
    timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
) -> RecipeRun:
    """Run ``tune run recipes/full_finetune_single_device.py`` from the repo root and wait.

    ``overrides`` are key=value strings placed after the defaults, so they win. ``timeout``: none by default (see
    HANG_GUARD_S).
    """
    proc = subprocess.run(
        recipe_command(output_dir, *overrides, config=config, fast=fast, wandb=wandb),
        cwd=REPO_ROOT,
        env=env or recipe_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return RecipeRun(proc.returncode, proc.stdout, proc.stderr, Path(output_dir), read_metrics(output_dir))


def run_in_one_process(runs: Dict[str, Sequence], *, wandb: bool = False) -> Dict[str, RecipeRun]:
    """``{name: (output_dir, overrides)}`` run one after another in one subprocess pinned as run_recipe's
    (recipe_env; support.run_batch: each a fresh recipe_main with `tune run`'s arguments): start-up (importing torch,
    torchtune and torchao) paid once for all of them. Each RecipeRun carries the batch's stdout and stderr; if the
    batch itself dies, every run gets its exit status."""
    import support

    skip = len(run_command(RECIPE))  # what follows `tune run <recipe>` is what run_batch takes
    items = list(runs.items())
    if not items:
        return {}
    spec = Path(items[0][1][0]).parent / "runs.json"
    spec.write_text(json.dumps([recipe_command(out, *o, wandb=wandb)[skip:] for _, (out, o) in items]))
    proc = subprocess.run(
        [sys.executable, support.__file__, str(spec)], cwd=REPO_ROOT, env=recipe_env(), capture_output=True, text=True
    )
    try:
        codes = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    except (IndexError, ValueError):
        codes = None
    codes = codes or [proc.returncode or 1] * len(items)
    return {
        name: RecipeRun(c, proc.stdout, proc.stderr, Path(out), read_metrics(out))
        for (name, (out, _)), c in zip(items, codes)
    }


def run_here(output_dir, *overrides: str, config: str = TINY_CONFIG, fast: bool = True) -> RecipeRun:
    """recipe_main in this process, as `tune run` would call it (FAST tiny unless fast=False, no metric logger, no pack
    cache), its stdout and stderr captured. No fixtures needed, so a module-scoped fixture can share a run.

    A recipe subprocess spends about 6.5 of its 11 seconds importing torch, torchtune and torchao; in this process
    they are imported once. Use a subprocess (run_recipe) where the process is the subject: its exit status as a
    shell sees it, signals, `tune run` itself, or losses recorded under the pinned vector ISA of recipe_env (this
    process is not pinned, so quantized optimizers may round differently on an AVX-512 machine)."""
    from recipes.full_finetune_single_device import recipe_main

    argv = [RECIPE, "--config", config, f"data_dir={DATA_DIR}", f"output_dir={output_dir}"]
    argv += [*(FAST if fast else []), "metric_logger=null", "pack_cache_dir=off", *overrides]
    out, err, code = io.StringIO(), io.StringIO(), 0
    # The recipes' INFO lines go through torchtune's logger, which has a stderr handler of its own only where nothing
    # handled logging when it was made (in a subprocess; under pytest the root logger has pytest's): give it this
    # run's stderr, so that run.stderr holds them as a subprocess's does.
    log, to_err = logging.getLogger("torchtune.utils._logging"), logging.StreamHandler(err)
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setattr(sys, "argv", argv)
        patch.chdir(REPO_ROOT)
        log.addHandler(to_err)
        try:
            recipe_main()
        except SystemExit as e:
            code = e.code or 0
        finally:
            log.removeHandler(to_err)
    return RecipeRun(code, out.getvalue(), err.getvalue(), Path(output_dir), read_metrics(output_dir))


def run_distributed(
    output_dir: Path,
    *overrides: str,
    nproc: int = 2,
    timeout: Optional[float] = None,
    env: Optional[Dict[str, str]] = None,
) -> RecipeRun:
    """``tune run --nproc_per_node N recipes/full_finetune_distributed.py`` on FAST tiny; nproc=0: no torchrun."""
    launch = ["--nproc_per_node", str(nproc), "--standalone"] if nproc else []
    args = [
        TUNE,
        "run",
        *launch,
        DISTRIBUTED_RECIPE,
        "--config",
        TINY_CONFIG,
        f"data_dir={DATA_DIR}",
        f"output_dir={output_dir}",
        *FAST,
        "metric_logger=null",
        *overrides,
    ]
    # One thread per rank: 2 ranks on 2 cores.
    proc = subprocess.run(
        args,
        cwd=REPO_ROOT,
        env=recipe_env(OMP_NUM_THREADS="1", **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return RecipeRun(proc.returncode, proc.stdout, proc.stderr, Path(output_dir), read_metrics(output_dir))


def eval_recipe_module():
    """recipes/evaluate.py, loaded by its file path: the name `recipes` may resolve to torchtune's own package when
    this repo isn't installed."""
    spec = importlib.util.spec_from_file_location("evaluate_recipe", REPO_ROOT / "recipes" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kill_once_saved(output_dir: Path, checkpoint: str, *overrides: str) -> None:
    """Run the recipe and SIGKILL it as soon as ``{output_dir}/{checkpoint}`` exists (a crash right after a save)."""
    proc = subprocess.Popen(
        recipe_command(output_dir, *overrides),
        cwd=REPO_ROOT,
        env=recipe_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 300
    while not (Path(output_dir) / checkpoint).exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (Path(output_dir) / checkpoint / "recipe_state.pt").exists()


def wandb_history(run_dir: Path) -> List[Dict]:
    """The history rows of an offline wandb run, read from its run-*.wandb file.

    The file is a LevelDB-style log (7-byte file header, 32 KiB blocks, records with a
    7-byte header: crc32, length, type FULL/FIRST/MIDDLE/LAST) of wandb Record protobufs.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data = next(Path(run_dir).glob("run-*.wandb")).read_bytes()
    block, pos, pending, rows = 32768, 7, b"", []

    def records():
        nonlocal pos, pending
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:  # block trailer padding
                pos += left
                continue
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            chunk = data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind == 1:
                yield chunk
            elif kind == 2:
                pending = chunk
            elif kind == 3:
                pending += chunk
            elif kind == 4:
                yield pending + chunk

    for raw in records():
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


# A variant that exists only for the tests: 8-bit AdamW under another name, registered from outside optimizers/ as a
# user's would be (``throwaway`` fixture); its component path is importable wherever tests/ is on sys.path (spawned
# ranks included).
THROWAWAY_KEY = "throwaway"
THROWAWAY_COMPONENT = "conftest.ThrowawayAdamW"


class ThrowawayAdamW(optimizers.AdamW8bit):
    """8-bit AdamW under another name."""


@pytest.fixture
def throwaway():
    """ThrowawayAdamW registered in optimizers.VARIANTS for the test (removed after)."""
    v = optimizers.register(
        optimizers.Variant(THROWAWAY_KEY, THROWAWAY_COMPONENT, ThrowawayAdamW, 2.03125, "as ours8", tol_contract=0.05)
    )
    try:
        yield v
    finally:
        del optimizers.VARIANTS[THROWAWAY_KEY]


@pytest.fixture(scope="module")
def no_environment_report():
    """lm-eval puts torch's environment report (torch.utils.collect_env: about a second and ten commands, `pip list`
    among them) into every evaluation's results; no test reads it. A module that evaluates in this process many times
    takes this fixture to leave it out (`tune run` evaluations in subprocesses still write it)."""
    from torch.utils import collect_env

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(collect_env, "get_pretty_env_info", lambda: "(not collected in the tests)")
        yield


@pytest.fixture
def recipe_runner(tmp_path):
    """run_recipe with a fresh output_dir: ``recipe_runner("optimizer=torch.optim.AdamW")``."""

    def run(*overrides: str, **kwargs) -> RecipeRun:
        return run_recipe(tmp_path / "out", *overrides, **kwargs)

    return run


def pytest_collection_modifyitems(config, items: Sequence[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
