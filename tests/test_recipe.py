"""Tests for optax_hybrid.recipe: the standard optimizer against hand-built Optax chains."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax_hybrid
from optax_hybrid.recipe import (
    LearningRateState,
    flax_weight_decay_rule,
    last_learning_rate,
    path_name,
    standard_optimizer,
)
from optax_hybrid import HybridAdamState

SHAPES = {
    "body": {"kernel": (6, 5), "bias": (5,)},
    "norm": {"scale": (5,)},
    "head": {"kernel": (5, 3), "bias": (3,)},
    "embed": {"embedding": (7, 6)},
}
# Flax's conventions by hand: only the 2-D kernels decay.
DECAY = {"body": {"kernel": True, "bias": False}, "norm": {"scale": False},
         "head": {"kernel": True, "bias": False}, "embed": {"embedding": False}}


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  return jax.device_put(
      jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), SHAPES,
                   is_leaf=lambda x: isinstance(x, tuple)), jax.devices()[0])


def make_grads(steps, seed=1):
  rng = np.random.default_rng(seed)
  # Alternate small and large gradients, so that clipping acts on some steps only.
  return [jax.tree.map(lambda s, i=i: ((3.0 if i % 2 else 0.05) * rng.normal(size=s)).astype(np.float32),
                       SHAPES, is_leaf=lambda x: isinstance(x, tuple)) for i in range(steps)]


# Two leaves, for tests where the tree does not matter (smaller programs compile faster).
TINY = jax.device_put({"kernel": jnp.arange(9.0, dtype=jnp.float32).reshape(3, 3) / 9,
                       "bias": jnp.ones(3, jnp.float32)}, jax.devices()[0])


def tiny_grads(steps):
  rng = np.random.default_rng(2)
  return [{"kernel": rng.normal(size=(3, 3)).astype(np.float32), "bias": rng.normal(size=3).astype(np.float32)}
          for _ in range(steps)]


def warmup_cosine(peak, total, warmup, floor):
  """The schedule by hand (the formula in docs/optimizer.md), k = updates already taken."""
  def value(k):
    if k < warmup:
      return (k + 1) / warmup * peak
    if k >= total:
      return floor
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))
  return value


def traced(peak, total, warmup, floor):
  """The same hand formula in jax.numpy, for Optax references that trace it."""
  def sched(k):
    k = jnp.asarray(k, jnp.float32)
    progress = jnp.clip((k - warmup) / (total - warmup), 0.0, 1.0)
    cosine = floor + (peak - floor) * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return jnp.where(k < warmup, (k + 1) / max(warmup, 1) * peak, cosine)
  return sched


def make_step(tx, apply=optax.apply_updates):
  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return apply(p, u), s, last_learning_rate(s) if has_record(s) else jnp.float32(0)
  return step


def run(tx, params, grads, apply=optax.apply_updates, step=None):
  """``len(grads)`` jitted updates; returns the params, the state and the recorded lr after each."""
  step = step or make_step(tx, apply)
  state = committed(tx.init(params))
  lrs = []
  for g in grads:
    params, state, lr = step(params, state, g)
    lrs.append(float(lr))
  return params, state, lrs


def committed(state):
  """Optax's own counts are uncommitted: commit them, or a jitted step's second call compiles again."""
  return jax.tree.map(lambda x: x if x.committed else jax.device_put(x, jax.devices()[0]), state)


def has_record(state):
  is_record = lambda x: isinstance(x, LearningRateState)
  return any(is_record(s) for s in jax.tree.leaves(state, is_leaf=is_record))


def hybrid_states(state):
  is_hybrid = lambda x: isinstance(x, HybridAdamState)
  return [s for s in jax.tree.leaves(state, is_leaf=is_hybrid) if is_hybrid(s)]


def assert_trees_close(a, b, rtol=1e-5, atol=1e-7):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


def test_default_stack_equals_clip_plus_optax_adamw():
  params, grads = make_params(), make_grads(8)
  # warmup 0.25 of 8 = 2 updates; floor 10% of the peak.
  tx = standard_optimizer(1e-2, total_steps=8, warmup=0.25)
  ref = optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(traced(1e-2, 8, 2, 1e-3), b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=DECAY))
  got, _, lrs = run(tx, params, grads)
  want, _, _ = run(ref, params, grads)
  assert_trees_close(got, want)
  hand = warmup_cosine(1e-2, 8, 2, 1e-3)
  np.testing.assert_allclose(lrs, [hand(k) for k in range(8)], rtol=1e-6)
  # Clipping acted on the odd steps only.
  norms = [np.sqrt(sum(np.sum(x ** 2) for x in jax.tree.leaves(g))) for g in grads]
  assert max(norms[0::2]) < 1.0 < min(norms[1::2])


def test_param_groups_match_optax_per_group_and_frozen_leaves_have_no_state():
  params, grads = make_params(), make_grads(5)
  # First matching pattern wins: "head/bias" is frozen by the regex before "head/*"
  # sees it; "norm/scale" matches nothing and is in the default group.
  groups = {re.compile(r"head/b.*"): {"frozen": True},
            "head/*": {"lr_multiplier": 10.0},
            "body/*": {"lr_multiplier": 0.5, "weight_decay": 0.05},
            "embed/*": {"lr_multiplier": 0.0}}
  tx = standard_optimizer(1e-2, total_steps=10, warmup=2, param_groups=groups, state_memory_kind="pinned_host")
  s = traced(1e-2, 10, 2, 1e-3)
  adamw = lambda sched, wd: optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=wd, mask=DECAY)
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
      {"default": adamw(s, 0.1), "head": adamw(lambda k: 10.0 * s(k), 0.1),
       "body": adamw(lambda k: 0.5 * s(k), 0.05), "frozen": optax.set_to_zero()},
      {"body": {"kernel": "body", "bias": "body"}, "norm": {"scale": "default"},
       "head": {"kernel": "head", "bias": "frozen"}, "embed": {"embedding": "frozen"}}))
  got, state, _ = run(tx, params, grads, apply=optax_hybrid.apply_updates)
  want, _, _ = run(ref, params, grads)
  assert_trees_close(got, want)  # moments in host memory, reference on the device
  np.testing.assert_array_equal(got["embed"]["embedding"], params["embed"]["embedding"])
  np.testing.assert_array_equal(got["head"]["bias"], params["head"]["bias"])

  # No state at all for the 45 frozen weights: 2 moments for each of the 55
  # trained ones, count and skipped for each of 3 AdamW groups, the recorded lr.
  leaves = jax.tree.leaves(state)
  assert sum(x.size for x in leaves) == 2 * 55 + 3 * 2 + 1
  assert not any(x.shape in ((7, 6), (3,)) for x in leaves)
  moments = [x for h in hybrid_states(state) for x in jax.tree.leaves((h.mu, h.nu))]
  assert len(moments) == 2 * 4 and {x.sharding.memory_kind for x in moments} == {"pinned_host"}


class Model(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(10, 4, rngs=rngs)
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)
    self.head = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, tokens):
    return self.head(jax.nn.relu(self.norm(self.hidden(self.embed(tokens)))))


_MODEL = []


def fresh_model():
  """A new copy of one small nnx model, filled from NumPy.

  Running Flax's initializers eagerly would compile each of them; tracing the
  constructor with ``nnx.eval_shape`` compiles nothing.
  """
  if not _MODEL:
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Model(nnx.Rngs(0))))
    rng = np.random.default_rng(3)
    _MODEL.extend([graphdef, jax.tree.map(lambda x: (0.5 * rng.normal(size=x.shape)).astype(x.dtype), state)])
  graphdef, state = _MODEL
  return nnx.merge(graphdef, jax.tree.map(jnp.asarray, state))


def test_flax_weight_decay_rule():
  assert flax_weight_decay_rule("layers/0/attn/kernel", jnp.ones((4, 2, 2)))
  assert flax_weight_decay_rule("w", jnp.ones((4, 4)))
  assert not flax_weight_decay_rule("attn/bias", jnp.ones((2, 2)))
  assert not flax_weight_decay_rule("vit/pos_embedding", jnp.ones((1, 4, 4)))
  assert not flax_weight_decay_rule("rms/scale", jnp.ones(4))
  assert not flax_weight_decay_rule("alpha", jnp.ones(4))


def test_path_name():
  tree = {"a": [{"kernel": 1}, {"bias": 2}], "b": nnx.Param(jnp.ones(2))}
  names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert names == ["a/0/kernel", "a/1/bias", "b"]


class _KeylessPair:  # a pytree node registered without keys: JAX numbers its children (FlattenedIndexKey)

  def __init__(self, a, b):
    self.a, self.b = a, b


class _NamedPair:  # a pytree node whose own key entries are plain strings

  def __init__(self, x, y):
    self.x, self.y = x, y


jax.tree_util.register_pytree_node(_KeylessPair, lambda p: ((p.a, p.b), None), lambda _, c: _KeylessPair(*c))
jax.tree_util.register_pytree_with_keys(_NamedPair, lambda n: ((("first", n.x), ("second", n.y)), None),
                                        lambda _, c: _NamedPair(*c))


def test_path_name_of_custom_pytree_nodes_numbers_keyless_children_and_prints_other_keys():
  # mutmut: paths._key_name's FlattenedIndexKey branch and its fallback `str(key)` (both survived
  # as `str(None)`: no test had a node without dict, attribute or sequence keys).
  tree = {"keyless": _KeylessPair(1, 2), "named": _NamedPair(3, 4)}
  names = [path_name(p) for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  assert names == ["keyless/0", "keyless/1", "named/first", "named/second"]


def test_accumulation_equals_optax_multisteps_and_lr_advances_per_update():
  grads = [jax.tree.map(lambda g: 5 * g, g) for g in tiny_grads(7)]  # some clipped
  # decay_mask replaces the Flax rule: the bias decays too, as in the reference.
  tx = standard_optimizer(1e-2, total_steps=4, warmup=2, accumulation_steps=3, decay_mask=lambda path, p: True)
  ref = optax.MultiSteps(optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(traced(1e-2, 4, 2, 1e-3), b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)), 3)
  got, _, lrs = run(tx, TINY, grads)
  want, _, _ = run(ref, TINY, grads)
  assert_trees_close(got, want)
  hand = warmup_cosine(1e-2, 4, 2, 1e-3)
  # After micro-step j (1-based) j // 3 updates were taken; before the first,
  # the rate the first will use.
  expected = [hand(max(j // 3 - 1, 0)) for j in range(1, 8)]
  np.testing.assert_allclose(lrs, expected, rtol=1e-6)
  assert lrs[4] != lrs[6]  # the second update moved it


def params_by_path(model):
  return {path_name(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param))}


def test_nnx_optimizer_decays_flax_kernels_only_and_matches_optax():
  tokens, targets = jnp.arange(6) % 10, jnp.linspace(-1, 1, 18).reshape(6, 3)
  groups = {"head/*": {"lr_multiplier": 4.0}, "norm/*": {"frozen": True}}
  model, ref_model = fresh_model(), fresh_model()
  optimizer = nnx.Optimizer(model, standard_optimizer(1e-2, total_steps=4, warmup=2, param_groups=groups),
                            wrt=nnx.Param)
  # The reference, by hand: Flax's conventions decay only the Linear kernels
  # (not the Embed table, the biases or the LayerNorm scale).
  decays = {"embed/embedding": False, "hidden/kernel": True, "hidden/bias": False, "norm/scale": False,
            "norm/bias": False, "head/kernel": True, "head/bias": False}
  labels = {"embed/embedding": "default", "hidden/kernel": "default", "hidden/bias": "default",
            "norm/scale": "frozen", "norm/bias": "frozen", "head/kernel": "head", "head/bias": "head"}
  # nnx hands Optax nnx.State trees: the reference mask and labels are built by path.
  by_path = lambda table: lambda tree: jax.tree_util.tree_map_with_path(lambda p, _: table[path_name(p)], tree)
  s = traced(1e-2, 4, 2, 1e-3)
  adamw = lambda sched: optax.adamw(sched, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, mask=by_path(decays))
  ref_optimizer = nnx.Optimizer(ref_model, optax.chain(optax.clip_by_global_norm(1.0), optax.multi_transform(
      {"default": adamw(s), "head": adamw(lambda k: 4.0 * s(k)), "frozen": optax.set_to_zero()},
      by_path(labels))), wrt=nnx.Param)

  @nnx.jit
  def update(model, optimizer, grads):
    optimizer.update(model, grads)
    return last_learning_rate(optimizer.opt_state)

  ref_update = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))
  grad_fn = nnx.jit(nnx.grad(lambda m: jnp.mean((m(tokens) - targets) ** 2)))
  hand = warmup_cosine(1e-2, 4, 2, 1e-3)

  # Zero gradients: the Adam direction is 0, so only weight decay moves a
  # param, by a factor 1 - lr * wd: exactly the Flax kernels move.
  before = params_by_path(model)
  zeros = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
  lrs = [float(update(model, optimizer, zeros))]
  ref_update(ref_model, ref_optimizer, zeros)
  after = params_by_path(model)
  assert {p for p in before if not np.array_equal(before[p], after[p])} == {"hidden/kernel", "head/kernel"}
  np.testing.assert_allclose(after["hidden/kernel"], before["hidden/kernel"] * (1 - hand(0) * 0.1), rtol=1e-6)
  np.testing.assert_allclose(after["head/kernel"], before["head/kernel"] * (1 - 4 * hand(0) * 0.1), rtol=1e-6)

  for _ in range(4):
    lrs.append(float(update(model, optimizer, grad_fn(model))))
    ref_update(ref_model, ref_optimizer, grad_fn(ref_model))
  assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
  # Warmup, cosine, then the floor (total_steps=4), read inside nnx.jit.
  np.testing.assert_allclose(lrs, [hand(k) for k in range(5)], rtol=1e-6)
  assert lrs[-1] == pytest.approx(1e-3)
  np.testing.assert_array_equal(params_by_path(model)["norm/scale"], before["norm/scale"])


def test_optax_schedules_compose():
  grads = tiny_grads(6)
  # Each schedule is Optax's own; the recipe only evaluates it at the update count
  # (optax.piecewise_constant_schedule composes the same way).
  onecycle = optax.cosine_onecycle_schedule(transition_steps=6, peak_value=1e-2)
  staircase = optax.exponential_decay(1e-2, transition_steps=2, decay_rate=0.5, staircase=True)
  expected = {
      onecycle: list(np.asarray(jax.jit(jax.vmap(onecycle))(jnp.arange(6)))),
      staircase: [1e-2 * 0.5 ** (k // 2) for k in range(6)],
  }
  for schedule, lrs in expected.items():
    _, _, got = run(standard_optimizer(schedule=schedule), TINY, grads)
    np.testing.assert_allclose(got, lrs, rtol=1e-6)


def test_reduce_on_plateau_chained_after():
  grads = tiny_grads(8)
  plateau = lambda: optax.contrib.reduce_on_plateau(factor=0.5, patience=2)
  tx = optax.chain(standard_optimizer(schedule=optax.constant_schedule(1e-2)), plateau())
  ref = optax.chain(optax.clip_by_global_norm(1.0),
                    optax.adamw(1e-2, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1,
                                mask={"kernel": True, "bias": False}), plateau())

  def train(tx):
    @jax.jit
    def step(p, s, g):
      u, s = tx.update(g, s, p, value=jnp.float32(1.0))  # a loss that never improves
      return optax.apply_updates(p, u), s
    p, s = TINY, committed(tx.init(TINY))
    for g in grads:
      p, s = step(p, s, g)
    return p, s

  got, state = train(tx)
  want, ref_state = train(ref)
  assert float(ref_state[-1].scale) < 1.0  # the plateau was reached
  assert float(state[-1].scale) == float(ref_state[-1].scale)
  assert_trees_close(got, want)
  np.testing.assert_allclose(float(last_learning_rate(state)), 1e-2, rtol=1e-6)


def test_skip_nonfinite_skips_every_group_together():
  def place(tree):  # the "head/*" group in host memory (updated by host compute), the rest on the device
    return {**tree, "head": jax.device_put(tree["head"], jax.memory.Space.Host)}

  params, grads = place(make_params()), make_grads(3)
  bad = jax.tree.map(np.copy, grads[1])
  bad["body"]["kernel"][0, 0] = np.inf  # in the default group, on the device
  # No clipping: an infinite global norm would otherwise zero the finite gradients.
  tx = standard_optimizer(1e-2, total_steps=10, warmup=2, max_grad_norm=None, skip_nonfinite=True,
                          param_groups={"head/*": {"lr_multiplier": 2.0}, "embed/*": {"frozen": True}})
  step = make_step(tx, optax_hybrid.apply_updates)
  got, state, lrs = run(tx, params, [place(g) for g in (grads[0], bad, grads[2])], step=step)
  # The same run without the bad step.
  want, _, ref_lrs = run(tx, params, [place(g) for g in (grads[0], grads[2])], step=step)
  assert_trees_close(got, want, rtol=1e-6)
  # Both groups skipped: the default one holding the infinity and the host-resident head.
  assert [(int(h.count), int(h.skipped)) for h in hybrid_states(state)] == [(2, 1), (2, 1)]
  assert lrs == [ref_lrs[0], ref_lrs[0], ref_lrs[1]]
  assert got["head"]["kernel"].sharding.memory_kind == "pinned_host"

  def plain_step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s
  jaxpr = jax.make_jaxpr(plain_step)(params, tx.init(params), place(grads[0]))
  assert optax_hybrid.host_arithmetic_outside_host_compute(jaxpr) == []


def test_last_learning_rate_needs_a_recipe_or_hybrid_state():
  with pytest.raises(ValueError, match="found neither"):
    last_learning_rate(optax.adamw(1e-3).init({"w": jnp.ones(2)}))


def test_last_learning_rate_of_a_plain_hybrid_adamw_state():
  """The rate of the latest update taken, from the count and the schedule (issue 22), inside jit."""
  hand = warmup_cosine(1e-2, 6, 2, 1e-3)
  schedule = optax_hybrid.warmup_cosine_schedule(1e-2, total_steps=6, warmup_steps=2, eta_min=1e-3)
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax_hybrid.hybrid_adamw(schedule, skip_nonfinite=True))

  @jax.jit
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, last_learning_rate(s, schedule)

  grads = tiny_grads(4)
  grads[2]["bias"][0] = np.inf  # a skipped update: neither the count nor the rate moves
  params, state = TINY, tx.init(TINY)
  rates = [float(last_learning_rate(state, schedule))]  # before any update: the first one's
  for g in grads:
    params, state, lr = step(params, state, g)
    rates.append(float(lr))
  np.testing.assert_allclose(rates, [hand(0), hand(0), hand(1), hand(1), hand(2)], rtol=1e-6)
  # A constant rate, and a state kept by nnx.Optimizer (arrays in Variables).
  assert float(last_learning_rate(optax_hybrid.hybrid_adamw(3e-4).init(TINY), 3e-4)) == np.float32(3e-4)
  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax_hybrid.hybrid_adamw(schedule), wrt=nnx.Param)
  optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
  optimizer.update(model, jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param)))
  assert float(last_learning_rate(optimizer.opt_state, schedule)) == pytest.approx(hand(1), rel=1e-6)


P = {"w": jnp.ones((2, 2))}


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(learning_rate=1e-3, total_steps=100, warmup=1.0), ValueError, "`warmup` as a float is a fraction"),
    (dict(learning_rate=1e-3, total_steps=100, warmup=100), ValueError, "gives 100 warmup steps"),
    (dict(learning_rate=1e-3, total_steps=10, warmup=0.96), ValueError, "gives 10 warmup steps"),
    (dict(learning_rate=1e-3, total_steps=100, warmup=True), TypeError, "`warmup` must be a number of steps"),
    (dict(learning_rate=-1e-3, total_steps=100), ValueError, "`learning_rate` must be >= 0.0"),
    (dict(learning_rate=float("nan"), total_steps=100), ValueError, "`learning_rate` must be finite"),
    (dict(learning_rate=optax.constant_schedule(1e-3)), TypeError, "pass an Optax schedule as `schedule=`"),
    (dict(total_steps=100), ValueError, "`learning_rate` (the peak"),
    (dict(learning_rate=1e-3), ValueError, "`total_steps` (the number of optimizer updates"),
    (dict(learning_rate=1e-3, total_steps=0), ValueError, "`total_steps` must be >= 1"),
    (dict(learning_rate=1e-3, total_steps=100, accumulation_steps=0), ValueError, "`accumulation_steps` must be >= 1"),
    (dict(learning_rate=1e-3, total_steps=100, accumulation_steps=2.0), TypeError,
     "`accumulation_steps` must be an integer"),
    (dict(learning_rate=1e-3, total_steps=100, min_lr=1e-4, min_lr_ratio=0.1), ValueError, "either `min_lr`"),
    (dict(learning_rate=1e-3, total_steps=100, min_lr=1e-2), ValueError, "`min_lr`=0.01 exceeds `learning_rate`"),
    (dict(learning_rate=1e-3, total_steps=100, min_lr_ratio=1.5), ValueError,
     "`min_lr_ratio` must be in [0.0, 1.0]"),
    (dict(schedule=optax.constant_schedule(1e-3), learning_rate=1e-3), ValueError,
     "`learning_rate` shape the built-in"),
    (dict(schedule=optax.constant_schedule(1e-3), warmup=10), ValueError, "have no effect with `schedule`"),
    (dict(schedule=1e-3), TypeError, "`schedule` must be an Optax schedule"),
    (dict(learning_rate=1e-3, total_steps=100, max_grad_norm=0.0), ValueError, "pass None to disable clipping"),
    (dict(learning_rate=1e-3, total_steps=100, param_groups={"w": {"lr_mult": 2.0}}), ValueError,
     "param_groups['w'] has unknown key 'lr_mult'"),
    (dict(learning_rate=1e-3, total_steps=100, param_groups={"w": {"lr_multiplier": -1.0}}), ValueError,
     "param_groups['w']['lr_multiplier']` must be >= 0.0"),
    (dict(learning_rate=1e-3, total_steps=100, param_groups={"w": {"frozen": True, "lr_multiplier": 2.0}}),
     ValueError, "is frozen, so it takes no 'lr_multiplier'"),
    (dict(learning_rate=1e-3, total_steps=100, param_groups=[("w", {})]), TypeError,
     "`param_groups` must be a dict"),
    (dict(learning_rate=1e-3, total_steps=100, param_groups={3: {}}), TypeError, "keys must be glob strings"),
    (dict(learning_rate=1e-3, total_steps=100, decay_mask={"w": True}), TypeError,
     "`decay_mask` must be None (Flax naming conventions) or a callable"),
    (dict(learning_rate=1e-3, total_steps=100, mask={"w": True}), ValueError,
     "pass the weight-decay mask as `decay_mask`"),
    (dict(learning_rate=1e-3, total_steps=100, state_memory_knd="pinned_host"), TypeError,
     "unexpected keyword argument 'state_memory_knd'"),
    (dict(learning_rate=1e-3, total_steps=100, state_memory_kind="vram"), ValueError,
     "`state_memory_kind`='vram' is not a placement"),
])
def test_bad_arguments(kwargs, error, message):
  with pytest.raises(error, match=re.escape(message)):
    standard_optimizer(**kwargs)


@pytest.mark.parametrize("groups, message", [
    ({"haed/*": {"lr_multiplier": 2.0}}, "pattern 'haed/*' matches no parameter (a typo?); parameter paths look like"),
    ({"*": {"lr_multiplier": 2.0}, "w": {"frozen": True}},
     "pattern 'w' only matches parameters an earlier pattern already claims"),
])
def test_rules_are_checked_against_the_params_at_init(groups, message):
  tx = standard_optimizer(1e-3, total_steps=100, param_groups=groups)
  with pytest.raises(ValueError, match=re.escape(message)):
    tx.init(P)


def test_decay_mask_must_return_bools():
  tx = standard_optimizer(1e-3, total_steps=100, decay_mask=lambda path, p: p.ndim)
  with pytest.raises(TypeError, match=re.escape("`decay_mask` returned 2 for 'w'")):
    tx.init(P)  # the mask is resolved once, by init


def test_accumulation_with_host_moments_stays_in_host_compute_and_matches_multisteps():
  from optax_hybrid import placement
  from optax_hybrid.recipe import accumulate_gradients
  if "pinned_host" not in placement.available_memory_kinds():
    pytest.skip("no pinned_host")
  params = jax.device_put({"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.ones(4)}, jax.devices()[0])
  rng = np.random.default_rng(5)
  grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(6)]
  ours = accumulate_gradients(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, state_memory_kind="pinned_host"), 3)
  ref = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), 3)
  step = lambda tx: jax.jit(lambda p, s, g: (lambda u, s: (optax_hybrid.apply_updates(p, u), s))(*tx.update(g, s, p)))
  p_ours, s_ours, p_ref, s_ref = params, ours.init(params), params, ref.init(params)
  counts = []
  for g in grads:
    p_ours, s_ours = step(ours)(p_ours, s_ours, g)
    p_ref, s_ref = step(ref)(p_ref, s_ref, g)
    counts.append(int(s_ours.inner_state.count))
    assert s_ours.inner_state.mu["w"].sharding.memory_kind == "pinned_host"
  assert counts == [0, 0, 1, 1, 1, 2]  # the inner update ran on micro-steps 3 and 6 only
  assert_trees_close(p_ours, p_ref)
  jaxpr = jax.make_jaxpr(lambda p, s, g: ours.update(g, s, p))(params, ours.init(params), grads[0])
  assert optax_hybrid.host_arithmetic_outside_host_compute(jaxpr) == []
  with pytest.raises(ValueError, match="every_k"):
    accumulate_gradients(optax.sgd(1.0), 0)


@pytest.mark.parametrize("scale", [0.01, 100.0], ids=["under-the-norm", "clipped"])
def test_clipping_equals_optax_for_gradients_in_host_memory(scale):
  """standard_optimizer clips gradients that live in host memory (scan_layers' layers) as optax does on the device."""
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  grads = {"dense": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4) * scale,
           "layers": jnp.arange(10.0).reshape(2, 5) * scale, "bias": jnp.ones(6) * scale}
  expected, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  placed = dict(grads, layers=jax.device_put(grads["layers"], host))

  def clipped(g):  # the recipe's clipping stage (standard_optimizer's first)
    return optax_hybrid.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]

  got = jax.jit(clipped)(placed)
  assert got["layers"].sharding.memory_kind == "pinned_host"
  for key in grads:
    np.testing.assert_allclose(np.asarray(got[key], np.float32), np.asarray(expected[key], np.float32), rtol=1e-6)
  jaxpr = jax.make_jaxpr(clipped)(placed)
  assert optax_hybrid.host_arithmetic_outside_host_compute(jaxpr) == []


def test_our_clip_in_optax_chain_steps_host_resident_params_as_optax_does_on_the_device():
  """optax.chain(optax_hybrid.clip_by_global_norm, hybrid_adamw(state_memory_kind="host")) on streamed layers in host memory."""
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  params = {"proj": jnp.linspace(-0.5, 0.5, 16).reshape(4, 4),
            "layers": jax.device_put(jnp.stack([jnp.eye(4) * (1 + 0.1 * i) for i in range(3)]), host)}
  x = jnp.linspace(-1.0, 1.0, 8).reshape(2, 4)

  def loss(p, scale):
    return scale * jnp.mean(optax_hybrid.scan_layers(lambda c, w: jnp.tanh(c @ w), x @ p["proj"], p["layers"]) ** 2)

  tx = optax.chain(optax_hybrid.clip_by_global_norm(0.5), optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="host"))

  @jax.jit
  def step(p, s, scale):
    updates, s = tx.update(jax.grad(loss)(p, scale), s, p)
    return optax_hybrid.apply_updates(p, updates), s

  ref_tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
  ref = jax.device_put(params, jax.memory.Space.Device)
  ref_state, state = ref_tx.init(ref), tx.init(params)
  for scale in (0.1, 50.0, 0.1, 50.0):  # under the norm, then clipped
    params, state = step(params, state, scale)
    updates, ref_state = ref_tx.update(jax.grad(loss)(ref, scale), ref_state, ref)
    ref = optax.apply_updates(ref, updates)
  assert params["layers"].sharding.memory_kind == "pinned_host"
  assert_trees_close(params, ref, rtol=1e-5, atol=1e-6)
  assert optax_hybrid.host_arithmetic_outside_host_compute(jax.make_jaxpr(step)(params, state, 1.0)) == []
  with pytest.raises(ValueError, match="memory_space of all inputs"):  # docs/errors.md, row optax-clip-host
    jax.jit(lambda p: optax.clip_by_global_norm(0.5).update(jax.grad(loss)(p, 1.0), optax.EmptyState()))(params)


@pytest.mark.parametrize("options,message", [
    (dict(min_lr=-1.0), "`min_lr` must be >= 0.0, got -1.0."),
    (dict(min_lr_ratio=-0.5), "`min_lr_ratio` must be in [0.0, 1.0], got -0.5."),
    (dict(min_lr_ratio=1.5), "`min_lr_ratio` must be in [0.0, 1.0], got 1.5."),
])
def test_a_schedule_floor_out_of_range_is_refused_naming_the_argument(options, message):
  # mutmut: recipe._build_schedule 53 (the argument's name "min_lr" in the check replaced) survived.
  with pytest.raises(ValueError, match=re.escape(f"standard_optimizer: {message}")):
    standard_optimizer(1e-3, total_steps=10, **options)
