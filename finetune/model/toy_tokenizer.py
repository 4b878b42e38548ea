"""Stand-in tokenizers of the model families: a byte-level BPE trained here on Alpaca, with a family's special tokens
and a short chat template of the family's shape, saved as transformers saves a tokenizer.

No model hub is reachable where the toys are made (the CPU tests, the device benchmarks), so the families' real
tokenizers are out of reach; a stand-in has what the recipes look at: the family's BOS/EOS and chat tokens, a chat
template in the family's format, a vocabulary trained the same way every time. ``finetune.toy_folder`` writes
one into each toy folder; tests/support.py and bench/model_families.py write the fuller ones of ``STAND_INS``.
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from finetune.base import BadInput

# Qwen's pre-tokenizer (Llama 3's differs only in taking digits three at a time): words, single digits, punctuation
# runs, newlines and spaces, split before the byte-level BPE.
PRETOKENIZE = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The special tokens: BOS and EOS, those the family's chat format uses, then those torchtune's own tokenizer for the
# family looks up (the benchmark's stock rows read them from our tokenizer.json: special_tokens_path). A toy folder
# carries only the first, the chat format's (``*_CHAT_SPECIALS``).
LLAMA3_CHAT_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
]
LLAMA3_SPECIALS = LLAMA3_CHAT_SPECIALS + [
    "<|eom_id|>",
    "<|python_tag|>",
    "<|image|>",
    "<|step_id|>",
    "<|finetune_right_pad_id|>",
]
QWEN_CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_SPECIALS = QWEN_CHAT_SPECIALS + ["<tool_call>", "</tool_call>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

# Chat templates: the families' own structure, shortened (Llama 3's headers and trimmed content; Qwen 2.5's ChatML
# with a default system prompt; Qwen 3's empty think block on the last answer, which makes its rendering of a
# conversation not a prefix of the rendering of a longer one; Mistral's [INST], refusing roles it does not know).
# CHATML is plain ChatML, without Qwen 3's think block: the toy folder's Qwen 3 template.
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEMPLATES = {
    "llama3": (
        "{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
        " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "qwen2": (
        "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>"
        "\\n' }}{% endif %}" + CHATML
    ),
    "qwen3": (
        "{% for m in messages %}{% if m['role'] == 'assistant' and loop.last %}{{ '<|im_start|>assistant\\n"
        "<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m['role']"
        " + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "mistral": (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + "
        "'[/INST]' }}{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}{% else %}"
        "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
    ),
}


@dataclass(frozen=True)
class StandIn:
    """A family's stand-in tokenizer: the special tokens appended to the BPE (in this order), BOS (None: the family
    has none), EOS, the padding token and the chat template."""

    specials: Tuple[str, ...]
    bos: Optional[str]
    eos: str
    pad: str
    template: str


# Per finetune/checkpoint/hf_format.py family: the tests' and the benchmark's stand-ins (every special token; Llama 3
# pads with its own padding token, as torchtune's Llama 3 tokenizer does).
_LLAMA3 = ("<|begin_of_text|>", "<|end_of_text|>")
STAND_INS: Dict[str, StandIn] = {
    "llama3": StandIn(tuple(LLAMA3_SPECIALS), *_LLAMA3, "<|finetune_right_pad_id|>", TEMPLATES["llama3"]),
    "qwen2": StandIn(tuple(QWEN_SPECIALS), None, "<|endoftext|>", "<|endoftext|>", TEMPLATES["qwen2"]),
    "qwen3": StandIn(tuple(QWEN_SPECIALS), None, "<|endoftext|>", "<|endoftext|>", TEMPLATES["qwen3"]),
    # (Qwen3-30B-A3B ships Qwen3's tokenizer and chat template)
    "qwen3_moe": StandIn(tuple(QWEN_SPECIALS), None, "<|endoftext|>", "<|endoftext|>", TEMPLATES["qwen3"]),
    "mistral": StandIn(tuple(MISTRAL_SPECIALS), "<s>", "</s>", "</s>", TEMPLATES["mistral"]),
}


def alpaca_texts(data_dir, limit: Optional[int] = None, *, skip_empty: bool = True) -> List[str]:
    """The first ``limit`` Alpaca records (``data_dir``'s alpaca/alpaca_data.json) as plain text: instruction,
    input and output joined by a space; ``skip_empty=False`` joins an empty field too (two spaces where a record has
    no input: what the toy folders' BPE was trained on)."""
    path = Path(data_dir) / "alpaca" / "alpaca_data.json"
    try:
        records = json.loads(path.read_text(encoding="utf-8"))[:limit]
    except (OSError, ValueError) as e:
        raise BadInput(
            f"cannot read {path} to train the toy tokenizer on ({type(e).__name__}); pass --data-dir, the folder "
            "holding alpaca/alpaca_data.json (the configs' data_dir)"
        ) from None
    fields = [[str(r.get(k) or "") for k in ("instruction", "input", "output")] for r in records]
    return [" ".join(f for f in parts if f or not skip_empty) for parts in fields]


def train_bpe(texts: List[str], vocab_size: int):
    """A byte-level BPE of ``vocab_size`` tokens (every byte in its alphabet, Qwen's pre-tokenizer, as Llama 3's and
    Qwen's tokenizer.json) trained on ``texts`` with the ``tokenizers`` library: deterministic. transformers' own
    tokenizer classes for the families (Qwen2Tokenizer) encode with it exactly as the ``tokenizers`` library does."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def with_specials(bpe, stand_in: StandIn):
    """A copy of ``bpe`` with the stand-in's special tokens appended (``bpe`` itself is left as it was)."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_str(bpe.to_str())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in stand_in.specials])
    return tok


def token_ids(tok, stand_in: StandIn) -> Dict[str, Optional[int]]:
    """config.json's ``bos_token_id`` and ``eos_token_id`` in ``tok`` (BOS None where the family has none)."""
    return {
        "bos_token_id": None if stand_in.bos is None else tok.token_to_id(stand_in.bos),
        "eos_token_id": tok.token_to_id(stand_in.eos),
    }


def write_tokenizer(folder: Path, bpe, stand_in: StandIn, *, template_file: bool = True) -> Dict[str, Optional[int]]:
    """``bpe`` with the stand-in's special tokens, BOS, EOS, padding and chat template, saved by transformers into
    ``folder`` as a user saves a tokenizer (tokenizer.json, tokenizer_config.json; the template in a
    chat_template.jinja of its own, transformers 5's default, or with ``template_file=False`` inside
    tokenizer_config.json). Returns config.json's bos/eos ids."""
    from transformers import PreTrainedTokenizerFast

    tok = with_specials(bpe, stand_in)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=stand_in.bos,
        eos_token=stand_in.eos,
        pad_token=stand_in.pad,
        model_max_length=131072,
    )
    hf_tok.chat_template = stand_in.template
    hf_tok.save_pretrained(folder, save_jinja_files=template_file)
    return token_ids(tok, stand_in)
