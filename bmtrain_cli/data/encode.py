"""Conversation + template + tokenizer -> token ids and a trainable mask (labels are ids where trainable)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from bmtrain_cli.data.formats import Conversation
from bmtrain_cli.data.templates import BOS_MARK, EOS_MARK, ChatTemplate, Piece
from bmtrain_cli.data.tokenizers import Tokenizer
from bmtrain_cli.data.turns import DEFAULT, RenderOptions, apply_options, prepare
from bmtrain_cli.labels import IGNORE_INDEX


@dataclass
class Encoder:
    """Encodes conversations for one tokenizer/template pair (caches the marker -> id table)."""

    tokenizer: Tokenizer
    template: ChatTemplate
    train_on_prompt: bool = False
    options: RenderOptions = DEFAULT  # mask_history, reasoning and enable_thinking (data/turns.py)

    def render(self, conv: Conversation) -> List[Piece]:
        """The template's pieces of a conversation, with the loss options applied."""
        conv = prepare(conv, self.options)
        pieces = self.template.render(conv, self.tokenizer, self.options)
        return apply_options(pieces, conv, self.options)

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

    def split_specials(self, text: str) -> List[Union[str, int]]:
        """Text cut into plain strings and the ids of the special-token strings / markers inside it."""
        if EOS_MARK in text and self.tokenizer.eos_id is None:
            text = text.replace(EOS_MARK, "")
        if BOS_MARK in text and self.tokenizer.bos_id is None:
            text = text.replace(BOS_MARK, "")
        out: List[Union[str, int]] = []
        pos = 0
        while pos < len(text):
            best, best_tok = -1, ""
            for tok in self._order:
                i = text.find(tok, pos)
                if i != -1 and (best == -1 or i < best):
                    best, best_tok = i, tok
            if best == -1:
                out.append(text[pos:])
                break
            if best > pos:
                out.append(text[pos:best])
            out.append(self._table[best_tok])
            pos = best + len(best_tok)
        return out

    def _pieces_to_ids(self, pieces: Sequence[Piece]) -> Tuple[List[int], List[bool]]:
        if self.template.joint:
            return self._joint(self._plan(pieces))
        return self._assemble(self._plan(pieces), None)

    def _joint(self, plan: Sequence[Tuple[Union[str, int], bool]]) -> Tuple[List[int], List[bool]]:
        """The text between special tokens tokenised as one string; a token is trainable when any of its
        characters is (transformers' assistant mask takes the tokens that its spans' characters fall in)."""
        ids: List[int] = []
        mask: List[bool] = []
        text: List[str] = []
        flags: List[bool] = []

        def flush() -> None:
            if text:
                part_ids, spans = self.tokenizer.encode_offsets("".join(text))
                for idx, (a, b) in zip(part_ids, spans):
                    ids.append(idx)
                    mask.append(any(flags[a : max(b, a + 1)]) or self.train_on_prompt)
                text.clear()
                flags.clear()

        for part, trainable in plan:
            if isinstance(part, int):
                flush()
                ids.append(part)
                mask.append(trainable or self.train_on_prompt)
            else:
                text.append(part)
                flags.extend([trainable] * len(part))
        flush()
        return self._with_bos(ids, mask)

    def _plan(self, pieces: Sequence[Piece]) -> List[Tuple[Union[str, int], bool]]:
        return [(part, trainable) for text, trainable in pieces for part in self.split_specials(text)]

    def _assemble(
        self, plan: Sequence[Tuple[Union[str, int], bool]], encoded: Optional[Iterator[List[int]]]
    ) -> Tuple[List[int], List[bool]]:
        ids: List[int] = []
        mask: List[bool] = []
        tok = self.tokenizer
        for part, trainable in plan:
            if isinstance(part, int):
                part_ids = [part]
            else:
                part_ids = next(encoded) if encoded is not None else tok.encode(part)
            ids.extend(part_ids)
            mask.extend([trainable or self.train_on_prompt] * len(part_ids))
        return self._with_bos(ids, mask)

    def _with_bos(self, ids: List[int], mask: List[bool]) -> Tuple[List[int], List[bool]]:
        tok = self.tokenizer
        if tok.add_bos and tok.bos_id is not None and (not ids or ids[0] != tok.bos_id):
            ids.insert(0, tok.bos_id)
            mask.insert(0, False)
        return ids, mask

    def encode_many(self, convs: Sequence[Conversation]) -> List[Tuple[List[int], List[bool]]]:
        """``encode`` over many samples with one batched tokenizer call (faster than one call per piece)."""
        tok = self.tokenizer
        plans: List[Any] = []
        texts: List[str] = []
        for conv in convs:
            if conv.is_text:
                plans.append(None)
                texts.append(conv.text or "")
                continue
            if self.template.joint:  # one string per run of text: encoded with its offsets, per sample
                plans.append(self._finish(*self._pieces_to_ids(self.render(conv))))
                continue
            plan = self._plan(self.render(conv))
            plans.append(plan)
            texts.extend(p for p, _ in plan if isinstance(p, str))
        encoded = iter(tok.encode_batch(texts))
        out = []
        for plan in plans:
            if plan is None:
                out.append(self._text_sample(next(encoded)))
                continue
            if isinstance(plan, tuple):
                out.append(plan)
                continue
            ids, mask = self._assemble(plan, encoded)
            out.append(self._finish(ids, mask))
        return out

    def _text_sample(self, ids: List[int]) -> Tuple[List[int], List[bool]]:
        tok = self.tokenizer
        ids = list(ids)
        if tok.eos_id is not None:
            ids.append(tok.eos_id)
        mask = [True] * len(ids)
        if tok.add_bos and tok.bos_id is not None:
            ids.insert(0, tok.bos_id)
            mask.insert(0, False)
        return ids, mask

    def _finish(self, ids: List[int], mask: List[bool]) -> Tuple[List[int], List[bool]]:
        tok = self.tokenizer
        if tok.add_eos and tok.eos_id is not None and ids and ids[-1] != tok.eos_id:
            ids.append(tok.eos_id)
            mask.append(True)
        return ids, mask

    def encode(self, conv: Conversation) -> Tuple[List[int], List[bool]]:
        """Token ids and the trainable mask of one sample."""
        if conv.is_text:
            return self._text_sample(self.tokenizer.encode(conv.text or ""))
        ids, mask = self._pieces_to_ids(self.render(conv))
        return self._finish(ids, mask)

    def encode_prompt(self, conv: Conversation) -> List[int]:
        """Ids of the prompt for generation: every turn but the last answer, plus the assistant header."""
        ids, _ = self._pieces_to_ids(self.template.render_prompt(conv, self.tokenizer, self.options))
        return ids


def labels_from_mask(ids: Sequence[int], mask: Sequence[bool]) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64)
    return np.where(np.asarray(mask, dtype=bool), arr, IGNORE_INDEX)


def make_encoder(
    tokenizer: Tokenizer,
    template_name: str = "auto",
    train_on_prompt: bool = False,
    options: RenderOptions = DEFAULT,
) -> Encoder:
    from bmtrain_cli.data.templates import get_template

    return Encoder(tokenizer, get_template(template_name, tokenizer), train_on_prompt, options)


def encode_prompt(
    record: dict, tokenizer: Tokenizer, template_name: str = "auto", data_format: str = "auto"
) -> Tuple[List[int], Optional[str]]:
    """For evaluation/generation: (prompt ids, expected answer or None) of one raw record."""
    from bmtrain_cli.data.formats import parse_record

    conv = parse_record(record, data_format)
    enc = make_encoder(tokenizer, template_name)
    answer = conv.messages[-1][1] if conv.messages and conv.messages[-1][0] == "assistant" else None
    return enc.encode_prompt(conv), answer


def encode_scored_file(
    path: str,
    tokenizer: Tokenizer,
    template: str = "auto",
    data_format: str = "auto",
    max_len: int = 2048,
    max_records: Optional[int] = None,
) -> List[Tuple[np.ndarray, np.ndarray]]:
    """(input ids, unshifted labels with -100 on unscored tokens) per record of a JSONL/JSON file, encoded
    exactly as for training (format, template, trainable mask), for scoring (`bmtrain eval`, the export's
    held-out check). A bad record is a UserError naming file:line; records longer than ``max_len`` keep
    their last tokens; records with nothing to score (e.g. the answer truncated away) are left out; at
    most ``max_records`` are returned."""
    from bmtrain_cli.data.formats import BadRecord, parse_record
    from bmtrain_cli.data.readers import read_records
    from bmtrain_cli.errors import UserError

    encoder = make_encoder(tokenizer, template)
    out: List[Tuple[np.ndarray, np.ndarray]] = []
    for rec in read_records(path):
        if rec.error:
            raise UserError(f"{rec.where()}: {rec.error}")
        try:
            conv = parse_record(rec.value, data_format)
        except BadRecord as exc:
            raise UserError(f"{rec.where()}: {exc}") from None
        ids, mask = encoder.encode(conv)
        ids, mask = ids[-max_len:], mask[-max_len:]
        labels = labels_from_mask(ids, mask)
        if (labels[1:] != IGNORE_INDEX).sum() == 0:
            continue
        out.append((np.asarray(ids, dtype=np.int64), labels))
        if max_records is not None and len(out) >= max_records:
            break
    return out


def encode_eval_file(
    path: str,
    tokenizer: Tokenizer,
    template: str = "auto",
    data_format: str = "auto",
    max_records: int = 200,
    max_len: int = 2048,
) -> List[Tuple[np.ndarray, np.ndarray]]:
    """The first ``max_records`` usable records of a held-out file (:func:`encode_scored_file`); UserError
    when none has a trainable token."""
    from bmtrain_cli.errors import UserError

    samples = encode_scored_file(
        path, tokenizer, template, data_format, max_len=max_len, max_records=max_records
    )
    if not samples:
        raise UserError(f"{path}: no record with a trainable token to evaluate")
    return samples
