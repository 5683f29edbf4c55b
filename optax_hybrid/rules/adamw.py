r"""AdamW as ``optax.adamw``, ColossalAI's HybridAdam and ``torch.optim.AdamW`` compute it: :func:`hybrid_adamw`.

With :math:`t` the 1-based step, :math:`\eta_t` the learning rate and
:math:`\lambda` the weight decay, each leaf's update is (float32 math
whatever the parameter dtype):

.. math::

  g_t &\leftarrow g_t + \lambda p_{t-1} \quad\text{(only if adamw\_mode=False)} \\
  m_t &= \beta_1 m_{t-1} + (1 - \beta_1) g_t, \qquad
  v_t = \beta_2 v_{t-1} + (1 - \beta_2) |g_t|^2 \\
  \hat m_t &= \frac{m_t}{1 - \beta_1^t}
    \quad\text{or, with nesterov,}\quad
    \frac{\beta_1 m_t}{1 - \beta_1^{t+1}} + \frac{(1 - \beta_1) g_t}{1 - \beta_1^t} \\
  u_t &= -\eta_t \left( \frac{\hat m_t}{\sqrt{v_t / (1 - \beta_2^t) + \epsilon_{root}} + \epsilon}
        + \lambda p_{t-1} \,\text{(only if adamw\_mode)} \right)

:math:`\epsilon` sits outside the square root, as in PyTorch, ColossalAI and
Optax. ``bias_correction=False`` replaces every :math:`1 - \beta^k` by 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from optax_hybrid import _checks, _deprecations, transform
from optax_hybrid.base import DECOUPLED, Field, L2, UpdateRule, f32, is_static_zero
from optax_hybrid.options import MaskOrFn, ScalarOrSchedule, takes_options


class HybridAdamState(NamedTuple):
  """State of :func:`hybrid_adamw` and :func:`scale_by_hybrid_adam`.

  Attributes:
    count: int32 scalar, the number of updates taken (on device).
    mu: first moments, shaped like the params, in ``mu_dtype`` and their
      state memory kind.
    nu: second moments, in the param's dtype or ``moment_format`` (real for
      complex params).
    skipped: int32 scalar, the number of steps skipped for non-finite
      gradients (``skip_nonfinite=True``); they do not advance ``count``.
    master: with ``master="float32"`` (or another dtype), the master copy
      of each lower-precision param; with ``master="kahan"``, its error term
      in the param's dtype (:mod:`optax_hybrid.masters`): a tree shaped like
      the params (an empty entry where a param keeps no master), placed with
      the leaf's moments; ``None`` otherwise (``master="stochastic"`` keeps
      nothing).
    mu_scales, nu_scales: with ``moment_format="8bit"``, the float32 per-block
      scales of each 8-bit moment (trees shaped like the params, an empty
      entry where a leaf keeps float32 moments); ``mu`` and ``nu`` then hold
      the uint8 codes of those leaves. ``None`` otherwise. Read the values
      with :func:`optax_hybrid.moment_values`.
    plan: every per-leaf decision made by ``init`` (:class:`optax_hybrid.plan.Plan`:
      tier, memory kinds, dtypes, decay, shardings, streaming stage, the disk
      tier's files), static data that holds no arrays.

  Every params-shaped field (``mu``, ``nu``, ``master``, the scales) holds exactly one
  array per param leaf: where a leaf keeps nothing in it (no master for a
  float32 param; disk-tier moments, which are files) it holds an *empty
  entry*, an array of shape ``(0,) * max(ndim, 1)``
  (:func:`optax_hybrid.placement.empty_entry`). So
  ``optax.tree_utils.tree_map_params`` maps partition specs (or anything
  shaped like the params) over every such field, for every tier.
  """

  count: jax.Array
  mu: optax.Updates
  nu: optax.Updates
  skipped: jax.Array
  master: Any = None
  mu_scales: Any = None
  nu_scales: Any = None
  plan: Any = None


class AdamScalars(NamedTuple):
  """Adam's per-step scalars, float32. ``learning_rate`` multiplies the whole step with a minus sign."""

  learning_rate: jax.Array
  b1: jax.Array
  b2: jax.Array
  eps: jax.Array
  weight_decay: jax.Array
  bias_correction1: jax.Array  # 1 - b1**t, or 1 without bias correction
  bias_correction2_sqrt: jax.Array  # sqrt(1 - b2**t), or 1
  eps_root: jax.Array | None = None  # None: a static zero
  bias_correction2: jax.Array | None = None  # 1 - b2**t, with eps_root only
  bias_correction1_next: jax.Array | None = None  # 1 - b1**(t + 1), with nesterov only
  step_ok: jax.Array | None = None  # False: the step is skipped


@dataclasses.dataclass(frozen=True)
class AdamW(UpdateRule):
  """The AdamW rule (see the module docstring). Hyperparameters may be traced; flags are static."""

  b1: Any = 0.9
  b2: Any = 0.999
  eps: Any = 1e-8
  eps_root: Any = 0.0
  weight_decay: Any = 1e-4
  nesterov: bool = False
  bias_correction: bool = True
  adamw_mode: bool = True
  mu_dtype: Any = None
  nu_dtype: Any = None
  # Derived: eps_root is not a static zero (it then takes the step's scalars;
  # the native kernel computes the plain rule only).
  uses_eps_root: bool = dataclasses.field(init=False, repr=False, compare=False)

  name = "adam"
  owner = "hybrid_adamw"
  state_type = HybridAdamState
  zero_skippable = ("weight_decay", "eps_root")

  def __post_init__(self):
    object.__setattr__(self, "uses_eps_root", not is_static_zero(self.eps_root))

  @property
  def decay(self) -> str:
    return DECOUPLED if self.adamw_mode else L2

  @property
  def fields(self) -> tuple[Field, ...]:
    return (Field("mu", signed=True, dtype_argument="mu_dtype"),
            Field("nu", signed=False, real=True, dtype_argument="nu_dtype"))

  @property
  def field_dtypes(self) -> tuple[Any, ...]:
    return (self.mu_dtype, self.nu_dtype)

  def check(self) -> None:
    for name, high in (("b1", 1.0), ("b2", 1.0), ("eps", None), ("eps_root", None), ("weight_decay", None)):
      _checks.hyperparameter(self.owner, name, getattr(self, name), low=0.0, high=high, high_open=True)
    for name in ("bias_correction", "adamw_mode", "nesterov"):
      _checks.flag(self.owner, name, getattr(self, name))

  def scalars(self, count: jax.Array, learning_rate: Any, step_ok: jax.Array | None) -> AdamScalars:
    b1, b2 = f32(self.b1), f32(self.b2)
    t = count.astype(jnp.float32) + 1.0
    correct = lambda b, k: 1.0 - b**k if self.bias_correction else jnp.ones([], jnp.float32)
    return AdamScalars(
        f32(learning_rate), b1, b2, f32(self.eps), f32(self.weight_decay), correct(b1, t),
        jnp.sqrt(correct(b2, t)), eps_root=f32(self.eps_root) if self.uses_eps_root else None,
        bias_correction2=correct(b2, t) if self.uses_eps_root else None,
        bias_correction1_next=correct(b1, t + 1.0) if self.nesterov else None, step_ok=step_ok)

  def update(self, grad: jax.Array, state: tuple, s: AdamScalars) -> tuple[jax.Array, tuple]:
    mu, nu = state
    m = s.b1 * mu + (1.0 - s.b1) * grad
    g_sq = (grad * jnp.conj(grad)).real if jnp.iscomplexobj(grad) else grad * grad
    v = s.b2 * nu + (1.0 - s.b2) * g_sq
    if s.eps_root is None:
      denom = jnp.sqrt(v) / s.bias_correction2_sqrt + s.eps
    else:
      denom = jnp.sqrt(v / s.bias_correction2 + s.eps_root) + s.eps
    if s.bias_correction1_next is None:
      update = -(s.learning_rate / s.bias_correction1) * (m / denom)
    else:  # Nesterov: optax's mu_hat, Dozat (2016)
      m_hat = (s.b1 / s.bias_correction1_next) * m + ((1.0 - s.b1) / s.bias_correction1) * grad
      update = -s.learning_rate * (m_hat / denom)
    return update, (m, v)


def _older_spellings(owner: str, mask: MaskOrFn, options: dict[str, Any]) -> tuple[MaskOrFn, Any]:
  """``(mask, nu_dtype)`` with the older ``weight_decay_mask`` and ``nu_dtype`` taken out of ``options`` (they warn)."""
  weight_decay_mask, nu_dtype = options.pop("weight_decay_mask", None), options.pop("nu_dtype", None)
  if nu_dtype is not None:
    _deprecations.warn(owner, "nu_dtype", _deprecations.SPELLINGS["nu_dtype"])
  if weight_decay_mask is not None:
    _deprecations.warn(owner, "weight_decay_mask", _deprecations.SPELLINGS["weight_decay_mask"])
    if mask is not None:
      raise ValueError(f"{owner}: pass either `mask` or its alias `weight_decay_mask`, not both.")
    mask = weight_decay_mask
  return mask, nu_dtype


@takes_options()
def hybrid_adamw(
    learning_rate: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: float = 1e-4,
    mask: MaskOrFn = None,
    *,
    nesterov: bool = False,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    **options: Any,
) -> transform.HybridOptimizer:
  r"""AdamW with placeable state: ``optax.adamw``'s arguments in its order, with its defaults.

  The update is the module's (:mod:`optax_hybrid.rules.adamw`):
  ``adamw_mode=True`` is ``optax.adamw`` and ``torch.optim.AdamW`` (decay
  decoupled and scaled by the current learning rate); ``adamw_mode=False`` is
  ``torch.optim.Adam(weight_decay=...)`` (L2 decay added to the gradient).
  The state can live in host memory (``state_memory_kind="pinned_host"``),
  in files, on the host CPU: every option of :mod:`optax_hybrid.options`.
  Parameters that live in host memory are updated on the host (XLA host
  compute); use :func:`optax_hybrid.apply_updates` to apply the updates.

  Args:
    learning_rate: a float ``>= 0`` or an Optax schedule of the step count.
    b1: decay of the first moment, in ``[0, 1)``.
    b2: decay of the second moment, in ``[0, 1)``.
    eps: added to the denominator, outside the square root; ``>= 0``.
    eps_root: added to :math:`\hat v` inside the square root; ``>= 0``. The
      native and Pallas kernels compute the plain rule: leaves of a rule with
      a non-zero ``eps_root`` take the XLA reference.
    mu_dtype: dtype of the first moments; ``None``: the param's dtype.
    weight_decay: decay coefficient :math:`\lambda`; ``>= 0``.
    mask: which leaves take weight decay: a tree of bools with the structure
      of the params (or a prefix of it), or a callable ``params -> tree``.
      ``None``: every leaf. Resolved once, by ``init``.
    nesterov: Nesterov momentum, as ``optax.adamw(nesterov=True)`` (NAdamW).
      Computed by the XLA reference.
    bias_correction: divide the moments by :math:`1 - \beta^t`.
    adamw_mode: decoupled decay (True) or L2 decay through the gradient (False).
    **options: the placement, storage and kernel options, keyword-only:
      :class:`~optax_hybrid.options.Placement` (``state_memory_kind``,
      ``nvme_offload_dir``, ``shard_state_over``),
      :class:`~optax_hybrid.options.Storage` (``moment_format``, ``master``,
      ``state_layout``), :class:`~optax_hybrid.options.Execution`
      (``kernel``, ``skip_nonfinite``); and, as ``**deprecated``, the older
      spellings, which warn once and give the same results until 0.3
      (docs/optimizer.md, "One spelling per choice").

  All numeric hyperparameters may be traced, so
  ``optax.inject_hyperparams(hybrid_adamw)(...)`` works, and changing an
  injected value does not recompile when the new value has the old one's
  shape, dtype, weak type and committedness (``jnp.full_like(old, value)``;
  a Python float is weakly typed and compiles the step once more). Pass
  ``hyperparam_dtype=jnp.float32`` there for low-precision params: Optax
  otherwise casts the injected betas to the params' dtype. A ``weight_decay`` or ``eps_root`` that is zero when
  ``init`` runs is left out of every step.

  Returns:
    A :class:`optax_hybrid.HybridOptimizer`: an
    ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`HybridAdamState`, with the fused ``step`` method.

  Raises:
    ValueError: for a hyperparameter out of range, an unknown memory kind or
      kernel, or a memory kind the backend does not have.
    TypeError: for arguments of the wrong type.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> params = {"w": jnp.ones((3,))}
    >>> tx = optax_hybrid.hybrid_adamw(
    ...     optax_hybrid.warmup_cosine_schedule(1e-3, total_steps=1000, warmup_steps=30),
    ...     weight_decay=0.1, state_memory_kind="pinned_host")
    >>> state = tx.init(params)
    >>> state.mu["w"].sharding.memory_kind
    'pinned_host'
    >>> updates, state = tx.update({"w": jnp.ones((3,))}, state, params)
    >>> params = optax_hybrid.apply_updates(params, updates)
  """
  mask, nu_dtype = _older_spellings("hybrid_adamw", mask, options)
  rule = AdamW(b1, b2, eps, eps_root, weight_decay, nesterov, bias_correction, adamw_mode, mu_dtype, nu_dtype)
  return transform.optimizer(rule, learning_rate, mask=mask, **options)


@takes_options(without=("master",))
def scale_by_hybrid_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    eps_root: float = 0.0,
    nesterov: bool = False,
    bias_correction: bool = True,
    adamw_mode: bool = True,
    mask: MaskOrFn = None,
    mu_dtype: Any = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""The Adam direction, without the learning rate, for users who compose their own chain.

  Returns :math:`\hat m / (\sqrt{\hat v} + \epsilon)` plus, in AdamW mode,
  :math:`\lambda p` on masked leaves; so that
  ``optax.chain(scale_by_hybrid_adam(...), optax.scale_by_learning_rate(lr))``
  equals ``hybrid_adamw(lr, ...)``. Arguments are those of
  :func:`hybrid_adamw` (master weights need the learning rate inside the
  step, so ``master`` is only offered there).

  Example:
    >>> import optax, optax_hybrid
    >>> tx = optax.chain(
    ...     optax.clip_by_global_norm(1.0),
    ...     optax_hybrid.scale_by_hybrid_adam(b2=0.95),
    ...     optax.scale_by_learning_rate(3e-4))
  """
  mask, nu_dtype = _older_spellings("scale_by_hybrid_adam", mask, options)
  rule = AdamW(b1, b2, eps, eps_root, weight_decay, nesterov, bias_correction, adamw_mode, mu_dtype, nu_dtype)
  return transform.building_block(rule, mask=mask, **options)
