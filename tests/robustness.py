"""Shared by the robustness suites (tests/unit/test_robustness*.py, issue 18): what a clean end of a command
looks like, and the ways a file gets damaged."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable, Dict

from tests.tiny import model_yaml

USAGE_ERRORS = (
    "Invalid value",
    "No such option",
    "Missing option",
    "requires an argument",
    "Got unexpected",
    "does not take a value",
)


def assert_clean_exit(result: Any, what: str) -> None:
    """Exit 0, or exit 2 where every line is one problem (or the header), or Typer's own short usage
    error (a wrong type or range of an argument); no traceback, no crash."""
    out = result.output
    assert result.exit_code in (0, 2), f"{what}: exit {result.exit_code}\n{out}"
    assert "Traceback" not in out, f"{what}:\n{out}"
    exc = result.exception
    assert exc is None or isinstance(exc, SystemExit), f"{what}: {type(exc).__name__}: {exc}"
    if result.exit_code == 2:
        lines = [x for x in out.splitlines() if x.strip()]
        assert lines, f"{what}: exit 2 without a message"
        # click's usage error: "Usage: ..." then "Error: ...", or the "Error: ..." line alone
        if lines[0].startswith(("Usage: ", "Error: ")) or "─ Error ─" in lines[0]:
            assert len(lines) <= 8 and any(u in out for u in USAGE_ERRORS), f"{what}:\n{out}"
            return
        errors = [x for x in lines if x.startswith("error: ") or ": error: " in x]
        assert errors, f"{what}: exit 2 without an error line\n{out}"


def _truncate(at: Any) -> Callable[[Path], None]:
    def mutate(p: Path) -> None:
        data = p.read_bytes().rstrip()  # a trailing newline is no content: cut into the content
        n = at(len(data)) if callable(at) else at
        p.write_bytes(data[:n])

    return mutate


def _replace(content: bytes) -> Callable[[Path], None]:
    return lambda p: p.write_bytes(content)


FILE_MUTATIONS: Dict[str, Callable[[Path], None]] = {
    "empty": _truncate(0),
    "truncated at 8 bytes": _truncate(8),
    "truncated at half": _truncate(lambda n: n // 2),
    "last byte of content missing": _truncate(lambda n: n - 1),
    "garbage": _replace(bytes(range(256)) * 16),
    "pickle bytes": _replace(pickle.dumps({"step": 1, "weights": [1.0, 2.0]})),
    "missing": lambda p: p.unlink(),
}


# a fresh tiny LLaMA trained on a few arithmetic records, saving every step (the tokenizer is generated
# into output_dir/tokenizer)
RUN_YAML = (
    model_yaml(max_seq_len=24, kv_heads=None)
    + """train_config:
  data_path: {data}
  output_dir: {out}
  max_steps: {steps}
  micro_batch_size: 4
  learning_rate: 1.0e-3
  save_steps: 1
  logging_steps: 1
  num_workers: 0
"""
)


def run_config(tmp: Path, out: Path, data: Path, steps: int) -> str:
    """Write RUN_YAML for ``steps`` steps into ``tmp``; returns its path."""
    cfg = tmp / f"run-{steps}.yaml"
    cfg.write_text(RUN_YAML.format(data=data, out=out, steps=steps), encoding="utf-8")
    return str(cfg)


def write_arithmetic(path: Path, n: int = 40) -> Path:
    """``n`` instruction records ``{"input": "i+i=", "output": "2i"}``, one a line."""
    path.write_text("\n".join(json.dumps({"input": f"{i}+{i}=", "output": str(2 * i)}) for i in range(n)))
    return path
