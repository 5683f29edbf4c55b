"""What XLA:GPU runs from command buffers (CUDA graphs): read from the thunk plan it writes at compile time.

XLA:GPU turns a compiled module into a sequence of *thunks* (a kernel launch,
a copy, a ``while`` driven by the host...) and then groups runs of them into
command buffers, which the host launches as one CUDA graph: the kernels of a
command buffer cost the host one launch between them, and a ``while`` inside
one runs every trip on the device without the host. Which runs XLA groups
depends on its flags (``--xla_gpu_enable_command_buffer``,
``--xla_gpu_graph_min_graph_size``), the target and the program; the
optimized HLO does not show it. XLA writes the plan it made when asked to dump
the executable (``--xla_gpu_experimental_dump_gpu_executable``): the thunk
sequence after its passes, each thunk by id, and the HLO instruction each id
stands for. :func:`read_command_buffers` reads those two files;
:func:`optax_hybrid.gpu_compile.compile_for_gpu` asks for them and keeps the
result in ``GpuCompileReport.command_buffers``.

A deviceless compile plans for the CUDA runtime the target names, not for a
driver: a real GPU's driver may let XLA capture more (a ``while`` loop as a
conditional node).
"""

from __future__ import annotations

import dataclasses
import os
import re

__all__ = ["CommandBuffers", "parse_thunk_plan", "read_command_buffers"]

# A thunk line: "<indent><id>: <kind> ...". Labels ("condition:", "body:") have no id.
_THUNK = re.compile(r"^(\s*)(\d+): (k\w+)")
_ANNOTATION = re.compile(r'profile_annotation: "([^"]+)"\s*thunk_id: (\d+)')
# The sequence after XLA's thunk passes (command buffers formed), else the one before them.
_SEQUENCE_SUFFIXES = (".thunk_sequence_after_thunk_passes.txt", ".thunk_sequence.txt")
_METADATA_SUFFIX = ".thunk_metadata.txt"


@dataclasses.dataclass(frozen=True)
class CommandBuffers:
  """The instructions XLA:GPU runs from command buffers (:func:`parse_thunk_plan`).

  Attributes:
    members: the HLO instructions (by name) that run inside a command buffer:
      the host does not launch them one by one.
    launched_at: per command buffer, its first member: where the host
      launches the buffer (one launch per run of the computation holding it).
    captured_loops: the ``while`` instructions that run inside a command
      buffer: the device runs their trips without the host.
    buffers: how many command buffers the plan has (each counted once).
  """

  members: frozenset = frozenset()
  launched_at: frozenset = frozenset()
  captured_loops: frozenset = frozenset()
  buffers: int = 0


def parse_thunk_plan(sequence: str, metadata: str) -> CommandBuffers:
  """Reads XLA's thunk sequence (after its passes) and metadata into :class:`CommandBuffers`.

  Args:
    sequence: the text of ``*.thunk_sequence_after_thunk_passes.txt``: one
      thunk per line, nested thunks (a command buffer's, a loop's body)
      indented under theirs.
    metadata: the text of ``*.thunk_metadata.txt``: each thunk id's
      ``profile_annotation``, the HLO instruction's name.

  Returns:
    The command buffers' members, launch points and captured loops.
  """
  names = {int(thunk_id): name for name, thunk_id in _ANNOTATION.findall(metadata)}
  members, launched_at, loops = set(), set(), set()
  stack: list[list] = []  # [indent, kind, awaiting its first member]
  buffers = 0
  for line in sequence.splitlines():
    match = _THUNK.match(line)
    if not match:
      continue
    indent, kind, name = len(match.group(1)), match.group(3), names.get(int(match.group(2)))
    while stack and stack[-1][0] >= indent:
      stack.pop()
    enclosing = [entry for entry in stack if entry[1] == "kCommandBuffer"]
    if enclosing and name is not None:
      members.add(name)
      if enclosing[-1][2]:
        launched_at.add(name)
        enclosing[-1][2] = False
      if kind == "kWhile":
        loops.add(name)
    buffers += kind == "kCommandBuffer"
    stack.append([indent, kind, kind == "kCommandBuffer"])
  return CommandBuffers(frozenset(members), frozenset(launched_at), frozenset(loops), buffers)


def read_command_buffers(dump_dir: str) -> CommandBuffers | None:
  """The command buffers of the module XLA dumped into ``dump_dir``; None when it wrote no thunk plan.

  XLA writes the sequence after its thunk passes only where they changed it;
  otherwise the sequence it wrote first is the plan (no command buffer).

  Args:
    dump_dir: a directory XLA dumped one compile into (``--xla_dump_to``
      with ``--xla_gpu_experimental_dump_gpu_executable``).

  Returns:
    :class:`CommandBuffers` of the last module dumped, or None.
  """
  metadata = sorted(f for f in os.listdir(dump_dir) if f.endswith(_METADATA_SUFFIX))
  if not metadata:
    return None
  stem = metadata[-1][:-len(_METADATA_SUFFIX)]
  sequences = [os.path.join(dump_dir, stem + suffix) for suffix in _SEQUENCE_SUFFIXES]
  sequence = next((path for path in sequences if os.path.exists(path)), None)
  if sequence is None:
    return None
  with open(sequence) as f, open(os.path.join(dump_dir, metadata[-1])) as g:
    return parse_thunk_plan(f.read(), g.read())
