"""The rows of bench/model_families.py: each model of a family (``SPECS``: its real config.json, our configs per
memory class, torchtune's stock config) and what each family x class row runs (``rows_of``: ours, the FP8 twins, the
stock recipe at its flags, the candidates and loss paths), apart from the script that measures them.

Their real config.json values are finetune/toy_folder.py's MODELS (the models the configs/ folders are for);
their stand-in tokenizers finetune/model/toy_tokenizer.py's STAND_INS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import _harness as harness
import _runner as runner
from finetune.model.toy_tokenizer import STAND_INS, StandIn
from finetune.toy_folder import MODELS

# -- the families ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """One model of a family: its real config.json, how our recipe and torchtune's stock recipe build it."""

    key: str
    family: str  # finetune/checkpoint/hf_format.py FAMILIES key
    model_type: str  # config.json's model_type (transformers' AutoConfig picks its config class by it)
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


def _configs(stem: str, *classes: str) -> Dict[str, str]:
    """Our configs of a model per memory class, in this order: configs/<stem>_full_<class>.yaml."""
    return {c: f"{stem}_full_{c}" for c in classes}


# The Qwen2.5-3B: the 7B's config.json at the 3B's sizes, tied.
_QWEN2_5_3B = dict(
    MODELS["qwen2_5"]["hf"], vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
    num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768, tie_word_embeddings=True,
    sliding_window=32768, max_window_layers=36,
)  # fmt: skip
# torchtune's Mistral configs are for v0.1 (32,000 tokens, RoPE base 10,000): the stock row builds v0.3's sizes.
_MISTRAL_V0_3 = [
    "model._component_=torchtune.models.mistral.mistral", "model.vocab_size=32768", "model.num_layers=32",
    "model.num_heads=32", "model.num_kv_heads=8", "model.embed_dim=4096", "model.intermediate_dim=14336",
    "model.max_seq_len=32768", "model.rope_base=1000000",
]  # fmt: skip
_TT = "torchtune.models."

# fmt: off
SPECS: Dict[str, Spec] = {s.key: s for s in [
    # (key, family, model_type, config.json, our configs' builder, the toys' sizes builder, our configs per class,
    # torchtune's stock config and its overrides, the sizes builder's keywords beyond the sizes)
    Spec("llama3_1_8b", "llama3", "llama", MODELS["llama3_1"]["hf"], _TT + "llama3_1.llama3_1_8b",
         _TT + "llama3_1.llama3_1", _configs("llama3_1/8B", "80gb", "32gb"), ("llama3_1/8B_full_single_device", []),
         {"scale_factor": 8}),
    Spec("llama3_2_3b", "llama3", "llama", MODELS["llama3_2"]["hf"], _TT + "llama3_2.llama3_2_3b",
         _TT + "llama3_2.llama3_2", _configs("llama3_2/3B", "80gb", "24gb", "12gb"),
         ("llama3_2/3B_full_single_device", []), {"scale_factor": 32, "tie_word_embeddings": True}),
    Spec("qwen2_5_7b", "qwen2", "qwen2", MODELS["qwen2_5"]["hf"], _TT + "qwen2_5.qwen2_5_7b_base", _TT + "qwen2.qwen2",
         _configs("qwen2_5/7B", "80gb", "32gb"),
         ("qwen2_5/7B_full_single_device", [f"model._component_={_TT}qwen2_5.qwen2_5_7b_base"])),
    Spec("qwen2_5_3b", "qwen2", "qwen2", _QWEN2_5_3B, _TT + "qwen2_5.qwen2_5_3b", _TT + "qwen2.qwen2",
         _configs("qwen2_5/3B", "80gb", "24gb", "12gb"), ("qwen2_5/3B_full_single_device", []),
         {"tie_word_embeddings": True}),
    # (no stock config for Qwen3; the toy's head_dim: 2 x 64 / 4, not the width's share, as in the real 4B)
    Spec("qwen3_8b", "qwen3", "qwen3", MODELS["qwen3"]["hf"], "finetune.model.qwen3_8b", "finetune.model.qwen3",
         _configs("qwen3/8B", "80gb", "32gb"), None, {"head_dim": 32}),
    Spec("mistral_7b", "mistral", "mistral", MODELS["mistral"]["hf"], "finetune.model.mistral_7b_v0_3",
         _TT + "mistral.mistral", _configs("mistral/7B", "80gb", "32gb"),
         ("mistral/7B_full_low_memory", _MISTRAL_V0_3)),
]}
# fmt: on


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
    *runner.STOCK_PACKED,
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
