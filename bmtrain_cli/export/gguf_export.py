"""``bmtrain export --format gguf``: one ``model.gguf`` (weights, architecture, tokenizer, chat template)
for llama.cpp, Ollama and LM Studio, written with the ``gguf`` package (the optional extra ``gguf``).

Tensor names come from gguf's own map (``gguf.get_tensor_name_map``) applied to the Hugging Face names of
``models.hf_state_dict``, so the GGUF layout follows the family's weight names. llama.cpp's layout rules:

- the ``llama`` architecture (LLaMA and Mistral) and ``baichuan`` rotate q/k with interleaved pairs, so
  the rows of q_proj/k_proj (and their biases) are permuted from Hugging Face's half-split layout; Qwen2/3
  use the half-split (NeoX) rotation and are written as they are;
- a tied LM head is not written (llama.cpp and transformers then use ``token_embd``); Baichuan 2's
  ``norm_head`` is applied to the written ``output.weight``;
- 1-D tensors (norms, biases) stay f32; matrices take the requested type; ``q8_0``/``q4_0`` go through
  ``gguf.quants.quantize``; a matrix whose rows do not split into 32-value blocks falls back to f16 and,
  under ``q4_0``, the output projection (``output.weight``, or ``token_embd`` when tied) is written q8_0,
  as llama-quantize keeps it above 4 bits;
- LLaMA 3 rope scaling becomes the ``rope_freqs`` tensor, linear scaling ``rope.scaling.*``; dynamic
  NTK and YaRN are refused (llama.cpp does not compute them as our decoder does); so is ALiBi Baichuan;
- Phi-3 keeps its fused ``qkv_proj`` and ``gate_up_proj`` (llama.cpp's ``attn_qkv`` and ``ffn_up``), its
  partial rotary dimension, and LongRoPE as the ``rope_factors_long``/``rope_factors_short`` tensors with
  the attention factor;
- Gemma 3 stores its norms as ``1 + weight`` (llama.cpp's Gemma converters do; transformers' reader takes
  the 1 off again); llama.cpp fixes its layer pattern (every sixth layer global), the sliding layers'
  rope base (10000) and the score scale (head_dim^-1/2), so a model that differs is refused;
- Gemma 2 (``gemma2``) stores its norms as Gemma 3's and writes both soft-caps
  (``attn_logit_softcapping``, ``final_logit_softcapping``); llama.cpp makes the even layers sliding,
  always caps scores and logits and scales scores by head_dim^-1/2 (hidden / heads in its 46-layer 27B),
  so a model that differs is refused;
- Qwen3-MoE's and Mixtral's experts are stacked per layer into ``ffn_{gate,up,down}_exps`` [experts, out,
  in] (Mixtral is llama.cpp's ``llama`` with experts); llama.cpp's qwen3moe makes every layer sparse and
  renormalises the top-k weights, so dense layers or ``norm_topk_prob: false`` are refused;
- ERNIE 4.5 and GLM-4 rotate interleaved pairs as transformers holds them (no reordering; GLM-4's rotary
  part is ``rope.dimension_count``); ERNIE 4.5 MoE adds shared experts (``ffn_*_shexp``), its selection bias
  (``exp_probs_b.bias``) and leading dense layers, with experts in every later layer (other layouts refused);
- GLM-4.5 (``glm4moe``) rotates half-split partial heads as transformers holds them; its sigmoid router
  writes ``expert_gating_func``, ``expert_weights_norm`` (norm_topk_prob), ``expert_weights_scale``
  (routed_scaling_factor) and, when fewer groups are kept than there are, ``expert_group_count`` /
  ``expert_group_used_count``; shared experts, selection bias and leading dense layers as ERNIE 4.5 MoE's.
  llama.cpp's glm4moe always adds the shared expert and reads a scale of 0 as none, so a model without
  shared experts or with ``routed_scaling_factor`` 0 is refused;
- LLaMA 3 rope scaling is read (``rope_freqs``) only by llama.cpp's ``llama``, so it is refused elsewhere;
- llama.cpp's baichuan rotates q/k only in 32-layer models, so other layer counts are refused.

Every family is checked by running the file in llama.cpp (tests/unit/export/test_gguf_llama_cpp.py).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from bmtrain_cli.errors import UserError
from bmtrain_cli.export.gguf_arch import add_hparams, check_exportable

GGUF_FILE = "model.gguf"
GGUF_QUANTIZE = ("f16", "bf16", "q8_0", "q4_0")
DEFAULT_GGUF_QUANTIZE = "f16"
_INTERLEAVED_ROPE = ("llama", "baichuan")
_BLOCK = 32  # values per q8_0/q4_0 block
_SCORE_BIAS = "e_score_correction_bias"  # ERNIE 4.5 MoE's moe_statics, GLM-4.5's router
_EXPERT = re.compile(r"^(.+)\.experts\.(\d+)\.(.+)$")


def import_gguf() -> Any:
    """The ``gguf`` module; UserError naming the extra when it is not installed."""
    try:
        import gguf
    except ImportError:
        raise UserError(
            "--format gguf needs the gguf package: pip install 'bmtrain-cli[gguf]' (or pip install gguf)"
        ) from None
    return gguf


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's half-split rotary layout -> llama.cpp's interleaved pairs, per head (rows of a q/k
    weight [heads*head_dim, in] or bias [heads*head_dim])."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_w_pack(hf: Dict[str, np.ndarray], arch: Any) -> Dict[str, np.ndarray]:
    """Baichuan's fused W_pack -> q_proj/k_proj/v_proj (llama.cpp's baichuan has separate q/k/v)."""
    out = {}
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    for name, arr in hf.items():
        if name.endswith("self_attn.W_pack.weight"):
            prefix = name[: -len("W_pack.weight")]
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), np.split(arr, [q, q + kv], axis=0)):
                out[f"{prefix}{proj}.weight"] = part
        else:
            out[name] = arr
    return out


def _stack_experts(hf: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """Per-expert ``<moe>.experts.E.P.weight`` (Qwen3-MoE's ``mlp``, Mixtral's ``block_sparse_moe``) -> one
    ``<moe>.experts.P.weight`` [experts, out, in] per layer and projection, in expert order (llama.cpp's
    ``ffn_*_exps``)."""
    out: Dict[str, np.ndarray] = {}
    stacks: Dict[str, Dict[int, np.ndarray]] = {}
    for name, arr in hf.items():
        match = _EXPERT.match(name)
        if match is None:
            out[name] = arr
            continue
        head, expert, proj = match.groups()
        stacks.setdefault(f"{head}.experts.{proj}", {})[int(expert)] = arr
    for name, experts in stacks.items():
        out[name] = np.stack([experts[e] for e in sorted(experts)])
    return out


def longrope_tensors(arch: Any) -> Dict[str, np.ndarray]:
    """Phi-3's LongRoPE factors as llama.cpp's ``rope_factors_long``/``rope_factors_short`` tensors."""
    from bmtrain_cli.models.rope import rope_type

    if rope_type(arch.rope_scaling) != "longrope":
        return {}
    half = arch.rotary_dim // 2
    out = {}
    for kind in ("long", "short"):
        factors = np.asarray(arch.rope_scaling[f"{kind}_factor"], dtype=np.float32)
        if factors.shape != (half,):
            raise UserError(
                f"--format gguf: {kind}_factor has {factors.size} entries, the rotary dimension needs {half}"
            )
        out[f"rope_factors_{kind}.weight"] = factors
    return out


def rope_factors(arch: Any) -> Optional[np.ndarray]:
    """llama.cpp's ``rope_freqs`` for LLaMA 3 scaling: how much each frequency is divided by, from the
    decoder's own scaled and unscaled frequencies."""
    from bmtrain_cli.models.rope import inv_frequencies, rope_type

    if rope_type(arch.rope_scaling) != "llama3":
        return None
    base, _ = inv_frequencies(arch.head_dim, arch.rope_theta, None, arch.max_position_embeddings)
    scaled, _ = inv_frequencies(
        arch.head_dim, arch.rope_theta, arch.rope_scaling, arch.max_position_embeddings
    )
    return (base / scaled).astype(np.float32)


def gguf_tensors(model: Any) -> Dict[str, np.ndarray]:
    """GGUF name -> fp32 array in llama.cpp's layout (see the module docstring)."""
    gguf = import_gguf()
    from bmtrain_cli.models import hf_state_dict
    from bmtrain_cli.models.decoder import head_weight

    arch = model.arch
    name = check_exportable(arch)
    hf = _split_w_pack(hf_state_dict(model), arch) if arch.fused_qkv else hf_state_dict(model)
    if arch.num_experts:
        hf = _stack_experts(hf)
    if arch.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    if arch.norm_head:
        weight, transposed = head_weight(arch, model.lm_head, model.model.embed_tokens.weight)
        w = weight.astype("float32").numpy()
        hf["lm_head.weight"] = np.ascontiguousarray(w if transposed else w.T)
    names = gguf.get_tensor_name_map(_arch_enum(gguf, name), arch.num_hidden_layers)
    out: Dict[str, np.ndarray] = {}
    for hf_name, arr in hf.items():
        if hf_name.endswith(_SCORE_BIAS):  # the selection bias ([1, experts] in ERNIE's): exp_probs_b.bias
            hf_name, arr = hf_name[: -len("_bias")] + ".bias", arr.reshape(-1)
        new = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if new is None:
            raise UserError(f"--format gguf: no llama.cpp tensor for {hf_name} ({name} architecture)")
        if name in _INTERLEAVED_ROPE and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = permute_rows(arr, arch.num_attention_heads)
        elif name in _INTERLEAVED_ROPE and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = permute_rows(arr, arch.num_key_value_heads)
        if arch.norm_offset and hf_name.endswith("norm.weight"):
            arr = arr + 1.0  # Gemma: the file holds the scale itself
        out[new] = np.ascontiguousarray(arr, dtype=np.float32)
    out.update(longrope_tensors(arch))
    factors = rope_factors(arch)
    if factors is not None:
        out[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"] = factors
    return out


def _arch_enum(gguf: Any, name: str) -> Any:
    return next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == name)


def tensor_type(name: str, arr: np.ndarray, quantize: str, tied: bool) -> str:
    """The GGML type of one tensor: f32 for 1-D ones, rope_freqs/rope_factors and MoE routers (as llama.cpp's
    converter keeps them), else ``quantize`` with llama.cpp's fallbacks (see the module docstring)."""
    if arr.ndim < 2 or name.startswith(("rope_freqs", "rope_factors")) or ".ffn_gate_inp." in name:
        return "f32"
    if quantize in ("q8_0", "q4_0") and arr.shape[-1] % _BLOCK:
        return "f16"
    if quantize == "q4_0" and (name == "output.weight" or (tied and name == "token_embd.weight")):
        return "q8_0"
    return quantize


def encode_tensor(arr: np.ndarray, kind: str) -> Tuple[np.ndarray, Any]:
    """(the array as stored, its GGMLQuantizationType)."""
    gguf = import_gguf()
    qt = gguf.GGMLQuantizationType
    if kind == "f32":
        return arr.astype(np.float32), qt.F32
    if kind == "f16":
        return arr.astype(np.float16), qt.F16
    qtype = {"bf16": qt.BF16, "q8_0": qt.Q8_0, "q4_0": qt.Q4_0}[kind]
    return gguf.quants.quantize(arr.astype(np.float32), qtype), qtype


_FILE_TYPES = {"f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


@dataclass
class GGUFSummary:
    """What was written: the file, its architecture and the type of each tensor."""

    path: Path
    architecture: str
    quantize: str
    tensor_types: Dict[str, str] = field(default_factory=dict)
    vocab: Optional[Any] = None

    def to_dict(self) -> Dict[str, Any]:
        counts: Dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        return {
            "file": self.path.name,
            "architecture": self.architecture,
            "quantize": self.quantize,
            "tensor_type_counts": counts,
            "tokenizer_model": getattr(self.vocab, "model", None),
            "tokenizer_pre": getattr(self.vocab, "pre", None),
        }


def write_gguf(
    model: Any, tokenizer: Any, out_dir: Path, quantize: Optional[str] = None, name: str = "model"
) -> GGUFSummary:
    """Write ``out_dir/model.gguf`` from an fp32 CausalLM and its tokenizer; returns what was written."""
    from bmtrain_cli.export.gguf_vocab import add_vocab, gguf_vocab

    gguf = import_gguf()
    logging.getLogger("gguf.gguf_writer").setLevel(logging.WARNING)  # its per-file INFO lines
    quantize = (quantize or DEFAULT_GGUF_QUANTIZE).lower()
    if quantize not in GGUF_QUANTIZE:
        raise UserError(
            f"--format gguf: unknown --quantize {quantize!r}; supported: {', '.join(GGUF_QUANTIZE)}"
        )
    if tokenizer is None:
        raise UserError("--format gguf needs the checkpoint's tokenizer (tokenizer.model or tokenizer.json)")
    arch = model.arch
    arch_name = check_exportable(arch)
    vocab = gguf_vocab(tokenizer, arch.vocab_size)
    tensors = gguf_tensors(model)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    path = Path(out_dir) / GGUF_FILE
    writer = gguf.GGUFWriter(str(path), arch_name)
    summary = GGUFSummary(path, arch_name, quantize, vocab=vocab)
    try:
        writer.add_name(name)
        writer.add_file_type(int(getattr(gguf.LlamaFileType, _FILE_TYPES[quantize])))
        if quantize in ("q8_0", "q4_0"):
            writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        add_hparams(writer, arch, gguf)
        add_vocab(writer, vocab)
        for tname in sorted(tensors, key=_tensor_order):
            arr = tensors[tname]
            kind = tensor_type(tname, arr, quantize, arch.tie_word_embeddings)
            data, qtype = encode_tensor(arr, kind)
            writer.add_tensor(tname, data, raw_dtype=qtype)
            summary.tensor_types[tname] = kind
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return summary


def _tensor_order(name: str) -> Tuple[int, int, str]:
    """token_embd, the blocks in order, then the rest (the order llama.cpp's converter writes)."""
    if name.startswith("blk."):
        return (1, int(name.split(".")[1]), name)
    return (0 if name.startswith("token_embd") else 2, 0, name)


def gguf_tokenizer(tokenizer: Any, ckpt: Path) -> Any:
    """The tokenizer to embed: a sentencepiece ``tokenizer.model`` beside a tokenizer.json that is not a
    byte-level BPE (a converted LLaMA 2 / Mistral tokenizer) is what llama.cpp reads."""
    sp_file = Path(ckpt) / "tokenizer.model"
    if getattr(tokenizer, "kind", None) != "hf" or not sp_file.is_file():
        return tokenizer
    from bmtrain_cli.export.gguf_vocab import bpe_vocab

    try:
        bpe_vocab(tokenizer)
        return tokenizer
    except UserError:
        from bmtrain_cli.data.tokenizers import load_tokenizer

        return load_tokenizer(str(sp_file))


def write_gguf_export(
    model: Any, tokenizer: Any, out_dir: Path, ckpt: Path, quantize: Optional[str], template: str = "auto"
) -> GGUFSummary:
    """model.gguf + the Ollama Modelfile + the tokenizer files + bmtrain_export.json's ``gguf`` entry."""
    from bmtrain_cli.export.hf import write_tokenizer
    from bmtrain_cli.export.meta import write_export_meta
    from bmtrain_cli.export.modelfile import write_modelfile

    tokenizer = gguf_tokenizer(tokenizer, ckpt)
    name = (
        Path(ckpt).resolve().parent.parent.name
        if Path(ckpt).parent.name == "checkpoints"
        else Path(ckpt).name
    )
    summary = write_gguf(model, tokenizer, Path(out_dir), quantize, name=name)
    from bmtrain_cli.data.templates import get_template

    get_template(template, tokenizer)  # UserError naming the choices for an unknown --template
    builtin = template if template not in ("auto", "tokenizer") else None
    write_modelfile(Path(out_dir), GGUF_FILE, tokenizer, builtin, model.arch.max_position_embeddings)
    write_tokenizer(tokenizer, Path(out_dir))
    write_export_meta(Path(out_dir), {"gguf": summary.to_dict()})
    return summary


def describe_gguf(out_dir: Path) -> List[str]:
    """Lines `bmtrain export` prints about a GGUF export (from its bmtrain_export.json)."""
    from bmtrain_cli.export.meta import read_export_meta

    summary = read_export_meta(Path(out_dir)).get("gguf", {})
    counts = ", ".join(f"{n} {t}" for t, n in sorted(summary.get("tensor_type_counts", {}).items()))
    pre = f" (pre-tokenizer {summary['tokenizer_pre']})" if summary.get("tokenizer_pre") else ""
    return [
        f"gguf: {summary.get('file')} (architecture {summary.get('architecture')}; tensors: {counts}); "
        f"tokenizer {summary.get('tokenizer_model')}{pre}; Ollama Modelfile beside it",
    ]
