import os
import sys

# Before anything imports jax: the tests run on the CPU backend. With the CUDA
# PJRT plugin installed (the `gpu-compile` extra, for tests/test_gpu_compile.py,
# which compiles for a GPU without one) JAX would otherwise try CUDA first and
# could change the default backend of every test. Subprocesses started by the
# tests inherit the variable. An explicit JAX_PLATFORMS (a GPU run) is kept.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The float64 NumPy references live beside the tests.
sys.path.insert(0, os.path.dirname(__file__))
