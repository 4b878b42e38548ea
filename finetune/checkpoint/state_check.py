"""A saved optimizer state's values, checked before any optimizer loads it. Part of the checkpoint component:
``optimizer_state.restore`` calls ``check`` first, so both recipes' resumes (one process's ``load_state_dict``, and the
distributed recipe's shard-by-shard ``load_full``, which would pad a short tensor silently) refuse the same states,
each with one line naming the parameter, the value and the fix.

The checksum beside the file (``state_file.py``) finds any changed byte. These checks are what a file without one (a
checkpoint written before checksums, or one edited on purpose) still gets, and they say what is wrong in the state's
terms:

- every parameter has its entry: a missing one would start that parameter's moments again from zero while the others
  go on. The recipes' models give every parameter a gradient at every step, so a state they saved has them all.
- step counts are integers >= 0, and global_step is the step the saved lr schedule stands at.
- the moments fit their parameter: torch's tensors its shape, ours the codes of its whole blocks with finite,
  non-negative block scales (``optimizers.portable.entry_problem``).
- the param groups hold what the run was saved with: lr where the saved lr schedule stands (optimizer.lr without
  one), initial_lr the schedule's base; with the same optimizer class, betas, eps, weight_decay, maximize and amsgrad
  as this run's optimizer has them (the resume table has made the config match the recorded settings; another class
  keeps its own, as the conversion does).

Not checked: every code or moment value (a pass over the whole state at each resume, seconds per GB); a NaN there
makes the weights non-finite, and that refusal names the state the run resumed from.
"""

import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from finetune.base import BadInput
from optimizers import portable

# The hyper-parameters of AdamW's update that a param group carries and a resume must not change silently
MATH = ("betas", "eps", "weight_decay", "maximize", "amsgrad")

# One parameter's saved state: its name, its entry (None where it has none), its saved param group and that group's
# index among the lr schedule's groups
Item = Tuple[str, Any, dict, int]


class _Refusal:
    def __init__(self, where: str, fix: str):
        self.where, self.fix = where, fix

    def __call__(self, what: str) -> BadInput:
        return BadInput(f"{self.where} {what}, so it was damaged or edited after it was written; {self.fix}")


def check(
    items: Sequence[Item],
    params: Sequence[torch.Tensor],
    live_groups: Sequence[dict],
    state: dict,
    *,
    kind: str,
    same_class: bool,
    where: str,
    fix: str,
) -> None:
    """Refuse (BadInput) a saved optimizer state whose values cannot be the run's. ``items`` and ``params`` and
    ``live_groups`` (this run's param group of each parameter) follow the model's parameters; ``state`` is the
    recipe state (its lr schedule, global step and recorded settings); ``kind``: the saved class's ('ours', 'torch',
    or another: then only presence, steps and hyper-parameters are checked); ``where``: "the optimizer state in
    FILE"; ``fix``: what to do instead."""
    refuse = _Refusal(where, fix)
    lrs, bases, lr_source = _schedule(state, 1 + max((gi for *_, gi in items), default=0), refuse)
    for (name, entry, group, gi), p, live in zip(items, params, live_groups):
        if not entry:
            raise refuse(
                f"has no entry for parameter {name} (its moments would start again from zero while the others' go on)"
            )
        if not isinstance(entry, dict):
            raise refuse(f"holds a {type(entry).__name__} as the entry of parameter {name}, not a dict of its state")
        _check_step(entry, name, refuse, required=kind in ("ours", "torch"))
        problem = _tensors_problem(entry, group, p, kind)
        if problem is not None:
            raise refuse(f"does not fit parameter {name} {tuple(p.shape)}: {problem}")
        if lrs is not None and not _same(group.get("lr"), lrs[gi]):
            raise refuse(f"has lr={_show(group.get('lr'))} for parameter {name}, where {lr_source.format(lrs[gi])}")
        if bases is not None and "initial_lr" in group and not _same(group["initial_lr"], bases[gi]):
            raise refuse(
                f"has initial_lr={_show(group['initial_lr'])} for parameter {name}, where its lr schedule starts "
                f"from {bases[gi]} (lr_scheduler's base_lrs)"
            )
        for key in MATH if same_class else ():
            if key in group and key in live and not _same(group[key], live[key]):
                raise refuse(
                    f"has {key}={_show(group[key])} for parameter {name}, where the settings it was saved with "
                    f"and this run's optimizer have {key}={_show(live[key])}"
                )


def items(saved: Any, saved_bwd: bool, names: List[str], where: str, fix: str) -> Optional[List[Item]]:
    """Each parameter's ``Item`` from a saved optimizer state (one optimizer's state dict, or with ``saved_bwd``
    optimizer_in_bwd's {parameter name: one optimizer's state dict}, keyed by ``names``), refusing one whose structure
    is broken. None where there is nothing to check here: a layout of its own (torchao's CPU offload), or another
    number of parameters than ``names`` (the load refuses that as a state of another model)."""
    refuse = _Refusal(where, fix)
    if not saved_bwd:
        if "state" not in saved and "param_groups" not in saved:
            return None
        groups = _groups(saved, "", refuse)
        ids = [i for g in groups for i in g["params"]]
        index = {i: k for k, g in enumerate(groups) for i in g["params"]}
        if len(ids) != len(names):
            return None
        return [(name, saved["state"].get(i), groups[index[i]], index[i]) for name, i in zip(names, ids)]
    out = []
    for name in names:
        groups = _groups(saved[name], f" of parameter {name}", refuse)
        ids = [i for g in groups for i in g["params"]]
        if len(ids) != 1:
            return None
        out.append((name, saved[name]["state"].get(ids[0]), groups[0], 0))
    return out


def _groups(one: Any, of: str, refuse: _Refusal) -> List[dict]:
    """A torch optimizer state dict's param groups, its structure checked: {"state": {index: entry},
    "param_groups": [{"params": [index, ...], ...}, ...]} (an index: an int, or a parameter's name)."""
    if not isinstance(one, dict):
        raise refuse(f"holds a {type(one).__name__} as the optimizer state{of}, not an optimizer's state dict")
    for key, kind in (("state", dict), ("param_groups", list)):
        if not isinstance(one.get(key), kind):
            raise refuse(
                f"holds {key}={type(one.get(key)).__name__}{of}, where an optimizer's state dict has a {kind.__name__}"
            )
    groups = one["param_groups"]
    for g in groups:
        # (a parameter is an index, or its name in the state torch.distributed.checkpoint gathers)
        if (
            not isinstance(g, dict)
            or not isinstance(g.get("params"), list)
            or {type(i) for i in g["params"]} - {int, str}
        ):
            raise refuse(f"holds a param group{of} that is not a dict with a list of parameter indices")
    return groups


def _schedule(state: dict, groups: int, refuse: _Refusal) -> Tuple[Optional[List], Optional[List], str]:
    """(lr, initial lr) of each param group as the saved run left them, each None where the state does not say, and
    where the lr comes from. A recipe state always has "lr_scheduler": None for a constant lr (optimizer.lr), else
    LambdaLR's state, whose last_epoch counts every step (skipped ones too) as global_step does."""
    if "lr_scheduler" not in state:
        return None, None, ""
    schedule = state["lr_scheduler"]
    if schedule is None:
        lr = state.get("config", {}).get("lr")
        return (None if lr is None else [lr] * groups), None, "optimizer.lr is {} (a constant lr: no lr_scheduler)"
    if not isinstance(schedule, dict):
        raise refuse(f"has an lr_scheduler state that is a {type(schedule).__name__}, not a dict")
    epoch, step = schedule.get("last_epoch"), state.get("global_step")
    if isinstance(epoch, int) and isinstance(step, int) and epoch != step:
        raise refuse(f"is at global_step={step}, where the lr schedule saved with it is at step {epoch}")

    def numbers(v: Any) -> Optional[List]:
        ok = isinstance(v, list) and len(v) >= groups and all(isinstance(x, (int, float)) for x in v)
        return v if ok else None

    last = "its lr schedule stands at {} (lr_scheduler's last lr)"
    return numbers(schedule.get("_last_lr")), numbers(schedule.get("base_lrs")), last


def _check_step(entry: dict, name: str, refuse: _Refusal, required: bool) -> None:
    """A step count: a number or a one-element tensor, an integer >= 0."""
    if "step" not in entry:
        if required:
            raise refuse(f"has no step count for parameter {name}")
        return
    v = entry["step"]
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        v, ok = float(v.float()), True
    if not ok or not math.isfinite(v) or v < 0 or v != int(v):
        raise refuse(f"has step={_show(entry['step'])} for parameter {name}, where a step count is an integer >= 0")


def _tensors_problem(entry: dict, group: dict, p: torch.Tensor, kind: str) -> Optional[str]:
    if kind == "ours":
        return portable.entry_problem(entry, group, p.numel())
    if kind != "torch":  # (torchao's and other classes' layouts: their own optimizer checks them)
        return None
    for key in ("exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if "max_exp_avg_sq" in entry else [])):
        t = entry.get(key)
        if not isinstance(t, torch.Tensor) or t.shape != p.shape:
            return f"{key} is {tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}"
    return None


def _same(a: Any, b: Any) -> bool:
    """Two hyper-parameter values (numbers, bools, tensors of one element, or tuples of them) equal as floats."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(_same(x, y) for x, y in zip(a, b))
        )
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return a == b
    return x == y or math.isclose(x, y, rel_tol=1e-9)


def _show(v: Any) -> str:
    """A value as a message shows it (a one-element tensor as its number)."""
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return f"{float(v):g}"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(_show(x) for x in v) + ")"
    return f"{v!r}"
