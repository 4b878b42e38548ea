"""4-bit AdamW: both moments as 4-bit codes, block 128, fp32 scale per block, two codes per byte.

Bytes per parameter: 1 (two 4-bit codes) + 2 x 4/128 scale = 1.06.

- First moment: the signed 4-bit dynamic map (0, 1.0 and three power-of-16 levels of +-values; see
  ``_dynamic_map.py``).
- Second moment (``second_moment=``), both without a zero code, as in "Memory Efficient Optimizers with 4-bit
  States" (Li et al., 2023): with a zero code, small second moments round to 0 and m / (sqrt(v) + eps) explodes;
  without it they round up, which only shrinks those steps.

  - ``"dynamic"`` (default): the unsigned 4-bit dynamic map (0 only for v = 0; 14 values from 16^-3 of the block
    max up, and 1.0). Second moments span g^2's range, so inside one block of 128 they differ by orders of
    magnitude; a linear map floors everything under 1/16 of the block max, which shrinks those elements' steps
    (seen in the loss-parity runs, bench/results/loss_parity.json).
  - ``"linear"``: values (c + 1) / 16 of the block max (the paper's linear map). Cheaper to encode.

  The paper's rank-1 normalisation (scale = min(row max, column max)) would need a whole-tensor reduction before
  quantising, a second pass over the state; block-wise scaling keeps the update one pass.

Packing: byte j of a block holds element j (low nibble) and element j + 64 (high nibble), so the kernel packs
two halves it already holds in registers, with no shuffles.
"""

import torch

from . import _dynamic_map as dm
from ._triton import jit, tl
from ._update import LowBitAdamW, StateFormat, ld, ldb, st_scale, stb

BLOCK = 128
_BLOCK = tl.constexpr(BLOCK) if tl is not None else None  # Triton reads only constexpr globals
_HALF = tl.constexpr(BLOCK // 2) if tl is not None else None  # Triton reads only constexpr globals
_QMAP_SIGNED = dm.dynamic_map(4, signed=True)
_QMAP_DYNAMIC = dm.dynamic_map(4, signed=False)
_QMAP_LINEAR = (torch.arange(16, dtype=torch.float32) + 1.0) / 16.0


def _encode_linear(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    c = torch.floor((x.abs() * inv) * 16.0 + 0.5) - 1.0
    return torch.clamp(c, 0.0, 15.0).to(torch.int32)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    half = BLOCK // 2
    return (codes[:, :half] | (codes[:, half:] << 4)).to(torch.uint8)


def _unpack(codes: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    c = codes.long()
    qmap = qmap.to(codes.device)
    return torch.cat([qmap[c & 15], qmap[c >> 4]], dim=1)


def quantize(x: torch.Tensor, signed: bool):
    absmax, inv = dm.inv_absmax(x)
    return _pack(dm.encode(x, inv[:, None], 4, signed)), absmax


def dequantize(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    return _unpack(codes, _QMAP_SIGNED if signed else _QMAP_DYNAMIC) * scale[:, None]


def quantize_linear_v(x: torch.Tensor, signed: bool):
    if signed:
        return quantize(x, signed)
    absmax, inv = dm.inv_absmax(x)
    return _pack(_encode_linear(x, inv[:, None])), absmax


def dequantize_linear_v(codes: torch.Tensor, scale: torch.Tensor, signed: bool) -> torch.Tensor:
    return _unpack(codes, _QMAP_SIGNED if signed else _QMAP_LINEAR) * scale[:, None]


@jit
def _load(codes, scale, lo, hi, rows, bmask):
    # One byte holds both halves' codes: returned as raw_lo (raw_hi is the same value).
    byte = ldb(codes + (lo - rows[:, None] * _HALF), bmask, 0)
    return byte, byte, ld(scale + rows, bmask, 0.0)


@jit
def _decode(byte, unused, s, SIGNED: tl.constexpr):
    s = s[:, None]
    byte = byte.to(tl.int32)
    return dm.decode_tl(byte & 15, 4, SIGNED) * s, dm.decode_tl(byte >> 4, 4, SIGNED) * s


@jit
def _decode_linear_v(byte, unused, s, SIGNED: tl.constexpr):
    if SIGNED:
        return _decode(byte, unused, s, True)
    else:  # (c + 1) / 16
        s = s[:, None] * 0.0625
        byte = byte.to(tl.int32)
        return ((byte & 15) + 1).to(tl.float32) * s, ((byte >> 4) + 1).to(tl.float32) * s


@jit
def _encode_linear_tl(x, inv):
    c = tl.floor((tl.abs(x) * inv) * 16.0 + 0.5) - 1.0
    return tl.minimum(tl.maximum(c, 0.0), 15.0).to(tl.int32)


@jit
def _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, SIGNED: tl.constexpr):
    absmax, inv = dm.inv_absmax_tl(val_lo, val_hi)
    st_scale(scale, lo, absmax, bmask, _BLOCK)
    c_lo = dm.encode_tl(val_lo, inv[:, None], 4, SIGNED)
    c_hi = dm.encode_tl(val_hi, inv[:, None], 4, SIGNED)
    stb(codes + (lo - rows[:, None] * _HALF), (c_lo | (c_hi << 4)).to(tl.uint8), bmask)


@jit
def _store_linear_v(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, SIGNED: tl.constexpr):
    if SIGNED:
        _store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, True)
    else:
        absmax, inv = dm.inv_absmax_tl(val_lo, val_hi)
        st_scale(scale, lo, absmax, bmask, _BLOCK)
        c_lo = _encode_linear_tl(val_lo, inv[:, None])
        c_hi = _encode_linear_tl(val_hi, inv[:, None])
        stb(codes + (lo - rows[:, None] * _HALF), (c_lo | (c_hi << 4)).to(tl.uint8), bmask)


FORMAT = StateFormat(
    name="4bit.v2", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=2, scaled=True,
    quantize=quantize, dequantize=dequantize, triton_load=_load, triton_decode=_decode, triton_store=_store,
    bytes_per_element=0.5 + 4 / BLOCK,
    tile_blocks=8, num_warps=4,
)
FORMAT_LINEAR_V = StateFormat(
    name="4bit-linear-v.v2", block_size=BLOCK, code_dtype=torch.uint8, elems_per_code=2, scaled=True,
    quantize=quantize_linear_v, dequantize=dequantize_linear_v, triton_load=_load, triton_decode=_decode_linear_v,
    triton_store=_store_linear_v, bytes_per_element=0.5 + 4 / BLOCK, tile_blocks=8, num_warps=4,
)


class AdamW4bit(LowBitAdamW):
    """AdamW with 4-bit blockwise (block 128) states: about 1.06 bytes of state per parameter.

    Same arguments and defaults as ``torch.optim.AdamW`` (``amsgrad`` unsupported), plus ``second_moment``
    (``"dynamic"``, the default, or ``"linear"``: see the module docstring) and the keyword-only extras of
    ``optimizers.AdamW8bit`` (``backend``, ``min_quant_numel``, ``stochastic_round``, ``compensate``).
    """

    FORMAT = FORMAT

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, second_moment="dynamic", backend="auto", min_quant_numel=4096,
                 stochastic_round=False, compensate=False, tile_blocks=None, num_warps=None, programs_per_sm=None):
        # Spelled out (no **kwargs): the recipe reads this signature to drop torch-only flags such as fused=True.
        formats = {"dynamic": FORMAT, "linear": FORMAT_LINEAR_V}
        if second_moment not in formats:
            raise ValueError(f"second_moment must be 'dynamic' or 'linear', got {second_moment!r}")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, maximize=maximize, backend=backend,
                         min_quant_numel=min_quant_numel, stochastic_round=stochastic_round, compensate=compensate,
                         tile_blocks=tile_blocks, num_warps=num_warps, programs_per_sm=programs_per_sm,
                         _format=formats[second_moment])
