"""16-bit (or 32-bit) AdamW: plain moments in bf16 or fp32 (``_unquantized.py``), through the same kernel as the
low-bit formats. Bytes per parameter: 4 with bf16 states (the default), 8 with fp32."""

import torch

from ._optimizer import LowBitAdamW
from ._unquantized import FORMAT_BF16, FORMAT_FP32


class AdamW(LowBitAdamW):
    """AdamW with 16-bit (default) or 32-bit moments, updated by one multi-tensor kernel per step on CUDA.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus keyword-only extras:
    ``state_dtype`` (``torch.bfloat16`` or ``torch.float32``, or the strings ``"bf16"``/``"fp32"``), and those
    of ``optimizers.AdamW8bit`` (``backend``, ``stochastic_round``, ``compensate``).

    bf16 weights are rounded stochastically by default (``stochastic_round=None``: on unless ``compensate=True``;
    ``stochastic_round=False`` rounds to nearest, as torch's AdamW does): at fine-tuning learning rates most updates
    are below half a bf16 ulp and round to nearest away (docs/optimizers.md, "bf16 weights", has the measurement).
    It costs ~1.1 ms per Llama2-7B step on the H200 (bench/results/optimizer_step_h200.json). fp32 weights are
    unaffected.
    """

    FORMAT = FORMAT_BF16

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        state_dtype=torch.bfloat16,
        backend="auto",
        stochastic_round=None,
        compensate=False,
        tile_blocks=None,
        num_warps=None,
        programs_per_sm=None,
    ):
        # Spelled out (no **kwargs) so that inspect.signature shows exactly what this class accepts: the
        # recipe uses it to drop torch-only flags such as fused=True when the optimizer is swapped.
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
        dtype = names.get(state_dtype, state_dtype) if isinstance(state_dtype, str) else state_dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(
                f"state_dtype must be torch.bfloat16 or torch.float32 ('bf16'/'fp32'), got {state_dtype!r}"
            )
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            amsgrad,
            maximize=maximize,
            backend=backend,
            stochastic_round=stochastic_round,
            compensate=compensate,
            tile_blocks=tile_blocks,
            num_warps=num_warps,
            programs_per_sm=programs_per_sm,
            _format=FORMAT_BF16 if dtype == torch.bfloat16 else FORMAT_FP32,
        )
