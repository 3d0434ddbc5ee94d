"""Opening models for inference: training checkpoints, hf exports (fp32 or INT8) and paddle-inference
exports, all behind one object with ``logits(input_ids) -> np.ndarray`` and the tokenizer.

Also the checkpoint resolution shared by ``bmtrain export``: ``--checkpoint`` may name a ``step-N``
directory, the ``checkpoints`` directory or the run's ``output_dir`` (the ``latest`` checkpoint is used).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import numpy as np

from bmtrain_cli.checkpoint_layout import STATE_FILE, holds_checkpoints, is_step_dir_name, latest_under
from bmtrain_cli.errors import UserError
from bmtrain_cli.export.meta import read_export_meta

if TYPE_CHECKING:
    from bmtrain_cli.models.decoding import SamplingOptions, TokenCallback

LORA_ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json")


def resolve_checkpoint(path: str) -> Path:
    """The model directory ``path`` designates: itself when it holds a config.json (or is a step-N or
    LoRA directory), else the latest checkpoint (checkpoint_layout.latest_under) of a checkpoints
    directory or of a run's output_dir."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"checkpoint {path} does not exist")
    if not p.is_dir():
        raise UserError(f"checkpoint {path} is not a directory")
    if (p / "config.json").is_file() or is_step_dir_name(p.name) or (p / LORA_ADAPTER_CONFIG).is_file():
        return p
    if not holds_checkpoints(p):
        raise UserError(
            f"{path} is not a checkpoint: expected a step-N directory (with config.json and "
            "model*.safetensors), a checkpoints directory or a training output_dir"
        )
    found = latest_under(p)
    if found is None:
        raise UserError(f"{path}: no complete checkpoint (no step-N directory with {STATE_FILE})")
    return found


def check_checkpoint(ckpt: Path, need_tokenizer: bool = True) -> None:
    """UserError naming what is missing when ``ckpt`` is not a complete checkpoint."""
    from bmtrain_cli.export.hf import weight_files

    if (ckpt / LORA_ADAPTER_CONFIG).is_file():
        return  # adapters only: checked by the LoRA merge hook
    if is_step_dir_name(ckpt.name) and not (ckpt / STATE_FILE).is_file():
        raise UserError(f"{ckpt}: partial checkpoint (no {STATE_FILE}: the save did not finish)")
    if not (ckpt / "config.json").is_file():
        raise UserError(f"{ckpt}: partial checkpoint (no config.json)")
    files = weight_files(ckpt)
    from safetensors import SafetensorError, safe_open

    for f in files:
        try:
            with safe_open(str(f), framework="np") as handle:
                list(handle.keys())
        except (SafetensorError, OSError) as exc:
            raise UserError(f"{f}: partial checkpoint, unreadable or truncated weights ({exc})") from None
    if need_tokenizer and not any((ckpt / t).is_file() for t in TOKENIZER_FILES):
        raise UserError(f"{ckpt}: partial checkpoint (no tokenizer file: {' or '.join(TOKENIZER_FILES)})")


def load_checkpoint_model(ckpt: Path, kernels: str = "auto") -> Any:
    """The fp32 CausalLM of a checkpoint or hf directory.

    LoRA hook: a directory with adapter_config.json holds adapters plus the base model's path and hash;
    ``bmtrain_cli.lora.merge_checkpoint`` finds and verifies the base and merges the adapters into it.
    """
    if (ckpt / LORA_ADAPTER_CONFIG).is_file():
        from bmtrain_cli.lora.adapter_store import merge_checkpoint

        return merge_checkpoint(str(ckpt), kernels=kernels)
    from bmtrain_cli.export.hf import is_quantized, load_quantized

    if is_quantized(ckpt):
        return load_quantized(str(ckpt), kernels=kernels)
    from bmtrain_cli.models import load_pretrained

    return load_pretrained(str(ckpt), kernels=kernels)


@dataclass
class InferenceModel:
    """Something that maps token ids to logits, with its tokenizer.

    ``format``: "paddle-inference" (a predictor over the static graph), "hf" or "checkpoint" (a dygraph
    CausalLM in ``model``). ``quantized`` tells whether the weights are INT8.
    """

    path: Path
    format: str
    tokenizer: Any
    quantized: bool = False
    model: Any = None
    predictor: Any = None

    def logits(self, input_ids: np.ndarray) -> np.ndarray:
        """Logits [batch, seq, vocab] (float32) of int64 ``input_ids`` [batch, seq] (or [seq])."""
        ids = np.asarray(input_ids, dtype=np.int64)
        if ids.ndim == 1:
            ids = ids[None, :]
        if self.predictor is not None:
            return self.predictor.logits(ids)
        import paddle

        with paddle.no_grad():
            out = self.model(paddle.to_tensor(ids))
        return out.astype("float32").numpy()

    @property
    def arch(self) -> Any:
        if self.model is not None:
            return self.model.arch
        from bmtrain_cli.models.arch import read_hf_config

        return read_hf_config(str(self.path))


def _tokenizer_or_none(path: Path) -> Any:
    if not any((path / t).is_file() for t in TOKENIZER_FILES):
        return None
    from bmtrain_cli.data.tokenizers import load_tokenizer

    return load_tokenizer(str(path))


def load_for_inference(path: str, kernels: str = "auto") -> InferenceModel:
    """Open a paddle-inference export, an hf export (fp32 or INT8), a checkpoint or a run directory."""
    from bmtrain_cli.export.paddle_inference import Predictor

    p = Path(path)
    if not p.exists():
        raise UserError(f"model {path} does not exist")
    meta = read_export_meta(p) if p.is_dir() else {}
    if is_paddle_inference_export(p):
        return InferenceModel(
            path=p,
            format="paddle-inference",
            tokenizer=_tokenizer_or_none(p),
            quantized=bool(meta.get("quantization")),
            predictor=Predictor(str(p)),
        )
    ckpt = resolve_checkpoint(path)
    check_checkpoint(ckpt, need_tokenizer=False)
    from bmtrain_cli.export.hf import is_quantized

    model = load_checkpoint_model(ckpt, kernels=kernels)
    model.eval()
    fmt = "hf" if meta.get("format") == "hf" or not (ckpt / STATE_FILE).is_file() else "checkpoint"
    return InferenceModel(
        path=ckpt, format=fmt, tokenizer=_tokenizer_or_none(ckpt), quantized=is_quantized(ckpt), model=model
    )


def is_paddle_inference_export(path: Any) -> bool:
    """Whether ``path`` is a directory written by ``bmtrain export --format paddle-inference``."""
    p = Path(path)
    if not p.is_dir():
        return False
    if read_export_meta(p).get("format") == "paddle-inference":
        return True
    return ((p / "model.json").is_file() or (p / "model.pdmodel").is_file()) and (
        p / "model.pdiparams"
    ).is_file()


def generate_static(
    model: InferenceModel,
    prompts: Any,
    options: SamplingOptions,
    on_token: Optional[TokenCallback] = None,
) -> List[List[int]]:
    """Generation over logits only (a paddle-inference predictor has no KV cache and no mask input):
    each prompt runs alone and the whole sequence is recomputed per new token. Tokens are picked and rows
    stopped by the same ``DecodeStep`` as models.generate, so its output (greedy or seeded) matches it."""
    from bmtrain_cli.models.decoding import DecodeStep

    step = DecodeStep(options, len(prompts), on_token)
    for row, prompt in enumerate(prompts):
        ids = list(prompt)
        for _ in range(options.max_new_tokens):
            logits = model.logits(np.asarray([ids], dtype=np.int64))[:, -1]
            ids.append(int(step(logits.astype(np.float32), [row])[0]))
            if step.done[row]:
                break
    return step.tokens
