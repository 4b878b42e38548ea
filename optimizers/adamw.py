"""16-bit (or 32-bit) AdamW: plain moments in bf16 or fp32, through the same kernel as the low-bit formats.

Bytes per parameter: 4 with bf16 states (``state_dtype=torch.bfloat16``, the default), 8 with fp32. The fp32
format is also where every optimizer keeps tiny tensors (norm weights), whose states are not worth quantizing.
"""

import torch

from ._triton import jit, tl
from ._update import LowBitAdamW, StateFormat, _set_fp32_format, ldb, round_to, stb

BLOCK = 256  # only the tiling and padding unit here: nothing is block-scaled


def _make(dtype: torch.dtype, name: str) -> StateFormat:
    def quantize(x, signed):
        return x.to(dtype), None

    def dequantize(codes, scale, signed):
        return codes.float()

    return StateFormat(name=name, block_size=BLOCK, code_dtype=dtype, elems_per_code=1, scaled=False,
                       quantize=quantize, dequantize=dequantize, triton_load=_load, triton_decode=_decode,
                       triton_store=_store, bytes_per_element=torch.finfo(dtype).bits / 8,
                       tile_blocks=2, num_warps=1, programs_per_sm=16)


@jit
def _load(codes, scale, lo, hi, rows, bmask):
    # Block masks suffice: a state slice is padded to whole blocks, and its padding stays zero (g = p = 0 there).
    return ldb(codes + lo, bmask, 0.0), ldb(codes + hi, bmask, 0.0), 0.0


@jit
def _decode(c_lo, c_hi, s, lut, SIGNED: tl.constexpr):
    return c_lo.to(tl.float32), c_hi.to(tl.float32)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED: tl.constexpr):
    stb(codes + lo, round_to(val_lo, codes.dtype.element_ty), bmask)
    stb(codes + hi, round_to(val_hi, codes.dtype.element_ty), bmask)


FORMAT_BF16 = _make(torch.bfloat16, "bf16")
FORMAT_FP32 = _make(torch.float32, "fp32")
_set_fp32_format(FORMAT_FP32)


class AdamW(LowBitAdamW):
    """AdamW with 16-bit (default) or 32-bit moments, updated by one multi-tensor kernel per step on CUDA.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus keyword-only extras:
    ``state_dtype`` (``torch.bfloat16`` or ``torch.float32``, or the strings ``"bf16"``/``"fp32"``), and those
    of ``optimizers.AdamW8bit`` (``backend``, ``stochastic_round``, ``compensate``).

    bf16 weights are rounded stochastically by default (``stochastic_round=None``: on unless ``compensate=True``;
    ``stochastic_round=False`` rounds to nearest, as torch's AdamW does): at fine-tuning learning rates most updates
    are below half a bf16 ulp and round to nearest away, which kept only 0.26-0.29 of the fp32-master reference's
    loss improvement in our H200 runs against 0.99-1.01 with stochastic rounding (``optimizers.AdamW8bit``'s
    docstring has the setup). It costs ~1.1 ms per Llama2-7B step here. fp32 weights are unaffected.
    """

    FORMAT = FORMAT_BF16

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, state_dtype=torch.bfloat16, backend="auto", stochastic_round=None,
                 compensate=False, tile_blocks=None, num_warps=None, programs_per_sm=None):
        # Spelled out (no **kwargs) so that inspect.signature shows exactly what this class accepts: the
        # recipe uses it to drop torch-only flags such as fused=True when the optimizer is swapped.
        names = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}
        dtype = names.get(state_dtype, state_dtype) if isinstance(state_dtype, str) else state_dtype
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"state_dtype must be torch.bfloat16 or torch.float32 ('bf16'/'fp32'), got {state_dtype!r}")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, backend=backend,
                         stochastic_round=stochastic_round, compensate=compensate, tile_blocks=tile_blocks,
                         num_warps=num_warps, programs_per_sm=programs_per_sm, _format=FORMAT_BF16 if dtype == torch.bfloat16 else FORMAT_FP32)
