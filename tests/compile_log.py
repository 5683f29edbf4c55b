"""Counting compilations as a user sees them: the records ``jax.log_compiles`` makes.

With ``jax_log_compiles`` on, JAX logs ``Compiling jit(<name>) with global shapes
and types ...`` (logger ``jax._src.interpreters.pxla``) each time it lowers and
compiles a program, and only then. A jitted function's ``_cache_size()`` counts
its dispatch cache's entries instead, which is not the same thing: two entries
can share one compiled program (arguments whose shardings differ only in
trailing ``None`` s of a ``PartitionSpec``, under FSDP), so the count here is
the one a user who sets ``JAX_LOG_COMPILES=1`` reads.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Iterator

import jax

_COMPILING = re.compile(r"^Compiling (\S+) with ")


class CompileLog(logging.Handler):
  """The names of the programs compiled while it listens (``"jit(train_step)"``), in order."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.names: list[str] = []

  def emit(self, record: logging.LogRecord) -> None:
    match = _COMPILING.match(record.getMessage())
    if match:
      self.names.append(match.group(1))

  def count(self, function_name: str) -> int:
    """How many times a jitted function of this ``__name__`` was compiled."""
    return self.names.count(f"jit({function_name})")


@contextlib.contextmanager
def compile_log() -> Iterator[CompileLog]:
  """Listens to JAX's compile records (``jax.log_compiles``) for the duration; they are not printed."""
  handler = CompileLog()
  logger = logging.getLogger("jax")
  propagate = logger.propagate
  logger.addHandler(handler)
  logger.propagate = False  # the records are counted here, not printed on stderr
  try:
    with jax.log_compiles(True):
      yield handler
  finally:
    logger.removeHandler(handler)
    logger.propagate = propagate
