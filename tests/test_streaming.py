"""optax_hybrid.scan_layers on the CPU: the values and gradients of ``lax.scan`` over a checkpointed layer, where the layers live.

The reference is what a user writes without it:
``jax.lax.scan(jax.checkpoint(lambda c, a: (layer_fn(c, *a), None)), carry, (layers, xs))[0]``.
What it does on a GPU (one layer on the device at a time, bus bytes,
prefetch) is checked by compiling for the H200 target:
tests/test_streaming_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid

L, D = 5, 16
HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def make_layers(dtype=jnp.float32, key=0):
  k1, k2, k3 = jax.random.split(jax.random.key(key), 3)
  return {"w": (jax.random.normal(k1, (L, D, D)) * 0.4).astype(dtype),
          "b": (jax.random.normal(k2, (L, D)) * 0.1).astype(dtype),
          "gain": (1 + 0.1 * jax.random.normal(k3, (L,))).astype(dtype)}


def make_xs():
  return {"key": jax.random.split(jax.random.key(7), L), "mask": jnp.linspace(0.5, 1.5, L)}


def layer(c, p, x, scale):
  """A layer reading its params, a per-layer key and mask, and a value closed over by the caller (``scale``)."""
  noise = 0.01 * jax.random.normal(x["key"], c["h"].shape)
  h = jnp.tanh((c["h"] @ p["w"] * scale + p["b"]) * p["gain"] + noise) * x["mask"].astype(c["h"].dtype)
  return {"h": h.astype(c["h"].dtype), "sum": c["sum"] + h.sum().astype(c["sum"].dtype)}


def ours(carry, layers, xs, scale, **kw):
  out = optax_hybrid.scan_layers(lambda c, p, x: layer(c, p, x, scale), carry, layers, xs, **kw)
  return (out["h"].astype(jnp.float32) ** 2).sum() + out["sum"]


def reference(carry, layers, xs, scale):
  body = jax.checkpoint(lambda c, a: (layer(c, a[0], a[1], scale), None))
  out = jax.lax.scan(body, carry, (layers, xs))[0]
  return (out["h"].astype(jnp.float32) ** 2).sum() + out["sum"]


def carry_of(dtype=jnp.float32):
  return {"h": jax.random.normal(jax.random.key(3), (4, D)).astype(dtype), "sum": jnp.zeros((), jnp.float32)}


ARGS = (0, 1, 2, 3)  # carry, layers, xs (its float leaves), scale


def grads_of(fn, *args, **kw):
  return jax.jit(jax.value_and_grad(lambda *a: fn(*a, **kw), argnums=ARGS, allow_int=True))(*args)


def assert_trees_equal(a, b, **tolerance):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    x, y = np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y))
    if x.dtype == jax.dtypes.float0:
      continue
    if tolerance:
      np.testing.assert_allclose(x.astype(np.float32), y.astype(np.float32), err_msg=jax.tree_util.keystr(path),
                                 **tolerance)
    else:
      np.testing.assert_array_equal(x, y, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("offload_carries", [False, True])
def test_values_and_gradients_equal_lax_scan_float32_exactly(offload_carries):
  args = (carry_of(), make_layers(), make_xs(), jnp.float32(1.3))
  ours_value, ours_grads = grads_of(ours, *args, offload_carries=offload_carries)
  ref_value, ref_grads = grads_of(reference, *args)
  assert float(ours_value) == float(ref_value)
  assert_trees_equal(ours_grads, ref_grads)
  # Every input that takes a gradient got a non-trivial one (the test can fail).
  assert all(float(jnp.abs(g).sum()) > 0 for g in jax.tree.leaves((ours_grads[0]["h"], ours_grads[1], ours_grads[3],
                                                                   ours_grads[2]["mask"])))


def test_layers_in_host_memory_give_the_same_values_and_their_gradient_in_host_memory():
  layers = make_layers()
  args = (carry_of(), jax.device_put(layers, HOST), make_xs(), jnp.float32(1.3))
  value, grads = grads_of(ours, *args)
  ref_value, ref_grads = grads_of(reference, carry_of(), layers, make_xs(), jnp.float32(1.3))
  assert float(value) == float(ref_value)
  assert_trees_equal(grads, ref_grads)
  assert {g.sharding.memory_kind for g in jax.tree.leaves(grads[1])} == {"pinned_host"}
  assert {g.sharding.memory_kind for g in jax.tree.leaves(grads[0])} == {"device"}


def test_bfloat16_within_rounding_of_lax_scan():
  args = (carry_of(jnp.bfloat16), make_layers(jnp.bfloat16), make_xs(), jnp.bfloat16(1.3))
  value, grads = grads_of(ours, *args)
  ref_value, ref_grads = grads_of(reference, *args)
  np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-2)
  assert_trees_equal(grads, ref_grads, rtol=2e-2, atol=2e-2)


def test_no_xs_and_a_plain_array_carry():
  layers = make_layers()
  f = lambda c, p: jnp.tanh(c @ p["w"] + p["b"])
  x = jnp.ones((3, D))
  ours_out = jax.grad(lambda l, c: optax_hybrid.scan_layers(f, c, l).sum(), argnums=(0, 1))(layers, x)
  ref_out = jax.grad(lambda l, c: jax.lax.scan(jax.checkpoint(lambda c, p: (f(c, p), None)), c, l)[0].sum(),
                     argnums=(0, 1))(layers, x)
  assert_trees_equal(ours_out, ref_out)


def test_a_host_tier_train_step_with_donation_matches_the_device_run():
  """scan_layers + tx.step, layers in pinned_host, donated: the same params as the same step on the device."""
  def train(tx, params, state, batch):
    def loss(p):
      h = optax_hybrid.scan_layers(lambda c, q: jnp.tanh(c @ q["w"] + q["b"]) * q["gain"], batch @ p["inp"],
                                   p["layers"])
      return jnp.mean((h - 0.5) ** 2)
    grads = jax.grad(loss)(params)
    return tx.step(params, state, grads)

  batch = jax.random.normal(jax.random.key(5), (8, 4))
  params = {"inp": jax.random.normal(jax.random.key(6), (4, D)) * 0.5, "layers": make_layers()}
  results = {}
  for name, where in (("device", DEVICE), ("host", HOST)):
    tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, tiers="device" if name == "device" else "host")
    p = {"inp": jax.device_put(params["inp"], DEVICE, may_alias=False),  # donated below: a copy per run
         "layers": jax.device_put(params["layers"], where, may_alias=False)}
    s = tx.init(p)
    step = jax.jit(lambda p, s, b, tx=tx: train(tx, p, s, b), donate_argnums=(0, 1))
    for _ in range(3):
      p, s = step(p, s, batch)
    results[name] = p
    assert {x.sharding.memory_kind for x in jax.tree.leaves(p["layers"])} == {
        "pinned_host" if name == "host" else "device"}
  assert_trees_equal(results["host"], results["device"], rtol=2e-6, atol=1e-7)


def test_flax_nnx_stacked_layers():
  """Layers made with nnx.vmap, split into graphdef + state, streamed; the reference is the same layers in lax.scan."""
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(D, D, rngs=rngs)
      self.norm = nnx.LayerNorm(D, rngs=rngs)

    def __call__(self, x):
      return x + jax.nn.gelu(self.linear(self.norm(x)))

  @nnx.vmap(in_axes=0, out_axes=0)
  def make(key):
    return Block(nnx.Rngs(key))

  graphdef, state = nnx.split(make(jax.random.split(jax.random.key(0), L)))
  assert {x.shape[0] for x in jax.tree.leaves(state)} == {L}
  run = lambda c, s: nnx.merge(graphdef, s)(c)
  x = jax.random.normal(jax.random.key(1), (2, D))
  ours_out = jax.jit(jax.grad(lambda s, c: optax_hybrid.scan_layers(run, c, s).sum(), argnums=(0, 1)))(state, x)
  ref_out = jax.jit(jax.grad(lambda s, c: jax.lax.scan(jax.checkpoint(lambda c, p: (run(c, p), None)), c, s)[0].sum(),
                             argnums=(0, 1)))(state, x)
  assert_trees_equal(ours_out, ref_out)
  host_state = jax.device_put(state, HOST)
  host_out = jax.jit(jax.grad(lambda s, c: optax_hybrid.scan_layers(run, c, s).sum()))(host_state, x)
  assert_trees_equal(host_out, ref_out[0])
  assert {g.sharding.memory_kind for g in jax.tree.leaves(host_out)} == {"pinned_host"}


def test_no_arithmetic_on_host_values_outside_host_compute():
  """On a GPU such arithmetic silently becomes slow host compute: the streamed program only moves host values."""
  args = (carry_of(), jax.device_put(make_layers(), HOST), make_xs(), jnp.float32(1.3))
  jaxpr = jax.make_jaxpr(jax.grad(lambda *a: ours(*a, offload_carries=True), argnums=ARGS, allow_int=True))(*args)
  assert optax_hybrid.host_arithmetic_outside_host_compute(jaxpr) == []


@pytest.mark.parametrize("layers,xs,match", [
    ({}, None, "`layers` has no arrays"),
    ({"w": jnp.ones((3, 2)), "b": jnp.ones((4, 2))}, None, "one length"),
    ({"w": jnp.ones((3, 2)), "s": jnp.ones(())}, None, "stacked on axis 0"),
    ({"w": jnp.ones((3, 2))}, {"m": jnp.ones((4,))}, "`xs` must be stacked like `layers`"),
])
def test_bad_stacks_are_refused_with_the_argument_named(layers, xs, match):
  with pytest.raises(ValueError, match=match):
    optax_hybrid.scan_layers(lambda c, p, *x: c, jnp.ones(2), layers, xs)
