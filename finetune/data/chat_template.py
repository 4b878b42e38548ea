"""A model folder's chat template, compiled and rendered in a sandbox with a time and a size bound.

A chat template is a Jinja program shipped in the model folder (``chat_template.jinja`` or tokenizer_config.json),
and it runs on every sample. jinja2's ``ImmutableSandboxedEnvironment`` keeps it from reading files, running code or
changing the data it is given; this module adds what the sandbox leaves open, so that a broken or hostile template
is one ``error:`` line naming its file instead of a hung or exhausted run:

- time: each rendering has ``RENDER_SECONDS``. A watchdog thread raises ``RenderTimeout`` inside the thread that
  renders once its deadline passes (CPython's ``PyThreadState_SetAsyncExc``: no signal, so it works in any thread
  and in DataLoader workers, and costs nothing while rendering). It interrupts Python code, which is all a template
  runs; a single long call into C could only end first, which is why the sizes below are checked *before* the
  operations that could make one.
- size: no string or sequence a template builds may exceed ``MAX_CHARS`` (checked before ``*``, ``+``, ``~``,
  ``%``, ``**``, and the calls and filters that multiply their input: join, replace, indent, format, padding,
  expandtabs), no integer argument may exceed it, and one rendering may build at most ``BUDGET_CHARS`` in all (a
  loop cannot pile up gigabytes below the per-value bound). The bounds are far above what a real template needs: a
  128k-token conversation renders to about half a million characters.
- ``{% include %}``, ``{% import %}`` and ``{% extends %}`` are refused when the template is read (a template is one
  file here: there is nothing else to load), a macro that recurses without end is a RecursionError turned into an
  error line.

``ChatTemplate.probe`` renders a two-message conversation when the tokenizer is built, so a template that hangs,
overflows or breaks the sandbox is refused at setup, before any data is tokenized; a template that merely refuses
the probe's conversation (its ``raise_exception`` on roles) is left to the real data to judge.
"""

import ctypes
import json
import os
import re
import threading
import time
from functools import wraps
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from jinja2 import TemplateError, nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg

from finetune.base import BadInput, first_line

RENDER_SECONDS = 10.0  # one rendering of one conversation (tests lower it)
MAX_CHARS = 1 << 24  # 16,777,216: any string or sequence a template builds, any integer it passes to a call
BUDGET_CHARS = 1 << 28  # everything one rendering builds, in all
MAX_INT_BITS = 4096  # integers a template computes with * and ** (a number this long is no chat formatting)
PROBE = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]


class TemplateLimit(SecurityError):
    """A template that would build more than the bounds allow."""


class _DataRefused(BadInput):
    """The template refused this conversation (the data's fault as much as the template's)."""


class RenderTimeout(BaseException):
    """Raised inside a rendering thread by the watchdog. A BaseException, so that no ``except Exception`` on the
    way (jinja2's, a filter's) swallows it."""


# -- time -------------------------------------------------------------------------------------------------------


class _Watchdog:
    """One daemon thread per process holding each rendering thread's deadline; a thread past it gets RenderTimeout."""

    def __init__(self):
        self._pid = None

    def _start(self) -> None:
        # (again in a forked child, a DataLoader worker: threads do not survive fork)
        self._pid, self._cond, self._deadlines, self._wake = os.getpid(), threading.Condition(), {}, 0.0
        threading.Thread(target=self._watch, name="chat-template-watchdog", daemon=True).start()

    def _watch(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                for thread in [t for t, d in self._deadlines.items() if d <= now]:
                    del self._deadlines[thread]
                    _async_raise(thread, RenderTimeout)
                self._wake = min(self._deadlines.values(), default=now + 3600)
                self._cond.wait(self._wake - now)

    def bounded(self, seconds: float, fn: Callable[[], Any]) -> Any:
        if self._pid != os.getpid():
            self._start()
        thread = threading.get_ident()
        with self._cond:
            self._deadlines[thread] = deadline = time.monotonic() + seconds
            if deadline < self._wake:  # (else the watchdog wakes in time anyway: no thread switch per rendering)
                self._cond.notify()
        try:
            return fn()
        finally:
            with self._cond:
                fired = self._deadlines.pop(thread, None) is None
            if fired:  # the deadline passed as the rendering ended: drop the exception if it is still pending
                _async_raise(thread, None)


def _async_raise(thread: int, exc: Optional[type]) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None if exc is None else ctypes.py_object(exc))


_WATCHDOG = _Watchdog()


# -- size -------------------------------------------------------------------------------------------------------

_SIZED = (str, bytes, list, tuple, dict, set, frozenset)
_budget = threading.local()


def _size(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 0


def _bound(n: int, what: str) -> None:
    if n > MAX_CHARS:
        raise TemplateLimit(f"{what} of {n:,} (the bound is {MAX_CHARS:,})")


def _charge(value: Any) -> Any:
    """Count a built value against the rendering's budget (and the per-value bound); returns it."""
    n = _size(value)
    if n > 1024:
        _bound(n, "a value")
        _spend(n)
    return value


def _spend(n: int) -> None:
    _budget.left = getattr(_budget, "left", BUDGET_CHARS) - n
    if _budget.left < 0:
        raise TemplateLimit(f"more than {BUDGET_CHARS:,} characters built in one rendering")


def _check_int(value: Any) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_CHARS:
        raise TemplateLimit(f"an integer argument of {value:,} (the bound is {MAX_CHARS:,})")


def _check_format(fmt: Any) -> None:
    """A printf or str.format string asks for widths and precisions: none beyond the bound."""
    if isinstance(fmt, str):
        for digits in re.findall(r"\d{8,}", fmt):
            _bound(int(digits), "a format width")


def _growth(name: str, value: Any, args: tuple, kwargs: dict) -> int:
    """The size a call that multiplies its input would build, before it builds it (0 where it does not)."""
    arg = lambda i, key, default: args[i] if len(args) > i else kwargs.get(key, default)  # noqa: E731
    if name in ("replace", "do_replace") and isinstance(value, str):
        old, new = arg(0, "old", None), arg(1, "new", None)
        if isinstance(old, str) and isinstance(new, str):
            return len(value) + max(0, len(new) - len(old)) * (value.count(old) if old else len(value) + 1)
    if name in ("indent", "do_indent") and isinstance(value, str):
        width = arg(0, "width", 4)
        return len(value) + (value.count("\n") + 1) * (width if isinstance(width, int) else _size(width))
    if name == "expandtabs" and isinstance(value, str):
        tab = arg(0, "tabsize", 8)
        return len(value) + value.count("\t") * (tab if isinstance(tab, int) else 0)
    if name in ("format", "format_map", "do_format"):
        _check_format(value)
    return 0


def _listed(items: Any) -> Any:
    """An iterable to join as a list (so that its length is known before joining), anything else as it is."""
    return (
        items if isinstance(items, (str, bytes, list, tuple, dict)) or not hasattr(items, "__iter__") else list(items)
    )


def _join_size(sep: Any, items: Any) -> int:
    if not isinstance(items, (str, list, tuple, dict)):
        return 0
    return _size(sep) * len(items) + sum(_size(x) for x in items) if isinstance(items, (list, tuple)) else len(items)


def _bounded_filter(name: str, fn: Callable) -> Callable:
    skip = 0 if _PassArg.from_obj(fn) is None else 1  # (the context, eval context or environment comes first)

    @wraps(fn)
    def filtered(*args, **kwargs):
        for a in (*args[skip:], *kwargs.values()):
            _check_int(a)
        value, rest = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        if name == "join":
            value = _listed(value)
            args = (*args[:skip], value, *rest)
            _bound(_join_size(rest[0] if rest else kwargs.get("d", ""), value), "a joined string")
        else:
            _bound(_growth("do_" + name, value, rest, kwargs), f"the result of the {name} filter")
        return _charge(fn(*args, **kwargs))

    return filtered


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """``tojson`` as transformers' templates expect it: the dict's own key order and no HTML escaping (jinja2's
    sorts the keys and escapes <, >, & and '), so a tool call is rendered, and trained, as the model writes it."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` (jinja2 compiles it to a plain join, which no sandbox hook sees) goes through the environment."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with every operation that can build a large value checked first."""

    intercepted_binops = frozenset({"*", "+", "%", "**"})  # (and thereby never folded at compile time)
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, **options):
        super().__init__(**options)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":  # (the common case, a template's string building: kept cheap)
            if isinstance(left, _SIZED) and isinstance(right, _SIZED):
                n = len(left) + len(right)
                if n > 1024:
                    _bound(n, "a concatenation")
                    _spend(n)
            return left + right
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "*" and ints and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateLimit(f"a product of {left.bit_length() + right.bit_length():,} bits")
        if operator == "**" and ints and abs(left) > 1 and left.bit_length() * right > MAX_INT_BITS:
            raise TemplateLimit(f"a power of about {left.bit_length() * right:,} bits")
        if operator == "*" and isinstance(right if isinstance(left, int) else left, _SIZED):
            times, seq = (left, right) if isinstance(left, int) else (right, left)
            if isinstance(times, int):
                _bound(_size(seq) * times, "a repeated value")
        if operator == "%" and isinstance(left, str):
            _check_format(left)
            for a in right if isinstance(right, tuple) else right.values() if isinstance(right, dict) else (right,):
                _check_int(a)
        return _charge(super().call_binop(context, operator, left, right))

    def bounded_concat(self, values: tuple) -> str:
        texts = [str(v) for v in values]
        _bound(sum(len(t) for t in texts), "a concatenation")
        return _charge("".join(texts))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own naming, against clashes)
        for a in (*args, *kwargs.values()):
            _check_int(a)
        target = getattr(__obj, "__wrapped__", __obj)  # (the sandbox wraps str.format)
        owner = getattr(target, "__self__", None)
        name = getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and args:
                args = (_listed(args[0]), *args[1:])
                _bound(_join_size(owner, args[0]), "a joined string")
            _bound(_growth(name, owner, args, kwargs), f"the result of str.{name}")
        return _charge(super().call(__context, __obj, *args, **kwargs))


# -- the template ------------------------------------------------------------------------------------------------


class ChatTemplate:
    """The template from ``where`` (the file named in every error), compiled; ``variables`` are passed to every
    rendering (bos_token, eos_token ...), ``functions`` are its globals (raise_exception, strftime_now)."""

    def __init__(self, source: str, where: Path, variables: Dict[str, Any], functions: Dict[str, Callable]):
        self.where = Path(where)
        self._variables = variables
        env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals.update(functions)
        try:
            loads = next(env.parse(source).find_all((nodes.Include, nodes.Import, nodes.FromImport, nodes.Extends)))
        except StopIteration:
            loads = None
        except TemplateError as e:
            raise BadInput(f"the chat template in {where} does not parse ({e})") from None
        if loads is not None:
            raise BadInput(
                f"the chat template in {where} loads another template ({type(loads).__name__.lower()} on line "
                f"{loads.lineno}); a chat template is one file here, with nothing else to load: put the loaded "
                f"template's text in its place in {self.where.name}"
            )
        try:  # (compiling folds constant expressions, so it runs template code too: bounded the same way)
            self._template = _WATCHDOG.bounded(RENDER_SECONDS, lambda: env.from_string(source))
        except RenderTimeout:
            raise BadInput(
                f"the chat template in {where} ran past {RENDER_SECONDS:g} s compiling; replace "
                f"{self.where.name} with the model's published template"
            ) from None
        except TemplateError as e:
            raise BadInput(f"the chat template in {where} does not parse ({e})") from None

    def probe(self) -> Optional[str]:
        """Render a small conversation now, so that a template that hangs, overflows, recurses or breaks the
        sandbox is refused before any data is read; returns the rendering (None where the template refuses the
        probe's roles, which is not an error here)."""
        try:
            return self.render(PROBE)
        except _DataRefused:
            return None

    def render(self, chat: List[Dict[str, Any]], generation_prompt: bool = False) -> str:
        _budget.left = BUDGET_CHARS
        try:
            text = _WATCHDOG.bounded(RENDER_SECONDS, lambda: self._generate(chat, generation_prompt))
        except RenderTimeout:
            raise BadInput(
                f"the chat template in {self.where} ran past {RENDER_SECONDS:g} s on one conversation (a loop "
                f"without end?); replace {self.where.name} with the model's published template"
            ) from None
        except (TemplateLimit, SecurityError, RecursionError, MemoryError) as e:
            raise self._fault(e) from None
        except TemplateError as e:  # (its raise_exception, an undefined field: about this conversation)
            raise _DataRefused(
                f"the chat template in {self.where} refused a conversation ({e}); roles "
                f"{[m.get('role') for m in chat]}: fix those records, or the template"
            ) from None
        except Exception as e:  # the template's code failed on this conversation (a TypeError, a bad index ...)
            raise _DataRefused(
                f"the chat template in {self.where} failed on a conversation ({first_line(e)}); roles "
                f"{[m.get('role') for m in chat]}: fix those records, or the template"
            ) from None
        return text

    def _generate(self, chat, generation_prompt: bool) -> str:
        parts, size = [], 0
        for part in self._template.generate(messages=chat, add_generation_prompt=generation_prompt, **self._variables):
            size += len(part)
            _bound(size, "a rendering")
            parts.append(part)
        return "".join(parts)

    def _fault(self, e: BaseException) -> BadInput:
        what = {
            TemplateLimit: f"builds too much ({e})",
            RecursionError: "recurses without end (a macro that calls itself?)",
            MemoryError: "ran out of memory",
        }.get(type(e), f"did what the sandbox forbids ({first_line(e)})")
        return BadInput(
            f"the chat template in {self.where} {what}; replace {self.where.name} with the model's published template"
        )
