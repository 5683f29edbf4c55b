"""Where every leaf's optimizer state lives, for every tier, fraction, master setting, kernel and path.

For each placement the test states, per param leaf (in ``jax.tree.leaves``
order), the tier it expects and so where its ``mu``, ``nu`` and fp32 master
live: device memory, ``pinned_host`` memory (each with the param's sharding
and only the memory kind changed), or a file of the right size (disk tier,
master in ``pinned_host``). It checks that before a step, after a jitted step
with params and state donated, and after a second one, and that every moment
was really written where it lives (non-zero after a step with non-zero
gradients); and that the step has host compute exactly when a leaf is on the
host tier (its update runs on the host CPU). The expected tiers are written out by hand from the documented
rules (leaves taken in order, each when at least half of it fits within the
fraction; disk first), not computed with the library's own helpers.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid import disk
from stepping import grads_like, placed_params

pytestmark = pytest.mark.skipif("pinned_host" not in optax_hybrid.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")

# Leaves in jax.tree.leaves order: a (768), b (16), c (512), d (8); 1304 in all.
SHAPES = {"a": (48, 16), "b": (16,), "c": (16, 32), "d": (8,)}

KIND = {"device": "device", "host_state": "pinned_host", "host": "pinned_host", "disk": None}

# name: (hybrid_adamw arguments, expected tier of a, b, c, d)
PLACEMENTS = {
    "device": (dict(tiers="device"), ("device",) * 4),
    "host_state": (dict(tiers="host_state"), ("host_state",) * 4),
    "host": (dict(tiers="host"), ("host",) * 4),
    "disk": (dict(tiers="disk"), ("disk",) * 4),
    "memory_kind_pinned_host": (dict(state_memory_kind="pinned_host"), ("host_state",) * 4),
    # 70% of 1304 = 912.8: a (384 <= 912.8), b (768 + 8), not c (784 + 256), d (784 + 4).
    "offload_fraction": (dict(offload_fraction=0.7), ("host", "host", "device", "host")),
    "offload_fraction_over_host_state": (dict(state_memory_kind="pinned_host", offload_fraction=0.7),
                                         ("host", "host", "host_state", "host")),
    "nvme_offload_fraction": (dict(nvme_offload_fraction=0.7), ("disk", "disk", "device", "disk")),
    # Disk first: 50% = 652 takes a (384) only; then 40% = 521.6 of the rest in
    # order: b (8), c (16 + 256), not d (528 + 4).
    "both_fractions": (dict(nvme_offload_fraction=0.5, offload_fraction=0.4), ("disk", "host", "host", "device")),
    "tree_of_tiers": (dict(tiers={"a": "disk", "b": "host", "c": "host_state", "d": "device"}),
                      ("disk", "host", "host_state", "device")),
}


def check_where_the_state_lives(params, state, expected, master, stepped, when, param_kind="device", kinds=KIND):
  assert state.plan.tiers == expected, when
  assert state.count.sharding.memory_kind == "device", when
  p_leaves = jax.tree.leaves(params)
  trees = {"mu": jax.tree.leaves(state.mu), "nu": jax.tree.leaves(state.nu)}
  file_or_none = lambda x: x is None or isinstance(x, disk.DiskMoment)  # DiskMoments are static: no leaves
  files = {name: jax.tree.leaves(disk.files_of(state, name), is_leaf=file_or_none) for name in trees}
  if master:
    trees["master"] = jax.tree.leaves(state.master)
  else:
    assert state.master is None, when
  for name, leaves in trees.items():
    assert len(leaves) == len(p_leaves), (when, name)
    for i, (param, tier, x, key) in enumerate(zip(p_leaves, expected, leaves, sorted(SHAPES))):
      where = f"{when}: {name}[{key!r}] ({tier} tier)"
      assert param.sharding.memory_kind == param_kind, where
      if tier == "disk" and name != "master":
        moment = files[name][i]
        assert isinstance(moment, disk.DiskMoment), f"{where}: {type(moment).__name__}, not a file"
        assert moment.nbytes == param.size * 4, where
        # The state holds an empty entry there, in the master's memory, sharded like the param.
        assert x.size == 0 and x.ndim == max(param.ndim, 1), (where, x.shape)
        assert x.sharding == param.sharding.with_memory_kind("pinned_host"), (where, x.sharding)
        value = disk.read(moment)
      else:
        assert name == "master" or files[name][i] is None, where
        kind = "pinned_host" if tier == "disk" else kinds[tier]
        assert isinstance(x, jax.Array), f"{where}: {type(x).__name__}"
        assert x.sharding.memory_kind == kind, f"{where}: in {x.sharding.memory_kind}, expected {kind}"
        assert x.sharding == param.sharding.with_memory_kind(kind), (where, x.sharding, param.sharding)
        assert x.shape == param.shape, where
        value = np.asarray(jax.device_get(x))
      if name == "master":
        assert x.dtype == jnp.float32, where
      elif stepped:
        assert np.any(value != 0), f"{where}: the moment was not written"
      else:
        assert not np.any(value), where


def donated_step(tx, fused):
  if fused:
    return jax.jit(tx.step, donate_argnums=(0, 1))

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  return jax.jit(step, donate_argnums=(0, 1))


# Every placement and path with each kernel; the Pallas kernel (interpret mode
# on a CPU, slow) with bf16 params and fp32 masters only, the case that also
# places masters.
KERNEL_CASES = [("xla", False), ("xla", True), ("native", False), ("native", True), ("pallas", True)]


@pytest.mark.parametrize("fused", [False, True], ids=["update_apply", "step"])
@pytest.mark.parametrize("kernel,master", KERNEL_CASES,
                         ids=[f"{k}-{'bf16_fp32_master' if m else 'f32'}" for k, m in KERNEL_CASES])
@pytest.mark.parametrize("placement_name", sorted(PLACEMENTS))
def test_every_leaf_state_lives_where_its_tier_says(placement_name, kernel, master, fused, tmp_path):
  kw, expected = PLACEMENTS[placement_name]
  dtype = jnp.bfloat16 if master else jnp.float32
  params = placed_params(SHAPES, dtype)
  grads = grads_like(params, 2)
  extra = dict(master_dtype=jnp.float32, mu_dtype=jnp.float32, nu_dtype=jnp.float32) if master else {}
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel=kernel, nvme_offload_dir=tmp_path, **kw, **extra)
  try:
    state = tx.init(params)
    check_where_the_state_lives(params, state, expected, master, False, "after init")
    step = donated_step(tx, fused)
    # Where the update is computed: host compute exactly when a leaf is on the host tier.
    lowered = step.lower(params, state, grads[0]).as_text()
    assert ('_xla_compute_type = "host"' in lowered) == ("host" in expected), "host compute"
    for i, g in enumerate(grads):
      params, state = step(params, state, g)
      check_where_the_state_lives(params, state, expected, master, True, f"after donated step {i + 1}")
  finally:
    tx.close()


@pytest.mark.parametrize("fused", [False, True], ids=["update_apply", "step"])
@pytest.mark.parametrize("kernel", ["xla", "native"])
@pytest.mark.parametrize("state_memory_kind", [None, "pinned_host", "device"])
def test_params_in_host_memory_are_on_the_host_tier_whatever_the_state_kind(state_memory_kind, kernel, fused):
  # Params that live in host memory are updated on the host: their tier is
  # "host" whatever state_memory_kind asks, and their moments sit beside them
  # unless it asks for device memory ("computed on the host, wherever its
  # state is", tiers.resolve).
  params = jax.device_put(placed_params(SHAPES), jax.memory.Space.Host)
  kinds = {"host": "device" if state_memory_kind == "device" else "pinned_host"}
  grads = grads_like(params, 2)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel=kernel, state_memory_kind=state_memory_kind)
  state = tx.init(params)
  expected = ("host",) * len(SHAPES)
  check_where_the_state_lives(params, state, expected, False, False, "after init", "pinned_host", kinds)
  step = donated_step(tx, fused)
  assert '_xla_compute_type = "host"' in step.lower(params, state, grads[0]).as_text()
  for i, g in enumerate(grads):
    params, state = step(params, state, g)
    check_where_the_state_lives(params, state, expected, False, True, f"after donated step {i + 1}",
                                "pinned_host", kinds)


def test_a_state_without_a_plan_is_refused_with_a_clear_error():
  # Every decision of a step comes from the plan init made: a HybridAdamState
  # built by hand without one (plan=None) cannot be stepped.
  params = placed_params(SHAPES)
  grads = grads_like(params, 1)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel="xla")
  unplanned = tx.init(params)._replace(plan=None)
  with pytest.raises(TypeError, match="has no placement plan"):
    tx.update(grads[0], unplanned, params)
