r"""Lion as ``optax.lion`` computes it (Chen et al. 2023): :func:`hybrid_lion`.

With :math:`\eta_t` the learning rate and :math:`\lambda` the weight decay,
each leaf's update is (float32 math whatever the parameter dtype):

.. math::

  u_t &= -\eta_t \left( \operatorname{sign}\big((1 - \beta_1) g_t + \beta_1 m_{t-1}\big) + \lambda p_{t-1} \right) \\
  m_t &= (1 - \beta_2) g_t + \beta_2 m_{t-1}
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_hybrid import _checks, transform
from optax_hybrid.base import DECOUPLED, Field, UpdateRule, f32
from optax_hybrid.options import MaskOrFn, ScalarOrSchedule, takes_options


class HybridLionState(NamedTuple):
  """State of :func:`hybrid_lion`: ``mu``, the momentum, shaped like the params (see :class:`HybridAdamState`
  for ``count``, ``skipped``, ``master``, the scales and ``plan``)."""

  count: jax.Array
  mu: optax.Updates
  skipped: jax.Array
  master: Any = None
  mu_scales: Any = None
  plan: Any = None


class LionScalars(NamedTuple):
  """Lion's per-step scalars, float32."""

  learning_rate: jax.Array
  b1: jax.Array
  b2: jax.Array
  weight_decay: jax.Array
  step_ok: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class Lion(UpdateRule):
  """The Lion rule (see the module docstring)."""

  b1: Any = 0.9
  b2: Any = 0.99
  weight_decay: Any = 1e-3
  mu_dtype: Any = None

  name = "lion"
  owner = "hybrid_lion"
  state_type = HybridLionState
  decay = DECOUPLED
  zero_skippable = ("weight_decay",)

  @property
  def fields(self) -> tuple[Field, ...]:
    return (Field("mu", signed=True, dtype_argument="mu_dtype"),)

  @property
  def field_dtypes(self) -> tuple[Any, ...]:
    return (self.mu_dtype,)

  def check(self) -> None:
    for name, high in (("b1", 1.0), ("b2", 1.0), ("weight_decay", None)):
      _checks.hyperparameter(self.owner, name, getattr(self, name), low=0.0, high=high)

  def scalars(self, count: jax.Array, learning_rate: Any, step_ok: jax.Array | None) -> LionScalars:
    return LionScalars(f32(learning_rate), f32(self.b1), f32(self.b2),
                       f32(self.weight_decay), step_ok)

  def update(self, grad: jax.Array, state: tuple, s: LionScalars) -> tuple[jax.Array, tuple]:
    (mu,) = state
    direction = jnp.sign((1.0 - s.b1) * grad + s.b1 * mu)
    return -s.learning_rate * direction, ((1.0 - s.b2) * grad + s.b2 * mu,)


@takes_options()
def hybrid_lion(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.99,
    mu_dtype: Any = None,
    weight_decay: float = 1e-3,
    mask: MaskOrFn = None,
    **options: Any,
) -> transform.HybridOptimizer:
  """Lion with placeable state: ``optax.lion``'s arguments in its order, with its defaults.

  Args:
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    b1: weight of the momentum in the update's sign, in ``[0, 1]``.
    b2: decay of the momentum, in ``[0, 1]``.
    mu_dtype: dtype of the momentum; ``None``: the param's dtype.
    weight_decay: decoupled decay coefficient, ``>= 0``.
    mask: which leaves take weight decay: a tree of bools shaped like the
      params (or a prefix of it), or a callable ``params -> tree``; ``None``:
      every leaf.
    **options: the placement, storage and kernel options of
      :func:`optax_hybrid.hybrid_adamw`, keyword-only (:mod:`optax_hybrid.options`).

  Returns:
    A :class:`optax_hybrid.HybridOptimizer` whose state is a :class:`HybridLionState`.

  Raises:
    ValueError, TypeError: for a hyperparameter or option out of range or of the wrong type.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> tx = optax_hybrid.hybrid_lion(1e-4, weight_decay=0.1, state_memory_kind="pinned_host")
    >>> params = {"w": jnp.ones(3)}
    >>> params, state = tx.step(params, tx.init(params), {"w": jnp.array([1.0, -1.0, 0.0])})
    >>> [round(float(x), 6) for x in params["w"]]  # -lr * (sign(0.1 g) + 0.1 p)
    [0.99989, 1.00009, 0.99999]
  """
  rule = Lion(b1, b2, weight_decay, mu_dtype)
  return transform.optimizer(rule, learning_rate, mask=mask, **options)
