"""Learning-rate schedules with ColossalAI ``CosineAnnealingWarmupLR`` semantics."""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

from optax_hybrid import _checks

# The largest step count any JAX integer type holds (int64): no count reaches
# a schedule length beyond it, and floats represent every length up to it.
MAX_STEPS = 2**63 - 1


def _checked(peak_value: Any, total_steps: Any, warmup_steps: Any, eta_min: Any) -> tuple:
  """:func:`warmup_cosine_schedule`'s arguments, checked: ``(peak_value, eta_min, total_steps, warmup_steps)``."""
  owner, steps = "warmup_cosine_schedule", "an integer number of steps"
  peak_value = _checks.real(owner, "peak_value", peak_value)
  eta_min = _checks.real(owner, "eta_min", eta_min)
  total_steps = _checks.integer(owner, "total_steps", total_steps, what=steps)
  warmup_steps = _checks.integer(owner, "warmup_steps", warmup_steps, what=steps)
  if warmup_steps < 0:
    raise ValueError(
        f"warmup_cosine_schedule: `warmup_steps` must be >= 0, got {warmup_steps}."
    )
  if total_steps > MAX_STEPS:
    raise ValueError(
        f"warmup_cosine_schedule: `total_steps` must be at most 2**63 - 1 (the largest int64 "
        f"step count), got {total_steps}."
    )
  if total_steps <= warmup_steps:
    raise ValueError(
        "warmup_cosine_schedule: `total_steps` must be greater than "
        f"`warmup_steps`, got total_steps={total_steps} and "
        f"warmup_steps={warmup_steps}; raise total_steps or lower warmup_steps."
    )
  if peak_value < 0:
    raise ValueError(
        f"warmup_cosine_schedule: `peak_value` must be >= 0, got {peak_value}."
    )
  if eta_min < 0:
    raise ValueError(
        f"warmup_cosine_schedule: `eta_min` must be >= 0, got {eta_min}."
    )
  if eta_min > peak_value:
    raise ValueError(
        f"warmup_cosine_schedule: `eta_min` ({eta_min}) must not exceed "
        f"`peak_value` ({peak_value}); the cosine decays from the peak down to "
        "eta_min."
    )
  return peak_value, eta_min, total_steps, warmup_steps


def warmup_cosine_schedule(
    peak_value: float,
    total_steps: int,
    warmup_steps: int = 0,
    eta_min: float = 0.0,
) -> optax.Schedule:
  r"""Linear warmup to ``peak_value``, then a cosine down to a floor ``eta_min``.

  With :math:`k` the number of updates already taken (the count Optax passes,
  before it increments it), :math:`W` = ``warmup_steps`` and :math:`T` =
  ``total_steps``:

  .. math::

    \eta_k = \begin{cases}
      \frac{k + 1}{W}\,\eta_{peak} & k < W \\
      \eta_{min} + (\eta_{peak} - \eta_{min})\,
        \frac{1 + \cos\left(\pi \frac{k - W}{T - W}\right)}{2} & W \le k < T \\
      \eta_{min} & k \ge T
    \end{cases}

  This is ColossalAI's ``CosineAnnealingWarmupLR``: the first update already
  uses :math:`\eta_{peak} / W` (never a wasted step at lr 0, unlike
  ``optax.warmup_cosine_decay_schedule(0, ...)``), and past ``total_steps`` the
  rate stays at the floor instead of rising again along the cosine.

  The schedule works eagerly, under ``jit`` and ``vmap`` with traced integer
  counts, and for Python integer counts of any size (they are converted to
  float before any arithmetic, so counts past ``2**31`` do not overflow).
  ``total_steps`` and ``warmup_steps`` may be larger than the count's dtype
  holds (``total_steps=3_000_000_000`` with Optax's int32 count): they are
  compared with the count exactly, in its integer type where they fit in it,
  and never converted to that type where they do not.

  Args:
    peak_value: the learning rate at the end of warmup; ``>= 0``.
    total_steps: the count at which the cosine reaches ``eta_min``; must be
      greater than ``warmup_steps`` and at most ``2**63 - 1`` (the largest
      int64 count).
    warmup_steps: number of linear warmup updates; ``>= 0``.
    eta_min: the floor of the cosine; ``0 <= eta_min <= peak_value``.

  Returns:
    An ``optax.Schedule``: a function from the step count to a float32 scalar.

  Raises:
    ValueError: if ``total_steps <= warmup_steps``, ``total_steps > 2**63 - 1``,
      ``warmup_steps < 0``, ``peak_value < 0``, ``eta_min < 0``, ``eta_min > peak_value`` or a value
      is not finite.
    TypeError: if a step count is not an integer or a value is not a number.

  Example:
    >>> import optax_hybrid
    >>> sched = optax_hybrid.warmup_cosine_schedule(
    ...     1.0, total_steps=100, warmup_steps=10, eta_min=0.1)
    >>> [round(float(sched(k)), 3) for k in (0, 5, 10, 55, 100, 150)]
    [0.1, 0.6, 1.0, 0.55, 0.1, 0.1]
  """
  peak_value, eta_min, total_steps, warmup_steps = _checked(peak_value, total_steps, warmup_steps, eta_min)
  decay_steps = total_steps - warmup_steps

  def schedule_exact(k: float) -> jnp.ndarray:
    # Python and NumPy integer counts: float64 arithmetic, any size.
    if k < warmup_steps:
      value = (k + 1.0) / warmup_steps * peak_value
    elif k < total_steps:
      progress = (k - warmup_steps) / decay_steps
      value = eta_min + (peak_value - eta_min) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
      value = eta_min
    return jnp.asarray(value, dtype=jnp.float32)

  def schedule(count) -> jnp.ndarray:
    if isinstance(count, (numbers.Integral, np.integer)) and not isinstance(count, bool):
      return schedule_exact(float(count))
    count = jnp.asarray(count)
    if not (jnp.issubdtype(count.dtype, jnp.integer) or jnp.issubdtype(count.dtype, jnp.floating)):
      raise TypeError(
          f"warmup_cosine_schedule: the step count must be an integer, got dtype {count.dtype}."
      )
    k = count.astype(jnp.float32)
    # Compare and subtract in the count's own type, where they are exact,
    # before the conversion to float32 rounds large counts. A step number
    # beyond that type's range (total_steps=3e9 with an int32 count) is never
    # converted to it: no count of that type reaches it.
    in_warmup = jnp.logical_not(_reaches(count, warmup_steps))
    start = jnp.asarray(min(warmup_steps, _largest(count.dtype)), count.dtype)
    since_warmup = jnp.where(in_warmup, 0, count - start).astype(jnp.float32)
    progress = jnp.minimum(since_warmup / float(decay_steps), 1.0)
    cosine = eta_min + (peak_value - eta_min) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    cosine = jnp.where(_reaches(count, total_steps), eta_min, cosine)
    if warmup_steps == 0:
      return cosine.astype(jnp.float32)
    warmup = (k + 1.0) * (peak_value / warmup_steps)
    return jnp.where(in_warmup, warmup, cosine).astype(jnp.float32)

  return schedule



def _largest(dtype) -> int | float:
  """The largest value a count of ``dtype`` can hold."""
  return int(jnp.iinfo(dtype).max) if jnp.issubdtype(dtype, jnp.integer) else float(jnp.finfo(dtype).max)


def _reaches(count: jnp.ndarray, steps: int) -> jnp.ndarray:
  """``count >= steps`` for a Python int ``steps`` of any size, never converted to a type it does not fit."""
  if steps > _largest(count.dtype):
    return jnp.zeros(count.shape, bool)  # no count of this dtype reaches it
  return count >= jnp.asarray(steps, count.dtype)
