"""The equivalence matrix: every layout, through `bmtrain run`, logs the single process's per-step loss AND
grad_norm (1e-5 relative) on real settings.

* The shipped quickstart model (configs/quickstart.yaml: tied embeddings, max_grad_norm 1.0), warmup 0,
  4 optimizer steps of a global batch of 8. Its gradient norm is ~5 at step 1, so clipping scales every
  step (asserted): a layout whose norm or clip is off diverges from step 2.
* An untied grouped-query model (4 heads, 2 KV heads) with full recompute and packed rows.
* LoRA adapters under tensor parallel, also on fused projections held as their parts (Qwen3.5's
  ``in_proj_qkv``, Phi-3's ``qkv_proj`` and ``gate_up_proj``): the gathered adapters equal the single
  process's and PEFT loads them onto the transformers model.
* Qwen3.5's loss_sum compiled by to_static against dygraph.
* The 2026 dense families: ERNIE 4.5, Gemma 3 and the Qwen3.5 hybrid (Gated DeltaNet linear attention and
  gated full attention, tied), the last from a fresh checkpoint written once per session (the linear
  attention's sizes are a checkpoint's, not model_config's).

docs/parallel.md carries the table with the measured maximum differences
(``python -m tests.integration.test_parallel_matrix`` prints it).
"""

from __future__ import annotations

import atexit
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "configs" / "quickstart.yaml"
STEPS = 4
COMMON = [
    f"train_config.max_steps={STEPS}",
    "train_config.warmup_steps=0",
    "train_config.micro_batch_size=2",
    "train_config.global_batch_size=8",
    "train_config.logging_steps=1",
    "train_config.save_steps=4",
]
MODELS: Dict[str, List[str]] = {
    "quickstart": [],
    "quickstart-4-layers": ["model_config.num_hidden_layers=4"],
    "untied-gqa-recompute-packed": [
        "model_config.tie_word_embeddings=false",
        "model_config.num_key_value_heads=2",
        "train_config.gradient_checkpointing=true",
        "train_config.recompute_granularity=full",
        "train_config.batching=packed",
    ],
    "lora": ["train_config.finetuning=lora", "train_config.lora_target_modules=all-linear"],
    # tied Qwen2 (q/k/v biases) and Qwen3 (q/k norms) shapes, the small checkpoints users bring
    "qwen2-tied": ["model_config.family=qwen2"],
    "qwen3-tied": ["model_config.family=qwen3"],
    # ERNIE 4.5 (interleaved rope, biases everywhere, tied, GQA) and Gemma 3 (five sliding layers with a
    # window that bites and one global layer, (1 + w) sandwich norms, scaled embeddings, tied). Gemma 3's
    # round-off, like any run's, leaves a few gradient elements near AdamW's epsilon once clipped, where
    # the update follows the rounding; its layers turn that into step-2+ differences proportional to the
    # learning rate (at 3e-3: 5e-6 here, 1.4e-5 on another CPU, as large as one process against its own
    # reference kernels), so its rows train at 3e-4 (docs/parallel.md)
    "ernie4_5-gqa": ["model_config.family=ernie4_5", "model_config.num_key_value_heads=2"],
    "gemma3-window": [
        "model_config.family=gemma3_text",
        "model_config.num_hidden_layers=6",
        "model_config.sliding_window=4",
        "model_config.num_key_value_heads=2",
        "train_config.learning_rate=3.0e-4",
    ],
    # Qwen3.5 dense: three Gated DeltaNet layers (2 key heads, 4 value heads: one key head and its two
    # value heads per tp rank) and one gated full-attention layer (4 heads, 2 KV heads), tied embeddings
    "qwen3_5-hybrid": ["model_config.model_name_or_path={qwen3_5_text}"],
    # packed rows: the linear layers run each sample from a zero state, on split heads under tp2
    "qwen3_5-hybrid-packed": [
        "model_config.model_name_or_path={qwen3_5_text}",
        "train_config.batching=packed",
    ],
    # LoRA on every projection of both layer kinds: under tp2 the linear attention's [q; k; v] adapter is
    # one A shared by the three split parts and B split with them; a small max_grad_norm makes the clip
    # fire (the adapters' gradient is small: B starts at zero)
    # a fresh Phi-3 (fused qkv_proj and gate_up_proj): under tp each fused weight is drawn whole and cut into
    # its parts, so tp2 starts from the single process's weights
    "phi3-fresh": ["model_config.family=phi3"],
    # Phi-3 (fused qkv_proj and gate_up_proj, held as q/k/v and gate/up parts under tp) with LoRA on every
    # projection: under tp2 each fused projection's adapter is one A shared by its parts, B split with them
    "phi3-lora": [
        "model_config.model_name_or_path={phi3}",
        "model_config.tokenizer_path={qwen3_5_text}",
        "train_config.finetuning=lora",
        "train_config.lora_target_modules=all-linear",
    ],
    # the same model's loss_sum compiled by paddle.jit.to_static (one process; unpacked rows)
    "qwen3_5-hybrid-static": [
        "model_config.model_name_or_path={qwen3_5_text}",
        "train_config.to_static=true",
    ],
    "qwen3_5-hybrid-lora": [
        "model_config.model_name_or_path={qwen3_5_text}",
        "train_config.finetuning=lora",
        "train_config.lora_target_modules=all-linear",
        "train_config.max_grad_norm=0.05",
        "train_config.learning_rate=1.0e-2",
    ],
}
DP2 = ["parallel_config.data_parallel=2"]
TP2 = ["parallel_config.tensor_parallel=2"]
PP2 = ["parallel_config.pipeline_parallel=2"]
LAYOUTS: List[Tuple[str, str, List[str]]] = [
    ("quickstart", "dp2", DP2),
    ("quickstart", "tp2", TP2),
    ("quickstart", "pp2", PP2),
    ("quickstart", "sharding2", ["parallel_config.sharding_parallel=2", "parallel_config.sharding_stage=1"]),
    ("quickstart", "dp2 x tp2", DP2 + TP2),
    ("quickstart", "tp2 x pp2", TP2 + PP2),
    ("quickstart", "dp2 x pp2", DP2 + PP2),
    ("quickstart-4-layers", "pp4", ["parallel_config.pipeline_parallel=4"]),
    ("untied-gqa-recompute-packed", "tp2", TP2),
    ("untied-gqa-recompute-packed", "pp2", PP2),
    ("untied-gqa-recompute-packed", "dp2 x tp2", DP2 + TP2),
    ("untied-gqa-recompute-packed", "tp2 x pp2", TP2 + PP2),
    ("lora", "tp2", TP2),
    ("qwen2-tied", "pp2", PP2),
    ("qwen3-tied", "tp2 x pp2", TP2 + PP2),
    ("ernie4_5-gqa", "tp2", TP2),
    ("ernie4_5-gqa", "pp2", PP2),
    ("ernie4_5-gqa", "dp2", DP2),
    ("gemma3-window", "tp2", TP2),
    ("gemma3-window", "pp2", PP2),
    ("gemma3-window", "dp2", DP2),
    ("qwen3_5-hybrid", "tp2", TP2),
    ("qwen3_5-hybrid", "pp2", PP2),
    ("qwen3_5-hybrid", "dp2", DP2),
    ("qwen3_5-hybrid-packed", "tp2", TP2),
    ("qwen3_5-hybrid-lora", "tp2", TP2),
    ("phi3-fresh", "tp2", TP2),
    ("phi3-lora", "tp2", TP2),
]
_CHECKPOINTS: Dict[str, str] = {}


def _checkpoints() -> Dict[str, str]:
    """{name: directory} of the fresh checkpoints the models load, written on first use: a tied
    qwen3_5_text of the parity fixture's shape (tests/fixtures/hf/qwen3_5_text) with our initialisation,
    and the quickstart's demo tokenizer; a phi3 of tests/fixtures/hf/phi3_window's shape (the same
    tokenizer's vocabulary)."""
    if not _CHECKPOINTS:
        import dataclasses

        import paddle

        from bmtrain_cli.data.demo import train_demo_tokenizer, write_demo_data
        from bmtrain_cli.models import build, save_pretrained
        from bmtrain_cli.models.arch import read_hf_config

        out = Path(tempfile.mkdtemp(prefix="bmtrain-qwen3_5-"))
        atexit.register(shutil.rmtree, out, True)
        write_demo_data(str(out / "data"), task="reverse", seed=0)
        train_demo_tokenizer(
            str(out / "model"), [str(out / "data" / f) for f in ("train.jsonl", "heldout.jsonl")]
        )
        fixture = REPO / "tests" / "fixtures" / "hf" / "qwen3_5_text"
        arch = dataclasses.replace(read_hf_config(str(fixture)), tie_word_embeddings=True)
        paddle.seed(0)
        save_pretrained(build(arch, kernels="reference"), out / "model")
        _CHECKPOINTS["qwen3_5_text"] = str(out / "model")
        # Phi-3 of the phi3_window fixture's shape (fused qkv_proj and gate_up_proj, window 8), untied
        paddle.seed(0)
        phi3 = read_hf_config(str(REPO / "tests" / "fixtures" / "hf" / "phi3_window"))
        save_pretrained(build(phi3, kernels="reference"), out / "phi3")
        _CHECKPOINTS["phi3"] = str(out / "phi3")
    return _CHECKPOINTS


def _bmtrain(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bmtrain_cli", *args], capture_output=True, text=True, timeout=600
    )


def run_layout(out: Path, model: str, layout: List[str]) -> Dict[str, np.ndarray]:
    """Train through `bmtrain train` (no layout) or `bmtrain run`; per-step loss and grad_norm."""
    overrides = [o.format(**_checkpoints()) if "{" in o else o for o in MODELS[model]]
    sets = [x for o in COMMON + overrides + layout for x in ("--set", o)]
    res = _bmtrain("run" if layout else "train", "--config", str(QUICKSTART), *sets, "--output_dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "loss" in r and "grad_norm" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    return {k: np.array([float(r[k]) for r in steps]) for k in ("loss", "grad_norm")}


def max_rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want) / np.abs(want)))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    cache: Dict[str, Dict[str, np.ndarray]] = {}

    def get(model: str) -> Dict[str, Any]:
        if model not in cache:
            out = tmp_path_factory.mktemp("single")
            cache[model] = {**run_layout(out, model, []), "dir": out}
        return cache[model]

    return get


def test_the_clip_fires_in_the_reference_runs(single):
    """Otherwise the matrix would not exercise the clipping path it claims to check."""
    for model in (
        "quickstart",
        "untied-gqa-recompute-packed",
        "qwen3_5-hybrid",
        "qwen3_5-hybrid-packed",
        "qwen3_5-hybrid-lora",
        "gemma3-window",
    ):
        norms = single(model)["grad_norm"]
        clip = 0.05 if model.endswith("lora") else 1.0
        assert np.all(norms > clip), (model, norms)  # max_grad_norm: every step is scaled


@pytest.mark.parametrize("model,name,layout", LAYOUTS, ids=[f"{m}:{n}" for m, n, _ in LAYOUTS])
def test_layout_matches_one_process(tmp_path, single, model, name, layout):
    want = single(model)
    got = run_layout(tmp_path / "run", model, layout)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=f"{model} {name} {key}")
    assert want["loss"][-1] < want["loss"][0]  # it trains
    ckpt = tmp_path / "run" / "checkpoints" / f"step-{STEPS}"
    if model in FUSED_ADAPTERS:
        _check_gathered_adapters(ckpt, want["dir"] / "checkpoints" / f"step-{STEPS}", FUSED_ADAPTERS[model])
    elif model.startswith(
        "qwen3_5-hybrid"
    ):  # the split linear-attention parts are saved whole, under one-device names
        from bmtrain_cli.models import load_pretrained

        load_pretrained(str(ckpt), kernels="reference")


PEFT_LOGITS = """
import sys, numpy as np, torch, transformers, peft
base, ckpt, ids, out = sys.argv[1:]
m = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
m = peft.PeftModel.from_pretrained(m, ckpt).eval()
with torch.no_grad():
    np.save(out, m(input_ids=torch.from_numpy(np.load(ids))).logits.numpy())
"""


# the fused projections whose adapters a tp2 run holds on their parts and saves fused
FUSED_ADAPTERS = {"qwen3_5-hybrid-lora": ("in_proj_qkv",), "phi3-lora": ("qkv_proj", "gate_up_proj")}


def _check_gathered_adapters(ckpt: Path, single_ckpt: Path, fused: Tuple[str, ...]) -> None:
    """The tp2 run's adapters are saved whole in PEFT's layout under transformers' module names
    (the fused ``fused``, not their split parts): the single process's tensors (Adam moves near-zero gradients'
    elements by up to a few % of lr on rounding alone, as tests/integration/test_lora_parallel.py
    measures), and PEFT loads them onto the transformers model with the logits of our merged model."""
    import os

    import paddle

    from bmtrain_cli.lora import load_lora_checkpoint
    from bmtrain_cli.lora.merge import load_adapter_arrays

    got, want = load_adapter_arrays(ckpt), load_adapter_arrays(single_ckpt)
    assert set(got) == set(want) and all(any(f".{f}.lora_B." in n for n in got) for f in fused)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, atol=1e-2 * 5e-2, err_msg=name)
    ref = os.environ.get("BMTRAIN_REF_PYTHON")
    if not ref or not Path(ref).exists():
        return
    ids = np.random.default_rng(1).integers(3, 100, [2, 12])
    np.save(ckpt.parent / "ids.npy", ids)
    base = json.loads((ckpt / "lora_base.json").read_text())["base_model_name_or_path"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [
        ref,
        "-c",
        PEFT_LOGITS,
        base,
        str(ckpt),
        str(ckpt.parent / "ids.npy"),
        str(ckpt.parent / "peft.npy"),
    ]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    ours = load_lora_checkpoint(ckpt, merge=True, kernels="reference")(paddle.to_tensor(ids)).numpy()
    assert np.abs(np.load(ckpt.parent / "peft.npy") - ours).max() <= 1e-4


def test_qwen3_5_to_static_equals_dygraph(single):
    """train_config.to_static on the hybrid (Gated DeltaNet layers traced with the Paddle-op delta rule):
    the dygraph run's loss and grad_norm at every step (measured: equal losses, grad_norm 9.7e-8)."""
    want, got = single("qwen3_5-hybrid"), single("qwen3_5-hybrid-static")
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)


def test_pipeline_checkpoint_of_a_tied_model_loads_in_one_process(tmp_path, single):
    """The pp2 checkpoint of the tied quickstart model holds whole weights, the embedding once."""
    from bmtrain_cli.models import load_pretrained

    run_layout(tmp_path / "pp2", "quickstart", PP2)
    model = load_pretrained(str(tmp_path / "pp2" / "checkpoints" / f"step-{STEPS}"), kernels="reference")
    assert model.lm_head is None and model.arch.tie_word_embeddings


def test_gradient_compression_is_logged_per_step(tmp_path):
    """dp2 with int8 compression: metrics.jsonl and TensorBoard carry the bytes sent and the ratio."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "int8"
    sets = [x for o in COMMON + DP2 + ["parallel_config.gradient_compression=int8"] for x in ("--set", o)]
    res = _bmtrain("run", "--config", str(QUICKSTART), *sets, "--output_dir", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "compression_ratio" in r]
    assert len(steps) == STEPS
    assert all(3.0 < r["compression_ratio"] < 4.1 for r in steps)  # int8 + one fp32 scale per 256 values
    sent = [r["compression_bytes_sent"] for r in steps]
    assert sent == sorted(sent) and sent[0] > 0  # cumulative
    acc = EventAccumulator(str(out / "logs"))
    acc.Reload()
    assert "train/compression_ratio" in acc.Tags()["scalars"]


def test_two_nodes_on_one_machine_equal_one_process(tmp_path, single):
    """`bmtrain run --nnodes 2 --master 127.0.0.1:PORT --nproc_per_node 1`, started twice (two "nodes"
    rendezvous through the master), trains dp2 and logs the single process's loss and grad_norm."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    sets = [x for o in COMMON + DP2 for x in ("--set", o)]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "bmtrain_cli", "run", "--config", str(QUICKSTART), *sets]
            + ["--nnodes", "2", "--master", f"127.0.0.1:{port}", "--nproc_per_node", "1"]
            + ["--log_dir", str(tmp_path / f"node{i}"), "--output_dir", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    logs = [node.communicate(timeout=600)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(x[-2000:] for x in logs)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    got = {k: np.array([float(r[k]) for r in rows if "grad_norm" in r]) for k in ("loss", "grad_norm")}
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got[key], single("quickstart")[key], rtol=1e-5)


if __name__ == "__main__":  # the table for docs/parallel.md
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        refs: Dict[str, Dict[str, np.ndarray]] = {}
        print("| model | layout | max rel. diff loss | max rel. diff grad_norm |\n|---|---|---|---|")
        for i, (model, name, layout) in enumerate(LAYOUTS):
            if model not in refs:
                refs[model] = run_layout(Path(tmp) / f"single-{model}", model, [])
            got = run_layout(Path(tmp) / f"run-{i}", model, layout)
            d = [max_rel_diff(got[k], refs[model][k]) for k in ("loss", "grad_norm")]
            print(f"| {model} | {name} | {d[0]:.1e} | {d[1]:.1e} |", flush=True)
