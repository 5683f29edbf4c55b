"""What every kernel takes and returns, and what the custom kernels share.

A kernel is a function ``update_leaves(leaves, facts, s, rule) -> results``:

* ``leaves``: one :class:`LeafOperands` per leaf (arrays; ``param`` is None
  when the step does not read it);
* ``facts``: one :class:`LeafFacts` per leaf (static: known at trace time);
* ``s``: the step's :class:`AdamScalars` (traced: a changing learning rate or
  step count never recompiles);
* ``rule``: the step-wide :class:`Rule` (static);

and it returns one :class:`LeafResult` per leaf. ``kernels/reference.py`` is
the rule once; the custom kernels hand it the leaves they cannot take
(:func:`optax_hybrid.kernels.reference.with_reference_for_the_rest`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

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


class LeafOperands(NamedTuple):
  """One leaf's arrays for a step: the gradient, both moments, and the param (or its master) if read."""

  grad: jax.Array
  mu: jax.Array
  nu: jax.Array
  param: jax.Array | None = None


class LeafFacts(NamedTuple):
  """What a kernel knows statically about one leaf.

  Attributes:
    decay: does the leaf take weight decay (the mask)?
    out_dtype: dtype of the first result: the update, or the new param when
      ``Rule.write_params``.
  """

  decay: bool
  out_dtype: Any


class LeafResult(NamedTuple):
  """One leaf's results: the update (or the new param), and the new moments in their storage dtypes."""

  first: jax.Array
  mu: jax.Array
  nu: jax.Array


class Rule(NamedTuple):
  """Step-wide static choices.

  Attributes:
    adamw_mode: decoupled decay (True) or L2 decay through the gradient.
    write_params: return the new param ``p + u`` (rounded once) instead of ``u``.
  """

  adamw_mode: bool
  write_params: bool = False


# Storage dtypes the custom kernels have loops for.
STORAGE_DTYPES = frozenset({np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def pack_scalars(s: AdamScalars) -> jax.Array:
  """The scalars as one float32 vector operand, in field order (``step_ok`` as 1.0 / 0.0)."""
  step_ok = jnp.ones([], jnp.float32) if s.step_ok is None else s.step_ok.astype(jnp.float32)
  return jnp.stack([
      s.learning_rate, s.b1, s.b2, s.eps, s.weight_decay, s.bias_correction1, s.bias_correction2_sqrt, step_ok,
  ]).astype(jnp.float32)


def chunks(n: int, size: int) -> Iterator[slice]:
  """Slices of ``range(n)`` of at most ``size`` items: one custom call or launch each."""
  for start in range(0, n, size):
    yield slice(start, start + size)


def in_chunks(run, leaves: Sequence[LeafOperands], facts: Sequence[LeafFacts], size: int) -> list[LeafResult]:
  """``run(leaves, facts)`` over chunks of at most ``size`` leaves, results concatenated in order."""
  out: list[LeafResult] = []
  for part in chunks(len(leaves), size):
    out.extend(run(leaves[part], facts[part]))
  return out


# ---------------------------------------------------------------------------
# Per-platform choices
# ---------------------------------------------------------------------------

@contextlib.contextmanager
def lowering_for(*platforms: str) -> Iterator[None]:
  """Declares the platforms the steps traced inside will be lowered for (``"cuda"``, ``"cpu"``, ...).

  ``jit`` lowers for the default backend, and that is what the kernels assume.
  Tracing on one backend and lowering for another
  (``.lower(lowering_platforms=("cuda",))``) needs this declaration for the
  kernel choice to be the one that platform makes;
  :func:`optax_hybrid.gpu_compile.compile_for_gpu` makes it for you. ``jit``'s
  trace cache is keyed on it, so a step traced inside is not reused outside.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> from optax_hybrid.kernels import lowering_for
    >>> tx = optax_hybrid.hybrid_adamw(1e-3)  # kernel="auto"
    >>> params = {"w": jnp.ones(3)}
    >>> with lowering_for("cuda"):
    ...   lowered = jax.jit(tx.step).trace(params, tx.init(params), params).lower(lowering_platforms=("cuda",))
  """
  with _compat.declared_lowering_platforms(platforms):
    yield


def lowering_platforms() -> tuple[str, ...]:
  """The platforms a step traced now is lowered for: the declared ones, else the default backend's."""
  declared = _compat.lowering_platforms_declared()
  if declared:
    return declared
  backend = jax.default_backend()
  return {"gpu": ("cuda", "rocm")}.get(backend, (backend,))


def per_platform(branches: dict[str, Callable], *args: Any) -> Any:
  """``branches[platform](*args)`` for the platform the step is lowered for.

  ``branches`` maps platform names to functions, ``"default"`` covering the
  others. Only the branches of :func:`lowering_platforms` are traced (tracing
  a branch, the Pallas kernel's say, is not free); one left is called
  directly, several go through ``lax.platform_dependent``, which picks at
  lowering.
  """
  wanted = {p: branches.get(p, branches["default"]) for p in lowering_platforms()}
  distinct = list(dict.fromkeys(wanted.values()))
  if len(distinct) == 1:
    return distinct[0](*args)
  return jax.lax.platform_dependent(*args, **wanted, default=branches["default"])
