"""Flat params (optax_hybrid.flat_params): the tree's leaves in a few flat buffers, read through views.

Each test compares against the unflattened tree run the ordinary way:
values, gradients, optax.adamw's steps, scan_layers and step_in_backward.
"""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from compile_flags import with_fast_compiles
from optax_hybrid import flatten_params


def model_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 6)
  return {
      "embed": jax.random.normal(keys[0], (5, 4)),
      "blocks": [{"kernel": jax.random.normal(keys[1 + i], (4, 4)), "bias": jnp.full(4, 0.1 * i)} for i in range(2)],
      "norm": {"scale": jnp.ones(4), "half": jax.random.normal(keys[3], (3, 2)).astype(jnp.bfloat16)},
      "gain": jnp.asarray(1.5),
  }


def loss_of_tree(tree, x):
  h = tree["embed"][x]
  for block in tree["blocks"]:
    h = jnp.tanh(h @ block["kernel"] + block["bias"])
  h = h * tree["norm"]["scale"] * tree["gain"]
  return jnp.mean(h ** 2) + jnp.sum(tree["norm"]["half"].astype(jnp.float32) ** 2)


def decayed(path, leaf):
  return leaf.ndim > 1


def test_round_trip_is_exact_and_groups_by_dtype_and_key():
  params = model_params()
  flat = flatten_params(params, group=decayed)
  assert [g.name for g in flat.groups] == ["False/float32", "True/float32", "True/bfloat16"]
  assert [b.shape for b in flat.buffers] == [(13,), (52,), (6,)]
  assert flat["True/bfloat16"].dtype == jnp.bfloat16
  for tree in (flat.as_tree(), jax.jit(lambda f: f.as_tree())(flat)):
    assert jax.tree.structure(tree) == jax.tree.structure(params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)) or
                 (a.dtype, a.shape) == (b.dtype, b.shape) or pytest.fail(f"{a.dtype}{a.shape}"), tree, params)
  assert len(flatten_params(params).groups) == 2  # float32 and bfloat16
  # Weakly typed leaves (jnp.full with a Python float) give strongly typed buffers, as a step returns them.
  assert not flatten_params({"w": jnp.full(3, 0.5)})["float32"].weak_type


def test_flatten_inside_jit_and_eval_shape():
  params = model_params()
  flat = flatten_params(params, group=decayed)
  traced = jax.jit(lambda p: flatten_params(p, group=decayed))(params)
  assert traced.layout == flat.layout
  jax.tree.map(np.testing.assert_array_equal, traced.buffers, flat.buffers)
  abstract = jax.eval_shape(lambda p: flatten_params(p, group=decayed), params)
  assert [(b.shape, b.dtype) for b in abstract.buffers] == [(b.shape, b.dtype) for b in flat.buffers]


def test_gradients_through_the_views_equal_the_trees():
  params, x = model_params(), jnp.array([0, 3, 4])
  flat = flatten_params(params, group=decayed)
  want = jax.grad(loss_of_tree)(params, x)
  got = jax.jit(jax.grad(lambda f, x: loss_of_tree(f.as_tree(), x)))(flat, x)
  assert isinstance(got, optax_hybrid.FlatParams) and got.layout == flat.layout
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                                                       rtol=1e-5, atol=1e-6), got.as_tree(), want)


def run_steps(tx, params, x, steps, use_step=False):
  """``steps`` jitted steps of ``tx`` on ``params`` (a tree or FlatParams), the loss through ``as_tree`` for the latter."""
  view = (lambda p: p.as_tree()) if isinstance(params, optax_hybrid.FlatParams) else (lambda p: p)
  grad = jax.grad(lambda p: loss_of_tree(view(p), x))
  state = tx.init(params)

  @jax.jit
  def step(p, s):
    if use_step:
      return tx.step(p, s, grad(p))
    u, s = tx.update(grad(p), s, p)
    return optax.apply_updates(p, u), s

  for _ in range(steps):
    params, state = step(params, state)
  return view(params)


@functools.cache
def optax_references():
  """optax.adamw on the tree (decay masked by ndim), and undecayed: 3 steps each, computed once for the module."""
  params = jax.tree.map(lambda a: a.astype(jnp.float32), model_params())  # the packed layout steps float32 natively
  x = jnp.array([0, 3, 4])
  mask_of_tree = jax.tree.map(lambda a: a.ndim > 1, params)
  want = run_steps(optax.adamw(1e-2, weight_decay=0.1, mask=mask_of_tree), params, x, 3)
  return params, x, want, run_steps(optax.adamw(1e-2, weight_decay=0.0), params, x, 3)


@pytest.mark.parametrize("optimizer,layout,use_step", [
    ("hybrid", "leaves", False), ("hybrid", "leaves", True), ("hybrid", "packed", False),
    ("hybrid", "packed", True), ("optax", None, False)])
def test_adamw_on_flat_params_equals_optax_adamw_on_the_tree(optimizer, layout, use_step):
  params, x, want, undecayed = optax_references()
  flat = flatten_params(params, group=decayed)
  mask = flat.mask_by_group(lambda g: g.key)
  assert mask.buffers == (False, True)
  if optimizer == "hybrid":
    tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, mask=mask, state_layout=layout)
  else:
    tx = optax.adamw(1e-2, weight_decay=0.1, mask=mask)
  got = run_steps(tx, flat, x, 3, use_step)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6), got, want)
  # The decay mask took effect: without it the decayed leaves move differently.
  assert not np.allclose(got["embed"], undecayed["embed"], rtol=1e-6, atol=0)
  np.testing.assert_allclose(got["gain"], undecayed["gain"], rtol=2e-5)


def test_mask_from_tree_takes_a_tree_mask_whose_groups_agree():
  params = model_params()
  flat = flatten_params(params, group=decayed)
  tree_mask = jax.tree.map(lambda a: a.ndim > 1, params)
  assert flat.mask_from_tree(tree_mask).buffers == (False, True, True)
  assert flat.mask_from_tree(lambda tree: jax.tree.map(lambda a: a.ndim > 1, tree)).buffers == (False, True, True)


def test_flatten_keeps_the_memory_kind():
  device = jax.devices()[0]
  if "pinned_host" not in optax_hybrid.available_memory_kinds(device):
    pytest.skip("no pinned_host memory on this backend")
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  params = {"a": jax.device_put(jnp.arange(3.0), host), "b": jnp.arange(4.0)}
  flat = flatten_params(params)
  assert [g.name for g in flat.groups] == ["float32 pinned_host", "float32"]
  assert flat["float32 pinned_host"].sharding.memory_kind == "pinned_host"
  assert flat["float32"].sharding.memory_kind == "device"
  np.testing.assert_array_equal(flat.as_tree()["a"], np.arange(3.0))


LENGTH = 3


def stacked_layers():
  keys = jax.random.split(jax.random.key(1), 2)
  return {"w": jax.random.normal(keys[0], (LENGTH, 6, 6)) * 0.3, "b": jax.random.normal(keys[1], (LENGTH, 6)) * 0.1}


def layer_of(view):
  return lambda c, layer, *rest: jnp.tanh(c @ view(layer)["w"] + view(layer)["b"])


def test_stacked_round_trip_and_one_row():
  layers = stacked_layers()
  flat = flatten_params(layers, stacked=True)
  assert flat["float32"].shape == (LENGTH, 42)
  jax.tree.map(np.testing.assert_array_equal, flat.as_tree(), layers)
  row = jax.tree.map(lambda a: a[1], flat)
  jax.tree.map(np.testing.assert_array_equal, row.as_tree(), jax.tree.map(lambda a: a[1], layers))


def test_stacked_flat_params_through_scan_layers_equal_the_tree():
  layers, x = stacked_layers(), jnp.ones((2, 6))
  flat = flatten_params(layers, stacked=True)
  loss = lambda l, view: optax_hybrid.scan_layers(layer_of(view), x, l).sum()
  want_loss, want = jax.value_and_grad(loss)(layers, lambda l: l)
  got_loss, got = jax.jit(jax.value_and_grad(loss), static_argnums=1)(flat, optax_hybrid.FlatParams.as_tree)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  assert got["float32"].shape == (LENGTH, 42)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), got.as_tree(), want)


def test_stacked_flat_params_through_step_in_backward_equal_the_tree():
  layers = stacked_layers()
  params = {"embed": jnp.ones((4, 6)) * 0.2, "layers": layers, "head": jnp.linspace(-1, 1, 6)}
  flat = {**params, "layers": flatten_params(layers, stacked=True)}
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1)
  batch = jnp.array([0, 2])

  def run(p, view):
    step = jax.jit(optax_hybrid.step_in_backward(tx, lambda rest, b: rest["embed"][b], layer_of(view),
                                                 lambda rest, x, b: jnp.mean((x @ rest["head"]) ** 2)))
    state = tx.init(p)
    for _ in range(2):
      p, state, loss = step(p, state, batch)
    return p, loss

  want, want_loss = run(params, lambda l: l)
  got, got_loss = run(flat, optax_hybrid.FlatParams.as_tree)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
  assert isinstance(got["layers"], optax_hybrid.FlatParams)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
               {**got, "layers": got["layers"].as_tree()}, want)


def test_a_checkpoint_restores_flat_params_into_the_same_layout(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params = model_params()
  flat = flatten_params(params, group=decayed)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, mask=flat.mask_by_group(lambda g: g.key))
  state = tx.init(flat)
  manager = optax_hybrid.checkpoint.manager(tmp_path)
  optax_hybrid.checkpoint.save(manager, 1, {"params": flat, "opt": state}, wait=True)
  like = optax_hybrid.checkpoint.abstract_like({"params": flat, "opt": state})
  restored = optax_hybrid.checkpoint.restore(manager, like=like)
  assert isinstance(restored["params"], optax_hybrid.FlatParams) and restored["params"].layout == flat.layout
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               restored["params"].as_tree(), params)


ON_EIGHT_DEVICES = """
import jax, jax.numpy as jnp, numpy as np, optax_hybrid
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
replicated = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, P()))
flat = optax_hybrid.flatten_params({"w": replicated, "b": jax.device_put(jnp.ones(4), NamedSharding(mesh, P()))})
assert flat["float32"].sharding.is_fully_replicated and len(flat["float32"].sharding.device_set) == 2
np.testing.assert_array_equal(flat.as_tree()["w"], np.arange(8.0).reshape(2, 4))
split = jax.device_put(jnp.arange(8.0).reshape(2, 4), NamedSharding(mesh, P("d")))
try:
  optax_hybrid.flatten_params({"w": split})
except ValueError as e:
  assert "leaf 'w' is split over 2 devices" in str(e), e
  print("FLAT SHARDED OK")
"""


def test_replicated_leaves_stay_replicated_and_split_ones_are_refused():
  # Several devices need XLA_FLAGS before JAX starts: a subprocess, as tests/test_multidevice.py runs its script.
  env = dict(os.environ, XLA_FLAGS=with_fast_compiles("--xla_force_host_platform_device_count=8"), JAX_PLATFORMS="cpu")
  result = subprocess.run([sys.executable, "-c", ON_EIGHT_DEVICES], env=env, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stdout + result.stderr
  assert "FLAT SHARDED OK" in result.stdout
