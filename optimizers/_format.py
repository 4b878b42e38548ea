"""The state-format contract (``StateFormat``) and the Triton memory primitives every format's helpers use.

A state format is how one moment is stored: codes (and, for the quantized formats, an fp32 scale per block of
``block_size`` elements), with a plain-PyTorch ``quantize``/``dequantize`` pair (the reference path) and three
Triton helpers (``load``, ``decode``, ``store``) that the one update kernel (``_kernel.py``) calls for it. Each format
is a module constant of its file (``_unquantized.py``, ``adamw8bit.py``, ``adamw4bit.py``, ``adamw_fp8.py``); the
shared coding primitives are in ``_codes.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ._triton import INTERPRET, jit, tl

# Whether the kernel runs under TRITON_INTERPRET: a few conversions are spelled out there (see round_to).
_INTERP = tl.constexpr(INTERPRET)


@dataclass(frozen=True)
class StateFormat:
    """How one state format stores a moment. One instance per format file."""

    name: str  # saved in state_dict param_groups as 'state_format'; loading another format is refused
    block_size: int  # elements per quantization block; also the padding unit of each parameter's slice
    code_dtype: torch.dtype  # storage dtype of the codes
    elems_per_code: int  # 2 for packed 4-bit codes, else 1
    scaled: bool  # whether a per-block fp32 scale is stored
    # plain-PyTorch path: quantize(x [nblk, block] fp32, signed) -> (codes [nblk, block // elems_per_code],
    # scale [nblk])
    quantize: Callable
    # dequantize(codes, scale, signed) -> [nblk, block] fp32
    dequantize: Callable
    # Triton path, three @triton.jit helpers (use ld/st/ldb/stb below for the optional masks):
    #   load(codes, scale, lo, hi, rows, bmask) -> (raw_lo, raw_hi, s): the loads only, no arithmetic (the kernel
    #     issues them a tile ahead); codes/scale point at the tile's first code and block scale, lo/hi are int32
    #     element offsets [NB, block/2] inside the tile, rows = the tile's block indices [NB] (in the layout of a
    #     reduction over axis 1), bmask None (full tile) or [NB];
    #   decode(raw_lo, raw_hi, s, lut, SIGNED) -> (lo, hi) fp32 [NB, block/2];
    #   store(codes, scale, lo, hi, rows, bmask, val_lo, val_hi, root_lo, root_hi, lut, SIGNED): quantize and store
    #     val (root = sqrt(val) for the second moment, already computed by the update; = val for the first).
    #   lut points at the format's ``table`` on the device (for table-coded formats; else a dummy).
    # (Triton cannot return None from a helper, hence ld/st for element masks and ldb/stb for block masks.)
    triton_load: Any
    triton_decode: Any
    triton_store: Any
    bytes_per_element: float = 1.0  # per moment, scales included
    # int32 lookup table(s) the Triton helpers read through ``lut`` (copied to each bucket's device once)
    table: Optional[torch.Tensor] = None
    # The first moment is rounded stochastically: quantize(x, True, dither) takes ``m_dither``'s 23-bit integers
    # (one per element) on the PyTorch path, and the Triton store gets the kernel's same bits as its root_lo/hi.
    dithered_m: bool = False
    # Triton launch shape: blocks per tile, warps per program, persistent programs per SM; tuned on the H200
    # (bench/results/optimizer_sweep_h200.log)
    tile_blocks: int = 4
    num_warps: int = 4
    programs_per_sm: int = 8
    max_registers: Optional[int] = None  # per thread (Triton's maxnreg), to fit more programs per SM

    def __post_init__(self):
        _FORMATS[self.name] = self

    def __reduce__(self):
        # copy.deepcopy and pickle refer to a format by its name: each is a module constant, and its Triton helpers
        # (and closures) neither copy nor pickle
        return (format_named, (self.name,))


_FORMATS: dict = {}  # every StateFormat by name (importing optimizers defines them all)


def format_named(name: str) -> StateFormat:
    return _FORMATS[name]


@jit
def round_to(x, ty: tl.constexpr):
    """fp32 -> ``ty`` with round-to-nearest-even. On the GPU that is the hardware conversion. Under TRITON_INTERPRET
    the bf16 conversion does not round to even, so there the rounding is spelled out in integer ops (bit-equal to
    the GPU's cvt.rn; CI would otherwise test a different function from the one the GPU runs). Inputs are finite."""
    if _INTERP and ty == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(ty)


@jit
def ld(ptr, mask, other):
    """``tl.load`` with an optional mask: full tiles pass ``mask=None`` and get unpredicated, vectorised loads."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=other)


@jit
def st(ptr, val, mask):
    """``tl.store`` with an optional mask (see ``ld``)."""
    if mask is None:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=mask)


@jit
def ldb(ptr, bmask, other):
    """``ld`` with a per-block mask [NB] (or None) broadcast over each block's elements [NB, K]."""
    if bmask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=bmask[:, None], other=other)


@jit
def stb(ptr, val, bmask):
    """``st`` with a per-block mask [NB] (or None), like ``ldb``."""
    if bmask is None:
        tl.store(ptr, val)
    else:
        tl.store(ptr, val, mask=bmask[:, None])


@jit
def st_scale(scale, lo, absmax, bmask, BLOCK: tl.constexpr):
    """Store the per-block scales [NB] (a row reduction of the tile) at ``scale + block``.

    Written as a masked [NB, BLOCK/2] store of the broadcast value, one element per block enabled: a plain [NB]
    store makes Triton convert the reduction's layout to a 1-D one through shared memory, with two barriers per
    tile, which stalls all warps of the program mid-update."""
    first = (lo % BLOCK) == 0
    if bmask is not None:
        first = first & bmask[:, None]
    tl.store(scale + lo // BLOCK, tl.broadcast_to(absmax[:, None], lo.shape), mask=first)
