"""Launchable training recipe: the same arguments as `bmtrain train`.

python recipes/train.py --config configs/quickstart.yaml
python -m paddle.distributed.launch --nproc_per_node 2 recipes/train.py --config C --set parallel_config.data_parallel=2
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
    from bmtrain_cli.cli import main

    main(["train", *sys.argv[1:]])
