"""The blocks of the decoder: RMSNorm, the KV cache, attention, the MLP and the decoder layer. Family
differences are flags on :class:`~bmtrain_cli.models.arch.ModelArch` (see models/decoder.py); linear
layers come from the factory (``models/layers.py``), so tensor parallelism swaps them without touching this
file, and head counts are divided by ``factory.tp_degree``."""

from __future__ import annotations

import math
from typing import Any, List, Optional, Tuple

import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.models.arch import ModelArch
from bmtrain_cli.models.attention import attend
from bmtrain_cli.models.families import family
from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.models.linear_attention import GatedDeltaNet
from bmtrain_cli.models.moe import SparseMoE
from bmtrain_cli.models.rope import latent_attention_mscale
from bmtrain_cli.ops import OpSet, reference


class RMSNorm(nn.Layer):
    """``weight_view`` (optional) maps the weight before use: the tensor-parallel factory's
    ``sum_grad_over_group`` for a norm that every rank applies to its own heads (Qwen3's q/k norm).
    With ``offset`` (Gemma) the scale is 1 + weight and the weight starts at zero."""

    def __init__(
        self, dim: int, eps: float, ops: OpSet, weight_view: Optional[Any] = None, offset: bool = False
    ):
        super().__init__()
        start = 0.0 if offset else 1.0
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(start))
        self.eps = eps
        self.ops = ops
        self.weight_view = weight_view
        self.offset = offset

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        weight = self.weight if self.weight_view is None else self.weight_view(self.weight)
        if self.offset:
            weight = weight + 1.0
        return self.ops.rms_norm(x, weight, self.eps)


def _rows(t: Optional[paddle.Tensor], index: paddle.Tensor) -> Optional[paddle.Tensor]:
    return None if t is None else paddle.gather(t, index)


class KVCache:
    """Keys and values of the tokens seen so far, per layer ([b, s, kv_heads, d], before head
    repetition). Decoding appends one step at a time. A linear-attention layer (models/linear_attention.py)
    keeps (its convolution's last inputs, its recurrent state) in ``linear`` instead."""

    def __init__(self, num_layers: int):
        self.keys: List[Optional[paddle.Tensor]] = [None] * num_layers
        self.values: List[Optional[paddle.Tensor]] = [None] * num_layers
        self.linear: List[Tuple[Optional[paddle.Tensor], Optional[paddle.Tensor]]] = [
            (None, None)
        ] * num_layers
        self.linear_tokens = [0] * num_layers

    def __len__(self) -> int:
        k = next((k for k in self.keys if k is not None), None)
        return max(self.linear_tokens) if k is None else int(k.shape[1])

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
        prev_k, prev_v = self.keys[layer], self.values[layer]
        if prev_k is not None and prev_v is not None:  # set together
            k = paddle.concat([prev_k, k], axis=1)
            v = paddle.concat([prev_v, v], axis=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def select(self, index: paddle.Tensor) -> None:
        """Keep only the batch rows in ``index`` (e.g. after sequences finish)."""
        self.keys = [_rows(k, index) for k in self.keys]
        self.values = [_rows(v, index) for v in self.values]
        self.linear = [(_rows(c, index), _rows(r, index)) for c, r in self.linear]


def _local_heads(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise UserError(f"{what} ({total}) must be divisible by tensor_parallel ({tp})")
    return total // tp


class AttentionCore(nn.Layer):
    """What every softmax attention shares: the core over the cached keys/values (optionally recomputed in
    the backward), with the layer's sliding window and score soft-cap where the family has them."""

    def __init__(self, arch: ModelArch, ops: OpSet, layer_idx: int, implementation: str):
        super().__init__()
        self.layer_idx, self.implementation, self.ops = layer_idx, implementation, ops
        self.layer_type = arch.layer_type(layer_idx)
        # soft-capped scores (Gemma 2): the core caps them and applies the sliding window itself (the
        # layer inputs then hold no window in the mask: models/decoder.py LayerInputs)
        self.softcap = arch.attn_logit_softcapping
        self.window = arch.window_of(self.layer_type) if self.softcap is not None else None
        self.recompute_core = False

    def _cached_core(
        self,
        q: paddle.Tensor,
        k: paddle.Tensor,
        v: paddle.Tensor,
        bias: Optional[paddle.Tensor],
        cache: Optional[KVCache],
    ) -> paddle.Tensor:
        """The attention core over the cached keys/values and these (recomputed in the backward when
        ``recompute_core`` is set)."""
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if self.recompute_core and self.training:
            from paddle.distributed.fleet.utils import recompute

            return recompute(self._core, q, k, v, bias)
        return self._core(q, k, v, bias)

    def _core(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: Optional[paddle.Tensor]
    ) -> paddle.Tensor:
        return attend(
            q, k, v, bias, self.implementation, self.training, self.ops.attention, self.window, self.softcap
        )


class Attention(AttentionCore):
    def __init__(
        self, arch: ModelArch, factory: LayerFactory, ops: OpSet, layer_idx: int, implementation: str
    ):
        super().__init__(arch, ops, layer_idx, implementation)
        tp = factory.tp_degree
        self.head_dim = arch.head_dim
        self.num_heads = _local_heads(arch.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = _local_heads(arch.num_key_value_heads, tp, "num_key_value_heads")
        self.use_rope = arch.position_embedding == "rope"
        self.rotary_dim = arch.rotary_dim
        self.rotate = reference.rotary_interleaved if arch.rope_interleaved else ops.rotary
        # scores scale by query_pre_attn_scalar ** -0.5 (Gemma): q is pre-scaled, the core divides by sqrt(hd)
        scalar = arch.query_pre_attn_scalar
        self.q_scale = 1.0 if scalar is None else math.sqrt(arch.head_dim / scalar)
        h, hd = arch.hidden_size, arch.head_dim
        q_out, kv_out = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
        self.gated = (
            arch.attn_output_gate
        )  # q_proj yields [q; gate] per head, sigmoid(gate) scales the output
        self.fused = arch.fused_qkv and tp == 1  # under TP the fused matrix is split into q/k/v on load
        self.qkv_name = arch.qkv_name
        if self.fused:
            fused = factory.linear(h, q_out + 2 * kv_out, arch.attention_bias, tp="column")
            setattr(self, self.qkv_name, fused)  # named as the family's checkpoints name it
        else:
            self.q_proj = factory.linear(
                h, q_out * (2 if self.gated else 1), arch.attention_bias, tp="column"
            )
            self.k_proj = factory.linear(h, kv_out, arch.attention_bias, tp="column")
            self.v_proj = factory.linear(h, kv_out, arch.attention_bias, tp="column")
        self.o_proj = factory.linear(q_out, h, arch.o_proj_bias, tp="row")
        if arch.qk_norm:
            # one weight for all heads: under tensor parallel its gradient sums every rank's heads
            grad_sum = factory.sum_grad_over_group
            self.q_norm = RMSNorm(hd, arch.rms_norm_eps, ops, grad_sum, arch.norm_offset)
            self.k_norm = RMSNorm(hd, arch.rms_norm_eps, ops, grad_sum, arch.norm_offset)
        self.qk_norm = arch.qk_norm

    def forward(
        self,
        x: paddle.Tensor,
        cos: Optional[paddle.Tensor],
        sin: Optional[paddle.Tensor],
        bias: Optional[paddle.Tensor],
        cache: Optional[KVCache] = None,
    ) -> paddle.Tensor:
        b, s = x.shape[0], x.shape[1]
        hd = self.head_dim
        if self.fused:
            qkv = getattr(self, self.qkv_name)(x)
            nq, nkv = self.num_heads * hd, self.num_kv_heads * hd
            q, k, v = paddle.split(qkv, [nq, nkv, nkv], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape([b, s, self.num_heads, hd * 2 if self.gated else hd])
        gate = None
        if self.gated:
            q, gate = paddle.split(q, 2, axis=-1)
        k = k.reshape([b, s, self.num_kv_heads, hd])
        v = v.reshape([b, s, self.num_kv_heads, hd])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            assert cos is not None and sin is not None  # the model passes its rotary tables
            q, k = self._rotary(q, k, cos.astype(q.dtype), sin.astype(q.dtype))
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = self._cached_core(q, k, v, bias, cache).reshape([b, s, self.num_heads * hd])
        if gate is not None:
            out = out * F.sigmoid(gate.reshape([b, s, self.num_heads * hd]))
        return self.o_proj(out)

    def _rotary(
        self, q: paddle.Tensor, k: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """Rope on the leading ``rotary_dim`` dimensions of each head (all of them in most families)."""
        rest = self.head_dim - self.rotary_dim
        if not rest:
            return self.rotate(q, k, cos, sin)
        q_rot, q_pass = paddle.split(q, [self.rotary_dim, rest], axis=-1)
        k_rot, k_pass = paddle.split(k, [self.rotary_dim, rest], axis=-1)
        q_rot, k_rot = self.rotate(q_rot, k_rot, cos, sin)
        return paddle.concat([q_rot, q_pass], axis=-1), paddle.concat([k_rot, k_pass], axis=-1)


class LatentAttention(AttentionCore):
    """Multi-head latent attention (DeepSeek-V3; see models/families/deepseek_v3.py), named as transformers
    names its parts. The per-head keys [nope | rope] and values are expanded from the latent before the
    core, which then runs as any attention's (the KV cache holds them): where the value head is narrower
    than the query/key head (or wider) the narrower side is padded with zeros to the same width, which
    leaves the scores and the outputs exact, and the output is cut back to ``v_head_dim``."""

    def __init__(self, arch: ModelArch, factory: Any, ops: OpSet, layer_idx: int, implementation: str):
        super().__init__(arch, ops, layer_idx, implementation)
        # tensor parallel: each rank its heads (q_b/q, kv_b split by columns, o by rows); the latent
        # projections and norms whole, the shared rope key's gradient summed over the group
        h, n = arch.hidden_size, arch.num_attention_heads
        self.num_heads = _local_heads(n, factory.tp_degree, "num_attention_heads")
        self.rank, self.shared_key = arch.kv_lora_rank, factory.sum_grad_over_group
        self.nope, self.rope, self.v_dim = arch.qk_nope_head_dim, arch.head_dim, arch.v_head_dim
        qk = self.nope + self.rope
        self.width = max(qk, self.v_dim)
        self.q_lora = arch.q_lora_rank > 0
        bias = arch.attention_bias
        if self.q_lora:
            self.q_a_proj = factory.linear(h, arch.q_lora_rank, bias)
            # transformers gives the latent norms their default eps (1e-6), not rms_norm_eps
            self.q_a_layernorm = RMSNorm(arch.q_lora_rank, 1e-6, ops)
            self.q_b_proj = factory.linear(arch.q_lora_rank, n * qk, False, tp="column")
        else:
            self.q_proj = factory.linear(h, n * qk, False, tp="column")
        self.kv_a_proj_with_mqa = factory.linear(h, self.rank + self.rope, bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6, ops)
        self.kv_b_proj = factory.linear(self.rank, n * (self.nope + self.v_dim), False, tp="column")
        self.o_proj = factory.linear(n * self.v_dim, h, bias, tp="row")
        self.rotate = reference.rotary_interleaved if arch.rope_interleaved else ops.rotary
        # scores scale by qk^-1/2 (times YaRN's mscale squared); the core divides by sqrt(width)
        self.q_scale = latent_attention_mscale(arch.rope_scaling) * math.sqrt(self.width / qk)

    def forward(
        self,
        x: paddle.Tensor,
        cos: Optional[paddle.Tensor],
        sin: Optional[paddle.Tensor],
        bias: Optional[paddle.Tensor],
        cache: Optional[KVCache] = None,
    ) -> paddle.Tensor:
        assert cos is not None and sin is not None  # the model passes its rotary tables
        b, s, n = x.shape[0], x.shape[1], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_pass, q_rot = paddle.split(q.reshape([b, s, n, self.nope + self.rope]), [self.nope, self.rope], -1)
        latent, k_rot = paddle.split(self.kv_a_proj_with_mqa(x), [self.rank, self.rope], axis=-1)
        if self.shared_key is not None:  # every head of every rank reads it
            k_rot = self.shared_key(k_rot)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).reshape([b, s, n, self.nope + self.v_dim])
        k_pass, v = paddle.split(kv, [self.nope, self.v_dim], axis=-1)
        q_rot, k_rot = self.rotate(
            q_rot, k_rot.reshape([b, s, 1, self.rope]), cos.astype(x.dtype), sin.astype(x.dtype)
        )
        q = paddle.concat([q_pass, q_rot], axis=-1)
        k = paddle.concat([k_pass, k_rot.expand([b, s, n, self.rope])], axis=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        q, k, v = (self._widen(t) for t in (q, k, v))
        out = self._cached_core(q, k, v, bias, cache)[..., : self.v_dim]
        return self.o_proj(out.reshape([b, s, n * self.v_dim]))

    def _widen(self, t: paddle.Tensor) -> paddle.Tensor:
        """[b, s, n, d] padded with zeros to [b, s, n, width]."""
        extra = self.width - t.shape[-1]
        if not extra:
            return t
        return paddle.concat([t, paddle.zeros([*t.shape[:-1], extra], dtype=t.dtype)], axis=-1)


class MLP(nn.Layer):
    def __init__(self, arch: ModelArch, factory: LayerFactory, ops: OpSet):
        super().__init__()
        h, f, bias = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        # one gate_up_proj [gate; up] on one device; under TP it is split into gate/up on load
        self.fused = arch.fused_gate_up and factory.tp_degree == 1
        if self.fused:
            self.gate_up_proj = factory.linear(h, 2 * f, bias, tp="column")
        else:
            self.gate_proj = factory.linear(h, f, bias, tp="column")
            self.up_proj = factory.linear(h, f, bias, tp="column")
        self.down_proj = factory.linear(f, h, bias, tp="row")
        self.ops = ops
        self.act = arch.hidden_act

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        if self.fused:
            gate, up = paddle.chunk(self.gate_up_proj(x), 2, axis=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu":  # SwiGLU, through the fused kernels
            return self.down_proj(self.ops.swiglu(gate, up))
        # GeGLU: gelu (erf) or gelu_pytorch_tanh (the tanh approximation)
        return self.down_proj(F.gelu(gate, approximate=self.act == "gelu_pytorch_tanh") * up)


class DecoderLayer(nn.Layer):
    """Attention and MLP (or mixture of experts), each with a residual. The RMSNorms are the family's (``norm_names``: role ->
    Hugging Face name): before each block always, after each block too in Gemma 3 and GLM-4."""

    def __init__(
        self, arch: ModelArch, factory: LayerFactory, ops: OpSet, layer_idx: int, implementation: str
    ):
        super().__init__()
        self.norm_names = dict(family(arch.family).norm_names)
        self.layer_type = arch.layer_type(layer_idx)
        for name in self.norm_names.values():
            setattr(self, name, RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops, offset=arch.norm_offset))
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(arch, factory, ops, layer_idx)
        else:
            attention = LatentAttention if arch.kv_lora_rank else Attention
            self.self_attn = attention(arch, factory, ops, layer_idx, implementation)
        # the mixture of experts on the layers the family makes sparse; under tensor parallel its router
        # and routed experts are whole on every rank of the group, its shared experts split as an MLP
        self.sparse = arch.is_sparse(layer_idx)
        self.mlp = SparseMoE(arch, ops, factory) if self.sparse else MLP(arch, factory, ops)

    def _norm(self, role: str, x: paddle.Tensor) -> paddle.Tensor:
        name = self.norm_names.get(role)
        return x if name is None else getattr(self, name)(x)

    def forward(
        self,
        x: paddle.Tensor,
        cos: Optional[paddle.Tensor] = None,
        sin: Optional[paddle.Tensor] = None,
        bias: Optional[paddle.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> paddle.Tensor:
        if self.layer_type == "linear_attention":  # ``bias``: the padding mask (decoder.LayerInputs)
            mixed = self.linear_attn(self._norm("pre_attn", x), bias, cache)
        else:
            mixed = self.self_attn(self._norm("pre_attn", x), cos, sin, bias, cache)
        x = x + self._norm("post_attn", mixed)
        return x + self._norm("post_mlp", self.mlp(self._norm("pre_mlp", x)))
