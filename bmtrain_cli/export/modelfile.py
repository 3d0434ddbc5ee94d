"""The Ollama ``Modelfile`` written beside ``model.gguf``: FROM, a TEMPLATE in Ollama's Go-template syntax
when the chat format is one we recognise, the stop tokens and PARAMETER lines.

Recognised: the project's built-in templates (plain, alpaca, chatml, qwen, llama2, baichuan) when
``--template`` names one, else a Jinja chat template in the ChatML shape (``<|im_start|>``, Qwen's) or the
LLaMA 3 shape (``<|start_header_id|>``); a tokenizer without a chat template gets plain. Anything else gets a comment saying the
template could not be translated, so Ollama uses the chat template embedded in the GGUF.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, List, Optional, Tuple

MODELFILE = "Modelfile"

_CHATML = (
    "{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
    "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
    "<|im_start|>assistant\n"
)
_LLAMA3 = (
    "{{- if .System }}<|start_header_id|>system<|end_header_id|>\n\n{{ .System }}<|eot_id|>{{ end }}"
    "{{- range .Messages }}<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
    "{{ end }}<|start_header_id|>assistant<|end_header_id|>\n\n"
)
# built-in template name -> (Ollama template of one prompt, stop strings besides EOS, default system)
_BUILTIN = {
    "plain": ("{{ if .System }}{{ .System }}\n\n{{ end }}{{ .Prompt }}", (), None),
    "alpaca": (
        "{{ if .System }}{{ .System }}\n\n{{ end }}### Instruction:\n{{ .Prompt }}\n\n### Response:\n",
        ("### Instruction:",),
        "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.",
    ),
    "chatml": (_CHATML, ("<|im_end|>", "<|im_start|>"), None),
    "qwen": (_CHATML, ("<|im_end|>", "<|im_start|>"), "You are a helpful assistant."),
    "llama2": (
        "[INST] {{ if .System }}<<SYS>>\n{{ .System }}\n<</SYS>>\n\n{{ end }}{{ .Prompt }} [/INST]",
        ("[INST]",),
        None,
    ),
    "baichuan": ("<reserved_106>{{ .Prompt }}<reserved_107>", ("<reserved_106>",), None),
}


def translate_template(
    chat_template: Optional[str], builtin: Optional[str]
) -> Tuple[Optional[str], List[str], Optional[str]]:
    """(Ollama TEMPLATE or None, stop strings, default system prompt) for the built-in template ``builtin``
    when one is named, else for the Jinja chat template, else for plain (what the project uses then)."""
    if builtin is None and chat_template:
        if "<|im_start|>" in chat_template and "<|im_end|>" in chat_template:
            system = (
                "You are a helpful assistant." if "You are a helpful assistant." in chat_template else None
            )
            return _CHATML, ["<|im_end|>", "<|im_start|>"], system
        if "<|start_header_id|>" in chat_template and "<|eot_id|>" in chat_template:
            return _LLAMA3, ["<|eot_id|>", "<|start_header_id|>"], None
        return None, [], None
    template, stops, system = _BUILTIN.get(builtin or "plain", (None, (), None))
    return template, list(stops), system


def _quote(text: str) -> str:
    return '"""' + text.replace('"""', '\\"\\"\\"') + '"""'


def modelfile_text(
    gguf_name: str,
    chat_template: Optional[str],
    builtin: Optional[str],
    eos_token: Optional[str],
    context_length: int,
) -> str:
    """The Modelfile's content (see the module docstring)."""
    template, stops, system = translate_template(chat_template, builtin)
    lines = [
        f"# Ollama Modelfile written by bmtrain export: ollama create NAME -f {MODELFILE}",
        f"FROM ./{gguf_name}",
    ]
    if template is None:
        lines.append(
            "# The chat template could not be translated to Ollama's template syntax: Ollama uses the "
            "chat template embedded in the GGUF (tokenizer.chat_template)."
        )
    else:
        lines.append(f"TEMPLATE {_quote(template)}")
    if system:
        lines.append(f"SYSTEM {_quote(system)}")
    for stop in ([eos_token] if eos_token else []) + [s for s in stops if s != eos_token]:
        lines.append(f"PARAMETER stop {_quote(stop)}")
    lines += [f"PARAMETER num_ctx {int(context_length)}", "PARAMETER temperature 0.7", "PARAMETER top_p 0.9"]
    return "\n".join(lines) + "\n"


def write_modelfile(
    out_dir: Path, gguf_name: str, tokenizer: Any, builtin: Optional[str], context_length: int
) -> Path:
    """Write ``out_dir/Modelfile``; returns its path."""
    text = modelfile_text(
        gguf_name,
        getattr(tokenizer, "chat_template", None),
        builtin,
        getattr(tokenizer, "eos_token", None),
        context_length,
    )
    path = Path(out_dir) / MODELFILE
    path.write_text(text, encoding="utf-8")
    return path
