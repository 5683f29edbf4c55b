"""Telling a training loop, once, that its jitted step will compile twice, and the line that stops it.

JAX commits every output of a program that moves arrays between memory kinds
(``pxla.py``: ``committed = ... or transfer_mem_kind_in_jaxpr``), and it
compiles a jitted function again when an argument that was uncommitted comes
back committed. A step whose optimizer state lives outside device memory
moves arrays, so a loop written as for ``optax.adamw`` (params from ``jnp``,
``jax.random`` or Flax, a framework's step counter, all uncommitted) compiles
its whole step twice. The library cannot commit them itself: the params are
the user's arrays, and the counters (``nnx.Optimizer.step``,
``TrainState.step``, Optax's wrappers') are made around ``init``, out of its
reach. So ``init`` notes what it was given (:func:`watch`), and the first
step traced with that state (:func:`check_first_step`) says so, once, with the
line to add, unless that line ran since: :func:`optax_hybrid.commit` was given
the state (:func:`forget`), or the Flax NNX variables ``init`` read hold
committed arrays now. Said at the first step rather than at ``init`` so that a
loop that already has the line (it comes after ``init``) is not told to add
it.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from typing import Any

import jax
import numpy as np

from optax_hybrid import _compat

#: What to add, by how the loop holds its state: each line runs as written once
#: the optimizer is built (a test adds each one to a loop and counts compiles).
NNX_LINE = "nnx.update((model, optimizer), optax_hybrid.commit(nnx.state((model, optimizer))))"
TRAIN_STATE_LINE = "state = optax_hybrid.commit(state)"
PARAMS_LINE = "params, opt_state = optax_hybrid.commit((params, opt_state))"


@dataclasses.dataclass
class _Seen:
  """What ``init`` was given: Flax NNX variables (read again at the first step) or weak references to arrays."""

  owner: str
  words: str
  variables: list = dataclasses.field(default_factory=list)
  arrays: list = dataclasses.field(default_factory=list)
  loose_numbers: bool = False

  def still_uncommitted(self) -> bool:
    if self.variables:  # NNX: the line replaces the arrays inside the same variables
      return any(_uncommitted(_variable_value(v)) for v in self.variables)
    return self.loose_numbers or any(_uncommitted(r()) for r in self.arrays)


# A plan (the state's static data, hashable) -> what its init saw. Weak: a state that is dropped takes it along.
# Read by the steps: while it is empty (most loops, once their first step is traced) they call nothing here.
PENDING: "weakref.WeakKeyDictionary[Any, _Seen]" = weakref.WeakKeyDictionary()


def _is_variable(x: Any) -> bool:
  """A Flax NNX ``Variable`` (read by duck type: flax is not a dependency)."""
  return type(x).__module__.startswith("flax.nnx") and hasattr(x, "get_value")


def _variable_value(v: Any) -> Any:
  return v.get_value()


def _uncommitted(x: Any) -> bool:
  return isinstance(x, jax.Array) and not isinstance(x, _compat.Tracer) and not x.committed


def moves_memory_kinds(plan: Any) -> bool:
  """Whether a step with this plan moves arrays between memory kinds (its outputs then come back committed)."""
  return any(lp.tier != "device" or lp.state_kind != "device" or lp.param_kind != "device" for lp in plan.leaves)


def watch(params: Any, plan: Any, owner: str, words: str) -> None:
  """Called by ``init``: notes uncommitted params (or Flax NNX ones) of a plan whose steps move memory kinds."""
  if not moves_memory_kinds(plan):
    return
  nodes = jax.tree.leaves(params, is_leaf=_is_variable)
  if any(isinstance(x, (_compat.Tracer, jax.ShapeDtypeStruct)) for x in jax.tree.leaves(params)):
    return  # an abstract init (eval_shape, jit): no loop runs with these
  variables = [v for v in nodes if _is_variable(v)]
  seen = _Seen(owner, words, variables=variables)
  if not variables:
    seen.arrays = [weakref.ref(x) for x in nodes if _uncommitted(x)]
    seen.loose_numbers = any(isinstance(x, (int, float, complex, np.ndarray, np.generic)) for x in nodes)
    if not seen.arrays and not seen.loose_numbers:
      return
  PENDING[plan] = seen


def forget(tree: Any) -> None:
  """Called by :func:`optax_hybrid.commit`: the states in ``tree`` were committed, their first step compiles once."""
  watched = list(PENDING.keys())
  if not watched:
    return

  def is_watched(x: Any) -> bool:  # by identity: this module sits below plan and does not import it
    return any(x is p for p in watched)

  for x in jax.tree.leaves(tree, is_leaf=is_watched):
    if is_watched(x):
      PENDING.pop(x, None)


def check_first_step(plan: Any, count: Any) -> None:
  """Called by every step: the first one traced (its ``count`` a tracer) with a watched plan warns if nothing was
  committed."""
  if not isinstance(count, _compat.Tracer):  # an eager step: no trace of the user's to compile twice
    return
  try:
    seen = PENDING.pop(plan, None)
  except TypeError:  # not a plan (a state made by hand): its own error comes from the step
    return
  if seen is not None and seen.still_uncommitted():
    warnings.warn(message(seen), UserWarning, stacklevel=_user_stacklevel())


def message(seen: _Seen) -> str:
  if seen.variables:
    lines = f"  {NNX_LINE}\n(with an nnx.Optimizer, after making it), or\n  {TRAIN_STATE_LINE}\n(a TrainState)"
  else:
    lines = f"  {PARAMS_LINE}\n(after tx.init), or\n  {TRAIN_STATE_LINE}\n(a Flax TrainState)"
  return (f"{seen.owner}: this jitted step will compile twice. With {seen.words} its state lives outside device "
          "memory, and JAX returns committed arrays from a step that moves arrays between memory kinds; the "
          "params this optimizer was initialized with are uncommitted (as jax.numpy, jax.random and Flax make "
          "them), so the second call sees committed arrays where the first saw uncommitted ones and compiles "
          f"the whole step again. Commit what the step takes once, before its first call:\n{lines}\n"
          "(docs/tiers.md, 'A step that compiles once').")


def _user_stacklevel() -> int:
  """The stack level of the first frame outside optax_hybrid, JAX, Flax and Optax: the line that called the step."""
  frame, level = sys._getframe(2), 2
  while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _LIBRARIES:
    frame, level = frame.f_back, level + 1
  return level


_LIBRARIES = ("optax_hybrid", "jax", "jaxlib", "flax", "optax", "contextlib", "functools")
