"""The value types and the base block every config model shares (REFERENCE.md section 2).

Kept apart from `zeromem.config.schema` so that the blocks of each concern (the schema's
own, `config.optimizer_blocks`, `config.features`) can be written in their own modules.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, PrivateAttr, StrictBool,
                      model_validator)
from pydantic_core import PydanticCustomError

from zeromem.config.rules import map_renamed_keys


# Largest magnitude a number may have: sizes and counts end up in int64 tensors and C
# size_t, and anything beyond is a typo (a 400-digit batch size), not a setting.
NUMBER_LIMIT = 2**63 - 1


def _check_number(kind: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PydanticCustomError(f"{kind}_type", "Input should be a valid {kind}",
                                  {"kind": kind})
    if isinstance(value, float) and not math.isfinite(value):
        raise PydanticCustomError("finite_number", "Input should be a finite number")
    if abs(value) > NUMBER_LIMIT:
        raise PydanticCustomError("number_too_large", "Input should be at most 2**63 - 1")
    return value


def _numeric(kind: str) -> BeforeValidator:
    """Reject booleans and strings where a number is expected (pydantic's lax mode takes them),
    NaN and infinities (JSON's NaN/Infinity literals), and numbers beyond NUMBER_LIMIT."""
    return BeforeValidator(lambda value: _check_number(kind, value))


def _not_bool(value: Any) -> Any:
    """Reject booleans before an integer Literal: pydantic's lax mode takes true as 1."""
    if isinstance(value, bool):
        raise PydanticCustomError("int_type", "Input should be a valid integer")
    return value


def _steps_per_print(value: Any) -> Any:
    """A positive whole number, or Infinity (never print): what Accelerate passes."""
    if isinstance(value, float) and value == math.inf:
        return value
    value = _check_number("int", value)
    if isinstance(value, float) and not value.is_integer():
        raise PydanticCustomError("int_from_float", "Input should be a whole number")
    if value < 1:
        raise PydanticCustomError("greater_than_equal", "Input should be >= 1", {"ge": 1})
    return int(value)


Int = Annotated[int, _numeric("int")]  # whole floats like 5e8 become ints
Float = Annotated[float, _numeric("float")]
Bool = StrictBool
StepsPerPrint = Annotated[float, PlainValidator(_steps_per_print)]  # an int, or math.inf
Dtype = Literal["fp32", "fp16", "bf16"]
OffloadDevice = Literal["none", "cpu", "nvme"]


class _Block(BaseModel):
    """Base of every config block: unknown keys are errors and legacy names are mapped."""

    model_config = ConfigDict(extra="forbid")
    # Legacy key -> (current key, deprecated?): accepted in this block, renamed before validation.
    _renamed: ClassVar[dict[str, tuple[str, bool]]] = {}
    # Dotted path of this block, used in warnings.
    _section: ClassVar[str] = ""
    # Fields whose value was derived (batch rules, "auto", stage-dependent defaults).
    _derived: set[str] = PrivateAttr(default_factory=set)

    @model_validator(mode="before")
    @classmethod
    def _map_renamed_keys(cls, data: Any) -> Any:
        return map_renamed_keys(data, cls._renamed, cls._section)



def _pair(value: Any) -> Any:
    """A JSON list of exactly two items (Adam's betas); pydantic would name a missing index."""
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise PydanticCustomError("pair_type", "Input should be a pair")
    return value


_Beta = Annotated[Float, Field(ge=0, lt=1)]
