"""The rules besides AdamW (Lion, Adagrad, SGD with momentum and Nesterov, plain SGD) through the whole engine.

Each is compared with its Optax counterpart (``optax.lion``, ``optax.adagrad``,
``optax.sgd``) called with the same arguments, over 50 steps, in every tier
and ``offload_fraction``, with master weights, under ``optax.chain``,
``MultiSteps``, ``inject_hyperparams`` and ``tree_map_params``; with 8-bit
storage against a float64 model of the quantized rule
(``numpy_reference``); through a checkpoint restored into another tier; and
in the memory report.
"""

import inspect
from typing import Any, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpy_reference as nr
import optax_hybrid
from stepping import placed_params
from test_quantized import assert_codes_match

needs_host = pytest.mark.skipif("pinned_host" not in optax_hybrid.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")

# name: (ours, theirs, arguments both take, the state field it keeps or None)
RULES = {
    "lion": (optax_hybrid.hybrid_lion, optax.lion, dict(b1=0.8, weight_decay=0.1), "mu"),
    "adagrad": (optax_hybrid.hybrid_adagrad, optax.adagrad, dict(initial_accumulator_value=0.2), "sum_of_squares"),
    "sgd_nesterov": (optax_hybrid.hybrid_sgd, optax.sgd, dict(momentum=0.9, nesterov=True), "trace"),
    "sgd": (optax_hybrid.hybrid_sgd, optax.sgd, {}, None),
}
SHAPES = {"w": (16, 24), "b": (24,), "s": ()}
STEPS = 50
LR = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, STEPS, 1e-3)
TIERS = {"device": dict(state_memory_kind="device"), "host_state": dict(state_memory_kind="host_state"), "host": dict(state_memory_kind="host"),
         "disk": dict(state_memory_kind="disk"), "offload_fraction": dict(state_memory_kind=optax_hybrid.by_fraction(host=0.5))}


def make_params(dtype=jnp.float32):
  return {k: v.astype(dtype) for k, v in placed_params(SHAPES).items()}


def make_grads(params, n=STEPS, seed=1):
  rng = np.random.default_rng(seed)
  # Mixed magnitudes, as real gradients have.
  return [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape) * 10.0 ** rng.integers(-2, 2), p.dtype),
                       params) for _ in range(n)]


def run_optax(tx, params, grads):
  state = tx.init(params)
  update = jax.jit(tx.update)
  for g in grads:
    u, state = update(g, state, params)
    params = optax.apply_updates(params, u)
  return params, state


def run_step(tx, params, grads):
  state = tx.init(params)
  step = jax.jit(tx.step)
  for g in grads:
    params, state = step(params, state, g)
  return params, state


def test_each_signature_is_its_optax_counterparts_then_keyword_only_options():
  for ours, theirs, _, _ in RULES.values():
    mine = inspect.signature(ours).parameters.values()
    positional = [(p.name, p.default) for p in mine if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == [(p.name, p.default) for p in inspect.signature(theirs).parameters.values()]
    keyword_only = [p.name for p in mine if p.kind is inspect.Parameter.KEYWORD_ONLY]
    kept = [n for n in optax_hybrid.options.OPTION_NAMES if n not in optax_hybrid.options.DEPRECATED_OPTIONS]
    assert keyword_only == kept
    # The older spellings bind through **deprecated (and warn): tests/test_spellings.py.
    assert [p.kind for p in mine][-1] is inspect.Parameter.VAR_KEYWORD


@needs_host
@pytest.mark.parametrize("tier", list(TIERS))
@pytest.mark.parametrize("rule", list(RULES))
def test_matches_its_optax_counterpart_over_50_steps_in_every_tier(rule, tier, tmp_path):
  ours, theirs, kw, field = RULES[rule]
  params = make_params()
  grads = make_grads(params)
  tx = ours(LR, **kw, **TIERS[tier], nvme_offload_dir=tmp_path)
  got, state = run_step(tx, params, grads)
  want, want_state = run_optax(theirs(LR, **kw), params, grads)
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)
  if field is not None:  # the state, as stored (disk: read from its files)
    (values,) = optax_hybrid.moment_values(state)
    chex.assert_trees_all_close(values, optax.tree_utils.tree_get(want_state, field), rtol=2e-5, atol=1e-6)
  else:
    assert optax_hybrid.moment_values(state) == ()
  assert int(state.count) == STEPS
  if tier in ("host_state", "host") and field is not None:
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(getattr(state, field)))
  tx.close()


@pytest.mark.parametrize("rule", list(RULES))
def test_master_weights_follow_optax_in_float32(rule):
  ours, theirs, kw, field = RULES[rule]
  params = make_params(jnp.bfloat16)
  grads = make_grads(params, 20)
  tx = ours(LR, **kw, master="float32", moment_format=None if field is None else "float32")
  got, state = run_step(tx, params, grads)
  # optax on the float32 values of the bf16 params and gradients: what the master follows.
  f32 = lambda t: jax.tree.map(lambda x: x.astype(jnp.float32), t)
  want, _ = run_optax(theirs(LR, **kw), f32(params), [f32(g) for g in grads])
  chex.assert_trees_all_close(state.master, want, rtol=2e-5, atol=2e-6)
  chex.assert_trees_all_equal(got, jax.tree.map(lambda m: m.astype(jnp.bfloat16), state.master))


# --- 8-bit storage against the float64 model of the quantized rule ------------------------------------

QUANT_SHAPES = {"w": (24, 300), "e": (16, 512)}  # both quantized (>= 4096 values), "w" ends in a short block
MODELS = {
    "lion": lambda g, p, m, lr: nr.lion_step64(g, p, m, lr=lr, b1=0.8, b2=0.99, weight_decay=0.1),
    "adagrad": lambda g, p, s, lr: nr.adagrad_step64(g, p, s, lr=lr, eps=1e-7),
    "sgd_nesterov": lambda g, p, b, lr: nr.sgd_step64(g, p, b, lr=lr, momentum=0.9, nesterov=True),
}


@needs_host
@pytest.mark.parametrize("tier", ["device", "host", "disk"])
@pytest.mark.parametrize("rule", list(MODELS))
def test_8bit_state_follows_the_float64_model(rule, tier, tmp_path):
  ours, _, kw, field = RULES[rule]
  signed = rule != "adagrad"
  params = placed_params(QUANT_SHAPES)
  lr = 1e-2
  tx = ours(lr, **kw, moment_format="8bit", state_memory_kind=tier, nvme_offload_dir=tmp_path, kernel="xla")
  state = tx.init(params)
  assert all(leaf.moments is optax_hybrid.moments.BLOCKWISE_8BIT for leaf in state.plan.leaves)
  step = jax.jit(tx.step)
  for g in make_grads(params, 3):
    codes_before = {k: np.asarray(v) for k, v in _stored(state, field).items()}
    scales_before = {k: np.asarray(v) for k, v in _stored(state, field + "_scales").items()}
    old = {k: nr.dequantize_blockwise(codes_before[k], scales_before[k], signed) for k in params}
    want = {k: MODELS[rule](np.asarray(g[k]), np.asarray(params[k]), old[k], float(np.float32(lr))) for k in params}
    params, state = step(params, state, g)
    for k in params:
      new_p, new_state = want[k]
      np.testing.assert_allclose(np.asarray(params[k], np.float64), new_p, rtol=2e-5, atol=2e-6)
      assert_codes_match(_stored(state, field)[k], _stored(state, field + "_scales")[k], new_state, signed)
  tx.close()


def _stored(state, name):
  """A field's codes or scales as stored: the state's arrays, or the disk tier's files."""
  files = optax_hybrid.disk.files_of(state, name)
  return {k: optax_hybrid.disk.read(f) if f is not None else np.asarray(getattr(state, name)[k])
          for k, f in files.items()}


# --- the Optax wrappers --------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", list(RULES))
def test_under_chain_and_multisteps_as_optax(rule):
  ours, theirs, kw, _ = RULES[rule]
  params = make_params()
  grads = make_grads(params, 8)
  wrap = lambda make: optax.MultiSteps(optax.chain(optax.clip_by_global_norm(1.0), make(LR, **kw)), 2)
  got, _ = run_optax(wrap(ours), params, grads)
  want, _ = run_optax(wrap(theirs), params, grads)
  chex.assert_trees_all_close(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("rule", list(RULES))
def test_inject_hyperparams_changes_without_recompiling(rule):
  ours, theirs, kw, _ = RULES[rule]
  params = make_params()
  grads = make_grads(params, 4)
  results = []
  for make in (ours, theirs):
    tx = optax.inject_hyperparams(make)(learning_rate=1e-2, **kw)
    update = jax.jit(tx.update)
    p, s = params, tx.init(params)
    for i, g in enumerate(grads):
      s.hyperparams["learning_rate"] = jnp.asarray(1e-2 / (i + 1), jnp.float32)
      u, s = update(g, s, p)
      p = optax.apply_updates(p, u)
      if i == 1:  # (the first call's committed outputs retrace once, for optax's own rules too)
        compiled = update._cache_size()
    assert update._cache_size() == compiled  # new values of the injected rate: no recompile
    results.append(p)
  chex.assert_trees_all_close(*results, rtol=2e-5, atol=2e-6)


@needs_host
@pytest.mark.parametrize("rule", list(RULES))
def test_tree_map_params_maps_every_params_shaped_field(rule, tmp_path):
  ours, _, kw, field = RULES[rule]
  params = make_params(jnp.bfloat16)
  tx = ours(1e-3, **kw, state_memory_kind="host", master="float32")
  state = tx.init(params)
  specs = {k: f"spec-{k}" for k in SHAPES}
  mapped = optax.tree_utils.tree_map_params(tx, lambda _, spec: spec, state, specs,
                                            transform_non_params=lambda _: "other")
  assert mapped.count == mapped.skipped == mapped.plan == "other"
  assert mapped.master == specs
  if field is not None:
    assert getattr(mapped, field) == specs


# --- checkpoints and the memory report -----------------------------------------------------------------

@needs_host
@pytest.mark.parametrize("rule", list(RULES))
def test_a_checkpoint_restores_into_another_tier(rule, tmp_path):
  pytest.importorskip("orbax.checkpoint")
  ours, _, kw, field = RULES[rule]
  params = make_params()
  grads = make_grads(params, 6)
  device = ours(LR, **kw, state_memory_kind="device")
  p, s = run_step(device, params, grads[:3])
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt")
  optax_hybrid.checkpoint.save(manager, 3, {"params": p, "opt": s}, wait=True)
  want, want_state = run_step(device, params, grads)
  for tier in ("host", "disk"):
    tx = ours(LR, **kw, state_memory_kind=tier, nvme_offload_dir=tmp_path)
    restored = optax_hybrid.checkpoint.restore(manager, like={"params": params, "opt": tx.init(params)})
    assert restored["opt"].plan.tiers == (tier,) * len(SHAPES)
    q, t = restored["params"], restored["opt"]
    step = jax.jit(tx.step)
    for g in grads[3:]:
      q, t = step(q, t, g)
    chex.assert_trees_all_close(q, want, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(optax_hybrid.moment_values(t), optax_hybrid.moment_values(want_state),
                                rtol=1e-6, atol=1e-7)
    tx.close()


@needs_host
@pytest.mark.parametrize("rule", list(RULES))
def test_the_memory_report_counts_the_rules_state(rule):
  ours, _, kw, field = RULES[rule]
  params = make_params()
  n = sum(x.size for x in jax.tree.leaves(params))
  report = optax_hybrid.memory_report(params, ours(1e-3, **kw, state_memory_kind="pinned_host").init(params))
  fields = 0 if field is None else 1
  assert report.by_component["moments"] == {"device": 0, "host": 4 * n * fields, "disk": 0}
  assert report.num_leaves_without_state == (len(SHAPES) if field is None else 0)


# --- the Pallas kernel runs the rules it lists ---------------------------------------------------------

@pytest.mark.parametrize("moment_format", [None, "8bit"])
@pytest.mark.parametrize("rule", [r for r in RULES if RULES[r][3] is not None])
def test_the_pallas_kernel_steps_like_the_reference(rule, moment_format):
  ours, _, kw, _ = RULES[rule]
  params = placed_params({"w": (16, 512), "b": (24,)})  # "w": whole 256-value blocks, 8-bit when asked
  grads = make_grads(params, 3)
  results = [run_step(ours(1e-2, **kw, kernel=k, moment_format=moment_format), params, grads) for k in ("pallas", "xla")]
  (p_pallas, s_pallas), (p_xla, s_xla) = results
  chex.assert_trees_all_close(p_pallas, p_xla, rtol=2e-6, atol=1e-7)
  for a, b in zip(jax.tree.leaves(s_pallas), jax.tree.leaves(s_xla)):
    if a.dtype == jnp.uint8:  # both quantize the same float32 values: a difference is a near tie
      assert np.abs(np.asarray(a, np.int64) - np.asarray(b, np.int64)).max() <= 1
    else:
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-8)


def test_a_rule_the_pallas_kernel_does_not_list_takes_the_reference(monkeypatch):
  # Kernels declare the rules they run (pallas_gpu.RULES): a rule they have never seen (Lion under another name,
  # as a factored rule, wrong on a tile, would come) is stepped by the reference, the kernel never launched.
  from optax_hybrid import transform
  from optax_hybrid.kernels import native_cpu, pallas_gpu
  from optax_hybrid.rules import Adagrad, AdamW, Lion, Sgd

  class RenamedLion(Lion):
    name = "renamed_lion"

  assert all(pallas_gpu.implements(rule) for rule in (AdamW(), Lion(), Adagrad(), Sgd()))
  assert not pallas_gpu.implements(RenamedLion()) and not native_cpu.implements(RenamedLion())
  monkeypatch.setattr(pallas_gpu, "_run", lambda *a, **k: pytest.fail("the Pallas kernel ran a rule it does not list"))
  params = make_params()
  grads = make_grads(params, 2)
  ours = run_step(transform.optimizer(RenamedLion(b1=0.8, weight_decay=0.1), 1e-2, kernel="pallas"), params, grads)
  reference = run_step(optax_hybrid.hybrid_lion(1e-2, b1=0.8, weight_decay=0.1, kernel="xla"), params, grads)
  chex.assert_trees_all_equal(ours[0], reference[0])
  chex.assert_trees_all_equal(ours[1].mu, reference[1].mu)


@pytest.mark.parametrize("moment_format", [None, "8bit"])
def test_every_rule_compiles_for_an_h100_as_one_triton_launch_in_place(moment_format, cuda_compiler_plugin):
  from optax_hybrid import gpu_compile
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=one_device) for k, s in {"w": (256, 2048),
                                                                                     "b": (2048,)}.items()}
  for rule, (ours, _, kw, field) in RULES.items():
    tx = ours(1e-3, **kw, kernel="pallas", moment_format=moment_format)
    state = tx.init(params)
    report = gpu_compile.compile_for_gpu(tx.step, params, state, params, target="h100", donate_argnums=(0, 1))
    state_bytes = sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(getattr(state, field or "master")))
    assert report.triton_launches == 1, rule  # plain SGD too: the kernel reads g and p, writes p
    assert report.warnings == (), rule
    # Params and the rule's state (codes and scales) are updated in place.
    assert report.device_alias_bytes >= 4 * (256 * 2048 + 2048) + state_bytes, rule


@pytest.mark.parametrize("make,name,value", [
    (optax_hybrid.hybrid_lion, "b1", 1.5), (optax_hybrid.hybrid_lion, "b2", 1.5),
    (optax_hybrid.hybrid_lion, "weight_decay", -0.1), (optax_hybrid.hybrid_sgd, "momentum", -0.1),
    (optax_hybrid.hybrid_adagrad, "eps", -1e-8), (optax_hybrid.hybrid_adagrad, "initial_accumulator_value", -0.1),
])
def test_a_hyperparameter_out_of_its_range_is_refused_naming_the_function_and_the_argument(make, name, value):
  # The ranges of the rules' papers and Optax's docstrings: Lion's betas in [0, 1], every other value >= 0.
  # mutmut: rules.lion Lion.check 6 (b2's bound 1 -> 2) and rules.sgd Sgd.check 2 (the owner None) survived.
  with pytest.raises(ValueError, match=rf"^{make.__name__}: `{name}` must be "):
    make(1e-3, **{name: value})
  make(1e-3, **{name: 1.0 if name.startswith("b") else 0.0})  # the edge is accepted


def test_a_rules_state_type_is_checked_when_the_rule_is_defined():
  # A rule's state: count, skipped, master, plan and, per params-shaped field, <field>_scales (docs/architecture.md).
  # mutmut: every mutant of base._params_shaped (then rules._params_shaped) survived (the built-in rules are defined at import, before a test).
  from optax_hybrid.base import STATE_TYPES, UpdateRule

  class GoodState(NamedTuple):
    count: Any
    skipped: Any
    mu: Any
    mu_scales: Any
    master: Any
    plan: Any

  class Good(UpdateRule):
    state_type = GoodState

  assert STATE_TYPES[GoodState] == ("mu", "mu_scales", "master")

  class NoScales(NamedTuple):
    count: Any
    skipped: Any
    mu: Any
    master: Any
    plan: Any

  class NotANamedTuple:
    pass

  for bad in (NoScales, NotANamedTuple):
    with pytest.raises(TypeError, match=rf"^{bad.__name__}: a rule's state is a NamedTuple with count, skipped"):
      type("Bad", (UpdateRule,), {"state_type": bad})
