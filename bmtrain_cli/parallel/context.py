"""The parallel context: this rank's place in the layout (ranks, degrees, groups) and, by concern, the
collectives over it (``ctx.collectives``, parallel/collectives.py) and the model wrapping for it
(``ctx.wrapping``, parallel/wrapping.py).

``parallel.topology.init_parallel(config)`` builds it once per process before the model is built. With
world size 1 it touches no distributed state at all. Other modules type against its Protocols
(``parallel.protocol``: ``Topology``, ``Collectives``, ``ModelWrapping`` and ``ParallelCtx``, the three
together).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from bmtrain_cli.config.schema import Config
from bmtrain_cli.parallel.collectives import CollectiveOps
from bmtrain_cli.parallel.wrapping import ModelWrapper


@dataclass
class ParallelContext:
    world_size: int = 1
    rank: int = 0
    data_rank: int = 0  # index among ranks that see different data (dp x sharding)
    data_world: int = 1
    tp_rank: int = 0
    tp_degree: int = 1
    pp_rank: int = 0
    pp_degree: int = 1
    context_ring: Any = (
        None  # parallel.ring_attention.Ring of this rank's context group (context_parallel > 1)
    )
    expert_group: Any = None  # parallel.expert_parallel.ExpertGroup of this rank (expert_parallel > 1)
    hcg: Any = None  # fleet's HybridCommunicateGroup when distributed, else None (untyped: Paddle's object)
    config: Optional[Config] = None
    strategy: Optional[Any] = None
    on_cpu: bool = False
    watchdog: Optional[Any] = None
    pipeline_info: Dict[str, Any] = field(default_factory=dict)  # partition and imbalance when pp > 1
    collectives: CollectiveOps = field(init=False, repr=False, compare=False)
    wrapping: ModelWrapper = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.collectives = CollectiveOps(self)
        self.wrapping = ModelWrapper(self)

    # ------------------------------------------------------------------ facts
    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_degree - 1

    @property
    def sharding_degree(self) -> int:
        return self.config.parallel.sharding_parallel if self.config is not None else 1

    @property
    def context_degree(self) -> int:
        """Ranks that split each sequence between them (1 without context parallel)."""
        return 1 if self.context_ring is None else int(self.context_ring.degree)

    @property
    def loader_rank(self) -> int:
        """The data shard this rank reads: the ranks of one context group read the same batches. The
        context rank is the innermost part of fleet's data rank, which lies outside the sharding rank
        (data_rank = dp_rank x sharding + sharding_rank)."""
        sh = self.sharding_degree
        return (self.data_rank // sh) // self.context_degree * sh + self.data_rank % sh

    @property
    def loader_world(self) -> int:
        return self.data_world // self.context_degree

    @property
    def uses_fleet_model(self) -> bool:
        """True when the model is wrapped by fleet (tensor/pipeline parallel or sharding)."""
        return self.tp_degree > 1 or self.pp_degree > 1 or self.sharding_degree > 1

    def data_groups(self) -> List[Any]:
        """Groups whose product spans the data ranks (dp group, then the sharding group)."""
        groups: List[Any] = []
        if self.hcg is None:
            return groups
        if self.hcg.get_data_parallel_world_size() > 1:
            groups.append(self.hcg.get_data_parallel_group())
        if self.hcg.get_sharding_parallel_world_size() > 1:
            groups.append(self.hcg.get_sharding_parallel_group())
        return groups

    @property
    def holds_whole_weights(self) -> bool:
        """Whether this rank holds every weight whole (no tensor, pipeline or expert split)."""
        return self.tp_degree == 1 and self.pp_degree == 1 and self.expert_group is None

    @property
    def optimizer_state_portable(self) -> bool:
        """Whether rank 0's optimizer state is the whole state (not split by tensor/pipeline parallel or
        sharding, or expert parallel). When False, checkpoints carry weights only and a resume restarts the
        moments."""
        return self.holds_whole_weights and self.sharding_degree == 1


def launched_world_size() -> int:
    """Processes started by the launcher (1 when not launched)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", os.environ.get("WORLD_SIZE", "1")))
