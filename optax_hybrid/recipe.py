"""The "boring stack" most production training uses, in one call.

Gradient clipping by global norm, AdamW (:func:`optax_hybrid.hybrid_adamw`, so
the moments can live in host memory) with a linear warmup and a cosine decay to
a floor, gradient accumulation, and parameter groups in the spirit of PyTorch's:
a learning-rate multiplier and a weight decay per group of parameter paths, and
frozen groups that hold no optimizer state at all. The clipping, the global
norm and the accumulation it chains are the placed transforms of
:mod:`optax_hybrid.placed` (exported here too), which compute where the values
live.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import inspect
import numbers
import re
from typing import Any, Callable, Mapping, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_hybrid import _checks, _compat, _deprecations
from optax_hybrid.options import DEPRECATED_OPTIONS
from optax_hybrid.paths import path_name  # documented here too: param_groups match its paths
from optax_hybrid.placed import AccumulationState, accumulate_gradients, clip_by_global_norm, global_norm, skip_together
from optax_hybrid.schedules import warmup_cosine_schedule
from optax_hybrid.rules.adamw import HybridAdamState, hybrid_adamw

DEFAULT_WARMUP_FRACTION = 0.03
DEFAULT_MIN_LR_RATIO = 0.1
GROUP_KEYS = ("lr_multiplier", "weight_decay", "frozen")

# Labels of the partition: the params no rule claims, and every frozen rule's.
_DEFAULT_LABEL = "<default>"
_FROZEN_LABEL = "<frozen>"

# Flax's names for leaves that take no weight decay: linen and nnx Dense/Linear
# and norm biases, LayerNorm/RMSNorm/BatchNorm scales, Embed tables (and the
# ``pos_embedding``-style names of the Flax examples).
_NO_DECAY_NAMES = ("bias", "scale")
_NO_DECAY_SUFFIX = "embedding"


def flax_weight_decay_rule(path: str, param: Any) -> bool:
  """Whether a leaf takes weight decay by Flax's naming conventions (the default ``decay_mask``).

  Decays leaves with two or more dimensions (``kernel``-like: Linear/Dense,
  Conv, attention projections), except those whose last path name is
  ``bias`` or ``scale`` or ends in ``embedding`` (Flax's Embed tables and
  ``pos_embedding``-style positional tables). Biases, normalization scales
  and all 0-D/1-D leaves do not decay.

  Args:
    path: the leaf's ``'/'``-joined path (see :func:`path_name`).
    param: the leaf (only its number of dimensions is read).

  Returns:
    ``True`` if the leaf decays.

  Example:
    >>> import jax.numpy as jnp
    >>> from optax_hybrid.recipe import flax_weight_decay_rule
    >>> flax_weight_decay_rule("head/kernel", jnp.ones((4, 3)))
    True
    >>> flax_weight_decay_rule("embed/embedding", jnp.ones((10, 4)))
    False
  """
  name = path.rsplit("/", 1)[-1]
  if name in _NO_DECAY_NAMES or name.endswith(_NO_DECAY_SUFFIX):
    return False
  return np.ndim(param) >= 2


# ---------------------------------------------------------------------------
# Argument validation
# ---------------------------------------------------------------------------


_real = functools.partial(_checks.real, "standard_optimizer")
_integer = functools.partial(_checks.integer, "standard_optimizer")


def _warmup_steps(warmup: Any, total_steps: int) -> int:
  if warmup is None:
    warmup = DEFAULT_WARMUP_FRACTION
  if isinstance(warmup, bool) or not isinstance(warmup, numbers.Real):
    raise TypeError(
        "standard_optimizer: `warmup` must be a number of steps (int) or a fraction "
        f"of total_steps (float in [0, 1)), got {warmup!r} of type {type(warmup).__name__}."
    )
  if isinstance(warmup, numbers.Integral):
    steps = _integer("warmup", warmup, low=0)
  else:
    fraction = float(warmup)
    if not (0.0 <= fraction < 1.0):
      raise ValueError(
          "standard_optimizer: `warmup` as a float is a fraction of total_steps and "
          f"must be in [0, 1), got {fraction!r}; pass an int for a number of steps."
      )
    steps = int(round(fraction * total_steps))
  if steps >= total_steps:
    raise ValueError(
        f"standard_optimizer: `warmup`={warmup!r} gives {steps} warmup steps, which "
        f"leaves no cosine decay in total_steps={total_steps}; lower warmup or raise "
        "total_steps."
    )
  return steps


def _build_schedule(learning_rate, total_steps, schedule, warmup, min_lr_ratio, min_lr) -> optax.Schedule:
  if schedule is not None:
    if not callable(schedule):
      raise TypeError(
          "standard_optimizer: `schedule` must be an Optax schedule (a function of "
          f"the step count), got {schedule!r}."
      )
    ignored = [name for name, value in (
        ("learning_rate", learning_rate), ("total_steps", total_steps), ("warmup", warmup),
        ("min_lr_ratio", min_lr_ratio), ("min_lr", min_lr)) if value is not None]
    if ignored:
      raise ValueError(
          f"standard_optimizer: {', '.join(f'`{n}`' for n in ignored)} shape the built-in "
          "warmup-cosine schedule and have no effect with `schedule`; pass one or "
          "the other."
      )
    return schedule
  if learning_rate is None:
    raise ValueError(
        "standard_optimizer: `learning_rate` (the peak of the warmup-cosine schedule) "
        "is required; or pass any Optax schedule as `schedule`."
    )
  if callable(learning_rate):
    raise TypeError(
        "standard_optimizer: `learning_rate` is the peak value, a number; pass an "
        "Optax schedule as `schedule=` instead."
    )
  peak = _real("learning_rate", learning_rate, low=0.0)
  if total_steps is None:
    raise ValueError(
        "standard_optimizer: `total_steps` (the number of optimizer updates the "
        "cosine decays over) is required with `learning_rate`."
    )
  total_steps = _integer("total_steps", total_steps, low=1)
  warmup_steps = _warmup_steps(warmup, total_steps)
  if min_lr is not None:
    if min_lr_ratio is not None:
      raise ValueError(
          "standard_optimizer: pass either `min_lr` (absolute) or `min_lr_ratio` "
          "(a fraction of learning_rate), not both."
      )
    eta_min = _real("min_lr", min_lr, low=0.0)
    if eta_min > peak:
      raise ValueError(
          f"standard_optimizer: `min_lr`={eta_min!r} exceeds `learning_rate`={peak!r}; "
          "the cosine decays from the peak down to min_lr."
      )
  else:
    ratio = DEFAULT_MIN_LR_RATIO if min_lr_ratio is None else min_lr_ratio
    eta_min = peak * _real("min_lr_ratio", ratio, low=0.0, high=1.0)
  return warmup_cosine_schedule(peak, total_steps, warmup_steps=warmup_steps, eta_min=eta_min)


class _Rule(NamedTuple):
  text: str  # the pattern as written, for messages
  label: str
  matches: Callable[[str], bool]
  lr_multiplier: float
  weight_decay: Optional[float]
  frozen: bool


def _parse_param_groups(param_groups: Any) -> list[_Rule]:
  if param_groups is None:
    return []
  if not isinstance(param_groups, Mapping):
    raise TypeError(
        "standard_optimizer: `param_groups` must be a dict {pattern: {option: value}} "
        f"(patterns tried in order), got {type(param_groups).__name__}."
    )
  rules = []
  for pattern, options in param_groups.items():
    if isinstance(pattern, re.Pattern):
      text, label, matches = f"re:{pattern.pattern}", f"re:{pattern.pattern}", pattern.fullmatch
    elif isinstance(pattern, str):
      text, label = pattern, pattern
      matches = lambda path, pattern=pattern: fnmatch.fnmatchcase(path, pattern)
    else:
      raise TypeError(
          "standard_optimizer: `param_groups` keys must be glob strings (e.g. 'head/*') "
          f"or compiled regular expressions, got {pattern!r}."
      )
    where = f"param_groups[{pattern!r}]"
    if not isinstance(options, Mapping):
      raise TypeError(
          f"standard_optimizer: {where} must be a dict of options ({', '.join(GROUP_KEYS)}), "
          f"got {options!r}."
      )
    unknown = [k for k in options if k not in GROUP_KEYS]
    if unknown:
      raise ValueError(
          f"standard_optimizer: {where} has unknown key {unknown[0]!r}; the accepted "
          f"keys are {', '.join(map(repr, GROUP_KEYS))}."
      )
    frozen = options.get("frozen", False)
    if not isinstance(frozen, (bool, np.bool_)):
      raise TypeError(f"standard_optimizer: {where}['frozen'] must be a bool, got {frozen!r}.")
    if frozen and ("lr_multiplier" in options or "weight_decay" in options):
      raise ValueError(
          f"standard_optimizer: {where} is frozen, so it takes no 'lr_multiplier' or "
          "'weight_decay'; drop them or drop 'frozen'."
      )
    lr_multiplier = _real(f"{where}['lr_multiplier']", options.get("lr_multiplier", 1.0), low=0.0)
    weight_decay = options.get("weight_decay")
    if weight_decay is not None:
      weight_decay = _real(f"{where}['weight_decay']", weight_decay, low=0.0)
    # An lr of zero leaves params unchanged (decoupled decay is scaled by the lr
    # too), which is exactly what freezing does, without the state.
    frozen = bool(frozen) or lr_multiplier == 0.0
    if frozen:
      label = _FROZEN_LABEL
    elif label in (_DEFAULT_LABEL, _FROZEN_LABEL) or any(r.label == label for r in rules):
      raise ValueError(
          f"standard_optimizer: `param_groups` pattern {text!r} is given twice (or is "
          f"the reserved name {_DEFAULT_LABEL!r} or {_FROZEN_LABEL!r}).")
    rules.append(_Rule(text, label, matches, lr_multiplier, weight_decay, frozen))
  return rules


def _label_params(rules: list[_Rule], tree: Any) -> Any:
  """The group label of each leaf (first matching rule wins), checking that every rule claims a leaf."""
  if _compat.is_optax_params_placeholder(tree):
    # optax.tree_utils.tree_map_params: no params to label, and none to claim.
    return tree
  claimed = [0] * len(rules)
  matched = [0] * len(rules)
  paths = []

  def label(key_path, _):
    path = path_name(key_path)
    paths.append(path)
    hits = [i for i, rule in enumerate(rules) if rule.matches(path)]
    for i in hits:
      matched[i] += 1
    if not hits:
      return _DEFAULT_LABEL
    claimed[hits[0]] += 1
    return rules[hits[0]].label

  labels = jax.tree_util.tree_map_with_path(label, tree)
  for i, rule in enumerate(rules):
    if claimed[i]:
      continue
    if matched[i]:
      raise ValueError(
          f"standard_optimizer: `param_groups` pattern {rule.text!r} only matches "
          "parameters an earlier pattern already claims (the first matching pattern "
          "wins); reorder or remove it."
      )
    examples = ", ".join(repr(p) for p in paths[:4]) + (", ..." if len(paths) > 4 else "")
    raise ValueError(
        f"standard_optimizer: `param_groups` pattern {rule.text!r} matches no parameter "
        f"(a typo?); parameter paths look like {examples}."
    )
  return labels


def _decay_mask_fn(decay_mask: Any) -> Callable[[Any], Any]:
  """A ``hybrid_adamw`` mask callable ``params -> tree of bools`` from a per-path rule."""
  if decay_mask is None:
    decay_mask = flax_weight_decay_rule
  elif not callable(decay_mask):
    raise TypeError(
        "standard_optimizer: `decay_mask` must be None (Flax naming conventions) or a "
        "callable (path, param) -> bool, e.g. lambda path, p: path.endswith('kernel'); "
        f"got {decay_mask!r}."
    )

  def leaf(key_path, param):
    path = path_name(key_path)
    decays = decay_mask(path, param)
    if not isinstance(decays, (bool, np.bool_)):
      raise TypeError(
          f"standard_optimizer: `decay_mask` returned {decays!r} for {path!r}; it must "
          "return a Python bool (decide from the path and shape, not the values)."
      )
    return bool(decays)

  return lambda params: jax.tree_util.tree_map_with_path(leaf, params)


# ---------------------------------------------------------------------------
# Transformations the recipe adds around hybrid_adamw
# ---------------------------------------------------------------------------


class LearningRateState(NamedTuple):
  """State of :func:`standard_optimizer`'s outer transform.

  Attributes:
    learning_rate: float32 scalar: the learning rate of the default group (the
      schedule's value, multiplier 1) in the latest update taken; before the
      first update, the rate it will use. Read it with
      :func:`last_learning_rate`.
    inner_state: the state of the clipping / AdamW chain.
  """

  learning_rate: jax.Array
  inner_state: Any


def _hybrid_states(state: Any) -> list[HybridAdamState]:
  is_hybrid = lambda x: isinstance(x, HybridAdamState)
  return [s for s in jax.tree.leaves(state, is_leaf=is_hybrid) if is_hybrid(s)]


def _stepping_count(state: Any) -> Any:
  """The ``count`` of the first AdamW group that holds moments.

  All groups step together (non-finite gradients are spread to every group
  when ``skip_nonfinite``), except a group with no params, whose count also
  advances on skipped steps: it is not the one to follow.
  """
  states = _hybrid_states(state)
  for s in states:
    if jax.tree.leaves((s.mu, s.nu)):
      return s.count
  return states[0].count


def _learning_rate_at(schedule: optax.Schedule, count: Any) -> Any:
  """The schedule's value as a float32 scalar placed like ``count``."""
  if isinstance(count, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((), jnp.float32, sharding=count.sharding)
  if isinstance(count, _compat.Tracer):
    return jnp.asarray(schedule(count), jnp.float32)
  # A Python count: schedules then compute in Python (warmup_cosine_schedule
  # does) instead of compiling each eager jax.numpy op on a device scalar.
  lr = jnp.asarray(schedule(int(count)), jnp.float32)
  if getattr(count, "committed", False):
    # Committed like the count: a jitted step's outputs are committed, and an
    # uncommitted input would make its second call compile again.
    lr = jax.device_put(lr, count.sharding)
  return lr


def _record_learning_rate(inner: optax.GradientTransformation, schedule: optax.Schedule):
  """Wraps ``inner`` so its state records the learning rate of the latest update."""

  def init_fn(params):
    inner_state = inner.init(params)
    return LearningRateState(_learning_rate_at(schedule, _stepping_count(inner_state)), inner_state)

  def update_fn(updates, state, params=None, **extra_args):
    updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
    old, new = _stepping_count(state.inner_state), _stepping_count(inner_state)
    # hybrid_adamw evaluates the schedule at the count before incrementing it,
    # and leaves the count alone on a skipped step.
    lr = jnp.where(new != old, jnp.asarray(schedule(old), jnp.float32), state.learning_rate)
    return updates, LearningRateState(lr, inner_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _scaled(schedule: optax.Schedule, multiplier: float) -> optax.Schedule:
  if multiplier == 1.0:
    return schedule
  return lambda count: multiplier * schedule(count)


# ---------------------------------------------------------------------------
# The recipe
# ---------------------------------------------------------------------------


def _check_hybrid_options(hybrid_options: Mapping[str, Any]) -> None:
  """Raises a TypeError naming ``standard_optimizer`` and the closest option for a keyword nobody takes."""
  # hybrid_adamw's arguments less those the recipe sets itself, and its options' older spellings (they warn).
  hybrid_keywords = [name for name, p in inspect.signature(hybrid_adamw).parameters.items()
                     if p.kind is not inspect.Parameter.VAR_KEYWORD
                     and name not in ("learning_rate", "b1", "b2", "eps", "weight_decay", "mask")]
  older = [*DEPRECATED_OPTIONS, "nu_dtype"]
  hybrid_keywords += older
  own = [name for name, p in inspect.signature(standard_optimizer).parameters.items()
         if p.kind is not inspect.Parameter.VAR_KEYWORD]
  for name in hybrid_options:
    if name not in hybrid_keywords:
      close = difflib.get_close_matches(name, own + hybrid_keywords, n=1)
      hint = f"; did you mean {close[0]!r}?" if close else "."
      raise TypeError(
          f"standard_optimizer() got an unexpected keyword argument {name!r}{hint} It takes its own "
          f"arguments ({', '.join(own)}) and hybrid_adamw's keyword options "
          f"({', '.join(k for k in hybrid_keywords if k not in older)}).")


def standard_optimizer(
    learning_rate: Optional[float] = None,
    total_steps: Optional[int] = None,
    *,
    schedule: Optional[optax.Schedule] = None,
    warmup: Union[int, float, None] = None,
    min_lr: Optional[float] = None,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    max_grad_norm: Optional[float] = 1.0,
    accumulation_steps: int = 1,
    param_groups: Optional[Mapping[Any, Mapping[str, Any]]] = None,
    decay_mask: Optional[Callable[[str, Any], bool]] = None,
    **hybrid_options: Any,
) -> optax.GradientTransformationExtraArgs:
  r"""AdamW with warmup-cosine, gradient clipping, accumulation and parameter groups.

  The "boring stack" (LLaMA/GPT practice) built from a handful of arguments:

  1. clipping by global norm, as ``optax.clip_by_global_norm(max_grad_norm)``
     does it, for gradients in any memory kind (skipped when ``None``);
  2. :func:`optax_hybrid.hybrid_adamw` with ``b1=0.9, b2=0.95, eps=1e-8,
     weight_decay=0.1`` and :func:`optax_hybrid.warmup_cosine_schedule`
     (``warmup`` steps of linear warmup to ``learning_rate``, then a cosine to
     ``min_lr``), or any Optax ``schedule``;
  3. :func:`accumulate_gradients` (``optax.MultiSteps``' numbers, with the
     inner update under a ``lax.cond``) when ``accumulation_steps > 1``:
     gradients of ``accumulation_steps`` micro-batches are averaged, then
     clipped and applied as one update.

  Steps count optimizer updates: with accumulation, ``total_steps`` and
  ``warmup`` are in updates (micro-batches / ``accumulation_steps``), and the
  learning rate advances once per update.

  **Weight decay** applies, by default, only to ``kernel``-like leaves of two or
  more dimensions, following Flax's names: no decay on ``bias``, ``scale``
  (LayerNorm/RMSNorm/BatchNorm) or ``embedding`` (Embed) leaves, nor on any
  0-D/1-D leaf (see :func:`flax_weight_decay_rule`). ``decay_mask`` replaces
  that rule with a callable ``(path, param) -> bool``.

  **Parameter groups**: ``param_groups`` maps patterns to options, like
  PyTorch's param groups::

    {"head/*": {"lr_multiplier": 10.0},                       # a faster head
     "backbone/*": {"lr_multiplier": 0.1, "weight_decay": 0.05},
     "embed/*": {"frozen": True}}                             # not trained

  Patterns are matched against each leaf's ``'/'``-joined path
  (:func:`path_name`: ``"head/kernel"``, ``"layers/0/bias"``); a string is a
  glob (``fnmatch``: ``*`` also matches ``/``), a compiled ``re.Pattern`` must
  match the whole path. Patterns are tried in order and **the first matching
  one wins**; leaves no pattern matches form the default group (multiplier 1,
  ``weight_decay``). Options: ``lr_multiplier`` (``>= 0``, scales the schedule),
  ``weight_decay`` (the group's coefficient, applied to the leaves the decay
  mask selects; default: ``weight_decay``), ``frozen`` (no optimizer state is
  allocated, the updates are zero). ``lr_multiplier=0`` also freezes. Each group
  is its own ``hybrid_adamw`` inside ``optax.multi_transform``. A pattern that
  matches no parameter, or only parameters an earlier one claims, raises a
  ``ValueError`` naming it when the optimizer is initialized.

  **Placement.** With the moments in host memory
  (``state_memory_kind="pinned_host"``) the stack keeps every computation on
  host-resident values inside host compute, accumulation included (the
  moments are touched only on the micro-step that updates). Clipping computes
  the global norm across leaves, so gradients in host memory need
  ``max_grad_norm=None``.

  Args:
    learning_rate: the peak learning rate (``>= 0``) of the warmup-cosine
      schedule. Leave it out when passing ``schedule``.
    total_steps: the number of optimizer updates the cosine decays over;
      required with ``learning_rate``. After it the rate stays at ``min_lr``.
    schedule: any Optax schedule (``optax.cosine_onecycle_schedule``,
      ``optax.exponential_decay``, ...), instead of the warmup-cosine; then
      ``learning_rate``, ``total_steps``, ``warmup`` and ``min_lr`` must be
      left out.
    warmup: warmup length: an ``int`` number of updates, or a ``float`` in
      ``[0, 1)``, a fraction of ``total_steps`` (rounded to the nearest update).
      Default: 3% of ``total_steps``.
    min_lr: the floor the cosine decays to, in ``[0, learning_rate]``;
      default a tenth of ``learning_rate``.
    b1: Adam's first-moment decay.
    b2: Adam's second-moment decay.
    eps: added to the denominator, outside the square root.
    weight_decay: decoupled weight decay of the default group (scaled by the
      current learning rate, as in ``torch.optim.AdamW``).
    max_grad_norm: clip the gradients to this global norm (``> 0``), before the
      update; ``None``: no clipping.
    accumulation_steps: micro-batches per update (``>= 1``).
    param_groups: ``{pattern: {option: value}}`` as above.
    decay_mask: ``(path, param) -> bool``: which leaves take weight decay;
      ``None``: :func:`flax_weight_decay_rule`.
    **hybrid_options: any other keyword argument of
      :func:`optax_hybrid.hybrid_adamw`, given to every group's AdamW: the
      placement options (``state_memory_kind="pinned_host"`` for moments in
      host memory, ``kernel``), ``moment_format`` (``"8bit"``), ``mu_dtype``,
      ``bias_correction``, and ``skip_nonfinite=True``, which skips a whole
      update (every group together) whose gradients hold a NaN or an
      infinity, without advancing the schedule. Options that take a tree or a
      per-leaf callable see each group's params (others masked out); prefer
      callables ``(path, param) -> ...``. The weight-decay mask is the
      recipe's own: use ``decay_mask``. The older spellings warn, as
      ``hybrid_adamw``'s (``min_lr_ratio``, for ``min_lr``, too).

  Returns:
    An ``optax.GradientTransformationExtraArgs``. Its state records the
    learning rate of the latest update: read it with
    :func:`last_learning_rate`, also inside ``jit`` and from
    ``nnx.Optimizer.opt_state``.

  Raises:
    ValueError: for a value out of range (negative ``learning_rate``,
      ``warmup`` fraction ``>= 1``, ``accumulation_steps < 1``, ...),
      arguments that contradict each other, an unknown ``param_groups`` key,
      and, at ``init``, a pattern that matches no parameter.
    TypeError: for arguments of the wrong type, or a keyword argument that
      neither it nor ``hybrid_adamw`` takes (the message suggests the closest
      name).

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> from optax_hybrid.recipe import standard_optimizer, last_learning_rate
    >>> params = {"body": {"kernel": jnp.ones((4, 4)), "bias": jnp.zeros(4)},
    ...           "head": {"kernel": jnp.ones((4, 2))}}
    >>> tx = standard_optimizer(3e-4, total_steps=1000, warmup=0.05,
    ...                         param_groups={"head/*": {"lr_multiplier": 10.0}},
    ...                         state_memory_kind="pinned_host")
    >>> state = tx.init(params)
    >>> grads = {"body": {"kernel": jnp.ones((4, 4)), "bias": jnp.ones(4)},
    ...          "head": {"kernel": jnp.ones((4, 2))}}
    >>> updates, state = jax.jit(tx.update)(grads, state, params)
    >>> round(float(last_learning_rate(state)), 9)  # (0 + 1) / 50 * 3e-4
    6e-06
  """
  min_lr_ratio = hybrid_options.pop("min_lr_ratio", None)
  if min_lr_ratio is not None:
    _deprecations.warn("standard_optimizer", "min_lr_ratio", _deprecations.SPELLINGS["min_lr_ratio"])
  sched = _build_schedule(learning_rate, total_steps, schedule, warmup, min_lr_ratio, min_lr)
  if max_grad_norm is not None:
    max_grad_norm = _real("max_grad_norm", max_grad_norm, low=0.0)
    if max_grad_norm == 0.0:
      raise ValueError(
          "standard_optimizer: `max_grad_norm` must be > 0, got 0.0; pass None to "
          "disable clipping."
      )
  accumulation_steps = _integer("accumulation_steps", accumulation_steps, low=1)
  rules = _parse_param_groups(param_groups)
  mask = _decay_mask_fn(decay_mask)
  for name in ("mask", "weight_decay_mask"):
    if name in hybrid_options:
      raise ValueError(
          f"standard_optimizer: pass the weight-decay mask as `decay_mask` (a callable "
          f"(path, param) -> bool), not `{name}`."
      )

  _check_hybrid_options(hybrid_options)

  def adamw(lr, wd):
    return hybrid_adamw(lr, b1, b2, eps, weight_decay=wd, mask=mask, **hybrid_options)

  core = adamw(sched, weight_decay)
  trainable_groups = 1
  if rules:
    transforms = {_DEFAULT_LABEL: core}
    for rule in rules:
      if rule.frozen:
        transforms[_FROZEN_LABEL] = optax.set_to_zero()
      else:
        wd = weight_decay if rule.weight_decay is None else rule.weight_decay
        transforms[rule.label] = adamw(_scaled(sched, rule.lr_multiplier), wd)
        trainable_groups += 1
    core = optax.multi_transform(transforms, lambda tree: _label_params(rules, tree))

  parts = []
  if hybrid_options.get("skip_nonfinite", False) and trainable_groups > 1:
    parts.append(skip_together())
  if max_grad_norm is not None:
    parts.append(clip_by_global_norm(max_grad_norm))
  tx = _record_learning_rate(optax.chain(*parts, core), sched)
  if accumulation_steps > 1:
    tx = accumulate_gradients(tx, accumulation_steps)
  return tx


def last_learning_rate(opt_state: Any, learning_rate: Any = None) -> jax.Array:
  """The learning rate of the latest update, read from a :func:`standard_optimizer` or :func:`hybrid_adamw` state.

  It is the default group's rate (the schedule's value; multiply by a group's
  ``lr_multiplier`` for that group), for the latest update actually taken:
  micro-steps of an accumulation and skipped non-finite steps do not change
  it. Before the first update it is the rate the first update will use. A
  transform chained after the optimizer (e.g.
  ``optax.contrib.reduce_on_plateau``) scales the updates on its own; its
  factor is not included.

  A :func:`standard_optimizer` state records the rate. A plain
  :func:`optax_hybrid.hybrid_adamw` state records only its ``count`` (the
  updates taken), so pass the ``learning_rate`` given to ``hybrid_adamw``
  (a float or the schedule): the rate is then ``learning_rate(max(count - 1,
  0))``, the value ``hybrid_adamw`` used (it evaluates the schedule at the
  count before incrementing it).

  Works on the raw Optax state, nested anywhere (``optax.chain``,
  ``optax.MultiSteps``), inside ``jit``, and on ``nnx.Optimizer.opt_state``
  (whose arrays are wrapped in Variables).

  Args:
    opt_state: the state of a :func:`standard_optimizer` transformation, or of
      a transformation that contains exactly one; or, with
      ``learning_rate``, a state that contains :func:`hybrid_adamw` states
      (the count of the first one that holds moments is read).
    learning_rate: for a state that does not record its rate (a plain
      ``hybrid_adamw`` one): the float or schedule given to ``hybrid_adamw``.
      Leave it out for a :func:`standard_optimizer` state.

  Returns:
    A float32 scalar ``jax.Array``.

  Raises:
    ValueError: if ``opt_state`` holds more than one
      :class:`LearningRateState`; none and no ``learning_rate`` (the message
      says to pass it), or no ``hybrid_adamw`` state either; or a
      :class:`LearningRateState` and a ``learning_rate`` too.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> from optax_hybrid.recipe import standard_optimizer, last_learning_rate
    >>> tx = standard_optimizer(1.0, total_steps=100, warmup=10, min_lr=0.1)
    >>> state = tx.init({"w": jnp.ones((2, 2))})
    >>> _, state = jax.jit(tx.update)({"w": jnp.ones((2, 2))}, state, {"w": jnp.ones((2, 2))})
    >>> float(jax.jit(last_learning_rate)(state))  # (0 + 1) / 10 * 1.0
    0.10000000149011612
    >>> schedule = optax_hybrid.warmup_cosine_schedule(1.0, total_steps=100, warmup_steps=10, eta_min=0.1)
    >>> tx = optax_hybrid.hybrid_adamw(schedule)
    >>> state = tx.init({"w": jnp.ones((2, 2))})
    >>> _, state = jax.jit(tx.update)({"w": jnp.ones((2, 2))}, state, {"w": jnp.ones((2, 2))})
    >>> float(last_learning_rate(state, schedule))  # the first update's: (0 + 1) / 10 * 1.0
    0.10000000149011612
  """
  is_record = lambda x: isinstance(x, LearningRateState)
  records = [s for s in jax.tree.leaves(opt_state, is_leaf=is_record) if is_record(s)]
  if len(records) > 1 or (records and learning_rate is not None):
    raise ValueError(
        f"last_learning_rate: `opt_state` holds {len(records)} standard_optimizer state(s) "
        "(LearningRateState), which record their rate: pass a state with exactly one, and no "
        "`learning_rate`."
    )
  if records:
    # An nnx Variable is a pytree node around the array: flattening unwraps it.
    (value,) = jax.tree.leaves(records[0].learning_rate)
    return jnp.asarray(value, jnp.float32)
  if not _hybrid_states(opt_state):
    raise ValueError(
        "last_learning_rate: `opt_state` must contain exactly one standard_optimizer state "
        "(LearningRateState) or a hybrid_adamw state; found neither. Pass the state made by "
        "standard_optimizer(...).init or hybrid_adamw(...).init (or nnx.Optimizer.opt_state)."
    )
  if learning_rate is None:
    raise ValueError(
        "last_learning_rate: a hybrid_adamw state records its count, not its learning rate: pass the "
        "learning rate or schedule given to hybrid_adamw, last_learning_rate(state, learning_rate) "
        "(standard_optimizer's state records it)."
    )
  (count,) = jax.tree.leaves(_stepping_count(opt_state))
  if not callable(learning_rate):
    return jnp.asarray(learning_rate, jnp.float32)
  return jnp.asarray(learning_rate(jnp.maximum(jnp.asarray(count) - 1, 0)), jnp.float32)


# The placed transforms are documented and imported here too, where they were before placed.py held them.
__all__ = ["AccumulationState", "LearningRateState", "accumulate_gradients", "clip_by_global_norm",
           "flax_weight_decay_rule", "global_norm", "last_learning_rate", "standard_optimizer"]
