"""Run by test_multidevice.py in a subprocess with 8 simulated CPU devices."""

import os

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import optax_hybrid  # noqa: E402

assert jax.device_count() == 8
mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
specs = {"w": P("data", "model"), "b": P("model"), "r": P(), "h": P("data")}
shapes = {"w": (16, 6), "b": (6,), "r": (3,), "h": (8, 5)}
rng = np.random.default_rng(0)
host_values = {k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()}
grads_np = [{k: rng.normal(size=s).astype(np.float32) for k, s in shapes.items()} for _ in range(4)]


def shard(tree, memory_kind="device"):
  return {k: jax.device_put(v, NamedSharding(mesh, specs[k], memory_kind=memory_kind)) for k, v in tree.items()}


sched = optax_hybrid.warmup_cosine_schedule(1e-2, total_steps=4, warmup_steps=1, eta_min=1e-3)
tx = optax_hybrid.hybrid_adamw(sched, weight_decay=0.1, state_memory_kind="pinned_host")


def step(p, s, g):
  u, s = tx.update(g, s, p)
  return optax_hybrid.apply_updates(p, u), s


# Sharded run: "h" itself lives in host memory (updated by host compute).
params = shard(host_values)
params["h"] = jax.device_put(params["h"], params["h"].sharding.with_memory_kind("pinned_host"))
state = tx.init(params)
for name in ("mu", "nu"):
  for k, leaf in getattr(state, name).items():
    assert leaf.sharding == params[k].sharding.with_memory_kind("pinned_host"), (name, k, leaf.sharding)
jstep = jax.jit(step, donate_argnums=(0, 1))
for g in grads_np:
  params, state = jstep(params, state, shard(g))
for name in ("mu", "nu"):
  for k, leaf in getattr(state, name).items():
    assert leaf.sharding.memory_kind == "pinned_host", (name, k)
    assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, specs[k], memory_kind="pinned_host"), len(shapes[k])), (name, k, leaf.sharding)
for k in shapes:
  assert params[k].sharding.is_equivalent_to(
      NamedSharding(mesh, specs[k], memory_kind="pinned_host" if k == "h" else "device"), len(shapes[k])), (k, params[k].sharding)

# Single-device run of the same steps.
one = jax.devices()[0]
p1 = jax.device_put({k: jnp.asarray(v) for k, v in host_values.items()}, one)
s1 = tx.init(p1)
for g in grads_np:
  p1, s1 = jax.jit(step)(p1, s1, g)
for k in shapes:
  np.testing.assert_allclose(np.asarray(jax.device_get(params[k])), np.asarray(p1[k]), rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(np.asarray(jax.device_get(state.nu[k])), np.asarray(s1.nu[k]), rtol=1e-6, atol=1e-12)
# A checkpoint round trip keeps every leaf's mesh, spec and memory kind.
import tempfile  # noqa: E402

with tempfile.TemporaryDirectory() as d:
  manager = optax_hybrid.checkpoint.manager(d)
  optax_hybrid.checkpoint.save(manager, 4, {"params": params, "opt": state}, wait=True)
  restored = optax_hybrid.checkpoint.restore(manager, like={"params": params, "opt": state})
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves({"params": params, "opt": state})):
    assert a.sharding == b.sharding, (path, a.sharding, b.sharding)
    np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
  again, _ = jstep(restored["params"], restored["opt"], shard(grads_np[0]))

# The host tier with sharded params: each leaf updated in host compute, state
# keeping the params' shardings in pinned_host; bf16 params with an fp32 master.
tiered = optax_hybrid.hybrid_adamw(sched, weight_decay=0.1, tiers={"w": "host", "b": "host_state", "r": "device",
                                                                    "h": "host"})
params_t = shard(host_values)
state_t = tiered.init(params_t)
for k in ("w", "b", "h"):
  assert state_t.mu[k].sharding == params_t[k].sharding.with_memory_kind("pinned_host"), k
tstep = jax.jit(lambda p, s, g: tiered.step(p, s, g), donate_argnums=(0, 1))
for g in grads_np:
  params_t, state_t = tstep(params_t, state_t, shard(g))
for k in shapes:
  np.testing.assert_allclose(np.asarray(jax.device_get(params_t[k])), np.asarray(p1[k]), rtol=1e-6, atol=1e-7)
  assert params_t[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), len(shapes[k])), k

# ZeRO-1: replicated params, state split over "data" (moments and master), in
# both memory kinds; the params stay replicated and equal the one-device run.
def replicated():
  return {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in host_values.items()}


for kind in ("device", "pinned_host"):
  zero = optax_hybrid.hybrid_adamw(sched, weight_decay=0.1, state_memory_kind=kind, shard_state_over="data")
  pz = replicated()
  sz = zero.init(pz)
  # "w" (16, 6) and "h" (8, 5) split their first dimension over data (4); "b" (6,) and "r" (3,) cannot.
  expected = {"w": P("data", None), "h": P("data", None), "b": P(), "r": P()}
  for k in shapes:
    for leaf in (sz.mu[k], sz.nu[k]):
      assert leaf.sharding.memory_kind == kind, (k, leaf.sharding)
      assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, expected[k], memory_kind=kind), len(shapes[k])), (
          k, leaf.sharding)
  # Each device holds a quarter of w's moments.
  assert sz.mu["w"].addressable_shards[0].data.shape == (4, 6)
  zstep = jax.jit(step_fn := (lambda p, s, g, tx=zero: (lambda u, s: (optax_hybrid.apply_updates(p, u), s))(
      *tx.update(g, s, p))), donate_argnums=(0, 1))
  fused = jax.jit(zero.step, donate_argnums=(0, 1))
  pf = replicated()
  sf = zero.init(pf)
  for g in grads_np:
    gz = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in g.items()}
    pz, sz = zstep(pz, sz, gz)
    pf, sf = fused(pf, sf, gz)
  for k in shapes:
    for got in (pz[k], pf[k]):
      assert got.sharding.is_equivalent_to(NamedSharding(mesh, P()), len(shapes[k])), (kind, k, got.sharding)
      np.testing.assert_allclose(np.asarray(jax.device_get(got)), np.asarray(p1[k]), rtol=1e-6, atol=1e-7)
    assert sz.mu[k].sharding.is_equivalent_to(NamedSharding(mesh, expected[k], memory_kind=kind), len(shapes[k]))
    np.testing.assert_allclose(np.asarray(jax.device_get(sz.nu[k])), np.asarray(s1.nu[k]), rtol=1e-6, atol=1e-12)

# ZeRO-1 with a state that does not start at zero (Adagrad's accumulator): split like the moments above, every
# element the initial value (mutmut: transform._leaf_state 19, the ZeRO-1 state made zeros, survived the
# one-device selection).
za = optax_hybrid.hybrid_adagrad(1e-2, initial_accumulator_value=0.25, shard_state_over="data").init(replicated())
for k in shapes:
  acc = za.sum_of_squares[k]
  assert acc.sharding.is_equivalent_to(NamedSharding(mesh, expected[k]), len(shapes[k])), (k, acc.sharding)
  np.testing.assert_array_equal(np.asarray(jax.device_get(acc)), np.full(shapes[k], 0.25, np.float32))

# ZeRO-1 with bf16 params and an fp32 master split over "data".
bf = {k: jax.device_put(v.astype(jnp.bfloat16), NamedSharding(mesh, P())) for k, v in host_values.items()}
zm = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.0, state_memory_kind="pinned_host", shard_state_over="data",
                               master_dtype=jnp.float32, mu_dtype=jnp.float32, nu_dtype=jnp.float32)
szm = zm.init(bf)
assert szm.master["w"].sharding.is_equivalent_to(NamedSharding(mesh, P("data", None), memory_kind="pinned_host"), 2)
bf2, szm = jax.jit(zm.step)(bf, szm, {k: jnp.asarray(v, jnp.bfloat16) for k, v in grads_np[0].items()})
np.testing.assert_array_equal(np.asarray(jax.device_get(bf2["w"]), np.float32),
                              np.asarray(jax.device_get(szm.master["w"]).astype(jnp.bfloat16), np.float32))

# ZeRO-1 on a mesh with Explicit axes (jax.make_mesh's default in JAX 0.10):
# the update is resharded back instead of constrained.
explicit = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
pe = {"w": jax.device_put(host_values["w"], NamedSharding(explicit, P()))}
ze = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, shard_state_over="data", state_memory_kind="pinned_host")
se = ze.init(pe)
assert se.mu["w"].sharding.spec == P("data", None), se.mu["w"].sharding
pe2, se2 = jax.jit(ze.step)(pe, se, {"w": jax.device_put(grads_np[0]["w"], NamedSharding(explicit, P()))})
assert pe2["w"].sharding.spec in (P(), P(None, None)), pe2["w"].sharding
single = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1)
want, _ = jax.jit(single.step)({"w": jnp.asarray(host_values["w"])}, single.init({"w": jnp.asarray(host_values["w"])}),
                               {"w": jnp.asarray(grads_np[0]["w"])})
np.testing.assert_allclose(np.asarray(jax.device_get(pe2["w"])), np.asarray(want["w"]), rtol=1e-6)

# The custom kernels run per shard under shard_map: the native CPU kernel (one
# custom call per device program, no gathers) and the Pallas kernel (interpret
# mode here), on sharded params, host state, a ZeRO-1 state and bf16 with a master;
# all equal the XLA rule.
from optax_hybrid.kernels import native_cpu  # noqa: E402

kernels_to_check = ["pallas"] + (["native"] if native_cpu.available() else [])
cases = {
    "sharded, host state": dict(state_memory_kind="pinned_host"),
    "ZeRO-1": dict(shard_state_over="data"),
}
for case, options in cases.items():
  results = {}
  for kernel in ["xla"] + kernels_to_check:
    tk = optax_hybrid.hybrid_adamw(sched, weight_decay=0.1, kernel=kernel, **options)
    pk = shard(host_values) if case != "ZeRO-1" else replicated()
    sk = tk.init(pk)
    kstep = jax.jit(tk.step)
    for g in grads_np:
      gk = shard(g) if case != "ZeRO-1" else {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in g.items()}
      pk, sk = kstep(pk, sk, gk)
    results[kernel] = (pk, sk)
    if kernel == "native":
      compiled = kstep.lower(pk, sk, gk).compile().as_text()
      assert native_cpu.TARGET in compiled, case
      if case != "ZeRO-1":
        assert "all-gather" not in compiled, case  # each device updates its own shards
  for kernel in kernels_to_check:
    for a, b in zip(jax.tree.leaves(results[kernel]), jax.tree.leaves(results["xla"])):
      assert a.sharding == b.sharding, (case, kernel, a.sharding, b.sharding)
      np.testing.assert_allclose(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)), rtol=1e-6,
                                 atol=1e-7, err_msg=f"{case} {kernel}")
# optax.tree_utils.tree_map_params: the state's shardings from the params'
# partition specs, for every tier that runs on a mesh and ZeRO-1, with fp32
# masters for the bf16 leaves and empty entries for the float32 one ("b").
# The state is placed with them (jax.device_put), and a step jitted with them
# as in/out shardings equals the one-device step.
import optax  # noqa: E402
from optax_hybrid import tiers as tiers_lib  # noqa: E402

mixed = {k: v.astype(np.float32 if k == "b" else jnp.bfloat16) for k, v in host_values.items()}
mixed_grads = {k: jnp.asarray(v, mixed[k].dtype) for k, v in grads_np[0].items()}
masters = dict(master_dtype=jnp.float32, mu_dtype=jnp.float32, nu_dtype=jnp.float32, weight_decay=0.1)
one_tx = optax_hybrid.hybrid_adamw(1e-2, **masters)
one_params = {k: jnp.asarray(v) for k, v in mixed.items()}
want_params, _ = jax.jit(one_tx.step)(one_params, one_tx.init(one_params), mixed_grads)
OTHER = P()  # count, skipped and the plan: replicated
for name, options in {"device": dict(tiers="device"), "host_state": dict(tiers="host_state"),
                      "host": dict(tiers="host"), "ZeRO-1": dict(tiers="host_state", shard_state_over="data")}.items():
  tx_m = optax_hybrid.hybrid_adamw(1e-2, **masters, **options)
  params_m = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in mixed.items()}
  if name == "ZeRO-1":  # replicated params; the state's specs are the params' split over "data"
    params_m = {k: jax.device_put(v, NamedSharding(mesh, P())) for k, v in mixed.items()}
  param_specs = {k: v.sharding.spec for k, v in params_m.items()}
  state_specs = param_specs if name != "ZeRO-1" else {
      k: (tiers_lib.zero1_sharding(p, "data") or p.sharding).spec for k, p in params_m.items()}
  state_m = tx_m.init(params_m)
  # Optax's alias-test form: the params-shaped fields map to the specs, the rest to OTHER.
  got = optax.tree_utils.tree_map_params(tx_m, lambda _, spec: spec, state_m, state_specs,
                                         transform_non_params=lambda _: OTHER)
  assert got == optax_hybrid.HybridAdamState(OTHER, state_specs, state_specs, OTHER, state_specs, plan=OTHER), (name, got)
  # Shardings with each entry's memory kind; the plan's entry is a replicated sharding.
  shardings = optax.tree_utils.tree_map_params(
      tx_m, lambda x, spec: NamedSharding(mesh, spec, memory_kind=x.sharding.memory_kind), state_m, state_specs,
      transform_non_params=lambda _: NamedSharding(mesh, OTHER))
  placed = jax.device_put(state_m, shardings)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(placed), jax.tree.leaves(state_m)):
    # An empty entry holds no bytes: init replicates it over the mesh (as a step returns it), the specs split it.
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim) or a.size == b.size == 0, (name, path, a.sharding,
                                                                                        b.sharding)
  assert placed.master["b"].shape == (0,) and placed.master["w"].sharding.memory_kind == tx_m.init(
      params_m).master["w"].sharding.memory_kind
  param_shardings = jax.tree.map(lambda p: p.sharding, params_m)
  jitted = jax.jit(tx_m.step, in_shardings=(param_shardings, shardings, param_shardings),
                   out_shardings=(param_shardings, shardings), donate_argnums=(0, 1))
  got_params, got_state = jitted(params_m, placed, {k: jax.device_put(v, param_shardings[k])
                                                     for k, v in mixed_grads.items()})
  for k in shapes:
    np.testing.assert_array_equal(np.asarray(jax.device_get(got_params[k]), np.float32),
                                  np.asarray(want_params[k], np.float32), err_msg=f"{name} {k}")
  for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(shardings)):
    assert a.sharding.is_equivalent_to(b, a.ndim), (name, a.sharding, b)

# A checkpoint saved on the (4, 2) mesh restores onto another mesh (8 devices
# in another order, another axis layout) and into another tier.
with tempfile.TemporaryDirectory() as d:
  manager = optax_hybrid.checkpoint.manager(d)
  optax_hybrid.checkpoint.save(manager, 4, {"params": params, "opt": state}, wait=True)
  other_mesh = jax.sharding.Mesh(np.array(jax.devices()[::-1]).reshape(2, 4), ("data", "model"))
  other_specs = {"w": P("model", "data"), "b": P(), "r": P(), "h": P(None, None)}
  other_params = {k: jax.device_put(v, NamedSharding(other_mesh, other_specs[k])) for k, v in host_values.items()}
  other_tx = optax_hybrid.hybrid_adamw(sched, weight_decay=0.1, tiers="host")
  like = {"params": other_params, "opt": other_tx.init(other_params)}
  restored = optax_hybrid.checkpoint.restore(manager, like=like)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(like)):
    assert a.sharding == b.sharding, (path, a.sharding, b.sharding)
  for k in shapes:
    np.testing.assert_array_equal(np.asarray(jax.device_get(restored["opt"].nu[k])),
                                  np.asarray(jax.device_get(state.nu[k])))
  assert int(restored["opt"].count) == int(state.count)
  # Stepping from there equals stepping the saved state.
  other_grads = {k: jax.device_put(v, NamedSharding(other_mesh, other_specs[k])) for k, v in grads_np[0].items()}
  p_a, s_a = jax.jit(other_tx.step)(restored["params"], restored["opt"], other_grads)
  p_b, s_b = jax.jit(tx.step)(params, state, shard(grads_np[0]))
  for k in shapes:
    np.testing.assert_allclose(np.asarray(jax.device_get(p_a[k])), np.asarray(jax.device_get(p_b[k])), rtol=1e-6,
                               atol=1e-7)
# optax_hybrid.commit commits what Optax leaves uncommitted (inject_hyperparams'
# values and count) replicated over the mesh of the sharded params: one compile.
tx_i = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, tiers="host")
p_i = shard(host_values)
p_i, s_i = optax_hybrid.commit((p_i, tx_i.init(p_i)))
assert s_i.hyperparams["learning_rate"].sharding == NamedSharding(mesh, P()), s_i.hyperparams["learning_rate"].sharding
assert s_i.inner_state.mu["w"].sharding.memory_kind == "pinned_host"
step_i = jax.jit(lambda p, s, g: (lambda u, s: (optax_hybrid.apply_updates(p, u), s))(*tx_i.update(g, s, p)))
for g in grads_np[:3]:
  p_i, s_i = step_i(p_i, s_i, shard(g))
assert step_i._cache_size() == 1, step_i._cache_size()
print("MULTIDEVICE OK")
