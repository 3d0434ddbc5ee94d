"""What the plan learns from a config's tokenizer and data before training: the vocabulary a fresh model is
sized by, and, with ``batching: longest``, the longest sample (batches are padded to their longest row, so
the activations of the biggest batch follow it, not ``max_seq_len``).

The trainer knows both exactly (it has the tokenizer and the indexed data set); ``bmtrain plan`` and
``validate-config`` read them the same way the trainer will: the tokenizer from ``tokenizer_path``, the one
a previous run generated in ``<output_dir>/tokenizer``, or the demo tokenizer; the data through the real
loader (validated and tokenised, into the data cache). Nothing here writes to the output directory.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, List, Optional

from bmtrain_cli.methods import method_of

# Data sets larger than this are not tokenised by `bmtrain plan` (the trainer does it anyway); the plan
# then assumes batches reach max_seq_len and says so.
SCAN_LIMIT_BYTES = 64 << 20  # about 15 s of tokenising on one core
SAY_BYTES = 8 << 20  # above this, say on stderr that the data is being read


@dataclass(frozen=True)
class DataFacts:
    vocab_size: Optional[int] = None  # None: the checkpoint's or the config's own
    longest: Optional[int] = None  # longest usable sample (<= max_seq_len); None: not known
    note: str = ""  # what was assumed, for the plan's notes


@contextlib.contextmanager
def generated_inputs(config: Any) -> Iterator[dict]:
    """The tokenizer directory and training data the trainer would use, generating the demo ones in a
    temporary directory (deterministic: the trainer generates the same). Values may be None."""
    m, t = config.model, config.train
    with contextlib.ExitStack() as stack:
        out = {"tokenizer": None, "data": t.data_path, "tmp": None}
        demo = bool(t.demo_data) and t.data_path is None
        generated = Path(t.output_dir) / "tokenizer"
        if m.tokenizer_path or m.model_name_or_path:  # the trainer's order (train/trainer._load_tokenizer)
            out["tokenizer"] = str(m.tokenizer_path or m.model_name_or_path)
        elif (generated / "tokenizer_config.json").is_file():
            out["tokenizer"] = str(generated)
        if demo:
            from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data

            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bmtrain-plan-")))
            out["tmp"] = str(tmp)
            train, heldout = write_demo_data(str(tmp / "data"), task=t.demo_data, seed=0)
            out["data"] = train
            if out["tokenizer"] is None:
                train_demo_tokenizer(str(tmp / "tokenizer"), [train, heldout])
                out["tokenizer"] = str(tmp / "tokenizer")
        yield out


def _data_bytes(data: Any) -> Optional[int]:
    """Total size of the data files, None when they are not there."""
    from bmtrain_cli.data.readers import as_list, resolve_source
    from bmtrain_cli.errors import UserError

    try:
        return sum(Path(f).stat().st_size for src in as_list(data) for f in resolve_source(src))
    except (UserError, OSError, ValueError, TypeError):
        return None


def _longest(config: Any, tokenizer: Any, data: Any, tmp: Optional[str]) -> tuple:
    from bmtrain_cli.data.loader import build_loader
    from bmtrain_cli.errors import UserError

    size = _data_bytes(data)
    if size is None:
        return None, "the data was not found"
    if size > SCAN_LIMIT_BYTES:
        from bmtrain_cli.plan.devices import format_bytes

        return None, f"the data ({format_bytes(size)}, over {format_bytes(SCAN_LIMIT_BYTES)}) was not scanned"
    if size > SAY_BYTES:
        print(
            f"reading {size / 2**20:.0f} MiB of data for the longest sample ...", file=sys.stderr, flush=True
        )
    with contextlib.ExitStack() as stack:
        out_dir = tmp or stack.enter_context(tempfile.TemporaryDirectory(prefix="bmtrain-plan-"))
        try:
            if method_of(config.train).sample == "pair":  # the longest sequence of a pair
                from bmtrain_cli.preference.loader import build_preference_loader

                loader: Any = build_preference_loader(config, tokenizer, data_path=data, output_dir=out_dir)
            else:
                loader = build_loader(config, tokenizer, split="train", data_path=data, output_dir=out_dir)
        except (UserError, OSError, ValueError) as exc:
            return None, f"the data could not be read ({str(exc).splitlines()[0] if str(exc) else exc})"
    return loader.longest, ""


def data_facts(config: Any, *, need_vocab: bool = True, need_longest: bool = True) -> DataFacts:
    """Vocabulary and longest sample as the trainer will see them (None where they cannot be known)."""
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.errors import UserError

    m, t = config.model, config.train
    if m.model_name_or_path:
        need_vocab = False  # the checkpoint's vocabulary; arch_from_model_config reads it
    longest_wanted = need_longest and t.batching == "longest"
    if not (need_vocab or longest_wanted):
        return DataFacts()
    vocab: Optional[int] = None
    longest: Optional[int] = None
    notes: List[str] = []
    try:
        with generated_inputs(config) as inputs:
            tok = None
            if inputs["tokenizer"]:
                tok = load_tokenizer(inputs["tokenizer"])
                if need_vocab:
                    vocab = int(tok.vocab_size)
            if longest_wanted:
                if tok is None:
                    why = "the tokenizer is generated at run time"
                elif inputs["data"] is None:
                    why = "no data_path"
                else:
                    longest, why = _longest(config, tok, inputs["data"], inputs["tmp"])
                if longest is not None:
                    notes.append(
                        f"batching longest: the longest sample is {longest} tokens (max_seq_len "
                        f"{m.max_seq_len}); the peak is a batch that reaches it"
                    )
                else:
                    notes.append(
                        f"batching longest: {why}; assumed batches reach max_seq_len (an upper bound)"
                    )
    except (UserError, OSError, ValueError, RuntimeError) as exc:
        notes.append(f"tokenizer/data not read ({str(exc).splitlines()[0] if str(exc) else exc})")
    return DataFacts(vocab_size=vocab, longest=longest, note="; ".join(notes))
