"""Builds the native CPU kernel (optax_hybrid/kernels/native_cpu.cc) at install time.

Everything else is declared in pyproject.toml. The kernel is an XLA FFI handler
compiled against the headers that jaxlib ships (``jax.ffi.include_dir()``). If it
cannot be built (no C++ compiler, an unsupported platform), installation still
succeeds: the package then uses its XLA path and says so once at run time.

It is compiled without ``-march``, so a wheel (``python -m build``) runs on any
CPU of its architecture. On x86-64 its work loop is compiled four times, for
AVX-512 with and without VBMI, AVX2 and the baseline (``target`` attributes in
native_cpu.cc), and the library picks the widest one the CPU runs when it
loads; the environment variable ``OPTAX_HYBRID_NATIVE_ISA`` (``auto``,
``avx512vbmi``, ``avx512``, ``avx2``, ``baseline``) forces one, and ``optax_hybrid.kernels.native_cpu.isa()`` says
which runs.
"""

import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNativeKernel(build_ext):

  def build_extension(self, ext):
    try:
      import jax.ffi

      ext.include_dirs.append(jax.ffi.include_dir())
      super().build_extension(ext)
    except Exception as e:  # noqa: BLE001 - any failure means "no native kernel", never "no install"
      print(f"optax_hybrid: the native CPU kernel was not built ({e}); the XLA path will be used.",
            file=sys.stderr)


native_kernel = Extension(
    "optax_hybrid.kernels._native_cpu",
    sources=["optax_hybrid/kernels/native_cpu.cc"],
    language="c++",
    # No -march: the library runs on any CPU of the architecture, and the kernel
    # picks its instruction set when it loads (AVX-512, AVX2 or the baseline on
    # x86-64: a copy of the work loop compiled for each, see native_cpu.cc).
    extra_compile_args=["-O3", "-std=c++17", "-fno-math-errno", "-w"],
    optional=True,
)

setup(ext_modules=[native_kernel], cmdclass={"build_ext": BuildNativeKernel})
