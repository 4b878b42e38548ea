"""What a model folder's weight files say about the model, checked against its config.json before anything is built:
the one check of the fine-tune recipes (at settings time, before the data) and the eval (before transformers loads).

A model is built from what config.json describes, and only then are the weights read into it, so a config.json that
disagrees with the weights costs the whole build: ``num_hidden_layers=100000`` over the weights of 2 layers builds for
minutes with rising memory and dies in the allocator; a size of 1e12 asks for terabytes; a width or vocabulary of
another model fails inside a loader with a table of every tensor. The weight files know the model's sizes: the layer
count from the tensors' names, the width, vocabulary, MLP width and query/key-value heads from their shapes. Those
are read here from the safetensors headers (no tensor is loaded) and each disagreement is one BadInput naming the
file at fault (config.json, or the weight file that holds the odd tensor), the field, the tensor and the fix. Every
size is also a positive integer, and no larger than any model's (``SIZE_LIMITS``): the bound is what holds the
sizes no tensor shows (``max_position_embeddings``: RoPE's cache is built at that length).

The tensors' shapes come from a per-``model_type`` ``Layout`` (``LAYOUTS``); a model_type without a row of its own
is read with the Llama layout every family here shares (names it does not list are not checked), so a new family
adds a row only for tensors of its own (an MoE's experts). Names are transformers' (``model.layers.N.self_attn...``);
a folder saved without the ``model.`` prefix (a base model) is read the same, as transformers reads it.
"""

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from safetensors import safe_open

from finetune.base import BadInput, load_state_file

# name -> (shape, the file that holds it)
Shapes = Dict[str, Tuple[Tuple[int, ...], str]]

_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.+)$")
RESTORE = "or restore the config.json these weights were saved with"

# config.json's size fields. Without the required ones transformers builds its default model (Llama's 7B, in fp32);
# the others it fills in when left out, and they are checked when given. Each is at most its limit: far above any
# released model's (Llama 3.1 405B: 126 layers, width 16384, 128 heads, 53248 hidden; vocabularies to 262144; head
# sizes to 256; Llama 4 Scout: 10M tokens of context), far below what breaks the build (a max_position_embeddings of
# 1e12 asks for a 4 TB RoPE cache). finetune/settings/read.py bounds the config's own model keys by the same numbers.
REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SIZE_LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 2**16,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 2**12,
    "vocab_size": 2**22,
    "max_position_embeddings": 2**24,
    "intermediate_size": 2**18,
}


@dataclass(frozen=True)
class Layout:
    """A family's tensors in config.json's sizes: H width, V vocabulary, I MLP width, D head_dim, Q query rows
    (heads x head_dim), KV key/value rows. ``shapes``: each tensor's shape by its name after ``model.`` or
    ``model.layers.N.`` (other numbers in a name read as N: ``mlp.experts.N.up_proj.weight``); ``reads``: the
    fields read off one tensor each, named in the message when they differ (field, tensor, dimension); ``heads``:
    the head counts read off the projections' rows (what, field, tensor)."""

    shapes: Dict[str, Tuple[str, ...]]
    reads: Tuple[Tuple[str, str, int], ...]
    heads: Tuple[Tuple[str, str, str], ...]


LLAMA = Layout(
    shapes={
        "embed_tokens.weight": ("V", "H"),
        "lm_head.weight": ("V", "H"),
        "norm.weight": ("H",),
        "input_layernorm.weight": ("H",),
        "post_attention_layernorm.weight": ("H",),
        "self_attn.q_proj.weight": ("Q", "H"),
        "self_attn.q_proj.bias": ("Q",),
        "self_attn.k_proj.weight": ("KV", "H"),
        "self_attn.k_proj.bias": ("KV",),
        "self_attn.v_proj.weight": ("KV", "H"),
        "self_attn.v_proj.bias": ("KV",),
        "self_attn.o_proj.weight": ("H", "Q"),
        "self_attn.q_norm.weight": ("D",),
        "self_attn.k_norm.weight": ("D",),
        "mlp.gate_proj.weight": ("I", "H"),
        "mlp.up_proj.weight": ("I", "H"),
        "mlp.down_proj.weight": ("H", "I"),
    },
    reads=(
        ("hidden_size", "embed_tokens.weight", 1),
        ("vocab_size", "embed_tokens.weight", 0),
        ("intermediate_size", "layers.0.mlp.gate_proj.weight", 0),
    ),
    heads=(
        ("query", "num_attention_heads", "layers.0.self_attn.q_proj.weight"),
        ("key/value", "num_key_value_heads", "layers.0.self_attn.k_proj.weight"),
    ),
)
# config.json fields under another name in some folders: transformers 5 writes Qwen3-MoE's num_experts as
# num_local_experts (the published folder says num_experts)
ALIASES = {"num_experts": "num_local_experts"}
# Qwen3-MoE: Qwen3's layers with a router (E experts) and per-expert MLPs of width M (moe_intermediate_size), as
# transformers saves them; the dense MLP of an mlp_only layer is Llama's.
QWEN3_MOE = Layout(
    shapes={
        **LLAMA.shapes,
        "mlp.gate.weight": ("E", "H"),
        "mlp.experts.N.gate_proj.weight": ("M", "H"),
        "mlp.experts.N.up_proj.weight": ("M", "H"),
        "mlp.experts.N.down_proj.weight": ("H", "M"),
    },
    reads=(
        *LLAMA.reads,
        ("num_experts", "layers.0.mlp.gate.weight", 0),
        ("moe_intermediate_size", "layers.0.mlp.experts.0.gate_proj.weight", 0),
    ),
    heads=LLAMA.heads,
)
LAYOUTS: Dict[str, Layout] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "qwen3": LLAMA, "qwen3_moe": QWEN3_MOE}


def check_folder(ckpt: Path, config: dict, files: List[Path], fix: str) -> None:
    """config.json's sizes (``config``) for sign and range, then against the shapes in the weight ``files`` of folder
    ``ckpt``; a BadInput (``checkpoint_dir=...: ...``) for the first that is wrong. Nothing is built or loaded."""
    check_sizes(ckpt, config, read_shapes(ckpt, files, fix))


def check_config_sizes(ckpt: Path, config: dict) -> None:
    """Every size field config.json gives is a positive integer; the required ones are there."""
    missing = [k for k in REQUIRED_SIZES if config.get(k) is None]
    if missing:
        raise BadInput(
            f"checkpoint_dir={ckpt}: config.json lacks the model's sizes ({', '.join(f'{k}=None' for k in missing)}; "
            f"without them transformers would build its default 7B model): restore the config.json the weights were saved "
            "with"
        )
    for key in SIZE_LIMITS:
        value = config.get(key)
        if value is not None and not (type(value) is int and value > 0):
            raise BadInput(
                f"checkpoint_dir={ckpt}: config.json says {key}={value!r}, not a positive integer: set the model's "
                f"{key} in config.json{' (or remove it)' if key not in REQUIRED_SIZES else ''}, {RESTORE}"
            )


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
                raise BadInput(
                    f"checkpoint_dir={ckpt}: weights file {shard.name} is unreadable ({text}) (a partial write?): {fix}"
                ) from None
            continue
        refuse_pickled_code(ckpt, shard)
        try:
            state = load_state_file(shard, mmap=True, fix=fix)
        except BadInput as e:
            raise BadInput(f"checkpoint_dir={ckpt}: {e}") from None
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
        raise BadInput(
            f"checkpoint_dir={ckpt}: {shard.name} is a pickle that names {', '.join(unsafe[:3])} besides tensors "
            "(code that unpickling would run; a weights file needs none): refused; this repository reads a pickled "
            "weights file as plain tensors only and never unpickles more of a file it is handed (there is no option "
            "to): use the model's weights as safetensors (model.safetensors, as published models and transformers' "
            f"save_pretrained have them), saved from a copy you trust, and remove {shard.name}"
        )


def check_sizes(ckpt: Path, config: dict, shapes: Shapes) -> None:
    """config.json's sizes against the weights' (``shapes``), first disagreement first: the layer count, then the
    fields of the layout's ``reads`` and ``heads``, then any other tensor of another shape than config.json's sizes
    make it, then the limits. Tensors a folder lacks are left to the loader (it names the missing ones)."""
    check_config_sizes(ckpt, config)
    _check_layers(ckpt, config, shapes)
    layout = LAYOUTS.get(config.get("model_type"), LLAMA)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    if head_dim < 1:
        raise BadInput(
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
        "E": config.get("num_experts") or config.get("num_local_experts") or 0,  # (a mixture of experts': QWEN3_MOE)
        "M": config.get("moe_intermediate_size") or 0,
    }

    for field, suffix, dim in layout.reads:
        field = field if field in config else ALIASES.get(field, field)  # (the spelling the folder uses)
        name = _find(shapes, suffix)
        if name is not None and shapes[name][0][dim] != config.get(field):
            found = shapes[name][0][dim]
            raise BadInput(
                f"checkpoint_dir={ckpt}: config.json says {field}={config[field]} but {_holds(shapes, name)}, so the "
                f'weights\' {field} is {found}: set "{field}": {found} in config.json, {RESTORE}'
            )
    for what, field, suffix in layout.heads:
        name = _find(shapes, suffix)
        count = heads if field == "num_attention_heads" else kv_heads
        rows = shapes[name][0][0] if name is not None else None
        if rows is None or rows == count * head_dim:
            continue
        said = f"config.json says {field}={count} (x head_dim {head_dim} = {count * head_dim} rows)"
        if rows % head_dim == 0:
            fix = f'{rows // head_dim} {what} heads of {head_dim}: set "{field}": {rows // head_dim} in config.json'
        elif rows % count == 0:  # (the head count agrees: the head size is what differs)
            fix = f'{count} {what} heads of {rows // count}: set "head_dim": {rows // count} in config.json'
        else:
            fix = f"which config.json's head_dim {head_dim} does not divide"
        raise BadInput(f"checkpoint_dir={ckpt}: {said} but {_holds(shapes, name)}, {fix}, {RESTORE}")

    for name, (shape, file) in shapes.items():
        want = _expected(layout, name, size)
        if want is not None and shape != want:
            raise BadInput(
                f"checkpoint_dir={ckpt}: {file} holds {name} of shape {list(shape)} but config.json's sizes make it "
                f"{list(want)} (config.json agrees with the embedding and layer 0: a tensor of another model?): re-copy "
                f"{file} from the folder the others came from, {RESTORE}"
            )
    for key, limit in SIZE_LIMITS.items():  # (what no tensor above showed: max_position_embeddings, above all)
        if (config.get(key) or 0) > limit:
            raise BadInput(
                f"checkpoint_dir={ckpt}: config.json says {key}={config[key]}, more than any model's (at most "
                f"{limit}; the model's buffers would be built at this size): set the model's {key} in config.json, "
                f"{RESTORE}"
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
        raise BadInput(
            f"checkpoint_dir={ckpt}: the weight files ({where}) hold layer{'s' * (len(held) > 1)} {_ranges(held)} but "
            f"not model.layers.{gap} (config.json says num_hidden_layers={said}): a weight file is missing or partial; "
            "re-copy the checkpoint folder"
        )
    n = len(held)
    span = "model.layers.0" if n == 1 else f"model.layers.0 to model.layers.{n - 1}"
    lacking = f"; none of model.layers.{n} to model.layers.{said - 1}" if n < said else ""
    raise BadInput(
        f"checkpoint_dir={ckpt}: config.json says num_hidden_layers={said} but the weight files ({where}) hold "
        f'{n} layer{"s" * (n != 1)} ({span}{lacking}): set "num_hidden_layers": {n} in config.json, {RESTORE}'
        f"{' (or the weight files of the other layers)' if n < said else ''}"
    )


def _expected(layout: Layout, name: str, size: Dict[str, int]) -> Optional[Tuple[int, ...]]:
    """The shape config.json's sizes give tensor ``name`` (None for a name the layout does not list)."""
    layer = _LAYER.match(name)
    suffix = re.sub(r"\.\d+\.", ".N.", layer.group(2) if layer else re.sub(r"^model\.", "", name))
    symbols = layout.shapes.get(suffix)
    return None if symbols is None else tuple(size[s] for s in symbols)


def _find(shapes: Shapes, suffix: str) -> Optional[str]:
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
