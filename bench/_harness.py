"""What every benchmark shares: running a recipe in a fresh process, recording where a result came from, the rows.

A benchmark script parses its flags, calls ``provenance()`` first (which refuses a dirty tree), runs its work
(``run()`` for a recipe or any command in a subprocess, or in-process code), and writes one JSON with
``write_json()``. Every result file then carries:

    command   the bench command as typed (``python bench/....py --flags``), led by the variables of the environment
              that steered the runs (``TORCHINDUCTOR_DETERMINISTIC=0 python ...``); each recipe run's own command is
              in its record
    env       those variables by name (STEERING_PREFIXES), where any was set
    hardware  the GPU(s) by name and memory, or the CPU model; and the core count
    versions  python, torch, triton, torchtune, torchao, bitsandbytes, transformers, lm_eval (null: not installed)
    date      UTC, when the benchmark started
    code      ``git rev-parse HEAD``, the committed code it ran; ``<hash>+dirty`` under --allow-dirty; null where it
              cannot be told (no .git, as in a copied tree, or git failing), with the reason in ``code_note``
    code_tree a fingerprint of the files under CODE_PATHS as they were (``code_tree()``): where a copied tree's .git
              lags the files it was given (the GPU machine's copy records an old commit, "+dirty"), the commit whose
              files these are is found by it (``commit_code_tree()``; bench/merge_rows.py does)

A result is only worth keeping if its code can be named, so a benchmark refuses to start while tracked files under
CODE_PATHS have uncommitted changes (staged or not; untracked files and bench/results/ do not count). --allow-dirty
runs anyway and says so in ``code``.

Where results go: a benchmark writes into bench/results/ (the committed results, indexed in its README) only when
given ``--out bench/results/...``; by default it writes under outputs/bench/ (git-ignored), so a trial run never
overwrites a committed figure.
"""

from __future__ import annotations

import ast
import datetime
import hashlib
import importlib
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "bench" / "results"
SCRATCH = REPO_ROOT / "outputs" / "bench"
# The default data folder, as the configs name it: beside the checkout, relative to the repository root, where every
# run starts (so a result records no machine's path). repo_path() finds it for the files a benchmark opens itself.
DATA_DIR = "../shared/data"

# What a card sold as N GB leaves a run, the cap of its class: such a card reports a little under N GiB to CUDA (an
# A100 or H100 80 GB about 79.1, an RTX 5090 31.4, a 4090 23.6, a 16 GB card about 15.7, a 12 GB one 11.8), less its
# CUDA context and some room for a display. A row that completes under its cap fits that card. The 16 and 12 GB caps leave ~0.8 GiB for what nvidia-smi
# lists beside the allocator (CUDA context, loaded kernels): 15,400 and 11,400 MiB per process, measured. (Until 2026-12-04 the
# 80, 32 and 24 GB classes were capped at 80, 32 and 24 GiB: Llama2-7B's 24 GiB configs reserved 23.1 GiB there and
# ran out of memory at 22.7, bench/results/llama2_7b_24gb_card_h200.json.)
CLASS_GIB = {"80gb": 78, "32gb": 30.5, "24gb": 22.7, "16gb": 14.2, "12gb": 10.3}
# Each class's cap as the recipe's override: a run given it behaves as on a card of the class.
CAP = {c: f"device_memory_limit_gib={gib:g}" for c, gib in CLASS_GIB.items()}
# The code a result depends on. bench/results/ is excluded: it is what the benchmarks write, and a --merge into a
# committed file would otherwise make the next run of the same matrix refuse to start.
CODE_PATHS = ["finetune", "recipes", "optimizers", "eval", "configs", "bench", ":(exclude)bench/results"]
PACKAGES = ["torch", "triton", "torchtune", "torchao", "bitsandbytes", "transformers", "lm_eval"]
# In-process benchmarks import optimizers/ and recipes/ from this checkout, the code that `code` names, whatever
# else is installed (and ahead of torchtune's own `recipes` package).
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


def repo_path(path) -> Path:
    """A path as the runs see it: a relative one is taken from the repository root."""
    return REPO_ROOT / path


def scratch(name: str) -> str:
    """The default output of a benchmark: outputs/bench/NAME, git-ignored."""
    return str(SCRATCH / name)


def add_arguments(parser) -> None:
    """The flag every benchmark that records a result takes."""
    parser.add_argument(
        "--allow-dirty",
        action="store_true",
        help="run although finetune/, recipes/, optimizers/, eval/, configs/ or bench/ have uncommitted "
        "changes (the result's code is then recorded as <commit>+dirty)",
    )


def pick(parser, value: Optional[str], known, what: str, default: Sequence[str] = ()) -> List[str]:
    """The names a comma-separated option lists (none given: ``default``), in its order, each one of ``known``;
    otherwise the parser's error naming the unknown ones and the choices."""
    names = [n.strip() for n in (value or ",".join(default)).split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {', '.join(known)}")
    return names


def refuse(message: str) -> None:
    """A bad input or state: one line on stderr, exit status 2 (as the recipes and argparse do)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


# -- provenance --------------------------------------------------------------------------------------------------


class DirtyTree(Exception):
    """Tracked code has uncommitted changes: a result would not say which code made it."""


def code_version(root: Path = REPO_ROOT, allow_dirty: bool = False) -> tuple:
    """(code, note): the commit checked out in ``root``, "+dirty" with uncommitted changes under CODE_PATHS (or
    DirtyTree without allow_dirty); (None, why) where git cannot tell."""
    if not (Path(root) / ".git").exists():  # (a file, not a folder, in a git worktree)
        return None, "not a git checkout (no .git): record the commit this tree was copied from"

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60, check=True).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        changed = git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS).rstrip()
    except (OSError, subprocess.SubprocessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        return None, f"git failed: {detail[-1] if detail else type(e).__name__}"
    if not changed:
        return head, None
    if not allow_dirty:
        files = [line[3:] for line in changed.splitlines()]
        raise DirtyTree(
            f"uncommitted changes in {', '.join(files[:5])}{' ...' if len(files) > 5 else ''}: commit "
            "them so the result names the code it ran, or pass --allow-dirty"
        )
    return head + "+dirty", None


def hardware() -> str:
    """The accelerator(s), or the CPU model; and the cores. nvidia-smi first: asking torch would create a CUDA
    context in this (parent) process, which then holds GPU memory for the whole benchmark."""
    cores = f"{os.cpu_count()} CPU cores"
    try:
        out = (
            subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
                check=True,
            )
            .stdout.strip()
            .splitlines()
        )
        if out:
            name, mib = [s.strip() for s in out[0].split(",")]
            return f"{len(out)}x {name} ({float(mib) / 1024:.0f} GiB), {cores}"
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    import torch

    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{torch.cuda.device_count()}x {p.name} ({p.total_memory / 2**30:.0f} GiB), {cores}"
    model = platform.processor() or platform.machine()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    return f"CPU only: {model}, {cores}"


def versions() -> Dict[str, Optional[str]]:
    """Installed versions, None where not installed (from the dist-info, which bench/make_device_site.sh copies along
    with each package: importing lm-eval or bitsandbytes here only to ask would cost seconds)."""
    from importlib import metadata

    found = {"python": platform.python_version()}
    for pkg in PACKAGES:
        try:
            found[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            found[pkg] = None
    return found


# Environment variables that change what a run computes, or how fast: Inductor's and torch's settings
# (TORCHINDUCTOR_DETERMINISTIC, TORCH_COMPILE_DISABLE, PYTORCH_CUDA_ALLOC_CONF), Triton's, cuBLAS's, NCCL's, the
# fused cross-entropy's (CCE_AUTOTUNE), the CPU kernels' (ATEN_CPU_CAPABILITY), CUDA_LAUNCH_BLOCKING. Where a
# result's runs were steered by one, the result must say so: two rows told apart only by an exported variable
# otherwise read as the same command. What does not steer a run: where things are kept (``*_DIR``, ``*_PATH``,
# ``*_HOME``), what an image was built with (``*_VERSION``, TORCH_CUDA_ARCH_LIST), and the switches the GPU machine
# sets for every program there (NVLink multicast off: STEERING_IGNORED).
STEERING_PREFIXES = (
    "TORCHINDUCTOR_",
    "TORCH_",
    "PYTORCH_",
    "TRITON_",
    "CUBLAS_",
    "CUBLASLT_",
    "NCCL_",
    "CCE_",
    "ATEN_",
)
STEERING_NAMES = ("CUDA_LAUNCH_BLOCKING", "NVIDIA_TF32_OVERRIDE")
STEERING_IGNORED = ("TORCH_CUDA_ARCH_LIST", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def steering_env() -> Dict[str, str]:
    """The variables of this process's environment that steer the runs it starts (STEERING_PREFIXES), by name."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if (k.startswith(STEERING_PREFIXES) or k in STEERING_NAMES)
        and k not in STEERING_IGNORED
        and not k.endswith(("_DIR", "_PATH", "_HOME", "_VERSION"))
    }


def _code_dirs() -> List[str]:
    """CODE_PATHS as plain folders (their exclusions applied by ``_is_code``): git ls-tree takes no pathspec magic."""
    return [p for p in CODE_PATHS if not p.startswith(":")]


def _is_code(rel: str) -> bool:
    excluded = [p.split(")", 1)[1] for p in CODE_PATHS if p.startswith(":(exclude)")]
    return not any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in excluded)


def _fingerprint(entries: Dict[str, str]) -> str:
    """sha256 over "path blob-id" lines in path order: the same files (paths and contents) give the same value."""
    return hashlib.sha256("".join(f"{path} {blob}\n" for path, blob in sorted(entries.items())).encode()).hexdigest()


def code_tree(root: Path = REPO_ROOT) -> Optional[str]:
    """The fingerprint of the code files in ``root`` as they are on disk: each file under CODE_PATHS that git tracks
    or would (untracked and not ignored), by its path and git blob id. It names the files a run read whatever
    commit the checkout's .git records: a tree copied over an older .git (the GPU machine's) gives its own files'
    value, which ``commit_code_tree`` of the commit holding those files equals. None where git cannot list them."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *_code_dirs()],
            cwd=root, capture_output=True, timeout=60, check=True,
        ).stdout.decode()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    entries = {}
    for rel in filter(None, set(listed.split("\0"))):
        path = Path(root) / rel
        if not _is_code(rel) or not (path.is_file() or path.is_symlink()):
            continue  # (in an older index but gone from the tree)
        data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
        entries[rel] = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    return _fingerprint(entries)


def commit_code_tree(commit: str, root: Path = REPO_ROOT) -> Optional[str]:
    """``code_tree``'s fingerprint of the code files of ``commit``; None where git does not know it."""
    try:
        listed = subprocess.run(
            ["git", "ls-tree", "-r", "-z", commit, "--", *_code_dirs()],
            cwd=root, capture_output=True, timeout=60, check=True,
        ).stdout.decode()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    entries = {}
    for line in filter(None, listed.split("\0")):
        meta, rel = line.split("\t", 1)
        _, kind, blob = meta.split()
        if kind == "blob" and _is_code(rel):
            entries[rel] = blob
    return _fingerprint(entries)


def provenance(script: str, argv: List[str], allow_dirty: bool) -> dict:
    """The fields every result starts with (module docstring). Call it before any work: on a dirty tree it exits
    with status 2 unless allow_dirty. Variables of the environment that steer the runs (``steering_env``) are kept
    as ``env`` and lead the command, as a shell would take them."""
    try:
        code, note = code_version(REPO_ROOT, allow_dirty)
    except DirtyTree as e:
        refuse(str(e))
    rel = Path(script).resolve().relative_to(REPO_ROOT)
    env = steering_env()
    record = {
        "command": shlex.join([*(f"{k}={v}" for k, v in env.items()), "python", str(rel), *argv]),
        "hardware": hardware(),
        "versions": versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "code": code,
        "code_tree": code_tree(REPO_ROOT),
    }
    if note:
        record["code_note"] = note
    if env:
        record["env"] = env
    return record


def write_json(path, doc: dict) -> None:
    """Write doc to path whole or not at all (a benchmark rewrites its file after every row: an interrupted write
    must not cost the rows already measured)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def earlier(path, merge: bool) -> dict:
    """The results file a --merge run adds to ({} when not merging or when there is none yet)."""
    return json.loads(Path(path).read_text()) if merge and Path(path).exists() else {}


def commands(old: dict, command: str) -> List[str]:
    """Every command behind a merged file, oldest first (each record says which commit measured it: ``code``)."""
    return (old.get("commands") or [old["command"]] if old else []) + [command]


# -- running a recipe ----------------------------------------------------------------------------------------------


def recipe_command(recipe, *args: str, nproc: int = 0) -> List[str]:
    """The command that runs a recipe: ours by name (``full_finetune_single_device`` -> ``python -m
    recipes.full_finetune_single_device``) or any recipe file by path (ours, or torchtune's stock one). With nproc:
    under torchrun, nproc processes. ``python -m`` rather than ``tune run``: the same code path (tune run imports the
    module the same way) and it works where torchtune is on PYTHONPATH without its ``tune`` script."""
    target = [str(recipe)] if str(recipe).endswith(".py") else ["-m", f"recipes.{recipe}"]
    launcher = [sys.executable] + (["-m", "torch.distributed.run", "--nproc_per_node", str(nproc)] if nproc else [])
    return launcher + target + list(args)


# tqdm's bar updates: kept in the log file, left out of the tail that explains a failure
PROGRESS = re.compile(r"\d+(\.\d+)?(it/s|s/it)\]")


@dataclass
class Run:
    """A finished subprocess: how it ended and the last lines it printed."""

    command: str
    log: Path
    timeout: Optional[float] = None
    returncode: Optional[int] = None
    wall_s: float = 0.0
    timed_out: bool = False
    stopped: bool = False  # killed because its work was done (``until``): a success
    last_output_s: Optional[float] = None
    tail: deque = field(default_factory=lambda: deque(maxlen=40))
    # The process's resident memory at its peaks, GiB, from /proc/PID/status while it ran (None where that cannot be
    # read): its own (RssAnon + RssShmem: what the kernel cannot drop, pinned memory included) and its mapped file
    # pages (RssFile: a checkpoint read through a map, which the kernel can drop). VmRSS, the recipes' peak_rss_gib,
    # counts both, so a resume that maps its state file shows there as large as one that reads it whole.
    own_gib_peak: Optional[float] = None
    file_gib_peak: Optional[float] = None
    # The same over time, a sample each half second or more: (seconds since the start, own GiB, mapped file GiB), to
    # set beside a footprint's MemAvailable drop (bench/_runner.py's Footprint) and tell the run's share of it.
    memory_series: List[tuple] = field(default_factory=list)

    def sample_memory(self, pid: int, seconds: float = 0.0) -> None:
        from finetune.host_memory import process_status  # (here, not at the top: it imports torch)

        status = process_status(str(pid))
        if status is None or "RssAnon" not in status:
            return
        own = round((status["RssAnon"] + status.get("RssShmem", 0)) / 2**30, 2)
        mapped = round(status.get("RssFile", 0) / 2**30, 2)
        self.own_gib_peak = max(own, self.own_gib_peak or 0.0)
        self.file_gib_peak = max(mapped, self.file_gib_peak or 0.0)
        if not self.memory_series or seconds - self.memory_series[-1][0] >= 0.5:
            self.memory_series.append((round(seconds, 1), own, mapped))

    def error(self) -> Optional[str]:
        """One line on why it failed, None if it did not: the recipe's own ``error:`` line, else the last exception
        line (a rank's under torchrun, ``[rank0]: RuntimeError: ...``, not the launcher's report after it), else the
        exit status."""
        if self.timed_out:
            return f"timed out after {self.timeout:.0f} s"
        if self.stopped or self.returncode == 0:
            return None
        lines = [ln for ln in self.tail if ln.startswith("error:")]
        lines = lines or [ln for ln in self.tail if re.match(r"^(\[rank\d+\]:\s*)?\w*(Error|Exception)\b", ln)]
        return (lines[-1] if lines else f"exit status {self.returncode}: " + (self.tail[-1] if self.tail else ""))[:500]


def run(
    cmd: List[str],
    log,
    *,
    timeout: Optional[float] = None,
    until: Optional[Callable[[], bool]] = None,
    on_line: Optional[Callable[[str, float], None]] = None,
    env: Optional[Dict[str, str]] = None,
    poll_s: float = 0.25,
) -> Run:
    """Run cmd from the repository root, its output (stdout and stderr) into the file ``log``.

    on_line(line, seconds since start) sees every line as it comes. until() is polled: once true, the run's work is
    done and the process is killed (a recipe that has logged its last step need not write its end-of-epoch
    checkpoint, 40 GB at 7B). timeout: seconds before it is killed as a failure. The process leads its own process
    group, so a kill reaches its children too (torchrun's ranks, compile workers). Kills are SIGKILL: the recipes answer
    SIGTERM by saving a checkpoint, the very thing a stop is for avoiding.
    """
    # Recorded with "python" for the interpreter: its path is this machine's, its version is in `versions`.
    result = Run(shlex.join(["python" if c == sys.executable else c for c in cmd]), Path(log), timeout)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
    start = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            bufsize=1,
            start_new_session=True,
        )

        def read() -> None:  # text mode splits tqdm's \r updates into lines too
            for line in proc.stdout:
                f.write(line)
                result.last_output_s = time.monotonic() - start
                line = line.rstrip("\n")
                if line.strip() and not PROGRESS.search(line):
                    result.tail.append(line)
                if on_line is not None:
                    on_line(line, result.last_output_s)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            while proc.poll() is None:
                result.sample_memory(proc.pid, time.monotonic() - start)
                if timeout is not None and time.monotonic() - start > timeout:
                    result.timed_out = True
                    break
                if until is not None and until():
                    result.stopped = True
                    break
                reader.join(poll_s)  # a sleep that ends early when the output does
        finally:  # also on Ctrl-C, which the child, in a process group of its own, would not see
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            reader.join(30)
    result.returncode, result.wall_s = proc.returncode, round(time.monotonic() - start, 1)
    return result


def read_metrics(output_dir) -> List[dict]:
    """Our recipes' ``metrics.jsonl`` in a run folder, one dict per logged step ([] before the first), read by the
    library's reader (finetune/reporting/metrics.py; imported here, not at the top: it imports torch)."""
    from finetune.reporting.metrics import read_records
    from finetune.run_files import METRICS_FILE

    return read_records(Path(output_dir) / METRICS_FILE)


NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def read_stock_log(output_dir) -> List[dict]:
    """The steps torchtune's stock recipe logged with its DiskLogger (``{output_dir}/logs/*.txt``), in our records'
    keys: step, loss, tokens_per_second (per GPU), peak_memory_alloc_gib and peak_memory_reserved_gib (None where it
    did not log them, as GPU memory on the CPU)."""
    logs = Path(output_dir) / "logs"
    records = []
    for log in sorted(logs.glob("*.txt")) if logs.is_dir() else []:
        for line in log.read_text().splitlines():
            m = re.match(r"Step (\d+) \| (.*)", line)
            if not m:
                continue
            # key:value pairs; a tensor's value reads "tensor(1.5, device='cuda:0')"
            fields = {
                k: float(NUMBER.search(v).group(0))
                for k, v in re.findall(r"(\w+):(\S+(?:, device='[^']*'\))?)", m.group(2))
                if NUMBER.search(v)
            }
            records.append(
                {
                    "step": int(m.group(1)),
                    "loss": fields["loss"],
                    "tokens_per_second": fields["tokens_per_second_per_gpu"],
                    "peak_memory_alloc_gib": fields.get("peak_memory_alloc"),
                    "peak_memory_reserved_gib": fields.get("peak_memory_reserved"),
                }
            )
    return records


def peak(records: List[dict], key: str) -> Optional[float]:
    """The largest ``key`` over the records, to 0.01 (None where none logged it)."""
    values = [r[key] for r in records if r.get(key) is not None]
    return round(max(values), 2) if values else None


# -- the rows of every table -------------------------------------------------------------------------------------

# The third-party AdamWs ours are measured against: short key -> (name = the _component_ path, with torch's backend in
# brackets; the recipe overrides that select it). Ours are not listed here: they come from optimizers.VARIANTS, read
# when a table is made, so a newly registered variant is in every table without an edit to bench/.
ANCHORS: Dict[str, tuple] = {
    "fused": ("torch.optim.AdamW(fused=True)", ["optimizer=torch.optim.AdamW", "optimizer.fused=True"]),
    "foreach": (
        "torch.optim.AdamW(foreach=True)",
        ["optimizer=torch.optim.AdamW", "optimizer.fused=False", "optimizer.foreach=True"],
    ),
    "bnb8": ("bitsandbytes.optim.AdamW8bit", ["optimizer=bitsandbytes.optim.AdamW8bit"]),
    "ao8": ("torchao.optim.AdamW8bit", ["optimizer=torchao.optim.AdamW8bit"]),
    "ao4": ("torchao.optim.AdamW4bit", ["optimizer=torchao.optim.AdamW4bit"]),
    "aofp8": ("torchao.optim.AdamWFp8", ["optimizer=torchao.optim.AdamWFp8"]),
}


def ours() -> list:
    """Our variants, ``optimizers.Variant`` each, in registration order (read now: one registered at runtime is in)."""
    import optimizers

    return list(optimizers.VARIANTS.values())


def make_optimizer(name: str, params, **defaults):
    """An optimizer over params from a row's name: a registered key (``ours8``) or config path, any class path,
    optionally with keyword arguments (``optimizers.AdamW8bit(tile_blocks=2)``, ``torch.optim.AdamW(fused=True)``).
    defaults (lr, weight_decay) come first; a registered variant's own kwargs and the name's override them."""
    path, _, args = name.partition("(")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in ast.parse(f"f({args}").body[0].value.keywords} if args else {}
    variant = next((v for v in ours() if path in (v.key, v.component)), None)
    if variant is not None:
        cls, kwargs = variant.cls, {**variant.kwargs, **kwargs}
    else:
        module, _, attr = path.rpartition(".")
        cls = getattr(importlib.import_module(module), attr)
    return cls(params, **{**defaults, **kwargs})


# -- reporting ---------------------------------------------------------------------------------------------------


def table(headers: List[str], rows: List[List[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]) + "\n"


def pyplot():
    """matplotlib.pyplot on the file backend, or None (with a note) where it is not installed, as on the device
    machine: plots are then drawn here later from the JSON (each script's --replot)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (draw them from the JSON where it is)", flush=True)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
