"""`bmtrain data-preview`: the first records rendered as the model sees them, trained tokens marked.

Trained runs are shown in colour on a terminal and between ``[[`` and ``]]`` otherwise; each sample ends
with its token counts. SFT records are shown once, preference pairs (stage: dpo) as chosen and rejected.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Sequence, Tuple

from bmtrain_cli.methods import method_of

GREEN, RESET = "\x1b[32m", "\x1b[0m"


def mark(tokenizer: Any, ids: Sequence[int], mask: Sequence[bool], colour: bool) -> str:
    """The decoded text with each run of trained tokens coloured or bracketed."""
    out: List[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j < len(ids) and bool(mask[j]) == bool(mask[i]):
            j += 1
        text = tokenizer.decode(list(ids[i:j]), skip_special_tokens=False)
        if mask[i]:
            text = f"{GREEN}{text}{RESET}" if colour else f"[[{text}]]"
        out.append(text)
        i = j
    return "".join(out)


def _samples(files: List[str], dpo: bool, data_format: str) -> Iterator[Tuple[str, List[Any]]]:
    from bmtrain_cli.data.formats import BadRecord, parse_record
    from bmtrain_cli.data.readers import read_records
    from bmtrain_cli.preference.pairs import parse_pair

    for path in files:
        for rec in read_records(path):
            where = rec.where()
            if rec.error:
                yield f"{where}: rejected: {rec.error}", []
                continue
            try:
                convs = list(parse_pair(rec.value)) if dpo else [parse_record(rec.value, data_format)]
            except BadRecord as exc:
                yield f"{where}: rejected: {exc}", []
                continue
            yield where, convs


def preview(config: Any, tokenizer: Any, n: int, colour: bool) -> List[str]:
    """The lines `bmtrain data-preview` prints for the first ``n`` records of the training data."""
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.readers import as_list, resolve_source
    from bmtrain_cli.data.turns import options_of

    t = config.train
    dpo = method_of(t).sample == "pair"  # preference pairs: chosen and rejected
    encoder = make_encoder(tokenizer, t.template, t.train_on_prompt and not dpo, options_of(t))
    files = [f for spec in as_list(t.data_path) for f in resolve_source(spec)]
    lines: List[str] = []
    for k, (where, convs) in enumerate(_samples(files, dpo, t.data_format)):
        if k >= n:
            break
        lines.append(f"--- {where}")
        for label, conv in zip(("chosen", "rejected") if dpo else ("",), convs):
            ids, mask = encoder.encode(conv)
            if label:
                lines.append(f"[{label}]")
            lines.append(mark(tokenizer, ids, mask, colour))
            lines.append(f"({len(ids)} tokens, {sum(map(bool, mask))} trained)")
    return lines
