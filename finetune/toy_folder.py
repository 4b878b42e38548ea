"""A toy Hugging Face folder of a model family, to try the family's config on a CPU in a minute.

    python -m finetune.toy_folder --family qwen3 --out /tmp/toy-qwen3
    python -m finetune.toy_folder --config /path/to/Qwen2.5-7B/config.json --out /tmp/toy-qwen2_5

The folder is what transformers saves (``AutoConfig``, ``AutoModelForCausalLM.from_config``, ``save_pretrained``):
the model's own config.json at toy sizes, with random values, and a tokenizer. The sizes shrink (2 layers, a width
of 64-128, heads of 16 keeping the model's ratio of query to key/value heads, the MLP keeping its ratio to the
width); every other architecture field stays the model's: ``rope_theta``, Llama 3.1's ``rope_scaling``, norm eps,
tied embeddings, Qwen's window fields, max positions. ``--set key=value`` changes any config.json field after that
(``--set rope_theta=20000 --set num_hidden_layers=3``).

``--family`` takes a folder name of ``configs/`` (the model its shipped configs are for: Llama 2 7B, Llama 3.1 8B,
Llama 3.2 3B, Qwen2.5 7B, Qwen3 8B, Qwen3-30B-A3B, Mistral 7B v0.3; a mixture of experts' toy has 8 experts, 2 per
token, their width keeping its ratio to the model's); ``--config`` a config.json of your own (or the folder that
holds it: a model's folder downloaded without its weights will do). The tokenizer:

- Llama 2: its SentencePiece ``tokenizer.model`` from ``--data-dir`` (``llama2_tokenizer/``), as configs/tiny.yaml;
- the others: a byte-level BPE of 1,024 tokens trained on Alpaca (``--data-dir``'s ``alpaca/``) with the family's
  special tokens, BOS/EOS and a short chat template in the family's format (``chat_template.jinja``), so both
  ``tokenizer.chat_template=False`` and ``True`` run;
- with ``--config``, the model's own tokenizer files when they sit beside its config.json (and its vocabulary size).

A model too large to build whole (Qwen3-30B-A3B: 61 GB in bf16, 122 GB as transformers builds it) is written tensor
by tensor instead, at its own sizes, on the GPU when there is one (``stream_model``; host memory holds a tensor, not
the model):

    python -m finetune.toy_folder --family qwen3_moe --sizes full --stream-shards --out /tmp/qwen3-30b-a3b
    python -m finetune.toy_folder --family qwen3_moe --sizes full --stream-shards --set num_hidden_layers=8 ...

It then prints the command that fine-tunes the folder with the family's shipped 80 GB config and ``CPU_OVERRIDES``
(docs/models.md, "Try a family on the CPU in a minute"). A config.json the family's recipe cannot honour (a sliding
window, another RoPE scaling) is refused here, with the recipe's own message.

Its ``save_model`` is the one writer of a random model folder: the toy folders, the tests' toys (tests/support.py, at
the fixed ``TINY_SIZES``) and the benchmarks' full-size checkpoints (bench/model_families.py) all go through it.
"""

import argparse
import copy
import json
import math
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from finetune.base import BadInput
from finetune.checkpoint import hf_format
from finetune.model import from_hf_config, toy_tokenizer
from finetune.model.toy_tokenizer import (
    CHATML,
    LLAMA3_CHAT_SPECIALS,
    QWEN_CHAT_SPECIALS,
    STAND_INS,
    TEMPLATES,
    StandIn,
)

RECIPE = "recipes/full_finetune_single_device.py"

# What a shipped 80 GB config needs on a CPU besides checkpoint_dir and output_dir (docs/models.md gives the same
# list; tests/recipes/test_any_folder.py runs every family's 80 GB config with it): its GPU settings off (bf16,
# compile, the 4-bit AdamW whose CPU path is slow, FlashAttention's varlen kernel of the Llama 2 config, wandb) and
# a short run that shows the loss falling: 20 steps of 2 packed rows of 128 tokens from the first 500 Alpaca
# records (not all 52K to tokenize), at a learning rate of 1e-3 without warmup. Nothing of the model: that is the
# folder's.
CPU_OVERRIDES = [
    "device=cpu",
    "dtype=fp32",
    "compile=False",
    "optimizer._component_=torch.optim.AdamW",
    "packed_attention=flex",
    "metric_logger=null",
    "dataset.split=train[:500]",
    "tokenizer.max_seq_len=128",
    "batch_size=2",
    "max_steps_per_epoch=20",
    "lr_scheduler.num_warmup_steps=0",
    "optimizer.lr=1e-3",
]

# Per configs/ folder: the config.json of the model its configs are for (the fields that matter; transformers fills
# in the rest, as it does for the released file) and the folder's shipped 80 GB config.
_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _model(model_type, config, vocab, width, mlp, layers, heads, kv, positions, eps, theta, **rest):
    return dict(
        model_type=model_type,
        config=config,
        hf=dict(
            zip(_SIZES, (vocab, width, mlp, layers, heads)),
            num_key_value_heads=kv,
            max_position_embeddings=positions,
            rms_norm_eps=eps,
            rope_theta=theta,
            **rest,
        ),
    )


# fmt: off
MODELS: Dict[str, Dict[str, Any]] = {
    # key: _model(model_type, its 80 GB config, vocab, width, MLP, layers, heads, kv heads, positions, eps, rope_theta)
    "llama2":   _model("llama", "llama2/7B_full_80gb",   32000,  4096, 11008, 32, 32, 32, 4096, 1e-5, 10000.0),
    "llama3_1": _model("llama", "llama3_1/8B_full_80gb", 128256, 4096, 14336, 32, 32, 8, 131072, 1e-5, 500000.0,
                       rope_scaling=_LLAMA31_ROPE, tie_word_embeddings=False),
    "llama3_2": _model("llama", "llama3_2/3B_full_80gb", 128256, 3072, 8192, 28, 24, 8, 131072, 1e-5, 500000.0,
                       head_dim=128, rope_scaling={**_LLAMA31_ROPE, "factor": 32.0}, tie_word_embeddings=True),
    "qwen2_5":  _model("qwen2", "qwen2_5/7B_full_80gb",  152064, 3584, 18944, 28, 28, 4, 131072, 1e-6, 1000000.0,
                       use_sliding_window=False, sliding_window=131072, max_window_layers=28,
                       tie_word_embeddings=False),
    "qwen3":    _model("qwen3", "qwen3/8B_full_80gb",    151936, 4096, 12288, 36, 32, 8, 40960, 1e-6, 1000000.0,
                       head_dim=128, tie_word_embeddings=False),
    "mistral":  _model("mistral", "mistral/7B_full_80gb", 32768, 4096, 14336, 32, 32, 8, 32768, 1e-5, 1000000.0,
                       sliding_window=None, tie_word_embeddings=False),
    "qwen3_moe": _model("qwen3_moe", "qwen3_moe/30B_A3B_full_80gb", 151936, 2048, 6144, 48, 32, 4, 40960, 1e-6,
                        1000000.0, head_dim=128, tie_word_embeddings=False, moe_intermediate_size=768,
                        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                        mlp_only_layers=[], router_aux_loss_coef=0.001),
}
# fmt: on

# A folder made from a config.json of your own trains with its family's config (any of a family's configs trains
# any folder of the family).
FAMILY_CONFIG = {
    "llama2": "llama2/7B_full_80gb",
    "llama3": "llama3_1/8B_full_80gb",
    "qwen2": "qwen2_5/7B_full_80gb",
    "qwen3": "qwen3/8B_full_80gb",
    "qwen3_moe": "qwen3_moe/30B_A3B_full_80gb",
    "mistral": "mistral/7B_full_80gb",
}

# The toy folders' stand-in tokenizers (finetune/model/toy_tokenizer.py): the family's special tokens of its chat
# format only (BOS, EOS, then the chat format's), EOS as padding, Qwen3's template without the think block. (The
# tests' and the benchmark's STAND_INS carry more; a toy folder's tokenizer stays as it was, so that its tokens, and
# the losses recorded from them, do not move.)
TOKENIZERS = {
    "llama3": StandIn(tuple(LLAMA3_CHAT_SPECIALS), "<|begin_of_text|>", "<|end_of_text|>", "<|end_of_text|>",
                      TEMPLATES["llama3"]),
    "qwen2": StandIn(tuple(QWEN_CHAT_SPECIALS), None, "<|endoftext|>", "<|endoftext|>", TEMPLATES["qwen2"]),
    "qwen3": StandIn(tuple(QWEN_CHAT_SPECIALS), None, "<|endoftext|>", "<|endoftext|>", CHATML),
    "qwen3_moe": StandIn(tuple(QWEN_CHAT_SPECIALS), None, "<|endoftext|>", "<|endoftext|>", CHATML),
    "mistral": STAND_INS["mistral"],
}  # fmt: skip
TOY_VOCAB = 1024
TOY_HEAD_DIM = 16
TOY_LAYERS = 2
# A mixture of experts' toy: 8 experts, 2 per token (Qwen3-30B-A3B: 128, 8): routing that a few steps move, at a cost
# a CPU run does not notice.
TOY_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2}
# config.json fields that describe a saved file, not the model (transformers writes them again)
_NOT_ARCHITECTURE = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "auto_map")


def shrink(source: Dict[str, Any]) -> Dict[str, Any]:
    """``source`` (config.json's fields) at toy sizes: 2 layers; key/value heads and query heads of 16 keeping the
    source's ratio (4 to 8 query heads); the width their product; the MLP's ratio to the width kept; a head_dim
    of its own where the source's differs from its width's share; every other field as it was."""
    # (a deep copy: transformers' config classes edit rope_scaling in place, and MODELS' dicts must stay as written)
    hf = copy.deepcopy({k: v for k, v in source.items() if k not in _NOT_ARCHITECTURE and k != "quantization_config"})
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    ratio = max(1, heads // kv)
    toy_kv = -(-4 // ratio) if ratio <= 8 else 1  # (at least 4 query heads)
    toy_heads = toy_kv * min(ratio, 8)
    width = toy_heads * TOY_HEAD_DIM
    own_head_dim = hf.get("head_dim") and hf["head_dim"] != hf["hidden_size"] // heads
    mlp = max(16, round(hf["intermediate_size"] / hf["hidden_size"] * width / 16) * 16)
    if "moe_intermediate_size" in hf:  # (a mixture of experts: the experts' width keeps its ratio too, 8 of them)
        moe = max(16, round(hf["moe_intermediate_size"] / hf["hidden_size"] * width / 16) * 16)
        hf.pop("num_local_experts", None)  # (transformers 5's name for num_experts)
        hf.update(TOY_EXPERTS, moe_intermediate_size=moe)
        hf["mlp_only_layers"] = [i for i in hf.get("mlp_only_layers") or [] if i < TOY_LAYERS]
    hf.update(
        hidden_size=width,
        intermediate_size=mlp,
        num_hidden_layers=TOY_LAYERS,
        num_attention_heads=toy_heads,
        num_key_value_heads=toy_kv,
    )
    if "head_dim" in hf:
        hf["head_dim"] = 2 * TOY_HEAD_DIM if own_head_dim else TOY_HEAD_DIM
    if "max_window_layers" in hf:
        hf["max_window_layers"] = min(int(hf["max_window_layers"]), TOY_LAYERS)
    if isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = hf["layer_types"][:TOY_LAYERS]
    return hf


def parse_sets(items: Sequence[str]) -> Dict[str, Any]:
    """``--set key=value`` pairs; a value is read as JSON (numbers, true/false/null, objects) or else kept as text."""
    fields = {}
    for item in items:
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise BadInput(f"--set {item!r} is not key=value; e.g. --set rope_theta=20000")
        try:
            fields[key] = json.loads(text)
        except ValueError:
            fields[key] = text
    return fields


def read_source(family: Optional[str], config: Optional[str]) -> tuple:
    """(config.json's fields, the folder holding them or None) for ``--family`` or ``--config``."""
    if family is not None:
        if family not in MODELS:
            raise BadInput(f"--family {family!r} is not a folder of configs/; use one of: {', '.join(MODELS)}")
        return {"model_type": MODELS[family]["model_type"], **MODELS[family]["hf"]}, None
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        source = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        text = " ".join(str(e).split())[:200]
        raise BadInput(f"--config {config}: cannot read a config.json there ({type(e).__name__}: {text})") from None
    if not isinstance(source, dict) or "model_type" not in source or "num_attention_heads" not in source:
        raise BadInput(f"--config {path} is not a model's config.json (no model_type or num_attention_heads)")
    return source, path.parent


def check_family(hf: Dict[str, Any]) -> hf_format.Family:
    """The family the recipe reads ``hf`` as, and the model it builds (a field it cannot honour: the recipe's
    BadInput, now rather than at training)."""
    family = hf_format.source_family(hf)
    family.from_config(from_hf_config.read_config(hf))
    return family


# -- the tokenizer ----------------------------------------------------------------------------------------------------


def write_bpe(out: Path, family: str, data_dir: Path) -> Dict[str, Optional[int]]:
    """A byte-level BPE of TOY_VOCAB tokens (trained on the first 2,000 Alpaca records with the ``tokenizers``
    library: deterministic) with the family's special tokens and chat template, saved by transformers
    (tokenizer.json, tokenizer_config.json, chat_template.jinja). Returns config.json's token ids."""
    stand_in = TOKENIZERS[family]
    texts = toy_tokenizer.alpaca_texts(data_dir, 2000, skip_empty=False)
    bpe = toy_tokenizer.train_bpe(texts, TOY_VOCAB - len(stand_in.specials))
    return toy_tokenizer.write_tokenizer(out, bpe, stand_in)


def write_tokenizer(out: Path, family: str, hf: Dict[str, Any], source_dir: Optional[Path], data_dir: Path) -> str:
    """The folder's tokenizer (see the module's docstring); updates ``hf``'s vocabulary and token ids. Returns what
    it wrote, in words."""
    own = [n for n in hf_format.TOKENIZER_FILES if source_dir is not None and (source_dir / n).is_file()]
    main = "tokenizer.model" if family == "llama2" else "tokenizer.json"
    if main in own:
        for name in own:
            shutil.copyfile(source_dir / name, out / name)
        return f"the model's own ({', '.join(own)}, from {source_dir})"
    if family == "llama2":
        sentencepiece = data_dir / "llama2_tokenizer" / "tokenizer.model"
        if not sentencepiece.is_file():
            raise BadInput(
                f"no Llama 2 tokenizer at {sentencepiece}; pass --data-dir, the folder holding "
                "llama2_tokenizer/tokenizer.model (the configs' data_dir)"
            )
        shutil.copyfile(sentencepiece, out / "tokenizer.model")
        hf.update(vocab_size=32000, bos_token_id=1, eos_token_id=2)
        return f"Llama 2's SentencePiece tokenizer.model (32,000 tokens, from {sentencepiece.parent})"
    hf.update(write_bpe(out, family, data_dir), vocab_size=TOY_VOCAB)
    return f"a byte-level BPE of {TOY_VOCAB:,} tokens trained on Alpaca, the family's special tokens and chat template"


# -- the model, as transformers saves it -----------------------------------------------------------------------------


def save_model(
    folder: Path,
    hf: Dict[str, Any],
    *,
    seed: int = 0,
    scale: Optional[float] = None,
    device: str = "cpu",
    dtype=None,
    max_shard_size: Optional[str] = None,
) -> Tuple[Dict[str, Any], int]:
    """transformers' model for the config.json fields ``hf`` (``model_type`` among them) saved into ``folder`` as a
    user saves one (``AutoConfig.for_model``, ``AutoModelForCausalLM.from_config``, ``save_pretrained``): every toy
    folder, the tests' and the benchmarks' random checkpoints. Returns (the config.json written, the parameters).

    The values: transformers' own initialisation, seeded (``scale`` None: a toy folder's), or uniform in +-``scale``
    with the norms' scales in 1 +- 0.1, drawn one tensor at a time from a seeded generator, so bit-identical on every
    CPU (the tests' recorded losses rest on them) and made on ``device`` (a 7-8B checkpoint on the GPU in seconds).
    fp32, or ``dtype`` (the uniform values are drawn in fp32 and rounded to it); in shards of ``max_shard_size``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = copy.deepcopy(hf)  # (transformers' config classes edit rope_scaling in place)
    try:
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as e:  # transformers' own validation of the fields
        text = " ".join(str(e).split())[:300]
        raise BadInput(f"transformers refuses this config.json ({type(e).__name__}: {text})") from None
    dtype = dtype or torch.float32
    if scale is None:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    else:
        generator = torch.Generator(device=device).manual_seed(seed)
        with torch.device(device):  # (built in fp32, then cast: from_config's dtype keyword differs across versions)
            model = AutoModelForCausalLM.from_config(config)
        model = model.to(dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                u = torch.rand(p.shape, generator=generator, device=device, dtype=torch.float32)
                p.copy_(u.mul_(0.2).add_(0.9) if name.endswith("norm.weight") else u.mul_(2 * scale).sub_(scale))
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    parameters = sum(p.numel() for p in model.parameters())
    del model  # (a 7-8B model on the GPU: freed before the caller's next one)
    return json.loads((Path(folder) / "config.json").read_text()), parameters


def save_toy(
    folder: Path, hf: Dict[str, Any], bpe, stand_in: StandIn, *, template_file=True, **model
) -> Dict[str, Any]:
    """A toy checkpoint: ``bpe`` saved as the family's stand-in tokenizer (toy_tokenizer.write_tokenizer; the chat
    template in a file of its own, or with ``template_file=False`` inside tokenizer_config.json) and save_model's
    model for ``hf`` with the tokenizer's BOS and EOS ids (``model``: save_model's keywords). Returns config.json."""
    ids = toy_tokenizer.write_tokenizer(folder, bpe, stand_in, template_file=template_file)
    return save_model(folder, {**hf, **ids}, **model)[0]


# -- a folder too large to build whole ------------------------------------------------------------------------------
# Qwen3-30B-A3B is 61 GB in bf16; transformers' from_config builds it in fp32 first (122 GB, more than the GPU
# machine's 125 GiB of host memory once anything else runs). So its random folder is written without a model: the
# names and shapes come from our family's model built on the meta device and converted by the checkpoint writer's
# own names (hf_format.to_hf: per-expert ``mlp.experts.{j}.gate_proj`` as transformers saves them), and the values
# are drawn one tensor at a time (on the GPU when there is one) straight into safetensors shards. Host memory holds
# the tensor being written and the one before it, never a shard.
SHARD_GB = 5.0  # transformers' default shard size: 13 shards for the 30B folder
STREAM_STD = 0.02  # normal(0, 0.02), transformers' initializer_range; norms are ones


def hf_layout(hf: Dict[str, Any]) -> Dict[str, Tuple[int, ...]]:
    """The tensors of the HF folder for config.json ``hf``, name -> shape, in the order a folder holds them
    (embeddings, layer by layer, the final norm and the output layer)."""
    import torch

    from finetune.model.from_hf_config import decoder

    family, section = hf_format.resolve_model(hf, None)
    section.pop("_component_")
    with torch.device("meta"):  # (no memory: 30.5B parameters are only shapes here)
        state = decoder(**section).state_dict()
    shapes = {name: tuple(t.shape) for name, t in hf_format.to_hf(state, hf, family).items()}

    def position(name):
        layer = re.match(r"model\.layers\.(\d+)\.", name)
        if layer:
            return (int(layer.group(1)), name)
        return (-1 if "embed_tokens" in name else (1 << 31) if name.startswith("lm_head") else 1 << 30, name)

    return dict(sorted(shapes.items(), key=lambda kv: position(kv[0])))


def shard_plan(shapes: Dict[str, Tuple[int, ...]], shard_bytes: int, element_size: int = 2) -> List[List[str]]:
    """``shapes``' names cut in order into shards of at most ``shard_bytes`` (a larger tensor has a shard alone)."""
    shards: List[List[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * element_size
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def draw(name: str, shape: Tuple[int, ...], index: int, seed: int, device: str):
    """One tensor's random values in bf16: ones for a norm's scale, else normal * STREAM_STD from a generator seeded
    by (``seed``, ``index``), so a tensor's values do not depend on the shard it lands in."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16, device=device)
    generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
    values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    return values.mul_(STREAM_STD).to(torch.bfloat16)


def stream_model(
    folder: Path, hf: Dict[str, Any], *, seed: int = 0, device: str = "cpu", shard_gb: float = SHARD_GB
) -> Tuple[Dict[str, Any], int]:
    """A random bf16 model for config.json's fields ``hf`` written into ``folder`` tensor by tensor (see above):
    ``model-0000i-of-0000n.safetensors`` shards of at most ``shard_gb`` GB and their index (one shard: a lone
    model.safetensors, as transformers writes it), and config.json by transformers' config class. Returns (the
    config.json written, the parameters)."""
    import torch
    from transformers import AutoConfig

    from finetune.checkpoint.async_save import write_safetensors

    fields = copy.deepcopy(hf)
    try:
        config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    except Exception as e:  # transformers' own validation of the fields, as save_model reports it
        text = " ".join(str(e).split())[:300]
        raise BadInput(f"transformers refuses this config.json ({type(e).__name__}: {text}); fix --set") from None
    shapes = hf_layout({"model_type": config.model_type, **hf})
    index = {name: i for i, name in enumerate(shapes)}
    total = sum(math.prod(s) * 2 for s in shapes.values())
    free = shutil.disk_usage(folder).free
    if free < total:  # (refused before the first byte: a disk filled at shard 12 of 13 costs minutes and the disk)
        raise BadInput(
            f"the folder needs {total / 1e9:.1f} GB and {folder} has {free / 1e9:.1f} GB free; free some, or name "
            "--out on a larger disk (or fewer layers: --set num_hidden_layers=N)"
        )
    shards = shard_plan(shapes, int(shard_gb * 1e9))
    files = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]  # fmt: skip

    def convert(part):
        # write_safetensors plans the file from meta tensors, then asks for each tensor's bytes with the placeholder
        # it was given: only then are values drawn.
        return {n: v if v.is_meta else draw(n, v.shape, index[n], seed, device) for n, v in part.items()}

    placeholder = torch.zeros((), dtype=torch.bfloat16)
    for names, file in zip(shards, files):
        tensors = {n: placeholder.expand(shapes[n]) for n in names}  # (shapes only: no memory)
        write_safetensors(Path(folder) / file, tensors, convert, hf_format.WEIGHTS_METADATA)
    if len(files) > 1:
        weight_map = {n: f for names, f in zip(shards, files) for n in names}
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (Path(folder) / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    config.architectures = [hf_format.source_family(hf).architecture]
    config.dtype = torch.bfloat16
    config.save_pretrained(folder)
    return json.loads((Path(folder) / "config.json").read_text()), sum(math.prod(s) for s in shapes.values())


# -- the tests' and the benchmark's tiny models -----------------------------------------------------------------------
# tests/support.py's toys and bench/model_families.py --toy: every family at the same sizes (2 layers of width 64, 4
# query heads of 16 in 2 key/value groups, a 1,024-token vocabulary, positions up to 16,384), the rest of the model's
# config.json kept (RoPE and its scaling, tying, norms, windows), uniform values of +-0.1 (real models: +-0.02, so
# that a toy's attention is not uniform). Unlike shrink()'s, these sizes do not follow the model's ratios: the tests'
# recorded losses were measured on them.
TINY_SIZES = dict(zip(_SIZES, (1024, 64, 128, 2, 4)), num_key_value_heads=2)
TINY_POSITIONS = 16384
TINY_SCALE = 0.1
TINY_BPE_SIZE = 1008  # the stand-in BPE's tokens: with a family's special tokens (at most 10) within the 1,024
TINY_MOE = dict(TOY_EXPERTS, moe_intermediate_size=32)  # a mixture of experts': 8 experts of 32, 2 per token


def tiny(hf: Dict[str, Any], head_dim: Optional[int] = None) -> Dict[str, Any]:
    """config.json's fields ``hf`` at TINY_SIZES: positions up to TINY_POSITIONS, a head_dim only where ``head_dim``
    is given (none: the width's share), a Qwen2 sliding window over every position and layer."""
    tiny_hf = {**hf, **TINY_SIZES, "max_position_embeddings": min(hf["max_position_embeddings"], TINY_POSITIONS)}
    if "moe_intermediate_size" in hf:
        tiny_hf.update(TINY_MOE)
    tiny_hf.pop("head_dim", None)
    if head_dim is not None:
        tiny_hf["head_dim"] = head_dim
    if "max_window_layers" in tiny_hf:
        tiny_hf["max_window_layers"], tiny_hf["sliding_window"] = 2, tiny_hf["max_position_embeddings"]
    return tiny_hf


def rope_theta(hf: Dict[str, Any]) -> float:
    """RoPE's base from config.json as transformers 4 (rope_theta) or 5 (rope_parameters) writes it."""
    return float(hf["rope_theta"] if "rope_theta" in hf else hf["rope_parameters"]["rope_theta"])


# A sizes builder's keywords (torchtune's llama3_1, qwen2, mistral; finetune.model.qwen3), by config.json's field.
_BUILDER_KEYWORDS = {
    "vocab_size": "vocab_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "hidden_size": "embed_dim",
    "intermediate_size": "intermediate_dim",
    "max_position_embeddings": "max_seq_len",
    "rms_norm_eps": "norm_eps",
}


# ... and a mixture of experts' (finetune.model.qwen3_moe), where config.json has them.
_MOE_KEYWORDS = {
    "moe_intermediate_size": "moe_intermediate_dim",
    "num_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_tok",
    "norm_topk_prob": "norm_topk_prob",
    "decoder_sparse_step": "decoder_sparse_step",
    "router_aux_loss_coef": "router_aux_loss_coef",
}


def sizes_overrides(builder: str, hf: Dict[str, Any], **extra: Any) -> List[str]:
    """Recipe overrides that build the model of config.json ``hf`` with ``builder``, a model builder taking the
    sizes (``torchtune.models.llama3_1.llama3_1``), and its keywords beyond them (``extra``: ``scale_factor=8``)."""
    if "num_local_experts" in hf:  # (transformers 5 writes num_experts under this name)
        hf = {"num_experts": hf["num_local_experts"], **hf}
    args = {
        **{keyword: hf[field] for field, keyword in _BUILDER_KEYWORDS.items()},
        **{keyword: hf[field] for field, keyword in _MOE_KEYWORDS.items() if field in hf},
        "rope_base": rope_theta(hf),
        **extra,
    }
    return [f"model._component_={builder}"] + [f"model.{k}={v}" for k, v in args.items()]


# -- the folder -------------------------------------------------------------------------------------------------------


def make_toy_folder(
    out: Path,
    *,
    family: Optional[str] = None,
    config: Optional[str] = None,
    fields: Optional[Dict[str, Any]] = None,
    data_dir: Path = Path("../shared/data"),
    seed: int = 0,
    sizes: str = "toy",
    stream: bool = False,
    device: str = "cpu",
    shard_gb: float = SHARD_GB,
) -> Dict[str, Any]:
    """Write the toy folder of ``family`` (a configs/ folder name) or of ``config`` (a config.json or its folder)
    into ``out``, with ``fields`` changed in its config.json; transformers' initialisation, seeded. Returns a summary
    (``config_json``: what was written, ``family``, ``config``: the shipped config that trains it, ``tokenizer``).

    ``sizes="full"`` keeps the model's own sizes (the stand-in tokenizer's tokens are the vocabulary's first ids);
    ``stream``: bf16 values written tensor by tensor by stream_model (on ``device``, in shards of ``shard_gb`` GB),
    which a full-size model needs: transformers' model of it would be built whole, in fp32."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # (save_pretrained's bar, for one small file)
    if (family is None) == (config is None):
        raise BadInput("give one of --family NAME or --config PATH (a config.json)")
    if sizes not in ("toy", "full"):
        raise BadInput(f"--sizes {sizes!r} is not toy or full; use --sizes toy (2 layers) or full (the model's own)")
    if sizes == "full" and not stream:
        raise BadInput(
            "--sizes full builds transformers' model whole in fp32 (Qwen3-30B-A3B: 122 GB); add --stream-shards, "
            "which writes it tensor by tensor in bf16"
        )
    source, source_dir = read_source(family, config)
    hf = shrink(source) if sizes == "toy" else {k: v for k, v in source.items() if k not in _NOT_ARCHITECTURE}
    vocab = hf["vocab_size"]
    hf_family = check_family({**hf, **(fields or {})}).name  # (before any file is written)
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise BadInput(f"--out {out} is not empty; name a new folder (a toy folder is written whole)")
    out.mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = write_tokenizer(out, hf_family, hf, source_dir, Path(data_dir))
        if sizes == "full":
            hf["vocab_size"] = vocab  # (the model's embedding size; the stand-in's ids are its first)
        hf.update(fields or {})
        if stream:  # (its refusals name their own fix: the fields, or the disk)
            written, parameters = stream_model(out, hf, seed=seed, device=device, shard_gb=shard_gb)
        else:
            try:
                written, parameters = save_model(out, hf, seed=seed)
            except BadInput as e:
                raise BadInput(f"{e}; fix --set") from None
        check_family(written)
    except BaseException:
        shutil.rmtree(out)  # (no half-written folder: the next try starts clean)
        raise
    return dict(
        config_json=written,
        family=hf_family,
        config=f"configs/{MODELS[family]['config'] if family else FAMILY_CONFIG[hf_family]}.yaml",
        tokenizer=tokenizer,
        parameters=parameters,
    )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def train_command(config: str, folder: Path, data_dir: Optional[Path] = None) -> List[str]:
    """The command that fine-tunes a toy folder on the CPU: the shipped config, checkpoint_dir, CPU_OVERRIDES."""
    extra = [f"data_dir={data_dir}"] if data_dir is not None else []
    return [
        "tune", "run", RECIPE, "--config", config,
        f"checkpoint_dir={folder}", f"output_dir={folder}-run", *extra, *CPU_OVERRIDES,
    ]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m finetune.toy_folder",
        description="Write a toy Hugging Face folder of a model family (its config.json at toy sizes, random "
        "values, a tokenizer) and print the command that fine-tunes it on the CPU with the family's config.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--family", choices=list(MODELS), help="the model of a configs/ folder")
    source.add_argument("--config", help="a model's config.json (or its folder) to shrink")
    parser.add_argument("--out", required=True, help="the folder to write (new or empty)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="change a config.json field")
    parser.add_argument(
        "--data-dir", default=None, help="holds alpaca/ and llama2_tokenizer/ (default: ../shared/data, the configs')"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sizes", default="toy", help="toy (2 layers, a small width) or full (the model's own; needs --stream-shards)"
    )
    parser.add_argument(
        "--stream-shards",
        action="store_true",
        help="bf16 normal(0, 0.02) values written tensor by tensor into safetensors shards, never the whole model in "
        "memory (a 30B folder: 61 GB)",
    )
    parser.add_argument("--device", default=None, help="where the values are drawn (default: cuda if there is one)")
    parser.add_argument("--shard-gb", type=float, default=SHARD_GB, help="the largest shard, GB (--stream-shards)")
    args = parser.parse_args(argv)
    data_dir = Path(args.data_dir) if args.data_dir else Path("../shared/data")
    try:
        made = make_toy_folder(
            Path(args.out),
            family=args.family,
            config=args.config,
            fields=parse_sets(args.set),
            data_dir=data_dir,
            seed=args.seed,
            sizes=args.sizes,
            stream=args.stream_shards,
            device=args.device or _default_device(),
            shard_gb=args.shard_gb,
        )
    except BadInput as e:
        sys.stderr.write(f"error: {e}\n")
        sys.exit(2)
    hf = made["config_json"]
    rope = from_hf_config.rope_of(from_hf_config.read_config(hf))
    scaling = f" ({rope['rope_type']} scaling, factor {rope['factor']:g})" if rope["rope_type"] != "default" else ""
    print(
        f"wrote {args.out}: {hf['architectures'][0]} ({made['family']}), {hf['num_hidden_layers']} layers of width "
        f"{hf['hidden_size']}, {hf['num_attention_heads']} heads ({hf['num_key_value_heads']} key/value) of "
        f"{hf.get('head_dim') or hf['hidden_size'] // hf['num_attention_heads']}, vocabulary {hf['vocab_size']:,}, "
        f"rope_theta {rope['rope_theta']:g}{scaling}, rms_norm_eps {hf['rms_norm_eps']:g}, tied embeddings "
        f"{hf.get('tie_word_embeddings', False)}; {made['parameters'] / 1e6:.2f}M random parameters"
    )
    print(f"tokenizer: {made['tokenizer']}")
    command = train_command(made["config"], Path(args.out), Path(args.data_dir) if args.data_dir else None)
    print("fine-tune it on the CPU with the family's 80 GB config (docs/models.md):\n  " + shlex.join(command))


if __name__ == "__main__":
    main()
