"""Text generation with a KV cache: the prompt is run once (prefill), then each new token is one
incremental forward step over the cached keys and values. How each token is picked and when a row stops
is models/decoding.py's (:class:`~bmtrain_cli.models.decoding.SamplingOptions`, ``DecodeStep``).

Prompts of different lengths are left-padded; padding gets segment id 0 in the attention mask (so
nothing attends to it) and positions count real tokens only.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, List, Optional, Sequence

import numpy as np
import paddle

from bmtrain_cli.models.blocks import KVCache
from bmtrain_cli.models.decoder import CausalLM
from bmtrain_cli.models.decoding import (
    DecodeStep,
    SamplingOptions,
    TokenCallback,
    dense_transposes,
    left_pad,
    next_logits,
    prompt_positions,
)


def long_rope_switch(arch: Any) -> Optional[int]:
    """The length past which LongRoPE (Phi-3) turns from its short to its long factors, else None."""
    scaling = arch.rope_scaling or {}
    return (
        int(scaling["original_max_position_embeddings"]) if scaling.get("rope_type") == "longrope" else None
    )


@paddle.no_grad()
def generate(
    model: CausalLM,
    prompts: Sequence[Sequence[int]],
    options: SamplingOptions,
    use_cache: bool = True,
    on_token: Optional[TokenCallback] = None,
) -> List[List[int]]:
    """New token ids for each prompt, chosen and stopped as ``options`` say (the end-of-sequence token
    included), and never past the model's max_position_embeddings for the longest prompt.

    ``on_token(row, token)`` is called for each new token as soon as it is chosen (streaming); when it
    returns True that row stops there (a stop string, a client gone). Finished rows leave the batch and
    the cache. ``use_cache=False`` recomputes the whole sequence every step (the reference the cache is
    tested against).

    On a model whose experts are split over an expert group (``decode_in_step``, parallel/expert_parallel.py)
    every rank of the group must run each forward: the loop goes on while any rank still decodes, a rank
    whose rows are all done running :func:`idle_step` (its tokens are what they would be alone)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    was_training = model.training
    model.eval()
    dense = contextlib.ExitStack()
    dense.enter_context(dense_transposes())
    ids, mask = left_pad(prompts)
    pos = prompt_positions(mask)
    cache = KVCache(len(model.layers)) if use_cache else None
    step = DecodeStep(options, len(prompts), on_token)
    rows = np.arange(len(prompts))  # the prompts still decoding, in batch order
    step_ids, step_pos = ids, pos
    switch = long_rope_switch(model.arch)
    limit = min(options.max_new_tokens, model.arch.max_position_embeddings - ids.shape[1])
    in_step = getattr(model, "decode_in_step", None)
    try:
        for k in itertools.count():
            finished = k >= limit or bool(step.done.all())
            if finished if in_step is None else in_step(finished):
                break
            if finished:  # the other ranks of the expert group still decode: a step for their dispatch
                idle_step(model)
                continue
            if cache is not None and switch is not None and len(cache) <= switch < ids.shape[1]:
                # the sequence just passed LongRoPE's switch: the keys cached under the short factors are
                # recomputed under the long ones (as transformers' Phi-3 does)
                cache = KVCache(len(model.layers))
                step_ids, step_pos = ids, pos
            nxt = step(next_logits(model, step_ids, mask, step_pos, cache), rows)
            if step.done.all():
                continue
            mask = np.concatenate([mask, np.ones((len(rows), 1), dtype=np.int64)], axis=1)
            pos = np.concatenate([pos, pos[:, -1:] + 1], axis=1)
            ids = np.concatenate([ids, nxt[:, None]], axis=1)
            live = np.nonzero(~step.done[rows])[0]
            if len(live) < len(rows):  # finished prompts leave the batch (and the cache)
                rows, ids, mask, pos, nxt = rows[live], ids[live], mask[live], pos[live], nxt[live]
                if cache is not None:
                    cache.select(paddle.to_tensor(live.astype(np.int64)))
            step_ids, step_pos = (nxt[:, None], pos[:, -1:]) if use_cache else (ids, pos)
    finally:
        dense.close()
        model.train(was_training)
    return step.tokens


def idle_step(model: CausalLM) -> None:
    """One forward of a single token whose output is dropped: a decoding step of a rank that has finished,
    for the dispatch of the ranks of its expert group that have not."""
    one = np.zeros((1, 1), dtype=np.int64)
    model.hidden_states(paddle.to_tensor(one), paddle.to_tensor(one + 1), paddle.to_tensor(one), cache=None)
