"""recipes/train.py, copied and edited the way a user would: decoder layer ``SLOW_LAYER`` sleeps
``SLOW_SECONDS`` before each forward, so the pipeline stage holding it is the slow one (the sleep changes
no number). Launched by tests/integration/test_pipeline_rebalance.py under the Paddle launcher."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout under test

from bmtrain_cli.config.load import LoadedConfig  # noqa: E402
from bmtrain_cli.train.run import load_recipe  # noqa: E402
from bmtrain_cli.train.setup import setup  # noqa: E402

SLOW_LAYER = 5
SLOW_SECONDS = 0.2

base = load_recipe("train")  # recipes/train.py: its loop, unchanged


def slow_down(layer: Any) -> None:
    forward = layer.forward

    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_SECONDS)
        return forward(*args, **kwargs)

    layer.forward = slowed


def recipe(loaded: LoadedConfig, stream: Optional[TextIO] = None, on_step: Any = None) -> Dict[str, Any]:
    parts, state = setup(loaded, stream=stream)
    slow_down(parts.model.raw.model.layers[SLOW_LAYER])
    try:
        return base.train(parts, state, on_step)
    finally:
        parts.metrics.close()


if __name__ == "__main__":
    from bmtrain_cli.cli import main

    sys.modules["bmtrain_recipe_train"] = sys.modules[__name__]  # `train` runs this file's recipe
    main(["train", *sys.argv[1:]])
