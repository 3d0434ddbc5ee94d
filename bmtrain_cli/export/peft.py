"""`bmtrain export --no-merge` on a LoRA checkpoint: the adapters alone, in the layout Hugging Face PEFT
reads (adapter_config.json + adapter_model.safetensors), plus the tokenizer and the base record. Adapters on a mixture of experts' routed experts are written as
PEFT adapts transformers 5.x's stacked experts (lora/peft_experts.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from bmtrain_cli.checkpoint_layout import atomic_directory
from bmtrain_cli.errors import UserError, writes_to
from bmtrain_cli.export.hf import write_tokenizer
from bmtrain_cli.export.meta import ExportResult, write_export_meta
from bmtrain_cli.lora.adapter_store import BASE_FILE, find_base, is_lora_checkpoint
from bmtrain_cli.lora.merge import (
    ADAPTER_CONFIG,
    load_adapter_arrays,
    read_adapter_config,
    save_adapters,
    settings_from_adapter_config,
)


def export_adapters(ckpt: Path, out: Path, log: Any = print) -> ExportResult:
    """Write ``ckpt``'s adapters to ``out`` in PEFT layout (atomically); returns an ExportResult."""
    ckpt, out = Path(ckpt), Path(out)
    if not is_lora_checkpoint(ckpt):
        raise UserError(
            f"--no-merge applies to LoRA checkpoints (with {ADAPTER_CONFIG}); {ckpt} is a full model"
        )
    settings = settings_from_adapter_config(read_adapter_config(ckpt), str(ckpt / ADAPTER_CONFIG))
    arrays = load_adapter_arrays(ckpt)
    base = find_base(ckpt)  # PEFT needs the base too: name a verified one
    log(f"writing the LoRA adapters of {ckpt} (base {base}) in PEFT layout")
    with writes_to(out), atomic_directory(out, f".{out.name}.tmp-export", create=False) as tmp:
        save_adapters(str(tmp), settings, arrays, str(base))  # stacked experts: lora/peft_experts.py
        shutil.copy2(ckpt / BASE_FILE, tmp / BASE_FILE)
        tokenizer = None
        if any((ckpt / f).is_file() for f in ("tokenizer.model", "tokenizer.json")):
            from bmtrain_cli.data.tokenizers import load_tokenizer

            tokenizer = load_tokenizer(str(ckpt))
        write_tokenizer(tokenizer, tmp)
        size = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
        fp32 = sum(int(a.size) * 4 for a in arrays.values())
        result = ExportResult(ckpt, out, "peft", None, fp32, size)
        write_export_meta(
            tmp, {"format": "peft", "source": str(ckpt), "base_model": str(base), "report": result.to_dict()}
        )
    return result
