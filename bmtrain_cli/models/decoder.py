"""One decoder-only transformer for every supported family.

Family differences are flags on :class:`~bmtrain_cli.models.arch.ModelArch`:

- grouped-query attention: ``num_key_value_heads < num_attention_heads`` (LLaMA 2 70B / 3, Qwen, Mistral)
- ``attention_bias``: q/k/v biases (Qwen2/2.5); LLaMA and Qwen3 checkpoints that set it also bias o_proj
- ``qk_norm``: per-head RMSNorm of q and k before the rotary embedding, explicit ``head_dim`` (Qwen3)
- ``fused_qkv``: one ``W_pack`` projection holding [q; k; v] (Baichuan)
- ``position_embedding``: ``rope`` (with ``rope_scaling``) or ``alibi`` (Baichuan 13B)
- ``sliding_window``: local attention window (Mistral)
- ``norm_head``: LM head rows L2-normalised (Baichuan 2)
- ``tie_word_embeddings``: the LM head reuses the embedding matrix

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...). Linear and
embedding layers come from a factory (``models/layers.py``), so tensor parallelism swaps them without
touching this file; head counts are divided by ``factory.tp_degree``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Set, Tuple

import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.models.arch import ModelArch, arch_problems
from bmtrain_cli.models.attention import IMPLEMENTATIONS, attend, batch_segments, build_bias
from bmtrain_cli.models.layers import PlainFactory
from bmtrain_cli.models.rope import RotaryTables, alibi_slopes
from bmtrain_cli.ops import OpSet, OpShapes, select


class RMSNorm(nn.Layer):
    """``weight_view`` (optional) maps the weight before use: the tensor-parallel factory's
    ``sum_grad_over_group`` for a norm that every rank applies to its own heads (Qwen3's q/k norm)."""

    def __init__(self, dim: int, eps: float, ops: OpSet, weight_view: Optional[Any] = None):
        super().__init__()
        self.weight = self.create_parameter([dim], default_initializer=nn.initializer.Constant(1.0))
        self.eps = eps
        self.ops = ops
        self.weight_view = weight_view

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        weight = self.weight if self.weight_view is None else self.weight_view(self.weight)
        return self.ops.rms_norm(x, weight, self.eps)


class KVCache:
    """Keys and values of the tokens seen so far, per layer ([b, s, kv_heads, d], before head
    repetition). Decoding appends one step at a time."""

    def __init__(self, num_layers: int):
        self.keys: List[Optional[paddle.Tensor]] = [None] * num_layers
        self.values: List[Optional[paddle.Tensor]] = [None] * num_layers

    def __len__(self) -> int:
        k = self.keys[0]
        return 0 if k is None else int(k.shape[1])

    def update(self, layer: int, k: paddle.Tensor, v: paddle.Tensor) -> Tuple[paddle.Tensor, paddle.Tensor]:
        prev_k, prev_v = self.keys[layer], self.values[layer]
        if prev_k is not None and prev_v is not None:  # set together
            k = paddle.concat([prev_k, k], axis=1)
            v = paddle.concat([prev_v, v], axis=1)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def select(self, index: paddle.Tensor) -> None:
        """Keep only the batch rows in ``index`` (e.g. after sequences finish)."""
        self.keys = [None if k is None else paddle.gather(k, index) for k in self.keys]
        self.values = [None if v is None else paddle.gather(v, index) for v in self.values]


def _local_heads(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise UserError(f"{what} ({total}) must be divisible by tensor_parallel ({tp})")
    return total // tp


class Attention(nn.Layer):
    def __init__(self, arch: ModelArch, factory: Any, ops: OpSet, layer_idx: int, implementation: str):
        super().__init__()
        tp = factory.tp_degree
        self.layer_idx = layer_idx
        self.head_dim = arch.head_dim
        self.num_heads = _local_heads(arch.num_attention_heads, tp, "num_attention_heads")
        self.num_kv_heads = _local_heads(arch.num_key_value_heads, tp, "num_key_value_heads")
        self.implementation = implementation
        self.ops = ops
        self.use_rope = arch.position_embedding == "rope"
        self.recompute_core = False
        h, hd = arch.hidden_size, arch.head_dim
        q_out, kv_out = arch.num_attention_heads * hd, arch.num_key_value_heads * hd
        self.fused = arch.fused_qkv and tp == 1  # under TP the fused matrix is split into q/k/v on load
        if self.fused:
            self.W_pack = factory.linear(h, q_out + 2 * kv_out, arch.attention_bias, tp="column")
        else:
            self.q_proj = factory.linear(h, q_out, arch.attention_bias, tp="column")
            self.k_proj = factory.linear(h, kv_out, arch.attention_bias, tp="column")
            self.v_proj = factory.linear(h, kv_out, arch.attention_bias, tp="column")
        self.o_proj = factory.linear(q_out, h, arch.o_proj_bias, tp="row")
        if arch.qk_norm:
            # one weight for all heads: under tensor parallel its gradient sums every rank's heads
            grad_sum = factory.sum_grad_over_group if tp > 1 else None
            self.q_norm = RMSNorm(hd, arch.rms_norm_eps, ops, grad_sum)
            self.k_norm = RMSNorm(hd, arch.rms_norm_eps, ops, grad_sum)
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
            qkv = self.W_pack(x)
            nq, nkv = self.num_heads * hd, self.num_kv_heads * hd
            q, k, v = paddle.split(qkv, [nq, nkv, nkv], axis=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape([b, s, self.num_heads, hd])
        k = k.reshape([b, s, self.num_kv_heads, hd])
        v = v.reshape([b, s, self.num_kv_heads, hd])
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            assert cos is not None and sin is not None  # the model passes its rotary tables
            q, k = self.ops.rotary(q, k, cos.astype(q.dtype), sin.astype(q.dtype))
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        if self.recompute_core and self.training:
            from paddle.distributed.fleet.utils import recompute

            out = recompute(self._core, q, k, v, bias)
        else:
            out = self._core(q, k, v, bias)
        return self.o_proj(out.reshape([b, s, self.num_heads * hd]))

    def _core(
        self, q: paddle.Tensor, k: paddle.Tensor, v: paddle.Tensor, bias: Optional[paddle.Tensor]
    ) -> paddle.Tensor:
        return attend(q, k, v, bias, self.implementation, self.training, self.ops.attention)


class MLP(nn.Layer):
    def __init__(self, arch: ModelArch, factory: Any, ops: OpSet):
        super().__init__()
        h, f = arch.hidden_size, arch.intermediate_size
        self.gate_proj = factory.linear(h, f, False, tp="column")
        self.up_proj = factory.linear(h, f, False, tp="column")
        self.down_proj = factory.linear(f, h, False, tp="row")
        self.ops = ops
        self.act = arch.hidden_act

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.act == "silu":  # SwiGLU, through the fused kernels
            return self.down_proj(self.ops.swiglu(gate, up))
        # GeGLU: gelu (erf) or gelu_pytorch_tanh (the tanh approximation)
        return self.down_proj(F.gelu(gate, approximate=self.act == "gelu_pytorch_tanh") * up)


class DecoderLayer(nn.Layer):
    def __init__(self, arch: ModelArch, factory: Any, ops: OpSet, layer_idx: int, implementation: str):
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.self_attn = Attention(arch, factory, ops, layer_idx, implementation)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)
        self.mlp = MLP(arch, factory, ops)

    def forward(
        self,
        x: paddle.Tensor,
        cos: Optional[paddle.Tensor] = None,
        sin: Optional[paddle.Tensor] = None,
        bias: Optional[paddle.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> paddle.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, bias, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Layer):
    """The transformer body (Hugging Face's ``model.`` prefix): embeddings, layers, final norm."""

    def __init__(self, arch: ModelArch, factory: Any, ops: OpSet, implementation: str):
        super().__init__()
        self.embed_tokens = factory.embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.LayerList(
            [DecoderLayer(arch, factory, ops, i, implementation) for i in range(arch.num_hidden_layers)]
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops)


def head_weight(
    arch: ModelArch, lm_head: Optional[nn.Layer], embed_weight: Any
) -> Tuple[paddle.Tensor, bool]:
    """(LM head weight, whether it is [vocab, hidden] and needs a transpose): the head's own weight, or
    the tied embedding's; normalised per vocabulary row for Baichuan2's ``norm_head``."""
    weight, transposed = (embed_weight, True) if lm_head is None else (lm_head.weight, False)
    if arch.norm_head:
        weight = F.normalize(weight, axis=1 if transposed else 0)
    return weight, transposed


def project_to_vocab(
    hidden: paddle.Tensor, arch: ModelArch, factory: Any, lm_head: Optional[nn.Layer], embed_weight: Any
) -> paddle.Tensor:
    """Logits from the final (normed) hidden state; the local vocabulary shard under tensor parallel.
    ``embed_weight`` is read only for tied embeddings (``lm_head`` None)."""
    if lm_head is not None and not arch.norm_head:
        return lm_head(hidden)
    weight, transposed = head_weight(arch, lm_head, embed_weight)
    return factory.head_matmul(hidden, weight, transposed)


class LayerInputs:
    """What every decoder layer takes besides the hidden states, from the attention mask and positions:
    the rotary tables (None without rope) and the attention bias. CausalLM computes them once per forward;
    the pipeline stages (parallel/pipeline.py) call the same object, so a family's inputs are the same
    under every layout. It holds no layer, so a pipeline stage keeping it keeps no other stage's weights."""

    def __init__(self, arch: ModelArch, rotary: Optional[RotaryTables], alibi: Optional[Any]) -> None:
        self.arch = arch
        self.rotary = rotary
        self.alibi = alibi

    def __call__(
        self,
        attention_mask: Optional[paddle.Tensor],
        position_ids: paddle.Tensor,
        s: int,
        past: int,
        dtype: Any,
    ) -> Tuple[Optional[paddle.Tensor], Optional[paddle.Tensor], Optional[paddle.Tensor]]:
        """(cos, sin, bias) for ``s`` new positions after ``past`` cached ones."""
        cos = sin = None
        if self.rotary is not None:
            cos, sin = self.rotary(position_ids)
        return cos, sin, self.attention_bias(attention_mask, s, past, dtype)

    def attention_bias(
        self, attention_mask: Optional[paddle.Tensor], s: int, past: int, dtype: Any
    ) -> Optional[paddle.Tensor]:
        """What the attention core gets as its mask (models/attention.py): None for plain causal rows,
        the segment ids [b, s] for padded or packed rows without a cache, else an additive bias."""
        window = self.arch.sliding_window
        if window is not None and past + s <= window:
            window = None  # the window cannot bite: keep the plain causal fast path
        if past == 0 and window is None and self.alibi is None:
            # segment ids, with their cu_seqlens computed once per batch on a GPU (not in every layer)
            return None if attention_mask is None else batch_segments(attention_mask)
        seg_q = seg_k = None
        if attention_mask is not None:
            seg_k = attention_mask.astype("int64")
            seg_q = seg_k[:, past:] if past else seg_k
        alibi = None if self.alibi is None else paddle.to_tensor(self.alibi, dtype="float32")
        return build_bias(seg_q, seg_k, s, past + s, past, dtype, window, alibi)


class CausalLM(nn.Layer):
    """Decoder-only language model. See the module docstring for the family flags."""

    def __init__(
        self,
        arch: ModelArch,
        factory: Any = None,
        kernels: str = "auto",
        attention_implementation: str = "auto",
    ):
        super().__init__()
        if attention_implementation not in IMPLEMENTATIONS:
            raise UserError(
                f"attention_implementation {attention_implementation!r} is not one of {IMPLEMENTATIONS}"
            )
        for key, message in arch_problems(arch):
            raise UserError(f"model_config.{key}: {message}")
        self.arch = arch
        self.factory = factory if factory is not None else PlainFactory()
        self.ops = select(kernels, shapes=OpShapes.of(arch))
        self.model = DecoderModel(arch, self.factory, self.ops, attention_implementation)
        self.lm_head = (
            None if arch.tie_word_embeddings else self.factory.lm_head(arch.hidden_size, arch.vocab_size)
        )
        rotary = None
        if arch.position_embedding == "rope":
            try:
                rotary = RotaryTables(
                    arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings
                )
            except (ValueError, KeyError) as exc:
                raise UserError(f"rope_scaling: {exc}") from None
        alibi = None
        if arch.position_embedding == "alibi":
            tp_rank = int(getattr(self.factory, "tp_rank", 0))
            n_local = arch.num_attention_heads // self.factory.tp_degree
            alibi = alibi_slopes(arch.num_attention_heads)[tp_rank * n_local : (tp_rank + 1) * n_local]
        self.layer_inputs = LayerInputs(arch, rotary, alibi)
        self._recompute_layers: Set[int] = set()

    # Hugging Face-style accessors used by the trainer, LoRA and pipeline code.
    @property
    def layers(self) -> nn.LayerList:
        return self.model.layers

    @property
    def embed_tokens(self) -> nn.Layer:
        return self.model.embed_tokens

    @property
    def norm(self) -> nn.Layer:
        return self.model.norm

    def init_weights(self) -> None:
        """Fresh initialisation: normal(0, initializer_range) matrices, zero biases, unit norms.

        A tensor-parallel shard is drawn as the whole tensor (same random numbers, same order as one
        process) and cut to this rank's slice, so a fresh tp model holds exactly the single-process weights.
        """
        std = self.arch.initializer_range
        normal, zeros = nn.initializer.Normal(0.0, std), nn.initializer.Constant(0.0)
        ones = nn.initializer.Constant(1.0)
        tp = int(getattr(self.factory, "tp_degree", 1))
        tp_rank = int(getattr(self.factory, "tp_rank", 0))
        for name, p in self.named_parameters():
            axis = getattr(p, "split_axis", None) if getattr(p, "is_distributed", False) else None
            if len(p.shape) >= 2 and tp > 1 and axis is not None:
                shape = list(p.shape)
                size = shape[int(axis)]
                shape[int(axis)] = size * tp
                full = paddle.empty(shape, dtype=p.dtype)
                normal(full)
                p.set_value(
                    paddle.slice(full, axes=[int(axis)], starts=[tp_rank * size], ends=[(tp_rank + 1) * size])
                )
            elif len(p.shape) >= 2:
                normal(p)
            elif name.endswith("norm.weight"):
                ones(p)
            else:
                zeros(p)

    def enable_recompute(self, granularity: str = "full", num_layers: Optional[int] = None) -> None:
        """Recompute activations in the backward pass for the first ``num_layers`` decoder layers
        (all when None): ``full`` recomputes whole layers, ``attention`` only the attention core
        (scores and softmax), ``none`` turns it off."""
        if granularity not in ("full", "attention", "none"):
            raise UserError(f"recompute granularity {granularity!r} is not full, attention or none")
        n = len(self.layers) if num_layers is None else min(int(num_layers), len(self.layers))
        chosen = set(range(n)) if granularity != "none" else set()
        self._recompute_layers = chosen if granularity == "full" else set()
        for i, layer in enumerate(self.layers):
            layer.self_attn.recompute_core = granularity == "attention" and i in chosen

    # ---- forward paths ----
    def _position_ids(self, input_ids: paddle.Tensor, past: int) -> paddle.Tensor:
        """[1, s] (broadcast over the batch, so the rotary tables are computed once per step)."""
        s = input_ids.shape[1]
        return paddle.arange(past, past + s, dtype="int64").unsqueeze(0)

    def hidden_states(
        self,
        input_ids: paddle.Tensor,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> paddle.Tensor:
        """Last hidden states [b, s, hidden] after the final norm.

        With a ``cache``, ``input_ids`` are the new tokens and ``attention_mask`` (if given) covers
        the cached plus the new tokens.
        """
        s = input_ids.shape[1]
        past = 0 if cache is None else len(cache)
        if position_ids is None:
            position_ids = self._position_ids(input_ids, past)
        x = self.model.embed_tokens(input_ids)
        cos, sin, bias = self.layer_inputs(attention_mask, position_ids, s, past, x.dtype)
        for i, layer in enumerate(self.model.layers):
            if i in self._recompute_layers and self.training:
                from paddle.distributed.fleet.utils import recompute

                x = recompute(layer, x, cos, sin, bias)
            else:
                x = layer(x, cos, sin, bias, cache)
        return self.model.norm(x)

    def _head(self) -> Tuple[paddle.Tensor, bool]:
        """(LM head weight, whether it is [vocab, hidden] and needs a transpose)."""
        return head_weight(self.arch, self.lm_head, self.model.embed_tokens.weight)

    def logits_from_hidden(self, hidden: paddle.Tensor) -> paddle.Tensor:
        return project_to_vocab(hidden, self.arch, self.factory, self.lm_head, self.model.embed_tokens.weight)

    def forward(
        self,
        input_ids: paddle.Tensor,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
        cache: Optional[KVCache] = None,
    ) -> paddle.Tensor:
        """Logits [b, s, vocab] (the local vocabulary shard under tensor parallelism)."""
        return self.logits_from_hidden(self.hidden_states(input_ids, attention_mask, position_ids, cache))

    def loss_sum(
        self,
        input_ids: paddle.Tensor,
        labels: paddle.Tensor,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(sum of next-token losses fp32, number of predicted tokens fp32).

        ``labels`` are unshifted (same positions as input_ids, -100 = ignore): position t predicts
        labels[t + 1]. Across a segment boundary of a packed row nothing is predicted.
        """
        hidden = self.hidden_states(input_ids, attention_mask, position_ids)[:, :-1]
        target = labels[:, 1:]
        if attention_mask is not None:
            same = attention_mask[:, 1:] == attention_mask[:, :-1]
            target = paddle.where(same, target, paddle.full_like(target, IGNORE_INDEX))
        hidden = hidden.reshape([-1, hidden.shape[-1]])
        target = target.reshape([-1])
        if self.factory.tp_degree > 1:
            return self.factory.vocab_cross_entropy_sum(self.logits_from_hidden(hidden), target)
        weight, transposed = self._head()
        return self.ops.linear_cross_entropy(
            hidden, weight, target, IGNORE_INDEX, transpose_weight=transposed
        )


class LossSum(paddle.nn.Layer):
    """A layer whose forward is ``model.loss_sum``: what paddle.jit.to_static compiles (train/static.py) and
    what the group-sharded wrapper runs (its buffers are prepared in forward())."""

    def __init__(self, model: paddle.nn.Layer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: paddle.Tensor,
        labels: paddle.Tensor,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
    ) -> Any:
        return self.model.loss_sum(
            input_ids, labels, attention_mask=attention_mask, position_ids=position_ids
        )
