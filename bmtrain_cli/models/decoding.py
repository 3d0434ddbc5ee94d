"""The one definition of how a next token is chosen, for every decoding loop: `bmtrain generate` and eval
(models/generate.py), GRPO's rollouts (grpo/rollout.py, through generate), the server's continuous batching
(serve/batching.py) and generation over a logits-only export (export/loading.py).

- :class:`SamplingOptions`: how tokens are picked (greedy, temperature, top-p, the seed) and when a row
  stops (its end-of-sequence token, the most new tokens);
- :func:`next_logits`: one forward step (a prompt or the tokens after a KV cache) to the last position's
  logits over the whole vocabulary, float32 on the host;
- :class:`DecodeStep`: logits of the rows still decoding -> their next tokens, appended, handed to the
  ``on_token`` callback, and the rows that stop marked done.

A loop owns the rows and the cache (left padding, finished rows leaving, a paged or preallocated cache);
what a step does with its logits is this module's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import paddle

from bmtrain_cli.errors import UserError

TokenCallback = Callable[[int, int], bool]  # (row, new token) -> stop this row now
Rows = Union[Sequence[int], np.ndarray]  # indices of the rows a step's logits belong to


@dataclass(frozen=True)
class SamplingOptions:
    """How each next token is chosen and when a row stops.

    ``temperature`` <= 0 is greedy (argmax); otherwise a sample from softmax(logits / temperature) cut to
    the smallest set of tokens whose probability reaches ``top_p``, drawn with a generator seeded by
    ``seed``. A row stops after ``eos_token_id`` (included in its tokens) or ``max_new_tokens`` tokens."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    eos_token_id: Optional[int] = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def sample_next(
    logits: np.ndarray,
    temperature: float,
    top_p: float,
    rng: np.random.Generator,
    draws: Optional[np.ndarray] = None,
) -> np.ndarray:
    """Next token per row of ``logits`` [b, vocab]: argmax when temperature <= 0, else a sample from
    softmax(logits / temperature) restricted to the smallest set of tokens whose probability mass
    reaches top_p (top_p 0 keeps only the most likely token: greedy), with one uniform number per row
    from ``rng`` (or ``draws``, given). Non-finite logits (a model with non-finite weights) are refused."""
    if not np.isfinite(logits).all():
        raise UserError("the model produced non-finite logits: its weights hold inf or NaN")
    if temperature <= 0:
        return logits.argmax(-1)
    z = logits.astype(np.float64) / temperature
    z -= z.max(-1, keepdims=True)
    probs = np.exp(z)
    probs /= probs.sum(-1, keepdims=True)
    order = np.argsort(-probs, axis=-1, kind="stable")
    sorted_p = np.take_along_axis(probs, order, -1)
    keep = (np.cumsum(sorted_p, -1) - sorted_p) < top_p
    keep[:, 0] = True  # the most likely token always stays (top_p 0: greedy)
    kept = sorted_p * keep
    # all rows at once, the draws of rng.choice(p=kept / kept.sum()) row after row: its normalised
    # cumulative sum searched (side right) for one uniform number per row, the same numbers in the same
    # order (tests/unit/models/test_generate.py compares with the row loop)
    cdf = np.cumsum(kept / kept.sum(-1, keepdims=True), -1)
    cdf /= cdf[:, -1:]
    uniform = rng.random(len(probs)) if draws is None else draws
    picked = (cdf <= uniform[:, None]).sum(-1)
    return order[np.arange(len(probs)), picked]


class DecodeStep:
    """The tokens of ``rows`` rows decoded under one :class:`SamplingOptions`.

    Each call takes the logits [n, vocab] of some rows (``rows``, the indices of the rows still decoding,
    in the order of the logits) and picks their next tokens. Sampling draws one uniform number per row
    and token: a row's k-th token uses the row's number of the k-th draw of ``rows`` numbers from the
    seeded generator, so a row samples the same tokens whichever rows decode beside it, when the others
    stop, or whether rows are decoded together or one after another. Every new token goes to ``on_token``
    (which may stop its row: a stop string, a client gone); a row is ``done`` after it, after the end of
    sequence token or at ``max_new_tokens``."""

    def __init__(
        self, options: SamplingOptions, rows: int = 1, on_token: Optional[TokenCallback] = None
    ) -> None:
        self.options = options
        self.on_token = on_token
        self.tokens: List[List[int]] = [[] for _ in range(rows)]
        self.done = np.zeros(rows, dtype=bool)
        self._rng = np.random.default_rng(options.seed)
        self._draws: List[np.ndarray] = []  # the k-th draw: one number per row

    def _uniform(self, rows: Rows) -> np.ndarray:
        out = np.empty(len(rows))
        for j, i in enumerate(rows):
            k = len(self.tokens[i])
            while len(self._draws) <= k:
                self._draws.append(self._rng.random(len(self.tokens)))
            out[j] = self._draws[k][i]
        return out

    def __call__(self, logits: np.ndarray, rows: Rows) -> np.ndarray:
        """The next token of each of ``rows`` (int64 [n]) from their logits [n, vocab]."""
        o = self.options
        draws = None if o.greedy else self._uniform(rows)
        picked = sample_next(logits, o.temperature, o.top_p, self._rng, draws)
        for i, t in zip(rows, picked):
            token = int(t)
            self.tokens[i].append(token)
            stop = self.on_token is not None and self.on_token(int(i), token)
            self.done[i] = stop or token == o.eos_token_id or len(self.tokens[i]) >= o.max_new_tokens
        return picked


def left_pad(prompts: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64 [n, longest]: each prompt right-aligned, 0 before it in both."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask


def prompt_positions(mask: np.ndarray) -> np.ndarray:
    """Positions of left-padded rows: each row's real tokens count from 0 (padding gets 0 too)."""
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)


def next_logits(
    model: Any, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, cache: Any
) -> np.ndarray:
    """The last position's logits [rows, vocab], float32 on the host, of one forward step: ``ids`` [rows, s]
    (a prompt, or the new tokens after what ``cache`` holds; ``mask`` covers both). Only the last position
    goes through the LM head; under tensor parallel every rank gets the whole, gathered vocabulary, so
    every rank picks the same tokens with the same seed."""
    hidden = model.hidden_states(
        paddle.to_tensor(ids), paddle.to_tensor(mask), paddle.to_tensor(positions), cache=cache
    )
    logits = model.logits_from_hidden(hidden[:, -1:])[:, -1]
    return model.factory.whole_vocab(logits).astype("float32").numpy()


STRIDE_FLAG = "FLAGS_use_stride_kernel"


@contextlib.contextmanager
def dense_transposes() -> Iterator[None]:
    """On a CPU, transposes produce dense tensors inside the block (FLAGS_use_stride_kernel off), as
    Paddle 2.x did. Paddle 3's CPU kernels read the strided views its transposes give otherwise ~30x
    slower: its sdpa (which transposes q/k/v to heads-first) took 12 ms for one decoding step's attention
    of 32 rows over 20 keys, 0.4 ms with dense tensors (docs/benchmarks.md, GRPO). Elsewhere (a GPU) nothing
    changes."""
    if paddle.is_compiled_with_cuda():
        yield
        return
    before = paddle.get_flags([STRIDE_FLAG])[STRIDE_FLAG]
    paddle.set_flags({STRIDE_FLAG: False})
    try:
        yield
    finally:
        paddle.set_flags({STRIDE_FLAG: before})
