"""How long a compiled GPU program's step takes, estimated from XLA's optimized, scheduled HLO.

XLA:GPU schedules a module before it emits it: the instructions of each
computation are listed in the order the GPU's compute stream runs them, with
each asynchronous host<->device copy split into a start and a done. This
module replays that schedule on a model of one GPU of a node, and of the host
thread that launches its work:

* **Launches.** The host issues each piece of work (a kernel, a copy, a
  collective, a host computation) one after the other, ``launch_seconds``
  each, ahead of the GPU by at most ``launch_queue`` launches on the compute
  stream; work cannot start before it is issued. A command
  buffer (a CUDA graph: runs of kernels XLA groups, read from the thunk plan
  it wrote at compile time, :mod:`optax_hybrid.gpu_compile.thunks`) costs one
  launch for all its members.
* **Kernels** run one after the other on the compute stream, each at its
  roofline: :math:`\\max(F / \\text{peak}, B / \\text{HBM})`, with :math:`F`
  the flops of the dots and convolutions it contains (:math:`2 m n k`, read
  off the shapes) and :math:`B` the bytes it reads and writes (a fusion that
  reads only a slice of an operand counts the slice; one that updates a
  buffer in place counts the update).
* **Host<->device copies** run on one copy engine per direction, each taking
  ``copy_latency_seconds`` plus its bytes at ``pcie_bandwidth``, first come
  first served; their bytes also cross host memory, of which this GPU gets
  ``host_memory_bandwidth / gpus_per_node`` (every GPU of the node runs the
  same step at once), shared with the host computations. An asynchronous
  copy starts when the stream reaches its start (and the host has issued it)
  and the stream waits at its done, so a copy overlaps compute only between
  its start and its done in the schedule. A synchronous copy holds the stream.
* **Host computations** (XLA's host compute, host callbacks) read and write
  their operands in host memory at this GPU's share, after their device
  inputs have crossed to the host and before their device outputs cross back.
* **Collectives** run at ``nvlink_bandwidth * nccl_efficiency`` per direction
  (a ring: an all-reduce moves :math:`2 (n - 1) / n` of its bytes, an
  all-gather or a reduce-scatter :math:`(n - 1) / n`, ``n`` read from the
  replica groups in every form XLA prints them).
* **Loops** run their body once per trip (the known trip count; 1 when XLA
  does not know it, counted in ``unknown_trip_counts``). The host drives a
  loop trip by trip unless the loop runs inside a command buffer; where XLA
  does not know the trip count, each trip's predicate is copied to the host,
  which waits for it (``copy_latency_seconds + while_trip_seconds``) before it
  launches the next trip. Once two successive trips leave the machine in the
  same state, the remaining trips repeat them and are added without being
  replayed. A ``conditional`` outside a command buffer waits for its branch
  index the same way.

The result, a :class:`StepTime`, gives the estimated step, the time each
resource is busy, the lower bound
:math:`\\max(\\text{compute}, \\text{bus in}, \\text{bus out},
\\text{host memory}, \\text{collectives}, \\text{launches})` that a perfect
overlap would reach, how much of the time the bus is busy a kernel runs
beside it (``bus_hidden``), and what the host launched.

What the model leaves out, and which way each omission errs:
docs/step_time.md. A GPU's measurement (``benchmarks/gpu_check.py``) is the
judge.

Example::

  import jax, jax.numpy as jnp
  from optax_hybrid import gpu_compile
  from optax_hybrid.gpu_compile import step_time

  x = jax.ShapeDtypeStruct((8192, 8192), jnp.bfloat16)
  report = gpu_compile.compile_for_gpu(lambda a, b: a @ b, x, x, target="h200")
  estimate = step_time.estimate(report, step_time.H200_SXM)
  estimate.seconds   # 3.8e-6 + 2 * 8192**3 / 989e12 = 1.116e-3: one launch, then the matmul
"""

from __future__ import annotations

import collections
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
    collective_group_size,
    collective_of,
    collective_payload,
    host_call_bytes,
    in_host_memory,
    is_host_call,
    module_devices,
    parse_hlo,
    transfer_of,
)
from optax_hybrid.gpu_compile.thunks import CommandBuffers

__all__ = ["H100_SXM", "H200_SXM", "HARDWARE", "Hardware", "LoopTime", "StepTime", "estimate", "kernel_seconds"]

_RATES = ("peak_flops", "hbm_bandwidth", "pcie_bandwidth", "nvlink_bandwidth", "host_memory_bandwidth")
_OVERHEADS = ("launch_seconds", "while_trip_seconds", "copy_latency_seconds")


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The figures a step-time estimate takes from the machine (SI units: FLOP/s, bytes/s, seconds).

  Every field but ``name`` is a keyword. The four overheads have defaults
  measured on NVIDIA hardware (the sources are public; docs/step_time.md has
  the table):

  Attributes:
    name: what the figures describe.
    peak_flops: tensor-core peak per GPU for the dots and convolutions.
    hbm_bandwidth: device memory bandwidth per GPU, for every other kernel.
    pcie_bandwidth: host<->device copy bandwidth per GPU and direction (one
      copy engine each way, both running at once).
    nvlink_bandwidth: GPU<->GPU bandwidth per GPU and direction.
    host_memory_bandwidth: the node's host memory bandwidth (all its
      sockets), which its GPUs' copies and host computations share.
    gpus_per_node: the GPUs sharing it, all running the same step at once:
      each gets ``host_memory_bandwidth / gpus_per_node``.
    launch_seconds: the host's time to issue one piece of work (a kernel, a
      copy, a collective; a command buffer as a whole). Default 3.8 us:
      NVIDIA's "Getting Started with CUDA Graphs" (2019), short kernels
      issued back to back on a V100 ran at one per 3.8 us.
    launch_queue: how many launches on the compute stream the host may be
      ahead of the GPU before a launch blocks it. Default 1024: OneFlow's
      report (Oneflow-Inc/oneflow pull request 890) that past 1,024 pending
      kernels in a stream the launches block.
    while_trip_seconds: the host's wait for the device, per trip of a loop
      whose trip count XLA does not know (and per ``conditional``), once the
      predicate's copy has arrived. Default 5.8 us: the same measurement with
      a stream synchronization after each kernel took 9.6 us per kernel.
    copy_latency_seconds: the fixed time of one host<->device copy on its
      engine. Default 6 us: NVIDIA's GDRCopy README, "a cudaMemcpy can incur
      in a 6-7us overhead".
    nccl_efficiency: the share of ``nvlink_bandwidth`` a collective's ring
      reaches. Default 0.8: nccl-tests' all_gather and all_reduce bus
      bandwidth on 8 H100 over NVLink saturates at 360 GB/s of 450, "exactly
      what we'd expect on H100" (NVIDIA/nccl-tests issue 326).

  Raises:
    ValueError: a bandwidth that is not a positive finite number, an overhead
      that is negative or not finite, ``gpus_per_node`` not a positive int,
      ``nccl_efficiency`` outside (0, 1] (the message names the field).
  """

  name: str
  _: dataclasses.KW_ONLY
  peak_flops: float
  hbm_bandwidth: float
  pcie_bandwidth: float
  nvlink_bandwidth: float
  host_memory_bandwidth: float
  gpus_per_node: int
  launch_seconds: float = 3.8e-6
  launch_queue: int = 1024
  while_trip_seconds: float = 5.8e-6
  copy_latency_seconds: float = 6e-6
  nccl_efficiency: float = 0.8

  def __post_init__(self):
    for name in _RATES + _OVERHEADS + ("nccl_efficiency",):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not -math.inf < value < math.inf:
        raise ValueError(f"Hardware: `{name}` must be a finite number; got {value!r}.")
    for name in _RATES:
      if getattr(self, name) <= 0:
        raise ValueError(f"Hardware: `{name}` must be a positive number (per second); got {getattr(self, name)!r}.")
    for name in _OVERHEADS:
      if getattr(self, name) < 0:
        raise ValueError(f"Hardware: `{name}` must be 0 or more seconds; got {getattr(self, name)!r}.")
    if not 0 < self.nccl_efficiency <= 1:
      raise ValueError(f"Hardware: `nccl_efficiency` must be in (0, 1]; got {self.nccl_efficiency!r}.")
    for name in ("gpus_per_node", "launch_queue"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"Hardware: `{name}` must be a positive int; got {value!r}.")

  @property
  def host_memory_share(self) -> float:
    """The host memory bandwidth one GPU's copies and host computations get: ``host_memory_bandwidth / gpus_per_node``."""
    return self.host_memory_bandwidth / self.gpus_per_node


H200_SXM = Hardware(
    "H200 SXM in a DGX H200, PCIe 5 x16",
    peak_flops=989e12,       # dense BF16 tensor cores (NVIDIA H200 datasheet; 1,979 with sparsity)
    hbm_bandwidth=4.8e12,    # HBM3e, 141 GB (datasheet)
    pcie_bandwidth=55e9,     # PCIe 5 x16: 64 GB/s per direction in theory; 52.8 measured device->host on H100
                             # (nvbandwidth, NVIDIA/nvbandwidth issue 24)
    nvlink_bandwidth=450e9,  # NVLink 4: 900 GB/s per GPU, both directions together
    host_memory_bandwidth=2 * 8 * 4800e6 * 8,  # DGX H200: two Xeon Platinum 8480C, 8 DDR5-4800 channels each
    gpus_per_node=8,                           # (DGX H200 datasheet; Intel ARK): 614.4 GB/s in theory
)
"""NVIDIA H200 SXM, one of the eight of a DGX H200 (sources: docs/step_time.md)."""

H100_SXM = dataclasses.replace(H200_SXM, name="H100 SXM in a DGX H100, PCIe 5 x16", hbm_bandwidth=3.35e12)
"""NVIDIA H100 SXM: the H200's chip with 80 GB of HBM3 at 3.35 TB/s (a DGX H100 has the same CPUs and memory)."""

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
    launches: what the host issued for it (kernels, copies, collectives,
      command buffers), over all its trips.
    kernels: the kernels its trips ran, those of loops in its body included.
    inner_trips: trips of the loops in its body that the host drives, over
      its trips.
  """

  body: str
  trips: int
  seconds: float
  compute: float
  bus_in: float
  bus_out: float
  launches: int
  kernels: int = 0
  inner_trips: int = 0


@dataclasses.dataclass(frozen=True)
class StepTime:
  """A step-time estimate (:func:`estimate`). Times in seconds.

  Attributes:
    seconds: the estimated step: when the compute stream finishes its last
      instruction (having waited for every launch, copy, host call and
      collective it depends on).
    compute: the kernels' time (each at its roofline).
    bus_in, bus_out: the host->device and device->host copy engines' busy time.
    host: the host computations' time (at this GPU's share of host memory).
    host_memory: this GPU's share of host memory busy: its copies' bytes and
      its host computations.
    collectives: NVLink's busy time.
    launch_time: the host's time issuing work (``launches`` times
      ``launch_seconds``).
    launch_wait: of ``seconds``, the time the compute stream waited for the
      host to issue its next kernel (launches, and loop predicates read back).
    bus_busy: the time at least one copy engine is busy.
    bus_hidden: of ``bus_busy``, the time a kernel runs at the same moment.
    flops: the dots' and convolutions' flops per step, recomputation included.
    kernels: kernels run per step.
    launches: pieces of work the host issued per step (a command buffer counts one).
    loop_trips: trips of loops the host drives (those outside command buffers).
    loops: per ``while`` body, slowest first.
    unknown_trip_counts: loops whose trip count XLA does not know (counted once).
    command_buffers_read: whether XLA's thunk plan was read (otherwise every
      kernel is taken to be launched alone).
    hardware: the :class:`Hardware` assumed.
  """

  seconds: float
  compute: float
  bus_in: float
  bus_out: float
  host: float
  host_memory: float
  collectives: float
  launch_time: float
  launch_wait: float
  bus_busy: float
  bus_hidden: float
  flops: float
  kernels: int
  launches: int
  loop_trips: int
  loops: tuple[LoopTime, ...]
  unknown_trip_counts: int
  command_buffers_read: bool
  hardware: Hardware

  @property
  def lower_bound(self) -> float:
    """``max(compute, bus_in, bus_out, host_memory, collectives, launch_time)``: the step if everything overlapped."""
    return max(self.compute, self.bus_in, self.bus_out, self.host_memory, self.collectives, self.launch_time)

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


def estimate(hlo: Any, hardware: Hardware | str = H200_SXM, command_buffers: CommandBuffers | None = None) -> StepTime:
  """Estimates one run of a compiled program from its optimized, scheduled HLO (rules: the module's docstring).

  Args:
    hlo: the optimized HLO text (``GpuCompileReport.hlo``, or on a GPU
      ``jax.jit(f).lower(*args).compile().as_text()``), or a
      :class:`~optax_hybrid.gpu_compile.GpuCompileReport` (its
      ``command_buffers`` used).
    hardware: a :class:`Hardware` or a name of :data:`HARDWARE`.
    command_buffers: what XLA runs from command buffers
      (:func:`optax_hybrid.gpu_compile.thunks.read_command_buffers`); None:
      the report's, or for plain text none (every kernel launched alone).

  Returns:
    A :class:`StepTime`.

  Raises:
    ValueError: ``hlo`` has no entry computation (not an HLO module's text),
      or ``hardware`` is an unknown name.

  Example::

    report = gpu_compile.compile_for_gpu(train_step, params, state, batch, target="h200", donate_argnums=(0, 1))
    t = step_time.estimate(report)
    t.seconds, t.lower_bound, t.bus_hidden_fraction, t.launches
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
  plan = command_buffers if command_buffers is not None else getattr(hlo, "command_buffers", None)
  replay = _Replay(computations, hardware, plan, module_devices(text))
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


def _collective_seconds(opcode: str, group: int, nbytes: float, bandwidth: float) -> float:
  """A ring collective's time: what each GPU sends, at ``bandwidth`` per direction."""
  if opcode.startswith("collective-permute"):
    return nbytes / bandwidth
  share = (group - 1) / group
  return (2 * share if opcode.startswith("all-reduce") else share) * nbytes / bandwidth


# --- the replay ------------------------------------------------------------------

_ENGINES = ("in", "out", "memory", "net")  # copy engines, this GPU's share of host memory, NVLink
_COUNTS = ("flops", "kernels", "launches", "trips", "launch_wait", "bus_busy", "bus_hidden")


class _Timeline:
  """The compute stream's and the host's clocks, when each engine is next free, and what each resource did so far."""

  def __init__(self, hardware: Hardware):
    self.hardware = hardware
    self.clock = 0.0  # the compute stream
    self.host = 0.0  # when the host has issued everything so far
    self.buffer_issued = 0.0  # when the host launched the command buffer now running
    self.free = dict.fromkeys(_ENGINES, 0.0)
    self.busy = dict.fromkeys(("compute", "host") + _ENGINES, 0.0)
    self.count = dict.fromkeys(_COUNTS, 0.0)
    self.bus: list[list[float]] = []  # the copy engines' busy intervals (merged) not yet behind the clock
    self.queue: collections.deque = collections.deque(maxlen=hardware.launch_queue)  # the last launches' starts

  def issue(self, starts_buffer: bool = False, on_stream: bool = False) -> float:
    """The host issues one piece of work (or a command buffer); returns when it is issued.

    Work for the compute stream waits for a place in its queue: the launch ``launch_queue`` before it must
    have started.
    """
    if on_stream and len(self.queue) == self.queue.maxlen:
      self.host = max(self.host, self.queue[0])
    self.host += self.hardware.launch_seconds
    self.count["launches"] += 1
    if starts_buffer:
      self.buffer_issued = self.host
    return self.host

  def compute(self, seconds: float, flops: float, issued: float, queued: bool) -> None:
    """A kernel: it starts once the stream is free and the host has issued it; bus time beside it is hidden.

    ``queued``: the host launched it (alone, or as its command buffer's first kernel): it takes a place in the
    launch queue until it starts.
    """
    start = max(self.clock, issued)
    if queued:
      self.queue.append(start)
    end = start + seconds
    self.count["launch_wait"] += start - self.clock
    self.count["bus_hidden"] += sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.bus)
    self.clock = end
    self.busy["compute"] += seconds
    self.count["flops"] += flops
    self.count["kernels"] += 1
    self._forget()

  def engine(self, name: str, seconds: float, not_before: float) -> float:
    """Work on an engine, first come first served, from ``not_before`` on; returns when it ends."""
    start = max(not_before, self.free[name])
    end = self.free[name] = start + seconds
    self.busy[name] += seconds
    if name in ("in", "out") and seconds > 0:
      self._add_bus(start, end)
    return end

  def transfer(self, direction: str, nbytes: float, not_before: float) -> float:
    """A host<->device copy: its engine (latency, then the link) and its bytes through host memory; when it ends."""
    hw = self.hardware
    link = self.engine(direction, hw.copy_latency_seconds + nbytes / hw.pcie_bandwidth, not_before)
    return max(link, self.engine("memory", nbytes / hw.host_memory_share, not_before))

  def host_compute(self, nbytes: float, not_before: float) -> float:
    """A host computation reading and writing ``nbytes`` in host memory; when it ends."""
    seconds = nbytes / self.hardware.host_memory_share
    self.busy["host"] += seconds
    return self.engine("memory", seconds, not_before)

  def read_back(self) -> None:
    """The host waits for a predicate the stream computed (a loop's, a conditional's) before it issues more."""
    hw = self.hardware
    self.host = max(self.host, self.clock + hw.copy_latency_seconds) + hw.while_trip_seconds

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
    self.count["bus_busy"] += sum(e - s for s, e in self.bus) - before

  def _forget(self) -> None:
    self.bus = [[s, e] for s, e in self.bus if e > self.clock]

  def totals(self) -> dict:
    return {"clock": self.clock, **{"busy." + k: v for k, v in self.busy.items()}, **self.count}

  def state(self, carried: dict) -> tuple:
    """What the next trip depends on, relative to the clock (a host further ahead than one launch does not matter)."""
    ahead = lambda t: max(0.0, t - self.clock)
    lead = self.hardware.launch_seconds
    return (tuple(ahead(t) for t in self.free.values()), ahead(self.host + lead), ahead(self.buffer_issued + lead),
            tuple(max(s, self.host) - self.clock for s in self.queue),
            tuple((s - self.clock, e - self.clock) for s, e in self.bus),
            tuple(sorted((j, ahead(t)) for j, t in carried.items())))

  def repeat(self, per_trip: dict, times: int, carried: dict) -> dict:
    """Adds ``times`` more trips that each add ``per_trip`` (a difference of :meth:`totals`); shifts the clocks."""
    shift = per_trip["clock"] * times
    self.clock += shift
    self.host += shift
    self.buffer_issued += shift
    for name in self.free:
      self.free[name] += shift
    for name in self.busy:
      self.busy[name] += per_trip["busy." + name] * times
    for name in self.count:
      self.count[name] += per_trip[name] * times
    self.bus = [[s + shift, e + shift] for s, e in self.bus]
    self.queue = collections.deque((s + shift for s in self.queue), maxlen=self.queue.maxlen)
    return {j: t + shift for j, t in carried.items()}


def _close(a: Any, b: Any) -> bool:
  if isinstance(a, tuple):
    return isinstance(b, tuple) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
  if isinstance(a, dict):
    return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
  return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


_LOOP_FIELDS = {"seconds": "clock", "compute": "busy.compute", "bus_in": "busy.in", "bus_out": "busy.out",
                "launches": "launches", "kernels": "kernels", "inner_trips": "trips"}  # LoopTime field -> totals() key


class _Replay:
  """Runs the schedule of a module on a :class:`_Timeline`."""

  def __init__(self, computations: dict, hardware: Hardware, plan: CommandBuffers | None, devices: int):
    self.computations = computations
    self.hardware = hardware
    self.plan = plan if plan is not None else CommandBuffers()
    self.plan_read = plan is not None
    self.devices = devices
    self.costs = _Costs(computations, hardware)
    self.timeline = _Timeline(hardware)
    self.loops: dict[str, dict] = {}  # body -> {"trips": ..., LoopTime field: ...}
    self.unknown_trip_counts = 0

  def result(self) -> StepTime:
    t, hw = self.timeline, self.hardware
    loops = sorted((LoopTime(body, int(round(v["trips"])), v["seconds"], v["compute"], v["bus_in"], v["bus_out"],
                             int(round(v["launches"])), int(round(v["kernels"])), int(round(v["inner_trips"])))
                    for body, v in self.loops.items()), key=lambda x: -x.seconds)
    launches = int(round(t.count["launches"]))
    return StepTime(seconds=t.clock, compute=t.busy["compute"], bus_in=t.busy["in"], bus_out=t.busy["out"],
                    host=t.busy["host"], host_memory=t.busy["memory"], collectives=t.busy["net"],
                    launch_time=launches * hw.launch_seconds, launch_wait=t.count["launch_wait"],
                    bus_busy=t.count["bus_busy"], bus_hidden=t.count["bus_hidden"], flops=t.count["flops"],
                    kernels=int(round(t.count["kernels"])), launches=launches,
                    loop_trips=int(round(t.count["trips"])), loops=tuple(loops),
                    unknown_trip_counts=self.unknown_trip_counts, command_buffers_read=self.plan_read, hardware=hw)

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

  def launched(self, ins: HloInstruction) -> bool:
    """Does the host launch ``ins`` (alone, or as its command buffer's first member)?"""
    return ins.name not in self.plan.members or ins.name in self.plan.launched_at

  def issued(self, ins: HloInstruction, on_stream: bool = False) -> float:
    """When the host has issued ``ins``: launched alone, with its command buffer, or as a member of one.

    ``on_stream``: work of the compute stream (a kernel), which waits for a place in the launch queue.
    """
    if not self.launched(ins):
      return self.timeline.buffer_issued
    return self.timeline.issue(starts_buffer=ins.name in self.plan.launched_at, on_stream=on_stream)

  def instruction(self, ins: HloInstruction, shapes: dict, pending: dict, tuples: dict) -> None:
    t, op = self.timeline, ins.opcode
    if op.endswith("-done"):
      t.wait(pending.pop(ins.operands[0], t.clock) if ins.operands else t.clock)
    elif op == "while":
      tuples[ins.name] = self.loop(ins, tuples.get(ins.operands[0], {}))
    elif op in ("call", "conditional") and not is_host_call(ins):
      self.branches(ins)
    elif op in BOOKKEEPING_OPS or op.endswith("-update") or op in ("send", "recv"):
      pass
    else:
      end = self.work(ins, shapes)
      if op.endswith("-start"):
        pending[ins.name] = end
      else:
        t.wait(end)

  def ready(self, ins: HloInstruction, on_stream: bool = False) -> float:
    """When ``ins`` may start: the stream has reached it and the host has issued it."""
    return max(self.timeline.clock, self.issued(ins, on_stream))

  def work(self, ins: HloInstruction, shapes: dict) -> float:
    """Issued work: a host call, a transfer, a collective, a host-memory copy or a kernel.

    Returns when it ends (a kernel: when the stream is done with it).
    """
    t, hw = self.timeline, self.hardware
    collective = collective_of(ins, self.computations)
    if ins.opcode == "async-start" and collective is None:
      for c in ins.called:  # work XLA wrapped to run asynchronously: issued and counted on the compute stream
        self.run(c, {})
      return t.clock
    if is_host_call(ins):
      return self.host_call(ins, shapes, self.ready(ins))
    moved = transfer_of(ins, shapes)
    if moved is not None:
      return t.transfer("in" if moved[0] else "out", sum(moved), self.ready(ins))
    if collective is not None:
      opcode, group = collective.opcode.removesuffix("-start"), collective_group_size(collective.rest, self.devices)
      seconds = _collective_seconds(opcode, group, collective_payload(ins, shapes),
                                    hw.nvlink_bandwidth * hw.nccl_efficiency)
      return t.engine("net", seconds, self.ready(ins))
    if _host_to_host(ins, shapes):
      return t.engine("memory", self.costs.kernel_bytes(ins, shapes) / hw.host_memory_share, self.ready(ins))
    t.compute(*self.costs.kernel_seconds(ins, shapes), self.ready(ins, on_stream=True), self.launched(ins))
    return t.clock

  def host_call(self, ins: HloInstruction, shapes: dict, ready: float) -> float:
    """A host computation: device inputs cross out, the host reads and writes, device outputs cross in."""
    t = self.timeline
    to_device, to_host = host_call_bytes(ins)
    nbytes = array_bytes(ins.shape) + (0 if ins.opcode.endswith("-start") else
                                       sum(array_bytes(shapes.get(o, "")) for o in ins.operands))
    inputs = t.transfer("out", to_host, ready) if to_host else ready
    done = t.host_compute(nbytes, inputs)
    return t.transfer("in", to_device, done) if to_device else done

  def branches(self, ins: HloInstruction) -> None:
    """A ``call`` runs its computation; a ``conditional`` its slowest branch, after the host reads its index."""
    if ins.opcode == "call":
      for c in ins.called:
        self.run(c, {})
      return
    if ins.name not in self.plan.members:
      self.timeline.read_back()
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

  def trip(self, ins: HloInstruction, body: str, carried: dict) -> dict:
    """One trip of a loop: its predicate read back by the host if XLA does not know the trip count, then its body."""
    host_driven = ins.name not in self.plan.members
    if host_driven and '"known_trip_count"' not in ins.rest:
      condition = re.search(r"condition=%?([\w.\-]+)", ins.rest)
      if condition:
        self.run(condition.group(1), {})
      self.timeline.read_back()
    carried = self.run(body, carried)
    self.timeline.count["trips"] += host_driven
    return carried

  def loop(self, ins: HloInstruction, carried: dict) -> dict:
    """Runs a ``while`` body trip by trip until two trips match, then adds the rest; returns what it carries out."""
    body = re.search(r"body=%?([\w.\-]+)", ins.rest)
    trips = ins.trip_count
    self.unknown_trip_counts += '"known_trip_count"' not in ins.rest
    if ins.name in self.plan.launched_at:  # a command buffer that begins with this loop
      self.issued(ins)
    name = body.group(1) if body else ins.name
    previous = None
    done = 0
    while done < trips:
      totals, loops = self.timeline.totals(), copy.deepcopy(self.loops)
      carried = self.trip(ins, name, carried)
      t = self.timeline  # a conditional in the body may have replaced it
      done += 1
      per_trip = {k: b - totals[k] for k, b in t.totals().items()}
      _add_stats(self.loops, {name: _loop_stats(per_trip, ins.name not in self.plan.members)}, 1)
      now = (per_trip, t.state(carried))
      if previous is not None and _close(now, previous) and done < trips:
        carried = t.repeat(per_trip, trips - done, carried)
        _add_stats(self.loops, _stats_delta(loops, self.loops), trips - done)
        done = trips
      previous = now
    return carried


def _loop_stats(per_trip: dict, host_driven: bool) -> dict:
  stats = {"trips": 1.0, **{field: per_trip[key] for field, key in _LOOP_FIELDS.items()}}
  stats["inner_trips"] -= host_driven  # the trip itself
  return stats


def _stats_delta(before: dict, after: dict) -> dict:
  zero = dict.fromkeys(("trips", *_LOOP_FIELDS), 0.0)
  return {k: {f: x - before.get(k, zero)[f] for f, x in v.items()} for k, v in after.items()}


def _add_stats(loops: dict, delta: dict, times: int) -> None:
  for k, v in delta.items():
    current = loops.setdefault(k, dict.fromkeys(v, 0.0))
    for f, x in v.items():
      current[f] += x * times


def _host_to_host(ins: HloInstruction, shapes: dict) -> bool:
  """A copy whose source and destination are both in host memory (run by the host, not by a kernel)."""
  arrays = [ins.shape] + [shapes.get(o, "") for o in ins.operands]
  spaces = {h for a in arrays for h in in_host_memory(a)}
  return ins.opcode in ("copy", "dynamic-slice", "dynamic-update-slice") and spaces == {True}
