"""What the rest of bmtrain-cli may ask of the parallel context, as typed Protocols, one per concern.

``parallel/context.py`` holds the one implementation (:class:`~bmtrain_cli.parallel.context.ParallelContext`):
its own fields and properties are the :class:`Topology` (ranks, degrees, groups), ``ctx.collectives`` the
:class:`Collectives` (parallel/collectives.py) and ``ctx.wrapping`` the :class:`ModelWrapping`
(parallel/wrapping.py). The modules it calls into (full weights, pipeline, sharding, faults) and the
trainer, checkpoints, LoRA and evaluation are typed against these Protocols instead, so none of them
imports the context back (no cycle) and none probes an untyped ``ctx: Any``; a part that needs one concern
only takes that one.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from bmtrain_cli.config.schema import Config
from bmtrain_cli.models.layers import LayerFactory


class Topology(Protocol):
    """This rank's place in the layout (dp x tp x pp x sharding x context) and the groups over it."""

    world_size: int
    rank: int
    data_rank: int  # index among the ranks that see different data (dp x sharding)
    data_world: int
    tp_rank: int
    tp_degree: int
    pp_rank: int
    pp_degree: int
    context_ring: Any  # parallel.ring_attention.Ring when context_parallel > 1, else None
    expert_group: Any  # parallel.expert_parallel.ExpertGroup when expert_parallel > 1, else None
    hcg: Any  # fleet's HybridCommunicateGroup when distributed, else None (untyped: Paddle's object)
    on_cpu: bool
    pipeline_info: Dict[str, Any]  # the pipeline cut the wrapping chose (pp > 1)

    @property
    def is_distributed(self) -> bool: ...

    @property
    def is_main(self) -> bool: ...

    @property
    def is_last_stage(self) -> bool: ...

    @property
    def sharding_degree(self) -> int: ...

    @property
    def context_degree(self) -> int: ...

    @property
    def loader_rank(self) -> int: ...

    @property
    def loader_world(self) -> int: ...

    @property
    def uses_fleet_model(self) -> bool: ...

    @property
    def holds_whole_weights(self) -> bool: ...

    @property
    def optimizer_state_portable(self) -> bool: ...

    def data_groups(self) -> List[Any]: ...


class Collectives(Protocol):
    """Sums, barriers and broadcasts over the layout (each the identity in one process)."""

    def all_reduce_sum(self, value: Any) -> Any: ...

    def barrier(self) -> None: ...

    def broadcast_object(self, obj: Any, src: int = 0) -> Any: ...

    def mark_progress(self) -> None: ...

    def context_share(self, batch: Dict[str, Any]) -> Dict[str, Any]: ...


class ModelWrapping(Protocol):
    """The layer factory, the model / optimizer / scaler wrapped for the layout, the pipeline step and the
    whole weights gathered from or split into this rank's pieces."""

    @property
    def factory(self) -> LayerFactory: ...

    @property
    def compression_stats(self) -> Dict[str, Any]: ...

    def wrap_model(
        self,
        model: Any,
        pipeline_costs: Optional[List[float]] = None,
        pipeline_bounds: Optional[List[int]] = None,
    ) -> Any: ...

    def shard_experts(self, model: Any) -> str: ...

    def attach_context(self, model: Any) -> Any: ...

    def wrap_optimizer(self, optimizer: Any) -> Any: ...

    def wrap_model_and_optimizer(self, model: Any, optimizer: Any, scaler: Any = None) -> Any: ...

    def wrap_scaler(self, scaler: Any) -> Any: ...

    def pipeline_step(
        self, model: Any, micro_batches: List[Dict[str, Any]], optimizer: Any, **kw: Any
    ) -> Any: ...

    def pipeline_aux_losses(self, model: Any) -> Optional[Tuple[float, float]]: ...

    def full_state_dict(self, model: Any, dequantize: bool = True) -> Dict[str, Any]: ...

    def load_full_state_dict(self, model: Any, state: Dict[str, Any]) -> None: ...

    def checkpoint_weights_writer(self, model: Any) -> Optional[Callable[[Any, str], None]]: ...

    def gather_full_model(self, model: Any, kernels: str = "auto") -> Any: ...


class ParallelCtx(Topology, Protocol):
    """The whole context: the topology, the run's config, and the other two concerns as members."""

    config: Optional[Config]

    @property
    def collectives(self) -> Collectives: ...

    @property
    def wrapping(self) -> ModelWrapping: ...
