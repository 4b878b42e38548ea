"""A model's own tokenizer, read from its Hugging Face folder: ``tokenizer.json``, ``tokenizer_config.json`` and
``chat_template.jinja``.

    tokenizer:
      _component_: finetune.data.HFTokenizer
      path: ${checkpoint_dir}/tokenizer.json   # the other files are read from beside it
      max_seq_len: 512
      chat_template: False                     # True: format conversations with the model's chat template

Every family but Llama 2 (whose SentencePiece ``tokenizer.model`` torchtune's ``llama2_tokenizer`` reads) ships these
files: the vocabulary, merges and special tokens in tokenizer.json (the ``tokenizers`` library reads it, as
transformers does), and in tokenizer_config.json which tokens are BOS, EOS and padding. The chat template is
``chat_template.jinja`` (where transformers 5 saves it) or else tokenizer_config.json's ``chat_template``; when a
folder has both, the file wins, as in transformers.

Two formats for a sample's messages:

- ``chat_template: False`` (base models, as the Llama 2 configs): BOS (where the family has one), then each
  message's text, then EOS after each assistant turn. With torchtune's ``alpaca_dataset`` the Alpaca prompt is the
  template, exactly as for Llama 2.
- ``chat_template: True`` (instruct models, chat data): the conversation rendered by the model's own Jinja template
  (ChatML for Qwen, header tokens for Llama 3, ``[INST]`` for Mistral), then tokenized in one piece. The loss sees
  the tokens of the messages that are trained (the assistant's, or all with ``train_on_input``) and the end-of-turn
  token the template closes each with (``<|im_end|>``, ``<|eot_id|>``, ``</s>``), so the model learns to stop; the
  template's scaffolding (role headers, a default system prompt, Qwen3's empty think block) is masked. Templates
  that print the date (Llama 3.x) get a fixed one (26 Jul 2024), so a sample tokenizes the same on every day and a
  resumed run sees the same tokens.
"""

import datetime
import hashlib
import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from jinja2 import TemplateError
from tokenizers import Tokenizer
from torchtune.data import Message
from torchtune.data._utils import truncate
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import ModelTokenizer

from finetune.base import BadInput
from finetune.data.chat_template import ChatTemplate

TEMPLATE_DATE = datetime.datetime(2024, 7, 26)
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # transformers 5 saves a folder's chat template here, not in CONFIG_FILE
# Text that makes a backtracking pre-tokenizer regex (tokenizer.json's Split pattern) show itself: a run of each
# character class its patterns tell apart, ended by each other class (a catastrophic pattern backtracks where a run
# fails to match at its end). A published tokenizer encodes it in milliseconds.
PROBE_TEXT = "".join(c * 500 + d for c in "a1 !é\n" for d in "a1 !é\n" if c != d) + "Hello, world! It's 42."
PROBE_SECONDS = 5.0
# A text is refused before it is tokenized when it is longer than TOO_LONG times tokenizer.max_seq_len tokens of the
# vocabulary's longest: whatever the text, it then holds more than TOO_LONG times the tokens a sample keeps (the
# rest is cut), and tokenizing costs about 1 us and 200 bytes a character (a 16 M-character rendering: 45 s and
# 3.5 GiB, for 512 tokens). A factor, not a cut: a record a few times too long is truncated after tokenizing, as
# it always was, with the same tokens; cutting the text first could split a word and change the kept tokens.
TOO_LONG = 8
UNCUT_CHARS = 1 << 22  # the bound with tokenizer.max_seq_len=null (every token kept): beyond any model's context
# SentencePiece's pieces are short (Llama 2's longest: 16 characters), so the factor alone would refuse a real record
# at a small max_seq_len (Alpaca's longest text, 4,181 characters, at max_seq_len=32): below this many characters a
# text costs a fraction of a second to tokenize, and is cut as before.
SENTENCEPIECE_MIN_CHARS = 1 << 18
# What a template that leaves out a part of tool use costs the training, by the part left out.
_LEFT_OUT = {
    "tool_calls": ("its calls", "the call would not be trained (its turn renders as a reply without text)"),
    "tool messages": ("it", "the reply after it would be trained without the result it answers"),
}


def sentencepiece_text_bound(tokenizer) -> Optional[Tuple[int, str]]:
    """For torchtune's SentencePiece tokenizers (Llama 2's ``tokenizer.model``), which tokenize any text whole: the
    most characters a record's text may have, by the same TOO_LONG factor as HFTokenizer's own bound, and the words
    that say why; None for any other tokenizer (HFTokenizer bounds its texts itself)."""
    sp = getattr(getattr(tokenizer, "_spm_model", None), "spm_model", None)
    if sp is None:
        return None
    if tokenizer.max_seq_len is None:
        why = "and tokenizer.max_seq_len=null keeps every token (set tokenizer.max_seq_len, e.g. 4096)"
        return UNCUT_CHARS, f"more than {UNCUT_CHARS:,}, {why}"
    longest = max(len(sp.id_to_piece(i)) for i in range(sp.get_piece_size()))  # (32,000 pieces: milliseconds)
    bound = max(TOO_LONG * tokenizer.max_seq_len * longest, SENTENCEPIECE_MIN_CHARS)
    return bound, (
        f"more than {bound:,} (the larger of {TOO_LONG} x tokenizer.max_seq_len={tokenizer.max_seq_len} tokens of "
        f"at most {longest} characters, and {SENTENCEPIECE_MIN_CHARS:,}): tokenizing it would cost seconds and "
        "gigabytes for tokens that are cut"
    )


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _common_prefix(a: List[int], b: List[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _common_suffix(a: List[int], b: List[int], limit: int) -> int:
    n = 0
    while n < limit and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


class HFTokenizer(ModelTokenizer, Transform):
    """torchtune's tokenizer interface (``encode``, ``decode``, ``tokenize_messages``, the dataset transform) over a
    Hugging Face ``tokenizer.json``. Bad files are a BadInput naming them."""

    # Some record can make it fail (its pre-tokenizer regex panics on a text, the chat template refuses a
    # conversation, a rendering is too long to tokenize): finetune/data/loading.py then tokenizes every record at
    # setup, packed or not, so that none stops the run mid-epoch.
    refuses_records = True

    def __init__(self, path: str, max_seq_len: Optional[int] = None, chat_template: bool = False):
        self.path = Path(path)
        self.max_seq_len = max_seq_len
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library's own Exception for JSON or model errors
            raise BadInput(
                f"tokenizer.path={self.path} is not a Hugging Face tokenizer.json ({str(e)[:200]}); point "
                "it at the model folder's tokenizer.json (Llama 2's tokenizer.model goes with "
                "torchtune.models.llama2.llama2_tokenizer)"
            ) from None
        self._probe_tokenizer()
        self._longest = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        self._max_chars = UNCUT_CHARS if max_seq_len is None else TOO_LONG * max_seq_len * self._longest
        config_file = self.path.with_name(CONFIG_FILE)
        self._config_bytes = config_file.read_bytes() if config_file.is_file() else b""
        try:
            self.config: Dict[str, Any] = json.loads(self._config_bytes) if self._config_bytes else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise BadInput(f"{config_file} is not valid JSON ({e}); re-copy it from the model folder") from None

        self.special_tokens = {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.bos_id = self._id_of("bos_token")
        self.eos_id = self._id_of("eos_token")
        if self.eos_id is None:
            raise BadInput(
                f"{config_file} names no eos_token that {self.path.name} knows; copy the model's "
                f"{CONFIG_FILE} beside {self.path} (it says which token ends a sequence)"
            )
        pad = self._id_of("pad_token")
        self.pad_id = self.eos_id if pad is None else pad  # (padding is never trained: its labels are ignored)
        self.stop_tokens = [self.eos_id]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # The tokens that can end a turn: the special ones (<|im_end|>, <|eot_id|>, </s>, [/INST]) and EOS.
        self._turn_ends = {*self.special_tokens.values(), self.eos_id}

        self.chat_template = None
        self._template_source: Optional[str] = None
        if chat_template not in (True, False):
            raise BadInput(f"tokenizer.chat_template={chat_template!r} must be True or False")
        if chat_template:
            source, where = self._read_template(config_file)
            # (compiled and rendered with a time and size bound, in finetune/data/chat_template.py's sandbox)
            self.chat_template = ChatTemplate(
                source,
                where,
                variables={
                    k: _token_text(v) for k, v in self.config.items() if k.endswith("_token") and _token_text(v)
                },
                functions=dict(
                    raise_exception=self._template_error, strftime_now=lambda fmt: TEMPLATE_DATE.strftime(fmt)
                ),
            )
            probe = self.chat_template.probe()
            if probe is not None and len(probe) > self._max_chars:
                raise BadInput(
                    f"the chat template in {where} renders a two-message conversation to {self._too_long(probe)}; "
                    f"replace {where.name} with the model's published template"
                )
            self._template_source = source

    def _read_template(self, config_file: Path) -> Tuple[str, Path]:
        """The chat template's source and its file: chat_template.jinja beside tokenizer.json, else
        tokenizer_config.json's ``chat_template`` (its default one, where it names several)."""
        template_file = self.path.with_name(TEMPLATE_FILE)
        if template_file.is_file():
            try:
                return template_file.read_text(encoding="utf-8"), template_file
            except UnicodeDecodeError as e:
                raise BadInput(f"{template_file} is not UTF-8 text ({e}); re-copy it from the model folder") from None
        source = self.config.get("chat_template")
        if isinstance(source, list):  # several named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise BadInput(
                f"tokenizer.chat_template=True but {self.path.parent} has no chat_template (no "
                f"{TEMPLATE_FILE}, none in {CONFIG_FILE}: a base model's folder?); copy the instruct "
                "model's chat_template.jinja beside tokenizer.json, or set tokenizer.chat_template=False to "
                "format samples as plain text"
            )
        return source, config_file

    def _ids(self, text: str) -> List[int]:
        """The text's token ids. A pre-tokenizer regex that backtracks past its limit makes the Rust library panic:
        a PanicException, which derives from BaseException (so ``except Exception`` lets it through) and is caught
        here by its name (pyo3 exports no class to import)."""
        try:
            return self._tok.encode(text, add_special_tokens=False).ids
        except BaseException as e:
            if type(e).__name__ != "PanicException":
                raise
            raise BadInput(
                f"{self.path} failed to tokenize a text of {len(text):,} characters ({str(e)[:200]}): its "
                "pre_tokenizer's Split regex backtracks without bound; re-copy tokenizer.json from the model's "
                "published folder"
            ) from None

    def _bounded_ids(self, text: str, what: str) -> List[int]:
        """``_ids`` of a sample's text (``what`` it is, for the error) within the bound of TOO_LONG."""
        if len(text) > self._max_chars:
            raise BadInput(
                f"{what} is {self._too_long(text)}; shorten or drop that record, or raise tokenizer.max_seq_len"
            )
        return self._ids(text)

    def _too_long(self, text: str) -> str:
        if self.max_seq_len is None:
            return (
                f"{len(text):,} characters, more than {UNCUT_CHARS:,}, and tokenizer.max_seq_len=null keeps every "
                "token (set tokenizer.max_seq_len, e.g. 4096)"
            )
        return (
            f"{len(text):,} characters, more than {TOO_LONG} x tokenizer.max_seq_len={self.max_seq_len} tokens of at "
            f"most {self._longest} characters ({self._max_chars:,}): tokenizing it would cost seconds and gigabytes "
            "for tokens that are cut"
        )

    def _probe_tokenizer(self) -> None:
        """Encode PROBE_TEXT once, now: a pre-tokenizer regex that backtracks without bound is refused before any
        data is read. The Rust library's panic prints its own report to the process's stderr, which is silenced
        for this one call (the error line says what happened).

        The bound on a merely slow regex is measured after the fact rather than enforced: a call into Rust cannot
        be interrupted from Python, and a worker process to run it in would cost every run a process start.
        Oniguruma's own retry limit turns the usual catastrophic patterns into a panic within a fraction of a
        second, so what remains is a slow but finishing regex, refused here before it slows a whole dataset."""
        start = time.monotonic()
        with _quiet_stderr():
            self._ids(PROBE_TEXT)
        took = time.monotonic() - start
        if took > PROBE_SECONDS:
            raise BadInput(
                f"{self.path} took {took:.1f} s to tokenize {len(PROBE_TEXT):,} characters (a published tokenizer "
                "takes milliseconds): its pre_tokenizer's regex backtracks; re-copy tokenizer.json from the model's "
                "published folder"
            )

    def _id_of(self, key: str) -> Optional[int]:
        text = _token_text(self.config.get(key))
        return None if text is None else self._tok.token_to_id(text)

    @staticmethod
    def _template_error(message: str):
        raise TemplateError(message)

    @property
    def fingerprint(self) -> Dict[str, Any]:
        """What tokenized samples depend on besides tokenizer.json (the pack cache's key folds it in): the config,
        and with a chat template its source and how messages are masked in it."""
        template = (
            False
            if self._template_source is None
            else hashlib.sha256(f"masked by token boundaries\n{self._template_source}".encode()).hexdigest()
        )
        return {
            "config": hashlib.sha256(self._config_bytes).hexdigest(),
            "chat_template": template,
            "template_date": TEMPLATE_DATE.date().isoformat(),
        }

    # -- encoding ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **_) -> List[int]:
        ids = self._bounded_ids(text, "a message's text")
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def tokenize_messages(
        self, messages: List[Message], add_end_tokens: bool = True, **_
    ) -> Tuple[List[int], List[bool]]:
        """Tokens and their mask (True: not trained) for one sample's messages."""
        if self.chat_template is not None:
            tokens, mask = self._templated(messages)
        else:
            tokens, mask = self._plain(messages, add_end_tokens)
        if self.max_seq_len is not None and len(tokens) > self.max_seq_len:
            tokens = truncate(tokens, self.max_seq_len, self.eos_id if add_end_tokens else None)
            mask = truncate(mask, self.max_seq_len, messages[-1].masked if add_end_tokens else None)
        return tokens, mask

    def _plain(self, messages: List[Message], add_end_tokens: bool) -> Tuple[List[int], List[bool]]:
        tokens: List[int] = []
        mask: List[bool] = []
        start_of_turn = True
        for message in messages:
            if start_of_turn and self.bos_id is not None:
                tokens.append(self.bos_id)
                mask.append(message.masked)
            ids = self.encode(message.text_content, add_bos=False, add_eos=False)
            tokens += ids
            mask += [message.masked] * len(ids)
            start_of_turn = message.role == "assistant"
            if start_of_turn and add_end_tokens:  # the end of a turn
                tokens.append(self.eos_id)
                mask.append(message.masked)
        return tokens, mask

    def _templated(self, messages: List[Message]) -> Tuple[List[int], List[bool]]:
        """The whole conversation rendered and tokenized, masked but for each trained message's tokens.

        A message's tokens are found by comparing token sequences, never by searching the rendered text (a reply
        such as ``a`` or ``assistant`` also occurs in the template's headers). The first i+1 messages rendered twice,
        as they are and with message i's text emptied, give two token sequences that differ exactly in that text:
        their common start is what comes before it (earlier turns, the role header, a default system prompt, Qwen3's
        empty think block), their common end what the template closes the turn with. Trained: the text's tokens (a
        token that holds template text too, such as Mistral's space before a reply's first word, counts as the
        text's), and of the closing ones those up to the last special token (``<|im_end|>``, not the newline after
        it).

        The first i+1 messages must render as the start of the whole conversation (the template is prefix-stable),
        except that a reply may lose the scaffolding before its text once later turns follow (Qwen3 drops the think
        block of past replies): its tokens must then directly follow its generation prompt (the first i messages
        rendered with ``add_generation_prompt=True``). Otherwise the conversation is refused, rather than some other
        tokens trained.

        Tool use reaches the template as transformers' ``apply_chat_template`` passes it: a message's
        ``template_fields`` (finetune/data/records.py sets an assistant's ``tool_calls``, a tool message's
        ``tool_call_id`` and ``name``) are keys of its dict. An assistant's tool calls are trained with its text:
        emptying message i empties both."""
        chat = [
            {"role": "tool" if m.role == "ipython" else m.role, "content": m.text_content}
            | getattr(m, "template_fields", {})
            for m in messages
        ]
        tokens = self._render(chat)  # (first: a template that refuses the conversation says so)
        if any(m.get("tool_calls") or m["role"] == "tool" for m in chat):
            self._check_tools_rendered(chat)
        mask = [True] * len(tokens)
        for i, message in enumerate(messages):
            if not message.masked:
                start, trained = self._find_message(chat, i, tokens)
                mask[start : start + len(trained)] = [False] * len(trained)
                if self.max_seq_len is not None and start >= self.max_seq_len:
                    break  # the later messages are cut too: no more renderings of ever longer prefixes
        return tokens, mask

    def _check_tools_rendered(self, chat: List[Dict[str, Any]]) -> None:
        """Every tool call and tool result changes the rendering. A template that leaves either out renders another
        conversation than the data holds, silently: a call turn with no text then trains nothing, and a reply is
        trained without the result it answers. Each is compared with the rendering of the conversation up to it
        without it (text only, one more rendering per tool message: conversations without tools pay nothing)."""
        render = self.chat_template.render
        for i, message in enumerate(chat):
            if message.get("tool_calls"):
                what, without = "tool_calls", chat[:i] + [{k: v for k, v in message.items() if k != "tool_calls"}]
            elif message["role"] == "tool":
                what, without = "tool messages", chat[:i]
            else:
                continue
            if render(chat[: i + 1]) == render(without):
                it, lost = _LEFT_OUT[what]
                raise BadInput(
                    f"the chat template in {self.chat_template.where} renders no {what} (message {i + 1}, "
                    f"{message['role']}, renders the same without {it}): {lost}; use a model whose template renders "
                    "tool calls and results, or drop the tool messages"
                )

    def _render(self, chat: List[Dict[str, str]], generation_prompt: bool = False) -> List[int]:
        return self._bounded_ids(
            self.chat_template.render(chat, generation_prompt), "the chat template's rendering of a conversation"
        )

    def _find_message(self, chat: List[Dict[str, str]], i: int, tokens: List[int]) -> Tuple[int, List[int]]:
        """Where message ``i``'s trained tokens start in ``tokens`` (the whole conversation's), and what they are."""
        upto = self._render(chat[: i + 1])
        blank = self._render(chat[:i] + [{k: v for k, v in chat[i].items() if k != "tool_calls"} | {"content": ""}])
        start = _common_prefix(upto, blank)
        after = _common_suffix(upto, blank, min(len(upto), len(blank)) - start)
        closing = upto[len(upto) - after :]
        ends = [k for k, t in enumerate(closing) if t in self._turn_ends]
        trained = upto[start : len(upto) - after] + (closing[: ends[-1] + 1] if ends else [])
        if tokens[: start + len(trained)] == upto[: start + len(trained)]:
            return start, trained
        if chat[i]["role"] == "assistant" and i:  # a past reply without the scaffolding before its text (Qwen3)
            prompt = self._render(chat[:i], generation_prompt=True)
            if tokens[: len(prompt)] == prompt and tokens[len(prompt) : len(prompt) + len(trained)] == trained:
                return len(prompt), trained
        raise BadInput(
            f"the chat template of {self.path.parent} renders message {i} ({chat[i]['role']}) otherwise once later "
            f"messages follow, so its tokens in the conversation are unknown (rendering the first {i + 1} messages "
            "must begin the rendering of all of them); put a template that renders every turn the same way in "
            f"{TEMPLATE_FILE} beside tokenizer.json, or end each conversation at its last trained message"
        )

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


@contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the duration (what native code writes there too)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def check_fits_model(tokenizer, hf: dict, tokenizer_path: Path) -> None:
    """The tokenizer against the model built (``hf``: its config.json): no sample longer than its position
    embeddings, no token id beyond its vocabulary. Either is one BadInput naming the key to change."""
    tok_len, model_len = tokenizer.max_seq_len, hf.get("max_position_embeddings")
    if tok_len is not None and model_len is not None and tok_len > model_len:
        raise BadInput(
            f"tokenizer.max_seq_len={tok_len} is longer than the model's max_seq_len={model_len} (its "
            f"position embeddings); set tokenizer.max_seq_len={model_len} or lower, or raise model.max_seq_len"
        )
    tok_vocab, model_vocab = getattr(tokenizer, "vocab_size", None), hf["vocab_size"]
    if tok_vocab is not None and tok_vocab > model_vocab:
        raise BadInput(
            f"the tokenizer ({tokenizer_path}) has {tok_vocab} tokens but the model's vocab_size is "
            f"{model_vocab}; use the tokenizer of the checkpoint (its tokenizer.json or tokenizer.model) or "
            "a model with a larger model.vocab_size"
        )
