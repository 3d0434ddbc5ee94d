"""The parallel context every part of training asks about ranks, groups and collectives.

``parallel.topology.init_parallel(config)`` builds it once per process before the model is built. With
world size 1 it touches no distributed state at all. Other modules type against its Protocol,
``parallel.protocol.ParallelCtx``.

Gradient convention (all layouts): after ``wrap_optimizer(opt).step()`` has reduced them, gradients are
the SUM over data ranks of each rank's gradient. The trainer's token-weighted loss (local loss sum divided
by the token count summed over micro-batches and data ranks) therefore gives exactly the single-process
gradient, whatever the layout. Fleet's own reductions average; the context rescales them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from bmtrain_cli.config.schema import Config
from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.parallel.sharding import uses_group_sharded


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
    hcg: Any = None  # fleet's HybridCommunicateGroup when distributed, else None (untyped: Paddle's object)
    config: Optional[Config] = None
    strategy: Optional[Any] = None
    on_cpu: bool = False
    watchdog: Optional[Any] = None
    _factory: Optional[Any] = field(default=None, repr=False)
    _compressor: Optional[Any] = field(default=None, repr=False)
    _fleet_model: Optional[Any] = field(default=None, repr=False)
    pipeline_info: Dict[str, Any] = field(default_factory=dict)  # partition and imbalance when pp > 1

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

    @property
    def factory(self) -> LayerFactory:
        """Layer factory for the model builder: plain layers, or fleet's mp layers when tp > 1."""
        if self._factory is None:
            if self.tp_degree > 1:
                from bmtrain_cli.parallel.layers import TensorParallelFactory

                group = self.hcg.get_model_parallel_group() if self.hcg is not None else None
                self._factory = TensorParallelFactory(self.tp_degree, self.tp_rank, group)
            else:
                from bmtrain_cli.models.layers import PlainFactory

                self._factory = PlainFactory()
        return self._factory

    def context_share(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        """This rank's share of a batch its context group holds whole (the batch itself without context
        parallel): parallel/ring_attention.split_batch."""
        if self.context_ring is None:
            return batch
        from bmtrain_cli.parallel.ring_attention import split_batch

        return split_batch(batch, self.context_ring.degree, self.context_ring.rank)

    # ------------------------------------------------------------------ collectives
    def all_reduce_sum(self, value: Any) -> Any:
        """Sum a tensor (in place, also returned) over the data-parallel ranks (identity in one process).

        Accepts a paddle Tensor, or a python/numpy number (returned as float)."""
        if self.data_world == 1:
            return value
        import paddle
        import paddle.distributed as dist

        self.mark_progress()
        groups = self.data_groups()
        if isinstance(value, paddle.Tensor):
            for g in groups:
                dist.all_reduce(value, group=g)
            return value
        t = paddle.to_tensor([float(value)], dtype="float64")
        for g in groups:
            dist.all_reduce(t, group=g)
        return float(t.numpy()[0])

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

    def barrier(self) -> None:
        if self.world_size > 1:
            import paddle.distributed as dist

            dist.barrier()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from global rank ``src`` to every rank."""
        if self.world_size == 1:
            return obj
        import paddle.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    # ------------------------------------------------------------------ model and optimizer
    def wrap_model(
        self,
        model: Any,
        pipeline_costs: Optional[List[float]] = None,
        pipeline_bounds: Optional[List[int]] = None,
    ) -> Any:
        """Prepare a built model for this layout (identity in one process).

        pipeline parallel: the decoder is cut into a fleet PipelineLayer (only this stage's layers kept),
        by pipeline_partition, by ``pipeline_costs`` (one per item) or at ``pipeline_bounds``
        (parallel/rebalance.py);
        tensor parallel / sharding: fleet.distributed_model; plain data parallel: parameters broadcast from
        rank 0 and gradients summed by the optimizer wrapper (optionally compressed)."""
        if self.world_size == 1:
            return model
        import paddle.distributed as dist
        from paddle.distributed import fleet

        self.attach_context(model)
        if self.pp_degree > 1:
            from bmtrain_cli.parallel.pipeline import to_pipeline_layer

            if self.tp_degree > 1:
                self._reinit_duplicated_shards(model)
            from bmtrain_cli.lora.inject import SETTINGS_ATTR, lora_settings

            pipe = to_pipeline_layer(model, self, pipeline_costs, pipeline_bounds)
            if lora_settings(model) is not None:  # gathered whole copies (eval, demo) fold the adapters in
                object.__setattr__(pipe, SETTINGS_ATTR, lora_settings(model))
            return fleet.distributed_model(pipe)
        if self.config is not None and uses_group_sharded(self.config):
            return model  # wrapped together with the optimizer in wrap_model_and_optimizer
        if self.uses_fleet_model:
            if self.tp_degree > 1:
                self._reinit_duplicated_shards(model)
            self._fleet_model = fleet.distributed_model(model)
            # fleet's TensorParallel/sharding wrappers only broadcast parameters at construction and inputs
            # in forward (switched off: the ranks of a tensor-parallel group load the same batches); return
            # the model itself so that its methods (loss_sum, hidden_states) stay callable.
            return model
        for p in model.parameters():
            dist.broadcast(p, src=0)
        return model

    def attach_context(self, model: Any) -> Any:
        """Give a model this rank's context group as its attention core on context-parallel shares (the
        training model in wrap_model; a frozen reference copy); the model itself."""
        if self.context_ring is not None:
            from bmtrain_cli.parallel.ring_attention import RingCore

            model.context_attention = RingCore(self.context_ring)
        return model

    def _reinit_duplicated_shards(self, model: Any) -> None:
        """A fresh model's init draws the same numbers on every tensor-parallel rank, so each rank's
        shard would be a copy of the others' (heads that never diverge). When all split parameters are
        identical across the group, redraw them as slices of full-size tensors (same draws on all ranks).
        Loaded checkpoints have distinct shards and are left alone."""
        import numpy as np
        import paddle
        import paddle.distributed as dist

        split = [
            (n, p)
            for n, p in model.named_parameters()
            if getattr(p, "is_distributed", False) and not getattr(p, "is_lora", False)  # LoRA: own init
        ]
        if not split:
            return
        digest = float(
            sum(float(p.astype("float64").abs().sum()) * (i + 1) for i, (_, p) in enumerate(split))
        )
        digests: List[Any] = []
        dist.all_gather_object(digests, digest, group=self.hcg.get_model_parallel_group())
        if len(set(digests)) > 1:
            return
        std = float(getattr(getattr(model, "arch", None), "initializer_range", 0.02))
        for _, p in split:
            axis = int(p.split_axis)
            shape = list(p.shape)
            shape[axis] *= self.tp_degree
            if len(shape) >= 2:
                full = paddle.normal(0.0, std, shape).astype(p.dtype)
            else:
                full = paddle.zeros(shape, dtype=p.dtype)
            size = p.shape[axis]
            idx = paddle.to_tensor(np.arange(self.tp_rank * size, (self.tp_rank + 1) * size))
            p.set_value(paddle.index_select(full, idx, axis=axis))

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Wrap an optimizer so that step() reduces gradients over data ranks first (see module doc)."""
        if self.world_size == 1:
            return optimizer
        from bmtrain_cli.parallel.sharding import wrap_sharded_optimizer

        if self.uses_fleet_model:
            return wrap_sharded_optimizer(optimizer, self)
        from bmtrain_cli.parallel.compression import make_compressor

        self._compressor = make_compressor(self.config.parallel if self.config else None)
        return DataParallelOptimizer(optimizer, self)

    def wrap_model_and_optimizer(self, model: Any, optimizer: Any, scaler: Any = None) -> Any:
        """(model, optimizer, scaler) for this layout; needed for sharding stage 2/3, which wraps all three
        together (the fp16 scaler becomes Paddle's GroupShardedScaler).

        Call after wrap_model with the optimizer built over the wrapped model's parameters."""
        if self.world_size > 1 and self.config is not None and uses_group_sharded(self.config):
            from bmtrain_cli.parallel.sharding import group_sharded

            return group_sharded(model, optimizer, self, scaler)
        return model, self.wrap_optimizer(optimizer), self.wrap_scaler(scaler)

    def wrap_scaler(self, scaler: Any) -> Any:
        """The fp16 loss scaler for this layout: fleet.distributed_scaler under tensor/pipeline parallel
        and sharding stage 1, unchanged otherwise (parallel/sharding.scaler_kind)."""
        from bmtrain_cli.parallel.sharding import wrap_scaler

        return wrap_scaler(scaler, self)

    def mark_progress(self) -> None:
        """Tell the fault watchdog that training advanced (called by the collectives here)."""
        from bmtrain_cli.parallel.faults import mark_progress

        mark_progress()

    def pipeline_step(
        self, model: Any, micro_batches: List[Dict[str, Any]], optimizer: Any, **kw: Any
    ) -> Any:
        """One optimizer step of 1F1B pipeline training; returns (loss_sum, token_count) over data ranks."""
        from bmtrain_cli.parallel.pipeline import pipeline_train_step

        return pipeline_train_step(self, model, micro_batches, optimizer, **kw)

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, model: Any) -> Dict[str, Any]:
        """Whole (unsplit) weights under the single-process names, as numpy arrays, on every rank."""
        from bmtrain_cli.parallel.full_weights import full_state_dict

        return full_state_dict(self, model)

    def load_full_state_dict(self, model: Any, state: Dict[str, Any]) -> None:
        """Load whole weights (single-process names) into this rank's shards/stage."""
        from bmtrain_cli.parallel.full_weights import load_full_state_dict

        load_full_state_dict(self, model, state)

    def checkpoint_weights_writer(self, model: Any) -> Optional[Any]:
        """Collective (call on every rank before saving): gathers the whole weights under tensor/pipeline
        parallel and returns a ``writer(model, dir)`` for train.training_state.save_checkpoint that writes them
        in Hugging Face layout. None when this rank already holds whole weights (use the default writer)."""
        if self.tp_degree == 1 and self.pp_degree == 1:
            return None
        from bmtrain_cli.parallel.full_weights import full_weights_writer

        return full_weights_writer(self, model)

    def gather_full_model(self, model: Any, kernels: str = "auto") -> Any:
        """Collective (call on every rank): a plain single-process CausalLM holding the whole weights, for
        work that runs on one rank only (demo accuracy, generation, export) under tensor/pipeline parallel.
        Returns the model itself when this rank already holds whole weights."""
        if self.tp_degree == 1 and self.pp_degree == 1:
            from bmtrain_cli.parallel.full_weights import unwrap

            return unwrap(model)
        from bmtrain_cli.parallel.full_weights import full_model

        return full_model(self, model, kernels)

    @property
    def optimizer_state_portable(self) -> bool:
        """Whether rank 0's optimizer state is the whole state (not split by tensor/pipeline parallel or
        sharding). When False, checkpoints carry weights only and a resume restarts the moments."""
        return self.tp_degree == 1 and self.pp_degree == 1 and self.sharding_degree == 1

    @property
    def compression_stats(self) -> Dict[str, Any]:
        return self._compressor.stats() if self._compressor is not None else {}


class DataParallelOptimizer:
    """Plain data parallel: sum gradients over the data ranks (compressed when configured), then step."""

    def __init__(self, inner: Any, ctx: ParallelContext) -> None:
        self._inner = inner
        self._ctx = ctx
        self._reduced = False

    def reduce_gradients(self) -> None:
        """Sum gradients over the data ranks now (call before clipping or measuring the gradient norm;
        step() does it itself when it was not called)."""
        import paddle.distributed as dist

        if self._reduced:
            return
        self._reduced = True
        self._ctx.mark_progress()
        params = [p for p in self._inner._parameter_list if not p.stop_gradient and p.grad is not None]
        comp = self._ctx._compressor
        if comp is not None:
            comp.all_reduce_sum(params, self._ctx.data_groups()[0])
            return
        for p in params:
            for g in self._ctx.data_groups():
                dist.all_reduce(p.grad, group=g)

    def step(self) -> None:
        self.reduce_gradients()
        self._inner.step()
        self._reduced = False

    def clear_grad(self, *args: Any, **kwargs: Any) -> None:
        """Start the next step: its gradients have not been reduced yet."""
        self._reduced = False
        self._inner.clear_grad(*args, **kwargs)

    def minimize(self, loss: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("call loss.backward() then step()")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def launched_world_size() -> int:
    """Processes started by the launcher (1 when not launched)."""
    return int(os.environ.get("PADDLE_TRAINERS_NUM", os.environ.get("WORLD_SIZE", "1")))
