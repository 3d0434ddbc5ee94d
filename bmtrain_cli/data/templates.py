"""Prompt templates: built-in formats and the tokenizer's own Jinja chat template.

A template renders a Conversation into pieces ``(text, trainable)``; ``encode.py`` turns pieces into token
ids and labels. Assistant turns are the trainable pieces; everything else gets the ignore label unless
``train_on_prompt`` is set.

Built-ins: plain (prompt then answer, nothing added: the quickstart), alpaca, chatml, qwen (chatml with
Qwen's default system prompt), llama2, baichuan (Baichuan2-Chat's reserved user/assistant tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

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


class JinjaTemplate:
    """A Hugging Face chat template (Jinja) rendered in a sandbox.

    Trainable spans are found by rendering prefixes: for assistant turn i, the text of messages[:i] with
    the generation prompt is the prompt, and the text of messages[:i+1] ends with the answer.
    """

    name = "tokenizer"
    specials: Tuple[str, ...] = ()

    def __init__(self, source: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            keep_trailing_newline=True,
            extensions=["jinja2.ext.loopcontrols"],
        )
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        env.filters["tojson"] = tojson  # as transformers: no HTML escaping, keys in order, ensure_ascii off
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise UserError(f"the tokenizer's chat_template does not parse: {exc}") from None
        self.source = source

    def _text(
        self,
        messages: List[dict],
        tokenizer: Optional[Tokenizer],
        generation_prompt: bool,
        extra: Optional[dict] = None,
    ) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=generation_prompt,
                bos_token=(tokenizer.bos_token or "") if tokenizer else "",
                eos_token=(tokenizer.eos_token or "") if tokenizer else "",
                **(extra or {}),
            )
        except TemplateError as exc:
            raise UserError(f"the tokenizer's chat_template failed: {exc}") from None

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
            raise UserError(f"template {self.name!r} (the chat_template) does not render tools or tool calls")
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


def get_template(name: str, tokenizer: Optional[Tokenizer] = None):  # -> BuiltinTemplate | JinjaTemplate
    """``auto``: the tokenizer's chat template if it has one, else ``plain``. ``tokenizer``: require it."""
    if name in ("auto", "tokenizer"):
        source = tokenizer.chat_template if tokenizer is not None else None
        if source:
            return JinjaTemplate(source)
        if name == "tokenizer":
            raise UserError("template: tokenizer, but the tokenizer has no chat_template")
        return BUILTIN_TEMPLATES["plain"]
    if name in BUILTIN_TEMPLATES:
        return BUILTIN_TEMPLATES[name]
    import difflib

    close = difflib.get_close_matches(name, template_names(), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UserError(f"unknown template {name!r}{hint}; choose one of {', '.join(template_names())}")
