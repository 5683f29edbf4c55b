"""Compile a JAX function for an NVIDIA GPU on a machine without one.

XLA:GPU can compile for a GPU it cannot see, given a ``GpuTargetConfig`` that
describes the chip. :func:`compile_for_gpu` traces a function on the running
backend (normally the CPU, which has ``pinned_host`` memory), lowers it for
CUDA, and compiles it with the compile-only client of a deviceless topology.
XLA:GPU's own passes then run for real, the host-offload passes included, and
the compiled executable tells how many bytes the program needs in device
memory and in host memory, and what it launches.

The result is a :class:`GpuCompileReport`: memory statistics split by memory
space, counts taken from the optimized HLO (kernels, Triton launches,
host<->device transfers, host calls, bytes read and written by the kernels),
the host-offloader fallback warnings XLA printed, and the HLO itself.

Example::

  import jax, jax.numpy as jnp
  from optax_hybrid import gpu_compile

  x = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)
  report = gpu_compile.compile_for_gpu(lambda a: jnp.sin(a) * 2, x, target="h100")
  report.device_peak_bytes  # 8388608: the argument and the result
  report.kernels            # 1: one fusion

Needs JAX's CUDA plugin (``jax-cuda12-plugin`` and ``jax-cuda12-pjrt``) of
the installed jaxlib's exact version; no GPU and no driver.
:func:`install_cuda_plugin` puts it in a cache directory
(:func:`cuda_plugin_dir`) outside the environment's site-packages, where only
this package loads it: the environment's other JAX programs never see it
(installed into the environment, JAX would load it in every process, and on a
machine without CUDA ``import jax`` logs CUDA errors). A plugin JAX already
loaded (installed with the ``gpu-compile`` extra) is used as it is.

Compile time, not run time: the figures say what XLA planned (buffers, kernels,
copies), not how fast the program runs or how much bandwidth it reaches.
An internal XLA check failure aborts the whole process: compile matrices of
programs in a subprocess.

The package's modules, none of which the optimizer imports:

* :mod:`~optax_hybrid.gpu_compile.targets`: the H100/H200 ``GpuTargetConfig``
  files (``gpu_targets/``) and :func:`load_target`.
* :mod:`~optax_hybrid.gpu_compile.plugin`: JAX's CUDA plugin in its cache
  directory (:func:`install_cuda_plugin`) and the deviceless topology.
* :mod:`~optax_hybrid.gpu_compile.deviceless`: :func:`compile_for_gpu` and
  :func:`compile_lowered`.
* :mod:`~optax_hybrid.gpu_compile.report`: :class:`GpuCompileReport`.
* :mod:`~optax_hybrid.gpu_compile.hlo`: reading the optimized HLO
  (:func:`count_hlo`, :func:`loop_transfers`...) and counting the Pallas
  launches of a lowered program (:func:`gpu_launches`).
* :mod:`~optax_hybrid.gpu_compile.thunks`: which instructions XLA runs from
  command buffers (CUDA graphs), read from the thunk plan it writes at
  compile time (:class:`CommandBuffers`).
* :mod:`~optax_hybrid.gpu_compile.step_time`: the step time estimated from
  the compiled schedule.
* :mod:`~optax_hybrid.gpu_compile.jaxpr_check`:
  :func:`host_arithmetic_outside_host_compute`, the same mistake the
  host-offloader warns of, found in a jaxpr without a compiler (also exported
  as ``optax_hybrid.host_arithmetic_outside_host_compute``).
"""

from optax_hybrid.gpu_compile import hlo, step_time, targets, thunks
from optax_hybrid.gpu_compile.deviceless import compile_for_gpu, compile_lowered
from optax_hybrid.gpu_compile.hlo import (
    HloInstruction,
    HloSummary,
    LoopTransfers,
    array_bytes,
    array_dims,
    collective_group_size,
    collective_of,
    collective_payload,
    count_hlo,
    gpu_launches,
    host_call_bytes,
    in_host_memory,
    is_host_call,
    loop_transfers,
    module_devices,
    parse_hlo,
    transfer_of,
)
from optax_hybrid.gpu_compile.jaxpr_check import host_arithmetic_outside_host_compute
from optax_hybrid.gpu_compile.plugin import GpuCompileError, cuda_plugin_dir, install_cuda_plugin
from optax_hybrid.gpu_compile.report import GpuCompileReport
from optax_hybrid.gpu_compile.targets import load_target, rematerialization_limit, target_device_memory_bytes
from optax_hybrid.gpu_compile.thunks import CommandBuffers, parse_thunk_plan, read_command_buffers

# Bound here as well as imported: Sphinx reads a constant's docstring from the module that documents it.
TARGETS = targets.TARGETS
"""The target names :func:`compile_for_gpu` accepts, and their files (:mod:`optax_hybrid.gpu_compile.targets`)."""
BOOKKEEPING_OPS = hlo.BOOKKEEPING_OPS
"""HLO opcodes that launch nothing and move nothing (:mod:`optax_hybrid.gpu_compile.hlo`)."""
COLLECTIVE_OPS = hlo.COLLECTIVE_OPS
"""HLO opcodes of collectives between GPUs (:mod:`optax_hybrid.gpu_compile.hlo`)."""

__all__ = [
    "BOOKKEEPING_OPS",
    "COLLECTIVE_OPS",
    "CommandBuffers",
    "GpuCompileError",
    "GpuCompileReport",
    "HloInstruction",
    "HloSummary",
    "LoopTransfers",
    "TARGETS",
    "array_bytes",
    "array_dims",
    "collective_group_size",
    "collective_of",
    "collective_payload",
    "compile_for_gpu",
    "compile_lowered",
    "count_hlo",
    "cuda_plugin_dir",
    "gpu_launches",
    "host_arithmetic_outside_host_compute",
    "host_call_bytes",
    "in_host_memory",
    "install_cuda_plugin",
    "is_host_call",
    "load_target",
    "loop_transfers",
    "module_devices",
    "parse_hlo",
    "parse_thunk_plan",
    "read_command_buffers",
    "rematerialization_limit",
    "step_time",
    "target_device_memory_bytes",
    "thunks",
    "transfer_of",
]
