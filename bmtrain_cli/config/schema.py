"""The config schema: one pydantic v2 model per section, unknown keys forbidden.

Field names follow Hugging Face's where one exists. Cross-field checks that need more than one
section live in ``checks.py`` so that each section here stays a plain description of its keys.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Type, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bmtrain_cli.config.derived import Derived, derive
from bmtrain_cli.config.grpo_schema import GrpoConfig
from bmtrain_cli.config.parallel_schema import ParallelConfig
from bmtrain_cli.config.quant_schema import QuantizationConfig
from bmtrain_cli.config.section import Dtype, _Section
from bmtrain_cli.methods import STAGES
from bmtrain_cli.models.families import FAMILY_NAMES
from bmtrain_cli.trackers import NONE, REPORT_TO_NAMES

Family = Literal[FAMILY_NAMES]  # type: ignore[valid-type]  # one choice per module in models/families/
Tracker = Literal[REPORT_TO_NAMES]  # type: ignore[valid-type]  # the names of the trackers' registry
Stage = Literal[STAGES]  # type: ignore[valid-type]  # one choice per training method (methods.py)


class ModelConfig(_Section):
    """Where the model comes from and how it is built."""

    family: Family = Field("llama", description="Model family of a fresh model (ignored for a checkpoint).")
    model_name_or_path: Optional[str] = Field(
        None, description="Hugging Face-style checkpoint directory (config.json + *.safetensors)."
    )
    tokenizer_path: Optional[str] = Field(
        None,
        description="sentencepiece .model, tokenizer.json, or a directory holding one. "
        "Defaults to model_name_or_path; the quickstart trains one when missing.",
    )
    # Architecture of a fresh model (Hugging Face names). None means: the family default, or the value
    # from the checkpoint's config.json when model_name_or_path is set.
    hidden_size: Optional[int] = Field(None, gt=0)
    intermediate_size: Optional[int] = Field(None, gt=0)
    num_hidden_layers: Optional[int] = Field(None, gt=0, le=10_000)  # the plan walks the layers one by one
    num_attention_heads: Optional[int] = Field(None, gt=0)
    num_key_value_heads: Optional[int] = Field(None, gt=0)
    head_dim: Optional[int] = Field(None, gt=0)
    vocab_size: Optional[int] = Field(None, gt=0)
    max_position_embeddings: Optional[int] = Field(None, gt=0)
    rope_theta: Optional[float] = Field(None, gt=0)
    rope_scaling: Optional[Dict[str, Any]] = None
    rms_norm_eps: Optional[float] = Field(None, gt=0)
    tie_word_embeddings: Optional[bool] = None
    attention_bias: Optional[bool] = Field(None, description="q/k/v projection bias (Qwen2 default true).")
    position_embedding: Optional[Literal["rope", "alibi"]] = Field(
        None, description="rope (default) or alibi (Baichuan 13B)."
    )
    sliding_window: Optional[int] = Field(
        None, gt=0, description="Local attention window (Mistral, Phi-3; Gemma 3's sliding layers)."
    )
    initializer_range: float = Field(0.02, gt=0)
    # mixture of experts (qwen3_moe, mixtral, ernie4_5_moe)
    num_experts: Optional[int] = Field(None, gt=0, description="Experts per sparse layer.")
    num_experts_per_tok: Optional[int] = Field(None, gt=0, description="Experts each token is routed to.")
    moe_intermediate_size: Optional[int] = Field(None, gt=0, description="Width of each expert's MLP.")
    output_router_logits: Optional[bool] = Field(
        None, description="Add router_aux_loss_coef x the load-balancing loss to the training loss."
    )
    router_aux_loss_coef: Optional[float] = Field(None, ge=0)
    # the sigmoid group-limited router (glm4_moe, deepseek_v3) and DeepSeek-V3's multi-head latent
    # attention, as config.json names them; each only for the families whose config.json has it
    norm_topk_prob: Optional[bool] = Field(None, description="Renormalise the top-k routing weights.")
    n_shared_experts: Optional[int] = Field(None, ge=0, description="Always-on experts beside the routed.")
    first_k_dense_replace: Optional[int] = Field(None, ge=0, description="Leading dense (non-MoE) layers.")
    n_group: Optional[int] = Field(None, gt=0, description="Expert groups of group-limited routing.")
    topk_group: Optional[int] = Field(None, gt=0, description="Best groups a token's experts come from.")
    routed_scaling_factor: Optional[float] = Field(None, gt=0, description="Routing weights times this.")
    q_lora_rank: Optional[int] = Field(None, ge=0, description="Query latent width (0: one q_proj).")
    kv_lora_rank: Optional[int] = Field(None, gt=0, description="Key/value latent width.")
    qk_nope_head_dim: Optional[int] = Field(None, gt=0, description="Per-head q/k part without rope.")
    qk_rope_head_dim: Optional[int] = Field(None, gt=0, description="Per-head q/k part with rope.")
    v_head_dim: Optional[int] = Field(None, gt=0, description="Per-head value width.")

    dtype: Dtype = "float32"
    attention_implementation: Literal["auto", "sdpa", "flash", "eager"] = "auto"
    kernels: Literal["auto", "custom", "paddle", "reference"] = "auto"
    max_seq_len: int = Field(512, gt=0, description="Longest training sequence in tokens.")
    quantization: Optional[QuantizationConfig] = Field(
        None, description="Store the frozen base low-bit (QLoRA, finetuning: lora only); docs/qlora.md."
    )


class TrainConfig(_Section):
    """Data, optimisation, precision, checkpointing and logging."""

    # data
    data_path: Optional[Union[str, List[str]]] = Field(
        None,
        description="JSONL file(s), globs or directories. Unset with demo_data set: the generated demo task.",
    )
    dataset: Optional[Union[str, List[str]]] = Field(
        None, description="LLaMA-Factory registry names (dataset_dir/dataset_info.json); sets data_path."
    )
    dataset_dir: str = Field("data", description="The directory holding dataset_info.json.")
    data_weights: Optional[List[float]] = Field(None, description="Mixing weight per data_path entry.")
    eval_data_path: Optional[Union[str, List[str]]] = None
    data_format: Literal["auto", "input_output", "alpaca", "chat", "text"] = "auto"
    template: str = Field("auto", description="auto (the tokenizer's chat template) or a built-in name.")
    train_on_prompt: bool = False
    mask_history: bool = Field(False, description="Train only the last assistant turn of each conversation.")
    train_reasoning: bool = Field(
        True, description="Train the assistant's reasoning (<think>...</think>); false masks it."
    )
    enable_thinking: Optional[bool] = Field(
        None, description="Passed to the chat template as enable_thinking (unset: the template's default)."
    )
    history_reasoning: Literal["template", "drop"] = Field(
        "template",
        description="Reasoning of earlier assistant turns: as the chat template renders it, or dropped.",
    )
    batching: Literal["max_length", "longest", "packed"] = Field(
        "longest", description="Pad to max_seq_len, pad to the longest in the batch, or pack rows."
    )
    truncation: Literal["left", "drop"] = "left"
    shuffle: bool = True
    shuffle_buffer: int = Field(
        10000, ge=1, description="Streaming: records shuffled together (and held in memory) at a time."
    )
    num_workers: int = Field(1, ge=0)
    streaming: Union[bool, Literal["auto"]] = Field(
        "auto",
        description="Read and tokenise the training data while training (true), tokenise it all into "
        "the cache first (false), or stream from 1 GiB of data files when max_steps is set (auto).",
    )
    data_workers: Optional[int] = Field(
        None, ge=0, description="Tokenizer processes (streaming and the cache build); default: half the CPUs."
    )
    on_bad_record: Literal["error", "skip"] = "error"
    host_memory: Literal["auto", "reuse", "release"] = Field(
        "auto",
        description="CPU training: keep freed tensor memory for reuse (faster, higher peak RSS), return it "
        "to the OS (release), or reuse when twice the memory plan fits in RAM (auto).",
    )
    allow_memory_overcommit: bool = Field(
        False,
        description="Start even when the memory plan exceeds the device's memory (the host's on a CPU); "
        "by default such a run is refused before anything is allocated.",
    )
    data_cache_dir: Optional[str] = Field(
        None, description="Token cache directory (default: beside the data)."
    )
    demo_data: Optional[Literal["reverse", "rotate", "arithmetic"]] = Field(
        None,
        description="Generate the built-in demo task (train + held-out split) under output_dir/data "
        "and train on it when data_path is not set.",
    )

    # run
    output_dir: str = "output"
    overwrite_output_dir: bool = False
    num_train_epochs: float = Field(1.0, gt=0)
    max_steps: Optional[int] = Field(None, gt=0, description="Optimizer steps; overrides num_train_epochs.")
    micro_batch_size: int = Field(1, gt=0)
    global_batch_size: Optional[int] = Field(
        None, gt=0, description="Samples per optimizer step. Default: micro_batch_size x data ranks."
    )

    # optimisation
    learning_rate: float = Field(2e-5, gt=0)
    scale_lr: bool = Field(False, description="Linear scaling rule: lr = learning_rate x global_batch / 256.")
    min_lr: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    warmup_ratio: float = Field(0.0, ge=0, lt=1)
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    max_grad_norm: Optional[float] = Field(1.0, ge=0, description="Global-norm clipping; null or 0 disables.")

    # precision and memory
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    amp_level: Literal["O1", "O2"] = "O2"
    loss_scale: float = Field(32768.0, gt=0, description="Initial dynamic loss scale (fp16).")
    gradient_checkpointing: bool = False
    recompute_granularity: Literal["full", "attention", "none"] = "full"
    recompute_num_layers: Optional[int] = Field(None, ge=0, description="Layers to recompute (default all).")
    to_static: bool = Field(False, description="Compile the training step with paddle.jit.to_static.")

    # fine-tuning method
    finetuning: Literal["full", "lora"] = "full"
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_dropout: float = Field(0.0, ge=0, lt=1)
    lora_target_modules: Union[str, List[str]] = Field(default_factory=lambda: ["q_proj", "v_proj"])

    # preference tuning (stage: dpo; docs/preference.md). Names follow TRL's DPOConfig/CPOConfig with a
    # dpo_ prefix where TRL's name (beta, loss_type, label_smoothing) would be ambiguous in this section.
    stage: Stage = Field(
        "sft",
        description="sft: instruction tuning; dpo: preference pairs (prompt, chosen, rejected); grpo: "
        "reinforcement learning from reward functions on prompts.",
    )
    recipe: Optional[str] = Field(
        None,
        description="A recipe file (.py defining recipe(loaded, stream=None, on_step=None)) to train "
        "with instead of the stage's built-in one (recipes/<stage>.py); `bmtrain train --recipe`.",
    )
    dpo_loss: Literal["sigmoid", "ipo", "simpo", "orpo"] = Field(
        "sigmoid", description="Preference loss (TRL's loss_type): sigmoid (DPO), ipo, simpo, orpo."
    )
    dpo_beta: float = Field(
        0.1, gt=0, description="TRL's beta: DPO/SimPO temperature, IPO's tau, ORPO's lambda."
    )
    dpo_label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Conservative DPO / SimPO: probability that a pair's label is flipped."
    )
    simpo_gamma: float = Field(0.5, ge=0, description="SimPO target reward margin (TRL's simpo_gamma).")
    precompute_ref_log_probs: bool = Field(
        False,
        description="Compute the reference log-probs once before training and cache them with the data.",
    )
    grpo: GrpoConfig = Field(
        default_factory=GrpoConfig, description="stage: grpo: rollouts, rewards and loss (docs/grpo.md)."
    )

    # bookkeeping
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Seed of Python, NumPy and Paddle (0 .. 2**32-1).")
    logging_steps: int = Field(10, gt=0)
    report_to: List[Tracker] = Field(
        default_factory=lambda: ["tensorboard"],
        description="Experiment trackers (docs/training.md): tensorboard, visualdl, wandb, swanlab, mlflow, "
        "or none; a single name is a list of one.",
    )
    eval_steps: Optional[int] = Field(None, gt=0)
    save_steps: Optional[int] = Field(500, gt=0)
    save_total_limit: Optional[int] = Field(3, gt=0)
    resume: Union[bool, str] = Field(False, description="false, true/auto (latest checkpoint), or a path.")
    max_nonfinite_steps: int = Field(5, gt=0, description="Stop after this many consecutive bad steps.")

    @field_validator("data_path", "eval_data_path")
    @classmethod
    def _non_empty_paths(cls, v: Optional[Union[str, List[str]]]) -> Optional[Union[str, List[str]]]:
        if isinstance(v, list) and not v:
            raise ValueError("must name at least one file")
        if isinstance(v, str) and not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("report_to")
    @classmethod
    def _none_alone(cls, v: List[str]) -> List[str]:
        if NONE in v and len(v) > 1:
            raise ValueError("none reports to no tracker: list trackers or none, not both")
        if len(set(v)) != len(v):
            raise ValueError("a tracker is listed twice")
        return v

    @field_validator("lora_rank")
    @classmethod
    def _rank_positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("lora_rank must be > 0 (typical values: 8, 16, 64)")
        return v

    @model_validator(mode="after")
    def _warmup_one_form(self) -> TrainConfig:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        if self.data_weights is not None:
            paths = self.data_path if isinstance(self.data_path, list) else [self.data_path]
            if len(self.data_weights) != len(paths):
                raise ValueError(
                    f"data_weights has {len(self.data_weights)} entries but data_path has {len(paths)}"
                )
            if any(w <= 0 for w in self.data_weights):
                raise ValueError("data_weights must all be > 0")
        return self


class Config(BaseModel):
    """The whole config file. ``parallel:`` is accepted as a synonym of ``parallel_config:``."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    # Attribute names are short (cfg.model, cfg.train, cfg.parallel); the file uses the section names.
    model: ModelConfig = Field(default_factory=ModelConfig, alias="model_config")
    train: TrainConfig = Field(default_factory=TrainConfig, alias="train_config")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, alias="parallel_config")

    @model_validator(mode="before")
    @classmethod
    def _parallel_synonym(cls, data: Any) -> Any:
        if isinstance(data, dict) and "parallel" in data:
            if "parallel_config" in data:
                raise ValueError("give either `parallel` or `parallel_config`, not both")
            data = dict(data)
            data["parallel_config"] = data.pop("parallel")
        return data

    def to_dict(self) -> Dict[str, Any]:
        """Plain dict with the file's section names (for saving the resolved config)."""
        return self.model_dump(mode="json", by_alias=True)

    def derived(self) -> Derived:
        """The values derived from the settings (config/derived.py): batch arithmetic, the scaled rate.
        A method, so that parts handed the config (the data loaders) need not import the config package."""
        return derive(self)


def json_schema() -> Dict[str, Any]:
    """The JSON Schema of a config file (`bmtrain schema`), with ``parallel:`` listed as the synonym of
    ``parallel_config:`` that the loader accepts (one of the two, not both)."""
    schema = Config.model_json_schema(by_alias=True)
    ref = schema["properties"]["parallel_config"]["$ref"]
    schema["properties"]["parallel"] = {"$ref": ref, "description": "Synonym of parallel_config."}
    schema["not"] = {"required": ["parallel", "parallel_config"]}
    return schema


SECTION_MODELS: Dict[str, Type[BaseModel]] = {
    "model_config": ModelConfig,
    "train_config": TrainConfig,
    "parallel_config": ParallelConfig,
}
