"""What tests build besides conftest's fixtures: toy Hugging Face folders of each model family (a model made by
transformers from the family's config.json at toy sizes, a stand-in tokenizer saved by transformers), the tiny
Llama folder the eval tests read, and the batch runner of fine-tunes. (A run's offline wandb files are read back by
the library's reader, finetune.reporting.wandb_run.read_runs.)

Import it from any test module (tests/ is on sys.path, as conftest's folder): ``import support``. It imports only
the standard library at the top (transformers, tokenizers and torch inside the functions), so that it stays cheap to
import and, run as a script (``python tests/support.py RUNS.json``, the batch of fine-tunes), changes nothing in the
recipe process it runs in.
"""

import copy
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

# -- toy models of the families ---------------------------------------------------------------------------------------

# The stand-in tokenizers (their special tokens, templates, the BPE) are finetune/model/toy_tokenizer.py's, read
# through this module (``support.LLAMA3_SPECIALS``, ``support.train_bpe``) but imported only when first asked for:
# finetune.model imports torchtune, which must not come before the recipe's own imports in ``run_batch``.
_FROM_TOY_TOKENIZER = ("LLAMA3_SPECIALS", "QWEN_SPECIALS", "MISTRAL_SPECIALS", "TEMPLATES", "alpaca_texts", "train_bpe")


def __getattr__(name: str):
    if name in _FROM_TOY_TOKENIZER:
        from finetune.model import toy_tokenizer

        return getattr(toy_tokenizer, name)
    raise AttributeError(f"module 'support' has no attribute {name!r}")


# Every toy: 2 layers of width 64, 4 query heads of 16 in 2 key/value groups, a 1,024-token vocabulary, positions
# up to 16,384; the rest (RoPE and its scaling, tying, norms, biases, windows) is the family's real config.json.
TOY_SIZES = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16384,
)
TOY_SCALE = 0.1  # the random values: +-0.1 (real models: +-0.02), so that a toy's attention is not uniform
TOY_BPE_SIZE = 1008  # the stand-in BPE's tokens; with a family's special tokens (at most 10) within the 1,024
_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Toy:
    """A toy model of one family's model: its config.json and how the recipe builds it."""

    key: str  # the model it is a toy of
    family: str  # finetune/checkpoint/hf_format.py FAMILIES key
    config_class: str  # transformers' config class
    hf: Dict[str, Any]  # config.json's values
    sizes_builder: str  # the recipe's model._component_: a builder taking the sizes
    builder_extra: Dict[str, Any] = field(default_factory=dict)  # sizes_builder keywords beyond the sizes

    @property
    def stand_in(self):
        """The family's stand-in tokenizer (finetune/model/toy_tokenizer.py's STAND_INS; Llama 2 has none: its
        toys carry its SentencePiece tokenizer.model)."""
        from finetune.model.toy_tokenizer import STAND_INS

        return STAND_INS[self.family]


TOYS: Dict[str, Toy] = {
    t.key: t
    for t in [
        Toy(
            "llama3_1_8b",
            "llama3",
            "LlamaConfig",
            dict(
                TOY_SIZES, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA31_ROPE, tie_word_embeddings=False
            ),
            "torchtune.models.llama3_1.llama3_1",
            {"scale_factor": 8},
        ),
        Toy(
            "llama3_2_3b",
            "llama3",
            "LlamaConfig",
            dict(
                TOY_SIZES,
                rms_norm_eps=1e-5,
                rope_theta=500000.0,
                rope_scaling={**_LLAMA31_ROPE, "factor": 32.0},
                tie_word_embeddings=True,
            ),
            "torchtune.models.llama3_2.llama3_2",
            {"scale_factor": 32, "tie_word_embeddings": True},
        ),
        Toy(
            "qwen2_5_7b",
            "qwen2",
            "Qwen2Config",
            dict(
                TOY_SIZES,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=False,
                use_sliding_window=False,
                sliding_window=16384,
                max_window_layers=2,
            ),
            "torchtune.models.qwen2.qwen2",
        ),
        Toy(
            "qwen2_5_3b",
            "qwen2",
            "Qwen2Config",
            dict(
                TOY_SIZES,
                rms_norm_eps=1e-6,
                rope_theta=1000000.0,
                tie_word_embeddings=True,
                use_sliding_window=False,
                sliding_window=16384,
                max_window_layers=2,
            ),
            "torchtune.models.qwen2.qwen2",
            {"tie_word_embeddings": True},
        ),
        # (Qwen3's head_dim: 2 x 64 / 4, not the width's share, as in the real 4B)
        Toy(
            "qwen3_8b",
            "qwen3",
            "Qwen3Config",
            dict(TOY_SIZES, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False, head_dim=32),
            "finetune.model.builders.qwen3",
            {"head_dim": 32},
        ),
        Toy(
            "mistral_7b",
            "mistral",
            "MistralConfig",
            dict(TOY_SIZES, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False),
            "torchtune.models.mistral.mistral",
        ),
    ]
}


def tiny_decoder(device: str = "cpu", seed: int = 0, width: int = 128, layers: int = 2):
    """A torchtune Llama 2 decoder (2 layers, vocabulary 512) in fp32, for tests of what trains it, without a folder."""
    import torch
    from torchtune.models.llama2 import llama2

    torch.manual_seed(seed)
    with torch.device(device):
        return llama2(vocab_size=512, num_layers=layers, num_heads=4, num_kv_heads=2, embed_dim=width, max_seq_len=64)


def rope_theta(hf: Dict[str, Any]) -> float:
    """RoPE's base from config.json as transformers 4 (rope_theta) or 5 (rope_parameters) writes it."""
    return float(hf["rope_theta"] if "rope_theta" in hf else hf["rope_parameters"]["rope_theta"])


def model_overrides(toy: Toy, hf: Dict[str, Any]) -> List[str]:
    """Recipe overrides that build the model of config.json ``hf`` with the toy's sizes builder."""
    args = dict(
        vocab_size=hf["vocab_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf["num_key_value_heads"],
        embed_dim=hf["hidden_size"],
        intermediate_dim=hf["intermediate_size"],
        max_seq_len=hf["max_position_embeddings"],
        norm_eps=hf["rms_norm_eps"],
        rope_base=rope_theta(hf),
        **toy.builder_extra,
    )
    return [f"model._component_={toy.sizes_builder}"] + [f"model.{k}={v}" for k, v in args.items()]


# -- the stand-in tokenizer -----------------------------------------------------------------------------------------


def write_tokenizer(folder: Path, toy: Toy, bpe) -> Dict[str, Optional[int]]:
    """The toy's tokenizer saved by transformers into ``folder``, as a user saves one: the BPE with the family's
    special tokens, its BOS, EOS, padding and chat template (tokenizer.json, tokenizer_config.json). The template
    inside tokenizer_config.json, where finetune.data.HFTokenizer reads it (transformers 5 writes it into a
    chat_template.jinja of its own by default). Returns the bos/eos ids for config.json."""
    from finetune.model import toy_tokenizer

    return toy_tokenizer.write_tokenizer(folder, bpe, toy.stand_in, template_file=False)


# -- the toy checkpoint ---------------------------------------------------------------------------------------------


def make_checkpoint(folder: Path, toy: Toy, bpe, *, seed: int = 0, scale: float = TOY_SCALE) -> Dict[str, Any]:
    """An HF folder as transformers saves one: the family's model for the toy's config.json with uniform random
    values (bit-identical on every CPU: no vectorised normal sampling; +-``scale``, norm scales 1 +- 0.1) in fp32,
    and the toy's tokenizer. Returns the config.json written."""
    import torch
    import transformers

    ids = write_tokenizer(folder, toy, bpe)
    config = getattr(transformers, toy.config_class)(**copy.deepcopy({**toy.hf, **ids}))  # (it edits rope_scaling)
    generator = torch.Generator().manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=generator, dtype=torch.float32)
            p.copy_(u.mul_(0.2).add_(0.9) if name.endswith("norm.weight") else u.mul_(2 * scale).sub_(scale))
    model.save_pretrained(folder)
    return json.loads((Path(folder) / "config.json").read_text())


def make_tiny_llama(folder: Path, tokenizer_model: Path) -> Path:
    """A Llama folder as docs/CONVENTIONS.md describes one (config.json, model.safetensors, tokenizer.model): 2 layers
    of width 64 at transformers' own initialisation (seed 0), with Llama 2's SentencePiece tokenizer."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(tokenizer_model, Path(folder) / "tokenizer.model")
    return Path(folder)


# -- any folder of a family: sizes and fields no released model has ------------------------------------------------
# (the model is built from the folder's config.json, not from the config's builder: tests/recipes/test_any_folder.py,
# tests/finetune/model/test_model_from_folder.py)

# Per family, a config.json unlike the shipped config's model on every field the builder would otherwise fix: width 48
# with head_dim 16 (not 48 / 4) where the family has head_dim, 3 layers, RoPE bases and norm eps no release has, the
# Llama 3.1 scaling's every number changed, tying flipped against the config's model, (key, shipped 80 GB config).
_ODD = dict(
    hidden_size=48,
    head_dim=16,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
ANY_FOLDERS: Dict[str, tuple] = {
    "llama2": (
        Toy(
            "llama2_odd",
            "llama2",
            "LlamaConfig",
            dict(_ODD, vocab_size=32000, rms_norm_eps=3e-6, rope_theta=20000.0, tie_word_embeddings=False),
            "",
        ),
        "configs/llama2/7B_full_80gb.yaml",
    ),
    "llama3_1": (
        Toy(
            "llama3_1_odd",
            "llama3",
            "LlamaConfig",
            dict(
                _ODD,
                vocab_size=1024,
                rms_norm_eps=2e-5,
                rope_theta=250000.0,
                tie_word_embeddings=False,
                rope_scaling={
                    "rope_type": "llama3",
                    "factor": 16.0,
                    "low_freq_factor": 2.0,
                    "high_freq_factor": 8.0,
                    "original_max_position_embeddings": 1024,
                },
            ),
            "",
        ),
        "configs/llama3_1/8B_full_80gb.yaml",
    ),
    "llama3_2": (
        Toy(
            "llama3_2_odd",
            "llama3",
            "LlamaConfig",
            dict(
                _ODD,
                vocab_size=1024,
                rms_norm_eps=4e-6,
                rope_theta=300000.0,
                tie_word_embeddings=True,
                rope_scaling=dict(_LLAMA31_ROPE, factor=4.0, original_max_position_embeddings=2048),
            ),
            "",
        ),
        "configs/llama3_2/3B_full_80gb.yaml",
    ),
    # (Qwen2's config.json has no head_dim: the width's share. RoPE base 1e4 and eps 1e-6: what a 7B builder used to
    # replace silently.)
    "qwen2_5": (
        Toy(
            "qwen2_5_odd",
            "qwen2",
            "Qwen2Config",
            dict(
                {k: v for k, v in _ODD.items() if k != "head_dim"},
                hidden_size=64,
                vocab_size=1024,
                rms_norm_eps=1e-6,
                rope_theta=10000.0,
                tie_word_embeddings=True,
                use_sliding_window=False,
            ),
            "",
        ),
        "configs/qwen2_5/7B_full_80gb.yaml",
    ),
    "qwen3": (
        Toy(
            "qwen3_odd",
            "qwen3",
            "Qwen3Config",
            dict(_ODD, vocab_size=1024, rms_norm_eps=2e-6, rope_theta=50000.0, tie_word_embeddings=True),
            "",
        ),
        "configs/qwen3/8B_full_80gb.yaml",
    ),
    "mistral": (
        Toy(
            "mistral_odd",
            "mistral",
            "MistralConfig",
            dict(
                _ODD,
                vocab_size=1024,
                rms_norm_eps=2e-6,
                rope_theta=30000.0,
                sliding_window=None,
                tie_word_embeddings=False,
            ),
            "",
        ),
        "configs/mistral/7B_full_80gb.yaml",
    ),
}


def make_any_folder(folder: Path, key: str, bpe, llama2_tokenizer: Path, **fields: Any) -> Dict[str, Any]:
    """ANY_FOLDERS[key]'s folder as transformers saves one (``fields`` change its config.json): the model with
    make_checkpoint's random values and the family's tokenizer (Llama 2: its SentencePiece tokenizer.model; the
    others: the stand-in BPE). Returns the config.json written."""
    import dataclasses
    import shutil

    toy, _ = ANY_FOLDERS[key]
    toy = dataclasses.replace(toy, hf={**toy.hf, **fields})
    if toy.family != "llama2":
        return make_checkpoint(folder, toy, bpe)
    import torch
    import transformers

    config = transformers.LlamaConfig(**copy.deepcopy(toy.hf), bos_token_id=1, eos_token_id=2)
    generator = torch.Generator().manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=generator, dtype=torch.float32)
            p.copy_(u.mul_(0.2).add_(0.9) if name.endswith("norm.weight") else u.mul_(2 * TOY_SCALE).sub_(TOY_SCALE))
    model.save_pretrained(folder)
    shutil.copy(llama2_tokenizer, Path(folder) / "tokenizer.model")
    return json.loads((Path(folder) / "config.json").read_text())


# -- a batch of fine-tunes in one process -------------------------------------------------------------------------


def run_batch(path: str) -> None:
    """Run several fine-tunes one after another in this process: ``python tests/support.py RUNS.json``.

    RUNS.json is a list of argument lists, each what follows ``tune run recipes/full_finetune_single_device.py``
    (``--config FILE key=value ...``). Each run goes through the recipe's entry point as ``tune run`` calls it; the
    process pays for importing torch, torchtune and transformers once instead of once per run. Its exit status per
    run is printed last, as one JSON list. Tests start it with conftest's ``recipe_env()`` (the pinned vector code
    their recorded losses need)."""
    from recipes.full_finetune_single_device import RECIPE_PATH, recipe_main

    codes = []
    for args in json.loads(Path(path).read_text()):
        sys.argv = [RECIPE_PATH, *args]
        try:
            recipe_main()
            codes.append(0)
        except SystemExit as e:
            codes.append(0 if e.code is None else e.code if isinstance(e.code, int) else 1)  # (config.parse exits)
    print(json.dumps(codes))


# -- a folder in shards -----------------------------------------------------------------------------------------------


def make_sharded(source: Path, folder: Path, max_shard_size: str) -> List[str]:
    """HF folder ``source`` re-saved by transformers into ``folder`` in shards of at most ``max_shard_size``
    (model-00001-of-0000N.safetensors ... and model.safetensors.index.json), as large published models come; its
    tokenizer files copied beside them. Returns the shards' names."""
    import shutil

    import transformers

    transformers.AutoModelForCausalLM.from_pretrained(source).save_pretrained(folder, max_shard_size=max_shard_size)
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        if (Path(source) / name).is_file():
            shutil.copy(Path(source) / name, Path(folder) / name)
    return sorted(p.name for p in Path(folder).glob("model-*.safetensors"))


if __name__ == "__main__":
    run_batch(sys.argv[1])
