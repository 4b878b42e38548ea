"""A chat template or tokenizer.json that hangs, overflows, loads other files, recurses or panics is one error
naming its file, through HFTokenizer (the recipes build it at setup) and the recipe's ``error:`` line; the sandbox
still refuses to run code.

The time bound is lowered to half a second here (finetune.data.chat_template.RENDER_SECONDS); the tests assert only
that the run ended with the error.
"""

import json
from pathlib import Path

import pytest
from torchtune.data import Message

import support
from conftest import DATA_DIR, run_here
from finetune.base import BadInput
from finetune.data import chat_template
from finetune.data.tokenizer import HFTokenizer

CONVERSATION = [Message("user", "Name a colour.", masked=True), Message("assistant", "Blue.")]
NESTED_LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def bpe():
    return support.train_bpe(support.alpaca_texts(DATA_DIR, 2000), support.TOY_BPE_SIZE)


@pytest.fixture(autouse=True)
def short_bound(monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)


def refused(path: Path, *words: str, chat_template: bool = True, messages=None) -> str:
    """The one-line BadInput that building the tokenizer (and, with ``messages``, tokenizing them) raises."""
    with pytest.raises(BadInput) as e:
        HFTokenizer(str(path), chat_template=chat_template).tokenize_messages(messages or CONVERSATION)
    text = str(e.value)
    assert "\n" not in text
    for word in words:
        assert word in text, text
    return text


def test_a_template_that_never_ends_is_stopped_at_setup_and_per_sample(bpe, tmp_path):
    refused(
        support.tokenizer_folder(tmp_path / "setup", bpe, NESTED_LOOP),
        "chat_template.jinja ran past 0.5 s",
        "published template",
    )
    # A template that hangs only on longer conversations passes the setup check and is stopped on the sample.
    only_long = "{% if messages|length > 2 %}" + NESTED_LOOP + "{% endif %}{{ messages[0]['content'] }}"
    tok = HFTokenizer(str(support.tokenizer_folder(tmp_path / "sample", bpe, only_long)), chat_template=True)
    assert tok.tokenize_messages(CONVERSATION)[0]
    longer = [*CONVERSATION, Message("user", "Another?", masked=True), Message("assistant", "Red.")]
    with pytest.raises(BadInput, match=r"chat_template.jinja ran past 0.5 s on one conversation"):
        tok.tokenize_messages(longer)


@pytest.mark.parametrize(
    "payload, words",
    [
        ("{{ 'x' * 4000000000 }}", "a repeated value of 4,000,000,000"),
        ("{% set s = 'x' * 4000000000 %}", "a repeated value of 4,000,000,000"),  # (built, never printed)
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
            "a concatenation of",
        ),
        ("{{ range(100000)|join('y' * 100000) }}", "a joined string of 10,000,000,000"),
        ("{{ 'x'|center(4000000000) }}", "an integer argument of 4,000,000,000"),
        ("{{ '%0999999999d' % 1 }}", "a format width of 999,999,999"),
        ("{{ 2 ** 100000000 }}", "a power of about"),
    ],
    ids=["multiply", "multiply-unprinted", "concat-doubling", "join", "center", "format-width", "power"],
)
def test_a_huge_value_is_refused_before_it_is_built(bpe, tmp_path, payload, words):
    """In tokenizer_config.json's chat_template, as older folders have it: the message names that file."""
    refused(
        support.tokenizer_folder(tmp_path, bpe, config_template=payload), "tokenizer_config.json builds too much", words
    )


@pytest.mark.parametrize(
    "payload, kind",
    [
        ("{% include 'other.jinja' %}", "include"),
        ("{% import 'macros.jinja' as m %}{{ m.f() }}", "import"),
        ("{% from 'macros.jinja' import f %}{{ f() }}", "fromimport"),
        ("{% extends 'base.jinja' %}", "extends"),
    ],
    ids=["include", "import", "from-import", "extends"],
)
def test_loading_another_template_is_refused(bpe, tmp_path, payload, kind):
    (tmp_path / "other.jinja").write_text("{{ 1 }}")  # (even where the file exists beside it)
    refused(
        support.tokenizer_folder(tmp_path, bpe, payload),
        f"chat_template.jinja loads another template ({kind} on line 1)",
    )


def test_a_recursive_macro_is_one_error(bpe, tmp_path):
    payload = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}"
    refused(support.tokenizer_folder(tmp_path, bpe, payload), "chat_template.jinja recurses without end")


def test_a_backtracking_pre_tokenizer_regex_is_one_error(bpe, tmp_path):
    """The Rust library panics (a BaseException); at setup on the probe text, and on a sample's text where only
    the data sets it off."""
    refused(
        support.tokenizer_folder(tmp_path / "setup", bpe, split_regex=r"([a-z]+)+$"),
        "tokenizer.json",
        "Split regex backtracks",
    )
    tok = HFTokenizer(str(support.tokenizer_folder(tmp_path / "sample", bpe, split_regex=r"(x+)+y")))
    with pytest.raises(BadInput, match=r"tokenizer.json failed to tokenize .*re-copy tokenizer.json"):
        tok.tokenize_messages([Message("user", "x" * 60 + "!", masked=True), Message("assistant", "Blue.")])


# A template within its own bounds (no value over 1,024 characters, 1,000,000 in all: the finding was 16,000 pieces of
# 1,000 under the 16,777,216-character bound, 45 s and 3.5 GiB to tokenize) whose output dwarfs any max_seq_len.
PIECES = "{% for i in range(1000) %}{{ 'x' * 999 }}\n{% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
LONG_TEXT = "word " * 40000  # 200,000 characters in one message: some 3,000 times tokenizer.max_seq_len=64


@pytest.mark.parametrize("where", ["template", "templated-record", "plain-record"])
def test_a_text_far_past_max_seq_len_is_refused_before_it_is_tokenized(bpe, tmp_path, where):
    """A template whose output is a million characters whatever the conversation: refused at setup, naming its file.
    A record that far past tokenizer.max_seq_len, rendered or plain: refused before tokenizing (the run's setup check
    names the record: tests/finetune/data/test_records_checked_at_setup.py). Before, each was tokenized whole (seconds
    and hundreds of MB here, minutes and gigabytes at the template bound) to keep its first 64 tokens."""
    path = support.tokenizer_folder(tmp_path, bpe, PIECES if where == "template" else support.TEMPLATES["qwen2"])
    long = [Message("user", LONG_TEXT, masked=True), Message("assistant", "Blue.")]
    with pytest.raises(BadInput) as e:
        tok = HFTokenizer(str(path), max_seq_len=64, chat_template=where != "plain-record")
        tok.tokenize_messages(CONVERSATION if where == "template" else long)
    text = str(e.value)
    expected = {
        "template": "chat_template.jinja renders a two-message conversation to 1,000,",
        "templated-record": "the chat template's rendering of a conversation is 200,",
        "plain-record": "a message's text is 200,000 characters",
    }[where]
    assert expected in text and "tokenizer.max_seq_len=64" in text and "\n" not in text, text
    # A record past max_seq_len but within the bound is cut to it, as before
    tok = HFTokenizer(str(support.tokenizer_folder(tmp_path / "good", bpe, support.TEMPLATES["qwen2"])), max_seq_len=64)
    assert len(tok.tokenize_messages([Message("user", "word " * 100, masked=True), Message("assistant", "x")])[0]) == 64


@pytest.mark.parametrize(
    "payload",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('touch MARK').read() }}",
        "{{ joiner.__init__.__globals__['__builtins__']['open']('MARK', 'w').write('x') }}",
        "{{ namespace.__init__.__globals__.sys.modules.os.system('touch MARK') }}",
        "{{ lipsum.__globals__['os'].system('touch MARK') }}",
        "{{ raise_exception.__globals__['os'].system('touch MARK') }}",
        "{{ messages.append('x') or messages.pop() }}",  # (the data itself is not changed)
    ],
)
def test_the_sandbox_still_refuses_code(bpe, tmp_path, payload):
    mark = tmp_path / "mark"
    refused(
        support.tokenizer_folder(tmp_path, bpe, payload.replace("MARK", str(mark))),
        "chat_template.jinja",
        "sandbox forbids",
    )
    assert not mark.exists()


@pytest.mark.parametrize("fault", ["hang", "regex"])
def test_the_recipe_prints_one_error_line(bpe, tmp_path, capfd, fault):
    """Through the recipe in this process: its Python-level output in the run, and what reaches the process's own
    stderr (file descriptor 2, where a Rust panic's report would go) through capfd."""
    if fault == "hang":
        path = support.tokenizer_folder(tmp_path / "folder", bpe, NESTED_LOOP)
    else:
        path = support.tokenizer_folder(tmp_path / "folder", bpe, support.TEMPLATES["qwen2"], split_regex=r"([a-z]+)+$")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        json.dumps({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}) + "\n"
    )
    capfd.readouterr()
    run = run_here(
        tmp_path / "out",
        "tokenizer._component_=finetune.data.HFTokenizer",
        "~tokenizer.prompt_template",
        f"tokenizer.path={path}",
        "tokenizer.chat_template=True",
        "dataset._component_=torchtune.datasets.chat_dataset",
        "dataset.source=json",
        f"dataset.data_files={chats}",
        "dataset.conversation_column=messages",
        "dataset.conversation_style=openai",
        "model.vocab_size=1024",
    )
    fd_err = capfd.readouterr().err
    assert run.returncode == 2
    assert ("chat_template.jinja ran past" if fault == "hang" else "tokenizer.json") in run.error
    assert "Traceback" not in run.stderr and "panicked" not in run.stderr + fd_err
