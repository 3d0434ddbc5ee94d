"""train_config.grpo: TRL's GRPOConfig names and defaults (docs/grpo.md)."""

from __future__ import annotations

from typing import List, Literal, Optional

from pydantic import Field

from bmtrain_cli.config.section import _Section


class GrpoConfig(_Section):
    """stage: grpo (docs/grpo.md): TRL's GRPOConfig names and defaults, as one nested section so that
    beta, epsilon and loss_type keep TRL's names beside the dpo_ keys and adam_epsilon."""

    num_generations: int = Field(8, ge=2, description="Completions sampled per prompt (the group size).")
    max_completion_length: int = Field(512, gt=0, description="New tokens per completion at most.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass of the rollouts.")
    beta: float = Field(0.0, ge=0, description="KL coefficient to the reference; 0 keeps no reference model.")
    epsilon: float = Field(0.2, gt=0, lt=1, description="Lower clipping bound: ratio >= 1 - epsilon.")
    epsilon_high: Optional[float] = Field(
        None, gt=0, description="Upper clipping bound: ratio <= 1 + epsilon_high (default: epsilon)."
    )
    num_iterations: int = Field(
        1, gt=0, description="Optimizer steps per batch of rollouts (the old policy's log-probs kept)."
    )
    loss_type: Literal["grpo", "dr_grpo", "dapo", "bnpo"] = Field(
        "dapo", description="How per-token losses are averaged (TRL's loss_type; docs/grpo.md)."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Divide advantages by the group's reward std, the batch's, or not at all."
    )
    mask_truncated_completions: bool = Field(
        False, description="Leave completions that reached max_completion_length without EOS out of the loss."
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token (GRPO) or per sequence (GSPO)."
    )
    reward_funcs: List[str] = Field(
        default_factory=list,
        description="Built-in rewards (accuracy, format, overlong) or user functions, path/to/file.py:name "
        "or module:name, each f(prompts, completions, **columns) -> list of floats.",
    )
    reward_weights: Optional[List[float]] = Field(
        None, description="Weight per reward function (default: 1 each)."
    )
    answer_column: str = Field("answer", description="The column the accuracy reward compares with.")
    format_pattern: str = Field(
        r"<think>.*?</think>\s*<answer>.*?</answer>",
        description="The regular expression (full match, dot matches newline) the format reward checks.",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="overlong reward: the last this many tokens before max_completion_length are "
        "penalised linearly from 0 to -1 (DAPO's soft overlong punishment; 0: only truncation gives -1).",
    )
    eval_prompts: int = Field(
        64, gt=0, description="Held-out prompts (eval_data_path) scored by greedy decoding at each eval."
    )

    @property
    def upper_epsilon(self) -> float:
        """TRL's epsilon_high: epsilon_high, or epsilon when unset."""
        return self.epsilon if self.epsilon_high is None else self.epsilon_high
