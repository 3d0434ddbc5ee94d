"""Prompt templates: built-in formats and the tokenizer's own Jinja chat template.

A template renders a Conversation into pieces ``(text, trainable)``; ``encode.py`` turns pieces into token
ids and labels. Assistant turns are the trainable pieces; everything else gets the ignore label unless
``train_on_prompt`` is set.

Built-ins: plain (prompt then answer, nothing added: the quickstart), alpaca, chatml, qwen (chatml with
Qwen's default system prompt), llama2, baichuan (Baichuan2-Chat's reserved user/assistant tokens).
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    ClassVar,
    Dict,
    Iterator,
    List,
    Optional,
    Sequence,
    Tuple,
    Union,
)

from bmtrain_cli.data.formats import Conversation
from bmtrain_cli.errors import UserError

if TYPE_CHECKING:
    from bmtrain_cli.data.tokenizers import Tokenizer

Piece = Tuple[str, bool]  # (text, trainable); the text may contain "{eos}" markers, see EOS_MARK
EOS_MARK = "\x00EOS\x00"  # replaced by the tokenizer's EOS id when encoding
BOS_MARK = "\x00BOS\x00"  # replaced by the tokenizer's BOS id


@dataclass(frozen=True)
class BuiltinTemplate:
    name: str
    user: str  # "{content}" is the user's text; ends with the assistant header
    assistant: str  # the trained part
    system: str = "{content}"
    default_system: Optional[str] = None
    assistant_suffix: str = ""  # untrained text after an assistant turn
    system_in_first_user: bool = False  # llama2 puts <<SYS>> inside the first [INST]
    bos_before_user: bool = False  # llama2 starts every [INST] with BOS
    specials: Tuple[str, ...] = ()  # marker strings that map to one token id when the tokenizer has them
    # the prompt and each answer are tokenised apart (the built-in layouts' own rule)
    joint: ClassVar[bool] = False

    def render(
        self, conv: Conversation, tokenizer: Optional[Tokenizer] = None, options: Any = None
    ) -> List[Piece]:
        return self._render(conv, generation_prompt=False)

    def render_prompt(
        self, conv: Conversation, tokenizer: Optional[Tokenizer] = None, options: Any = None
    ) -> List[Piece]:
        """The conversation up to and including the header of the last assistant turn (for generation)."""
        return self._render(conv, generation_prompt=True)

    def _render(self, conv: Conversation, generation_prompt: bool) -> List[Piece]:
        from bmtrain_cli.data.tools import has_tools

        if has_tools(conv):
            raise UserError(
                f"template {self.name!r} cannot render tools or tool calls; use the model's chat template "
                "(template: auto or tokenizer) for tool-calling data"
            )
        system = conv.system if conv.system is not None else self.default_system
        pieces: List[Piece] = []
        pending_system = ""
        if system:
            text = self.system.format(content=system)
            if self.system_in_first_user:
                pending_system = text
            else:
                pieces.append((text, False))
        msgs = list(conv.messages)
        if generation_prompt and msgs and msgs[-1][0] == "assistant":
            msgs = msgs[:-1]
        n_users = 0
        for i, (role, content) in enumerate(msgs):
            reasoning = conv.extras[i].get("reasoning_content") if conv.extras else None
            if reasoning:
                content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content}"
            if role == "user":
                text = self.user.format(content=pending_system + content)
                pending_system = ""
                if self.bos_before_user and n_users > 0:
                    text = BOS_MARK + text
                n_users += 1
                pieces.append((text, False))
            else:
                pieces.append((self.assistant.format(content=content, eos=EOS_MARK), True))
                if self.assistant_suffix:
                    pieces.append((self.assistant_suffix, False))
        return pieces


_CHATML_USER = "<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"

BUILTIN_TEMPLATES = {
    t.name: t
    for t in (
        BuiltinTemplate("plain", user="{content}", assistant="{content}{eos}", system="{content}\n\n"),
        BuiltinTemplate(
            "alpaca",
            user="### Instruction:\n{content}\n\n### Response:\n",
            assistant="{content}{eos}",
            system="{content}\n\n",
            default_system="Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.",
            assistant_suffix="\n\n",
        ),
        BuiltinTemplate(
            "chatml",
            user=_CHATML_USER,
            assistant="{content}<|im_end|>",
            system="<|im_start|>system\n{content}<|im_end|>\n",
            assistant_suffix="\n",
            specials=("<|im_start|>", "<|im_end|>"),
        ),
        BuiltinTemplate(
            "qwen",
            user=_CHATML_USER,
            assistant="{content}<|im_end|>",
            system="<|im_start|>system\n{content}<|im_end|>\n",
            default_system="You are a helpful assistant.",
            assistant_suffix="\n",
            specials=("<|im_start|>", "<|im_end|>"),
        ),
        BuiltinTemplate(
            "llama2",
            user="[INST] {content} [/INST]",
            assistant=" {content} {eos}",
            system="<<SYS>>\n{content}\n<</SYS>>\n\n",
            system_in_first_user=True,
            bos_before_user=True,
        ),
        BuiltinTemplate(
            "baichuan",
            user="<reserved_106>{content}<reserved_107>",
            assistant="{content}{eos}",
            specials=("<reserved_106>", "<reserved_107>"),
        ),
    )
}


# Limits on rendering a chat template (a template comes with a downloaded model: treat it as hostile).
# Each limit applies to one render (one call of the template); docs/data.md lists them.
MAX_RENDER_SECONDS = 10.0  # wall clock
MAX_RENDER_STEPS = 1_000_000  # template lines executed (each loop iteration counts)
MAX_RENDER_CHARS = 8_000_000  # the rendered text, and any one string or list the template builds
MAX_RENDER_DEPTH = 64  # nested macro calls
MAX_RANGE = 100_000  # items in one range(...)
_TEMPLATE_CODE = "<template>"  # the file name Jinja gives the code it compiles from a string


class _LimitHit(BaseException):
    """A render limit was hit. A BaseException, so no ``except Exception`` on the way out swallows it."""


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else 0


def _check_size(value: Any, what: str) -> Any:
    if _sized(value) > MAX_RENDER_CHARS:
        raise _LimitHit(
            f"{what} builds a value of {_sized(value)} items, over the limit of {MAX_RENDER_CHARS}"
        )
    return value


def _check_int_args(args: Sequence[Any], kwargs: Dict[str, Any], what: str) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_RENDER_CHARS:
            raise _LimitHit(f"{what} is given {value}, over the limit of {MAX_RENDER_CHARS}")


def _bounded_range(*args: int) -> range:
    rng = range(*args)
    if len(rng) > MAX_RANGE:
        raise _LimitHit(f"range() of {len(rng)} items, over the limit of {MAX_RANGE}")
    return rng


_bounded_range.__name__ = "range"  # as errors name it


def _bounded_filter(func: Callable[..., Any], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_int_args(args[1:], kwargs, f"filter {name}")
        return _check_size(func(*args, **kwargs), f"filter {name}")

    return functools.update_wrapper(wrapper, func)  # keeps Jinja's pass_context / pass_eval_context marks


def _binop_size(operator: str, left: Any, right: Any) -> int:
    """The number of items ``left <operator> right`` would build (0 when it builds no sequence)."""
    if operator == "+":
        return _sized(left) + _sized(right)
    seq, times = (left, right) if _sized(left) else (right, left)
    if isinstance(times, int) and not isinstance(times, bool):
        return _sized(seq) * times
    return 0


def _check_binop(operator: str, left: Any, right: Any) -> None:
    if operator in ("*", "+"):
        n = _binop_size(operator, left, right)
        if n > MAX_RENDER_CHARS:
            raise _LimitHit(f"'{operator}' builds a value of {n} items, over the limit of {MAX_RENDER_CHARS}")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right * abs(left).bit_length() > 65536:
            raise _LimitHit(f"{left} ** {right} is over the limit of 65536 bits")
    elif operator == "%" and isinstance(left, str):
        _check_int_args(right if isinstance(right, tuple) else (right,), {}, "'%' formatting")


class _RenderBudget:
    """The steps (loop iterations and calls), call depth and time of the render running in this thread."""

    def __init__(self) -> None:
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS
        self.steps = 0
        self.depth = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_RENDER_STEPS:
            raise _LimitHit(
                f"ran more than {MAX_RENDER_STEPS} loop iterations and calls (a loop without end?)"
            )
        if not self.steps & 255 and time.monotonic() > self.deadline:
            raise _LimitHit(f"ran longer than {MAX_RENDER_SECONDS:g} s")


_BUDGET = threading.local()  # .current: the _RenderBudget of the render in progress


def _budget() -> _RenderBudget:
    current = getattr(_BUDGET, "current", None)
    if current is None:  # rendered outside JinjaTemplate._text (not done here): bound it anyway
        current = _BUDGET.current = _RenderBudget()
    return current


def _bounded_iter(iterable: Any) -> Iterator[Any]:
    """Wraps the iterable of every ``{% for %}``: each iteration is a step."""
    budget = _budget()
    for item in iterable:
        budget.step()
        yield item


def _guard_loops(node: Any) -> Any:
    """Wrap the iterable of every for loop in the template's syntax tree in ``environment.bounded_iter``
    (an environment attribute: no template can name or rebind it)."""
    from jinja2 import nodes

    for loop in node.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_iter"), [loop.iter], [], None, None)
    return node


def _bounded_env():  # -> jinja2.sandbox.ImmutableSandboxedEnvironment
    """A Jinja sandbox whose ``range``, ``*``, ``**``, ``+``, ``%``, ``~``, filters and calls cannot build
    values over MAX_RENDER_CHARS items, and whose loops and calls count against the render's budget."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node: Any, frame: Any) -> None:  # the ``~`` operator
            self.write("environment.bounded_concat(")
            super().visit_Concat(node, frame)
            self.write(")")

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BoundedCodeGenerator
        intercepted_binops = frozenset(["*", "**", "+", "%"])
        bounded_iter = staticmethod(_bounded_iter)

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.globals["range"] = _bounded_range
            self.filters = {k: _bounded_filter(f, k) for k, f in self.filters.items()}

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            return _check_size(super().call_binop(context, operator, left, right), f"'{operator}'")

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            if __obj is _bounded_iter:
                return super().call(__context, __obj, *args, **kwargs)
            what = f"calling {getattr(__obj, '__name__', 'a function')}()"
            _check_int_args(args, kwargs, what)
            budget = _budget()
            budget.step()
            budget.depth += 1
            try:
                if budget.depth > MAX_RENDER_DEPTH:
                    raise _LimitHit(
                        f"calls nested deeper than {MAX_RENDER_DEPTH} (a macro recursing without end?)"
                    )
                return _check_size(super().call(__context, __obj, *args, **kwargs), what)
            finally:
                budget.depth -= 1

        @staticmethod
        def bounded_concat(value: Any) -> Any:
            return _check_size(value, "'~'")

    return BoundedSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        extensions=["jinja2.ext.loopcontrols"],
    )


def _bounded_join(chunks: Iterator[str]) -> str:
    out: List[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise _LimitHit(f"rendered more than {MAX_RENDER_CHARS} characters")
        out.append(chunk)
    return "".join(out)


class JinjaTemplate:
    """A Hugging Face chat template (Jinja) rendered in a sandbox, under the MAX_RENDER_* limits.

    Trainable spans are found by rendering prefixes: for assistant turn i, the text of messages[:i] with
    the generation prompt is the prompt, and the text of messages[:i+1] ends with the answer.
    ``origin`` names the template's file in errors.
    """

    name = "tokenizer"
    specials: Tuple[str, ...] = ()
    # the text between special tokens is tokenised as one string, as transformers' apply_chat_template does
    joint = True

    def __init__(self, source: str, origin: Optional[str] = None):
        from jinja2 import TemplateError

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        self.origin = origin or "the tokenizer's chat_template"
        env = _bounded_env()
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        env.filters["tojson"] = tojson  # as transformers: no HTML escaping, keys in order, ensure_ascii off
        try:
            self._template = env.from_string(_guard_loops(env.parse(source)))
        except (TemplateError, RecursionError, MemoryError) as exc:
            raise UserError(f"{self.origin}: the chat template does not parse: {exc}") from None
        self.source = source

    def __getstate__(self) -> Dict[str, Any]:  # compiled templates do not pickle: workers recompile
        return {"source": self.source, "origin": self.origin}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        JinjaTemplate.__init__(self, state["source"], state["origin"])

    def _text(
        self,
        messages: List[dict],
        tokenizer: Optional[Tokenizer],
        generation_prompt: bool,
        extra: Optional[dict] = None,
    ) -> str:
        chunks = self._template.generate(
            messages=messages,
            add_generation_prompt=generation_prompt,
            bos_token=(tokenizer.bos_token or "") if tokenizer else "",
            eos_token=(tokenizer.eos_token or "") if tokenizer else "",
            **(extra or {}),
        )
        _BUDGET.current = _RenderBudget()
        try:
            return _bounded_join(chunks)
        except _LimitHit as exc:
            raise UserError(f"{self.origin}: the chat template stopped: {exc}") from None
        except (Exception, RecursionError) as exc:  # the template's own errors: raise_exception, bad types
            raise UserError(f"{self.origin}: the chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.current = None
            chunks.close()

    @staticmethod
    def _messages(conv: Conversation) -> List[dict]:
        out = [{"role": "system", "content": conv.system}] if conv.system is not None else []
        extras = conv.extras or ({},) * len(conv.messages)
        return out + [
            {"role": r, "content": c, **{k: v for k, v in e.items() if k != "loss"}}
            for (r, c), e in zip(conv.messages, extras)
        ]

    def _kwargs(self, conv: Conversation, options: Any) -> dict:
        """tools= and enable_thinking= as transformers passes them to the template."""
        from bmtrain_cli.data.tools import has_tools

        if has_tools(conv) and not ("tools" in self.source or "tool_calls" in self.source):
            raise UserError(f"{self.origin}: the chat template does not render tools or tool calls")
        out: dict = {"tools": list(conv.tools) if conv.tools else None}
        if options is not None and options.enable_thinking is not None:
            out["enable_thinking"] = options.enable_thinking
        return out

    def render(
        self, conv: Conversation, tokenizer: Optional[Tokenizer] = None, options: Any = None
    ) -> List[Piece]:
        from bmtrain_cli.data.chat_spans import locate_turns

        msgs = self._messages(conv)
        kw = self._kwargs(conv, options)
        return locate_turns(msgs, lambda m, gen: self._text(m, tokenizer, gen, kw), BUILTIN_TEMPLATES)

    def render_prompt(
        self, conv: Conversation, tokenizer: Optional[Tokenizer] = None, options: Any = None
    ) -> List[Piece]:
        msgs = self._messages(conv)
        if msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        return [(self._text(msgs, tokenizer, True, self._kwargs(conv, options)), False)]


ChatTemplate = Union[BuiltinTemplate, JinjaTemplate]


def tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Optional[int] = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def template_names() -> List[str]:
    return ["auto", "tokenizer", *BUILTIN_TEMPLATES]


def get_template(name: str, tokenizer: Optional[Tokenizer] = None) -> ChatTemplate:
    """``auto``: the tokenizer's chat template if it has one, else ``plain``. ``tokenizer``: require it."""
    if name in ("auto", "tokenizer"):
        source = tokenizer.chat_template if tokenizer is not None else None
        if source:
            return JinjaTemplate(source, getattr(tokenizer, "chat_template_file", None))
        if name == "tokenizer":
            raise UserError("template: tokenizer, but the tokenizer has no chat_template")
        return BUILTIN_TEMPLATES["plain"]
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    import difflib

    close = difflib.get_close_matches(name, template_names(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserError(f"unknown template {name!r}{hint}; choose one of {', '.join(template_names())}")
