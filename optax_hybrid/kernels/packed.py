"""One leaf's state array stored in a slice of a flat buffer that many leaves share (``state_layout="packed"``).

The storage format once, as :mod:`quantized` is for 8-bit values: a
:class:`PackedSlice` is one array of one leaf (a field's values, 8-bit codes
or scales), at a static offset in a *pool*, a 1-D array holding that array
for many leaves; :func:`read` gives its values. A kernel that takes pools
(the native CPU kernel) steps its leaves in place inside them and returns
slices of the new pools; every other kernel reads its operands' slices
(:func:`read_operands`) and returns the leaves' new values as arrays, which
:mod:`optax_hybrid.packing` writes back into the pools.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax import lax

from optax_hybrid.kernels.contract import LeafOperands


@jax.tree_util.register_pytree_node_class
class PackedSlice:
  """The array of ``shape`` stored in ``pool[offset:offset + size]``; ``key`` names the pool (static, hashable).

  A pytree whose only child is the pool, so that ``jit``, barriers and
  ``lax.platform_dependent`` carry it as the one array it is.
  """

  __slots__ = ("pool", "key", "offset", "shape")

  def __init__(self, pool: Any, key: Any, offset: int, shape: tuple):
    self.pool, self.key, self.offset, self.shape = pool, key, offset, tuple(shape)

  @property
  def dtype(self) -> Any:
    return self.pool.dtype

  @property
  def size(self) -> int:
    return math.prod(self.shape)

  @property
  def ndim(self) -> int:
    return len(self.shape)

  def tree_flatten(self):
    return (self.pool,), (self.key, self.offset, self.shape)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)

  def __repr__(self) -> str:
    return f"PackedSlice({self.key!r}[{self.offset}:{self.offset + self.size}], shape={self.shape})"


def is_slice(x: Any) -> bool:
  """Whether ``x`` is a :class:`PackedSlice` (``is_leaf`` for tree maps that stop at slices, not their pools)."""
  return isinstance(x, PackedSlice)


def _read_slice(x: Any) -> Any:
  if isinstance(x, PackedSlice):
    return lax.slice(x.pool, (x.offset,), (x.offset + x.size,)).reshape(x.shape)
  return x


def read(x: Any) -> Any:
  """``x``'s values: every :class:`PackedSlice` in it read from its pool (a field's array, or each array of a moment
  format's record: 8-bit codes and scales); anything else as it is."""
  return jax.tree.map(_read_slice, x, is_leaf=is_slice)


def is_packed(x: Any) -> bool:
  """Whether ``x`` (a field's stored value: an array or a moment format's record of arrays) is stored in a pool."""
  return any(isinstance(a, PackedSlice) for a in jax.tree.leaves(x, is_leaf=is_slice))


def read_operands(leaf: LeafOperands) -> LeafOperands:
  """A leaf's operands with every packed array read from its pool: what a kernel without pools takes."""
  return LeafOperands(leaf.grad, tuple(read(x) for x in leaf.state), read(leaf.param), read(leaf.master))


__all__ = ["PackedSlice", "is_packed", "is_slice", "read", "read_operands"]
