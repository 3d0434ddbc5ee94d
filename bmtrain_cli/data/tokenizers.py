"""Tokenizers: sentencepiece ``.model`` files and Hugging Face ``tokenizer.json``, behind one small class.

Special tokens and the chat template come from ``tokenizer_config.json`` / ``special_tokens_map.json`` /
``chat_template.jinja`` beside the tokenizer file, as Hugging Face lays them out. ``save(dir)`` writes the
same layout so that ``load_tokenizer(dir)`` gives the tokenizer back (checkpoints and exports use it).
"""

from __future__ import annotations

import hashlib
import io
import json
import string
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from bmtrain_cli.errors import UserError

TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
SP_MODEL_FILE = "tokenizer.model"
HF_TOKENIZER_FILE = "tokenizer.json"

_EOS_GUESSES = ("</s>", "<|endoftext|>", "<|im_end|>", "<eos>", "<|end_of_text|>")
_BOS_GUESSES = ("<s>", "<|begin_of_text|>", "<bos>")
_PAD_GUESSES = ("<pad>", "<|pad|>", "[PAD]")


def _token_text(value: Any) -> Optional[str]:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: cannot read tokenizer settings: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object")
    return data


def _pick_chat_template(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": "default", "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        chosen = named.get("default") or next(iter(named.values()), None)
        return chosen if isinstance(chosen, str) else None
    return None


class Tokenizer:
    """Common surface of the two backends.

    ``encode`` never adds special tokens; the data pipeline adds BOS/EOS itself according to
    ``add_bos`` / ``add_eos`` and the template. ``bos_id`` may be None (Qwen has no BOS); ``eos_id`` and
    ``pad_id`` are always set (pad falls back to EOS).
    """

    kind = "base"

    def __init__(self, settings: Dict[str, Any]):
        self.settings = dict(settings)  # tokenizer_config.json contents, kept for save()
        self.chat_template: Optional[str] = _pick_chat_template(settings.get("chat_template"))
        self.chat_template_file: Optional[str] = None  # where the chat template was read (named in errors)
        self.bos_token = _token_text(settings.get("bos_token"))
        self.eos_token = _token_text(settings.get("eos_token"))
        self.pad_token = _token_text(settings.get("pad_token"))

    # -- backend hooks
    def encode(self, text: str) -> List[int]:  # pragma: no cover - overridden
        raise NotImplementedError

    def encode_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:  # pragma: no cover
        """``encode`` plus each token's [start, end) character span in ``text``."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:  # pragma: no cover
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [self.encode(t) for t in texts]

    def token_to_id(self, token: str) -> Optional[int]:  # pragma: no cover
        raise NotImplementedError

    def id_to_token(self, idx: int) -> Optional[str]:  # pragma: no cover
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:  # pragma: no cover
        raise NotImplementedError

    def _save_model(self, out: Path) -> None:  # pragma: no cover
        raise NotImplementedError

    def _model_bytes(self) -> bytes:  # pragma: no cover
        raise NotImplementedError

    # -- shared
    def _resolve_specials(self, default_bos: Optional[int], default_eos: Optional[int]) -> None:
        def lookup(text: Optional[str], guesses: Iterable[str]) -> Optional[int]:
            if text is not None:
                return self.token_to_id(text)
            for g in guesses:
                idx = self.token_to_id(g)
                if idx is not None:
                    return idx
            return None

        if "bos_token" in self.settings:
            bos = lookup(self.bos_token, ())
        else:
            bos = default_bos if default_bos is not None else lookup(None, _BOS_GUESSES)
        if "eos_token" in self.settings:
            eos = lookup(self.eos_token, ())
        else:
            eos = default_eos if default_eos is not None else lookup(None, _EOS_GUESSES)
        pad = lookup(self.pad_token, ()) if self.pad_token is not None else self._default_pad()
        self.bos_id: Optional[int] = bos
        self.eos_id: Optional[int] = eos
        self.pad_id: int = pad if pad is not None else (eos if eos is not None else 0)
        if self.bos_token is None and bos is not None:
            self.bos_token = self.id_to_token(bos)
        if self.eos_token is None and eos is not None:
            self.eos_token = self.id_to_token(eos)
        add_bos = self.settings.get("add_bos_token")
        self.add_bos: bool = bool(add_bos) if add_bos is not None else self._default_add_bos()
        self.add_bos = self.add_bos and self.bos_id is not None
        self.add_eos: bool = bool(self.settings.get("add_eos_token", False))

    def _default_pad(self) -> Optional[int]:
        for g in _PAD_GUESSES:
            idx = self.token_to_id(g)
            if idx is not None:
                return idx
        return None

    def _default_add_bos(self) -> bool:
        return self.bos_id is not None

    def special_tokens(self) -> Dict[str, int]:
        """Text form -> id of the tokens that must never be split (used when encoding rendered templates)."""
        out: Dict[str, int] = {}
        for text, idx in ((self.bos_token, self.bos_id), (self.eos_token, self.eos_id)):
            if text and idx is not None:
                out[text] = idx
        if self.pad_token and self.pad_token not in out:
            out[self.pad_token] = self.pad_id
        return out

    def fingerprint(self) -> str:
        """A hash of everything that decides token ids (model + specials); keys the token cache."""
        h = hashlib.sha256(self._model_bytes())
        meta = [
            self.kind,
            self.bos_id,
            self.eos_id,
            self.pad_id,
            self.add_bos,
            self.add_eos,
            self.chat_template,
        ]
        h.update(json.dumps(meta, sort_keys=True).encode())
        return h.hexdigest()[:24]

    def save(self, out_dir: str) -> None:
        """Write the tokenizer and tokenizer_config.json so that ``load_tokenizer(out_dir)`` restores it."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._save_model(out)
        cfg = {k: v for k, v in self.settings.items() if k not in ("chat_template",)}
        cfg.update(
            {
                "bos_token": self.bos_token if self.bos_id is not None else None,
                "eos_token": self.eos_token,
                "pad_token": self.id_to_token(self.pad_id),
                "add_bos_token": self.add_bos,
                "add_eos_token": self.add_eos,
            }
        )
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (out / TOKENIZER_CONFIG).write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id}, "
            f"pad_id={self.pad_id}, chat_template={'yes' if self.chat_template else 'no'})"
        )


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, model_bytes: bytes, settings: Dict[str, Any]):
        import sentencepiece as spm

        self._bytes = model_bytes
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError) as exc:
            raise UserError(f"not a valid sentencepiece model: {exc}") from None
        super().__init__(settings)
        bos = self.sp.bos_id()
        eos = self.sp.eos_id()
        self._resolve_specials(bos if bos >= 0 else None, eos if eos >= 0 else None)
        if self.pad_token is None:
            sp_pad = self.sp.pad_id()
            if sp_pad >= 0:
                self.pad_id = sp_pad

    def _default_pad(self) -> Optional[int]:
        p = self.sp.pad_id()
        return p if p >= 0 else super()._default_pad()

    def encode(self, text: str) -> List[int]:
        return list(self.sp.encode(text))

    def encode_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        pieces = self.sp.encode(text, return_type="proto").pieces
        # sentencepiece's spans count bytes of the UTF-8 input: map them to characters
        char_at = [i for i, ch in enumerate(text) for _ in range(len(ch.encode("utf-8")))] + [len(text)]
        return [p.id for p in pieces], [(char_at[p.begin], char_at[p.end]) for p in pieces]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(x) for x in self.sp.encode(list(texts))] if texts else []

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # ids past the vocabulary (the rows of a model whose vocab_size pads the tokenizer's) decode to
        # nothing, as in the tokenizers library
        n = self.sp.get_piece_size()
        ids = [int(i) for i in ids if 0 <= int(i) < n]
        if skip_special_tokens:
            ids = [i for i in ids if not (self.sp.IsControl(i) or i == self.pad_id)]
        return self.sp.decode(ids)

    def token_to_id(self, token: str) -> Optional[int]:
        idx = self.sp.piece_to_id(token)
        if idx == self.sp.unk_id() and token != self.sp.id_to_piece(idx):
            return None
        return int(idx)

    def id_to_token(self, idx: int) -> Optional[str]:
        if 0 <= idx < self.sp.get_piece_size():
            return self.sp.id_to_piece(idx)
        return None

    @property
    def vocab_size(self) -> int:
        return int(self.sp.get_piece_size())

    def _save_model(self, out: Path) -> None:
        (out / SP_MODEL_FILE).write_bytes(self._bytes)

    def _model_bytes(self) -> bytes:
        return self._bytes


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, json_text: str, settings: Dict[str, Any]):
        from tokenizers import Tokenizer as _Tok

        try:
            self.tok = _Tok.from_str(json_text)
        except Exception as exc:  # the tokenizers library raises plain Exception subclasses
            raise UserError(f"not a valid tokenizer.json: {exc}") from None
        self._json = json_text
        super().__init__(settings)
        self._resolve_specials(None, None)

    def _default_add_bos(self) -> bool:
        # Without add_bos_token, do what the tokenizer's own post-processor does.
        if self.bos_id is None:
            return False
        ids = self.tok.encode("a", add_special_tokens=True).ids
        return bool(ids) and ids[0] == self.bos_id

    def encode(self, text: str) -> List[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_offsets(self, text: str) -> Tuple[List[int], List[Tuple[int, int]]]:
        enc = self.tok.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [list(e.ids) for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> Optional[int]:
        idx = self.tok.token_to_id(token)
        return None if idx is None else int(idx)

    def id_to_token(self, idx: int) -> Optional[str]:
        return self.tok.id_to_token(int(idx))

    def special_tokens(self) -> Dict[str, int]:
        # added tokens are matched by the tokenizers library itself; only declared specials are needed
        return super().special_tokens()

    @property
    def vocab_size(self) -> int:
        return int(self.tok.get_vocab_size(with_added_tokens=True))

    def _save_model(self, out: Path) -> None:
        (out / HF_TOKENIZER_FILE).write_text(self._json, encoding="utf-8")

    def _model_bytes(self) -> bytes:
        return self._json.encode("utf-8")


def _settings_beside(directory: Path) -> Dict[str, Any]:
    settings: Dict[str, Any] = {}
    stm = directory / SPECIAL_TOKENS_MAP
    if stm.is_file():
        for k, v in _read_json(stm).items():
            if k in ("bos_token", "eos_token", "pad_token", "unk_token"):
                settings[k] = v
    tc = directory / TOKENIZER_CONFIG
    if tc.is_file():
        settings.update(_read_json(tc))
    jinja = directory / CHAT_TEMPLATE_FILE
    if jinja.is_file() and not settings.get("chat_template"):
        settings["chat_template"] = jinja.read_text(encoding="utf-8")
    return settings


def load_tokenizer(path: str) -> Tokenizer:
    """Load a sentencepiece ``.model``, a ``tokenizer.json``, or a directory holding one of them."""
    p = Path(path).expanduser()
    if not p.exists():
        raise UserError(f"tokenizer not found: {path}")
    if p.is_dir():
        directory = p
        if (p / HF_TOKENIZER_FILE).is_file():
            p = p / HF_TOKENIZER_FILE
        elif (p / SP_MODEL_FILE).is_file():
            p = p / SP_MODEL_FILE
        else:
            models = sorted(p.glob("*.model"))
            if not models:
                raise UserError(
                    f"no tokenizer in {path}: expected {HF_TOKENIZER_FILE} or a sentencepiece *.model file"
                )
            p = models[0]
    else:
        directory = p.parent
    settings = _settings_beside(directory)
    tok = _load_backend(p, settings)
    if tok.chat_template is not None:
        in_config = (
            _read_json(directory / TOKENIZER_CONFIG).get("chat_template")
            if (directory / TOKENIZER_CONFIG).is_file()
            else None
        )
        tok.chat_template_file = str(directory / (TOKENIZER_CONFIG if in_config else CHAT_TEMPLATE_FILE))
    return tok


def _load_backend(p: Path, settings: Dict[str, Any]) -> Tokenizer:
    if p.suffix == ".json":
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{p}: cannot read: {exc}") from None
        return HFTokenizer(text, settings)
    try:
        return SentencePieceTokenizer(p.read_bytes(), settings)
    except UserError as exc:  # name the file that is not a sentencepiece model
        raise UserError(f"{p}: {exc}") from None


# The smallest vocabulary train_sentencepiece makes: byte pieces + unk/bos/eos/pad + the printable ASCII
# characters (each character of the corpus gets a piece too)
MIN_GENERATED_VOCAB = 256 + 4 + len(set(string.printable))


def train_sentencepiece(
    texts: Iterable[str],
    out_dir: str,
    vocab_size: int = 512,
    *,
    chat_template: Optional[str] = None,
    model_type: str = "bpe",
) -> Tokenizer:
    """Train a small byte-fallback sentencepiece tokenizer (used by the quickstart) and save it to out_dir.

    Digits are split one per token (arithmetic stays learnable), whitespace is kept as is, no dummy prefix
    is added (so prompt and answer can be encoded separately without a spurious space).
    """
    import sentencepiece as spm

    corpus = [t for t in texts if t]
    if not corpus:
        raise UserError("cannot train a tokenizer on no text")
    corpus.append(string.printable)  # every ASCII character (and the space) gets its own piece
    chars = set("".join(corpus))
    floor = MIN_GENERATED_VOCAB - len(set(string.printable)) + len(chars)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type=model_type,
        vocab_size=max(int(vocab_size), floor),
        hard_vocab_limit=False,
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
        num_threads=1,
    )
    settings: Dict[str, Any] = {"add_bos_token": True, "add_eos_token": False}
    if chat_template is not None:
        settings["chat_template"] = chat_template
    tok = SentencePieceTokenizer(model.getvalue(), settings)
    tok.save(out_dir)
    return load_tokenizer(out_dir)
