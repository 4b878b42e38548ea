"""The model: builders torchtune lacks (``builders``: Qwen3, Qwen3-MoE, Mistral 7B v0.3; the MoE blocks: ``moe``),
packed rows' attention (``attention``), the fused output layer and loss (``loss``), the device and the model as the
recipes prepare them (``prepare``). Configs name ``finetune.model.qwen3_8b``, ``finetune.model.LinearCrossEntropyLoss``."""

from finetune.model.builders import (
    mistral_7b_v0_3,
    qwen3,
    qwen3_0_6b,
    qwen3_1_7b,
    qwen3_4b,
    qwen3_8b,
    qwen3_moe,
    qwen3_moe_30b_a3b,
)
from finetune.model.loss import LinearCrossEntropyLoss

__all__ = [
    "LinearCrossEntropyLoss",
    "mistral_7b_v0_3",
    "qwen3",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_moe",
    "qwen3_moe_30b_a3b",
]
