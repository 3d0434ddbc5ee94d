"""The global gradient norm under fleet's hybrid parallel (tensor, pipeline, sharding stage 1).

Fleet's ``HybridParallelClipGrad`` (put in place of the optimizer's ``ClipGradByGlobalNorm`` by
``fleet.distributed_optimizer``) measures the norm of the whole model's gradient inside ``step()``,
after the data-parallel reduction:

* a parameter split by an mp layer (``is_distributed``) adds its shard's squares, summed over the
  tensor-parallel group; a replicated one adds its squares once (not summed over that group);
* a weight shared by pipeline stages (``SharedLayerDesc``: the tied embedding) counts on its first stage
  only (the others are marked ``is_firstly_shared = False``); everything is summed over the pipeline group;
* under sharding stage 1 each rank clips the parameters it owns, summed over the sharding group;
* under expert parallel (parallel/expert_parallel.py) a rank's experts are left out of fleet's sums and
  added to the replicated parameters' squares summed over the expert group and the pipeline group, so
  every expert counts once.

This module keeps that computation (one definition of the rule, fleet's) and records its result, so the
trainer logs the norm that clipping used. Without ``max_grad_norm`` the clip still runs with a bound no
gradient reaches (its factor is exactly 1.0), only to measure.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import paddle
from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer.hybrid_parallel_optimizer import (
    HybridParallelClipGrad,
)

# max/(max(norm, MEASURE_ONLY) + 1e-6) rounds to exactly 1.0 in fp32 for every finite norm
MEASURE_ONLY = 3.0e38


def clip_bound(max_grad_norm: Optional[float]) -> float:
    """The bound to give fleet's clip: the configured one, or one no gradient reaches (measure only)."""
    return max_grad_norm if max_grad_norm else MEASURE_ONLY


class RecordingClip(HybridParallelClipGrad):
    """fleet's hybrid-parallel clip, keeping the global norm it computed (None until it runs);
    ``experts``: this rank's expert group under expert parallel."""

    last_norm: Optional[paddle.Tensor] = None
    experts: Any = None
    _expert_squares: Optional[paddle.Tensor] = None

    def _dygraph_clip(self, params_grads: Sequence[Tuple[Any, Any]]) -> Any:
        if self.experts is None:
            return super()._dygraph_clip(params_grads)
        from paddle.nn import clip

        from bmtrain_cli.parallel.expert_parallel import is_expert

        held = [(p, g) for p, g in params_grads if g is not None and is_expert(p)]
        squares = [clip._squared_l2_norm(g).astype("float32").reshape([-1]) for _, g in held]
        self._expert_squares = paddle.concat(squares).sum() if squares else paddle.zeros([], "float32")
        for p, _ in held:
            p.is_firstly_shared = False  # fleet's sums leave them out (they are still clipped)
        try:
            return super()._dygraph_clip(params_grads)
        finally:
            for p, _ in held:
                p.is_firstly_shared = True

    def _global_norm(self, global_norm_var_dist: Any, global_norm_var_not_dist: Any) -> None:
        super()._global_norm(global_norm_var_dist, global_norm_var_not_dist)  # reduces both in place
        if self._expert_squares is not None:  # the experts' squares over their group and the stages
            squares = self.experts.sum_squares(self._expert_squares.reshape([1]))
            if self._hcg.get_pipe_parallel_world_size() > 1:
                paddle.distributed.all_reduce(squares, group=self._hcg.get_pipe_parallel_group())
            global_norm_var_not_dist.add_(squares.reshape(global_norm_var_not_dist.shape))
            self._expert_squares = None
        self.last_norm = paddle.sqrt(global_norm_var_dist + global_norm_var_not_dist)


def install_recorder(fleet_optimizer: Any, experts: Any = None) -> RecordingClip:
    """Swap the HybridParallelClipGrad that fleet.distributed_optimizer attached for a RecordingClip
    (``experts``: this rank's expert group under expert parallel)."""
    opt = fleet_optimizer
    while opt is not None:
        clip = vars(opt).get("_grad_clip")  # the optimizer that owns it (the wrappers delegate reads)
        if isinstance(clip, HybridParallelClipGrad):
            recorder = RecordingClip(clip._clip, clip._hcg, clip.split_norm_comm, clip._timers)
            recorder.experts = experts
            opt._grad_clip = recorder
            return recorder
        opt = getattr(opt, "_inner_opt", None)
    raise RuntimeError("fleet's optimizer carries no HybridParallelClipGrad (was a grad_clip given?)")


def take_norm(recorder: RecordingClip) -> Optional[float]:
    """The norm the last step measured (None when no clip ran, e.g. a skipped fp16 step), and forget it."""
    norm, recorder.last_norm = recorder.last_norm, None
    return float(norm.reshape([-1])[0]) if norm is not None else None
