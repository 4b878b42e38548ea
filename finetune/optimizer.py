"""The optimizer the config names, resolved once before anything is built: its class imported, its kwargs checked
against its signature (torch's backend flags dropped for a class that lacks them), a wrapper's inner class imported.
``OptimizerSpec.build(params)`` makes it; the recipes build one, or one per parameter for optimizer-in-backward.
"""

import difflib
import importlib
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config, utils
from torchtune.config._utils import _get_component_from_path

from finetune.base import BadInput, first_line

log = utils.get_logger("INFO")

# Keyword arguments that only select torch.optim's implementation (not the math). Other optimizer libraries reject
# them; they are dropped for a class that does not take them, so one config serves every optimizer. Any other
# rejected kwarg is a user error.
TORCH_BACKEND_FLAGS = ("fused", "foreach", "capturable", "differentiable")


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer as the config names it, resolved once: its class, the kwargs to build it with (torch's backend
    flags dropped for a class that lacks them), and a wrapper's inner class (``optimizer_class``), imported."""

    path: str
    cls: Any
    kwargs: DictConfig  # without _component_ and optimizer_class
    inner: Any = None

    @property
    def cpu_offload(self) -> bool:
        """torchao's CPUOffloadOptimizer: states and step on the CPU, gradients copied out during backward."""
        return getattr(self.cls, "__name__", "") == "CPUOffloadOptimizer"

    @property
    def lr(self) -> Any:
        return self.kwargs.get("lr")

    def build(self, params) -> torch.optim.Optimizer:
        extra = {} if self.inner is None else {"optimizer_class": self.inner}
        try:
            return config.instantiate(OmegaConf.merge({"_component_": self.path}, self.kwargs), params, **extra)
        except (TypeError, ValueError) as e:
            raise BadInput(
                f"optimizer={self.path} rejected its arguments ({first_line(e)}); fix the optimizer.* keys"
            ) from None


def _import(path: str, key: str):
    try:
        return _get_component_from_path(path)
    except Exception as e:  # InstantiationError, ValueError: the path does not import
        close = _close_to(path)
        if close:
            raise BadInput(f"{key}={path} cannot be imported; did you mean {key}={close}?") from None
        hint = " (install it with: pip install -e '.[bnb]')" if path.startswith("bitsandbytes") else ""
        more = (
            ", bitsandbytes.optim.AdamW8bit, torchao.optim.AdamW8bit or optimizers.AdamW8bit"
            if key == "optimizer"
            else ""
        )
        raise BadInput(
            f"{key}={path} cannot be imported{hint} ({first_line(e.__cause__ or e)}); use a class path "
            f"such as torch.optim.AdamW{more}"
        ) from None


def _close_to(path: str) -> str:
    """The class path a misspelled ``path`` most likely meant (``torch.optim.AdamWW`` -> ``torch.optim.AdamW``), or
    "": a public class of the module ``path`` names, or, where the module part does not import either, one of
    torch.optim's optimizers or our registered variants (``optimizers.VARIANTS``). Only close spellings (difflib
    ratio >= 0.8, case ignored): a wrong guess is worse than none. Called on the error path only."""
    module_path, _, name = path.rpartition(".")
    try:
        module = importlib.import_module(module_path) if module_path else None
    except Exception:  # (any import failure: the module part is misspelled too)
        module = None
    if module is not None:  # the class name alone is compared (a shared module prefix would make any name close)
        names = [n for n in dir(module) if not n.startswith("_") and inspect.isclass(getattr(module, n))]
        found = _closest(name, names)
        return f"{module_path}.{found}" if found else ""
    known = [f"torch.optim.{n}" for n in dir(torch.optim) if _is_optimizer(getattr(torch.optim, n))]
    try:
        from optimizers import VARIANTS

        known += [v.component for v in VARIANTS.values()]
    except Exception:  # (our optimizers need triton's import to succeed; a suggestion is not worth a failure)
        pass
    return _closest(path, known)


def _is_optimizer(obj) -> bool:
    return inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer) and obj is not torch.optim.Optimizer


def _closest(word: str, candidates) -> str:
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.8)
    return by_lower[match[0]] if match else ""


def resolve_optimizer(cfg_optimizer: DictConfig) -> OptimizerSpec:
    """Import the optimizer's class and check its kwargs against its signature; nothing is built here."""
    path = cfg_optimizer.get("_component_")
    if not path:
        raise BadInput("optimizer._component_ is missing; set optimizer=torch.optim.AdamW (or another class path)")
    cls = _import(path, "optimizer")
    if not callable(cls):
        raise BadInput(f"optimizer={path} is not a class or function; use a class path such as torch.optim.AdamW")
    inner = cfg_optimizer.get("optimizer_class")
    inner = _import(inner, "optimizer.optimizer_class") if isinstance(inner, str) else inner
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # builtins without a signature: let the call decide
        params = None
    takes_any = params is None or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    keep = OmegaConf.create({})
    dropped = []
    for key, value in cfg_optimizer.items():
        if key in ("_component_", "optimizer_class"):
            continue
        if takes_any or key in params:
            keep[key] = value
        elif key in TORCH_BACKEND_FLAGS:
            dropped.append(f"{key}={value}")
        else:
            accepted = ", ".join(k for k in params if k not in ("self", "params"))
            raise BadInput(
                f"optimizer.{key}={value} is not accepted by {path} (it takes: {accepted}); remove it "
                f"with ~optimizer.{key}"
            )
    if dropped:
        log.info(f"{path} does not take torch.optim's backend flag(s) {', '.join(dropped)}: dropped them")
    return OptimizerSpec(path=path, cls=cls, kwargs=keep, inner=inner)


def warn_round_to_nearest(path: str, dtype: torch.dtype) -> None:
    """One line for a torch.optim Adam/AdamW run on bf16 weights: its updates round to the nearest bf16 value."""
    if dtype == torch.bfloat16 and path in ("torch.optim.AdamW", "torch.optim.Adam"):
        log.warning(
            f"{path} on bf16 weights rounds every update to the nearest bf16 value: at fine-tuning learning rates "
            "most updates are below half a bf16 step and vanish (measured: ~0.27 of the fp32-master improvement kept "
            "at lr 2e-5). optimizer=optimizers.AdamW8bit (or AdamW4bit, AdamW) rounds stochastically and keeps it "
            "(docs/optimizers.md)"
        )
