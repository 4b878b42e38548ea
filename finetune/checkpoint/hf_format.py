"""The Hugging Face checkpoint format of each model family: part of the checkpoint component.

A checkpoint folder is what transformers' ``from_pretrained`` reads: ``config.json``, the weights
(``model.safetensors``), ``generation_config.json`` and the tokenizer's files. torchtune's models name their
weights otherwise (``layers.0.attn.q_proj.weight`` for ``model.layers.0.self_attn.q_proj.weight``), and the Llama
and Mistral builders permute the query and key projections for their RoPE; torchtune's converters do both
directions.

A model family is one ``Family`` row in ``FAMILIES``: its ``model_type`` and architecture class, the torchtune
builders that make it, the config.json fields it always writes, and its converters. Everything else in config.json
is read off the built model (sizes, tied embeddings, RoPE base and Llama 3 scaling), so one row serves every size
of a family. The recipes never branch on a family; they call ``family_of``, ``hf_config``, ``read_weights`` /
``to_tune`` and ``write_folder``. docs/models.md says how to add a family.
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file
from torchtune.models import convert_weights
from torchtune.models.convert_weights import get_mapped_key
from torchtune.models.qwen2._convert_weights import _FROM_HF as _QWEN2_FROM_HF

from finetune.base import BadInput, hf_weight_files, load_state_file

WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
WEIGHTS_METADATA = {"format": "pt"}  # model.safetensors' header metadata, as transformers writes it
# Files of the tokenizer that a checkpoint folder carries when they sit beside ``tokenizer.path`` (the first two are
# what transformers' AutoTokenizer reads; tokenizer.model is SentencePiece, Llama 2's and Mistral's).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _rename(mapping: Dict[str, Optional[str]]) -> Callable:
    """A converter that only renames (the families whose RoPE needs no permutation: Qwen's rotate-half)."""
    def convert(state, num_heads, num_kv_heads, dim, head_dim):
        return {get_mapped_key(k, mapping): v for k, v in state.items() if "rotary_emb.inv_freq" not in k}
    return convert


# Qwen3: Qwen2's names without the q/k/v biases, plus one RMSNorm per head on the queries and the keys.
_QWEN3_FROM_HF = {k: v for k, v in _QWEN2_FROM_HF.items() if not k.endswith(".bias")}
_QWEN3_FROM_HF.update({"model.layers.{}.self_attn.q_norm.weight": "layers.{}.attn.q_norm.scale",
                       "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attn.k_norm.scale"})


def _inverse(mapping: Dict[str, Optional[str]]) -> Dict[str, str]:
    return {v: k for k, v in mapping.items() if v is not None}


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


# torchtune's builders have no sliding-window attention: the families that can have one say so in config.json.
_LLAMA_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}

FAMILIES: Dict[str, Family] = {
    "llama2": Family(
        name="llama2", builders=("torchtune.models.llama2.",), model_type="llama",
        architecture="LlamaForCausalLM", example_builder="torchtune.models.llama2.llama2_7b", fixed=_LLAMA_FIXED),
    # Llama 3, 3.1, 3.2 and 3.3: Llama 2's layout; 3.1 on adds the llama3 RoPE scaling, 3.2 1B/3B tie the
    # embeddings (both read off the model).
    "llama3": Family(
        name="llama3", builders=("torchtune.models.llama3.", "torchtune.models.llama3_1.",
                                 "torchtune.models.llama3_2.", "torchtune.models.llama3_3."),
        model_type="llama", architecture="LlamaForCausalLM", example_builder="torchtune.models.llama3_1.llama3_1_8b",
        fixed=_LLAMA_FIXED),
    # Qwen2 and 2.5: biases on the q/k/v projections (always, so config.json has no key for it), rotate-half RoPE.
    "qwen2": Family(
        name="qwen2", builders=("torchtune.models.qwen2.", "torchtune.models.qwen2_5."), model_type="qwen2",
        architecture="Qwen2ForCausalLM", example_builder="torchtune.models.qwen2_5.qwen2_5_7b_base",
        fixed={"hidden_act": "silu", "use_sliding_window": False}, hf_to_tune=_rename(_QWEN2_FROM_HF),
        tune_to_hf=_rename(_inverse(_QWEN2_FROM_HF))),
    # Qwen3 (our builder, finetune/model/builders.py): no biases, RMSNorm per head on q and k before RoPE.
    "qwen3": Family(
        name="qwen3", builders=("finetune.model.qwen3", "finetune.model.builders.qwen3"), model_type="qwen3", architecture="Qwen3ForCausalLM",
        example_builder="finetune.model.qwen3_8b",
        fixed={"hidden_act": "silu", "attention_bias": False, "use_sliding_window": False},
        hf_to_tune=_rename(_QWEN3_FROM_HF), tune_to_hf=_rename(_inverse(_QWEN3_FROM_HF))),
    "mistral": Family(
        name="mistral", builders=("torchtune.models.mistral.", "finetune.model.mistral", "finetune.model.builders.mistral"),
        model_type="mistral",
        architecture="MistralForCausalLM", example_builder="finetune.model.mistral_7b_v0_3",
        fixed={"hidden_act": "silu", "sliding_window": None}),
}
DEFAULT_FAMILY = "llama2"


def family_of(model_component: Optional[str]) -> Family:
    """The family whose builder ``model._component_`` names; a builder of no known family (one of your own) is read
    and written as Llama 2, whose layout every Llama-architecture builder shares."""
    for family in FAMILIES.values():
        if str(model_component or "").startswith(family.builders):
            return family
    return FAMILIES[DEFAULT_FAMILY]


def rope_scaling(rope: torch.nn.Module) -> Optional[dict]:
    """config.json's ``rope_scaling`` for torchtune's RoPE module: Llama 3.1's scaled RoPE, or None (plain RoPE)."""
    if not hasattr(rope, "scale_factor"):
        return None
    return {"rope_type": "llama3", "factor": float(rope.scale_factor), "low_freq_factor": float(rope.low_freq_factor),
            "high_freq_factor": float(rope.high_freq_factor),
            "original_max_position_embeddings": int(rope.old_context_len)}


def hf_config(model: torch.nn.Module, dtype: torch.dtype, base: Optional[dict], family: Family,
              tokenizer=None) -> dict:
    """config.json for ``family``'s transformers class, read off the built model.

    ``base`` (the source checkpoint's config.json, if any) is kept for keys we do not derive, such as bos/eos ids;
    without it they come from ``tokenizer``. A source checkpoint of another family, or one whose embedding tying
    differs from the model's, is a BadInput. Call it before activation checkpointing or compile wrap the layers.
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
                f"size (e.g. {family.example_builder}), or set model.tie_word_embeddings where the builder takes it")
    rope = attn.pos_embeddings
    scaling = rope_scaling(rope)
    hf = dict(base or {})
    hf.update(
        architectures=[family.architecture],
        model_type=family.model_type,
        vocab_size=model.tok_embeddings.weight.shape[0],
        hidden_size=model.tok_embeddings.weight.shape[1],
        intermediate_size=layer.mlp.w1.weight.shape[0],
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
    if base is None or "bos_token_id" not in base:
        hf["bos_token_id"] = getattr(tokenizer, "bos_id", None) if tokenizer is not None else 1
    if base is None or "eos_token_id" not in base:
        hf["eos_token_id"] = getattr(tokenizer, "eos_id", None) if tokenizer is not None else 2
    return hf


def check_source_family(base: dict, family: Family) -> None:
    """A checkpoint's config.json of another model_type than the configured builder's is a BadInput naming a
    builder of the checkpoint's family."""
    found = base.get("model_type")
    if found is None or found == family.model_type:
        return
    match = next((f for f in FAMILIES.values() if f.model_type == found), None)
    hint = (f"set model._component_ to a builder of that family (e.g. {match.example_builder})" if match else
            f"the families this recipe reads are: {', '.join(sorted({f.model_type for f in FAMILIES.values()}))}")
    raise BadInput(f"the checkpoint's config.json has model_type={found!r} but model._component_ builds a "
                   f"{family.model_type!r} model ({family.name}); {hint}")


def read_source_config(folder: Optional[Path]) -> Optional[dict]:
    """A checkpoint folder's config.json, if it has one, read once (settings keeps it: ``Settings.source_config``);
    unreadable JSON, or JSON that is not an object, is a BadInput."""
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    path = Path(folder) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError) as e:  # (JSONDecodeError is a ValueError)
        config = f"{type(e).__name__}: {str(e)[:120]}"
    if not isinstance(config, dict):
        what = config if isinstance(config, str) else f"a {type(config).__name__}"
        raise BadInput(f"{path} is not a JSON object ({what}); re-copy the checkpoint folder (its config.json "
                       "describes the model)")
    return config


def read_weights(folder: Path) -> Dict[str, torch.Tensor]:
    """Every tensor of an HF folder's weight files; an unreadable file is one BadInput naming it."""
    fix = ("re-copy or re-download it, or point checkpoint_dir / resume_from_checkpoint at another folder "
           "(an earlier step_N or epoch_E)")
    state: Dict[str, torch.Tensor] = {}
    for f in hf_weight_files(folder):
        if f.suffix == ".safetensors":
            try:
                state.update(load_file(str(f)))
            except Exception as e:  # safetensors' own error for truncated headers, OSError, ...
                text = " ".join(str(e).split())[:200]
                raise BadInput(f"{f} is not a readable safetensors file ({type(e).__name__}: {text}; truncated or "
                               f"garbage?); {fix}") from None
        else:
            state.update(load_state_file(f, fix=fix))
    return state


def to_tune(state: Dict[str, torch.Tensor], hf: dict, family: Family) -> Dict[str, torch.Tensor]:
    """HF names and layout to torchtune's, for the shapes in ``hf`` (a config.json dict). With tied embeddings the
    output weight is the embedding's, so a stored ``lm_head.weight`` (some tied checkpoints keep a copy) is dropped.
    A tensor the family does not have is a KeyError naming it."""
    if hf.get("tie_word_embeddings"):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    try:
        return family.hf_to_tune(state, num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                                 dim=hf["hidden_size"], head_dim=hf["head_dim"])
    except KeyError:
        raise
    except Exception as e:  # torchtune's key mapping raises a bare Exception for a tensor it has no name for
        raise KeyError(" ".join(str(e).split())[:300]) from None


def to_hf(state: Dict[str, torch.Tensor], hf: dict, family: Family) -> Dict[str, torch.Tensor]:
    """torchtune's names and layout to HF's (q/k permuted back), for the shapes in ``hf``; on the tensors' device."""
    return family.tune_to_hf(state, num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                             dim=hf["hidden_size"], head_dim=hf["head_dim"])


def misfit_error(folder: Path, detail: str, family: Optional[Family] = None) -> BadInput:
    example = (family or FAMILIES[DEFAULT_FAMILY]).example_builder
    return BadInput(
        f"the weights in {folder} do not fit the model config ({detail}); make the config's model section "
        f"match the checkpoint (e.g. model._component_={example} for that family's model of that size)")


def load_weights(model: torch.nn.Module, folder: Path, hf: dict, family: Family) -> None:
    """Load an HF checkpoint folder (safetensors or .bin shards) into a torchtune model built for ``hf``."""
    state = read_weights(folder)
    try:  # (a checkpoint of another size fails in the q/k permutation already, or in load_state_dict)
        model.load_state_dict(to_tune(state, hf, family))
    except (RuntimeError, KeyError) as e:
        raise misfit_error(folder, " ".join(str(e).split())[:600], family) from None


def write_folder(folder: Path, tune_state: Dict[str, torch.Tensor], hf: dict, family: Family,
                 tokenizer_path: Path) -> None:
    """The weights (converted to HF names, on the CPU), config.json, generation_config.json and the tokenizer's
    files into ``folder``, which the caller publishes.

    The tokenizer: ``tokenizer_path`` under its standard name (tokenizer.json, or tokenizer.model for a SentencePiece
    file) and those of TOKENIZER_FILES that sit beside it (tokenizer_config.json with the special tokens and chat
    template), so the folder is whole for transformers' AutoTokenizer.
    """
    state = {k: v.detach().to("cpu").contiguous() for k, v in to_hf(tune_state, hf, family).items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata=WEIGHTS_METADATA)
    del state
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
