"""Context parallel through `bmtrain run` logs the single process's per-step loss AND grad_norm (1e-5
relative): rows of 4096 tokens (one long sample per row, truncated or padded; or packed rows of many short
samples), a tiny grouped-query model (4 heads, 2 KV heads), 4 optimizer steps of 2 rows with max_grad_norm
0.2 (LoRA: 0.02), which every step's norm exceeds (asserted), so a layout whose norm or clip is off
diverges from step 2.
Every rank of a context group holds 2 chunks of 4096 / (2 x degree) tokens: 1024 (cp2) and 512 (cp4).
Layouts: cp2, cp4, and cp2 beside data, tensor, sharding (stage 1) and pipeline (with recompute) parallel;
the ulysses mode's cp2 (1 KV head and 2 query heads a rank) on long and packed rows; a tiny Gemma 3 (sliding
layers with a window of 96 tokens and a global layer) at cp2;
a tiny Gemma 2 (soft-capped scores that the cap bends, sliding and global layers) at cp2;
DPO (pairs of 4096-token sequences, frozen reference, recompute) under cp2 against one process; a tiny
Qwen3-MoE with its load-balancing loss under cp2, ep2 x cp2 and pp2 x cp2 (its logged aux_loss too).

docs/parallel.md carries the table (``python -m tests.integration.test_context_parallel`` prints it).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS, SEQ = 4, 4096
CONFIG = """model_config:
  family: llama
  hidden_size: 32
  intermediate_size: 64
  num_hidden_layers: 2
  num_attention_heads: 4
  num_key_value_heads: 2
  max_seq_len: {seq}
  tokenizer_path: {tok}
train_config:
  data_path: {data}
  template: {template}
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 1
  global_batch_size: 2
  learning_rate: 1.0e-2
  warmup_steps: 0
  logging_steps: 1
  save_steps: {steps}
"""
# rows, settings, max_grad_norm (below every step's norm: the clip scales every step)
MODELS: Dict[str, Tuple[str, List[str], float]] = {
    "long": ("long.jsonl", [], 0.2),
    "packed": ("short.jsonl", ["train_config.batching=packed"], 0.2),
    "lora": (
        "long.jsonl",
        ["train_config.finetuning=lora", "train_config.lora_target_modules=all-linear"],
        0.02,
    ),
    # Gemma 3's pattern: 5 sliding layers (window 96 of 4096 tokens) and 1 global layer; at cp2 (chunks of
    # 1024 tokens) the sliding layers skip the key chunks 96 or more tokens back and the window cuts the rest
    "gemma3": (
        "long.jsonl",
        [
            "model_config.family=gemma3_text",
            "model_config.num_hidden_layers=6",
            "model_config.sliding_window=96",
        ],
        0.2,
    ),
    # rope tables read the batch's largest position (4095 > 3500, the original length: the long factors, the
    # grown base); the second rank's share (positions 1024-3071) would pick the short ones on its own
    "longrope": (
        "long.jsonl",
        [
            "model_config.rope_scaling={type: longrope, short_factor: [1.0, 1.2, 1.5, 2.0], "
            "long_factor: [1.0, 2.0, 4.0, 8.0], original_max_position_embeddings: 3500}",
            "model_config.max_position_embeddings=8192",
        ],
        0.2,
    ),
    "dynamic": (
        "long.jsonl",
        ["model_config.rope_scaling={type: dynamic, factor: 4.0, original_max_position_embeddings: 3500}"],
        0.2,
    ),
}
CP2, CP4 = ["parallel_config.context_parallel=2"], ["parallel_config.context_parallel=4"]
ULYSSES2 = CP2 + ["parallel_config.context_parallel_mode=ulysses"]
LAYOUTS: List[Tuple[str, str, List[str]]] = [
    ("long", "cp2", CP2),
    ("long", "cp4", CP4),
    ("long", "dp2 x cp2", CP2 + ["parallel_config.data_parallel=2"]),
    ("long", "tp2 x cp2", CP2 + ["parallel_config.tensor_parallel=2"]),
    ("long", "sharding2 x cp2", CP2 + ["parallel_config.sharding_parallel=2"]),
    (
        "long",
        "pp2 x cp2, recompute",
        CP2 + ["parallel_config.pipeline_parallel=2", "train_config.gradient_checkpointing=true"],
    ),
    ("packed", "cp2", CP2),
    ("lora", "cp2", CP2),
    ("long", "ulysses cp2", ULYSSES2),
    ("packed", "ulysses cp2", ULYSSES2),
    ("gemma3", "cp2, sliding window", CP2),
    ("longrope", "cp2", CP2),
    ("dynamic", "cp2", CP2),
]


def write_data(root: Path) -> Path:
    """long.jsonl: 12 samples of 3500-5100 characters (one token each: rows truncated to 4096 or padded);
    short.jsonl: 160 samples of 100-600 characters (many to a packed row); their tokenizer."""
    from bmtrain_cli.data.demo import train_demo_tokenizer

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def text(n: int) -> str:
        return "".join(rng.choice(letters, n))

    files = {
        "long.jsonl": [
            (text(int(rng.integers(2000, 2600))), text(int(rng.integers(1500, 2500)))) for _ in range(12)
        ],
        "short.jsonl": [
            (text(int(rng.integers(50, 300))), text(int(rng.integers(50, 300)))) for _ in range(160)
        ],
    }
    for name, rows in files.items():
        with open(root / name, "w") as f:
            for prompt, answer in rows:
                f.write(json.dumps({"input": prompt, "output": answer}) + "\n")
    train_demo_tokenizer(str(root / "tok"), [str(root / n) for n in files])
    return root


def _train_steps(cfg: Path, run: Path, sets: List[str], layout: List[str]) -> List[dict]:
    """Run ``cfg`` through `bmtrain train` (no layout) or `bmtrain run` with ``sets`` and the layout's
    overrides; the per-step metrics rows, one per step 1..STEPS."""
    args = [x for o in [*sets, *layout] for x in ("--set", o)]
    cmd = [sys.executable, "-m", "bmtrain_cli", "run" if layout else "train", "--config", str(cfg), *args]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "grad_norm" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return steps


def run_layout(data: Path, out: Path, model: str, layout: List[str]) -> Dict[str, np.ndarray]:
    """Train through `bmtrain train` (no layout) or `bmtrain run`; per-step loss and grad_norm."""
    out.mkdir(parents=True, exist_ok=True)
    name, sets, norm = MODELS[model]
    cfg = out / "config.yaml"
    cfg.write_text(
        CONFIG.format(
            seq=SEQ,
            tok=data / "tok",
            data=data / name,
            template="plain",
            out=out / "run",
            steps=STEPS,
        )
    )
    steps = _train_steps(cfg, out / "run", [*sets, f"train_config.max_grad_norm={norm}"], layout)
    got = {k: np.array([float(r[k]) for r in steps]) for k in ("loss", "grad_norm")}
    got["tokens"] = np.array(json.loads((out / "run" / "summary.json").read_text())["tokens_seen"])
    return got


def max_rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("cpdata"))


@pytest.fixture(scope="module")
def singles(tmp_path_factory):
    return tmp_path_factory.mktemp("single")


@pytest.fixture(scope="module")
def single(singles, data):
    cache: Dict[str, Dict[str, np.ndarray]] = {}

    def get(model: str) -> Dict[str, np.ndarray]:
        if model not in cache:
            cache[model] = run_layout(data, singles / model, model, [])
        return cache[model]

    return get


@pytest.mark.parametrize("model,name,layout", LAYOUTS, ids=[f"{m}:{n}" for m, n, _ in LAYOUTS])
def test_context_parallel_matches_one_process(tmp_path, data, single, model, name, layout):
    want = single(model)
    assert np.all(want["grad_norm"] > MODELS[model][2]), want["grad_norm"]  # the clip scales every step
    got = run_layout(data, tmp_path, model, layout)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{model} {name} {key}")
    np.testing.assert_array_equal(got["tokens"], want["tokens"])  # each token counted once over the ranks
    assert want["loss"][-1] < want["loss"][0]  # it trains


def gemma2_checkpoint(root: Path, tokenizer: Path) -> Path:
    """A fresh tiny Gemma 2 (a sliding layer with a window of 96 tokens, a global layer) whose scores the
    cap bends: attn_logit_softcapping 1.0, with weights drawn wide enough (std 0.2) that the scaled
    scores reach it; the vocabulary of the data's ``tokenizer``."""
    import dataclasses

    import paddle

    from bmtrain_cli.data.tokenizers import load_tokenizer
    from bmtrain_cli.models import build, save_pretrained
    from bmtrain_cli.models.families import family
    from tests.tiny import ARCH

    arch = dataclasses.replace(
        dataclasses.replace(ARCH, family="gemma2", **family("gemma2").defaults),
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        vocab_size=load_tokenizer(str(tokenizer)).vocab_size,
        layer_types=("sliding_attention", "full_attention"),
        sliding_window=96,
        query_pre_attn_scalar=8.0,
        attn_logit_softcapping=1.0,
        initializer_range=0.2,
    )
    paddle.seed(0)
    model = build(arch, kernels="reference")
    model.init_weights()
    save_pretrained(model, root)
    return root


def test_gemma2_soft_capped_scores_under_context_parallel_match_one_process(tmp_path, data):
    """cp2 (ring: the fused CPU pair kernel caps each score, kernels auto with our kernels built) against one
    process (the blocked kernel over whole rows) on 2048-token rows: per-step loss and grad_norm at 1e-5,
    the clip scaling every step."""
    base = gemma2_checkpoint(tmp_path / "gemma2", data / "tok")
    arch_keys = ("  family:", "  hidden_size:", "  intermediate_size:", "  num_")  # the checkpoint's own
    lines = [x for x in CONFIG.splitlines(keepends=True) if not x.startswith(arch_keys)]
    text = f"model_config:\n  model_name_or_path: {base}\n" + "".join(lines[1:])
    runs = {}
    for name, layout in (("single", []), ("cp2", CP2)):
        out = tmp_path / name
        out.mkdir()
        cfg = out / "config.yaml"
        cfg.write_text(
            text.format(
                seq=2048,
                tok=data / "tok",
                data=data / "long.jsonl",
                template="plain",
                out=out / "run",
                steps=STEPS,
            )
        )
        steps = _train_steps(cfg, out / "run", ["train_config.max_grad_norm=0.2"], layout)
        runs[name] = {k: np.array([float(r[k]) for r in steps]) for k in ("loss", "grad_norm")}
    want = runs["single"]
    assert np.all(want["grad_norm"] > 0.2), want["grad_norm"]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(runs["cp2"][key], want[key], rtol=1e-5, err_msg=key)


def test_a_context_parallel_checkpoint_resumes_in_one_process(tmp_path, data, single):
    """cp2 saves whole weights and the whole optimizer state at step 2; one process resumes from it and
    logs the uninterrupted single-process run's steps 3 and 4."""
    got = run_layout(data, tmp_path, "long", CP2 + ["train_config.save_steps=2"])
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    (run / "checkpoints" / "latest").write_text("step-2\n")
    cmd = [
        sys.executable,
        "-m",
        "bmtrain_cli",
        "train",
        "--config",
        str(tmp_path / "config.yaml"),
        "--resume",
    ]
    res = subprocess.run(
        cmd + ["--set", "train_config.max_grad_norm=0.2"], capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "not carried over" not in res.stdout + res.stderr  # the moments were restored
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resumed = {r["step"]: r for r in rows if "grad_norm" in r}
    want = single("long")
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5)
        np.testing.assert_allclose([resumed[3][key], resumed[4][key]], want[key][2:], rtol=1e-5, err_msg=key)


MOE_LAYOUTS = {
    "cp2": CP2,
    "ep2 x cp2": CP2 + ["parallel_config.expert_parallel=2"],
    "pp2 x cp2": CP2 + ["parallel_config.pipeline_parallel=2"],
}


def run_moe(root: Path) -> Dict[str, Dict[str, np.ndarray]]:
    """One process's (key "") and each MOE_LAYOUTS layout's run of the expert-parallel matrix's tiny
    Qwen3-MoE with its load-balancing loss on, on that matrix's data in rows padded to max_seq_len
    (tests/integration/test_expert_parallel.py)."""
    from tests.integration import test_expert_parallel as ep

    (root / "data").mkdir()
    data = ep.write_data(root / "data")
    runs = {"": ep.run_layout(data, root / "single", "qwen3_moe padded", [])}
    for i, (name, layout) in enumerate(MOE_LAYOUTS.items()):
        runs[name] = ep.run_layout(data, root / f"run-{i}", "qwen3_moe padded", layout)
    return runs


def test_the_moe_load_balancing_loss_under_context_parallel_matches_one_process(tmp_path):
    """The tiny Qwen3-MoE of test_expert_parallel.py with its load-balancing loss on, at cp2, ep2 x cp2 and
    pp2 x cp2, rows padded to max_seq_len: each rank routes its share of a row's tokens (padding routed, not
    counted), and the routers' per-expert sums are summed over the context group before the loss (under
    pipeline parallel: the sums the stages carry, on the last stage); per-step loss,
    grad_norm and aux_loss, the eval loss and the saved weights equal one process's, the clip scaling
    every step."""
    from tests.integration.test_expert_parallel import MODELS

    runs = run_moe(tmp_path)
    want = runs[""]
    assert np.all(want["grad_norm"] > MODELS["qwen3_moe padded"][2]), want["grad_norm"]
    assert want["loss"][-1] < want["loss"][0]
    weights = sorted(k for k in want if k.startswith("w:"))
    assert any(".experts." in k for k in weights)
    for name in MOE_LAYOUTS:
        got = runs[name]
        assert got["aux_loss"].size == STEPS
        for key in ("loss", "grad_norm", "aux_loss", "eval_loss"):
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{name} {key}")
        assert sorted(k for k in got if k.startswith("w:")) == weights  # every expert saved once
        for k in weights:  # AdamW moves an entry whose gradient is round-off by a fraction of lr
            assert (np.abs(got[k] - want[k]) > 1e-4).mean() < 1e-3, (name, k)


DPO = """model_config:
  model_name_or_path: {base}
  max_seq_len: {seq}
train_config:
  stage: dpo
  dpo_loss: sigmoid
  dpo_beta: 0.1
  data_path: {data}
  template: plain
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 1
  global_batch_size: 1
  learning_rate: 1.0e-4
  warmup_steps: 0
  logging_steps: 1
  save_steps: {steps}
  max_grad_norm: {norm}
  gradient_checkpointing: true
"""
DPO_KEYS = ("loss", "grad_norm", "rewards/chosen", "rewards/margins", "logps/chosen", "logps/rejected")
DPO_CLIP = 0.05


def write_pairs(root: Path) -> Path:
    """4 pairs (one a step) whose chosen and rejected sequences (prompt + response) exceed 4096 tokens (truncated to
    it: the prompt kept, the responses cut), with distinct responses."""
    rng = np.random.default_rng(1)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def text(n: int) -> str:
        return "".join(rng.choice(letters, n))

    path = root / "pairs.jsonl"
    with open(path, "w") as f:
        for _ in range(STEPS):
            prompt = text(int(rng.integers(1000, 1500)))
            f.write(json.dumps({"prompt": prompt, "chosen": text(3000), "rejected": text(3000)}) + "\n")
    return path


def run_dpo(base: Path, pairs: Path, out: Path, layout: List[str]) -> Dict[str, np.ndarray]:
    """DPO (sigmoid, reference = a frozen copy of ``base``, recompute) through `bmtrain train` or `bmtrain
    run`; per-step loss, grad_norm and TRL's metrics."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "config.yaml"
    text = DPO.format(base=base, seq=SEQ, data=pairs, out=out / "run", steps=STEPS, norm=DPO_CLIP)
    cfg.write_text(text)
    steps = _train_steps(cfg, out / "run", [], layout)
    return {k: np.array([float(r[k]) for r in steps]) for k in DPO_KEYS}


@pytest.fixture(scope="module")
def dpo_single(tmp_path_factory, data, single, singles):
    single("long")  # its last checkpoint is the starting model (and the reference)
    base = singles / "long" / "run" / "checkpoints" / f"step-{STEPS}"
    root = tmp_path_factory.mktemp("dpo")
    pairs = write_pairs(root)
    return base, pairs, run_dpo(base, pairs, root / "single", [])


def test_dpo_context_parallel_matches_one_process(tmp_path, dpo_single):
    """cp2: chosen and rejected rows split alike, each rank's partial log-probs summed over the context
    group (the frozen reference's too), the pairs counted once; the clip scales every step."""
    base, pairs, want = dpo_single
    assert np.all(want["grad_norm"] > DPO_CLIP), want["grad_norm"]
    assert want["rewards/margins"][0] == 0.0 and want["rewards/margins"][-1] != 0.0  # policy moves
    got = run_dpo(base, pairs, tmp_path, CP2)
    for key in ("loss", "grad_norm", "logps/chosen", "logps/rejected"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    for key in ("rewards/chosen", "rewards/margins"):  # beta x the round-off of ~4000 fp32 token log-probs
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5, err_msg=key)


if __name__ == "__main__":  # the table for docs/parallel.md; an argument: only the layouts naming it
    import tempfile

    only = sys.argv[1] if len(sys.argv) > 1 else ""
    with tempfile.TemporaryDirectory() as tmp:
        root = write_data(Path(tmp))
        refs: Dict[str, Dict[str, np.ndarray]] = {}
        print("| rows | layout | max rel. diff loss | max rel. diff grad_norm |\n|---|---|---|---|")
        for i, (model, name, layout) in enumerate(LAYOUTS):
            if only not in name:
                continue
            if model not in refs:
                refs[model] = run_layout(root, Path(tmp) / f"single-{model}", model, [])
            got = run_layout(root, Path(tmp) / f"run-{i}", model, layout)
            d = [max_rel_diff(got[k], refs[model][k]) for k in ("loss", "grad_norm")]
            print(f"| {model} | {name} | {d[0]:.1e} | {d[1]:.1e} |", flush=True)
        if only:
            sys.exit(0)
        base = Path(tmp) / "single-long" / "run" / "checkpoints" / f"step-{STEPS}"
        pairs = write_pairs(Path(tmp))
        want = run_dpo(base, pairs, Path(tmp) / "dpo-single", [])
        got = run_dpo(base, pairs, Path(tmp) / "dpo-cp2", CP2)
        d = [max_rel_diff(got[k], want[k]) for k in ("loss", "grad_norm")]
        print(f"| dpo pairs | cp2, recompute | {d[0]:.1e} | {d[1]:.1e} |", flush=True)
        runs = run_moe(Path(tmp) / "moe")
        for name in MOE_LAYOUTS:
            d = [max_rel_diff(runs[name][k], runs[""][k]) for k in ("loss", "grad_norm", "aux_loss")]
            print(f"| qwen3_moe, load-balancing loss | {name} | {d[0]:.1e} | {d[1]:.1e} | aux {d[2]:.1e} |")
