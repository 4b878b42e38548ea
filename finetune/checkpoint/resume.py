"""Resume: reading a checkpoint back and checking it against the run that continues from it. Part of the checkpoint
component (``finetune/checkpoint/checkpointer.py`` writes what this reads).

``run_settings`` is what a checkpoint records of its run (in recipe_state.pt's "config"); ``read_resume`` compares a
resuming run's settings with it, row by row of RESUME_TABLE: each setting must match, may change with a warning, or
may change freely, with the reason for each (docs/recipes.md prints the table).
"""

from pathlib import Path
from typing import Any, Dict, Optional

from omegaconf import OmegaConf
from torchtune.config._utils import _get_component_from_path

from finetune.base import BadInput, load_state_file
from finetune.checkpoint import state_file
from finetune.checkpoint.checkpointer import RANK_STATE_FILE, RECIPE_STATE_FILE
from finetune.checkpoint.optimizer_state import convertible
from finetune.data.packing import file_digest
from finetune.optimizer import TORCH_BACKEND_FLAGS

# The resume table. A checkpoint records the run's settings (``run_settings``, in recipe_state.pt's "config"); a
# resume compares them with its own, all in ``read_resume``. Each row: the recorded name, the rule, the config keys
# it covers, and why. MUST: a difference is refused (one error line naming the key). WARN: accepted with a warning.
# FREE: accepted without a word (those rows are not recorded; they are here so every config key has its rule).
MUST, WARN, FREE = "must match", "may change, with a warning", "may change"
CONVERT = "may change: the state is converted, with a warning"
_SAMPLES = "the data position and every later step's samples would differ from the interrupted run's"
RESUME_TABLE = (
    (
        "samples_per_step",
        MUST,
        ("batch_size", "gradient_accumulation_steps"),
        f"batch_size x gradient_accumulation_steps (x ranks) samples make a step: with another number {_SAMPLES}",
    ),
    ("seed", MUST, ("seed",), f"the data order follows it: {_SAMPLES}"),
    ("shuffle", MUST, ("shuffle",), f"the data order follows it: {_SAMPLES}"),
    ("packed", MUST, (), f"packed rows hold other samples than single ones: {_SAMPLES}"),
    (
        "dataset",
        MUST,
        ("dataset",),
        f"the dataset section (source, split, train_on_input, ...) makes the samples: {_SAMPLES}",
    ),
    (
        "data",
        MUST,
        ("data_dir",),
        f"the data files' content makes the samples (an edited file is other data): {_SAMPLES}",
    ),
    (
        "tokenizer",
        MUST,
        ("tokenizer",),
        "the tokenizer file and its settings (max_seq_len, prompt_template, ...) make "
        f"every sample's tokens: {_SAMPLES}",
    ),
    ("dtype", MUST, ("dtype",), "the weights and the optimizer state were trained and saved in that dtype"),
    (
        "optimizer",
        CONVERT,
        ("optimizer",),
        "another AdamW variant (optimizers.*, torch.optim.AdamW or Adam; torchao.optim's low-bit ones as the "
        "source) continues from the saved moments, decoded to fp32 and stored in its format, step counts kept: "
        "the losses differ from the interrupted run's by that rounding. Refused where nothing can carry over: a "
        "class without a second moment (SGD), bitsandbytes' and CPU offload's own layouts, torchao's as the target "
        "(its format depends on the shard sizes), amsgrad",
    ),
    (
        "optimizer_in_bwd",
        CONVERT,
        ("optimizer_in_bwd",),
        "the saved per-parameter states (one optimizer per parameter name, or one optimizer's by position) are "
        "re-keyed into the other layout, moments, step counts and param groups (lr included) as saved, with the "
        "class conversion above where optimizer changes too; the lr schedule is the same LambdaLR in both. One "
        "device steps each parameter with the same arithmetic in either layout (bf16 weights rounded "
        "stochastically by optimizers.* excepted: their random bits follow a parameter's place in the optimizer)",
    ),
    ("lr", MUST, (), "a resume continues the saved lr schedule"),
    (
        "optimizer_settings",
        MUST,
        (),
        "the optimizer's settings (weight_decay, betas, eps, ...) are restored with its "
        "state, so the checkpoint's would silently replace a new value (with another optimizer class only "
        "those AdamW's math shares are compared: another class's own extras may change with it)",
    ),
    (
        "lr_scheduler",
        MUST,
        ("lr_scheduler",),
        "the saved schedule (its warmup included) continues; another one would not",
    ),
    (
        "epochs",
        WARN,
        ("epochs",),
        "the lr schedule's length follows it: the schedule will not match the interrupted run",
    ),
    (
        "max_steps_per_epoch",
        WARN,
        ("max_steps_per_epoch",),
        "the lr schedule's length follows it: the schedule will not match the interrupted run",
    ),
    ("clip_grad_norm", WARN, ("clip_grad_norm",), "every update from here on is clipped differently"),
    (
        "fp8",
        WARN,
        ("fp8",),
        "the matmuls' precision changes (FP8 or bf16): the losses will not match the interrupted run's exactly",
    ),
    (
        "world_size",
        FREE,
        (),
        "a step of the same size resumes on any number of ranks: the optimizer state is saved whole, its "
        "quantized blocks counted from each tensor's first element, whichever recipe and rank count wrote it "
        "(a per-rank state of an older checkpoint excepted: read_resume refuses another number)",
    ),
    ("model", FREE, ("model",), "the checkpoint's weights must fit it: another size fails when they load"),
    (
        "how a step runs",
        FREE,
        (
            "device",
            "compile",
            "enable_activation_checkpointing",
            "ac_mode",
            "ac_option",
            "enable_activation_offloading",
            "device_memory_limit_gib",
            "host_memory_limit_gib",
            "loss",
            "fsdp_reshard_after_forward",
        ),
        "memory and speed, not what a step computes",
    ),
    (
        "where and when the run writes",
        FREE,
        (
            "output_dir",
            "checkpoint_dir",
            "resume_from_checkpoint",
            "overwrite",
            "pack_cache_dir",
            "save_every_n_steps",
            "log_every_n_steps",
            "metric_logger",
            "log_level",
            "max_consecutive_skipped_steps",
            "async_checkpoint",
            "profiler",
            "dataset_val",
            "run_val_every_n_steps",
            "batch_size_val",
        ),
        "files, reports and limits, not the training",
    ),
)
RESUME_RULES = {name: (rule, why) for name, rule, _, why in RESUME_TABLE}
ADAMW_MATH = ("betas", "eps", "weight_decay", "maximize", "amsgrad")  # compared across optimizer classes
CONFIG_NAMES = {"packed": "dataset.packed", "lr": "optimizer.lr", "optimizer_settings": "optimizer"}


def run_settings(
    training, data, *, dtype_name: str, fp8: Optional[str], world_size: Optional[int] = None
) -> Dict[str, Any]:
    """What a checkpoint records of the run for ``read_resume``: the MUST and WARN rows of RESUME_TABLE, from its
    ``training`` and (training) ``data`` sections, in plain types (paths replaced by their files' digests, so a moved
    file is the same)."""
    dataset_cfg = OmegaConf.to_container(data.section, resolve=True)
    dataset = {k: v for k, v in dataset_cfg.items() if k not in ("data_files", "packed")}
    tokenizer = {k: v for k, v in (data.tokenizer_cfg or {}).items() if k != "path"}
    tokenizer["file"] = file_digest(data.tokenizer_path)
    optimizer = training.optimizer
    kwargs = OmegaConf.to_container(optimizer.kwargs, resolve=True)
    schedule = training.lr_scheduler
    settings = {
        "batch_size": data.batch_size,
        "gradient_accumulation_steps": training.accum,
        "seed": training.seed,
        "shuffle": training.shuffle,
        "packed": data.packed,
        "dataset": dataset,
        "data": [file_digest(Path(f)) for f in data.files],
        "tokenizer": tokenizer,
        "dtype": dtype_name,
        "optimizer": optimizer.path,
        "optimizer_in_bwd": training.optimizer_in_bwd,
        "lr": optimizer.lr,
        # (torch's backend flags choose the implementation, not the math: a resume may change them)
        "optimizer_settings": {k: v for k, v in kwargs.items() if k != "lr" and k not in TORCH_BACKEND_FLAGS},
        "lr_scheduler": None if schedule is None else OmegaConf.to_container(schedule, resolve=True),
        "epochs": training.epochs,
        "max_steps_per_epoch": training.max_steps_per_epoch,
        "clip_grad_norm": training.clip,
        "fp8": fp8,
    }
    if world_size is not None:
        settings["world_size"] = world_size
    return settings


def read_state_file(path: Path, mmap: bool = False, log=None) -> dict:
    """A recipe_state*.pt file, checked against the checksum saved beside it (``state_file.verify``; a file without
    one: a warning on ``log``), loaded weights_only (tensors and plain values only: see finetune.base), and its
    structure and progress counters checked: every failure one BadInput naming the file and the fix."""
    fix = state_file.resume_elsewhere(path.parent)
    if not state_file.verify(path, fix) and log is not None:
        log.warning(
            f"{path} has no checksum beside it ({state_file.checksum_path(path).name}: a checkpoint written before "
            "checksums, or copied without it): its zip records' CRCs were checked, which finds damaged bytes but "
            "not an edit saved again with torch.save; the optimizer state's values are checked"
        )
    state = load_state_file(path, mmap=mmap, fix=fix, kind="a recipe state file")
    main = path.name == RECIPE_STATE_FILE
    if not isinstance(state, dict) or "optimizer" not in state or (main and "config" not in state):
        raise BadInput(f"{path} is not a recipe state file this recipe wrote; {fix}")
    expected = {"optimizer": (dict,) if main else (dict, type(None))}
    if main:
        expected.update(config=(dict,), lr_scheduler=(dict, type(None)))
    for key, kinds in expected.items():
        if key in state and not isinstance(state[key], kinds):
            raise BadInput(
                f"{path} holds {key}={_shown(state[key])}, where a recipe state file holds a {kinds[0].__name__}, so "
                f"it was damaged or edited after it was written; {fix}"
            )
    for key in _COUNTERS if main else ():
        value = state.get(key, 0 if key in _COUNTED_LATER else None)
        if type(value) is not int or value < 0:  # (exactly int: a bool or a float is not a count)
            raise BadInput(
                f"{path} holds {key}={_shown(value)}, where a checkpoint records a count of steps (an integer >= 0), "
                f"so it was damaged or edited after it was written; {fix}"
            )
    return state


# The progress a recipe state records, as counts; the skip counters were added later (an older file lacks them)
_COUNTED_LATER = ("skipped_steps", "skipped_in_a_row", "empty_in_a_row")
_COUNTERS = ("epoch", "steps_in_epoch", "global_step", *_COUNTED_LATER)


def _shown(value: Any) -> str:
    """A value for a message: a container by its type (its contents could be a whole state)."""
    return repr(value) if isinstance(value, (int, float, str, type(None))) else f"<a {type(value).__name__}>"


def read_rank_state(folder: Path, ranks, *, required: bool) -> dict:
    """This rank's ``recipe_state_rank{r}.pt`` from a checkpoint (``{}`` if it has none and none is ``required``),
    read by every rank at once: a file that one rank cannot read (missing, truncated, planted) is the same one-line
    error on every rank, rather than an error on one and a broken connection on the others."""
    path = Path(folder) / RANK_STATE_FILE.format(rank=ranks.rank)
    state, error = {}, None
    try:
        if path.is_file():
            state = read_state_file(path)
        elif required:
            raise BadInput(
                f"resume_from_checkpoint={folder} lacks {path.name} (each rank's share of the optimizer "
                "state); resume from a checkpoint that has it, with the rank count that wrote it"
            )
    except BadInput as e:
        error = str(e)
    ranks.agree_any(error)
    return state


def _flat(prefix: str, value: Any) -> Dict[str, Any]:
    """A section as {"section.key": value} (nested sections joined with dots), for messages that name the key."""
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(f"{prefix}.{k}", v))
        return out or {prefix: {}}
    return {prefix: value}


def _samples_advice(saved: Dict[str, Any], now: Dict[str, Any]) -> str:
    """How to make this run's step take the checkpoint's samples: batch_size is per rank, so on another rank count
    the saved batch_size would not do (4 per rank on 2 ranks is 8, not 4)."""
    samples, world = saved["samples_per_step"], now.get("world_size", 1)
    for accum in dict.fromkeys((now["gradient_accumulation_steps"], saved["gradient_accumulation_steps"], 1)):
        if samples % (world * accum) == 0:
            on = f" on {world} ranks" if world > 1 else ""
            return f"{samples} samples per step (batch_size={samples // (world * accum)} gradient_accumulation_steps={accum}{on})"
    return (
        f"{samples} samples per step, which {world} ranks cannot split evenly (--nproc_per_node "
        f"{saved.get('world_size', 1)} with batch_size={saved['batch_size']} "
        f"gradient_accumulation_steps={saved['gradient_accumulation_steps']})"
    )


def _difference(name: str, saved: Dict[str, Any], now: Dict[str, Any]) -> Optional[tuple]:
    """(what differs, how to resume instead) between the recorded setting ``name`` and this run's, or None."""
    if saved[name] == now[name]:
        return None
    if name == "samples_per_step":
        ranks = " x ranks" if "world_size" in now else ""
        return (
            f"batch_size x gradient_accumulation_steps{ranks} = {now[name]} samples per step differs from the "
            f"checkpoint's {saved[name]}",
            _samples_advice(saved, now),
        )
    if name == "data":
        return (
            "the content of the data files (dataset.data_files) differs from the checkpoint's",
            "the data files it was trained on",
        )
    key = CONFIG_NAMES.get(name, name)
    flat_saved, flat_now = _flat(key, saved[name]), _flat(key, now[name])
    for k in sorted(set(flat_saved) | set(flat_now), key=lambda k: (k not in flat_saved or k not in flat_now, k)):
        if flat_saved.get(k) != flat_now.get(k):
            was, value = flat_saved.get(k, "(unset)"), flat_now.get(k, "(unset)")
            return f"{k}={value} differs from the checkpoint's {was}", f"{k}={was}"
    return None


def read_resume(folder: Path, *, now: Dict[str, Any], mmap: bool = False, log=None) -> dict:
    """``{folder}/recipe_state.pt``, checked against this run's settings ``now`` (``run_settings``) by every MUST
    and WARN row of RESUME_TABLE: a MUST difference is a BadInput naming the key, a WARN one a warning. A setting the
    checkpoint did not record (one written before that row existed) is not compared."""
    state = read_state_file(Path(folder) / RECIPE_STATE_FILE, mmap=mmap, log=log)
    saved, now = dict(state["config"]), dict(now)
    if saved.get("optimizer", now.get("optimizer")) == now.get("optimizer"):
        _check_state_format(state, now.get("optimizer"), Path(folder) / RECIPE_STATE_FILE)
    saved_world = saved.get("world_size", 1)
    if state.get("optimizer_layout") == "per_rank" and now.get("world_size", saved_world) != saved_world:
        # (first: with another rank count nothing else can make this checkpoint resume)
        raise BadInput(
            f"resume_from_checkpoint={folder} was saved by {saved_world} ranks and its optimizer state "
            f"({saved.get('optimizer')}) is quantized per rank shard (a checkpoint of an older version of this "
            f"recipe); resume with --nproc_per_node {saved_world}, or start a new run from its weights with "
            "checkpoint_dir=..."
        )
    if saved.get("optimizer", now.get("optimizer")) != now.get("optimizer"):  # (CONVERT: optimizer_state.restore)
        why = convertible(saved["optimizer"], now["optimizer"])
        if why is not None:
            raise BadInput(
                f"optimizer={now['optimizer']} cannot continue the optimizer state of {saved['optimizer']} in "
                f"resume_from_checkpoint={folder} ({why}); resume with optimizer={saved['optimizer']}, or start a "
                "new run from its weights with checkpoint_dir=... and no resume_from_checkpoint"
            )
        for d in (saved, now):  # another class's own extras may change with it: AdamW's shared math is compared
            if isinstance(d.get("optimizer_settings"), dict):
                d["optimizer_settings"] = {k: v for k, v in d["optimizer_settings"].items() if k in ADAMW_MATH}
    for d in (saved, now):  # the samples per step: per rank x accumulation x ranks (1 in the single-device recipe)
        if "batch_size" in d and "gradient_accumulation_steps" in d:
            d["samples_per_step"] = d["batch_size"] * d["gradient_accumulation_steps"] * d.get("world_size", 1)
    for name, (rule, why) in RESUME_RULES.items():
        if rule in (FREE, CONVERT) or name not in saved or name not in now:
            continue
        diff = _difference(name, saved, now)
        if diff is None:
            continue
        what, back = diff
        if rule == MUST:
            raise BadInput(
                f"{what} (resume_from_checkpoint={folder}): {why}; resume with {back}, or start a new run "
                "from its weights with checkpoint_dir=... and no resume_from_checkpoint"
            )
        if log is not None:
            log.warning(f"{what}: {why}")
    return state


def _state_formats(value: Any) -> set:
    """The ``state_format`` names our optimizers (optimizers.*) write into their param groups, anywhere in a saved
    optimizer state (one optimizer's, or one per parameter with optimizer_in_bwd)."""
    if isinstance(value, dict):
        groups = value.get("param_groups")
        found = {g["state_format"] for g in groups if "state_format" in g} if isinstance(groups, list) else set()
        return found.union(*(_state_formats(v) for k, v in value.items() if k != "param_groups"))
    return set()


def _check_state_format(state: dict, optimizer_path: Optional[str], path: Path) -> None:
    """An optimizers.* state (quantized moments and their scales) is refused before another optimizer loads it: an
    optimizer of ours compares formats itself, but torch.optim's loads any tensors and fails at the first step with a
    shape error. Reached only when the file's recorded optimizer was edited (read_resume compares it otherwise)."""
    formats = _state_formats(state.get("optimizer"))
    if not formats or not optimizer_path:
        return
    cls = _get_component_from_path(optimizer_path)
    if getattr(cls, "FORMAT", None) is not None or getattr(cls, "__name__", "") == "CPUOffloadOptimizer":
        return  # (ours: its load_state_dict checks; torchao's CPU offload wraps an inner class and its own state)
    fmt = sorted(formats)[0]
    try:
        from optimizers import VARIANTS

        writer = next((v.component for v in VARIANTS.values() if v.cls.FORMAT.name == fmt), "an optimizers.* class")
    except Exception:  # (naming the writer is a courtesy; the refusal stands without it)
        writer = "an optimizers.* class"
    raise BadInput(
        f"the optimizer state in {path} was written by {writer} (state format {fmt!r}), which {optimizer_path} "
        f"cannot load (was the file's recorded optimizer edited?); resume with optimizer={writer}, or start a new run "
        "from its weights with checkpoint_dir=... and no resume_from_checkpoint"
    )


def progress_after(state: dict, steps_per_epoch: int) -> tuple:
    """(epoch, steps into it, global step) a resume from ``state`` starts at: a checkpoint at an epoch's last
    step continues with the next epoch."""
    epoch, steps = state["epoch"], state["steps_in_epoch"]
    if steps >= steps_per_epoch:
        epoch, steps = epoch + 1, 0
    return epoch, steps, state["global_step"]


def nothing_left(resume_dir: Path, global_step: int, epochs: int, max_steps_per_epoch: Optional[int]) -> str:
    """The one line a resume from the end of training ends with. The recipe stops at that point of its setup, before
    the run folder is touched: no metrics, no summary.json, no wandb run (a new, empty one would take the finished
    run's place in summary.json and in wandb's ``latest-run``)."""
    return (
        f"Nothing trained: resume_from_checkpoint={resume_dir} is at global step {global_step}, already the end of "
        f"training with epochs={epochs}, max_steps_per_epoch={max_steps_per_epoch}; nothing was written. To train "
        "further, raise epochs or max_steps_per_epoch (the lr schedule then differs from the finished run's)"
    )
