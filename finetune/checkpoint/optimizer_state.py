"""The optimizer state in a checkpoint: one format per optimizer, whatever the rank count that wrote it, and the
conversion when a resume names another AdamW variant. Part of the checkpoint component (``resume.py`` reads the
file; the recipes call ``restore`` and ``gather_full``).

The format is what the optimizer's ``state_dict()`` holds on one device: full, unsharded tensors per parameter index
(torch.optim: tensors shaped like the parameter; ours, ``optimizers.*``: codes and block scales of the whole tensor,
blocks counted from its first element: ``optimizers/portable.py``). The single-device recipe writes its optimizer's
``state_dict()`` (with optimizer_in_bwd, one per parameter name: torchtune's wrapper, or
``finetune.streaming.StreamedStates``, whose ``state_dict`` is the same); the distributed one gathers the ranks'
shards into that format on rank 0 (``gather_full``), and every rank takes its shard back out of it (``load_full``),
for any rank count.

Another optimizer at resume (``convert``): the moments are decoded to fp32 and stored in the new class's format,
step counts kept, with one warning line. What converts, and what is refused with the reason, is ``convertible``;
docs/recipes.md ("What may change at a resume") prints the rules.

Another ``optimizer_in_bwd`` at resume: the two layouts hold the same per-parameter entries, keyed by parameter name
(one optimizer per parameter) or by position in ``model.parameters()`` (one optimizer over all), so ``restore`` only
re-keys them (``_join``, ``_split``): moments and step counts as saved, nothing rounded, each parameter's param group
(lr, betas, ...) carried; with another class too, the entries are then converted as above. The lr schedule needs
nothing: both layouts drive one LambdaLR over one param group (with optimizer_in_bwd, the first parameter's
optimizer's, whose lr torchtune's wrapper copies to the others after each step), so its saved state loads as it is.
"""

import math
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from finetune.base import BadInput
from finetune.checkpoint import state_check, state_file
from optimizers import portable

# Optimizers whose state we can read as AdamW moments (exp_avg, exp_avg_sq and a step count) and, as a target, write.
_TORCH_ADAM = ("torch.optim.AdamW", "torch.optim.Adam")
_REFUSED = (
    (
        "bitsandbytes.",
        "bitsandbytes keeps its moments in its own layout (state1/state2 with dynamic-map codes, paged buffers), "
        "which this recipe does not decode",
    ),
    (
        "torchao.optim.CPUOffloadOptimizer",
        "its state sits in one inner optimizer per parameter on the CPU, a layout of its own",
    ),
)
_TO_TORCHAO = (
    "torchao's optimizers make their states at their first step and choose per shard whether to quantize (a shard "
    "whose size is not a multiple of the block keeps fp32), so a converted state would depend on the rank count"
)


def _kind(path: str) -> str:
    """'ours', 'torch', 'torchao' or 'other' for an optimizer class path."""
    if path.startswith("optimizers."):
        return "ours"
    if path in _TORCH_ADAM:
        return "torch"
    if path.startswith("torchao.optim.") and "CPUOffload" not in path:
        return "torchao"
    return "other"


def convertible(saved: str, now: str) -> Optional[str]:
    """Why a state written by ``saved`` (a class path) cannot be continued by ``now``, or None if it can. The same
    class always can; any two of ours and torch's Adam/AdamW can (the same moments, stored differently); torchao's
    low-bit states convert out but not in; anything else (bitsandbytes, CPU offload, an optimizer without a second
    moment such as SGD) cannot."""
    if saved == now:
        return None
    for prefix, why in _REFUSED:
        for path in (saved, now):
            if path.startswith(prefix):
                return f"{path}: {why}"
    if _kind(now) == "torchao":
        return f"{now}: {_TO_TORCHAO}"
    for path in (saved, now):
        if _kind(path) == "other":
            return (
                f"{path} is not one of the AdamW variants whose moments carry over (optimizers.*, torch.optim.AdamW "
                "or Adam, torchao.optim's low-bit ones as the source): with no second moment, or one we cannot "
                "read, there is nothing to carry"
            )
    return None


# -- reading and writing one parameter's moments ------------------------------------------------------------------


def _read(entry: dict, group: dict, numel: int) -> Dict[str, torch.Tensor]:
    """One saved entry as fp32 moments [numel] and its step."""
    if "state_format" in group:
        out = portable.moments(entry, portable.saved_format(entry, group), numel)
    else:
        if "exp_avg" not in entry or "exp_avg_sq" not in entry:  # (convertible lets only Adam-family classes here)
            raise BadInput(f"a saved optimizer state has no moments to carry (keys {sorted(entry)})")
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            t = entry[key]
            t = t.dequantize() if type(t) is not torch.Tensor and hasattr(t, "dequantize") else t  # torchao's
            out[key] = t.detach().float().reshape(-1).cpu()
    step = entry.get("step", 0)
    out["step"] = float(step) if not isinstance(step, torch.Tensor) else float(step.float().item())
    return out


def _write(values: Dict[str, torch.Tensor], optimizer, p: torch.Tensor) -> dict:
    """fp32 moments as ``optimizer``'s entry for parameter ``p`` (full shape: a DTensor's global one)."""
    step = torch.tensor(values["step"], dtype=torch.float32)
    if hasattr(optimizer, "param_format"):  # optimizers.*: the format it gives this tensor (tiny ones: fp32)
        return portable.encode(values, optimizer.param_format(p), step)
    return {
        "step": step,
        **{k: values[k].to(p.dtype).view(p.shape) for k in ("exp_avg", "exp_avg_sq")},
    }


def _groups(saved_groups: List[dict], optimizer) -> List[dict]:
    """``optimizer``'s own param groups (its format, its flags) with the saved lr, initial_lr and parameter ids:
    the schedule continues, the hyper-parameters are the live ones (read_resume checked they match)."""
    out = []
    for sg, g in zip(saved_groups, optimizer.param_groups):
        group = {k: v for k, v in g.items() if k != "params"}
        group.update({k: sg[k] for k in ("lr", "initial_lr") if k in sg})
        out.append({**group, "params": list(sg["params"])})
    return out


def convert_one(saved: dict, optimizer, params: List[torch.Tensor]) -> Tuple[dict, int, bool]:
    """A torch-style state dict (full tensors) of another Adam-family class as ``optimizer``'s, for ``params`` in
    its order. Returns (state dict, parameters converted, whether compensation buffers were dropped)."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise BadInput("the saved optimizer state has another number of param groups than this optimizer")
    ids = [i for g in saved["param_groups"] for i in g["params"]]
    group_of = {i: g for g in saved["param_groups"] for i in g["params"]}
    state, dropped = {}, False
    if len(ids) != len(params):
        raise BadInput(f"the saved optimizer state has {len(ids)} parameters, this model {len(params)}")
    for pid, p in zip(ids, params):
        entry = saved["state"].get(pid)
        if not entry:
            continue
        if entry.get("max_exp_avg_sq") is not None or getattr(optimizer, "defaults", {}).get("amsgrad"):
            raise BadInput("amsgrad's running maximum of v has no counterpart in the other class")
        dropped |= "error" in entry
        state[pid] = _write(_read(entry, group_of[pid], p.numel()), optimizer, p)
    return {"state": state, "param_groups": _groups(saved["param_groups"], optimizer)}, len(state), dropped


def _describe(optimizer) -> str:
    fmt = getattr(optimizer, "format", None)
    if fmt is not None:
        return f"{fmt.name} codes" + (f" in blocks of {fmt.block_size}" if fmt.scaled else "")
    return "tensors in the parameters' dtype"


def _saved_in_bwd(state: dict) -> bool:
    """Whether ``state["optimizer"]`` is optimizer_in_bwd's {parameter name: one optimizer's state dict}: as the run
    recorded it, or (a file without the record) by its shape. (Not by the absence of "param_groups" alone: torchao's
    CPU offload saves {"offloaded": [...]}, one optimizer's state.)"""
    recorded = state.get("config", {}).get("optimizer_in_bwd")
    if recorded is not None:
        return bool(recorded)
    saved = state["optimizer"]
    return bool(saved) and all(isinstance(v, dict) and "param_groups" in v for v in saved.values())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


_WRAPPED = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, in the names of the layers it wraps


def _by_name(per_name: Dict[str, dict], names: List[str]) -> Dict[str, dict]:
    """optimizer_in_bwd's saved states keyed by this model's parameter names (``names``): a parameter's name is the
    same with and without activation checkpointing's wrapper, which a resume may turn on or off."""
    if list(per_name) == names:
        return per_name
    saved = {n.replace(_WRAPPED, ""): v for n, v in per_name.items()}
    missing = [n for n in names if n.replace(_WRAPPED, "") not in saved]
    if missing or len(saved) != len(names):
        extra = sorted(set(saved) - {n.replace(_WRAPPED, "") for n in names})
        raise ValueError(f"the saved per-parameter optimizer states do not fit this model ({(missing or extra)[:3]})")
    return {n: saved[n.replace(_WRAPPED, "")] for n in names}


def _join(per_name: Dict[str, dict], names: List[str]) -> dict:
    """optimizer_in_bwd's states (``_by_name``'s) as one optimizer's over the parameters ``names``
    (``model.named_parameters()``): entry i is parameter i's, as saved. The param group is the first parameter's
    (the lr schedule's optimizer, the one with ``initial_lr``); the others' must equal it, as torchtune's wrapper
    keeps them."""
    state, group = {}, None
    for i, name in enumerate(names):
        groups = per_name[name]["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != 1:
            raise ValueError(f"the saved optimizer state of {name} is not one parameter's")
        entry = per_name[name]["state"].get(groups[0]["params"][0])
        if entry:
            state[i] = entry
        mine = {k: v for k, v in groups[0].items() if k != "params"}
        group = group or mine
        differ = [k for k in set(group) | set(mine) if k != "initial_lr" and not _same(group.get(k), mine.get(k))]
        if differ:
            raise ValueError(
                f"the per-parameter optimizers' {differ[0]} differ ({names[0]}, {name}): one optimizer has one value"
            )
    return {"state": state, "param_groups": [{**group, "params": list(range(len(names)))}]}


def _split(one: dict, names: List[str]) -> Dict[str, dict]:
    """One optimizer's state as optimizer_in_bwd's {parameter name: one optimizer's state dict}: each parameter's
    entry as saved, with its param group (lr, initial_lr, betas, ...)."""
    ids = [i for g in one["param_groups"] for i in g["params"]]
    if len(ids) != len(names):
        raise ValueError(f"the saved optimizer state has {len(ids)} parameters, this model {len(names)}")
    group_of = {i: g for g in one["param_groups"] for i in g["params"]}
    out = {}
    for name, pid in zip(names, ids):
        entry = one["state"].get(pid)
        group = {k: v for k, v in group_of[pid].items() if k != "params"}
        out[name] = {"state": {0: entry} if entry else {}, "param_groups": [{**group, "params": [0]}]}
    return out


def restore(
    state: dict,
    optimizers: list,
    model: torch.nn.Module,
    *,
    now: str,
    in_bwd: bool = False,
    log=None,
    source: Optional[Path] = None,
) -> Any:
    """``state["optimizer"]`` as the live optimizer(s) load it: as saved when the class and the layout are the ones
    that saved it, else re-keyed to this run's layout and/or converted to its class (one warning line saying what
    changed). ``optimizers``: the recipe's list (one, or with ``in_bwd`` (optimizer_in_bwd=True) one per parameter,
    in ``model.parameters()`` order). Its values are checked first (``state_check``: a BadInput naming ``source``,
    the file it was read from, and the parameter), whichever recipe loads it."""
    saved_path = state.get("config", {}).get("optimizer") or now
    saved = state["optimizer"]
    if saved is None:
        return saved
    saved_bwd = _saved_in_bwd(state)
    names = [n for n, _ in model.named_parameters()]
    if saved_bwd:
        saved = _by_name(saved, names)
    _check(
        state,
        saved,
        saved_bwd,
        names,
        optimizers,
        model,
        same_class=saved_path == now,
        kind=_kind(saved_path),
        source=source,
    )
    other_class, other_layout = saved_path != now, saved_bwd != in_bwd
    if not other_class and not other_layout:
        return saved
    if other_class:
        why = convertible(saved_path, now)
        if why is not None:  # (read_resume refuses these first; kept for a caller that did not)
            raise BadInput(f"optimizer={now} cannot continue the state {saved_path} saved: {why}")
    params = list(model.parameters())
    if in_bwd:  # {name: one optimizer's state}
        out = dict(saved) if saved_bwd else _split(saved, names)
        count, dropped = sum(bool(out[n]["state"]) for n in names), False
        if other_class:
            for name, p, opt in zip(names, params, optimizers):
                out[name], _, d = convert_one(out[name], opt, [p])
                dropped = dropped or d
    else:
        out = _join(saved, names) if saved_bwd else saved
        count, dropped = len(out["state"]), False
        if other_class:
            out, count, dropped = convert_one(out, optimizers[0], params)
    if log:  # (None or False: a rank that does not log)
        log.warning(_what_changed(saved_path, now, saved_bwd, in_bwd, count, optimizers[0], dropped))
    return out


def _check(
    state: dict, saved: Any, saved_bwd: bool, names: List[str], optimizers: list, model, *, source, **how
) -> None:
    """``state_check.check`` of the saved state, laid out per parameter, against this run's param groups."""
    where = "the saved optimizer state" if source is None else f"the optimizer state in {source}"
    fix = "resume from another checkpoint" if source is None else state_file.resume_elsewhere(Path(source).parent)
    per_parameter = state_check.items(saved, saved_bwd, names, where, fix)
    if per_parameter is None:
        return
    live = [g for opt in optimizers for g in getattr(opt, "param_groups", ()) for _ in g["params"]]
    if len(live) != len(names):  # (an optimizer that hides its groups: only the saved values are checked)
        live = [{}] * len(names)
    state_check.check(per_parameter, list(model.parameters()), live, state, where=where, fix=fix, **how)


def _what_changed(saved_path: str, now: str, saved_bwd: bool, in_bwd: bool, count: int, optimizer, dropped) -> str:
    """The one warning line of a converted resume."""
    other_class, other_layout = saved_path != now, saved_bwd != in_bwd
    who = " ".join([f"optimizer={now}"] * other_class + [f"optimizer_in_bwd={in_bwd}"] * other_layout)
    whence = (
        (f"{saved_path} " if other_class else "") + "saved" + (f" with optimizer_in_bwd={saved_bwd}" * other_layout)
    )
    done = []
    if other_layout:
        how = "joined into one optimizer's" if saved_bwd else "split into one optimizer per parameter"
        done.append(f"the states of {count} parameters were {how} with the saved param group (lr included)")
    if other_class:
        done.append(
            ("their" if other_layout else f"the {count} parameters'") + " moments were decoded to fp32 and stored as "
            f"{_describe(optimizer)}, step counts kept"
            + (" (compensation buffers dropped: under 1 bf16 ulp of each weight)" if dropped else "")
            + "; the losses will differ from the interrupted run's by the moments' rounding"
        )
    else:
        done.append("moments and step counts as saved, nothing rounded")
    return f"{who} continues the state {whence}: " + ", ".join(done)


# -- the distributed recipe: the ranks' shards gathered into that format, and taken back out -----------------------


def _is_ours(optimizer) -> bool:
    return hasattr(optimizer, "param_format") and hasattr(optimizer, "format")


def _span(p: torch.Tensor) -> Tuple[int, int, int]:
    """(element offset of this rank's shard in the flattened tensor, its element count, the tensor's) for a
    DTensor sharded on dim 0 (FSDP2), or (0, numel, numel) for a plain tensor."""
    if not hasattr(p, "device_mesh"):
        return 0, p.numel(), p.numel()
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not isinstance(pl, (Shard, Replicate)) or (isinstance(pl, Shard) and pl.dim != 0) for pl in p.placements):
        raise BadInput(f"a parameter sharded as {p.placements} (not on dim 0) has no portable optimizer state")
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    row = math.prod(p.shape[1:])
    return (offset[0] * row if offset else 0), math.prod(shape), p.numel()


def gather_full(model: torch.nn.Module, optimizer, *, main: bool, device: torch.device) -> Optional[dict]:
    """The full state dict on rank 0 (None on the others), every rank taking part: torch.optim's through torchtune
    (its states are DTensors), ours by gathering each parameter's shard entries and joining them on the whole
    tensor's blocks (``optimizers.portable.gather``)."""
    if not _is_ours(optimizer):
        from torchtune import training

        return _private(training.get_full_optimizer_state_dict(model, optimizer, main, device), optimizer)
    sd = optimizer.state_dict()
    params = [p for g in optimizer.param_groups for p in g["params"]]
    world = dist.get_world_size()
    state = {}
    for i, p in enumerate(params):
        entry = sd["state"].get(i)
        off, n, numel = _span(p)
        mine = None if not entry else {k: v.detach().to("cpu", copy=True) for k, v in entry.items()}
        pieces = [None] * world if main else None
        dist.gather_object((off, n, mine), pieces, dst=0)
        if main and all(e is not None for _, _, e in pieces):
            state[i] = portable.gather(pieces, optimizer.param_format(p), numel)
    return {"state": state, "param_groups": sd["param_groups"]} if main else None


def _private(full: Optional[dict], optimizer) -> Optional[dict]:
    """``full`` with every tensor that shares memory with the optimizer's live state replaced by a copy.

    torch's gather (``get_optimizer_state_dict`` with ``cpu_offload``) copies only what it must: a tensor already on the
    CPU comes back as itself. So on the CPU the step counts (plain tensors, not shards) and, with one rank, every moment
    were the live tensors, and a background save (``async_save.Owned``: taken as a private copy) wrote whatever the
    following optimizer steps had left in them by the time its thread got there: a checkpoint of step 3 resumed with
    step 4's step count, and its steps 5 and 6 trained other losses (0.3 % off, seen when the machine was loaded)."""
    if not full:
        return full
    live = set()
    for entry in optimizer.state.values():
        for v in entry.values():
            if isinstance(v, torch.Tensor):
                live.add((v.to_local() if hasattr(v, "to_local") else v).untyped_storage().data_ptr())

    def own(v):
        shared = isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in live
        return v.clone() if shared else v

    full["state"] = {k: {n: own(v) for n, v in entry.items()} for k, entry in full["state"].items()}
    return full


def load_full(model: torch.nn.Module, optimizer, full: dict, device: torch.device) -> None:
    """Load a full state dict (any rank count's, or one device's) into this rank's shards: torch.optim's through
    torchtune, ours by taking each parameter's shard out of the whole tensor's blocks (``optimizers.portable.shard``)."""
    if not _is_ours(optimizer):
        from torchtune import training

        training.load_from_full_optimizer_state_dict(model, optimizer, full, device)
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in full["param_groups"] for i in g["params"]]
    if len(ids) != len(params):
        raise ValueError(f"the saved optimizer state has {len(ids)} parameters, this model {len(params)}")
    state = {}
    for pid, p in zip(ids, params):
        entry = full["state"].get(pid)
        if entry:
            off, n, numel = _span(p)
            state[pid] = portable.shard(entry, optimizer.param_format(p), numel, off, n)
    optimizer.load_state_dict({"state": state, "param_groups": full["param_groups"]})
