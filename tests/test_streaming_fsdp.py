"""Streamed layers under FSDP over 8 devices: scan_layers and step_in_backward (tests/streaming_fsdp_script.py).

On 8 CPU devices the steps equal one device's and keep every leaf's sharding;
compiled for one DGX H200 node, each GPU's host memory grows per layer by its
eighth of the layer's params and state and its device memory by its eighth of
the saved carry.
"""

import os
import subprocess
import sys

import pytest

from compile_flags import with_fast_compiles, without_fast_compiles

SCRIPT = os.path.join(os.path.dirname(__file__), "streaming_fsdp_script.py")


def run_script(flag):
  flags = "--xla_force_host_platform_device_count=8"
  # The GPU compile as a user's gets it (XLA's own optimization: tests/compile_flags.py).
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=without_fast_compiles(flags) if flag == "--gpu" else with_fast_compiles(flags))
  result = subprocess.run([sys.executable, SCRIPT, flag], env=env, capture_output=True, text=True, timeout=900)
  print(result.stdout)
  return result


@pytest.mark.xdist_group("tests/test_streaming_fsdp.py:cpu")
def test_streamed_fsdp_steps_equal_one_device_and_keep_their_shardings():
  result = run_script("--cpu")
  assert result.returncode == 0 and "FSDP CPU OK" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]


@pytest.mark.xdist_group("tests/test_streaming_fsdp.py:gpu")
@pytest.mark.usefixtures("cuda_compiler_plugin")
def test_on_an_h200_node_each_gpu_grows_by_its_share_of_a_layer():
  result = run_script("--gpu")
  assert result.returncode == 0 and "FSDP GPU OK" in result.stdout, result.stdout[-4000:] + result.stderr[-4000:]
