"""Property-based tests: random pytrees and hyperparameters against the float64 model.

What the examples are, and why they do not depend on test order:

- Hyperparameters come from the ranges people train with: lr log-uniform in
  [1e-6, 1e-1], weight decay in [0, 0.3], b1 in [0.8, 0.95], b2 in
  [0.9, 0.9999], eps log-uniform in [1e-8, 1e-6]. Every tree of the main
  property has at least one leaf and no zero-size leaf, so each example steps
  real numbers. Degenerate inputs (an empty tree, zero-size leaves, lr 0) are
  explicit ``@example``s, run every time.
- Every value is decoded from a fixed-length tuple of booleans
  (:func:`bits`). Hypothesis mixes "constants" into its integer, float and
  string draws, among them constants it collects from every local module
  imported so far (``hypothesis.internal.conjecture.providers``'s
  ``_get_local_constants``; no setting turns it off), so examples built from
  ``st.integers``/``st.floats``/``st.sampled_from`` change with the test files
  that ran before. Boolean draws never use constants: with
  ``derandomize=True`` (a seed from the test's own source) and no example
  database the examples are a function of this file alone.
  ``test_examples_do_not_depend_on_what_was_imported_before`` checks that.
- Settings are per test (``@settings``), not a global profile, so other test
  files keep Hypothesis' defaults.
"""

import math
import subprocess
import sys
import os

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, example, given, settings, strategies as st

import optax_hybrid
from numpy_reference import adamw_steps

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# Relative to the size of the terms of each step (no cancellation inside the
# bound): storage rounding of the dtype.
TOLERANCE = {np.dtype(jnp.float32): 4e-6, np.dtype(jnp.bfloat16): 1e-2, np.dtype(jnp.float16): 2e-3}

PROPERTY_SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None,
                             suppress_health_check=[HealthCheck.too_slow])


# --- strategies decoded from booleans ------------------------------------------

def bits(n):
  """``n`` booleans: the only kind of draw Hypothesis never replaces with a collected constant."""
  return st.tuples(*[st.booleans()] * n)


class BitReader:
  """Reads unsigned integers, uniform floats and choices from a tuple of booleans, in order."""

  def __init__(self, bools):
    self.bools, self.at = bools, 0

  def uint(self, k):
    value = 0
    for b in self.bools[self.at:self.at + k]:
      value = 2 * value + int(b)
    self.at += k
    return value

  def unit(self, k=20):
    """A float in [0, 1]: all False bits give 0 (what Hypothesis shrinks towards)."""
    return self.uint(k) / (2**k - 1)

  def uniform(self, lo, hi):
    return lo + (hi - lo) * self.unit()

  def log_uniform(self, lo, hi):
    return math.exp(math.log(lo) + (math.log(hi) - math.log(lo)) * self.unit())

  def choice(self, options):
    return options[self.uint(max(1, (len(options) - 1).bit_length())) % len(options)]


HP_BITS = 5 * 20 + 1 + 2 + 1


def hyperparameters_from(bools):
  r = BitReader(bools)
  return {
      "learning_rate": r.log_uniform(1e-6, 1e-1),
      "weight_decay": r.uniform(0.0, 0.3),
      "b1": r.uniform(0.8, 0.95),
      "b2": r.uniform(0.9, 0.9999),
      "eps": r.log_uniform(1e-8, 1e-6),
      "bias_correction": r.choice([True, False]),
      "adamw_mode": r.choice([True, True, True, False]),  # decoupled decay, as most runs use
      "state_memory_kind": r.choice([None, "pinned_host"]),
  }


MAX_LEAVES = 6
# Per leaf: ndim (2 bits), 4 dims (2 bits each), dtype (2), decay (2), container (2).
LEAF_BITS = 2 + 4 * 2 + 2 + 2 + 2
TREE_BITS = 3 + MAX_LEAVES * LEAF_BITS


def tree_from(bools, min_dim):
  """A nested dict/list tree of leaf specs ``(shape, dtype name, decay)``, 1 to 6 leaves.

  ``min_dim`` 1: every leaf has elements; 0: zero-size leaves can appear.
  """
  r = BitReader(bools)
  n = 1 + r.uint(3) % MAX_LEAVES
  top, nested, listed = {}, {}, []
  for i in range(n):
    ndim = r.uint(2)
    dims = [min_dim + r.uint(2) for _ in range(4)]
    dtype = r.choice(["f32", "f32", "bf16", "f16"])  # float32 twice as often
    decay = r.choice([True, True, True, False])
    leaf = (tuple(dims[:ndim]), dtype, decay)
    where = r.uint(2)
    if where == 0:
      nested[f"n{i}"] = leaf
    elif where == 1:
      listed.append(leaf)
    else:
      top[f"t{i}"] = leaf
  if nested:
    top["nested"] = nested
  if listed:
    top["listed"] = listed
  return top


hyperparameters = bits(HP_BITS).map(hyperparameters_from)
nonempty_trees = bits(TREE_BITS).map(lambda b: tree_from(b, min_dim=1))
any_trees = bits(TREE_BITS).map(lambda b: tree_from(b, min_dim=0))
seeds = bits(32).map(lambda b: BitReader(b).uint(32))


def is_spec(x):
  return isinstance(x, tuple) and len(x) == 3 and isinstance(x[1], str)


def materialize(spec_tree, seed):
  rng = np.random.default_rng(seed)
  make = lambda spec: jnp.asarray(rng.normal(size=spec[0]) * 3, DTYPES[spec[1]])
  params = jax.tree.map(make, spec_tree, is_leaf=is_spec)
  grads = [jax.tree.map(make, spec_tree, is_leaf=is_spec) for _ in range(2)]
  mask = jax.tree.map(lambda spec: spec[2], spec_tree, is_leaf=is_spec)
  return params, grads, mask


def check_close(ours, ref, scale, dtype, what):
  ours = np.asarray(ours, np.float64)
  # Plus the dtype's smallest step near zero: a float16 update of 1e-8 is 0 or 6e-8.
  bound = TOLERANCE[np.dtype(dtype)] * scale + 2 * float(ml_dtypes.finfo(dtype).smallest_subnormal)
  excess = np.abs(ours - ref) - bound
  assert np.all(excess <= 0), f"{what}: off by {np.max(excess):.3g} beyond the tolerance"


BASE_HP = {"learning_rate": 1e-2, "weight_decay": 0.1, "b1": 0.9, "b2": 0.999, "eps": 1e-8,
           "bias_correction": True, "adamw_mode": True, "state_memory_kind": None}
SOME_LEAVES = {"w": ((3, 4), "f32", True), "b": ((4,), "bf16", False), "s": ((), "f16", True)}


@PROPERTY_SETTINGS
@given(nonempty_trees, hyperparameters, seeds)
# Degenerate inputs, run every time beside the drawn examples.
@example({}, BASE_HP, 0)                                                        # an empty tree
@example({"z": ((0, 3), "f32", True), "e": ((0,), "bf16", False)}, BASE_HP, 1)  # zero-size leaves only
@example({**SOME_LEAVES, "z": ((2, 0), "f16", True)}, BASE_HP, 2)               # zero-size beside real leaves
@example(SOME_LEAVES, {**BASE_HP, "learning_rate": 0.0}, 3)                     # lr 0: params do not move
@example(SOME_LEAVES, {**BASE_HP, "learning_rate": 0.0, "adamw_mode": False}, 4)
@example(SOME_LEAVES, {**BASE_HP, "weight_decay": 0.0, "bias_correction": False}, 5)
def test_two_steps_equal_the_float64_model(spec_tree, hp, seed):
  params, grads, mask = materialize(spec_tree, seed)
  tx = optax_hybrid.hybrid_adamw(**hp, mask=mask)
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
  decays = dict(zip(keys, jax.tree.leaves(mask)))
  as64 = lambda tree: {k: np.asarray(x, np.float64) for k, x in zip(keys, jax.tree.leaves(tree))}
  # The step's scalars are float32 (documented): the model gets them rounded
  # the same way, so that the tolerance measures the arithmetic alone (1 - b2
  # of a rounded b2 = 0.9999 is off by 3e-4 otherwise).
  f32 = lambda x: float(np.float32(x))
  kw = {k: f32(hp[k]) for k in ("b1", "b2", "eps", "weight_decay")}
  kw.update(bias_correction=hp["bias_correction"], adamw_mode=hp["adamw_mode"])
  lr, wd, b1, b2 = f32(hp["learning_rate"]), kw["weight_decay"], kw["b1"], kw["b2"]
  # Step 1 from the params as stored; step 2 from the params our step 1 produced.
  p0 = as64(params)
  (ref1,), m1, v1 = adamw_steps(p0, [as64(grads[0])], [lr], decay_mask=decays, **kw)
  bc1 = 1 - b1 if kw["bias_correction"] else 1.0
  bc2 = 1 - b2 if kw["bias_correction"] else 1.0
  for i, (k, leaf) in enumerate(zip(keys, leaves_p)):
    u64 = ref1[k] - p0[k]
    # The two terms of the step, each as large as it is: the bound does not
    # grow with a cancellation between them (the decay bugs hide there).
    adam = lr / bc1 * np.abs(m1[k]) / (np.sqrt(v1[k]) / math.sqrt(bc2) + kw["eps"])
    decay = lr * wd * np.abs(p0[k]) if (kw["adamw_mode"] and decays[k]) else 0.0
    check_close(jax.tree.leaves(ours_updates[0])[i], u64, adam + decay, leaf.dtype, f"step 1 update of leaf {k}")
    if lr == 0.0:
      assert not np.any(np.asarray(jax.tree.leaves(ours_updates[0])[i], np.float64)), k
  # Moments after two steps, each leaf in its storage dtype.
  p1 = as64(optax_hybrid.apply_updates(params, ours_updates[0]))
  state_m, state_v = jax.tree.leaves(state.mu), jax.tree.leaves(state.nu)
  for i, (k, leaf) in enumerate(zip(keys, leaves_p)):
    g2 = as64(grads[1])[k]
    if not kw["adamw_mode"] and decays[k]:
      g2 = g2 + wd * p1[k]
    m2 = b1 * m1[k] + (1 - b1) * g2
    v2 = b2 * v1[k] + (1 - b2) * g2 * g2
    check_close(state_m[i], m2, np.abs(m1[k]) + np.abs(g2), leaf.dtype, f"step 2 mu of leaf {k}")
    check_close(state_v[i], v2, v1[k] + g2 * g2, leaf.dtype, f"step 2 nu of leaf {k}")
  assert int(state.count) == 2


@PROPERTY_SETTINGS
@given(any_trees, hyperparameters, seeds)
@example({}, BASE_HP, 0)
@example({"z": ((0, 3), "f32", True)}, {**BASE_HP, "state_memory_kind": "pinned_host"}, 1)
def test_structure_dtypes_jit_and_no_recompile(spec_tree, hp, seed):
  params, grads, mask = materialize(spec_tree, seed)
  tx = optax_hybrid.hybrid_adamw(**hp, mask=mask, mu_dtype=jnp.float32)
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


def test_strategies_draw_realistic_examples():
  """Under the properties' settings the strategies draw real numbers at realistic rates.

  (A different test function gets a different derandomized seed, so these are
  examples like the properties', not the same ones.)
  """
  drawn = []

  @settings(PROPERTY_SETTINGS, max_examples=PROPERTY_SETTINGS.max_examples)
  @given(nonempty_trees, hyperparameters, seeds)
  def collect(spec_tree, hp, seed):
    drawn.append((spec_tree, hp))

  collect()
  assert len(drawn) >= 20
  leaves = [jax.tree.leaves(t, is_leaf=is_spec) for t, _ in drawn]
  assert all(ls and all(math.prod(s[0]) > 0 for s in ls) for ls in leaves)
  lrs = [hp["learning_rate"] for _, hp in drawn]
  assert all(1e-6 <= lr <= 1e-1 for lr in lrs)
  # Decoupled decay, a float32 leaf that decays, and lr * wd large enough to
  # show: the kind of example the decay bugs fail.
  decisive = [hp for (t, hp), ls in zip(drawn, leaves)
              if hp["adamw_mode"] and hp["learning_rate"] * hp["weight_decay"] > 1e-4
              and any(s[1] == "f32" and s[2] for s in ls)]
  assert len(decisive) >= 3, len(decisive)


ORDER_SCRIPT = r"""
import sys
sys.path.insert(0, {tests!r})
for name in {imports!r}:
  __import__(name)
import test_properties as t
from hypothesis import given
drawn = []
@t.PROPERTY_SETTINGS
@given(t.any_trees, t.hyperparameters, t.seeds)
def collect(spec_tree, hp, seed):
  drawn.append(repr((spec_tree, sorted(hp.items()), seed)))
collect()
import hashlib
print(len(drawn), hashlib.sha256("\n".join(drawn).encode()).hexdigest())
"""


def test_examples_do_not_depend_on_what_was_imported_before():
  """Fresh interpreters that imported different local modules first draw the same examples."""
  tests = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  outs = []
  for imports in ([], ["numpy_reference", "stepping", "test_schedules", "test_kernels", "test_recipe"]):
    script = ORDER_SCRIPT.format(tests=tests, imports=imports)
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    outs.append(result.stdout.strip().splitlines()[-1])
  assert outs[0] == outs[1], outs
