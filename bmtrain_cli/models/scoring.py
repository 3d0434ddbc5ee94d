"""Loss evaluation, the one place: token-weighted mean next-token loss and perplexity.

Two entry points share one counting rule (position t predicts labels[t + 1] unless it is IGNORE_INDEX or t,
t + 1 lie in different segments):

- :func:`eval_loss`: a model with ``loss_sum`` over collated batches (the trainer's eval loss, summed over
  data ranks) and :func:`score` over encoded samples (``bmtrain eval``);
- :func:`sample_logps`: each sample's summed log-probability of its scored tokens (``bmtrain eval --task``,
  multiple-choice benchmarks scored as lm-evaluation-harness does);
- :func:`logits_loss`: any ``logits(ids) -> np.ndarray`` function, for what has no ``loss_sum`` (a
  paddle-inference export, the INT8 check of ``bmtrain export --quantize``).

Samples come from ``data.encode.encode_scored_file`` (records encoded exactly as for training).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from bmtrain_cli.errors import UserError
from bmtrain_cli.labels import IGNORE_INDEX

Sample = Tuple[np.ndarray, np.ndarray]  # (input_ids [s], labels [s]), unshifted, IGNORE_INDEX = not scored


def count_targets(batch: Dict[str, np.ndarray]) -> int:
    """Tokens the model predicts in a batch, exactly as CausalLM.loss_sum counts them (a context-parallel
    share, parallel/ring_attention.split_batch, carries its shifted targets)."""
    if "targets" in batch:
        return int((batch["targets"] != IGNORE_INDEX).sum())
    labels = batch["labels"]
    valid = labels[:, 1:] != IGNORE_INDEX
    mask = batch.get("attention_mask")
    if mask is not None:
        valid &= mask[:, 1:] == mask[:, :-1]
    return int(valid.sum())


def right_padded(mask: np.ndarray) -> bool:
    """Whether every row of segment ids [b, s] is one sample followed by padding (1 ... 1 0 ... 0)."""
    return bool(((mask == 0) | (mask == 1)).all() and (mask[:, 1:] <= mask[:, :-1]).all())


def to_tensors(batch: Dict[str, np.ndarray], keep_mask: bool = False) -> Dict[str, Any]:
    """The model's inputs. Rows of one sample followed by padding need no attention mask: padding comes
    after every real token and carries no target, so plain causal attention gives every real token the
    same result and the loss the same targets; such batches go without one (the mask-free kernels), unless
    ``keep_mask`` (a mixture of experts' load-balancing loss leaves the padding's routing out, models/moe.py)."""
    import paddle

    if "targets" in batch:  # a context-parallel share: CausalLM.loss_sum's context path
        keys = ["input_ids", "targets", "position_ids", "segment_ids", "attention_mask"]
        return {k: paddle.to_tensor(batch[k]) for k in keys if batch.get(k) is not None}
    keys = ["input_ids", "labels", "attention_mask", "position_ids"]
    mask = batch.get("attention_mask")
    if mask is not None and right_padded(mask) and not (keep_mask and (mask == 0).any()):
        keys.remove("attention_mask")
    return {k: paddle.to_tensor(batch[k]) for k in keys if batch.get(k) is not None}


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0)) if math.isfinite(loss) else float("nan")


def eval_loss(
    model: Any,
    batches: Iterable[Dict[str, np.ndarray]],
    autocast: Any = None,
    all_reduce_sum: Optional[Callable[[float], Any]] = None,
) -> Tuple[float, int]:
    """(mean loss per predicted token, token count) over all batches; with ``all_reduce_sum`` (the
    parallel context's, where several data ranks score their own shares) summed over the ranks."""
    import paddle

    from bmtrain_cli.models.moe import adds_aux_loss

    keep_mask = adds_aux_loss(getattr(model, "arch", None))
    was_training = model.training
    model.eval()
    total = 0.0
    count = 0.0
    try:
        with paddle.no_grad():
            for batch in batches:
                t = to_tensors(batch, keep_mask)
                if autocast is not None:
                    with autocast():
                        loss_sum, n = model.loss_sum(**t)
                else:
                    loss_sum, n = model.loss_sum(**t)
                total += float(loss_sum)
                count += float(n)
    finally:
        if was_training:
            model.train()
    if all_reduce_sum is not None:
        total = float(all_reduce_sum(total))
        count = float(all_reduce_sum(count))
    return (total / count if count else float("nan")), int(count)


def indexed_batches(
    samples: List[Sample], batch_size: int
) -> Iterator[Tuple[List[int], Dict[str, np.ndarray]]]:
    """(indices into ``samples``, right-padded batch), shortest first (less padding)."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = [samples[i] for i in index]
        width = max(len(ids) for ids, _ in batch)
        ids = np.zeros((len(batch), width), dtype=np.int64)
        labels = np.full((len(batch), width), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((len(batch), width), dtype=np.int64)
        for r, (i, lab) in enumerate(batch):
            ids[r, : len(i)], labels[r, : len(i)], mask[r, : len(i)] = i, lab, 1
        yield index, {"input_ids": ids, "labels": labels, "attention_mask": mask}


def padded_batches(samples: List[Sample], batch_size: int) -> Iterator[Dict[str, np.ndarray]]:
    """Samples as right-padded batches, shortest first (less padding)."""
    for _, batch in indexed_batches(samples, batch_size):
        yield batch


def sample_logps(
    model: Any,
    samples: List[Sample],
    batch_size: int = 8,
    on_batch: Optional[Callable[[int], None]] = None,
    greedy: bool = False,
) -> Any:
    """Summed log p of each sample's scored tokens (labels != IGNORE_INDEX), in the order of ``samples``:
    lm-evaluation-harness's loglikelihood of a continuation. Only the positions that predict a scored token
    go through the LM head, and the model reads each sample but its last token (only a target, so a sample
    may be one token longer than the model's context, as lm-eval's are). A logits-only model (``logits`` attribute, no ``hidden_states``) runs each
    sample alone. ``on_batch(n)`` is told how many samples each batch held (a progress bar). With
    ``greedy``: (log-probs, whether every scored token is the most likely one), lm-eval's is_greedy."""
    out = np.zeros(len(samples), dtype=np.float64)
    misses = np.zeros(len(samples), dtype=np.int64)
    if not hasattr(model, "hidden_states"):
        for k, (ids, labels) in enumerate(samples):
            # the last token is only a target: the model reads the others (and a row is added for it)
            logits = model.logits(ids[None, :-1])[0]
            logits = np.concatenate([logits, np.zeros_like(logits[:1])])
            out[k] = -next_token_loss_sum(logits, labels)[0]
            scored = labels[1:] != IGNORE_INDEX
            misses[k] = int((logits[:-1][scored].argmax(-1) != labels[1:][scored]).sum())
            if on_batch is not None:
                on_batch(1)
        return (out, misses == 0) if greedy else out
    import paddle
    import paddle.nn.functional as F

    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            for index, batch in indexed_batches(samples, batch_size):
                rows, cols = np.nonzero(batch["labels"][:, 1:] != IGNORE_INDEX)
                # the last column is only a target: the model reads the others
                hidden = model.hidden_states(paddle.to_tensor(batch["input_ids"][:, :-1]))
                picked = hidden[paddle.to_tensor(rows), paddle.to_tensor(cols)]
                logits = model.logits_from_hidden(picked).astype("float32")
                target = paddle.to_tensor(batch["labels"][rows, cols + 1].reshape([-1, 1]))
                token = -F.cross_entropy(logits, target, reduction="none").reshape([-1]).numpy()
                out[index] = np.bincount(rows, weights=token.astype(np.float64), minlength=len(index))
                wrong = (logits.argmax(axis=-1).numpy() != target.numpy().reshape([-1])).astype(np.float64)
                misses[index] = np.bincount(rows, weights=wrong, minlength=len(index)).astype(np.int64)
                if on_batch is not None:
                    on_batch(len(index))
    finally:
        if was_training:
            model.train()
    return (out, misses == 0) if greedy else out


def _report(loss: float, count: int, records: int) -> Dict[str, Any]:
    if count == 0:
        raise UserError("no tokens to score (every record is empty after encoding)")
    return {"loss": loss, "ppl": perplexity(loss), "tokens": int(count), "records": records}


def score(model: Any, samples: List[Sample], batch_size: int = 8) -> Dict[str, Any]:
    """`bmtrain eval` of a model with ``loss_sum``: {"loss", "ppl", "tokens", "records"}."""
    loss, count = eval_loss(model, padded_batches(samples, batch_size))
    return _report(loss, count, len(samples))


def next_token_loss_sum(logits: np.ndarray, labels: np.ndarray) -> Tuple[float, int]:
    """(sum of -log p(labels[t+1] | ..t), number of predicted tokens) for logits [s, vocab], labels [s]."""
    logits = np.asarray(logits, dtype=np.float64)[:-1]
    target = np.asarray(labels)[1:]
    valid = target != IGNORE_INDEX
    if not valid.any():
        return 0.0, 0
    z = logits[valid]
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    picked = logp[np.arange(len(z)), target[valid]]
    return float(-picked.sum()), int(valid.sum())


def logits_loss(logits_fn: Callable[[np.ndarray], np.ndarray], samples: List[Sample]) -> Tuple[float, int]:
    """(token-weighted mean next-token loss, token count) of ``logits_fn`` (ids [1, s] -> logits [1, s,
    vocab]); each sample runs alone (no padding, so every export format gives the same numbers)."""
    total, count = 0.0, 0
    for ids, labels in samples:
        s, n = next_token_loss_sum(logits_fn(ids[None, :])[0], labels)
        total += s
        count += n
    return total / max(count, 1), count


def score_logits(logits_fn: Callable[[np.ndarray], np.ndarray], samples: List[Sample]) -> Dict[str, Any]:
    """`bmtrain eval` of a logits-only model (a paddle-inference export)."""
    loss, count = logits_loss(logits_fn, samples)
    return _report(loss, count, len(samples))
