"""Property-based tests: random pytrees and hyperparameters against the float64 model.

Bounded for CI: a fixed number of examples, derandomized, with a per-example
deadline generous enough for one jit compilation.
"""

import datetime

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

import optax_hybrid
from numpy_reference import adamw_steps

settings.register_profile(
    "optax_hybrid", max_examples=25, deadline=datetime.timedelta(seconds=20), derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("optax_hybrid")

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Relative to the size of each step: storage rounding of the dtype, two steps.
TOLERANCE = {np.dtype(jnp.float32): 2e-5, np.dtype(jnp.bfloat16): 4e-2, np.dtype(jnp.float16): 5e-3}

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=4).map(tuple)
leaves = st.tuples(shapes, st.sampled_from(sorted(DTYPES)))
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(st.text("abcdef", min_size=1, max_size=3), children, max_size=3)),
    max_leaves=6)

hyperparameters = st.fixed_dictionaries({
    "learning_rate": st.floats(0.0, 0.1),
    "b1": st.floats(0.0, 0.99),
    "b2": st.floats(0.5, 0.999),
    "eps": st.floats(1e-8, 1e-3),
    "weight_decay": st.floats(0.0, 0.5),
    "bias_correction": st.booleans(),
    "adamw_mode": st.booleans(),
    "state_memory_kind": st.sampled_from([None, "pinned_host"]),
})


def is_spec(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)


def materialize(spec_tree, seed):
  rng = np.random.default_rng(seed)
  make = lambda spec: jnp.asarray(rng.normal(size=spec[0]) * 3, DTYPES[spec[1]])
  params = jax.tree.map(make, spec_tree, is_leaf=is_spec)
  grads = [jax.tree.map(make, spec_tree, is_leaf=is_spec) for _ in range(2)]
  return params, grads


def check_close(ours, ref, scale, dtype):
  ours = np.asarray(ours, np.float64)
  # Plus the dtype's smallest step near zero: a float16 update of 1e-8 is 0 or 6e-8.
  bound = TOLERANCE[np.dtype(dtype)] * scale + 2 * float(ml_dtypes.finfo(dtype).smallest_subnormal)
  assert np.all(np.abs(ours - ref) <= bound), np.max(np.abs(ours - ref) - bound)


@given(trees, hyperparameters, st.integers(0, 2**31 - 1))
def test_two_steps_equal_the_float64_model(spec_tree, hp, seed):
  params, grads = materialize(spec_tree, seed)
  tx = optax_hybrid.hybrid_adamw(**hp)
  state = tx.init(params)
  update = jax.jit(tx.update)
  p = params
  ours_updates = []
  for g in grads:
    u, state = update(g, state, p)
    ours_updates.append(u)
    p = optax_hybrid.apply_updates(p, u)

  leaves_p = jax.tree.leaves(params)
  keys = [str(i) for i in range(len(leaves_p))]
  as64 = lambda tree: {k: np.asarray(x, np.float64) for k, x in zip(keys, jax.tree.leaves(tree))}
  kw = {k: hp[k] for k in ("b1", "b2", "eps", "weight_decay", "bias_correction", "adamw_mode")}
  lr = hp["learning_rate"]
  # Step 1 from the params as stored; step 2 from the params our step 1 produced.
  (ref1,), m1, v1 = adamw_steps(as64(params), [as64(grads[0])], [lr], **kw)
  p1 = as64(optax_hybrid.apply_updates(params, ours_updates[0]))
  for i, (k, leaf) in enumerate(zip(keys, leaves_p)):
    u64 = ref1[k] - as64(params)[k]
    check_close(jax.tree.leaves(ours_updates[0])[i], u64, np.abs(u64) + lr * (1 + np.abs(as64(params)[k])), leaf.dtype)
  # Moments after two steps, each leaf in its storage dtype.
  state_m, state_v = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  b1, b2 = kw["b1"], kw["b2"]
  for i, (k, leaf) in enumerate(zip(keys, leaves_p)):
    g2 = as64(grads[1])[k]
    if not kw["adamw_mode"]:
      g2 = g2 + kw["weight_decay"] * p1[k]
    m2 = b1 * m1[k] + (1 - b1) * g2
    v2 = b2 * v1[k] + (1 - b2) * g2 * g2
    check_close(state_m[i], m2, np.abs(m1[k]) + np.abs(g2), leaf.dtype)
    check_close(state_v[i], v2, v1[k] + g2 * g2, leaf.dtype)
  assert int(state.count) == 2


@given(trees, hyperparameters, st.integers(0, 2**31 - 1))
def test_structure_dtypes_jit_and_no_recompile(spec_tree, hp, seed):
  params, grads = materialize(spec_tree, seed)
  tx = optax_hybrid.hybrid_adamw(**hp, mu_dtype=jnp.float32)
  state0 = tx.init(params)
  update = jax.jit(tx.update)
  u_jit, state1 = update(grads[0], state0, params)
  u_eager, state1_eager = tx.update(grads[0], state0, params)
  _, state2 = update(grads[1], state1, params)
  assert update._cache_size() == 1  # the second call reused the first compilation
  for s in (state1, state2, state1_eager):
    assert jax.tree.structure(s) == jax.tree.structure(state0)
    chex.assert_trees_all_equal_shapes_and_dtypes(s, state0)
    assert ([x.sharding.memory_kind for x in jax.tree.leaves(s)]
            == [x.sharding.memory_kind for x in jax.tree.leaves(state0)])
  for a, b in zip(jax.tree.leaves(u_jit), jax.tree.leaves(u_eager)):
    assert a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-6 if a.dtype == jnp.float32 else 1e-2, atol=1e-12)
