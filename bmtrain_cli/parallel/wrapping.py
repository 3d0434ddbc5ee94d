"""Model wrapping for this rank's layout (``ctx.wrapping``): the layer factory the model is built with,
the model, optimizer and fp16 scaler wrapped for the layout, the pipeline-parallel step, and the whole
weights gathered from (or split into) this rank's shards and stages for checkpoints and one-rank work.

Gradient convention (all layouts): after ``wrap_optimizer(opt).step()`` has reduced them, gradients are
the SUM over data ranks of each rank's gradient. The trainer's token-weighted loss (local loss sum divided
by the token count summed over micro-batches and data ranks) therefore gives exactly the single-process
gradient, whatever the layout. Fleet's own reductions average; the context rescales them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from bmtrain_cli.models.layers import LayerFactory
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.parallel.sharding import uses_group_sharded

if TYPE_CHECKING:
    from bmtrain_cli.parallel.compression import Compressor


class ModelWrapper:
    """Builds and wraps the model and optimizer of one rank; keeps what the wrapping made (the layer
    factory, the gradient compressor)."""

    def __init__(self, ctx: ParallelCtx) -> None:
        self._ctx = ctx
        self._factory: Optional[LayerFactory] = None
        self._compressor: Optional[Compressor] = None
        self._fleet_model: Any = None  # fleet's wrapper under tensor parallel / sharding stage 1

    @property
    def factory(self) -> LayerFactory:
        """Layer factory for the model builder: plain layers, or fleet's mp layers when tp > 1."""
        if self._factory is None:
            if self._ctx.tp_degree > 1:
                from bmtrain_cli.parallel.layers import TensorParallelFactory

                group = self._ctx.hcg.get_model_parallel_group() if self._ctx.hcg is not None else None
                self._factory = TensorParallelFactory(self._ctx.tp_degree, self._ctx.tp_rank, group)
            else:
                from bmtrain_cli.models.layers import PlainFactory

                self._factory = PlainFactory()
        return self._factory

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
        (train/loop/pipeline_rebalance.py);
        tensor parallel / sharding: fleet.distributed_model; plain data parallel: parameters broadcast from
        rank 0 and gradients summed by the optimizer wrapper (optionally compressed)."""
        if self._ctx.world_size == 1:
            return model
        import paddle.distributed as dist
        from paddle.distributed import fleet

        self.attach_context(model)
        if self._ctx.pp_degree > 1:
            from bmtrain_cli.parallel.pipeline import to_pipeline_layer

            if self._ctx.tp_degree > 1:
                self._reinit_duplicated_shards(model)
            from bmtrain_cli.lora.inject import SETTINGS_ATTR, lora_settings

            pipe = to_pipeline_layer(model, self._ctx, pipeline_costs, pipeline_bounds)
            if lora_settings(model) is not None:  # gathered whole copies (eval, demo) fold the adapters in
                object.__setattr__(pipe, SETTINGS_ATTR, lora_settings(model))
            return fleet.distributed_model(pipe)
        if self._ctx.config is not None and uses_group_sharded(self._ctx.config):
            return model  # wrapped together with the optimizer in wrap_model_and_optimizer
        if self._ctx.uses_fleet_model:
            if self._ctx.tp_degree > 1:
                self._reinit_duplicated_shards(model)
            self._fleet_model = fleet.distributed_model(model)
            # fleet's TensorParallel/sharding wrappers only broadcast parameters at construction and inputs
            # in forward (switched off: the ranks of a tensor-parallel group load the same batches); return
            # the model itself so that its methods (loss_sum, hidden_states) stay callable.
            return model
        from bmtrain_cli.parallel.expert_parallel import is_expert

        for p in model.parameters():
            if not is_expert(p):  # held experts: broadcast by shard_experts, before the split
                dist.broadcast(p, src=0)
        return model

    def attach_context(self, model: Any) -> Any:
        """Give a model this rank's context group as its attention core on context-parallel shares (the
        training model in wrap_model; a frozen reference copy); the model itself."""
        ring = self._ctx.context_ring
        if ring is None:
            return model
        config = self._ctx.config
        if config is not None and config.parallel.context_parallel_mode == "ulysses":
            from bmtrain_cli.parallel.ulysses import UlyssesCore

            model.context_attention = UlyssesCore(ring)
        else:
            from bmtrain_cli.parallel.ring_attention import RingCore

            ops = getattr(model, "ops", None)  # the fused CPU attention where the model's op set carries it
            model.context_attention = RingCore(ring, fused=getattr(ops, "attention", None) is not None)
        return model

    def shard_experts(self, model: Any) -> str:
        """Expert parallel (collective; call before the optimizer is built over ``model``'s parameters):
        rank 0's whole weights to every rank, then only this rank's experts kept in each MoE layer (see
        parallel/expert_parallel.py). Returns what this rank holds, for the log ("" without expert
        parallel)."""
        if self._ctx.expert_group is None:
            return ""
        import paddle.distributed as dist

        from bmtrain_cli.parallel.expert_parallel import shard_experts

        group, src = None, 0  # under tensor parallel each rank's shards: over its data ranks
        if self._ctx.tp_degree > 1:
            group, src = (
                self._ctx.hcg.get_data_parallel_group(),
                self._ctx.hcg.get_data_parallel_group_src_rank(),
            )
        for p in model.parameters():
            dist.broadcast(p, src=src, group=group)
        return shard_experts(model, self._ctx.expert_group)

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
        dist.all_gather_object(digests, digest, group=self._ctx.hcg.get_model_parallel_group())
        if len(set(digests)) > 1:
            return
        std = float(getattr(getattr(model, "arch", None), "initializer_range", 0.02))
        for _, p in split:
            axis = int(p.split_axis)
            shape = list(p.shape)
            shape[axis] *= self._ctx.tp_degree
            if len(shape) >= 2:
                full = paddle.normal(0.0, std, shape).astype(p.dtype)
            else:
                full = paddle.zeros(shape, dtype=p.dtype)
            size = p.shape[axis]
            idx = paddle.to_tensor(np.arange(self._ctx.tp_rank * size, (self._ctx.tp_rank + 1) * size))
            p.set_value(paddle.index_select(full, idx, axis=axis))

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Wrap an optimizer so that step() reduces gradients over data ranks first (see module doc)."""
        if self._ctx.world_size == 1:
            return optimizer
        from bmtrain_cli.parallel.sharding import wrap_sharded_optimizer

        if self._ctx.uses_fleet_model:
            return wrap_sharded_optimizer(optimizer, self._ctx)
        from bmtrain_cli.parallel.compression import make_compressor

        self._compressor = make_compressor(self._ctx.config.parallel if self._ctx.config else None)
        return DataParallelOptimizer(optimizer, self._ctx, self._compressor)

    def wrap_model_and_optimizer(self, model: Any, optimizer: Any, scaler: Any = None) -> Any:
        """(model, optimizer, scaler) for this layout; needed for sharding stage 2/3, which wraps all three
        together (the fp16 scaler becomes Paddle's GroupShardedScaler).

        Call after wrap_model with the optimizer built over the wrapped model's parameters."""
        if self._ctx.world_size > 1 and self._ctx.config is not None and uses_group_sharded(self._ctx.config):
            from bmtrain_cli.parallel.sharding import group_sharded

            return group_sharded(model, optimizer, self._ctx, scaler)
        return model, self.wrap_optimizer(optimizer), self.wrap_scaler(scaler)

    def wrap_scaler(self, scaler: Any) -> Any:
        """The fp16 loss scaler for this layout: fleet.distributed_scaler under tensor/pipeline parallel
        and sharding stage 1, unchanged otherwise (parallel/sharding.scaler_kind)."""
        from bmtrain_cli.parallel.sharding import wrap_scaler

        return wrap_scaler(scaler, self._ctx)

    def pipeline_step(
        self, model: Any, micro_batches: List[Dict[str, Any]], optimizer: Any, **kw: Any
    ) -> Any:
        """One optimizer step of 1F1B pipeline training; returns (loss_sum, token_count) over data ranks."""
        from bmtrain_cli.parallel.pipeline import pipeline_train_step

        return pipeline_train_step(self._ctx, model, micro_batches, optimizer, **kw)

    def pipeline_aux_losses(self, model: Any) -> Optional[Tuple[float, float]]:
        """Under pipeline parallel (collective): (sum, count) of the last step's load-balancing losses over
        this data rank's micro-batches, from the last stage; None without pipeline parallel or aux loss."""
        if self._ctx.pp_degree == 1:
            return None
        import numpy as np
        import paddle

        from bmtrain_cli.models.moe import adds_aux_loss
        from bmtrain_cli.parallel.pipeline import last_stage_values

        loss_fn = (model._layers if hasattr(model, "_layers") else model)._bmtrain_loss
        arch = loss_fn.arch  # a custom model's may be no ModelArch: no experts then
        if not adds_aux_loss(arch):
            return None
        auxes = loss_fn.auxes
        local = [float(paddle.add_n(auxes)), float(len(auxes))] if auxes else [0.0, 0.0]
        total, count = last_stage_values(self._ctx, np.asarray(local))
        return (float(total), float(count)) if count else None

    # ------------------------------------------------------------------ checkpoints
    def full_state_dict(self, model: Any, dequantize: bool = True) -> Dict[str, Any]:
        """Whole (unsplit) weights under the single-process names, as numpy arrays, on every rank (a
        quantised base's layers dequantised unless ``dequantize`` is False)."""
        from bmtrain_cli.parallel.full_weights import full_state_dict

        return full_state_dict(self._ctx, model, dequantize)

    def load_full_state_dict(self, model: Any, state: Dict[str, Any]) -> None:
        """Load whole weights (single-process names) into this rank's shards/stage."""
        from bmtrain_cli.parallel.full_weights import load_full_state_dict

        load_full_state_dict(self._ctx, model, state)

    def checkpoint_weights_writer(self, model: Any) -> Optional[Any]:
        """Collective (call on every rank before saving): gathers the whole weights under tensor/pipeline
        parallel and returns a ``writer(model, dir)`` for train.checkpoint.training_state.save_checkpoint that writes them
        in Hugging Face layout. None when this rank already holds whole weights (use the default writer)."""
        if self._ctx.holds_whole_weights:
            return None
        from bmtrain_cli.parallel.full_weights import full_weights_writer

        return full_weights_writer(self._ctx, model)

    def gather_full_model(self, model: Any, kernels: str = "auto") -> Any:
        """Collective (call on every rank): a plain single-process CausalLM holding the whole weights, for
        work that runs on one rank only (demo accuracy, generation, export) under tensor/pipeline parallel.
        Returns the model itself when this rank already holds whole weights."""
        if self._ctx.holds_whole_weights:
            from bmtrain_cli.parallel.full_weights import unwrap

            return unwrap(model)
        from bmtrain_cli.parallel.full_weights import full_model

        return full_model(self._ctx, model, kernels)

    @property
    def compression_stats(self) -> Dict[str, Any]:
        return self._compressor.stats() if self._compressor is not None else {}


class DataParallelOptimizer:
    """Plain data parallel: sum gradients over the data ranks (compressed when configured), then step."""

    def __init__(self, inner: Any, ctx: ParallelCtx, compressor: Optional[Compressor]) -> None:
        self._inner = inner
        self._ctx = ctx
        self._compressor = compressor
        self._reduced = False

    def reduce_gradients(self) -> None:
        """Sum gradients over the data ranks now (call before clipping or measuring the gradient norm;
        step() does it itself when it was not called)."""
        import paddle.distributed as dist

        from bmtrain_cli.parallel.expert_parallel import is_expert

        if self._reduced:
            return
        self._reduced = True
        self._ctx.collectives.mark_progress()
        params = [p for p in self._inner._parameter_list if not p.stop_gradient and p.grad is not None]
        comp = self._compressor
        if comp is not None:
            comp.all_reduce_sum(params, self._ctx.data_groups()[0])
            return
        experts = self._ctx.expert_group
        for p in params:
            if experts is not None and is_expert(p):  # summed over its group already: over its replicas
                if experts.replicas is not None:
                    dist.all_reduce(p.grad, group=experts.replicas)
                continue
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
