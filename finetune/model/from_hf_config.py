"""The model a Hugging Face folder's config.json describes, built from torchtune's modules.

With ``checkpoint_dir`` set, the fine-tune recipes build the folder's model, whatever its size: ``decoder``
(finetune/model/builders.py) takes
every architecture field a supported family has (sizes, heads, key/value heads, ``head_dim`` on its own, vocabulary,
tied embeddings, RoPE base and Llama 3.1's RoPE scaling, norm eps, q/k/v biases, q/k norms, max positions), and one
function per family (``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``mistral``, named in hf_format.FAMILIES) reads those fields
from config.json into ``decoder``'s keywords. A field the family's modules cannot honour (a sliding window, a RoPE
scaling other than Llama 3.1's, Llama's optional biases, an activation other than SiLU) is a BadInput naming the
field, its value and the fix, raised while the config is checked: before anything is tokenized or built.

config.json is read by transformers' own config class for its ``model_type``, so a field the file leaves out has
the value transformers gives it (``rope_theta``, ``head_dim``, ``num_key_value_heads``...), in transformers 4's
spelling (``rope_theta``, ``rope_scaling``) or 5's (``rope_parameters``).
"""

from typing import Any, Dict

from finetune.base import BadInput
from finetune.model.builders import decoder  # noqa: F401  (COMPONENT names it here)

COMPONENT = "finetune.model.from_hf_config.decoder"  # what ModelSettings.section names when built from config.json


# ------------------------------------------------------------------------------------------------
# config.json, read
# ------------------------------------------------------------------------------------------------

LLAMA3_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_config(source: Dict[str, Any]):
    """transformers' config object for config.json ``source`` (its class for ``model_type``: defaults filled in,
    old spellings converted); a file transformers refuses is a BadInput quoting its reason."""
    from transformers import AutoConfig

    fields = {k: v for k, v in source.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(source["model_type"], **fields)
    except Exception as e:  # transformers' own validation (a rope_scaling it cannot read, ...)
        text = " ".join(str(e).split())[:300]
        raise BadInput(
            f"transformers cannot read checkpoint_dir's config.json ({type(e).__name__}: {text}); fix the "
            "file, or re-download the model folder"
        ) from None


def rope_of(cfg) -> Dict[str, Any]:
    """RoPE as config.json sets it: ``rope_type``, ``rope_theta`` and the scaling's own keys, whichever spelling
    (transformers 5's ``rope_parameters``, or 4's ``rope_theta`` and ``rope_scaling``) the config has."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        rope = dict(params)
    else:
        scaling = dict(getattr(cfg, "rope_scaling", None) or {})
        rope = {**scaling, "rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    rope["rope_type"] = rope.get("rope_type", rope.pop("type", "default")) or "default"
    return rope


def refuse(field: str, value: Any, why: str, fix: str) -> BadInput:
    return BadInput(f"checkpoint_dir's config.json has {field}={value!r}, which {why}; {fix}")


def _common(cfg, *, family: str, scalings=("default",)) -> Dict[str, Any]:
    """``decoder``'s keywords every family reads the same way, and the checks they share."""
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise refuse(
            "hidden_act",
            act,
            f"{family}'s MLP (SiLU-gated) does not compute",
            "fine-tune a model of this family with hidden_act='silu'",
        )
    rope = rope_of(cfg)
    if rope["rope_type"] not in scalings:
        raise refuse(
            "rope_scaling",
            {k: v for k, v in rope.items() if k != "rope_theta"},
            f"{family}'s RoPE does not compute (it has: {', '.join(scalings)})",
            "fine-tune a folder without rope_scaling (null)"
            + (", or with Llama 3.1's (rope_type 'llama3')" if "llama3" in scalings else ""),
        )
    partial = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise refuse(
            "partial_rotary_factor",
            partial,
            "rotates a part of each head; this family's RoPE rotates all of it",
            "fine-tune a folder with partial_rotary_factor 1.0",
        )
    heads, width = cfg.num_attention_heads, cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or width // heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % kv_heads:
        raise refuse(
            "num_key_value_heads",
            kv_heads,
            f"does not divide num_attention_heads={heads}",
            "fix the folder's config.json",
        )
    kwargs = dict(
        vocab_size=cfg.vocab_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        embed_dim=width,
        intermediate_dim=cfg.intermediate_size,
        max_seq_len=cfg.max_position_embeddings,
        head_dim=head_dim,
        norm_eps=float(cfg.rms_norm_eps),
        rope_base=float(rope["rope_theta"]),
        tie_word_embeddings=bool(cfg.tie_word_embeddings),
        attn_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
    )
    if rope["rope_type"] == "llama3":
        kwargs["rope_scaling"] = {
            k: float(rope[k]) if k != "original_max_position_embeddings" else int(rope[k]) for k in LLAMA3_SCALING_KEYS
        }
    return kwargs


def _no_sliding_window(cfg, family: str, fix: str) -> None:
    """torchtune's attention has no sliding window: a folder whose layers use one is refused."""
    if getattr(cfg, "use_sliding_window", False):
        raise refuse(
            "use_sliding_window", True, f"torchtune's attention (every {family} layer here) does not compute", fix
        )
    window = getattr(cfg, "sliding_window", None)
    if family == "mistral" and window is not None:
        raise refuse(
            "sliding_window", window, "torchtune's attention does not compute (it attends to every earlier token)", fix
        )
    types = getattr(cfg, "layer_types", None) or []
    windowed = [t for t in types if t != "full_attention"]
    if windowed:
        raise refuse("layer_types", windowed[0], "torchtune's attention does not compute", fix)


def _no_llama_biases(cfg, family: str) -> None:
    for key in ("attention_bias", "mlp_bias"):
        if getattr(cfg, key, False):
            raise refuse(
                key,
                True,
                f"adds biases {family}'s converter has no names for",
                f"fine-tune a folder with {key} false (every released Llama)",
            )


def llama(cfg) -> Dict[str, Any]:
    """Llama 2 and 3.x: interleaved RoPE (q/k permuted by the converter), Llama 3.1's scaling, tying (3.2)."""
    _no_llama_biases(cfg, "Llama")
    return _common(cfg, family="Llama", scalings=("default", "llama3"))


def qwen2(cfg) -> Dict[str, Any]:
    """Qwen2 and 2.5: rotate-half RoPE, biases on q/k/v (always: config.json has no key for them)."""
    _no_sliding_window(cfg, "qwen2", "fine-tune a folder with use_sliding_window false (every released Qwen2.5)")
    return dict(_common(cfg, family="Qwen2"), rotate_half=True, qkv_bias=True)


def qwen3(cfg) -> Dict[str, Any]:
    """Qwen3 dense: rotate-half RoPE, RMSNorm over each head's q and k before RoPE, no biases."""
    _no_llama_biases(cfg, "Qwen3")
    _no_sliding_window(cfg, "qwen3", "fine-tune a folder with use_sliding_window false (every released Qwen3)")
    return dict(_common(cfg, family="Qwen3"), rotate_half=True, qk_norm=True)


def qwen3_moe(cfg) -> Dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention; sparse MoE blocks where transformers puts them (``mlp_only_layers``,
    ``decoder_sparse_step``: honoured), with ``norm_topk_prob`` and the load-balancing loss at
    ``router_aux_loss_coef``. (``output_router_logits``, an output switch of transformers' forward, is not read: the
    recipes always train with the load-balancing loss; a folder that wants none sets router_aux_loss_coef 0.)"""
    _no_llama_biases(cfg, "Qwen3-MoE")
    _no_sliding_window(cfg, "qwen3_moe", "fine-tune a folder with use_sliding_window false (every released Qwen3-MoE)")
    experts, per_token = int(cfg.num_experts), int(cfg.num_experts_per_tok)
    if experts < 1:
        raise refuse(
            "num_experts", experts, "makes every layer dense", "fine-tune it as a dense Qwen3 folder (model_type qwen3)"
        )
    if not 1 <= per_token <= experts:
        raise refuse(
            "num_experts_per_tok",
            per_token,
            f"is not between 1 and num_experts={experts}",
            "fix the folder's config.json (Qwen3-30B-A3B routes each token to 8 of 128)",
        )
    fields = {
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }
    lowest = {"moe_intermediate_size": 1, "decoder_sparse_step": 1, "router_aux_loss_coef": 0}
    for key, value in fields.items():
        if value < lowest[key]:
            raise refuse(key, value, f"is below {lowest[key]}", "fix the folder's config.json")
    return dict(
        _common(cfg, family="Qwen3-MoE"),
        rotate_half=True,
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=per_token,
        moe_intermediate_dim=int(cfg.moe_intermediate_size),
        norm_topk_prob=bool(cfg.norm_topk_prob),
        decoder_sparse_step=int(cfg.decoder_sparse_step),
        mlp_only_layers=sorted(int(i) for i in (cfg.mlp_only_layers or [])),
        router_aux_loss_coef=float(cfg.router_aux_loss_coef),
    )


def mistral(cfg) -> Dict[str, Any]:
    """Mistral: Llama's layout with interleaved RoPE; no sliding window (v0.2 and v0.3 have none)."""
    _no_sliding_window(
        cfg, "mistral", "fine-tune a folder with sliding_window null (Mistral 7B v0.2 and v0.3 have none)"
    )
    return _common(cfg, family="Mistral")


# ------------------------------------------------------------------------------------------------
# the config's model section, against config.json
# ------------------------------------------------------------------------------------------------

# The model keywords of torchtune's builders (and ours) that config.json decides, with the field that decides each.
KWARG_FIELDS = {
    "vocab_size": "vocab_size",
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "embed_dim": "hidden_size",
    "intermediate_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "head_dim": "head_dim",
    "norm_eps": "rms_norm_eps",
    "rope_base": "rope_theta",
    "tie_word_embeddings": "tie_word_embeddings",
    "attn_dropout": "attention_dropout",
    "scale_factor": "rope_scaling.factor",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "moe_intermediate_dim": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
    "mlp_only_layers": "mlp_only_layers",
    "router_aux_loss_coef": "router_aux_loss_coef",
}


def check_model_keys(given: Dict[str, Any], built: Dict[str, Any]) -> None:
    """The config's own model keywords (``model.num_layers=2`` beside checkpoint_dir) must say what config.json says:
    the model is built from config.json, and a key that disagrees is refused rather than ignored."""
    for key, value in given.items():
        if key == "_component_":
            continue
        if key not in KWARG_FIELDS or (key not in built and key != "scale_factor"):
            raise BadInput(
                f"model.{key}={value!r} is not read when the model is built from checkpoint_dir's "
                f"config.json; remove it (~model.{key})"
            )
        if key == "scale_factor":
            found = (built.get("rope_scaling") or {}).get("factor")
        else:
            found = built[key]
        same = (
            found is not None
            and value is not None
            and (
                list(value) == found
                if isinstance(found, list)
                else value == found
                if isinstance(found, bool) or isinstance(value, bool)
                else float(value) == float(found)
            )
        )
        if not same and not (key == "intermediate_dim" and value is None):
            raise BadInput(
                f"model.{key}={value!r} but checkpoint_dir's config.json has {KWARG_FIELDS[key]}="
                f"{found!r}, and the model is built from config.json; remove model.{key} "
                f"(~model.{key}) or set model.{key}={found!r}"
            )
