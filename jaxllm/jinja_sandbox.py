"""A bounded Jinja sandbox for chat templates (jaxllm/chat_template.py says what to render).

The environment is the one transformers renders chat templates in (an
`ImmutableSandboxedEnvironment` with trim_blocks, lstrip_blocks, loopcontrols, `{% generation %}`,
a plain-JSON `tojson`, `raise_exception`, `strftime_now`, a guarded `dict` and `namespace`), and
its hooks also bound what a template may cost:

    time    every call, filter, attribute or item lookup, operator, loop iteration and output
            chunk checks the render's deadline
    size    no string, list or output the template builds exceeds `max_chars` characters: `*`,
            `**`, `+`, `%`, `~`, buffers, padding widths and format specs are checked before they
            run; all the text a render builds adds up to at most BUILD_REPEATS * max_chars
    source  templates over MAX_TEMPLATE_CHARS are refused; each is compiled once

Every failure is a ChatTemplateError (a ValueError) with a message fit for an HTTP 400.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import json
import re
import time
import traceback
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, optimizeconst
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_TEMPLATE_CHARS = 256 * 1024
MAX_INT_BITS = 4096  # integers a template may compute (about 1,233 digits)
# All the text one render builds or prints (strings made by calls, filters, operators and joins,
# and every `{{ ... }}`) may add up to this many times max_chars: a template copies each message a
# few times (strip, split, a macro), and buffers (macros, blocks) keep what they collect until joined.
BUILD_REPEATS = 16
# The parts of a format string that set widths: `%-10.3f` and `{0:>10}` (a `{` inside is nested).
_FORMAT_SPECS = re.compile(r"%[^a-zA-Z%]*|\{[^{}]*[{}]")


class ChatTemplateError(ValueError):
    """A chat template could not render a conversation; the message is fit to show a client."""


class _Rejected(jinja2.TemplateError):
    """The template called `raise_exception(message)`."""


@dataclasses.dataclass(slots=True)
class _Budget:
    """One render's limits, checked by the environment's hooks."""

    deadline: float
    timeout_s: float
    max_chars: int
    num_built: int = 0  # characters of text built so far

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template took longer than {self.timeout_s} s to render")

    def too_big(self) -> ChatTemplateError:
        return ChatTemplateError(f"the chat template produced more than {self.max_chars} characters")

    def built(self, value):
        """Account for `value`, just built: its size, and the render's total (containers count
        one per element, since what they hold is counted where it was built)."""
        self.check_size(value)
        self.num_built += len(value) if isinstance(value, (str, list, tuple, dict)) else 0
        if self.num_built > BUILD_REPEATS * self.max_chars:
            raise ChatTemplateError(
                f"the chat template built more than {BUILD_REPEATS * self.max_chars} characters of text"
            )
        return value

    def check_size(self, *values) -> None:
        total = 0
        for value in values:
            total += _size(value, self.max_chars - total)
            if total > self.max_chars:
                raise self.too_big()

    def check_args(self, args, kwargs: dict, *, widths: bool) -> None:
        """A call's arguments; with `widths`, integers are padding widths or counts."""
        self.check_size(*args, *kwargs.values())
        for value in (*args, *kwargs.values()) if widths else ():
            if type(value) is int and abs(value) > self.max_chars:
                raise ChatTemplateError(f"the chat template asked for a width of {value}; at most {self.max_chars}")

    def check_format(self, fmt: str) -> None:
        for spec in _FORMAT_SPECS.findall(fmt.replace("{{", "").replace("}}", "")):
            too_wide = any(len(n) > 15 or int(n) > self.max_chars for n in re.findall(r"\d+", spec))
            if too_wide or "*" in spec or spec[0] + spec[-1] == "{{":  # `*` and `{{`: widths from arguments
                raise ChatTemplateError(f"the chat template tried an unsafe operation: the format spec {spec!r}")

    def check_binop(self, operator: str, left, right) -> None:
        ints = isinstance(left, int) and isinstance(right, int)
        if ints and (
            operator == "*"
            and left.bit_length() + right.bit_length() > MAX_INT_BITS
            or operator == "**"
            and abs(left) > 1
            and right > 0
            and left.bit_length() * right > MAX_INT_BITS
        ):
            raise ChatTemplateError(f"the chat template computed a number of more than {MAX_INT_BITS} bits")
        if operator == "*" and not ints:
            seq, count = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(count, int) and max(count, 0) * _size(seq, self.max_chars) > self.max_chars:
                raise self.too_big()
        elif operator == "+":
            self.check_size(left, right)
        elif operator == "%" and isinstance(left, str):
            self.check_format(left)
            self.check_size(right)


_BUDGET: contextvars.ContextVar[_Budget] = contextvars.ContextVar("chat_template_budget")


def _size(value, limit: int) -> int:
    """Characters in `value`: its strings, one per container element, ~digits of its integers;
    counted up to just past `limit`."""
    total, stack = 0, [value]
    while stack and total <= limit:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, int):
            total += value.bit_length() // 3
        elif isinstance(value, (list, tuple, set, frozenset, dict)):
            total += len(value)
            stack.extend(value.items() if isinstance(value, dict) else value)
    return total


class _CodeGenerator(CodeGenerator):
    """Routes loop iterations and `~` through the environment, so that they are bounded too."""

    def visit_For(self, node: nodes.For, frame) -> None:
        node.iter = nodes.Call(
            nodes.EnvironmentAttribute("checked_iter"), [node.iter], [], None, None, lineno=node.lineno
        )
        super().visit_For(node, frame)

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox's hooks, each checking the current render's `_Budget`. Outside a render they
    raise, which also keeps lookups and filters from being folded into constants at compile time."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def call(self, context, obj, /, *args, **kwargs):
        budget = _BUDGET.get()
        budget.tick()
        method = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
        owner = getattr(method, "__self__", None)
        is_format = isinstance(owner, str) and method.__name__ in ("format", "format_map")
        if is_format:
            budget.check_format(owner)
        budget.check_args(args, kwargs, widths=isinstance(owner, str) and not is_format)
        return budget.built(super().call(context, obj, *args, **kwargs))

    def call_binop(self, context, operator, left, right):
        budget = _BUDGET.get()
        budget.tick()
        budget.check_binop(operator, left, right)
        return budget.built(super().call_binop(context, operator, left, right))

    def getattr(self, obj, attribute):
        _BUDGET.get().tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):  # `x[a:b]` does not come here: jinja slices directly
        _BUDGET.get().tick()
        return super().getitem(obj, argument)

    def checked_iter(self, iterable):
        budget = _BUDGET.get()
        for item in iterable:
            budget.tick()
            yield item

    def concat(self, parts) -> str:  # `~`, and the buffers of macros, call blocks and `{% set %}` blocks
        parts = list(parts)
        budget = _BUDGET.get()
        budget.check_size(*parts)
        return budget.built("".join(map(str, parts)))


def _finalize(value):
    """Every `{{ value }}` passes here before `str()`, on its way to the output or a buffer: it
    counts as built (a slice, say, was built unseen), and a value that is not a string is made
    text here, once its size is known to be in bounds."""
    budget = _BUDGET.get(None)  # None while compiling (constants only)
    if budget is None:
        return value
    if not isinstance(value, str):
        budget.check_size(value)
        value = str(value)
    return budget.built(value)


def _bounded_filter(name: str, func):
    @functools.wraps(func)  # keeps jinja's pass_context/pass_environment marks
    def bounded(*args, **kwargs):
        budget = _BUDGET.get()
        budget.tick()
        first = 2 if hasattr(func, "jinja_pass_arg") else 1  # args[first - 1]: the filtered value
        if name == "format" and isinstance(args[first - 1], str):
            budget.check_format(args[first - 1])
        budget.check_size(*args[:first])
        budget.check_args(args[first:], kwargs, widths=True)
        return budget.built(func(*args, **kwargs))

    return bounded


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` without underscore names, as in transformers (defense in depth)."""

    def __init__(*args, **kwargs):
        attrs = dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._public(name)
        jinja2.utils.Namespace.__init__(args[0], attrs)

    def __setitem__(self, name, value):
        jinja2.utils.Namespace.__setitem__(self, _Namespace._public(name), value)

    @staticmethod
    def _public(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")
        return name


def _raise_exception(message):
    raise _Rejected(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes <, >, & and ' for HTML; templates want the JSON as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _dict(*args, **kwargs) -> dict:  # `dict(...)` and `dict.fromkeys`, not the type itself
    return dict(*args, **kwargs)


_dict.fromkeys = dict.fromkeys


def _environment() -> _Environment:
    env = _Environment(
        trim_blocks=True, lstrip_blocks=True, finalize=_finalize, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, func) for name, func in env.filters.items()}
    del env.globals["lipsum"]  # its size is an argument no hook sees
    env.globals.update(
        raise_exception=_raise_exception,
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
        dict=_dict,
        namespace=_Namespace,
    )
    return env


_ENV = _environment()


def compile_template(source: str) -> jinja2.Template:
    """`source` compiled in the bounded environment (cached). Raises ChatTemplateError."""
    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"the chat template has {len(source)} characters; at most {MAX_TEMPLATE_CHARS}")
    try:
        return _compile(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e.message} (line {e.lineno})") from e
    except Exception as e:  # nested too deeply for jinja's parser or Python's compiler
        raise ChatTemplateError(f"the chat template is not valid Jinja: {e}") from e


@functools.lru_cache(maxsize=8)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def render(template: jinja2.Template, variables: dict, *, timeout_s: float, max_chars: int) -> str:
    """The text `template` renders from `variables`, within `timeout_s` seconds and `max_chars`
    characters. Raises ChatTemplateError."""
    budget = _Budget(time.monotonic() + timeout_s, timeout_s, max_chars)
    token = _BUDGET.set(budget)
    stream = template.generate(variables)
    chunks, num_chars = [], 0
    try:
        for chunk in stream:
            budget.tick()
            num_chars += len(chunk)
            if num_chars > max_chars:
                raise budget.too_big()
            chunks.append(chunk)
    except ChatTemplateError:
        raise
    except _Rejected as e:
        raise ChatTemplateError(f"the chat template rejected the conversation: {str(e)[:1000]}") from e
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template tried an unsafe operation{_where(e)}: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError("the chat template recursed too deeply") from e
    except MemoryError as e:
        raise budget.too_big() from e
    except Exception as e:  # a TypeError, UndefinedError, ... inside the template
        raise ChatTemplateError(f"the chat template failed{_where(e)}: {str(e)[:1000]}") from e
    finally:
        stream.close()
        _BUDGET.reset(token)
    return "".join(chunks)


def _where(error: Exception) -> str:
    """' (line N)': where in the template `error` was raised (jinja rewrites tracebacks to point there)."""
    lines = [n for frame, n in traceback.walk_tb(error.__traceback__) if frame.f_code.co_filename == "<template>"]
    return f" (line {lines[-1]})" if lines else ""
