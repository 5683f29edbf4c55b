"""Layers streamed from host memory: :func:`scan_layers`, a ``jax.lax.scan`` over stacked layers whose gradient stays where the layers live.

A model whose layers are stacked on a leading axis (one array per weight kind,
``(L, ...)``) and run by ``jax.lax.scan`` over a ``jax.checkpoint`` ed layer
can keep those arrays in host memory (``pinned_host``). Differentiated by JAX,
such a scan brings each layer to the device but accumulates the stacked
gradient in device memory: 2 bytes per bf16 weight on the device, growing
with depth (measured on the H200 target: docs/records/streaming_programs.md).
:func:`scan_layers` computes the same values and gradients with a backward
pass of its own (``jax.custom_vjp``): the forward loop brings layer ``i`` to
the device, saves the carry and runs the layer; the backward loop brings layer
``i`` in again, recomputes it from its saved carry, takes its VJP and writes
the layer's gradient into a buffer in the layers' memory, slice by slice. The
device then holds, of the stack, one or two layers at a time and the saved
carries (which can go to host memory too: ``offload_carries``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from optax_hybrid import _compat, placement, stacks, user_fns
from optax_hybrid._compat import DEVICE, HOST

__all__ = ["scan_layers", "step_in_backward"]


def scan_layers(layer_fn: Callable[..., Any], carry: Any, layers: Any, xs: Any = None, *, args: tuple = (),
                offload_carries: bool = False) -> Any:
  r"""Runs ``layer_fn`` over stacked layers, one layer on the device at a time; returns the final carry.

  Equal in value and gradients to::

    jax.lax.scan(jax.checkpoint(lambda c, a: (layer_fn(c, *a, *args), None)), carry, (layers,) or (layers, xs))[0]

  Each array of ``layers`` (and of ``xs``) is stacked on axis 0, one slice
  per layer, and may live in any memory kind. For a leaf in host memory
  (``pinned_host``), layer :math:`i`'s slice is copied to the device for its
  forward and again for its backward (the copy of layer :math:`i \pm 1`
  starts while layer :math:`i` computes), and its gradient is produced in host
  memory, written slice by slice inside the backward loop, so nothing of the
  stack stays on the device. The gradient with respect to ``carry`` (and to
  values ``layer_fn`` closes over) is an ordinary device value.

  The memory kind of each leaf is read off its type under ``jit``: arrays
  placed in ``pinned_host`` are host values. So are ``jax.ShapeDtypeStruct`` s
  whose sharding is a ``NamedSharding`` with ``memory_kind="pinned_host"``; in
  JAX 0.10 a ``SingleDeviceSharding`` one is traced as a device value (place
  abstract inputs on a one-device mesh to compile what real arrays compile).

  Args:
    layer_fn: ``(carry, layer, *args) -> carry``, or ``(carry, layer, x,
      *args) -> carry`` when ``xs`` is given (the convention of
      :func:`step_in_backward`, whose ``args`` are ``(rest, batch)``);
      ``layer`` is one slice of ``layers`` on the device. It may close over
      arrays (positions, a mask, shared weights): they are hoisted out
      (``jax.closure_convert``) and get their gradients.
    carry: the initial carry, a pytree of device arrays.
    layers: a pytree of arrays stacked on axis 0 (the layers' params, e.g.
      the ``nnx.State`` of Flax NNX layers made with ``nnx.vmap``; any
      mapping or pytree).
    xs: per-layer inputs that are not params (a per-layer RNG key, a mask),
      stacked on axis 0; None for none. Their float leaves get gradients.
    args: values every layer gets after its own inputs (shared weights, the
      batch), as closed-over values are; their float leaves get gradients
      (summed over the layers).
    offload_carries: keep the carries saved for the backward pass in host
      memory too (activation offload): the device then holds no term that
      grows with depth.

  Returns:
    The carry after the last layer.

  Raises:
    ValueError: for ``layers`` (or ``xs``) without leaves, or whose leaves
      do not share one leading length.
    TypeError: when ``layer_fn`` returns something other than a carry typed
      like ``carry`` (its structure, shapes and dtypes), naming it.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> layers = {"w": jnp.stack([jnp.eye(4) * (i + 1) for i in range(3)])}
    >>> x = jnp.ones((2, 4))
    >>> y = optax_hybrid.scan_layers(lambda c, p: jnp.tanh(c @ p["w"]), x, layers)
    >>> y.shape
    (2, 4)
    >>> g = jax.grad(lambda l: optax_hybrid.scan_layers(lambda c, p: jnp.tanh(c @ p["w"]), x, l).sum())(layers)
    >>> g["w"].shape
    (3, 4, 4)
  """
  parts, lengths, _ = _parts(layers, "scan_layers")
  length = sum(lengths)
  if xs is not None and _length(xs, "xs") != length:
    raise ValueError(f"scan_layers: `xs` must be stacked like `layers` (leading length {length}); "
                     f"got {_length(xs, 'xs')}.")
  one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), tree)
  example = (carry, one(parts[0])) if xs is None else (carry, one(parts[0]), one(xs))
  checked = user_fns.returning_the_carry("scan_layers", "layer_fn", layer_fn, carry)
  closed, consts = jax.closure_convert(lambda *inputs: checked(*inputs, *args), *example)
  step = (lambda c, p, x, k: closed(c, p, *k)) if xs is None else (lambda c, p, x, k: closed(c, p, x, *k))
  run = _streamed(step, lengths, offload_carries)
  if not isinstance(layers, stacks.SplitStack):
    return run(carry, (layers,), (xs,), tuple(consts))
  return run(carry, parts, _rows_per_part(xs, lengths), tuple(consts))


class _Parts(NamedTuple):
  """The one or two stacks that stacked layers hold, run one after the other as one stack.

  A stack in one memory is one part (``names`` ``(None,)``); a
  :class:`~optax_hybrid.stacks.SplitStack` is its ``resident`` and
  ``streamed`` parts, an empty one left out.
  """

  stacks: tuple
  lengths: tuple
  names: tuple


def _parts(layers: Any, owner: str) -> _Parts:
  if not isinstance(layers, stacks.SplitStack):
    return _Parts((layers,), (_length(layers, "layers", owner),), (None,))
  parts = [(name, getattr(layers, name)) for name in ("resident", "streamed")]
  if jax.tree.structure(parts[0][1]) != jax.tree.structure(parts[1][1]):
    raise ValueError(f"{owner}: a SplitStack's `resident` and `streamed` parts must hold the same arrays (one "
                     "tree structure); make it with optax_hybrid.split_stack.")
  kept = [(name, part, _length(part, "layers", owner, empty=True)) for name, part in parts]
  kept = [k for k in kept if k[2]]
  if not kept:
    raise ValueError(f"{owner}: the SplitStack `layers` holds no layers; pass at least one.")
  return _Parts(*map(tuple, zip(*[(part, n, name) for name, part, n in kept])))


def _rows_per_part(tree: Any, lengths: Sequence[int]) -> tuple:
  """``tree`` (stacked on axis 0, or None) cut into consecutive rows of ``lengths``."""
  if tree is None:
    return (None,) * len(lengths)
  starts = np.cumsum([0, *lengths])
  return tuple(jax.tree.map(lambda a, a0=a0, n=n: a[a0:a0 + n], tree) for a0, n in zip(starts, lengths))


def _length(tree: Any, name: str, owner: str = "scan_layers", empty: bool = False) -> int:
  lengths = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(tree)}
  if not lengths and empty:
    return 0
  if not lengths:
    raise ValueError(f"{owner}: `{name}` has no arrays; pass the layers' params stacked on axis 0.")
  if len(lengths) != 1 or None in lengths:
    raise ValueError(f"{owner}: every array of `{name}` must be stacked on axis 0 with one length (the number "
                     f"of layers); got leading lengths {sorted(lengths, key=str)}.")
  return lengths.pop()


# Slices are cut and written where the stack lives and only moved across
# (a slice of a host array, copied to the device, is one transfer for XLA);
# reshapes happen on the device side.

def _may_be_split(tree: Any) -> bool:
  """Can the traced stack ``tree`` be split over a mesh? Yes where an array's type says it is on several devices.

  What XLA's partitioner cannot split (a layout constraint, ``lax.empty``,
  both custom calls) it gives a whole operand on every device, so the
  loops leave them out there (:func:`optax_hybrid.placement.sharding_of`).
  """
  return any(placement.sharding_of(a) is not None for a in jax.tree.leaves(tree))


def _slice(tree: Any, i: Any) -> Any:
  """Slice ``i`` of each stacked array of ``tree``, on the device, row-major.

  Row-major, so that a layer's use of it (a matmul reading it transposed)
  never makes layout assignment transpose the whole stack instead (which kept
  a second copy of the saved carries).
  Not for a stack on several devices (:func:`_may_be_split`): it may be split
  over a mesh in ways the trace cannot see, and XLA's partitioner gives a layout constraint
  (a custom call) a whole operand: each GPU gathered each layer once more
  per pass and sliced its share back (an H200 node, width 512: 5.2 layers
  gathered per layer against 2.0 without it).
  """
  constrain = (lambda x: x) if _may_be_split(tree) else _compat.row_major
  return jax.tree.map(lambda a: constrain(_compat.move(lax.dynamic_slice_in_dim(a, i, 1), DEVICE)[0]), tree)


def _put(buffer: Any, values: Any, i: Any) -> Any:
  """``buffer`` with slice ``i`` replaced by ``values``, moved to the buffer's memory first."""
  return jax.tree.map(lambda b, v: lax.dynamic_update_slice_in_dim(
      b, _compat.move(v[None], _compat.memory_space_of(b)), i, 0), buffer, values)


def _buffer_like_stack(tree: Any) -> Any:
  """A buffer shaped like each array of ``tree``, in that array's memory; every slice is written.

  For a stack on one device, uninitialized (``lax.empty``: XLA:GPU
  allocates it where it lives): zeros for a host buffer are made on the
  device and copied over the bus each step. For a stack on several devices
  (:func:`_may_be_split`) it may be split in ways the trace cannot see, and
  ``lax.empty`` (a custom call XLA's partitioner cannot split) kept a whole
  gradient on every device (more device memory and bus traffic per layer
  than zeros, which the partitioner splits like the gradient slices written
  into them).
  """
  def buffer(a):
    typed = _compat.explicit_sharding(a)  # on Explicit mesh axes, zeros of the stack's type
    if typed is None and not split:
      return _compat.move(lax.empty(a.shape, a.dtype), _compat.memory_space_of(a))
    return _compat.move(jnp.zeros(a.shape, a.dtype, out_sharding=typed), _compat.memory_space_of(a))

  split = _may_be_split(tree)
  return jax.tree.map(buffer, tree)


def _saved_buffer(carry: Any, length: int, offload: bool) -> Any:
  """Room for ``length`` carries (every slice is written): on the device, or in host memory.

  On the device, zeros: XLA's partitioner splits them like the carries
  written into them (a carry split over the batch on a mesh), where an
  uninitialized buffer (``lax.empty``, a custom call it cannot split) or a
  layout constraint on it was kept whole on every device: the device grew
  by the whole batch's carry per layer instead of its share.
  In host memory, uninitialized: zeros would be made on the device and
  copied, a device temporary as large as the stack.
  """
  def buffer(c):
    shape, typed = (length,) + np.shape(c), _compat.explicit_sharding(c, lead=1)  # on Explicit mesh axes, typed
    if offload and typed is None:
      return _compat.move(_compat.row_major(lax.empty(shape, c.dtype)), HOST)
    return _compat.move(jnp.zeros(shape, c.dtype, out_sharding=typed), HOST if offload else DEVICE)

  return jax.tree.map(buffer, carry)


def _inexact(leaves: list) -> list[int]:
  """Indices of the leaves that take gradients (floating point)."""
  return [j for j, a in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.inexact)]


def _cotangents(leaves: list, treedef: Any, computed: list, indices: list[int]) -> Any:
  """The tree of cotangents: ``computed`` at ``indices``, float0 zeros for the other (integer, key) leaves."""
  out = [np.zeros(np.shape(a), jax.dtypes.float0) for a in leaves]
  for j, value in zip(indices, computed):
    out[j] = value
  return treedef.unflatten(out)


def _forward_loop(step: Callable, length: int, carry: Any, layers: Any, xs: Any, consts: Any, saved: Any
                  ) -> tuple[Any, Any]:
  """Runs ``step`` over the layers; returns the final carry and ``saved`` with each layer's input carry written."""
  # The loop carries layer i's device copy and fetches layer i + 1 beside
  # layer i's arithmetic, so the copy overlaps the compute (the last trip
  # fetches layer L - 1 again rather than branch).
  def body(i, loop):
    c, p, saved = loop
    following = _slice(layers, jnp.minimum(i + 1, length - 1))
    if saved is not None:
      saved = _put(saved, c, i)
    return step(c, p, _slice(xs, i), consts), following, saved
  carry, _, saved = lax.fori_loop(0, length, body, (carry, _slice(layers, 0), saved))
  return carry, saved


def _backward_loop(step: Callable, length: int, saved: Any, xs: Any, consts: Any, g: Any, stack_of: Callable,
                   use_gradient: Callable, sink: Any, x_diff: list[int] | None, k_diff: list[int],
                   g_consts: list | None = None, writes_stack: bool = False) -> tuple:
  """Goes back through the layers from the last: each layer's VJP from its saved carry, its gradient to ``use_gradient``.

  Trip ``i`` fetches layer ``i - 1`` from ``stack_of(sink)`` beside layer
  ``i``'s arithmetic (rows a sink writes in place are not read again), takes
  the VJP of ``step(carry, layer, x, consts)``, and hands the layer's
  gradient on: ``sink = use_gradient(sink, g_layer, layer, i)`` (written into
  a buffer, or the layer stepped at once). ``x_diff``: the leaves of ``xs``
  whose gradients are kept, per layer (None: ``xs`` is not differentiated);
  ``k_diff``: the leaves of ``consts`` whose gradients are summed. Returns the
  carry's cotangent at the first layer's input, the sink, the gradients of
  ``xs``' leaves ``x_diff`` (stacked) and of ``consts``' leaves ``k_diff``
  (added to ``g_consts`` when given: the sums of the layers after these, so
  that a stack in two parts adds in the order one stack does).
  ``writes_stack``: ``use_gradient`` writes its rows into the stack the
  trips read from (:func:`_after_reading` orders the two).
  """
  x_leaves, k_leaves = jax.tree.leaves(xs), jax.tree.leaves(consts)

  def body(t, loop):
    i = length - 1 - t
    g, p, sink, g_xs, g_consts = loop
    stack = stack_of(sink)
    preceding = _slice(stack, jnp.maximum(i - 1, 0))  # fetched beside layer i's arithmetic
    if x_diff is None:
      x = _slice(xs, i)
      _, vjp = jax.vjp(lambda c, p, k: step(c, p, x, k), _slice(saved, i), p, consts)
      g, g_p, g_k = vjp(g)
    else:
      _, vjp = jax.vjp(step, _slice(saved, i), p, _slice(xs, i), consts)
      g, g_p, g_x, g_k = vjp(g)
      g_x = jax.tree.leaves(g_x)
      g_xs = [lax.dynamic_update_index_in_dim(buf, g_x[j], i, 0) for buf, j in zip(g_xs, x_diff)]
    g_k = jax.tree.leaves(g_k)
    g_consts = [acc + g_k[j] for acc, j in zip(g_consts, k_diff)]
    if writes_stack:
      g_p = _after_reading(preceding, stack, g_p)
    return g, preceding, use_gradient(sink, g_p, p, i), g_xs, g_consts

  if g_consts is None:
    g_consts = [jnp.zeros_like(k_leaves[j]) for j in k_diff]
  start = (g, _slice(stack_of(sink), length - 1), sink, [jnp.zeros_like(x_leaves[j]) for j in x_diff or ()],
           list(g_consts))
  g, _, sink, g_xs, g_consts = lax.fori_loop(0, length, body, start)
  return g, sink, g_xs, g_consts


def _after_reading(rows: Any, stack: Any, value: Any) -> Any:
  """``value``, made to depend on ``rows`` wherever they were sliced from a stack in device memory.

  A trip reads the next layer's rows from a stack and writes this layer's
  stepped rows into the same stack. Unless the write depends on the read,
  XLA cannot order them and copies the whole device-resident stack on every
  trip before writing into it (on the H200 target: each leaf stepped in one
  pass copied its whole stack, per layer, so a step grew with the square of
  the depth). Rows fetched from host memory are device copies already: they
  are left unordered, so their transfers keep their schedule.
  """
  resident = [r for r, s in zip(jax.tree.leaves(rows), jax.tree.leaves(stack)) if _compat.memory_space_of(s) == DEVICE]
  if not resident:
    return value
  return lax.optimization_barrier((resident, value))[1]


def _streamed(step: Callable, lengths: tuple[int, ...], offload: bool) -> Callable:
  """The custom-VJP scan of ``step(carry, layer, x, consts)`` over consecutive stacks of ``lengths`` layers.

  ``run(carry, parts, xs_parts, consts)``: one stack per part (a stack in
  one memory, or a split stack's two), run as one stack: forward part after
  part, backward from the last, the gradients of ``consts`` summed across
  parts in the order one stack sums them.
  """

  @jax.custom_vjp
  def run(carry, parts, xs_parts, consts):
    for n, part, xs in zip(lengths, parts, xs_parts):
      carry = _forward_loop(step, n, carry, part, xs, consts, None)[0]
    return carry

  def run_forward(carry, parts, xs_parts, consts):
    saved = []
    for n, part, xs in zip(lengths, parts, xs_parts):
      carry, kept = _forward_loop(step, n, carry, part, xs, consts, _saved_buffer(carry, n, offload))
      saved.append(kept)
    return carry, (tuple(saved), parts, xs_parts, consts)

  def run_backward(residuals, g_carry):
    saved, parts, xs_parts, consts = residuals
    k_leaves, k_def = jax.tree.flatten(consts)
    k_diff = _inexact(k_leaves)
    write = lambda g_layers, g_p, p, i: _put(g_layers, g_p, i)
    g, g_consts, g_parts, g_xs_parts = g_carry, None, [None] * len(parts), [None] * len(parts)
    for j in reversed(range(len(parts))):
      x_leaves, x_def = jax.tree.flatten(xs_parts[j])
      x_diff = _inexact(x_leaves)
      g, g_parts[j], g_xs, g_consts = _backward_loop(
          step, lengths[j], saved[j], xs_parts[j], consts, g, lambda _, j=j: parts[j], write,
          _buffer_like_stack(parts[j]), x_diff, k_diff, g_consts)
      g_xs_parts[j] = None if xs_parts[j] is None else _cotangents(x_leaves, x_def, g_xs, x_diff)
    return g, tuple(g_parts), tuple(g_xs_parts), _cotangents(k_leaves, k_def, g_consts, k_diff)

  run.defvjp(run_forward, run_backward)
  return run


def step_in_backward(tx: Any, embed_fn: Callable[[Any, Any], Any], layer_fn: Callable[..., Any],
                     head_fn: Callable[[Any, Any, Any], Any], *, layers: str = "layers", xs: Callable | None = None,
                     offload_carries: bool = False) -> Callable[[Any, Any, Any], tuple[Any, Any, Any]]:
  r"""A train step whose optimizer steps each layer inside the backward pass: no gradient of the layers is kept.

  ``params[layers]`` holds layers stacked on axis 0 (as for
  :func:`scan_layers`, in any memory kind) and the other entries of
  ``params`` (a dict, a Flax ``FrozenDict``, an ``nnx.State`` or any mapping)
  are the rest of the model. The step runs the model as::

    carry = embed_fn(rest, batch)                      # rest: params without `layers`
    carry = layer_fn(carry, layer_i, rest, batch)      # for each layer i, streamed as scan_layers does
    loss = head_fn(rest, carry, batch)

  (with ``xs``, ``layer_fn(carry, layer_i, x_i, rest, batch)``), then goes
  back through the layers from the last: it brings layer :math:`i` in,
  recomputes it from its saved input carry, takes its gradient and at once
  steps layer :math:`i`'s rows of every stacked param with ``tx``
  (:meth:`optax_hybrid.HybridOptimizer.begin_step`), written in place where
  the params and state live; the rest of the params are stepped last, with
  the gradient of every function that reads them (a weight the layers
  share: summed over the layers). Its result equals::

    loss, grads = jax.value_and_grad(loss_fn)(params, batch)   # loss_fn: the model above, by scan_layers
    params, opt_state = tx.step(params, opt_state, grads)

  (to float rounding of the gradients; bit for bit on a CPU) while never
  holding the layers' gradient: with the stacked layers in host memory
  (``pinned_host``) and ``state_memory_kind="host_state"``, the host holds the layers and
  the state, and nothing else that grows with depth.

  Args:
    tx: an optimizer of this library (``hybrid_adamw`` and the other
      ``hybrid_*``), whose stacked layers run on the device (``state_memory_kind``
      ``"device"`` or ``"host_state"``; on a mesh, split along any axis but
      the first: each device steps its shard), with ``skip_nonfinite=False``.
    embed_fn: ``(rest, batch) -> carry``, a pytree of arrays.
    layer_fn: ``(carry, layer, rest, batch) -> carry`` (the convention of
      :func:`scan_layers`, whose ``args`` are here ``(rest, batch)``); ``layer``
      is one slice of ``params[layers]`` on the device. The values of
      ``rest`` it reads get their gradients. Closing over a value of the
      params is refused (it would be a constant of the step). The old
      ``(carry, layer, batch)`` is accepted for one release with a
      DeprecationWarning, and the step then returns ``(loss, params,
      opt_state)`` as it did.
    head_fn: ``(rest, carry, batch) -> loss``, a float scalar.
    layers: the key of the stacked layers in ``params``.
    xs: per-layer inputs that are not params (a per-layer RNG key):
      ``(rest, batch) -> pytree stacked on axis 0`` (one slice per layer),
      passed to ``layer_fn`` after ``layer``; None for none. They get no
      gradient.
    offload_carries: keep the carries saved for the backward pass in host
      memory (as :func:`scan_layers`).

  Returns:
    ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``,
    the params in the type they came in, to be jitted with
    ``donate_argnums=(0, 1)`` so that the layers and the state are updated in
    place (results in the arguments' order: each donated buffer pairs with
    its own result).

  Raises:
    TypeError: for a ``tx`` that is not one of this library's optimizers
      (``optax.chain`` of it included: the step must own the update), or a
      ``layer_fn`` that takes neither convention's arguments.
    ValueError, TypeError: when the step runs, naming the function or
      argument: for ``params`` without ``layers``; a model function that
      returns the wrong structure, shape or dtype (``embed_fn`` not a
      pytree of arrays, ``layer_fn`` not the carry it takes, ``head_fn`` not a
      float scalar) or that closes over a value of the params; layers in
      the ``host`` or ``disk`` tier or with their first axis split over
      devices;
      ``skip_nonfinite=True``.

  Example:
    >>> import jax, jax.numpy as jnp, optax_hybrid
    >>> params = {"embed": jnp.ones((4, 8)) * 0.1, "layers": {"w": jnp.stack([jnp.eye(8)] * 3)}, "head": jnp.ones(8)}
    >>> tx = optax_hybrid.hybrid_adamw(1e-3)
    >>> train_step = jax.jit(optax_hybrid.step_in_backward(
    ...     tx, lambda rest, b: rest["embed"][b],
    ...     lambda x, layer, rest, b: jnp.tanh(x @ layer["w"]),
    ...     lambda rest, x, b: jnp.mean((x @ rest["head"]) ** 2)), donate_argnums=(0, 1))
    >>> params, state, loss = train_step(params, tx.init(params), jnp.array([0, 2]))
    >>> params["layers"]["w"].shape
    (3, 8, 8)
  """
  owner = "step_in_backward"
  if not callable(getattr(tx, "begin_step", None)):
    raise TypeError(f"{owner}: `tx` must be one of optax_hybrid's optimizers (hybrid_adamw, ...), which "
                    f"can step a layer at a time; got {type(tx).__name__}. Put what a chain would add (a "
                    "schedule, weight decay) in its arguments.")
  layer_fn, old_convention = user_fns.layer_fn_of_step(owner, layer_fn, xs is not None)

  def train_step(params, opt_state, batch):
    stack, rest = _split_layers(params, opt_state, layers)
    parts = _parts(stack, owner)
    length = sum(parts.lengths)
    per_layer = None if xs is None else xs(rest, batch)
    if per_layer is not None and _length(per_layer, "xs", owner) != length:
      raise ValueError(f"{owner}: `xs` must return per-layer inputs stacked like the layers (leading length "
                       f"{length}); got {_length(per_layer, 'xs', owner)}.")
    per_part = _rows_per_part(per_layer, parts.lengths)
    carry, embed_vjp = jax.vjp(lambda r: embed_fn(r, batch), rest)
    user_fns.check_carry(owner, "embed_fn", carry)
    layer = _layer_of_step(layer_fn, params, rest, batch, carry, parts.stacks[0], per_layer)
    saved = []
    for n, part, x in zip(parts.lengths, parts.stacks, per_part):
      carry, kept = _forward_loop(layer.run, n, carry, part, x, layer.shared,
                                  _saved_buffer(carry, n, offload_carries))
      saved.append(kept)
    loss, head_vjp = jax.vjp(lambda r, c: head_fn(r, c, batch), rest, carry)
    user_fns.check_loss(owner, "head_fn", loss)
    _check_closures(params, rest, batch, carry, embed_fn, head_fn)
    g_rest, g = head_vjp(jnp.ones_like(loss))
    stacked = {id(x) for x in jax.tree.leaves(stack)}
    steps = tx.begin_step(params, opt_state, jax.tree.map(lambda x: id(x) in stacked, params))
    g, buffers, g_shared = _backward_stepping(steps, layer, parts, params, stack, layers, saved, per_part, g)
    # The rest's gradients in the order of the backward pass (as jax.grad adds them): the head's, the layers'
    # (a weight they share: summed over them), the embedding's.
    g_rest = jax.tree.leaves(g_rest)
    for j, g_layers in zip(layer.reads, g_shared):
      g_rest[j] = g_rest[j] + g_layers
    g_rest = [a + b for a, b in zip(g_rest, jax.tree.leaves(embed_vjp(g)[0]))]
    new_params, new_state = steps.finish(buffers, _grads_like(params, stacked, rest, g_rest))
    return (loss, new_params, new_state) if old_convention else (new_params, new_state, loss)

  return train_step


def _split_layers(params: Any, opt_state: Any, layers: str) -> tuple[Any, Any]:
  """``(params[layers], the other entries)``, the other entries in ``params``' mapping type where it takes a dict."""
  if not isinstance(params, Mapping) or layers not in params:
    hint = ""
    if hasattr(params, "plan") or getattr(opt_state, "ndim", None) == 0:  # a state, and the loss as the state
      hint = (" It looks like an optimizer state: the train step returns (params, opt_state, loss), in the order "
              "of its arguments; unpack it as `params, opt_state, loss = train_step(params, opt_state, batch)`.")
    raise ValueError(f"step_in_backward: `params` must be a mapping (a dict, a Flax FrozenDict or nnx.State) "
                     f"holding the stacked layers under {layers!r} (the `layers=` argument); got "
                     f"{type(params).__name__}" + (f" with keys {sorted(params)}." if isinstance(params, Mapping)
                                                   else ".") + hint)
  entries = {k: v for k, v in params.items() if k != layers}
  try:
    rest = entries if type(params) is dict else type(params)(entries)
  except TypeError:  # a mapping type that is not made from a dict: the embedding and head get a dict
    rest = entries
  return params[layers], rest


class _StepLayer(NamedTuple):
  """``layer_fn`` as :func:`step_in_backward`'s loops run it.

  Attributes:
    run: ``(carry, layer, x, shared) -> carry`` (``x`` a slice of the per-layer inputs, or None).
    reads: the indices, among ``rest``'s leaves, of the float leaves ``layer_fn`` reads.
    shared: those leaves, in that order: ``run``'s last argument.
  """

  run: Callable
  reads: list
  shared: list


def _layer_of_step(layer_fn: Callable, params: Any, rest: Any, batch: Any, carry: Any, stack: Any,
                   per_layer: Any) -> _StepLayer:
  """``layer_fn`` with the leaves of ``rest`` it reads as an argument of their own (:class:`_StepLayer`).

  ``layer_fn`` is traced once here on layer 0's shapes: its result is
  checked, a closed-over value of the params refused, and the float leaves
  of ``rest`` it reads become ``run``'s last argument, so that the
  backward loop takes their gradient (and only theirs: no accumulator for
  the embedding a layer never reads).
  """
  checked = user_fns.returning_the_carry("step_in_backward", "layer_fn", layer_fn, carry)
  rest_leaves, rest_def = jax.tree.flatten(rest)
  one = lambda tree: jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a)[1:], a.dtype), tree)
  x_args = () if per_layer is None else (one(per_layer),)
  closed = jax.make_jaxpr(lambda c, p, *x_rest_batch: checked(c, p, *x_rest_batch))(
      carry, one(stack), *x_args, rest, batch)
  user_fns.check_no_closed_over_params(
      "step_in_backward", "layer_fn", closed, params,
      "Read params from its arguments: `rest` (layer_fn(carry, layer, rest, batch)), whose values the layers read "
      "get their gradients summed over the layers.")
  start = len(jax.tree.leaves((carry, one(stack), *x_args)))
  read = [j for j in user_fns.used_inputs(closed, start, len(rest_leaves))
          if jnp.issubdtype(rest_leaves[j].dtype, jnp.inexact)]

  def run_layer(c, p, x, shared):
    leaves = list(rest_leaves)
    for j, value in zip(read, shared):
      leaves[j] = value
    inputs = () if per_layer is None else (x,)
    return checked(c, p, *inputs, rest_def.unflatten(leaves), batch)

  return _StepLayer(run_layer, read, [rest_leaves[j] for j in read])


def _check_closures(params: Any, rest: Any, batch: Any, carry: Any, embed_fn: Callable, head_fn: Callable) -> None:
  """Refuses an ``embed_fn`` or ``head_fn`` that closes over a value of the params, naming it."""
  fix = "Read params from `rest`, its first argument: their gradients are taken there."
  user_fns.check_no_closed_over_params("step_in_backward", "embed_fn", jax.make_jaxpr(embed_fn)(rest, batch),
                                       params, fix)
  user_fns.check_no_closed_over_params("step_in_backward", "head_fn", jax.make_jaxpr(head_fn)(rest, carry, batch),
                                       params, fix)


def _backward_stepping(steps: Any, layer: _StepLayer, parts: _Parts, params: Any, stack: Any, layers: str,
                       saved: list, per_part: tuple, g: Any) -> tuple[Any, Any, list]:
  """The backward loop of :func:`step_in_backward`: each layer's VJP, then its rows stepped at once.

  Goes through the parts from the last (a split stack's streamed layers,
  then its resident ones), stepping each part's leaves only. Returns the
  carry's cotangent at the first layer's input, the stepped buffers and the
  gradients of ``layer.shared`` (summed over the layers).
  """
  leaves, treedef = jax.tree.flatten(params)
  buffers, g_shared = steps.buffers, None
  for j in reversed(range(len(parts.lengths))):
    name = parts.names[j]
    of_part = (lambda tree: tree) if name is None else (lambda tree, name=name: getattr(tree, name))
    if name is None:
      rows = lambda tree: jax.tree.map(lambda a: a[None], tree)
    else:  # a tree like the params: this part's rows, None elsewhere (the other part is not stepped now)
      position = {id(x): k for k, x in enumerate(jax.tree.leaves(of_part(stack)))}

      def rows(tree, position=position):
        flat = jax.tree.leaves(tree)
        return treedef.unflatten([flat[position[id(x)]][None] if id(x) in position else None for x in leaves])
    # The layer's params are on the device already (its VJP read them): the step reads them, not the host.
    step = lambda buffers, g_p, p, i, rows=rows: steps.step_rows(buffers, rows(g_p), i, rows(p))
    g, buffers, _, g_shared = _backward_loop(
        layer.run, parts.lengths[j], saved[j], per_part[j], layer.shared, g,
        lambda buffers, of_part=of_part: of_part(steps.current(buffers)[layers]), step, buffers, None,
        list(range(len(layer.shared))), g_shared, writes_stack=True)
  return g, buffers, g_shared


def _grads_like(params: Any, stacked: set, rest: Any, g_rest: list) -> Any:
  """The gradients ``finish`` takes: a tree like ``params`` with ``g_rest`` (one per leaf of ``rest``) at the other
  leaves and None at the stacked ones (stepped already)."""
  by_leaf = {id(r): g for r, g in zip(jax.tree.leaves(rest), g_rest)}
  return jax.tree.map(lambda x: None if id(x) in stacked else by_leaf[id(x)], params)
