"""recipes/sft.py, copied and edited the way a user would: one decoder layer sleeps ``SLOW_SECONDS``
before each forward, so the pipeline stage holding it is the slow one (the sleep changes no number).
Layer 5 is the slow one for the first ``SWITCH_STEP`` steps, layer 0 after them. Launched by
tests/integration/test_pipeline_rebalance.py under the Paddle launcher."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, Optional, TextIO

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the checkout under test

from bmtrain_cli.config.load import LoadedConfig
from bmtrain_cli.train.run import load_recipe

SLOW_SECONDS = 0.25  # well above a layer's forward even on a loaded machine
SLOW_FIRST, SLOW_AFTER, SWITCH_STEP = 5, 0, 4

base = load_recipe("sft")  # recipes/sft.py: its setup and loop, unchanged
slow = {"layer": SLOW_FIRST}


def slow_down(layer: Any, index: int) -> None:
    forward = layer.forward

    def slowed(*args: Any, **kwargs: Any) -> Any:
        if slow["layer"] == index:
            time.sleep(SLOW_SECONDS)
        return forward(*args, **kwargs)

    layer.forward = slowed


def switch(parts: Any, state: Any, out: Any) -> None:
    if state.step >= SWITCH_STEP:
        slow["layer"] = SLOW_AFTER


def recipe(loaded: LoadedConfig, stream: Optional[TextIO] = None, on_step: Any = None) -> Dict[str, Any]:
    parts, state = base.setup(loaded, stream=stream)
    for index in (SLOW_FIRST, SLOW_AFTER):
        slow_down(parts.model.raw.model.layers[index], index)
    try:
        return base.train(parts, state, switch)
    finally:
        parts.metrics.close()


if __name__ == "__main__":
    from bmtrain_cli.cli import run_recipe_script

    run_recipe_script(sys.modules[__name__])  # `bmtrain train --recipe THIS_FILE`
