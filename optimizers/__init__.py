"""Our AdamW variants: torch.optim.AdamW's signature, low-bit states, one multi-tensor Triton kernel per step.

| class                    | state format                                                        | bytes/param |
|--------------------------|---------------------------------------------------------------------|-------------|
| ``optimizers.AdamW``     | bf16 (or fp32 with state_dtype)                                     | 4 (8)       |
| ``optimizers.AdamW8bit`` | m e4m3, sqrt(v) as an 8-bit float, block 256                        | 2.03        |
| ``optimizers.AdamW4bit`` | m 4-bit levels, stochastically rounded; sqrt(v) 4-bit float; 128    | 1.06        |
| ``optimizers.AdamWFp8``  | float8 e4m3, block 256                                              | 2.03        |

Adding a format: one file (``StateFormat`` + a ~10-line public class), one export here, one spec in
``tests/test_optimizers.py``, one row in ``docs/optimizers.md``.
"""

from .adamw import AdamW
from .adamw4bit import AdamW4bit
from .adamw8bit import AdamW8bit
from .adamw_fp8 import AdamWFp8

__all__ = ["AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8"]
