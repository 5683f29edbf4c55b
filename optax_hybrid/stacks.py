"""Stacked layers split between two memories: the first rows resident on the device, the rest in host memory.

A stack of ``L`` layers (every array ``(L, ...)``) need not live in one memory.
:func:`split_stack` keeps its first ``k`` layers in device memory and the
other ``L - k`` in host memory (``pinned_host``), as a :class:`SplitStack`
of two such trees. :func:`optax_hybrid.scan_layers` and
:func:`optax_hybrid.step_in_backward` run it as the one stack it stands for
(layer ``i`` of the whole is row ``i`` of ``resident`` or row ``i - k`` of
``streamed``): a resident layer is read where it is, costing no copy; a
streamed one crosses the bus as a stack in host memory does. The optimizer
sees each part as leaves of their own, each placed and stepped where its
tier says, with the numbers of the whole stack (a random master format draws
each element's bits at its row in the whole stack).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_hybrid import _compat, placement


@jax.tree_util.register_pytree_with_keys_class
@dataclasses.dataclass(frozen=True)
class SplitStack:
  """One stack of layers held in two memories: ``resident`` (rows ``0..k-1``) and ``streamed`` (rows ``k..L-1``).

  Attributes:
    resident: a pytree of arrays stacked on axis 0, the first ``k`` layers
      (in device memory).
    streamed: a pytree of the same structure, the other ``L - k`` layers (in
      host memory).

  A pytree whose children are the two parts (key paths ``.resident`` and
  ``.streamed``), so that every Optax and JAX tree function, checkpoints
  and ``tiers`` prefixes (``SplitStack(resident="device",
  streamed="host_state")``) treat them as ordinary subtrees.
  """

  resident: Any
  streamed: Any

  def tree_flatten_with_keys(self):
    return ((jax.tree_util.GetAttrKey("resident"), self.resident),
            (jax.tree_util.GetAttrKey("streamed"), self.streamed)), None

  def tree_flatten(self):
    return (self.resident, self.streamed), None

  @classmethod
  def tree_unflatten(cls, aux: Any, children: Any) -> "SplitStack":
    del aux
    return cls(*children)

  @property
  def resident_layers(self) -> int:
    """``k``: how many layers (the first) are resident."""
    return _length(self.resident)

  @property
  def num_layers(self) -> int:
    """``L``: the layers of the whole stack."""
    return _length(self.resident) + _length(self.streamed)


def _length(tree: Any) -> int:
  leaves = jax.tree.leaves(tree)
  return int(np.shape(leaves[0])[0]) if leaves else 0


def split_stack(layers: Any, resident_layers: int, *, host_memory_kind: str = placement.HOST_KIND) -> SplitStack:
  """``layers`` as a :class:`SplitStack`: the first ``resident_layers`` rows on the device, the rest in host memory.

  Each part keeps the stack's sharding (its mesh and spec; on one device,
  that device) with the memory kind changed. Arrays are copied into place;
  ``jax.ShapeDtypeStruct`` s give ``ShapeDtypeStruct`` s (nothing
  allocated); traced values are sliced and moved inside the trace.

  Args:
    layers: a pytree of arrays stacked on axis 0 (one slice per layer), in
      any memory, or a :class:`SplitStack` (joined first).
    resident_layers: ``k``, from 0 (every layer streamed) to ``L`` (every
      layer resident).
    host_memory_kind: where the streamed rows live.

  Returns:
    The :class:`SplitStack`.

  Raises:
    ValueError: for ``layers`` without arrays or of several leading lengths,
      a ``resident_layers`` outside ``[0, L]``, or an unknown memory kind.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> stack = optax_hybrid.split_stack({"w": jnp.ones((4, 8, 8))}, 3)
    >>> stack.resident["w"].shape, stack.streamed["w"].sharding.memory_kind
    ((3, 8, 8), 'pinned_host')
  """
  if isinstance(layers, SplitStack):
    layers = join_stack(layers)
  lengths = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(layers)}
  if len(lengths) != 1 or None in lengths:
    raise ValueError(f"split_stack: `layers` must be arrays stacked on axis 0 with one leading length (the number "
                     f"of layers); got leading lengths {sorted(lengths, key=str) or 'none (no arrays)'}.")
  length = lengths.pop()
  if isinstance(resident_layers, bool) or not isinstance(resident_layers, (int, np.integer)) \
      or not 0 <= resident_layers <= length:
    raise ValueError(f"split_stack: `resident_layers` must be an integer from 0 to the stack's {length} layers "
                     f"(how many of the first layers stay on the device); got {resident_layers!r}.")
  placement.check_memory_kind(host_memory_kind, argument="host_memory_kind")
  k = int(resident_layers)
  part = lambda rows, kind: jax.tree.map(lambda a: _rows_placed(a, rows, kind), layers)
  return SplitStack(part(slice(0, k), placement.DEVICE_KIND), part(slice(k, length), host_memory_kind))


def _rows_placed(a: Any, rows: slice, kind: str) -> Any:
  """Rows ``rows`` of ``a``, in memory ``kind`` with ``a``'s sharding."""
  shape = (len(range(*rows.indices(np.shape(a)[0]))),) + tuple(np.shape(a)[1:])
  sharding = getattr(a, "sharding", None)
  if isinstance(a, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, a.dtype, sharding=None if sharding is None
                                else _compat.abstract_sharding_in(sharding, kind))
  if isinstance(a, _compat.Tracer):
    return _compat.move(a[rows], placement.space_of_kind(kind))
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.device_put(a[rows] if _compat.memory_space_of(a) != _compat.HOST else np.asarray(a)[rows],
                        sharding.with_memory_kind(kind))


def join_stack(stack: SplitStack, memory_kind: str | None = None) -> Any:
  """The whole stack of a :class:`SplitStack`: each array's two parts concatenated on axis 0.

  In memory ``memory_kind`` (default: the streamed part's, where most of it
  lives), with the streamed part's sharding; on the host when neither part
  is traced (nothing passes through the device).
  """
  def joined(r, s):
    kind = memory_kind or getattr(getattr(s, "sharding", None), "memory_kind", None) or placement.HOST_KIND
    if isinstance(r, _compat.Tracer) or isinstance(s, _compat.Tracer):
      space = placement.space_of_kind(kind)
      return jnp.concatenate([_compat.move(r, space), _compat.move(s, space)])
    value = np.concatenate([np.asarray(jax.device_get(r)), np.asarray(jax.device_get(s))])
    sharding = getattr(s, "sharding", None) or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.device_put(value, sharding.with_memory_kind(kind))

  return jax.tree.map(joined, stack.resident, stack.streamed)


def stack_rows(params: Any) -> dict[str, tuple[str, int, int]]:
  """``{keystr of a leaf in a SplitStack part: (that leaf's keystr in the whole stack, its first row, L)}``.

  What the plan reads so that a part's leaf is stored and stepped as its
  rows of the whole stack: the 8-bit format chosen for the whole leaf, the
  random bits of its rows drawn (``master="stochastic"``).
  """
  out = {}
  nodes = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, SplitStack))[0]
  for path, node in nodes:
    if not isinstance(node, SplitStack):
      continue
    for name, first in (("resident", 0), ("streamed", node.resident_layers)):
      for sub, _ in jax.tree_util.tree_flatten_with_path(getattr(node, name))[0]:
        whole = jax.tree_util.keystr(tuple(path) + tuple(sub))
        out[jax.tree_util.keystr(tuple(path) + (jax.tree_util.GetAttrKey(name),) + tuple(sub))] = (
            whole, first, node.num_layers)
  return out


__all__ = ["SplitStack", "join_stack", "split_stack"]
