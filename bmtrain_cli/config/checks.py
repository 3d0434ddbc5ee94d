"""Cross-field checks: things no single section can decide alone.

Each check appends a Problem with the dotted path of the field to blame; ``load.py`` maps paths to
file positions. ``mode="train"`` turns machine-dependent warnings into errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Tuple

from bmtrain_cli.config.context_checks import check_context
from bmtrain_cli.config.derived import peak_learning_rate, schedule_problems
from bmtrain_cli.config.expert_checks import check_expert_parallel
from bmtrain_cli.config.grpo_checks import check_grpo
from bmtrain_cli.config.linear_checks import check_linear_attention
from bmtrain_cli.config.moe_checks import check_moe
from bmtrain_cli.config.moe_size_checks import check_family_keys
from bmtrain_cli.config.preference_checks import check_preference
from bmtrain_cli.config.quant_checks import check_quantization
from bmtrain_cli.config.recipe_checks import check_recipe
from bmtrain_cli.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from bmtrain_cli.errors import Problem, UserError
from bmtrain_cli.machine import paddle_has_gpu
from bmtrain_cli.models.arch import (
    LORA_PROJECTIONS,
    ModelArch,
    arch_from_model_config,
    arch_problems,
    arch_projections,
)
from bmtrain_cli.models.families import family
from bmtrain_cli.trackers import missing as missing_trackers


def _nearest_multiples(value: int, unit: int) -> str:
    lo = (value // unit) * unit
    hi = lo + unit
    return " or ".join(str(x) for x in (lo, hi) if x > 0)


def cpu_gloo_subgroups(p: ParallelConfig) -> List[str]:
    """The groups fleet's topology creates (one per degree, and the clip/check groups of world / data and
    world / sharding ranks) that have 3+ ranks but not the whole world, described for the message. Such a
    gloo group fails in ProcessGroupGloo's connect ("address.cc:30 sizeof(impl_) == bytes.size()", seen
    for dp2 x pp3 and dp2 x tp2 x pp2)."""
    world = p.world_size
    data = p.data_parallel * p.context_parallel * p.expert_parallel  # context and expert groups lie inside it
    sizes = {
        "data": data,
        "tensor": p.tensor_parallel,
        "pipeline": p.pipeline_parallel,
        "sharding": p.sharding_parallel,
        "clip-check": world // data,
        "context": p.context_parallel,
        "expert": p.expert_parallel,
        "expert-replica": p.data_parallel if p.expert_parallel > 1 else 1,
    }
    if p.sharding_parallel > 1:
        sizes["sharding-check"] = world // p.sharding_parallel
    return [f"{n} ({name})" for name, n in sizes.items() if 3 <= n < world]


def fresh_vocab_size(configured: Optional[int], tokenizer_vocab: int, tokenizer: str) -> int:
    """The vocabulary of a fresh model: model_config.vocab_size when set (it may pad the tokenizer's, e.g.
    to a multiple of tensor_parallel), else the tokenizer's. A smaller size than the tokenizer's is
    refused: the tokenizer's larger ids would have no embedding row."""
    if configured is None:
        return tokenizer_vocab
    if configured < tokenizer_vocab:
        raise UserError(
            f"vocab_size ({configured}) is smaller than the {tokenizer_vocab} tokens of {tokenizer}: its "
            "larger token ids would have no embedding; remove vocab_size (a fresh "
            f"model takes the tokenizer's) or set it to at least {tokenizer_vocab}"
        )
    return configured


def tokenizer_fits(model_vocab: int, tokenizer_vocab: int, tokenizer: str) -> None:
    """A pretrained model's embedding must have a row for every id of the tokenizer it is trained with."""
    if tokenizer_vocab > model_vocab:
        raise UserError(
            f"{tokenizer} has {tokenizer_vocab} tokens but the model's vocab_size is {model_vocab}: its larger "
            "token ids would have no embedding row; use the model's own tokenizer (leave tokenizer_path unset "
            "when the checkpoint directory holds one)"
        )


def _tokenizer_vocab(m: ModelConfig) -> Tuple[Optional[int], str]:
    """(vocabulary size, description) of the tokenizer a fresh model will be trained with, when known
    without training one: the smallest vocabulary of a generated tokenizer, or tokenizer_path's."""
    from bmtrain_cli.data.tokenizers import MIN_GENERATED_VOCAB, load_tokenizer

    if m.tokenizer_path is None:
        return MIN_GENERATED_VOCAB, "the smallest tokenizer generated from data"
    try:
        return load_tokenizer(m.tokenizer_path).vocab_size, f"the tokenizer {m.tokenizer_path}"
    except UserError:  # a missing or broken tokenizer is reported when training loads it
        return None, ""


# C901: one flat list of independent rules, each an `if` that appends a Problem; splitting it would only
# scatter the one validation authority (the to_static / precision / gloo refusals live here too).
def loss_masking_problems(t: TrainConfig) -> List[Tuple[str, str, str]]:
    """(path, message, suggestion) for loss options that train_on_prompt (every token trained) voids."""
    out = []
    if t.train_on_prompt and t.mask_history:
        out.append(
            (
                "train_config.mask_history",
                "mask_history: true (train only the last assistant turn) contradicts train_on_prompt: true "
                "(train every token)",
                "set one of them to false",
            )
        )
    if t.train_on_prompt and not t.train_reasoning:
        out.append(
            (
                "train_config.train_reasoning",
                "train_reasoning: false (mask the reasoning) contradicts train_on_prompt: true (train every token)",
                "set train_on_prompt: false",
            )
        )
    return out


def check_config(  # noqa: C901
    config: Config,
    *,
    mode: str = "validate",
    world_size: Optional[int] = None,
    has_gpu: Optional[bool] = None,
) -> List[Problem]:
    problems: List[Problem] = []
    strict = mode == "train"

    def err(path: str, msg: str, suggestion: Optional[str] = None) -> None:
        problems.append(Problem(msg, path=path, suggestion=suggestion))

    def warn(path: str, msg: str, suggestion: Optional[str] = None) -> None:
        problems.append(Problem(msg, path=path, suggestion=suggestion, severity="warning"))

    m, t, p = config.model, config.train, config.parallel

    # --- architecture vs layout
    arch: Optional[ModelArch] = None
    try:
        arch = arch_from_model_config(m, allow_known=not strict)
        if not strict and m.model_name_or_path and not Path(m.model_name_or_path).exists():
            warn(
                "model_config.model_name_or_path",
                f"{m.model_name_or_path} is not present on this machine; checked against its published "
                "architecture",
            )
    except UserError as exc:
        (err if strict else warn)(
            "model_config.model_name_or_path",
            f"{exc} (architecture checks skipped)",
        )
    if arch is not None:
        for key, message in arch_problems(arch):
            err(f"model_config.{key}", message)
        tp = p.tensor_parallel
        if arch.num_attention_heads % tp:
            err(
                "parallel_config.tensor_parallel",
                f"num_attention_heads ({arch.num_attention_heads}) is not divisible by tensor_parallel ({tp})",
                "use a tensor_parallel degree that divides the number of heads",
            )
        if arch.num_key_value_heads % tp:
            err(
                "parallel_config.tensor_parallel",
                f"num_key_value_heads ({arch.num_key_value_heads}) is not divisible by tensor_parallel ({tp})",
                "use a tensor_parallel degree that divides the number of key/value heads",
            )
        if tp > 1 and arch.vocab_size % tp:
            err(
                "model_config.vocab_size",
                f"vocab_size ({arch.vocab_size}) is not divisible by tensor_parallel ({tp}); "
                "the vocabulary is split evenly across tensor-parallel ranks",
                f"pad the vocabulary to a multiple of {tp}, e.g. {_nearest_multiples(arch.vocab_size, tp)}",
            )
        if tp > 1 and arch.intermediate_size % tp:
            err(
                "model_config.intermediate_size",
                f"intermediate_size ({arch.intermediate_size}) is not divisible by tensor_parallel ({tp})",
            )
        if arch.num_hidden_layers < p.pipeline_parallel:
            err(
                "parallel_config.pipeline_parallel",
                f"pipeline_parallel ({p.pipeline_parallel}) exceeds num_hidden_layers ({arch.num_hidden_layers}): "
                "every stage needs at least one layer",
                f"use at most {arch.num_hidden_layers} stages",
            )
        if t.recompute_num_layers is not None and t.recompute_num_layers > arch.num_hidden_layers:
            err(
                "train_config.recompute_num_layers",
                f"{t.recompute_num_layers} exceeds num_hidden_layers ({arch.num_hidden_layers})",
            )
        if m.max_seq_len > arch.max_position_embeddings:
            warn(
                "model_config.max_seq_len",
                f"max_seq_len ({m.max_seq_len}) exceeds max_position_embeddings ({arch.max_position_embeddings})",
                "the model was not trained on positions this long; consider rope_scaling",
            )
        if (
            arch.hidden_size != arch.num_attention_heads * arch.head_dim
            and not family(arch.family).free_head_dim
        ):
            if m.head_dim is None and not m.model_name_or_path:
                err(
                    "model_config.hidden_size",
                    f"hidden_size ({arch.hidden_size}) is not divisible by num_attention_heads "
                    f"({arch.num_attention_heads})",
                    "set head_dim explicitly or change the sizes",
                )

    # the tokenizer's ids against the embedding: a pretrained model's rows, or a fresh model's vocab_size
    pretrained = arch is not None and m.model_name_or_path and m.tokenizer_path
    if pretrained or (m.vocab_size is not None and not m.model_name_or_path):
        known, tokenizer = _tokenizer_vocab(m)
        if known is not None:
            try:
                if arch is not None and pretrained:
                    tokenizer_fits(arch.vocab_size, known, tokenizer)
                else:
                    fresh_vocab_size(m.vocab_size, known, tokenizer)
            except UserError as exc:
                err("model_config.tokenizer_path" if pretrained else "model_config.vocab_size", str(exc))

    for path, message, suggestion in loss_masking_problems(t):
        err(path, message, suggestion)

    # --- batch arithmetic
    data_ranks = p.data_ranks
    per_pass = t.micro_batch_size * data_ranks
    if t.global_batch_size is not None and t.global_batch_size % per_pass:
        err(
            "train_config.global_batch_size",
            f"global_batch_size ({t.global_batch_size}) must equal micro_batch_size ({t.micro_batch_size}) x "
            f"gradient accumulation x data ranks (data_parallel {p.data_parallel} x sharding_parallel "
            f"{p.sharding_parallel}{f' x expert_parallel {p.expert_parallel}' if p.expert_parallel > 1 else ''}), so it must be a multiple of {per_pass}",
            f"try {_nearest_multiples(t.global_batch_size, per_pass)}",
        )
    if (
        p.pipeline_parallel > 1
        and p.pipeline_micro_batches is not None
        and t.global_batch_size is not None
        and (t.global_batch_size // data_ranks) % p.pipeline_micro_batches
    ):
        err(
            "parallel_config.pipeline_micro_batches",
            f"the per-rank batch ({t.global_batch_size // data_ranks}) is not divisible by "
            f"pipeline_micro_batches ({p.pipeline_micro_batches})",
        )

    # --- world size
    expert = f" x expert {p.expert_parallel}" if p.expert_parallel > 1 else ""
    if world_size is not None and world_size != p.world_size:
        err(
            "parallel_config",
            f"the product of the degrees (data {p.data_parallel} x tensor {p.tensor_parallel} x pipeline "
            f"{p.pipeline_parallel} x sharding {p.sharding_parallel} x context {p.context_parallel}{expert} = "
            f"{p.world_size}) does not match the "
            f"{world_size} launched processes",
            f"launch {p.world_size} processes (bmtrain run does) or change the degrees",
        )

    # --- gloo (the CPU build): a process group of 3+ ranks that is not the whole world fails to connect
    if p.world_size > 2 and not (paddle_has_gpu() if has_gpu is None else has_gpu):
        groups = cpu_gloo_subgroups(p)
        if groups:
            msg = (
                f"this layout needs process groups of {' and '.join(groups)} ranks inside a world of "
                f"{p.world_size}; on the CPU build Paddle's gloo cannot connect a group of 3 or more ranks "
                "that is not the whole world"
            )
            hint = (
                "on CPU use degrees of 2 beside each other, or one degree equal to the world size (e.g. pp4)"
            )
            if strict:
                err("parallel_config", msg, hint)
            else:
                warn("parallel_config", msg + "; training on this machine would refuse", hint)

    # --- sharding / offload
    if p.sharding_stage in (2, 3) and p.pipeline_parallel > 1:
        err(
            "parallel_config.sharding_stage",
            f"sharding stage {p.sharding_stage} cannot be combined with pipeline_parallel > 1 (Paddle does not "
            "support the pair)",
            "use sharding_stage: 1 with pipeline parallel",
        )
    if p.offload_params and p.sharding_stage != 3:
        err(
            "parallel_config.offload_params",
            "parameter offload needs sharding_stage: 3",
            "set sharding_stage: 3 or use offload_optimizer alone",
        )
    elif p.offload_params and p.sharding_parallel <= 1:
        err(
            "parallel_config.offload_params",
            "parameter offload runs through group-sharded stage 3, which needs sharding_parallel > 1: with "
            f"sharding_parallel {p.sharding_parallel} it would not be applied",
            "use offload_optimizer: true instead (it works on one device), or set sharding_parallel > 1",
        )
    # --- pipeline rebalancing: the boundaries move at a checkpoint of a pipeline-parallel run
    if p.pipeline_rebalance.enabled:
        if p.pipeline_parallel == 1:
            warn(
                "parallel_config.pipeline_rebalance.enabled",
                "pipeline_rebalance has no effect with pipeline_parallel 1 (there are no stage boundaries)",
            )
        else:
            if not t.save_steps:
                err(
                    "parallel_config.pipeline_rebalance.enabled",
                    "pipeline_rebalance moves the stage boundaries at a checkpoint, and without "
                    "train_config.save_steps the only checkpoint is the last one",
                    f"set train_config.save_steps (a multiple of check_every, {p.pipeline_rebalance.check_every})",
                )
            if p.sharding_parallel > 1:
                err(
                    "parallel_config.pipeline_rebalance.enabled",
                    "pipeline_rebalance is implemented for pipeline parallel with data and tensor parallel, "
                    "not with sharding (whose optimizer splits its state by its own ownership)",
                    "use data_parallel instead of sharding_parallel, or disable pipeline_rebalance",
                )
    if p.gradient_compression != "none" and p.data_ranks == 1:
        warn(
            "parallel_config.gradient_compression",
            "gradient compression only applies to the data-parallel all-reduce, and data_parallel is 1",
        )
    if p.gradient_compression != "none" and p.sharding_parallel > 1:
        err(
            "parallel_config.gradient_compression",
            "gradient compression is implemented for plain data parallel, not with sharding",
        )

    # --- schedule
    if t.max_steps is not None and t.warmup_steps >= t.max_steps:
        err(
            "train_config.warmup_steps",
            f"warmup_steps ({t.warmup_steps}) must be shorter than training (max_steps {t.max_steps})",
            f"use fewer warmup steps, e.g. {max(0, t.max_steps // 10)}",
        )
    peak_lr = peak_learning_rate(t.learning_rate, t.scale_lr, t.global_batch_size or per_pass)
    for message in schedule_problems(t.min_lr, peak_lr, t.lr_scheduler):
        hint = "scale_lr: true multiplies learning_rate by global_batch / 256; lower min_lr to match"
        err("train_config.min_lr", message, hint if t.scale_lr else "lower min_lr")

    # --- precision
    if t.precision != "fp32":
        gpu = paddle_has_gpu() if has_gpu is None else has_gpu
        if not gpu:
            msg = (
                f"precision {t.precision} needs a GPU build of Paddle: on the CPU build AMP does nothing and "
                "bf16/fp16 matmuls have no kernel"
            )
            if strict:
                err("train_config.precision", msg, "use precision: fp32 on this machine")
            else:
                warn("train_config.precision", msg + "; training on this machine would refuse")

    # --- sharding stage 2/3 (Paddle's group-sharded API refuses the CPU build)
    if p.sharding_parallel > 1 and p.sharding_stage in (2, 3):
        gpu = paddle_has_gpu() if has_gpu is None else has_gpu
        if not gpu:
            msg = (
                f"sharding_stage {p.sharding_stage}"
                + (" with offload" if p.offload_optimizer or p.offload_params else "")
                + " needs a GPU build of Paddle (group_sharded_parallel supports only gpu, xpu and custom "
                "devices)"
            )
            if strict:
                err("parallel_config.sharding_stage", msg, "use sharding_stage: 1 on this machine")
            else:
                warn("parallel_config.sharding_stage", msg + "; training on this machine would refuse")

    # --- to_static: the compiled step cannot contain fleet's eager schedules and collectives
    if t.to_static:
        eager_parts = [
            (
                p.pipeline_parallel > 1,
                "pipeline_parallel > 1",
                "fleet's 1F1B scheduler runs each stage eagerly",
            ),
            (
                p.sharding_parallel > 1 and p.sharding_stage in (2, 3),
                "sharding_stage 2/3",
                "the group-sharded wrapper gathers and releases parameters around an eager forward",
            ),
            (
                p.tensor_parallel > 1,
                "tensor_parallel > 1",
                "the tensor-parallel layers communicate inside the forward through eager collectives",
            ),
        ]
        for refused, what, why in eager_parts:
            if refused:
                err(
                    "train_config.to_static",
                    f"to_static cannot be combined with {what}: {why}",
                    "set to_static: false for this layout",
                )

    # --- LoRA
    if t.finetuning == "lora":
        if not m.model_name_or_path:
            warn(
                "train_config.finetuning",
                "LoRA on a fresh, randomly initialised model: the base weights stay random and frozen, so "
                "only the small adapters learn",
                "set model_config.model_name_or_path to a pretrained checkpoint, or use finetuning: full",
            )
        targets = [t.lora_target_modules] if isinstance(t.lora_target_modules, str) else t.lora_target_modules
        for name in targets:
            if name not in LORA_PROJECTIONS and name != "all-linear":
                err(
                    "train_config.lora_target_modules",
                    f"unknown target module {name!r}",
                    f"available: {', '.join(LORA_PROJECTIONS)}, all-linear",
                )
        if arch is not None:  # names this architecture does not have (Baichuan fuses q/k/v into W_pack)
            present = arch_projections(arch)
            for name in targets:
                if name in LORA_PROJECTIONS and name not in present:
                    err(
                        "train_config.lora_target_modules",
                        f"target module not in this model ({arch.family}): {name!r}",
                        f"available: {', '.join(present)}, all-linear",
                    )

    check_moe(config, arch, err)
    check_family_keys(m, arch, err)
    check_linear_attention(config, arch, err)
    check_quantization(config, arch, err)
    check_preference(config, err, warn)
    check_grpo(config, err)
    check_recipe(config, err)
    check_context(config, arch, err)
    check_expert_parallel(config, arch, err)

    # --- data
    if "shuffle_buffer" in t.model_fields_set and t.streaming is False:
        warn(
            "train_config.shuffle_buffer",
            "not used with streaming: false: the cached loader shuffles each epoch with a seeded permutation "
            "over the token cache (docs/data.md)",
        )
    if t.streaming is True and t.stage == "dpo":
        err(
            "train_config.streaming",
            "streaming reads SFT records; preference pairs (stage: dpo) are read through the token cache",
            "set streaming: false (or leave it at auto) for stage: dpo",
        )
    if t.streaming is True and t.max_steps is None:
        err(
            "train_config.streaming",
            "streaming cannot count the batches of an epoch without reading all the data first, so the "
            "run length and learning-rate schedule need max_steps",
            "set train_config.max_steps, or streaming: false to tokenise the data into the cache first",
        )
    if t.eval_steps is not None and t.eval_data_path is None and t.demo_data is None:
        warn("train_config.eval_steps", "eval_steps is set but there is no eval_data_path; no eval will run")
    for backend in missing_trackers(t.report_to):
        err(
            "train_config.report_to",
            f"report_to: {backend.name} needs the {backend.package} package, which is not installed",
            f"{backend.install} (or remove {backend.name} from report_to)",
        )
    if strict and t.data_path is None and t.demo_data is None:
        err(
            "train_config.data_path",
            "no training data",
            "set train_config.data_path, pass --data_path, or set demo_data: arithmetic",
        )
    return problems


def missing_data(config: Config) -> List[Problem]:
    """data_path / eval_data_path entries that name no file here (a missing file, a glob that matches
    nothing, an empty directory): the loader would refuse them at the first step. The demo task, which
    is generated, has no data_path. Checked by `bmtrain validate-config` (load_config(require_data=True));
    `bmtrain plan` sizes a run whose data may live on the cluster."""
    from bmtrain_cli.data.readers import as_list, resolve_source

    out = []
    for key in ("data_path", "eval_data_path"):
        specs = as_list(getattr(config.train, key))
        for i, spec in enumerate(specs):
            try:
                resolve_source(spec)
            except UserError as exc:
                path = f"train_config.{key}" + (
                    f".{i}" if isinstance(getattr(config.train, key), list) else ""
                )
                out.append(Problem(str(exc), path=path, suggestion="check the path"))
    return out
