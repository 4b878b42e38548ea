"""What a checkpoint folder's weight files say about the model, checked against its config.json before anything is
built.

transformers builds the model config.json describes first and only then reads the weights into it, so a config.json
that disagrees with the weights costs the whole build: ``num_hidden_layers=200000`` over the weights of 2 layers
builds layers for minutes with rising memory and says nothing; a width or vocabulary of another model fails inside
transformers' loader with a table of every tensor. The weight files know the model's sizes: the layer count from the
tensors' names, the width, vocabulary, MLP width and query/key-value heads from their shapes. Those are read here
from the safetensors headers (no tensor is loaded) and each disagreement is one message naming the file at fault
(config.json, or the weight file that holds the odd tensor), both values and the fix.

The tensor names are those of the families the eval reads (Llama 2 / 3.x, Mistral, Qwen 2.5 / 3: transformers'
``model.layers.N.self_attn.q_proj.weight`` ...); a folder saved without the ``model.`` prefix (a base model) is read
the same, as transformers reads it.
"""

import re
from pathlib import Path
from typing import Dict, List, Tuple

import torch
from safetensors import safe_open

from eval.errors import EvalInputError
from finetune.base import BadInput, load_state_file

# name -> (shape, the file that holds it)
Shapes = Dict[str, Tuple[Tuple[int, ...], str]]

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
RESTORE = "or restore the config.json these weights were saved with"


def read_shapes(ckpt: Path, files: List[Path], fix: str) -> Shapes:
    """Every tensor's shape in ``files``: safetensors from their headers (nothing loaded); a pickled
    ``pytorch_model*.bin`` checked for anything but tensors first (``refuse_pickled_code``), then read as plain
    tensors, memory-mapped."""
    shapes: Shapes = {}
    for shard in files:
        if shard.suffix == ".safetensors":
            try:
                with safe_open(str(shard), framework="pt") as f:
                    shapes.update({name: (tuple(f.get_slice(name).get_shape()), shard.name) for name in f.keys()})
            except Exception as e:  # safetensors raises its own error type for truncated or garbled files
                text = " ".join(str(e).split())[:200]
                raise EvalInputError(
                    f"checkpoint_dir={ckpt}: weights file {shard.name} is unreadable ({text}) (a partial write?): {fix}"
                ) from None
            continue
        refuse_pickled_code(ckpt, shard)
        try:
            state = load_state_file(shard, mmap=True, fix=fix)
        except BadInput as e:
            raise EvalInputError(f"checkpoint_dir={ckpt}: {e}") from None
        tensors = state.items() if isinstance(state, dict) else ()
        shapes.update({k: (tuple(v.shape), shard.name) for k, v in tensors if isinstance(v, torch.Tensor)})
    return shapes


def refuse_pickled_code(ckpt: Path, shard: Path) -> None:
    """A pickled weights file that names anything besides tensors (``os.system`` in a planted file) is refused by
    name, found by torch's scan of the pickle's instructions (nothing is unpickled). A file torch cannot scan (the
    pre-1.6 format, garbage) goes on to ``load_state_file``, which reads tensors only and names what is wrong."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(shard))
    except Exception:  # (not a zip-format torch file)
        return
    if unsafe:
        raise EvalInputError(
            f"checkpoint_dir={ckpt}: {shard.name} is a pickle that names {', '.join(unsafe[:3])} besides tensors "
            "(code that unpickling would run; a weights file needs none): refused; the eval reads a pickled weights "
            "file as plain tensors only and never unpickles more of a file it is handed (there is no option to): "
            "use the model's weights as safetensors (model.safetensors, as published models and transformers' "
            f"save_pretrained have them), saved from a copy you trust, and remove {shard.name}"
        )


def check_sizes(ckpt: Path, config: dict, shapes: Shapes) -> None:
    """config.json's sizes against the weights' (``shapes``), first disagreement first: the layer count, then the
    width, vocabulary, MLP width, query heads and key/value heads, then any other tensor of another shape than
    config.json's sizes make it. Tensors a folder lacks are left to the loader (it names the missing ones)."""
    _check_layers(ckpt, config, shapes)
    for key in ("num_key_value_heads", "head_dim"):  # (optional: transformers' defaults below)
        if config.get(key) is not None and not (type(config[key]) is int and config[key] > 0):
            raise EvalInputError(
                f"checkpoint_dir={ckpt}: config.json says {key}={config[key]!r}, not a positive integer: set the "
                f"model's {key} in config.json (or remove it), {RESTORE}"
            )
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    if head_dim < 1:
        raise EvalInputError(
            f"checkpoint_dir={ckpt}: config.json says num_attention_heads={heads} but hidden_size="
            f"{config['hidden_size']}, a head_dim of 0: set the model's num_attention_heads in config.json, {RESTORE}"
        )
    size = {
        "H": config["hidden_size"],
        "V": config["vocab_size"],
        "I": config["intermediate_size"],
        "Q": heads * head_dim,
        "KV": kv_heads * head_dim,
        "D": head_dim,
    }

    # Each size read off one tensor: (config.json's field, what it says, the tensor, the dimension that holds it).
    embed = _find(shapes, "embed_tokens.weight")
    gate = _find(shapes, "layers.0.mlp.gate_proj.weight")
    q_proj = _find(shapes, "layers.0.self_attn.q_proj.weight")
    k_proj = _find(shapes, "layers.0.self_attn.k_proj.weight")
    for field, said, name, dim in (
        ("hidden_size", size["H"], embed, 1),
        ("vocab_size", size["V"], embed, 0),
        ("intermediate_size", size["I"], gate, 0),
    ):
        if name is not None and shapes[name][0][dim] != said:
            found = shapes[name][0][dim]
            raise EvalInputError(
                f"checkpoint_dir={ckpt}: config.json says {field}={said} but {_holds(shapes, name)}, so the "
                f'weights\' {field} is {found}: set "{field}": {found} in config.json, {RESTORE}'
            )
    for what, field, count, name in (
        ("query", "num_attention_heads", heads, q_proj),
        ("key/value", "num_key_value_heads", kv_heads, k_proj),
    ):
        rows = shapes[name][0][0] if name is not None else None
        if rows is None or rows == count * head_dim:
            continue
        said = f"config.json says {field}={count} (x head_dim {head_dim} = {count * head_dim} rows)"
        fix = (
            f'set "{field}": {rows // head_dim} in config.json'
            if rows % head_dim == 0
            else f"config.json's head_dim {head_dim} does not divide {rows}"
        )
        raise EvalInputError(
            f"checkpoint_dir={ckpt}: {said} but {_holds(shapes, name)}, {rows / head_dim:g} {what} heads of "
            f"{head_dim}: {fix}, {RESTORE}"
        )

    for name, (shape, file) in shapes.items():
        want = _expected(name, size)
        if want is not None and shape != want:
            raise EvalInputError(
                f"checkpoint_dir={ckpt}: {file} holds {name} of shape {list(shape)} but config.json's sizes make it "
                f"{list(want)} (config.json agrees with the embedding and layer 0: a tensor of another model?): re-copy "
                f"{file} from the folder the others came from, {RESTORE}"
            )


def _check_layers(ckpt: Path, config: dict, shapes: Shapes) -> None:
    """The layers the weights hold (``model.layers.N.*``) are 0 to num_hidden_layers - 1, each."""
    files: Dict[int, str] = {}
    for name, (_, file) in shapes.items():
        found = _LAYER.match(name)
        if found:
            files.setdefault(int(found.group(1)), file)
    said = config["num_hidden_layers"]
    if not files or set(files) == set(range(said)):
        return
    held = sorted(files)
    names = sorted(set(files.values()))
    where = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    if held != list(range(len(held))):  # a gap: the weights are incomplete, whatever config.json says
        gap = min(set(range(held[-1] + 1)) - set(held))
        raise EvalInputError(
            f"checkpoint_dir={ckpt}: the weight files ({where}) hold layer{'s' * (len(held) > 1)} {_ranges(held)} but "
            f"not model.layers.{gap} (config.json says num_hidden_layers={said}): a weight file is missing or partial; "
            "re-copy the checkpoint folder"
        )
    n = len(held)
    span = "model.layers.0" if n == 1 else f"model.layers.0 to model.layers.{n - 1}"
    lacking = f"; none of model.layers.{n} to model.layers.{said - 1}" if n < said else ""
    raise EvalInputError(
        f"checkpoint_dir={ckpt}: config.json says num_hidden_layers={said} but the weight files ({where}) hold "
        f'{n} layer{"s" * (n != 1)} ({span}{lacking}): set "num_hidden_layers": {n} in config.json, {RESTORE}'
        f"{' (or the weight files of the other layers)' if n < said else ''}"
    )


def _expected(name: str, size: Dict[str, int]):
    """The shape config.json's sizes give tensor ``name`` (None for a name not checked here)."""
    layer = _LAYER.match(name)
    suffix = layer.group(2) if layer else re.sub(r"^model\.", "", name)
    H, I, Q, KV, D = size["H"], size["I"], size["Q"], size["KV"], size["D"]  # noqa: E741 (the MLP width)
    return {
        "embed_tokens.weight": (size["V"], H),
        "lm_head.weight": (size["V"], H),
        "norm.weight": (H,),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (Q, H),
        "self_attn.q_proj.bias": (Q,),
        "self_attn.k_proj.weight": (KV, H),
        "self_attn.k_proj.bias": (KV,),
        "self_attn.v_proj.weight": (KV, H),
        "self_attn.v_proj.bias": (KV,),
        "self_attn.o_proj.weight": (H, Q),
        "self_attn.q_norm.weight": (D,),
        "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (I, H),
        "mlp.up_proj.weight": (I, H),
        "mlp.down_proj.weight": (H, I),
    }.get(suffix)


def _find(shapes: Shapes, suffix: str):
    """The matrix named ``model.{suffix}`` (or ``{suffix}``, a folder saved without the prefix), or None."""
    return next((n for n in (f"model.{suffix}", suffix) if n in shapes and len(shapes[n][0]) == 2), None)


def _holds(shapes: Shapes, name: str) -> str:
    shape, file = shapes[name]
    return f"{file} holds {name} of shape {list(shape)}"


def _ranges(held: List[int]) -> str:
    """[0, 1, 2, 5, 6] as '0-2, 5-6'."""
    runs: List[List[int]] = []
    for i in held:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
