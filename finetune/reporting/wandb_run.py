"""The run as a dashboard shows it: its name, group and tags, the metric logger (wandb, offline without an API key)
with a copy of the run's config, the wandb run each checkpoint names (``run.json``) and the summary the run ends
with (docs/wandb.md).

Identity. The name is the config's and the optimizer's (``7B_full_80gb-AdamW4bit``), the group the config
(``7B_full_80gb``), the tags the memory class (``80gb``, from ``device_memory_limit_gib`` or the config's name; the
device otherwise), the variant, and ``packed`` / ``compiled`` / ``in-backward`` when on. ``metric_logger.name``,
``.group`` and ``.tags`` override each. The same identity heads ``summary.json``, with or without a logger.
"""

import atexit
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import DictConfig, OmegaConf

from finetune.base import BadInput
from finetune.run_files import keep_wandb_logs_inside

# How a variant is named: ours by the class alone (optimizers.AdamW4bit -> AdamW4bit), the third-party anchors
# with their library's short name (torch.AdamW, ao.AdamW8bit, bnb.AdamW8bit), anything else with its package's.
LIBRARY_PREFIX = {"optimizers": "", "torch": "torch.", "torchao": "ao.", "bitsandbytes": "bnb."}


def config_name(argv: Optional[List[str]] = None) -> str:
    """The ``--config`` file's name without ``.yaml`` (``7B_full_80gb``), or ``run`` without one."""
    args = sys.argv if argv is None else argv
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return Path(args[i + 1]).stem
        if a.startswith("--config="):
            return Path(a.split("=", 1)[1]).stem
    return "run"


def variant_label(optimizer_path: str) -> str:
    parts = str(optimizer_path).split(".")
    return LIBRARY_PREFIX.get(parts[0], parts[0] + ".") + parts[-1] if len(parts) > 1 else parts[0]


def memory_class(device, memory_limit_gib: Optional[float], config: str) -> str:
    """``24gb`` for a run capped at 24 GiB, else the ``NNgb`` in the config's name, else the device (``cpu``, or
    the GPU's size)."""
    if memory_limit_gib is not None:
        return f"{memory_limit_gib:g}gb"
    found = re.search(r"(\d+)gb", config, re.IGNORECASE)
    if found:
        return f"{found.group(1)}gb"
    if device.type == "cuda":
        import torch

        return f"{round(torch.cuda.get_device_properties(device).total_memory / 2**30)}gb"
    return device.type


def run_identity(
    cfg: DictConfig,
    *,
    optimizer: str,
    device,
    memory_limit_gib: Optional[float],
    packed: bool,
    compiled: bool,
    in_backward: bool,
    world: int = 1,
) -> Dict[str, Any]:
    """The run's ``name``, ``group``, ``tags`` (defaults or ``metric_logger.*``), ``config``, ``optimizer`` (its
    dotted path) and ``variant``; the tags name the memory class and what is on (packed, compiled, in backward)."""
    config = config_name()
    variant = variant_label(optimizer)
    tags = [memory_class(device, memory_limit_gib, config), variant]
    tags += [t for t, on in (("packed", packed), ("compiled", compiled), ("in-backward", in_backward)) if on]
    if world > 1:
        tags.append(f"{world}-ranks")
    mine = {"name": f"{config}-{variant}", "group": config, "tags": tags}
    user = cfg.get("metric_logger") or {}
    for key in mine:
        if user.get(key) is not None:
            value = user.get(key)
            mine[key] = list(value) if OmegaConf.is_list(value) else ([value] if key == "tags" else str(value))
    return {**mine, "config": config, "optimizer": optimizer, "variant": variant}


# ------------------------------------------------------------------------------------------------
# the metric logger
# ------------------------------------------------------------------------------------------------


def is_wandb(logger) -> bool:
    return type(logger).__name__ == "WandBLogger"


def log_config(logger, cfg: DictConfig) -> Optional[Path]:
    """The run's config to the metric logger; for wandb, returns the run's folder.

    torchtune's WandBLogger.log_config writes ``{output_dir}/torchtune_config.yaml`` and ``wandb.save``s it, which
    puts an absolute symlink to it into the run's files/ (and warns "Symlinked 1 file"): a later run into the same
    folder overwrites what that link shows. Here the run's folder gets a copy of its own config instead.
    """
    if not is_wandb(logger):
        logger.log_config(cfg)
        return None
    import wandb

    if wandb.run is None:
        return None
    resolved = OmegaConf.to_container(cfg, resolve=True)
    wandb.run.config.update(resolved, allow_val_change=logger.config_allow_val_change)
    # Files in the run's files/ folder are uploaded with the run (at its end, or by `wandb sync`).
    (Path(wandb.run.dir) / "torchtune_config.yaml").write_text(OmegaConf.to_yaml(resolved))
    return Path(wandb.run.dir).parent


def metric_logger(cfg: DictConfig, log, identity: Dict[str, Any]):
    """``metric_logger`` built (None when off: ``metric_logger=null`` on the CLI sets only its _component_ to null),
    and the wandb run folder if it is wandb. A wandb run is named, grouped and tagged by ``identity``. Without
    WANDB_API_KEY (and no ``mode``), wandb logs offline."""
    from torchtune import config

    cfg_logger = cfg.get("metric_logger")
    if cfg_logger is None or not cfg_logger.get("_component_"):
        return None, None
    cfg_logger = OmegaConf.create(OmegaConf.to_container(cfg_logger, resolve=True))
    if cfg_logger._component_.endswith("WandBLogger"):
        for key in ("name", "group", "tags"):
            cfg_logger[key] = identity[key]
        if "mode" not in cfg_logger and os.environ.get("WANDB_MODE"):
            cfg_logger.mode = os.environ["WANDB_MODE"]  # (explicit: wandb reads the environment once per process)
        elif "mode" not in cfg_logger and not os.environ.get("WANDB_API_KEY"):
            # No key: log offline into {log_dir}/wandb/offline-run-*; `wandb sync DIR` uploads it later.
            cfg_logger.mode = "offline"
            log.info("wandb: no WANDB_API_KEY, logging offline (upload later with `wandb sync`)")
    logger = config.instantiate(cfg_logger, **quiet_settings(cfg_logger))
    if is_wandb(logger):
        close_at_exit(logger)
    run_dir = log_config(logger, cfg)
    if run_dir is not None:
        # wandb-core links the run's logs/debug-core.log to its own log in ~/.cache/wandb, by absolute path: a run
        # folder moved to another machine (to upload it there) would carry a dangling link. When the logger closes,
        # the link becomes a copy of what it showed, so the run folder is self-contained.
        close = logger.close

        def close_and_copy_core_log():
            close()
            keep_wandb_logs_inside(run_dir)

        logger.close = close_and_copy_core_log
    return logger, run_dir


def quiet_settings(cfg_logger) -> Dict[str, Any]:
    """wandb.init's ``settings`` that keep wandb's own lines off the terminal: about 25 of them (its version, the
    offline notice, the run's history and summary as sparklines, a sync hint) around the run, the last ones after our
    closing lines. The run's summary already names the wandb folder and the upload command. Offline, wandb is silent;
    online, quiet (the run's URL still shows). WANDB_SILENT or WANDB_QUIET in the environment, or
    ``metric_logger.settings``, decide instead; errors raise either way. {} for another logger."""
    if not cfg_logger._component_.endswith("WandBLogger") or "settings" in cfg_logger:
        return {}
    if os.environ.get("WANDB_SILENT") or os.environ.get("WANDB_QUIET"):
        return {}
    import wandb

    offline = str(cfg_logger.get("mode", "")) in ("offline", "disabled")
    return {"settings": wandb.Settings(**({"silent": True} if offline else {"quiet": True}))}


def close_at_exit(logger) -> None:
    """Close ``logger`` (finish its wandb run) when the process exits, before wandb's own exit hook stops its
    service: atexit runs the hooks registered last first, and wandb registered its hook in wandb.init.

    Why. Without this, a run that ended other than through the recipe's cleanup (Ctrl-C, a bad input found mid-run,
    an out-of-memory error) was finished by torchtune's ``WandBLogger.__del__``, whenever the logger was freed. The
    recipe holds it in reference cycles, so that was often during the interpreter's final garbage collection, after
    wandb's hook had stopped its service: ``wandb.finish()`` then waited forever for an answer (the process printed
    its closing lines and hung, threads in futex waits, until a second Ctrl-C). A closed logger's ``__del__`` does
    nothing. Closing twice is harmless (``close`` finishes only a run still active)."""
    atexit.register(finish, logger)


def finish(logger, exit_code: Optional[int] = None) -> None:
    """Close the metric logger now: for wandb, finish its run (``exit_code`` recorded as the run's, 130 for Ctrl-C;
    None: wandb's own record of the process's exit). A Ctrl-C during it (a user who does not want to wait for wandb)
    abandons it: the run folder keeps what was logged, as after a crash. No-op without a logger or once closed."""
    if logger is None:
        return
    try:
        if is_wandb(logger) and exit_code is not None:
            import wandb

            if wandb.run is not None:
                wandb.run.finish(exit_code=exit_code)
        logger.close()
    except KeyboardInterrupt:
        pass


def wandb_run_info(logger) -> Optional[Dict[str, Any]]:
    """What ``run.json`` records of the wandb run, for the eval to resume it: id, project, entity, mode, and the
    folder its ``wandb/`` is in. None without a wandb run."""
    if not is_wandb(logger):
        return None
    import wandb

    run = wandb.run
    if run is None:
        return None
    log_dir = getattr(logger, "log_dir", None)
    return {
        "id": run.id,
        "project": run.project,
        "entity": run.entity or None,
        "mode": str(getattr(run.settings, "mode", "online")),
        "dir": str(Path(log_dir).resolve()) if log_dir else str(Path(run.dir).parents[2].resolve()),
    }


def run_file(identity: Dict[str, Any]) -> Dict[str, Any]:
    """The identity keys ``run.json`` keeps (with the wandb run and the checkpoint's global step)."""
    return {k: identity[k] for k in ("name", "group", "tags", "config", "optimizer", "variant")}


def push_summary(logger, values: Dict[str, Any]) -> Dict[str, Any]:
    """The run's summary numbers into the wandb run's summary (a dashboard's table reads them without the history).
    Returns what ``summary.json`` adds about the wandb run: its id, and ``wandb_next_step``, the history step after
    the last (the eval logs its row there). Other loggers keep no summary: {}."""
    if not is_wandb(logger):
        return {}
    import wandb

    if wandb.run is None:
        return {}
    wandb.run.summary.update({k: v for k, v in values.items() if k not in ("name", "group", "tags")})
    return {"wandb_run_id": wandb.run.id, "wandb_project": wandb.run.project, "wandb_next_step": int(wandb.run.step)}


# ------------------------------------------------------------------------------------------------
# reading runs back
# ------------------------------------------------------------------------------------------------


def read_runs(path: Path) -> Dict[str, Dict[str, Any]]:
    """Every wandb run under ``path`` (a wandb folder, or a run folder holding ``wandb/``) by id, read with wandb's
    own reader (``wandb leet inspect --json``), never by the code that wrote them: name, group, tags, project, config,
    the summary (updates applied in order), the history, and its files (``files``: their folders), merged in the
    order they started, as ``wandb sync`` merges a run's files (the training run and the evals that resumed it).
    {} where ``path`` holds no run; BadInput where wandb cannot read one. bench/table.py's ``--from wandb`` and the
    tests read runs with it."""
    root = path / "wandb" if (path / "wandb").is_dir() else path
    pieces = []
    for f in sorted(root.glob("*run-*/run-*.wandb")):
        records = inspect_file(f)
        run = next((r["run"] for r in records if r.get("type") == "run"), {})
        pieces.append((run.get("start_time", ""), run.get("run_id", f.stem[4:]), run, records, f))
    runs: Dict[str, Dict[str, Any]] = {}
    for _, run_id, run, records, f in sorted(pieces, key=lambda p: p[0]):
        merged = runs.setdefault(run_id, {"id": run_id, "summary": {}, "history": [], "config": {}, "files": []})
        merged["files"].append(str(f.parent))
        for key, name in (("name", "display_name"), ("group", "run_group"), ("tags", "tags"), ("project", "project")):
            if run.get(name):  # (a resumed run's file names none of these: the first file's stand)
                merged[key] = run[name]
        for record in records:
            kind = record.get("type")
            if kind == "run":
                merged["config"].update(record["run"].get("config", {}).get("update", {}))
            elif kind == "config":
                merged["config"].update(record["config"].get("update", {}))
            elif kind == "summary":
                merged["summary"].update(record["summary"].get("update", {}))
                for item in record["summary"].get("remove", []) or []:
                    merged["summary"].pop(item.get("key") if isinstance(item, dict) else item, None)
            elif kind == "history":
                merged["history"].append(record["history"].get("item", {}))
    return runs


def inspect_file(wandb_file: Path) -> List[Dict[str, Any]]:
    """The records of one ``.wandb`` file as wandb's reader prints them (one JSON object a line); the ``wandb`` beside
    this Python first, so that no activated environment is needed."""
    wandb_cli = Path(sys.executable).with_name("wandb")
    command = [str(wandb_cli) if wandb_cli.exists() else "wandb", "leet", "inspect", str(wandb_file), "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise BadInput(f"wandb could not read {wandb_file}: {done.stderr.strip()[-300:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
