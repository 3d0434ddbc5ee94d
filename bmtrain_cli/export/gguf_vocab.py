"""The tokenizer as GGUF metadata (``tokenizer.ggml.*``), in the two shapes llama.cpp reads:

- a sentencepiece ``.model`` -> tokenizer model ``llama``: pieces, scores, token types (normal, unknown,
  control, unused, byte), ``add_space_prefix`` from whether the model adds its dummy prefix;
- a Hugging Face ``tokenizer.json`` byte-level BPE -> model ``gpt2``: tokens, merges, token types (added
  special tokens are control, other added tokens user-defined) and the pre-tokenizer type that names the
  split regex (``qwen2``, ``llama-bpe``, or ``gpt2`` for ByteLevel's own regex).

Rows of the embedding past the tokenizer's vocabulary get ``[PAD<i>]`` tokens of type unused, as
llama.cpp's converter writes them. The chat template goes into ``tokenizer.chat_template``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from bmtrain_cli.errors import UserError

# llama.cpp's token types (gguf.TokenType)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Split regexes of tokenizer.json pre-tokenizers -> llama.cpp's pre-tokenizer type
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_TYPES = {_QWEN2_SPLIT: "qwen2", _LLAMA3_SPLIT: "llama-bpe"}


@dataclass
class GGUFVocab:
    model: str  # "llama" (sentencepiece) or "gpt2" (byte-level BPE)
    tokens: List[str]
    token_types: List[int]
    scores: Optional[List[float]] = None
    merges: List[str] = field(default_factory=list)
    pre: Optional[str] = None
    add_space_prefix: Optional[bool] = None
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    pad_id: Optional[int] = None
    unk_id: Optional[int] = None
    add_bos: bool = False
    add_eos: bool = False
    chat_template: Optional[str] = None


def _pad_to(vocab: GGUFVocab, size: int) -> None:
    if len(vocab.tokens) > size:
        raise UserError(
            f"--format gguf: the tokenizer has {len(vocab.tokens)} tokens but the model only {size} "
            "embedding rows"
        )
    for i in range(len(vocab.tokens), size):
        vocab.tokens.append(f"[PAD{i}]")
        vocab.token_types.append(UNUSED)
        if vocab.scores is not None:
            vocab.scores.append(-1000.0)


def _sentencepiece_vocab(tok: Any) -> GGUFVocab:
    sp = tok.sp
    tokens, types, scores = [], [], []
    for i in range(sp.get_piece_size()):
        tokens.append(sp.id_to_piece(i))
        scores.append(float(sp.get_score(i)))
        if sp.is_unknown(i):
            types.append(UNKNOWN)
        elif sp.is_control(i):
            types.append(CONTROL)
        elif sp.is_unused(i):
            types.append(UNUSED)
        elif sp.is_byte(i):
            types.append(BYTE)
        else:
            types.append(NORMAL)
    first = sp.encode("a", out_type=str)
    unk = sp.unk_id()
    return GGUFVocab(
        "llama",
        tokens,
        types,
        scores=scores,
        add_space_prefix=bool(first) and first[0].startswith("\u2581"),
        unk_id=unk if unk >= 0 else None,
    )


def _pre_tokenizer(pre: Any) -> Tuple[List[str], bool]:
    """(the Split regexes, whether a ByteLevel step is there and whether it splits with its own regex)."""
    steps = pre.get("pretokenizers", []) if isinstance(pre, dict) and pre.get("type") == "Sequence" else [pre]
    regexes, byte_level, own_regex = [], False, False
    for step in steps:
        if not isinstance(step, dict):
            continue
        if step.get("type") == "Split":
            pattern = step.get("pattern") or {}
            regexes.append(pattern.get("Regex") or pattern.get("String") or "")
        elif step.get("type") == "ByteLevel":
            byte_level = True
            own_regex = own_regex or bool(step.get("use_regex", True))
    if own_regex:
        regexes.append("<ByteLevel>")
    return regexes, byte_level


def _bpe_pre_type(regexes: List[str]) -> str:
    if regexes == ["<ByteLevel>"]:
        return "gpt2"
    if len(regexes) == 1 and regexes[0] in PRE_TOKENIZER_TYPES:
        return PRE_TOKENIZER_TYPES[regexes[0]]
    raise UserError(
        "--format gguf: the tokenizer.json pre-tokenizer splits text with "
        f"{' then '.join(regexes) or 'no regex'}, which matches no llama.cpp pre-tokenizer type "
        f"(known: Qwen2's, LLaMA 3's, GPT-2's ByteLevel)"
    )


def bpe_vocab(tok: Any) -> GGUFVocab:
    """The vocabulary of a byte-level BPE tokenizer.json; UserError for any other tokenizer.json."""
    data = json.loads(tok._model_bytes().decode("utf-8"))
    model = data.get("model") or {}
    regexes, byte_level = _pre_tokenizer(data.get("pre_tokenizer"))
    if model.get("type") != "BPE" or not byte_level:
        raise UserError(
            "--format gguf: tokenizer.json is not a byte-level BPE (model "
            f"{model.get('type')!r}); llama.cpp reads byte-level BPE tokenizer.json or a sentencepiece "
            "tokenizer.model (put the .model file in the checkpoint)"
        )
    pre = _bpe_pre_type(regexes)
    by_id: Dict[int, Tuple[str, int]] = {int(i): (t, NORMAL) for t, i in model.get("vocab", {}).items()}
    for added in data.get("added_tokens") or []:
        by_id[int(added["id"])] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    size = max(by_id) + 1 if by_id else 0
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED))[0] for i in range(size)]
    types = [by_id.get(i, (f"[PAD{i}]", UNUSED))[1] for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    unk = model.get("unk_token")
    return GGUFVocab(
        "gpt2", tokens, types, merges=merges, pre=pre, unk_id=tok.token_to_id(unk) if unk else None
    )


def gguf_vocab(tok: Any, vocab_size: int) -> GGUFVocab:
    """The tokenizer's GGUF vocabulary, padded to the model's ``vocab_size`` rows."""
    vocab = _sentencepiece_vocab(tok) if tok.kind == "sentencepiece" else bpe_vocab(tok)
    vocab.bos_id, vocab.eos_id, vocab.pad_id = tok.bos_id, tok.eos_id, tok.pad_id
    vocab.add_bos, vocab.add_eos = bool(tok.add_bos), bool(tok.add_eos)
    vocab.chat_template = tok.chat_template
    _pad_to(vocab, vocab_size)
    return vocab


def add_vocab(writer: Any, vocab: GGUFVocab) -> None:
    """Write ``vocab`` as tokenizer.ggml.* (and tokenizer.chat_template) through a gguf.GGUFWriter; the
    optional entries only when set."""
    writer.add_tokenizer_model(vocab.model)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.token_types)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    optional = (
        (vocab.pre, writer.add_tokenizer_pre),
        (vocab.scores, writer.add_token_scores),
        (vocab.merges or None, writer.add_token_merges),
        (vocab.bos_id, writer.add_bos_token_id),
        (vocab.eos_id, writer.add_eos_token_id),
        (vocab.pad_id, writer.add_pad_token_id),
        (vocab.unk_id, writer.add_unk_token_id),
        (vocab.add_space_prefix, writer.add_add_space_prefix),
        (vocab.chat_template or None, writer.add_chat_template),
    )
    for value, add in optional:
        if value is not None:
            add(value)
