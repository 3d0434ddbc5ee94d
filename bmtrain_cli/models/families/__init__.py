"""The model families: one module per family in this folder, each defining ``FAMILY``.

A family says which Hugging Face ``model_type`` names it reads, the architecture flags it sets (its
defaults, used for a fresh model and as the defaults when reading a config.json), the config.json keys it
reads and writes beyond the shared ones. Everything else (the schema's
``model_config.family`` choices, reading and writing config.json, the checks) is derived from this
registry, so adding a dense family is adding one module here plus its parity test; see
docs/architecture.md, "Adding a model family".

This package imports nothing else of bmtrain_cli but ``errors``: ``models/arch.py`` builds on it.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Tuple

from bmtrain_cli.models.families._base import Family


def _discover() -> Dict[str, Family]:
    found: Dict[str, Family] = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if not isinstance(family, Family):
            raise TypeError(f"{module.__name__} defines no FAMILY = Family(...)")
        if family.name in found:
            raise TypeError(f"family {family.name!r} is defined twice ({module.__name__})")
        found[family.name] = family
    return found


FAMILIES: Dict[str, Family] = _discover()
MODEL_TYPES: Dict[str, str] = {mt: f.name for f in FAMILIES.values() for mt in f.model_types}
FAMILY_NAMES: Tuple[str, ...] = tuple(FAMILIES)


def family(name: str) -> Family:
    return FAMILIES[name]


__all__ = ["FAMILIES", "FAMILY_NAMES", "MODEL_TYPES", "Family", "family"]
