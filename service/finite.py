"""Finite numbers for settings: NaN and infinities are refused as such, before any range check.

pydantic checks ``gt=0`` before ``allow_inf_nan=False``, so ``NaN`` (which JSON's ``NaN``, a flag's
``nan`` and an env var's ``nan`` all give) was told "should be greater than 0", and ``inf`` passed a
``ge=0`` field unchecked: neither says what to change.
"""
from __future__ import annotations

import math
from typing import Annotated

from pydantic import BeforeValidator
from pydantic_core import PydanticCustomError


def _finite(value: object) -> object:
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return value  # not a number at all: pydantic's own message says so
    if isinstance(number, float) and not math.isfinite(number):
        raise PydanticCustomError("finite_number", "{value} is not a finite number; give a number of seconds "
                                  "such as 30", {"value": str(value)})
    return value


# The longest a duration setting may be: a month. Longer is a typo (1e300 was taken, and logged in 300 digits).
MAX_SECONDS = 31 * 24 * 3600.0
Finite = BeforeValidator(_finite)
FiniteFloat = Annotated[float, Finite]
