"""Sequence log-probs, the references and the objective on a tiny model: packing does not change a
sequence's log-prob, adapters off is the base model, precomputed equals live, and the step's loss does not
depend on how its pairs are split into micro-batches."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from bmtrain_cli.preference.batches import collate_pairs
from bmtrain_cli.preference.logps import sequence_logps
from bmtrain_cli.preference.objective import PreferenceObjective
from bmtrain_cli.preference.reference import AdaptersOff, FrozenCopy, Precomputed, adapters_disabled
from tests.unit.preference.conftest import make_config, tiny_model

VOCAB = 64


def _pairs(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = rng.integers(3, VOCAB, rng.integers(2, 6))
        pair = []
        for _ in range(2):
            resp = rng.integers(3, VOCAB, rng.integers(1, 6))
            ids = np.r_[1, prompt, resp].astype(np.int64)
            pair.append((ids, np.r_[np.zeros(1 + len(prompt), bool), np.ones(len(resp), bool)]))
        out.append(tuple(pair))
    return out


def _batch(pairs, packed: bool, start: int = 0):
    b = collate_pairs(pairs, 0, width=None, packed=packed, max_len=24)
    b["pair_ids"] = np.arange(start, start + len(pairs))
    return b


def _by_hand(model, ids, mask) -> float:
    """Summed log-prob of the trained tokens of one sequence, from its logits alone."""
    logits = model(paddle.to_tensor(ids[None])).numpy()[0].astype(np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return float(sum(logp[t - 1, ids[t]] for t in range(1, len(ids)) if mask[t]))


def test_packed_and_unpacked_log_probs_equal_each_sequence_alone():
    model = tiny_model(VOCAB)
    model.eval()
    pairs = _pairs(4)
    want = [_by_hand(model, ids, mask) for pair in pairs for ids, mask in pair]
    flat, _ = sequence_logps(model, _batch(pairs, packed=False), 8)
    packed_batch = _batch(pairs, packed=True)
    assert packed_batch["input_ids"].shape[0] < 8  # rows really hold several sequences
    packed, counts = sequence_logps(model, packed_batch, 8)
    np.testing.assert_allclose(flat.numpy(), want, rtol=1e-5)
    np.testing.assert_allclose(packed.numpy(), want, rtol=1e-5)
    assert list(counts) == [int(m.sum()) for pair in pairs for _, m in pair]


def test_adapters_off_is_the_base_model(tmp_path):
    from bmtrain_cli.lora.inject import apply_lora, lora_layers

    base = tiny_model(VOCAB, seed=1)
    batch = _batch(_pairs(3, seed=1), packed=False)
    with paddle.no_grad():
        want = sequence_logps(base, batch, 6)[0].numpy()
    cfg = make_config(tmp_path, finetuning="lora", lora_rank=4, lora_target_modules="all-linear")
    apply_lora(base, cfg.train)
    for _, layer in lora_layers(base):  # trained adapters: B no longer zero
        layer.lora_B.weight.set_value(paddle.full(layer.lora_B.weight.shape, 0.05))
    with paddle.no_grad():
        policy = sequence_logps(base, batch, 6)[0].numpy()
    ref = AdaptersOff(base).logps(batch, 6).numpy()
    assert np.abs(policy - want).max() > 1e-3  # the adapters change the policy
    np.testing.assert_allclose(ref, want, rtol=1e-6)
    with adapters_disabled(base):
        assert all(not m.adapter_enabled for _, m in lora_layers(base))
    assert all(m.adapter_enabled for _, m in lora_layers(base))


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo", "orpo"])
def test_step_loss_and_gradient_do_not_depend_on_the_micro_batches(tmp_path, kind):
    """One micro-batch of 4 pairs and two of 2 (packed) give the same loss and gradients: the pair mean
    and ORPO's token-weighted NLL are over the whole step."""
    cfg = make_config(tmp_path, dpo_loss=kind, dpo_beta=0.5)
    pairs = _pairs(4, seed=2)
    results = []
    for micro in ([_batch(pairs, False)], [_batch(pairs[:2], True), _batch(pairs[2:], True, start=2)]):
        model = tiny_model(VOCAB, seed=3)
        ref_model = tiny_model(VOCAB, seed=4)
        obj = PreferenceObjective(
            cfg.train, FrozenCopy(ref_model) if kind in ("sigmoid", "ipo") else None, lambda v: v
        )
        denom, _ = obj.begin_step(micro)
        total = 0.0
        for b in micro:
            loss, _ = obj.loss_sum(model, b)
            (loss / denom).backward()
            total += float(loss) / denom
        grads = np.concatenate([p.grad.numpy().ravel() for p in model.parameters() if p.grad is not None])
        results.append((total, grads, obj.step_metrics()))
    (l1, g1, m1), (l2, g2, m2) = results
    assert l1 == pytest.approx(l2, rel=1e-5)
    np.testing.assert_allclose(g2, g1, rtol=1e-4, atol=1e-7)
    for key, value in m1.items():
        assert m2[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    if kind == "sigmoid":  # the reference is a different model: rewards are not zero
        assert m1["rewards/margins"] != 0.0


def test_precomputed_reference_equals_the_live_one(tmp_path, letters_tok, write_jsonl):
    from bmtrain_cli.preference.loader import build_preference_loader
    from bmtrain_cli.preference.reference import precompute

    path = write_jsonl(
        [{"prompt": f"{w}=", "chosen": w[::-1], "rejected": w} for w in ("abcde", "fghij", "klmno")]
    )
    loader = build_preference_loader(make_config(tmp_path, data_path=path, micro_batch_size=2), letters_tok)
    live = FrozenCopy(tiny_model(letters_tok.vocab_size, seed=5))
    file = precompute(loader, live, "k", is_main=True)
    assert file.is_file() and loader.dataset.ref_logps.shape == (3, 2)
    batch = next(iter(loader))
    np.testing.assert_allclose(Precomputed().logps(batch, 4).numpy(), live.logps(batch, 4).numpy(), rtol=1e-5)
    loader.dataset.ref_logps = None
    precompute(loader, None, "k", is_main=True)  # read back from the file: no reference needed
    np.testing.assert_allclose(Precomputed().logps(batch, 4).numpy(), live.logps(batch, 4).numpy(), rtol=1e-5)


def test_recompute_gives_the_same_gradients(tmp_path):
    cfg = make_config(tmp_path, dpo_loss="sigmoid")
    batch = _batch(_pairs(3, seed=6), packed=True)
    grads = []
    for recompute in (False, True):
        model = tiny_model(VOCAB, seed=7)
        if recompute:
            model.enable_recompute("full")
        obj = PreferenceObjective(cfg.train, FrozenCopy(tiny_model(VOCAB, seed=8)), lambda v: v)
        denom, _ = obj.begin_step([batch])
        loss, _ = obj.loss_sum(model, batch)
        (loss / denom).backward()
        grads.append(np.concatenate([p.grad.numpy().ravel() for p in model.parameters()]))
    np.testing.assert_allclose(grads[1], grads[0], rtol=1e-5, atol=1e-8)


def test_a_rank_without_pairs_contributes_zero_with_a_graph(tmp_path):
    """The last step of an epoch can leave a data rank no pair: its loss is 0 and backward still runs
    (every rank takes part in the gradient reduction)."""
    cfg = make_config(tmp_path, dpo_loss="simpo")
    empty = collate_pairs([], 0, width=None, packed=False, max_len=24)
    empty["pair_ids"] = np.zeros(0, dtype=np.int64)
    model = tiny_model(VOCAB, seed=9)
    obj = PreferenceObjective(cfg.train, None, lambda v: v)
    assert obj.begin_step([empty]) == (0.0, 1.0)
    loss, n = obj.loss_sum(model, empty)
    loss.backward()
    assert float(loss) == 0.0 and n == 0.0
    assert all(float(abs(p.grad).max()) == 0.0 for p in model.parameters() if p.grad is not None)
    assert obj.step_metrics()["rewards/margins"] == 0.0
