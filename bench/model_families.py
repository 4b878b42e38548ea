"""Fine-tune speed and memory of every model family's configs, each against torchtune's stock recipe, one GPU a family.

    python bench/model_families.py --data-dir /tmp/data --stock-dir .devsite/site/recipes \\
        --out bench/results/model_families_e2e_h200.json            # every family, over every visible GPU
    python bench/model_families.py --families qwen3_8b,mistral_7b --only ours_80gb,stock ...   # a subset
    python bench/model_families.py --families llama3_1_8b --classes 80gb ...   # one class: its bf16, FP8, stock rows
    python bench/model_families.py ... --loss-rows --candidates   # also the loss paths, the configs' alternatives
    python bench/model_families.py --toy --stock-dir <torchtune's recipes folder>           # CPU: tiny models, seconds

Per family (``SPECS``), in its own worker on its own GPU (families are dealt round-robin to the visible GPUs, so
six families on an 8-GPU host run side by side; on one GPU they run one after another):

1. a Hugging Face checkpoint with random values, made by transformers from the family's real config.json (its
   ``SPECS`` entry: sizes, RoPE, tying, token ids) on the GPU, in 5 GB shards, with a stand-in tokenizer: a byte-level
   BPE trained on the Alpaca file (no model hub here), written as the family's tokenizer.json + tokenizer_config.json
   for our recipe and in the format torchtune's stock tokenizer for the family reads (Llama 3's tiktoken file,
   Qwen's vocab.json + merges.txt; Mistral's stock tokenizer reads Llama 2's SentencePiece file). The same BPE in
   every format, so both recipes train on the same tokens;
2. the rows, each one fresh process for ``--steps`` optimizer steps, stopped once its last step is logged (as
   bench/e2e.py does): ours, ``configs/<family>/<size>_full_<class>.yaml`` capped at its class
   (``device_memory_limit_gib``), and its FP8 twin ``<size>_full_<class>_fp8.yaml`` (FP8 matmuls and varlen
   attention; row ``ours_<class>_fp8``) at the same cap; the stock row, torchtune 0.6.1's own single-device recipe and
   config for the family at the flags that fit 80 GB (``STOCK_ROWS``); and with ``--loss-rows``, the smaller-class
   config with each loss (``finetune.model.LinearCrossEntropyLoss`` impl cce / liger / torch, and torchtune's
   ``CEWithChunkedOutputLoss``), uncapped, on a GPU of their own;
3. the checkpoint is deleted before the worker's next family (a 7-8B one is 15-16 GB; the device disk is 64 GB).

The JSON (``--out``; rewritten after every row) opens with the command, hardware, versions, date and commit
(bench/_harness.py); per row: ``family``, ``config``, ``memory_class``, ``device_memory_limit_gib``, ``kind`` (ours /
stock / loss), ``variant`` (the AdamW and the loss), ``tok_s`` (median trained tokens/s of the steps after
``--skip-steps``), ``peak_gib`` / ``peak_reserved_gib``, ``mfu`` (6 x parameters x tok_s / 989 TFLOP/s),
``vs_stock`` (over the family's stock row of the same invocation), ``vs_bf16`` (an FP8 row: over the bf16 row of its
class in the same invocation), ``first_step_s``, ``losses``, ``tok_s_per_step`` (every step, the skipped ones too:
a row whose median moves between runs shows here whether a few steps or all of them were slow), ``command``; with
``--profile``, our rows' ``profile`` (finetune/reporting/profiler.py's summary of the last two steps: milliseconds
per step by category, idle being the GPU's gaps between kernels, a step bound by the CPU that launches it shows
there) and ``profiled_steps`` (the last three, left out of ``tok_s``).

``--toy`` is the same pipeline on the CPU with 2-layer width-64 models and 3 steps (tests/bench/test_model_families.py
runs it): a check of the machinery, not a measurement (flex attention, since varlen is CUDA's; the FP8 rows' matmuls
emulated, and at width 64 no layer is large enough to convert).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import _harness as harness
from finetune.reporting import console

console.quiet_known_noise()  # (before finetune.model imports torchtune, and torchtune torchao, with its noise: console.KNOWN_NOISE)
from finetune.model.toy_folder import MODELS  # noqa: E402
from finetune.model.toy_tokenizer import (  # noqa: E402
    STAND_INS,
    StandIn,
    alpaca_texts,
    token_ids,
    train_bpe,
    with_specials,
)

REPO_ROOT = harness.REPO_ROOT
PEAK_FLOPS = 989e12  # dense bf16, H100/H200 SXM
ALPACA = Path("alpaca") / "alpaca_data.json"  # inside --data-dir
LLAMA2_TOKENIZER = Path("llama2_tokenizer") / "tokenizer.model"

# -- the families ---------------------------------------------------------------------------------------------------
# Their real config.json values are finetune/model/toy_folder.py's MODELS (the models the configs/ folders are for);
# their stand-in tokenizers finetune/model/toy_tokenizer.py's STAND_INS.


@dataclass(frozen=True)
class Spec:
    """One model of a family: its real config.json, how our recipe and torchtune's stock recipe build it."""

    key: str
    family: str  # finetune/checkpoint/hf_format.py FAMILIES key
    config_class: str  # transformers' config class
    hf: Dict  # the model's config.json values (sizes, RoPE, tying, token ids)
    builder: str  # our configs' model._component_ (a sized builder)
    sizes_builder: str  # a builder taking the sizes (the toy models)
    configs: Dict[str, str]  # memory class -> our config under configs/
    stock: Optional[tuple] = None  # (torchtune config under recipes/configs, overrides) or None: no stock config
    builder_extra: Dict = field(default_factory=dict)  # sizes_builder keywords beyond the sizes

    @property
    def stand_in(self) -> StandIn:
        """The family's stand-in tokenizer: its special tokens, BOS, EOS, padding, chat template."""
        return STAND_INS[self.family]


SPECS: Dict[str, Spec] = {
    s.key: s
    for s in [
        Spec(
            "llama3_1_8b",
            "llama3",
            "LlamaConfig",
            MODELS["llama3_1"]["hf"],
            "torchtune.models.llama3_1.llama3_1_8b",
            "torchtune.models.llama3_1.llama3_1",
            {"80gb": "llama3_1/8B_full_80gb", "32gb": "llama3_1/8B_full_32gb"},
            ("llama3_1/8B_full_single_device", []),
            {"scale_factor": 8},
        ),
        Spec(
            "llama3_2_3b",
            "llama3",
            "LlamaConfig",
            MODELS["llama3_2"]["hf"],
            "torchtune.models.llama3_2.llama3_2_3b",
            "torchtune.models.llama3_2.llama3_2",
            {"80gb": "llama3_2/3B_full_80gb", "24gb": "llama3_2/3B_full_24gb", "12gb": "llama3_2/3B_full_12gb"},
            ("llama3_2/3B_full_single_device", []),
            {"scale_factor": 32, "tie_word_embeddings": True},
        ),
        Spec(
            "qwen2_5_7b",
            "qwen2",
            "Qwen2Config",
            MODELS["qwen2_5"]["hf"],
            "torchtune.models.qwen2_5.qwen2_5_7b_base",
            "torchtune.models.qwen2.qwen2",
            {"80gb": "qwen2_5/7B_full_80gb", "32gb": "qwen2_5/7B_full_32gb"},
            ("qwen2_5/7B_full_single_device", ["model._component_=torchtune.models.qwen2_5.qwen2_5_7b_base"]),
        ),
        Spec(
            "qwen2_5_3b",
            "qwen2",
            "Qwen2Config",
            dict(  # (the 7B's, at the 3B's sizes and tied)
                MODELS["qwen2_5"]["hf"],
                vocab_size=151936,
                hidden_size=2048,
                intermediate_size=11008,
                num_hidden_layers=36,
                num_attention_heads=16,
                num_key_value_heads=2,
                max_position_embeddings=32768,
                tie_word_embeddings=True,
                sliding_window=32768,
                max_window_layers=36,
            ),
            "torchtune.models.qwen2_5.qwen2_5_3b",
            "torchtune.models.qwen2.qwen2",
            {"80gb": "qwen2_5/3B_full_80gb", "24gb": "qwen2_5/3B_full_24gb", "12gb": "qwen2_5/3B_full_12gb"},
            ("qwen2_5/3B_full_single_device", []),
            {"tie_word_embeddings": True},
        ),
        Spec(
            "qwen3_8b",
            "qwen3",
            "Qwen3Config",
            MODELS["qwen3"]["hf"],
            "finetune.model.qwen3_8b",
            "finetune.model.qwen3",
            {"80gb": "qwen3/8B_full_80gb", "32gb": "qwen3/8B_full_32gb"},
            None,
            {"head_dim": 32},
        ),  # (the toy's head_dim: 2 x 64 / 4, not the width's share, as in the real 4B)
        Spec(
            "mistral_7b",
            "mistral",
            "MistralConfig",
            MODELS["mistral"]["hf"],
            "finetune.model.mistral_7b_v0_3",
            "torchtune.models.mistral.mistral",
            {"80gb": "mistral/7B_full_80gb", "32gb": "mistral/7B_full_32gb"},
            (
                "mistral/7B_full_low_memory",
                [
                    "model._component_=torchtune.models.mistral.mistral",
                    "model.vocab_size=32768",
                    "model.num_layers=32",
                    "model.num_heads=32",
                    "model.num_kv_heads=8",
                    "model.embed_dim=4096",
                    "model.intermediate_dim=14336",
                    "model.max_seq_len=32768",
                    "model.rope_base=1000000",
                ],
            ),
        ),
    ]
}

# The toy models (--toy): 2 layers of width 64, 4 heads of 16 in 2 key/value groups, a 1,024-token BPE.
TOY_SCALE = 0.1  # their random values: +-0.1 (the real sizes: +-0.02), so that a toy's attention is not uniform
TOY_BPE_SIZE = 1008  # the toy BPE's tokens; with a family's special tokens (at most 10) within the 1,024
TOY_SIZES = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def toy_hf(spec: Spec) -> Dict:
    """The spec's config.json with the toy's sizes (RoPE, tying and norms kept)."""
    hf = {**spec.hf, **TOY_SIZES, "max_position_embeddings": min(spec.hf["max_position_embeddings"], 16384)}
    hf.pop("head_dim", None)
    if "head_dim" in spec.builder_extra:
        hf["head_dim"] = spec.builder_extra["head_dim"]
    if "max_window_layers" in hf:
        hf["max_window_layers"], hf["sliding_window"] = 2, hf["max_position_embeddings"]
    return hf


def model_overrides(spec: Spec, hf: Dict) -> List[str]:
    """Recipe overrides that build the model of config.json ``hf`` with the spec's sizes builder (the toys)."""
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
        **spec.builder_extra,
    )
    return [f"model._component_={spec.sizes_builder}"] + [f"model.{k}={v}" for k, v in args.items()]


def rope_theta(hf: Dict) -> float:
    """RoPE's base from config.json as transformers 4 (rope_theta) or 5 (rope_parameters) writes it."""
    return float(hf["rope_theta"] if "rope_theta" in hf else hf["rope_parameters"]["rope_theta"])


def n_params(spec: Spec) -> int:
    """Parameters of the spec's model (embedding and output layer included; Qwen2's q/k/v biases, Qwen3's q/k norms)."""
    hf = spec.hf
    d, layers, vocab = hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]
    heads, kv = hf["num_attention_heads"], hf["num_key_value_heads"]
    hd = hf.get("head_dim") or d // heads
    attn = d * heads * hd * 2 + d * kv * hd * 2
    attn += {"qwen2": heads * hd + 2 * kv * hd, "qwen3": 2 * hd}.get(spec.family, 0)
    per_layer = attn + 3 * d * hf["intermediate_size"] + 2 * d
    return vocab * d * (1 if hf.get("tie_word_embeddings") else 2) + layers * per_layer + d


# -- the stand-in tokenizer -------------------------------------------------------------------------------------------


def write_tokenizer(folder: Path, spec: Spec, bpe) -> Dict[str, Optional[int]]:
    """The family's tokenizer.json (the BPE plus its special tokens, appended) and tokenizer_config.json (BOS, EOS,
    padding, chat template) into ``folder``, written as plain files; returns the bos/eos ids."""
    stand_in = spec.stand_in
    tok = with_specials(bpe, stand_in)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": stand_in.bos,
        "eos_token": stand_in.eos,
        "pad_token": stand_in.pad,
        "model_max_length": 131072,
        "chat_template": stand_in.template,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return token_ids(tok, stand_in)


def write_stock_tokenizer(folder: Path, spec: Spec, bpe, data_dir) -> List[str]:
    """The same BPE in the format torchtune's own tokenizer for the family reads; returns the stock recipe's
    tokenizer overrides."""
    if spec.family == "llama3":  # tiktoken: base64 of each token's bytes, and its rank (= its BPE id)
        import base64

        byte_of = _gpt2_unicode_to_byte()
        lines = [
            f"{base64.b64encode(bytes(byte_of[c] for c in token)).decode()} {i}"
            for token, i in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])
        ]
        (folder / "tiktoken.model").write_text("\n".join(lines) + "\n")
        return [f"tokenizer.path={folder / 'tiktoken.model'}"]
    if spec.family in ("qwen2", "qwen3"):
        bpe.model.save(str(folder))  # vocab.json, merges.txt
        return [f"tokenizer.path={folder / 'vocab.json'}", f"tokenizer.merges_file={folder / 'merges.txt'}"]
    return [f"tokenizer.path={Path(data_dir) / LLAMA2_TOKENIZER}", "tokenizer.prompt_template=null"]


def _gpt2_unicode_to_byte() -> Dict[str, int]:
    """The byte-level BPE's printable character for each byte (GPT-2's table), inverted."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# -- the checkpoint ---------------------------------------------------------------------------------------------------


def make_checkpoint(
    folder: Path,
    spec: Spec,
    hf: Dict,
    bpe,
    *,
    device: str = "cpu",
    seed: int = 0,
    shard: str = "5GB",
    scale: float = 0.02,
) -> Dict:
    """An HF folder: transformers' model for config.json ``hf`` with uniform random values (bit-identical on every
    CPU: no vectorised normal sampling; +-``scale``, norm scales 1 +- 0.1), bf16 on a GPU, fp32 on the CPU, and the
    family's tokenizer files. Returns the config.json written."""
    import torch
    import transformers

    ids = write_tokenizer(folder, spec, bpe)
    config = getattr(transformers, spec.config_class)(**copy.deepcopy({**hf, **ids}))  # (it edits rope_scaling)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.device(device):  # (built in fp32, then cast: from_config's dtype keyword differs across versions)
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32 if device == "cpu" else torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            u = torch.rand(p.shape, generator=generator, device=device, dtype=torch.float32)
            p.copy_(u.mul_(0.2).add_(0.9) if name.endswith("norm.weight") else u.mul_(2 * scale).sub_(scale))
    model.save_pretrained(folder, max_shard_size=shard)
    del model
    return json.loads((folder / "config.json").read_text())


# -- the rows ---------------------------------------------------------------------------------------------------------

CLASS_GIB = harness.CLASS_GIB  # each memory class's cap (bench/_harness.py)
# The 16 GB class exists as an FP8 config only, for the 7-8B models whose weights stream (stream_layers). Its stock row
# is torchtune's low-memory setting (in backward, checkpointing, activation offloading, paged 8-bit AdamW), uncapped:
# its peak says whether stock fits the class at all. The candidate streams fewer layers (faster, if it fits).
STREAMED_16GB = {
    "llama3_1_8b": ("llama3_1/8B_full_16gb_fp8", ["stream_layers=12"]),
    "qwen2_5_7b": ("qwen2_5/7B_full_16gb_fp8", ["stream_layers=8"]),
    "qwen3_8b": ("qwen3/8B_full_16gb_fp8", ["stream_layers=14"]),
    "mistral_7b": ("mistral/7B_full_16gb_fp8", ["stream_layers=8"]),
}
# The 12 GB class is the 3B models' (their weights stay resident; the states stream), bf16 and FP8, with the same
# stock row as the 16 GB class.
STOCK_LOW_MEMORY = [
    "optimizer=bitsandbytes.optim.PagedAdamW8bit",
    "enable_activation_checkpointing=True",
    "enable_activation_offloading=True",
]
# torchtune's stock recipe at the flags that fit 80 GB for every family here (its configs' defaults otherwise): the
# packed, compiled setting that measured fastest for Llama2-7B (bench/e2e.py), with the gradients applied in backward
# (7-8B x (2 bytes of weights + 4 of bf16 AdamW states) is 45-49 GiB; with their gradients too, no room is left for
# the activations). Two choices per model: torch's fused AdamW with activation checkpointing, and bitsandbytes'
# 8-bit AdamW without (half the states' memory pays for the activations). The faster of those that finish is the
# family's anchor. (Peak memory is logged on every row: torchtune's Qwen2.5 configs turn it off.)
STOCK_COMMON = [
    "dataset.packed=True",
    "compile=True",
    "batch_size=16",
    "seed=42",
    "clip_grad_norm=null",
    "optimizer.lr=2e-5",
    "optimizer_in_bwd=True",
    "enable_activation_offloading=False",
    "tokenizer.max_seq_len=512",
    "log_peak_memory_stats=True",
]
STOCK_ROWS = {
    "stock": ["optimizer=torch.optim.AdamW", "optimizer.fused=True", "enable_activation_checkpointing=True"],
    "stock_8bit": ["optimizer=bitsandbytes.optim.AdamW8bit", "enable_activation_checkpointing=False"],
}
# --loss-rows: the family's smaller-class config (activation checkpointing, the fused loss) with each loss path of
# finetune/model/loss.py and with torchtune's chunked loss, uncapped: the rows' peak memory says which fit the class, their
# tokens/s which is fastest (each record's ``variant`` names the loss it ran).
LOSSES = {
    "chunked": ["loss._component_=torchtune.modules.loss.CEWithChunkedOutputLoss", "~loss.impl"],
    "cce": ["loss.impl=cce"],
    "liger": ["loss.impl=liger"],
    "torch": ["loss.impl=torch"],
}


# --candidates: alternatives a class's config was chosen against, where one might be faster and still fit (the 3B
# models at 24 GiB: half the batch with every activation kept, against the whole batch recomputed; every other layer
# recomputed, which their FP8 twins measured faster and an RTX 3090, without FP8, would run in bf16).
# At 12 GB (the 3B models, states in host memory): the activations kept on the GPU instead of offloaded.
CANDIDATES = {
    "24gb": {
        "bs8_no_ac": ["batch_size=8", "enable_activation_checkpointing=False"],
        "ac2": ["ac_mode=selective", "ac_option=2"],
    },
    "12gb": {"no_offload": ["enable_activation_offloading=False"]},
}
# ... and of the FP8 twins (rows ours_<class>_fp8_<name>), each for the classes named (None: every class): flex
# attention, the share of varlen in the FP8 row's gain; at 80 GB, the output layer's loss fused (the 3B twins keep
# the chunked loss there, whose logits cost more of a short FP8 step); at 24 GiB, every other layer recomputed (ac2:
# the 3B twins' setting since it measured faster, kept so the recorded commands run) against every layer (what the
# twins were chosen against).
FP8_CANDIDATES = {
    "flex": (["packed_attention=flex"], None),
    "fused_loss": (["loss._component_=finetune.model.LinearCrossEntropyLoss"], {"80gb"}),
    # twice the batch: half the launches per token, for a step the host CPU holds back (the 3B models at 80 GB use
    # 31-34 of their 78 GiB; the 7-8B ones would not fit)
    "bs32": (["batch_size=32"], {"80gb"}),
    "ac2": (["ac_mode=selective", "ac_option=2"], {"24gb"}),
    "every_layer": (["ac_mode=full"], {"24gb"}),
    "no_offload": (["enable_activation_offloading=False"], {"12gb"}),
}
PROFILED = 3  # --profile: the last steps of our rows, one warming the profiler up and two recorded
FP8 = "_fp8"  # an FP8 twin: configs/<family>/<size>_full_<class>_fp8.yaml, row ours_<class>_fp8


@dataclass
class Row:
    name: str
    kind: str  # ours, stock, loss
    config: str  # ours: under configs/ (no .yaml); stock: under torchtune's recipes/configs
    memory_class: str
    overrides: List[str]
    cap: Optional[int] = None  # device_memory_limit_gib (ours: the class's); None: uncapped


def rows_of(spec: Spec, kinds: List[str], loss_rows: bool, candidates: bool = False) -> List[Row]:
    """The rows of ``kinds`` (ours: the bf16 configs; fp8: their FP8 twins; stock), class by class."""
    rows = []
    for c, cfg in spec.configs.items():
        if "ours" in kinds:
            rows.append(Row(f"ours_{c}", "ours", cfg, c, [], CLASS_GIB[c]))
        if "fp8" in kinds:
            rows.append(Row(f"ours_{c}{FP8}", "ours", cfg + FP8, c, [], CLASS_GIB[c]))
    if "ours" in kinds and candidates:
        rows += [
            Row(f"ours_{c}_{name}", "ours", cfg, c, flags, CLASS_GIB[c])
            for c, cfg in spec.configs.items()
            for name, flags in CANDIDATES.get(c, {}).items()
        ]
    if "fp8" in kinds and candidates:
        rows += [
            Row(f"ours_{c}{FP8}_{name}", "ours", cfg + FP8, c, flags, CLASS_GIB[c])
            for c, cfg in spec.configs.items()
            for name, (flags, classes) in FP8_CANDIDATES.items()
            if classes is None or c in classes
        ]
    if "stock" in kinds and spec.stock is not None:
        rows += [Row(name, "stock", spec.stock[0], "80gb", flags) for name, flags in STOCK_ROWS.items()]
    if spec.key in STREAMED_16GB:
        cfg, fewer = STREAMED_16GB[spec.key]
        if "fp8" in kinds:
            rows.append(Row(f"ours_16gb{FP8}", "ours", cfg, "16gb", [], CLASS_GIB["16gb"]))
        if "fp8" in kinds and candidates:
            rows.append(Row(f"ours_16gb{FP8}_fewer_streamed", "ours", cfg, "16gb", fewer, CLASS_GIB["16gb"]))
    # torchtune's low-memory row beside the family's smallest class: 16 GB for the 7-8B models, 12 GB for the 3B ones
    smallest = "16gb" if spec.key in STREAMED_16GB else "12gb" if "12gb" in spec.configs else None
    if smallest and "stock" in kinds and spec.stock is not None:
        rows.append(Row("stock_low_memory", "stock", spec.stock[0], smallest, STOCK_LOW_MEMORY))
    if loss_rows:
        small = [c for c in spec.configs if c != "80gb"][0]
        rows += [Row(f"loss_{name}", "loss", spec.configs[small], small, flags) for name, flags in LOSSES.items()]
    return rows


def command(row: Row, spec: Spec, ck: Path, out: Path, args) -> List[str]:
    data, steps, split = Path(args.data_dir), f"max_steps_per_epoch={args.steps}", f"dataset.split={args.split}"
    if row.kind == "stock":
        stock = Path(args.stock_dir)
        shards = sorted(p.name for p in ck.glob("*.safetensors"))
        extra = (
            []
            if not args.toy
            else [
                "device=cpu",
                "dtype=fp32",
                "compile=False",
                "batch_size=2",
                "tokenizer.max_seq_len=128",
                "log_peak_memory_stats=False",
                *model_overrides(spec, json.loads((ck / "config.json").read_text())),
            ]
        )
        return harness.recipe_command(
            stock / "full_finetune_single_device.py",
            "--config",
            str(stock / "configs" / f"{row.config}.yaml"),
            f"output_dir={out}",
            f"checkpointer.checkpoint_dir={ck}",
            f"checkpointer.checkpoint_files=[{','.join(shards)}]",
            "dataset._component_=torchtune.datasets.alpaca_dataset",
            "dataset.source=json",
            split,
            f"dataset.data_files={data / ALPACA}",
            "log_every_n_steps=1",
            f"metric_logger.log_dir={out / 'logs'}",
            "metric_logger._component_=torchtune.training.metric_logging.DiskLogger",
            steps,
            *spec.stock[1],
            *STOCK_COMMON,
            *row.overrides,
            *(ck / "stock_tokenizer.args").read_text().split("\n"),
            *extra,
        )
    cap = [] if args.toy or row.cap is None else [f"device_memory_limit_gib={row.cap}"]
    profile = (
        []
        if not args.profile
        else [  # the last 3 steps: one to warm the profiler up, two recorded (profiled_steps)
            "profiler.enabled=True",
            f"profiler.wait_steps={args.steps - PROFILED}",
            "profiler.warmup_steps=1",
            f"profiler.active_steps={PROFILED - 1}",
            "profiler.num_cycles=1",
            f"profiler.output_dir={out / 'profiler'}",
        ]
    )
    extra = (
        []
        if not args.toy
        else [
            "device=cpu",
            "dtype=fp32",
            "compile=False",
            "batch_size=2",
            "tokenizer.max_seq_len=128",
            "packed_attention=flex",  # (varlen is CUDA's)
            "enable_activation_offloading=False",  # (the 12 GB configs': it needs a GPU)
            *model_overrides(spec, json.loads((ck / "config.json").read_text())),
        ]
    )
    return harness.recipe_command(
        "full_finetune_single_device",
        "--config",
        f"configs/{row.config}.yaml",
        f"checkpoint_dir={ck}",
        f"data_dir={data}",
        f"output_dir={out}",
        "metric_logger=null",
        f"pack_cache_dir={args.work_dir}/pack_cache",
        "log_every_n_steps=1",
        steps,
        split,
        *cap,
        *row.overrides,
        *profile,
        *extra,
    )


def variant(row: Row, cmd: List[str]) -> str:
    """The AdamW and the loss the row ran (its config's, or the overrides'), and its FP8 recipe and attention where
    they are not bf16 matmuls and flex attention."""
    from omegaconf import OmegaConf

    if row.kind == "stock":
        opt = next(o.split("=", 1)[1] for o in row.overrides if o.startswith("optimizer="))
        return f"{opt} + CEWithChunkedOutputLoss"
    cfg = OmegaConf.load(REPO_ROOT / "configs" / f"{row.config}.yaml")
    cfg = OmegaConf.merge(
        cfg,
        OmegaConf.from_dotlist(
            [
                o
                for o in cmd
                if "=" in o
                and not o.startswith("~")
                and o.split("=")[0].startswith(("optimizer", "loss", "fp8", "packed_attention"))
            ]
        ),
    )
    for deleted in [o[1:] for o in cmd if o.startswith("~loss.")]:
        cfg.loss.pop(deleted.split(".", 1)[1], None)
    loss = cfg.loss._component_.rsplit(".", 1)[1] + (f"({cfg.loss.impl})" if cfg.loss.get("impl") else "")
    extras = [f"fp8={cfg.fp8}"] if cfg.get("fp8") else []
    extras += [f"packed_attention={cfg.packed_attention}"] if cfg.get("packed_attention", "flex") != "flex" else []
    return f"{cfg.optimizer._component_} + {loss}" + "".join(f" + {e}" for e in extras)


def read_records(kind: str, out: Path) -> List[dict]:
    """The steps a row logged: ours from metrics.jsonl, the stock recipe's from its DiskLogger file (a figure it did
    not log, such as GPU memory on the CPU, is None)."""
    return harness.read_stock_log(out) if kind == "stock" else harness.read_metrics(out)


def run_row(row: Row, spec: Spec, ck: Path, gpu: Optional[int], args) -> dict:
    out = Path(args.work_dir) / "runs" / spec.key / row.name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = command(row, spec, ck, out, args)
    kind = "stock" if row.kind == "stock" else "ours"
    record = {
        "family": spec.key,
        "name": row.name,
        "kind": row.kind,
        "config": row.config,
        "memory_class": row.memory_class,
        "device_memory_limit_gib": row.cap,
        "overrides": row.overrides,
    }
    env = {"WANDB_MODE": "disabled"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        record["gpu"] = gpu
    summary = out / "profiler" / "rank0_summary.json"  # (our rows with --profile: written once the trace is)
    profiled = args.profile and kind == "ours"

    def done() -> bool:
        return len(read_records(kind, out)) >= args.steps and (not profiled or summary.is_file())

    run = harness.run(cmd, out / "log.txt", timeout=args.timeout, env=env, until=done)
    records = read_records(kind, out)
    record.update(command=run.command, wall_s=run.wall_s)
    if len(records) < args.steps:
        why = run.error() or " / ".join(list(run.tail)[-3:])
        record["error"] = f"{len(records)} of {args.steps} steps logged in {run.wall_s} s: " + why[-600:]
        return record
    if profiled and not summary.is_file():
        record["error"] = f"--profile: no {summary} after {run.wall_s} s: " + " / ".join(list(run.tail)[-3:])[-600:]
        return record
    # The median leaves the profiled steps out: recording slows them.
    steady = records[args.skip_steps : args.steps - (PROFILED if profiled else 0)]
    tok_s = statistics.median(r["tokens_per_second"] for r in steady)
    if profiled:
        record.update(
            profile=json.loads(summary.read_text()),
            profiled_steps=list(range(args.steps - PROFILED + 1, args.steps + 1)),
        )
    record.update(
        variant=variant(row, cmd),
        tok_s=round(tok_s, 1),
        peak_gib=harness.peak(records, "peak_memory_alloc_gib"),
        peak_reserved_gib=harness.peak(records, "peak_memory_reserved_gib"),
        mfu=round(6 * n_params(spec) * tok_s / PEAK_FLOPS, 3),
        first_step_s=round(records[0]["first_step_s"], 1) if "first_step_s" in records[0] else None,
        losses=[round(r["loss"], 5) for r in records],
        tok_s_per_step=[round(r["tokens_per_second"], 1) for r in records],
    )
    return record


# -- one worker per GPU ---------------------------------------------------------------------------------------------


@dataclass
class Job:
    """Rows of one family that run one after another on one GPU, on a checkpoint of their own."""

    name: str
    spec: Spec
    rows: List[Row]

    @property
    def cost(self) -> int:
        return n_params(self.spec) * (len(self.rows) + 1)


def jobs_of(args) -> List[Job]:
    """One job per family (its ours, FP8 and stock rows); --loss-rows add one per loss family, on a GPU of its own."""
    jobs = []
    for key in args.names:
        spec = SPECS[key]
        rows = [
            r
            for r in rows_of(spec, args.kinds, False, args.candidates)
            if (not args.only or r.name in args.only)
            and (not args.classes or r.kind != "ours" or r.memory_class in args.classes)
        ]
        if rows:
            jobs.append(Job(key, spec, rows))
        if args.loss_rows and key in args.loss_families:
            jobs.append(Job(f"{key}_losses", spec, rows_of(spec, [], True)))
    return sorted(jobs, key=lambda j: -j.cost)


def make_family_checkpoint(spec: Spec, folder: Path, bpe, args) -> None:
    """The family's checkpoint and the stock recipe's tokenizer files for it (``--make-checkpoint`` runs it in a
    process of its own, so the GPU memory it took is freed after)."""
    hf = toy_hf(spec) if args.toy else spec.hf
    make_checkpoint(folder, spec, hf, bpe, device="cpu" if args.toy else "cuda", scale=TOY_SCALE if args.toy else 0.02)
    stock = write_stock_tokenizer(folder, spec, bpe, args.data_dir) if spec.stock else []
    if spec.stock and spec.family != "mistral":
        stock.append(f"tokenizer.special_tokens_path={folder / 'tokenizer.json'}")
    (folder / "stock_tokenizer.args").write_text("\n".join(stock))


def worker(gpu: Optional[int], jobs: List[Job], bpe_file: Path, args, done: List[dict], lock, flush) -> None:
    for job in jobs:
        ck = Path(args.work_dir) / "checkpoints" / job.name
        shutil.rmtree(ck, ignore_errors=True)
        if args.toy:  # (the CPU: no GPU memory to free, so no process of its own)
            from tokenizers import Tokenizer

            t = time.monotonic()
            make_family_checkpoint(job.spec, ck, Tokenizer.from_file(str(bpe_file)), args)
            error, wall = None, round(time.monotonic() - t, 1)
        else:
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--make-checkpoint",
                str(ck),
                "--families",
                job.spec.key,
                "--bpe",
                str(bpe_file),
                "--data-dir",
                args.data_dir,
                "--rows",
                "ours",
            ]
            made = harness.run(
                cmd,
                Path(args.work_dir) / f"make_{job.name}.log",
                timeout=args.timeout,
                env={"CUDA_VISIBLE_DEVICES": str(gpu)} if gpu is not None else {},
            )
            error, wall = made.error(), made.wall_s
        if error:
            with lock:
                done.append({"family": job.spec.key, "name": "checkpoint", "kind": "setup", "error": error})
            continue
        print(f"{job.name}: checkpoint made in {wall} s (gpu {gpu})", flush=True)
        for row in job.rows:
            try:
                record = run_row(row, job.spec, ck, gpu, args)
            except Exception as e:  # (one row's surprise must not cost the others)
                record = {"family": job.spec.key, "name": row.name, "kind": row.kind, "error": repr(e)[:500]}
            print(
                f"{job.spec.key} {row.name}: "
                + (
                    f"error {record['error']}"
                    if record.get("error")
                    else f"{record['tok_s']:,.0f} tok/s, {record['peak_reserved_gib']} GiB reserved"
                ),
                flush=True,
            )
            with lock:
                done.append(record)
                flush()
        shutil.rmtree(ck, ignore_errors=True)  # (the device disk holds about four 7-8B checkpoints)


def finish(records: List[dict]) -> None:
    """vs_stock: over the stock row of the row's own class where the run has one (torchtune's low-memory row beside
    the 16 GB and 12 GB configs), else over the fastest stock row of the family that finished within the 80 GB
    class's cap; vs_bf16 (an FP8 row): over the bf16 row of its class (ours_<class>_fp8[_<candidate>] over
    ours_<class>)."""
    for r in records:
        if FP8 in r.get("name", "") and not r.get("error"):
            bf16 = f"ours_{r['memory_class']}"
            base = [s for s in records if s["family"] == r["family"] and s.get("name") == bf16 and not s.get("error")]
            if base:
                r["vs_bf16"] = round(r["tok_s"] / base[0]["tok_s"], 3)
    for r in records:
        stock = [
            s
            for s in records
            if s["family"] == r["family"]
            and s["kind"] == "stock"
            and not s.get("error")
            and (s.get("peak_reserved_gib") or 0) <= CLASS_GIB["80gb"]
        ]
        if stock and not r.get("error"):
            own_class = [s for s in stock if s["memory_class"] == r["memory_class"]]
            anchor = max(own_class or stock, key=lambda s: s["tok_s"])
            r["vs_stock"], r["anchor"] = round(r["tok_s"] / anchor["tok_s"], 3), anchor["name"]


def table(records: List[dict]) -> str:
    rows = []
    for r in records:
        if r.get("error"):
            rows.append([r["family"], r.get("name", ""), "", f"error: {r['error'][:100]}", "", "", "", ""])
            continue
        rows.append(
            [
                r["family"],
                r["name"],
                r["variant"],
                f"{r['tok_s']:,.0f}",
                f"{r['vs_stock']:.2f}x" if r.get("vs_stock") else "-",
                f"{r['vs_bf16']:.2f}x" if r.get("vs_bf16") else "-",
                f"{r['mfu']:.2f}",
                f"{r['peak_gib']} / {r['peak_reserved_gib']} (cap {r['device_memory_limit_gib']})",
            ]
        )
    return harness.table(
        ["family", "row", "AdamW + loss", "tokens/s", "vs stock", "vs bf16", "MFU", "peak alloc / reserved GiB"], rows
    )


def gpus(toy: bool) -> List[Optional[int]]:
    """The GPUs to deal the jobs to: CUDA_VISIBLE_DEVICES, else every GPU nvidia-smi lists (no CUDA context here)."""
    if toy:
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [int(g) for g in visible.split(",") if g.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
        return list(range(len([ln for ln in listed.splitlines() if ln.startswith("GPU ")]))) or [None]
    except (OSError, subprocess.SubprocessError):
        return [None]


def parse_args(argv: Optional[List[str]] = None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(SPECS), help=f"comma-separated, of: {', '.join(SPECS)}")
    ap.add_argument(
        "--rows",
        default="ours,fp8,stock",
        help="ours (the bf16 configs), fp8 (their _fp8 twins), stock; comma-separated",
    )
    ap.add_argument(
        "--classes",
        default="",
        help="only our rows of these memory classes (e.g. 80gb or 32gb,24gb); default all. Stock rows are not filtered",
    )
    ap.add_argument(
        "--loss-rows",
        action="store_true",
        help="also the smaller-class config with each loss (LOSSES), on a GPU of their own",
    )
    ap.add_argument("--loss-families", default="llama3_1_8b", help="the families that get --loss-rows")
    ap.add_argument("--only", default="", help="only these row names (e.g. ours_80gb,stock); default all")
    ap.add_argument("--candidates", action="store_true", help="also the alternatives in CANDIDATES")
    ap.add_argument("--data-dir", default=harness.DATA_DIR, help="holds alpaca/alpaca_data.json and llama2_tokenizer/")
    ap.add_argument("--stock-dir", help="torchtune's recipes folder (its full_finetune_single_device.py, configs/)")
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per row")
    ap.add_argument(
        "--split",
        default="train[:4000]",
        help="the Alpaca records every row reads (tokenized and packed before its first step: the first "
        "4,000, about 1,100 rows of 512 tokens, hold the steps; the whole file costs each row a "
        "minute)",
    )
    ap.add_argument("--skip-steps", type=int, default=4, help="steps left out of the median (compile, warm-up)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per row before it is stopped as an error")
    ap.add_argument("--bpe-size", type=int, default=32000, help="tokens of the stand-in BPE")
    ap.add_argument("--work-dir", default="/tmp/model_families", help="checkpoints, runs, pack cache")
    ap.add_argument("--out", default=harness.scratch("model_families_e2e.json"), help="the JSON written")
    ap.add_argument("--merge", action="store_true", help="keep --out's rows that this run does not re-measure")
    ap.add_argument(
        "--profile",
        action="store_true",
        help=f"our rows record their last {PROFILED} steps with torch.profiler (left out of the median): each gets "
        "profile, milliseconds per step by category (idle: the GPU's gaps between kernels)",
    )
    ap.add_argument("--toy", action="store_true", help="tiny models on the CPU, 3 steps: the machinery, no figures")
    ap.add_argument("--make-checkpoint", metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--bpe", help=argparse.SUPPRESS)
    harness.add_arguments(ap)
    args = ap.parse_args(argv)
    args.names = harness.pick(ap, args.families, SPECS, "families")
    args.kinds = [k for k in args.rows.split(",") if k]
    args.loss_families = args.loss_families.split(",")
    args.only = [r for r in args.only.split(",") if r]
    args.classes = [c for c in args.classes.split(",") if c]
    unknown = sorted(set(args.classes) - set(CLASS_GIB)) + sorted(set(args.kinds) - {"ours", "fp8", "stock"})
    if unknown:
        ap.error(
            f"unknown --classes / --rows value(s) {', '.join(unknown)}: "
            f"classes {', '.join(CLASS_GIB)}; rows ours, fp8, stock"
        )
    if args.toy:
        toy_steps = 3 + (PROFILED if args.profile else 0)
        args.steps, args.skip_steps, args.bpe_size, args.split = (
            min(args.steps, toy_steps),
            1,
            TOY_BPE_SIZE,
            "train[:200]",
        )
    if args.profile and args.steps - PROFILED <= args.skip_steps:
        ap.error(
            f"--profile records the last {PROFILED} steps and leaves them out of the median: --steps {args.steps} "
            f"leaves none after --skip-steps {args.skip_steps}; use --steps {args.skip_steps + PROFILED + 4} or more"
        )
    if "stock" in args.kinds and not args.stock_dir and not args.make_checkpoint:
        ap.error("stock rows need --stock-dir (torchtune's recipes folder), or --rows ours")
    return args


def main(argv: Optional[List[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.make_checkpoint:
        from tokenizers import Tokenizer

        make_family_checkpoint(SPECS[args.names[0]], Path(args.make_checkpoint), Tokenizer.from_file(args.bpe), args)
        return
    prov = harness.provenance(__file__, argv, args.allow_dirty)
    jobs = jobs_of(args)
    old = harness.earlier(args.out, args.merge)
    measured = {(j.spec.key, r.name) for j in jobs for r in j.rows}
    kept = [r for r in old.get("records", []) if (r["family"], r.get("name")) not in measured]
    doc = {
        **prov,
        "commands": harness.commands(old, prov["command"]),
        "steps": args.steps,
        "skip_steps": args.skip_steps,
        "weights": "random values: HF checkpoints made by transformers from each family's real config.json; "
        f"a {args.bpe_size}-token byte-level BPE trained on Alpaca stands in for its tokenizer",
        "records": kept,
    }
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    bpe_file = work / f"bpe_{args.bpe_size}.json"
    if not bpe_file.is_file():
        t = time.monotonic()
        train_bpe(alpaca_texts(args.data_dir), args.bpe_size).save(str(bpe_file))
        print(f"stand-in BPE of {args.bpe_size} tokens trained in {time.monotonic() - t:.0f} s", flush=True)
    records: List[dict] = []
    lock = threading.Lock()

    def flush() -> None:  # after every row: a stopped run keeps what it measured
        finish(records)
        doc["records"] = kept + records
        harness.write_json(args.out, doc)

    devices = gpus(args.toy)
    # The costliest job first, each to the GPU with the least work so far: on 8 GPUs every job has its own.
    plan: Dict[Optional[int], List[Job]] = {g: [] for g in devices}
    for job in jobs:
        plan[min(devices, key=lambda g: sum(j.cost for j in plan[g]))].append(job)
    threads = [
        threading.Thread(target=worker, args=(g, js, bpe_file, args, records, lock, flush))
        for g, js in plan.items()
        if js
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flush()
    print(table(doc["records"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
