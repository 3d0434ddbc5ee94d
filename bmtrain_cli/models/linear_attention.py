"""Gated DeltaNet, the linear attention of Qwen3.5's ``linear_attention`` layers (transformers'
``Qwen3_5GatedDeltaNet``; weights named as there).

Per token: x -> in_proj_qkv -> a causal depthwise convolution (``conv1d``, kernel ``conv_kernel``) and
SiLU -> q, k, v; q and k l2-normalised per head (q also scaled by 1/sqrt(key_head_dim)); beta =
sigmoid(in_proj_b x) and the log decay g = -exp(A_log) softplus(in_proj_a x + dt_bias) per value head;
the gated delta rule (ops/reference.py, or the op set's kernel) gives o; then o is RMS-normalised per head,
scaled by the norm's weight and by SiLU(in_proj_z x), and projected back by out_proj.

Padding: the layer's input is zeroed where the mask says padding (as transformers does), so a pad token
writes nothing into the state or the convolution. Generation carries, per layer, the convolution's last
inputs and the recurrent state in the KV cache (models/blocks.KVCache.linear)."""

from __future__ import annotations

from typing import Any, Optional

import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.ops import OpSet, reference


def _wide(x: paddle.Tensor) -> paddle.dtype:
    """fp32 for half-precision activations, else their own dtype."""
    return paddle.float32 if x.dtype in (paddle.float16, paddle.bfloat16) else x.dtype


class GatedRMSNorm(nn.Layer):
    """RMSNorm of each head's output (fp32), times weight, times SiLU(gate)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps

    def forward(self, x: paddle.Tensor, gate: paddle.Tensor) -> paddle.Tensor:
        wide = _wide(x)
        xf = x.astype(wide)
        normed = (xf * paddle.rsqrt(xf.pow(2).mean(axis=-1, keepdim=True) + self.eps)).astype(x.dtype)
        return (self.weight * normed * F.silu(gate.astype(wide))).astype(x.dtype)


class _DepthwiseConv(nn.Layer):
    """The weight [channels, 1, kernel] as transformers' ``nn.Conv1d`` holds it (groups = channels)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = self.create_parameter([channels, 1, kernel])
        self.kernel = kernel

    def forward(self, x: paddle.Tensor, previous: Optional[paddle.Tensor]) -> tuple:
        """x [b, s, c] -> (causal convolution of x after ``previous`` [b, kernel - 1, c] (zeros when None),
        the last kernel - 1 inputs)."""
        b, s, c = x.shape
        if previous is None:
            previous = paddle.zeros([b, self.kernel - 1, c], dtype=x.dtype)
        full = paddle.concat([previous.astype(x.dtype), x], axis=1)
        w = self.weight.squeeze(1).transpose([1, 0])  # [kernel, c]
        out = full[:, 0:s] * w[0]
        for j in range(1, self.kernel):
            out = out + full[:, j : j + s] * w[j]
        return out, full[:, full.shape[1] - (self.kernel - 1) :]


def _l2norm(x: paddle.Tensor) -> paddle.Tensor:
    return x * paddle.rsqrt((x * x).sum(axis=-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Layer):
    def __init__(self, arch: Any, factory: Any, ops: OpSet, layer_idx: int):
        super().__init__()
        if factory.tp_degree > 1:
            raise UserError("the Gated DeltaNet layers (qwen3_5_text) do not support tensor_parallel > 1 yet")
        shape = arch.linear_attention
        self.shape, self.layer_idx, self.ops = shape, layer_idx, ops
        h, nv = arch.hidden_size, shape.num_value_heads
        self.in_proj_qkv = factory.linear(h, shape.conv_dim, False, tp="column")
        self.in_proj_z = factory.linear(h, shape.value_dim, False, tp="column")
        self.in_proj_b = factory.linear(h, nv, False, tp="column")
        self.in_proj_a = factory.linear(h, nv, False, tp="column")
        self.conv1d = _DepthwiseConv(shape.conv_dim, shape.conv_kernel)
        self.dt_bias = self.create_parameter([nv], default_initializer=nn.initializer.Constant(1.0))
        self.A_log = self.create_parameter([nv], default_initializer=nn.initializer.Constant(0.0))
        self.norm = GatedRMSNorm(shape.value_head_dim, arch.rms_norm_eps)
        self.out_proj = factory.linear(shape.value_dim, h, False, tp="row")

    def forward(self, x: paddle.Tensor, mask: Optional[paddle.Tensor], cache: Any = None) -> paddle.Tensor:
        """x [b, s, hidden]; mask [b, s] (0 = padding) or None; cache: a KVCache or None."""
        shape = self.shape
        b, s = x.shape[0], x.shape[1]
        if mask is not None:
            x = x * (mask > 0).astype(x.dtype).unsqueeze(-1)
        conv_state, state = cache.linear[self.layer_idx] if cache is not None else (None, None)
        mixed, conv_state = self.conv1d(self.in_proj_qkv(x), conv_state)
        q, k, v = paddle.split(F.silu(mixed), [shape.key_dim, shape.key_dim, shape.value_dim], axis=-1)
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
        return self.out_proj(out.reshape([b, s, shape.value_dim]))

    def init_weights(self) -> None:
        """transformers' fresh values: dt_bias 1, A = exp(A_log) uniform in [0.01, 16], the norm's weight 1
        (CausalLM.init_weights draws the matrices and the convolution)."""
        self.dt_bias.set_value(paddle.ones_like(self.dt_bias))
        self.A_log.set_value(paddle.log(paddle.uniform(self.A_log.shape, self.A_log.dtype, 0.01, 16.0)))
        self.norm.weight.set_value(paddle.ones_like(self.norm.weight))
