"""Expert parallel through `bmtrain run` logs the single process's per-step loss AND grad_norm (1e-5
relative): the tiny Qwen3-MoE (4 experts, top 2, the load-balancing loss on), DeepSeek-V3 (8 experts in 4
groups, sigmoid routing, a shared expert, latent attention; no auxiliary loss) and ERNIE 4.5 MoE parity
checkpoints (tests/fixtures/hf), the Qwen3-MoE with LoRA on its attention and on its experts'
projections (also on an nf4 base, QLoRA: each rank quantises only its own experts), and DPO on the
Qwen3-MoE (full, with a frozen reference; LoRA, with precomputed reference log-probs, also under pipeline
parallel with and without expert parallel; both with the load-balancing loss); expert parallel alone and
beside data, pipeline and tensor parallel; the demo task's records,
4 optimizer steps of 4 rows with a max_grad_norm below every step's norm (asserted), so a layout whose
norm or clip is off diverges from step 2. The load-balancing loss each step logs is the single process's
too. The eval loss (each rank evaluates its shard on a copy with every expert gathered) and the
checkpoint each layout writes (the experts gathered from their ranks) equal the single process's.

docs/parallel.md carries the table (``python -m tests.integration.test_expert_parallel`` prints it).
"""

from __future__ import annotations

import functools
import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np
import pytest

from tests.integration.test_context_parallel import max_rel_diff
from tests.integration.test_families_end_to_end import FIXTURES

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS = 4
CONFIG = """model_config:
  model_name_or_path: {model}
  tokenizer_path: {data}/tok
  max_seq_len: 24
train_config:
  data_path: {data}/train.jsonl
  eval_data_path: {data}/heldout.jsonl
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 1
  global_batch_size: 4
  learning_rate: 1.0e-2
  adam_epsilon: 1.0e-6
  warmup_steps: 0
  logging_steps: 1
  save_steps: {steps}
  num_workers: 0
"""
AUX = ["model_config.output_router_logits=true"]
LORA = ["train_config.finetuning=lora", "train_config.lora_target_modules=[q_proj,k_proj,v_proj,o_proj]"]
EXPERT_LORA = [
    "train_config.finetuning=lora",
    "train_config.lora_target_modules=[q_proj,v_proj,gate_proj,up_proj,down_proj]",
]
# QLoRA: an nf4 base (blocks of 16 divide the experts' 48 inputs), each rank quantising its own experts
QLORA = EXPERT_LORA + ["model_config.quantization.method=nf4", "model_config.quantization.block_size=16"]
# DPO on the preference pairs write_data adds (a frozen copy of the starting weights as the reference)
DPO = [
    "train_config.stage=dpo",
    "train_config.data_path={data}/pairs.jsonl",
    "train_config.eval_data_path={data}/pairs-heldout.jsonl",
]
# checkpoint (tests/fixtures/hf), settings, max_grad_norm (below every step's norm: the clip scales every step)
MODELS: Dict[str, Tuple[str, List[str], float]] = {
    "qwen3_moe": ("qwen3_moe", AUX, 0.5),
    # rows padded to max_seq_len (test_context_parallel.py: the padding left out of the aux loss)
    "qwen3_moe padded": ("qwen3_moe", AUX + ["train_config.batching=max_length"], 0.5),
    "deepseek_v3": ("deepseek_v3", [], 0.5),
    "ernie4_5_moe": ("ernie4_5_moe", AUX, 0.5),
    "qwen3_moe + LoRA": ("qwen3_moe", AUX + LORA, 0.05),
    "qwen3_moe + LoRA on the experts": ("qwen3_moe", AUX + EXPERT_LORA, 0.05),
    "qwen3_moe QLoRA on the experts": ("qwen3_moe", AUX + QLORA, 0.05),
    "qwen3_moe DPO": ("qwen3_moe", DPO + AUX, 0.05),  # the pair loss + coef x the load-balancing loss
    # the reference is the policy with its adapters off, its log-probs computed once by every rank
    "qwen3_moe DPO + LoRA": (
        "qwen3_moe",
        DPO
        + AUX
        + ["train_config.finetuning=lora", "train_config.lora_target_modules=all-linear"]
        + ["train_config.precompute_ref_log_probs=true"],
        0.01,
    ),
}
EP2 = ["parallel_config.expert_parallel=2"]
PP2 = ["parallel_config.pipeline_parallel=2"]
TP2 = ["parallel_config.tensor_parallel=2"]
# adam_epsilon 1e-6 (not 1e-8): AdamW's first steps move an entry by lr x g / (|g| + eps), so with eps 1e-8
# an entry whose gradient is a few 1e-8 (a cancellation, 0.6% of the tiny Qwen3-MoE's entries) turns the
# round-off of any other summation order into a move of up to 4% of lr. Every layout sums in its own order
# (data ranks, the tensor ranks' halves); with 1e-8 that alone took ep2 x tp2's grad_norm 2.9e-5 off at step
# 3, with every parameter entry whose |g| > 30 eps equal after step 1 (docs/parallel.md). A wrong shard or
# a doubled expert is off from step 1
LAYOUTS: List[Tuple[str, str, List[str]]] = [
    ("qwen3_moe", "ep2", EP2),
    ("qwen3_moe", "dp2 x ep2", EP2 + ["parallel_config.data_parallel=2"]),
    ("deepseek_v3", "ep2", EP2),
    ("deepseek_v3", "dp2 x ep2", EP2 + ["parallel_config.data_parallel=2"]),
    ("qwen3_moe", "ep2 x pp2", EP2 + PP2),
    ("qwen3_moe", "ep2 x tp2", EP2 + TP2),
    ("deepseek_v3", "ep2 x pp2", EP2 + PP2),
    ("deepseek_v3", "ep2 x tp2", EP2 + TP2),
    ("ernie4_5_moe", "dp2", ["parallel_config.data_parallel=2"]),
    ("qwen3_moe + LoRA", "ep2", EP2),
    ("qwen3_moe + LoRA on the experts", "ep2", EP2),
    ("qwen3_moe QLoRA on the experts", "ep2", EP2),
    ("qwen3_moe DPO + LoRA", "ep2", EP2),
    # the pair loss on the last stage, plus the load-balancing loss of the routers' sums the stages carry
    ("qwen3_moe DPO + LoRA", "pp2", PP2),
    ("qwen3_moe DPO + LoRA", "ep2 x pp2", EP2 + PP2),
    # beside context parallel: the last stage sums its share's log-probs and the routers' sums over the group
    ("qwen3_moe DPO + LoRA", "pp2 x cp2", PP2 + ["parallel_config.context_parallel=2"]),
    ("qwen3_moe DPO", "ep2 x tp2", EP2 + TP2),
]


def write_data(root: Path) -> Path:
    """The reverse demo's first 64 training and 8 held-out records, a one-character tokenizer, and 32 + 6
    preference pairs of the same task."""
    from bmtrain_cli.data.demo import demo_records, train_demo_tokenizer, write_demo_files
    from bmtrain_cli.preference.demo import preference_records

    train, held = demo_records("reverse", 0)
    paths = write_demo_files(str(root), {"train": train[:64], "heldout": held[:8]})
    train_demo_tokenizer(str(root / "tok"), paths.values())
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghij") for _ in range(5)) for _ in range(38)]
    for name, part in (("pairs", words[:32]), ("pairs-heldout", words[32:])):
        lines = [json.dumps(r) for r in preference_records(part, rng)]
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def run_layout(data: Path, out: Path, model: str, layout: List[str]) -> Dict[str, np.ndarray]:
    """Train through `bmtrain train` (no layout) or `bmtrain run`; per-step loss and grad_norm, the eval
    loss and the last checkpoint's weights."""
    from safetensors.numpy import load_file

    out.mkdir(parents=True, exist_ok=True)
    checkpoint, sets, norm = MODELS[model]
    cfg = out / "config.yaml"
    cfg.write_text(CONFIG.format(model=FIXTURES / checkpoint, data=data, out=out / "run", steps=STEPS))
    sets = [o.format(data=data) for o in sets]
    args = [x for o in [*sets, f"train_config.max_grad_norm={norm}", *layout] for x in ("--set", o)]
    cmd = [sys.executable, "-m", "bmtrain_cli", "run" if layout else "train", "--config", str(cfg), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    held = [
        line for line in res.stdout.splitlines() if "expert parallel: rank 0 of 2 holds experts 0-" in line
    ]
    assert bool(held) == any("expert_parallel" in o for o in layout), res.stdout[-2000:]
    quantised = re.findall(r"quantised base: (\d+) linear layers", res.stdout)  # QLoRA: rank 0's count
    assert bool(quantised) == any(o.startswith("model_config.quantization") for o in sets), res.stdout[-2000:]
    rows = [
        json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]
    steps = [r for r in rows if "loss" in r and "grad_norm" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    got: Dict[str, np.ndarray] = {k: np.array([float(r[k]) for r in steps]) for k in ("loss", "grad_norm")}
    got["aux_loss"] = np.array([float(r["aux_loss"]) for r in steps if "aux_loss" in r])
    got["eval_loss"] = np.array([float(r["eval_loss"]) for r in rows if "eval_loss" in r])
    got["quantised_layers"] = np.array([int(n) for n in quantised])
    assert got["eval_loss"].size == 1
    ckpt = out / "run" / "checkpoints" / f"step-{STEPS}"
    for f in sorted(
        [*ckpt.glob("model*.safetensors"), *ckpt.glob("adapter_model.safetensors")]
    ):  # not the optimizer
        got.update({f"w:{k}": v for k, v in load_file(str(f)).items()})
    return got


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_data(tmp_path_factory.mktemp("epdata"))


@pytest.fixture(scope="module")
def single(tmp_path_factory, data):
    """One process's run of each model, trained once for the module."""

    @functools.cache
    def run(model: str) -> Dict[str, np.ndarray]:
        return run_layout(data, tmp_path_factory.mktemp("single"), model, [])

    return run


@pytest.mark.parametrize("model,name,layout", LAYOUTS, ids=[f"{m}:{n}" for m, n, _ in LAYOUTS])
def test_expert_parallel_matches_one_process(tmp_path, data, single, model, name, layout):
    want = single(model)
    assert np.all(want["grad_norm"] > MODELS[model][2]), want["grad_norm"]  # the clip scales every step
    got = run_layout(data, tmp_path, model, layout)
    # the load-balancing loss is logged every step, as one process logs it (pipeline stages included)
    assert got["aux_loss"].size == (STEPS if AUX[0] in MODELS[model][1] else 0)
    for key in ("loss", "grad_norm", "eval_loss", "aux_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{model} {name} {key}")
    if want["quantised_layers"].size:  # rank 0 quantised its own experts alone: 2 of 4 in 2 sparse layers
        assert want["quantised_layers"][0] - got["quantised_layers"][0] == 2 * 2 * 3, got["quantised_layers"]
    weights = sorted(k for k in want if k.startswith("w:"))
    lora = "LoRA" in model  # LoRA saves the adapters only, each expert's own when it targets them
    assert all("lora_" in k for k in weights) == lora, weights[:4]
    on_experts = any("gate_proj" in o or "all-linear" in o for o in MODELS[model][1])
    assert (".experts." in " ".join(weights)) == (not lora or on_experts), weights[:4]
    assert sorted(k for k in got if k.startswith("w:")) == weights
    for k in weights:  # every expert saved once, from the rank holding it, after 4 updates
        # AdamW's first steps move an entry by about lr whatever its gradient's size, so an entry whose
        # gradient is round-off may differ; a misplaced tensor differs almost everywhere
        off = np.abs(got[k] - want[k]) > 1e-4
        assert got[k].shape == want[k].shape and off.mean() < 1e-3, (k, off.mean())
    assert want["loss"][-1] < want["loss"][0]  # it trains


def test_an_expert_parallel_checkpoint_resumes_exactly(tmp_path, data, single):
    """dp2 x ep2 saves the whole weights and each rank's optimizer part at step 2; resumed under the same
    layout it logs the uninterrupted single-process run's steps 3 and 4."""
    layout = EP2 + ["parallel_config.data_parallel=2", "train_config.save_steps=2"]
    run_layout(data, tmp_path, "qwen3_moe", layout)
    run = tmp_path / "run"
    shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
    (run / "checkpoints" / "latest").write_text("step-2\n")
    sets = [*MODELS["qwen3_moe"][1], f"train_config.max_grad_norm={MODELS['qwen3_moe'][2]}", *layout]
    cmd = [sys.executable, "-m", "bmtrain_cli", "run", "--config", str(tmp_path / "config.yaml"), "--resume"]
    res = subprocess.run(
        cmd + [x for o in sets for x in ("--set", o)], capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "not carried over" not in res.stdout + res.stderr  # each rank's moments were restored
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    resumed = {r["step"]: r for r in rows if "grad_norm" in r}
    want = single("qwen3_moe")
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([resumed[3][key], resumed[4][key]], want[key][2:], rtol=1e-5, err_msg=key)


def table(root: Path) -> List[str]:
    """docs/parallel.md's table: each layout's largest relative difference from one process over the steps."""
    models = list(dict.fromkeys(m for m, _, _ in LAYOUTS))
    refs = {m: run_layout(root, root / f"single-{i}", m, []) for i, m in enumerate(models)}
    rows = ["| model | layout | loss | grad_norm |", "|---|---|---|---|"]
    for i, (model, name, layout) in enumerate(LAYOUTS):
        got = run_layout(root, root / f"run-{i}", model, layout)
        diffs = [f"{max_rel_diff(got[k], refs[model][k]):.1e}" for k in ("loss", "grad_norm")]
        rows.append(f"| {model} | {name} | {' | '.join(diffs)} |")
    return rows


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        print("\n".join(table(write_data(Path(tmp)))))
