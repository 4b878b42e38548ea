"""The Hugging Face checkpoint format of each model family: part of the checkpoint component.

A checkpoint folder is what transformers' ``from_pretrained`` reads: ``config.json``, the weights
(``model.safetensors``), ``generation_config.json`` and the tokenizer's files. torchtune's models name their
weights otherwise (``layers.0.attn.q_proj.weight`` for ``model.layers.0.self_attn.q_proj.weight``), and the Llama
and Mistral builders permute the query and key projections for their RoPE; torchtune's converters do both
directions.

A model family is one ``Family`` row in ``FAMILIES``: its ``model_type`` and architecture class, the torchtune
builders that make it, the config.json fields it always writes, its converters, and the function that reads a
config.json of the family into the model's keywords (finetune/model/from_hf_config.py), so one row serves every
size of a family. With checkpoint_dir, ``resolve_model`` picks the family from config.json and builds the folder's
model; config.json is written back as the source's, with only the run's dtype changed. Without one, config.json is
read off the built model (sizes, tied embeddings, RoPE base and Llama 3 scaling). The recipes never branch on a
family; they call ``resolve_model`` (through settings), ``hf_config``, ``read_weights`` / ``to_tune`` and
``write_folder``. docs/models.md says how to add a family.
"""

import contextlib
import functools
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open
from torchtune.models import convert_weights
from torchtune.models.convert_weights import get_mapped_key
from torchtune.models.qwen2._convert_weights import _FROM_HF as _QWEN2_FROM_HF

from finetune.base import BadInput, hf_weight_files, load_state_file
from finetune.checkpoint.async_save import write_safetensors
from finetune.model import from_hf_config

WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
WEIGHTS_METADATA = {"format": "pt"}  # model.safetensors' header metadata, as transformers writes it
# Files of the tokenizer that a checkpoint folder carries when they sit beside ``tokenizer.path`` (the first two are
# what transformers' AutoTokenizer reads; chat_template.jinja is where transformers 5 keeps the chat template, which
# the fine-tuned model needs as much as the source did; tokenizer.model is SentencePiece, Llama 2's and Mistral's).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "tokenizer.model",
)


def _rename(mapping: Dict[str, Optional[str]]) -> Callable:
    """A converter that only renames (the families whose RoPE needs no permutation: Qwen's rotate-half)."""

    def convert(state, num_heads, num_kv_heads, dim, head_dim):
        return {get_mapped_key(k, mapping): v for k, v in state.items() if "rotary_emb.inv_freq" not in k}

    return convert


# Qwen3: Qwen2's names without the q/k/v biases, plus one RMSNorm per head on the queries and the keys.
_QWEN3_FROM_HF = {k: v for k, v in _QWEN2_FROM_HF.items() if not k.endswith(".bias")}
_QWEN3_FROM_HF.update(
    {
        "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
        "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale",
    }
)


def _inverse(mapping: Dict[str, Optional[str]]) -> Dict[str, str]:
    return {v: k for k, v in mapping.items() if v is not None}


# Qwen3-MoE: Qwen3's names (the dense MLP's too, for ``mlp_only_layers``), the router, and the experts. The folders on
# the hub and transformers 5's save_pretrained hold each expert's three matrices under its own names
# (``mlp.experts.{j}.gate_proj.weight`` [I, H], ``up_proj`` [I, H], ``down_proj`` [H, I]); transformers 5 holds them
# stacked in memory (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]), as our model
# does. A folder of either naming is read; folders are written per expert, which transformers 4 and 5 both load.
_QWEN3_MOE_FROM_HF = {**_QWEN3_FROM_HF, "model.layers.{}.mlp.gate.weight": "layers.{}.mlp.router.weight"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_STACKED_HF = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_STACKED_TUNE = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def _moe_hf_to_tune(state, num_heads, num_kv_heads, dim, head_dim):
    """HF's Qwen3-MoE names to ours, each layer's per-expert matrices stacked. The per-expert tensors are taken out
    of ``state`` as their layer is stacked: a 30B folder (57 GiB in bf16) is then never held twice in host memory."""
    per_expert: Dict[int, Dict[Tuple[int, str], torch.Tensor]] = {}
    out, rest = {}, {}
    for key in list(state):
        expert, stacked = _EXPERT.match(key), _STACKED_HF.match(key)
        if expert:
            per_expert.setdefault(int(expert.group(1)), {})[(int(expert.group(2)), expert.group(3))] = state.pop(key)
        elif stacked:
            out[f"layers.{stacked.group(1)}.mlp.experts.{stacked.group(2)}"] = state[key]
        else:
            rest[key] = state[key]
    out.update(_rename(_QWEN3_MOE_FROM_HF)(rest, num_heads, num_kv_heads, dim, head_dim))
    for layer, parts in per_expert.items():
        count = 1 + max(j for j, _ in parts)
        missing = [f"{j}.{p}_proj" for j in range(count) for p in ("gate", "up", "down") if (j, p) not in parts]
        if missing:
            raise KeyError(f"model.layers.{layer}.mlp.experts.{missing[0]}.weight is missing ({len(missing)} in all)")
        out[f"layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts.pop((j, "gate")), parts.pop((j, "up"))]) for j in range(count)]
        )
        out[f"layers.{layer}.mlp.experts.down_proj"] = torch.stack([parts.pop((j, "down")) for j in range(count)])
    return out


def _moe_tune_to_hf(state, num_heads, num_kv_heads, dim, head_dim):
    """Our Qwen3-MoE names to HF's, the stacked experts written per expert (views of the stacked tensors: the writer
    copies one expert's matrix at a time)."""
    out, rest = {}, {}
    for key, value in state.items():
        stacked = _STACKED_TUNE.match(key)
        if not stacked:
            rest[key] = value
            continue
        prefix = f"model.layers.{stacked.group(1)}.mlp.experts"
        if stacked.group(2) == "down_proj":
            out.update({f"{prefix}.{j}.down_proj.weight": value[j] for j in range(value.shape[0])})
            continue
        gate, up = value.chunk(2, dim=1)
        for j in range(value.shape[0]):
            out[f"{prefix}.{j}.gate_proj.weight"], out[f"{prefix}.{j}.up_proj.weight"] = gate[j], up[j]
    out.update(_rename(_inverse(_QWEN3_MOE_FROM_HF))(rest, num_heads, num_kv_heads, dim, head_dim))
    return out


def _dense_fields(model: torch.nn.Module) -> Dict[str, Any]:
    """config.json's MLP field read off a dense model: the width of its first layer's MLP."""
    return {"intermediate_size": model.layers[0].mlp.w1.weight.shape[0]}


def _moe_fields(model: torch.nn.Module) -> Dict[str, Any]:
    """config.json's MLP fields of a mixture of experts: those it was built with (finetune/model/moe.py)."""
    return dict(model.moe_fields)


@dataclass(frozen=True)
class Family:
    """One model family's Hugging Face format."""

    name: str
    builders: Tuple[str, ...]  # model._component_ prefixes (torchtune's builder modules, or ours) of this family
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]: the transformers class that loads the folder
    example_builder: str  # named in error messages: a builder of this family
    fixed: Dict[str, Any] = field(default_factory=dict)  # config.json fields this family always writes
    hf_to_tune: Callable = convert_weights.hf_to_tune  # (state, num_heads, num_kv_heads, dim, head_dim) -> state
    tune_to_hf: Callable = convert_weights.tune_to_hf
    # transformers' config of the family -> from_hf_config.decoder's keywords; a BadInput for what it cannot honour
    from_config: Callable = from_hf_config.llama
    # the built model -> config.json's MLP fields (read off the model; checked against a source's config.json)
    mlp_fields: Callable = _dense_fields


# torchtune's builders have no sliding-window attention: the families that can have one say so in config.json.
_LLAMA_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
_QWEN3_FIXED = {"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False}  # (and its MoE)

FAMILIES: Dict[str, Family] = {
    "llama2": Family(
        name="llama2",
        builders=("torchtune.models.llama2.",),
        model_type="llama",
        architecture="LlamaForCausalLM",
        example_builder="torchtune.models.llama2.llama2_7b",
        fixed=_LLAMA_FIXED,
    ),
    # Llama 3, 3.1, 3.2 and 3.3: Llama 2's layout; 3.1 on adds the llama3 RoPE scaling, 3.2 1B/3B tie the
    # embeddings (both read off the model).
    "llama3": Family(
        name="llama3",
        builders=(
            "torchtune.models.llama3.",
            "torchtune.models.llama3_1.",
            "torchtune.models.llama3_2.",
            "torchtune.models.llama3_3.",
        ),
        model_type="llama",
        architecture="LlamaForCausalLM",
        example_builder="torchtune.models.llama3_1.llama3_1_8b",
        fixed=_LLAMA_FIXED,
    ),
    # Qwen2 and 2.5: biases on the q/k/v projections (always, so config.json has no key for it), rotate-half RoPE.
    "qwen2": Family(
        name="qwen2",
        builders=("torchtune.models.qwen2.", "torchtune.models.qwen2_5."),
        model_type="qwen2",
        architecture="Qwen2ForCausalLM",
        example_builder="torchtune.models.qwen2_5.qwen2_5_7b_base",
        fixed={"hidden_act": "silu", "use_sliding_window": False},
        hf_to_tune=_rename(_QWEN2_FROM_HF),
        tune_to_hf=_rename(_inverse(_QWEN2_FROM_HF)),
        from_config=from_hf_config.qwen2,
    ),
    # Qwen3 (our builder, finetune/model/builders.py): no biases, RMSNorm per head on q and k before RoPE.
    "qwen3": Family(
        name="qwen3",
        builders=("finetune.model.qwen3", "finetune.model.builders.qwen3"),
        model_type="qwen3",
        architecture="Qwen3ForCausalLM",
        example_builder="finetune.model.qwen3_8b",
        fixed=_QWEN3_FIXED,
        hf_to_tune=_rename(_QWEN3_FROM_HF),
        tune_to_hf=_rename(_inverse(_QWEN3_FROM_HF)),
        from_config=from_hf_config.qwen3,
    ),
    # Qwen3-MoE (our builder and blocks: finetune/model/builders.py, moe.py): Qwen3's attention, sparse MoE blocks.
    "qwen3_moe": Family(
        name="qwen3_moe",
        builders=("finetune.model.qwen3_moe", "finetune.model.builders.qwen3_moe"),
        model_type="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        example_builder="finetune.model.qwen3_moe_30b_a3b",
        fixed=_QWEN3_FIXED,
        hf_to_tune=_moe_hf_to_tune,
        tune_to_hf=_moe_tune_to_hf,
        from_config=from_hf_config.qwen3_moe,
        mlp_fields=_moe_fields,
    ),
    "mistral": Family(
        name="mistral",
        builders=("torchtune.models.mistral.", "finetune.model.mistral", "finetune.model.builders.mistral"),
        model_type="mistral",
        architecture="MistralForCausalLM",
        example_builder="finetune.model.mistral_7b_v0_3",
        fixed={"hidden_act": "silu", "sliding_window": None},
        from_config=from_hf_config.mistral,
    ),
}
DEFAULT_FAMILY = "llama2"


def family_of(model_component: Optional[str]) -> Family:
    """The family whose builder ``model._component_`` names (the longest prefix that matches: ``qwen3_moe`` before
    ``qwen3``); a builder of no known family (one of your own) is read and written as Llama 2, whose layout every
    Llama-architecture builder shares."""
    component = str(model_component or "")
    matches = [(len(b), f) for f in FAMILIES.values() for b in f.builders if component.startswith(b)]
    return max(matches, key=lambda m: m[0])[1] if matches else FAMILIES[DEFAULT_FAMILY]


def _is_family_builder(model_component: Optional[str]) -> bool:
    return any(str(model_component or "").startswith(f.builders) for f in FAMILIES.values())


def source_family(source: dict) -> Family:
    """The family of a checkpoint's config.json: its model_type; for ``llama``, Llama 3.x when the RoPE is Llama
    3.1's or the vocabulary is Llama 3's (128,256), else Llama 2 (the two differ only in those, both read here)."""
    found = source.get("model_type")
    matches = [f for f in FAMILIES.values() if f.model_type == found]
    if not matches:
        raise BadInput(
            f"checkpoint_dir's config.json has model_type={found!r}; the families this recipe reads are: "
            f"{', '.join(sorted({f.model_type for f in FAMILIES.values()}))} (docs/models.md)"
        )
    if found == "llama":
        rope = source.get("rope_parameters") or source.get("rope_scaling") or {}
        llama3 = (rope.get("rope_type") or rope.get("type")) == "llama3" or source.get("vocab_size", 0) >= 128_000
        return FAMILIES["llama3" if llama3 else "llama2"]
    return matches[0]


def resolve_model(source: dict, model_section: Optional[dict]) -> Tuple[Family, dict]:
    """The family and the model section (``_component_`` and keywords, for ``config.instantiate``) of the model
    checkpoint_dir's config.json ``source`` describes, checked before anything is built.

    ``model_section`` (the config's ``model``, resolved) may name a builder: it must be of the folder's family
    (Llama 2 and 3.x builders both take a ``llama`` folder), and its keywords must say what config.json says. Every
    architecture field is then what the model is built with, or a BadInput naming the field (the family's
    ``from_config``)."""
    section = dict(model_section or {})
    component = section.get("_component_")
    family = source_family(source)
    if component:
        if not _is_family_builder(component):
            raise BadInput(
                f"model._component_={component} is not a builder of a family this recipe reads, and with "
                f"checkpoint_dir the model is built from its config.json ({family.name}); remove "
                f"model._component_ (~model._component_), or name a builder of that family (e.g. "
                f"{family.example_builder})"
            )
        named = family_of(component)
        check_source_family(source, named)
        family = named  # (a llama folder: the family the config names, Llama 2 or 3.x)
    kwargs = family.from_config(from_hf_config.read_config(source))
    from_hf_config.check_model_keys(section, kwargs)
    return family, {"_component_": from_hf_config.COMPONENT, **kwargs}


def rope_scaling(rope: torch.nn.Module) -> Optional[dict]:
    """config.json's ``rope_scaling`` for torchtune's RoPE module: Llama 3.1's scaled RoPE, or None (plain RoPE)."""
    if not hasattr(rope, "scale_factor"):
        return None
    return {
        "rope_type": "llama3",
        "factor": float(rope.scale_factor),
        "low_freq_factor": float(rope.low_freq_factor),
        "high_freq_factor": float(rope.high_freq_factor),
        "original_max_position_embeddings": int(rope.old_context_len),
    }


def hf_config(model: torch.nn.Module, dtype: torch.dtype, base: Optional[dict], family: Family, tokenizer=None) -> dict:
    """config.json for ``family``'s transformers class: ``base`` (the source checkpoint's config.json) with the
    run's dtype, or without one, read off the built model.

    Every field of ``base`` is kept as the source wrote it (the model was built from it: ``resolve_model``), so
    transformers reads the written folder as it read the source; the fields read off the model must agree with it
    (a source checkpoint of another family, or whose sizes, tying, RoPE or norm differ from the model's, is a
    BadInput naming the field). Without ``base``, bos/eos ids come from ``tokenizer``. Call it before activation
    checkpointing or compile wrap the layers.
    """
    layer = model.layers[0]
    attn = layer.attn
    tied = not isinstance(model.output, torch.nn.Linear)  # torchtune's TiedLinear reuses tok_embeddings.weight
    if base is not None:
        check_source_family(base, family)
        if base.get("tie_word_embeddings", False) != tied:
            raise BadInput(
                f"the checkpoint's config.json has tie_word_embeddings={base.get('tie_word_embeddings', False)} but "
                f"model._component_ builds a model with tie_word_embeddings={tied}; use the builder of that model "
                f"size (e.g. {family.example_builder}), or set model.tie_word_embeddings where the builder takes it"
            )
    rope = attn.pos_embeddings
    scaling = rope_scaling(rope)
    hf = {}
    hf.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        vocab_size=model.tok_embeddings.weight.shape[0],
        hidden_size=model.tok_embeddings.weight.shape[1],
        **family.mlp_fields(model),
        num_hidden_layers=len(model.layers),
        num_attention_heads=attn.num_heads,
        num_key_value_heads=attn.num_kv_heads,
        head_dim=attn.head_dim,
        max_position_embeddings=model.max_seq_len,
        rms_norm_eps=model.norm.eps,
        tie_word_embeddings=tied,
        # Both spellings: rope_theta/rope_scaling (transformers 4) and rope_parameters (transformers 5, which reads
        # either); the values are the same.
        rope_theta=float(rope.base),
        rope_scaling=scaling,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope.base), **(scaling or {})},
        **family.fixed,
        torch_dtype=DTYPE_NAMES[dtype],
    )
    if base is not None:
        check_model_fits_source(hf, base, family, tuple(family.mlp_fields(model)))
        # The source's own fields win: its spelling of RoPE (rope_parameters or rope_theta/rope_scaling), head_dim
        # left to transformers' default, its name for a field (transformers 5 writes num_experts as
        # num_local_experts), fields we do not read; only the dtype is the run's.
        aliases = from_hf_config.read_config({"model_type": family.model_type, **base}).attribute_map
        own = [k for k in hf if k in ROPE_KEYS or k in ("head_dim", "torch_dtype") or aliases.get(k) in base]
        hf = {**{k: v for k, v in hf.items() if k not in own}, **base}
        hf["dtype" if "dtype" in base else "torch_dtype"] = DTYPE_NAMES[dtype]  # (transformers 5's name, or 4's)
    if base is None or "bos_token_id" not in base:
        hf["bos_token_id"] = getattr(tokenizer, "bos_id", None) if tokenizer is not None else 1
    if base is None or "eos_token_id" not in base:
        hf["eos_token_id"] = getattr(tokenizer, "eos_id", None) if tokenizer is not None else 2
    return hf


ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_parameters")


def check_model_fits_source(derived: dict, base: dict, family: Family, mlp_fields=("intermediate_size",)) -> None:
    """The model's own config.json fields (``derived``, read off it) against the source's as transformers reads
    them: a field that differs is a BadInput naming it, both values and the fix. ``mlp_fields``: the family's MLP
    fields among them (``Family.mlp_fields``)."""
    source = from_hf_config.read_config({"model_type": family.model_type, **base})
    rope = from_hf_config.rope_of(source)
    scaling = {k: rope[k] for k in from_hf_config.LLAMA3_SCALING_KEYS if k in rope} or None
    expected = {
        "vocab_size": source.vocab_size,
        "hidden_size": source.hidden_size,
        **{key: getattr(source, key) for key in mlp_fields},
        "num_hidden_layers": source.num_hidden_layers,
        "num_attention_heads": source.num_attention_heads,
        "num_key_value_heads": getattr(source, "num_key_value_heads", None) or source.num_attention_heads,
        "head_dim": getattr(source, "head_dim", None) or source.hidden_size // source.num_attention_heads,
        "max_position_embeddings": source.max_position_embeddings,
        "rms_norm_eps": source.rms_norm_eps,
        "rope_theta": rope["rope_theta"],
        "rope_scaling": scaling,
    }
    for key, want in expected.items():
        have = derived[key]
        if key == "rope_scaling":
            have = {k: have[k] for k in from_hf_config.LLAMA3_SCALING_KEYS} if have else None
            want = {k: float(v) for k, v in want.items()} if want else None
            have = {k: float(v) for k, v in have.items()} if have else None
        if isinstance(want, (list, tuple)):  # (mlp_only_layers: a set of layers, in any order)
            want, have = sorted(want), sorted(have)
        if have != want and not (isinstance(want, (int, float)) and float(have) == float(want)):
            raise BadInput(
                f"the checkpoint's config.json has {key}={want!r} but model._component_ builds a model "
                f"with {key}={have!r}; set checkpoint_dir and leave the model's sizes to its config.json "
                f"(or use the builder of that model size, e.g. {family.example_builder})"
            )


def check_source_family(base: dict, family: Family) -> None:
    """A checkpoint's config.json of another model_type than the configured builder's is a BadInput naming a
    builder of the checkpoint's family."""
    found = base.get("model_type")
    if found is None or found == family.model_type:
        return
    match = next((f for f in FAMILIES.values() if f.model_type == found), None)
    hint = (
        f"set model._component_ to a builder of that family (e.g. {match.example_builder})"
        if match
        else f"the families this recipe reads are: {', '.join(sorted({f.model_type for f in FAMILIES.values()}))}"
    )
    raise BadInput(
        f"the checkpoint's config.json has model_type={found!r} but model._component_ builds a "
        f"{family.model_type!r} model ({family.name}); {hint}"
    )


def read_source_config(folder: Optional[Path]) -> Optional[dict]:
    """A checkpoint folder's config.json, if it has one, read once (the settings keep it:
    ``ModelSettings.source_config``); unreadable JSON, or JSON that is not an object, is a BadInput."""
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        config = f"{type(e).__name__}: {str(e)[:120]}"
    if not isinstance(config, dict):
        what = config if isinstance(config, str) else f"a {type(config).__name__}"
        raise BadInput(
            f"{path} is not a JSON object ({what}); re-copy the checkpoint folder (its config.json describes the model)"
        )
    return config


_UNREADABLE_FIX = (
    "re-copy or re-download it, or point checkpoint_dir / resume_from_checkpoint at another folder "
    "(an earlier step_N or epoch_E)"
)
_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def _unreadable(f: Path, e: Exception) -> BadInput:
    text = " ".join(str(e).split())[:200]
    return BadInput(
        f"{f} is not a readable safetensors file ({type(e).__name__}: {text}; truncated or garbage?); {_UNREADABLE_FIX}"
    )


def read_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF folder's weight files; an unreadable file is one BadInput naming it."""
    state: Dict[str, torch.Tensor] = {}
    for part in read_weight_groups(folder):
        state.update(part)
    return state


def read_weight_groups(folder: Path) -> Iterator[Dict[str, torch.Tensor]]:
    """An HF folder's tensors one transformer layer at a time (``model.layers.N.*``, a layer's tensors together
    whichever shards hold them), then the rest; the whole folder at once where it holds .bin files (pickles cannot
    be read a tensor at a time). A model on the GPU takes each group before the next is read, so loading holds one
    layer in host memory, not the folder: a 30B mixture of experts' 57 GiB would otherwise all pass through the host
    on its way to the card. An unreadable file is one BadInput naming it."""
    files = hf_weight_files(folder)
    if any(f.suffix != ".safetensors" for f in files):
        state: Dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_state_file(f, fix=_UNREADABLE_FIX))
        yield state
        return
    with contextlib.ExitStack() as stack:
        where: Dict[str, Tuple[Path, Any]] = {}  # (a key in two files: the later file's, as one dict update would)
        for f in files:
            try:
                handle = stack.enter_context(safe_open(str(f), framework="pt"))
            except Exception as e:  # safetensors' own error for truncated headers, OSError, ...
                raise _unreadable(f, e) from None
            where.update({key: (f, handle) for key in handle.keys()})
        groups: Dict[Optional[int], list] = {}
        for key in where:
            layer = _LAYER_KEY.match(key)
            groups.setdefault(int(layer.group(1)) if layer else None, []).append(key)
        for layer in sorted(groups, key=lambda n: (n is None, n or 0)):
            part = {}
            for key in groups.pop(layer):
                f, handle = where[key]
                try:
                    part[key] = handle.get_tensor(key)
                except Exception as e:
                    raise _unreadable(f, e) from None
            yield part


def to_tune(state: Dict[str, torch.Tensor], hf: dict, family: Family) -> Dict[str, torch.Tensor]:
    """HF names and layout to torchtune's, for the shapes in ``hf`` (a config.json dict). With tied embeddings the
    output weight is the embedding's, so a stored ``lm_head.weight`` (some tied checkpoints keep a copy) is dropped.
    A tensor the family does not have is a KeyError naming it."""
    if hf.get("tie_word_embeddings"):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    try:
        return family.hf_to_tune(state, **_shapes(hf))
    except KeyError:
        raise
    except Exception as e:  # torchtune's key mapping raises a bare Exception for a tensor it has no name for
        raise KeyError(" ".join(str(e).split())[:300]) from None


def to_hf(state: Dict[str, torch.Tensor], hf: dict, family: Family) -> Dict[str, torch.Tensor]:
    """torchtune's names and layout to HF's (q/k permuted back), for the shapes in ``hf``; on the tensors' device."""
    return family.tune_to_hf(state, **_shapes(hf))


def _shapes(hf: dict) -> dict:
    """The converters' shapes from config.json, with transformers' defaults for the fields a source may leave out
    (Qwen2's config.json has no head_dim)."""
    heads = hf["num_attention_heads"]
    return dict(
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        dim=hf["hidden_size"],
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
    )


def misfit_error(
    folder: Path, detail: str, family: Optional[Family] = None, config_json: Optional[Path] = None
) -> BadInput:
    """The weights of ``folder`` do not fit the model: the one ``config_json`` (checkpoint_dir's) describes, or
    without one the config's model section, which is then what to change."""
    if config_json is not None:
        return BadInput(
            f"the weights in {folder} do not fit the model {config_json} describes ({detail}); a weight file lacks "
            f"tensors or holds another model's: re-copy the folder, or restore the config.json the weights were saved "
            "with"
        )
    example = (family or FAMILIES[DEFAULT_FAMILY]).example_builder
    return BadInput(
        f"the weights in {folder} do not fit the model config ({detail}); make the config's model section "
        f"match the checkpoint (e.g. model._component_={example} for that family's model of that size)"
    )


def _keys_error(kind: str, keys: List[str]) -> KeyError:
    """load_state_dict's wording for keys the model lacks (``kind``: Unexpected) or the folder lacks (Missing): the
    first eight, and how many in all."""
    names = ", ".join(f'"{k}"' for k in keys[:8])
    return KeyError(f"{kind} key(s) in state_dict: {names} ({len(keys)} in all)")


def load_weights(
    model: torch.nn.Module,
    folder: Path,
    hf: dict,
    family: Family,
    assign: bool = False,
    config_json: Optional[Path] = None,
) -> None:
    """Load an HF checkpoint folder (safetensors or .bin shards) into a torchtune model built for ``hf``. ``assign``:
    the file's tensors (cast to the model's dtype) become the parameters: a model built on the meta device gets its
    weights in host memory without a copy of its own. Read and loaded a layer at a time (``read_weight_groups``): a
    model built on the GPU never has the folder whole in host memory. ``config_json``: the file the model was built
    from, if any (the message of a misfit names it)."""
    dtypes = {k: v.dtype for k, v in model.state_dict().items()}
    loaded = set()
    try:  # (a checkpoint of another size fails in the q/k permutation already, or in load_state_dict)
        for part in read_weight_groups(folder):  # (a layer at a time: on the GPU, the host holds about one layer)
            tune = to_tune(part, hf, family)
            if assign:
                tune = {k: v.to(dtypes.get(k, v.dtype)) for k, v in tune.items()}
            unexpected = model.load_state_dict(tune, assign=assign, strict=False).unexpected_keys
            if unexpected:
                raise _keys_error("Unexpected", unexpected)
            loaded.update(tune)
            del part, tune  # (before the next layer is read)
        missing = sorted(set(dtypes) - loaded)
        if missing:
            raise _keys_error("Missing", missing)
    except (RuntimeError, KeyError) as e:
        raise misfit_error(folder, " ".join(str(e).split())[:600], family, config_json) from None


def write_folder(
    folder: Path,
    tune_state: Dict[str, torch.Tensor],
    hf: dict,
    family: Family,
    tokenizer_path: Path,
    bounce: Optional[torch.Tensor] = None,
) -> None:
    """The weights (converted to HF names), config.json, generation_config.json and the tokenizer's files into
    ``folder``, which the caller publishes.

    The weights are converted and written one tensor at a time (``async_save.write_safetensors``: the bytes
    safetensors' own writer writes), wherever they live: a model on the GPU, or one whose streamed layers sit in host
    memory beside the resident ones, needs no host copy of itself for a save (a 7B model's would be 13 GB at the
    moment a small-card run has the least host memory to spare). ``bounce``: a pinned buffer that GPU tensors go
    through, a piece at a time (faster than a pageable copy of each).

    The tokenizer: ``tokenizer_path`` under its standard name (tokenizer.json, or tokenizer.model for a SentencePiece
    file) and those of TOKENIZER_FILES that sit beside it (tokenizer_config.json with the special tokens and chat
    template), so the folder is whole for transformers' AutoTokenizer.
    """
    convert = functools.partial(to_hf, hf=hf, family=family)
    weights = {k: v.detach() for k, v in tune_state.items()}  # (emptied as it is written; the caller's dict is not)
    write_safetensors(folder / WEIGHTS_FILE, weights, convert, WEIGHTS_METADATA, bounce)
    write_config_and_tokenizer(folder, hf, family, tokenizer_path)


def write_config_and_tokenizer(folder: Path, hf: dict, family: Family, tokenizer_path: Path) -> None:
    """The folder's files beside the weights: config.json, generation_config.json and the tokenizer's."""
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer_path = Path(tokenizer_path)
    main = "tokenizer.json" if tokenizer_path.suffix == ".json" else "tokenizer.model"
    shutil.copyfile(tokenizer_path, folder / main)
    for name in TOKENIZER_FILES:
        beside = tokenizer_path.with_name(name)
        if name != main and beside.is_file():
            shutil.copyfile(beside, folder / name)
