"""Sharded params over 8 simulated CPU devices, in a subprocess (XLA_FLAGS must precede jax)."""

import os
import subprocess
import sys

from compile_flags import with_fast_compiles


def test_sharded_host_state_keeps_sharding_and_matches_single_device():
  env = dict(os.environ, XLA_FLAGS=with_fast_compiles("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
  script = os.path.join(os.path.dirname(__file__), "multidevice_script.py")
  result = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "MULTIDEVICE OK" in result.stdout
