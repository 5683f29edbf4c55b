"""The rule contract: what an optimizer computes for one leaf, as a value the engine runs.

A rule is a small frozen dataclass (:class:`UpdateRule`) holding:

* its hyperparameters, numbers that may be traced (``optax.inject_hyperparams``);
* its static flags (Adam's ``nesterov``, say);
* the state it keeps per leaf: :class:`Field` s, each an array shaped like the
  param (none for plain SGD, one for Lion, Adagrad and momentum, two for Adam),
  with the dtype each asks for;
* how it takes weight decay (:data:`DECOUPLED`, :data:`L2` or none);
* its per-step scalars (:meth:`UpdateRule.scalars`: float32 values computed once
  per step);
* its reference update of one leaf (:meth:`UpdateRule.update`), in plain
  ``jax.numpy``: the single source of truth every kernel is tested against.

The engine (:mod:`optax_hybrid.transform`, the plan, the placement tiers,
streaming, ZeRO-1, the disk tier, master weights, 8-bit storage of any field,
``skip_nonfinite``, checkpoints and the memory report) runs any rule without
knowing which one it is. A kernel runs the rules it declares
(:mod:`optax_hybrid.kernels`) and hands the leaves of any other rule to
its reference, in the same step.

This module sits below the engine (it imports nothing of it), as optax keeps
``base.py`` apart from ``transform.py`` and ``alias.py``; the rules themselves
live above it, in :mod:`optax_hybrid.rules`. Adding a rule is one file there
(the rule, its state type and its ``hybrid_<name>`` function made with
:func:`optax_hybrid.transform.optimizer`) and its exports: see
``rules/adagrad.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, ClassVar, NamedTuple

import jax

from optax_hybrid import _compat

#: Decoupled weight decay: ``u -= lr * weight_decay * p`` after the rule (AdamW, Lion).
DECOUPLED = "decoupled"
#: L2 weight decay: ``g += weight_decay * p`` before the rule (``torch.optim.Adam``).
L2 = "l2"

# The attributes every rule's state has besides its params-shaped ones.
_SCALAR_ATTRIBUTES = ("count", "skipped", "plan")

#: Every rule's state type -> its params-shaped attributes, in the state's
#: order: the fields it may keep, their ``_scales`` and ``master``. Filled as
#: rule classes are defined; the engine, checkpoints and the memory report
#: recognise a state by its type here.
STATE_TYPES: dict[type, tuple[str, ...]] = {}


def _params_shaped(state_type: type) -> tuple[str, ...]:
  """The params-shaped attributes of a rule's state type, checked."""
  names = getattr(state_type, "_fields", ())
  shaped = tuple(n for n in names if n not in _SCALAR_ATTRIBUTES)
  fields = {n for n in shaped if n != "master" and not n.endswith("_scales")}
  if (not set(_SCALAR_ATTRIBUTES) <= set(names) or "master" not in shaped
      or {n for n in shaped if n.endswith("_scales")} != {f + "_scales" for f in fields}):
    raise TypeError(f"{state_type.__name__}: a rule's state is a NamedTuple with count, skipped, master and "
                    f"plan, each field and its <field>_scales; got {names}.")
  return shaped


class Field(NamedTuple):
  """One array a rule keeps per param leaf, shaped like the param.

  Attributes:
    name: the state's attribute, e.g. ``"mu"``.
    signed: its values take either sign (8-bit storage then uses the signed
      code map), or are never negative (the unsigned map, one more bit of
      precision).
    real: its values are real even for a complex param (sums of ``|g|^2``):
      stored in the param's real dtype by default, and a complex dtype is refused.
    dtype_argument: the argument that sets its storage dtype, for messages
      (``"mu_dtype"``); None when the rule has none.
  """

  name: str
  signed: bool = True
  real: bool = False
  dtype_argument: str | None = None


@dataclasses.dataclass(frozen=True)
class UpdateRule:
  """The base of every update rule. A subclass is a frozen dataclass of its hyperparameters and flags.

  Class attributes a rule sets:

  * ``name``: a short identifier kernels declare support by (``"adam"``).
  * ``owner``: the public function that builds it, for messages (``"hybrid_adamw"``).
  * ``state_type``: its state, a ``NamedTuple`` with ``count``, one attribute
    per field it may keep and one ``<field>_scales`` per field (8-bit storage),
    ``skipped``, ``master`` and ``plan``.
  * ``decay``: :data:`DECOUPLED`, :data:`L2` or None (no weight decay); a rule
    with decay has a ``weight_decay`` hyperparameter and its scalars a
    ``weight_decay`` field.
  * ``zero_skippable``: hyperparameters that, when they are a concrete zero at
    ``init``, are left out of every step statically (the plan records it), so
    that a kernel that lacks them still takes the leaves.

  Its scalars (:meth:`scalars`) are a ``NamedTuple`` with at least
  ``learning_rate`` and ``step_ok``. :meth:`update` must read hyperparameters
  from there, never from ``self`` (they may be another trace's values), and
  may read ``self``'s static flags.
  """

  name: ClassVar[str]
  owner: ClassVar[str]
  state_type: ClassVar[type]
  decay: ClassVar[str | None] = None
  zero_skippable: ClassVar[tuple[str, ...]] = ()

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    if "state_type" in cls.__dict__:
      STATE_TYPES[cls.state_type] = _params_shaped(cls.state_type)

  @property
  def fields(self) -> tuple[Field, ...]:
    """The arrays this rule keeps per leaf (a subset of ``state_type``'s, in its order)."""
    raise NotImplementedError

  @property
  def field_dtypes(self) -> tuple[Any, ...]:
    """Per field, the storage dtype asked for, or None (the param's dtype, its real dtype for a real field)."""
    return (None,) * len(self.fields)

  def initial_values(self) -> tuple[Any, ...]:
    """Per field, the value every element starts at (zeros unless a rule says otherwise)."""
    return (0.0,) * len(self.fields)

  def check(self) -> None:
    """Raises ValueError or TypeError, naming the argument, for a bad hyperparameter or flag."""

  def scalars(self, count: jax.Array, learning_rate: Any, step_ok: jax.Array | None) -> NamedTuple:
    """The float32 scalars of the update that follows ``count`` earlier ones."""
    raise NotImplementedError

  def update(self, grad: jax.Array, state: tuple, s: NamedTuple) -> tuple[jax.Array, tuple]:
    """The reference update of one leaf: ``(update, new state values)``.

    Args:
      grad: the gradient in the compute dtype (float32 or wider), with L2
        decay already added for an :data:`L2` rule.
      state: the values of each field in the compute dtype (real fields in
        its real counterpart), decoded from their storage format.
      s: this step's scalars (:meth:`scalars`).

    Returns:
      The update, learning rate and sign included (decoupled decay is the
      engine's), and the new value of each field, before storage.
    """
    raise NotImplementedError

  def without(self, names: frozenset) -> "UpdateRule":
    """This rule with the hyperparameters ``names`` set to a static zero (see ``zero_skippable``)."""
    return dataclasses.replace(self, **{name: 0.0 for name in names}) if names else self

  def static_zeros(self) -> frozenset:
    """The ``zero_skippable`` hyperparameters that are a concrete zero now."""
    return frozenset(name for name in self.zero_skippable if is_static_zero(getattr(self, name)))


def is_static_zero(value: Any) -> bool:
  """A hyperparameter known to be zero when the step is traced (not a traced value)."""
  if isinstance(value, _compat.Tracer):
    return False
  try:
    return float(value) == 0.0
  except (TypeError, ValueError):
    return False


#: A hyperparameter as a float32 array (a traced one stays traced): what a rule's scalars hold. Not
#: ``jnp.float32(x)``, which gives a NumPy scalar for a Python number, converted again by every
#: operation that uses it (a large share of a many-leaf step's tracing time).
f32 = functools.partial(jax.numpy.asarray, dtype=jax.numpy.float32)


def zeros_like(x: jax.Array) -> jax.Array:
  """Zeros shaped and placed like ``x``, for a rule's update: also inside host compute (the ``host`` tier).

  A constant there (``jnp.zeros_like``, a scalar in ``jnp.where``) is typed
  as device memory and cannot mix with the host values of the step.
  """
  return _compat.zeros_like(x)


def is_state(x: Any) -> bool:
  """Whether ``x`` is the state of a rule's optimizer (a type in :data:`STATE_TYPES`)."""
  return type(x) in STATE_TYPES


__all__ = ["DECOUPLED", "L2", "STATE_TYPES", "Field", "UpdateRule", "f32", "is_state", "is_static_zero", "zeros_like"]
