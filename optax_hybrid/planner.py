"""Where a model's stacked layers live: the placement that fits and moves the fewest bytes over the bus.

A layer of a stack can be held three ways, each with its cost in device
memory, host memory and bus bytes per step:

* ``"device"``: its params and optimizer state in device memory. No bus.
* ``"host_state"``: its params in device memory, its state in host memory
  (``state_memory_kind="host_state"``): the state crosses the bus each step.
* ``"streamed"``: params and state in host memory (``pinned_host``): the
  layer crosses the bus for the forward and the backward, its update back.

:func:`choose_placement` compiles the user's own train step at two depths for
each way (XLA's memory plan and the bytes its copies move, read from the
compiled program) and, unless the whole stack fits on the device with its
state, at three splits ``k`` resident layers + ``L - k`` streamed (an
:class:`optax_hybrid.SplitStack`) per resident way; predicts every placement
from those lines, takes the one that fits both budgets without XLA
recomputing to fit and moves the fewest bytes over the bus (then: the most
layers resident), and compiles it at full depth to confirm it.
The result, a :class:`StackPlacement`, places the params and names each
leaf's ``state_memory_kind``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import numpy as np

from optax_hybrid import placement as placement_lib
from optax_hybrid import stacks

LAYER_WAYS = ("device", "host_state", "streamed")
# The splits compiled per resident way, (resident, streamed) layers: a base and a slope per part.
SPLIT_PROBES = ((2, 2), (4, 2), (2, 4))
# A compiled step with more dot flops than its probes' line by more than this recomputes (XLA's rematerialization).
RECOMPUTE_TOLERANCE = 0.01
BUDGET_FRACTION = 0.9  # of each memory: room for the CUDA context, the allocator's fragmentation, the process
_GB = 1e9


@dataclasses.dataclass(frozen=True)
class Cost:
  """A compiled (or predicted) train step's figures: peak bytes per memory, bytes over the bus per step, the
  device's scratch bytes (``device_temp_bytes``) and the dots' flops per step."""

  device: float
  host: float
  bus_in: float
  bus_out: float
  device_temp: float = 0.0
  flops: float = 0.0

  def fits(self, device_budget: float, host_budget: float) -> bool:
    return self.device <= device_budget and self.host <= host_budget

  def plus(self, other: "Cost", times: float = 1.0) -> "Cost":
    return Cost(*(a + times * b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


@dataclasses.dataclass(frozen=True)
class StackPlacement:
  """Where each layer of a stack lives, as :func:`choose_placement` chose it, and why.

  The first ``resident_layers`` layers stay on the device (their state where
  ``resident_state`` says), the other ``streamed_layers`` live in host memory
  with their state; the params outside the stack keep their state where
  ``rest_state`` says.

  Attributes:
    stack: the params' key of the stacked layers.
    num_layers: ``L``.
    resident_layers: ``k``.
    resident_state: ``"device"`` or ``"host_state"``: where the resident
      layers' state lives.
    rest_state: the same for the params outside the stack.
    target: the GPU compiled for.
    device_budget, host_budget: the bytes each memory may hold (the budget
      fraction of each memory).
    compiled: the chosen placement's whole step as compiled at full depth.
    predicted: what the compiled depths and splits predicted for it.
    step_seconds, step_lower_bound: the step-time estimate of the compiled
      step (:mod:`optax_hybrid.gpu_compile.step_time`) and its lower bound.
    probes: ``{(way, depth): Cost}``, the compiles the choice read.
    rejected: placements predicted to fit that the confirming compile did not
      (``(resident_layers, resident_state, Cost)``), if any.
    num_devices: the devices the params are split over (FSDP on a mesh), 1
      on one device; the figures and budgets are each device's.
    flops_as_written: the dots' flops per step of this placement as its
      probes' lines give them (no recomputation), to compare with
      ``compiled.flops``.
  """

  stack: str
  num_layers: int
  resident_layers: int
  resident_state: str
  rest_state: str
  target: str
  device_budget: float
  host_budget: float
  compiled: Cost
  predicted: Cost
  step_seconds: float
  step_lower_bound: float
  probes: dict = dataclasses.field(repr=False, default_factory=dict, compare=False, hash=False)
  rejected: tuple = dataclasses.field(repr=False, default=(), compare=False, hash=False)
  num_devices: int = 1
  flops_as_written: float = float("nan")

  @property
  def streamed_layers(self) -> int:
    return self.num_layers - self.resident_layers

  @property
  def recomputes(self) -> bool:
    """Whether XLA recomputes values in the chosen step to keep it under its memory limit (more flops than the
    placement as written): chosen only when no placement fits both budgets without, or when its step is
    estimated faster than the best that does (it moves fewer bytes)."""
    return bool(self.flops_as_written > 0 and self.compiled.flops > (1 + RECOMPUTE_TOLERANCE) * self.flops_as_written)

  def place(self, params: Any) -> Any:
    """``params`` with the stack placed: a :class:`~optax_hybrid.SplitStack` (or a whole stack in one memory).

    Arrays are copied into place, ``jax.ShapeDtypeStruct`` s described there.

    Raises:
      ValueError: ``params`` without this placement's stack, or a stack of
        another length.
    """
    layers = _stack_of(params, self.stack, "StackPlacement.place")
    length = _length(layers, self.stack, "StackPlacement.place")
    if length != self.num_layers:
      raise ValueError(f"StackPlacement.place: params[{self.stack!r}] has {length} layers; this placement was chosen "
                       f"for {self.num_layers}. Choose again for this model (optax_hybrid.choose_placement).")
    if any(isinstance(x, jax.ShapeDtypeStruct) and x.sharding is None for x in jax.tree.leaves(layers)):
      layers = _abstract_stack(layers)  # described on the device, so that each part can name its memory
    return _with_stack(params, self.stack, _placed_stack(layers, self.resident_layers))

  def state_memory_kind(self, path: Any, param: Any) -> str:
    """Per leaf, as ``hybrid_adamw(state_memory_kind=placement.state_memory_kind)`` reads it."""
    del param
    if not path or _key_name(path[0]) != self.stack:
      return self.rest_state
    in_streamed_part = len(path) > 1 and isinstance(path[1], jax.tree_util.GetAttrKey) and path[1].name == "streamed"
    return "host_state" if in_streamed_part or self.resident_layers == 0 else self.resident_state

  def table(self) -> str:
    """The figures that justify the choice, as a few lines of text (GB = 1e9 bytes)."""
    c, p = self.compiled, self.predicted
    return "\n".join([
        f"{self.resident_layers} of {self.num_layers} layers resident (state: {self.resident_state}), "
        f"{self.streamed_layers} streamed; the rest's state: {self.rest_state}; compiled for {self.target}"
        + (f" x {self.num_devices}, figures per device" if self.num_devices > 1 else ""),
        f"device: {_size(c.device)} of {_size(self.device_budget)} (predicted {_size(p.device)})",
        f"host:   {_size(c.host)} of {_size(self.host_budget)} (predicted {_size(p.host)})",
        f"bus per step: {_size(c.bus_in)} in, {_size(c.bus_out)} out",
        f"estimated step: {self.step_seconds:.4f} s (lower bound {self.step_lower_bound:.4f} s)",
    ] + ([f"XLA recomputes to fit: {self.compiled.flops / self.flops_as_written:.2f}x the flops as written"]
         if self.recomputes else []))


def choose_placement(optimizer: Callable[..., Any], step: Callable[[Any], Callable], params: Any, batch: Any, *,
                     stack: str = "layers", target: str | None = None, device_bytes: float | None = None,
                     host_bytes: float | None = None, budget_fraction: float = BUDGET_FRACTION,
                     max_confirms: int = 4, probes: dict | None = None) -> StackPlacement:
  r"""The placement of a stack of layers that fits both memories and moves the fewest bytes over the bus.

  For each way a layer can be held (:data:`LAYER_WAYS`) the train step is
  compiled (for ``target``, without a GPU: :mod:`optax_hybrid.gpu_compile`)
  at two depths :math:`d_1 < d_2`; each figure :math:`f` (device and host
  peak, bus bytes in and out per step) is a line in depth,
  :math:`f(d) = b + d\,g`, which predicts the stack held whole one way.
  Unless the whole stack fits on the device with its state (no bus: nothing
  does better), a split of :math:`k` resident layers and :math:`L - k`
  streamed, which runs a loop per part, is compiled at three splits per
  resident way (:data:`SPLIT_PROBES`) and predicted by the plane through
  them, :math:`f(k, L - k) = b + k\,g_r + (L - k)\,g_s`. Of the placements
  predicted to fit ``budget_fraction`` of each memory, the one with the
  fewest bus bytes (then the most resident layers, then state on the device)
  is compiled at full depth. If it does not fit, what the prediction missed
  is spread over that way's resident layers and the next best is compiled.
  If it fits with more flops than predicted, XLA recomputed values to keep
  it under its own memory limit, a cost in time: it is compiled as written
  (``recompute=False``) to make the prediction exact there, and from then on
  a placement must also keep its device scratch under XLA's limit
  (:func:`optax_hybrid.gpu_compile.rematerialization_limit`, lowered to
  where XLA recomputed). If it fits, the prediction is made exact there and
  a placement predicted to move fewer bytes still (a guess that left room)
  is compiled in turn. The best that fit, after at most ``max_confirms``
  full-depth compiles, is the choice. If XLA recomputed along the way, the
  search runs again letting it recompute, and its result is the choice when
  nothing fits without (the largest models) or when its step is estimated
  faster (:mod:`optax_hybrid.gpu_compile.step_time`, for a target with
  hardware figures: fewer bytes over the bus can outweigh the flops);
  :attr:`StackPlacement.recomputes` says so.

  Nothing of ``params`` is read but shapes, dtypes and shardings; nothing
  is moved. Place the params with :meth:`StackPlacement.place` and build
  the optimizer with ``state_memory_kind=placement.state_memory_kind``.

  Params split over a mesh of several devices (FSDP: ``NamedSharding`` s,
  arrays or ``jax.ShapeDtypeStruct`` s) keep their specs in every part of
  the split, and the step is compiled for that many GPUs, one partition
  each; every figure and budget is then one device's, the host's memory
  shared by the devices of this process.

  Args:
    optimizer: ``state_memory_kind -> optimizer``: builds the
      :func:`optax_hybrid.hybrid_adamw` (or any of the package's
      optimizers) to place, with the ``state_memory_kind`` it is given.
    step: ``optimizer -> train_step``, ``train_step(params, opt_state,
      batch) -> (params, opt_state, ...)`` (for example ``lambda tx:
      optax_hybrid.step_in_backward(tx, embed, layer, head)``). Compiled with
      the params and state donated.
    params: the model's params (arrays or ``jax.ShapeDtypeStruct`` s), a
      mapping whose ``stack`` entry holds the layers stacked on axis 0.
    batch: a batch (arrays or ``jax.ShapeDtypeStruct`` s).
    stack: the key of the stacked layers.
    target: ``"h100"``, ``"h200"`` or a ``GpuTargetConfig`` file; None: the
      running GPU (on a machine without one, name the target).
    device_bytes: the device's memory; None: the running GPU's
      (``memory_stats``), or the target's.
    host_bytes: the host's memory; None: this machine's (required with a
      ``target`` when planning for another machine is meant: pass it). On
      a mesh, each device's budget is its share: ``host_bytes`` over the
      mesh's devices of this process.
    budget_fraction: the share of each memory a placement may use.
    max_confirms: full-depth compiles tried per search, at most.
    probes: the :attr:`StackPlacement.probes` of an earlier choice for the
      same model, batch, optimizer and target at any depth (the lines do
      not depend on it): its compiles are not repeated (planning for
      several depths).

  Returns:
    A :class:`StackPlacement`.

  Raises:
    ValueError: ``params`` without a stack at ``stack``; an ``optimizer`` or
      ``step`` that does not build what is asked; a budget that is not a
      positive number; params (or a batch) on meshes of different sizes; no
      placement fits (the message says which memory is short and by how
      much).

  Example::

    tx_for = lambda kinds: optax_hybrid.hybrid_adamw(1e-4, state_memory_kind=kinds, moment_format="8bit")
    step_for = lambda tx: optax_hybrid.step_in_backward(tx, embed, layer, head)
    chosen = optax_hybrid.choose_placement(tx_for, step_for, params, batch, target="h200", host_bytes=256e9)
    print(chosen.table())
    tx = tx_for(chosen.state_memory_kind)
    params = chosen.place(params)
  """
  from optax_hybrid import gpu_compile  # the compile toolkit, loaded when a choice is asked for

  owner = "choose_placement"
  if not callable(optimizer) or not callable(step):
    raise ValueError(f"{owner}: `optimizer` (state_memory_kind -> optimizer) and `step` (optimizer -> train_step) "
                     f"must be callables; got {type(optimizer).__name__} and {type(step).__name__}.")
  layers = _stack_of(params, stack, owner)
  length = _length(layers, stack, owner)
  if not isinstance(budget_fraction, (int, float)) or not 0 < budget_fraction <= 1:
    raise ValueError(f"{owner}: `budget_fraction` must be in (0, 1] (the share of each memory a placement may use); "
                     f"got {budget_fraction!r}.")
  target, device_bytes, host_bytes = _budgets(target, device_bytes, host_bytes, gpu_compile, owner)
  num_devices, local_devices = _devices(params, batch, owner)
  device_budget, host_budget = budget_fraction * device_bytes, budget_fraction * host_bytes / local_devices
  abstract = jax.tree.map(_abstract, params)
  abstract_batch = jax.tree.map(_abstract, batch)
  rest = sum(_shard_bytes(x) for x in jax.tree.leaves(_with_stack(abstract, stack, None)))
  if rest > device_budget:  # what stays on the device in any placement: no compile can make it fit
    raise ValueError(f"{owner}: device memory is short by at least {_size(rest - device_budget)}: the params outside "
                     f"params[{stack!r}] (the embedding and head among them) stay on the device and take "
                     f"{_size(rest)}{' per device' if num_devices > 1 else ''}, against a budget of "
                     f"{_size(device_budget)} ({budget_fraction:.0%} of `device_bytes`). Give more device memory, "
                     f"or stack more of the model.")

  timed = _has_hardware(target, gpu_compile)

  def compile_at(depth: int, resident: int, resident_state: str, recompute: bool = True) -> tuple[Cost, Any]:
    """The step compiled at ``depth``: its figures, and its step-time estimate (for its flops; its time when the
    target has hardware figures, else the H200's)."""
    chosen = StackPlacement(stack, depth, resident, resident_state, _rest_state(resident, resident_state), target,
                            device_budget, host_budget, None, None, 0.0, 0.0, num_devices=num_devices)
    tx = optimizer(chosen.state_memory_kind)
    if not hasattr(tx, "init"):
      raise ValueError(f"{owner}: `optimizer` must return an optimizer (with init); got {type(tx).__name__}.")
    p = chosen.place(_with_stack(abstract, stack, _rows(layers_abstract, depth)))
    report = gpu_compile.compile_for_gpu(step(tx), p, tx.init(p), abstract_batch, target=target,
                                         num_devices=num_devices, donate_argnums=(0, 1), recompute=recompute)
    estimate = report.step_time() if timed else gpu_compile.step_time.estimate(report)
    return Cost(report.device_peak_bytes, report.host_peak_bytes, report.to_device_bytes, report.to_host_bytes,
                report.device_temp_bytes, estimate.flops), estimate

  layers_abstract = _abstract_stack(_stack_of(abstract, stack, owner))
  depths = sorted({min(2, length), min(4, length)})
  probes = dict(probes or {})
  for way in LAYER_WAYS:
    for depth in depths:
      resident, state = (0, "host_state") if way == "streamed" else (depth, way)
      if (way, depth) not in probes:
        probes[way, depth] = compile_at(depth, resident, state)[0]
  lines = {way: _line(probes, way, depths) for way in LAYER_WAYS}
  # A split runs a loop per part, and its figures are a plane of their own: measured at three splits per way.
  # Compiled only when needed: a model whose every layer fits on the device with its state moves nothing over the
  # bus, which no split betters.
  splits = {}

  def measure_splits() -> None:
    for way in ("device", "host_state"):
      for resident, streamed in SPLIT_PROBES:
        if (f"split {way}", resident, streamed) not in probes:
          probes[f"split {way}", resident, streamed] = compile_at(resident + streamed, resident, way)[0]
      splits[way] = _plane(probes, f"split {way}")

  def predict(k: int, resident_state: str, corrections: dict | None = None) -> Cost:
    if k == 0:
      return _at(lines["streamed"], length)
    if k == length:
      cost = _at(lines[resident_state], k)
    elif not splits:
      return None  # not measured yet
    else:
      base, per_resident, per_streamed = splits[resident_state]
      cost = base.plus(per_resident, k).plus(per_streamed, length - k)
    return cost if corrections is None else cost.plus(corrections[resident_state], k)

  confirmed = {}  # (k, resident_state, recompute): the full-depth compile, made once for both searches

  def confirm(k: int, resident_state: str, recompute: bool = True) -> tuple[Cost, Any]:
    if (k, resident_state, recompute) not in confirmed:
      confirmed[k, resident_state, recompute] = compile_at(length, k, resident_state, recompute)
    return confirmed[k, resident_state, recompute]

  ways = [(k, r) for r in ("device", "host_state") for k in range(length + 1) if not (k == 0 and r == "device")]
  bus = lambda cost: cost.bus_in + cost.bus_out
  # XLA's rematerialization limit, heeded once a compile has recomputed (before that XLA's word is its compile):
  # its own rule, scaled down where a compile recomputed under it.
  limit_scale = [None]
  under_limit = lambda cost: limit_scale[0] is None or cost.device_temp <= limit_scale[0] * (
      gpu_compile.rematerialization_limit(target, cost.device - cost.device_temp))

  def search(recompute: bool) -> tuple[Any, list, list]:
    """The best placement that fits (without XLA recomputing, unless ``recompute``), the placements predicted to
    fit that did not, and the last candidates."""
    # What each full-depth compile taught: per way, a correction per resident layer (XLA's plan at full depth is
    # not always the line through small depths), so that the next guess accounts for it.
    corrections = {way: Cost(0, 0, 0, 0) for way in ("device", "host_state")}
    allowed = lambda cost: cost.fits(device_budget, host_budget) and (recompute or under_limit(cost))
    tried, rejected, best, candidates = set(), [], None, []
    while len(tried) < max_confirms:
      whole_on_device = (length, "device") not in tried and allowed(predict(length, "device", corrections))
      if not splits and length >= 2 and not whole_on_device:
        measure_splits()
      candidates = [(k, r, cost) for k, r in ways if (cost := predict(k, r, corrections)) is not None]
      fitting = sorted((c for c in candidates if allowed(c[2]) and c[:2] not in tried
                        and (best is None or (bus(c[2]), -c[0]) < (bus(best[2]), -best[0]))),
                       key=lambda c: (bus(c[2]), -c[0], c[1] != "device"))
      if not fitting:
        break
      k, resident_state, predicted = fitting[0]
      tried.add((k, resident_state))
      compiled, estimate = confirm(k, resident_state)
      fits = compiled.fits(device_budget, host_budget)
      as_written = predict(k, resident_state).flops  # the lines' flops: the corrections may hold recomputation
      if fits and not recompute and as_written > 0 and compiled.flops > (1 + RECOMPUTE_TOLERANCE) * as_written:
        # XLA recomputed to fit: the placement as written teaches the prediction, and where XLA's limit really is.
        written, _ = confirm(k, resident_state, recompute=False)
        limit = gpu_compile.rematerialization_limit(target, written.device - written.device_temp)
        # Lowered only where XLA recomputed under its rule's limit; over it, the rule already says so.
        limit_scale[0] = min(1.0 if limit_scale[0] is None else limit_scale[0],
                             0.99 * written.device_temp / limit if limit > 0 else 1.0)
        compiled, fits = written, False
      missed = compiled.plus(predicted, -1)
      if fits:
        best = (k, resident_state, compiled, predicted, estimate)
        if k:  # the prediction made exact at k: a guess that left room is followed by one that uses it
          corrections[resident_state] = corrections[resident_state].plus(
              Cost(*(x / k for x in dataclasses.astuple(missed))))
        continue
      rejected.append((k, resident_state, compiled))
      if k:  # spread what the prediction missed over the resident layers of this way
        corrections[resident_state] = corrections[resident_state].plus(
            Cost(*(max(x, 0.0) / k for x in dataclasses.astuple(missed))))
    return best, rejected, candidates

  best, rejected, _ = search(recompute=False)
  if best is None or (timed and limit_scale[0] is not None):
    # Nothing fits unless XLA recomputes (the largest models), or XLA recomputed in a placement that moves fewer
    # bytes: the best placement XLA fits by recomputing, taken if nothing else fits or its step is estimated faster.
    recomputing, rejected_too, candidates = search(recompute=True)
    if best is None:
      best, rejected = recomputing, rejected_too
      if best is None and not rejected:
        raise ValueError(_short(candidates, device_budget, host_budget, budget_fraction, length, stack, owner))
    elif recomputing is not None and recomputing[4].seconds < best[4].seconds:
      best = recomputing
  if best is not None:
    k, resident_state, compiled, predicted, estimate = best
    estimate = estimate if timed else None
    return StackPlacement(stack, length, k, resident_state, _rest_state(k, resident_state), target, device_budget,
                          host_budget, compiled, predicted,
                          float("nan") if estimate is None else estimate.seconds,
                          float("nan") if estimate is None else estimate.lower_bound,
                          probes=probes, rejected=tuple(rejected), num_devices=num_devices,
                          flops_as_written=predict(k, resident_state).flops)
  k, resident_state, compiled = rejected[0]
  raise ValueError(
      f"{owner}: {len(rejected)} placements predicted to fit did not when compiled at full depth ({length} "
      f"layers); the first, {k} resident ({resident_state}), needs {_size(compiled.device)} of device memory "
      f"(budget {_size(device_budget)}) and {_size(compiled.host)} of host memory (budget "
      f"{_size(host_budget)}). Raise `max_confirms` to try more, or the budgets.")


# ---------------------------------------------------------------------------
# The stack: reading it, cutting it, placing it


def _size(nbytes: float) -> str:
  return f"{nbytes / 1e9:.2f} GB" if abs(nbytes) >= 1e8 else f"{nbytes / 1e6:.2f} MB"


def _key_name(key: Any) -> Any:
  for attribute in ("key", "name", "idx"):
    if hasattr(key, attribute):
      return getattr(key, attribute)
  return key


def _stack_of(params: Any, stack: str, owner: str) -> Any:
  try:
    layers = params[stack]
  except (KeyError, TypeError, IndexError):
    keys = list(params.keys()) if hasattr(params, "keys") else type(params).__name__
    raise ValueError(f"{owner}: the params have no stacked layers at `stack`={stack!r} (their keys: {keys}); pass "
                     f"stack= the key of the layers stacked on axis 0.") from None
  if isinstance(layers, stacks.SplitStack):
    layers = _as_one_stack(layers)
  return layers


def _as_one_stack(split: stacks.SplitStack) -> Any:
  """A SplitStack's whole stack, abstract (only its shapes and dtypes are read)."""
  return jax.tree.map(lambda r, s: jax.ShapeDtypeStruct((r.shape[0] + s.shape[0],) + tuple(r.shape[1:]), r.dtype,
                                                        sharding=_split_over_mesh(r)), split.resident, split.streamed)


def _length(layers: Any, stack: str, owner: str) -> int:
  lengths = {np.shape(a)[0] if np.ndim(a) else None for a in jax.tree.leaves(layers)}
  if len(lengths) != 1 or None in lengths or 0 in lengths:
    raise ValueError(f"{owner}: params[{stack!r}] must be arrays stacked on axis 0 with one leading length (the "
                     f"number of layers, at least 1); got leading lengths {sorted(lengths, key=str) or 'none'}.")
  return int(lengths.pop())


def _with_stack(params: Any, stack: str, layers: Any) -> Any:
  if isinstance(params, dict):
    return {**params, stack: layers}
  if hasattr(params, "copy") and type(params).__name__ == "FrozenDict":
    return params.copy({stack: layers})
  out = type(params)({**dict(params.items()), stack: layers}) if hasattr(params, "items") else None
  if out is None:
    raise ValueError(f"choose_placement: the params must be a mapping (dict, FrozenDict, nnx.State) whose "
                     f"{stack!r} entry holds the stacked layers; got {type(params).__name__}.")
  return out


def _split_over_mesh(x: Any) -> Any:
  """``x``'s NamedSharding if it spans several devices, else None."""
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh.size > 1:
    return sharding
  return None


def _devices(params: Any, batch: Any, owner: str) -> tuple[int, int]:
  """The devices the params and batch are split over, and how many of them this process holds (they share its
  host memory): ``(1, 1)`` on one device."""
  meshes = {sharding.mesh.size: sharding.mesh for x in jax.tree.leaves((params, batch))
            if (sharding := _split_over_mesh(x)) is not None}
  if len(meshes) > 1:
    raise ValueError(f"{owner}: the params and batch are split over meshes of {sorted(meshes)} devices; place them "
                     f"all on one mesh (the devices the step runs on).")
  if not meshes:
    return 1, 1
  mesh = meshes.popitem()[1]
  devices = getattr(mesh, "devices", None)
  if devices is None:  # an abstract mesh: its devices are not named, all taken to be this process's
    return mesh.size, mesh.size
  local = sum(d.process_index == jax.process_index() for d in np.asarray(devices).flat)
  return mesh.size, max(local, 1)


def _shard_bytes(x: Any) -> int:
  """The bytes of one device's share of ``x``."""
  sharding = getattr(x, "sharding", None)
  shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
  return int(np.prod(shape)) * x.dtype.itemsize


def _abstract(x: Any) -> Any:
  """An array's shape and dtype on the device(s) it is split over (on the first device if on one): the planner
  places the stack; the rest stays there."""
  if not hasattr(x, "dtype"):
    return x
  sharding = _split_over_mesh(x)
  if sharding is not None:
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype,
                                sharding=sharding.with_memory_kind(placement_lib.DEVICE_KIND))
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def _abstract_stack(layers: Any) -> Any:
  """The stack as ShapeDtypeStructs on a mesh (its own, split; else one device's): JAX traces a NamedSharding in
  host memory as a host value (a SingleDeviceSharding one as a device value), as it does real arrays placed
  there."""
  mesh = jax.make_mesh((1,), ("one",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=placement_lib.DEVICE_KIND)
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=(
      one if (split := _split_over_mesh(a)) is None else split.with_memory_kind(placement_lib.DEVICE_KIND))), layers)


def _rows(layers: Any, depth: int) -> Any:
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct((depth,) + tuple(a.shape[1:]), a.dtype, sharding=a.sharding),
                      layers)


def _placed_stack(layers: Any, resident: int) -> Any:
  split = stacks.split_stack(layers, resident)
  if resident == _length(layers, "layers", "place"):
    return split.resident  # every layer on the device: one stack, no empty part
  return split.streamed if resident == 0 else split


def _rest_state(resident: int, resident_state: str) -> str:
  return resident_state if resident else "host_state"


# ---------------------------------------------------------------------------
# The choice: lines through two depths, predictions, the budgets


def _line(probes: dict, way: str, depths: list[int]) -> tuple[Cost, Cost]:
  """``(base, per layer)`` of one way, through its two compiled depths."""
  if len(depths) == 1:
    return probes[way, depths[0]], Cost(0, 0, 0, 0)
  (d1, d2), (a, b) = depths, (probes[way, depths[0]], probes[way, depths[1]])
  per = Cost(*((y - x) / (d2 - d1) for x, y in zip(dataclasses.astuple(a), dataclasses.astuple(b))))
  return a.plus(per, -d1), per


def _at(line: tuple[Cost, Cost], depth: int) -> Cost:
  return line[0].plus(line[1], depth)


def _plane(probes: dict, name: str) -> tuple[Cost, Cost, Cost]:
  """``(base, per resident layer, per streamed layer)`` of a split, through its three compiled splits."""
  (r0, s0), (r1, _), (_, s2) = SPLIT_PROBES
  first, more_resident, more_streamed = (probes[name, r, s] for r, s in SPLIT_PROBES)
  per_resident = more_resident.plus(first, -1)
  per_resident = Cost(*(x / (r1 - r0) for x in dataclasses.astuple(per_resident)))
  per_streamed = more_streamed.plus(first, -1)
  per_streamed = Cost(*(x / (s2 - s0) for x in dataclasses.astuple(per_streamed)))
  return first.plus(per_resident, -r0).plus(per_streamed, -s0), per_resident, per_streamed


def _short(candidates: list, device_budget: float, host_budget: float, fraction: float, length: int, stack: str,
           owner: str) -> str:
  least_device = min(candidates, key=lambda c: c[2].device)
  least_host = min(candidates, key=lambda c: c[2].host)
  lines = []
  if least_device[2].device > device_budget:
    lines.append(f"device memory is short by {_size((least_device[2].device - device_budget))}: even with "
                 f"every layer streamed the step needs {_size(least_device[2].device)} (the params outside "
                 f"the stack, the embedding and head among them, the batch's activations and one layer at a time) "
                 f"against a budget of {_size(device_budget)}")
  if least_host[2].host > host_budget:
    lines.append(f"host memory is short by {_size((least_host[2].host - host_budget))}: with as much as "
                 f"possible on the device the step needs {_size(least_host[2].host)} against a budget of "
                 f"{_size(host_budget)}")
  if not lines:
    best = min(candidates, key=lambda c: max(c[2].device / device_budget, c[2].host / host_budget))
    lines.append(f"no split of the {length} layers fits both: the closest, {best[0]} resident, needs "
                 f"{_size(best[2].device)} of device memory (budget {_size(device_budget)}) and "
                 f"{_size(best[2].host)} of host memory (budget {_size(host_budget)})")
  return (f"{owner}: no placement of params[{stack!r}] fits ({fraction:.0%} of each memory): " + "; ".join(lines)
          + ". Give more memory (`device_bytes`, `host_bytes`), a smaller batch, or a smaller model.")


def _budgets(target: str | None, device_bytes: float | None, host_bytes: float | None, gpu_compile: Any,
             owner: str) -> tuple[str, float, float]:
  if target is None:
    device = jax.devices()[0]
    if device.platform != "gpu":
      raise ValueError(f"{owner}: the running backend is {device.platform!r}, which has no device memory of its "
                       f"own to plan for: pass target='h100' or 'h200' (compiled without a GPU) and the budgets "
                       f"(`device_bytes`, `host_bytes`).")
    kind = device.device_kind.lower()
    target = next((t for t in ("h200", "h100") if t in kind), None)
    if target is None:
      raise ValueError(f"{owner}: no compile target for a {device.device_kind!r}: pass target= a GpuTargetConfig "
                       f"file of it (optax_hybrid.gpu_compile.load_target).")
    if device_bytes is None:
      device_bytes = (device.memory_stats() or {}).get("bytes_limit")
  if device_bytes is None:
    device_bytes = gpu_compile.target_device_memory_bytes(target)
  if host_bytes is None:
    host_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  for name, value in (("device_bytes", device_bytes), ("host_bytes", host_bytes)):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"{owner}: `{name}` must be a positive number of bytes (e.g. 256e9); got {value!r}.")
  return target, float(device_bytes), float(host_bytes)


def _has_hardware(target: str, gpu_compile: Any) -> bool:
  return target in gpu_compile.step_time.HARDWARE


__all__ = ["LAYER_WAYS", "StackPlacement", "choose_placement"]
