"""What every kernel takes and returns, and what the custom kernels share.

A kernel is a function ``update_leaves(leaves, facts, s, step) -> results``:

* ``leaves``: one :class:`LeafOperands` per leaf (arrays; ``param`` is None
  when the step does not read it);
* ``facts``: one :class:`LeafFacts` per leaf (static: known at trace time);
* ``s``: the step's scalars, the rule's ``NamedTuple``
  (:meth:`optax_hybrid.base.UpdateRule.scalars`; traced: a changing learning
  rate or step count never recompiles);
* ``step``: the step-wide :class:`Step` (static): the rule and whether the
  new params are written;

and it returns one :class:`LeafResult` per leaf. A kernel declares the rules
it implements; ``kernels/reference.py`` runs any rule, and the custom kernels
hand it the leaves they cannot take
(:func:`optax_hybrid.kernels.reference.with_reference_for_the_rest`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from optax_hybrid import _compat, masters


class LeafOperands(NamedTuple):
  """One leaf's arrays for a step: the gradient, the rule's state, the param if read, and its master's operand.

  ``state`` holds one value per field of the rule (``(mu, nu)`` for Adam), each
  an array in its storage dtype or an 8-bit
  :class:`~optax_hybrid.kernels.quantized.QuantizedMoment`. With a master
  format (:attr:`Step.master`), ``master`` is what the format gives the kernel
  (:meth:`optax_hybrid.masters.MasterFormat.operand`: what it keeps, a
  seed, or None without one), and ``param`` is None where the format does not read the param (a
  float32 copy stands in for it).
  """

  grad: jax.Array
  state: tuple
  param: jax.Array | None = None
  master: Any = None


class LeafFacts(NamedTuple):
  """What a kernel knows statically about one leaf.

  Attributes:
    decay: does the leaf take weight decay (the mask)?
    out_dtype: dtype of the first result: the update, or the new param when
      ``Step.write_params``.
    row_axes: how many leading axes of the leaf are whole on every device
      (not split over a mesh), at most ``ndim - 1``: a kernel that cuts the
      leaf into slices of rows merges only these into its rows, so a leaf
      split over devices keeps its split (a reshape or a dynamic slice
      across a split axis makes XLA's partitioner gather the leaf whole on
      every device). None: the leaf is whole on this device (one device,
      or one shard under ``shard_map``), every axis but the last.
    shard: ``(shard's shape, whole leaf's shape)`` when the kernel gets one
      shard of a leaf split over devices (under ``shard_map``), else None: a
      random master format then draws its bits at each element's position in
      the whole leaf (:func:`optax_hybrid.masters.positions`), the shard's
      first element's position being in its seed, so a step split over
      devices draws the bits a whole one does.
    moments: the leaf's moment format (:class:`optax_hybrid.moments.MomentFormat`):
      a kernel takes the leaf if the format names it (``kernels``), and the
      reference rule decodes and encodes its fields through it. None: the
      reference reads the fields as the values themselves; a kernel that
      implements a format may still recognise its stored values by type
      (8-bit :class:`~optax_hybrid.kernels.quantized.QuantizedMoment` s).
  """

  decay: bool
  out_dtype: Any
  row_axes: int | None = None
  shard: tuple | None = None
  moments: Any = None


class LeafResult(NamedTuple):
  """One leaf's results: the update (or the new param), the new state in its storage formats, the new master.

  ``master`` is what the master format keeps after the step (None without
  one, or for a format that keeps nothing).
  """

  first: jax.Array
  state: tuple
  master: Any = None


class Step(NamedTuple):
  """Step-wide static choices. Make one with :func:`step_of`.

  Attributes:
    rule: the :class:`optax_hybrid.base.UpdateRule` (its static flags; its
      hyperparameters arrive in the scalars).
    write_params: return the new param ``p + u`` (rounded once) instead of ``u``.
    fields: ``rule.fields``, and ``decay``: ``rule.decay``, read once for all
      the leaves.
    master: the leaves' master format (:class:`optax_hybrid.masters.MasterFormat`).
      An active one (every format but :data:`~optax_hybrid.masters.NO_MASTER`):
      the step reads each leaf's float32 value from its param and master
      operand and writes the new param and master through the format
      (:func:`optax_hybrid.kernels.reference.master_update`); ``write_params``
      is True and each leaf's ``out_dtype`` is its param's dtype.
    packed: the leaves' state is packed (``state_layout="packed"``): each
      value a :class:`~optax_hybrid.kernels.packed.PackedSlice` of a pool,
      which a kernel without pools reads first
      (:func:`~optax_hybrid.kernels.packed.read_operands`).
  """

  rule: Any
  write_params: bool
  fields: tuple
  decay: str | None
  master: Any = masters.NO_MASTER
  packed: bool = False


def step_of(rule: Any, write_params: bool = False, master: Any = masters.NO_MASTER) -> Step:
  """The :class:`Step` of ``rule`` (through an active master format, ``write_params`` is implied)."""
  return Step(rule, write_params or master.active, rule.fields, rule.decay, master)


# Storage dtypes the custom kernels have loops for.
STORAGE_DTYPES = frozenset({np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def pack_scalars(s: Any, names: Sequence[str]) -> jax.Array:
  """The scalars ``names`` of ``s`` and then ``step_ok`` (1.0 / 0.0) as one float32 vector operand."""
  step_ok = jnp.ones([], jnp.float32) if s.step_ok is None else s.step_ok.astype(jnp.float32)
  return jnp.stack([getattr(s, name) for name in names] + [step_ok]).astype(jnp.float32)


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


#: The platforms a step traced now is lowered for: the declared ones (:func:`lowering_for`), else the default
#: backend's (its value read where the JAX versions differ: :mod:`optax_hybrid._compat`).
lowering_platforms = _compat.lowering_platforms


def per_platform(kernels: dict[str, Callable], leaves: Sequence[LeafOperands], facts: Sequence[LeafFacts], s: Any,
                 step: Step) -> list[LeafResult]:
  """``kernels[platform](leaves, facts, s, step)`` for the platform the step is lowered for.

  ``kernels`` maps platform names to kernels (functions of this contract),
  ``"default"`` covering the others. Only the kernels of
  :func:`lowering_platforms` are traced (tracing one, the Pallas kernel's
  say, is not free); one left is called directly, several go through
  ``lax.platform_dependent``, which picks at lowering (the leaves and the
  scalars its operands; the static facts and step closed over). A table of
  one kernel is that kernel on every platform.
  """
  if len(kernels) == 1:
    return kernels["default"](leaves, facts, s, step)
  wanted = {p: kernels.get(p, kernels["default"]) for p in lowering_platforms()}
  distinct = list(dict.fromkeys(wanted.values()))
  if len(distinct) == 1:
    return distinct[0](leaves, facts, s, step)
  # One function per kernel, so that a kernel several platforms run is traced once.
  calls = {k: (lambda leaves, s, k=k: k(leaves, facts, s, step)) for k in [*distinct, kernels["default"]]}
  return jax.lax.platform_dependent(leaves, s, **{p: calls[k] for p, k in wanted.items()},
                                    default=calls[kernels["default"]])
