"""The shape of a Gated DeltaNet linear-attention layer (Qwen3.5's ``linear_attention`` layers) as plain
data: its projections, parameters and per-sequence state. Used by ModelArch (models/arch.py), the layer
(models/linear_attention.py) and the planner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Tuple

FULL_ATTENTION_INTERVAL = 4  # without layer_types, every fourth layer is full attention (transformers)
DELTA_CHUNK = 64  # tokens per chunk of the chunked delta rule (ops/reference.gated_delta_rule)


@dataclass(frozen=True)
class LinearAttention:
    """Heads and widths of the linear-attention layers: q/k heads of ``key_head_dim``, value heads of
    ``value_head_dim`` (a multiple of the key heads, each q/k head serving a group), and the kernel width
    of the causal depthwise convolution over [q; k; v]."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    # its linear projections, named as transformers names them (LoRA targets)
    PROJECTIONS: ClassVar[Tuple[str, ...]] = (
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
    )

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def projection_shapes(self, hidden: int) -> Dict[str, Tuple[int, int]]:
        """(in, out) of each linear projection."""
        return {
            "in_proj_qkv": (hidden, self.conv_dim),
            "in_proj_z": (hidden, self.value_dim),
            "in_proj_b": (hidden, self.num_value_heads),
            "in_proj_a": (hidden, self.num_value_heads),
            "out_proj": (self.value_dim, hidden),
        }

    def parameters(self, hidden: int) -> int:
        """The projections, the convolution, dt_bias and A_log per value head, the gated norm."""
        linear = sum(i * o for i, o in self.projection_shapes(hidden).values())
        return linear + self.conv_dim * self.conv_kernel + 2 * self.num_value_heads + self.value_head_dim

    def state_numbers(self) -> int:
        """Numbers one sequence carries between steps: the recurrent state of every value head and the
        convolution's last conv_kernel - 1 inputs."""
        recurrent = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return recurrent + (self.conv_kernel - 1) * self.conv_dim

    def activation_elements(self, kernel: bool = False) -> float:
        """Elements per token a linear-attention layer keeps for its backward (beside the layer input and
        the MLP's): the projections' outputs, the convolution's padded input, output and SiLU, q/k before
        and after the l2 norm (repeated per value head), the state before each chunk of ``DELTA_CHUNK``
        tokens and the rule's output, the gated norm's input and output; on the Paddle-op path
        (``kernel`` False) also each chunk's decay, system and attention matrices, the solved right-hand
        sides and the decayed q/k, which our CPU kernel (ops/delta_rule.py) recomputes in its backward."""
        nv, dk, dv = self.num_value_heads, self.key_head_dim, self.value_head_dim
        projections = self.conv_dim + self.value_dim + 2 * nv
        conv = 3 * self.conv_dim
        qk = 2 * self.key_dim + 2 * nv * dk
        chunk = 0 if kernel else 3 * nv * DELTA_CHUNK + 2 * nv * (dk + dv) + 3 * nv * dk
        state = nv * dk * dv / DELTA_CHUNK + nv * dv
        return projections + conv + qk + chunk + state + 3 * self.value_dim

    @staticmethod
    def layer_type(layer: int) -> str:
        """The layer type of a hybrid model without layer_types: every fourth layer is full attention."""
        return "full_attention" if (layer + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"

    @staticmethod
    def mixer_parameters(arch: Any, attention: int, tp: int = 1) -> int:
        """Parameters of every layer's token mixer on one of ``tp`` tensor-parallel ranks: ``attention``
        for each attention layer, the Gated DeltaNet's (split over the ranks) for each linear-attention
        layer (``arch``: a ModelArch)."""
        shape = arch.linear_attention
        return sum(
            shape.parameters(arch.hidden_size) // tp
            if arch.layer_type(i) == "linear_attention"
            else attention
            for i in range(arch.num_hidden_layers)
        )
