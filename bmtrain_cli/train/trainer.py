"""The training loop behind `bmtrain train` and recipes/train.py.

One optimizer step = ``grad_accum_steps`` micro-batches per data rank. The loss is token-weighted: each
micro-batch's summed token loss is divided by the number of predicted tokens of the whole step (summed
over micro-batches and data ranks) before backward, so the gradient equals the single-process gradient of
the mean token loss whatever the layout. Checkpoints, metrics and signals are handled here; the pieces
live in schedule.py, optim.py, checkpoint.py, metrics.py, evaluate.py and runtime.py.
"""

from __future__ import annotations

import dataclasses
import math
import random
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, TextIO

import numpy as np
import yaml

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.config.schema import Config
from bmtrain_cli.data.stream import DataError
from bmtrain_cli.errors import UserError
from bmtrain_cli.train.runtime import Runtime, clear_output_dir, make_runtime


class TrainingStopped(UserError):
    """Training ended early for a reason the user should see (non-finite losses, a signal)."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class _SignalGuard:
    """SIGINT/SIGTERM ask the loop to save and stop at the end of the current step; a second one
    interrupts at once."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._old: Dict[int, Any] = {}

    def __enter__(self) -> _SignalGuard:
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)


def seed_everything(seed: int) -> None:
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


# ----------------------------------------------------------------------------- data and tokenizer


def _prepare_data(rt: Runtime, is_main: bool, ctx: Any) -> Dict[str, Any]:
    """Training/eval paths; the demo task is generated under output_dir/data when no data_path is set."""
    t = rt.config.train
    paths: Dict[str, Any] = {"train": t.data_path, "eval": t.eval_data_path, "heldout": None}
    if t.data_path is None and t.demo_data:
        from bmtrain_cli.data.demo import write_demo_data

        data_dir = rt.output_dir / "data"
        if is_main:
            write_demo_data(str(data_dir), task=t.demo_data, seed=0)
        _barrier(ctx)
        paths["train"] = str(data_dir / "train.jsonl")
        paths["heldout"] = str(data_dir / "heldout.jsonl")
        if paths["eval"] is None:
            paths["eval"] = paths["heldout"]
    return paths


def _barrier(ctx: Any) -> None:
    if getattr(ctx, "world_size", 1) > 1 and hasattr(ctx, "barrier"):
        ctx.barrier()


def _collect_texts(paths: Any, limit: int = 200000) -> List[str]:
    """Strings of a data set (JSONL or JSON array, any format), for training a tokenizer when none is
    given. Bad records are skipped here (the loader applies on_bad_record later); if no text is left,
    the first bad record is named."""
    from bmtrain_cli.data.readers import as_list, read_records, resolve_source

    texts: List[str] = []

    def walk(v: Any) -> None:
        if isinstance(v, str):
            texts.append(v)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, list):
            for x in v:
                walk(x)

    first_bad = ""
    for p in (f for spec in as_list(paths) for f in resolve_source(spec)):
        for rec in read_records(p):
            if rec.error is not None:
                first_bad = first_bad or f"{rec.where()}: {rec.error}"
                continue
            walk(rec.value)
            if len(texts) >= limit:
                return texts
    if not texts:
        why = first_bad or "the files hold no text"
        raise UserError(
            f"no text to train a tokenizer on in data_path: {why}. Fix the data, or set "
            "model_config.tokenizer_path to an existing tokenizer"
        )
    return texts


def _load_tokenizer(rt: Runtime, paths: Dict[str, Any], is_main: bool, ctx: Any) -> Any:
    from bmtrain_cli.data.tokenizers import load_tokenizer

    m, t = rt.config.model, rt.config.train
    if rt.resume_from is not None:
        return load_tokenizer(str(rt.resume_from))
    if m.tokenizer_path:
        return load_tokenizer(m.tokenizer_path)
    if m.model_name_or_path:
        return load_tokenizer(m.model_name_or_path)
    tok_dir = rt.output_dir / "tokenizer"
    if is_main:
        if t.demo_data and t.data_path is None:
            from bmtrain_cli.data.demo import train_demo_tokenizer

            train_demo_tokenizer(str(tok_dir), [paths["train"], paths["heldout"]])
        else:
            from bmtrain_cli.data.tokenizers import train_sentencepiece

            texts = _collect_texts(paths["train"])
            vocab = m.vocab_size or min(8000, max(300, len(set("".join(texts[:20000]))) * 4))
            train_sentencepiece(texts, str(tok_dir), vocab_size=vocab)
    _barrier(ctx)
    return load_tokenizer(str(tok_dir))


def _data_config(config: Config, paths: Dict[str, Any]) -> Config:
    """The config the loader reads: same as the user's, with the generated data paths filled in (a new
    frozen object; the user's config is never modified)."""
    train = config.train.model_copy(update={"data_path": paths["train"], "eval_data_path": paths["eval"]})
    return config.model_copy(update={"train": train})


# ----------------------------------------------------------------------------- model


def _build_model(rt: Runtime, tokenizer: Any, ctx: Any) -> Any:
    from bmtrain_cli.config.checks import fresh_vocab_size
    from bmtrain_cli.models import build, load_pretrained
    from bmtrain_cli.models.arch import arch_from_model_config

    m = rt.config.model
    factory = getattr(ctx, "factory", None)
    if rt.resume_from is not None:
        if rt.config.train.finetuning == "lora":  # adapters-only checkpoint: load its verified base
            from bmtrain_cli.lora.checkpoint import find_base

            alternatives = [m.model_name_or_path] if m.model_name_or_path else []
            base = find_base(rt.resume_from, alternatives)
            return load_pretrained(str(base), kernels=m.kernels, factory=factory)
        return load_pretrained(str(rt.resume_from), kernels=m.kernels, factory=factory)
    if m.model_name_or_path:
        return load_pretrained(m.model_name_or_path, kernels=m.kernels, factory=factory)
    arch = arch_from_model_config(m)
    arch = dataclasses.replace(
        arch,
        vocab_size=fresh_vocab_size(m.vocab_size, tokenizer.vocab_size, "the tokenizer"),
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    return build(arch, factory=factory, kernels=m.kernels)


# ----------------------------------------------------------------------------- the trainer


class Trainer:
    def __init__(self, loaded: LoadedConfig, ctx: Any = None, stream: Optional[TextIO] = None):
        import paddle

        from bmtrain_cli.parallel.context import init_parallel
        from bmtrain_cli.train.metrics import MemoryMeter
        from bmtrain_cli.train.optim import check_precision_supported

        self.config = loaded.config
        self.stream = stream or sys.stdout
        self.ctx = ctx if ctx is not None else init_parallel(self.config)
        self.is_main = getattr(self.ctx, "is_main", True)
        self.rt = make_runtime(self.config, is_main=self.is_main)
        check_precision_supported(self.config.train.precision, self.rt.has_gpu)
        if not self.rt.has_gpu:
            paddle.set_device("cpu")
            from bmtrain_cli.plan.host_memory import pin_mmap_threshold

            pin_mmap_threshold()  # freed tensors go back to the OS: lower, predictable peak RSS (docs/plan.md)
        self.t0 = time.time()
        self.paddle = paddle
        self.metrics: Any = None

        t = self.config.train
        seed_everything(t.seed)
        self.paths = _prepare_data(self.rt, self.is_main, self.ctx)
        self.rt.data_paths = dict(self.paths)
        self.tokenizer = _load_tokenizer(self.rt, self.paths, self.is_main, self.ctx)
        self.data_config = _data_config(self.config, self.paths)

        from bmtrain_cli.data.loader import build_loader

        self.loader = build_loader(
            self.data_config,
            self.tokenizer,
            split="train",
            data_rank=getattr(self.ctx, "data_rank", 0),
            data_world=getattr(self.ctx, "data_world", 1),
            seed=t.seed,
            write_rejected=False,  # written by _claim_output_dir, once every check has passed
        )
        self.eval_loader = None
        if self.paths["eval"] is not None:
            self.eval_loader = build_loader(
                self.data_config,
                self.tokenizer,
                split="eval",
                data_rank=getattr(self.ctx, "data_rank", 0),
                data_world=getattr(self.ctx, "data_world", 1),
                seed=t.seed,
            )
        self.data_report = _data_report(self.loader, self.eval_loader, self.rt.output_dir, t.truncation)

        from bmtrain_cli.plan.estimator import (
            check_weights_fit,
            format_bytes,
            memory_warning,
            training_estimate,
        )

        longest = self.loader.longest if t.batching == "longest" else None  # other modes fill max_seq_len
        plan = training_estimate(
            self.config, vocab_size=getattr(self.tokenizer, "vocab_size", None), seq_len=longest
        )
        check_weights_fit(plan)
        warning = memory_warning(plan)
        if warning:
            self._say(warning)
        self.memory = MemoryMeter(self.rt.has_gpu)
        try:
            self._build_model_and_optimizer()
        except MemoryError:
            figure = (
                f" (the memory plan estimates {format_bytes(plan.required)} per device; {plan.device.name} "
                f"has {format_bytes(plan.device.memory_bytes)})"
                if plan is not None
                else ""
            )
            raise UserError(
                f"out of memory while building the model and optimizer{figure}; use a smaller model or more "
                "devices (`bmtrain plan --config ... --search`)"
            ) from None
        self.rt.total_steps = self._total_steps()

        from bmtrain_cli.train.schedule import build_schedule

        self.schedule = build_schedule(t, self.rt.derived.learning_rate, self.rt.total_steps)
        self.step = 0
        self.best_eval_loss: Optional[float] = None
        self.consecutive_nonfinite = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        self.train_time = 0.0
        self.last_saved_step: Optional[int] = None
        self.history: Dict[str, Any] = {}
        # called as fn(trainer, step_output) at the end of every optimizer step (benchmarks, tests)
        self.step_callbacks: List[Callable[[Trainer, Dict[str, Any]], None]] = []
        if self.rt.resume_from is not None:
            self._restore(self.rt.resume_from)
        self._claim_output_dir()

    # -- construction
    def _build_model_and_optimizer(self) -> None:
        from bmtrain_cli.train.optim import Precision, build_optimizer

        t, p = self.config.train, self.config.parallel
        self.model = _build_model(self.rt, self.tokenizer, self.ctx)
        self.lora = None
        if t.finetuning == "lora":  # freeze the base, only the adapters train (bmtrain_cli/lora)
            from bmtrain_cli.lora.checkpoint import LoRARun

            self.lora = LoRARun.start(self.model, t, resume_from=self.rt.resume_from)
        if t.gradient_checkpointing and t.recompute_granularity != "none":
            self.model.enable_recompute(t.recompute_granularity, t.recompute_num_layers)
        self.precision = Precision(t.precision, t.amp_level, t.loss_scale)
        distributed = getattr(self.ctx, "world_size", 1) > 1
        # under tensor/pipeline parallel and sharding, fleet's hybrid clip measures the whole model's norm
        # inside step() (after its reductions) and clips with it; the trainer logs what it measured
        fleet_clip = distributed and getattr(self.ctx, "uses_fleet_model", False)
        # sharding stage 2/3 (and their offload) wrap model and optimizer together (parallel/sharding.py)
        self.group_sharded = distributed and p.sharding_parallel > 1 and p.sharding_stage in (2, 3)
        grad_clip = None
        if fleet_clip:
            from bmtrain_cli.parallel.grad_norm import clip_bound

            grad_clip = clip_bound(t.max_grad_norm)
        self.base_optimizer = build_optimizer(
            self.model,
            t,
            self.rt.derived.learning_rate,
            multi_precision=self.precision.master_weights,
            grad_clip=grad_clip,
            offload=p.offload_optimizer and not self.group_sharded,  # group-sharded offload is Paddle's
        )
        self.own_clip = not fleet_clip
        self.model, self.base_optimizer = self.precision.decorate(self.model, self.base_optimizer)
        self.raw_model = self.model
        self.train_model = self.ctx.wrap_model(self.model) if distributed else self.model
        self.sharded_loss: Any = None
        if self.group_sharded:
            from bmtrain_cli.train.static import LossSum

            # the group-sharded wrapper prepares its buffers in forward(): make loss_sum that forward
            self.sharded_loss, self.optimizer = self.ctx.wrap_model_and_optimizer(
                LossSum(self.train_model), self.base_optimizer
            )
        else:
            self.optimizer = (
                self.ctx.wrap_optimizer(self.base_optimizer) if distributed else self.base_optimizer
            )
        self.params = [q for q in self.raw_model.parameters() if not q.stop_gradient]
        self.loss_fn = self._loss_function()
        from bmtrain_cli.models.arch import count_parameters

        self.n_params = count_parameters(self.raw_model.arch)

    def _claim_output_dir(self) -> None:
        """Every check has passed (data, tokenizer, model, optimizer, the checkpoint to resume): only now
        are the previous run's outputs removed (with overwrite) and this run's first files written."""
        if self.is_main:
            clear_output_dir(self.config, resuming=self.rt.resume_from is not None)
        _barrier(self.ctx)
        self.loader.start_rejected_log(self.rt.output_dir, self.is_main)
        if self.lora is not None:  # a fresh base is written to output_dir/base_model (collective)
            self.lora.record_base(self.config, self.rt.output_dir, self.train_model, self.ctx)
            self._say(self.lora.describe(self.raw_model, self.n_params))

    def _attention_line(self) -> str:
        """Which attention kernel the training batches reach, and why (models/attention_choice.py)."""
        from bmtrain_cli.models.attention_choice import choose_kernel, training_mask_kind

        m, t = self.config.model, self.config.train
        pipeline = getattr(self.ctx, "pp_degree", 1) > 1
        kind = training_mask_kind(self.raw_model.arch, m.max_seq_len, t.batching == "packed", pipeline)
        kernel, why = choose_kernel(kind, m.attention_implementation, self.precision.enabled, self.rt.has_gpu)
        return f"attention: {kernel} ({why})"

    def _loss_function(self) -> Optional[Callable[..., Any]]:
        """loss_sum of the training model; compiled with paddle.jit.to_static when train_config.to_static
        (the forward and its backward become one static program; the optimizer step stays eager)."""
        t = self.config.train
        if self.sharded_loss is not None:
            return self.sharded_loss
        if getattr(self.ctx, "pp_degree", 1) > 1:
            return None  # fleet's pipeline schedule computes the loss (ctx.pipeline_step)
        if not t.to_static:
            return self.train_model.loss_sum
        from bmtrain_cli.train.static import compile_loss_sum

        if t.batching == "longest":
            self._say(
                "note: to_static with batching: longest compiles one program per distinct batch length; "
                "batching: max_length or packed gives one fixed shape"
            )
        return compile_loss_sum(self.train_model)

    def _total_steps(self) -> int:
        t = self.config.train
        if t.max_steps:
            return t.max_steps
        n = None
        for attr in ("num_batches", "__len__"):
            try:
                n = len(self.loader) if attr == "__len__" else getattr(self.loader, attr)
            except (TypeError, AttributeError):
                n = None
            if n:
                break
        if not n:
            raise UserError("the data loader cannot tell its length; set train_config.max_steps")
        return max(1, math.ceil(t.num_train_epochs * int(n) / self.rt.grad_accum_steps))

    def _restore(self, ckpt: Path) -> None:
        from bmtrain_cli.train.checkpoint import load_training_state, optimizer_layout

        state = load_training_state(
            ckpt,
            model=self.raw_model,
            optimizer=self.base_optimizer,
            layout=optimizer_layout(self.ctx),
            rank=getattr(self.ctx, "rank", 0),
        )
        if not state.get("optimizer_restored", True):
            self._say(f"note: {state['optimizer_message']} (weights, schedule and data position are resumed)")
        if hasattr(self.base_optimizer, "sync_from_model"):
            self.base_optimizer.sync_from_model()
        self.step = int(state["step"])
        self.precision.load_state_dict(state.get("scaler") or {})
        if state.get("data") is not None:
            self.loader.load_state_dict(state["data"])
        c = state.get("counters", {})
        self.best_eval_loss = c.get("best_eval_loss")
        self.skipped_steps = int(c.get("skipped_steps", 0))
        self.tokens_seen = int(c.get("tokens_seen", 0))
        self.train_time = float(c.get("train_time", 0.0))
        self.history = state.get("history", {})
        self.last_saved_step = self.step

    # -- helpers
    def _micro_batches(self) -> List[Dict[str, np.ndarray]]:
        out = []
        for _ in range(self.rt.grad_accum_steps):
            try:
                out.append(next(self._iter))
            except StopIteration:
                self._iter = iter(self.loader)
                try:
                    out.append(next(self._iter))
                except StopIteration:
                    raise UserError("the training data produced no batches") from None
        return out

    def _say(self, text: str) -> None:
        if self.is_main:
            if self.metrics is not None:
                self.metrics.message(text)
            else:
                print(text, file=self.stream, flush=True)

    def _check_weights_finite(self) -> None:
        """A checkpoint never holds inf or NaN weights, and a run that made them never reports success.
        Collective (every rank checks its own parameters; the verdict is summed over all ranks)."""
        paddle = self.paddle
        checks = [paddle.isfinite(q).all() for q in self.raw_model.parameters()]
        finite = bool(paddle.stack(checks).all()) if checks else True  # one device-to-host sync
        bad = paddle.to_tensor(0.0 if finite else 1.0)
        if getattr(self.ctx, "world_size", 1) > 1:
            import paddle.distributed as dist

            dist.all_reduce(bad)
        if float(bad) > 0:
            raise TrainingStopped(
                f"training stopped at step {self.step}: the weights hold inf or NaN (the updates diverged: "
                "lower learning_rate or check the data); they were not saved, the last good checkpoint is "
                f"kept in {self.rt.checkpoint_dir}",
                exit_code=2,
            )

    def save(self) -> Path:
        from bmtrain_cli.train.checkpoint import optimizer_layout, save_checkpoint, write_optimizer_shard

        self._check_weights_finite()
        eval_path = self.paths.get("eval")
        if isinstance(eval_path, list):
            eval_path = eval_path[0] if eval_path else None
        state = {
            # export compares eval loss before/after on the file this run evaluated on
            "eval_data_path": str(Path(eval_path).resolve()) if isinstance(eval_path, str) else None,
            "data_paths": {k: v for k, v in self.paths.items() if v is not None},
            "scaler": self.precision.state_dict(),
            "data": self.loader.state_dict(),
            "schedule": self.schedule.state_dict(),
            "counters": {
                "best_eval_loss": self.best_eval_loss,
                "skipped_steps": self.skipped_steps,
                "tokens_seen": self.tokens_seen,
                "train_time": self.train_time,
            },
            "history": self.history,
            "total_steps": self.rt.total_steps,
        }
        path = self.rt.checkpoint_dir / f"step-{self.step}"
        self._gather_sharded_parameters()
        layout = optimizer_layout(self.ctx)
        if not layout["portable"]:
            # the optimizer state is split over the ranks: every rank saves its part (reused by a resume
            # under the same layout only); rank 0 moves them into the checkpoint after the barrier
            write_optimizer_shard(
                self.rt.checkpoint_dir,
                self.step,
                getattr(self.ctx, "rank", 0),
                self.base_optimizer,
                self.raw_model,
            )
            _barrier(self.ctx)
        # LoRA: adapters only (+ base path and hash); gathering them is collective under tensor parallel
        writer = self.lora.weights_writer(self.train_model, self.ctx) if self.lora is not None else None
        if writer is None and hasattr(self.ctx, "checkpoint_weights_writer"):
            # collective: under tensor/pipeline parallel gather whole tensors (None: the default writer)
            writer = self.ctx.checkpoint_weights_writer(self.train_model)
        if self.is_main:
            path = save_checkpoint(
                self.rt.checkpoint_dir,
                self.step,
                model=self.raw_model,
                optimizer=self.base_optimizer,
                state=state,
                tokenizer=self.tokenizer,
                keep=self.config.train.save_total_limit,
                weights_writer=writer,
                extra_files={"bmtrain_config.yaml": yaml.safe_dump(self.config.to_dict(), sort_keys=False)},
                layout=layout,
            )
            if self.metrics is not None:
                self.metrics.log_event(self.step, "checkpoint", path=str(path))
        _barrier(self.ctx)
        self.last_saved_step = self.step
        return path

    def evaluate(self) -> Optional[float]:
        from bmtrain_cli.train.evaluate import eval_loss

        if self.eval_loader is None:
            return None
        loss, _ = eval_loss(self._whole_model(), self.eval_loader, self.precision.autocast, self.ctx)
        if math.isfinite(loss) and (self.best_eval_loss is None or loss < self.best_eval_loss):
            self.best_eval_loss = loss
        if self.metrics is not None:
            self.metrics.log_eval(self.step, loss)
        return loss

    def demo_accuracy(self) -> Optional[Dict[str, Any]]:
        """Held-out answer accuracy of the demo task (None for other data)."""
        if not self.paths.get("heldout"):
            return None
        model = self._whole_model()  # collective under tensor/pipeline parallel
        if not self.is_main:
            return None
        from bmtrain_cli.train.evaluate import answer_accuracy, read_records

        records = read_records(self.paths["heldout"])
        t = self.config.train
        return answer_accuracy(model, self.tokenizer, records, template=t.template, data_format=t.data_format)

    def _gather_sharded_parameters(self) -> None:
        """Sharding stage 3 keeps only a slice of each parameter on a rank: gather them whole (collective)
        before weights are read for a checkpoint or an evaluation."""
        gather = getattr(self.sharded_loss, "get_all_parameters", None)
        if gather is not None:
            gather()

    def _whole_model(self) -> Any:
        """The model with whole weights: raw_model, or (collective) a gathered copy under tp/pp > 1."""
        self._gather_sharded_parameters()
        if getattr(self.ctx, "tp_degree", 1) > 1 or getattr(self.ctx, "pp_degree", 1) > 1:
            return self.ctx.gather_full_model(self.train_model, kernels=self.config.model.kernels)
        return self.raw_model

    def _pipeline_train_step(self, micro: List[Dict[str, np.ndarray]]) -> Dict[str, Any]:
        """Pipeline parallel: 1F1B over the micro-batches and the optimizer step inside fleet."""
        lr = self.schedule(self.step)
        self.optimizer.set_lr(lr)
        loss_total, count = self.ctx.pipeline_step(self.train_model, micro, self.optimizer)
        local_tokens = float(sum(int((b["attention_mask"] > 0).sum()) for b in micro))
        tokens = float(self.ctx.all_reduce_sum(local_tokens))
        loss = loss_total / max(count, 1.0)
        grad_norm = self._fleet_grad_norm()  # measured by fleet's clip inside train_batch
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": tokens,
            "applied": True,
            "finite": math.isfinite(loss),
        }

    def _fleet_grad_norm(self) -> float:
        """The global norm fleet's clip measured in the step just taken (nan if its clip did not run: a
        skipped fp16 step). A non-finite measured norm means the update already ran with it, inside fleet:
        stop rather than train on from non-finite weights."""
        norm = self.optimizer.grad_norm()
        if norm is None:
            return math.nan
        if not math.isfinite(norm):
            raise TrainingStopped(
                f"training stopped at step {self.step + 1}: the gradient norm is {norm} and fleet's optimizer "
                f"has applied the update; the last good checkpoint is kept in {self.rt.checkpoint_dir}. "
                "Lower learning_rate or check the data"
            )
        return norm

    # -- one step
    def train_step(self, micro: List[Dict[str, np.ndarray]]) -> Dict[str, Any]:
        from bmtrain_cli.train.evaluate import count_targets, to_tensors
        from bmtrain_cli.train.optim import clip_grads_, grad_norm_tensor

        t = self.config.train
        if getattr(self.ctx, "pp_degree", 1) > 1:
            return self._pipeline_train_step(micro)
        local_count = float(sum(count_targets(b) for b in micro))
        local_tokens = float(sum(int((b["attention_mask"] > 0).sum()) for b in micro))
        distributed = getattr(self.ctx, "data_world", 1) > 1
        if distributed:
            total_count = float(self.ctx.all_reduce_sum(local_count))
            total_tokens = float(self.ctx.all_reduce_sum(local_tokens))
        else:
            total_count, total_tokens = local_count, local_tokens
        denom = max(total_count, 1.0)
        lr = self.schedule(self.step)
        self.optimizer.set_lr(lr)
        loss_acc = None
        for b in micro:
            tensors = to_tensors(b)
            with self.precision.autocast():
                loss_sum, _ = self.loss_fn(**tensors)
            self.precision.backward(loss_sum / denom)
            loss_acc = loss_sum.detach() if loss_acc is None else loss_acc + loss_sum.detach()
        if self.own_clip and distributed and hasattr(self.optimizer, "reduce_gradients"):
            self.optimizer.reduce_gradients()  # plain data parallel: sum gradients now, step the inner one
            step_opt = self.base_optimizer
        else:
            step_opt = self.optimizer
        self.precision.unscale(step_opt)
        # the loss and the fp32 global grad norm come to the host together: one sync per step
        norm_t = grad_norm_tensor(self.params) if self.own_clip else None
        parts = [loss_acc.astype("float32").reshape([1])]
        if norm_t is not None:
            parts.append(norm_t.reshape([1]))
        host = self.paddle.concat(parts).numpy() if len(parts) > 1 else parts[0].numpy()
        loss_total = float(host[0])
        grad_norm = float(host[1]) if norm_t is not None else 0.0
        if distributed:
            loss_total = float(self.ctx.all_reduce_sum(loss_total))
        loss = loss_total / denom
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite and self.own_clip and t.max_grad_norm:
            clip_grads_(self.params, t.max_grad_norm, grad_norm)
        applied = self.precision.step(step_opt, finite)
        if not self.own_clip:
            grad_norm = self._fleet_grad_norm()  # measured by fleet's clip inside step()
        self.optimizer.clear_grad(set_to_zero=False)
        return {
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens": total_tokens,
            "applied": applied,
            "finite": finite,
        }

    # -- the loop
    def train(self) -> Dict[str, Any]:
        from bmtrain_cli.train.metrics import MetricsWriter, flops_per_token, peak_flops

        t = self.config.train
        total = self.rt.total_steps
        resumed = self.rt.resume_from is not None
        self.metrics = MetricsWriter(
            self.rt.output_dir,
            total_steps=total,
            logging_steps=t.logging_steps,
            enabled=self.is_main,
            resume_step=self.step if resumed else None,
            stream=self.stream,
        )
        if self.is_main:
            (self.rt.output_dir / "config.yaml").write_text(
                yaml.safe_dump(self.config.to_dict(), sort_keys=False), encoding="utf-8"
            )
            self.metrics.add_text(
                "config", "```\n" + yaml.safe_dump(self.config.to_dict(), sort_keys=False) + "```"
            )
        arch = self.raw_model.arch
        fpt = flops_per_token(
            self.n_params, arch.num_hidden_layers, arch.hidden_size, self.config.model.max_seq_len
        )
        peak = peak_flops(self.rt.has_gpu, self.precision.dtype) * max(1, getattr(self.ctx, "world_size", 1))

        self._say(
            f"training {arch.family} ({self.n_params:,} parameters) for {total} steps: "
            f"global batch {self.rt.derived.global_batch_size} (micro {t.micro_batch_size} x accumulation "
            f"{self.rt.grad_accum_steps} x data ranks {self.rt.derived.data_ranks}), lr {self.rt.derived.learning_rate:.3g} "
            f"{t.lr_scheduler}, precision {t.precision}, output {self.rt.output_dir}"
            + (f" (resumed from {self.rt.resume_from.name})" if resumed else "")
        )
        self._say(self.data_report["line"])
        self._say(self._attention_line())
        if self.paths.get("heldout") and "accuracy_before" not in self.history:
            acc = self.demo_accuracy()
            if acc is not None:
                self.history["accuracy_before"] = acc["accuracy"]
                self._say(
                    f"held-out accuracy before training: {100 * acc['accuracy']:.1f}% ({acc['n']} problems)"
                )

        self._iter = iter(self.loader)
        # the final-loss window survives a resume (kept in the checkpoint's history), so a resumed run
        # reports the same final_loss as an uninterrupted one
        recent: List[float] = [float(x) for x in self.history.get("recent_losses", [])]
        tps_window: List[float] = []
        stopped: Optional[str] = None
        with _SignalGuard() as guard:
            while self.step < total:
                if guard.received is not None:
                    stopped = signal.Signals(guard.received).name
                    break
                start = time.time()
                try:
                    micro = self._micro_batches()
                except DataError as exc:  # streaming: a bad record ahead; the loader is at this step
                    raise self._stop_on_bad_data(exc, total) from None
                out = self.train_step(micro)
                elapsed = time.time() - start
                self.train_time += elapsed
                self.step += 1
                self.tokens_seen += int(out["tokens"])
                tps = out["tokens"] / elapsed if elapsed > 0 else 0.0
                tps_window.append(tps)
                if not out["finite"]:
                    self.consecutive_nonfinite += 1
                    self.skipped_steps += 1
                    if self.metrics is not None:
                        self.metrics.log_event(
                            self.step, "nonfinite_skipped", loss=out["loss"], grad_norm=out["grad_norm"]
                        )
                    self._say(
                        f"step {self.step}: non-finite loss/gradient (loss {out['loss']}, grad norm "
                        f"{out['grad_norm']}); update skipped ({self.consecutive_nonfinite} in a row)"
                    )
                    if self.consecutive_nonfinite >= t.max_nonfinite_steps:
                        raise TrainingStopped(
                            f"training stopped at step {self.step}: {self.consecutive_nonfinite} consecutive "
                            f"steps had a non-finite loss or gradient (max_nonfinite_steps "
                            f"{t.max_nonfinite_steps}). Lower learning_rate, check the data, or use fp32/bf16; "
                            f"the last good checkpoint is kept in {self.rt.checkpoint_dir}"
                        )
                    for fn in self.step_callbacks:
                        fn(self, out)
                    continue
                self.consecutive_nonfinite = 0
                recent.append(out["loss"])
                recent = recent[-max(10, t.logging_steps) :]
                self.history["recent_losses"] = list(recent)
                self.history["tokens_per_sec"] = tps
                mem = self.memory.peak()
                values = {
                    "loss": out["loss"],
                    "lr": out["lr"],
                    "grad_norm": out["grad_norm"],
                    "tokens_per_sec": tps,
                    "mfu": (tps * fpt / peak) if peak else 0.0,
                    "memory": mem,
                }
                if self.precision.loss_scale is not None:
                    values["loss_scale"] = self.precision.loss_scale
                compression = getattr(self.ctx, "compression_stats", {})
                if compression:  # gradient compression: dense / sent bytes so far, and bytes sent
                    values["compression_ratio"] = compression["ratio"]
                    values["compression_bytes_sent"] = compression["bytes_sent"]
                if self.metrics is not None:
                    self.metrics.log_train(self.step, values)
                if t.eval_steps and self.step % t.eval_steps == 0 and self.step < total:
                    self.evaluate()
                if t.save_steps and self.step % t.save_steps == 0 and self.step < total:
                    self.save()
                for fn in self.step_callbacks:
                    fn(self, out)
            if stopped is not None:
                path = self.save() if self.last_saved_step != self.step else self.rt.checkpoint_dir
                self.metrics.close()
                code = 130 if stopped == "SIGINT" else 143
                raise TrainingStopped(
                    f"{stopped} received: stopped at step {self.step}/{total}, checkpoint saved in {path}; "
                    "continue with --resume",
                    exit_code=code,
                )
            final_eval = self.evaluate() if self.eval_loader is not None else None
            ckpt = (
                self.save()
                if self.last_saved_step != self.step
                else self.rt.checkpoint_dir / f"step-{self.step}"
            )
        return self._finish(ckpt, recent, tps_window, final_eval)

    def _stop_on_bad_data(self, exc: Exception, total: int) -> TrainingStopped:
        path = (
            self.save() if self.last_saved_step != self.step else self.rt.checkpoint_dir / f"step-{self.step}"
        )
        self.metrics.close()
        return TrainingStopped(
            f"{exc}; stopped at step {self.step}/{total}, checkpoint saved in {path}. Fix the record, or set "
            "on_bad_record: skip and continue with --resume (it goes to rejected.jsonl)",
            exit_code=2,
        )

    def _finish(
        self, ckpt: Path, recent: List[float], tps_window: List[float], final_eval: Optional[float]
    ) -> Dict[str, Any]:
        from bmtrain_cli.train.metrics import plot_loss_curve, write_summary

        t = self.config.train
        # again: a streaming loader counts the records it has reached by now
        self.data_report = _data_report(self.loader, self.eval_loader, self.rt.output_dir, t.truncation)
        steady = tps_window[1:] if len(tps_window) > 1 else tps_window
        summary: Dict[str, Any] = {
            "steps": self.step,
            "final_loss": float(np.mean(recent)) if recent else None,
            "best_eval_loss": self.best_eval_loss,
            "final_eval_loss": final_eval,
            "tokens_per_sec": (
                float(np.mean(steady)) if steady else float(self.history.get("tokens_per_sec", 0.0))
            ),
            "peak_memory_bytes": self.memory.peak(),
            "peak_memory_source": self.memory.source,
            "peak_rss_bytes": self.memory.peak_rss(),
            "wall_time_s": round(time.time() - self.t0, 3),
            "train_time_s": round(self.train_time, 3),
            "tokens_seen": self.tokens_seen,
            "skipped_steps": self.skipped_steps,
            "parameters": self.n_params,
            "rejected_records": self.data_report["rejected"],
            "overlong_samples": self.data_report["overlong"],
            "checkpoint": str(ckpt),
            "logs": str(self.rt.logs_dir),
        }
        if self.paths.get("heldout"):
            acc = self.demo_accuracy()
            if acc is not None:
                summary["accuracy_before"] = self.history.get("accuracy_before")
                summary["accuracy_after"] = acc["accuracy"]
                summary["heldout_examples"] = acc["examples"]
        if self.is_main:
            png = plot_loss_curve(self.rt.output_dir / "metrics.jsonl", self.rt.output_dir / "loss_curve.png")
            summary["plot"] = str(png) if png else None
            self.metrics.add_hparams(
                {
                    "learning_rate": self.rt.derived.learning_rate,
                    "global_batch_size": self.rt.derived.global_batch_size,
                    "micro_batch_size": t.micro_batch_size,
                    "lr_scheduler": t.lr_scheduler,
                    "warmup_steps": self.schedule.warmup_steps,
                    "weight_decay": t.weight_decay,
                    "precision": t.precision,
                    "max_seq_len": self.config.model.max_seq_len,
                    "gradient_checkpointing": t.gradient_checkpointing,
                    "steps": self.rt.total_steps,
                    "seed": t.seed,
                },
                {"final_loss": summary["final_loss"], "best_eval_loss": self.best_eval_loss},
            )
            self.metrics.close()
            write_summary(self.rt.output_dir, summary)
            self._print_report(summary)
        return summary

    def _print_report(self, s: Dict[str, Any]) -> None:
        out = self.stream
        print(
            f"done: {s['steps']} steps in {s['wall_time_s']:.1f}s, final loss {s['final_loss']:.4f}"
            if s["final_loss"] is not None
            else f"done: {s['steps']} steps",
            file=out,
        )
        if s.get("best_eval_loss") is not None:
            print(f"  best eval loss   {s['best_eval_loss']:.4f}", file=out)
        if s.get("accuracy_after") is not None:
            before = s.get("accuracy_before")
            before_txt = f"{100 * before:.1f}%" if before is not None else "?"
            print(
                f"  held-out accuracy: before {before_txt} -> after {100 * s['accuracy_after']:.1f}%",
                file=out,
            )
        rss = (
            f", process {s['peak_rss_bytes'] / 2**20:.0f} MiB"
            if s["peak_memory_source"] == "host_allocator"
            else ""
        )
        print(
            f"  throughput       {s['tokens_per_sec']:.0f} tokens/s, "
            f"peak memory {s['peak_memory_bytes'] / 2**20:.0f} MiB (tensors{rss})",
            file=out,
        )
        if self.data_report["rejected"]:
            print(f"  bad records      {self.data_report['rejected_text']}", file=out)
        print(f"  checkpoint       {s['checkpoint']}", file=out)
        print(f"  logs             {s['logs']}  (tensorboard --logdir {s['logs']})", file=out)
        if s.get("plot"):
            print(f"  loss curve       {s['plot']}", file=out)
        print(f"  summary          {self.rt.output_dir / 'summary.json'}", file=out)
        out.flush()


def _data_report(loader: Any, eval_loader: Any, output_dir: Path, truncation: str) -> Dict[str, Any]:
    """What the data came to: usable samples, rejected records (on_bad_record: skip) and over-long samples,
    said at the start and counted in summary.json, so nothing is left out silently."""
    train = loader.stats()
    ev = eval_loader.stats() if eval_loader is not None else None
    rejected = int(train["rejected"]) + (int(ev["rejected"]) if ev else 0)
    overlong = int(train["overlong"])
    parts = [
        train.get("line") or f"data: {train['samples']:,} training samples from {train['records']:,} records"
    ]
    if ev is not None:
        parts.append(f"{ev['samples']:,} eval samples")
    rejected_text = ""
    if rejected:
        where = [f"{train['rejected']} training record(s) in {output_dir / 'rejected.jsonl'}"]
        if ev and ev["rejected"]:
            where.append(f"{ev['rejected']} eval record(s) left out")
        rejected_text = f"{rejected} skipped (on_bad_record: skip): " + "; ".join(where)
        parts.append(rejected_text)
    if overlong:
        parts.append(
            f"{overlong} longer than max_seq_len ({'truncated' if truncation == 'left' else 'dropped'})"
        )
    return {
        "rejected": rejected,
        "overlong": overlong,
        "rejected_text": rejected_text,
        "line": "; ".join(parts),
    }


def run_training(loaded: LoadedConfig, stream: Optional[TextIO] = None) -> Dict[str, Any]:
    """Train with a loaded config; returns summary.json's content. A run that fails before writing
    anything leaves no output directory behind (one that existed before is never touched)."""
    out = Path(loaded.config.train.output_dir)
    existed = out.exists()
    try:
        trainer = Trainer(loaded, stream=stream)
    except BaseException:
        if not existed:
            _remove_if_empty(out)
        raise
    try:
        return trainer.train()
    finally:
        metrics = getattr(trainer, "metrics", None)
        if metrics is not None:
            metrics.close()


def _remove_if_empty(directory: Path) -> None:
    """Remove ``directory`` when it holds no file at any depth (only empty folders)."""
    if directory.is_dir() and not any(p.is_file() or p.is_symlink() for p in directory.rglob("*")):
        shutil.rmtree(directory, ignore_errors=True)
