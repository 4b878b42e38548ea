"""A model folder's chat template in ``chat_template.jinja``, where transformers 5 saves it.

HFTokenizer reads it (and prefers it to tokenizer_config.json's ``chat_template`` when a folder has both, as
transformers does); a folder with neither is one error naming both places; and the checkpoints a run writes carry
the file, so the fine-tuned model keeps its template (transformers reads it back from the checkpoint folder).
"""

import json
import sys
from pathlib import Path

import pytest
from torchtune.data import Message

import support
from conftest import DATA_DIR, REPO_ROOT, TINY_CONFIG
from finetune.base import BadInput
from finetune.data.tokenizer import HFTokenizer

REAL_QWEN = (Path(__file__).with_name("chat_templates") / "qwen2_5.jinja").read_text()  # Qwen2.5 Instruct's own
CONVERSATION = [Message("user", "Name a colour.", masked=True), Message("assistant", "Blue.")]


@pytest.fixture(scope="module")
def bpe():
    return support.train_bpe(support.alpaca_texts(DATA_DIR, 2000), support.TOY_BPE_SIZE)


def qwen_folder(folder: Path, bpe, config_template, jinja=None) -> Path:
    """Qwen2.5's stand-in tokenizer files; the config's chat_template is ``config_template`` (None: the key is
    absent, as in transformers 5's tokenizer_config.json), ``jinja`` goes to chat_template.jinja."""
    support.write_tokenizer(folder, support.TOYS["qwen2_5_7b"], bpe)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    if config_template is not None:
        config["chat_template"] = config_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    if jinja is not None:
        (folder / "chat_template.jinja").write_text(jinja)
    return folder / "tokenizer.json"


def trained_text(tok: HFTokenizer, tokens, mask) -> str:
    return tok.decode([t for t, m in zip(tokens, mask) if not m], skip_special_tokens=False)


def test_chat_template_jinja_is_read_and_wins_over_the_config(bpe, tmp_path):
    in_config = HFTokenizer(str(qwen_folder(tmp_path / "config", bpe, REAL_QWEN)), chat_template=True)
    only_file = HFTokenizer(str(qwen_folder(tmp_path / "file", bpe, None, REAL_QWEN)), chat_template=True)
    # Both: the file's (Qwen2.5's real template, "You are Qwen ...") over the config's stand-in ("You are a helpful
    # assistant.")
    both = HFTokenizer(
        str(qwen_folder(tmp_path / "both", bpe, support.TEMPLATES["qwen2"], REAL_QWEN)), chat_template=True
    )
    stand_in = HFTokenizer(str(qwen_folder(tmp_path / "stand_in", bpe, support.TEMPLATES["qwen2"])), chat_template=True)

    want = in_config.tokenize_messages(CONVERSATION)
    assert "You are Qwen, created by Alibaba Cloud." in in_config.decode(want[0], skip_special_tokens=False)
    assert trained_text(in_config, *want) == "Blue.<|im_end|>"
    assert only_file.tokenize_messages(CONVERSATION) == want
    assert both.tokenize_messages(CONVERSATION) == want
    assert stand_in.tokenize_messages(CONVERSATION) != want
    # The pack cache's key follows the template that is used, wherever it is read from
    assert (
        only_file.fingerprint["chat_template"]
        == both.fingerprint["chat_template"]
        == in_config.fingerprint["chat_template"]
        != stand_in.fingerprint["chat_template"]
    )


def test_plain_format_ignores_the_template_file(bpe, tmp_path):
    """chat_template=False (Alpaca on a base model): no template is read, the tokens and the pack cache's key are
    those of a folder without the file."""
    without = HFTokenizer(str(qwen_folder(tmp_path / "without", bpe, None)))
    with_file = HFTokenizer(str(qwen_folder(tmp_path / "with", bpe, None, "{{ raise_exception('not read') }}")))
    assert with_file.fingerprint == without.fingerprint
    assert with_file.fingerprint["chat_template"] is False
    assert with_file.tokenize_messages(CONVERSATION) == without.tokenize_messages(CONVERSATION)


def test_no_template_anywhere_and_a_bad_file_are_one_error_each(bpe, tmp_path):
    path = qwen_folder(tmp_path / "base", bpe, None)
    with pytest.raises(
        BadInput,
        match=r"has no chat_template \(no chat_template.jinja, none in tokenizer_config.json"
        r".*tokenizer.chat_template=False",
    ):
        HFTokenizer(str(path), chat_template=True)
    (tmp_path / "base" / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(BadInput, match=r"the chat template in .*chat_template.jinja does not parse"):
        HFTokenizer(str(path), chat_template=True)
    (tmp_path / "base" / "chat_template.jinja").write_bytes(b"{{ '\xff' }}")
    with pytest.raises(BadInput, match=r"chat_template.jinja is not UTF-8 text"):
        HFTokenizer(str(path), chat_template=True)


def test_the_checkpoint_folder_keeps_the_template_file(bpe, tmp_path):
    """The unit: write_config_and_tokenizer copies chat_template.jinja from beside tokenizer.path."""
    from finetune.checkpoint import hf_format

    path = qwen_folder(tmp_path / "source", bpe, None, REAL_QWEN)
    out = tmp_path / "out"
    out.mkdir()
    hf = {"bos_token_id": None, "eos_token_id": 0}
    hf_format.write_config_and_tokenizer(out, hf, hf_format.family_of("torchtune.models.qwen2_5.qwen2_5_7b_base"), path)
    assert (out / "chat_template.jinja").read_text() == REAL_QWEN
    assert {p.name for p in out.iterdir()} >= {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_a_chat_run_writes_checkpoints_with_the_template(bpe, tmp_path, monkeypatch):
    """A tiny run on conversations with a transformers-5 folder (its template only in chat_template.jinja): the
    epoch checkpoint holds the file, and transformers' tokenizer read from the checkpoint has the template."""
    from transformers import AutoTokenizer

    from recipes.full_finetune_single_device import RECIPE_PATH, recipe_main

    path = qwen_folder(tmp_path / "source", bpe, None, REAL_QWEN)
    chats = tmp_path / "chats.jsonl"
    records = json.loads((DATA_DIR / "alpaca" / "alpaca_data.json").read_text())[:8]
    chats.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": r["instruction"]},
                        {"role": "assistant", "content": r["output"]},
                    ]
                }
            )
            + "\n"
            for r in records
        )
    )
    out = tmp_path / "out"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            RECIPE_PATH,
            "--config",
            TINY_CONFIG,
            f"data_dir={DATA_DIR}",
            f"output_dir={out}",
            "metric_logger=null",
            "tokenizer._component_=finetune.data.HFTokenizer",
            "~tokenizer.prompt_template",
            f"tokenizer.path={path}",
            "tokenizer.chat_template=True",
            "dataset._component_=torchtune.datasets.chat_dataset",
            "dataset.source=json",
            f"dataset.data_files={chats}",
            "dataset.conversation_column=messages",
            "dataset.conversation_style=openai",
            "dataset.train_on_input=False",
            "model.vocab_size=1024",
            "model.num_layers=1",
            "model.embed_dim=64",
            "model.num_heads=2",
            "model.num_kv_heads=2",
            "batch_size=2",
            "max_steps_per_epoch=1",
        ],
    )
    monkeypatch.chdir(REPO_ROOT)
    with pytest.raises(SystemExit) as done:  # (torchtune's config.parse exits with the recipe's return value)
        recipe_main()
    assert not done.value.code
    checkpoint = out / "epoch_0"
    assert (checkpoint / "chat_template.jinja").read_text() == REAL_QWEN
    assert "chat_template" not in json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert AutoTokenizer.from_pretrained(str(checkpoint)).chat_template == REAL_QWEN
