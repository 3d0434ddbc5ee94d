"""The rollout phase of a stage grpo run for the memory estimator (plan/estimator.py): what sampling the
completions (grpo/rollout.py, the KV-cache generator of models/generate.py) and the old policy's and
reference's log-probs hold on top of the weights and optimizer states, between two optimizer steps (the
gradients are freed by then).

One generate() call samples ``micro_batch_size`` rows (grpo/rollout.py sample_completions): its prefill
runs the prompts (up to seq_len - max_completion_length tokens) through the model without gradients and
returns the logits of every prompt position; each decoding step then appends one token's keys and values
per layer to the cache (a concatenation: the layer's old and new tensors exist at once), which ends at
rows x (prompt + completion) tokens. The held-out reward (an eval set: eval_data_path or the demo's) runs
the same greedy, ``min(eval_prompts, 64)`` rows per call (grpo/objective.py held_out_reward). The log-probs pass (num_iterations > 1 or beta > 0) runs a
no-gradient forward of ``micro_batch_size`` rows and the completion positions' fp32 logits.

Under context parallel every rank of a context group samples the same whole rows (generation runs no ring),
while the log-probs pass runs the ring over the rank's share of each row (grpo/objective.py no_grad_logps:
two chunks of seq_len / (2 x cp) tokens) and scores only the completion positions that share holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Tuple

from bmtrain_cli.plan.activations import act_bytes, context_share, held_predictions, no_grad_forward_bytes
from bmtrain_cli.plan.devices import Device
from bmtrain_cli.plan.workload import Layout, Workload


@dataclass(frozen=True)
class RolloutMemory:
    kv_cache: int  # the KV cache of one generate() call at its longest
    peak: int  # the most the rollout phase holds at once beyond the weights and optimizer states


def kv_bytes_per_token(w: Workload, layout: Layout, layers: int) -> int:
    """Keys and values of one token in ``layers`` decoder layers (kv heads split by tensor parallel)."""
    a = w.arch
    return layers * 2 * (a.num_key_value_heads // layout.tp) * a.head_dim * act_bytes(w)


def _generation(w: Workload, device: Device, layout: Layout, layers: int, rows: int) -> Tuple[int, int]:
    """(KV cache at its longest, the most one generate() call of ``rows`` rows holds at once)."""
    a = w.arch
    e = act_bytes(w)
    per_token = kv_bytes_per_token(w, layout, layers)
    prompt = max(1, w.seq_len - w.completion_len)
    cache = rows * w.seq_len * per_token
    layer_copy = cache // max(1, layers)  # one layer's keys and values, concatenated
    vocab = a.vocab_size // layout.tp
    prefill = (
        no_grad_forward_bytes(replace(w, seq_len=prompt), device, replace(layout, micro_batch=rows))
        + rows * prompt * per_token
        + rows * prompt * vocab * e  # the prefill's logits of every prompt position
    )
    return cache, max(prefill, cache + layer_copy + rows * vocab * 4)


def logps_pass_bytes(w: Workload, device: Device, layout: Layout) -> int:
    """The most the old policy's or reference's log-probs pass over ``micro_batch_size`` rows of ``w``
    (whole rows) holds at once: its no-gradient forward, the final hidden states, the held completion
    positions' hidden states and two fp32 [positions, vocabulary] tensors (the logits and their softmax).
    Under context parallel a rank runs the share of each row and the completion positions it holds."""
    a = w.arch
    rows, e = layout.micro_batch, act_bytes(w)
    share = replace(w, seq_len=context_share(w.seq_len, layout.cp)) if layout.cp > 1 else w
    n = rows * held_predictions(w.seq_len, w.completion_len, layout.cp)
    hidden = rows * share.seq_len * a.hidden_size * e
    forward = no_grad_forward_bytes(share, device, layout)
    return forward + hidden + n * a.hidden_size * e + 2 * n * (a.vocab_size // layout.tp) * 4


def rollout_memory(w: Workload, device: Device, layout: Layout, layers: int) -> RolloutMemory:
    """The rollout phase of ``w`` (a stage grpo workload of whole rows: ``completion_len`` > 0) on one
    device, and the held-out reward's greedy generate() calls (``eval_rows`` rows each) where there is an
    eval set. Under context parallel the generate() calls hold whole rows, the log-probs pass a share."""
    one = replace(layout, cp=1, cp_mode="ring")  # sampling runs every row on every rank of a context group
    cache, generation = _generation(w, device, one, layers, layout.micro_batch)
    if w.eval_rows:
        generation = max(generation, _generation(w, device, one, layers, w.eval_rows)[1])
    logps = logps_pass_bytes(w, device, layout) if w.rollout_logps else 0
    return RolloutMemory(kv_cache=int(cache), peak=int(max(generation, logps)))
