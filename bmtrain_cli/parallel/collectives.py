"""The collectives over this rank's layout (``ctx.collectives``): sums over the data ranks, barriers,
object broadcasts, the fault watchdog's progress mark, and this rank's share of a context-parallel batch.
Each is the identity in one process and touches no distributed state there."""

from __future__ import annotations

from typing import Any, Dict

from bmtrain_cli.parallel.protocol import Topology


class CollectiveOps:
    """The collectives of one rank, over the groups its topology names."""

    def __init__(self, topology: Topology) -> None:
        self._topology = topology

    def all_reduce_sum(self, value: Any) -> Any:
        """Sum a tensor (in place, also returned) over the data-parallel ranks (identity in one process).

        Accepts a paddle Tensor, or a python/numpy number (returned as float)."""
        if self._topology.data_world == 1:
            return value
        import paddle
        import paddle.distributed as dist

        self.mark_progress()
        groups = self._topology.data_groups()
        if isinstance(value, paddle.Tensor):
            for g in groups:
                dist.all_reduce(value, group=g)
            return value
        t = paddle.to_tensor([float(value)], dtype="float64")
        for g in groups:
            dist.all_reduce(t, group=g)
        return float(t.numpy()[0])

    def barrier(self) -> None:
        if self._topology.world_size > 1:
            import paddle.distributed as dist

            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from global rank ``src`` to every rank."""
        if self._topology.world_size == 1:
            return obj
        import paddle.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def mark_progress(self) -> None:
        """Tell the fault watchdog that training advanced (called by the collectives here)."""
        from bmtrain_cli.parallel.faults import mark_progress

        mark_progress()

    def context_share(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's share of a batch its context group holds whole (the batch itself without context
        parallel): parallel/ring_attention.split_batch."""
        ring = self._topology.context_ring
        if ring is None:
            return batch
        from bmtrain_cli.parallel.ring_attention import split_batch

        return split_batch(batch, ring.degree, ring.rank)
