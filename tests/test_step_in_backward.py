"""optax_hybrid.step_in_backward: the optimizer inside the backward pass equals value_and_grad then tx.step.

The reference is what a user writes without it: ``jax.value_and_grad`` of the
same model (its layers run by ``optax_hybrid.scan_layers``, or by a plain
``jax.lax.scan`` over a checkpointed layer), then ``tx.step``; and for the
numbers of the rule, ``optax.adamw``. What it does on a GPU (no gradient
buffer of the layers) is checked by compiling for the H200 target:
tests/test_streaming_compile.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid

L, D, V, B = 4, 16, 11, 6
HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def make_params(dtype=jnp.float32, layers_on_host=True):
  k = jax.random.split(jax.random.key(0), 5)
  stack = {"w": jax.random.normal(k[0], (L, D, D)) * 0.3, "b": jax.random.normal(k[1], (L, D)) * 0.1,
           "gain": 1 + 0.1 * jax.random.normal(k[2], (L,))}
  stack = jax.tree.map(lambda a: a.astype(dtype), stack)
  if layers_on_host:
    stack = jax.device_put(stack, HOST)
  return {"embed": (jax.random.normal(k[3], (V, D)) * 0.5).astype(dtype),
          "head": (jax.random.normal(k[4], (D, V)) * 0.3).astype(dtype), "layers": stack}


def batch_of(seed):
  k1, k2 = jax.random.split(jax.random.key(100 + seed))
  return {"inputs": jax.random.randint(k1, (B,), 0, V), "targets": jax.random.randint(k2, (B,), 0, V)}


def embed(rest, batch):
  return rest["embed"][batch["inputs"]]


def layer(x, p, batch):
  del batch
  return x + jnp.tanh((x @ p["w"] + p["b"]) * p["gain"]).astype(x.dtype)


def head(rest, x, batch):
  logits = (x @ rest["head"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def loss_by_scan_layers(params, batch):
  rest = {k: v for k, v in params.items() if k != "layers"}
  x = optax_hybrid.scan_layers(lambda c, p: layer(c, p, batch), embed(rest, batch), params["layers"])
  return head(rest, x, batch)


def loss_by_lax_scan(params, batch):
  rest = {k: v for k, v in params.items() if k != "layers"}
  body = jax.checkpoint(lambda c, p: (layer(c, p, batch), None))
  x = jax.lax.scan(body, embed(rest, batch), jax.device_put(params["layers"], jax.memory.Space.Device))[0]
  return head(rest, x, batch)


def reference_step(tx, loss_fn):
  def train_step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params, state = tx.step(params, state, grads)
    return loss, params, state
  return jax.jit(train_step)


def run(train_step, tx, params, steps=3):
  state = optax_hybrid.commit(tx.init(params))
  params = optax_hybrid.commit(params)
  losses = []
  for i in range(steps):
    loss, params, state = train_step(params, state, batch_of(i))
    losses.append(float(loss))
  assert train_step._cache_size() == 1  # committed inputs: one compile for every step
  return losses, params, state


def assert_equal_trees(a, b, what):
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)),
                                  err_msg=what + jax.tree_util.keystr(path))


SETUPS = {
    "float32, layers in host memory, host_state": dict(dtype=jnp.float32, options=dict(tiers="host_state")),
    "float32, layers on the device": dict(dtype=jnp.float32, host=False, options={}),
    "bf16, stochastic master, 8-bit moments, host_state": dict(
        dtype=jnp.bfloat16, options=dict(tiers="host_state", master="stochastic", moment_format="8bit")),
    "bf16, fp32 master, host_state, a layer per stage, carries offloaded": dict(
        dtype=jnp.bfloat16, options=dict(tiers="host_state", master="float32"), budget=D * D * 12,
        offload_carries=True),
}


@pytest.mark.parametrize("name", list(SETUPS))
def test_equals_value_and_grad_then_tx_step(name, monkeypatch):
  setup = SETUPS[name]
  if "budget" in setup:  # the reference's host_state leaves then step in slices of rows too
    monkeypatch.setattr(optax_hybrid.plan, "STREAM_STAGE_BYTES", setup["budget"])
  tx = optax_hybrid.hybrid_adamw(optax.linear_schedule(3e-2, 1e-2, 3), weight_decay=0.1, **setup["options"])
  params = lambda: make_params(setup["dtype"], setup.get("host", True))  # donated: one each
  ours = run(jax.jit(optax_hybrid.step_in_backward(tx, embed, layer, head,
                                                   offload_carries=setup.get("offload_carries", False)),
                     donate_argnums=(0, 1)), tx, params())
  ref = run(reference_step(tx, loss_by_scan_layers), tx, params())
  assert ours[0] == ref[0]
  assert_equal_trees(ours[1], ref[1], "params")
  assert_equal_trees(ours[2], ref[2], "state")
  assert int(ours[2].count) == 3
  if setup.get("host", True):  # the layers and their state stay in host memory
    assert {x.sharding.memory_kind for x in jax.tree.leaves(ours[1]["layers"])} == {"pinned_host"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(ours[2].mu["layers"])} == {"pinned_host"}
  assert ours[1]["embed"].sharding.memory_kind == "device"


def test_float32_numbers_match_optax_adamw_on_a_plain_lax_scan():
  """Independent of our gradients and rule: jax.lax.scan's gradients through optax.adamw."""
  params = make_params(jnp.float32)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, tiers="host_state")
  losses, ours, _ = run(jax.jit(optax_hybrid.step_in_backward(tx, embed, layer, head)), tx, params)
  ref_tx = optax.adamw(1e-2, weight_decay=0.1)
  ref = jax.device_put(params, jax.memory.Space.Device)
  state = ref_tx.init(ref)
  ref_losses = []
  for i in range(3):
    loss, grads = jax.value_and_grad(loss_by_lax_scan)(ref, batch_of(i))
    updates, state = ref_tx.update(grads, state, ref)
    ref = optax.apply_updates(ref, updates)
    ref_losses.append(float(loss))
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(ref)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6, err_msg=jax.tree_util.keystr(path))
