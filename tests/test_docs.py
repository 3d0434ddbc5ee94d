"""The user docs describe the product as it is: every config key of the schema is in docs/config.md
(in the first column of its section's table), and no development history is left in them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Dict, Iterator, Tuple

from pydantic import BaseModel

from bmtrain_cli.config.schema import SECTION_MODELS

REPO = Path(__file__).resolve().parents[1]
CONFIG_MD = REPO / "docs" / "config.md"


def documented_rows() -> Dict[str, Dict[str, str]]:
    """section -> {key: its table row} from docs/config.md (a row may name several keys: `a, b` or `a / b`)."""
    out: Dict[str, Dict[str, str]] = {}
    section = None
    for line in CONFIG_MD.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## (\w+)", line)
        if heading:
            section = heading.group(1)
            out.setdefault(section, {})
        elif (
            section
            and line.startswith("| ")
            and not line.startswith("| key ")
            and not line.startswith("|---")
        ):
            first = line.split("|")[1]
            for key in re.split(r"[,/]| or ", first):
                if key.strip():
                    out[section][key.strip()] = line
    return out


def schema_keys(model: type, prefix: str = "") -> Iterator[Tuple[str, type]]:
    for name, field in model.model_fields.items():
        yield prefix + (field.alias or name), model
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from schema_keys(ann, prefix + (field.alias or name) + ".")


def test_every_schema_key_is_in_config_md():
    rows = documented_rows()
    missing = []
    for section, model in SECTION_MODELS.items():
        table = rows.get(section, {})
        for key, _ in schema_keys(model):
            parent, _, leaf = key.rpartition(".")
            if parent:  # a nested key is named in its parent's row
                if not re.search(rf"\b{leaf}\b", table.get(parent, "")):
                    missing.append(f"{section}.{key}")
            elif key not in table:
                missing.append(f"{section}.{key}")
    assert missing == [], f"keys missing from docs/config.md: {missing}"


def test_config_md_names_no_key_the_schema_lacks():
    rows = documented_rows()
    for section, model in SECTION_MODELS.items():
        known = {k for k, _ in schema_keys(model)}
        assert set(rows[section]) <= known, set(rows[section]) - known


HISTORY = re.compile(
    r"\bsession[- ]?[0-9]+|this session|previous session|this branch|\bother agents?\b", re.I
)


def test_user_docs_carry_no_development_history():
    files = [
        REPO / "README.md",
        *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "configs").glob("*.yaml")),
    ]
    found = [
        f"{p.relative_to(REPO)}:{i}: {line.strip()[:80]}"
        for p in files
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == []


def test_training_md_mfu_is_the_code_formula():
    """docs/training.md's MFU line: the FLOPs per token of train/monitoring/metrics.flops_per_token and the CPU peak of
    measured_matmul_flops (not a clock x FLOP/cycle estimate)."""
    from bmtrain_cli.train.monitoring.metrics import flops_per_token

    text = (REPO / "docs" / "training.md").read_text(encoding="utf-8")
    line = text[text.index("* MFU = ") :].split("\n* ")[0]
    assert "6 x parameters + 12 x layers x hidden x max_seq_len" in line
    assert flops_per_token(10, 2, 3, 4) == 6 * 10 + 12 * 2 * 3 * 4
    assert "measured_matmul_flops" in line and "FLOP/cycle" not in line
