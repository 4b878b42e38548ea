"""Every record a tokenizer can refuse is checked before the first step, packed or not (finetune/data/loading.py):
an HF tokenizer's chat template may refuse a conversation (its ``raise_exception``) and its pre-tokenizer regex may
fail on a text, so every record is tokenized at setup and the first refused one stops the run there, named, in one
``error:`` line; the tokens are kept (the pack cache) and the loader serves them without tokenizing again.

Before, unpacked data stopped the run when the sampler reached the record, after some trained steps (their
checkpoint-less work lost), or at the first validation pass.
"""

import dataclasses
import json
from types import SimpleNamespace

import pytest

import support
from conftest import DATA_DIR, run_here
from finetune.data import loading, packing
from finetune.data.tokenizer import HFTokenizer

RECORDS = 12  # FAST reads 6 steps x 2 samples: the whole epoch, the refused record somewhere inside it
BAD_LINE = 11  # (the seed-42 order reads it in step 4: before, the run stopped there after 3 steps)
# The Qwen stand-in's template, refusing system messages as some published templates do (Gemma's, Mistral's)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
BACKTRACKS = r"(x+)+y"  # fine on the probe text, a panic of the regex engine on a long run of x without a y


def chat(i, bad=None):
    messages = [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
    if bad == "template":
        messages.insert(0, {"role": "system", "content": "Be brief."})
    elif bad == "regex":
        messages[0]["content"] = "x" * 60 + "!"
    elif bad == "long":  # 200,000 characters: over 8 x max_seq_len=64 tokens of the vocabulary's longest
        messages[0]["content"] = "word " * 40000
    return {"messages": messages}


@pytest.fixture(scope="module")
def bpe():
    return support.train_bpe(support.alpaca_texts(DATA_DIR, 300), support.TOY_BPE_SIZE)


def chats(path, bad=None):
    path.write_text("".join(json.dumps(chat(i, bad if i == BAD_LINE else None)) + "\n" for i in range(1, RECORDS + 1)))
    return path


WHY = {
    "template": "the chat template in {tokenizer}/tokenizer_config.json refused a conversation (System role",
    "regex": "{tokenizer}/tokenizer.json failed to tokenize a text of 61 characters",
    "long": "the chat template's rendering of a conversation is 200,0",
    "validation": "the chat template in {tokenizer}/tokenizer_config.json refused a conversation (System role",
}


@pytest.mark.parametrize("fault", WHY)
def test_a_refused_record_stops_the_run_before_the_first_step(bpe, tmp_path, fault):
    """A system message the template refuses, a text the regex cannot split, a conversation too long to tokenize
    (tests/finetune/data/test_chat_template_bounds.py), in the training set (unpacked) or the validation set: one
    error line naming the record's line, nothing trained, nothing written."""
    path = support.tokenizer_folder(
        tmp_path / "tokenizer", bpe, config_template=NO_SYSTEM, split_regex=BACKTRACKS if fault == "regex" else None
    )
    bad = chats(tmp_path / "bad.jsonl", "template" if fault == "validation" else fault)
    good = chats(tmp_path / "good.jsonl")
    train, val = (good, bad) if fault == "validation" else (bad, None)
    run = run_here(
        tmp_path / "out",
        "tokenizer._component_=finetune.data.HFTokenizer",
        "~tokenizer.prompt_template",
        f"tokenizer.path={path}",
        f"tokenizer.chat_template={fault != 'regex'}",
        "dataset._component_=torchtune.datasets.chat_dataset",
        "dataset.source=json",
        f"dataset.data_files={train}",
        "dataset.conversation_column=messages",
        "dataset.conversation_style=openai",
        "model.vocab_size=1024",
        *([f"dataset_val.data_files={val}", "run_val_every_n_steps=2"] if val else []),
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert [m["step"] for m in run.metrics] == [] and not (tmp_path / "out" / "metrics.jsonl").exists()
    assert run.error.startswith(f"error: line {BAD_LINE} of {bad}: " + WHY[fault].format(tokenizer=path.parent))
    assert "Traceback" not in run.stderr


def test_unpacked_samples_come_from_the_cache_as_the_dataset_makes_them(bpe, tmp_path):
    """The samples the loader reads are the dataset's own, tokenized once: the second build loads them."""
    path = support.tokenizer_folder(tmp_path / "tokenizer", bpe, config_template=NO_SYSTEM)
    tok = HFTokenizer(str(path), chat_template=True)
    section = {
        "_component_": "torchtune.datasets.chat_dataset",
        "source": "json",
        "data_files": str(chats(tmp_path / "good.jsonl")),
        "conversation_column": "messages",
        "conversation_style": "openai",
        "split": "train",
    }
    data = dataclasses.replace(support.dataset_settings(section), tokenizer_path=path, pack_cache_dir=tmp_path / "c")
    lines = []
    log = SimpleNamespace(info=lines.append, warning=lines.append)
    first = loading.build_dataset(data, tok, log)
    again = loading.build_dataset(data, tok, log)
    assert isinstance(first, packing.SampleTable) and "tokenized in" in lines[0] and "cache in" in lines[1]
    reference = loading.config.instantiate(support.dataset_settings(section).section, tok)  # torchtune's own
    loading.records.chat_transform(reference, tok, section)
    for i in range(RECORDS):
        want = reference[i]
        assert first[i] == again[i] == {"tokens": want["tokens"], "labels": [int(x) for x in want["labels"]]}


@pytest.mark.parametrize("kind", ["alpaca", "chat"])
def test_a_text_far_past_max_seq_len_is_refused_at_setup_with_a_sentencepiece_tokenizer(tmp_path, kind):
    """Llama 2's SentencePiece tokenizer (torchtune's) tokenizes any text whole: a record's text over 8 x
    max_seq_len tokens of its longest piece (16 characters), and over 262,144 characters, is refused at setup, named,
    in one line, as HFTokenizer refuses it (tests/finetune/data/test_chat_template_bounds.py). Before, it was
    tokenized whole, then cut to 64 tokens: seconds and gigabytes for a large enough text."""
    long = "word " * 60000  # 300,000 characters
    if kind == "alpaca":
        rows = [{"instruction": f"Say {i}.", "input": "", "output": f"{i}."} for i in range(RECORDS)]
        rows[BAD_LINE - 1]["output"] = long
        data = tmp_path / "alpaca.json"
        data.write_text(json.dumps(rows))
        dataset = [f"dataset.data_files={data}"]
    else:
        data = chats(tmp_path / "chats.jsonl")
        lines = data.read_text().splitlines()
        bad = json.loads(lines[BAD_LINE - 1])
        bad["messages"][1]["content"] = long
        lines[BAD_LINE - 1] = json.dumps(bad)
        data.write_text("\n".join(lines) + "\n")
        dataset = ["dataset._component_=torchtune.datasets.chat_dataset", "dataset.source=json"]
        dataset += [f"dataset.data_files={data}", "dataset.conversation_column=messages"]
        dataset += ["dataset.conversation_style=openai", "~dataset.train_on_input"]
    run = run_here(tmp_path / "out", *dataset, "dataset.packed=False")
    assert run.returncode == 2, run.stderr[-3000:]
    error = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "is 300,000 characters, more than 262,144" in error[0], run.stderr
    assert f"{BAD_LINE}" in error[0] and "raise tokenizer.max_seq_len" in error[0], error[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()
    # Within the bound, a long text is cut to max_seq_len as before (8,192 characters: 8 x 64 x 16, under the floor)
    ok = tmp_path / "ok.json"
    ok.write_text(json.dumps([{"instruction": "Say it.", "input": "", "output": "word " * 20000}] * RECORDS))
    assert run_here(tmp_path / "ok", f"dataset.data_files={ok}", "dataset.packed=False").ok
