"""The Hugging Face checkpoint format of each model family: part of the checkpoint component.

A checkpoint folder is what transformers' ``from_pretrained`` reads: ``config.json``, the weights
(``model.safetensors``), ``generation_config.json`` and the tokenizer's files. torchtune's models name their
weights otherwise (``layers.0.attn.q_proj.weight`` for ``model.layers.0.self_attn.q_proj.weight``) and permute
the query and key projections for their RoPE; torchtune's converters do both directions.

A model family is one ``Family`` row in ``FAMILIES``: its ``model_type`` and architecture class, the config.json
fields it always writes, its converters and its tokenizer files. The recipes never branch on a family; they call
``family_of``, ``hf_config``, ``read_weights`` / ``to_tune`` and ``write_folder``.
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from safetensors.torch import load_file, save_file
from torchtune.models import convert_weights

from finetune_base import BadInput, hf_weight_files, load_state_file

WEIGHTS_FILE = "model.safetensors"
DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
WEIGHTS_METADATA = {"format": "pt"}  # model.safetensors' header metadata, as transformers writes it


@dataclass(frozen=True)
class Family:
    """One model family's Hugging Face format."""

    name: str
    builders: Tuple[str, ...]  # torchtune builder modules (``model._component_`` prefixes) of this family
    model_type: str  # config.json's model_type
    architecture: str  # config.json's architectures[0]: the transformers class that loads the folder
    fixed: Dict[str, Any] = field(default_factory=dict)  # config.json fields this family always writes
    defaults: Dict[str, Any] = field(default_factory=dict)  # written unless the source checkpoint's config has them
    hf_to_tune: Callable = convert_weights.hf_to_tune  # (state, num_heads, num_kv_heads, dim, head_dim) -> state
    tune_to_hf: Callable = convert_weights.tune_to_hf
    # The tokenizer's files in a checkpoint: the first is a copy of ``tokenizer.path``, the others are read from
    # beside it (a tokenizer.json's tokenizer_config.json).
    tokenizer_files: Tuple[str, ...] = ("tokenizer.model",)


FAMILIES: Dict[str, Family] = {
    "llama2": Family(
        name="llama2",
        builders=("torchtune.models.llama2.",),
        model_type="llama",
        architecture="LlamaForCausalLM",
        fixed={"hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False},
        defaults={"bos_token_id": 1, "eos_token_id": 2, "initializer_range": 0.02},
    ),
}
DEFAULT_FAMILY = "llama2"


def family_of(model_component: Optional[str]) -> Family:
    """The family whose torchtune builder ``model._component_`` names; a builder of no known family (one of your
    own) is read and written as Llama 2, whose layout every Llama-architecture builder shares."""
    for family in FAMILIES.values():
        if str(model_component or "").startswith(family.builders):
            return family
    return FAMILIES[DEFAULT_FAMILY]


def hf_config(model: torch.nn.Module, dtype: torch.dtype, base: Optional[dict], family: Family) -> dict:
    """config.json for ``family``'s transformers class, read off the built model's shapes.

    ``base`` (the source checkpoint's config.json, if any) is kept for keys we do not derive, such as bos/eos ids.
    Call it before activation checkpointing or compile wrap the layers.
    """
    layer = model.layers[0]
    attn = layer.attn
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
        rope_theta=float(attn.pos_embeddings.base),
        **family.fixed,
        torch_dtype=DTYPE_NAMES[dtype],
    )
    for key, value in family.defaults.items():
        hf.setdefault(key, value)
    return hf


def read_source_config(folder: Optional[Path]) -> Optional[dict]:
    """A checkpoint folder's config.json, if it has one."""
    if folder is None or not (Path(folder) / "config.json").is_file():
        return None
    return json.loads((Path(folder) / "config.json").read_text())


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
    """HF names and layout to torchtune's, for the shapes in ``hf`` (a config.json dict)."""
    return family.hf_to_tune(state, num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                             dim=hf["hidden_size"], head_dim=hf["head_dim"])


def to_hf(state: Dict[str, torch.Tensor], hf: dict, family: Family) -> Dict[str, torch.Tensor]:
    """torchtune's names and layout to HF's (q/k permuted back), for the shapes in ``hf``; on the tensors' device."""
    return family.tune_to_hf(state, num_heads=hf["num_attention_heads"], num_kv_heads=hf["num_key_value_heads"],
                             dim=hf["hidden_size"], head_dim=hf["head_dim"])


def misfit_error(folder: Path, detail: str) -> BadInput:
    return BadInput(
        f"the weights in {folder} do not fit the model config ({detail}); make the config's model section "
        "match the checkpoint (e.g. model._component_=torchtune.models.llama2.llama2_7b for Llama-2-7b-hf)")


def load_weights(model: torch.nn.Module, folder: Path, hf: dict, family: Family) -> None:
    """Load an HF checkpoint folder (safetensors or .bin shards) into a torchtune model built for ``hf``."""
    state = read_weights(folder)
    try:  # (a checkpoint of another size fails in the q/k permutation already, or in load_state_dict)
        model.load_state_dict(to_tune(state, hf, family))
    except (RuntimeError, KeyError) as e:
        raise misfit_error(folder, " ".join(str(e).split())[:600]) from None


def write_folder(folder: Path, tune_state: Dict[str, torch.Tensor], hf: dict, family: Family,
                 tokenizer_path: Path) -> None:
    """The weights (converted to HF names, on the CPU), config.json, generation_config.json and the tokenizer's
    files into ``folder``, which the caller publishes."""
    state = {k: v.detach().to("cpu").contiguous() for k, v in to_hf(tune_state, hf, family).items()}
    save_file(state, str(folder / WEIGHTS_FILE), metadata=WEIGHTS_METADATA)
    del state
    write_config_and_tokenizer(folder, hf, family, tokenizer_path)


def write_config_and_tokenizer(folder: Path, hf: dict, family: Family, tokenizer_path: Path) -> None:
    """The folder's files beside the weights: config.json, generation_config.json and the tokenizer's."""
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    generation = {"bos_token_id": hf["bos_token_id"], "eos_token_id": hf["eos_token_id"]}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    first, *others = family.tokenizer_files
    shutil.copyfile(tokenizer_path, folder / first)
    for name in others:
        shutil.copyfile(Path(tokenizer_path).with_name(name), folder / name)
