"""The typed parts of one training run, as `setup()` builds them, and the state the loop advances.

``Parts`` is frozen: the recipe (recipes/sft.py, recipes/dpo.py) reads it, never re-assigns it.
``TrainState`` is what changes from step to step and what a checkpoint restores (step, counters, history).
``Objective`` is what a training method's loss gives the shared step, evaluation and report; each recipe
builds its own (SFT: train/loop/token_loss.py; DPO: recipes/dpo.py over preference/objective.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    Dict,
    Iterator,
    List,
    Optional,
    Protocol,
    Sequence,
    TextIO,
    Tuple,
    Union,
    runtime_checkable,
)

import numpy as np

from bmtrain_cli.config.schema import Config
from bmtrain_cli.parallel.protocol import ParallelCtx
from bmtrain_cli.train.runtime import Runtime

if TYPE_CHECKING:
    import paddle

    from bmtrain_cli.data.tokenizers import Tokenizer
    from bmtrain_cli.models.decoder import CausalLM
    from bmtrain_cli.train.lora_run import LoRARun
    from bmtrain_cli.train.monitoring.metrics import MemoryMeter, MetricsWriter
    from bmtrain_cli.train.optimizer.adamw import Precision
    from bmtrain_cli.train.optimizer.lr_schedule import Schedule

Batch = Dict[str, np.ndarray]
Count = Union[float, "paddle.Tensor"]  # what a loss sum is divided by: tokens, pairs or sequences


class BatchSource(Protocol):
    """What the shared loop, checkpointing and report ask of a method's loader (SFT records, streamed
    records, preference pairs, GRPO rollouts): batches in order, a resumable position, what it holds."""

    def __iter__(self) -> Iterator[Batch]: ...

    def __len__(self) -> int: ...

    def state_dict(self) -> Dict[str, Any]: ...

    def load_state_dict(self, state: Dict[str, Any]) -> None: ...

    def stats(self) -> Dict[str, Any]: ...

    def start_rejected_log(self, output_dir: Path, is_main: bool) -> None: ...

    @property
    def longest(self) -> int:
        """Tokens of the longest sample a batch can hold (the padding width of batching: longest)."""


class Stepper(Protocol):
    """What applies the update: the optimizer itself, or fleet's / our data-parallel wrapper of it."""

    def set_lr(self, value: float) -> None: ...

    def step(self) -> None: ...

    def clear_grad(self, set_to_zero: bool = True) -> None: ...


@runtime_checkable
class ClipMeasuringStepper(Protocol):
    """A stepper that clips inside step() (fleet's: OptimParts.own_clip False) and tells the norm it
    measured (None: its clip did not run)."""

    def grad_norm(self) -> Optional[float]: ...


@dataclass
class Console:
    """Messages of the main rank: to the metrics writer (which keeps them apart from the progress bar)
    once it exists, to the stream before that."""

    stream: TextIO = field(default_factory=lambda: sys.stdout)
    is_main: bool = True
    metrics: Optional[MetricsWriter] = None  # attached by setup() at its end

    def say(self, text: str) -> None:
        if not self.is_main:
            return
        if self.metrics is not None:
            self.metrics.message(text)
        else:
            print(text, file=self.stream, flush=True)


@dataclass(frozen=True)
class TrainData:
    paths: Dict[str, Any]  # train / eval / heldout (the demo task's answers) as used
    loader: BatchSource  # this data rank's training batches
    eval_loader: Optional[BatchSource]
    report: Dict[str, Any]  # what the data came to (see report.data_report)


@dataclass(frozen=True)
class ModelParts:
    raw: CausalLM  # the decoder itself (after precision decoration): weights are read from here
    wrapped: paddle.nn.Layer  # what forward runs on: raw, or fleet's data/tensor/pipeline wrapper of it
    params: List[paddle.Tensor]  # the trainable parameters (LoRA: the adapters)
    n_params: int
    lora: Optional[LoRARun] = None  # when finetuning: lora


@dataclass(frozen=True)
class OptimParts:
    base: paddle.optimizer.Optimizer  # the optimizer that holds the state (what a checkpoint saves)
    stepper: Stepper  # what steps: base, or fleet's / our data-parallel wrapper of it
    precision: Precision  # autocast, loss scaling, master weights
    own_clip: bool  # False when fleet's hybrid clip measures and clips inside step()
    loss_fn: Optional[
        Callable[..., Tuple[paddle.Tensor, paddle.Tensor]]
    ]  # loss_sum of the training model (None under pipeline parallel)
    sharded: Optional[paddle.nn.Layer] = None  # sharding stage 2/3: the wrapper that also computes the loss
    backward_factor: float = 1.0  # loss multiplier before backward (parallel/sharding.backward_factor)


class PipelineLoss(Protocol):
    """An objective's loss on the last pipeline stage (parallel/pipeline.py PipelineObjective), with the
    step's metrics handed to every stage."""

    def pipeline_data(self, micro_batches: Sequence[Batch], length: int) -> Tuple[Any, Any, float]: ...

    def loss_sum(self, logits: paddle.Tensor, labels: paddle.Tensor) -> Tuple[paddle.Tensor, float]: ...

    def step_metrics(self) -> Dict[str, float]: ...


class Objective(Protocol):
    """A training method's loss, as the shared step (train/loop/step.py), evaluation (train/evaluation/holdout.py) and
    report call it. Per optimizer step: ``begin_step(micro)`` gives (the step's loss denominator, its
    non-padding tokens), both summed over the data ranks; ``loss_sum(model, batch)`` one micro-batch's
    summed loss (divided by that denominator before backward) and its count; ``step_metrics()`` the
    method's own per-step figures (metrics.jsonl). ``pipeline()`` is the loss under fleet's pipeline
    schedule (None: the token loss fleet's schedule computes itself); ``evaluate()`` the eval loss with
    extra figures (collective); ``perplexity``: the eval loss is a mean token NLL (its exp is logged)."""

    perplexity: bool

    def begin_step(self, micro: List[Batch]) -> Tuple[float, float]: ...

    def loss_sum(self, model: paddle.nn.Layer, batch: Batch) -> Tuple[paddle.Tensor, Count]: ...

    def step_metrics(self) -> Dict[str, float]: ...

    def pipeline(self, ctx: ParallelCtx, micro_batch_size: int) -> Optional[PipelineLoss]: ...

    def evaluate(self, parts: Parts, state: TrainState) -> Tuple[float, Dict[str, Any]]: ...


@dataclass(frozen=True)
class Parts:
    config: Config
    runtime: Runtime
    ctx: ParallelCtx
    console: Console
    tokenizer: Tokenizer
    data: TrainData
    model: ModelParts
    optim: OptimParts
    schedule: Schedule  # lr(step), warmup_steps, state_dict()
    memory: MemoryMeter
    metrics: MetricsWriter  # disabled on other ranks
    started: float  # time.time() when setup began
    objective: Objective  # the method's loss (built by the recipe: train/setup.py build_objective)


@dataclass
class TrainState:
    """Everything the loop changes; a checkpoint holds it and a resume restores it."""

    step: int = 0
    best_eval_loss: Optional[float] = None
    skipped_steps: int = 0
    tokens_seen: int = 0
    train_time: float = 0.0
    consecutive_nonfinite: int = 0
    last_checkpoint: Optional[Path] = None  # the newest checkpoint of this run (or the one resumed)
    last_saved_step: Optional[int] = None
    # accuracy_before (demo task), recent_losses (the final-loss window), tokens_per_sec
    history: Dict[str, Any] = field(default_factory=dict)

    def counters(self) -> Dict[str, Any]:
        return {
            "best_eval_loss": self.best_eval_loss,
            "skipped_steps": self.skipped_steps,
            "tokens_seen": self.tokens_seen,
            "train_time": self.train_time,
        }

    @classmethod
    def restored(
        cls, checkpoint: Path, step: int, counters: Dict[str, Any], history: Dict[str, Any]
    ) -> TrainState:
        return cls(
            step=step,
            last_checkpoint=checkpoint,
            best_eval_loss=counters.get("best_eval_loss"),
            skipped_steps=int(counters.get("skipped_steps", 0)),
            tokens_seen=int(counters.get("tokens_seen", 0)),
            train_time=float(counters.get("train_time", 0.0)),
            last_saved_step=step,
            history=dict(history),
        )


@dataclass(frozen=True)
class StepOutput:
    loss: float  # mean token loss of the global batch
    lr: float
    grad_norm: float  # global norm before clipping (nan when not measured)
    tokens: float  # non-padding tokens of the global batch
    applied: bool  # the optimizer update ran
    finite: bool
    metrics: Dict[str, float] = field(default_factory=dict)  # the objective's (DPO: rewards/*, logps/*)
