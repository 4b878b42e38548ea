"""Tool use in chat data (finetune/data/records.py, finetune/data/tokenizer.py): OpenAI's order (system?, user,
assistant with tool_calls, tool, assistant) is accepted where the chat template renders it, with each family's real
template (tests/finetune/data/chat_templates/); the assistant's tool call and reply are trained, the tool's result
never; where nothing renders tools (no chat template, or one that leaves them out) one error names the record and the
fix.

The expected renderings are transformers' ``apply_chat_template`` of the same messages; what is trained is written
out per family.
"""

import json
import logging
import re
from pathlib import Path

import pytest
from tokenizers import AddedToken, Tokenizer

import support
from conftest import DATA_DIR
from finetune.base import BadInput
from finetune.data import loading
from finetune.data.tokenizer import HFTokenizer

TEMPLATES = Path(__file__).with_name("chat_templates")
# family: template file, special tokens, BOS, EOS
FAMILIES = {
    "llama3_1": ("llama3_1.jinja", support.LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>"),
    "llama3_2": ("llama3_2.jinja", support.LLAMA3_SPECIALS, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen2_5": ("qwen2_5.jinja", support.QWEN_SPECIALS, None, "<|im_end|>"),
    "qwen3": ("qwen3.jinja", support.QWEN_SPECIALS, None, "<|im_end|>"),
    "mistral": ("mistral_v0_3.jinja", support.MISTRAL_SPECIALS, "<s>", "</s>"),
}
# A call as OpenAI's API writes it: content null, the arguments a JSON string (Mistral's template wants 9-character
# ids). The templates print the arguments as an object.
CALL = {"id": "call00001", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call00001", "content": "18C"},
    {"role": "assistant", "content": "It is 18C."},
]
PLAIN_CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
# What the loss sees of TOOL_CHAT, decoded: the call as the family writes it, the reply, and each one's end of turn.
TRAINED = {
    "llama3_1": '{"name": "weather", "parameters": {"city": "Paris"}}<|eot_id|>It is 18C.<|eot_id|>',
    "qwen2_5": '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>It is 18C.<|im_end|>',
    "mistral": '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "Paris"}, "id": "call00001"}]</s> It is 18C.</s>',
}
TRAINED["llama3_2"] = TRAINED["llama3_1"]
TRAINED["qwen3"] = TRAINED["qwen2_5"]


TURN = "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}{CALLS}<|im_end|>\n"
CALLS = "{{ (m['tool_calls'] | tojson) if m['tool_calls'] else '' }}"
DROPPING = {
    "drops_calls": "{% for m in messages %}" + TURN.replace("{CALLS}", "") + "{% endfor %}",
    "drops_results": "{% for m in messages %}{% if m['role'] != 'tool' %}"
    + TURN.replace("{CALLS}", CALLS)
    + "{% endif %}{% endfor %}",
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's tokenizer folder: the stand-in BPE, the family's special tokens, its real chat template."""
    bpe = support.train_bpe(support.alpaca_texts(DATA_DIR, 300), support.TOY_BPE_SIZE)
    root = tmp_path_factory.mktemp("tool_tokenizers")
    for family, (template, specials, bos, eos) in FAMILIES.items():
        tok = Tokenizer.from_str(bpe.to_str())
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        (root / family).mkdir()
        tok.save(str(root / family / "tokenizer.json"))
        config = {"bos_token": bos, "eos_token": eos, "chat_template": (TEMPLATES / template).read_text()}
        (root / family / "tokenizer_config.json").write_text(json.dumps(config))
    # A folder whose template renders only user and assistant turns (tests/support.py's Mistral stand-in)
    support.write_tokenizer(root / "user_assistant_only", support.TOYS["mistral_7b"], bpe)
    # Templates that render every turn but silently leave out what tool use adds: an assistant's tool_calls (plain
    # ChatML, the Qwen stand-in's), or the tool messages themselves
    for name, template in DROPPING.items():
        support.write_tokenizer(root / name, support.TOYS["qwen2_5_7b"], bpe)
        config = json.loads((root / name / "tokenizer_config.json").read_text())
        (root / name / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return root


def build(path, tok, **extra):
    cfg = {
        "_component_": "torchtune.datasets.chat_dataset",
        "source": "json",
        "data_files": str(path),
        "conversation_column": "messages",
        "conversation_style": "openai",
        "train_on_input": False,
        "split": "train",
        "packed": False,
        **extra,
    }
    data = support.dataset_settings(cfg)
    return loading.build_dataset(data, tok, log=logging.getLogger(__name__))


def write(tmp_path, *conversations) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def trained_text(tok, sample) -> str:
    return tok.decode([t for t, label in zip(sample["tokens"], sample["labels"]) if label != -100], False)


@pytest.mark.parametrize("family", FAMILIES)
def test_openai_tool_order_trains_the_call_and_the_reply_not_the_result(folders, tmp_path, family):
    from transformers import PreTrainedTokenizerFast

    tok = HFTokenizer(str(folders / family / "tokenizer.json"), chat_template=True)
    ds = build(write(tmp_path, PLAIN_CHAT, TOOL_CHAT), tok)
    sample = ds[1]
    assert trained_text(tok, sample) == TRAINED[family]
    assert "18C" not in trained_text(tok, sample).replace("It is 18C.", "")  # the tool's result is masked
    # The whole sample is what transformers renders for these messages (the arguments as the object they encode)
    _, _, bos, eos = FAMILIES[family]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(folders / family / "tokenizer.json"), bos_token=bos, eos_token=eos)
    hf.chat_template = (TEMPLATES / FAMILIES[family][0]).read_text()
    call = {**CALL, "function": {"name": "weather", "arguments": {"city": "Paris"}}}
    messages = [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": [call]}, *TOOL_CHAT[2:]]
    text = hf.apply_chat_template(messages, tokenize=False, date_string="26 Jul 2024")
    assert tok.decode(sample["tokens"], False) == text
    # A conversation without tools trains as before
    assert trained_text(tok, ds[0]) == (" Hello.</s>" if family == "mistral" else "Hello." + FAMILIES[family][3])


def test_a_tool_result_is_not_trained_even_with_train_on_input(folders, tmp_path):
    tok = HFTokenizer(str(folders / "qwen2_5" / "tokenizer.json"), chat_template=True)
    system = {"role": "system", "content": "Use tools."}
    several = [  # two calls answered by two results, as OpenAI writes parallel calls
        TOOL_CHAT[0],
        {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call00002"}]},
        {"role": "tool", "tool_call_id": "call00001", "content": "18C"},
        {"role": "tool", "tool_call_id": "call00002", "content": "19C"},
        TOOL_CHAT[3],
    ]
    ds = build(write(tmp_path, [system, *TOOL_CHAT], several), tok, train_on_input=True)
    trained = trained_text(tok, ds[0])
    assert trained.startswith("Use tools.<|im_end|>Weather in Paris?<|im_end|><tool_call>")  # user text: trained
    assert "<tool_response>" not in trained and trained.count("18C") == 1  # (the reply's, not the result's)
    trained = trained_text(tok, ds[1])
    assert trained.count("<tool_call>") == 2 and "19C" not in trained


def test_without_a_chat_template_tool_messages_are_one_error(folders, tmp_path):
    tok = HFTokenizer(str(folders / "qwen2_5" / "tokenizer.json"))  # the plain format: no template
    with pytest.raises(
        BadInput,
        match=r"line 2 of .*chats.jsonl: message 2 is a tool message or calls tools, which only a chat template "
        r"renders; set tokenizer.chat_template=True",
    ):
        build(write(tmp_path, PLAIN_CHAT, TOOL_CHAT), tok)


def test_a_template_that_cannot_render_tools_stops_before_training(folders, tmp_path):
    tok = HFTokenizer(str(folders / "user_assistant_only" / "tokenizer.json"), chat_template=True)
    with pytest.raises(BadInput, match=r"line 3 of .*, the first with tool messages: the chat template .*refused"):
        build(write(tmp_path, PLAIN_CHAT, PLAIN_CHAT, TOOL_CHAT), tok)


@pytest.mark.parametrize(
    "folder, what",
    [("drops_calls", r"renders no tool_calls \(message 2, assistant,"), ("drops_results", r"renders no tool messages")],
    ids=["calls", "results"],
)
def test_a_template_that_leaves_tools_out_stops_before_training(folders, tmp_path, folder, what):
    """A template that renders the conversation but not its tool calls (the call turn would train nothing: an
    empty reply) or not the tool results (the reply would be trained without what it answers): one error naming
    the template and the record, at setup; before, the run trained the last reply only, without a word."""
    tok = HFTokenizer(str(folders / folder / "tokenizer.json"), chat_template=True)
    with pytest.raises(BadInput) as e:
        build(write(tmp_path, PLAIN_CHAT, PLAIN_CHAT, TOOL_CHAT), tok)
    line = str(e.value)
    assert re.match(rf"line 3 of {tmp_path}/chats.jsonl.*: the chat template in {folders / folder}/tokenizer_config"
                    rf"\.json {what}", line), line  # fmt: skip
    assert "\n" not in line and "use a model whose template renders tool" in line


BAD = [
    (
        [TOOL_CHAT[0], TOOL_CHAT[2], TOOL_CHAT[3]],
        r"line 2 of .*: message 2 is a tool message that follows no assistant message",
    ),
    (
        [
            TOOL_CHAT[0],
            {"role": "assistant", "content": "Which city?"},
            {"role": "user", "content": "Paris"},
            *TOOL_CHAT[2:],
        ],
        r"line 2 of .*: message 4 is a tool message that follows no assistant message",
    ),
    (
        [TOOL_CHAT[0], {**TOOL_CHAT[1], "tool_calls": [{**CALL, "function": {"name": "w", "arguments": "{city"}}]}],
        r"line 2 of .*: message 2 \(assistant\) calls w with arguments '\{city', not JSON",
    ),
    (
        [TOOL_CHAT[0], {"role": "assistant", "content": "x"}, {**TOOL_CHAT[0], "tool_calls": [CALL]}],
        r"line 2 of .*: message 3 \(user\) has tool_calls=.*only an assistant message calls tools",
    ),
    ([TOOL_CHAT[0], {"role": "assistant", "content": None}], r"message 2 \(assistant\) has content=.None., not text"),
]


@pytest.mark.parametrize("bad, message", BAD, ids=["tool-first", "tool-after-user", "arguments", "user-call", "null"])
def test_a_bad_tool_record_is_one_error_naming_it(folders, tmp_path, bad, message):
    tok = HFTokenizer(str(folders / "qwen2_5" / "tokenizer.json"), chat_template=True)
    with pytest.raises(BadInput, match=message):
        build(write(tmp_path, PLAIN_CHAT, bad), tok)
