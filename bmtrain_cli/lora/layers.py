"""The LoRA wrapper around one linear layer made by the layer factory.

``y = base(x) + scaling * B(A(dropout(x)))`` with ``scaling = alpha / r``. A is [in, r] and B is [r, out]
(Paddle's [in, out] layout); B starts at zero, so the wrapped model's output at step 0 is the base model's.

The base may be a quantised layer (bmtrain_cli/quant/layer.py, QLoRA): it has no weight parameter, only
its codes, and cannot be merged into; the adapters are the same.

The base layer's parameters are registered on the wrapper under their own names (``weight``, ``bias``),
so the wrapped model keeps the Hugging Face parameter names (``...q_proj.weight``) and the adapters add
``...q_proj.lora_A.weight`` / ``...q_proj.lora_B.weight`` (PEFT's names). The base layer itself is kept
outside the sublayer tree and its own ``forward`` runs unchanged, tensor-parallel collectives included.

Tensor parallel (fleet's mp layers from ``parallel/layers.py``):

* column-parallel base (weight split along out, input replicated): A is replicated and B is split along
  out like the base. ``A(x)`` goes through ``c_identity`` so that the backward all-reduces the partial
  gradient coming from each rank's slice of B; A's gradient is then whole and equal on every rank.
* row-parallel base (weight split along in, input already split): A is split along in, ``A(x_local)`` is
  all-reduced over the model-parallel group (a sum of the partial products) and B is replicated.

Split adapter weights carry fleet's ``is_distributed`` / ``split_axis`` attributes, so the parallel
context's ``full_state_dict`` / ``load_full_state_dict`` gather and slice them like any split weight.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import numpy as np
import paddle
from paddle import nn

from bmtrain_cli.errors import UserError
from bmtrain_cli.quant.layer import WEIGHTLESS, QuantLinear

LORA_ATTR = "is_lora"  # set on every adapter parameter


def tensor_parallel_kind(layer: nn.Layer) -> Tuple[Optional[str], int, int, Any]:
    """("column" | "row" | None, tp world, tp rank, model-parallel group) of a factory-made linear."""
    world = int(getattr(layer, "world_size", 1) or 1)
    if world <= 1 or not getattr(layer, "is_mp", world > 1):
        return None, 1, 0, None
    # a quantised shard (parallel/layers.ShardedQuantLinear) has no weight parameter: the layer says
    split_axis: Any = getattr(
        getattr(layer, "weight", None), "split_axis", getattr(layer, "split_axis", None)
    )
    kind = {1: "column", 0: "row"}.get(split_axis)
    if kind is None:
        return None, 1, 0, None
    group = getattr(layer, "model_parallel_group", None)
    rank = getattr(layer, "rank", None)  # RowParallelLinear has it, ColumnParallelLinear does not
    if rank is None and group is not None:
        rank = group.rank
    if rank is None:
        from paddle.distributed import fleet

        rank = fleet.get_hybrid_communicate_group().get_model_parallel_rank()
    return kind, world, int(rank), group


class LoRALinear(nn.Layer):
    """A frozen linear layer plus a trainable low-rank update (see the module docstring)."""

    def __init__(self, base: nn.Layer, rank: int, alpha: float, dropout: float = 0.0) -> None:
        super().__init__()
        if rank <= 0:
            raise ValueError(f"LoRA rank must be > 0, got {rank}")
        # a quantised base (bmtrain_cli/quant/layer.py) holds codes, not a weight parameter (an expert
        # another expert-parallel rank holds: nothing)
        weight = None if isinstance(base, WEIGHTLESS) else base.weight
        if weight is not None and len(weight.shape) != 2:
            raise ValueError("LoRA wraps linear layers with a 2-D weight")
        kind, world, tp_rank, group = tensor_parallel_kind(base)
        if weight is None:
            in_local, out_local, dtype = base.in_features, base.out_features, base.compute_dtype
        else:
            in_local, out_local = int(weight.shape[0]), int(weight.shape[1])
            dtype = str(weight.dtype).replace("paddle.", "")
        self.tp_kind, self.tp_world, self.tp_rank = kind, world, tp_rank
        object.__setattr__(self, "_group", group)
        # Not a sublayer: its parameters are registered below under the wrapper's own names.
        object.__setattr__(self, "base_layer", base)
        if weight is not None:
            self.weight = weight
        bias = getattr(base, "bias", None)
        if bias is not None:
            self.bias = bias
        self.in_features = in_local * world if kind == "row" else in_local
        self.out_features = out_local * world if kind == "column" else out_local
        self.r = int(rank)
        self.lora_alpha = float(alpha)
        self.scaling = float(alpha) / float(rank)
        self.merged = False
        self.adapter_enabled = (
            True  # False: the base layer alone (the DPO reference, preference/reference.py)
        )
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else None
        a_in = in_local if kind == "row" else self.in_features
        b_out = out_local if kind == "column" else self.out_features
        self.lora_A = nn.Linear(a_in, self.r, bias_attr=False)
        self.lora_B = nn.Linear(self.r, b_out, bias_attr=False)
        if str(self.lora_A.weight.dtype).replace("paddle.", "") != dtype:
            self.lora_A.to(dtype=dtype)
            self.lora_B.to(dtype=dtype)
        self.reset_lora_parameters()
        if kind == "row":
            self.lora_A.weight.is_distributed = True
            self.lora_A.weight.split_axis = 0
        elif kind == "column":
            self.lora_B.weight.is_distributed = True
            self.lora_B.weight.split_axis = 1
        for p in (self.lora_A.weight, self.lora_B.weight):
            setattr(p, LORA_ATTR, True)

    def reset_lora_parameters(self, rng: Optional[np.random.Generator] = None) -> None:
        """A ~ U(-1/sqrt(in), 1/sqrt(in)) (PEFT's kaiming-uniform with a=sqrt(5)), B = 0.

        A is drawn whole and sliced under tensor parallelism, so every rank's shard is a distinct piece of
        the same matrix (the ranks draw the same numbers). With ``rng`` the numbers come from it (so they
        do not depend on how much of Paddle's random stream the model's construction used)."""
        bound = 1.0 / math.sqrt(self.in_features)
        with paddle.no_grad():
            if rng is not None:
                drawn = rng.uniform(-bound, bound, (self.in_features, self.r)).astype(np.float32)
                full = paddle.to_tensor(drawn)
            else:
                full = paddle.uniform([self.in_features, self.r], dtype="float32", min=-bound, max=bound)
            if self.tp_kind == "row":
                n = self.in_features // self.tp_world
                full = full[self.tp_rank * n : (self.tp_rank + 1) * n]
            self.lora_A.weight.set_value(full.astype(self.lora_A.weight.dtype))
            self.lora_B.weight.set_value(paddle.zeros(self.lora_B.weight.shape, self.lora_B.weight.dtype))

    # ------------------------------------------------------------------ forward
    def lora_delta(self, x: paddle.Tensor) -> paddle.Tensor:
        """scaling * B(A(dropout(x))) in this rank's output layout."""
        h = x if self.lora_dropout is None else self.lora_dropout(x)
        h = self.lora_A(h)
        if self.tp_kind is not None:
            from paddle.distributed.fleet.layers.mpu import mp_ops

            if self.tp_kind == "row":
                h = mp_ops._mp_allreduce(h, group=self._group, use_calc_stream=True, use_model_parallel=True)
            else:
                h = mp_ops._c_identity(h, group=self._group)
        return self.lora_B(h) * self.scaling

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        out = self.base_layer(x)
        if self.merged or not self.adapter_enabled:
            return out
        return out + self.lora_delta(x)

    # ------------------------------------------------------------------ merge
    def delta_weight(self) -> paddle.Tensor:
        """scaling * A @ B: this rank's piece of the update of the base weight ([in, out] layout)."""
        a = self.lora_A.weight.astype("float32")
        b = self.lora_B.weight.astype("float32")
        return paddle.matmul(a, b) * self.scaling

    def grouped_weight(self) -> Optional[paddle.Tensor]:
        """The weight this layer's function is, for the experts' grouped GEMM (models/moe.py): the base
        weight plus ``scaling * A @ B`` (differentiable in A and B), the base weight alone with the adapter
        off or merged; None where no single weight is the function (dropout while training, a quantised
        base, a bias, tensor parallel)."""
        if isinstance(self.base_layer, WEIGHTLESS) or self.tp_kind is not None or "bias" in self._parameters:
            return None
        if self.merged or not self.adapter_enabled:
            return self.weight
        if self.lora_dropout is not None and self.training:
            return None
        return self.weight + self.delta_weight().astype(self.weight.dtype)

    def merge(self) -> None:
        """Fold the adapter into the base weight (idempotent); forward then skips the adapter."""
        if self.merged:
            return
        self._refuse_quantised("merge")
        with paddle.no_grad():
            w = self.weight
            w.set_value((w.astype("float32") + self.delta_weight()).astype(w.dtype))
        self.merged = True

    def _refuse_quantised(self, what: str) -> None:
        if isinstance(self.base_layer, QuantLinear):
            raise UserError(
                f"LoRA: cannot {what} adapters into a quantised ({self.base_layer.method}) base layer; the "
                "adapters are saved alone (PEFT layout) for the original base"
            )

    def unmerge(self) -> None:
        """Undo :meth:`merge` (up to rounding in the weight's dtype)."""
        if not self.merged:
            return
        with paddle.no_grad():
            w = self.weight
            w.set_value((w.astype("float32") - self.delta_weight()).astype(w.dtype))
        self.merged = False

    def extra_repr(self) -> str:
        tp = f", tp={self.tp_kind}x{self.tp_world}" if self.tp_kind else ""
        return f"in={self.in_features}, out={self.out_features}, r={self.r}, alpha={self.lora_alpha}{tp}"
