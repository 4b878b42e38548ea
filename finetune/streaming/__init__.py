"""Streaming between host and GPU memory, for GPUs that cannot hold a 7-8B model's whole training state."""

from finetune.streaming.states import StreamedStates, check_host_memory

__all__ = ["StreamedStates", "check_host_memory"]
