"""The Python API on a user's own model: init_distributed, DataParallel, TensorParallel, PipelineParallel
and train_step.

These are thin layers over the engine that ``bmtrain train`` runs. ``init_distributed`` turns the degrees
into a parallel_config and starts fleet through ``parallel.topology.start_fleet`` (the CPU compatibility
layer included), returning the same ParallelContext the trainer uses. The wrappers put fleet's own pieces
into the user's model: ``TensorParallel`` replaces ``paddle.nn.Linear``/``paddle.nn.Embedding`` layers by
ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding holding slices of the original weights,
``PipelineParallel`` cuts a Sequential (or a model's one LayerList) into a fleet PipelineLayer at the
boundaries of ``parallel.pipeline.partition``. ``train_step`` reduces gradients through
``ParallelContext.wrapping.wrap_optimizer`` (plain data parallel: summed over the data ranks; otherwise fleet's
hybrid-parallel optimizer, whose clip measures the global norm over shards and stages).

Loss convention: ``loss_fn(output, labels)`` returns the mean over the rows of ``labels`` (first axis).
Each data rank passes its own rows; ``train_step`` weights every rank's loss by its share of the global
batch, so gradients and the returned loss are those of one process on the concatenated batch.

Every rank builds the whole model after ``init_distributed`` (which seeds Paddle, numpy and random
identically on every rank); the wrappers broadcast it from the first rank of each group before cutting
it, so the starting weights are rank 0's whatever the user's initialisation does.

Modules: distributed.py (init_distributed, init_distributed_mode), data_parallel.py, tensor_parallel.py,
pipeline_parallel.py, step.py (train_step), common.py (what the wrappers record on a model).
"""

from bmtrain_cli.api.data_parallel import DataParallel
from bmtrain_cli.api.distributed import DistributedMode, init_distributed, init_distributed_mode
from bmtrain_cli.api.pipeline_parallel import PARTITIONS, PipelineParallel, pipeline_items
from bmtrain_cli.api.step import train_step
from bmtrain_cli.api.tensor_parallel import KINDS, Split, TensorParallel, resolve_plan

__all__ = [
    "KINDS",
    "PARTITIONS",
    "DataParallel",
    "DistributedMode",
    "PipelineParallel",
    "Split",
    "TensorParallel",
    "init_distributed",
    "init_distributed_mode",
    "pipeline_items",
    "resolve_plan",
    "train_step",
]
