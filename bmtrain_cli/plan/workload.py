"""What the memory estimator reasons about: the training workload (model, batch, precision, options), the
parallel layout, and the per-device estimate it returns; the constants of the memory model."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, List, Optional, Tuple

from bmtrain_cli.methods import GRPO_EVAL_ROWS, METHODS, Method
from bmtrain_cli.models.arch import (
    ModelArch,
    lora_targets,
)
from bmtrain_cli.plan.devices import Device, format_bytes
from bmtrain_cli.preference.reference_kind import NO_REFERENCE, reference_kind

# --- CPU: the process around the tensors (Python, Paddle's libraries and thread pools; ~0.4 GiB resident
# on Paddle 3.3.1), counted by the fit check only. See docs/plan.md "What is measured".
CPU_RUNTIME_BYTES = 512 << 20
# --- GPU allocator headroom for the fit check (auto_growth fragmentation)
GPU_FRAGMENTATION = 0.05
DP_BUCKET_BYTES = 25 << 20  # Paddle's fused gradient all-reduce bucket
# score-sized [b, heads, block, s] fp32 temporaries alive at once in the blocked attention's backward:
# the probabilities, the gradient of the probabilities and the intermediate products of the score gradient
# (counted from models/attention.py; the calibration cases with long rows and few heads agree)
BLOCKED_TEMPORARIES = 6
# fp32 [b, heads, block, block] temporaries alive at once in the ring attention's backward: the scores,
# their probabilities, the gradient of the probabilities and the products of the score gradient
RING_TEMPORARIES = 5


@dataclass(frozen=True)
class Layout:
    """A parallel layout and the memory-relevant training options."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: int = 1
    stage: int = 1
    micro_batch: int = 1
    recompute: str = "none"  # none | full | attention
    recompute_layers: Optional[int] = None  # first N layers (None: all)
    offload_optimizer: bool = False
    offload_params: bool = False
    pipeline_micro_batches: Optional[int] = None
    cp: int = 1  # context parallel: ranks that split every row
    cp_mode: str = "ring"  # ring | ulysses (parallel/ulysses.py): how the attention sees the rows
    ep: int = 1  # expert parallel: ranks that split the experts (a data axis: each sees its own data)

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.sharding * self.cp * self.ep

    @property
    def data_ranks(self) -> int:
        return self.dp * self.sharding * self.ep

    @classmethod
    def from_config(cls, config: Any) -> Layout:
        p, t = config.parallel, config.train
        granularity = t.recompute_granularity if t.gradient_checkpointing else "none"
        return cls(
            dp=p.data_parallel,
            tp=p.tensor_parallel,
            pp=p.pipeline_parallel,
            sharding=p.sharding_parallel,
            stage=p.sharding_stage,
            micro_batch=t.micro_batch_size,
            recompute=granularity,
            recompute_layers=t.recompute_num_layers if granularity != "none" else None,
            offload_optimizer=p.offload_optimizer,
            offload_params=p.offload_params,
            pipeline_micro_batches=p.pipeline_micro_batches,
            cp=p.context_parallel,
            cp_mode=p.context_parallel_mode if p.context_parallel > 1 else "ring",
            ep=p.expert_parallel,
        )

    def describe(self) -> str:
        parts = [f"dp {self.dp}", f"tp {self.tp}", f"pp {self.pp}"]
        if self.sharding > 1:
            parts.append(f"sharding {self.sharding} (stage {self.stage})")
        if self.cp > 1:
            parts.append(f"context {self.cp}" + (" (ulysses)" if self.cp_mode == "ulysses" else ""))
        if self.ep > 1:
            parts.append(f"expert {self.ep}")
        parts.append(f"micro batch {self.micro_batch}")
        parts.append("recompute " + (self.recompute if self.recompute != "none" else "off"))
        if self.offload_optimizer:
            parts.append("optimizer offload")
        if self.offload_params:
            parts.append("parameter offload")
        return ", ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What is trained: the architecture and the per-sample shape, precision and method."""

    arch: ModelArch
    seq_len: int
    global_batch: int
    precision: str = "fp32"  # fp32 | bf16 | fp16
    amp_level: str = "O2"
    finetuning: str = "full"  # full | lora
    lora_rank: int = 8
    lora_targets: Tuple[str, ...] = ("q_proj", "v_proj")
    lora_dropout: float = 0.0
    attention: str = "auto"
    kernels: str = "auto"
    packed: bool = False  # batching: packed (segment ids reach the attention; else no mask at all)
    stage: str = "sft"  # the training method (methods.py; dpo: a sample is a preference pair)
    reference: str = NO_REFERENCE  # dpo's reference model (preference/reference_kind.py)
    note: str = ""  # what the plan assumed about the data (plan/data_facts.py)
    # model_config.quantization (QLoRA): method ('' for none), block size, double quant, skipped names
    quant_method: str = ""
    quant_block: int = 0
    quant_double: bool = False
    quant_skip: Tuple[str, ...] = ()
    # stage grpo (plan/rollout.py): completion tokens per row at most, and whether the rollouts also run a
    # log-probs pass (the old policy's, num_iterations > 1; the reference's, beta > 0)
    completion_len: int = 0
    rollout_logps: bool = False
    eval_rows: int = 0  # rows of one generate() call of the held-out reward (0: no eval set)

    @property
    def method(self) -> Method:
        return METHODS[self.stage]

    @property
    def sequences_per_sample(self) -> int:
        """Sequences per micro-batch sample: 2 for pairs (stage dpo), whose micro_batch_size counts pairs."""
        return self.method.sequences_per_sample

    def micro_sequences(self, layout: Layout) -> int:
        """Sequences in one micro-batch (what sizes the activations and the loss)."""
        return layout.micro_batch * self.sequences_per_sample

    @classmethod
    def from_config(
        cls,
        config: Any,
        arch: Optional[ModelArch] = None,
        seq_len: Optional[int] = None,
        read_data: bool = True,
    ) -> Workload:
        """``arch``/``seq_len``: what the trainer built and the longest batch it will see; without them the
        tokenizer and (for ``batching: longest``) the data are read as the trainer will read them, unless
        ``read_data`` is False (then batches are assumed to reach max_seq_len)."""
        from bmtrain_cli.config.derived import derive
        from bmtrain_cli.models.arch import arch_from_model_config
        from bmtrain_cli.plan.data_facts import DataFacts, data_facts

        m, t = config.model, config.train
        facts = DataFacts()
        grpo = METHODS[t.stage].sample == "completion"
        # a GRPO row is a prompt and its sampled completion: assumed to reach max_seq_len
        wants_longest = seq_len is None and t.batching == "longest" and read_data and not grpo
        if arch is None or wants_longest:
            facts = data_facts(config, need_vocab=arch is None, need_longest=wants_longest)
        if arch is None:
            arch = arch_from_model_config(m, allow_known=True)
            # a fresh model takes its tokenizer's vocabulary, or model_config.vocab_size when set (the
            # trainer's rule, config/checks.fresh_vocab_size)
            if facts.vocab_size and not m.model_name_or_path:
                from bmtrain_cli.config.checks import fresh_vocab_size

                arch = replace(
                    arch, vocab_size=fresh_vocab_size(m.vocab_size, facts.vocab_size, "the tokenizer")
                )
        if seq_len is None:
            seq_len = facts.longest or m.max_seq_len
        targets = lora_targets(arch, t.lora_target_modules)
        return cls(
            arch=arch,
            seq_len=int(seq_len),
            global_batch=derive(config).global_batch_size,
            precision=t.precision,
            amp_level=t.amp_level,
            finetuning=t.finetuning,
            lora_rank=t.lora_rank,
            lora_targets=tuple(targets),
            lora_dropout=t.lora_dropout,
            attention=m.attention_implementation,
            kernels=m.kernels,
            packed=t.batching == "packed",
            stage=t.stage,
            reference=reference_kind(t),
            note="; ".join(n for n in (facts.note, _grpo_note(t) if grpo else "") if n),
            **_quant_fields(m.quantization),
            **_grpo_fields(t),
        )


def _grpo_fields(t: Any) -> Dict[str, Any]:
    if METHODS[t.stage].sample != "completion":
        return {}
    g = t.grpo
    has_eval = t.eval_data_path is not None or (t.demo_data is not None and t.data_path is None)
    return {
        "completion_len": g.max_completion_length,
        "rollout_logps": g.num_iterations > 1 or g.beta > 0,
        "eval_rows": min(g.eval_prompts, GRPO_EVAL_ROWS) if has_eval else 0,
    }


def _grpo_note(t: Any) -> str:
    return (
        f"stage grpo: rows of prompt + completion (max_completion_length {t.grpo.max_completion_length}) "
        "assumed to reach max_seq_len; the rollout phase holds the KV cache of micro_batch_size rows"
    )


def _quant_fields(q: Any) -> Dict[str, Any]:
    if q is None:
        return {}
    return {
        "quant_method": q.method,
        "quant_block": q.resolved_block_size,
        "quant_double": q.double_quant,
        "quant_skip": tuple(q.skip_modules),
    }


@dataclass
class MemoryEstimate:
    """Bytes per device of the worst pipeline stage (and host bytes when offloading)."""

    device: Device
    layout: Layout
    stage_index: int
    parameters: int
    reference_weights: int  # stage dpo's frozen copy of the starting weights (0 without one)
    gradients: int
    optimizer_states: int
    master_weights: int
    activations: int
    activations_by_recompute: Dict[str, int]
    logits: int
    comm_buffers: int
    transient: int
    runtime: int
    peak: int  # what summary.json's peak_memory_bytes measures
    required: int  # peak + runtime reserve + allocator headroom: compared with the device memory
    host_bytes: int
    total_parameters: int
    trainable_parameters: int
    notes: List[str] = field(default_factory=list)
    rollout_cache: int = 0  # stage grpo: the KV cache of one generate() call of the rollouts
    rollout_peak: int = 0  # stage grpo: the rollout phase's peak (weights, optimizer states, sampling)

    @property
    def fits(self) -> bool:
        return self.required <= self.device.memory_bytes

    def to_dict(self) -> Dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("device", "layout")}
        out["device"] = self.device.name
        out["device_memory_bytes"] = self.device.memory_bytes
        out["layout"] = asdict(self.layout)
        out["fits"] = self.fits
        return out

    def lines(self) -> List[str]:
        f = format_bytes
        lay = self.layout
        rec = self.activations_by_recompute
        where = f" (pipeline stage {self.stage_index}, the largest)" if lay.pp > 1 else ""
        opt_where = " [host]" if lay.offload_optimizer else ""
        out = [
            f"per-device memory on {self.device.name}{where}: {lay.describe()}",
            f"  parameters       {f(self.parameters):>12}   "
            f"({self.trainable_parameters:,} trainable of {self.total_parameters:,})",
            *(
                [
                    f"  reference copy   {f(self.reference_weights):>12}   (frozen starting weights: the reference)"
                ]
                if self.reference_weights
                else []
            ),
            f"  gradients        {f(self.gradients):>12}",
            f"  optimizer states {f(self.optimizer_states):>12}{opt_where}",
            f"  master weights   {f(self.master_weights):>12}{opt_where}",
            f"  activations      {f(self.activations):>12}   "
            f"(recompute off {f(rec['none'])}, attention {f(rec['attention'])}, full {f(rec['full'])})",
            f"  logits and loss  {f(self.logits):>12}",
            f"  comm buffers     {f(self.comm_buffers):>12}",
            f"  transient        {f(self.transient):>12}",
            *(
                [
                    f"  rollout KV cache {f(self.rollout_cache):>12}   (micro_batch_size rows of prompt + "
                    f"completion, stage grpo; the rollout phase peaks at {f(self.rollout_peak)})"
                ]
                if self.rollout_cache
                else []
            ),
        ]
        out.append(f"  peak             {f(self.peak):>12}   (live tensors; summary.json peak_memory_bytes)")
        if self.host_bytes:
            out.append(f"  host memory      {f(self.host_bytes):>12}   (offloaded)")
        verdict = "fits" if self.fits else "does NOT fit"
        out.append(
            f"  => needs {f(self.required)} of {f(self.device.memory_bytes)}: {verdict}"
            + (
                " (incl. the process and the checkpoint save)"
                if self.device.kind == "cpu"
                else " (incl. runtime reserve and allocator headroom)"
            )
        )
        out += [f"  note: {n}" for n in self.notes]
        return out
