"""Tests for optax_hybrid.checkpoint: memory kinds, exact resume, interrupted saves."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import optax_hybrid  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "checkpoint_script.py")


def run_script(*args, expect_rc=0):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == expect_rc, result.stdout + result.stderr
  return result.stdout


def load(path):
  with np.load(path) as f:
    return [f[k] for k in sorted(f.files, key=lambda k: int(k.split("_")[1]))]


def test_resume_in_a_new_process_is_bit_identical(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  full = run_script("train", "--dir", ckpt, "--steps", "8", "--save-at", "4", "--out", str(tmp_path / "full.npz"))
  resumed = run_script("train", "--dir", ckpt, "--steps", "8", "--resume", "--out", str(tmp_path / "resumed.npz"))
  # Step 2 had a NaN and was skipped: 4 steps run, count 3, one skipped.
  assert "RESTORED step=4 count=3 skipped=1" in resumed
  assert "DONE count=7 skipped=1" in full and "DONE count=7 skipped=1" in resumed
  a, b = load(tmp_path / "full.npz"), load(tmp_path / "resumed.npz")
  assert len(a) == len(b) > 0
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
  ckpt = str(tmp_path / "ckpt")
  # The script kills itself once the temporary directory of step 2's save
  # exists (it waits for it: the save is asynchronous), never before.
  out = run_script("kill", "--dir", ckpt, expect_rc=-9)
  assert "KILLING during" in out, out
  leftovers = [name for name in os.listdir(ckpt) if name.startswith("2") and "tmp" in name]
  assert leftovers, os.listdir(ckpt)  # the kill really hit the save of step 2 midway
  manager = optax_hybrid.checkpoint.manager(ckpt)
  assert manager.latest_step() == 1
  restored = optax_hybrid.checkpoint.restore(manager, like={"x": jnp.zeros(10)})
  np.testing.assert_array_equal(np.asarray(restored["x"]), np.arange(10.0))
  with pytest.raises(FileNotFoundError, match="step 2"):
    optax_hybrid.checkpoint.restore(manager, like={"x": jnp.zeros(10)}, step=2)


def test_round_trip_keeps_memory_kinds_in_process(tmp_path):
  params = jax.device_put({"w": jnp.arange(12.0).reshape(3, 4), "b": jnp.ones(4)}, jax.devices()[0])
  tx = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind=lambda path, p: "pinned_host" if p.ndim == 2 else "device")
  state = tx.init(params)
  _, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  manager = optax_hybrid.checkpoint.manager(tmp_path / "c")
  optax_hybrid.checkpoint.save(manager, 1, state, wait=True)
  # Restore into an abstract target built without allocating: tx.init on shapes.
  abstract = tx.init(optax_hybrid.checkpoint.abstract_like(params))
  restored = optax_hybrid.checkpoint.restore(manager, like=abstract)
  assert restored.mu["w"].sharding.memory_kind == "pinned_host"
  # The array's type agrees, so jit traces it as a host value (Orbax alone
  # returns host-sharded arrays typed as device memory).
  assert "<host>" in str(jax.typeof(restored.mu["w"]))
  assert restored.mu["b"].sharding.memory_kind == "device"
  assert restored.count.committed and int(restored.count) == 1
  chex.assert_trees_all_equal(jax.device_get(restored.nu), jax.device_get(state.nu))
  # A donated step on the restored state keeps the moments on the host.
  step = jax.jit(lambda g, s, p: tx.update(g, s, p)[1], donate_argnums=(1,),
                 out_shardings=jax.tree.map(lambda x: x.sharding, restored))
  stepped = step(jax.tree.map(jnp.ones_like, params), restored, params)
  assert stepped.mu["w"].sharding.memory_kind == "pinned_host"
  with pytest.raises(FileNotFoundError):
    optax_hybrid.checkpoint.restore(optax_hybrid.checkpoint.manager(tmp_path / "empty"), like=state)
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="not a directory"):
    optax_hybrid.checkpoint.manager(tmp_path / "file")
