"""The XLA flag that makes the tests' CPU compilations faster, and how to leave it out.

Most of the suite's time is XLA:CPU compiling small programs, and most of a
compilation is LLVM optimizing the generated code. ``tests/conftest.py`` adds
:data:`FAST_CPU_COMPILE` to ``XLA_FLAGS`` before JAX starts (subprocesses
inherit it): LLVM then compiles without optimizing: 30% less CPU time for
files of small programs, 13% for the whole suite (docs/records/testing.md). The
programs are the same HLO (XLA's own passes, fusion, layouts, buffer
assignment and memory kinds do not depend on it: the optimized HLO text and
``memory_analysis()`` of a hybrid_adamw step are identical with and without
it). Their machine code is slower, and a multiply-add is rounded twice instead
of once in an FMA, which changes some float32 results as another CPU or
compiler would: bit-identical for float32 params; on three
bf16-with-fp32-master steps, one float32 ulp of the values' scale (5.96e-8 at
0.51), more ulps only for a moment that cancels to near zero. The suite
compares against float64 references with float32 tolerances of 1e-6 or more,
or compares programs compiled the same way.

A test that measures what XLA makes of a program for a real target (the GPU
compilations of tests/test_gpu_compile.py) compiles without it
(:func:`without_fast_compiles`).

Example::

    env = dict(os.environ, XLA_FLAGS=with_fast_compiles("--xla_force_host_platform_device_count=8"))
"""

from __future__ import annotations

FAST_CPU_COMPILE = "--xla_backend_optimization_level=0"
_FLAG_NAME = FAST_CPU_COMPILE.split("=", 1)[0]


def with_fast_compiles(xla_flags: str) -> str:
  """``xla_flags`` plus :data:`FAST_CPU_COMPILE`, unless it already sets the optimization level.

  Args:
    xla_flags: an ``XLA_FLAGS`` value (flags separated by spaces; may be empty).

  Returns:
    The flags, with an optimization level chosen by the caller kept as it is.
  """
  flags = xla_flags.split()
  if not any(f.split("=", 1)[0] == _FLAG_NAME for f in flags):
    flags.append(FAST_CPU_COMPILE)
  return " ".join(flags)


def without_fast_compiles(xla_flags: str) -> str:
  """``xla_flags`` without :data:`FAST_CPU_COMPILE` (other flags, and other levels, kept).

  Args:
    xla_flags: an ``XLA_FLAGS`` value.

  Returns:
    The flags XLA's own default optimization applies to.
  """
  return " ".join(f for f in xla_flags.split() if f != FAST_CPU_COMPILE)
