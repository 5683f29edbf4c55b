"""optax.tree_utils.tree_map_params over hybrid_adamw states: every tier, master weights, the wrappers.

Large-model code builds the optimizer state's shardings from the params'
partition specs with ``tree_map_params``; these tests do it as Optax's own
alias tests do (the params-shaped fields mapped to specs, everything else
through ``transform_non_params``) and compare with what the same call gives
for ``optax.adamw``. The expected trees are written out by hand.
Multi-device placement with the specs obtained is checked in
``multidevice_script.py``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import HybridAdamState
from stepping import grads_like, placed_params

TIERS = ["device", "host_state", "host", "disk"]
needs_host = pytest.mark.skipif("pinned_host" not in optax_hybrid.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")

# "w" and "s" are bf16 (a master with master=jnp.float32), "b" is float32 (none).
SHAPES = {"w": (8, 4), "b": (4,), "s": ()}
# Stand-ins for partition specs: any leaf that is not a pytree node.
SPECS = {"w": "spec-w", "b": "spec-b", "s": "spec-s"}
OTHER = "non-params"


def make_params():
  params = placed_params(SHAPES)
  return {k: v.astype(jnp.float32 if k == "b" else jnp.bfloat16) for k, v in params.items()}


def specs_of(tx, state, **kw):
  return optax.tree_utils.tree_map_params(tx, lambda _, spec: spec, state, SPECS, transform_non_params=lambda _: OTHER,
                                          **kw)


@needs_host
@pytest.mark.parametrize("master", [False, True], ids=["no_master", "master"])
@pytest.mark.parametrize("tier", TIERS)
def test_specs_map_onto_every_params_shaped_field(tier, master, tmp_path):
  params = make_params()
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=tier, nvme_offload_dir=tmp_path,
                                 master=jnp.float32 if master else None)
  state = tx.init(params)
  expected = HybridAdamState(count=OTHER, mu=SPECS, nu=SPECS, skipped=OTHER, master=SPECS if master else None,
                             plan=OTHER)
  assert specs_of(tx, state) == expected
  # What optax.adamw gives for its moments, field for field.
  (adam_state, *_) = specs_of(optax.adamw(1e-3), optax.adamw(1e-3).init(params))
  assert (adam_state.count, adam_state.mu, adam_state.nu) == (OTHER, SPECS, SPECS)

  # The mapped function sees one array per param leaf: the moment itself, or
  # an empty entry (shape (0,) * max(ndim, 1)) where the leaf keeps nothing there.
  seen = optax.tree_utils.tree_map_params(tx, lambda x, p: (isinstance(x, jax.Array), x.shape, p.shape), state, params)
  full = {"w": (True, (8, 4), (8, 4)), "b": (True, (4,), (4,)), "s": (True, (), ())}
  empty = {"w": (True, (0, 0), (8, 4)), "b": (True, (0,), (4,)), "s": (True, (0,), ())}
  assert seen.mu == seen.nu == (empty if tier == "disk" else full)
  if master:
    assert seen.master == {**full, "b": empty["b"]}

  # The identity map keeps the state (Optax's alias tests), and it still steps.
  same = optax.tree_utils.tree_map_params(tx, lambda v: v, state)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(state)))
  tx.close()


@needs_host
@pytest.mark.parametrize("tier", TIERS)
def test_specs_map_onto_the_scales_of_8bit_moments(tier, tmp_path):
  # "w" (64 x 512 = 32768 values) keeps 8-bit moments, "b" float32 ones (an empty scales entry).
  params = jax.device_put({"w": jnp.ones((64, 512)), "b": jnp.zeros(4)}, jax.devices()[0])
  specs = {"w": "spec-w", "b": "spec-b"}
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=tier, nvme_offload_dir=tmp_path, moment_format="8bit")
  state = tx.init(params)
  got = optax.tree_utils.tree_map_params(tx, lambda _, spec: spec, state, specs, transform_non_params=lambda _: OTHER)
  assert got == HybridAdamState(count=OTHER, mu=specs, nu=specs, skipped=OTHER, master=None, mu_scales=specs,
                                nu_scales=specs, plan=OTHER)
  seen = optax.tree_utils.tree_map_params(tx, lambda x, p: (x.dtype.name, x.shape), state, params)
  if tier == "disk":  # codes and scales are files: empty entries in the state
    assert seen.mu["w"] == ("uint8", (0, 0)) and seen.mu_scales["w"] == ("float32", (0, 0))
  else:
    assert seen.mu["w"] == ("uint8", (64, 512)) and seen.mu_scales["w"] == ("float32", (64, 2))
  assert seen.nu_scales["b"] == ("float32", (0,))
  tx.close()


def test_init_on_the_params_placeholder_marks_the_params_shaped_fields_and_cannot_step():
  placeholder = optax.tree_utils._state_utils._ParamsPlaceholder()
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, master=jnp.float32)
  state = tx.init(placeholder)
  assert state.mu is placeholder and state.nu is placeholder and state.master is placeholder
  assert "no plan" in repr(state.plan) and jax.tree.leaves(state.plan) == [state.plan]  # a leaf, not a Plan
  assert optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0).init(placeholder).master is None
  with pytest.raises(TypeError, match="the state has no placement plan"):
    tx.update({"w": jnp.ones(3)}, state, {"w": jnp.ones(3)})


def test_abstract_state_from_eval_shape():
  params = make_params()
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, master=jnp.float32, state_memory_kind=optax_hybrid.by_fraction(host=0.5))
  abstract = jax.eval_shape(tx.init, params)
  assert specs_of(tx, abstract) == HybridAdamState(OTHER, SPECS, SPECS, OTHER, SPECS, plan=OTHER)
  # The abstract state describes the real one exactly (empty entries included).
  real = tx.init(params)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), abstract) == jax.tree.map(lambda a: (a.shape, a.dtype), real)


def _masked_specs(keep):
  return {k: (SPECS[k] if keep[k] else "masked") for k in SPECS}


def _wrappers():
  hybrid = lambda **kw: optax_hybrid.hybrid_adamw(1e-3, master=jnp.float32, **kw)
  mask = {"w": True, "b": False, "s": True}
  label = lambda tree: {"w": "a", "b": "b", "s": "b"}
  every = {k: True for k in SPECS}
  return {
      # name: (transform, {path of each HybridAdamState in the state: which params it holds})
      "chain": (optax.chain(optax.clip_by_global_norm(1.0), hybrid(state_memory_kind=optax_hybrid.by_fraction(host=0.5))), [every]),
      "masked": (optax.masked(hybrid(state_memory_kind="host_state"), mask), [mask]),
      "MultiSteps": (optax.MultiSteps(hybrid(state_memory_kind="host"), 2), [every]),
      "multi_transform": (optax.multi_transform({"a": hybrid(state_memory_kind="host"), "b": hybrid(state_memory_kind="disk")}, label),
                          [{"w": True, "b": False, "s": False}, {"w": False, "b": True, "s": True}]),
      # master is static: inject_hyperparams would call jnp.float32 as a schedule.
      "inject_hyperparams": (optax.inject_hyperparams(optax_hybrid.hybrid_adamw, hyperparam_dtype=jnp.float32,
                                                      static_args=("master", "state_memory_kind"))(
          learning_rate=1e-3, master=jnp.float32, state_memory_kind="disk"), [every]),
      "standard_optimizer": (optax_hybrid.standard_optimizer(
          1e-3, total_steps=100, accumulation_steps=2, param_groups={"s": {"lr_multiplier": 2.0}, "b": {"frozen": True}},
          state_memory_kind="pinned_host", master=jnp.float32),
          [{"w": True, "b": False, "s": False}, {"w": False, "b": False, "s": True}]),
  }


@needs_host
@pytest.mark.parametrize("name", list(_wrappers()))
def test_through_optax_wrappers_and_the_recipe(name):
  tx, held = _wrappers()[name]
  params = make_params()
  state = tx.init(params)
  is_masked = lambda v: isinstance(v, optax.MaskedNode)
  # As Optax's masked tests do: masked-out params are MaskedNodes in the state.
  got = optax.tree_utils.tree_map_params(tx, lambda v, spec: "masked" if is_masked(v) else spec, state, SPECS,
                                         transform_non_params=lambda _: OTHER, is_leaf=is_masked)
  is_hybrid = lambda x: isinstance(x, HybridAdamState)
  hybrid_states = [s for s in jax.tree.leaves(got, is_leaf=is_hybrid) if is_hybrid(s)]
  assert len(hybrid_states) == len(held)
  for s, keep in zip(hybrid_states, held):
    assert s.count == s.skipped == s.plan == OTHER
    assert s.mu == s.nu == s.master == _masked_specs(keep)
  # Nothing but specs and the non-params marker is left.
  assert set(jax.tree.leaves(got)) <= set(SPECS.values()) | {OTHER, "masked"}
  same = optax.tree_utils.tree_map_params(tx, lambda v: v, state, is_leaf=is_masked)
  assert jax.tree.structure(same) == jax.tree.structure(state)
  for part in jax.tree.leaves(tx, is_leaf=lambda x: isinstance(x, optax_hybrid.HybridOptimizer)):
    if isinstance(part, optax_hybrid.HybridOptimizer):
      part.close()


@needs_host
def test_shardings_from_tree_map_params_place_and_step_the_state(tmp_path):
  # Every tier in one state, a master for the bf16 leaves; shardings made from
  # each entry's memory kind and a "spec" (here: the one device).
  params = make_params()
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, master=jnp.float32, nvme_offload_dir=tmp_path,
                                 state_memory_kind={"w": "host", "b": "disk", "s": "host_state"})
  state = tx.init(params)
  device = jax.devices()[0]
  sharding = lambda kind="device": jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
  # The static plan goes through transform_non_params: None (Optax's
  # documented example) or a sharding stands for its (no) arrays either way.
  for transform in (lambda _: None, lambda _: sharding()):
    shardings = optax.tree_utils.tree_map_params(tx, lambda x, _: sharding(x.sharding.memory_kind), state, params,
                                                 transform_non_params=transform)
    assert shardings.plan == transform(None)
    placed = jax.device_put(state, shardings)
    for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(state)):
      assert a.sharding == b.sharding
  param_shardings = jax.tree.map(lambda p: p.sharding, params)
  step = jax.jit(tx.step, in_shardings=(param_shardings, shardings, param_shardings),
                 out_shardings=(param_shardings, shardings))
  grads = grads_like(params, 1)[0]
  got_params, got_state = step(params, placed, grads)
  reference = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, master=jnp.float32)
  want_params, want_state = jax.jit(reference.step)(params, reference.init(params), grads)
  for k in params:
    np.testing.assert_array_equal(np.asarray(got_params[k], np.float32), np.asarray(want_params[k], np.float32))
  np.testing.assert_allclose(np.asarray(got_state.master["w"]), np.asarray(want_state.master["w"]), rtol=1e-6)
  assert got_state.mu["w"].sharding.memory_kind == "pinned_host" and got_state.mu["b"].shape == (0,)
  tx.close()
