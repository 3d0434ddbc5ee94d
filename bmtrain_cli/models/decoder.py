"""One decoder-only transformer for every supported family.

Family differences are flags on :class:`~bmtrain_cli.models.arch.ModelArch`:

- grouped-query attention: ``num_key_value_heads < num_attention_heads`` (LLaMA 2 70B / 3, Qwen, Mistral)
- ``attention_bias``: q/k/v biases (Qwen2/2.5); LLaMA and Qwen3 checkpoints that set it also bias o_proj
- ``qk_norm``: per-head RMSNorm of q and k before the rotary embedding, explicit ``head_dim`` (Qwen3)
- ``fused_qkv``: one ``W_pack`` projection holding [q; k; v] (Baichuan)
- ``position_embedding``: ``rope`` (with ``rope_scaling``) or ``alibi`` (Baichuan 13B)
- ``sliding_window``: local attention window (Mistral); with ``layer_types``, only on the sliding layers,
  which take their own rope base ``rope_local_theta`` (Gemma 3)
- ``norm_head``: LM head rows L2-normalised (Baichuan 2)
- ``tie_word_embeddings``: the LM head reuses the embedding matrix
- ``mlp_bias`` (ERNIE 4.5), ``fused_gate_up``: one gate_up_proj (Phi-3, GLM-4), and the family's
  ``qkv_name`` for ``fused_qkv`` (W_pack, qkv_proj)
- ``partial_rotary_factor`` and ``rope_interleaved``: rope on the leading dimensions only, on
  interleaved pairs (GLM-4, ERNIE 4.5, Phi-4-mini)
- ``norm_offset`` ((1 + w) RMSNorm), ``scale_embeddings`` (times sqrt(hidden)), ``query_pre_attn_scalar``
  (Gemma); the family's ``norm_names`` add norms on the attention and MLP outputs (Gemma 3, GLM-4)
- ``linear_attention`` with ``layer_types``: Gated DeltaNet on the ``linear_attention`` layers
  (models/linear_attention.py) and ``attn_output_gate``: a sigmoid gate on the attention output (Qwen3.5)
- ``num_experts`` > 0: the sparse layers' MLP is a mixture of experts (models/moe.py; Qwen3-MoE, Mixtral),
  with transformers' load-balancing loss added in ``loss_sum`` when ``output_router_logits`` is set

The blocks (RMSNorm, attention, MLP, the decoder layer, the KV cache) are ``models/blocks.py``; this file
holds the model around them: embeddings, the per-layer inputs, the head and the loss.

Parameter names follow Hugging Face (``model.layers.0.self_attn.q_proj.weight`` ...). Linear and
embedding layers come from a factory (``models/layers.py``), so tensor parallelism swaps them without
touching this file; head counts are divided by ``factory.tp_degree``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple

import paddle
import paddle.nn.functional as F
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.labels import IGNORE_INDEX
from bmtrain_cli.models.arch import ModelArch, arch_problems
from bmtrain_cli.models.attention import IMPLEMENTATIONS, ContextShard, batch_segments, build_bias, soft_cap
from bmtrain_cli.models.blocks import DecoderLayer, KVCache, RMSNorm
from bmtrain_cli.models.layers import LayerFactory, PlainFactory
from bmtrain_cli.models.moe import adds_aux_loss, load_balancing_loss
from bmtrain_cli.models.rope import RotaryTables, alibi_slopes
from bmtrain_cli.ops import OpSet, OpShapes, select


class DecoderModel(nn.Layer):
    """The transformer body (Hugging Face's ``model.`` prefix): embeddings, layers, final norm."""

    def __init__(self, arch: ModelArch, factory: LayerFactory, ops: OpSet, implementation: str):
        super().__init__()
        self.embed_tokens = factory.embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.LayerList(
            [DecoderLayer(arch, factory, ops, i, implementation) for i in range(arch.num_hidden_layers)]
        )
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, ops, offset=arch.norm_offset)


def embed(arch: ModelArch, embed_tokens: nn.Layer, input_ids: paddle.Tensor) -> paddle.Tensor:
    """Token embeddings, times sqrt(hidden_size) in their own dtype where the family scales them (Gemma)."""
    x = embed_tokens(input_ids)
    if arch.scale_embeddings:
        x = x * paddle.to_tensor(math.sqrt(arch.hidden_size), dtype=x.dtype)
    return x


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
    hidden: paddle.Tensor,
    arch: ModelArch,
    factory: LayerFactory,
    lm_head: Optional[nn.Layer],
    embed_weight: Any,
) -> paddle.Tensor:
    """Logits from the final (normed) hidden state; the local vocabulary shard under tensor parallel.
    ``embed_weight`` is read only for tied embeddings (``lm_head`` None). Soft-capped where the family caps
    its logits (Gemma 2's final_logit_softcapping)."""
    if lm_head is not None and not arch.norm_head:
        return soft_cap(lm_head(hidden), arch.final_logit_softcapping)
    weight, transposed = head_weight(arch, lm_head, embed_weight)
    return soft_cap(factory.head_matmul(hidden, weight, transposed), arch.final_logit_softcapping)


Inputs = Tuple[Optional[paddle.Tensor], Optional[paddle.Tensor], Optional[paddle.Tensor]]  # cos, sin, bias


class LayerInputs:
    """What every decoder layer takes besides the hidden states, from the attention mask and positions:
    the rotary tables (None without rope) and the attention bias, per layer type (``full_attention``,
    ``sliding_attention``: Gemma 3's sliding layers have their own window and rope base). CausalLM
    computes them once per forward; the pipeline stages (parallel/pipeline.py) call the same object, so a
    family's inputs are the same under every layout. It holds no layer, so a pipeline stage keeping it
    keeps no other stage's weights."""

    def __init__(
        self, arch: ModelArch, rotary: Dict[str, Optional[RotaryTables]], alibi: Optional[Any]
    ) -> None:
        self.arch = arch
        self.rotary = rotary
        self.alibi = alibi
        self.types = tuple(sorted({arch.layer_type(i) for i in range(arch.num_hidden_layers)}))
        # looked up here, not in forward: paddle.jit's SOT cannot call a dataclass's methods
        self.windows = {kind: arch.window_of(kind) for kind in self.types}
        # soft-capped attention (Gemma 2) runs the blocked kernel, which applies the window itself
        self.kernel_windows = arch.attn_logit_softcapping is not None
        # dynamic NTK / LongRoPE tables read the batch's largest position (a context share's comes from its group)
        self.reads_longest = any(r is not None and r.reads_longest for r in rotary.values())

    def __call__(
        self,
        attention_mask: Optional[paddle.Tensor],
        position_ids: paddle.Tensor,
        s: int,
        past: int,
        dtype: Any,
        types: Optional[Iterable[str]] = None,
    ) -> Dict[str, Inputs]:
        """{layer type: (cos, sin, bias)} for ``s`` new positions after ``past`` cached ones, for ``types``
        (default: every type the model's layers have)."""
        out: Dict[str, Inputs] = {}
        longest = None
        if self.reads_longest and isinstance(attention_mask, ContextShard):
            longest = attention_mask.core.ring.max(position_ids.max())  # the whole rows' largest position
        for kind in self.types if types is None else types:
            if kind == "linear_attention":  # its padding mask over the new positions (no rope, no bias)
                out[kind] = (None, None, None if attention_mask is None else attention_mask[:, past:])
                continue
            cos = sin = None
            rotary = self.rotary.get(kind)
            if rotary is not None:
                cos, sin = rotary(position_ids, longest)
            out[kind] = (
                cos,
                sin,
                self.attention_bias(attention_mask, s, past, dtype, self.windows.get(kind)),
            )
        return out

    def attention_bias(
        self,
        attention_mask: Optional[paddle.Tensor],
        s: int,
        past: int,
        dtype: Any,
        window: Optional[int] = None,
    ) -> Optional[paddle.Tensor]:
        """What the attention core gets as its mask (models/attention.py): None for plain causal rows,
        the segment ids [b, s] for padded or packed rows without a cache, a ContextShard with the layer's
        window (the context group's core applies it), else an additive bias."""
        if isinstance(attention_mask, ContextShard):
            return attention_mask.windowed(window)
        if window is not None and isinstance(s, int) and past + s <= window:
            # the window cannot bite: keep the plain causal fast path (a static graph's length is unknown)
            window = None
        if self.kernel_windows and past == 0 and paddle.in_dynamic_mode():
            window = None  # the attention core applies it (models/blocks.py Attention.window)
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
        factory: Optional[LayerFactory] = None,
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
        rotary: Dict[str, Optional[RotaryTables]] = {}
        if arch.position_embedding == "rope":
            try:
                full = RotaryTables(
                    arch.rotary_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings
                )
            except (ValueError, KeyError) as exc:
                raise UserError(f"rope_scaling: {exc}") from None
            local = full
            if arch.rope_local_theta is not None:  # Gemma 3's sliding layers: their own base, no scaling
                local = RotaryTables(
                    arch.rotary_dim, arch.rope_local_theta, None, arch.max_position_embeddings
                )
            rotary = {"full_attention": full, "sliding_attention": local}
        alibi = None
        if arch.position_embedding == "alibi":
            tp_rank = self.factory.tp_rank
            n_local = arch.num_attention_heads // self.factory.tp_degree
            alibi = alibi_slopes(arch.num_attention_heads)[tp_rank * n_local : (tp_rank + 1) * n_local]
        self.layer_inputs = LayerInputs(arch, rotary, alibi)
        self._recompute_layers: Set[int] = set()
        self.last_aux_loss: Optional[paddle.Tensor] = None  # the load-balancing loss of the last loss_sum
        self.context_attention: Optional[Any] = None  # the ring attention core under context parallel
        # expert parallel: (this rank done decoding) -> every rank of its expert group done; a decoding
        # loop runs each step on every rank of the group while this says not (models/generate.py)
        self.decode_in_step: Optional[Callable[[bool], bool]] = None

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
        tp = self.factory.tp_degree
        tp_rank = self.factory.tp_rank
        params = dict(self.named_parameters())
        drawn: Set[str] = set()  # the later parts of a fused projection, drawn with the first
        for name, p in params.items():
            axis = getattr(p, "split_axis", None) if getattr(p, "is_distributed", False) else None
            if ".linear_attn." in name or name in drawn:  # linear attention: drawn by the layer below
                continue
            parts = self._fused_parts(name) if tp > 1 else []
            if parts:  # one device draws the fused [h, parts] here: draw it whole, cut it into the parts
                whole = [int(params[n].shape[1]) * tp for n in parts]
                full = paddle.empty([int(p.shape[0]), sum(whole)], dtype=p.dtype)
                normal(full)
                for n, piece in zip(parts, paddle.split(full, whole, axis=1)):
                    size = int(params[n].shape[1])
                    params[n].set_value(piece[:, tp_rank * size : (tp_rank + 1) * size])
                drawn.update(parts)
            elif len(p.shape) >= 2 and tp > 1 and axis is not None:
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
                (zeros if self.arch.norm_offset else ones)(p)  # the scale starts at 1 either way
            else:
                zeros(p)
        for layer in self.layers:
            if layer.layer_type == "linear_attention":
                layer.linear_attn.init_weights(normal)

    def _fused_parts(self, name: str) -> List[str]:
        """Under tensor parallel, for the first part of a fused projection (q_proj of Phi-3's qkv_proj or
        Baichuan's W_pack, gate_proj of gate_up_proj, held as their parts): every part's weight name."""
        groups: List[Tuple[str, Tuple[str, ...]]] = []
        groups += [("self_attn.", ("q_proj", "k_proj", "v_proj"))] if self.arch.fused_qkv else []
        groups += [("mlp.", ("gate_proj", "up_proj"))] if self.arch.fused_gate_up else []
        for module, parts in groups:
            first = f".{module}{parts[0]}.weight"
            if name.endswith(first):
                prefix = name[: -len(first)]
                return [f"{prefix}.{module}{q}.weight" for q in parts]
        return []

    def enable_recompute(self, granularity: str = "full", num_layers: Optional[int] = None) -> None:
        """Recompute activations in the backward pass for the first ``num_layers`` decoder layers
        (all when None): ``full`` recomputes whole layers, ``attention`` only the attention core
        (scores and softmax), ``none`` turns it off."""
        if granularity not in ("full", "attention", "none"):
            raise UserError(f"recompute granularity {granularity!r} is not full, attention or none")
        if granularity == "full" and self.arch.output_router_logits and self.arch.num_experts:
            # a recomputed layer's first forward runs without gradients: its router logits would give
            # the load-balancing loss no gradient
            raise UserError(
                "recompute granularity 'full' cannot be combined with the MoE load-balancing loss "
                "(output_router_logits); use granularity 'attention' or turn the auxiliary loss off"
            )
        n = len(self.layers) if num_layers is None else min(int(num_layers), len(self.layers))
        chosen = set(range(n)) if granularity != "none" else set()
        self._recompute_layers = chosen if granularity == "full" else set()
        for i, layer in enumerate(self.layers):
            if layer.layer_type != "linear_attention":
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
        x = embed(self.arch, self.model.embed_tokens, input_ids)
        inputs = self.layer_inputs(attention_mask, position_ids, s, past, x.dtype)
        for i, layer in enumerate(self.model.layers):
            cos, sin, bias = inputs[layer.layer_type]
            if i in self._recompute_layers and self.training:
                from paddle.distributed.fleet.utils import recompute

                x = recompute(layer, x, cos, sin, bias)
            else:
                x = layer(x, cos, sin, bias, cache)
        return self.model.norm(x)

    def _head(self) -> Tuple[paddle.Tensor, bool]:
        """(LM head weight, whether it is [vocab, hidden] and needs a transpose)."""
        return head_weight(self.arch, self.lm_head, self.model.embed_tokens.weight)

    def _quantized_head(self) -> Any:
        """The int8 LM head (quant/vocab.py's VocabCodes; a tied model's embedding codes), or None."""
        from bmtrain_cli.quant.layer import quantized_head

        return quantized_head(self.lm_head, self.model.embed_tokens)

    def logits_from_hidden(self, hidden: paddle.Tensor) -> paddle.Tensor:
        head = self._quantized_head()
        if head is not None:
            return soft_cap(head.logits(hidden), self.arch.final_logit_softcapping)
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
        labels: Optional[paddle.Tensor] = None,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
        targets: Optional[paddle.Tensor] = None,
        segment_ids: Optional[paddle.Tensor] = None,
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(sum of next-token losses fp32, number of predicted tokens fp32).

        ``labels`` are unshifted (same positions as input_ids, -100 = ignore): position t predicts
        labels[t + 1]. Across a segment boundary of a packed row nothing is predicted.

        Context parallel (parallel/ring_attention.py) passes this rank's share of each row instead:
        ``targets`` (already shifted over the whole row), the tokens' ``position_ids`` in the row, and the
        whole rows' ``segment_ids`` (None for plain causal rows); attention then runs the ring.

        With ``output_router_logits`` (MoE), ``router_aux_loss_coef * aux * count`` is added to the sum,
        where aux is transformers' load-balancing loss over the unpadded tokens: the per-token mean
        sum / count is then transformers' loss (mean cross-entropy + coef * aux). Over several
        micro-batches the aux term is weighted by each one's token count. ``last_aux_loss`` keeps aux.
        """
        if targets is not None:
            if self.context_attention is None:
                raise UserError("loss_sum got context-parallel targets but the model has no context group")
            shard = ContextShard(self.context_attention, segment_ids)
            hidden = self.hidden_states(input_ids, shard, position_ids)  # type: ignore[arg-type]
            total, count = self._token_loss(hidden, targets)
            aux = self.aux_loss(attention_mask, over_context=True)  # the whole micro-batch's on every rank
            if aux is not None:  # the group's counts add up to the whole: the ranks' terms to one process's
                total = total + self.arch.router_aux_loss_coef * aux * count
            return total, count
        assert labels is not None  # one of labels and targets
        hidden = self.hidden_states(input_ids, attention_mask, position_ids)
        aux = self.aux_loss(attention_mask)
        hidden = hidden[:, :-1]
        target = labels[:, 1:]
        if attention_mask is not None:
            same = attention_mask[:, 1:] == attention_mask[:, :-1]
            target = paddle.where(same, target, paddle.full_like(target, IGNORE_INDEX))
        total, count = self._token_loss(hidden, target)
        if aux is not None:
            total = total + self.arch.router_aux_loss_coef * aux * count
        return total, count

    def _token_loss(
        self, hidden: paddle.Tensor, target: paddle.Tensor
    ) -> Tuple[paddle.Tensor, paddle.Tensor]:
        """(summed cross entropy, counted targets) of hidden states [b, s, hidden] against targets [b, s]."""
        hidden = hidden.reshape([-1, hidden.shape[-1]])
        target = target.reshape([-1])
        if self.factory.tp_degree > 1:
            return self.factory.vocab_cross_entropy_sum(self.logits_from_hidden(hidden), target)
        if self.arch.final_logit_softcapping is not None:  # the fused head + loss does not cap logits
            return self.ops.cross_entropy_sum(self.logits_from_hidden(hidden), target, IGNORE_INDEX)
        head = self._quantized_head()
        if head is not None:  # an int8 head: dequantised one vocabulary chunk at a time
            from bmtrain_cli.quant.vocab import head_cross_entropy

            return head_cross_entropy(head, hidden, target, IGNORE_INDEX)
        weight, transposed = self._head()
        return self.ops.linear_cross_entropy(
            hidden, weight, target, IGNORE_INDEX, transpose_weight=transposed
        )

    def aux_loss(
        self, attention_mask: Optional[paddle.Tensor], over_context: bool = False
    ) -> Optional[paddle.Tensor]:
        """The load-balancing loss of the forward just run over the tokens where ``attention_mask`` is not 0
        (all: None), when the architecture adds it to the loss (else None); kept in ``last_aux_loss``.
        ``over_context``: the forward ran a context-parallel share (``attention_mask``: the share's), and
        the routers' sums are summed over the context group first: the whole micro-batch's loss, whose
        gradient reaches every rank's routers (models/moe.py load_balancing_loss)."""
        self.last_aux_loss = None
        if not adds_aux_loss(self.arch):
            return None
        logits = [layer.mlp.router_logits for layer in self.layers if layer.sparse]
        core = self.context_attention if over_context else None  # None: the model has no context group
        group_sum = None if core is None else core.ring.sum
        aux = load_balancing_loss(
            logits, self.arch.num_experts, self.arch.num_experts_per_tok, attention_mask, group_sum
        )
        self.last_aux_loss = aux.detach()
        return aux


class LossSum(paddle.nn.Layer):
    """A layer whose forward is ``model.loss_sum``: what paddle.jit.to_static compiles (train/loop/to_static.py) and
    what the group-sharded wrapper runs (its buffers are prepared in forward()), whole rows or a
    context-parallel share (``targets``, ``segment_ids``)."""

    def __init__(self, model: paddle.nn.Layer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: paddle.Tensor,
        labels: Optional[paddle.Tensor] = None,
        attention_mask: Optional[paddle.Tensor] = None,
        position_ids: Optional[paddle.Tensor] = None,
        targets: Optional[paddle.Tensor] = None,
        segment_ids: Optional[paddle.Tensor] = None,
    ) -> Any:
        return self.model.loss_sum(
            input_ids,
            labels,
            attention_mask=attention_mask,
            position_ids=position_ids,
            targets=targets,
            segment_ids=segment_ids,
        )
