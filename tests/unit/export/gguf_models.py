"""Tiny trained checkpoints of each family the GGUF export supports, with the two tokenizer kinds: the
quickstart's sentencepiece model (LLaMA, Mistral) and a byte-level BPE tokenizer.json with Qwen2's split
regex and a ChatML chat template (Qwen2, Qwen3). Trained for a few AdamW steps on the demo task, saved
in the trainer's layout (output_dir/checkpoints/step-N + latest)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from tests.unit.export.conftest import _batches

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Qwen2's pre-tokenizer split, as its tokenizer.json writes it
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
EXTRA_TEXT = [
    "hello world, this is a test.",
    "你好，世界。今天天气很好。",
    "emoji 🙂🚀 done",
    "The quick brown fox.",
]
TEXTS = [" hello world", "hello world", "12+35=", "你好，世界", "emoji 🙂🚀", "The quick brown fox."]


def bpe_tokenizer_dir(out: Path, corpus: list, split: str = QWEN2_SPLIT) -> Path:
    """A byte-level BPE tokenizer.json (Qwen2-style) + tokenizer_config.json with a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out


def family_checkpoint(
    root: Path,
    family: str = "llama",
    tokenizer: str = "sentencepiece",
    steps: int = 6,
    tie: Optional[bool] = None,
    vocab_pad: int = 0,
    setup: Optional[Callable[[Any], None]] = None,
    **arch_updates: Any,
) -> Path:
    """Train a tiny ``family`` model for ``steps`` steps and save it as a run; returns the run dir.
    ``vocab_pad`` extra embedding rows past the tokenizer's vocabulary; ``tie`` None keeps the family's
    default; ``setup`` is called on the built model before training (to set what training leaves alone)."""
    import paddle

    from bmtrain_cli.data.demo import demo_corpus, train_demo_tokenizer, write_demo_data
    from bmtrain_cli.data.encode import encode_eval_file
    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.models import build, save_pretrained
    from bmtrain_cli.models.arch import ModelArch
    from bmtrain_cli.models.families import family as family_of

    paddle.seed(0)
    data = root / "data"
    train, _ = write_demo_data(str(data))
    if tokenizer == "sentencepiece":
        tok = train_demo_tokenizer(str(data / "tok"), [train], vocab_size=300)
    else:
        corpus = list(demo_corpus([train]))[:2000] + EXTRA_TEXT * 20
        tok = load_tokenizer(str(bpe_tokenizer_dir(data / "tok", corpus)))
    arch = ModelArch(
        family=family,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=tok.vocab_size + vocab_pad,
        max_position_embeddings=128,
        bos_token_id=tok.bos_id,
        eos_token_id=tok.eos_id,
        **{**family_of(family).defaults, **({} if tie is None else {"tie_word_embeddings": tie})},
    )
    model = build(replace(arch, **arch_updates), kernels="reference")
    if setup is not None:
        setup(model)
    _train(model, encode_eval_file(train, tok, max_records=400), steps)
    run = root / "run"
    ckpt = run / "checkpoints" / f"step-{steps}"
    save_pretrained(model, str(ckpt))
    tok.save(str(ckpt))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": steps}), encoding="utf-8")
    (run / "checkpoints" / "latest").write_text(f"step-{steps}\n", encoding="utf-8")
    return run


def _train(model: Any, samples: list, steps: int) -> None:
    import paddle

    opt = paddle.optimizer.AdamW(learning_rate=3e-3, parameters=model.parameters())
    rng = np.random.default_rng(0)
    done = 0
    while done < steps:
        for ids, labels, mask in _batches(samples, 16, rng):
            loss_sum, count = model.loss_sum(
                paddle.to_tensor(ids), paddle.to_tensor(labels), paddle.to_tensor(mask)
            )
            (loss_sum / count).backward()
            opt.step()
            opt.clear_grad()
            done += 1
            if done >= steps:
                break
    model.eval()


def logits_with_file_weights(run: Path, quantize: str, ids: np.ndarray) -> np.ndarray:
    """Our logits when every matrix carries the rounding the GGUF stores: ``quantize`` along each weight's
    input axis (f16 for rows that do not split into 32-value blocks), routers and 1-D tensors in fp32."""
    import gguf

    from bmtrain_cli.export.loading import load_for_inference

    loaded = load_for_inference(str(run), kernels="reference")
    model = next(v for v in vars(loaded).values() if hasattr(v, "named_parameters"))
    for name, p in model.named_parameters():
        if p.ndim < 2 or name.endswith("mlp.gate.weight"):
            continue
        w = p.numpy()
        hf = w if "embed_tokens" in name else w.T  # Paddle's linear weights are [in, out]
        if quantize == "q8_0" and hf.shape[-1] % 32 == 0:
            qt = gguf.GGMLQuantizationType.Q8_0
            r = gguf.quants.dequantize(gguf.quants.quantize(np.ascontiguousarray(hf), qt), qt).reshape(
                hf.shape
            )
        else:
            r = hf.astype(np.float16).astype(np.float32)
        p.set_value((r if "embed_tokens" in name else r.T).astype(w.dtype))
    return loaded.logits(ids)


def read_gguf(path: Path, name: Optional[str] = None) -> Any:
    import gguf

    return gguf.GGUFReader(str(path))


def field_value(reader: Any, key: str) -> Any:
    """A metadata value read back with gguf.GGUFReader (str, number, or list)."""
    f = reader.fields[key]
    return f.contents()
