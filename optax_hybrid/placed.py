"""Optax transformations for values in any memory kind: each computes where its values live.

``optax.clip_by_global_norm``, ``optax.global_norm`` and ``optax.MultiSteps``
run device arithmetic on every leaf: on a leaf in host memory (the layers'
gradient of :func:`optax_hybrid.scan_layers`, params and gradients of the
``host`` tier, host-resident optimizer state) that fails at trace time or runs
as slow host compute. These compute the same numbers where the values live
(host-resident leaves together in one host computation), so they chain in
front of (or around) a ``hybrid_*`` optimizer.
:func:`optax_hybrid.standard_optimizer` is built from them; each is also
exported where it was (``optax_hybrid.clip_by_global_norm``,
``optax_hybrid.global_norm``, ``optax_hybrid.recipe.accumulate_gradients``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_hybrid import _checks, _compat, placement


class AccumulationState(NamedTuple):
  """State of :func:`accumulate_gradients`.

  Attributes:
    mini_step: int32 scalar, micro-batches accumulated since the last update.
    acc_grads: the running mean of those micro-batches' gradients (float32 for
      float32-or-narrower gradients, like ``optax.MultiSteps``).
    inner_state: the wrapped transformation's state.
  """

  mini_step: jax.Array
  acc_grads: Any
  inner_state: Any


def accumulate_gradients(inner: optax.GradientTransformation, every_k: int) -> optax.GradientTransformationExtraArgs:
  r"""Averages ``every_k`` micro-batch gradients, then runs ``inner`` once: ``optax.MultiSteps`` for placed state.

  .. math::

    a_j = a_{j-1} + (g_j - a_{j-1}) / j, \qquad j = 1..k

  and on micro-step :math:`k` the update is ``inner.update(a_k, ...)``; the
  other micro-steps return zero updates and leave ``inner``'s state untouched.
  The numbers equal ``optax.MultiSteps(inner, every_k)``. The difference is
  where the work happens: the choice between "update" and "wait" is a
  ``lax.cond``, so the inner update (and the streaming of host-resident
  moments it implies) runs only on the final micro-step, and its state is
  passed through unchanged otherwise. ``optax.MultiSteps`` runs the inner
  update on every micro-step and selects the result with ``jnp.where``:
  device arithmetic on host-memory state, which a GPU runs as slow host
  compute.

  Args:
    inner: the transformation to run once per ``every_k`` micro-batches.
    every_k: micro-batches per update, ``>= 1``.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with :class:`AccumulationState`.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> tx = optax_hybrid.recipe.accumulate_gradients(optax_hybrid.hybrid_adamw(1e-3), every_k=4)
    >>> state = tx.init({"w": jnp.ones(3)})
  """
  every_k = _checks.integer("accumulate_gradients", "every_k", every_k, low=1)

  def acc_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)

  def init_fn(params):
    acc = jax.tree.map(lambda p: placement.zeros_placed(p, acc_dtype(p.dtype), placement.param_memory_kind(p)),
                       params)
    inner_state = inner.init(params)
    counts = [x for x in jax.tree.leaves(inner_state) if np.ndim(x) == 0]
    return AccumulationState(placement.step_counter_like(counts + jax.tree.leaves(acc)), acc, inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    j = state.mini_step + 1
    acc = jax.tree.map(lambda a, g: a + (g.astype(a.dtype) - a) / j.astype(a.dtype), state.acc_grads, updates)

    def final(operand):
      acc, inner_state = operand
      mean = jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates)
      new_updates, new_inner = inner.update(mean, inner_state, params, **extra_args)
      zero_acc = jax.tree.map(jnp.zeros_like, acc)
      return new_updates, AccumulationState(jnp.zeros_like(state.mini_step), zero_acc, new_inner)

    def wait(operand):
      acc, inner_state = operand
      # Zero updates shaped and typed like the ones the final step returns.
      shapes = jax.eval_shape(lambda: inner.update(jax.tree.map(lambda a, g: a.astype(g.dtype), acc, updates),
                                                   inner_state, params, **extra_args)[0])
      zero_updates = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
      return zero_updates, AccumulationState(j, acc, inner_state)

    return jax.lax.cond(j >= every_k, final, wait, (acc, state.inner_state))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def scaled_where_they_live(leaves: list, factor: jax.Array) -> list:
  """Each floating-point leaf times ``factor`` (in its dtype), computed where the leaf lives.

  Host-resident leaves (the layers' gradients of ``scan_layers``, say) are
  scaled together in one host computation: on a GPU, device arithmetic on a
  host value would silently run as slow host compute.
  """
  scaled = placement.map_where_they_live(lambda g, f, _: g * f.astype(jnp.finfo(g.dtype).dtype),
                                         [g for g in leaves if jnp.issubdtype(g.dtype, jnp.inexact)],
                                         [factor] * sum(jnp.issubdtype(g.dtype, jnp.inexact) for g in leaves))
  scaled = iter(scaled)
  return [next(scaled) if jnp.issubdtype(g.dtype, jnp.inexact) else g for g in leaves]


def skip_together() -> optax.GradientTransformation:
  """Makes every gradient NaN when any is not finite, so that every group skips the step.

  Each group's ``skip_nonfinite`` sees only its own gradients; without this,
  one group would skip while the others stepped and their counts (and so
  their schedules) would drift apart. Host-resident gradients are scaled in
  host compute.
  """

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    factor = jnp.where(placement.all_finite(leaves), 1.0, jnp.nan).astype(jnp.float32)
    return jax.tree.unflatten(treedef, scaled_where_they_live(leaves, factor)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def global_norm(updates: Any) -> jax.Array:
  r"""``optax.global_norm`` for trees in any memory kind: :math:`\sqrt{\sum_i \sum |g_i|^2}`, a float32 device scalar.

  Each leaf's sum of squares is computed where the leaf lives (host-resident
  leaves together in one host computation), and only those scalars come to
  the device. ``optax.global_norm`` adds every leaf's square on the device: with
  a leaf in host memory (the layers' gradient of :func:`optax_hybrid.scan_layers`,
  or params and gradients of the ``host`` tier) it fails at trace time
  ("memory_space of all inputs passed to `add` must be the same").

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> float(optax_hybrid.global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
    5.0
  """
  inexact = [g for g in jax.tree.leaves(updates) if jnp.issubdtype(g.dtype, jnp.inexact)]
  squares = placement.map_where_they_live(lambda g, _: jnp.sum(jnp.real(g * jnp.conj(g)).astype(jnp.float32)),
                                          inexact)
  return jnp.sqrt(sum((_compat.move(x, _compat.DEVICE) for x in squares), jnp.float32(0)))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
  r"""``optax.clip_by_global_norm`` for gradients in any memory kind (host memory included).

  .. math::

    g_i \leftarrow g_i \cdot \min(1, \text{max\_norm} / \lVert g \rVert)

  with :math:`\lVert g \rVert` the :func:`global_norm` of all the gradients:
  Optax's numbers. Each leaf's share of the norm is computed where the leaf
  lives, and each leaf is scaled there (host-resident ones in one host
  computation), so it runs in front of a ``hybrid_*`` optimizer in
  ``optax.chain`` when gradients live in host memory (layers streamed by
  :func:`optax_hybrid.scan_layers`, the ``host`` tier's params), where
  ``optax.clip_by_global_norm`` fails at trace time (docs/errors.md).
  :func:`optax_hybrid.standard_optimizer` clips with it.

  Args:
    max_norm: the largest global norm left unscaled, ``> 0``.

  Returns:
    A stateless ``optax.GradientTransformation``.

  Raises:
    ValueError: for ``max_norm <= 0``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, optax_hybrid
    >>> host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    >>> params = {"w": jax.device_put(jnp.ones(3), host)}
    >>> tx = optax.chain(optax_hybrid.clip_by_global_norm(1.0), optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="host"))
    >>> state = tx.init(params)
    >>> updates, state = jax.jit(tx.update)({"w": jax.device_put(jnp.full(3, 10.0), host)}, state, params)
    >>> updates["w"].sharding.memory_kind
    'pinned_host'
  """
  _checks.hyperparameter("clip_by_global_norm", "max_norm", max_norm, low=0.0)
  if not isinstance(max_norm, _compat.Tracer) and float(max_norm) == 0.0:
    raise ValueError("clip_by_global_norm: `max_norm` must be > 0, got 0.0 (every gradient would be zeroed); "
                     "leave the stage out to not clip.")

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    norm = global_norm(leaves)
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm).astype(jnp.float32)
    return jax.tree.unflatten(treedef, scaled_where_they_live(leaves, factor)), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


__all__ = ["AccumulationState", "accumulate_gradients", "clip_by_global_norm", "global_norm", "scaled_where_they_live",
           "skip_together"]
