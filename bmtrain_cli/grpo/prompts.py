"""Prompt records of stage grpo: JSONL or JSON files of ``{"prompt": ..., <columns>}``.

``prompt`` is text (rendered as one user turn) or a list of chat messages (``role``/``content``, rendered up
to the assistant's header), both through the tokenizer's chat template (train_config.template), as the SFT
prompts are. Every other field is a column handed to the reward functions (``answer``, ...). A record
without a usable prompt is a bad record (file:line; train_config.on_bad_record); a prompt longer than
max_seq_len - max_completion_length keeps its last tokens (truncation: left) or is dropped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from bmtrain_cli.data.formats import BadRecord, Conversation
from bmtrain_cli.errors import UserError


@dataclass(frozen=True)
class Prompt:
    ids: List[int]  # the rendered prompt's token ids
    value: Any  # the record's prompt as written (text or messages): what reward functions get
    columns: Dict[str, Any]  # every other field of the record


def conversation_of(value: Any) -> Conversation:
    """The conversation a ``prompt`` value renders: text as one user turn, or chat messages."""
    from bmtrain_cli.data.tools import parse_message

    if isinstance(value, str):
        if not value.strip():
            raise BadRecord('field "prompt" is empty')
        return Conversation(messages=(("user", value),))
    if isinstance(value, list) and value:
        system: Optional[str] = None
        turns: List[Tuple[str, str]] = []
        for i, m in enumerate(value):
            role, content, _ = parse_message(m, f"prompt[{i}]")
            if role == "system" and not turns:
                system = content
            else:
                turns.append((role, content))
        if not turns:
            raise BadRecord('field "prompt" holds no user turn')
        return Conversation(messages=tuple(turns), system=system)
    raise BadRecord('field "prompt" must be text or a non-empty list of chat messages')


@dataclass
class PromptSet:
    """The prompts of one split, with what reading them came to (train/monitoring/report.py data_report)."""

    prompts: List[Prompt]
    records: int
    rejected: List[Dict[str, Any]]  # {"where", "error", "record"} of the records left out
    overlong: int

    def __len__(self) -> int:
        return len(self.prompts)

    def stats(self) -> Dict[str, Any]:
        return {
            "samples": len(self.prompts),
            "records": self.records,
            "rejected": len(self.rejected),
            "overlong": self.overlong,
            "line": f"data: {len(self.prompts):,} prompts from {self.records:,} records",
        }

    def start_rejected_log(self, output_dir: Path, is_main: bool) -> None:
        """The records left out (on_bad_record: skip), one JSON line each, in output_dir/rejected.jsonl."""
        if not is_main or not self.rejected:
            return
        with (Path(output_dir) / "rejected.jsonl").open("w", encoding="utf-8") as f:
            for r in self.rejected:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_prompts(
    paths: Any, tokenizer: Any, *, template: str, max_prompt_len: int, truncation: str, on_bad_record: str
) -> PromptSet:
    """Every prompt record of ``paths`` (files, globs or directories), rendered and tokenised."""
    from bmtrain_cli.data.encode import make_encoder
    from bmtrain_cli.data.readers import as_list, read_records, resolve_source

    encoder = make_encoder(tokenizer, template)
    out = PromptSet(prompts=[], records=0, rejected=[], overlong=0)
    for path in (f for spec in as_list(paths) for f in resolve_source(spec)):
        for rec in read_records(path):
            out.records += 1
            error = rec.error
            ids: Sequence[int] = ()
            if error is None:
                try:
                    if not isinstance(rec.value, dict) or "prompt" not in rec.value:
                        raise BadRecord('expected a JSON object with a "prompt" field')
                    ids = encoder.encode_prompt(conversation_of(rec.value["prompt"]))
                except BadRecord as exc:
                    error = str(exc)
            if error is not None:
                if on_bad_record == "error":
                    raise UserError(f"{rec.where()}: {error} (or set train_config.on_bad_record: skip)")
                out.rejected.append({"where": rec.where(), "error": error, "record": rec.value})
                continue
            if len(ids) > max_prompt_len:
                out.overlong += 1
                if truncation == "drop":
                    continue
                ids = ids[-max_prompt_len:]
            value = dict(rec.value)
            prompt = value.pop("prompt")
            out.prompts.append(Prompt(ids=list(ids), value=prompt, columns=value))
    if not out.prompts:
        raise UserError(f"no usable prompt in {paths}")
    return out
