"""Reading XLA's optimized HLO text: instructions, array shapes, and what a program launches and moves.

:func:`parse_hlo` splits a module into computations of :class:`HloInstruction`
s; :func:`count_hlo` counts its kernels, host<->device transfers and host
calls; :func:`loop_transfers` reads which slice copies of a loop overlap its
kernels. :func:`gpu_launches` counts the Pallas GPU kernels of a program
lowered for CUDA, before any compile.
"""

from __future__ import annotations

import dataclasses
import math
import re

__all__ = [
    "BOOKKEEPING_OPS",
    "COLLECTIVE_OPS",
    "HloInstruction",
    "HloSummary",
    "LoopTransfers",
    "array_bytes",
    "array_dims",
    "collective_group_size",
    "collective_of",
    "collective_payload",
    "count_hlo",
    "gpu_launches",
    "host_call_bytes",
    "in_host_memory",
    "is_host_call",
    "loop_transfers",
    "module_devices",
    "parse_hlo",
    "transfer_of",
]

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4,
                "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16,
                "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1, "f8e4m3b11fnuz": 1,
                "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\](\{[^}]*\})?")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\((.*)$")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")

BOOKKEEPING_OPS = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "add-dependency",
    "opt-barrier", "partition-id", "replica-id", "iota-free", "domain",
})
"""Opcodes that launch nothing on the device and move nothing: they only name or regroup buffers."""

COLLECTIVE_OPS = frozenset({"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                            "collective-permute", "collective-broadcast"})
"""Opcodes of collectives between GPUs (each also has an asynchronous ``-start`` / ``-done`` form)."""

# Ops that launch nothing: bookkeeping, control flow (its bodies are walked),
# and the asynchronous transfers and host calls (counted apart).
_NOT_KERNELS = BOOKKEEPING_OPS | frozenset({
    "while", "conditional", "call",
    "copy-start", "copy-done", "call-start", "call-done", "async-start", "async-update", "async-done",
    "custom-call-update", "custom-call-done",
    "send", "send-done", "recv", "recv-done",
})
_CONTROL_FLOW = frozenset({"while", "conditional", "call"})
_TRANSFER_OPS = frozenset({"copy", "dynamic-slice", "dynamic-update-slice"})
# Custom calls that run on the host: XLA's host compute (``HostExecute``) and
# Python callbacks (``jax.pure_callback``, ``io_callback``).
_HOST_CALLBACK_TARGETS = ("HostExecute", "callback", "HostCompute")
# The custom call a Pallas kernel written for Triton lowers to.
_TRITON_CALL = "__gpu$xla.gpu.triton"


@dataclasses.dataclass(frozen=True)
class HloInstruction:
  """One instruction of an HLO computation, as :func:`parse_hlo` reads it.

  Attributes:
    name: its name, without the ``%``.
    shape: its result shape as written (``bf16[4,8]{1,0:S(5)}``, a tuple...).
    opcode: ``fusion``, ``copy-start``, ``while``...
    rest: the text after the opcode's ``(``: operands, then attributes.
  """

  name: str
  shape: str
  opcode: str
  rest: str

  @property
  def operands(self) -> list[str]:
    """The names of its operands, in order."""
    return _operand_names(self.rest)

  @property
  def called(self) -> list[str]:
    """The computations it calls (fusion, loop body and condition, branches, reducers)."""
    return _called(self.rest)

  @property
  def trip_count(self) -> int:
    """A ``while`` op's known trip count, 1 when XLA does not know it."""
    return _trip_count(self.rest)

  @property
  def target(self) -> str | None:
    """A custom call's target (``__cublas$gemm``...), None for other ops."""
    match = re.search(r'custom_call_target="([^"]+)"', self.rest)
    return match.group(1) if match else None


def array_bytes(text: str) -> int:
  """Bytes of every array shape in ``text`` (a shape or a tuple of shapes)."""
  total = 0.0
  for dtype, dims, _ in _ARRAY.findall(text):
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * _DTYPE_BYTES[dtype]
  return int(total)


def in_host_memory(shape: str) -> list[bool]:
  """Per array in ``shape``: is its layout in host memory space ``S(5)``?"""
  return ["S(5)" in (layout or "") for _, _, layout in _ARRAY.findall(shape)]


def array_dims(shape: str) -> list[tuple[int, ...]]:
  """The dimensions of every array in ``shape`` (a shape or a tuple of shapes), in order."""
  return [tuple(int(d) for d in dims.split(",") if d) for _, dims, _ in _ARRAY.findall(shape)]


def parse_hlo(text: str) -> tuple[dict[str, list[HloInstruction]], str | None]:
  """Splits HLO module text into computations of instructions; returns them and the entry's name.

  A scheduled module (``is_scheduled=true``, as ``hlo_modules()`` of a
  compiled executable gives it) lists each computation's instructions in the
  order they run.

  Args:
    text: HLO module text.

  Returns:
    ``({computation name: [HloInstruction, ...]}, entry name or None)``.
  """
  computations: dict[str, list[HloInstruction]] = {}
  entry = None
  current = None
  for line in text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m and not line.startswith("HloModule"):
        current = m.group(2)
        computations[current] = []
        if m.group(1):
          entry = current
      continue
    if line.startswith("}"):  # "}" or, closing a host computation, '}, execution_thread="host"'
      current = None
      continue
    m = _INSTRUCTION.match(line)
    if m:
      computations[current].append(HloInstruction(*m.groups()))
  return computations, entry


def _operand_names(rest: str) -> list[str]:
  depth, end = 1, len(rest)
  for i, c in enumerate(rest):
    depth += (c == "(") - (c == ")")
    if depth == 0:
      end = i
      break
  return re.findall(r"%([\w.\-]+)", rest[:end])


def _called(rest: str) -> list[str]:
  names = []
  for key in ("calls", "to_apply", "body", "condition", "branch_computations", "true_computation",
              "false_computation"):
    for m in re.finditer(key + r"=\{?([^,}\s]+(?:,\s*%[\w.\-]+)*)\}?", rest):
      names += re.findall(r"%?([\w.\-]+)", m.group(1))
  return names


@dataclasses.dataclass(frozen=True)
class HloSummary:
  """What the optimized HLO launches. See :func:`count_hlo` for the rules."""

  kernels: int
  triton_launches: int
  transfers: int
  host_calls: int
  kernel_bytes: int
  kernel_ops: dict
  transfer_bytes: int = 0
  to_device_bytes: int = 0
  to_host_bytes: int = 0
  collective_bytes: dict = dataclasses.field(default_factory=dict)


def collective_of(ins: HloInstruction, computations: dict) -> HloInstruction | None:
  """The collective ``ins`` starts or is (itself, or the one an ``async-start`` wraps), None for others."""
  if ins.opcode.removesuffix("-start") in COLLECTIVE_OPS:
    return ins
  if ins.opcode == "async-start":
    return next((i for c in ins.called for i in computations.get(c, []) if i.opcode in COLLECTIVE_OPS), None)
  return None


def collective_payload(ins: HloInstruction, shapes: dict) -> int:
  """The bytes a collective (or its ``-start`` / ``async-start``) gathers, scatters or reduces on one GPU.

  The larger of its operands and its result: an asynchronous start's tuple
  shape holds both, each counted alone.
  """
  parts = _top_level(ins.shape) + [shapes.get(o, "") for o in ins.operands]
  return max(array_bytes(part) for part in parts)


def module_devices(text: str) -> int:
  """The devices one program of the module runs on together: its ``replica_count`` times its ``num_partitions``.

  Read from the ``HloModule`` line (XLA leaves out a count of 1).
  """
  header = next((line for line in text.splitlines() if line.startswith("HloModule")), "")
  counts = [re.search(key + r"=(\d+)", header) for key in ("replica_count", "num_partitions")]
  return math.prod(int(c.group(1)) for c in counts if c)


# mesh[<axis sizes>][, device_ids=(<iota>)] {<axes grouped>}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^{}]*)\}")


def collective_group_size(rest: str, devices: int) -> int:
  """How many devices take part in each group of a collective, from its ``replica_groups``.

  XLA prints the groups in several forms, all read here:

  * explicit lists, ``replica_groups={{0,1,2,3},{4,5,6,7}}``: the first group's length;
  * iota, ``replica_groups=[2,4]<=[8]`` (or ``<=[4,2]T(1,0)``): the second dimension;
  * mesh axes, ``replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}`` or
    ``mesh['axis_0'=1,'axis_1'=4,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_1'}``
    (collectives the SPMD partitioner inserts): the product of the sizes of
    the axes named in braces (a sub-axis ``'axis_0':(1)2`` by its own size);
  * none, ``replica_groups={}``: every device of the program.

  Args:
    rest: the collective's text after its opcode (:attr:`HloInstruction.rest`).
    devices: the program's devices (:func:`module_devices`), for ``{}``.

  Returns:
    The group size (``devices`` when the instruction has no groups).
  """
  mesh = _MESH_GROUPS.search(rest)
  if mesh:
    sizes = {name: int(size) for name, size in re.findall(r"'([^']+)'=(\d+)", mesh.group(1))}
    named = re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", mesh.group(2))
    return math.prod(int(sub) if sub else sizes.get(name, 1) for name, sub in named)
  iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", rest)
  if iota:
    return int(iota.group(1))
  groups = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
  if groups:
    return len([g for g in groups.group(1).split(",") if g])
  return devices


def _top_level(shape: str) -> list[str]:
  """The elements of a tuple shape ``(a, (b, c), d)``; ``[shape]`` for an array shape."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  parts, depth, begin = [], 0, 1
  for i, c in enumerate(shape):
    depth += (c in "({[") - (c in ")}]")
    if (c == "," and depth == 1) or (depth == 0 and c == ")"):
      parts.append(shape[begin:i].strip())
      begin = i + 1
  return [p for p in parts if p]


def _trip_count(rest: str) -> int:
  """A ``while`` op's known trip count (its backend config), 1 when XLA does not know it."""
  match = re.search(r'"known_trip_count":\{"n":"(\d+)"', rest)
  return int(match.group(1)) if match else 1


def _moved(nbytes: int, to_host: bool) -> tuple[int, int]:
  """``(to_device, to_host)`` bytes of one transfer."""
  return (0, nbytes) if to_host else (nbytes, 0)


def transfer_of(ins: HloInstruction, shapes: dict) -> tuple[int, int] | None:
  """``(to_device, to_host)`` bytes a transfer instruction moves across the link, None if it is no transfer."""
  operands = [shapes.get(o, "") for o in _operand_names(ins.rest)]
  if ins.opcode == "copy-start":  # (destination, source, context)
    destination = _top_level(ins.shape)[0]
    return _moved(array_bytes(operands[0] if operands else ""), any(in_host_memory(destination)))
  wrapped = re.search(r"calls=%?wrapped_dynamic-(update-)?slice", ins.rest) if ins.opcode == "fusion-start" else None
  if wrapped:
    # An asynchronous slice copy: ((operands...), result, context).
    parts = _top_level(ins.shape)
    result = parts[1] if len(parts) > 2 else ""
    # Read from the computation it calls: an operand's name may say "dynamic-update-slice" too (a slice of
    # a buffer just updated in place).
    if wrapped.group(1):  # the update (operand 1) into a buffer in the result's memory
      update = operands[1] if len(operands) > 1 else ""
      if any(in_host_memory(update)) != any(in_host_memory(result)):
        return _moved(array_bytes(update), any(in_host_memory(result)))
      return None
    source = operands[0] if operands else ""
    if any(in_host_memory(source)) != any(in_host_memory(result)):
      return _moved(array_bytes(result), any(in_host_memory(result)))
    return None
  if ins.opcode in _TRANSFER_OPS:
    spaces = set(in_host_memory(ins.shape)) | {h for o in operands for h in in_host_memory(o)}
    if len(spaces) > 1:
      moved = operands[1:2] if ins.opcode == "dynamic-update-slice" else [ins.shape]
      return _moved(sum(array_bytes(x) for x in moved), any(in_host_memory(ins.shape)))
  return None


def is_host_call(ins: HloInstruction) -> bool:
  """Does ``ins`` run a computation on the host CPU?

  XLA's host compute (a ``call``/``call-start`` whose backend config says
  ``DEVICE_TYPE_HOST``, or a custom call to ``HostExecute``) and custom calls
  to Python callbacks (``jax.pure_callback``, ``io_callback``).
  """
  host_device = "DEVICE_TYPE_HOST" in ins.rest
  if ins.opcode in ("call-start", "call"):
    return host_device
  return ins.opcode in ("custom-call", "custom-call-start") and (
      host_device or any(t in (ins.target or "") for t in _HOST_CALLBACK_TARGETS))


def host_call_bytes(ins: HloInstruction) -> tuple[int, int]:
  """``(to_device, to_host)`` bytes a host call reads from and writes into device memory.

  An asynchronous host call's shape is ``((inputs...), (outputs...), context)``:
  an input in device memory is read across the link, an output in device
  memory is written across it (a new param the host computed, say).
  """
  parts = _top_level(ins.shape)
  if ins.opcode not in ("call-start", "custom-call-start") or len(parts) < 2:
    return 0, 0
  device_bytes = lambda group: sum(array_bytes(x) for x in _top_level(group) if not any(in_host_memory(x)))
  return device_bytes(parts[1]), device_bytes(parts[0])


def count_hlo(text: str) -> HloSummary:
  """Counts the device kernels, transfers and host calls of an optimized HLO module.

  Rules:

  * The entry computation and the bodies of its control flow (``while``,
    ``conditional``, ``call``) run on the device. Each of their instructions
    is a kernel launch unless it is bookkeeping (parameter, constant, tuple,
    get-tuple-element, bitcast, barrier), control flow, or asynchronous
    (``copy-start``/``copy-done``, asynchronous slice copies, host
    ``call-start``/``call-done``, send/recv). So fusions, custom calls
    (cuBLAS, cuDNN, Triton — the Pallas kernels are
    ``__gpu$xla.gpu.triton`` custom calls), collectives and any unfused op (a
    ``copy``, a ``sort``) each count one. Counts are static: an instruction
    inside a ``while`` body counts once, not per trip.
  * ``triton_launches``: custom calls to ``__gpu$xla.gpu.triton`` and fusions
    that XLA emits with Triton (``"kind":"__triton..."``).
  * ``transfers``: host<->device copies: every ``copy-start`` (XLA:GPU emits
    them only between memory spaces), asynchronous ``dynamic-slice`` /
    ``dynamic-update-slice`` copies between the memory spaces (a layer's slice
    brought in from a stack in host memory, a gradient slice written out), and
    synchronous ``copy``, ``dynamic-slice`` and ``dynamic-update-slice`` ops
    whose operands and result are not all in the same memory space (layout
    ``S(5)`` is host memory). Synchronous ones are kernels too.
  * ``host_calls``: computations run on the host CPU: XLA host compute
    (``custom-call-start`` to ``HostExecute``, or any call whose backend config
    says ``DEVICE_TYPE_HOST``) and custom calls to Python host callbacks
    (``jax.pure_callback``, ``io_callback``). Not kernels.
  * ``kernel_ops`` names a ``copy`` between two host-memory buffers
    ``"copy (host->host)"``: a copy of host state that a program updating it
    in place would not make.
  * ``kernel_bytes``: over the kernels, the bytes of their operands plus their
    results: a compile-time proxy for the memory traffic. It overcounts
    in-place updates of part of a buffer and ignores caching.
  * ``collective_bytes``: per collective (``all-gather``, ``reduce-scatter``,
    ``all-reduce``...), the bytes of the whole buffer it gathers, scatters or
    reduces, as one GPU holds it (the larger of its operands and its result):
    an all-gather's *result*, a reduce-scatter's *operand*, an all-reduce's
    operand (its result's size); an instruction inside a ``while`` body once
    per trip. What crosses NVLink is a ring's share of it (``(n - 1) / n``,
    twice for an all-reduce): :mod:`optax_hybrid.gpu_compile.step_time`.
  * ``to_device_bytes``, ``to_host_bytes``: the bytes that cross the
    host-device link per step in each direction: each transfer's payload (a
    ``copy-start``'s operand; a slice copy's slice; a synchronous transfer's
    result, or the update of a ``dynamic-update-slice``), plus what host calls
    read from and write into device memory; an instruction inside a ``while``
    body counts once per trip (the loop's known trip count).
    ``transfer_bytes`` is their sum.

  Args:
    text: the optimized HLO module(s) as text (``exe.hlo_modules()``'s
      ``to_string()``).

  Returns:
    An :class:`HloSummary`; ``kernel_ops`` maps each kernel opcode (custom
    calls by target) to its count.
  """
  computations, entry = parse_hlo(text)
  kernels = triton = transfers = host_calls = kernel_bytes = to_device = to_host = 0
  ops: dict[str, int] = {}
  collectives: dict[str, int] = {}
  if entry is None:
    return HloSummary(0, 0, 0, 0, 0, {})
  seen = set()
  todo = [(entry, 1)]  # (computation, trips per step)
  while todo:
    name, trips = todo.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    shapes = {ins.name: ins.shape for ins in computations[name]}
    for ins in computations[name]:
      if is_host_call(ins):
        host_calls += 1
        down, up = host_call_bytes(ins)
        to_device, to_host = to_device + trips * down, to_host + trips * up
        continue
      if ins.opcode in _CONTROL_FLOW:
        inner = trips * _trip_count(ins.rest) if ins.opcode == "while" else trips
        todo += [(called, inner) for called in _called(ins.rest)]
        continue
      collective = collective_of(ins, computations)
      if collective is not None:
        key = collective.opcode.removesuffix("-start")
        collectives[key] = collectives.get(key, 0) + trips * collective_payload(ins, shapes)
      moved = transfer_of(ins, shapes)
      if moved is not None:
        transfers += 1
        to_device, to_host = to_device + trips * moved[0], to_host + trips * moved[1]
      if ins.opcode in _NOT_KERNELS or ins.opcode in ("fusion-done",) or (
          ins.opcode == "fusion-start" and moved is not None):
        continue
      operands = [shapes.get(o, "") for o in _operand_names(ins.rest)]
      if ins.opcode in ("custom-call", "custom-call-start"):
        key = f"custom-call {ins.target or '?'}"
        triton += ins.target == _TRITON_CALL
      else:
        key = ins.opcode
        triton += ins.opcode == "fusion" and '"kind":"__triton' in ins.rest
      if ins.opcode in _TRANSFER_OPS and {h for x in [ins.shape] + operands for h in in_host_memory(x)} == {True}:
        key += " (host->host)"
      kernels += 1
      ops[key] = ops.get(key, 0) + 1
      kernel_bytes += array_bytes(ins.shape) + sum(array_bytes(o) for o in operands)
  return HloSummary(kernels, triton, transfers, host_calls, kernel_bytes, dict(sorted(ops.items())),
                    to_device + to_host, to_device, to_host, dict(sorted(collectives.items())))


@dataclasses.dataclass(frozen=True)
class LoopTransfers:
  """The host->device slice copies of one ``while`` body, in schedule order (:func:`loop_transfers`).

  Attributes:
    body: the body computation's name.
    trips: its known trip count (1 when unknown).
    fetches: the asynchronous slice copies into device memory it starts.
    overlapped: how many of them have a device kernel scheduled between their
      start and their done: the copy runs while the device computes.
    carried: how many of them are used only in the next trip (their result
      goes to the loop's carry, not to this trip's arithmetic): a prefetch.
  """

  body: str
  trips: int
  fetches: int
  overlapped: int
  carried: int


def loop_transfers(text: str) -> list[LoopTransfers]:
  """The slice copies host -> device of each ``while`` body of an optimized (scheduled) HLO module.

  XLA schedules a module before it emits it, so the order of a computation's
  instructions in the text is the order they run in. A body that fetches the
  next trip's slice while it computes on this trip's shows ``carried`` copies
  that are ``overlapped``.

  Args:
    text: the optimized HLO module(s) as text.

  Returns:
    One :class:`LoopTransfers` per ``while`` body that fetches anything.
  """
  computations, _ = parse_hlo(text)
  trips = {}
  for instructions in computations.values():
    for ins in instructions:
      if ins.opcode == "while":
        for body in re.findall(r"body=%?([\w.\-]+)", ins.rest):
          trips[body] = _trip_count(ins.rest)
  out = []
  for body, count in trips.items():
    instructions = computations.get(body, [])
    shapes = {ins.name: ins.shape for ins in instructions}
    users: dict[str, list[str]] = {}
    for ins in instructions:
      for operand in _operand_names(ins.rest):
        users.setdefault(operand, []).append(ins.name)
    root = instructions[-1].name if instructions else None
    position = {ins.name: k for k, ins in enumerate(instructions)}
    fetches = overlapped = carried = 0
    for k, ins in enumerate(instructions):
      moved = transfer_of(ins, shapes) if ins.opcode == "fusion-start" else None
      if not moved or not moved[0]:
        continue
      fetches += 1
      done = next((u for u in users.get(ins.name, []) if u.startswith(ins.name.replace("-start", "-done"))
                   or "done" in u), None)
      if done is None:
        continue
      between = instructions[k + 1:position[done]]
      overlapped += any(i.opcode in ("fusion", "custom-call") and "wrapped_dynamic" not in i.rest for i in between)
      # Follow bitcasts and copies: a prefetch reaches the root tuple (the next trip) without arithmetic.
      frontier, reaches_root, computes = [done], False, False
      while frontier:
        name = frontier.pop()
        for user in users.get(name, []):
          opcode = instructions[position[user]].opcode
          if user == root:
            reaches_root = True
          elif opcode in ("bitcast", "copy", "get-tuple-element", "tuple"):
            frontier.append(user)
          else:
            computes = True
      carried += reaches_root and not computes
    if fetches:
      out.append(LoopTransfers(body, count, fetches, overlapped, carried))
  return out


def gpu_launches(lowered_text: str) -> int:
  """The number of Pallas GPU kernel launches in StableHLO text lowered for CUDA (before XLA compiles it).

  Each launch is a custom call to ``__gpu$xla.gpu.triton``; counted from
  ``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()``,
  it needs no CUDA plugin.
  """
  return lowered_text.count(f"@{_TRITON_CALL}") + lowered_text.count(f'"{_TRITON_CALL}"')
