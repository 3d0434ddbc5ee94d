"""Mixture of experts (Qwen3-MoE, Mixtral): a router (``gate``) scores every token in fp32, the top-k
experts (SwiGLU MLPs) process it and their outputs are summed with the routing weights. Dropless: every
token reaches its k experts, no capacity limit.

Expert compute groups the (token, expert) pairs by expert (a stable argsort of the expert ids) and runs
one matmul chain per expert over its contiguous rows, then adds the weighted rows back per token. This is
plain Paddle ops on one device: no grouped-GEMM kernel, no expert parallelism.

``load_balancing_loss`` is transformers' ``load_balancing_loss_func`` (Switch Transformer eq. 4-6), padding
excluded through the attention mask as transformers does.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.ops import OpSet


class Expert(nn.Layer):
    """One SwiGLU expert, named as Hugging Face's per-expert checkpoints name it."""

    def __init__(self, hidden: int, inter: int, ops: OpSet):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias_attr=False)
        self.up_proj = nn.Linear(hidden, inter, bias_attr=False)
        self.down_proj = nn.Linear(inter, hidden, bias_attr=False)
        self.ops = ops

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class SparseMoE(nn.Layer):
    """The MLP of a sparse layer: ``gate`` [hidden -> num_experts] and ``experts.{e}``. The router logits
    of the last forward stay in ``router_logits`` [tokens, num_experts] for the auxiliary loss."""

    def __init__(self, arch: ModelArch, ops: OpSet):
        super().__init__()
        h, f = arch.hidden_size, arch.moe_intermediate_size
        self.num_experts = arch.num_experts
        self.top_k = arch.num_experts_per_tok
        self.norm_topk_prob = arch.norm_topk_prob
        self.gate = nn.Linear(h, arch.num_experts, bias_attr=False)
        self.experts = nn.LayerList([Expert(h, f, ops) for _ in range(arch.num_experts)])
        self.router_logits: Optional[paddle.Tensor] = None

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        logits = self.gate(flat)
        self.router_logits = logits
        probs = F.softmax(logits.astype("float32"), axis=-1)
        weights, chosen = paddle.topk(probs, self.top_k, axis=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdim=True)
        weights = weights.astype(x.dtype)
        # (token, expert) pairs sorted by expert: each expert's rows are contiguous
        pairs = chosen.reshape([-1])
        order = paddle.argsort(pairs, stable=True)
        counts: List[int] = [int(n) for n in paddle.bincount(pairs, minlength=self.num_experts).numpy()]
        token = order // self.top_k
        rows = paddle.gather(flat, token)
        outs: List[paddle.Tensor] = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                outs.append(self.experts[e](rows[start : start + n]))
                start += n
        done = paddle.concat(outs) * paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
        out = paddle.index_add(paddle.zeros_like(flat), token, 0, done)
        return out.reshape(shape)


def load_balancing_loss(
    router_logits: Sequence[paddle.Tensor],
    num_experts: int,
    top_k: int,
    attention_mask: Optional[paddle.Tensor] = None,
) -> paddle.Tensor:
    """num_experts * sum_e(fraction of top-k assignments to e) * (mean router probability of e), over all
    sparse layers' tokens together (fp32); tokens where ``attention_mask`` is 0 are left out."""
    tokens: Any = 0.0
    probs_sum: Any = 0.0
    rows: Any = 0.0
    mask = None
    if attention_mask is not None:
        mask = (attention_mask.reshape([-1, 1]) != 0).astype("float32")
    for logits in router_logits:
        probs = F.softmax(logits.astype("float32"), axis=-1)
        _, chosen = paddle.topk(probs, top_k, axis=-1)
        assigned = F.one_hot(chosen, num_experts).sum(axis=1)  # [tokens, experts], no gradient
        if mask is None:
            tokens = tokens + assigned.sum(axis=0)
            probs_sum = probs_sum + probs.sum(axis=0)
            rows = rows + float(probs.shape[0])
        else:
            tokens = tokens + (assigned * mask).sum(axis=0)
            probs_sum = probs_sum + (probs * mask).sum(axis=0)
            rows = rows + mask.sum()
    return (tokens / rows * (probs_sum / rows)).sum() * float(num_experts)
