"""What tests build besides conftest's fixtures: toy Hugging Face folders of each model family (the library's builder,
finetune/toy_folder.py: a model made by transformers from the family's config.json at toy sizes, a stand-in
tokenizer saved by transformers), the tiny Llama folder the eval tests read, the batch runner of fine-tunes, and git
in a test's own repository.
(A run's offline wandb files are read back by the library's reader, finetune.reporting.wandb_run.read_runs.)

Import it from any test module (tests/ is on sys.path, as conftest's folder): ``import support``. It imports only
the standard library at the top (transformers, tokenizers and torch inside the functions), so that it stays cheap to
import and, run as a script (``python tests/support.py RUNS.json``, the batch of fine-tunes), changes nothing in the
recipe process it runs in.
"""

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

# -- a slow background checkpoint writer -------------------------------------------------------------------------------

# An optimizer component whose run's background checkpoint jobs first spend ``write_s`` seconds in torch's C++ code
# (matmuls, which let go of the GIL), as a 7B checkpoint's copies and serialization do: a recipe run (one process or
# torchrun's ranks) imports it as ``slow_writer.SlowWriteAdamW`` with ``slow_writer_path``'s folder on PYTHONPATH.
SLOW_WRITER = """
import time
import torch
from finetune.checkpoint import async_save


class SlowWriteAdamW(torch.optim.AdamW):
    def __init__(self, params, write_s=0.0, **kwargs):
        super().__init__(params, **kwargs)
        run = async_save.Job._run

        def slow(job, fn):
            a, end = torch.randn(600, 600), time.monotonic() + write_s
            while time.monotonic() < end:
                a @ a
            run(job, fn)

        async_save.Job._run = slow
"""


def slow_writer_path(folder: Path) -> str:
    """The folder to put on PYTHONPATH for ``optimizer._component_=slow_writer.SlowWriteAdamW``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slow_writer.py").write_text(SLOW_WRITER)
    return str(folder)


# -- toy models of the families ---------------------------------------------------------------------------------------

# The toys are written by the library's builder (finetune/toy_folder.py: the model at its fixed TINY_SIZES,
# transformers' save_pretrained, the stand-in tokenizers of finetune/model/toy_tokenizer.py), read through this module
# (``support.TOYS``, ``support.train_bpe``) but imported only when first asked for: finetune.model imports torchtune,
# which must not come before the recipe's own imports in ``run_batch``.
_FROM_TOY_TOKENIZER = ("LLAMA3_SPECIALS", "QWEN_SPECIALS", "MISTRAL_SPECIALS", "TEMPLATES", "alpaca_texts", "train_bpe")
_FROM_TOY_FOLDER = {"TOY_BPE_SIZE": "TINY_BPE_SIZE", "rope_theta": "rope_theta"}


def __getattr__(name: str):
    if name in _FROM_TOY_TOKENIZER:
        from finetune.model import toy_tokenizer

        return getattr(toy_tokenizer, name)
    if name in _FROM_TOY_FOLDER:
        from finetune import toy_folder

        return getattr(toy_folder, _FROM_TOY_FOLDER[name])
    if name == "TOYS":
        globals()["TOYS"] = _toys()
        return globals()["TOYS"]
    raise AttributeError(f"module 'support' has no attribute {name!r}")


@dataclass(frozen=True)
class Toy:
    """A toy model of one family's model: its config.json and how the recipe builds it."""

    key: str  # the model it is a toy of
    family: str  # finetune/checkpoint/hf_format.py FAMILIES key
    hf: Dict[str, Any]  # config.json's values, model_type among them
    sizes_builder: str  # the recipe's model._component_: a builder taking the sizes
    builder_extra: Dict[str, Any] = field(default_factory=dict)  # sizes_builder keywords beyond the sizes

    @property
    def stand_in(self):
        """The family's stand-in tokenizer (finetune/model/toy_tokenizer.py's STAND_INS; Llama 2 has none: its
        toys carry its SentencePiece tokenizer.model)."""
        from finetune.model.toy_tokenizer import STAND_INS

        return STAND_INS[self.family]


def _toys() -> Dict[str, Toy]:
    """``support.TOYS``: per model, the toy of the config.json finetune/toy_folder.py's MODELS hold for it, at
    the library's TINY_SIZES (Qwen2.5-3B: the 7B's, tied)."""
    from finetune.toy_folder import MODELS, tiny

    def hf(key: str, **fields: Any) -> Dict[str, Any]:
        return {
            "model_type": MODELS[key]["model_type"],
            **tiny({**MODELS[key]["hf"], **fields}, fields.get("head_dim")),
        }

    llama31, llama32 = {"scale_factor": 8}, {"scale_factor": 32, "tie_word_embeddings": True}
    return {
        t.key: t
        for t in [
            Toy("llama3_1_8b", "llama3", hf("llama3_1"), "torchtune.models.llama3_1.llama3_1", llama31),
            Toy("llama3_2_3b", "llama3", hf("llama3_2"), "torchtune.models.llama3_2.llama3_2", llama32),
            Toy("qwen2_5_7b", "qwen2", hf("qwen2_5"), "torchtune.models.qwen2.qwen2"),
            Toy("qwen2_5_3b", "qwen2", hf("qwen2_5", tie_word_embeddings=True), "torchtune.models.qwen2.qwen2",
                {"tie_word_embeddings": True}),
            # (Qwen3's head_dim: 2 x 64 / 4, not the width's share, as in the real 4B)
            Toy("qwen3_8b", "qwen3", hf("qwen3", head_dim=32), "finetune.model.builders.qwen3", {"head_dim": 32}),
            Toy("mistral_7b", "mistral", hf("mistral"), "torchtune.models.mistral.mistral"),
            # (Qwen3-30B-A3B at TINY_SIZES: 8 experts of 32, 2 per token, every layer sparse)
            Toy("qwen3_moe_30b", "qwen3_moe", hf("qwen3_moe", head_dim=32), "finetune.model.builders.qwen3_moe",
                {"head_dim": 32}),
        ]
    }  # fmt: skip


def tiny_decoder(device: str = "cpu", seed: int = 0, width: int = 128, layers: int = 2):
    """A torchtune Llama 2 decoder (2 layers, vocabulary 512) in fp32, for tests of what trains it, without a folder."""
    import torch
    from torchtune.models.llama2 import llama2

    torch.manual_seed(seed)
    with torch.device(device):
        return llama2(vocab_size=512, num_layers=layers, num_heads=4, num_kv_heads=2, embed_dim=width, max_seq_len=64)


def model_overrides(toy: Toy, hf: Dict[str, Any]) -> List[str]:
    """Recipe overrides that build the model of config.json ``hf`` with the toy's sizes builder."""
    from finetune.toy_folder import sizes_overrides

    return sizes_overrides(toy.sizes_builder, hf, **toy.builder_extra)


# -- the stand-in tokenizer -----------------------------------------------------------------------------------------


def write_tokenizer(folder: Path, toy: Toy, bpe) -> Dict[str, Optional[int]]:
    """The toy's tokenizer saved by transformers into ``folder``, as a user saves one: the BPE with the family's
    special tokens, its BOS, EOS, padding and chat template (tokenizer.json, tokenizer_config.json). The template
    inside tokenizer_config.json, where finetune.data.HFTokenizer reads it (transformers 5 writes it into a
    chat_template.jinja of its own by default). Returns the bos/eos ids for config.json."""
    from finetune.model import toy_tokenizer

    return toy_tokenizer.write_tokenizer(folder, bpe, toy.stand_in, template_file=False)


def tokenizer_folder(path: Path, bpe, jinja=None, config_template=None, split_regex=None) -> Path:
    """Qwen2.5's stand-in tokenizer files, for the tokenizer tests: ``jinja`` in chat_template.jinja, or
    ``config_template`` as tokenizer_config.json's chat_template, and optionally ``split_regex`` as tokenizer.json's
    pre-tokenizer (a template or regex under test)."""
    write_tokenizer(path, __getattr__("TOYS")["qwen2_5_7b"], bpe)  # (TOYS: made on first use, above)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    if config_template is not None:
        config["chat_template"] = config_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    if split_regex is not None:
        tok = json.loads((path / "tokenizer.json").read_text())
        tok["pre_tokenizer"] = {
            "type": "Split",
            "pattern": {"Regex": split_regex},
            "behavior": "Isolated",
            "invert": False,
        }
        (path / "tokenizer.json").write_text(json.dumps(tok))
    return path / "tokenizer.json"


# -- the toy checkpoint ---------------------------------------------------------------------------------------------


def make_checkpoint(folder: Path, toy: Toy, bpe, *, seed: int = 0, scale: Optional[float] = None) -> Dict[str, Any]:
    """An HF folder as transformers saves one: the family's model for the toy's config.json with the library's
    uniform random values (finetune/toy_folder.py's save_model: bit-identical on every CPU; +-``scale``, by
    default TINY_SCALE) in fp32, and the toy's tokenizer. Returns the config.json written."""
    from finetune import toy_folder

    scale = toy_folder.TINY_SCALE if scale is None else scale
    return toy_folder.save_toy(folder, toy.hf, bpe, toy.stand_in, template_file=False, seed=seed, scale=scale)


def make_tiny_llama(folder: Path, tokenizer_model: Path) -> Path:
    """A Llama folder as docs/CONVENTIONS.md describes one (config.json, model.safetensors, tokenizer.model): 2 layers
    of width 64 at transformers' own initialisation (seed 0), with Llama 2's SentencePiece tokenizer."""
    import shutil

    from finetune.toy_folder import save_model

    sizes = dict(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    save_model(folder, dict(sizes, model_type="llama", num_key_value_heads=4, max_position_embeddings=512), seed=0)
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
_LLAMA31_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)


def _odd(key: str, family: str, model_type: str, config: str, *, drop: tuple = (), **fields: Any) -> tuple:
    hf = {k: v for k, v in {"model_type": model_type, **_ODD, **fields}.items() if k not in drop}
    return Toy(f"{key}_odd", family, hf, ""), f"configs/{config}.yaml"


ANY_FOLDERS: Dict[str, tuple] = {
    "llama2": _odd("llama2", "llama2", "llama", "llama2/7B_full_80gb",
                   vocab_size=32000, rms_norm_eps=3e-6, rope_theta=20000.0, tie_word_embeddings=False),
    "llama3_1": _odd("llama3_1", "llama3", "llama", "llama3_1/8B_full_80gb",
                     vocab_size=1024, rms_norm_eps=2e-5, rope_theta=250000.0, tie_word_embeddings=False,
                     rope_scaling=dict(_LLAMA31_SCALING, factor=16.0, low_freq_factor=2.0, high_freq_factor=8.0,
                                       original_max_position_embeddings=1024)),
    "llama3_2": _odd("llama3_2", "llama3", "llama", "llama3_2/3B_full_80gb",
                     vocab_size=1024, rms_norm_eps=4e-6, rope_theta=300000.0, tie_word_embeddings=True,
                     rope_scaling=dict(_LLAMA31_SCALING, factor=4.0, original_max_position_embeddings=2048)),
    # (Qwen2's config.json has no head_dim: the width's share. RoPE base 1e4 and eps 1e-6: what a 7B builder used to
    # replace silently.)
    "qwen2_5": _odd("qwen2_5", "qwen2", "qwen2", "qwen2_5/7B_full_80gb",
                    drop=("head_dim",), hidden_size=64, vocab_size=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
                    tie_word_embeddings=True, use_sliding_window=False),
    "qwen3": _odd("qwen3", "qwen3", "qwen3", "qwen3/8B_full_80gb",
                  vocab_size=1024, rms_norm_eps=2e-6, rope_theta=50000.0, tie_word_embeddings=True),
    "mistral": _odd("mistral", "mistral", "mistral", "mistral/7B_full_80gb",
                    vocab_size=1024, rms_norm_eps=2e-6, rope_theta=30000.0, sliding_window=None,
                    tie_word_embeddings=False),
    # (6 experts of 24, 3 per token, not renormalised; layer 1 dense (mlp_only_layers): the released model has none of
    # these; tied, unlike it)
    "qwen3_moe": _odd("qwen3_moe", "qwen3_moe", "qwen3_moe", "qwen3_moe/30B_A3B_full_80gb",
                      vocab_size=1024, rms_norm_eps=2e-6, rope_theta=50000.0, tie_word_embeddings=True,
                      moe_intermediate_size=24, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False,
                      mlp_only_layers=[1], router_aux_loss_coef=0.01),
}  # fmt: skip


def make_any_folder(folder: Path, key: str, bpe, llama2_tokenizer: Path, **fields: Any) -> Dict[str, Any]:
    """ANY_FOLDERS[key]'s folder as transformers saves one (``fields`` change its config.json): the model with
    make_checkpoint's random values and the family's tokenizer (Llama 2: its SentencePiece tokenizer.model; the
    others: the stand-in BPE). Returns the config.json written."""
    import dataclasses
    import shutil

    from finetune import toy_folder

    toy, _ = ANY_FOLDERS[key]
    toy = dataclasses.replace(toy, hf={**toy.hf, **fields})
    if toy.family != "llama2":
        return make_checkpoint(folder, toy, bpe)
    written, _ = toy_folder.save_model(
        folder, {**toy.hf, "bos_token_id": 1, "eos_token_id": 2}, scale=toy_folder.TINY_SCALE
    )
    shutil.copy(llama2_tokenizer, Path(folder) / "tokenizer.model")
    return written


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


def dataset_settings(section: Dict[str, Any], packed: bool = False, key: str = "dataset"):
    """The data section a dataset is built from, ``section`` being the config's dataset keys (``key``: dataset, or
    dataset_val): one sample a batch, no pack cache (what the data tests that build a dataset directly need)."""
    from omegaconf import OmegaConf

    from finetune.sections import DataSettings

    return DataSettings(
        section=OmegaConf.create({**section, "packed": packed} if packed else section),
        key=key,
        packed=packed,
        files=(),
        batch_size=1,
        tokenizer_path=Path("t"),
        tokenizer_cfg={},
        pack_cache_dir=None,
        packed_attention="flex",
    )


def git(repo: Path, *args: str) -> str:
    """git in a test's own repository, with an author given (a machine without a git identity can commit); its
    output, stripped. A failing command raises."""
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=repo,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def command_lead(result: Dict[str, Any]) -> str:
    """What leads a benchmark result's recorded ``command`` before ``python``: the variables that steered its runs
    (``env``, e.g. TRITON_*), each quoted as a shell takes it (bench/_harness.py's provenance, shlex)."""
    return "".join(shlex.quote(f"{k}={v}") + " " for k, v in result.get("env", {}).items())
