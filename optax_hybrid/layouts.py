"""Where a state keeps its params-shaped values: a layout is a value the engine asks, made once by ``init``.

Two layouts, one spelling each (``state_layout=``):

* ``"leaves"`` (:data:`LEAVES`, the default): each params-shaped attribute
  of the state (the rule's fields, their formats' other arrays, ``master``)
  is a tree like the params, one array per leaf: the Optax contract.
* ``"packed"`` (:class:`optax_hybrid.packing.Layout`): each attribute is a
  dict of a few flat buffers, each leaf's array a static slice of one.

The engine asks the plan's layout (:attr:`optax_hybrid.plan.Plan.layout`),
never the option: :meth:`LeavesLayout.laid_out` (``init``: the layout of
these params), :meth:`~LeavesLayout.state_fields` (``init``: the state's
attributes from one array per leaf), :meth:`~LeavesLayout.read` (a step: each
leaf's stored values), :meth:`~LeavesLayout.written` (a step: the new
attributes from each leaf's new values), :meth:`~LeavesLayout.params_treedef`,
:attr:`~LeavesLayout.packed` (its values are slices of flat buffers that a
kernel may step in place: :class:`optax_hybrid.kernels.packed.PackedSlice`)
and :attr:`~LeavesLayout.in_parts_why` (why a step in parts, which steps
each leaf's arrays in place, cannot step it).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax

from optax_hybrid import _compat, moments


@dataclasses.dataclass(frozen=True)
class LeavesLayout:
  """One array per param leaf in each params-shaped attribute (``state_layout="leaves"``).

  Attributes:
    name: the ``state_layout=`` name.
    packed: its values are slices of flat buffers that a kernel may step in
      place (:class:`optax_hybrid.kernels.packed.PackedSlice`).
    in_parts_why: why a step in parts (``begin_step``, ``step_in_backward``),
      which steps each leaf's arrays in place, cannot step this layout's
      state; None: it can.
  """

  name: str = "leaves"
  packed: bool = False
  in_parts_why: str | None = None

  def laid_out(self, plan: Any, params: Any, attributes: Sequence[str]) -> "LeavesLayout":
    """The layout of ``params``' state (``attributes``: the state's params-shaped attributes): this one."""
    del plan, params, attributes
    return self

  def state_fields(self, plan: Any, treedef: Any, arrays: dict[str, list]) -> dict[str, Any]:
    """``init``: each attribute of ``arrays`` (one array per leaf, in the params' order) as a params-shaped tree."""
    del plan
    return {name: treedef.unflatten(values) for name, values in arrays.items()}

  def params_treedef(self, state: Any, plan: Any) -> Any:
    """The params' tree structure, as the state shows it."""
    return jax.tree.structure(getattr(state, plan.field_names[0] if plan.fields else "master"))

  def read(self, state: Any, plan: Any, treedef: Any) -> tuple[Any, list[tuple], list]:
    """``(treedef, each leaf's field values as its moment format stores them, each leaf's master entry (None
    where the state keeps no master))``; ``treedef``: the gradients'. A disk leaf's values are its files.

    Raises:
      ValueError: for a state whose trees do not match ``treedef``, or that lacks an array a leaf's moment
        format keeps.
    """
    names = plan.field_names
    try:
      trees = {name + suffix: getattr(state, name + suffix) for name in names for suffix in ("",) + moments.SUFFIXES}
      entries = {key: None if tree is None else treedef.flatten_up_to(tree) for key, tree in trees.items()}
    except (ValueError, TypeError) as e:
      name = names[0]
      raise ValueError(
          f"{plan.owner}: the gradients' tree structure does not match the optimizer state's; gradients: "
          f"{treedef}, state.{name}: {jax.tree.structure(getattr(state, name))}. Pass gradients for the same "
          "params tree the state was initialized with.") from e
    try:
      masters = treedef.flatten_up_to(state.master) if plan.master.keeps else [None] * len(plan.leaves)
    except (ValueError, TypeError) as e:
      raise ValueError(f"{plan.owner}: the state's master weights do not match the gradients' tree structure; "
                       "pass gradients for the params the state was initialized with.") from e
    arrays = []
    for i, lp in enumerate(plan.leaves):
      suffixes = lp.moments.attribute_suffixes
      if lp.on_disk:
        files = dict(lp.files)
        arrays.append([[files[name + suffix] for suffix in suffixes] for name in names])
        continue
      missing = [name + suffix for name in names for suffix in lp.moments.suffixes if entries[name + suffix] is None]
      if missing:
        raise ValueError(f"{plan.owner}: the state keeps {lp.moments.name} values for {lp.path} but has no "
                         f"`state.{missing[0]}` for them; make the state with this optimizer's init.")
      arrays.append([[entries[name + suffix][i] for suffix in suffixes] for name in names])
    return treedef, [lp.moments.stored_fields(a) if lp.moments.encodes else tuple(f[0] for f in a)
                     for lp, a in zip(plan.leaves, arrays)], masters

  def written(self, state: Any, plan: Any, treedef: Any, new: dict[str, list]) -> dict[str, Any]:
    """A step's new params-shaped attributes from each leaf's new arrays (``new``: per attribute, one per leaf).

    Where a leaf keeps nothing (:attr:`optax_hybrid.plan.Plan.empty`), its
    old empty entry passes through, typed with its state's memory space.
    """
    fields = {}
    for name, values in new.items():
      old, empty = getattr(state, name), plan.empty[name]
      if old is not None:
        for i, entry in enumerate(treedef.flatten_up_to(old) if empty else ()):
          if i in empty:
            values[i] = _compat.move(entry, plan.leaves[i].state_space)
        fields[name] = treedef.unflatten(values)
    return fields


#: ``state_layout="leaves"``.
LEAVES = LeavesLayout()

__all__ = ["LEAVES", "LeavesLayout"]
