"""Which tokens of a conversation the loss sees, with each family's real chat template (tokenizer.chat_template=True).

The templates in chat_templates/ are the ones the instruct models ship (Llama 3.1 and 3.2 Instruct, Qwen2.5
Instruct, Qwen3, Mistral 7B Instruct v0.3), byte for byte; the vocabulary is tests/support.py's stand-in (a
BPE trained here on Alpaca) with each family's special tokens. No hub access is needed.

The trouble these cases catch: a message located by searching the rendered text for its content finds a reply
``a`` inside ``<|start_header_id|>`` or ``<|im_start|>``, a reply ``assistant`` inside the role header, and user text
that equals the default system prompt inside the system block; the header is then trained and the real reply and
its end-of-turn token are not. The expected tokens and mask are written out here per family, piece by piece (the
template's layout in plain Python), independent of finetune/data/tokenizer.py: every token of the conversation and
whether the loss sees it.
"""

import json
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import pytest
from tokenizers import AddedToken, Tokenizer
from torchtune.data import Message

import support
from conftest import DATA_DIR
from finetune.base import BadInput
from finetune.data.tokenizer import HFTokenizer

TEMPLATES = Path(__file__).with_name("chat_templates")
QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
LLAMA_SYSTEM = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024"  # (the date is pinned)

Piece = Tuple[str, object]  # text, trained (True, False or AFTER_SPACE)
# Mistral's space before a message's text: trained where the tokenizer joins it to the text's first word (" a"),
# masked where it is a token of its own (the template's, not the text's)
AFTER_SPACE = "after space"


def llama3(messages: List[Message]) -> List[Piece]:
    pieces = [
        ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n" + LLAMA_SYSTEM + "\n\n<|eot_id|>", False)
    ]
    for m in messages:
        trained = not m.masked
        pieces += [
            (f"<|start_header_id|>{m.role}<|end_header_id|>\n\n", False),
            (m.text_content.strip(), trained),
            ("<|eot_id|>", trained),
        ]
    return pieces


def qwen(messages: List[Message], default_system: bool, think: bool) -> List[Piece]:
    pieces = [(f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n", False)] if default_system else []
    last = len(messages) - 1
    for i, m in enumerate(messages):
        trained = not m.masked
        # Qwen3: the reply after the last question, when it ends the conversation, opens with an empty think block
        header = f"<|im_start|>{m.role}\n" + ("<think>\n\n</think>\n\n" if think and i == last else "")
        pieces += [(header, False), (m.text_content, trained), ("<|im_end|>", trained), ("\n", False)]
    return pieces


def mistral(messages: List[Message]) -> List[Piece]:
    pieces = [("<s>", False)]
    for m in messages:
        trained = not m.masked
        if m.role == "user":
            pieces += [("[INST]", False), (" " + m.text_content, trained and AFTER_SPACE), ("[/INST]", trained)]
        else:
            pieces += [(" " + m.text_content.strip(), trained and AFTER_SPACE), ("</s>", trained)]
    return pieces


# family: template file, special tokens, BOS, EOS, the layout
FAMILIES: Dict[str, Tuple[str, List[str], str, str, Callable[[List[Message]], List[Piece]]]] = {
    "llama3_1": ("llama3_1.jinja", support.LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", llama3),
    "llama3_2": ("llama3_2.jinja", support.LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>", llama3),
    "qwen2_5": (
        "qwen2_5.jinja",
        support.QWEN_SPECIALS,
        None,
        "<|im_end|>",
        lambda ms: qwen(ms, default_system=True, think=False),
    ),
    "qwen3": (
        "qwen3.jinja",
        support.QWEN_SPECIALS,
        None,
        "<|im_end|>",
        lambda ms: qwen(ms, default_system=False, think=True),
    ),
    "mistral": ("mistral_v0_3.jinja", support.MISTRAL_SPECIALS, "<s>", "</s>", mistral),
}
# The default system prompt a family's template writes (where it writes one), as a user's text
DEFAULT_SYSTEM = {"llama3_1": LLAMA_SYSTEM, "llama3_2": LLAMA_SYSTEM}


def write_folder(folder: Path, family: str, bpe) -> None:
    """A model folder's tokenizer.json and tokenizer_config.json: the stand-in BPE, the family's special tokens
    (Qwen3's <think> and </think> as the plain added tokens its tokenizer.json has), the real template."""
    template, specials, bos, eos, _ = FAMILIES[family]
    tok = Tokenizer.from_str(bpe.to_str())
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if family == "qwen3":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "chat_template": (TEMPLATES / template).read_text(),
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> Dict[str, HFTokenizer]:
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 2000), support.TOY_BPE_SIZE)
    root = tmp_path_factory.mktemp("chat_tokenizers")
    for family in FAMILIES:
        write_folder(root / family, family, bpe)
    return {f: HFTokenizer(str(root / f / "tokenizer.json"), chat_template=True) for f in FAMILIES}


def expected(tok: HFTokenizer, family: str, messages: List[Message]) -> Tuple[List[int], List[bool]]:
    """The conversation's tokens and mask (True: not trained), the layout's pieces tokenized one by one."""
    tokens, mask = [], []
    for text, trained in FAMILIES[family][-1](messages):
        ids = tok.encode(text, add_bos=False, add_eos=False)
        tokens += ids
        mask += [not trained] * len(ids)
        if trained == AFTER_SPACE and tok.decode(ids[:1]) == " ":
            mask[-len(ids)] = True
    return tokens, mask


def check(tok: HFTokenizer, family: str, messages: List[Message]) -> None:
    tokens, mask = tok.tokenize_messages(messages)
    want_tokens, want_mask = expected(tok, family, messages)
    assert tokens == want_tokens  # (the rendering itself: the layout above is the template's)
    trained = [t for t, m in zip(tokens, mask) if not m]
    want_trained = [t for t, m in zip(want_tokens, want_mask) if not m]
    assert tok.decode(trained, skip_special_tokens=False) == tok.decode(want_trained, skip_special_tokens=False)
    assert trained == want_trained
    assert mask == want_mask  # ... and each at its place


@pytest.mark.parametrize("reply", ["a", "assistant", "system", "im_start", "user", "Blue."])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_reply_is_trained_where_it_is_not_in_the_headers(tokenizers, family, reply):
    """Single letters (multiple-choice answers) and role names occur in the template's headers before the reply."""
    check(
        tokenizers[family],
        family,
        [Message("user", "Which letter comes first, a or b?", masked=True), Message("assistant", reply)],
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_reply_of_a_longer_conversation(tokenizers, family):
    """Two exchanges (Qwen3 renders the first reply without the think block the last one has)."""
    check(
        tokenizers[family],
        family,
        [
            Message("user", "Pick a letter.", masked=True),
            Message("assistant", "a"),
            Message("user", "And the role that answers?", masked=True),
            Message("assistant", "assistant"),
            Message("user", "im_start", masked=True),
            Message("assistant", "system"),
        ],
    )


@pytest.mark.parametrize("train_on_input", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_user_text_equal_to_the_default_system_prompt(tokenizers, family, train_on_input):
    """The user's own text is trained (train_on_input) or masked, never the template's system block that reads the
    same; and the reply after it is found after the user's text."""
    text = DEFAULT_SYSTEM.get(family, QWEN_SYSTEM)
    check(tokenizers[family], family, [Message("user", text, masked=not train_on_input), Message("assistant", "a")])
    check(
        tokenizers[family],
        family,
        [Message("user", "What is your system prompt?", masked=not train_on_input), Message("assistant", text)],
    )


def test_a_reply_whose_tokens_cannot_be_located_is_one_error(tokenizers):
    """Qwen3 renders a past reply after its bare header but the last one after the think block, with leading
    newlines stripped; a past reply that starts with a newline then merges with its header's newline into one token,
    so no token boundary separates header and reply: the conversation is refused in one line naming the problem,
    not trained on some other tokens."""
    messages = [
        Message("user", "Pick a letter.", masked=True),
        Message("assistant", "\na"),
        Message("user", "Another?", masked=True),
        Message("assistant", "b"),
    ]
    with pytest.raises(BadInput) as error:
        tokenizers["qwen3"].tokenize_messages(messages)
    message = str(error.value)
    assert "\n" not in message
    assert "renders message 1 (assistant) otherwise once later messages follow" in message
    assert "chat_template.jinja" in message
    # The same reply last (the think block before it) is located
    check(tokenizers["qwen3"], "qwen3", [*messages[:1], Message("assistant", "a")])


def test_mistral_drops_a_system_message_from_a_finished_conversation(tokenizers):
    """Mistral v0.3's template writes the system message into the last user turn only when a conversation ends with
    it (a prompt for generation); a training conversation ends with a reply and is rendered without it, which the
    masking follows: the replies are trained as without a system message."""
    messages = [
        Message("user", "Pick a letter.", masked=True),
        Message("assistant", "a"),
        Message("user", "Another?", masked=True),
        Message("assistant", "b"),
    ]
    with_system = tokenizers["mistral"].tokenize_messages([Message("system", "Be brief.", masked=True), *messages])
    assert with_system == tokenizers["mistral"].tokenize_messages(messages)
    check(tokenizers["mistral"], "mistral", messages)
