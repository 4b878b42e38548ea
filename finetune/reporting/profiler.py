"""The profiler: torchtune's profiler component in both recipes, its trace in the run folder, and one paragraph at
the end of the run on where a profiled step's time went (docs/recipes.md, "Profiler").

    profiler.enabled=True                     # torchtune's schedule: wait 5 steps, warm up 3, record 2, once
    profiler.wait_steps=1 profiler.warmup_steps=1 profiler.active_steps=2 profiler.num_cycles=1

``training.setup_torch_profiler`` builds the ``torch.profiler.profile`` and its trace handler, which writes each
recorded cycle to ``{profiler.output_dir}/iteration_{N}/`` (default output_dir: ``{output_dir}/profiler``): a
Chrome trace (``*.pt.trace.json.gz``, open it in https://ui.perfetto.dev or TensorBoard's profiler plugin) and
the key-averages table. The recipe steps the profiler once per optimizer step. After each cycle the same sums as the
paragraph's go to ``{profiler.output_dir}/rank{R}_summary.json`` (the recorded global steps, milliseconds per step
by category, the wall time per step), for scripts: bench/model_families.py --profile reads it per row.

The paragraph sorts the recorded time into MATMULS, ATTENTION, ELEMENTWISE, OPTIMIZER, COPIES, COMMUNICATION and
IDLE by the names of what ran: on a GPU the kernels (their device time, each with the op that launched it), on the
CPU the PyTorch ops (their self time: the CPU has no kernels of its own, so the paragraph says "CPU ops"). Anything
inside ``Optimizer.step`` (every torch.optim.Optimizer records that range, ours and third-party ones too, also when
stepped in backward) counts as optimizer. Idle is the wall time of the recorded steps not covered: on a GPU the
gaps between kernels, on the CPU the time outside any op (Python, data loading, waits).

Off (the default), nothing is built: ``step()`` is an empty call.
"""

import json
import re
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from finetune.base import BadInput

COMPONENT = "torchtune.training.setup_torch_profiler"
CATEGORIES = ("matmuls", "attention", "elementwise", "optimizer", "copies", "communication", "idle")

# Name fragments, matched against a lower-cased kernel or op name split into words at every non-alphanumeric
# character ("aten::addmm" -> aten, addmm; "triton_tem_fused_mm_0" -> ..., mm, 0). Words must match whole, the
# longer fragments anywhere in the name. Checked in this order: the first category that matches wins.
RULES = (
    (
        "communication",
        {
            "words": {"broadcast"},
            "anywhere": (
                "nccl",
                "gloo",
                "all_reduce",
                "allreduce",
                "all_gather",
                "allgather",
                "reduce_scatter",
                "reducescatter",
                "c10d",
            ),
        },
    ),
    ("attention", {"words": {"sdpa", "softmax"}, "anywhere": ("attention", "attn", "flash", "fmha", "flex")}),
    (
        "matmuls",
        {
            "words": {"mm", "bmm", "addmm", "baddbmm", "addmv", "mv", "matmul", "linear", "dot"},
            "anywhere": ("gemm", "gemv", "cublas", "cutlass", "xmma", "wgmma", "nvjet", "_scaled_mm"),
        },
    ),
    (
        "copies",
        {
            "words": {"copy", "cat", "clone", "contiguous", "to", "memcpy", "memset"},
            "anywhere": ("memcpy", "memset", "copy_kernel", "copy", "catarray"),
        },
    ),
)


# inductor's generated pointwise / reduction kernels name the ops they fuse ("triton_poi_fused__to_copy_add_mul_0"):
# one that only moves data (casts, concatenation, views, transposes) is a copy, any other computes.
FUSED_KERNEL = re.compile(r"triton_(?:poi|red|per)_fused_(.*)")
MOVES_ONLY = {
    "to",
    "copy",
    "cat",
    "clone",
    "contiguous",
    "transpose",
    "permute",
    "view",
    "unsafe",
    "expand",
    "slice",
    "select",
    "split",
    "with",
    "sizes",
    "squeeze",
    "unsqueeze",
    "reshape",
    "stack",
    "t",
    "backward",
    "",
}


def classify(name: str) -> str:
    """The category of a kernel or op, by its name; ``elementwise`` when no rule matches (pointwise ops, norms,
    reductions, the loss: everything else that computes)."""
    lowered = re.sub(r"log_?softmax", "logprobs", name.lower())  # the loss's log-softmax is not attention
    words = set(re.split(r"[^a-z0-9]+", lowered))
    fused = FUSED_KERNEL.match(lowered)
    for category, rule in RULES:
        if category == "copies" and fused:
            ops = {w for w in re.split(r"[^a-z0-9]+", fused.group(1)) if not w.isdigit()}
            return "copies" if ops <= MOVES_ONLY else "elementwise"
        if words & rule["words"] or any(fragment in lowered for fragment in rule["anywhere"]):
            return category
    return "elementwise"


def _percent(part: float, whole: float) -> str:
    """A share in whole percent; a share that is there but rounds to 0 reads "<1 %", not "0 %"."""
    pct = 100 * part / whole
    return "<1 %" if 0 < pct < 0.5 else f"{pct:.0f} %"


def _in_optimizer_step(event) -> bool:
    while event is not None:
        if event.name.startswith("Optimizer.step#") or event.name.startswith("Optimizer.zero_grad#"):
            return True
        event = event.cpu_parent
    return False


def breakdown(events) -> Dict[str, Any]:
    """Microseconds per category of one recorded cycle's events (``profile.events()``), the wall time of its steps
    and their number, and whether the times are GPU kernels (``gpu``) or CPU ops."""
    from torch.autograd import DeviceType

    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    # (on a GPU each ProfilerStep range also appears as a device-side annotation: the CPU's ranges are the steps)
    steps = [e for e in cpu_ops if e.name.startswith("ProfilerStep")]
    wall = sum(e.time_range.elapsed_us() for e in steps)
    times = {c: 0.0 for c in CATEGORIES}
    # Each kernel hangs on the op that launched it (steady steps; the first, lazily loading kernels, may hang on
    # the driver's loading events, whose category is then the kernel name's alone).
    gpu = any(k.duration > 0 for e in cpu_ops for k in e.kernels)
    for e in cpu_ops:
        in_optimizer = _in_optimizer_step(e)
        if gpu:
            for kernel in e.kernels:  # (a kernel named for no category takes its launching op's category)
                category = classify(kernel.name)
                category = "optimizer" if in_optimizer else classify(e.name) if category == "elementwise" else category
                times[category] += kernel.duration
        elif not (e.name.startswith("ProfilerStep") or e.is_user_annotation and not in_optimizer):
            times["optimizer" if in_optimizer else classify(e.name)] += e.self_cpu_time_total
    busy = sum(times.values())
    times["idle"] = max(wall - busy, 0.0)
    return {"us": times, "wall_us": max(wall, busy), "steps": len(steps), "gpu": gpu}


class Profiler:
    """``profiler`` of the config: off (the default), or torchtune's profiler with a summary of what it recorded.

    Use as ``with profiler:`` around the training loop and ``profiler.step(global_step)`` after each optimizer step;
    ``text()`` is the end-of-run paragraph (None when off).
    """

    def __init__(self, cfg_profiler: Optional[DictConfig], *, output_dir: Path, device, rank: int = 0):
        self.rank = rank
        self.enabled = bool(cfg_profiler is not None and cfg_profiler.get("enabled", False))
        self._prof = None
        self._cycles: List[Dict[str, Any]] = []
        self._dirs: List[str] = []
        self._global_steps: List[int] = []  # the global step after each profiler step
        if not self.enabled:
            return
        from torchtune import config

        resolved = OmegaConf.to_container(cfg_profiler, resolve=True)
        resolved.setdefault("_component_", COMPONENT)
        resolved.setdefault("output_dir", str(Path(output_dir) / "profiler"))
        resolved.setdefault("cuda", device.type == "cuda")  # (a CUDA activity on a CPU run only warns)
        resolved.setdefault("xpu", False)
        for key, low in (("wait_steps", 0), ("warmup_steps", 0), ("active_steps", 1), ("num_cycles", 0)):
            value = resolved.get(key)
            if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
                rule = (
                    "a positive integer"
                    if low
                    else "a non-negative integer"
                    + (" (0: a cycle after another until the end)" if key == "num_cycles" else "")
                )
                raise BadInput(f"profiler.{key}={value!r} must be {rule}; set e.g. profiler.{key}=1")
        self._prof, self.cfg = config.instantiate(OmegaConf.create(resolved))
        self.output_dir = Path(self.cfg.output_dir)
        trace_handler = self._prof.on_trace_ready

        def on_trace_ready(prof) -> None:
            trace_handler(prof)  # torchtune's: the trace and the key-averages table, per rank
            self._dirs.append(str(self.output_dir / f"iteration_{prof.step_num}"))
            self._cycles.append({**breakdown(prof.events()), "last": prof.step_num})
            (self.output_dir / f"rank{self.rank}_summary.json").write_text(json.dumps(self.summary(), indent=1) + "\n")

        self._prof.on_trace_ready = on_trace_ready

    def __enter__(self) -> "Profiler":
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)

    def step(self, global_step: int) -> None:
        if self._prof is not None:
            self._global_steps.append(global_step)
            self._prof.step()

    def summary(self) -> Optional[Dict[str, Any]]:
        """The recorded cycles so far, summed: ``steps`` (the global steps recorded), ``ms_per_step`` per category
        and ``wall_ms_per_step``, ``gpu`` (kernel times, or the CPU ops' self times), ``trace`` (the last cycle's
        folder); None when off or before the first cycle."""
        if not self._cycles:
            return None
        total = {c: sum(cycle["us"][c] for cycle in self._cycles) for c in CATEGORIES}
        wall = sum(cycle["wall_us"] for cycle in self._cycles)
        steps = sum(cycle["steps"] for cycle in self._cycles)
        recorded = [
            self._global_steps[i - 1]
            for cycle in self._cycles
            for i in range(cycle["last"] - cycle["steps"] + 1, cycle["last"] + 1)
            if 0 < i <= len(self._global_steps)
        ]
        per_step = max(steps, 1) * 1e3
        return {
            "steps": recorded,
            "recorded": steps,
            "ms_per_step": {c: round(total[c] / per_step, 4) for c in CATEGORIES},
            "wall_ms_per_step": round(wall / per_step, 4),
            "gpu": any(cycle["gpu"] for cycle in self._cycles),
            "trace": self._dirs[-1],
        }

    def text(self) -> Optional[str]:
        """One paragraph: where the recorded steps' time went, and where the trace is."""
        if not self.enabled:
            return None
        summary = self.summary()
        if summary is None:
            c = self.cfg
            return (
                f"Profiler: no step was recorded: this run trained {len(self._global_steps)} step(s), and the "
                f"schedule records steps {c.wait_steps + c.warmup_steps + 1}-"
                f"{c.wait_steps + c.warmup_steps + c.active_steps} of each cycle (lower profiler.wait_steps "
                "and profiler.warmup_steps)."
            )
        ms, wall, steps, recorded = (summary[k] for k in ("ms_per_step", "wall_ms_per_step", "recorded", "steps"))
        what = (
            "GPU time (kernels by name)"
            if summary["gpu"]
            else "CPU time (by PyTorch op: on the CPU there are no GPU kernels, so these are ops' self times)"
        )
        shares = ", ".join(f"{c} {_percent(ms[c], wall)}" for c in CATEGORIES) if wall else "nothing"
        where = f"steps {min(recorded)}-{max(recorded)}" if recorded else f"{steps} step(s)"
        return (
            f"Profiler: {where} ({steps} recorded, {wall:.1f} ms each): {what}: "
            f"{shares}. Trace: {summary['trace']} (open the .pt.trace.json.gz in https://ui.perfetto.dev or "
            f"TensorBoard; rank{self.rank}_key_averages.txt holds the top ops)."
        )
