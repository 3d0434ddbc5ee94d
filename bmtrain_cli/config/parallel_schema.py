"""parallel_config: the hybrid-parallel layout (docs/parallel.md)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field

from bmtrain_cli.config.section import _Section


class PipelineRebalanceConfig(_Section):
    """Dynamic pipeline load balancing (train/loop/pipeline_rebalance.py, docs/parallel.md)."""

    enabled: bool = Field(
        False, description="Move the pipeline stage boundaries at a checkpoint when the stages are unequal."
    )
    threshold: float = Field(
        1.2,
        gt=1.0,
        description="Rebalance when the slowest stage's forward time exceeds the fastest's x this.",
    )
    check_every: int = Field(
        10, gt=0, description="Steps over which the per-layer times are averaged before each comparison."
    )


class ParallelConfig(_Section):
    """Hybrid-parallel layout: world size = data x tensor x pipeline x sharding x context x expert."""

    data_parallel: int = Field(1, gt=0)
    tensor_parallel: int = Field(1, gt=0)
    pipeline_parallel: int = Field(1, gt=0)
    sharding_parallel: int = Field(1, gt=0, description="ZeRO sharding degree (a data-parallel axis).")
    sharding_stage: Literal[1, 2, 3] = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    pipeline_micro_batches: Optional[int] = Field(
        None, gt=0, description="Micro-batches per pipeline step (default: gradient accumulation steps)."
    )
    pipeline_partition: Literal["uniform", "parameters", "measured"] = "uniform"
    pipeline_rebalance: PipelineRebalanceConfig = Field(default_factory=PipelineRebalanceConfig)
    gradient_compression: Literal["none", "int8", "topk", "threshold"] = "none"
    topk_ratio: float = Field(0.01, gt=0, le=1)
    compression_threshold: float = Field(
        1e-3,
        gt=0,
        description="threshold compression: gradient entries below this magnitude wait in the residual",
    )
    fault_timeout_s: float = Field(60.0, gt=0, description="Seconds before a stuck collective aborts.")
    context_parallel: int = Field(
        1, gt=0, description="Ranks that split every sequence (context_parallel_mode)."
    )
    context_parallel_mode: Literal["ring", "ulysses"] = Field(
        "ring",
        description="ring: K/V travel round the group; ulysses: an all-to-all of heads and sequence "
        "(KV heads per tensor rank divisible by context_parallel).",
    )
    expert_parallel: int = Field(
        1,
        gt=0,
        description="Ranks that split the experts of every MoE layer (a data-parallel axis: each sees its own data).",
    )

    @property
    def world_size(self) -> int:
        return self.data_ranks * self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def data_ranks(self) -> int:
        """Ranks that see different data (data parallel x sharding x expert parallel)."""
        return self.data_parallel * self.sharding_parallel * self.expert_parallel
