"""Text generation with a KV cache: the prompt is run once (prefill), then each new token is one
incremental forward step over the cached keys and values. Greedy, temperature and top-p sampling.

Prompts of different lengths are left-padded; padding gets segment id 0 in the attention mask (so
nothing attends to it) and positions count real tokens only.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List, Optional, Sequence

import numpy as np
import paddle

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.blocks import KVCache
from bmtrain_cli.models.decoder import CausalLM

TokenCallback = Callable[[int, int], bool]  # (prompt index, new token) -> stop this prompt now


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


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple:
    """(ids, mask) int64 [n, longest]: each prompt right-aligned, 0 before it in both."""
    width = max(len(p) for p in prompts)
    ids = np.zeros((len(prompts), width), dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        mask[i, width - len(p) :] = 1
    return ids, mask


def long_rope_switch(arch: Any) -> Optional[int]:
    """The length past which LongRoPE (Phi-3) turns from its short to its long factors, else None."""
    scaling = arch.rope_scaling or {}
    return (
        int(scaling["original_max_position_embeddings"]) if scaling.get("rope_type") == "longrope" else None
    )


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


@paddle.no_grad()
def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_p: float = 1.0,
    eos_token_id: Optional[int] = None,
    seed: int = 0,
    use_cache: bool = True,
    on_token: Optional[TokenCallback] = None,
) -> List[List[int]]:
    """New token ids for each prompt (stopping after ``eos_token_id``, which is included, and before the
    longest prompt's positions pass the model's max_position_embeddings).

    ``on_token(row, token)`` is called for each new token as soon as it is chosen (streaming); when it
    returns True that row stops there (a stop string, a client gone). ``use_cache=False`` recomputes the
    whole sequence every step (the reference the cache is tested against)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    was_training = model.training
    model.eval()
    dense = contextlib.ExitStack()
    dense.enter_context(dense_transposes())
    rng = np.random.default_rng(seed)
    ids, mask = left_pad(prompts)
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)
    cache = KVCache(len(model.layers)) if use_cache else None
    out: List[List[int]] = [[] for _ in prompts]
    done = np.zeros(len(prompts), dtype=bool)
    rows = np.arange(len(prompts))  # the prompts still decoding, in batch order
    step_ids, step_pos = ids, pos
    switch = long_rope_switch(model.arch)
    try:
        for _ in range(min(max_new_tokens, model.arch.max_position_embeddings - ids.shape[1])):
            if cache is not None and switch is not None and len(cache) <= switch < ids.shape[1]:
                # the sequence just passed LongRoPE's switch: the keys cached under the short factors are
                # recomputed under the long ones (as transformers' Phi-3 does)
                cache = KVCache(len(model.layers))
                step_ids, step_pos = ids, pos
            logits = model(
                paddle.to_tensor(step_ids),
                attention_mask=paddle.to_tensor(mask),
                position_ids=paddle.to_tensor(step_pos),
                cache=cache,
            )[:, -1]
            # under tensor parallel each rank holds a vocabulary shard: every rank samples from the
            # whole, gathered, distribution and so picks the same tokens with the same seed
            logits = model.factory.whole_vocab(logits)
            # one uniform number per prompt and step, finished ones included: a prompt's samples do not
            # depend on when the others stop
            draws = rng.random(len(prompts))[rows] if temperature > 0 else None
            nxt = sample_next(logits.astype("float32").numpy(), temperature, top_p, rng, draws)
            for i, t in zip(rows, nxt):
                out[i].append(int(t))
                done[i] = eos_token_id is not None and int(t) == eos_token_id
                if on_token is not None and on_token(int(i), int(t)):
                    done[i] = True
            if done.all():
                break
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            pos = np.concatenate([pos, pos[:, -1:] + 1], axis=1)
            ids = np.concatenate([ids, nxt[:, None]], axis=1)
            live = np.nonzero(~done[rows])[0]
            if len(live) < len(rows):  # finished prompts leave the batch (and the cache)
                rows, ids, mask, pos, nxt = rows[live], ids[live], mask[live], pos[live], nxt[live]
                if cache is not None:
                    cache.select(paddle.to_tensor(live.astype(np.int64)))
            step_ids, step_pos = (nxt[:, None], pos[:, -1:]) if use_cache else (ids, pos)
    finally:
        dense.close()
        model.train(was_training)
    return out
