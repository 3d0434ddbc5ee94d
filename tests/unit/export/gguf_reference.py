"""Run by the reference Python (torch + transformers + gguf, $BMTRAIN_REF_PYTHON), never imported by the
suite: for each directory given, load model.gguf with transformers' own GGUF reader and write its logits
on ids.npy, its tokenisation of texts.json and, when prompts.json is there, its greedy continuation of
each prompt (token ids) into ref_logits.npy / ref.json there."""

import json
import os
import sys

import numpy as np
import torch
import transformers


def read(d):
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file="model.gguf", dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file="model.gguf")
    with torch.no_grad():
        logits = model.eval()(input_ids=torch.from_numpy(np.load(f"{d}/ids.npy"))).logits.numpy()
    np.save(f"{d}/ref_logits.npy", logits)
    with open(f"{d}/texts.json", encoding="utf-8") as f:
        texts = json.load(f)
    greedy = []
    if os.path.exists(f"{d}/prompts.json"):
        with open(f"{d}/prompts.json", encoding="utf-8") as f:
            spec = json.load(f)
        for ids in spec["prompts"]:
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=spec["max_new_tokens"],
                    do_sample=False,
                    pad_token_id=0,
                )
            greedy.append(out[0, len(ids) :].tolist())
    return {
        "greedy": greedy,
        "ids": [tok.encode(t, add_special_tokens=False) for t in texts],
        "model_type": model.config.model_type,
        "tie_word_embeddings": bool(model.config.tie_word_embeddings),
        "sliding_window": getattr(model.config, "sliding_window", None),
        "eos_token": tok.eos_token,
        "chat_template": tok.chat_template,
    }


for d in sys.argv[1:]:
    try:
        out = read(d)
    except Exception as exc:  # one unreadable file is reported by its own test
        out = {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}
    with open(f"{d}/ref.json", "w", encoding="utf-8") as f:
        json.dump(out, f)
