"""Parameter paths as names: how param groups, the placement plan and the memory report name a leaf."""

from __future__ import annotations

from typing import Any

import jax


def _key_name(key: Any) -> str:
  if isinstance(key, jax.tree_util.DictKey):
    return str(key.key)
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return str(key.idx)
  if isinstance(key, jax.tree_util.FlattenedIndexKey):
    return str(key.key)
  return str(key)


def path_names(key_path: tuple) -> tuple[str, ...]:
  """The names along a JAX key path, without the ``.value`` step of a Flax NNX Variable.

  ``nnx.state(model)`` flattens a parameter to ``('l1', 'kernel', .value)``
  while ``nnx.Optimizer.update`` hands the transform plain arrays at
  ``('l1', 'kernel')``; dropping the trailing ``.value`` attribute makes both
  name the same parameter.
  """
  keys = list(key_path)
  if keys and isinstance(keys[-1], jax.tree_util.GetAttrKey) and keys[-1].name == "value":
    keys.pop()
  return tuple(_key_name(k) for k in keys)


def path_name(key_path: tuple) -> str:
  """The ``'/'``-joined parameter path that ``param_groups`` patterns are matched against.

  Dict keys, attribute names and sequence indices are joined with ``/``; a
  Flax NNX Variable's ``.value`` step is left out.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from optax_hybrid.paths import path_name
    >>> params = {"encoder": {"layers": [{"kernel": jnp.ones((2, 2))}]}}
    >>> [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
    ['encoder/layers/0/kernel']
  """
  return "/".join(path_names(key_path))


__all__ = ["path_name", "path_names"]
