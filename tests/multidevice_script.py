"""Run by test_multidevice.py in a subprocess with 8 simulated CPU devices."""

import os

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
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
print("MULTIDEVICE OK")
