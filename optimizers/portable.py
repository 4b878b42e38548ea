"""One parameter's state in a form that does not depend on how the parameter is sharded: the moments of the whole
(unsharded, flattened) tensor, in the state format's blocks counted from the tensor's first element.

That is exactly what ``LowBitAdamW.state_dict()`` holds on one device. Under FSDP2 each rank keeps the blocks of its
own shard, counted from the shard's first element (``_buckets.local``): where a shard starts on a multiple of the block
size (every split of a Llama or Mistral matrix: rows of 4096 or 11008 elements), its blocks are the tensor's blocks
and the conversions below copy codes and scales bit for bit. Where a shard starts inside a block (rows whose length
is not a multiple of the block, a shard shorter than a block), the blocks on either side of the split are
dequantized and quantized again in the other grid: those blocks (at most one per split, in ``gather``; the shard's
blocks, in ``shard``) carry one rounding more, within the format's quantization error, and stay in the format (no
fp32 fallback). The checkpoint component (``finetune/checkpoint/optimizer_state.py``) calls these per parameter:
this module is the package's public face for a saved state (the rest of the package is private).

``moments``/``encode`` turn an entry into fp32 moments and back, for resuming with another variant; ``saved_format``
tells which format a saved entry is in, and ``entry_problem`` what makes one unusable (a resume checks every entry
with it before any optimizer loads the state).

Entries are dicts as in ``optimizer.state[p]``: ``exp_avg``/``exp_avg_sq`` (codes [nblk, block / elems_per_code]),
``exp_avg_scale``/``exp_avg_sq_scale`` ([nblk], scaled formats), ``error`` ([nblk, block], with ``compensate``),
``step``. No torchtune import here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ._format import StateFormat, format_named
from ._unquantized import FORMAT_BF16, FORMAT_FP32

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (key, signed)


def saved_format(entry: dict, group: dict) -> StateFormat:
    """The format of one saved entry: its param group's ``state_format``, or fp32/bf16 for an unscaled entry (tiny
    tensors keep fp32 states; ``optimizers.AdamW`` keeps bf16 or fp32)."""
    if "exp_avg_scale" in entry:
        return format_named(group["state_format"])
    return FORMAT_FP32 if entry["exp_avg"].dtype == torch.float32 else FORMAT_BF16


def entry_problem(entry: dict, group: dict, numel: int) -> Optional[str]:
    """What makes a saved entry of a tensor of ``numel`` elements unusable, in a phrase, or None: its moments must be
    the codes of the tensor's whole blocks in its format (``saved_format``), with one finite, non-negative scale per
    block (a block's largest magnitude; 0 for a block of zeros). Shapes and scales only: a pass over the scales is
    1/block of the state, while a pass over every code would cost a resume seconds per GB (damaged codes are the
    checkpoint's checksum's to find)."""
    for key, _ in MOMENTS:
        if not isinstance(entry.get(key), torch.Tensor):
            return f"{key} is {type(entry.get(key)).__name__}, not a tensor"
    try:
        fmt = saved_format(entry, group)
    except KeyError:
        return f"state_format={group.get('state_format')!r} is not a state format of this version of optimizers"
    B, nblk = fmt.block_size, _blocks(numel, fmt.block_size)
    shape = (nblk, B // fmt.elems_per_code)
    for key, _ in MOMENTS:
        codes = entry[key]
        if tuple(codes.shape) != shape or codes.dtype != fmt.code_dtype:
            return (
                f"{key} is {tuple(codes.shape)} {codes.dtype}, where {numel} elements in {fmt.name} blocks of {B} "
                f"take {shape} {fmt.code_dtype}"
            )
        if not fmt.scaled:
            continue
        scale = entry.get(key + "_scale")
        if not isinstance(scale, torch.Tensor) or tuple(scale.shape) != (nblk,) or not scale.is_floating_point():
            what = tuple(scale.shape) if isinstance(scale, torch.Tensor) else type(scale).__name__
            return f"{key}_scale is {what}, where {nblk} blocks take ({nblk},) floats"
        bad = (~(torch.isfinite(scale) & (scale >= 0))).nonzero()
        if bad.numel():
            i = int(bad[0])
            return (
                f"{key}_scale[{i}] is {float(scale[i])}, where a block's scale is its largest magnitude (finite, >= 0)"
            )
    error = entry.get("error")
    if error is not None and (not isinstance(error, torch.Tensor) or tuple(error.shape) != (nblk, B)):
        return f"error is {getattr(error, 'shape', type(error).__name__)}, where {nblk} blocks take {(nblk, B)}"
    return None


def _blocks(n: int, block: int) -> int:
    return -(-n // block)


def unpack(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Codes [nblk, block / elems_per_code] -> one code per element [nblk * block] (4-bit: byte j of a block holds
    element j in its low nibble and element j + block/2 in its high one)."""
    if fmt.elems_per_code == 1:
        return codes.reshape(-1)
    return torch.cat([codes & 15, codes >> 4], dim=1).reshape(-1)


def pack(flat: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """The inverse of ``unpack``: one code per element [nblk * block] -> [nblk, block / elems_per_code]."""
    rows = flat.reshape(-1, fmt.block_size)
    if fmt.elems_per_code == 1:
        return rows.clone()
    half = fmt.block_size // 2
    return (rows[:, :half] | (rows[:, half:] << 4)).to(torch.uint8)


def _values(entry: dict, key: str, signed: bool, fmt: StateFormat) -> torch.Tensor:
    """A moment as fp32 [nblk * block] (padding included)."""
    codes = entry[key]
    if codes.numel() == 0:
        return torch.zeros(0)
    scale = entry.get(key + "_scale") if fmt.scaled else None
    return fmt.dequantize(codes.cpu(), None if scale is None else scale.cpu().float(), signed).reshape(-1)


def _encode(x: torch.Tensor, signed: bool, fmt: StateFormat) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """fp32 [nblk * block] -> (codes [nblk, block / epc], scale [nblk] or None). Round-to-nearest: a conversion
    keeps no dither (the 4-bit first moment is rounded stochastically only inside the update)."""
    rows = x.reshape(-1, fmt.block_size).float()
    if rows.shape[0] == 0:
        codes = torch.zeros(0, fmt.block_size // fmt.elems_per_code, dtype=fmt.code_dtype)
        return codes, (torch.zeros(0) if fmt.scaled else None)
    codes, scale = fmt.quantize(rows, signed)
    return codes.to(fmt.code_dtype), scale


def moments(entry: dict, fmt: StateFormat, numel: int) -> Dict[str, torch.Tensor]:
    """fp32 ``exp_avg`` and ``exp_avg_sq`` [numel] of an entry of ``numel`` elements (what its codes decode to)."""
    return {key: _values(entry, key, signed, fmt)[:numel] for key, signed in MOMENTS}


def encode(values: Dict[str, torch.Tensor], fmt: StateFormat, step) -> dict:
    """An entry in ``fmt`` for fp32 moments [numel] (``moments``' output), padded to whole blocks."""
    numel = values["exp_avg"].numel()
    padded = _blocks(numel, fmt.block_size) * fmt.block_size
    entry = {"step": step}
    for key, signed in MOMENTS:
        x = torch.zeros(padded)
        x[:numel] = values[key].float()
        codes, scale = _encode(x, signed, fmt)
        entry[key] = codes
        if fmt.scaled:
            entry[key + "_scale"] = scale
    return entry


def gather(pieces: List[Tuple[int, int, dict]], fmt: StateFormat, numel: int) -> dict:
    """The whole tensor's entry from its shards' entries: ``pieces`` holds (element offset, element count, entry)
    per rank. A block that is one shard's own block is copied; a block that straddles a split is dequantized from the
    shards and quantized again as one block."""
    B = fmt.block_size
    nblk = _blocks(numel, B)
    out: dict = {"step": next((e["step"] for _, n, e in pieces if n), pieces[0][2]["step"])}
    for key, signed in MOMENTS:
        codes = torch.zeros(nblk * B, dtype=torch.uint8 if fmt.elems_per_code == 2 else fmt.code_dtype)
        scale = torch.zeros(nblk) if fmt.scaled else None
        values = torch.zeros(nblk * B)
        exact = torch.zeros(nblk, dtype=torch.bool)
        for off, n, entry in pieces:
            if n == 0:
                continue
            values[off : off + n] = _values(entry, key, signed, fmt)[:n]
            if not fmt.scaled or off % B == 0:
                # the shard's whole blocks, and its last partial one where the tensor ends there too
                own = n // B + (1 if n % B and off + n == numel else 0)
                k0 = off // B if fmt.scaled else 0
                if not fmt.scaled:  # elementwise: no blocks to respect
                    codes[off : off + n] = unpack(entry[key], fmt)[:n].to(codes.dtype)
                    continue
                codes[off : off + own * B] = unpack(entry[key], fmt)[: own * B]
                scale[k0 : k0 + own] = entry[key + "_scale"][:own].float()
                exact[k0 : k0 + own] = True
        if fmt.scaled and not bool(exact.all()):
            redo = (~exact).nonzero().flatten()
            rows = values.view(nblk, B)[redo]
            new_codes, new_scale = _encode(rows.reshape(-1), signed, fmt)
            codes.view(nblk, B)[redo] = unpack(new_codes, fmt).view(-1, B).to(codes.dtype)
            scale[redo] = new_scale
        out[key] = pack(codes, fmt)
        if fmt.scaled:
            out[key + "_scale"] = scale
    if any("error" in e for _, _, e in pieces):
        err = torch.zeros(nblk * B, dtype=next(e["error"].dtype for _, _, e in pieces if "error" in e))
        for off, n, entry in pieces:
            if n:
                err[off : off + n] = entry["error"].reshape(-1)[:n]
        out["error"] = err.view(nblk, B)
    return out


def shard(full: dict, fmt: StateFormat, numel: int, off: int, n: int) -> dict:
    """The entry of the shard of ``n`` elements at element ``off`` of a tensor of ``numel``, in the shard's own
    blocks, from the whole tensor's entry (``gather``'s output, or one device's state). A shard that starts on a
    block boundary takes the codes and scales as they are (the scale of a block the shard holds only part of is the
    whole block's, which decodes that part exactly); one that starts inside a block is quantized again in its own
    blocks."""
    B = fmt.block_size
    nblk = _blocks(n, B)
    out: dict = {"step": full["step"]}
    for key, signed in MOMENTS:
        codes = torch.zeros(nblk * B, dtype=torch.uint8 if fmt.elems_per_code == 2 else fmt.code_dtype)
        if not fmt.scaled or off % B == 0:
            # (past the shard: the tensor's own padding where it ends there, else code 0, a zero)
            src = unpack(full[key], fmt)
            end = min(src.numel(), off + nblk * B) if off + n == numel else off + n
            codes[: end - off] = src[off:end].to(codes.dtype)
            out[key] = pack(codes, fmt)
            if fmt.scaled:
                out[key + "_scale"] = full[key + "_scale"][off // B : off // B + nblk].float().clone()
            continue
        x = torch.zeros(nblk * B)
        x[:n] = _values(full, key, signed, fmt)[off : off + n]
        out[key], out[key + "_scale"] = _encode(x, signed, fmt)
    if "error" in full:
        err = torch.zeros(nblk * B, dtype=full["error"].dtype)
        err[:n] = full["error"].reshape(-1)[off : off + n]
        out["error"] = err.view(nblk, B)
    return out
