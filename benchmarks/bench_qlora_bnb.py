"""The bitsandbytes side of bench_qlora.py's comparison, run in the reference venv (torch, transformers,
PEFT, bitsandbytes; `make ref-venv`): the same fp32 checkpoint loaded by transformers with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`` on the CPU (bitsandbytes' CPU 4-bit
matmul, blocks of 64, fp32 compute, no double quantisation), rank-8 PEFT LoRA adapters on every linear
projection, AdamW, the same random batches; prints one JSON line with the same fields as bench_qlora's
children (base weight bytes, peak RSS over the timed steps, mean step time).

Run by bench_qlora.py (``--shape 1.5b``); alone: python bench_qlora_bnb.py CHECKPOINT VOCAB BATCH SEQ STEPS
"""

from __future__ import annotations

import json
import sys
import time


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


def main(path: str, vocab: int, batch: int, seq: int, steps: int, warmup: int = 1) -> dict:
    import numpy as np
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        bnb_4bit_use_double_quant=False,
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, dtype=torch.float32, device_map="cpu"
    )
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    base_bytes += sum(
        int(m.weight.quant_state.absmax.numel()) * 4
        for m in model.modules()
        if getattr(getattr(m, "weight", None), "quant_state", None) is not None
    )
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    rng = np.random.default_rng(0)
    batches = [torch.from_numpy(rng.integers(0, vocab, (batch, seq))) for _ in range(2)]
    times, cpu, losses = [], [], []
    for i in range(steps):
        if i == warmup:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        ids = batches[i % 2]
        t0, c0 = time.perf_counter(), time.process_time()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {
        "mode": "bnb-peft",
        "base_bytes": int(base_bytes),
        "peak_rss_bytes": _status("VmHWM"),
        "step_seconds": sum(times) / len(times),
        "step_cpu_seconds": sum(cpu) / len(cpu),
        "losses": losses,
        "threads": torch.get_num_threads(),
    }


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]))))
