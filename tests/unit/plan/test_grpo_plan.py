"""The memory plan of a stage grpo run (docs/grpo.md "Memory", docs/plan.md): the rollout KV cache of
micro_batch_size rows of prompt + completion, the completion positions' logits in the step, the frozen
reference only with beta > 0 and full fine-tuning, and the rollout phase as the peak where it is larger.
(The CPU estimate of a GRPO run against a measured one: the h256-l2-s256-b8-grpo case of
tests/unit/plan/test_calibration.py.)"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from bmtrain_cli.config import load_config
from bmtrain_cli.config.schema import GrpoConfig
from bmtrain_cli.plan.devices import get_device
from bmtrain_cli.plan.estimator import Layout, Workload, estimate, estimate_layout
from bmtrain_cli.plan.rollout import kv_bytes_per_token

SEVEN_B = "configs/llama2-7b-sft-8gpu.yaml"


@pytest.fixture
def seven_b(repo_root):
    return load_config(str(repo_root / SEVEN_B)).config


def _grpo(cfg: Any, beta: float = 0.0, iterations: int = 1, completion: int = 1024, **train: Any) -> Any:
    g = GrpoConfig(
        num_generations=8,
        max_completion_length=completion,
        beta=beta,
        num_iterations=iterations,
        reward_funcs=["accuracy"],
    )
    return cfg.model_copy(
        update={"train": cfg.train.model_copy(update={"stage": "grpo", "grpo": g, **train})}
    )


def _plan(cfg: Any, **kw: Any):
    return estimate(_grpo(cfg, **kw), "A100-80GB", read_data=False)


def test_the_rollout_kv_cache_is_micro_batch_rows_of_prompt_and_completion(seven_b) -> None:
    est = _plan(seven_b)
    a, lay = Workload.from_config(_grpo(seven_b), read_data=False).arch, est.layout
    # llama2-7b: 32 layers, 32 kv heads of 128 split over tp 2, bf16; micro_batch_size 2 rows of max_seq_len 4096
    per_token = a.num_hidden_layers * 2 * (a.num_key_value_heads // lay.tp) * a.head_dim * 2
    assert est.rollout_cache == lay.micro_batch * 4096 * per_token
    assert est.rollout_cache > 0 and est.rollout_peak >= est.parameters + est.rollout_cache
    assert any("rollout KV cache" in line for line in est.lines())
    assert any("stage grpo" in n for n in est.notes)
    sft = estimate(seven_b, "A100-80GB", read_data=False)
    assert sft.rollout_cache == 0 and not any("rollout" in line for line in sft.lines())


def test_each_term_scales_with_what_it_counts(seven_b) -> None:
    w = Workload.from_config(_grpo(seven_b), read_data=False)
    gpu = get_device("A100-80GB")
    one = estimate_layout(w, Layout(tp=2, micro_batch=2), gpu)
    rows = estimate_layout(w, Layout(tp=2, micro_batch=4), gpu)
    assert rows.rollout_cache == 2 * one.rollout_cache  # rows per generate() call
    longer = estimate_layout(replace(w, seq_len=2 * w.seq_len), Layout(tp=2, micro_batch=2), gpu)
    assert longer.rollout_cache == 2 * one.rollout_cache  # prompt + completion tokens
    tp4 = estimate_layout(w, Layout(tp=4, micro_batch=2), gpu)
    assert tp4.rollout_cache == one.rollout_cache // 2  # kv heads split by tensor parallel
    assert kv_bytes_per_token(w, Layout(tp=2), 16) * 2 == kv_bytes_per_token(w, Layout(tp=2), 32)
    # the step's logits are those of the completion positions: twice the completion, twice the logits
    # (the kept hidden states of the final norm stay)
    short = estimate_layout(replace(w, completion_len=512), Layout(tp=2, micro_batch=2), gpu)
    final = 2 * w.seq_len * w.arch.hidden_size * 2
    assert one.logits - final == pytest.approx(2 * (short.logits - final), rel=1e-6)


def test_the_reference_is_a_frozen_copy_only_with_beta_and_full_fine_tuning(seven_b) -> None:
    none = _plan(seven_b)
    full = _plan(seven_b, beta=0.04)
    lora = _plan(seven_b, beta=0.04, finetuning="lora")
    assert none.reference_weights == 0 and lora.reference_weights == 0
    assert full.reference_weights == full.parameters
    assert full.peak >= none.peak + full.reference_weights
    assert any("reference copy" in line for line in full.lines())


def test_the_log_probs_pass_and_a_rollout_phase_peak(seven_b) -> None:
    """Long prompts, short completions and a large vocabulary: the prefill's logits of every prompt
    position make the rollout phase the peak of the run (the step's loss takes the completion positions
    only); the old policy's log-probs pass adds to the rollout phase, not to the step."""
    w = _small(Workload.from_config(_grpo(seven_b, completion=16), read_data=False), 50000, seq_len=1024)
    cpu, layout = get_device("cpu"), Layout(micro_batch=8, recompute="full")
    plain = estimate_layout(w, layout, cpu)
    with_logps = estimate_layout(replace(w, rollout_logps=True), layout, cpu)
    assert with_logps.rollout_peak >= plain.rollout_peak
    assert (with_logps.logits, with_logps.activations) == (plain.logits, plain.activations)
    prefill_logits = 8 * (1024 - 16) * 50000 * 4
    assert plain.rollout_peak >= plain.parameters + prefill_logits
    assert plain.peak == plain.rollout_peak
    assert "the peak is the rollout phase (sampling the completions)" in plain.notes


def test_the_held_out_rewards_greedy_calls_count_where_there_is_an_eval_set(seven_b) -> None:
    """The held-out reward decodes min(eval_prompts, 64) rows per call: with an eval set and a small
    micro batch its KV cache, not the rollouts', sizes the rollout phase."""
    assert Workload.from_config(_grpo(seven_b), read_data=False).eval_rows == 0  # no eval set
    with_eval = Workload.from_config(_grpo(seven_b, eval_data_path="held.jsonl"), read_data=False)
    assert with_eval.eval_rows == 64
    demo = _grpo(seven_b, demo_data="reverse", data_path=None)
    demo = demo.model_copy(
        update={
            "train": demo.train.model_copy(
                update={"grpo": demo.train.grpo.model_copy(update={"eval_prompts": 16})}
            )
        }
    )
    assert Workload.from_config(demo, read_data=False).eval_rows == 16
    gpu, layout = get_device("A100-80GB"), Layout(tp=2, micro_batch=2)
    plain = estimate_layout(replace(with_eval, eval_rows=0), layout, gpu)
    evaluated = estimate_layout(with_eval, layout, gpu)
    assert evaluated.rollout_cache == plain.rollout_cache  # the line shows the rollouts' cache
    assert evaluated.rollout_peak - plain.rollout_peak >= (64 - 2) * 4096 * kv_bytes_per_token(
        with_eval, layout, 32
    )


def _small(w: Workload, vocab_size: int = 32000, **kw: Any) -> Workload:
    """A 2-layer model whose MLP is the widest part of a layer's no-gradient forward (64 + 4 x 172 per
    token, against the attention's 64 + (4 + 2 x 4) x 16 + 4 heads), in fp32."""
    small = replace(
        w.arch,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=vocab_size,
    )
    return replace(w, arch=small, precision="fp32", **kw)


@pytest.mark.parametrize("cp,completion", [(2, 100), (2, 300), (4, 200), (4, 700)])
def test_the_log_probs_pass_under_context_parallel_counts_a_ranks_share(seven_b, cp, completion) -> None:
    """GRPO under context parallel: every rank samples whole rows, but the old policy's / reference's
    log-probs pass runs the ring over the rank's share of each row (seq / cp tokens) and scores only the
    completion positions that share holds (the run's layout, ring_attention.local_indices)."""
    from bmtrain_cli.parallel.ring_attention import local_indices
    from bmtrain_cli.plan.activations import held_predictions
    from bmtrain_cli.plan.rollout import logps_pass_bytes, rollout_memory

    seq, rows = 1024, 8
    w = _small(Workload.from_config(_grpo(seven_b, completion=completion), read_data=False), seq_len=seq)
    w = replace(w, rollout_logps=True)
    cpu = get_device("cpu")
    layout = Layout(cp=cp, micro_batch=rows, recompute="full")
    # the positions predicting a completion token of a full row, and the most any rank holds
    predicting = np.arange(seq - 1 - completion, seq - 1)
    held = max(int(np.isin(predicting, local_indices(seq, cp, r)).sum()) for r in range(cp))
    assert held_predictions(seq, completion, cp) == held <= completion
    if completion > seq // (2 * cp):  # longer than a chunk: the completion spreads over ranks
        assert held < completion
    share = seq // cp
    forward = 8 * share * (64 + 4 * 172) * 4  # the MLP's input, gate, up, activation and product, fp32
    want = forward + rows * share * 64 * 4 + rows * held * 64 * 4 + 2 * rows * held * 32000 * 4
    assert logps_pass_bytes(w, cpu, layout) == want
    whole = logps_pass_bytes(w, cpu, replace(layout, cp=1))
    assert (
        whole
        == 8 * seq * (64 + 4 * 172) * 4 + rows * seq * 64 * 4 + (rows * completion) * (64 + 2 * 32000) * 4
    )
    assert want < whole
    # sampling holds whole rows on every rank of the group: the KV cache and generation's peak are one
    # process's
    one = rollout_memory(replace(w, rollout_logps=False), cpu, replace(layout, cp=1), 2)
    ring = rollout_memory(replace(w, rollout_logps=False), cpu, layout, 2)
    assert ring == one and one.kv_cache == rows * seq * 2 * 2 * 4 * 16 * 4
    # the estimator hands the rollout phase whole rows and counts the step's logits of the held positions
    est = estimate_layout(w, layout, cpu)
    assert est.rollout_cache == one.kv_cache
    assert est.rollout_peak - est.parameters - est.optimizer_states >= max(one.peak, want)
    assert est.logits == rows * share * 64 * 4 + rows * held * (64 + 32000) * 4
