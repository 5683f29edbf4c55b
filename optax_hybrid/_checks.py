"""Argument checks shared by the public constructors: one wording for every "must be a number" error."""

from __future__ import annotations

import math
import numbers
from typing import Any


def real(owner: str, name: str, value: Any, *, low: float | None = None, high: float | None = None,
         high_open: bool = False) -> float:
  """``value`` as a finite Python float within the bounds, or a TypeError/ValueError naming ``owner`` and ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{owner}: `{name}` must be a real number, got {value!r} of type {type(value).__name__}.")
  x = float(value)
  if not math.isfinite(x):
    raise ValueError(f"{owner}: `{name}` must be finite, got {x!r}.")
  if (low is not None and x < low) or (high is not None and (x >= high if high_open else x > high)):
    accepted = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
    raise ValueError(f"{owner}: `{name}` must be {accepted}, got {x!r}.")
  return x


def integer(owner: str, name: str, value: Any, *, low: int | None = None, what: str = "an integer") -> int:
  """``value`` as a Python int ``>= low``, or a TypeError/ValueError naming ``owner`` and ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{owner}: `{name}` must be {what}, got {value!r} of type {type(value).__name__}.")
  if low is not None and value < low:
    raise ValueError(f"{owner}: `{name}` must be >= {low}, got {value}.")
  return int(value)
