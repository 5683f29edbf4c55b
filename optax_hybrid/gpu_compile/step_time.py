"""How long a compiled GPU program's step takes, estimated from XLA's optimized, scheduled HLO.

XLA:GPU schedules a module before it emits it: the instructions of each
computation are listed in the order the GPU's compute stream runs them, with
each asynchronous host<->device copy split into a start and a done. This
module replays that schedule on a model of the machine:

* **Kernels** run one after the other on the compute stream, each at its
  roofline: :math:`\\max(F / \\text{peak}, B / \\text{HBM})`, with :math:`F`
  the flops of the dots and convolutions it contains (:math:`2 m n k`, read
  off the shapes) and :math:`B` the bytes it reads and writes (a fusion that
  reads only a slice of an operand counts the slice; one that updates a
  buffer in place counts the update).
* **Host<->device copies** run on one copy engine per direction at
  ``pcie_bandwidth``, first come first served. An asynchronous copy starts
  when the stream reaches its start (or when its engine is free) and the
  stream waits at its done until it has finished, so a copy overlaps compute
  only between its start and its done in the schedule. A synchronous copy
  holds the stream.
* **Host computations** (XLA's host compute, host callbacks) read and write
  their operands at ``host_bandwidth`` on the host CPU, after their device
  inputs have crossed to the host and before their device outputs cross back.
* **Collectives** run at ``nvlink_bandwidth`` per direction (a ring: an
  all-reduce moves :math:`2 (n - 1) / n` of its bytes, an all-gather or a
  reduce-scatter :math:`(n - 1) / n`).
* **Loops** run their body once per trip (the known trip count; 1 when XLA
  does not know it, counted in ``unknown_trip_counts``). Once two successive
  trips leave the machine in the same state, the remaining trips repeat them
  and are added without being replayed.

The result, a :class:`StepTime`, gives the estimated step, the time each
resource is busy, the lower bound
:math:`\\max(\\text{compute}, \\text{bus in}, \\text{bus out}, \\text{host},
\\text{collectives})` that a perfect overlap would reach, and how much of the
time the bus is busy a kernel runs beside it (``bus_hidden``).

What it leaves out: launch latencies, kernels slower than their roofline
(small or badly tiled matmuls, attention), caches, contention between the
copy engines and the kernels for HBM, PCIe latency. Lower ``peak_flops``
(to what a matmul achieves, say 0.7 of the spec) for a closer figure. A
GPU's measurement (``benchmarks/gpu_check.py``) is the judge.

Example::

  import jax, jax.numpy as jnp
  from optax_hybrid import gpu_compile
  from optax_hybrid.gpu_compile import step_time

  x = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  report = gpu_compile.compile_for_gpu(lambda a, b: a @ b, x, x, target="h200")
  estimate = step_time.estimate(report.hlo, step_time.H200_SXM)
  estimate.seconds   # 2 * 8192**3 / 989e12 = 1.11e-3
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
from typing import Any

from optax_hybrid.gpu_compile.hlo import (
    BOOKKEEPING_OPS,
    HloInstruction,
    array_bytes,
    array_dims,
    collective_of,
    collective_payload,
    host_call_bytes,
    in_host_memory,
    is_host_call,
    parse_hlo,
    transfer_of,
)

__all__ = ["H100_SXM", "H200_SXM", "HARDWARE", "Hardware", "LoopTime", "StepTime", "estimate", "kernel_seconds"]


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The figures a step-time estimate takes from the machine, per GPU (SI units: FLOP/s, bytes/s).

  Attributes:
    name: what the figures describe.
    peak_flops: tensor-core peak for the dots and convolutions.
    hbm_bandwidth: device memory bandwidth, for every other kernel.
    pcie_bandwidth: host<->device copy bandwidth per direction (one copy
      engine each way, both running at once).
    host_bandwidth: the host memory bandwidth a host computation of this
      GPU's program gets (its share of the CPU sockets).
    nvlink_bandwidth: GPU<->GPU bandwidth per direction, for collectives.

  Raises:
    ValueError: a figure that is not a positive finite number (the message
      names it).
  """

  name: str
  peak_flops: float
  hbm_bandwidth: float
  pcie_bandwidth: float
  host_bandwidth: float
  nvlink_bandwidth: float

  def __post_init__(self):
    for field in dataclasses.fields(self)[1:]:
      value = getattr(self, field.name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"Hardware: `{field.name}` must be a positive number (per second); got {value!r}.")


H200_SXM = Hardware(
    name="H200 SXM, PCIe 5 x16",
    peak_flops=989e12,       # dense BF16 tensor cores (NVIDIA H200 datasheet; 1,979 with sparsity)
    hbm_bandwidth=4.8e12,    # HBM3e, 141 GB (datasheet)
    pcie_bandwidth=55e9,     # PCIe 5 x16: 64 GB/s per direction in theory, 50-55 measured for pinned copies
    host_bandwidth=75e9,     # DGX H200: 2 sockets x 8 DDR5-4800 channels (~300 GB/s each) shared by 8 GPUs
    nvlink_bandwidth=450e9,  # NVLink 4: 900 GB/s per GPU, both directions together
)
"""NVIDIA H200 SXM in a DGX H200 (sources: docs/step_time.md)."""

H100_SXM = dataclasses.replace(H200_SXM, name="H100 SXM, PCIe 5 x16", hbm_bandwidth=3.35e12)
"""NVIDIA H100 SXM: the H200's chip with 80 GB of HBM3 at 3.35 TB/s."""

HARDWARE = {"h200": H200_SXM, "h100": H100_SXM}
"""The hardware of :data:`optax_hybrid.gpu_compile.TARGETS`' targets, by target name."""


@dataclasses.dataclass(frozen=True)
class LoopTime:
  """Where a ``while`` body's time goes, over all its trips in one step.

  Attributes:
    body: the body computation's name.
    trips: how many times it ran per step (its trip count times its outer loops').
    seconds: the compute stream's time from each trip's start to its end, summed.
    compute: of which kernels ran.
    bus_in, bus_out: copy-engine time its copies took, per direction.
  """

  body: str
  trips: int
  seconds: float
  compute: float
  bus_in: float
  bus_out: float


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A step-time estimate (:func:`estimate`). Times in seconds.

  Attributes:
    seconds: the estimated step: when the compute stream finishes its last
      instruction (having waited for every copy, host call and collective
      it depends on).
    compute: the kernels' time (each at its roofline).
    bus_in, bus_out: the host->device and device->host copy engines' busy time.
    host: the host CPU's busy time (host computations).
    collectives: NVLink's busy time.
    bus_busy: the time at least one copy engine is busy.
    bus_hidden: of ``bus_busy``, the time a kernel runs at the same moment.
    flops: the dots' and convolutions' flops per step, recomputation included.
    kernels: kernel launches per step.
    loops: per ``while`` body, slowest first.
    unknown_trip_counts: loops whose trip count XLA does not know (counted once).
    hardware: the :class:`Hardware` assumed.
  """

  seconds: float
  compute: float
  bus_in: float
  bus_out: float
  host: float
  collectives: float
  bus_busy: float
  bus_hidden: float
  flops: float
  kernels: int
  loops: tuple[LoopTime, ...]
  unknown_trip_counts: int
  hardware: Hardware

  @property
  def lower_bound(self) -> float:
    """``max(compute, bus_in, bus_out, host, collectives)``: the step if everything overlapped."""
    return max(self.compute, self.bus_in, self.bus_out, self.host, self.collectives)

  @property
  def bus_hidden_fraction(self) -> float:
    """``bus_hidden / bus_busy`` (1.0 when the bus is never busy)."""
    return self.bus_hidden / self.bus_busy if self.bus_busy else 1.0

  def mfu(self, model_flops: float) -> float:
    """Model flops utilisation: ``model_flops / (seconds * peak_flops)`` (e.g. ``6 * params * tokens``)."""
    return model_flops / (self.seconds * self.hardware.peak_flops) if self.seconds else 0.0

  def as_dict(self) -> dict:
    """The figures as a JSON-friendly dict (the three largest loops only)."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("loops", "hardware")}
    out.update(lower_bound=self.lower_bound, bus_hidden_fraction=self.bus_hidden_fraction,
               hardware=self.hardware.name, loops=[dataclasses.asdict(x) for x in self.loops[:3]])
    return out


def estimate(hlo: Any, hardware: Hardware | str = H200_SXM) -> StepTime:
  """Estimates one run of a compiled program from its optimized, scheduled HLO (rules: the module's docstring).

  Args:
    hlo: the optimized HLO text (``GpuCompileReport.hlo``, or on a GPU
      ``jax.jit(f).lower(*args).compile().as_text()``), or a
      :class:`~optax_hybrid.gpu_compile.GpuCompileReport`.
    hardware: a :class:`Hardware` or a name of :data:`HARDWARE`.

  Returns:
    A :class:`StepTime`.

  Raises:
    ValueError: ``hlo`` has no entry computation (not an HLO module's text),
      or ``hardware`` is an unknown name.

  Example::

    report = gpu_compile.compile_for_gpu(train_step, params, state, batch, target="h200", donate_argnums=(0, 1))
    t = step_time.estimate(report)
    t.seconds, t.lower_bound, t.bus_hidden_fraction
  """
  if isinstance(hardware, str):
    if hardware not in HARDWARE:
      raise ValueError(f"`hardware` must be a Hardware or one of {sorted(HARDWARE)}; got {hardware!r}.")
    hardware = HARDWARE[hardware]
  text = getattr(hlo, "hlo", hlo)
  computations, entry = parse_hlo(text) if isinstance(text, str) else ({}, None)
  if entry is None:
    raise ValueError("`hlo` must be an optimized HLO module's text (with an ENTRY computation) or a "
                     f"GpuCompileReport; got {type(hlo).__name__} {str(text)[:60]!r}.")
  replay = _Replay(computations, hardware)
  replay.run(entry, {})
  return replay.result()


def kernel_seconds(hlo: Any, hardware: Hardware | str = H200_SXM) -> dict[str, float]:
  """Each kernel's time at its roofline, by instruction name (every computation's fusions, custom calls, copies).

  Args:
    hlo: HLO module text (scheduled or not), or a ``GpuCompileReport``.
    hardware: as for :func:`estimate`.

  Returns:
    ``{instruction name: seconds}`` for the instructions that launch a
    kernel (transfers between memory spaces and host calls excluded).
  """
  hardware = HARDWARE[hardware] if isinstance(hardware, str) else hardware
  computations, _ = parse_hlo(getattr(hlo, "hlo", hlo))
  costs = _Costs(computations, hardware)
  out = {}
  for instructions in computations.values():
    shapes = {i.name: i.shape for i in instructions}
    for ins in instructions:
      if (ins.opcode in ("fusion", "custom-call", "copy") and transfer_of(ins, shapes) is None
          and not is_host_call(ins)):
        out[ins.name] = costs.kernel_seconds(ins, shapes)[0]
  return out


# --- what one kernel costs --------------------------------------------------------

_GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul")
_SLICING_OPS = frozenset({"dynamic-slice", "slice", "gather"})


def _product(values) -> int:
  return math.prod(values) if values else 1


def _dims_attribute(rest: str, key: str) -> list[int]:
  match = re.search(key + r"=\{([\d,]*)\}", rest)
  return [int(d) for d in match.group(1).split(",") if d] if match else []


def _dot_flops(ins: HloInstruction, shapes: dict) -> float:
  """``2 * |result| * |contracted|`` of a ``dot`` or a cuBLAS gemm custom call."""
  lhs = array_dims(shapes.get(ins.operands[0], "")) if ins.operands else []
  out = array_dims(ins.shape)
  if not lhs or not out:
    return 0.0
  contracting = _dims_attribute(ins.rest, "lhs_contracting_dims")
  if ins.opcode == "custom-call":  # cuBLAS: the dimension numbers are in the backend config
    match = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.rest)
    contracting = [int(d) for d in re.findall(r"\d+", match.group(1))] if match else []
  return 2.0 * _product(out[0]) * _product([lhs[0][d] for d in contracting if d < len(lhs[0])])


def _convolution_flops(ins: HloInstruction, shapes: dict) -> float:
  """``2 * |result| * |kernel| / output features``: each output multiplies a kernel window by one filter."""
  kernel = array_dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
  labels = re.search(r"dim_labels=\w+_(\w+)->", ins.rest)
  out = array_dims(ins.shape)
  if not kernel or not out or not labels or "o" not in labels.group(1):
    return 0.0
  return 2.0 * _product(out[0]) * _product(kernel[0]) / max(1, kernel[0][labels.group(1).index("o")])


class _Costs:
  """Flops and bytes of kernels, read off the computations they call (memoized per computation)."""

  def __init__(self, computations: dict, hardware: Hardware):
    self.computations = computations
    self.hardware = hardware
    self._flops: dict[str, float] = {}
    self._access: dict[str, tuple] = {}

  def flops(self, name: str) -> float:
    """The dots' and convolutions' flops of a computation and of those it calls."""
    if name not in self._flops:
      self._flops[name] = 0.0  # a computation does not call itself; the guard keeps a bad text finite
      instructions = self.computations.get(name, [])
      shapes = {i.name: i.shape for i in instructions}
      self._flops[name] = sum(self.instruction_flops(i, shapes) for i in instructions)
    return self._flops[name]

  def instruction_flops(self, ins: HloInstruction, shapes: dict) -> float:
    if ins.opcode == "dot" or (ins.opcode == "custom-call" and ins.target in _GEMM_TARGETS):
      return _dot_flops(ins, shapes)
    if ins.opcode == "convolution" or (ins.opcode == "custom-call" and "conv" in (ins.target or "")):
      return _convolution_flops(ins, shapes)
    if ins.opcode in ("fusion", "fusion-start", "call", "async-start"):
      return sum(self.flops(c) for c in ins.called)
    return 0.0

  def kernel_bytes(self, ins: HloInstruction, shapes: dict) -> float:
    """Bytes a kernel reads and writes in device memory."""
    operands = [shapes.get(o, "") for o in ins.operands]
    if ins.opcode == "dynamic-update-slice":
      return 2.0 * array_bytes(operands[1] if len(operands) > 1 else "")
    if ins.opcode in _SLICING_OPS:
      return 2.0 * array_bytes(ins.shape)
    fused = ins.called[0] if ins.opcode in ("fusion", "fusion-start") and ins.called else None
    if fused not in self.computations:
      return float(array_bytes(ins.shape) + sum(array_bytes(o) for o in operands))
    reads, in_place, written = self._fused_access(fused)
    return written + sum(0 if j in in_place else reads.get(j, array_bytes(o)) for j, o in enumerate(operands))

  def kernel_seconds(self, ins: HloInstruction, shapes: dict) -> tuple[float, float]:
    """``(seconds, flops)`` of a kernel at its roofline."""
    flops = self.instruction_flops(ins, shapes)
    return max(flops / self.hardware.peak_flops, self.kernel_bytes(ins, shapes) / self.hardware.hbm_bandwidth), flops

  def _fused_access(self, name: str) -> tuple[dict, set, float]:
    """Of a fused computation: ``({param: bytes read} for sliced params, params updated in place, bytes written)``."""
    if name in self._access:
      return self._access[name]
    instructions = self.computations[name]
    by_name = {i.name: i for i in instructions}
    users: dict[str, list[HloInstruction]] = {}
    for i in instructions:
      for o in i.operands:
        users.setdefault(o, []).append(i)
    params = {int(re.match(r"\s*(\d+)", i.rest).group(1)): i.name for i in instructions
              if i.opcode == "parameter" and re.match(r"\s*\d+", i.rest)}
    root = instructions[-1] if instructions else None
    outputs = root.operands if root is not None and root.opcode == "tuple" else [root.name] if root else []
    in_place, written = set(), 0.0
    index_of = {p: j for j, p in params.items()}
    for out in outputs:
      ins = _through_bitcasts(by_name.get(out), by_name)
      buffer = _through_bitcasts(by_name.get(ins.operands[0]), by_name) if ins and ins.operands else None
      if ins is not None and ins.opcode == "dynamic-update-slice" and buffer is not None and buffer.name in index_of:
        in_place.add(index_of[buffer.name])
        written += array_bytes(by_name[ins.operands[1]].shape) if ins.operands[1] in by_name else 0
      elif ins is not None:
        written += array_bytes(ins.shape)
    reads = {j: r for j, p in params.items() if (r := _sliced_read(p, users)) is not None}
    self._access[name] = reads, in_place, written
    return self._access[name]


def _through_bitcasts(ins: HloInstruction | None, by_name: dict) -> HloInstruction | None:
  while ins is not None and ins.opcode == "bitcast" and ins.operands:
    ins = by_name.get(ins.operands[0])
  return ins


def _sliced_read(param: str, users: dict) -> float | None:
  """Bytes read of a fused parameter that is only sliced (or updated in place); None if it is read whole."""
  total, frontier = 0.0, [param]
  while frontier:
    name = frontier.pop()
    for user in users.get(name, []):
      if user.opcode == "bitcast":
        frontier.append(user.name)
      elif user.opcode in _SLICING_OPS and user.operands[0] == name:
        total += array_bytes(user.shape)
      elif not (user.opcode == "dynamic-update-slice" and user.operands[0] == name):
        return None
  return total


def _participants(rest: str) -> int:
  """The size of a collective's replica groups (``{{0,1,2,3}}`` or the iota form ``[2,4]<=[8]``)."""
  iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", rest)
  if iota:
    return int(iota.group(1))
  groups = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
  return len([g for g in groups.group(1).split(",") if g]) if groups else 1


def _collective_seconds(opcode: str, rest: str, nbytes: float, bandwidth: float) -> float:
  """A ring collective's time: what each GPU sends, at ``bandwidth`` per direction."""
  if opcode.startswith("collective-permute"):
    return nbytes / bandwidth
  n = _participants(rest)
  share = (n - 1) / n
  return (2 * share if opcode.startswith("all-reduce") else share) * nbytes / bandwidth


# --- the replay ------------------------------------------------------------------

_ENGINES = ("in", "out", "host", "net")


class _Timeline:
  """The compute stream's clock, when each engine is next free, and what each resource did so far."""

  def __init__(self):
    self.clock = 0.0
    self.free = dict.fromkeys(_ENGINES, 0.0)
    self.busy = dict.fromkeys(("compute",) + _ENGINES, 0.0)
    self.bus: list[list[float]] = []  # the copy engines' busy intervals (merged) not yet behind the clock
    self.bus_busy = self.bus_hidden = self.flops = 0.0
    self.kernels = 0

  def compute(self, seconds: float, flops: float = 0.0) -> None:
    """A kernel: the stream is busy for ``seconds``; the bus time beside it is hidden."""
    start, end = self.clock, self.clock + seconds
    self.bus_hidden += sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.bus)
    self.clock = end
    self.busy["compute"] += seconds
    self.flops += flops
    self.kernels += 1
    self._forget()

  def engine(self, name: str, seconds: float, not_before: float) -> float:
    """Work on an engine, first come first served, from ``not_before`` on; returns when it ends."""
    start = max(not_before, self.free[name])
    end = self.free[name] = start + seconds
    self.busy[name] += seconds
    if name in ("in", "out") and seconds > 0:
      self._add_bus(start, end)
    return end

  def wait(self, until: float) -> None:
    self.clock = max(self.clock, until)
    self._forget()

  def _add_bus(self, start: float, end: float) -> None:
    merged = [start, end]
    kept = []
    for s, e in self.bus:
      if e < merged[0] or s > merged[1]:
        kept.append([s, e])
      else:
        merged = [min(s, merged[0]), max(e, merged[1])]
    before = sum(e - s for s, e in self.bus)
    self.bus = sorted(kept + [merged])
    self.bus_busy += sum(e - s for s, e in self.bus) - before

  def _forget(self) -> None:
    self.bus = [[s, e] for s, e in self.bus if e > self.clock]

  def totals(self) -> tuple:
    return (self.clock, *self.busy.values(), self.bus_busy, self.bus_hidden, self.flops, self.kernels)

  def state(self, carried: dict) -> tuple:
    """What the next trip depends on, relative to the clock."""
    ahead = lambda t: max(0.0, t - self.clock)
    return (tuple(ahead(t) for t in self.free.values()), tuple((s - self.clock, e - self.clock) for s, e in self.bus),
            tuple(sorted((j, ahead(t)) for j, t in carried.items())))

  def repeat(self, per_trip: tuple, times: int, carried: dict) -> dict:
    """Adds ``times`` more trips that each add ``per_trip`` (a difference of :meth:`totals`); shifts the clocks."""
    shift = per_trip[0] * times
    self.clock += shift
    for name in self.free:
      self.free[name] += shift
    for name, delta in zip(self.busy, per_trip[1:]):
      self.busy[name] += delta * times
    self.bus = [[s + shift, e + shift] for s, e in self.bus]
    k = 1 + len(self.busy)
    self.bus_busy += per_trip[k] * times
    self.bus_hidden += per_trip[k + 1] * times
    self.flops += per_trip[k + 2] * times
    self.kernels += per_trip[k + 3] * times
    return {j: t + shift for j, t in carried.items()}


def _close(a: Any, b: Any) -> bool:
  if isinstance(a, tuple):
    return isinstance(b, tuple) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
  return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


class _Replay:
  """Runs the schedule of a module on a :class:`_Timeline`."""

  def __init__(self, computations: dict, hardware: Hardware):
    self.computations = computations
    self.hardware = hardware
    self.costs = _Costs(computations, hardware)
    self.timeline = _Timeline()
    self.loops: dict[str, list[float]] = {}  # body -> [trips, seconds, compute, in, out]
    self.unknown_trip_counts = 0

  def result(self) -> StepTime:
    t = self.timeline
    loops = sorted((LoopTime(body, int(round(v[0])), *v[1:]) for body, v in self.loops.items()),
                   key=lambda x: -x.seconds)
    return StepTime(seconds=t.clock, compute=t.busy["compute"], bus_in=t.busy["in"], bus_out=t.busy["out"],
                    host=t.busy["host"], collectives=t.busy["net"], bus_busy=t.bus_busy, bus_hidden=t.bus_hidden,
                    flops=t.flops, kernels=int(round(t.kernels)), loops=tuple(loops),
                    unknown_trip_counts=self.unknown_trip_counts, hardware=self.hardware)

  def run(self, name: str, argument: dict) -> dict:
    """Runs one computation; ``argument``: pending async results in its parameter tuple, by index.

    Returns the pending async results in its root tuple, by index.
    """
    instructions = self.computations.get(name, [])
    shapes = {i.name: i.shape for i in instructions}
    pending: dict[str, float] = {}  # async start -> when its work ends
    tuples: dict[str, dict[int, float]] = {}  # tuple -> {index: when that element's async work ends}
    for ins in instructions:
      if ins.opcode == "parameter":
        tuples[ins.name] = argument
      elif ins.opcode == "tuple":
        tuples[ins.name] = {j: pending[o] for j, o in enumerate(ins.operands) if o in pending}
      elif ins.opcode == "get-tuple-element":
        index = int(re.search(r"index=(\d+)", ins.rest).group(1))
        if index in tuples.get(ins.operands[0], {}):
          pending[ins.name] = tuples[ins.operands[0]][index]
      else:
        self.instruction(ins, shapes, pending, tuples)
    return tuples.get(instructions[-1].name, {}) if instructions else {}

  def instruction(self, ins: HloInstruction, shapes: dict, pending: dict, tuples: dict) -> None:
    t, op = self.timeline, ins.opcode
    if op.endswith("-done"):
      t.wait(pending.pop(ins.operands[0], t.clock) if ins.operands else t.clock)
    elif op == "while":
      tuples[ins.name] = self.loop(ins, tuples.get(ins.operands[0], {}))
    elif is_host_call(ins):
      end = self.host_call(ins, shapes)
      if op.endswith("-start"):
        pending[ins.name] = end
      else:
        t.wait(end)
    elif op in ("call", "conditional"):
      self.branches(ins)
    elif (moved := transfer_of(ins, shapes)) is not None:
      end = t.engine("in" if moved[0] else "out", sum(moved) / self.hardware.pcie_bandwidth, t.clock)
      if op.endswith("-start"):
        pending[ins.name] = end
      else:
        t.wait(end)
    elif op in BOOKKEEPING_OPS or op.endswith("-update") or op in ("send", "recv"):
      pass
    else:
      self.launch(ins, shapes, pending)

  def launch(self, ins: HloInstruction, shapes: dict, pending: dict) -> None:
    """A kernel, a collective, a copy between host buffers, or an async op's work."""
    t = self.timeline
    collective = collective_of(ins, self.computations)
    if collective is not None:
      opcode, rest = collective.opcode.removesuffix("-start"), collective.rest
      nbytes = collective_payload(ins, shapes)
      end = t.engine("net", _collective_seconds(opcode, rest, nbytes, self.hardware.nvlink_bandwidth), t.clock)
    elif _host_to_host(ins, shapes):
      end = t.engine("host", self.costs.kernel_bytes(ins, shapes) / self.hardware.host_bandwidth, t.clock)
    elif ins.opcode == "async-start":
      for c in ins.called:  # work XLA wrapped to run asynchronously: counted on the compute stream
        self.run(c, {})
      end = t.clock
    else:
      t.compute(*self.costs.kernel_seconds(ins, shapes))
      end = t.clock
    if ins.opcode.endswith("-start"):
      pending[ins.name] = end
    else:
      t.wait(end)

  def host_call(self, ins: HloInstruction, shapes: dict) -> float:
    """A host computation: device inputs cross out, the host reads and writes, device outputs cross in."""
    t, hw = self.timeline, self.hardware
    to_device, to_host = host_call_bytes(ins)
    nbytes = array_bytes(ins.shape) + (0 if ins.opcode.endswith("-start") else
                                       sum(array_bytes(shapes.get(o, "")) for o in ins.operands))
    ready = t.engine("out", to_host / hw.pcie_bandwidth, t.clock) if to_host else t.clock
    done = t.engine("host", nbytes / hw.host_bandwidth, ready)
    return t.engine("in", to_device / hw.pcie_bandwidth, done) if to_device else done

  def branches(self, ins: HloInstruction) -> None:
    """A ``call`` runs its computation; a ``conditional`` its slowest branch."""
    if ins.opcode == "call":
      for c in ins.called:
        self.run(c, {})
      return
    start = (self.timeline, self.loops)
    ends = []
    for c in ins.called:
      self.timeline, self.loops = copy.deepcopy(start)
      self.run(c, {})
      ends.append((self.timeline.clock, self.timeline, self.loops))
    if ends:
      _, self.timeline, self.loops = max(ends, key=lambda e: e[0])
    else:
      self.timeline, self.loops = start

  def loop(self, ins: HloInstruction, carried: dict) -> dict:
    """Runs a ``while`` body trip by trip until two trips match, then adds the rest; returns what it carries out."""
    body = re.search(r"body=%?([\w.\-]+)", ins.rest)
    trips = ins.trip_count
    self.unknown_trip_counts += '"known_trip_count"' not in ins.rest
    name = body.group(1) if body else ins.name
    previous = None
    done = 0
    while done < trips:
      totals, loops = self.timeline.totals(), copy.deepcopy(self.loops)
      carried = self.run(name, carried)
      t = self.timeline  # a conditional in the body may have replaced it
      done += 1
      per_trip = tuple(b - a for a, b in zip(totals, t.totals()))
      _add_stats(self.loops, {name: [1.0, *per_trip[:4]]}, 1)
      now = (per_trip, t.state(carried))
      if previous is not None and _close(now, previous) and done < trips:
        carried = t.repeat(per_trip, trips - done, carried)
        _add_stats(self.loops, _stats_delta(loops, self.loops), trips - done)
        done = trips
      previous = now
    return carried


def _stats_delta(before: dict, after: dict) -> dict:
  return {k: [b - a for a, b in zip(before.get(k, [0.0] * 5), v)] for k, v in after.items()}


def _add_stats(loops: dict, delta: dict, times: int) -> None:
  for k, v in delta.items():
    loops[k] = [a + b * times for a, b in zip(loops.get(k, [0.0] * 5), v)]


def _host_to_host(ins: HloInstruction, shapes: dict) -> bool:
  """A copy whose source and destination are both in host memory (run by the host, not by a kernel)."""
  arrays = [ins.shape] + [shapes.get(o, "") for o in ins.operands]
  spaces = {h for a in arrays for h in in_host_memory(a)}
  return ins.opcode in ("copy", "dynamic-slice", "dynamic-update-slice") and spaces == {True}
