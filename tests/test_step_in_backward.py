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
          "head": (jax.random.normal(k[4], (D, V)) * 0.3).astype(dtype), "layers": stack,
          "scale": jnp.linspace(0.8, 1.2, D).astype(dtype)}  # read by every layer: its gradient summed over them


def batch_of(seed):
  k1, k2 = jax.random.split(jax.random.key(100 + seed))
  return {"inputs": jax.random.randint(k1, (B,), 0, V), "targets": jax.random.randint(k2, (B,), 0, V)}


def embed(rest, batch):
  return rest["embed"][batch["inputs"]]


def layer(x, p, rest, batch):
  del batch
  return x + jnp.tanh((x @ p["w"] + p["b"]) * p["gain"] * rest["scale"]).astype(x.dtype)


def head(rest, x, batch):
  logits = (x @ rest["head"]).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def loss_by_scan_layers(params, batch):
  rest = {k: v for k, v in params.items() if k != "layers"}
  x = optax_hybrid.scan_layers(layer, embed(rest, batch), params["layers"], args=(rest, batch))
  return head(rest, x, batch)


def loss_by_lax_scan(params, batch):
  rest = {k: v for k, v in params.items() if k != "layers"}
  body = jax.checkpoint(lambda c, p: (layer(c, p, rest, batch), None))
  x = jax.lax.scan(body, embed(rest, batch), jax.device_put(params["layers"], jax.memory.Space.Device))[0]
  return head(rest, x, batch)


def reference_step(tx, loss_fn):
  def train_step(params, state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    params, state = tx.step(params, state, grads)
    return params, state, loss
  return jax.jit(train_step)


def run(train_step, tx, params, steps=3):
  state = optax_hybrid.commit(tx.init(params))
  params = optax_hybrid.commit(params)
  losses = []
  for i in range(steps):
    params, state, loss = train_step(params, state, batch_of(i))
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


# --- Flax params: nnx.State from nnx.split of layers made with nnx.vmap, Linen's FrozenDict ---

NNX_L, NNX_D, NNX_V = 3, 8, 11


def nnx_model():
  from flax import nnx

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.lin = nnx.Linear(NNX_D, NNX_D, rngs=rngs)

    def __call__(self, x, scale):
      return x + jnp.tanh(self.lin(x) * scale)

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(NNX_V, NNX_D, rngs=rngs)
      self.scale = nnx.Param(jnp.linspace(0.8, 1.5, NNX_D))  # every layer reads it

      @nnx.split_rngs(splits=NNX_L)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def stacked(rngs):
        return Block(rngs)

      self.layers = stacked(rngs)
      self.head = nnx.Linear(NNX_D, NNX_V, rngs=rngs)

  return Model(nnx.Rngs(0))


def nnx_parts(block_def):
  """embed, layer and head of the NNX model, each running its own NNX modules (nnx.merge)."""
  from flax import nnx
  embed = lambda rest, batch: rest["embed"]["embedding"][...][batch["inputs"]]
  layer = lambda x, p, rest, batch: nnx.merge(block_def, p)(x, rest["scale"][...])
  head = lambda rest, x, batch: optax.softmax_cross_entropy_with_integer_labels(
      x @ rest["head"]["kernel"][...] + rest["head"]["bias"][...], batch["targets"]).mean()
  return embed, layer, head


def nnx_reference(pure, steps):
  """The same model by hand on plain arrays, its layers by jax.lax.scan, stepped by optax.adamw."""
  def loss_fn(p, batch):
    def body(x, lin):
      return x + jnp.tanh((x @ lin["kernel"] + lin["bias"]) * p["scale"]), None
    x = jax.lax.scan(jax.checkpoint(body), p["embed"]["embedding"][batch["inputs"]], p["layers"]["lin"])[0]
    logits = x @ p["head"]["kernel"] + p["head"]["bias"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

  tx = optax.adamw(1e-2, weight_decay=0.1)
  state, losses = tx.init(pure), []
  for i in range(steps):
    loss, grads = jax.value_and_grad(loss_fn)(pure, batch_of_nnx(i))
    updates, state = tx.update(grads, state, pure)
    pure = optax.apply_updates(pure, updates)
    losses.append(float(loss))
  return losses, pure


def batch_of_nnx(seed):
  k1, k2 = jax.random.split(jax.random.key(200 + seed))
  return {"inputs": jax.random.randint(k1, (B,), 0, NNX_V), "targets": jax.random.randint(k2, (B,), 0, NNX_V)}


def test_nnx_state_params_train_against_optax_adamw_on_a_plain_lax_scan():
  """step_in_backward and scan_layers + tx.step take nnx.State params and return nnx.State."""
  from flax import nnx
  model = nnx_model()
  _, params = nnx.split(model, nnx.Param)
  params["layers"] = jax.device_put(params["layers"], HOST)
  embed, layer, head = nnx_parts(nnx.graphdef(model.layers))
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, tiers="host_state")
  ref_losses, ref = nnx_reference(jax.device_put(nnx.to_pure_dict(params), jax.memory.Space.Device), 3)

  def loss_fn(p, batch):  # the same model through scan_layers, the layer function shared with step_in_backward
    rest = nnx.State({k: v for k, v in p.items() if k != "layers"})
    return head(rest, optax_hybrid.scan_layers(layer, embed(rest, batch), p["layers"], args=(rest, batch)), batch)

  def value_and_grad_step(p, s, batch):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch)
    assert type(grads) is nnx.State and type(grads["layers"]) is nnx.State
    p, s = tx.step(p, s, grads)
    return p, s, loss

  for train_step in (optax_hybrid.step_in_backward(tx, embed, layer, head), value_and_grad_step):
    state = optax_hybrid.commit(tx.init(params))
    p, losses, step = optax_hybrid.commit(jax.tree.map(jnp.copy, params)), [], jax.jit(train_step)
    for i in range(3):
      p, state, loss = step(p, state, batch_of_nnx(i))
      losses.append(float(loss))
    assert step._cache_size() == 1
    assert type(p) is nnx.State and jax.tree.structure(p) == jax.tree.structure(params)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(p["layers"])} == {"pinned_host"}
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(p)), jax.tree.leaves(ref)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6,
                                 err_msg=jax.tree_util.keystr(path))
  nnx.update(model, p)  # the model takes the trained params back
  np.testing.assert_array_equal(np.asarray(model.scale[...]), np.asarray(p["scale"][...]))


def test_frozen_dict_params_come_back_as_frozen_dicts_with_the_dict_numbers():
  from flax.core import FrozenDict
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1)
  step = jax.jit(optax_hybrid.step_in_backward(tx, embed, layer, head))
  out = {}
  for kind in (dict, FrozenDict):
    params = kind(make_params(layers_on_host=False))
    out[kind] = step(params, tx.init(params), batch_of(0))
    assert type(out[kind][0]) is kind
  assert_equal_trees(dict(out[FrozenDict][0]), out[dict][0], "params")


# --- per-layer inputs, the old convention, the results' order ---


def test_per_layer_inputs_reach_each_layer_as_in_a_lax_scan_over_them():
  """``xs``: a dropout key per layer, as ``jax.lax.scan`` over (layers, keys) would give them."""
  def dropped(x, p, key, rest, batch):
    keep = jax.random.bernoulli(key, 0.8, x.shape)
    return jnp.where(keep, layer(x, p, rest, batch) / 0.8, 0.0)

  keys_of = lambda rest, batch: jax.random.split(batch["key"], L)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1)
  params = make_params(layers_on_host=False)
  batch = dict(batch_of(0), key=jax.random.key(7))
  ours, _, loss = jax.jit(optax_hybrid.step_in_backward(tx, embed, dropped, head, xs=keys_of))(
      params, tx.init(params), batch)

  def loss_fn(params, batch):
    rest = {k: v for k, v in params.items() if k != "layers"}
    body = jax.checkpoint(lambda c, a: (dropped(c, *a, rest, batch), None))
    x = jax.lax.scan(body, embed(rest, batch), (params["layers"], keys_of(rest, batch)))[0]
    return head(rest, x, batch)

  ref_loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, batch)
  ref, _ = jax.jit(tx.step)(params, tx.init(params), grads)
  np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6),
               ours, ref)


def test_the_old_convention_still_runs_for_one_release_with_a_deprecation_warning():
  """``layer_fn(carry, layer, batch)`` and results ``(loss, params, opt_state)``: the same numbers, warned."""
  tx = optax_hybrid.hybrid_adamw(1e-2)
  params = make_params(layers_on_host=False)
  fixed = {"scale": np.asarray(params["scale"])}  # the old layer_fn got no `rest`: a NumPy constant instead
  with pytest.warns(DeprecationWarning, match=r"layer_fn\(carry, layer, rest, batch\)"):
    old = optax_hybrid.step_in_backward(tx, embed, lambda x, p, batch: layer(x, p, fixed, batch), head)
  loss, new_params, new_state = jax.jit(old)(params, tx.init(params), batch_of(0))
  expected = jax.jit(optax_hybrid.step_in_backward(tx, embed, lambda x, p, rest, batch: layer(x, p, fixed, batch),
                                                   head))(params, tx.init(params), batch_of(0))
  assert_equal_trees((new_params, new_state, loss), expected, "")


def test_which_layer_functions_are_read_as_the_old_convention():
  import warnings
  from optax_hybrid import user_fns

  def old_with_a_flag(x, p, batch, deterministic=False):
    return x

  def read(fn, xs=False):
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      _, old = user_fns.layer_fn_of_step("step_in_backward", fn, xs)
    assert old == any(issubclass(w.category, DeprecationWarning) for w in caught)
    return old

  assert read(lambda x, p, rest, batch: x) is False
  assert read(lambda x, p, *inputs: x) is False
  assert read(lambda x, p, key, rest, batch: x, xs=True) is False
  assert read(lambda x, p, batch: x) is True
  assert read(old_with_a_flag) is True
  for fn, xs in ((lambda x, p: x, False), (lambda x, p, rest, batch: x, True)):
    with pytest.raises(TypeError, match="`layer_fn` must take"):
      read(fn, xs)
