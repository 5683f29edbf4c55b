"""Tests for optax_hybrid.placement: host-memory moments, host compute, memory kinds."""

import re
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import placement
from numpy_reference import adamw_steps

SHAPES = {"w": (33, 17), "b": (17,), "s": ()}


def make_params(seed=0):
  rng = np.random.default_rng(seed)
  params = {k: jnp.asarray(rng.normal(size=s), jnp.float32) for k, s in SHAPES.items()}
  # Committed, as a model placed on its device is.
  return jax.device_put(params, jax.devices()[0])


def make_grads(steps, seed=1):
  rng = np.random.default_rng(seed)
  return [{k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]


def kinds(tree):
  return jax.tree.map(lambda x: x.sharding.memory_kind, tree)


def train(tx, params, grads, donate=True):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1) if donate else ())
  params = jax.tree.map(jnp.copy, params)
  state = tx.init(params)
  for g in grads:
    params, state = step(params, state, g)
  return params, state, step


def schedule():
  return optax_hybrid.warmup_cosine_schedule(1e-2, total_steps=8, warmup_steps=2, eta_min=1e-3)


def test_host_moments_stay_on_host_and_match_device_run():
  params, grads = make_params(), make_grads(6)
  host_tx = optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1, state_memory_kind="pinned_host")
  device_tx = optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1)
  init_state = host_tx.init(params)
  assert kinds(init_state.mu) == {k: "pinned_host" for k in SHAPES}
  assert kinds(init_state.nu) == {k: "pinned_host" for k in SHAPES}
  assert init_state.count.sharding.memory_kind == "device"

  p_host, s_host, step = train(host_tx, params, grads)
  p_dev, s_dev, _ = train(device_tx, params, grads)
  assert kinds(s_host.mu) == {k: "pinned_host" for k in SHAPES}
  assert kinds(s_host.nu) == {k: "pinned_host" for k in SHAPES}
  assert kinds(p_host) == {k: "device" for k in SHAPES}
  chex.assert_trees_all_close(p_host, p_dev, rtol=1e-6)
  chex.assert_trees_all_close(s_host.mu, s_dev.mu, rtol=1e-6)

  # The compiled executable itself declares the moments' home.
  compiled = step.lower(p_host, s_host, grads[0]).compile()
  out_state_shardings = compiled.output_shardings[1]
  assert {s.memory_kind for s in jax.tree.leaves(out_state_shardings.mu)} == {"pinned_host"}
  assert {s.memory_kind for s in jax.tree.leaves(out_state_shardings.nu)} == {"pinned_host"}
  assert out_state_shardings.count.memory_kind == "device"


def test_state_only_donation_with_explicit_shardings():
  # Without out_shardings, jit pairs donated buffers with outputs by shape
  # only; a host buffer could then be matched with a device output.
  params, grads = make_params(), make_grads(2)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind="pinned_host")
  state = tx.init(params)
  shardings = jax.tree.map(lambda x: x.sharding, state)
  param_shardings = jax.tree.map(lambda x: x.sharding, params)
  update = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=(1,),
                   in_shardings=(param_shardings, shardings, param_shardings),
                   out_shardings=(param_shardings, shardings))
  for g in grads:
    _, state = update(g, state, params)
  assert kinds(state.mu) == {k: "pinned_host" for k in SHAPES}


def test_eager_update_with_host_moments():
  params, (g,) = make_params(), make_grads(1)
  tx = optax_hybrid.hybrid_adamw(0.05, weight_decay=0.1, state_memory_kind="pinned_host")
  updates, state = tx.update(g, tx.init(params), params)
  assert kinds(state.mu) == {k: "pinned_host" for k in SHAPES}
  (ref,), _, _ = adamw_steps(params, [g], [0.05], weight_decay=0.1)
  for k in SHAPES:
    np.testing.assert_allclose(np.asarray(params[k]) + np.asarray(updates[k]), ref[k], rtol=1e-5, atol=1e-7)


def test_callable_memory_kind_per_leaf():
  params, grads = make_params(), make_grads(3)
  choose = lambda path, p: "pinned_host" if np.size(p) > 100 else None
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind=choose)
  p_mixed, s_mixed, _ = train(tx, params, grads)
  assert kinds(s_mixed.mu) == {"w": "pinned_host", "b": "device", "s": "device"}
  p_dev, _, _ = train(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0), params, grads)
  chex.assert_trees_all_close(p_mixed, p_dev, rtol=1e-6)
  bad = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind=lambda path, p: "vram")
  with pytest.raises(ValueError, match=r"state_memory_kind\(\['b'\]\)"):
    bad.init(params)


def test_host_params_are_updated_with_host_compute():
  params, grads = make_params(), make_grads(5)
  host_params = jax.device_put(params, jax.memory.Space.Host)
  tx = optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1)
  state = tx.init(host_params)
  assert kinds(state.mu) == {k: "pinned_host" for k in SHAPES}  # beside the params

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  lowered = jax.jit(step).lower(host_params, state, grads[0]).as_text()
  assert "_xla_compute_type" in lowered  # the update really is host compute
  p_host, s_host, _ = train(tx, host_params, grads)
  p_dev, s_dev, _ = train(tx, params, grads)
  assert kinds(p_host) == {k: "pinned_host" for k in SHAPES}
  assert kinds(s_host.nu) == {k: "pinned_host" for k in SHAPES}
  chex.assert_trees_all_close(jax.device_get(p_host), jax.device_get(p_dev), rtol=1e-6)
  chex.assert_trees_all_close(jax.device_get(s_host.nu), jax.device_get(s_dev.nu), rtol=1e-6)


def test_no_arithmetic_on_host_values_outside_host_compute():
  params, (g,) = make_params(), make_grads(1)
  host_params = jax.device_put({"w": params["w"]}, jax.memory.Space.Host)
  mixed = {**host_params, "b": params["b"], "s": params["s"]}
  grads = {k: jnp.asarray(v) for k, v in g.items()}
  for state_kind in (None, "pinned_host", "device"):
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax_hybrid.hybrid_adamw(schedule(), weight_decay=0.1, state_memory_kind=state_kind),
    )

    def good_step(p, s, g, tx=tx):
      u, s = tx.update(g, s, p)
      return optax_hybrid.apply_updates(p, u), s

    jaxpr = jax.make_jaxpr(good_step)(mixed, tx.init(mixed), grads)
    assert optax_hybrid.host_arithmetic_outside_host_compute(jaxpr) == [], state_kind

  def bad_step(p, s, g, tx=tx):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s  # adds on host values outside host compute

  found = optax_hybrid.host_arithmetic_outside_host_compute(
      jax.make_jaxpr(bad_step)(mixed, tx.init(mixed), grads))
  assert found and all("<host>" in line for line in found), found


def test_apply_updates_handles_every_memory_kind():
  params = make_params()
  mixed = {"w": jax.device_put(params["w"], jax.memory.Space.Host), "b": params["b"], "s": None}
  updates = {"w": jnp.ones(SHAPES["w"]), "b": jax.device_put(jnp.ones(SHAPES["b"]), jax.memory.Space.Host), "s": None}
  for fn in (optax_hybrid.apply_updates, jax.jit(optax_hybrid.apply_updates)):
    out = fn(mixed, updates)
    assert out["w"].sharding.memory_kind == "pinned_host"
    assert out["b"].sharding.memory_kind == "device"
    assert out["s"] is None
    np.testing.assert_allclose(np.asarray(out["w"]), np.asarray(params["w"]) + 1, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(out["b"]), np.asarray(params["b"]) + 1, rtol=1e-6)
  with pytest.raises(ValueError, match="tree structure"):
    optax_hybrid.apply_updates(mixed, {"w": updates["w"]})


def test_missing_memory_kind_lists_what_the_backend_has():
  device_only = types.SimpleNamespace(
      platform="fakegpu", id=3, addressable_memories=lambda: [types.SimpleNamespace(kind="device")])
  on_it = types.SimpleNamespace(shape=(4,), dtype=np.dtype(np.float32), ndim=1,
                                sharding=types.SimpleNamespace(device_set=[device_only], memory_kind="device"))
  for asked in ("pinned_host", "host", lambda path, p: "disk"):
    words = "`state_memory_kind(['w'])`='disk'" if callable(asked) else f"`state_memory_kind`={asked!r}"
    with pytest.raises(ValueError, match=re.escape(f"{words} keeps the state in 'pinned_host', which fakegpu "
                                                   "device 3 does not have: it has memory kinds 'device'")):
      optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=asked).init({"w": on_it})
  assert "pinned_host" in optax_hybrid.available_memory_kinds()


def test_abstract_init_describes_host_placement():
  params = make_params()
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind="pinned_host")
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
  abstract = tx.init(shapes)
  assert {s.sharding.memory_kind for s in jax.tree.leaves(abstract.mu)} == {"pinned_host"}
  chex.assert_trees_all_equal_shapes_and_dtypes(abstract, tx.init(params))


def test_row_major_constrains_matrices_whole_on_one_device_and_shard_by_shard_on_a_mesh():
  # What host compute's operands get (placement.to_host): the row-major layout, for a value sharded over
  # several devices per shard (the partitioner would otherwise gather it), and nothing for a vector.
  # Traced over abstract meshes, so one CPU device suffices. mutmut: _compat.row_major 1 (no constraint)
  # and 16 (a two-device sharding constrained whole) survived.
  from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec
  from optax_hybrid import _compat

  def primitives(sharding, shape):
    jaxpr = jax.make_jaxpr(lambda x: _compat.row_major(x, sharding))(jax.ShapeDtypeStruct(shape, jnp.float32))
    found = []
    for eqn in jaxpr.eqns:
      found.append(eqn.primitive.name)
      found += [f"{eqn.primitive.name}/{e.primitive.name}" for e in getattr(eqn.params.get("jaxpr"), "eqns", ())]
      if eqn.primitive.name == "layout_constraint":
        assert eqn.params["layout"].major_to_minor == tuple(range(len(shape)))
    return found

  mesh = lambda n: AbstractMesh((n,), ("d",), axis_types=(AxisType.Auto,))
  assert primitives(None, (6, 4)) == ["layout_constraint"]
  assert primitives(None, (2, 3, 4)) == ["layout_constraint"]
  assert primitives(None, (6,)) == [] and primitives(NamedSharding(mesh(2), PartitionSpec("d")), (6,)) == []
  assert primitives(NamedSharding(mesh(1), PartitionSpec("d")), (6, 4)) == ["layout_constraint"]
  for n in (2, 8):
    assert primitives(NamedSharding(mesh(n), PartitionSpec("d")), (8, 4)) == ["shard_map", "shard_map/layout_constraint"]


@pytest.mark.parametrize("tiers", ["device", "host_state"])
def test_an_abstract_state_has_its_step_counter_replicated_over_the_params_devices(tiers):
  # Abstract params (ShapeDtypeStructs with shardings: what a checkpoint is restored into) give an abstract
  # count placed as a concrete init places it: on the params' devices, in device memory, replicated.
  # mutmut: placement.step_counter_like 36 (the abstract count's sharding dropped) survived.
  from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
  device = jax.devices()[0]
  mesh = jax.make_mesh((1,), ("d",))
  tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=tiers)
  for sharding, spec in ((SingleDeviceSharding(device), None), (NamedSharding(mesh, PartitionSpec("d")), PartitionSpec())):
    count = tx.init({"w": jax.ShapeDtypeStruct((4, 3), jnp.float32, sharding=sharding)}).count
    assert isinstance(count, jax.ShapeDtypeStruct) and count.shape == () and count.dtype == jnp.int32
    assert type(count.sharding) is type(sharding) and count.sharding.device_set == {device}
    assert count.sharding.memory_kind == "device"
    if spec is not None:
      assert count.sharding.spec == spec and count.sharding.mesh == mesh
