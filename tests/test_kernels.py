"""Tests for optax_hybrid.kernels: kernel selection and the reference rule on one leaf."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from optax_hybrid import kernels
from optax_hybrid.kernels import reference


def test_auto_and_xla_resolve_to_the_reference_rule():
  assert kernels.resolve_kernel("auto") is reference.update_leaves
  assert kernels.resolve_kernel("xla") is reference.update_leaves
  with pytest.raises(NotImplementedError, match="kernel='pallas'"):
    kernels.resolve_kernel("pallas")
  with pytest.raises(ValueError, match="'auto', 'xla', 'pallas'"):
    kernels.resolve_kernel("triton")


@pytest.mark.parametrize("adamw_mode,bias_correction,decay", list(itertools.product([True, False], repeat=3)))
def test_leaf_update_against_float64(adamw_mode, bias_correction, decay):
  rng = np.random.default_rng(3)
  p, g, m, v = (rng.normal(size=11) for _ in range(4))
  v = np.abs(v)
  count, lr, b1, b2, eps, wd = 6, 0.03, 0.8, 0.97, 1e-6, 0.2
  s = reference.step_scalars(jnp.int32(count), lr, b1, b2, eps, wd, bias_correction)
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  u, m_new, v_new = reference.adam_leaf_update(
      f32(g), f32(m), f32(v), f32(p), s, adamw_mode=adamw_mode, decay=decay, update_dtype=jnp.float32)
  # Float64, step t = count + 1, written out from the rule.
  t = count + 1
  g64 = g + wd * p if (decay and not adamw_mode) else g
  m64 = b1 * m + (1 - b1) * g64
  v64 = b2 * v + (1 - b2) * g64**2
  bc1, bc2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
  u64 = -lr / bc1 * m64 / (np.sqrt(v64) / np.sqrt(bc2) + eps)
  if decay and adamw_mode:
    u64 -= lr * wd * p
  np.testing.assert_allclose(np.asarray(m_new), m64, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(v_new), v64, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(u), u64, rtol=1e-5, atol=1e-8)


def test_negative_learning_rate_gives_the_raw_direction():
  s = reference.step_scalars(jnp.int32(0), -1.0, 0.9, 0.999, 0.0, 0.0, True)
  u, _, _ = reference.adam_leaf_update(jnp.array([3.0, -2.0]), jnp.zeros(2), jnp.zeros(2), None, s,
                                       adamw_mode=True, decay=False, update_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(u), [1.0, -1.0], rtol=1e-6)
