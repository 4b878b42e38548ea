"""8-bit AdamW: both moments as 8-bit dynamic-map codes, block 256, fp32 scale per block.

Bytes per parameter: 2 codes + 2 x 4/256 scale = 2.03 (torch AdamW with fp32 states: 8; bf16 states: 4).
The first moment uses the signed map, the second the unsigned one (twice the resolution, no sign bit).
See ``_dynamic_map.py`` for the code and ``_update.py`` for the shared update and the two paths.
"""

import torch

from . import _dynamic_map as dm
from ._triton import jit, tl
from ._update import LowBitAdamW, StateFormat, ld, ldb, st_scale, stb

BLOCK = 256
_BLOCK = tl.constexpr(BLOCK) if tl is not None else None  # Triton reads only constexpr globals
_QMAP_SIGNED = dm.dynamic_map(8, signed=True)
_QMAP_UNSIGNED = dm.dynamic_map(8, signed=False)


def quantize(x: torch.Tensor, signed: bool):
    absmax, inv = dm.inv_absmax(x)
    return dm.encode(x, inv[:, None], 8, signed).to(torch.uint8), absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    qmap = (_QMAP_SIGNED if signed else _QMAP_UNSIGNED).to(codes.device)
    return qmap[codes.long()] * scale[:, None]


@jit
def _load(codes, scale, lo, hi, rows, bmask):
    return ldb(codes + lo, bmask, 0), ldb(codes + hi, bmask, 0), ld(scale + rows, bmask, 0.0)


@jit
def _decode(c_lo, c_hi, s, SIGNED: tl.constexpr):
    s = s[:, None]
    return dm.decode_tl(c_lo.to(tl.int32), 8, SIGNED) * s, dm.decode_tl(c_hi.to(tl.int32), 8, SIGNED) * s


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, SIGNED: tl.constexpr):
    absmax, inv = dm.inv_absmax_tl(val_lo, val_hi)
    st_scale(scale, lo, absmax, bmask, _BLOCK)
    stb(codes + lo, dm.encode_tl(val_lo, inv[:, None], 8, SIGNED).to(tl.uint8), bmask)
    stb(codes + hi, dm.encode_tl(val_hi, inv[:, None], 8, SIGNED).to(tl.uint8), bmask)


FORMAT = StateFormat(
    name="8bit.v2", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=1, scaled=True,
    quantize=quantize, dequantize=dequantize, triton_load=_load, triton_decode=_decode, triton_store=_store,
    bytes_per_element=1.0 + 4 / BLOCK,
)


class AdamW8bit(LowBitAdamW):
    """AdamW with 8-bit blockwise (block 256) dynamic-map states: about 2 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus keyword-only extras:

    - ``backend``: ``"auto"`` (Triton on CUDA, PyTorch elsewhere), ``"triton"`` or ``"torch"``.
    - ``min_quant_numel`` (4096): smaller tensors keep fp32 states.
    - ``stochastic_round``: round bf16 weights stochastically (unbiased; no extra memory).
    - ``compensate``: keep a bf16 error buffer per weight (Kahan-style, +2 bytes/param) so updates below a bf16
      ulp accumulate instead of vanishing.
    """

    FORMAT = FORMAT
