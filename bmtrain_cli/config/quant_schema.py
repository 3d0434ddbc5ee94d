"""model_config.quantization: the frozen low-bit base of QLoRA (bmtrain_cli/quant/, docs/qlora.md)."""

from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import Field

from bmtrain_cli.config.section import Dtype, _Section

QUANT_METHODS = ("nf4", "int8", "int4")
# layers left in full precision unless skip_modules says otherwise (module-name components)
DEFAULT_SKIP_MODULES = ("embed_tokens", "lm_head", "norm", "gate")


class QuantizationConfig(_Section):
    """A frozen low-bit base (QLoRA): the linear layers' weights stored as 4- or 8-bit codes plus scales
    (bmtrain_cli/quant/). Only with finetuning: lora; see docs/qlora.md."""

    method: Literal[QUANT_METHODS] = Field(  # type: ignore[valid-type]
        "nf4",
        description="nf4 (4-bit NormalFloat, blockwise absmax; QLoRA's codebook and bitsandbytes' layout), "
        "int8 (per output channel) or int4 (per group of block_size inputs), symmetric, weight-only.",
    )
    block_size: Optional[int] = Field(
        None,
        gt=0,
        description="Elements per absmax block (nf4, default 64) or inputs per scale group (int4, default 64); "
        "not used by int8 (one scale per output channel).",
    )
    double_quant: bool = Field(
        False,
        description="nf4 only: quantise the absmax scales too (8-bit blockwise, blocks of 256, around their "
        "mean), saving about 0.37 bits per weight.",
    )
    compute_dtype: Optional[Dtype] = Field(
        None,
        description="dtype the dequantised weight is multiplied in; default and only choice in this slice: "
        "model_config.dtype.",
    )
    skip_modules: List[str] = Field(
        default_factory=lambda: list(DEFAULT_SKIP_MODULES),
        description="Linear layers kept unquantised: a layer is skipped when one of these equals a dotted "
        "component of its name (down_proj, layers.0 ...). Default: the embeddings, the LM head, norms and "
        "MoE routers.",
    )

    @property
    def resolved_block_size(self) -> int:
        """The block (nf4) or group (int4) size in use; 0 for int8 (per channel)."""
        if self.method == "int8":
            return 0
        return int(self.block_size or 64)
