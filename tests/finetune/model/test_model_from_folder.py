"""The model of a Hugging Face folder, built from its config.json (finetune/model/from_hf_config.py, through
hf_format.resolve_model): every architecture field is what the model is built with, or one BadInput naming it.

The folders are tests/support.py's ANY_FOLDERS, saved by transformers: per family a config.json unlike any released
model's (width 48 with head_dim 16, 3 layers, RoPE bases and norm eps no release has, tying flipped). In this
process, a few seconds.
"""

import json

import pytest
import torch
import transformers
from omegaconf import OmegaConf
from torchtune import config

import support
from conftest import DATA_DIR, LLAMA2_TOKENIZER
from finetune.base import BadInput
from finetune.checkpoint import hf_format


@pytest.fixture(scope="module")
def bpe():
    return support.train_bpe(support.alpaca_texts(DATA_DIR, 500), support.TOY_BPE_SIZE)


@pytest.fixture(scope="module")
def folders(tmp_path_factory, bpe):
    root = tmp_path_factory.mktemp("any")
    return {
        key: (root / key, support.make_any_folder(root / key, key, bpe, LLAMA2_TOKENIZER))
        for key in support.ANY_FOLDERS
    }


def build(built: dict) -> torch.nn.Module:
    return config.instantiate(OmegaConf.create(built))


def source(key: str, **fields) -> dict:
    """ANY_FOLDERS[key]'s config.json fields as a dict (no folder), with ``fields`` changed."""
    toy, _ = support.ANY_FOLDERS[key]
    model_type = hf_format.FAMILIES[toy.family].model_type
    return {"model_type": model_type, **toy.hf, **fields}


@pytest.mark.parametrize("key", list(support.ANY_FOLDERS))
def test_the_model_is_the_folders_model(key, folders):
    """No model section: the family from config.json, the model built from its fields (transformers' logits), and
    config.json written back as the source's."""
    folder, src = folders[key]
    toy, _ = support.ANY_FOLDERS[key]
    family, built = hf_format.resolve_model(src, None)
    assert family.name == toy.family
    model = build(built).eval()
    attn = model.layers[0].attn
    assert (len(model.layers), attn.num_heads, attn.num_kv_heads) == (3, 4, 2)
    assert attn.head_dim == src.get("head_dim", src["hidden_size"] // 4)
    assert model.norm.eps == src["rms_norm_eps"] and attn.pos_embeddings.base == support.rope_theta(src)
    written = hf_format.hf_config(model, torch.float32, src, family)
    assert written == {**src, "dtype": "float32"}
    hf_format.load_weights(model, folder, written, family)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokens = torch.randint(0, src["vocab_size"], (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4


def test_llama_2_or_3_from_the_folder():
    assert hf_format.source_family(source("llama2")).name == "llama2"
    assert hf_format.source_family(source("llama3_1")).name == "llama3"
    assert hf_format.source_family(source("llama2", vocab_size=128256)).name == "llama3"
    # a Llama 3 builder takes a Llama 2-like folder (one layout): the family the config names
    family, _ = hf_format.resolve_model(source("llama2"), {"_component_": "torchtune.models.llama3.llama3_8b"})
    assert family.name == "llama3"


def test_transformers_4_spelling_and_left_out_fields():
    """rope_theta / rope_scaling with "type" (transformers 4), no head_dim, no num_key_value_heads: transformers'
    own reading of the file (its defaults) is what the model is built with."""
    src = {
        "model_type": "llama",
        "vocab_size": 1024,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 70000.0,
        "rope_scaling": {
            "type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        },
    }
    family, built = hf_format.resolve_model(src, None)
    assert family.name == "llama3"
    assert (built["head_dim"], built["num_kv_heads"], built["rope_base"]) == (16, 4, 70000.0)
    assert built["rope_scaling"] == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    written = hf_format.hf_config(build(built), torch.bfloat16, src, family)
    assert {k: written[k] for k in src} == src and written["torch_dtype"] == "bfloat16"
    # what it adds (the class, the fields the family always has, the left-out defaults) changes nothing else
    # transformers reads
    ours, theirs = (transformers.AutoConfig.for_model(**c).to_dict() for c in (written, src))
    assert ours.pop("architectures") == ["LlamaForCausalLM"]
    assert {k: v for k, v in ours.items() if "dtype" not in k} == {
        k: v for k, v in theirs.items() if "dtype" not in k and k != "architectures"
    }


def test_the_config_s_model_keys_must_say_what_config_json_says():
    src = source("llama3_1")
    given = {
        "_component_": "torchtune.models.llama3_1.llama3_1",
        "num_layers": 3,
        "norm_eps": 2e-5,
        "scale_factor": 16,
        "rope_base": 250000,
    }
    assert hf_format.resolve_model(src, given)[1]["num_layers"] == 3
    with pytest.raises(
        BadInput,
        match=r"^model.num_layers=2 but checkpoint_dir's config.json has "
        r"num_hidden_layers=3.*remove model.num_layers",
    ):
        hf_format.resolve_model(src, {**given, "num_layers": 2})
    with pytest.raises(BadInput, match=r"model.scale_factor=8 but .* rope_scaling.factor=16.0"):
        hf_format.resolve_model(src, {**given, "scale_factor": 8})
    with pytest.raises(BadInput, match=r"model.norm_eps=1e-05 but .* rms_norm_eps=2e-05"):
        hf_format.resolve_model(src, {"_component_": "torchtune.models.llama3_1.llama3_1_8b", "norm_eps": 1e-5})


def test_the_moe_keys_must_say_what_config_json_says():
    """A mixture of experts' keys beside checkpoint_dir (``model.num_experts=6``) are checked as the sizes are; a MoE
    key given for a dense folder is refused as not read."""
    src = source("qwen3_moe")
    given = {"_component_": "finetune.model.qwen3_moe", "num_experts": 6, "mlp_only_layers": [1]}
    family, built = hf_format.resolve_model(src, given)
    assert family.name == "qwen3_moe" and built["moe_intermediate_dim"] == 24 and built["norm_topk_prob"] is False
    with pytest.raises(BadInput, match=r"^model.num_experts=8 but checkpoint_dir's config.json has num_experts=6"):
        hf_format.resolve_model(src, {**given, "num_experts": 8})
    with pytest.raises(BadInput, match=r"model.mlp_only_layers=\[0\] but .* mlp_only_layers=\[1\]"):
        hf_format.resolve_model(src, {**given, "mlp_only_layers": [0]})
    with pytest.raises(BadInput, match=r"^model.num_experts=6 is not read when the model is built from"):
        hf_format.resolve_model(source("qwen3"), {"_component_": "finetune.model.qwen3", "num_experts": 6})


def test_a_builder_of_another_family_or_none_is_refused():
    with pytest.raises(BadInput, match=r"model_type='qwen2'.*torchtune\.models\.qwen2_5\.qwen2_5_7b_base"):
        hf_format.resolve_model(source("qwen2_5"), {"_component_": "torchtune.models.llama3_1.llama3_1_8b"})
    with pytest.raises(BadInput, match=r"model._component_=mypkg.my_model is not a builder of a family"):
        hf_format.resolve_model(source("qwen3"), {"_component_": "mypkg.my_model"})
    with pytest.raises(BadInput, match=r"model_type='gemma'; the families this recipe reads are"):
        hf_format.resolve_model({**source("qwen3"), "model_type": "gemma"}, None)


@pytest.mark.parametrize(
    "key,fields,named",
    [
        (
            "qwen2_5",
            {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0},
            "use_sliding_window=True",
        ),
        (
            "qwen3",
            {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0},
            "use_sliding_window=True",
        ),
        ("mistral", {"sliding_window": 4096}, "sliding_window=4096"),
        (
            "llama3_1",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
            "rope_scaling={'rope_type': 'yarn'",
        ),
        ("qwen2_5", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling={'rope_type': 'linear'"),
        ("llama2", {"attention_bias": True}, "attention_bias=True"),
        ("llama3_2", {"mlp_bias": True}, "mlp_bias=True"),
        ("qwen3", {"attention_bias": True}, "attention_bias=True"),
        ("mistral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("qwen3_moe", {"num_experts": 0}, "num_experts=0"),
        ("qwen3_moe", {"num_experts_per_tok": 7}, "num_experts_per_tok=7"),
        ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0"),
        ("qwen3_moe", {"attention_bias": True}, "attention_bias=True"),
    ],
)
def test_a_field_the_family_cannot_honour_is_one_line(key, fields, named):
    with pytest.raises(BadInput) as e:
        hf_format.resolve_model(source(key, **fields), None)
    text = str(e.value)
    assert text.startswith(f"checkpoint_dir's config.json has {named}") and "\n" not in text
    assert "; " in text  # the fix


def test_written_config_json_loads_as_the_source_in_transformers(folders, tmp_path):
    """The round trip: transformers reads the written config.json as it read the source's."""
    folder, src = folders["llama3_1"]
    family, built = hf_format.resolve_model(src, None)
    written = hf_format.hf_config(build(built), torch.bfloat16, src, family)
    (tmp_path / "config.json").write_text(json.dumps(written))
    ours, theirs = (transformers.AutoConfig.from_pretrained(p).to_dict() for p in (tmp_path, folder))
    assert ours.pop("dtype") == "bfloat16"
    assert {k: v for k, v in ours.items() if k != "_name_or_path"} == {
        k: v for k, v in theirs.items() if k not in ("_name_or_path", "dtype")
    }
