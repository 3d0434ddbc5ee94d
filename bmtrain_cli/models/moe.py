"""Mixture of experts (Qwen3-MoE, Mixtral, ERNIE 4.5 MoE, GLM-4.5): a router (``gate``) scores every token
in fp32 (softmax over the experts, or a sigmoid per expert), the top-k experts (SwiGLU MLPs) process it and
their outputs are summed with the routing weights. Dropless: every token reaches its k experts, no capacity
limit. Optional per family: a score-correction bias that picks the experts but does not weigh them,
group-limited top-k (the best groups by the sum of their two best scores), a routed scaling factor and
always-on shared experts.

Expert compute groups the (token, expert) pairs by expert (a stable argsort of the expert ids), runs the
experts over their contiguous rows, then adds the weighted rows back per token. Where our kernels run on a
CPU (float32) or pass their launch check on a GPU (float32, float16, bfloat16) (``OpSet.moe_experts``) all
the experts run as one grouped GEMM call (ops/moe_experts.py, ``takes``); elsewhere one matmul chain per
expert (the reference composition). LoRA on the
experts' projections keeps the grouped GEMM: each wrapped projection runs as its base weight plus
``scaling * A @ B`` (the adapters' gradients through that sum); only LoRA dropout while training falls
back to the reference composition. Quantised experts (QLoRA) run as three grouped calls over their codes
(quant/experts.py: one C++ launcher call each where our CPU kernels run). Under expert parallel a layer
keeps only its rank's experts (:meth:`SparseMoE.shard_experts`) and hands its sorted rows to the dispatch
of parallel/expert_parallel.py.

``load_balancing_loss`` is transformers' ``load_balancing_loss_func`` (Switch Transformer eq. 4-6), padding
excluded through the attention mask as transformers does.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple, Union

import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.models.families import family
from bmtrain_cli.models.layers import PlainFactory
from bmtrain_cli.ops import OpSet
from bmtrain_cli.ops.moe_experts import reference_experts, resolve, takes
from bmtrain_cli.quant.experts import quantised_experts


class Expert(nn.Layer):
    """One SwiGLU expert, named as Hugging Face's per-expert checkpoints name it (biases: ERNIE's shared
    experts under use_bias)."""

    def __init__(self, hidden: int, inter: int, ops: OpSet, bias: bool = False, factory: Any = None):
        super().__init__()
        linear = PlainFactory().linear if factory is None else factory.linear  # the shared experts': split
        self.gate_proj = linear(hidden, inter, bias, tp="column")
        self.up_proj = linear(hidden, inter, bias, tp="column")
        self.down_proj = linear(inter, hidden, bias, tp="row")
        self.ops = ops

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class ScoreBias(nn.Layer):
    """ERNIE 4.5's ``moe_statics.e_score_correction_bias`` [num_experts] (a checkpoint's [1, E]): added to
    the routing probabilities to pick the top k only; not trained."""

    def __init__(self, num_experts: int):
        super().__init__()
        self.e_score_correction_bias = self.create_parameter(
            [num_experts], default_initializer=nn.initializer.Constant(0.0)
        )
        self.e_score_correction_bias.stop_gradient = True


class Router(nn.Layer):
    """``gate``: weight [hidden, num_experts] (Paddle layout), no bias; ERNIE's score bias inside."""

    def __init__(self, hidden: int, num_experts: int, score_bias: bool):
        super().__init__()
        self.weight = self.create_parameter([hidden, num_experts])
        self.moe_statics = ScoreBias(num_experts) if score_bias else None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return paddle.matmul(x, self.weight)


class HeldExperts(nn.Layer):
    """The experts a rank holds under expert parallel, under their single-process indices (``experts.{e}``),
    iterated in index order like the LayerList they replace."""

    def __init__(self, experts: Sequence[Tuple[int, nn.Layer]]):
        super().__init__()
        for e, expert in experts:
            self.add_sublayer(str(e), expert)

    def __iter__(self) -> Iterator[nn.Layer]:
        return iter(self._sub_layers.values())

    def __len__(self) -> int:
        return len(self._sub_layers)


Dispatch = Callable[
    [paddle.Tensor, List[int], Callable[[paddle.Tensor, List[int]], paddle.Tensor]], paddle.Tensor
]


class SparseMoE(nn.Layer):
    """The MLP of a sparse layer: ``gate`` [hidden -> num_experts] and ``experts.{e}``. The router logits
    of the last forward stay in ``router_logits`` [tokens, num_experts] for the auxiliary loss."""

    def __init__(self, arch: ModelArch, ops: OpSet, factory: Any = None):
        super().__init__()
        h, f = arch.hidden_size, arch.moe_intermediate_size
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.norm_min = arch.moe_norm_min
        self.sigmoid = family(arch.family).moe_scoring == "sigmoid"
        self.groups, self.topk_groups = arch.moe_groups, arch.moe_topk_groups
        self.scaling = arch.routed_scaling_factor
        self.gate = Router(h, arch.num_experts, arch.moe_score_bias)
        self.experts: Union[nn.LayerList, HeldExperts] = nn.LayerList(
            [Expert(h, f, ops) for _ in range(arch.num_experts)]
        )
        self.shared_experts = (  # split over tensor parallel by ``factory`` (the routed experts whole)
            Expert(h, f * arch.moe_shared_experts, ops, arch.mlp_bias, factory)
            if arch.moe_shared_experts
            else None
        )
        self.router_logits: Optional[paddle.Tensor] = None
        self.last_counts: List[int] = []  # tokens routed to each expert in the last forward (monitoring)
        self.grouped = resolve(ops.moe_experts, ops.name, paddle.get_device())
        self.dispatch: Optional[Dispatch] = None  # expert parallel: runs the rows on the experts' owners

    def shard_experts(self, owned: Sequence[int], dispatch: Dispatch) -> None:
        """Keep only the experts ``owned`` (expert parallel); ``dispatch(rows, counts, run_held)`` then
        computes every row's expert output, ``run_held`` running this layer's held experts."""
        whole = list(self.experts)
        self.experts = HeldExperts([(e, whole[e]) for e in owned])
        self.dispatch = dispatch

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        logits = self.gate(flat)
        self.router_logits = logits
        weights, chosen = self._route(logits.astype("float32"))
        weights = weights.astype(x.dtype)
        # (token, expert) pairs sorted by expert: each expert's rows are contiguous
        pairs = chosen.reshape([-1])
        order = paddle.argsort(pairs, stable=True)
        counts: List[int] = [int(n) for n in paddle.bincount(pairs, minlength=self.num_experts).numpy()]
        self.last_counts = counts
        token = order // self.top_k
        rows = paddle.gather(flat, token)
        done = self._experts(rows, counts) * paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
        out = paddle.index_add(paddle.zeros_like(flat), token, 0, done)
        if self.shared_experts is not None:
            out = self.shared_experts(flat) + out
        return out.reshape(shape)

    def _experts(self, rows: paddle.Tensor, counts: List[int]) -> paddle.Tensor:
        """Every expert over its rows (sorted by expert, ``counts`` each); an expert without rows gets zero
        gradients, not missing ones, so every rank reduces the same gradients under data parallel."""
        if self.dispatch is not None:
            return self.dispatch(rows, counts, self._held_experts)
        return self._held_experts(rows, counts)

    def _held_experts(self, rows: paddle.Tensor, counts: List[int]) -> paddle.Tensor:
        if self.grouped is not None and takes(self.grouped, rows.dtype):
            weights = [[_grouped_weight(getattr(x, n)) for x in self.experts] for n in _PROJS]
            # one dtype throughout: under AMP O1 the rows are autocast (bf16/fp16) while the weights stay
            # fp32, which the reference composition's autocast matmuls take and the grouped GEMM does not
            if all(w is not None and w.dtype == rows.dtype for ws in weights for w in ws):
                return self.grouped(rows, counts, tuple(weights))
        held = list(self.experts)
        quantised = quantised_experts(held, rows, counts, held[0].ops.swiglu) if held else None
        if quantised is not None:  # a quantised base (QLoRA): three grouped calls, quant/experts.py
            return quantised
        return reference_experts(rows, counts, [x.__call__ for x in self.experts])

    def _route(self, logits: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(weights, chosen experts) [tokens, top_k] from fp32 router logits."""
        probs = F.sigmoid(logits) if self.sigmoid else F.softmax(logits, axis=-1)
        statics = self.gate.moe_statics
        # the bias picks the experts, the unbiased scores weigh them (ERNIE 4.5, GLM-4.5)
        choice = probs if statics is None else probs + statics.e_score_correction_bias
        if self.groups > 1:
            tokens = choice.shape[0]
            grouped = choice.reshape([tokens, self.groups, -1])
            group_score = paddle.topk(grouped, 2, axis=-1)[0].sum(axis=-1)
            _, best = paddle.topk(group_score, self.topk_groups, axis=-1)
            keep = F.one_hot(best, self.groups).sum(axis=1).unsqueeze(-1)  # [tokens, groups, 1]
            choice = paddle.where(keep > 0, grouped, paddle.full_like(grouped, float("-inf")))
            choice = choice.reshape([tokens, -1])
        _, chosen = paddle.topk(choice, self.top_k, axis=-1)
        weights = paddle.take_along_axis(probs, chosen, axis=-1)
        if self.norm_topk_prob:
            weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=self.norm_min)
        if self.scaling != 1.0:
            weights = weights * self.scaling
        return weights, chosen


_PROJS = ("gate_proj", "up_proj", "down_proj")


AUX_LOSS_KEYS = ("output_router_logits", "router_aux_loss_coef")


def with_aux_loss_settings(model: Any, model_config: Any) -> Any:
    """A loaded ``model`` with model_config's load-balancing loss settings over its checkpoint's (they
    shape the training loss, not the weights)."""
    aux = {k: getattr(model_config, k) for k in AUX_LOSS_KEYS if getattr(model_config, k, None) is not None}
    if aux:
        model.arch = replace(model.arch, **aux)
    return model


def adds_aux_loss(arch: Any) -> bool:
    """Whether the training loss of ``arch`` adds the load-balancing loss (output_router_logits on an MoE)."""
    return bool(getattr(arch, "num_experts", 0) and getattr(arch, "output_router_logits", False))


def tensor_parallel_problem(arch: ModelArch, tp: int) -> Optional[str]:
    """Why tensor parallel ``tp`` cannot split a mixture of experts' shared experts (None: it can; the
    router and the routed experts stay whole on every rank)."""
    width = arch.moe_intermediate_size * arch.moe_shared_experts
    if arch.num_experts and tp > 1 and width % tp:
        return f"the shared experts' width ({width}) is not divisible by tensor_parallel ({tp})"
    return None


def _grouped_weight(proj: nn.Layer) -> Optional[paddle.Tensor]:
    """The [in, out] weight a projection is (a LoRA-wrapped one: base + its update, differentiable in the
    adapters, lora/layers.py); None where it is no bias-free single weight."""
    if type(proj) is nn.Linear:
        return proj.weight if proj.bias is None else None
    as_weight = getattr(proj, "grouped_weight", None)
    return as_weight() if as_weight is not None else None


def router_sums(
    logits: paddle.Tensor, num_experts: int, top_k: int, mask: Optional[paddle.Tensor] = None
) -> Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """One sparse layer's part of the load-balancing loss: (top-k assignments per expert, router
    probabilities summed per expert, counted tokens), fp32; ``mask`` [tokens, 1] (1.0 = counted) or None."""
    probs = F.softmax(logits.astype("float32"), axis=-1)
    _, chosen = paddle.topk(probs, top_k, axis=-1)
    assigned = F.one_hot(chosen, num_experts).sum(axis=1)  # [tokens, experts], no gradient
    if mask is None:
        return assigned.sum(axis=0), probs.sum(axis=0), paddle.full([], float(probs.shape[0]), "float32")
    return (assigned * mask).sum(axis=0), (probs * mask).sum(axis=0), mask.sum()


def token_mask(attention_mask: Optional[paddle.Tensor]) -> Optional[paddle.Tensor]:
    """[tokens, 1] fp32: 1.0 where ``attention_mask`` is not 0 (None stays None)."""
    if attention_mask is None:
        return None
    return (attention_mask.reshape([-1, 1]) != 0).astype("float32")


def stacked_router_sums(
    logits: paddle.Tensor, num_experts: int, top_k: int, mask: Optional[paddle.Tensor] = None
) -> paddle.Tensor:
    """:func:`router_sums` as one [3, experts] tensor: assignments, probabilities, and the counted tokens
    in every column (what the pipeline stages carry and a context group sums in one collective)."""
    t, p, r = router_sums(logits, num_experts, top_k, mask)
    return paddle.stack([t, p, r.reshape([1]).expand([num_experts])])


def balance_loss(sums: paddle.Tensor, num_experts: int) -> paddle.Tensor:
    """The load-balancing loss from the sparse layers' :func:`stacked_router_sums` added up."""
    tokens, probs_sum, rows = sums[0], sums[1], sums[2][0]
    return (tokens / rows * (probs_sum / rows)).sum() * float(num_experts)


def load_balancing_loss(
    router_logits: Sequence[paddle.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: Optional[paddle.Tensor] = None,
    group_sum: Optional[Callable[[paddle.Tensor], paddle.Tensor]] = None,
) -> paddle.Tensor:
    """num_experts * sum_e(fraction of top-k assignments to e) * (mean router probability of e), over all
    sparse layers' tokens together (fp32); tokens where ``attention_mask`` is 0 are left out.

    ``group_sum``: context parallel, where each rank routed only its share of the micro-batch's tokens:
    the differentiable sum of the sums over the context group (its gradient is the group's summed
    gradient, so every rank's router gets the whole loss's), so the loss is the whole micro-batch's."""
    sums: Any = 0.0
    mask = token_mask(attention_mask)
    for logits in router_logits:
        sums = sums + stacked_router_sums(logits, num_experts, top_k, mask)
    return balance_loss(sums if group_sum is None else group_sum(sums), num_experts)
