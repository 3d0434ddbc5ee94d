"""Every shipped config loads and validates, and documents the command that runs it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bmtrain_cli.commands.summary import summarize
from bmtrain_cli.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    names = {p.name for p in CONFIGS}
    assert {
        "quickstart.yaml",
        "llama2-7b-sft-8gpu.yaml",
        "qwen2.5-7b-sft.yaml",
        "baichuan2-7b-sft.yaml",
    } <= names
    assert any("70b" in n for n in names)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path):
    loaded = load_config(str(path))
    s = summarize(loaded.config)
    base = loaded.config.model.model_name_or_path
    if base and base.startswith("output/") and not Path(base).exists():
        # a second-stage config (llama-tiny-lora.yaml) whose base is the checkpoint another shipped config
        # writes: before that run, validation warns about the missing base instead of sizing the model
        assert s["world_size"] >= 1 and any(base in w.message for w in loaded.warnings)
    else:
        assert s["world_size"] >= 1 and s["parameters"] > 0
    first = path.read_text().splitlines()[0]
    assert first.startswith("#")
    assert "bmtrain" in path.read_text().split("model_config")[0]


def test_seed_layout_in_llama2_config():
    cfg = load_config(str(next(p for p in CONFIGS if p.name == "llama2-7b-sft-8gpu.yaml"))).config
    assert (cfg.parallel.data_parallel, cfg.parallel.tensor_parallel, cfg.parallel.pipeline_parallel) == (
        4,
        2,
        1,
    )


PLAN_HEADER = re.compile(
    r"--device (\S+) estimates a peak of\s*#?\s*([\d.]+) GiB[^(]*\(needs ([\d.]+) GiB of ([\d.]+) GiB"
)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_plan_figures_in_the_header_are_the_plans(path):
    """A header quoting `bmtrain plan --device D` (peak, needs, device memory) quotes what the plan says
    now, within 2% (rounding and small refinements of the estimate; not a model left out)."""
    from bmtrain_cli.plan.estimator import estimate

    found = PLAN_HEADER.search(path.read_text().split("model_config")[0])
    if found is None:
        pytest.skip("no plan figures in the header")
    device, peak, needs, memory = found.group(1), *(float(x) * 2**30 for x in found.groups()[1:])
    est = estimate(load_config(str(path)).config, device)
    assert est.peak == pytest.approx(peak, rel=0.02) and est.required == pytest.approx(needs, rel=0.02)
    assert est.device.memory_bytes == memory and est.fits


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_the_layout_line_names_every_degree_of_the_world_size(path):
    """validate-config's layout line: the degrees it names multiply to the world size (context and expert
    parallel included where set)."""
    import math
    import re

    from bmtrain_cli.commands.summary import format_summary

    config = load_config(str(path)).config
    line = next(x for x in format_summary(config, str(path)) if x.strip().startswith("layout"))
    world = int(re.search(r"world size (\d+) =", line).group(1))
    degrees = re.findall(r"(?:data|tensor|pipeline|sharding|expert|context) (\d+)", line)
    assert math.prod(int(d) for d in degrees) == world, line
    assert ("context" in line) == (config.parallel.context_parallel > 1), line
