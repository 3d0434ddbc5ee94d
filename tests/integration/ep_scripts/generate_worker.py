"""Worker for test_expert_dispatch.py's decoding case: a tiny Qwen3-MoE (the same weights on every rank)
with its experts split over the group (parallel/expert_parallel.shard_experts), sampling this rank's own
prompts with this rank's own max_new_tokens through models/generate.py, so that a rank finishes before the
others and keeps stepping for their dispatch; writes the tokens and how many forwards the rank ran.

Run under `python -m paddle.distributed.launch --nproc_per_node N`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, List

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import paddle
from dispatch_worker import group_of_all

from bmtrain_cli.models import build
from bmtrain_cli.models.decoding import SamplingOptions
from bmtrain_cli.models.families import family
from bmtrain_cli.models.generate import generate
from bmtrain_cli.parallel.expert_parallel import shard_experts
from tests.unit.models.tiny import TINY

ARCH = replace(
    TINY,
    family="qwen3_moe",
    **{
        **family("qwen3_moe").defaults,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 24,
    },
)
# per rank: its prompts and the most tokens it samples (rank 0 is done first)
PROMPTS = [[[5, 9, 11, 3], [4, 2]], [[7, 7, 1], [9, 8, 6, 5, 4], [3]]]
MAX_NEW = [2, 6]


def model() -> Any:
    paddle.seed(0)
    return build(ARCH)


def sample(m: Any, rank: int) -> List[List[int]]:
    return generate(m, PROMPTS[rank], SamplingOptions(max_new_tokens=MAX_NEW[rank], temperature=1.0, seed=5))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    group = group_of_all()
    m = model()
    shard_experts(m, group)
    forwards = [0]
    real = m.hidden_states

    def counted(*a: Any, **k: Any) -> Any:
        forwards[0] += 1
        return real(*a, **k)

    m.hidden_states = counted
    tokens = sample(m, group.rank)
    Path(f"{args.out}.{group.rank}.json").write_text(json.dumps({"tokens": tokens, "forwards": forwards[0]}))


if __name__ == "__main__":
    main()
