"""One plan per model in any process (issue 44): tests/one_plan_script.py in subprocesses of 1, 2 and 8 devices.

XLA_FLAGS (the device count) must be set before JAX starts, hence the
subprocesses.
"""

import os
import subprocess
import sys

import pytest

from compile_flags import with_fast_compiles

SCRIPT = os.path.join(os.path.dirname(__file__), "one_plan_script.py")


def run(devices, *args):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=with_fast_compiles(f"--xla_force_host_platform_device_count={devices}"))
  result = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
  return result.stdout


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_abstract_and_concrete_inits_give_one_plan_and_one_compile(devices):
  out = run(devices, "plans")
  assert "PLANS OK" in out
  assert "equal plans: one device" in out and "one compile: one device" in out
  if devices > 1:
    assert f"equal plans: split over {devices} (Explicit axes)" in out


def test_fsdp_checkpoint_with_streamed_layers_resumes_from_an_eval_shape_target_bit_for_bit(tmp_path):
  assert "SAVED" in run(8, "save", str(tmp_path))
  assert "RESUMED BIT FOR BIT" in run(8, "resume", str(tmp_path))
