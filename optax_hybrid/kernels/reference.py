r"""The HybridAdam / AdamW update rule, once, in plain ``jax.numpy``.

This is the single source of truth for the arithmetic: every kernel
(``kernel="xla"`` uses it directly) is tested against it, and it is tested
against an independent float64 NumPy model of ``torch.optim.AdamW``.

For one leaf, with :math:`t` the 1-based step, all in float32:

.. math::

  g &\leftarrow g + \lambda p \quad \text{(L2 mode, adamw\_mode=False, only)} \\
  m &\leftarrow \beta_1 m + (1 - \beta_1) g \\
  v &\leftarrow \beta_2 v + (1 - \beta_2) g^2 \\
  d &= \sqrt{v} / \sqrt{1 - \beta_2^t} + \epsilon \\
  u &= -\eta \lambda p \;\text{(AdamW mode only)}\; - \frac{\eta}{1 - \beta_1^t} \frac{m}{d}

and the new parameter is :math:`p + u`. ``bias_correction=False`` replaces
both :math:`1 - \beta^t` factors by 1. :math:`\epsilon` sits outside the
square root of :math:`\hat v`, as in PyTorch, ColossalAI and Optax.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

import jax
import jax.numpy as jnp
from jax import lax

from optax_hybrid import _compat
from optax_hybrid.kernels import quantized
from optax_hybrid.kernels.contract import AdamScalars, LeafFacts, LeafOperands, LeafResult, Rule


def step_scalars(
    count: jax.Array,
    learning_rate,
    b1,
    b2,
    eps,
    weight_decay,
    bias_correction: bool,
    step_ok: jax.Array | None = None,
) -> AdamScalars:
  """Builds :class:`AdamScalars` for the update that follows ``count`` earlier ones."""
  f32 = lambda x: jnp.asarray(x, dtype=jnp.float32)
  b1, b2 = f32(b1), f32(b2)
  if bias_correction:
    t = count.astype(jnp.float32) + 1.0
    bc1 = 1.0 - b1**t
    bc2_sqrt = jnp.sqrt(1.0 - b2**t)
  else:
    bc1 = bc2_sqrt = jnp.ones([], jnp.float32)
  return AdamScalars(
      f32(learning_rate), b1, b2, f32(eps), f32(weight_decay), bc1, bc2_sqrt, step_ok
  )


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype the step's arithmetic runs in: float32, or wider if the leaf is.

  Complex leaves compute in the complex type of that precision.
  """
  return jnp.promote_types(dtype, jnp.float32)


# A moment in its storage format: an array, or 8-bit block-wise codes and scales.
Moment = Union[jax.Array, quantized.QuantizedMoment]


def adam_leaf_update(
    grad: jax.Array,
    mu: Moment,
    nu: Moment,
    param: jax.Array | None,
    s: AdamScalars,
    *,
    adamw_mode: bool,
    decay: bool,
    update_dtype,
    write_params: bool = False,
) -> tuple[jax.Array, Moment, Moment]:
  """One leaf's step. Returns ``(update, new_mu, new_nu)``, the moments in their storage formats.

  ``decay`` says whether this leaf takes weight decay (the mask); ``param`` may
  be ``None`` only when it does not. Complex leaves follow ``optax.adamw``: the
  second moment accumulates :math:`|g|^2` and stays real.

  A moment is an array in its storage dtype or a
  :class:`~optax_hybrid.kernels.quantized.QuantizedMoment` (8-bit block-wise):
  it is dequantized, the step runs in float32 on the values, and the update is
  computed from the new moments *before* they are quantized for storage.

  With ``write_params=True`` the first result is the new parameter
  ``p + update``, added in float32 and rounded once to the param's dtype
  (``update_dtype`` is then the param's dtype): the fused apply.
  """
  dtype = compute_dtype(grad.dtype)
  g = grad.astype(dtype)
  if decay or write_params:
    p = param.astype(dtype)
  if decay:
    if not adamw_mode:
      g = g + s.weight_decay * p
  m = s.b1 * _values(mu, dtype, signed=True) + (1.0 - s.b1) * g
  g_sq = (g * jnp.conj(g)).real if jnp.iscomplexobj(g) else g * g
  v = s.b2 * _values(nu, g_sq.dtype, signed=False) + (1.0 - s.b2) * g_sq
  denom = jnp.sqrt(v) / s.bias_correction2_sqrt + s.eps
  update = -(s.learning_rate / s.bias_correction1) * (m / denom)
  if decay and adamw_mode:
    update = update - (s.learning_rate * s.weight_decay) * p
  if write_params:
    first, unchanged = (p + update).astype(update_dtype), param
  else:
    first, unchanged = update.astype(update_dtype), None
  new_mu, new_nu = _stored(m, like=mu, signed=True), _stored(v, like=nu, signed=False)
  if s.step_ok is not None:
    # A scalar predicate selects without broadcasting, which host compute needs.
    if unchanged is None:
      unchanged = _compat.zeros_like(first)
    keep = lambda old, new: lax.select_n(s.step_ok, old, new)
    first = keep(unchanged, first)
    new_mu, new_nu = jax.tree.map(keep, mu, new_mu), jax.tree.map(keep, nu, new_nu)
  return first, new_mu, new_nu


def _values(moment: Moment, dtype, *, signed: bool) -> jax.Array:
  """A stored moment's values in the compute dtype."""
  if isinstance(moment, quantized.QuantizedMoment):
    return quantized.dequantize(moment, signed=signed).astype(dtype)
  return moment.astype(dtype)


def _stored(x: jax.Array, *, like: Moment, signed: bool) -> Moment:
  """New moment values in the storage format of ``like``."""
  if isinstance(like, quantized.QuantizedMoment):
    return quantized.quantize(x, signed=signed)
  return x.astype(like.dtype)


def with_reference_for_the_rest(
    takes: Callable[[LeafOperands, LeafFacts], bool],
    run_taken: Callable[[list, list], list],
    leaves: Sequence[LeafOperands],
    facts: Sequence[LeafFacts],
    s: AdamScalars,
    rule: Rule,
) -> list[LeafResult]:
  """Runs a kernel on the leaves it takes and this rule on the others, in the same step.

  ``run_taken(leaves, facts)`` gets the leaves for which ``takes(leaf,
  facts)`` holds and returns their :class:`LeafResult` s; the results are
  merged back in the original order. The contract every custom kernel follows
  (module docstring of :mod:`optax_hybrid.kernels`).
  """
  taken = [takes(leaf, fact) for leaf, fact in zip(leaves, facts)]
  pick = lambda xs, want: [x for x, t in zip(xs, taken) if t == want]
  kernel_out = iter(run_taken(pick(leaves, True), pick(facts, True)) if any(taken) else [])
  rule_out = iter(update_leaves(pick(leaves, False), pick(facts, False), s, rule))
  return [next(kernel_out) if t else next(rule_out) for t in taken]


def update_leaves(
    leaves: Sequence[LeafOperands],
    facts: Sequence[LeafFacts],
    s: AdamScalars,
    rule: Rule,
) -> list[LeafResult]:
  """Applies :func:`adam_leaf_update` leaf by leaf; XLA fuses each leaf's step.

  Returns one :class:`LeafResult` per leaf: ``(update, new_mu, new_nu)``, or
  ``(new_param, new_mu, new_nu)`` with ``rule.write_params``. Large leaves
  with 8-bit moments are updated in slices of rows (:func:`_in_row_slices`).
  """
  return [_in_row_slices(leaf, fact, s, rule) if _sliced(leaf) else _whole(leaf, fact, s, rule)
          for leaf, fact in zip(leaves, facts)]


def _whole(leaf: LeafOperands, fact: LeafFacts, s: AdamScalars, rule: Rule) -> LeafResult:
  return LeafResult(*adam_leaf_update(leaf.grad, leaf.mu, leaf.nu, leaf.param, s, adamw_mode=rule.adamw_mode,
                                      decay=fact.decay, update_dtype=fact.out_dtype,
                                      write_params=rule.write_params))


# Values of a leaf with 8-bit moments that the rule updates at once. XLA keeps
# the new moments of what it updates at once in float32 temporaries (they
# feed both the block maxima and the codes), so a larger leaf is updated in
# slices of whole rows, one after another in a loop, which bounds them to a
# few MiB (4 bytes per value of a slice, per moment) instead of 8 bytes per
# value of the leaf.
SLICE_VALUES = 2**18


def _sliced(leaf: LeafOperands) -> bool:
  return (isinstance(leaf.mu, quantized.QuantizedMoment) and leaf.grad.size > SLICE_VALUES
          and leaf.grad.size // leaf.grad.shape[-1] > max(1, SLICE_VALUES // leaf.grad.shape[-1]))


def _in_row_slices(leaf: LeafOperands, fact: LeafFacts, s: AdamScalars, rule: Rule) -> LeafResult:
  """:func:`adam_leaf_update` over slices of rows (blocks never cross a row), written in place.

  The loop carries the results, initialized with the buffers they replace
  (moments, and the param when it is overwritten), and reads those operands
  from the carry so that XLA updates them in place instead of copying them.
  """
  shape = leaf.grad.shape
  rows_total = leaf.grad.size // shape[-1]
  rows = max(1, SLICE_VALUES // shape[-1])
  as_rows = lambda x: x.reshape(rows_total, x.shape[-1])
  ops = jax.tree.map(as_rows, leaf)
  if rule.write_params:
    first = ops.param.astype(fact.out_dtype)
  else:
    first = _compat.zeros_like(ops.grad).astype(fact.out_dtype)
  out = LeafResult(first, ops.mu, ops.nu)

  def update_rows(start, size, out):
    take = lambda x: lax.dynamic_slice_in_dim(x, start, size, axis=0)
    param = out.first if rule.write_params else ops.param
    part = LeafOperands(take(ops.grad), jax.tree.map(take, out.mu), jax.tree.map(take, out.nu),
                        None if param is None else take(param))
    new = _whole(part, fact, s, rule)
    return jax.tree.map(lambda buf, x: lax.dynamic_update_slice_in_dim(buf, x, start, axis=0), out, new)

  full = rows_total // rows
  out = lax.fori_loop(0, full, lambda i, out: update_rows(i * rows, rows, out), out)
  if rows_total % rows:
    out = update_rows(full * rows, rows_total % rows, out)
  return LeafResult(out.first.reshape(shape), *(jax.tree.map(lambda x, like: x.reshape(like.shape), m, like)
                                                for m, like in ((out.mu, leaf.mu), (out.nu, leaf.nu))))
