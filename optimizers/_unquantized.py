"""Unquantized states: plain bf16 or fp32 moments, through the same kernel as the low-bit formats.

``FORMAT_BF16`` is ``optimizers.AdamW``'s default (4 bytes per parameter), ``FORMAT_FP32`` its ``state_dtype=fp32``
(8 bytes) and also where every optimizer keeps tiny tensors (norm weights, biases), whose states are not worth
quantizing (``LowBitAdamW.param_format``).
"""

import torch

from ._format import StateFormat, ldb, round_to, stb
from ._triton import jit, tl

BLOCK = 256  # only the tiling and padding unit here: nothing is block-scaled


def _make(dtype: torch.dtype, name: str) -> StateFormat:
    def quantize(x, signed):
        return x.to(dtype), None

    def dequantize(codes, scale, signed):
        return codes.float()

    return StateFormat(
        name=name,
        block_size=BLOCK,
        code_dtype=dtype,
        elems_per_code=1,
        scaled=False,
        quantize=quantize,
        dequantize=dequantize,
        triton_load=_load,
        triton_decode=_decode,
        triton_store=_store,
        bytes_per_element=torch.finfo(dtype).bits / 8,
        tile_blocks=2,
        num_warps=1,
        programs_per_sm=16,
    )


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
