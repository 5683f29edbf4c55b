"""The model functions given to :func:`~optax_hybrid.scan_layers` and :func:`~optax_hybrid.step_in_backward`.

One convention for both: a layer function is ``layer_fn(carry, layer, *inputs)
-> carry``, the carry and one layer's params first (as the bodies of
``jax.lax.scan`` and ``nnx.scan`` take them), then the layer's slice of the
per-layer inputs ``xs`` when there are some, then the values every layer gets
(``scan_layers``' ``args``; ``step_in_backward``'s ``rest`` and ``batch``).

What a function returns is checked where it is traced, and a mismatch is an
error that names the function and shows what was expected against what came
back (instead of the loop's "carry input and carry output must have equal
types"). ``step_in_backward`` also refuses a model function that closes over a
value of the params: it would be a constant of the step, never updated.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np


class _Shown:
  """A leaf as a message shows it: ``float32[6,16]``."""

  def __init__(self, text: str):
    self.text = text

  def __repr__(self) -> str:
    return self.text


def type_str(x: Any) -> str:
  """``float32[6,16]`` for an array (or tracer, ``ShapeDtypeStruct``), the type's name for anything else."""
  dtype = getattr(x, "dtype", None)
  if dtype is None and isinstance(x, (int, float, complex, bool)):
    dtype = jnp.result_type(x)
  if dtype is None:
    return type(x).__name__
  return f"{np.dtype(dtype).name}[{','.join(str(d) for d in np.shape(x))}]"


def describe(tree: Any) -> str:
  """``tree`` with each leaf shown as its :func:`type_str`."""
  return repr(jax.tree.map(lambda x: _Shown(type_str(x)), tree))


def _same_type(a: Any, b: Any) -> bool:
  return type_str(a) == type_str(b)


def carry_mismatch(expected: Any, got: Any) -> str | None:
  """What differs between the carry a layer takes and what it returned (None: nothing)."""
  expected_leaves, expected_def = jax.tree.flatten(expected)
  got_leaves, got_def = jax.tree.flatten(got)
  if expected_def != got_def:
    hint = ""
    if isinstance(got, tuple) and len(got) == 2 and jax.tree.structure(got[0]) == expected_def:
      hint = (" It returned a (carry, output) pair, as a jax.lax.scan body does: return the carry alone "
              "(per-layer outputs are not kept).")
    return f"expected {describe(expected)}, got {describe(got)}.{hint}"
  for (path, e), g in zip(jax.tree_util.tree_leaves_with_path(expected), got_leaves):
    if not _same_type(e, g):
      if not path:
        return f"expected {type_str(e)}, got {type_str(g)}."
      return (f"expected {type_str(e)} at carry{jax.tree_util.keystr(path)}, got {type_str(g)} (the whole carry: "
              f"{describe(got)}).")
  return None


def returning_the_carry(owner: str, name: str, fn: Callable, carry: Any) -> Callable:
  """``fn``, checked where it is traced: it must return a carry typed like ``carry`` (the next layer's input).

  Raises (when the result is traced):
    TypeError: naming ``name``, with the expected and the returned types.
  """
  def checked(*args):
    out = fn(*args)
    problem = carry_mismatch(carry, out)
    if problem is not None:
      raise TypeError(f"{owner}: `{name}` must return the carry it takes, typed alike (it is the next layer's "
                      f"input): {problem}")
    return out
  return checked


def check_carry(owner: str, name: str, carry: Any) -> None:
  """Raises a TypeError naming ``name`` unless ``carry`` is a pytree of arrays (what ``embed_fn`` must return)."""
  if not jax.tree.leaves(carry) or any(getattr(x, "dtype", None) is None for x in jax.tree.leaves(carry)):
    raise TypeError(f"{owner}: `{name}` must return the carry, a pytree of arrays (the first layer's input); "
                    f"got {describe(carry)}.")


def check_loss(owner: str, name: str, loss: Any) -> None:
  """Raises a ValueError naming ``name`` unless ``loss`` is a float scalar."""
  leaves = jax.tree.leaves(loss)
  if len(leaves) == 1 and leaves[0] is loss and not np.ndim(loss) and jnp.issubdtype(
      getattr(loss, "dtype", np.int32), jnp.floating):
    return
  hint = ""
  if len(leaves) > 1:
    hint = " It returned several values: auxiliary outputs are not taken, return the loss alone."
  elif np.ndim(leaves[0]) if leaves else False:
    hint = f" Reduce it (a mean over the batch) in `{name}`."
  raise ValueError(f"{owner}: `{name}` must return the loss, a float scalar; expected float32[], got "
                   f"{describe(loss)}.{hint}")


def _positional_arity(signature: inspect.Signature) -> tuple[int, float]:
  """How many positional arguments a function needs at least and takes at most (inf with ``*args``)."""
  positional = [p for p in signature.parameters.values()
                if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
  variadic = any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in signature.parameters.values())
  required = sum(p.default is inspect.Parameter.empty for p in positional)
  return required, float("inf") if variadic else len(positional)


def layer_fn_of_step(owner: str, layer_fn: Callable, per_layer_inputs: bool) -> tuple[Callable, bool]:
  """``step_in_backward``'s ``layer_fn`` as ``(carry, layer, [x,] rest, batch)``, and whether it was old-style.

  The convention before: ``layer_fn(carry, layer, batch)`` and results
  ``(loss, params, opt_state)``. Kept one release with a DeprecationWarning.

  Raises:
    TypeError: for a ``layer_fn`` that takes neither.
  """
  expected = "(carry, layer, x, rest, batch)" if per_layer_inputs else "(carry, layer, rest, batch)"
  try:
    signature = inspect.signature(layer_fn)
  except (TypeError, ValueError):  # a callable without a signature (a C function): taken as given
    return layer_fn, False
  least, most = _positional_arity(signature)
  # Three required arguments: the old spelling (a fourth with a default, `deterministic=False`, is its own).
  if not per_layer_inputs and least == 3 and most != float("inf"):
    warnings.warn(
        f"{owner}: `layer_fn(carry, layer, batch)` and a train step returning `(loss, params, opt_state)` are "
        "deprecated and will be removed in the next release. Write `layer_fn(carry, layer, rest, batch)` (`rest`: "
        "the params without the layers, as `embed_fn` and `head_fn` get them; its values the layers use get "
        "their gradients): the train step then returns `(params, opt_state, loss)`, in the order of its "
        "arguments, as Optax's train steps do.", DeprecationWarning, stacklevel=3)
    return (lambda carry, layer, rest, batch: layer_fn(carry, layer, batch)), True
  if least <= (5 if per_layer_inputs else 4) <= most:
    return layer_fn, False
  raise TypeError(f"{owner}: `layer_fn` must take {expected}; got a function of {signature}. A body written for "
                  "scan_layers' `(carry, layer)`: `lambda carry, layer, rest, batch: body(carry, layer)`.")


def used_inputs(closed_jaxpr: Any, start: int, count: int) -> list[int]:
  """Which flat inputs ``start .. start + count`` of ``closed_jaxpr`` its equations read (0-based in that span)."""
  jaxpr = closed_jaxpr.jaxpr
  read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
  return [j for j, v in enumerate(jaxpr.invars[start:start + count]) if id(v) in read]


def check_no_closed_over_params(owner: str, name: str, closed_jaxpr: Any, params: Any, fix: str) -> None:
  """Raises a ValueError naming ``name`` if ``closed_jaxpr`` closes over a JAX array shaped like a params leaf.

  A model function of ``step_in_backward`` that reads a param from its
  closure (the ``params`` of the first step, say) reads a constant: the step
  neither updates it nor computes its gradient. Matched by shape and dtype
  (inside ``jit`` the params are tracers); a constant that is no param can be
  a NumPy array, which is not matched.
  """
  leaves = {}
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    leaves.setdefault(type_str(leaf), jax.tree_util.keystr(path))
  for const in closed_jaxpr.consts:
    if isinstance(const, jax.Array) and jnp.issubdtype(const.dtype, jnp.inexact) and type_str(const) in leaves:
      raise ValueError(
          f"{owner}: `{name}` closes over a {type_str(const)} array, shaped like params"
          f"{leaves[type_str(const)]}: a value a model function closes over is a constant of the step, never "
          f"updated and without a gradient. {fix} A constant that is not a param: close over a NumPy array.")
