"""Prompt templates: built-in formats and the tokenizer's own Jinja chat template.

A template renders a Conversation into pieces ``(text, trainable)``; ``encode.py`` turns pieces into token
ids and labels. Assistant turns are the trainable pieces; everything else gets the ignore label unless
``train_on_prompt`` is set.

Built-ins: plain (prompt then answer, nothing added: the quickstart), alpaca, chatml, qwen (chatml with
Qwen's default system prompt), llama2, baichuan (Baichuan2-Chat's reserved user/assistant tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, List, Optional, Tuple

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

    def render(self, conv: Conversation, tokenizer: Optional[Tokenizer] = None) -> List[Piece]:
        return self._render(conv, generation_prompt=False)

    def render_prompt(self, conv: Conversation, tokenizer: Optional[Tokenizer] = None) -> List[Piece]:
        """The conversation up to and including the header of the last assistant turn (for generation)."""
        return self._render(conv, generation_prompt=True)

    def _render(self, conv: Conversation, generation_prompt: bool) -> List[Piece]:
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
        for role, content in msgs:
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

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as exc:
            raise UserError(f"the tokenizer's chat_template does not parse: {exc}") from None
        self.source = source

    def _text(self, messages: List[dict], tokenizer: Optional[Tokenizer], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=generation_prompt,
                bos_token=(tokenizer.bos_token or "") if tokenizer else "",
                eos_token=(tokenizer.eos_token or "") if tokenizer else "",
            )
        except TemplateError as exc:
            raise UserError(f"the tokenizer's chat_template failed: {exc}") from None

    @staticmethod
    def _messages(conv: Conversation) -> List[dict]:
        out = [{"role": "system", "content": conv.system}] if conv.system is not None else []
        return out + [{"role": r, "content": c} for r, c in conv.messages]

    def render(self, conv: Conversation, tokenizer: Optional[Tokenizer] = None) -> List[Piece]:
        msgs = self._messages(conv)
        pieces: List[Piece] = []
        done = ""
        for i, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            prompt = self._text(msgs[:i], tokenizer, True)
            full = self._text(msgs[: i + 1], tokenizer, False)
            if not (prompt.startswith(done) and full.startswith(prompt)):
                raise UserError(
                    "the tokenizer's chat_template is not prefix-stable (rendering more messages changes "
                    "earlier text), so assistant turns cannot be located; set train_config.template to a "
                    f"built-in ({', '.join(BUILTIN_TEMPLATES)})"
                )
            pieces.append((prompt[len(done) :], False))
            pieces.append((full[len(prompt) :], True))
            done = full
        return [p for p in pieces if p[0]]

    def render_prompt(self, conv: Conversation, tokenizer: Optional[Tokenizer] = None) -> List[Piece]:
        msgs = self._messages(conv)
        if msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        return [(self._text(msgs, tokenizer, True), False)]


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
