"""Streaming between host and GPU memory, for GPUs that cannot hold a 7-8B model's whole training state."""

from finetune.streaming.room import check_host_room
from finetune.streaming.states import StreamedStates
from finetune.streaming.weights import StreamedWeights, step_metrics, stream_weights

__all__ = [
    "StreamedStates",
    "StreamedWeights",
    "check_host_room",
    "step_metrics",
    "stream_weights",
]
