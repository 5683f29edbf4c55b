r"""SGD, with momentum and Nesterov momentum, as ``optax.sgd`` computes it: :func:`hybrid_sgd`.

With :math:`\eta_t` the learning rate and :math:`\mu` the momentum, each
leaf's update is :math:`u_t = -\eta_t g_t` without momentum, else

.. math::

  b_t &= g_t + \mu b_{t-1} \\
  u_t &= -\eta_t b_t \quad\text{or, with nesterov,}\quad -\eta_t (g_t + \mu b_t)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_hybrid import _checks, transform
from optax_hybrid.base import Field, UpdateRule, f32
from optax_hybrid.options import ScalarOrSchedule, takes_options


class HybridSgdState(NamedTuple):
  """State of :func:`hybrid_sgd`: ``trace``, the momentum buffer shaped like the params (None without
  momentum; see :class:`HybridAdamState` for ``count``, ``skipped``, ``master``, the scales and ``plan``)."""

  count: jax.Array
  trace: optax.Updates
  skipped: jax.Array
  master: Any = None
  trace_scales: Any = None
  plan: Any = None


class SgdScalars(NamedTuple):
  """SGD's per-step scalars, float32 (``momentum`` None without momentum)."""

  learning_rate: jax.Array
  momentum: jax.Array | None = None
  step_ok: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Sgd(UpdateRule):
  """The SGD rule (see the module docstring)."""

  momentum: Any = None
  nesterov: bool = False
  accumulator_dtype: Any = None

  name = "sgd"
  owner = "hybrid_sgd"
  state_type = HybridSgdState

  @property
  def fields(self) -> tuple[Field, ...]:
    return () if self.momentum is None else (Field("trace", signed=True, dtype_argument="accumulator_dtype"),)

  @property
  def field_dtypes(self) -> tuple[Any, ...]:
    return () if self.momentum is None else (self.accumulator_dtype,)

  def check(self) -> None:
    if self.momentum is not None:
      _checks.hyperparameter(self.owner, "momentum", self.momentum, low=0.0)
    _checks.flag(self.owner, "nesterov", self.nesterov)

  def scalars(self, count: jax.Array, learning_rate: Any, step_ok: jax.Array | None) -> SgdScalars:
    momentum = None if self.momentum is None else f32(self.momentum)
    return SgdScalars(f32(learning_rate), momentum, step_ok)

  def update(self, grad: jax.Array, state: tuple, s: SgdScalars) -> tuple[jax.Array, tuple]:
    if s.momentum is None:
      return -s.learning_rate * grad, ()
    (trace,) = state
    trace = grad + s.momentum * trace
    return -s.learning_rate * (grad + s.momentum * trace if self.nesterov else trace), (trace,)


@takes_options()
def hybrid_sgd(
    learning_rate: ScalarOrSchedule,
    momentum: float | None = None,
    nesterov: bool = False,
    accumulator_dtype: Any = None,
    **options: Any,
) -> transform.HybridOptimizer:
  """SGD with placeable state: ``optax.sgd``'s arguments in its order, with its defaults.

  Args:
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    momentum: the momentum ``>= 0``, or None for plain SGD (no state but the
      step count and, with ``master``, what the master keeps).
    nesterov: Nesterov momentum (with ``momentum`` only).
    accumulator_dtype: dtype of the momentum buffer; ``None``: the param's dtype.
    **options: the placement, storage and kernel options of
      :func:`optax_hybrid.hybrid_adamw`, keyword-only (:mod:`optax_hybrid.options`).

  Returns:
    A :class:`optax_hybrid.HybridOptimizer` whose state is a :class:`HybridSgdState`.

  Raises:
    ValueError, TypeError: for a hyperparameter or option out of range or of the wrong type.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> tx = optax_hybrid.hybrid_sgd(0.1, momentum=0.9, state_memory_kind="host")
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> for _ in range(2):
    ...   params, state = tx.step(params, state, {"w": jnp.ones(2)})
    >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * (1 + 1.9)
    [0.71, 0.71]
  """
  rule = Sgd(momentum, nesterov, accumulator_dtype)
  return transform.optimizer(rule, learning_rate, **options)
