"""Data beyond Alpaca and the families' own tokenizers, in this process (no training).

finetune/data/tokenizer.py reads a model folder's tokenizer.json and tokenizer_config.json: Alpaca formatted as plain
text (BOS, prompt, response, EOS), conversations through the family's chat template with only the assistant's text
and its end-of-turn token trained. finetune/data/loading.py builds torchtune's instruct_dataset and chat_dataset from local
JSON, JSONL or Parquet, checks every record first (one BadInput naming the record), and packs them like Alpaca. The
tokenizers are tests/support.py's stand-ins, saved by transformers (a BPE trained here on Alpaca, each family's
special tokens and chat template).
"""

import json
import sys
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from torchtune.data import Message

import support
from conftest import DATA_DIR, REPO_ROOT, TINY_CONFIG
from finetune.base import BadInput
from finetune.data import loading
from finetune.data.packing import PackedSFTDataset
from finetune.data.tokenizer import HFTokenizer

# (Qwen3-MoE ships Qwen3's tokenizer and chat template: its toy's stand-in is the family's own entry all the same)
FAMILIES = {
    "llama3": "llama3_1_8b",
    "qwen2": "qwen2_5_7b",
    "qwen3": "qwen3_8b",
    "qwen3_moe": "qwen3_moe_30b",
    "mistral": "mistral_7b",
}
CONVERSATION = [
    Message("user", "Name a colour.", masked=True),
    Message("assistant", "Blue."),
    Message("user", "Another one?", masked=True),
    Message("assistant", " Green, then red."),
]
# What the loss sees of CONVERSATION, decoded: each answer (Llama 3's template trims it) and the end of its turn.
TRAINED = {
    "llama3": "Blue.<|eot_id|>Green, then red.<|eot_id|>",
    "qwen2": "Blue.<|im_end|> Green, then red.<|im_end|>",
    "qwen3": "Blue.<|im_end|> Green, then red.<|im_end|>",
    "qwen3_moe": "Blue.<|im_end|> Green, then red.<|im_end|>",
    "mistral": " Blue.</s> Green, then red.</s>",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's stand-in tokenizer folder: {family: folder}."""
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 2000), support.TOY_BPE_SIZE)
    root = tmp_path_factory.mktemp("tokenizers")
    for family, key in FAMILIES.items():
        support.write_tokenizer(root / family, support.TOYS[key], bpe)
    return {family: root / family for family in FAMILIES}


def tokenizer(folders, family, **kwargs) -> HFTokenizer:
    return HFTokenizer(str(folders[family] / "tokenizer.json"), **kwargs)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_template_trains_the_answers_and_their_end_of_turn(folders, family):
    tok = tokenizer(folders, family, chat_template=True)
    tokens, mask = tok.tokenize_messages(CONVERSATION)
    assert tok.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False) == TRAINED[family]
    # The scaffolding is there, masked: headers, the default system prompt, Qwen3's empty think block.
    rendered = tok.decode(tokens, skip_special_tokens=False)
    assert {
        "llama3": "<|start_header_id|>user<|end_header_id|>",
        "qwen2": "You are a helpful assistant.",
        "qwen3": "<think>\n\n</think>",
        "qwen3_moe": "<think>\n\n</think>",
        "mistral": "[INST] Name a colour.[/INST]",
    }[family] in rendered
    # train_on_input: every message's text is trained
    both = tok.tokenize_messages([Message("user", "Name a colour.", masked=False), CONVERSATION[1]])
    assert "Name a colour." in tok.decode([t for t, m in zip(*both) if not m], skip_special_tokens=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_format_is_bos_prompt_response_eos(folders, family):
    """Alpaca on a base model, as the Llama 2 configs do it: no template, the prompt masked unless trained on."""
    tok = tokenizer(folders, family)
    prompt, answer = "### Instruction:\nName a colour.\n\n### Response:\n", "Blue."
    tokens, mask = tok.tokenize_messages([Message("user", prompt, masked=True), Message("assistant", answer)])
    bos = [] if tok.bos_id is None else [tok.bos_id]  # (Qwen has no BOS)
    assert tokens == bos + tok.encode(prompt, add_bos=False, add_eos=False) + tok.encode(answer, add_bos=False)
    assert (
        tok.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)
        == answer
        + {
            "llama3": "<|end_of_text|>",
            "qwen2": "<|endoftext|>",
            "qwen3": "<|endoftext|>",
            "qwen3_moe": "<|endoftext|>",
            "mistral": "</s>",
        }[family]
    )


def test_bad_tokenizer_files_and_templates_are_one_error_each(folders, tmp_path):
    with pytest.raises(BadInput, match="is not a Hugging Face tokenizer.json"):
        HFTokenizer(str(DATA_DIR / "llama2_tokenizer" / "tokenizer.model"))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((folders["qwen2"] / "tokenizer.json").read_text())
    with pytest.raises(BadInput, match="names no eos_token"):
        HFTokenizer(str(bare / "tokenizer.json"))
    config = json.loads((folders["qwen2"] / "tokenizer_config.json").read_text())
    (bare / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "chat_template"}))
    with pytest.raises(BadInput, match="has no chat_template.*tokenizer.chat_template=False"):
        HFTokenizer(str(bare / "tokenizer.json"), chat_template=True)
    mistral = tokenizer(folders, "mistral", chat_template=True)
    with pytest.raises(BadInput, match="refused a conversation .Only user and assistant roles"):
        mistral.tokenize_messages([Message("system", "Be brief."), *CONVERSATION[:2]])


# -- datasets --------------------------------------------------------------------------------------------------------


def build(cfg: dict, tok, packed=False):
    data = support.dataset_settings({**cfg, "packed": packed}, packed=packed)  # (the settings read dataset.packed)
    return loading.build_dataset(data, tok, log=SimpleNamespace(info=lambda *_: None, warning=lambda *_: None))


def chats(n=24):
    records = json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[:n]
    return [
        {"messages": [{"role": "user", "content": r["instruction"]}, {"role": "assistant", "content": r["output"]}]}
        for r in records
    ]


def chat_cfg(path, style="openai", column="messages"):
    return {
        "_component_": "torchtune.datasets.chat_dataset",
        "source": "json",
        "data_files": str(path),
        "conversation_column": column,
        "conversation_style": style,
        "train_on_input": False,
        "split": "train",
    }


def test_chat_dataset_packed_trains_on_exactly_the_answers(folders, tmp_path):
    """OpenAI messages from JSONL, ShareGPT from JSON, in Qwen's chat format, packed: the rows hold every sample
    whole and train on exactly the tokens the unpacked samples train on."""
    tok = tokenizer(folders, "qwen2", chat_template=True, max_seq_len=256)
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats()))
    samples = build(chat_cfg(path), tok)
    packed = build(chat_cfg(path), tok, packed=True)
    assert isinstance(packed, PackedSFTDataset) and len(packed) < len(samples)
    unpacked_trained = sum(sum(1 for t in s["labels"][1:] if t != -100) for s in samples)
    assert sum(int((row["labels"] != -100).sum()) for row in packed) == unpacked_trained

    sharegpt = tmp_path / "sharegpt.json"
    role = {"user": "human", "assistant": "gpt"}
    sharegpt.write_text(
        json.dumps(
            [
                {"conversations": [{"from": role[m["role"]], "value": m["content"]} for m in c["messages"]]}
                for c in chats()
            ]
        )
    )
    other = build(chat_cfg(sharegpt, "sharegpt", "conversations"), tok)
    assert [s["tokens"] for s in other] == [s["tokens"] for s in samples]


def test_instruct_dataset_from_parquet_and_jsonl(folders, tmp_path):
    import datasets

    records = [{"question": c["messages"][0]["content"], "answer": c["messages"][1]["content"]} for c in chats(8)]
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "qa.parquet"))
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    tok = tokenizer(folders, "llama3")
    cfg = {
        "_component_": "torchtune.datasets.instruct_dataset",
        "column_map": {"input": "question", "output": "answer"},
        "train_on_input": False,
        "split": "train",
    }
    from_parquet = build({**cfg, "source": "parquet", "data_files": str(tmp_path / "qa.parquet")}, tok)
    from_jsonl = build({**cfg, "source": "json", "data_files": str(tmp_path / "qa.jsonl")}, tok)
    assert len(from_parquet) == 8 and [s["tokens"] for s in from_parquet] == [s["tokens"] for s in from_jsonl]
    assert (
        tok.decode([t for t in from_jsonl[0]["labels"] if t != -100], skip_special_tokens=False)
        == records[0]["answer"] + "<|end_of_text|>"
    )


BAD_CHATS = [
    (
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Hello"}]},
        r"line 3 of .*chats.jsonl: message 2 has role='bot'; use one of system, user, assistant",
    ),
    (
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
        r"line 3 of .*: message 2 \(assistant\) has content=.None., not text",
    ),
    ({"messages": []}, r"line 3 of .*: 'messages' is .*not a list of messages"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, r"line 3 of .* has no assistant message"),
    ({"conversation": [{"role": "user", "content": "Hi"}]}, r"have no 'messages' field .*dataset.conversation_column"),
    (
        {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "user", "content": "Hi?"},
                {"role": "assistant", "content": "Hello"},
            ]
        },
        r"line 3 of .*: messages 1 and 2 are both user messages \(torchtune's conversation rules\)",
    ),
]


@pytest.mark.parametrize("bad, message", BAD_CHATS, ids=["role", "content", "empty", "no-answer", "column", "order"])
def test_a_bad_chat_record_is_one_error_naming_it(folders, tmp_path, bad, message):
    good = chats(4)
    rows = good[:2] + [bad] + good[2:] if "messages" in bad else [bad] * 4
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadInput, match=message):
        build(chat_cfg(path), tokenizer(folders, "qwen2", chat_template=True))


def test_a_bad_instruct_record_is_one_error_naming_it(folders, tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"input": "a", "output": "b"}, {"input": "c", "output": None}]))
    cfg = {
        "_component_": "torchtune.datasets.instruct_dataset",
        "source": "json",
        "data_files": str(path),
        "split": "train",
    }
    with pytest.raises(
        BadInput,
        match=r"record 2 of .*qa.json \(counting from 1\) has no 'output'; fix or drop that record \(each needs input "
        r"and output\)",
    ):
        build(cfg, tokenizer(folders, "llama3"))
    with pytest.raises(BadInput, match="conversation_style='alpaca' is not one of openai, sharegpt"):
        build({**chat_cfg(path), "conversation_style": "alpaca"}, tokenizer(folders, "llama3"))


def test_a_bad_record_is_named_as_an_editor_shows_it(folders, tmp_path):
    """A JSONL record by its file and line (blank lines counted, as an editor counts them; the records of a list of
    files in order), any other by its place counting from 1, said so; its messages counted from 1 too."""
    bad = BAD_CHATS[0][0]  # (its second message has role 'bot')
    tok = tokenizer(folders, "qwen2", chat_template=True)
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text("".join(json.dumps(r) + "\n" for r in chats(2)))
    second.write_text(json.dumps(chats(1)[0]) + "\n\n" + json.dumps(bad) + "\n")  # the bad record on line 3
    with pytest.raises(BadInput, match=rf"^line 3 of {second}: message 2 has role='bot'"):
        build({**chat_cfg(first), "data_files": [str(first), str(second)]}, tok)
    as_list = tmp_path / "chats.json"
    as_list.write_text(json.dumps(chats(2) + [bad]))
    with pytest.raises(BadInput, match=rf"^record 3 of {as_list} \(counting from 1\): message 2 has role='bot'"):
        build(chat_cfg(as_list), tok)


def test_the_recipe_stops_on_a_bad_record_with_one_line_and_exit_2(folders, tmp_path, capsys, monkeypatch):
    from recipes.full_finetune_single_device import RECIPE_PATH, recipe_main

    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in chats(3) + [BAD_CHATS[0][0]]))
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
            f"tokenizer.path={folders['qwen2'] / 'tokenizer.json'}",
            "tokenizer.chat_template=True",
            *[f"dataset.{k}={v}" for k, v in chat_cfg(path).items()],
            "model.vocab_size=1024",
        ],
    )
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(SystemExit) as stop:
        recipe_main()
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: line 4 of ") and "role='bot'" in err[-1]
    assert not list((tmp_path / "out").glob("*_*"))  # (no checkpoint, no metrics)


def test_a_family_config_without_its_tokenizer_names_the_file(tmp_path):
    from finetune.settings import read_settings

    cfg = OmegaConf.merge(
        OmegaConf.load(REPO_ROOT / "configs" / "qwen3" / "8B_full_32gb.yaml"),
        {"checkpoint_dir": str(tmp_path), "device": "cpu", "data_dir": str(DATA_DIR)},
    )
    with pytest.raises(
        BadInput,
        match=r"tokenizer.path=.*tokenizer.json does not exist; set checkpoint_dir=DIR \(the "
        r"HF model folder, which holds tokenizer.json\)",
    ):
        read_settings(cfg)
