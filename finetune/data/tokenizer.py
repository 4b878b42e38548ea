"""A model's own tokenizer, read from its Hugging Face folder: ``tokenizer.json`` and ``tokenizer_config.json``.

    tokenizer:
      _component_: finetune.data.HFTokenizer
      path: ${checkpoint_dir}/tokenizer.json   # tokenizer_config.json is read from beside it
      max_seq_len: 512
      chat_template: False                     # True: format conversations with the model's chat template

Every family but Llama 2 (whose SentencePiece ``tokenizer.model`` torchtune's ``llama2_tokenizer`` reads) ships these
two files: the vocabulary, merges and special tokens in tokenizer.json (the ``tokenizers`` library reads it, as
transformers does), and in tokenizer_config.json which tokens are BOS, EOS and padding, and the chat template.

Two formats for a sample's messages:

- ``chat_template: False`` (base models, as the Llama 2 configs): BOS (where the family has one), then each
  message's text, then EOS after each assistant turn. With torchtune's ``alpaca_dataset`` the Alpaca prompt is the
  template, exactly as for Llama 2.
- ``chat_template: True`` (instruct models, chat data): the conversation rendered by the model's own Jinja template
  (tokenizer_config.json's ``chat_template``: ChatML for Qwen, header tokens for Llama 3, ``[INST]`` for Mistral),
  then tokenized in one piece. The loss sees the text of the messages that are trained (the assistant's, or all
  with ``train_on_input``) and the end-of-turn token the template closes each with (``<|im_end|>``, ``<|eot_id|>``,
  ``</s>``), so the model learns to stop; the template's scaffolding (role headers, a default system prompt) is
  masked. Templates that print the date (Llama 3.x) get a fixed one (26 Jul 2024), so a sample tokenizes the same
  on every day and a resumed run sees the same tokens.
"""

import datetime
import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from torchtune.data import Message
from torchtune.data._utils import truncate
from torchtune.modules.transforms import Transform
from torchtune.modules.transforms.tokenizers import ModelTokenizer

from finetune.base import BadInput

TEMPLATE_DATE = datetime.datetime(2024, 7, 26)
CONFIG_FILE = "tokenizer_config.json"


def _token_text(value: Any) -> Optional[str]:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


class HFTokenizer(ModelTokenizer, Transform):
    """torchtune's tokenizer interface (``encode``, ``decode``, ``tokenize_messages``, the dataset transform) over a
    Hugging Face ``tokenizer.json``. Bad files are a BadInput naming them."""

    def __init__(self, path: str, max_seq_len: Optional[int] = None, chat_template: bool = False):
        self.path = Path(path)
        self.max_seq_len = max_seq_len
        try:
            self._tok = Tokenizer.from_file(str(self.path))
        except Exception as e:  # the library's own Exception for JSON or model errors
            raise BadInput(f"tokenizer.path={self.path} is not a Hugging Face tokenizer.json ({str(e)[:200]}); point "
                           "it at the model folder's tokenizer.json (Llama 2's tokenizer.model goes with "
                           "torchtune.models.llama2.llama2_tokenizer)") from None
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
            raise BadInput(f"{config_file} names no eos_token that {self.path.name} knows; copy the model's "
                           f"{CONFIG_FILE} beside {self.path} (it says which token ends a sequence)")
        pad = self._id_of("pad_token")
        self.pad_id = self.eos_id if pad is None else pad  # (padding is never trained: its labels are ignored)
        self.stop_tokens = [self.eos_id]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        self.chat_template = None
        if chat_template not in (True, False):
            raise BadInput(f"tokenizer.chat_template={chat_template!r} must be True or False")
        if chat_template:
            source = self.config.get("chat_template")
            if isinstance(source, list):  # several named templates: the default one
                source = next((t.get("template") for t in source if t.get("name") == "default"), None)
            if not isinstance(source, str):
                raise BadInput(f"tokenizer.chat_template=True but {config_file} has no chat_template (a base "
                               "model's folder?); set tokenizer.chat_template=False to format samples as plain text")
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals.update(raise_exception=self._template_error,
                               strftime_now=lambda fmt: TEMPLATE_DATE.strftime(fmt))
            try:
                self.chat_template = env.from_string(source)
            except TemplateError as e:
                raise BadInput(f"the chat_template in {config_file} does not parse ({e})") from None

    def _id_of(self, key: str) -> Optional[int]:
        text = _token_text(self.config.get(key))
        return None if text is None else self._tok.token_to_id(text)

    @staticmethod
    def _template_error(message: str):
        raise TemplateError(message)

    @property
    def fingerprint(self) -> Dict[str, Any]:
        """What tokenized samples depend on besides tokenizer.json (the pack cache's key folds it in)."""
        return {"config": hashlib.sha256(self._config_bytes).hexdigest(), "chat_template": bool(self.chat_template),
                "template_date": TEMPLATE_DATE.date().isoformat()}

    # -- encoding ---------------------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True, **_) -> List[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def decode(self, token_ids: List[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def tokenize_messages(self, messages: List[Message], add_end_tokens: bool = True,
                          **_) -> Tuple[List[int], List[bool]]:
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
        chat = [{"role": "tool" if m.role == "ipython" else m.role, "content": m.text_content} for m in messages]
        specials = {k: _token_text(v) for k, v in self.config.items() if k.endswith("_token") and _token_text(v)}
        try:
            text = self.chat_template.render(messages=chat, add_generation_prompt=False, **specials)
        except TemplateError as e:
            raise BadInput(f"the chat template of {self.path.parent} refused a conversation ({e}); roles "
                           f"{[m['role'] for m in chat]}") from None
        # Where each message's text sits in the rendered conversation, in order.
        spans, cursor = [], 0
        for m, c in zip(messages, chat):
            content = c["content"]
            at = text.find(content, cursor)
            if at < 0 and content.strip():  # (templates may strip a message's surrounding whitespace)
                content = content.strip()
                at = text.find(content, cursor)
            if at < 0:
                raise BadInput(f"the chat template of {self.path.parent} changes the text of a {m.role} message "
                               "(not found verbatim in the rendered conversation); use tokenizer.chat_template=False")
            spans.append((at, at + len(content), m.masked))
            cursor = at + len(content)
        encoding = self._tok.encode(text, add_special_tokens=False)
        special_ids = set(self.special_tokens.values())
        mask, span, closing = [], 0, False
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            while span < len(spans) and start >= spans[span][1]:
                closing = not spans[span][2]  # just after a trained message's text
                span += 1
            # A token that overlaps a message's text is that message's (" The" with the template's space before it)
            if span < len(spans) and end > spans[span][0]:
                mask.append(spans[span][2])
            else:  # scaffolding; trained only if it is the special token right after a trained message
                mask.append(not (closing and token_id in special_ids))
            closing = False
        return list(encoding.ids), mask

    def __call__(self, sample: Mapping[str, Any], inference: bool = False) -> Mapping[str, Any]:
        messages = sample.pop("messages")
        tokens, mask = self.tokenize_messages(messages, add_end_tokens=not inference)
        sample["tokens"], sample["mask"] = tokens, mask
        return sample


def check_fits_model(tokenizer, hf: dict, tokenizer_path: Path) -> None:
    """The tokenizer against the model built (``hf``: its config.json): no sample longer than its position
    embeddings, no token id beyond its vocabulary. Either is one BadInput naming the key to change."""
    tok_len, model_len = tokenizer.max_seq_len, hf.get("max_position_embeddings")
    if tok_len is not None and model_len is not None and tok_len > model_len:
        raise BadInput(f"tokenizer.max_seq_len={tok_len} is longer than the model's max_seq_len={model_len} (its "
                       f"position embeddings); set tokenizer.max_seq_len={model_len} or lower, or raise model.max_seq_len")
    tok_vocab, model_vocab = getattr(tokenizer, "vocab_size", None), hf["vocab_size"]
    if tok_vocab is not None and tok_vocab > model_vocab:
        raise BadInput(f"the tokenizer ({tokenizer_path}) has {tok_vocab} tokens but the model's vocab_size is "
                       f"{model_vocab}; use the tokenizer of the checkpoint (its tokenizer.json or tokenizer.model) or "
                       "a model with a larger model.vocab_size")
