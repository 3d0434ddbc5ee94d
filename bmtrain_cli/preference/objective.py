"""The preference objective: the pair losses' arithmetic over a step, and an eval pass over pairs.

The DPO recipe (recipes/dpo.py) builds it with its reference and gives it to the shared step in place of
the SFT token loss (train/parts.py Objective).

Per optimizer step: ``begin_step(micro)`` sums the pairs (and, for ORPO, the chosen response tokens) over
the micro-batches and data ranks; ``loss_sum(model, batch)`` returns a micro-batch's summed pair losses,
which the trainer divides by the step's pair count before backward, so the gradient is that of the mean
pair loss of the whole step whatever the layout (as the SFT loss is token-weighted). ORPO's NLL term is
scaled so that, after that division, it is the NLL averaged over every chosen response token of the step.
``step_metrics()`` gives TRL's rewards/* and logps/* means over the step's pairs. A mixture of experts with
output_router_logits adds ``router_aux_loss_coef x`` the load-balancing loss of each micro-batch's policy
forward, weighted by its pairs (TRL's DPO, CPO and ORPO trainers add it to each batch's mean loss).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import paddle

from bmtrain_cli.methods import PREFERENCE_KEYS, REFERENCE_FREE
from bmtrain_cli.preference.logps import model_inputs, sequence_logps
from bmtrain_cli.preference.losses import PairLogps, pair_terms
from bmtrain_cli.preference.reference import Reference

METRIC_KEYS = PREFERENCE_KEYS  # order of the metric sums after the pair count
N_STATS = 1 + len(METRIC_KEYS)


def _counted_pairs(batch: Dict[str, np.ndarray]) -> int:
    """The pairs this rank counts: all of its batch's, none on the other ranks of a context group (every
    rank of the group holds the same pairs, parallel/ring_attention.split_batch)."""
    return len(batch["pair_ids"]) if batch.get("context_lead", True) else 0


def _count_chosen_tokens(batch: Dict[str, np.ndarray]) -> int:
    index = batch["sequence_index"]
    return int(((index >= 0) & (index % 2 == 0)).sum())


def _policy_aux_loss(model: Any, batch: Dict[str, np.ndarray]) -> Optional[paddle.Tensor]:
    """The MoE load-balancing loss of the policy forward just run over the batch's sequences (prompts and
    responses, padding left out), with output_router_logits; None without. Kept in the model's
    ``last_aux_loss``, which the step logs as ``aux_loss``. A context-parallel share's (``targets``) is
    the whole pairs' (its sums summed over the context group), on every rank of the group."""
    return model.aux_loss(paddle.to_tensor(batch["attention_mask"]), over_context="targets" in batch)


class PreferenceObjective:
    def __init__(self, train_config: Any, reference: Optional[Reference], all_reduce: Callable[[Any], Any]):
        t = train_config
        self.kind = t.dpo_loss
        self.beta, self.label_smoothing, self.gamma = t.dpo_beta, t.dpo_label_smoothing, t.simpo_gamma
        if reference is None and self.kind not in REFERENCE_FREE:
            raise ValueError(f"the {self.kind} loss needs a reference")
        self.reference = reference
        self._all_reduce = (
            all_reduce  # sums a tensor over the data ranks (ParallelContext.collectives.all_reduce_sum)
        )
        self._nll_scale = 0.0
        self._stats: List[paddle.Tensor] = []
        self.last_metrics: Dict[str, float] = {}  # the last step's (summary.json)

    # -- one optimizer step
    def begin_step(self, micro: List[Dict[str, np.ndarray]]) -> Tuple[float, float]:
        """(pairs, tokens) of the whole step, summed over the data ranks."""
        local = [
            sum(_counted_pairs(b) for b in micro),
            sum(int((b["attention_mask"] > 0).sum()) for b in micro),
            sum(_count_chosen_tokens(b) for b in micro),
        ]
        pairs, tokens, chosen_tokens = self._sum(np.asarray(local, dtype=np.float64))
        self._nll_scale = pairs / chosen_tokens if chosen_tokens else 0.0
        self._stats = []
        return pairs, tokens

    def _sum(self, values: np.ndarray) -> np.ndarray:
        """Sum a float64 vector over the data ranks (one collective)."""
        return np.asarray(
            self._all_reduce(paddle.to_tensor(values, dtype="float64")).numpy(), dtype=np.float64
        )

    def _terms(self, model: Any, batch: Dict[str, np.ndarray]) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(summed loss of the batch's pairs incl. the scaled ORPO NLL, [N_STATS] metric sums)."""
        n = 2 * len(batch["pair_ids"])
        logps, counts = sequence_logps(model, batch, n)
        aux = _policy_aux_loss(model, batch)  # before a reference forward (adapters off) reroutes
        ref = self.reference.logps(batch, n) if self.reference is not None else None
        loss, stats = self.pair_loss(logps, counts, ref)
        if aux is not None:  # TRL: pair loss mean + coef x aux per micro-batch; here summed over its pairs
            loss = loss + model.arch.router_aux_loss_coef * aux * float(len(batch["pair_ids"]))
        return loss, stats

    def pair_loss(
        self, logps: paddle.Tensor, counts: np.ndarray, ref: Optional[paddle.Tensor]
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(summed loss of the pairs incl. the scaled ORPO NLL, [N_STATS] metric sums) from the policy's
        summed response log-probs ``logps`` [2P] (chosen, rejected alternating), the response token
        counts and the reference's log-probs (None for the reference-free losses)."""
        # fp64: the log-ratios are small differences of sums of thousands of nats (logps.per_sequence)
        pair = logps.astype("float64").reshape([-1, 2])
        ref = paddle.zeros_like(pair) if ref is None else ref.astype("float64").reshape([-1, 2])
        tokens = paddle.to_tensor(counts.reshape(-1, 2).astype(np.float64))
        logps_in = PairLogps(pair[:, 0], pair[:, 1], ref[:, 0], ref[:, 1], tokens[:, 0], tokens[:, 1])
        terms = pair_terms(
            self.kind,
            logps_in,
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            simpo_gamma=self.gamma,
        )
        loss = terms.loss.sum()
        if self.kind == "orpo":  # NLL of the chosen responses, token-weighted over the step
            loss = loss - pair[:, 0].sum() * self._nll_scale
        c, r = terms.chosen_rewards.detach(), terms.rejected_rewards.detach()
        stats = paddle.stack(
            [
                paddle.to_tensor(float(pair.shape[0]), dtype="float64"),
                c.sum(),
                r.sum(),
                (c > r).astype("float64").sum(),
                (c - r).sum(),
                terms.chosen_logps.detach().sum(),
                terms.rejected_logps.detach().sum(),
                (pair[:, 0] > pair[:, 1]).astype("float64").sum(),
            ]
        ).astype("float32")
        return loss.astype("float32"), stats

    def record(self, stats: paddle.Tensor) -> None:
        """Add a micro-batch's [N_STATS] metric sums to the step's."""
        self._stats.append(stats)

    def loss_sum(self, model: Any, batch: Dict[str, np.ndarray]) -> Tuple[paddle.Tensor, float]:
        """(summed pair losses of one micro-batch, its pair count); records the step's metric sums."""
        if len(batch["pair_ids"]) == 0:  # this rank's share of the data ran out: zero, with a graph
            zero = model.hidden_states(**model_inputs(batch)).sum() * 0.0
            _policy_aux_loss(model, batch)  # logged as SFT logs an exhausted rank's (weight 0 in the loss)
            return zero, 0.0
        loss, stats = self._terms(model, batch)
        if not batch.get("context_lead", True):  # counted by the group's first rank (see ContextSum)
            loss, stats = loss * 0.0, stats * 0.0
        self.record(stats)
        return loss, float(_counted_pairs(batch))

    def _means(self, sums: np.ndarray) -> Dict[str, float]:
        pairs = max(float(sums[0]), 1.0)
        return {k: float(v) / pairs for k, v in zip(METRIC_KEYS, sums[1:])}

    def step_metrics(
        self, from_last_stage: Optional[Callable[[np.ndarray], np.ndarray]] = None
    ) -> Dict[str, float]:
        """TRL's metrics over the step's pairs (all data ranks); one host sync. Under pipeline parallel
        the sums are recorded on the last stage: ``from_last_stage`` hands them to every stage first."""
        local = paddle.stack(self._stats).sum(axis=0) if self._stats else paddle.zeros([N_STATS], "float32")
        self._stats = []
        sums = local.numpy().astype(np.float64)
        if from_last_stage is not None:
            sums = from_last_stage(sums)
        self.last_metrics = self._means(self._sum(sums))
        return self.last_metrics

    # -- evaluation
    def evaluate_pairs(
        self, model: Any, loader: Any, autocast: Callable[[], Any]
    ) -> Tuple[float, Dict[str, float]]:
        """(mean pair loss, TRL's metrics) over one pass of an eval loader (all data ranks)."""
        batches = list(loader)
        pairs, chosen_tokens = self._sum(
            np.asarray(
                [sum(len(b["pair_ids"]) for b in batches), sum(_count_chosen_tokens(b) for b in batches)],
                dtype=np.float64,
            )
        )
        saved, self._nll_scale = self._nll_scale, (pairs / chosen_tokens if chosen_tokens else 0.0)
        was_training = model.training
        model.eval()
        loss_total = 0.0
        sums = np.zeros(N_STATS)
        try:
            with paddle.no_grad():
                for b in batches:
                    if len(b["pair_ids"]) == 0:
                        continue
                    with autocast():
                        loss, stats = self._terms(model, b)
                    loss_total += float(loss)
                    sums += stats.numpy()
        finally:
            self._nll_scale = saved
            if was_training:
                model.train()
        total = self._sum(np.concatenate([[loss_total], sums]))
        return float(total[0]) / max(pairs, 1.0), self._means(total[1:])
