"""Checkpoints across stack placements: a stack saved whole, or split at another row, restored into ``like``'s split.

A :class:`~optax_hybrid.stacks.SplitStack` is saved as its two parts (the
checkpoint's tree has ``resident`` and ``streamed`` under the stack's key).
A ``like`` whose stack is held otherwise (whole in one memory, or split at
another row) is restored by reading the stack as it was saved, into the
memories ``like``'s parts name, and cutting or joining its rows afterwards:
:func:`as_saved` makes the target Orbax reads, and the function it returns
turns what was read into ``like``'s layout, every array placed as ``like``'s.
The same holds wherever the stack appears: the params, and every
params-shaped field of an optimizer state (moments, scales, masters).

This module knows nothing of Orbax: the saved tree is read through two
functions of a key path's names (``saved_node``, ``saved_shape``), as
:mod:`optax_hybrid.checkpoint` gives them.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np

from optax_hybrid import placement
from optax_hybrid.stacks import SplitStack

_PARTS = ("resident", "streamed")


def _children(node: Any) -> tuple[list, Any]:
  """``node``'s children with their key (one level), and its treedef; ``([], None)`` for a leaf or None."""
  if node is None:
    return [], None
  pairs, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
  if jax.tree_util.treedef_is_leaf(treedef):
    return [], None
  return [(path[0], child) for path, child in pairs], treedef


def _rebuild(node: Any, names: tuple, name_of: Callable, visit: Callable) -> Any:
  """``node`` with each subtree replaced by ``visit(names, subtree)`` where it returns one (else descended)."""
  replaced = visit(names, node)
  if replaced is not None:
    return replaced
  children, treedef = _children(node)
  if treedef is None:
    return node
  return treedef.unflatten([_rebuild(child, names + (name_of(key),), name_of, visit) for key, child in children])


def _saved_split(saved_node: Callable, saved_shape: Callable, name_of: Callable, names: tuple,
                 like_part: Any) -> tuple[bool, int | None]:
  """Was the checkpoint's stack at ``names`` saved split, and at which row (its resident part's length; None where
  the parts hold no arrays, as an optimizer state's empty entries)?"""
  node = saved_node(names)
  if not isinstance(node, dict) or not set(_PARTS) <= set(node):
    return False, None
  for path, _ in jax.tree_util.tree_flatten_with_path(like_part, is_leaf=lambda x: x is None)[0]:
    shape = saved_shape(names + ("resident",) + tuple(name_of(k) for k in path))
    if shape is not None:
      return True, shape[0]
  return True, None


def saved_entry(names: tuple, arrays: dict) -> Any:
  """What the checkpoint holds for the array a ``like`` leaf at ``names`` reads, whatever its stack's layout.

  ``arrays`` maps saved names to ``(shape, dtype)``. A leaf of a split
  stack's part reads the whole stack's array if it was saved whole, or
  either part's if it was split at another row; a whole stack's leaf reads
  the parts it was saved split into. None where the checkpoint holds none.
  """
  if names in arrays:
    return arrays[names]
  at_parts = [j for j, name in enumerate(names) if name in _PARTS]
  if at_parts:
    j = at_parts[-1]
    candidates = [names[:j] + names[j + 1:]] + [names[:j] + (part,) + names[j + 1:] for part in _PARTS]
  else:
    candidates = [names[:j] + (part,) + names[j:] for j in range(len(names)) for part in _PARTS]
  return next((arrays[c] for c in candidates if c in arrays), None)


def _described(like: Any, rows: int, other: Any = None) -> Any:
  """``like`` (a stack's part: ``ShapeDtypeStruct`` s, None where nothing is read) with ``rows`` rows, placed as
  it is; where ``like`` reads nothing (an empty part) but ``other`` (the other part) does, placed as that."""
  def one(x, y):
    x = y if x is None else x
    return None if x is None else jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype,
                                                       sharding=getattr(x, "sharding", None))
  other = jax.tree.map(lambda _: None, like, is_leaf=lambda x: x is None) if other is None else other
  return jax.tree.map(one, like, other, is_leaf=lambda x: x is None)


def as_saved(target: Any, saved_node: Callable, saved_shape: Callable, name_of: Callable) -> tuple[Any, Callable]:
  """``(the target in the checkpoint's stack layout, restored -> the same in target's layout)``.

  Args:
    target: what Orbax would read, in ``like``'s layout (``ShapeDtypeStruct``
      s, None where nothing is read).
    saved_node: names -> the saved subtree there (dicts by name), or None.
    saved_shape: names -> the saved array's shape there, or None.
    name_of: a key path entry -> its name in the checkpoint.
  """
  changed = {}

  def visit(names, node):
    if isinstance(node, SplitStack):
      split, k = _saved_split(saved_node, saved_shape, name_of, names, node.resident)
      if split and k in (None, node.resident_layers):
        return None
      changed[names] = ("resplit" if split else "split", node)
      if not split:  # saved whole: read into the streamed part's memory
        return _described(node.streamed, node.num_layers, node.resident)
      return SplitStack(_described(node.resident, k, node.streamed),
                        _described(node.streamed, node.num_layers - k, node.resident))
    if isinstance(node, (jax.ShapeDtypeStruct, jax.Array)) or node is None:
      return None
    split, k = _saved_split(saved_node, saved_shape, name_of, names, node)
    if not split:
      return None
    changed[names] = ("join", node)  # saved split, read whole into like's memory
    length = jax.tree.leaves(node)[0].shape[0] if jax.tree.leaves(node) else 0
    return SplitStack(_described(node, k or 0), _described(node, length - (k or 0)))

  converted = _rebuild(target, (), name_of, visit)
  if not changed:
    return target, lambda restored: restored

  def regroup(names, node):
    how = changed.get(names)
    if how is None:
      return None
    kind, like = how
    whole = _joined(node) if isinstance(node, SplitStack) else node
    if kind == "join":
      return jax.tree.map(lambda v, x: _rows(v, slice(None), x), whole, like, is_leaf=lambda x: x is None)
    k = like.resident_layers
    rows = lambda part, cut: jax.tree.map(lambda v, x: _rows(v, cut, x), whole, part, is_leaf=lambda x: x is None)
    return SplitStack(rows(like.resident, slice(0, k)), rows(like.streamed, slice(k, None)))

  return converted, lambda restored: _rebuild(restored, (), name_of, regroup)


def _joined(stack: SplitStack) -> Any:
  """A restored stack's parts as one host (NumPy) array per leaf (None where nothing was read)."""
  return jax.tree.map(lambda r, s: None if r is None else np.concatenate(
      [np.asarray(jax.device_get(r)), np.asarray(jax.device_get(s))]), stack.resident, stack.streamed,
                      is_leaf=lambda x: x is None)


def _rows(value: Any, rows: slice, like: Any) -> Any:
  """Rows ``rows`` of a restored array, placed as ``like`` (None stays None: an entry read as nothing)."""
  if like is None or value is None:
    return None
  host = np.asarray(jax.device_get(value))[rows]
  return placement.placed_with(host, tuple(like.shape), like.dtype, like.sharding)


__all__ = ["as_saved"]
