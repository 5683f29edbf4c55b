"""Flat params: a model's leaves in a few large buffers, with the user's tree as views.

A jitted training step takes and returns one buffer per leaf of the params,
and on a CPU the runtime's cost per buffer (argument checks, donation, a
result array per output: a few microseconds each) dominates a step over many
small leaves: AdamW on 1024 leaves passes 1,024 params in, 1,024 gradients in
and 1,024 params out even with its own state packed
(``state_layout="packed"``). :func:`flatten_params` lays the leaves out once
into a :class:`FlatParams`: a pytree whose children are one flat array per
*group* (leaves of one dtype and placement, and of one key of an optional
``group(path, leaf)``), and whose static layout says where each leaf is.
The model reads its params through :meth:`FlatParams.as_tree`, static slices
and reshapes that cost nothing inside ``jit``; ``jax.grad`` of a loss taken
with respect to the :class:`FlatParams` returns its gradient as a
:class:`FlatParams` too, so that an optimizer (any Optax transformation, or
:func:`optax_hybrid.hybrid_adamw`) steps a few large buffers. This is what
torch FSDP's flat parameters and Apex's flat buffers do.

``stacked=True`` lays out stacked layers (every leaf of leading length
``L``): each group is an ``(L, N)`` array, one row per layer, which
:func:`optax_hybrid.scan_layers` and :func:`optax_hybrid.step_in_backward`
slice row by row; :meth:`FlatParams.as_tree` of one row gives one layer's
tree.

What it gives up (the user's tree of arrays keeps all of it):

* The model calls :meth:`FlatParams.as_tree` (or the loss does, once).
* A checkpoint holds the flat buffers, and restores into a
  :class:`FlatParams` of the same layout (the same tree, grouping and
  leaf order): save ``as_tree()`` to restore into another layout.
* Per-leaf tools see the groups, not the user's leaves:
  ``optax.tree_utils.tree_map_params``, a params-shaped mask (one bool per
  group: :meth:`FlatParams.mask_by_group`, :meth:`FlatParams.mask_from_tree`),
  param groups by path, the memory report, a sharding per leaf (a group is
  placed whole: leaves split over devices are refused).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from optax_hybrid import _compat, flat_buffers
from optax_hybrid.paths import path_name


@dataclasses.dataclass(frozen=True)
class Group:
  """One flat buffer of a :class:`FlatParams`.

  Attributes:
    name: the buffer's key (its tree path, ``"float32"``; with a ``group``
      key, ``"<key>/float32"``; with a host memory kind, ``"float32 pinned_host"``).
    key: what ``group(path, leaf)`` returned for its leaves (None without ``group``).
    dtype: the leaves' dtype name.
    memory_kind: the leaves' host memory kind (``"pinned_host"``); None for
      device memory and for leaves flattened while traced, so that a layout
      made inside ``jit`` equals one made outside.
    size: elements per row (stacked) or in all (not stacked).
  """

  name: str
  key: Hashable
  dtype: str
  memory_kind: str | None
  size: int


@dataclasses.dataclass(frozen=True)
class FlatLayout:
  """The static part of a :class:`FlatParams` (its pytree aux data), made once by :func:`flatten_params`.

  Attributes:
    treedef: the user's tree structure.
    groups: one :class:`Group` per flat buffer, in the children's order.
    slots: one :class:`optax_hybrid.flat_buffers.Slot` per leaf of the user's tree, in its leaf order (its
      buffer: the group's index).
    length: the stacked leading length ``L`` (None: not stacked).
  """

  treedef: Any
  groups: tuple
  slots: tuple
  length: int | None = None


class FlatParams:
  """The user's params as a few flat buffers (pytree children) and their :class:`FlatLayout` (static).

  Made by :func:`flatten_params`. A pytree with keys: its paths are
  ``[group name]``, so ``jax.tree.map``, ``jax.grad``, Optax and this
  library's optimizers see one leaf per group.

  Attributes:
    buffers: the flat arrays, one per group (``(N,)``, or ``(L, N)`` stacked).
    layout: the :class:`FlatLayout`.

  Example:
    >>> import jax.numpy as jnp, optax_hybrid
    >>> flat = optax_hybrid.flatten_params({"w": jnp.ones((2, 3)), "b": jnp.zeros(3)})
    >>> flat["float32"].shape
    (9,)
    >>> flat.as_tree()["w"].shape
    (2, 3)
  """

  __slots__ = ("buffers", "layout")

  def __init__(self, buffers: tuple, layout: FlatLayout):
    self.buffers = tuple(buffers)
    self.layout = layout

  @property
  def groups(self) -> tuple:
    """The :class:`Group` of each buffer, in order."""
    return self.layout.groups

  def __getitem__(self, name: str) -> Any:
    for group, buffer in zip(self.layout.groups, self.buffers):
      if group.name == name:
        return buffer
    raise KeyError(f"FlatParams: no group {name!r}; its groups are {[g.name for g in self.layout.groups]}.")

  def __repr__(self) -> str:
    shown = ", ".join(f"{g.name!r}: {getattr(b, 'shape', b)}" for g, b in zip(self.layout.groups, self.buffers))
    return f"FlatParams({{{shown}}}, {len(self.layout.slots)} leaves)"

  def as_tree(self) -> Any:
    """The user's tree, each leaf a view (a static slice and reshape) of its group's buffer.

    Free inside ``jit`` (XLA fuses the slices into their readers), and
    differentiable: the gradient of a loss of ``flat.as_tree()`` with respect
    to ``flat`` is a :class:`FlatParams`. For stacked params, each buffer may be
    whole (``(L, N)``: leaves of shape ``(L, *shape)``) or one row (``(N,)``,
    as :func:`optax_hybrid.scan_layers` hands a layer: leaves of shape
    ``shape``).

    Returns:
      A tree shaped like the one :func:`flatten_params` took.

    Raises:
      ValueError: for a buffer that is not an array whose last axis is its
        group's size (with one leading axis only when stacked), naming the
        group.

    Example:
      >>> import jax, jax.numpy as jnp, optax_hybrid
      >>> flat = optax_hybrid.flatten_params({"w": jnp.ones((2, 3)), "b": jnp.zeros(3)})
      >>> grads = jax.grad(lambda f: jnp.sum(f.as_tree()["w"] * 2.0))(flat)
      >>> grads.as_tree()["w"].tolist(), grads.as_tree()["b"].tolist()
      ([[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]], [0.0, 0.0, 0.0])
    """
    for group, buffer in zip(self.layout.groups, self.buffers):
      _check_buffer(self.layout, group, buffer)
    return self.layout.treedef.unflatten([flat_buffers.view(self.buffers[s.buffer], s) for s in self.layout.slots])

  def mask_by_group(self, fn: Callable[[Group], bool]) -> "FlatParams":
    """A mask shaped like these params (a :class:`FlatParams` of bools): ``fn(group)`` for each group.

    For the options that take a params-shaped mask (``weight_decay_mask``,
    ``mask``, ``optax.masked``): build the params with a ``group`` key that
    tells the masked leaves apart, then map it here.

    Args:
      fn: ``Group -> bool`` (read ``group.key``, what ``group(path, leaf)``
        returned for its leaves).

    Returns:
      A :class:`FlatParams` with one bool per group.

    Example:
      >>> import jax.numpy as jnp, optax_hybrid
      >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
      >>> flat = optax_hybrid.flatten_params(params, group=lambda path, leaf: leaf.ndim > 1)
      >>> [g.name for g in flat.groups], flat.mask_by_group(lambda g: g.key).buffers
      (['False/float32', 'True/float32'], (False, True))
    """
    return FlatParams(tuple(bool(fn(g)) for g in self.layout.groups), self.layout)

  def mask_from_tree(self, mask: Any) -> "FlatParams":
    """The group mask of a mask shaped like the user's tree, where every group's leaves agree.

    Args:
      mask: a tree of bools shaped like the tree :func:`flatten_params`
        took, or a function of that tree returning one (Optax's convention).

    Returns:
      A :class:`FlatParams` with one bool per group.

    Raises:
      ValueError: for a mask not shaped like the user's tree, or a group
        holding masked and unmasked leaves (flatten with a ``group`` key that
        tells them apart).

    Example:
      >>> import jax.numpy as jnp, optax_hybrid
      >>> params = {"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}
      >>> decay = {"w": True, "b": False}
      >>> flat = optax_hybrid.flatten_params(params, group=lambda path, leaf: decay[path])
      >>> flat.mask_from_tree(decay).buffers
      (False, True)
    """
    tree = mask(self.as_tree()) if callable(mask) else mask
    try:
      values = self.layout.treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as e:
      raise ValueError(f"FlatParams.mask_from_tree: `mask` must be a tree of bools shaped like the params' tree "
                       f"({self.layout.treedef}); got {jax.tree.structure(tree)}.") from e
    return FlatParams(tuple(_agreed(self.layout, i, values) for i in range(len(self.layout.groups))), self.layout)


def _agreed(layout: FlatLayout, group: int, values: list) -> bool:
  """The one mask value of ``group``'s leaves; raises naming two leaves that disagree."""
  own = [(s.path, bool(v)) for s, v in zip(layout.slots, values) if s.buffer == group]
  if len({v for _, v in own}) > 1:
    yes = next(p for p, v in own if v)
    no = next(p for p, v in own if not v)
    raise ValueError(f"FlatParams.mask_from_tree: group {layout.groups[group].name!r} holds masked and unmasked "
                     f"leaves ({yes!r} True, {no!r} False), and a mask holds one bool per group. Flatten with a "
                     "`group` key that tells them apart, e.g. flatten_params(params, group=lambda path, leaf: "
                     "<the mask's value at path>).")
  return own[0][1]


def _check_buffer(layout: FlatLayout, group: Group, buffer: Any) -> None:
  shape = getattr(buffer, "shape", None)
  ranks = (1, 2) if layout.length is not None else (1,)
  if shape is None or len(shape) not in ranks or shape[-1] != group.size:
    want = f"(N,) or (L, N) with N = {group.size}" if layout.length is not None else f"({group.size},)"
    got = f"shape {tuple(shape)}" if shape is not None else f"a {type(buffer).__name__}"
    raise ValueError(f"FlatParams.as_tree: group {group.name!r} must hold an array of shape {want}; got {got}. "
                     "Its buffers are made by flatten_params; a transformation that changes their shape (or a "
                     "mask of bools) has no tree of views.")


def _flatten(flat: FlatParams) -> tuple:
  return flat.buffers, flat.layout


def _flatten_with_keys(flat: FlatParams) -> tuple:
  return tuple((jax.tree_util.DictKey(g.name), b) for g, b in zip(flat.layout.groups, flat.buffers)), flat.layout


def _unflatten(layout: FlatLayout, buffers: Any) -> FlatParams:
  return FlatParams(tuple(buffers), layout)


jax.tree_util.register_pytree_with_keys(FlatParams, _flatten_with_keys, _unflatten, _flatten)


def flatten_params(params: Any, *, group: Callable[[str, Any], Hashable] | None = None,
                   stacked: bool = False) -> FlatParams:
  r"""Lays the leaves of ``params`` out in a few flat buffers: a :class:`FlatParams`.

  Leaves are grouped by dtype and placement (memory kind and devices), and by
  ``group(path, leaf)`` when given; each group's leaves are raveled and
  concatenated in the tree's leaf order, into one array placed where its
  leaves were. With ``stacked=True``, every leaf has the same leading length
  :math:`L` (stacked layers) and each group is an :math:`(L, N)` array whose
  row :math:`i` holds layer :math:`i` of each of its leaves. The inverse is
  :meth:`FlatParams.as_tree` (exact: the values are copied, not converted).

  Args:
    params: a pytree of arrays (JAX or NumPy; traced values too, inside
      ``jit``).
    group: ``(path, leaf) -> hashable key``, where ``path`` is the leaf's
      ``'/'``-joined path (``"layers/0/kernel"``): leaves of different keys go
      to different buffers (e.g. decayed or not, for a weight decay mask per
      group). None: by dtype and placement only.
    stacked: lay out stacked layers, one row per layer (for
      :func:`optax_hybrid.scan_layers` and :func:`optax_hybrid.step_in_backward`).

  Returns:
    A :class:`FlatParams`.

  Raises:
    ValueError: for a tree without leaves, a leaf split over several devices,
      or, with ``stacked=True``, a leaf without a leading axis or leaves of
      different leading lengths, naming the leaves.
    TypeError: for a leaf that is not an array, or a ``group`` key that is
      not hashable, naming the leaf.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> layers = {"w": jnp.ones((4, 8, 8)), "b": jnp.zeros((4, 8))}
    >>> flat = optax_hybrid.flatten_params(layers, stacked=True)
    >>> flat["float32"].shape
    (4, 72)
    >>> one_layer = jax.tree.map(lambda a: a[0], flat)
    >>> one_layer.as_tree()["w"].shape
    (8, 8)
  """
  with_paths, treedef = jax.tree_util.tree_flatten_with_path(params)
  if not with_paths:
    raise ValueError("flatten_params: `params` has no leaves; pass a tree of arrays (the model's params).")
  names = [path_name(p) for p, _ in with_paths]
  leaves = [_as_array(name, x) for name, (_, x) in zip(names, with_paths)]
  length = _stacked_length(names, leaves) if stacked else None
  keys = [_group_key(group, name, x) for name, x in zip(names, leaves)]
  order = list(dict.fromkeys(keys))
  members = [[i for i, k in enumerate(keys) if k == key] for key in order]
  index = {key: g for g, key in enumerate(order)}
  slots, sizes = flat_buffers.lay_out(names, [index[k] for k in keys],
                                      [x.shape[1:] if stacked else x.shape for x in leaves])
  groups = _named_groups(order, [sizes[g] for g in range(len(order))], group is not None)
  buffers = tuple(_concatenate([leaves[i] for i in indices], length) for indices in members)
  return FlatParams(buffers, FlatLayout(treedef, groups, slots, length))


def _as_array(name: str, leaf: Any) -> Any:
  if isinstance(leaf, jax.Array):  # tracers too; a jax.ShapeDtypeStruct is not one
    return leaf
  if isinstance(leaf, (np.ndarray, np.generic)):
    return jnp.asarray(leaf)
  raise TypeError(f"flatten_params: leaf {name!r} is a {type(leaf).__name__}, not an array: flat params hold "
                  "arrays. Convert it (jnp.asarray) or keep it out of the tree; for shapes only, call "
                  "jax.eval_shape(flatten_params, params).")


def _stacked_length(names: list, leaves: list) -> int:
  """The leading length every leaf shares; raises naming the leaves that differ."""
  for name, x in zip(names, leaves):
    if x.ndim == 0:
      raise ValueError(f"flatten_params: with stacked=True every leaf must be stacked on axis 0 (one row per "
                       f"layer); leaf {name!r} is a scalar. Flatten the stacked layers apart from the rest.")
  first = {}
  for name, x in zip(names, leaves):
    first.setdefault(x.shape[0], name)
  if len(first) > 1:
    shown = ", ".join(f"{n!r} has {length}" for length, n in first.items())
    raise ValueError(f"flatten_params: with stacked=True every leaf must have the same leading length (the "
                     f"number of layers); {shown}. Flatten the stacked layers apart from the rest.")
  return next(iter(first))


def _group_key(group: Callable | None, name: str, leaf: Any) -> tuple:
  """(user key, dtype, host memory kind or None, device ids or None when traced) of one leaf: its group."""
  key = None if group is None else group(name, leaf)
  try:
    hash(key)
  except TypeError as e:
    raise TypeError(f"flatten_params: `group` must return a hashable key (a bool, str, int or tuple); got a "
                    f"{type(key).__name__} for leaf {name!r}.") from e
  memory_kind, devices = None, None
  if not isinstance(leaf, _compat.Tracer):
    sharding = leaf.sharding
    if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
      raise ValueError(f"flatten_params: leaf {name!r} is split over {len(sharding.device_set)} devices; a flat "
                       "buffer is placed whole. Keep sharded leaves out of the flat params (flatten a subtree) "
                       "or gather them first.")
    memory_kind = sharding.memory_kind if _compat.is_host_kind(sharding.memory_kind) else None
    devices = tuple(sorted(d.id for d in sharding.device_set))
  return key, jnp.dtype(leaf.dtype).name, memory_kind, devices


def _named_groups(order: list, sizes: list, keyed: bool) -> tuple:
  """One :class:`Group` per key, named by its user key, dtype and (a host) memory kind, the names unique."""
  groups, taken = [], set()
  for (key, dtype, memory_kind, _), size in zip(order, sizes):
    name = (f"{key}/" if keyed else "") + dtype + ("" if memory_kind is None else f" {memory_kind}")
    unique, n = name, 1
    while unique in taken:
      n += 1
      unique = f"{name} ({n})"
    taken.add(unique)
    groups.append(Group(unique, key, dtype, memory_kind, size))
  return tuple(groups)


def _placed_like(leaf: Any) -> Any:
  """A sharding for a buffer of ``leaf``'s group: its device (or devices, replicated) and memory kind."""
  sharding = leaf.sharding
  devices = sorted(sharding.device_set, key=lambda d: d.id)
  if len(devices) == 1:
    return jax.sharding.SingleDeviceSharding(devices[0], memory_kind=sharding.memory_kind)
  mesh = sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else jax.sharding.Mesh(
      np.array(devices), ("devices",))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=sharding.memory_kind)


def _concatenate(leaves: list, length: int | None) -> Any:
  """The leaves raveled (each row, when stacked) and concatenated, placed where the first one is.

  Never weakly typed (``jnp.full(shape, 0.5)`` is): a step's results are not, and a
  jitted loop fed them back would compile a second program.
  """
  shape, dtype = ((-1,) if length is None else (length, -1)), leaves[0].dtype
  if any(isinstance(x, _compat.Tracer) for x in leaves):
    return jnp.concatenate([jnp.reshape(x, shape) for x in leaves], axis=-1).astype(dtype)
  if not _compat.is_host_kind(leaves[0].sharding.memory_kind):
    flat = jnp.concatenate([jnp.reshape(x, shape) for x in leaves], axis=-1).astype(dtype)
  else:  # host memory: put together on the host, not through the device
    flat = np.concatenate([np.asarray(x).reshape(shape) for x in leaves], axis=-1)
  return jax.device_put(flat, _placed_like(leaves[0]))
