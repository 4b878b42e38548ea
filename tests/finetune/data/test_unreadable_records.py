"""A record that cannot be read (finetune/data/records.py) is named before training, for every dataset kind with
local files: a byte that is not UTF-8 by file, line and column in JSON, JSONL, CSV and text files (datasets' JSON
reader would keep it inside a string, and the sample would fail when the sampler reaches it, mid-run), by record
and field in Parquet; a line that is not JSON by file and line.
"""

import gzip
import json
import logging
import sys

import pytest

import support
from conftest import DATA_DIR, REPO_ROOT, TINY_CONFIG
from finetune.base import BadInput
from finetune.data import loading, records
from finetune.data.tokenizer import HFTokenizer

BAD = b"\xff"


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory):
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 300), support.TOY_BPE_SIZE)
    folder = tmp_path_factory.mktemp("tokenizer")
    support.write_tokenizer(folder, support.TOYS["qwen2_5_7b"], bpe)
    return folder / "tokenizer.json"


def build(cfg: dict, tokenizer_json, chat_template=False):
    tok = HFTokenizer(str(tokenizer_json), chat_template=chat_template)
    data = support.dataset_settings({"split": "train", "packed": False, **cfg})
    return loading.build_dataset(data, tok, log=logging.getLogger(__name__))


def chat(i):
    return {"messages": [{"role": "user", "content": f"Q{i} é"}, {"role": "assistant", "content": f"A{i}"}]}


def instruct(i):
    return {"input": f"Q{i} é", "output": f"A{i}"}


def alpaca(i):
    return {"instruction": f"Q{i} é", "input": "", "output": f"A{i}"}


def jsonl(rows):
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in rows)


def json_list(rows):
    return json.dumps(rows, indent=2, ensure_ascii=False).encode()


CHAT = {"_component_": "torchtune.datasets.chat_dataset", "source": "json", "conversation_column": "messages"}
INSTRUCT = {"_component_": "torchtune.datasets.instruct_dataset"}
# kind: the dataset section and a file of six records, record 4 holding "Q4 é"
KINDS = {
    "chat-jsonl": ({**CHAT, "conversation_style": "openai"}, "chats.jsonl", jsonl(map(chat, range(6)))),
    "chat-json": ({**CHAT, "conversation_style": "openai"}, "chats.json", json_list(list(map(chat, range(6))))),
    "instruct-jsonl": ({**INSTRUCT, "source": "json"}, "qa.jsonl", jsonl(map(instruct, range(6)))),
    "instruct-json": ({**INSTRUCT, "source": "json"}, "qa.json", json_list(list(map(instruct, range(6))))),
    "instruct-csv": (
        {**INSTRUCT, "source": "csv"},
        "qa.csv",
        b"input,output\n" + b"".join(f"Q{i} é,A{i}\n".encode() for i in range(6)),
    ),
    "alpaca-json": (
        {"_component_": "torchtune.datasets.alpaca_dataset", "source": "json"},
        "alpaca.json",
        json_list(list(map(alpaca, range(6)))),
    ),
    "text-completion": (
        {"_component_": "torchtune.datasets.text_completion_dataset", "source": "text"},
        "corpus.txt",
        b"".join(f"Q{i} é, A{i}\n".encode() for i in range(6)),
    ),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_byte_that_is_not_utf8_is_named_by_file_line_and_column(tokenizer_json, tmp_path, kind):
    cfg, name, data = KINDS[kind]
    path = tmp_path / name
    path.write_bytes(data)
    cfg = {**cfg, "data_files": str(path)}
    assert len(build(cfg, tokenizer_json, chat_template="chat" in kind)) == 6  # (the good file reads)
    # Where record 4's "é" is, in an editor's terms (lines and characters from 1)
    line = next(n for n, text in enumerate(data.decode().splitlines(), 1) if "Q4 é" in text)
    column = data.decode().splitlines()[line - 1].index("Q4 é") + 4
    # Record 4's "é" (two bytes) with its second byte replaced: a byte no UTF-8 character continues with
    path.write_bytes(data.replace("Q4 é".encode(), "Q4 ".encode() + b"\xc3" + BAD))
    with pytest.raises(BadInput) as stop:
        build(cfg, tokenizer_json, chat_template="chat" in kind)
    assert str(stop.value) == (
        f"dataset.data_files={path} line {line} is not valid UTF-8 (byte 0xc3 at column {column}); fix or drop the "
        "record (or re-save the file as UTF-8)"
    )


def test_the_scan_streams_blocks_and_a_character_may_straddle_two(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "_BLOCK", 5)  # every multi-byte character of the file crosses some block's end
    path = tmp_path / "a.jsonl"
    text = "ab\nçé€😀\n" * 3 + "x€y"
    path.write_bytes(text.encode())
    records.check_utf8(path)  # valid: no error
    path.write_bytes(text.encode() + b"\nok\nz\xe2\x82")  # a character cut off at the end of the file
    with pytest.raises(BadInput, match=r"line 9 is not valid UTF-8 \(byte 0xe2 at column 2\)"):
        records.check_utf8(path)
    path.write_bytes(text.encode().replace("😀".encode(), b"\xf0\x9f" + BAD, 1))
    with pytest.raises(BadInput, match=r"line 2 is not valid UTF-8 \(byte 0xf0 at column 4\)"):
        records.check_utf8(path)
    packed = tmp_path / "a.jsonl.gz"  # (read decompressed, as datasets reads it)
    packed.write_bytes(gzip.compress(b'{"a": 1}\n{"a": "\xff"}\n'))
    with pytest.raises(BadInput, match=r"a.jsonl.gz line 2 is not valid UTF-8 \(byte 0xff at column 8\)"):
        records.check_utf8(packed)


JSON_ERRORS = [
    (
        "qa.jsonl",
        jsonl([instruct(0)]) + b'{"input": "Q1", "output": A1}\n',
        r"line 2 is not valid JSON \(Expecting value",
    ),
    ("qa.jsonl", jsonl([instruct(0)]) + b"\n[1, 2]\n", r"line 3 is list '\[1, 2\]', not a JSON object"),
    (
        "qa.json",
        json_list([instruct(0), instruct(1)]).replace(b'"output":', b'"output"', 1),
        r"line 4 is not valid JSON",
    ),
]


@pytest.mark.parametrize("name, data, message", JSON_ERRORS, ids=["jsonl", "jsonl-list", "json"])
def test_a_line_that_is_not_json_is_named(tokenizer_json, tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    cfg = {"_component_": "torchtune.datasets.instruct_dataset", "source": "json", "data_files": str(path)}
    with pytest.raises(BadInput, match=rf"^dataset.data_files={path} {message}.*; fix or drop that record$"):
        build(cfg, tokenizer_json)


def _bad_strings(values):
    """A pyarrow string array holding ``values`` (bytes) unchecked, as a Parquet file written elsewhere may."""
    import pyarrow as pa

    raw = pa.array(values, pa.binary())
    return pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())


def test_a_parquet_string_that_is_not_utf8_is_named_by_record(tokenizer_json, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "qa.parquet"
    inputs = [f"Q{i}".encode() for i in range(6)]
    inputs[4] = b"Q" + BAD
    pq.write_table(pa.table({"input": _bad_strings(inputs), "output": [f"A{i}" for i in range(6)]}), path)
    cfg = {"_component_": "torchtune.datasets.instruct_dataset", "source": "parquet", "data_files": str(path)}
    # (the 5th record, inputs[4]: named from 1, as a user counts)
    with pytest.raises(BadInput, match=r"^record 5 of .*qa.parquet \(counting from 1\): field 'input' is not valid"):
        build(cfg, tokenizer_json)
    # Conversations: the bad string inside the 4th record's messages
    contents = [b"Q0", b"A0", b"Q1", b"A1", b"Q2", b"A2", b"Q3", b"A" + BAD, b"Q4", b"A4"]
    messages = pa.StructArray.from_arrays(
        [pa.array(["user", "assistant"] * 5), _bad_strings(contents)], names=["role", "content"]
    )
    path = tmp_path / "chats.parquet"
    pq.write_table(
        pa.table({"messages": pa.ListArray.from_arrays(pa.array([0, 2, 4, 6, 8, 10], pa.int32()), messages)}), path
    )
    cfg = {**CHAT, "source": "parquet", "data_files": str(path), "conversation_style": "openai"}
    with pytest.raises(BadInput, match=r"^record 4 of .*chats.parquet \(counting from 1\): field 'messages' is not"):
        build(cfg, tokenizer_json, chat_template=True)


def test_the_recipe_stops_before_training_on_a_record_it_cannot_read(tokenizer_json, tmp_path, capsys, monkeypatch):
    """instruct_dataset data with one bad byte: one error line and exit 2 at setup, not a traceback at the step
    that reaches the record."""
    from recipes.full_finetune_single_device import RECIPE_PATH, recipe_main

    path = tmp_path / "qa.jsonl"
    rows = jsonl(map(instruct, range(16)))
    path.write_bytes(rows.replace("Q11 é".encode(), b"Q11 " + BAD))
    monkeypatch.setattr(
        sys,
        "argv",
        [
            RECIPE_PATH,
            "--config",
            TINY_CONFIG,
            f"data_dir={DATA_DIR}",
            f"output_dir={tmp_path / 'out'}",
            "metric_logger=null",
            "tokenizer._component_=finetune.data.HFTokenizer",
            "~tokenizer.prompt_template",
            f"tokenizer.path={tokenizer_json}",
            "dataset._component_=torchtune.datasets.instruct_dataset",
            "dataset.source=json",
            f"dataset.data_files={path}",
            "model.vocab_size=1024",
        ],
    )
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(SystemExit) as stop:
        recipe_main()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        f"error: dataset.data_files={path} line 12 is not valid UTF-8 (byte 0xff at column 16); fix or drop the "
        "record (or re-save the file as UTF-8)"
    )
    assert "Traceback" not in "\n".join(err)
    assert not list((tmp_path / "out").glob("*_*"))  # (no checkpoint, no metrics)
