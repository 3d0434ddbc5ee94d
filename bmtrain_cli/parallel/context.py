"""The parallel context every part of training asks about ranks, groups and collectives.

``init_parallel(config)`` is called once per process before the model is built. With world size 1 it
touches no distributed state at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from bmtrain_cli.config.schema import Config


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
    hcg: Optional[Any] = None  # fleet's HybridCommunicateGroup when distributed

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, value: Any) -> Any:
        """Sum a tensor over the data-parallel ranks (identity in one process)."""
        return value


def launched_world_size() -> int:
    """Processes started by the launcher (1 when not launched)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", os.environ.get("WORLD_SIZE", "1")))


def init_parallel(config: Config) -> ParallelContext:
    """Single-process context; the distributed path lives in parallel/topology.py."""
    if config.parallel.world_size == 1 and launched_world_size() == 1:
        return ParallelContext()
    from bmtrain_cli.parallel.topology import init_distributed  # noqa: PLC0415

    return init_distributed(config)
