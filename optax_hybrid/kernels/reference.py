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

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from optax_hybrid import _compat


class AdamScalars(NamedTuple):
  """The per-step scalars of one update, float32, computed once per step.

  ``learning_rate`` multiplies the whole step with a minus sign; the
  ``scale_by_hybrid_adam`` building block passes ``-1`` to get the raw Adam
  direction.
  """

  learning_rate: jax.Array
  b1: jax.Array
  b2: jax.Array
  eps: jax.Array
  weight_decay: jax.Array
  bias_correction1: jax.Array  # 1 - b1**t, or 1 without bias correction
  bias_correction2_sqrt: jax.Array  # sqrt(1 - b2**t), or 1
  # A bool scalar, or None: when False the step is skipped (zero update,
  # moments unchanged). Selecting inside the step costs no extra pass.
  step_ok: jax.Array | None = None


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


def adam_leaf_update(
    grad: jax.Array,
    mu: jax.Array,
    nu: jax.Array,
    param: jax.Array | None,
    s: AdamScalars,
    *,
    adamw_mode: bool,
    decay: bool,
    update_dtype,
    write_params: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One leaf's step. Returns ``(update, new_mu, new_nu)`` in their storage dtypes.

  ``decay`` says whether this leaf takes weight decay (the mask); ``param`` may
  be ``None`` only when it does not. Complex leaves follow ``optax.adamw``: the
  second moment accumulates :math:`|g|^2` and stays real.

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
  m = s.b1 * mu.astype(dtype) + (1.0 - s.b1) * g
  g_sq = (g * jnp.conj(g)).real if jnp.iscomplexobj(g) else g * g
  v = s.b2 * nu.astype(g_sq.dtype) + (1.0 - s.b2) * g_sq
  denom = jnp.sqrt(v) / s.bias_correction2_sqrt + s.eps
  update = -(s.learning_rate / s.bias_correction1) * (m / denom)
  if decay and adamw_mode:
    update = update - (s.learning_rate * s.weight_decay) * p
  if write_params:
    first, unchanged = (p + update).astype(update_dtype), param
  else:
    first, unchanged = update.astype(update_dtype), None
  if s.step_ok is not None:
    # A scalar predicate selects without broadcasting, which host compute needs.
    if unchanged is None:
      unchanged = _compat.zeros_like(first)
    first = lax.select_n(s.step_ok, unchanged, first)
    m = lax.select_n(s.step_ok, mu.astype(m.dtype), m)
    v = lax.select_n(s.step_ok, nu.astype(v.dtype), v)
  return first, m.astype(mu.dtype), v.astype(nu.dtype)


def with_reference_for_the_rest(
    taken: Sequence[int],
    run_taken,
    grads: Sequence[jax.Array],
    mus: Sequence[jax.Array],
    nus: Sequence[jax.Array],
    params: Sequence[jax.Array | None],
    decays: Sequence[bool],
    update_dtypes: Sequence,
    s: AdamScalars,
    *,
    adamw_mode: bool,
    write_params: bool = False,
) -> tuple[list, list, list]:
  """Runs a kernel on the leaves it takes and this rule on the others, in the same step.

  ``run_taken(grads, mus, nus, params, decays, update_dtypes)`` gets the
  leaves at indices ``taken`` (params it does not need are None) and returns
  ``(firsts, new_mus, new_nus)`` for them; the results are merged back in the
  original order. The contract every custom kernel follows (module docstring
  of :mod:`optax_hybrid.kernels`).
  """
  n = len(grads)
  taken_set = set(taken)
  rest = [i for i in range(n) if i not in taken_set]
  pick = lambda xs, idx: [xs[i] for i in idx]
  taken_out = ([], [], [])
  if taken:
    taken_out = run_taken(pick(grads, taken), pick(mus, taken), pick(nus, taken),
                          [params[i] if (decays[i] or write_params) else None for i in taken],
                          pick(decays, taken), pick(update_dtypes, taken))
  rest_out = update_leaves(pick(grads, rest), pick(mus, rest), pick(nus, rest), pick(params, rest),
                           pick(decays, rest), pick(update_dtypes, rest), s, adamw_mode=adamw_mode,
                           write_params=write_params)
  firsts, new_mus, new_nus = [None] * n, [None] * n, [None] * n
  for source, idx in ((taken_out, taken), (rest_out, rest)):
    for j, i in enumerate(idx):
      firsts[i], new_mus[i], new_nus[i] = source[0][j], source[1][j], source[2][j]
  return firsts, new_mus, new_nus


def update_leaves(
    grads: Sequence[jax.Array],
    mus: Sequence[jax.Array],
    nus: Sequence[jax.Array],
    params: Sequence[jax.Array | None],
    decays: Sequence[bool],
    update_dtypes: Sequence,
    s: AdamScalars,
    *,
    adamw_mode: bool,
    write_params: bool = False,
) -> tuple[list, list, list]:
  """Applies :func:`adam_leaf_update` leaf by leaf; XLA fuses each leaf's step.

  Returns ``(updates, new_mus, new_nus)``, or ``(new_params, new_mus,
  new_nus)`` with ``write_params=True``.
  """
  outs = [
      adam_leaf_update(g, m, v, p, s, adamw_mode=adamw_mode, decay=d, update_dtype=dt,
                       write_params=write_params)
      for g, m, v, p, d, dt in zip(grads, mus, nus, params, decays, update_dtypes)
  ]
  if not outs:
    return [], [], []
  updates, new_mus, new_nus = (list(x) for x in zip(*outs))
  return updates, new_mus, new_nus
