"""Streaming between host and GPU memory, for GPUs that cannot hold a 7-8B model's whole training state.

The names below are loaded on first use (``finetune.streaming.stream_weights`` imports ``weights.py`` then): a run
that streams nothing (the 24-80 GB configs of the 7-8B and 3B models) never imports this package's modules, so the
end-to-end rows of those configs, which name the files their runs imported (bench/configs_check.py), stay current
across changes to streaming."""

import importlib
from typing import Any

_HOME = {
    "check_host_room": "room",
    "StreamedStates": "states",
    "StreamedWeights": "weights",
    "step_metrics": "weights",
    "stream_weights": "weights",
}

__all__ = sorted(_HOME)


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
