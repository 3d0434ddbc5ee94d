"""The base of every config section: unknown keys forbidden, frozen, no booleans read as numbers."""

from __future__ import annotations

import types
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, field_validator

Dtype = Literal["float32", "bfloat16", "float16"]


def _allows_bool(tp: Any) -> bool:
    if tp is bool or tp is Any:
        return True
    origin = get_origin(tp)
    if origin is Literal:
        return any(isinstance(a, bool) for a in get_args(tp))
    if origin is Union or origin is types.UnionType:
        return any(_allows_bool(a) for a in get_args(tp))
    return False


class _Section(BaseModel):
    # allow_inf_nan=False: YAML reads .inf and .nan as floats; no field of a config means either
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, protected_namespaces=(), allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: Any) -> Any:
        # pydantic's lax mode turns true/false (and YAML's yes/no/on/off) into 1/0 for a number field
        if isinstance(value, bool) and info.field_name in cls.model_fields:
            tp = cls.model_fields[info.field_name].annotation
            if not _allows_bool(tp):
                raise ValueError(
                    f"got the boolean {str(value).lower()}, which this field does not take (YAML reads "
                    "true/false, yes/no and on/off as booleans)"
                )
        return value
