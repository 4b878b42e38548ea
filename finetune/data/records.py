"""What every record of a dataset must be before training starts, and the first one that is not named in one
``error:`` line, never a traceback at some step mid-run. A record is named as the user finds it in an editor
(``RecordNames``): a JSON-lines record by its file and line, any other by its place counting from 1, said so; the
messages of a conversation are counted from 1 too:

- **readable**: a local JSON, JSONL, CSV or text file is valid UTF-8, checked byte by byte before HF ``datasets``
  reads it (its JSON reader keeps a bad byte inside a string and the sample fails only when read); Parquet and Arrow
  tables, and hub data, are checked as loaded Arrow strings; a JSON file that does not parse names its line;
- **complete**: instruction records have their text fields (``check_text_records``);
- **a conversation** the tokenizer can format (``check_chat_records``): known roles, text content, something to
  train on, and the turn order torchtune's ``validate_messages`` asks for, widened to OpenAI's tool-use order
  (system?, user, assistant with ``tool_calls``, tool, ..., assistant) where the chat template renders it.

OpenAI-style conversations are turned into messages by ``OpenAIChat`` rather than torchtune's ``OpenAIToMessages``,
so that tool messages and an assistant's ``tool_calls`` reach the chat template as transformers'
``apply_chat_template`` passes them.
"""

import bz2
import codecs
import gzip
import json
import lzma
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from torchtune.data import Message, OpenAIToMessages
from torchtune.modules.transforms import Transform

from finetune.base import BadInput

# -- readable files -------------------------------------------------------------------------------------------------

# HF datasets' loaders whose files are text; their bytes are checked before the loader reads them.
TEXT_SOURCES = ("json", "csv", "text")
# Compressed files as datasets opens them (decompressed on the fly); other compressions are left to datasets.
_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_BLOCK = 1 << 24  # bytes read at a time: a big file is streamed, never held whole
_LONG_LINE = 1 << 26  # columns beyond this many bytes into a line are counted in bytes, not characters


def local_text_files(cfg_dataset: Mapping[str, Any]) -> List[Path]:
    """The local files ``dataset.data_files`` names when ``dataset.source`` reads text (a string, a list, or a dict
    of splits); [] for Parquet, Arrow or a hub dataset."""
    if cfg_dataset.get("source") not in TEXT_SOURCES:
        return []
    files = cfg_dataset.get("data_files")
    if files is None:
        return []
    if isinstance(files, str):
        files = [files]
    elif hasattr(files, "values"):
        files = [f for v in files.values() for f in ([v] if isinstance(v, str) else v)]
    return [Path(f) for f in files if Path(f).is_file()]


def _open(path: Path):
    opener = _OPENERS.get(path.suffix)
    return opener(path, "rb") if opener else open(path, "rb")


def check_utf8(path: Path, key: str = "dataset") -> None:
    """``path`` is UTF-8 text throughout, or a BadInput naming the line and column of the first byte that is not
    (and the file as ``key.data_files``: dataset's, or dataset_val's).
    Streamed in 16 MiB blocks through an incremental decoder (a multi-byte character may straddle two blocks), about
    a second per GB; only the error path reads a line twice."""
    if path.suffix in (".zst", ".zip", ".lz4"):
        return  # datasets decompresses these itself; their raw bytes are not the text
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = line = 0  # the file offset of the block, the newlines before it
    line_start = 0  # the file offset where the current line begins
    with _open(path) as f:
        while True:
            block = f.read(_BLOCK)
            pending = len(decoder.getstate()[0])  # bytes of a character the last block left unfinished
            try:
                decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                at = offset - pending + e.start  # the file offset of the bad byte
                head = block[: max(at - offset, 0)]
                line += head.count(b"\n")
                if b"\n" in head:
                    line_start = offset + head.rfind(b"\n") + 1
                bad = (e.object[e.start : e.start + 1] or b"?")[0]
                column = _column(path, line_start, at)
                raise BadInput(
                    f"{key}.data_files={path} line {line + 1} is not valid UTF-8 (byte 0x{bad:02x} at column "
                    f"{column}); fix or drop the record (or re-save the file as UTF-8)"
                ) from None
            if not block:
                return
            newlines = block.count(b"\n")
            if newlines:
                line += newlines
                line_start = offset + block.rfind(b"\n") + 1
            offset += len(block)


def _column(path: Path, line_start: int, at: int) -> int:
    """The 1-based character column of file offset ``at`` in the line that begins at ``line_start`` (everything
    before it on the line is valid UTF-8); the byte column where that is far into a long line (a minified JSON
    file is one line), so as not to read it all again."""
    if at - line_start > _LONG_LINE:
        return at - line_start + 1
    with _open(path) as f:
        f.seek(line_start)
        return len(f.read(at - line_start).decode("utf-8")) + 1


def _json_lines(path: Path, field: Optional[str] = None) -> bool:
    """Whether datasets reads ``path`` as JSON lines: a file that begins with ``[`` (or any file, given ``field``)
    is one JSON document, any other one record a line."""
    with _open(path) as f:
        head = f.read(len(codecs.BOM_UTF8) + 1)
    return field is None and head.removeprefix(codecs.BOM_UTF8)[:1] != b"["


def json_error(path: Path, field: Optional[str] = None) -> Optional[str]:
    """Where a JSON or JSONL file does not parse, as 'line N ... (why)', or None when it parses."""
    if not _json_lines(path, field):
        try:
            with _open(path) as f:
                json.loads(f.read().decode("utf-8-sig"))
        except json.JSONDecodeError as e:
            return f"line {e.lineno} is not valid JSON ({e.msg} at column {e.colno})"
        return None
    with _open(path) as f:
        for n, raw in enumerate(f, 1):
            text = raw.decode("utf-8-sig" if n == 1 else "utf-8").strip()
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                return f"line {n} is not valid JSON ({e.msg} at column {e.colno}; a JSONL file holds one record a line)"
            if not isinstance(record, dict):
                return f"line {n} is {type(record).__name__} {text[:40]!r}, not a JSON object (one record a line)"
    return None


class RecordNames:
    """How an error names record ``i`` of the loaded table (0-based there): ``line 4 of data.jsonl`` for JSON lines
    (datasets skips blank lines, so the line is found by counting the others, on the error path only), ``record 4
    of data.json (counting from 1)`` for a JSON list, CSV, Parquet or hub data. ``where`` names the whole dataset,
    ``key`` its config section."""

    def __init__(
        self, where, cfg_dataset: Optional[Mapping[str, Any]] = None, text_files: List[Path] = (), key: str = "dataset"
    ):
        self.where = where
        self.key = key  # the dataset's config key, for an error that names one of its keys (dataset_val.column_map)
        cfg_dataset = cfg_dataset or {}
        files = cfg_dataset.get("data_files")
        # Lines only where the table is those files' records in order: one file or a list, not a dict of splits.
        listed = [files] if isinstance(files, str) else [] if files is None or hasattr(files, "values") else files
        self._lines = (
            len(listed) == len(text_files) > 0  # (a glob or a missing file: its records' lines are not known)
            and cfg_dataset.get("source") == "json"
            and all(_json_lines(path, cfg_dataset.get("field")) for path in text_files)
        )
        self._files = list(text_files)

    def __call__(self, i: int) -> str:
        if self._lines:
            seen = 0
            for path in self._files:
                with _open(path) as f:
                    for n, raw in enumerate(f, 1):
                        if raw.strip():
                            if seen == i:
                                return f"line {n} of {path}"
                            seen += 1
        return f"record {i + 1} of {self.where} (counting from 1)"


def check_table_utf8(ds, names: RecordNames) -> None:
    """Every string of a loaded Arrow table (Parquet, Arrow, hub data) is valid UTF-8: Arrow does not check the
    strings a Parquet file holds, and a bad one fails only when its sample is read, mid-run. A full validation of
    each column (native, about a GB per second); the first bad record is then found by bisection (error path only)."""
    import numpy as np
    import pyarrow as pa

    table = getattr(getattr(getattr(ds, "_data", None), "data", None), "table", None)
    if not isinstance(table, pa.Table):
        return
    for name in table.column_names:
        column = table.column(name)
        if _valid(column):
            continue
        lo, hi = 0, len(column)  # the first bad row is in [lo, hi)
        while hi - lo > 1:  # (rows copied out by take: a slice of nested values still validates all of them)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if _valid(column.take(pa.array(np.arange(lo, mid)))) else (lo, mid)
        raise BadInput(
            f"{names(lo)}: field '{name}' is not valid UTF-8 text; fix or drop that record (or re-write "
            "the file with its strings as UTF-8)"
        )


def _valid(column) -> bool:
    import pyarrow as pa

    try:
        column.validate(full=True)
    except pa.ArrowInvalid:
        return False
    return True


# -- instruction records --------------------------------------------------------------------------------------------

ALPACA_TEXT_FIELDS = ("instruction", "input", "output")
ALPACA_REQUIRED = ("instruction", "output")
INSTRUCT_FIELDS = ("input", "output")


def check_text_records(
    ds, column_map: dict, names: RecordNames, fields=ALPACA_TEXT_FIELDS, required=ALPACA_REQUIRED
) -> None:
    """Instruction data (Alpaca's instruction, input and output; instruct_dataset's input and output): the
    ``required`` fields are present in every record, and ``fields`` are text. The whole table is checked now (Arrow
    null counts, milliseconds) rather than fail at some step mid-run."""
    table = getattr(ds, "_data", None)
    if not hasattr(table, "column_names"):
        return
    needs = " and ".join(required)
    for field in fields:  # text, not numbers or booleans
        column = column_map.get(field, field)
        if column not in table.column_names:
            continue
        feature = getattr(table, "features", {}).get(column)
        if getattr(feature, "dtype", None) in ("string", "large_string", "null"):
            continue  # an Arrow string column: every value is text or missing
        # Numbers, booleans, or a mix (datasets then stores the column as JSON): find the first non-text.
        bad = next(((i, v) for i, v in enumerate(table[column]) if v is not None and not isinstance(v, str)), None)
        if bad is not None:
            raise BadInput(
                f"{names(bad[0])}: field '{column}' is {bad[1]!r} ({type(bad[1]).__name__}), not a "
                f"string; fix or drop that record ({', '.join(fields)} are text)"
            )
    for field in required:
        column = column_map.get(field, field)
        if column not in table.column_names:
            raise BadInput(
                f"the records in {names.where} have no '{column}' field; each needs {needs} (map other names "
                f"with {names.key}.column_map)"
            )
        values = table.data.column(column)
        if values.null_count:
            row = values.is_null().to_pylist().index(True)
            raise BadInput(f"{names(row)} has no '{column}'; fix or drop that record (each needs {needs})")


def check_text_lengths(ds, columns, bound, names: RecordNames, text_key: Optional[str] = None) -> None:
    """No text of ``columns`` longer than ``bound`` = (characters, why): a tokenizer that takes any text (torchtune's
    SentencePiece) would tokenize such a text whole, seconds and gigabytes, to keep its first max_seq_len tokens.
    ``text_key``: the columns hold conversations, and each message's text is under that key. Arrow's string lengths,
    milliseconds for Alpaca; a column Arrow cannot read that way is read in Python."""
    table = getattr(ds, "_data", None)
    if not hasattr(table, "column_names"):
        return
    limit, why = bound
    for column in columns:
        if column not in table.column_names:
            continue
        found = _first_too_long(table.data.column(column), limit, text_key)
        if found is not None:
            row, length = found
            what = f"a message of '{column}'" if text_key else f"its '{column}'"
            raise BadInput(
                f"{names(row)}: {what} is {length:,} characters, {why}; shorten or drop that record, or raise "
                "tokenizer.max_seq_len"
            )


def _first_too_long(column, limit: int, text_key: Optional[str]) -> Optional[Tuple[int, int]]:
    """(record, length) of the first text over ``limit`` characters, or None."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        values = column.combine_chunks()
        parents = None
        if text_key is not None:
            parents = pc.list_parent_indices(values)
            values = pc.struct_field(pc.list_flatten(values), text_key)
        lengths = pc.utf8_length(values)
        at = pc.index(pc.greater(lengths, limit), True).as_py()
        if at < 0:
            return None
        return (parents[at].as_py() if parents is not None else at), lengths[at].as_py()
    except (pa.ArrowException, TypeError, KeyError):
        pass
    for row, value in enumerate(column.to_pylist()):  # (mixed types: the other checks name what is wrong)
        texts = [value] if text_key is None else [m.get(text_key) for m in value or [] if isinstance(m, dict)]
        for text in texts:
            if isinstance(text, str) and len(text) > limit:
                return row, len(text)
    return None


# -- conversations --------------------------------------------------------------------------------------------------

# Per conversation_style: the keys of a message, and the roles it may have.
CHAT_STYLES = {
    "openai": ("role", "content", ("system", "user", "assistant", "ipython", "tool")),
    "sharegpt": ("from", "value", ("system", "human", "gpt")),
}
# The roles as the turn order and chat templates name them (torchtune calls a tool's result "ipython").
ROLES = {"human": "user", "gpt": "assistant", "ipython": "tool"}
# The keys of an OpenAI message, besides role and content, that a chat template reads.
TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def check_chat_records(ds, column, style, train_on_input: bool, names: RecordNames, templated: bool) -> None:
    """Conversations: every record's ``column`` is a non-empty list of messages with the style's keys, text
    content (none for an assistant message that calls tools) and a known role, (unless ``train_on_input``) an
    assistant message, so there is something to train on, and a turn order the tokenizer formats: tool messages
    and tool calls only where a chat template renders them (``templated``). The first conversation with tools is
    rendered now, so a template that cannot render them stops the run here. Read once in Python (about a second
    per 50,000 conversations)."""
    table = getattr(ds, "_data", None)
    if not hasattr(table, "column_names"):
        return
    role_key, text_key, roles = CHAT_STYLES[style]
    trained_role = "assistant" if style == "openai" else "gpt"
    if column not in table.column_names:
        raise BadInput(
            f"the records in {names.where} have no '{column}' field ({names.key}.conversation_column); its columns "
            f"are {', '.join(table.column_names)}: set {names.key}.conversation_column to the one that holds "
            "the messages"
        )
    first_with_tools = None
    for i, conversation in enumerate(table[column]):
        if not isinstance(conversation, list) or not conversation:
            raise BadInput(
                f"{names(i)}: '{column}' is {str(conversation)[:80]!r}, not a list of messages; fix or drop that record"
            )
        for j, message in enumerate(conversation):
            problem = _message_problem(message, role_key, text_key, roles, style)
            if problem:
                raise BadInput(f"{names(i)}: message {j + 1} {problem}")
        if not train_on_input and not any(m[role_key] == trained_role for m in conversation):
            raise BadInput(
                f"{names(i)} has no {trained_role} message, so nothing to train on; fix or drop "
                f"that record (or set {names.key}.train_on_input=True)"
            )
        order = [ROLES.get(m[role_key], m[role_key]) for m in conversation]
        turn_error = _turn_order(order)
        if turn_error:
            raise BadInput(f"{names(i)}: {turn_error} (torchtune's conversation rules); fix or drop that record")
        tools = [j for j, m in enumerate(conversation) if order[j] == "tool" or m.get("tool_calls")]
        if tools and not templated:
            raise BadInput(
                f"{names(i)}: message {tools[0] + 1} is a tool message or calls tools, which only a chat "
                "template renders; set tokenizer.chat_template=True (with a model whose template renders tools) "
                "or drop the tool messages"
            )
        if tools and first_with_tools is None:
            first_with_tools = i
    if first_with_tools is not None:
        try:
            ds[first_with_tools]
        except BadInput as e:
            raise BadInput(f"{names(first_with_tools)}, the first with tool messages: {e}") from None


def _message_problem(message, role_key, text_key, roles, style) -> str:
    """What is wrong with one message, as the end of an error line, or ""."""
    role = message.get(role_key) if isinstance(message, dict) else None
    text = message.get(text_key) if isinstance(message, dict) else None
    if role not in roles:
        return f"has {role_key}={role!r}; use one of {', '.join(roles)} ({style} style), or fix or drop that record"
    calls = message.get("tool_calls") if style == "openai" else None
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls):
            return (
                f"({role}) has tool_calls={str(calls)[:80]!r}; only an assistant message calls tools, with a list "
                'of {"type": "function", "function": {"name", "arguments"}}; fix or drop that record'
            )
        for call in calls:
            function = call.get("function", call)
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                return f"({role}) has a tool call without a function name ({str(call)[:80]!r}); fix or drop that record"
            if isinstance(arguments, str):
                try:
                    json.loads(arguments)
                except json.JSONDecodeError:
                    return (
                        f"({role}) calls {function['name']} with arguments {arguments[:80]!r}, not JSON; fix or "
                        "drop that record"
                    )
        if text is None:
            return ""  # a call without words: OpenAI writes content null
    if not (isinstance(text, str) or (style == "openai" and isinstance(text, list))):
        return f"({role}) has {text_key}={str(text)[:80]!r}, not text; fix or drop that record"
    return ""


def _turn_order(roles: List[str]) -> str:
    """What would make a conversation impossible to format (torchtune's validate_messages rules, with OpenAI's
    tool messages: a tool's result answers an assistant message, and an assistant message may answer it), or ""
    when the order is fine. Checked for every record when the dataset is built (torchtune checks a sample only when
    it is read: mid-run, or while packing)."""
    if len(roles) < 2:
        return f"{len(roles)} message, at least a user and an assistant message are needed"
    last = None
    for j, role in enumerate(roles, 1):  # (messages counted from 1, as the error names them)
        if role == "assistant" and last not in ("user", "tool"):
            return f"message {j} is an assistant message that follows no user (or tool) message"
        if role == "user" and last == "user":
            return f"messages {j - 1} and {j} are both user messages"
        if role == "system" and j > 1:
            return f"message {j} is a system message after the first"
        if role == "tool" and last not in ("assistant", "tool"):
            return f"message {j} is a tool message that follows no assistant message (a tool's result answers a call)"
        last = role
    return ""


class OpenAIChat(Transform):
    """A record's OpenAI-style messages as torchtune's ``OpenAIToMessages`` makes them (``new_system_prompt``,
    multimodal content lists, user and system messages trained only with ``train_on_input``), then tokenized by
    ``tokenizer``; and tool use, as transformers' ``apply_chat_template`` passes it to a template:

    - an assistant message's ``tool_calls`` go to the template with it (content null is an empty text); a call's
      ``arguments`` given as a JSON string (OpenAI's wire format) go as the object it encodes, which is what the
      templates print with ``tojson`` (a string would be printed quoted, twice encoded);
    - a tool message (``tool``, or torchtune's ``ipython``) keeps its ``tool_call_id`` and ``name``, and is never
      trained, ``train_on_input`` or not: a tool's output is not the model's to write, and a model trained on it
      learns to invent results.

    It replaces the dataset's message transform and tokenizer step together (``chat_transform``), which also leaves
    out torchtune's ``validate_messages``: ``check_chat_records`` checked every record's order, tools included,
    when the dataset was built."""

    def __init__(self, tokenizer, column: str, train_on_input: bool, new_system_prompt: Optional[str] = None):
        self._tokenizer = tokenizer
        self._column = column
        self._train_on_input = train_on_input
        self._new_system_prompt = new_system_prompt
        self._content = OpenAIToMessages()._convert_from_openai_content  # (stateless: text and image parts)

    def messages(self, sample: Mapping[str, Any]) -> List[Message]:
        messages = []
        if self._new_system_prompt is not None:
            messages.append(Message(role="system", content=self._new_system_prompt, masked=True))
        for raw in sample[self._column]:
            role = raw["role"]
            if role == "system" and self._new_system_prompt is not None:
                continue
            content = raw.get("content")
            content = self._content(content) if isinstance(content, list) else content or ""
            tool = ROLES.get(role, role) == "tool"
            masked = tool or (role != "assistant" and not self._train_on_input)
            message = Message(role=role, content=content, masked=masked)
            fields = {k: raw[k] for k in TOOL_KEYS if raw.get(k) is not None}
            if "tool_calls" in fields:
                fields["tool_calls"] = [_decoded_arguments(c) for c in fields["tool_calls"]]
            if fields:
                message.template_fields = fields  # read by HFTokenizer's chat template rendering
            messages.append(message)
        return messages

    def __call__(self, sample: Mapping[str, Any]) -> Mapping[str, Any]:
        return self._tokenizer({"messages": self.messages(sample)})


def _decoded_arguments(call: Dict[str, Any]) -> Dict[str, Any]:
    function = call.get("function", call)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            return call
        function = {**function, "arguments": decoded}
        return {**call, "function": function} if "function" in call else function
    return call


def chat_transform(ds, tokenizer, cfg_dataset: Mapping[str, Any]) -> None:
    """Let an OpenAI-style ``chat_dataset`` format its samples with ``OpenAIChat``: the dataset's sample transform
    is rebuilt with no message transform (so torchtune's ``validate_messages``, which refuses tool messages, is not
    called) and ``OpenAIChat`` as the model transform."""
    from torchtune.datasets._sft import SFTTransform

    ds._prepare_sample = SFTTransform(
        message_transform=None,
        model_transform=OpenAIChat(
            tokenizer,
            cfg_dataset.get("conversation_column"),
            bool(cfg_dataset.get("train_on_input", False)),
            cfg_dataset.get("new_system_prompt"),
        ),
    )
