"""Loading a model to use it (not to train it): the one loader of generate, eval, serve, chat and the
lm-eval model."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Tuple

from bmtrain_cli.errors import UserError


def load_model_and_tokenizer(model_path: Path, tokenizer_path: Optional[Path], dtype: str) -> Tuple[Any, Any]:
    """The model and tokenizer of any directory ``generate``, ``eval``, ``serve`` and ``chat`` take: a run's
    output_dir or checkpoints (the latest), a checkpoint, a Hugging Face directory, an hf or
    paddle-inference export (INT8 too), or a LoRA checkpoint (merged into its recorded base)."""
    if not model_path.exists():
        raise UserError(f"--model_path {model_path} does not exist")
    if not model_path.is_dir():
        raise UserError(f"--model_path {model_path} is not a directory")
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.export.hf import is_quantized, load_quantized
    from bmtrain_cli.export.loading import is_paddle_inference_export, load_for_inference, resolve_checkpoint
    from bmtrain_cli.lora.adapter_store import is_lora_checkpoint
    from bmtrain_cli.models import load_pretrained

    if dtype in ("bfloat16", "float16"):
        from bmtrain_cli.machine import paddle_has_gpu

        if not paddle_has_gpu(import_paddle=True):
            raise UserError(
                f"--dtype {dtype} needs a GPU: Paddle's CPU build has no {dtype} matmul or norm kernels; "
                "use --dtype float32 here"
            )
    if (model_path / "checkpoints").is_dir() or (model_path / "latest").exists():
        model_path = resolve_checkpoint(str(model_path))  # a run's output_dir or checkpoints dir: the latest
    tok_src = tokenizer_path or model_path
    try:
        tokenizer = load_tokenizer(str(tok_src))
    except UserError as exc:
        raise UserError(f"{exc} (pass --tokenizer_path if the tokenizer lives elsewhere)") from None
    model: Any  # a CausalLM, an INT8 one or a Paddle Inference predictor: each has arch and generates
    if is_paddle_inference_export(model_path):  # bmtrain export --format paddle-inference
        model = load_for_inference(str(model_path))
    elif is_lora_checkpoint(model_path):  # LoRA adapters (+ the recorded base): merged for inference
        from bmtrain_cli.lora.adapter_store import load_lora_checkpoint

        model = load_lora_checkpoint(model_path, merge=True, dtype=dtype)
    elif is_quantized(model_path):  # bmtrain export --format hf --quantize int8
        model = load_quantized(str(model_path))
    else:
        from bmtrain_cli.models.arch import read_hf_config
        from bmtrain_cli.plan.estimator import check_arch_fits

        check_arch_fits(read_hf_config(str(model_path)), 2 if dtype in ("bfloat16", "float16") else 4)
        model = load_pretrained(model_path, dtype=dtype)
    if tokenizer.vocab_size > model.arch.vocab_size:
        raise UserError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{model.arch.vocab_size}: they do not belong together"
        )
    return model, tokenizer
