"""Conversation + template + tokenizer -> token ids and a trainable mask (labels are ids where trainable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from bmtrain_cli.data.formats import Conversation
from bmtrain_cli.data.templates import BOS_MARK, EOS_MARK, Piece
from bmtrain_cli.data.tokenizers import Tokenizer

IGNORE_INDEX = -100


@dataclass
class Encoder:
    """Encodes conversations for one tokenizer/template pair (caches the marker -> id table)."""

    tokenizer: Tokenizer
    template: object
    train_on_prompt: bool = False

    def __post_init__(self) -> None:
        tok = self.tokenizer
        table: Dict[str, int] = dict(tok.special_tokens())
        for s in getattr(self.template, "specials", ()):
            idx = tok.token_to_id(s)
            if idx is not None:
                table[s] = idx
        if tok.eos_id is not None:
            table[EOS_MARK] = tok.eos_id
        if tok.bos_id is not None:
            table[BOS_MARK] = tok.bos_id
        self._table = table
        self._order = sorted(table, key=len, reverse=True)

    def encode_text(self, text: str) -> List[int]:
        """Encode text that may contain special-token strings or EOS/BOS markers (each becomes one id)."""
        if EOS_MARK in text and self.tokenizer.eos_id is None:
            text = text.replace(EOS_MARK, "")
        if BOS_MARK in text and self.tokenizer.bos_id is None:
            text = text.replace(BOS_MARK, "")
        ids: List[int] = []
        pos = 0
        while pos < len(text):
            best, best_tok = -1, ""
            for tok in self._order:
                i = text.find(tok, pos)
                if i != -1 and (best == -1 or i < best):
                    best, best_tok = i, tok
            if best == -1:
                ids.extend(self.tokenizer.encode(text[pos:]))
                break
            if best > pos:
                ids.extend(self.tokenizer.encode(text[pos:best]))
            ids.append(self._table[best_tok])
            pos = best + len(best_tok)
        return ids

    def _pieces_to_ids(self, pieces: Sequence[Piece]) -> Tuple[List[int], List[bool]]:
        ids: List[int] = []
        mask: List[bool] = []
        tok = self.tokenizer
        for text, trainable in pieces:
            piece_ids = self.encode_text(text)
            ids.extend(piece_ids)
            mask.extend([trainable or self.train_on_prompt] * len(piece_ids))
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
            mask.insert(0, False)
        return ids, mask

    def encode(self, conv: Conversation) -> Tuple[List[int], List[bool]]:
        """Token ids and the trainable mask of one sample."""
        tok = self.tokenizer
        if conv.is_text:
            ids = tok.encode(conv.text or "")
            if tok.eos_id is not None:
                ids.append(tok.eos_id)
            mask = [True] * len(ids)
            if tok.add_bos and tok.bos_id is not None:
                ids.insert(0, tok.bos_id)
                mask.insert(0, False)
            return ids, mask
        ids, mask = self._pieces_to_ids(self.template.render(conv, tok))
        if tok.add_eos and tok.eos_id is not None and ids and ids[-1] != tok.eos_id:
            ids.append(tok.eos_id)
            mask.append(True)
        return ids, mask

    def encode_prompt(self, conv: Conversation) -> List[int]:
        """Ids of the prompt for generation: every turn but the last answer, plus the assistant header."""
        ids, _ = self._pieces_to_ids(self.template.render_prompt(conv, self.tokenizer))
        return ids


def labels_from_mask(ids: Sequence[int], mask: Sequence[bool]) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64)
    return np.where(np.asarray(mask, dtype=bool), arr, IGNORE_INDEX)


def make_encoder(tokenizer: Tokenizer, template_name: str = "auto", train_on_prompt: bool = False) -> Encoder:
    from bmtrain_cli.data.templates import get_template

    return Encoder(tokenizer, get_template(template_name, tokenizer), train_on_prompt)


def encode_prompt(
    record: dict, tokenizer: Tokenizer, template_name: str = "auto", data_format: str = "auto"
) -> Tuple[List[int], Optional[str]]:
    """For evaluation/generation: (prompt ids, expected answer or None) of one raw record."""
    from bmtrain_cli.data.formats import parse_record

    conv = parse_record(record, data_format)
    enc = make_encoder(tokenizer, template_name)
    answer = conv.messages[-1][1] if conv.messages and conv.messages[-1][0] == "assistant" else None
    return enc.encode_prompt(conv), answer
