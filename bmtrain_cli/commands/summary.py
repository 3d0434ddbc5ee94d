"""A resolved, human-readable summary of a config (printed by validate-config)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

from bmtrain_cli.config.derived import derive
from bmtrain_cli.config.schema import Config
from bmtrain_cli.errors import UserError
from bmtrain_cli.models.arch import arch_from_model_config, lora_parameters_per_layer
from bmtrain_cli.models.param_count import count_parameters


def summarize(config: Config) -> Dict[str, Any]:
    """Resolved values as a flat dict (also the --json output of validate-config)."""
    d = derive(config)
    m, t, p = config.model, config.train, config.parallel
    out: Dict[str, Any] = {
        "world_size": d.world_size,
        "data_parallel": p.data_parallel,
        "tensor_parallel": p.tensor_parallel,
        "pipeline_parallel": p.pipeline_parallel,
        "sharding_parallel": p.sharding_parallel,
        "sharding_stage": p.sharding_stage,
        "expert_parallel": p.expert_parallel,
        "context_parallel": p.context_parallel,
        "context_parallel_mode": p.context_parallel_mode,
        "data_ranks": d.data_ranks,
        "micro_batch_size": d.micro_batch_size,
        "grad_accum_steps": d.grad_accum_steps,
        "global_batch_size": d.global_batch_size,
        "tokens_per_step": d.tokens_per_step,
        "learning_rate": d.learning_rate,
        "lr_scheduler": t.lr_scheduler,
        "precision": t.precision,
        "finetuning": t.finetuning,
    }
    try:
        arch = arch_from_model_config(m, allow_known=True)
    except UserError:
        arch = None
    if arch is not None:
        n = count_parameters(arch)
        out.update(
            family=arch.family,
            source=m.model_name_or_path or "fresh",
            hidden_size=arch.hidden_size,
            num_hidden_layers=arch.num_hidden_layers,
            num_attention_heads=arch.num_attention_heads,
            num_key_value_heads=arch.num_key_value_heads,
            vocab_size=arch.vocab_size,
            parameters=n,
        )
        if t.finetuning == "lora":
            per_layer = lora_parameters_per_layer(arch, t.lora_rank, t.lora_target_modules)
            trainable = per_layer * arch.num_hidden_layers
            out.update(trainable_parameters=trainable, trainable_share=trainable / (n + trainable))
    return out


def with_known_vocab(config: Config) -> Tuple[Config, str]:
    """A fresh model's config with the vocabulary its tokenizer will give it, where that is known before
    training (the demo task's tokenizer, generated in a temporary directory, or one a previous run left
    in output_dir/tokenizer), and a note saying so; else the config unchanged and ""."""
    m = config.model
    if m.model_name_or_path is not None or m.vocab_size is not None:
        return config, ""
    from bmtrain_cli.plan.data_facts import data_facts

    vocab = data_facts(config, need_longest=False).vocab_size
    if vocab is None:
        return config, ""
    what = (
        "the demo task's tokenizer"
        if config.train.demo_data and not config.train.data_path
        else "its tokenizer"
    )
    return config.model_copy(update={"model": m.model_copy(update={"vocab_size": vocab})}), f" ({what})"


def format_summary(config: Config, source: str) -> List[str]:
    config, vocab_note = with_known_vocab(config)
    s = summarize(config)
    lines = [f"config {source}: OK"]
    if "parameters" in s:
        m = config.model
        vocab_assumed = m.model_name_or_path is None and m.vocab_size is None
        lines.append(
            f"  model      {s['family']} ({s['source']}): hidden {s['hidden_size']}, layers {s['num_hidden_layers']}, "
            f"heads {s['num_attention_heads']}/{s['num_key_value_heads']} kv, vocab {s['vocab_size']}"
            + (" (assumed)" if vocab_assumed else vocab_note)
            + f", {s['parameters']:,} parameters"
        )
        if vocab_assumed:
            lines.append(
                "             (a fresh model takes its tokenizer's vocabulary when training starts; set "
                "model_config.vocab_size to fix it)"
            )
        if "trainable_parameters" in s:
            lines.append(
                f"  lora       rank {config.train.lora_rank}: {s['trainable_parameters']:,} trainable parameters "
                f"({100 * s['trainable_share']:.2f}% of the total)"
            )
    lines.append(
        f"  layout     world size {s['world_size']} = data {s['data_parallel']} x tensor {s['tensor_parallel']} x "
        f"pipeline {s['pipeline_parallel']} x sharding {s['sharding_parallel']} (stage {s['sharding_stage']})"
        + (f" x expert {s['expert_parallel']}" if s["expert_parallel"] > 1 else "")
        + (
            f" x context {s['context_parallel']} ({s['context_parallel_mode']})"
            if s["context_parallel"] > 1
            else ""
        )
    )
    lines.append(
        f"  batch      global {s['global_batch_size']} = micro {s['micro_batch_size']} x accumulation "
        f"{s['grad_accum_steps']} x data ranks {s['data_ranks']}; "
        f"up to {s['tokens_per_step']:,} tokens per optimizer step"
    )
    lines.append(
        f"  optimizer  AdamW, lr {s['learning_rate']:.3g} ({s['lr_scheduler']}), precision {s['precision']}"
    )
    from bmtrain_cli.plan.estimator import summary_line

    memory = summary_line(config)
    if memory:
        lines.append(memory)
    return lines
