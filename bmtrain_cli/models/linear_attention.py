"""Gated DeltaNet, the linear attention of Qwen3.5's ``linear_attention`` layers (transformers'
``Qwen3_5GatedDeltaNet``; weights named as there).

Per token: x -> in_proj_qkv -> a causal depthwise convolution (``conv1d``, kernel ``conv_kernel``) and
SiLU -> q, k, v; q and k l2-normalised per head (q also scaled by 1/sqrt(key_head_dim)); beta =
sigmoid(in_proj_b x) and the log decay g = -exp(A_log) softplus(in_proj_a x + dt_bias) per value head;
the gated delta rule (ops/reference.py, or the op set's kernel) gives o; then o is RMS-normalised per head,
scaled by the norm's weight and by SiLU(in_proj_z x), and projected back by out_proj.

Padding: the layer's input is zeroed where the mask says padding (as transformers does), so a pad token
writes nothing into the state or the convolution. Packed rows (segment ids above 1) run each sample as
its own row, from a zero state (``segment_rows``). Generation carries, per layer, the convolution's last
inputs and the recurrent state in the KV cache (models/blocks.KVCache.linear).

Tensor parallel (the factory's ``tp_degree`` > 1): each rank holds its share of the key heads and of the
value heads (a value head's key head stays on its rank), so the delta rule, the convolution and the gated
norm run on local heads only. [q; k; v] is one projection and one convolution on one device; under tensor
parallel they are held as their three parts (``in_proj_q/k/v``, ``conv1d_q/k/v``), each split over the
ranks, and models/hf.py splits and fuses them as it does other fused projections. z, b, a are
column-parallel, out_proj row-parallel, dt_bias and A_log split per value head, and the norm's weight
(shared by every head) has its gradient summed over the group."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Tuple

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.ops import OpSet, reference
from bmtrain_cli.ops.custom import _traced as traced


def _wide(x: paddle.Tensor) -> paddle.dtype:
    """fp32 for half-precision activations, else their own dtype."""
    return paddle.float32 if x.dtype in (paddle.float16, paddle.bfloat16) else x.dtype


class GatedRMSNorm(nn.Layer):
    """RMSNorm of each head's output (fp32), times weight, times SiLU(gate)."""

    def __init__(self, dim: int, eps: float, weight_view: Optional[Callable[[Any], Any]] = None):
        super().__init__()
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps
        self.weight_view = weight_view  # tensor parallel: sums the weight's gradient over the group

    def forward(self, x: paddle.Tensor, gate: paddle.Tensor) -> paddle.Tensor:
        wide = _wide(x)
        xf = x.astype(wide)
        normed = (xf * paddle.rsqrt(xf.pow(2).mean(axis=-1, keepdim=True) + self.eps)).astype(x.dtype)
        weight = self.weight if self.weight_view is None else self.weight_view(self.weight)
        return (weight * normed * F.silu(gate.astype(wide))).astype(x.dtype)


class _DepthwiseConv(nn.Layer):
    """The weight [channels, 1, kernel] as transformers' ``nn.Conv1d`` holds it (groups = channels)."""

    def __init__(self, channels: int, kernel: int, split: bool = False):
        super().__init__()
        self.weight = self.create_parameter([channels, 1, kernel])
        if split:  # this rank's channels of a tensor-parallel split (fleet's attributes)
            self.weight.is_distributed, self.weight.split_axis = True, 0


def causal_conv(x: paddle.Tensor, weight: paddle.Tensor, previous: Optional[paddle.Tensor]) -> tuple:
    """x [b, s, c], a depthwise ``weight`` [c, 1, kernel] -> (the causal convolution of x after
    ``previous`` [b, kernel - 1, c] (zeros when None), the last kernel - 1 inputs)."""
    b, s, c = x.shape
    kernel = weight.shape[-1]
    if previous is None:
        previous = paddle.zeros([b, kernel - 1, c], dtype=x.dtype)
    full = paddle.concat([previous.astype(x.dtype), x], axis=1)
    w = weight.squeeze(1).transpose([1, 0])  # [kernel, c]
    out = full[:, 0:s] * w[0]
    for j in range(1, kernel):
        out = out + full[:, j : j + s] * w[j]
    return out, full[:, full.shape[1] - (kernel - 1) :]


def segment_rows(segments: paddle.Tensor) -> Optional[Tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]]:
    """For rows that pack several samples (segment ids [b, s] above 1): each run of one id as its own row
    of a [runs, longest] batch, so every sample starts from a zero state and an empty convolution window,
    exactly as it would alone. Returns (the flat token index [b * s] of every slot, b * s for the empty
    ones; the slots' mask, 0 for empty slots and padding runs; the slot of every token), or None where
    every row holds one sample (nothing to reset), and in a static graph (the inference export, whose rows
    are single prompts)."""
    if traced():
        return None
    ids = segments.numpy()
    if ids.size == 0 or ids.max() <= 1:
        return None
    b, s = ids.shape
    starts, lengths, real = [], [], []
    for r in range(b):
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(ids[r])) + 1, [s]])
        for a, e in zip(cuts[:-1], cuts[1:]):
            starts.append(r * s + int(a))
            lengths.append(int(e - a))
            real.append(ids[r, a] > 0)
    start, length = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
    pos = np.arange(length.max(), dtype=np.int64)
    inside = pos[None, :] < length[:, None]
    source = np.where(inside, start[:, None] + pos[None, :], b * s)
    slot = np.empty(b * s, dtype=np.int64)
    for i, (a, n) in enumerate(zip(start, length)):
        slot[a : a + n] = i * len(pos) + np.arange(n)
    mask = (inside & np.array(real)[:, None]).astype(np.int64)
    return paddle.to_tensor(source), paddle.to_tensor(mask), paddle.to_tensor(slot)


def _l2norm(x: paddle.Tensor) -> paddle.Tensor:
    return x * paddle.rsqrt((x * x).sum(axis=-1, keepdim=True) + 1e-6)


QKV_PARTS = ("q", "k", "v")  # the parts of in_proj_qkv and conv1d under tensor parallel


class GatedDeltaNet(nn.Layer):
    def __init__(self, arch: Any, factory: Any, ops: OpSet, layer_idx: int):
        super().__init__()
        whole = arch.linear_attention
        tp, self.tp_rank = factory.tp_degree, factory.tp_rank
        if whole.num_key_heads % tp:
            raise UserError(
                f"linear_num_key_heads ({whole.num_key_heads}) is not divisible by tensor_parallel ({tp})"
            )
        # this rank's heads (all of them on one device)
        shape = dataclasses.replace(
            whole, num_key_heads=whole.num_key_heads // tp, num_value_heads=whole.num_value_heads // tp
        )
        self.whole, self.shape, self.tp, self.layer_idx, self.ops = whole, shape, tp, layer_idx, ops
        # this rank's q, k, v widths as plain ints (to_static's tracer reads no dataclass properties)
        self.qkv_sizes = [shape.key_dim, shape.key_dim, shape.value_dim]
        h, nv = arch.hidden_size, whole.num_value_heads
        self.hidden = h
        sizes = (whole.key_dim, whole.key_dim, whole.value_dim)
        if tp == 1:
            self.in_proj_qkv = factory.linear(h, whole.conv_dim, False, tp="column")
        else:
            for part, size in zip(QKV_PARTS, sizes):
                setattr(self, f"in_proj_{part}", factory.linear(h, size, False, tp="column"))
        self.in_proj_z = factory.linear(h, whole.value_dim, False, tp="column")
        self.in_proj_b = factory.linear(h, nv, False, tp="column")
        self.in_proj_a = factory.linear(h, nv, False, tp="column")
        if tp == 1:
            self.conv1d = _DepthwiseConv(whole.conv_dim, whole.conv_kernel)
        else:
            for part, size in zip(QKV_PARTS, sizes):
                setattr(self, f"conv1d_{part}", _DepthwiseConv(size // tp, whole.conv_kernel, split=True))
        self.dt_bias = self.create_parameter([nv // tp], default_initializer=nn.initializer.Constant(1.0))
        self.A_log = self.create_parameter([nv // tp], default_initializer=nn.initializer.Constant(0.0))
        if tp > 1:
            for p in (self.dt_bias, self.A_log):
                p.is_distributed, p.split_axis = True, 0
        self.norm = GatedRMSNorm(whole.value_head_dim, arch.rms_norm_eps, factory.sum_grad_over_group)
        self.out_proj = factory.linear(whole.value_dim, h, False, tp="row")

    def _qkv(self, x: paddle.Tensor, previous: Optional[paddle.Tensor]) -> tuple:
        """(SiLU of the causal convolution of this rank's [q; k; v] projection, the convolution's state)."""
        if self.tp == 1:
            return causal_conv(self.in_proj_qkv(x), self.conv1d.weight, previous)
        mixed = paddle.concat([getattr(self, f"in_proj_{p}")(x) for p in QKV_PARTS], axis=-1)
        weight = paddle.concat([getattr(self, f"conv1d_{p}").weight for p in QKV_PARTS], axis=0)
        return causal_conv(mixed, weight, previous)

    def forward(self, x: paddle.Tensor, mask: Optional[paddle.Tensor], cache: Any = None) -> paddle.Tensor:
        """x [b, s, hidden]; mask [b, s] (0 = padding, k > 0 = segment id) or None; cache: a KVCache or
        None. Rows packing several samples run as one row per sample (:func:`segment_rows`)."""
        rows = None if cache is not None or mask is None else segment_rows(mask)
        if rows is None:
            return self._mix(x, mask, cache)
        b, s, h = x.shape
        source, slot_mask, slot = rows
        n, longest = slot_mask.shape
        flat = paddle.concat([x.reshape([b * s, h]), paddle.zeros([1, h], dtype=x.dtype)])
        out = self._mix(paddle.gather(flat, source.reshape([-1])).reshape([n, longest, h]), slot_mask, None)
        return paddle.gather(out.reshape([n * longest, h]), slot).reshape([b, s, h])

    def _mix(self, x: paddle.Tensor, mask: Optional[paddle.Tensor], cache: Any) -> paddle.Tensor:
        shape = self.shape
        b, s = x.shape[0], x.shape[1]
        if mask is not None:
            x = x * (mask > 0).astype(x.dtype).unsqueeze(-1)
        conv_state, state = cache.linear[self.layer_idx] if cache is not None else (None, None)
        mixed, conv_state = self._qkv(x, conv_state)
        q, k, v = paddle.split(F.silu(mixed), self.qkv_sizes, axis=-1)
        wide = _wide(x)  # the delta rule's dtype
        q = _l2norm(q.reshape([b, s, shape.num_key_heads, shape.key_head_dim]).astype(wide))
        k = _l2norm(k.reshape([b, s, shape.num_key_heads, shape.key_head_dim]).astype(wide))
        q = q * shape.key_head_dim**-0.5
        group = shape.num_value_heads // shape.num_key_heads
        if group > 1:  # each q/k head serves ``group`` consecutive value heads
            q, k = (paddle.repeat_interleave(t, group, axis=2) for t in (q, k))
        v = v.reshape([b, s, shape.num_value_heads, shape.value_head_dim]).astype(wide)
        beta = F.sigmoid(self.in_proj_b(x).astype(wide))
        g = -paddle.exp(self.A_log.astype(wide)) * F.softplus(
            self.in_proj_a(x).astype(wide) + self.dt_bias.astype(wide)
        )
        if state is not None and s == 1:  # one decoding step
            out, state = reference.gated_delta_rule_recurrent(q, k, v, g, beta, state)
        else:
            rule = self.ops.delta_rule or reference.gated_delta_rule
            out, state = rule(q, k, v, g, beta, state)
        if cache is not None:
            cache.linear[self.layer_idx] = (conv_state, state)
            cache.linear_tokens[self.layer_idx] += s
        z = self.in_proj_z(x).reshape([b, s, shape.num_value_heads, shape.value_head_dim])
        out = self.norm(out.astype(x.dtype), z)
        return self.out_proj(out.reshape([b, s, self.qkv_sizes[2]]))

    def init_weights(self, normal: Callable[[paddle.Tensor], Any]) -> None:
        """transformers' fresh values: the matrices and the convolution drawn by ``normal``, dt_bias 1,
        A = exp(A_log) uniform in [0.01, 16], the norm's weight 1. Every tensor is drawn whole, in the same
        order under every tensor-parallel degree, and cut to this rank's parts, so a fresh tp model holds
        the single process's weights."""
        w, h, nv = self.whole, self.hidden, self.whole.num_value_heads
        dtype = self.dt_bias.dtype

        def drawn(shape: List[int]) -> paddle.Tensor:
            full = paddle.empty(shape, dtype=dtype)
            normal(full)
            return full

        def parts(fused: str, stem: str) -> List[paddle.Tensor]:
            if self.tp == 1:
                return [getattr(self, fused).weight]
            return [getattr(self, f"{stem}_{p}").weight for p in QKV_PARTS]

        self._put(parts("in_proj_qkv", "in_proj"), drawn([h, w.conv_dim]), 1)
        self._put([self.in_proj_z.weight], drawn([h, w.value_dim]), 1)
        self._put([self.in_proj_b.weight], drawn([h, nv]), 1)
        self._put([self.in_proj_a.weight], drawn([h, nv]), 1)
        self._put(parts("conv1d", "conv1d"), drawn([w.conv_dim, 1, w.conv_kernel]), 0)
        self._put([self.out_proj.weight], drawn([w.value_dim, h]), 0)
        self.dt_bias.set_value(paddle.ones_like(self.dt_bias))
        self._put([self.A_log], paddle.log(paddle.uniform([nv], dtype, 0.01, 16.0)), 0)
        self.norm.weight.set_value(paddle.ones_like(self.norm.weight))

    def _put(self, params: List[paddle.Tensor], full: paddle.Tensor, axis: int) -> None:
        """Cut the whole tensor ``full`` into ``params``' parts along ``axis`` (one part on one device),
        each part into this rank's slice."""
        tp, rank = self.tp, self.tp_rank
        pieces = paddle.split(full, [int(p.shape[axis]) * tp for p in params], axis=axis)
        for p, piece in zip(params, pieces):
            n = int(p.shape[axis])
            p.set_value(paddle.slice(piece, axes=[axis], starts=[rank * n], ends=[(rank + 1) * n]))
