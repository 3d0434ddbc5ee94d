"""setup(): every part of a training run, built and checked before anything in output_dir is replaced.

Order: parallel context and runtime (devices, batch arithmetic, the checkpoint to resume) -> data and
tokenizer -> memory plan -> model, LoRA, recompute -> optimizer and precision -> the layout's wrappers ->
objective -> schedule -> resume -> claim the output directory -> metrics. A failure anywhere before the
claim leaves the previous run's files as they were.

What differs between training methods comes from the recipe (recipes/<stage>.py): its demo task, its
data builder and its objective builder. The SFT ones live here and in train/loop/token_loss.py (token_data,
TOKEN_DEMO, token_loss); the DPO ones in recipes/dpo.py.
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, TextIO, Tuple

import numpy as np
import yaml

from bmtrain_cli.checkpoint_layout import write_text_atomic
from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.parallel.protocol import ParallelCtx, Topology
from bmtrain_cli.train.monitoring.report import data_report
from bmtrain_cli.train.parts import (
    Console,
    ModelParts,
    Objective,
    OptimParts,
    Parts,
    TrainData,
    TrainState,
)
from bmtrain_cli.train.runtime import Runtime, clear_output_dir, make_runtime


def seed_everything(seed: int) -> None:
    import paddle

    random.seed(seed)
    np.random.seed(seed)
    paddle.seed(seed)


# ----------------------------------------------------------------------------- data and tokenizer


@dataclass(frozen=True)
class DemoData:
    """A method's demo task (train_config.demo_data without data_path), generated under output_dir/data:
    ``write(data_dir, task)`` writes the files, ``files`` names them (train, eval, heldout: the answers
    the held-out accuracy is measured on)."""

    write: Callable[[str, str], Any]
    files: Dict[str, str]


def write_token_demo(data_dir: str, task: str) -> None:
    from bmtrain_cli.data.demo import write_demo_data

    write_demo_data(data_dir, task=task, seed=0)


# SFT's demo: train.jsonl, and heldout.jsonl as both the eval set and the exact-match answers
TOKEN_DEMO = DemoData(
    write=write_token_demo,
    files={"train": "train.jsonl", "eval": "heldout.jsonl", "heldout": "heldout.jsonl"},
)


def prepare_data(rt: Runtime, ctx: ParallelCtx, demo: DemoData) -> Dict[str, Any]:
    """Training/eval paths (the method's demo task generated under output_dir/data without data_path)."""
    t = rt.config.train
    paths: Dict[str, Any] = {"train": t.data_path, "eval": t.eval_data_path, "heldout": None}
    if t.data_path is None and t.demo_data:
        data_dir = rt.output_dir / "data"
        if ctx.is_main:
            demo.write(str(data_dir), t.demo_data)
        ctx.collectives.barrier()
        paths["train"] = str(data_dir / demo.files["train"])
        paths["heldout"] = str(data_dir / demo.files["heldout"])
        if paths["eval"] is None:
            paths["eval"] = str(data_dir / demo.files["eval"])
    return paths


def collect_texts(paths: Any, limit: int = 200000) -> List[str]:
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


def load_tokenizer(rt: Runtime, paths: Dict[str, Any], ctx: ParallelCtx) -> Any:
    """The checkpoint's tokenizer when resuming, the configured one, or one trained on the data."""
    from bmtrain_cli.data.tokenizers import load_tokenizer as load

    m, t = rt.config.model, rt.config.train
    if rt.resume_from is not None:
        return load(str(rt.resume_from))
    if m.tokenizer_path:
        return load(m.tokenizer_path)
    if m.model_name_or_path:
        return load(m.model_name_or_path)
    tok_dir = rt.output_dir / "tokenizer"
    if ctx.is_main:
        if t.demo_data and t.data_path is None:
            from bmtrain_cli.data.demo import train_demo_tokenizer

            train_demo_tokenizer(str(tok_dir), [paths["train"], paths["heldout"]])
        else:
            from bmtrain_cli.data.tokenizers import train_sentencepiece

            texts = collect_texts(paths["train"])
            vocab = m.vocab_size or min(8000, max(300, len(set("".join(texts[:20000]))) * 4))
            train_sentencepiece(texts, str(tok_dir), vocab_size=vocab)
    ctx.collectives.barrier()
    return load(str(tok_dir))


def data_config(rt: Runtime, paths: Dict[str, Any]) -> Config:
    """The user's config with the data paths as used (the generated demo's filled in): what the loaders
    read (a new frozen object)."""
    train_cfg = rt.config.train.model_copy(
        update={"data_path": paths["train"], "eval_data_path": paths["eval"]}
    )
    return rt.config.model_copy(update={"train": train_cfg})


def train_data(rt: Runtime, paths: Dict[str, Any], loader: Any, eval_loader: Optional[Any]) -> TrainData:
    """The loaders with what the data came to (said at the start, counted in summary.json)."""
    report = data_report(loader, eval_loader, rt.output_dir, rt.config.train.truncation)
    return TrainData(paths=paths, loader=loader, eval_loader=eval_loader, report=report)


def token_data(rt: Runtime, tokenizer: Any, paths: Dict[str, Any], ctx: Topology) -> TrainData:
    """SFT records: this data rank's training loader and the eval loader (rejected records are written
    later, by claim_output_dir, once every check has passed)."""
    from bmtrain_cli.data.loader import build_loader

    config = data_config(rt, paths)

    def loader(split: str, write_rejected: bool) -> Any:
        return build_loader(
            config,
            tokenizer,
            split=split,
            data_rank=ctx.loader_rank,
            data_world=ctx.loader_world,
            seed=config.train.seed,
            write_rejected=write_rejected,
        )

    train = loader("train", write_rejected=False)
    evaluation = loader("eval", write_rejected=True) if paths["eval"] is not None else None
    return train_data(rt, paths, train, evaluation)


# ----------------------------------------------------------------------------- model and optimizer


def _load_model(rt: Runtime, ctx: ParallelCtx) -> Any:
    """The checkpoint being resumed (a LoRA run's: its verified base), else the pretrained path."""
    from bmtrain_cli.models import load_pretrained

    m = rt.config.model
    path = rt.resume_from if rt.resume_from is not None else m.model_name_or_path
    if rt.resume_from is not None and rt.config.train.finetuning == "lora":  # adapters-only checkpoint
        from bmtrain_cli.lora.adapter_store import find_base

        alternatives = [m.model_name_or_path] if m.model_name_or_path else []
        path = find_base(rt.resume_from, alternatives)
    held = ctx.expert_group.owned if ctx.expert_group is not None else None  # a quantised base: its experts
    q, factory = m.quantization, ctx.wrapping.factory
    return load_pretrained(str(path), kernels=m.kernels, factory=factory, quantization=q, held_experts=held)


def build_model(rt: Runtime, tokenizer: Any, ctx: ParallelCtx) -> Any:
    """The decoder: from the checkpoint being resumed, a pretrained path, or fresh from model_config."""
    from bmtrain_cli.config.checks import fresh_vocab_size, tokenizer_fits
    from bmtrain_cli.models import build
    from bmtrain_cli.models.arch import arch_from_model_config
    from bmtrain_cli.models.moe import with_aux_loss_settings

    m = rt.config.model
    if m.model_name_or_path or rt.resume_from is not None:
        model = _load_model(rt, ctx)
        tokenizer_fits(model.arch.vocab_size, tokenizer.vocab_size, "the tokenizer")
        return with_aux_loss_settings(model, m)
    arch = dataclasses.replace(
        arch_from_model_config(m),
        vocab_size=fresh_vocab_size(m.vocab_size, tokenizer.vocab_size, "the tokenizer"),
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    return build(arch, factory=ctx.wrapping.factory, kernels=m.kernels, quantization=m.quantization)


def build_model_and_optimizer(
    rt: Runtime, tokenizer: Any, ctx: ParallelCtx, console: Console
) -> Tuple[ModelParts, OptimParts]:
    """Model (LoRA, recompute), optimizer and precision, wrapped for the parallel layout."""
    from bmtrain_cli.models.param_count import count_parameters
    from bmtrain_cli.train.loop.pipeline_rebalance import resumed_cut
    from bmtrain_cli.train.optimizer.adamw import Precision, build_optimizer

    t, p = rt.config.train, rt.config.parallel
    model = build_model(rt, tokenizer, ctx)
    lora = None
    if t.finetuning == "lora":  # freeze the base, only the adapters train (bmtrain_cli/lora)
        from bmtrain_cli.train.lora_run import LoRARun

        lora = LoRARun.start(model, t, resume_from=rt.resume_from)
    if t.gradient_checkpointing and t.recompute_granularity != "none":
        model.enable_recompute(t.recompute_granularity, t.recompute_num_layers)
    held = ctx.wrapping.shard_experts(model)  # expert parallel: before the optimizer takes the parameters
    if held:
        console.say(held)
    precision = Precision(t.precision, t.amp_level, t.loss_scale)
    distributed = ctx.is_distributed
    # under tensor/pipeline parallel and sharding, fleet's hybrid clip measures the whole model's norm
    # inside step() (after its reductions) and clips with it; the recipe logs what it measured
    fleet_clip = distributed and ctx.uses_fleet_model
    # sharding stage 2/3 (and their offload) wrap model and optimizer together (parallel/sharding.py)
    group_sharded = distributed and p.sharding_parallel > 1 and p.sharding_stage in (2, 3)
    grad_clip = None
    if fleet_clip:
        from bmtrain_cli.parallel.grad_norm import clip_bound

        grad_clip = clip_bound(t.max_grad_norm)
    base = build_optimizer(
        model,
        t,
        rt.derived.learning_rate,
        multi_precision=precision.master_weights,
        grad_clip=grad_clip,
        offload=p.offload_optimizer and not group_sharded,  # group-sharded offload is Paddle's
    )
    raw, base = precision.decorate(model, base)
    # pipeline_rebalance: a resume keeps the cut its checkpoint was saved under
    wrapped = (
        ctx.wrapping.wrap_model(raw, pipeline_bounds=resumed_cut(rt.config, rt.resume_from))
        if distributed
        else raw
    )
    sharded = None
    if group_sharded:
        from bmtrain_cli.models.decoder import LossSum

        # the group-sharded wrapper prepares its buffers in forward(): make loss_sum that forward
        sharded, stepper, scaler = ctx.wrapping.wrap_model_and_optimizer(
            LossSum(wrapped), base, precision.scaler
        )
        precision.scaler = scaler  # Paddle's GroupShardedScaler (fp16), or None
    else:
        stepper = ctx.wrapping.wrap_optimizer(base) if distributed else base
        if distributed:
            precision.scaler = ctx.wrapping.wrap_scaler(precision.scaler)
    from bmtrain_cli.parallel.sharding import backward_factor

    model_parts = ModelParts(
        raw=raw,
        wrapped=wrapped,
        params=[q for q in raw.parameters() if not q.stop_gradient],
        n_params=count_parameters(raw.arch),
        lora=lora,
    )
    loss_fn = sharded if sharded is not None else loss_function(rt.config, wrapped, ctx, console)
    optim = OptimParts(
        base=base,
        stepper=stepper,
        precision=precision,
        own_clip=not fleet_clip,
        loss_fn=loss_fn,
        sharded=sharded,
        backward_factor=backward_factor(ctx),
    )
    return model_parts, optim


def loss_function(config: Config, wrapped: Any, ctx: Topology, console: Console) -> Optional[Any]:
    """loss_sum of the training model; compiled with paddle.jit.to_static when train_config.to_static
    (the forward and its backward become one static program; the optimizer step stays eager)."""
    t = config.train
    if ctx.pp_degree > 1:
        return None  # fleet's pipeline schedule computes the loss (ctx.wrapping.pipeline_step)
    if not t.to_static:
        return wrapped.loss_sum
    from bmtrain_cli.train.loop.to_static import compile_loss_sum

    if t.batching == "longest":
        console.say(
            "note: to_static with batching: longest compiles one program per distinct batch length; "
            "batching: max_length or packed gives one fixed shape"
        )
    return compile_loss_sum(wrapped)


def total_steps(config: Config, loader: Any, grad_accum_steps: int) -> int:
    t = config.train
    if t.max_steps:
        return t.max_steps
    try:
        n = len(loader)
    except TypeError:
        n = 0
    if not n:
        raise UserError("the data loader cannot tell its length; set train_config.max_steps")
    return max(1, math.ceil(t.num_train_epochs * int(n) / grad_accum_steps))


# ----------------------------------------------------------------------------- setup


def _out_of_memory(plan: Any) -> UserError:
    from bmtrain_cli.plan.estimator import format_bytes

    figure = (
        f" (the memory plan estimates {format_bytes(plan.required)} per device; {plan.device.name} "
        f"has {format_bytes(plan.device.memory_bytes)})"
        if plan is not None
        else ""
    )
    return UserError(
        f"out of memory while building the model and optimizer{figure}; use a smaller model or more "
        "devices (`bmtrain plan --config ... --search`)"
    )


def claim_output_dir(
    rt: Runtime, ctx: ParallelCtx, data: TrainData, model: ModelParts, console: Console
) -> None:
    """Every check has passed (data, tokenizer, model, optimizer, the checkpoint to resume): only now
    are the previous run's outputs removed (with overwrite) and this run's first files written."""
    if ctx.is_main:
        clear_output_dir(rt.config, resuming=rt.resume_from is not None)
        text = yaml.safe_dump(rt.config.to_dict(), sort_keys=False)
        write_text_atomic(rt.output_dir / "config.yaml", text)  # a full disk leaves no empty config.yaml
    ctx.collectives.barrier()
    data.loader.start_rejected_log(rt.output_dir, ctx.is_main)  # streaming: every rank, as it reads
    if model.lora is not None:  # a fresh base is written to output_dir/base_model (collective)
        model.lora.record_base(rt.config, rt.output_dir, model.wrapped, ctx)
        console.say(model.lora.describe(model.raw, model.n_params))


def _set_host_memory(policy: str, plan: Any, ctx: Topology, console: Console) -> None:
    """CPU training: keep freed tensor memory for reuse or return it to the OS (plan/host_memory.py)."""
    from bmtrain_cli.plan import host_memory
    from bmtrain_cli.plan.devices import format_bytes, host_memory_bytes

    estimate = None if plan is None else int(plan.required)
    chosen = host_memory.choose(policy, estimate, host_memory_bytes(), ctx.world_size)
    host_memory.apply(chosen)
    if policy == "auto" and chosen == "release":
        console.say(
            f"host memory: freed tensors go back to the OS (twice the plan's {format_bytes(estimate or 0)} "
            "per rank does not fit in RAM); steps are slower than with train_config.host_memory: reuse"
        )


def memory_plan(rt: Runtime, tokenizer: Any, data: TrainData, ctx: ParallelCtx, console: Console) -> Any:
    """The memory plan of the run (plan/estimator.py): refuses weights that cannot fit, warns when the
    whole run may not, and sets the CPU's host-memory policy from it."""
    from bmtrain_cli.plan.estimator import check_memory_fits, check_weights_fit, training_estimate

    t = rt.config.train
    longest = data.loader.longest if t.batching == "longest" else None  # other modes fill max_seq_len
    vocab = getattr(tokenizer, "vocab_size", None)
    plan = training_estimate(rt.config, vocab_size=vocab, seq_len=longest)
    check_weights_fit(plan)
    warning = check_memory_fits(plan, t.allow_memory_overcommit)
    if warning:
        console.say(warning)
    if not rt.has_gpu:
        _set_host_memory(t.host_memory, plan, ctx, console)
    return plan


# what a recipe gives setup(): its data (after the tokenizer) and its objective (after the model)
DataBuilder = Callable[[Runtime, Any, Dict[str, Any], ParallelCtx], TrainData]
ObjectiveBuilder = Callable[[Runtime, TrainData, ModelParts, OptimParts, ParallelCtx, Console], Objective]


def setup(
    loaded: LoadedConfig,
    *,
    demo: DemoData,
    build_data: DataBuilder,
    build_objective: ObjectiveBuilder,
    ctx: Optional[ParallelCtx] = None,
    stream: Optional[TextIO] = None,
) -> Tuple[Parts, TrainState]:
    """Build and check every part of the run, the recipe's data (``demo`` when the config asks for the
    demo task, else ``build_data``) and objective (``build_objective``) among them; returns them with the
    state to start (or resume) from."""
    import paddle

    from bmtrain_cli.parallel.topology import init_parallel
    from bmtrain_cli.train.checkpoint.saving import restore
    from bmtrain_cli.train.monitoring.metrics import MemoryMeter, MetricsWriter
    from bmtrain_cli.train.optimizer.adamw import check_precision_supported
    from bmtrain_cli.train.optimizer.lr_schedule import build_schedule

    started = time.time()
    config = loaded.config
    ctx = ctx if ctx is not None else init_parallel(config)
    console = Console(stream=stream or sys.stdout, is_main=ctx.is_main)
    rt = make_runtime(config, is_main=ctx.is_main)
    check_precision_supported(config.train.precision, rt.has_gpu)
    if not rt.has_gpu:
        paddle.set_device("cpu")
    t = config.train
    seed_everything(t.seed)
    paths = prepare_data(rt, ctx, demo)
    rt.data_paths = dict(paths)
    tokenizer = load_tokenizer(rt, paths, ctx)
    data = build_data(rt, tokenizer, paths, ctx)

    plan = memory_plan(rt, tokenizer, data, ctx, console)
    memory = MemoryMeter(rt.has_gpu)
    try:
        model, optim = build_model_and_optimizer(rt, tokenizer, ctx, console)
    except MemoryError:
        raise _out_of_memory(plan) from None
    objective = build_objective(rt, data, model, optim, ctx, console)
    rt.total_steps = total_steps(config, data.loader, rt.grad_accum_steps)
    schedule = build_schedule(t, rt.derived.learning_rate, rt.total_steps)
    state = TrainState()
    if rt.resume_from is not None:
        state = restore(rt.resume_from, ctx, console, data, model, optim)
    claim_output_dir(rt, ctx, data, model, console)
    memory.training_starts()  # GPU: the reported peak is the training peak, not loading's
    metrics = MetricsWriter(
        rt.output_dir,
        total_steps=rt.total_steps,
        logging_steps=t.logging_steps,
        enabled=ctx.is_main,
        resume_step=state.step if rt.resume_from is not None else None,
        stream=console.stream,
        report_to=t.report_to,
    )
    console.metrics = metrics
    metrics.log_config(config.to_dict())
    parts = Parts(
        config=config,
        runtime=rt,
        ctx=ctx,
        console=console,
        tokenizer=tokenizer,
        data=data,
        model=model,
        optim=optim,
        schedule=schedule,
        memory=memory,
        metrics=metrics,
        started=started,
        objective=objective,
    )
    return parts, state
