"""The config, checked once into the frozen sections of one ``Settings`` object before anything is built or written.

Every check a config value gets lives in this package: unknown keys and the number vocabulary (checks.py), the keys
that depend on the machine (hardware.py), the paths a run reads (paths.py), and each section's reader and the rules
that join sections (read.py), into the sections of sections.py: training, data, validation, memory, model,
checkpoint. A component takes its section, not the whole. A bad value is one ``BadInput`` naming the key and the fix;
the recipes print it as ``error: ...`` and exit 2. Checks that need something built (the tokenizer's length against
the model's, the dataset's records) are in the component that builds it.
"""

from finetune.base import BadInput, first_line
from finetune.sections import (
    CheckpointSettings,
    DataSettings,
    MemorySettings,
    ModelSettings,
    Settings,
    TrainingSettings,
    ValidationSettings,
)
from finetune.settings.hardware import FP8_RECIPES, read_fp8, read_packed_attention
from finetune.settings.read import DISTRIBUTED_CONFIG_KEYS, KNOWN_CONFIG_KEYS, read_settings

__all__ = [
    "BadInput",
    "CheckpointSettings",
    "DISTRIBUTED_CONFIG_KEYS",
    "DataSettings",
    "FP8_RECIPES",
    "KNOWN_CONFIG_KEYS",
    "MemorySettings",
    "ModelSettings",
    "Settings",
    "TrainingSettings",
    "ValidationSettings",
    "first_line",
    "read_fp8",
    "read_packed_attention",
    "read_settings",
]
