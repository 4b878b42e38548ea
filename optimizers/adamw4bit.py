"""4-bit AdamW: both moments as 4-bit codes, block 128, fp32 scale per block, two codes per byte.

Bytes per parameter: 1 (two 4-bit codes) + 2 x 4/128 scale = 1.06.

- First moment: the signed 4-bit dynamic map (0, 1.0 and three decades of +-values; see ``_dynamic_map.py``).
- Second moment: a linear map without zero, values (c + 1) / 16 of the block max, as in "Memory Efficient
  Optimizers with 4-bit States" (Li et al., 2023): with a zero code, small second moments round to 0 and
  m / (sqrt(v) + eps) explodes; without it they round up, which only shrinks those steps. The paper's rank-1
  normalisation (scale = min(row max, column max)) would need a whole-tensor reduction before quantising, a
  second pass over the state; block-wise scaling keeps the update one pass. Loss parity (bench/) is the check.

Packing: byte j of a block holds element j (low nibble) and element j + 64 (high nibble), so the kernel packs
two halves it already holds in registers, with no shuffles.
"""

import torch

from . import _dynamic_map as dm
from ._triton import jit, tl
from ._update import LowBitAdamW, StateFormat

BLOCK = 128
_HALF = tl.constexpr(BLOCK // 2) if tl is not None else None  # Triton reads only constexpr globals
_QMAP_SIGNED = dm.dynamic_map(4, signed=True)
_QMAP_UNSIGNED = (torch.arange(16, dtype=torch.float32) + 1.0) / 16.0


def _encode_linear(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    c = torch.floor((x.abs() * inv) * 16.0 + 0.5) - 1.0
    return torch.clamp(c, 0.0, 15.0).to(torch.int32)


def quantize(x: torch.Tensor, signed: bool):
    absmax, inv = dm.inv_absmax(x)
    inv = inv[:, None]
    codes = dm.encode(x, inv, 4, True) if signed else _encode_linear(x, inv)
    half = BLOCK // 2
    packed = codes[:, :half] | (codes[:, half:] << 4)
    return packed.to(torch.uint8), absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    qmap = (_QMAP_SIGNED if signed else _QMAP_UNSIGNED).to(codes.device)
    c = codes.long()
    return torch.cat([qmap[c & 15], qmap[c >> 4]], dim=1) * scale[:, None]


@jit
def _load(codes, scale, qmap, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, SIGNED: tl.constexpr):
    s = tl.load(scale + blk, mask=bmask, other=0.0)[:, None]
    byte = tl.load(codes + (off_lo - blk[:, None] * _HALF), mask=bmask[:, None], other=0).to(tl.int32)
    lo, hi = byte & 15, byte >> 4
    if SIGNED:
        return dm.decode_tl(lo, 4, True) * s, dm.decode_tl(hi, 4, True) * s
    else:  # linear map without zero: (c + 1) / 16
        return (lo + 1).to(tl.float32) * (s * 0.0625), (hi + 1).to(tl.float32) * (s * 0.0625)


@jit
def _encode_linear_tl(x, inv):
    c = tl.floor((tl.abs(x) * inv) * 16.0 + 0.5) - 1.0
    return tl.minimum(tl.maximum(c, 0.0), 15.0).to(tl.int32)


@jit
def _store(codes, scale, off_lo, off_hi, blk, emask_lo, emask_hi, bmask, lo, hi, SIGNED: tl.constexpr):
    absmax, inv = dm.inv_absmax_tl(lo, hi)
    tl.store(scale + blk, absmax, mask=bmask)
    if SIGNED:
        c_lo = dm.encode_tl(lo, inv[:, None], 4, True)
        c_hi = dm.encode_tl(hi, inv[:, None], 4, True)
    else:
        c_lo = _encode_linear_tl(lo, inv[:, None])
        c_hi = _encode_linear_tl(hi, inv[:, None])
    byte = (c_lo | (c_hi << 4)).to(tl.uint8)
    tl.store(codes + (off_lo - blk[:, None] * _HALF), byte, mask=bmask[:, None])


FORMAT = StateFormat(
    name="4bit", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=2, scaled=True,
    quantize=quantize, dequantize=dequantize, triton_load=_load, triton_store=_store,
    qmap_signed=_QMAP_SIGNED, qmap_unsigned=_QMAP_UNSIGNED, bytes_per_element=0.5 + 4 / BLOCK,
    tile_blocks=8, num_warps=4,
)


class AdamW4bit(LowBitAdamW):
    """AdamW with 4-bit blockwise (block 128) states: about 1.06 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus the keyword-only
    extras of ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).
    """

    FORMAT = FORMAT
