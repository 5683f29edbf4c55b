"""Argument checks shared by the public constructors: one wording for every "must be a number" error."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np

from optax_hybrid import _compat


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


def hyperparameter(owner: str, name: str, value: Any, *, low: float, high: float | None = None,
                   high_open: bool = False) -> None:
  """Checks an optimizer hyperparameter: a scalar number within the bounds, or a traced value (taken as given).

  Raises:
    TypeError: for a bool, a string, or an array that is not a scalar number.
    ValueError: for a value that is not finite or out of range, naming ``owner`` and ``name``.
  """
  x = _concrete_float(owner, name, value)
  if x is None:
    return
  if not math.isfinite(x):
    raise ValueError(f"{owner}: `{name}` must be finite, got {x!r}.")
  if x < low or (high is not None and (x >= high if high_open else x > high)):
    accepted = f">= {low}" if high is None else f"in [{low}, {high}{')' if high_open else ']'}"
    hint = ""
    if high_open and x == high and not isinstance(value, numbers.Real):
      # A beta that rounded up to 1: typically optax.inject_hyperparams casting
      # hyperparameters to the dtype of bf16/fp16 params.
      hint = (" It is a low-precision array: with optax.inject_hyperparams and "
              "bf16/fp16 params pass hyperparam_dtype=jnp.float32.")
    raise ValueError(f"{owner}: `{name}` must be {accepted}, got {x!r}.{hint}")


def flag(owner: str, name: str, value: Any) -> bool:
  """``value`` as a bool, or a TypeError naming ``owner`` and ``name`` (NumPy bools are accepted)."""
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{owner}: `{name}` must be a Python bool, got {value!r}.")
  return bool(value)


def _concrete_float(owner: str, name: str, value: Any) -> float | None:
  """``value`` as a Python float, or None when it is traced (then it cannot be checked here)."""
  if isinstance(value, _compat.Tracer):
    return None
  if isinstance(value, bool):
    raise TypeError(f"{owner}: `{name}` must be a number, got the bool {value!r}.")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.ndim(value) != 0 or not jax.numpy.issubdtype(np.asarray(value).dtype, jax.numpy.number):
      raise TypeError(f"{owner}: `{name}` must be a scalar number, got an array of shape {np.shape(value)} "
                      f"and dtype {np.asarray(value).dtype}.")
    return float(np.asarray(value))
  raise TypeError(f"{owner}: `{name}` must be a number, got {value!r} of type {type(value).__name__}.")
