"""Tests for optax_hybrid.transform: the update rule, Optax composition and errors."""

import itertools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import optax_hybrid
from numpy_reference import adamw_steps, adamw_steps_stored_as, colossal_lr

SHAPES = {"w": (5, 7), "b": (7,), "s": ()}
STEPS = 25
PEAK, TOTAL, WARMUP, ETA_MIN = 1e-2, 20, 4, 1e-3  # the floor is reached inside the run


def make_params(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return {k: jnp.asarray(rng.normal(size=s), dtype) for k, s in SHAPES.items()}


def make_grads(steps=STEPS, seed=1):
  rng = np.random.default_rng(seed)
  # Mixed scales, so per-weight normalization matters.
  return [{k: (rng.normal(size=s) * 10.0 ** rng.integers(-3, 2)).astype(np.float32)
           for k, s in SHAPES.items()} for _ in range(steps)]


def run(tx, params, grads_list, jit=True):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, u
  step = jax.jit(step) if jit else step
  state = tx.init(params)
  history = []
  for g in grads_list:
    params, state, _ = step(params, state, g)
    history.append(params)
  return history, state


def schedule():
  return optax_hybrid.warmup_cosine_schedule(PEAK, TOTAL, WARMUP, ETA_MIN)


FLAGS = list(itertools.product([True, False], [True, False], [0.0, 0.1]))


@pytest.mark.parametrize("bias_correction,adamw_mode,weight_decay", FLAGS)
def test_matches_float64_reference(bias_correction, adamw_mode, weight_decay):
  params, grads = make_params(), make_grads()
  mask = {"w": True, "b": False, "s": True}
  kwargs = dict(b1=0.9, b2=0.95, eps=1e-6, weight_decay=weight_decay,
                bias_correction=bias_correction, adamw_mode=adamw_mode)
  tx = optax_hybrid.hybrid_adamw(schedule(), mask=mask, **kwargs)
  history, state = run(tx, params, grads)
  lrs = [colossal_lr(k, PEAK, TOTAL, WARMUP, ETA_MIN) for k in range(STEPS)]
  ref_hist, ref_m, ref_v = adamw_steps(params, grads, lrs, decay_mask=mask, **kwargs)
  for ours, ref in zip(history, ref_hist):
    for k in SHAPES:
      np.testing.assert_allclose(np.asarray(ours[k]), ref[k], rtol=2e-5, atol=2e-6)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(state.mu[k]), ref_m[k], rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(state.nu[k]), ref_v[k], rtol=1e-5, atol=1e-12)
  assert int(state.count) == STEPS


def test_decay_mask_is_honoured():
  params = make_params()
  zero_grads = [{k: np.zeros(s, np.float32) for k, s in SHAPES.items()}]
  tx = optax_hybrid.hybrid_adamw(0.1, weight_decay=0.5, mask={"w": True, "b": False, "s": True})
  (new,), _ = run(tx, params, zero_grads)
  np.testing.assert_allclose(new["w"], np.asarray(params["w"]) * (1 - 0.05), rtol=1e-6)
  np.testing.assert_array_equal(new["b"], params["b"])
  # A callable mask and a prefix mask give the same result.
  tx_fn = optax_hybrid.hybrid_adamw(0.1, weight_decay=0.5, mask=lambda p: {"w": True, "b": False, "s": True})
  (new_fn,), _ = run(tx_fn, params, zero_grads)
  chex.assert_trees_all_equal(new, new_fn)


@pytest.mark.parametrize("weight_decay,mask", [(0.0, None), (0.05, None), (0.05, {"w": True, "b": False, "s": False})])
def test_parity_with_optax_adamw(weight_decay, mask):
  params, grads = make_params(), make_grads()
  kwargs = dict(b1=0.8, b2=0.99, eps=1e-7, weight_decay=weight_decay, mask=mask)
  ours, s_ours = run(optax_hybrid.hybrid_adamw(schedule(), **kwargs), params, grads)
  theirs, s_theirs = run(optax.adamw(schedule(), **kwargs), params, grads)
  for a, b in zip(ours, theirs):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-7)
  # Same rule, different order of float32 operations: a few ulps after 25 steps.
  chex.assert_trees_all_close(s_ours.mu, s_theirs[0].mu, rtol=1e-5, atol=1e-9)
  chex.assert_trees_all_close(s_ours.nu, s_theirs[0].nu, rtol=1e-5, atol=1e-12)


def test_signature_is_optax_adamws_then_keyword_only_options():
  import inspect
  ours = list(inspect.signature(optax_hybrid.hybrid_adamw).parameters.values())
  theirs = list(inspect.signature(optax.adamw).parameters.values())
  positional = [p for p in ours if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  assert [(p.name, p.default) for p in positional] == [(p.name, p.default) for p in theirs
                                                      if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
  keyword_only = {p.name: p.default for p in ours if p.kind is inspect.Parameter.KEYWORD_ONLY}
  assert keyword_only["nesterov"] is False and list(keyword_only)[0] == "nesterov"
  # Every option of ours is keyword-only, with its default.
  assert {"state_memory_kind", "kernel", "moment_format", "master", "skip_nonfinite"} <= set(keyword_only)
  assert keyword_only["kernel"] == "auto" and keyword_only["state_memory_kind"] is None


@pytest.mark.parametrize("args,kwargs", [
    ((), {}),  # the defaults, weight_decay=1e-4 included
    ((0.8, 0.95, 1e-7, 1e-6, None, 0.05, {"w": True, "b": False, "s": True}), {}),  # every positional argument
    ((0.8, 0.95), dict(eps_root=1e-6, weight_decay=0.0, nesterov=True)),  # NAdamW, by keyword
    ((), dict(mu_dtype=jnp.bfloat16, nesterov=True, mask=lambda p: {"w": True, "b": False, "s": True})),
])
def test_same_calls_give_the_same_numbers_as_optax_adamw(args, kwargs):
  params, grads = make_params(), make_grads(12)
  ours, s_ours = run(optax_hybrid.hybrid_adamw(schedule(), *args, **kwargs), params, grads)
  theirs, s_theirs = run(optax.adamw(schedule(), *args, **kwargs), params, grads)
  # bf16 first moments: a float32 sum one ulp apart can round to the next bf16 (2**-8 relative): up to
  # lr / (1 - b1) * 2**-8 = 1e-4 per early step (measured 1e-4 after 12); float32 ones agree to rounding.
  bf16 = kwargs.get("mu_dtype") is not None
  for a, b in zip(ours, theirs):
    chex.assert_trees_all_close(a, b, rtol=2e-5, atol=5e-4 if bf16 else 1e-7)
  assert jax.tree.map(lambda x: x.dtype, s_ours.mu) == jax.tree.map(lambda x: x.dtype, s_theirs[0].mu)
  if not bf16:  # (bf16 moments themselves drift apart by whole ulps of their largest values)
    chex.assert_trees_all_close(s_ours.mu, s_theirs[0].mu, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("kernel", ["native", "pallas"])
def test_kernels_hand_eps_root_and_nesterov_leaves_to_the_reference(kernel):
  from optax_hybrid.kernels import native_cpu
  if kernel == "native" and not native_cpu.available():
    pytest.skip("native kernel not built")
  params, grads = make_params(), make_grads(6)
  kw = dict(eps_root=1e-6, nesterov=True, weight_decay=0.1)
  ours = optax_hybrid.hybrid_adamw(1e-2, kernel=kernel, **kw)
  p, s = params, ours.init(params)
  step = jax.jit(ours.step)
  for g in grads:
    p, s = step(p, s, g)
  want, _ = run(optax.adamw(1e-2, **kw), params, grads)
  chex.assert_trees_all_close(p, want[-1], rtol=2e-5, atol=1e-7)
  # The native kernel computes the plain rule only: this step holds no call to it.
  text = step.lower(params, ours.init(params), grads[0]).as_text()
  assert native_cpu.TARGET not in text


class VariantsTest(chex.TestCase):

  @chex.variants(with_jit=True, without_jit=True)
  def test_one_step_against_reference(self):
    params, (g,) = make_params(), make_grads(1)
    tx = optax_hybrid.hybrid_adamw(0.05, weight_decay=0.2)
    update = self.variant(tx.update)
    updates, state = update(g, tx.init(params), params)
    (ref,), _, _ = adamw_steps(params, [g], [0.05], weight_decay=0.2)
    for k in SHAPES:
      np.testing.assert_allclose(np.asarray(params[k]) + np.asarray(updates[k]), ref[k], rtol=1e-5, atol=1e-7)
    chex.assert_trees_all_equal_shapes_and_dtypes(state, tx.init(params))


def test_the_old_name_hybrid_adamw_is_a_deprecated_alias():
  # docs/optimizer.md promises HybridAdamW as an alias of HybridOptimizer; it warns, and other names still fail.
  with pytest.warns(DeprecationWarning, match="use optax_hybrid.HybridOptimizer"):
    assert optax_hybrid.HybridAdamW is optax_hybrid.HybridOptimizer
  assert isinstance(optax_hybrid.hybrid_lion(1e-3), optax_hybrid.HybridOptimizer)
  assert "HybridAdamW" not in optax_hybrid.__all__
  with pytest.raises(AttributeError, match="'HybridAdamX'"):
    optax_hybrid.HybridAdamX  # noqa: B018


def test_a_hybrid_optimizer_steps_through_its_engine_and_refuses_another_update():
  # HybridOptimizer's step, begin_step and close are its engine's (transform._Engine), found through its update;
  # one made with another update is refused when it is made, not at its first step.
  tx = optax_hybrid.hybrid_sgd(1e-1)
  assert tx.update.__self__.step.__qualname__ == "_Engine.step"
  params = {"w": jnp.ones(3)}
  new, _ = tx.step(params, tx.init(params), {"w": jnp.ones(3)})
  np.testing.assert_allclose(new["w"], 0.9)
  with pytest.raises(TypeError, match="`update` must be the engine's"):
    optax_hybrid.HybridOptimizer(tx.init, lambda updates, state, params=None: (updates, state))
  remade = optax_hybrid.HybridOptimizer(*tx)  # its own init and update: accepted
  np.testing.assert_allclose(remade.step(params, tx.init(params), {"w": jnp.ones(3)})[0]["w"], 0.9)


def test_chain_with_clipping_matches_optax():
  params, grads = make_params(), make_grads(10)
  ours = optax.chain(optax.clip_by_global_norm(0.5), optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1))
  theirs = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2, weight_decay=0.1))
  for a, b in zip(run(ours, params, grads)[0], run(theirs, params, grads)[0]):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-7)


def test_scale_by_hybrid_adam_composes_to_hybrid_adamw():
  params, grads = make_params(), make_grads(8)
  for adamw_mode in (True, False):
    kwargs = dict(b2=0.98, weight_decay=0.1, adamw_mode=adamw_mode)
    block = optax_hybrid.scale_by_hybrid_adam(**kwargs)
    assert not hasattr(block, "step")  # no learning rate of its own, so no fused step
    chained = optax.chain(block, optax.scale_by_learning_rate(schedule()))
    whole = optax_hybrid.hybrid_adamw(schedule(), **kwargs)
    for a, b in zip(run(chained, params, grads)[0], run(whole, params, grads)[0]):
      chex.assert_trees_all_close(a, b, rtol=1e-6, atol=1e-8)


def test_inject_hyperparams_changes_without_recompiling():
  params, grads = make_params(), make_grads(6)
  ours = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, b1=0.9, b2=0.99, weight_decay=0.1)
  theirs = optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, b1=0.9, b2=0.99, weight_decay=0.1)

  def step(tx, p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  step_ours = jax.jit(lambda p, s, g: step(ours, p, s, g))
  p_ours, s_ours = params, ours.init(params)
  p_ref, s_ref = params, theirs.init(params)
  for i, g in enumerate(grads):
    for s in (s_ours, s_ref):
      s.hyperparams["learning_rate"] = jnp.asarray(1e-2 / (i + 1), jnp.float32)
      s.hyperparams["b2"] = jnp.asarray(0.99 - 0.01 * i, jnp.float32)
      s.hyperparams["weight_decay"] = jnp.asarray(0.1 * i, jnp.float32)
    p_ours, s_ours = step_ours(p_ours, s_ours, g)
    p_ref, s_ref = step(theirs, p_ref, s_ref, g)
  assert step_ours._cache_size() == 1
  chex.assert_trees_all_close(p_ours, p_ref, rtol=1e-5, atol=1e-7)


def test_multisteps_matches_optax():
  params, grads = make_params(), make_grads(9)
  ours = optax.MultiSteps(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1), every_k_schedule=3)
  theirs = optax.MultiSteps(optax.adamw(1e-2, weight_decay=0.1), every_k_schedule=3)
  h_ours, s_ours = run(ours, params, grads)
  h_theirs, _ = run(theirs, params, grads)
  for a, b in zip(h_ours, h_theirs):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-7)
  assert int(s_ours.inner_opt_state.count) == 3


def test_second_call_does_not_recompile():
  params, grads = make_params(), make_grads(4)
  for memory_kind in ("device", "pinned_host"):
    tx = optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1, state_memory_kind=memory_kind)

    def step(p, s, g):
      u, s = tx.update(g, s, p)
      return optax_hybrid.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1))
    # Host state is committed to its device, so the step's outputs are too;
    # params committed from the start give the second call the same signature.
    p = jax.device_put(params, jax.devices()[0]) if memory_kind == "pinned_host" else jax.tree.map(jnp.copy, params)
    state = tx.init(p)
    for g in grads:
      p, state = compiled(p, state, g)
    assert compiled._cache_size() == 1
    assert int(state.count) == len(grads)


def test_bf16_params_with_fp32_moments():
  params = make_params(dtype=jnp.bfloat16)
  grads = make_grads(10)
  grads_bf16 = [{k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()} for g in grads]
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, moment_format="float32")
  history, state = run(tx, params, grads_bf16)
  for leaf in jax.tree.leaves(state.mu) + jax.tree.leaves(state.nu):
    assert leaf.dtype == jnp.float32
  for leaf in jax.tree.leaves(history[-1]):
    assert leaf.dtype == jnp.bfloat16
  # Float64 model of the same storage: bf16 params, fp32-or-better moments.
  ref, m = adamw_steps_stored_as(params, grads_bf16, 1e-2, ml_dtypes.bfloat16, weight_decay=0.1)
  for ours_t, ref_t in zip(history, ref):
    for k in ref_t:
      # At most one bf16 rounding step apart (fp32 vs float64 update, same rounding).
      np.testing.assert_allclose(np.asarray(ours_t[k], np.float64), ref_t[k], rtol=2 ** -7, atol=1e-6)
  np.testing.assert_allclose(np.asarray(state.mu["w"]), m["w"], rtol=1e-5, atol=1e-9)


def test_default_moment_dtype_follows_params_and_updates_promote():
  params = make_params(dtype=jnp.bfloat16)
  grads = {k: jnp.ones(s, jnp.bfloat16) for k, s in SHAPES.items()}
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0)
  state = tx.init(params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(state.mu))
  updates, _ = tx.update(grads, state, params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(updates))
  tx32 = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, moment_format="float32")
  updates32, _ = tx32.update(grads, tx32.init(params), params)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(updates32))


def test_state_is_a_namedtuple_with_tree_get_and_abstract_init():
  params = make_params()
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, mu_dtype=jnp.bfloat16)
  state = tx.init(params)
  assert isinstance(state, optax_hybrid.HybridAdamState)
  assert state.count.dtype == jnp.int32 and state.count.shape == ()
  chained_state = optax.chain(optax.clip(1.0), tx).init(params)
  mu = optax.tree_utils.tree_get(chained_state, "mu")
  chex.assert_trees_all_equal_shapes(mu, params)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(mu))
  abstract = jax.eval_shape(tx.init, params)
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, state)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  chex.assert_trees_all_equal_shapes_and_dtypes(tx.init(shapes), state)


def test_update_without_params_when_no_decay():
  # No decay needs no params: three steps of tx.update(g, state) against optax.adam (AdamW without decay;
  # optax.adamw asks for params even at weight_decay=0), also called without params, and the float64 model.
  params, grads = make_params(), make_grads(3)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0)
  theirs_tx = optax.adam(1e-2)
  state, theirs_state, p = tx.init(params), theirs_tx.init(params), dict(params)
  for g in grads:
    updates, state = jax.jit(tx.update)(g, state)
    theirs, theirs_state = theirs_tx.update(g, theirs_state)
    chex.assert_trees_all_close(updates, theirs, rtol=1e-5, atol=1e-8)
    p = {k: p[k] + updates[k] for k in p}
  want, _, _ = adamw_steps(params, grads, [1e-2] * 3, weight_decay=0.0)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[-1][k], rtol=1e-6, atol=1e-7)


def test_zero_size_and_scalar_leaves():
  params = {"empty": jnp.zeros((0, 3)), "scalar": jnp.asarray(2.0)}
  grads = {"empty": jnp.zeros((0, 3)), "scalar": jnp.asarray(0.5)}
  tx = optax_hybrid.hybrid_adamw(0.1, weight_decay=0.1)
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert updates["empty"].shape == (0, 3)
  (ref,), _, _ = adamw_steps({"scalar": 2.0}, [{"scalar": 0.5}], [0.1], weight_decay=0.1)
  np.testing.assert_allclose(2.0 + float(updates["scalar"]), ref["scalar"], rtol=1e-6)


# --- bad input: every case is a row of docs/errors.md, tested in test_errors.py ---

def test_inject_hyperparams_bf16_beta_rounding_is_explained():
  params = make_params(dtype=jnp.bfloat16)
  tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-3)
  with pytest.raises(ValueError, match="hyperparam_dtype=jnp.float32"):
    tx.init(params)  # b2=0.999 rounds to 1.0 in bf16
  tx32 = optax.inject_hyperparams(optax_hybrid.hybrid_adamw, hyperparam_dtype=jnp.float32)(learning_rate=1e-3)
  state = tx32.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  updates, _ = jax.jit(tx32.update)(grads, state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_parity_with_torch_when_installed(adamw_mode):
  torch = pytest.importorskip("torch")
  params, grads = make_params(), make_grads(15)
  lrs = [colossal_lr(k, PEAK, TOTAL, WARMUP, ETA_MIN) for k in range(15)]
  tensors = {k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in params.items()}
  cls = torch.optim.AdamW if adamw_mode else torch.optim.Adam
  opt = cls(list(tensors.values()), lr=lrs[0], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
  for g, lr in zip(grads, lrs):
    opt.param_groups[0]["lr"] = lr
    for k, t in tensors.items():
      t.grad = torch.tensor(g[k])
    opt.step()
  tx = optax_hybrid.hybrid_adamw(schedule(), b2=0.95, weight_decay=0.1, adamw_mode=adamw_mode)
  history, _ = run(tx, params, grads)
  for k, t in tensors.items():
    np.testing.assert_allclose(np.asarray(history[-1][k]), t.detach().numpy(), rtol=2e-5, atol=5e-6)


# --- non-finite gradients ---------------------------------------------------

def _poison(grads, step, leaf, value):
  grads = [dict(g) for g in grads]
  bad = np.array(grads[step][leaf], copy=True)
  bad.flat[0] = value
  grads[step][leaf] = bad
  return grads


@pytest.mark.parametrize("tier", ["device", "pinned_host", "host_params"])
def test_nonfinite_steps_are_skipped_in_every_tier(tier):
  params, grads = make_params(), make_grads(5)
  params = jax.device_put(params, jax.devices()[0])
  bad = _poison(_poison(grads, 1, "w", np.nan), 3, "s", np.inf)
  kind = "pinned_host" if tier == "pinned_host" else None
  if tier == "host_params":
    params = jax.device_put(params, jax.memory.Space.Host)
  tx = optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1, state_memory_kind=kind, skip_nonfinite=True)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  jaxpr = jax.make_jaxpr(step)(params, tx.init(params), bad[0])
  assert optax_hybrid.host_arithmetic_outside_host_compute(jaxpr) == []
  step = jax.jit(step)
  p, s = params, tx.init(params)
  for i, g in enumerate(bad):
    before = (p, s)
    p, s = step(p, s, g)
    if i in (1, 3):  # skipped: params, moments and count exactly as before
      chex.assert_trees_all_equal(jax.device_get(p), jax.device_get(before[0]))
      chex.assert_trees_all_equal(jax.device_get(s.mu), jax.device_get(before[1].mu))
      chex.assert_trees_all_equal(jax.device_get(s.nu), jax.device_get(before[1].nu))
      assert int(s.count) == int(before[1].count)
  assert int(s.count) == 3 and int(s.skipped) == 2
  # Equal to a run that never saw the bad steps.
  clean = [g for i, g in enumerate(grads) if i not in (1, 3)]
  p_ref, s_ref = params, tx.init(params)
  for g in clean:
    p_ref, s_ref = step(p_ref, s_ref, g)
  chex.assert_trees_all_equal(jax.device_get(p), jax.device_get(p_ref))
  chex.assert_trees_all_equal(jax.device_get(s.nu), jax.device_get(s_ref.nu))
  assert {x.sharding.memory_kind for x in jax.tree.leaves(s.mu)} == {"device" if tier == "device" else "pinned_host"}


def test_nonfinite_grads_without_the_option_propagate():
  params, grads = make_params(), _poison(make_grads(1), 0, "b", np.nan)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0)
  updates, state = tx.update(grads[0], tx.init(params), params)
  assert np.isnan(np.asarray(updates["b"])).any() and int(state.count) == 1


def test_composes_with_optax_apply_if_finite():
  params, grads = make_params(), _poison(make_grads(3), 1, "w", np.inf)
  tx = optax.apply_if_finite(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1), max_consecutive_errors=2)
  history, state = run(tx, params, grads)
  chex.assert_trees_all_equal(history[1], history[0])
  assert int(state.inner_state.count) == 2 and int(state.total_notfinite) == 1
  clean, _ = run(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1), params, [grads[0], grads[2]])
  chex.assert_trees_all_close(history[-1], clean[-1], rtol=1e-6)


# --- complex parameters -----------------------------------------------------

def test_complex_params_match_optax_adamw():
  rng = np.random.default_rng(5)
  cplx = lambda *s: (rng.normal(size=s) + 1j * rng.normal(size=s)).astype(np.complex64)
  params = {"z": jnp.asarray(cplx(4, 3)), "r": jnp.asarray(rng.normal(size=5), jnp.float32)}
  grads = [{"z": cplx(4, 3), "r": rng.normal(size=5).astype(np.float32)} for _ in range(10)]
  ours, s_ours = run(optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.05), params, grads)
  theirs, s_theirs = run(optax.adamw(schedule(), weight_decay=0.05), params, grads)
  for a, b in zip(ours, theirs):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-7)
  assert s_ours.nu["z"].dtype == jnp.float32  # |g|^2 is real: half optax's storage
  # |g|^2 from a complex product: a few more float32 roundings than the real case.
  np.testing.assert_allclose(np.asarray(s_ours.nu["z"]), np.asarray(s_theirs[0].nu["z"]).real, rtol=3e-5)
  assert np.abs(np.asarray(s_theirs[0].nu["z"]).imag).max() == 0


# --- the fused one-pass step ------------------------------------------------

@pytest.mark.parametrize("kernel", ["xla", "auto"])
@pytest.mark.parametrize("tier", ["device", "pinned_host", "host_params"])
def test_step_equals_update_then_apply(kernel, tier):
  params = jax.device_put(make_params(), jax.devices()[0])
  if tier == "host_params":
    params = jax.device_put(params, jax.memory.Space.Host)
  grads = make_grads(6)
  tx = optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1, kernel=kernel, skip_nonfinite=True,
                                 state_memory_kind="pinned_host" if tier == "pinned_host" else None)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  fused = jax.jit(tx.step, donate_argnums=(0, 1))
  p_fused, s_fused = jax.tree.map(jnp.copy, params), tx.init(params)
  for g in _poison(grads, 2, "b", np.nan):
    p_fused, s_fused = fused(p_fused, s_fused, g)
  assert int(s_fused.count) == 5 and int(s_fused.skipped) == 1
  clean = [g for i, g in enumerate(grads) if i != 2]
  p_two, _ = run(tx, params, clean)
  chex.assert_trees_all_close(jax.device_get(p_fused), jax.device_get(p_two[-1]), rtol=1e-6, atol=1e-7)
  expected_kind = "device" if tier == "device" else "pinned_host"
  assert {x.sharding.memory_kind for x in jax.tree.leaves(s_fused.mu)} == {expected_kind}
  if tier == "host_params":
    assert {x.sharding.memory_kind for x in jax.tree.leaves(p_fused)} == {"pinned_host"}


def test_step_rounds_bf16_params_once():
  params = make_params(dtype=jnp.bfloat16)
  grads = [{k: jnp.asarray(v, jnp.bfloat16) for k, v in g.items()} for g in make_grads(6)]
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, moment_format="float32")
  ref, _ = adamw_steps_stored_as(params, grads, 1e-2, ml_dtypes.bfloat16, weight_decay=0.1)
  p, s = params, tx.init(params)
  step = jax.jit(tx.step)
  for t, (g, ref_t) in enumerate(zip(grads, ref), start=1):
    p, s = step(p, s, g)
    for k in ref_t:
      assert p[k].dtype == jnp.bfloat16
      # One rounding of p + u (in float32) against one rounding in float64: equal
      # but for rare ties at the last bit.
      mismatch = np.mean(np.asarray(p[k], np.float64) != ref_t[k])
      assert mismatch < 0.02, (k, t, mismatch)
      np.testing.assert_allclose(np.asarray(p[k], np.float64), ref_t[k], rtol=2**-8)


def test_shard_state_over_on_a_one_device_mesh_steps_like_optax_adamw():
  # ZeRO-1 over a mesh of one device has nothing to split: the state stays whole and nothing is gathered
  # back (it raised an AttributeError at init, found by mutation testing).
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = {"w": jax.device_put(jnp.linspace(-1.0, 1.0, 32).reshape(8, 4), on_mesh)}
  grads = {"w": jax.device_put(jnp.full((8, 4), 0.5), on_mesh)}
  tx = optax_hybrid.hybrid_adamw(1e-3, shard_state_over="data")
  new, _ = jax.jit(tx.step)(params, tx.init(params), grads)
  ref = optax.adamw(1e-3)
  updates, _ = ref.update(grads, ref.init(params), params)
  np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(optax.apply_updates(params, updates)["w"]), rtol=1e-6)


def test_step_rows_refuses_params_rows_that_are_not_the_gradients_rows():
  tx = optax_hybrid.hybrid_adamw(1e-3)
  params = {"layers": jnp.ones((3, 4)), "head": jnp.ones(4)}
  parts = tx.begin_step(params, tx.init(params), {"layers": True, "head": False})
  with pytest.raises(ValueError, match="`params` must hold n rows of each leaf stepped by rows"):
    parts.step_rows(parts.buffers, {"layers": jnp.ones((1, 4))}, 0, {"layers": params["layers"][:2]})
  buffers = parts.step_rows(parts.buffers, {"layers": jnp.ones((1, 4))}, 0, {"layers": params["layers"][:1]})
  assert buffers[0].first.shape == (3, 4)
