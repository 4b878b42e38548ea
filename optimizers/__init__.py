"""Our AdamW variants: torch.optim.AdamW's signature, low-bit states, one multi-tensor Triton kernel per step.

``VARIANTS`` lists them (key -> ``Variant``); docs/optimizers.md is the user's guide, one page per variant.

Layout: ``_format.py`` (the state-format contract and memory primitives), ``_codes.py`` (coding primitives shared
by formats), ``_random_bits.py`` (the kernel's random bits and their PyTorch twins), ``_kernel.py`` (the Triton
kernel), ``_plain.py`` (its plain-PyTorch twin, the path on CPU), ``_buckets.py`` (the flat state buffers),
``_launch.py`` (the host side of the Triton path),
``_optimizer.py`` (``LowBitAdamW``, the torch.optim.Optimizer), one file per format (``_unquantized.py`` with
``adamw.py``, ``adamw8bit.py``, ``adamw4bit.py``, ``adamw_fp8.py``), ``_registry.py``. Public besides the classes:
``portable.py``, one parameter's state whatever its sharding (what a checkpoint holds, and its conversion to another
variant's format).
"""

from ._registry import VARIANTS, Variant, register
from .adamw import AdamW
from .adamw4bit import AdamW4bit
from .adamw8bit import AdamW8bit
from .adamw_fp8 import AdamWFp8

__all__ = ["AdamW", "AdamW8bit", "AdamW4bit", "AdamWFp8", "VARIANTS", "Variant", "register"]

register(
    Variant(
        "ours16",
        "optimizers.AdamW",
        AdamW,
        2 * AdamW.FORMAT.bytes_per_element,
        "m and v in bf16 (fp32 with state_dtype='fp32': 8 bytes/param)",
        tol_fp32=0.01,
        tol_bf16=0.04,
        tol_contract=0.01,
        exact_codes=False,
    )
)
register(
    Variant(
        "ours8",
        "optimizers.AdamW8bit",
        AdamW8bit,
        2 * AdamW8bit.FORMAT.bytes_per_element,
        "m as e4m3, sqrt(v) as an unsigned 8-bit float (4 exponent, 4 mantissa bits); fp32 scale per 256",
        tol_fp32=0.03,
        tol_bf16=0.05,
        tol_contract=0.05,
    )
)
register(
    Variant(
        "ours4",
        "optimizers.AdamW4bit",
        AdamW4bit,
        2 * AdamW4bit.FORMAT.bytes_per_element,
        "m as 4-bit levels, rounded stochastically; sqrt(v) as a 4-bit float; fp32 scale per 128",
        tol_fp32=0.25,
        tol_bf16=0.25,
        tol_contract=0.3,
    )
)
register(
    Variant(
        "oursfp8",
        "optimizers.AdamWFp8",
        AdamWFp8,
        2 * AdamWFp8.FORMAT.bytes_per_element,
        "m and v as float8 e4m3; fp32 scale per 256",
        tol_fp32=0.06,
        tol_bf16=0.08,
        tol_contract=0.05,
    )
)
