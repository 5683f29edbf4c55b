r"""Adagrad as ``optax.adagrad`` computes it (Duchi et al. 2011): :func:`hybrid_adagrad`.

With :math:`\eta_t` the learning rate, each leaf's update is (float32 math
whatever the parameter dtype), :math:`s_0` being ``initial_accumulator_value``:

.. math::

  s_t &= s_{t-1} + |g_t|^2 \\
  u_t &= -\eta_t \, g_t / \sqrt{s_t + \epsilon} \quad (0 \text{ where } s_t = 0)
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_hybrid import _checks, transform
from optax_hybrid.base import Field, UpdateRule, f32, zeros_like
from optax_hybrid.options import ScalarOrSchedule, takes_options


class HybridAdagradState(NamedTuple):
  """State of :func:`hybrid_adagrad`: ``sum_of_squares`` shaped like the params, real (see
  :class:`HybridAdamState` for ``count``, ``skipped``, ``master``, the scales and ``plan``)."""

  count: jax.Array
  sum_of_squares: optax.Updates
  skipped: jax.Array
  master: Any = None
  sum_of_squares_scales: Any = None
  plan: Any = None


class AdagradScalars(NamedTuple):
  """Adagrad's per-step scalars, float32."""

  learning_rate: jax.Array
  eps: jax.Array
  step_ok: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Adagrad(UpdateRule):
  """The Adagrad rule (see the module docstring)."""

  initial_accumulator_value: Any = 0.1
  eps: Any = 1e-7

  name = "adagrad"
  owner = "hybrid_adagrad"
  state_type = HybridAdagradState

  @property
  def fields(self) -> tuple[Field, ...]:
    return (Field("sum_of_squares", signed=False, real=True),)

  def initial_values(self) -> tuple[Any, ...]:
    return (self.initial_accumulator_value,)

  def check(self) -> None:
    for name in ("initial_accumulator_value", "eps"):
      _checks.hyperparameter(self.owner, name, getattr(self, name), low=0.0)

  def scalars(self, count: jax.Array, learning_rate: Any, step_ok: jax.Array | None) -> AdagradScalars:
    return AdagradScalars(f32(learning_rate), f32(self.eps), step_ok)

  def update(self, grad: jax.Array, state: tuple, s: AdagradScalars) -> tuple[jax.Array, tuple]:
    (sum_of_squares,) = state
    sum_of_squares = ((grad * jnp.conj(grad)).real if jnp.iscomplexobj(grad) else grad * grad) + sum_of_squares
    scale = jnp.where(sum_of_squares > 0, jax.lax.rsqrt(sum_of_squares + s.eps), zeros_like(sum_of_squares))
    return -s.learning_rate * (scale * grad), (sum_of_squares,)


@takes_options()
def hybrid_adagrad(
    learning_rate: ScalarOrSchedule,
    initial_accumulator_value: float = 0.1,
    eps: float = 1e-7,
    **options: Any,
) -> transform.HybridOptimizer:
  """Adagrad with placeable state: ``optax.adagrad``'s arguments in its order, with its defaults.

  Args:
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    initial_accumulator_value: what every sum of squares starts at, ``>= 0``.
    eps: added to the sum of squares inside the square root, ``>= 0``.
    **options: the placement, storage and kernel options of
      :func:`optax_hybrid.hybrid_adamw`, keyword-only (:mod:`optax_hybrid.options`).

  Returns:
    A :class:`optax_hybrid.HybridOptimizer` whose state is a :class:`HybridAdagradState`.

  Raises:
    ValueError, TypeError: for a hyperparameter or option out of range or of the wrong type.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> tx = optax_hybrid.hybrid_adagrad(0.1, state_memory_kind="host_state")
    >>> params = {"w": jnp.ones(2)}
    >>> params, state = tx.step(params, tx.init(params), {"w": jnp.array([3.0, 0.0])})
    >>> [round(float(x), 4) for x in params["w"]]  # 1 - 0.1 * 3 / sqrt(0.1 + 9)
    [0.9006, 1.0]
  """
  return transform.optimizer(Adagrad(initial_accumulator_value, eps), learning_rate, **options)
