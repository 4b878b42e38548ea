"""The vocabulary every config check speaks: unknown keys (top level and component sections, with the closest
valid key suggested), numbers ("a positive integer", "a positive number", "a non-negative integer", "a finite number
>= 0") and flags. Each failure is one ``BadInput`` naming the key and the fix."""

import difflib
import inspect
import math
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import InterpolationResolutionError
from torchtune.config._utils import _get_component_from_path

from finetune.base import BadInput, first_line

# The component sections whose keys are checked against what their _component_ accepts (a typo is one error naming
# the valid keys, not a TypeError from deep inside the build), with the component used when a section names none.
# The dataset is left to its builder: alpaca_dataset passes unknown keys on to datasets.load_dataset's builders.
CHECKED_COMPONENTS = {
    "model": None,
    "tokenizer": None,
    "loss": None,
    "lr_scheduler": None,
    "metric_logger": None,
    "profiler": "torchtune.training.setup_torch_profiler",
}
# A component that hands its **kwargs on: the keys of that callable are valid too.
KWARGS_GO_TO = {"torchtune.training.metric_logging.WandBLogger": "wandb.init"}


def check_config_keys(cfg: DictConfig, known) -> None:
    """Refuse a top-level key no recipe reads (a typo would otherwise be silently ignored).

    Component sections (optimizer.*, model.*) are checked by their instantiation; this looks at the top level only.
    """
    known = sorted(set(known))
    for key in cfg.keys():
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
            hint = f"did you mean {close[0]}?" if close else f"the known keys are: {', '.join(known)}"
            raise BadInput(f"{key} is not a config key of this recipe; {hint} (remove it with ~{key})")


# The sections every run builds from, with what each makes (the model's is required without checkpoint_dir only:
# read.resolve_model says so).
REQUIRED_SECTIONS = {
    "tokenizer": "the tokenizer",
    "dataset": "the training set",
    "loss": "the loss",
    "optimizer": "the optimizer",
}


def check_required_sections(cfg: DictConfig) -> None:
    """A section every run needs, removed (``~tokenizer``) or set to a value, is refused by name; and an
    interpolation that names a key the config no longer has (``~data_dir`` under ``${data_dir}/...``) names both."""
    for key, what in REQUIRED_SECTIONS.items():
        node = cfg.get(key)
        if not OmegaConf.is_dict(node) or not node.get("_component_"):
            has = f"{key}._component_ is not set" if OmegaConf.is_dict(node) else f"the config has {key}={node!r}"
            raise BadInput(
                f"{key} is required: the run builds {what} from it ({key}._component_ and its keys), and {has}; keep "
                f"the config file's {key} section (drop ~{key}), or name a component ({key}._component_=...)"
            )
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except InterpolationResolutionError as e:  # (InterpolationKeyError: the key it names is gone)
        where = getattr(e, "full_key", None) or "a value"
        raise BadInput(
            f"{where} refers to a key the config does not have ({first_line(e)}); set it (e.g. data_dir=DIR), or "
            "keep the config file's own"
        ) from None


def accepted_keys(target, path: str = "") -> Optional[set]:
    """The keyword arguments ``target`` takes (a class: its constructor's), or None when that cannot be known: no
    signature, or ``**kwargs`` that go nowhere KWARGS_GO_TO knows."""
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    named = {
        k
        for k, p in params.items()
        if k != "self" and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    }
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return named
    if path in KWARGS_GO_TO:
        forwarded = accepted_keys(_get_component_from_path(KWARGS_GO_TO[path]))
        return None if forwarded is None else named | forwarded
    return None


def check_component_keys(cfg: DictConfig) -> None:
    """Refuse a key a component section's ``_component_`` does not take (``model.num_layer=2``), naming the valid
    ones (CHECKED_COMPONENTS; the optimizer's keys are checked by resolve_optimizer)."""
    for section, default in CHECKED_COMPONENTS.items():
        node = cfg.get(section)
        path = (node.get("_component_") or default) if OmegaConf.is_dict(node) else None
        if not path:
            continue
        try:
            keys = accepted_keys(_get_component_from_path(path), path)
        except Exception as e:  # the path does not import
            raise BadInput(
                f"{section}._component_={path} cannot be imported ({first_line(e.__cause__ or e)}); check "
                "the dotted path"
            ) from None
        for key in node.keys() if keys is not None else ():
            if key == "_component_" or key in keys:
                continue
            close = difflib.get_close_matches(str(key), sorted(keys), n=1, cutoff=0.6)
            hint = f"did you mean {section}.{close[0]}? " if close else ""
            raise BadInput(
                f"{section}.{key} is not a key of {path}; {hint}its keys: {', '.join(sorted(keys))} "
                f"(remove it with ~{section}.{key})"
            )


# torchtune's tokenizer builders that read ``path`` with SentencePiece (their packages: models/<family>/).
SENTENCEPIECE_FAMILIES = ("llama2", "mistral", "gemma", "phi3")


def check_sentencepiece_file(cfg: DictConfig) -> None:
    """A ``tokenizer.path`` that one of torchtune's SentencePiece tokenizers cannot read (a damaged download, an HTML
    page saved as tokenizer.model) is one error naming the file, not SentencePiece's traceback from inside the
    builder. Loading the file takes milliseconds; other tokenizers check their own files when built."""
    component, path = OmegaConf.select(cfg, "tokenizer._component_"), OmegaConf.select(cfg, "tokenizer.path")
    parts = str(component).split(".")
    if not path or len(parts) < 4 or parts[:2] != ["torchtune", "models"] or parts[2] not in SENTENCEPIECE_FAMILIES:
        return
    import sentencepiece

    try:
        sentencepiece.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # (a RuntimeError, "could not parse ModelProto")
        raise BadInput(
            f"tokenizer.path={path} is not a SentencePiece model, which {component} reads ({first_line(e)}); "
            "use the model's own tokenizer.model (download it again if it was cut short)"
        ) from None


# ------------------------------------------------------------------------------------------------
# numbers: one vocabulary
# ------------------------------------------------------------------------------------------------


def number(
    cfg: DictConfig,
    key: str,
    *,
    integer: bool,
    low: float,
    strict: bool,
    allow_none: bool = False,
    default: Any = None,
    example: Any = 1,
    high: Optional[float] = None,
    why_high: str = "",
):
    """``cfg[key]`` (a dotted path; ``default`` when absent) checked as a finite number (``integer``: an int, not a
    float such as ``4.0`` or ``1e12``, which a component would be given as it is) above ``low`` (``>= low`` when not
    ``strict``) and at most ``high``, or None when ``allow_none``. Booleans are not numbers."""
    value = OmegaConf.select(cfg, key, default=default)
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and high is not None and value > high:
        limit = str(int(high)) if float(high).is_integer() else f"{high:g}"
        raise BadInput(f"{key}={value!r} must be at most {limit} ({why_high}); set e.g. {key}={example}")
    ok = ok and (value > low if strict else value >= low)
    if ok and integer and isinstance(value, float):
        if value.is_integer():  # (4.0, 1e3: YAML reads a decimal point or an exponent as a float)
            raise BadInput(f"{key}={value!r} must be an integer, not a float: write it as {key}={int(value)}")
        ok = False
    if not ok:
        if integer:
            rule = {(0, True): "a positive integer", (0, False): "a non-negative integer"}.get(
                (low, strict), f"an integer {'>' if strict else '>='} {low:g}"
            )
        else:
            rule = (
                "a positive number"
                if (low, strict) == (0, True)
                else f"a finite number {'>' if strict else '>='} {low:g}"
            )
        raise BadInput(f"{key}={value!r} must be {rule}{' or null' if allow_none else ''}; set e.g. {key}={example}")
    return int(value) if integer else float(value)


def flag(cfg: DictConfig, key: str, default: bool = False) -> bool:
    value = cfg.get(key, default)
    if value not in (True, False):
        raise BadInput(f"{key}={value!r} must be True or False")
    return bool(value)
