"""Every param and state leaf keeps its sharding through a step on a mesh (tests/sharding_script.py).

On 8 simulated CPU devices, a subset of tier x moment format x master x kernel
x path (each value at least once; ``python tests/sharding_script.py --all``
runs every combination): the results keep their input shardings and memory
kinds, each device holds its shards' bytes, the compiled step gathers nothing,
and the numbers are the one-device step's. Compiled for one DGX H200 node
(8 GPUs, deviceless), the 8-bit format in each tier: the compiled results'
shardings are the arguments', and each GPU's bytes are its shards'.
"""

import os
import subprocess
import sys

import pytest

from compile_flags import with_fast_compiles, without_fast_compiles

SCRIPT = os.path.join(os.path.dirname(__file__), "sharding_script.py")


def run_script(*args, fast_compiles=True):
  flags = "--xla_force_host_platform_device_count=8"
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=with_fast_compiles(flags) if fast_compiles else without_fast_compiles(flags))
  result = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=900)
  print(result.stdout)
  return result


@pytest.mark.xdist_group("tests/test_sharding.py:cpu")
def test_every_leaf_keeps_its_sharding_on_8_cpu_devices():
  result = run_script()
  assert result.returncode == 0 and "SHARDING OK" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.xdist_group("tests/test_sharding.py:gpu")
@pytest.mark.usefixtures("cuda_compiler_plugin")
def test_compiled_for_an_h200_node_every_result_keeps_its_sharding():
  # XLA's own optimization of the GPU program, as a user's compile gets it (tests/compile_flags.py).
  result = run_script("--gpu", fast_compiles=False)
  assert result.returncode == 0 and "GPU SHARDING OK" in result.stdout, (result.stdout[-4000:]
                                                                        + result.stderr[-4000:])
