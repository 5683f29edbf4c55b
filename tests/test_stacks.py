"""A stack split between device and host memory (optax_hybrid.split_stack): the numbers of the stack in one memory.

Every comparison is against the same model with its stack held whole in
host memory, bit for bit (the suite compiles without LLVM's optimizations,
tests/compile_flags.py: with them, XLA:CPU may contract a multiply-add into
an FMA in one program and not the other, a float32 ulp).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax_hybrid
from optax_hybrid import split_stack, join_stack, SplitStack

L, D = 5, 32
HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
RNG = np.random.default_rng(0)
VALUES = {"w": RNG.normal(size=(L, D, D)).astype(np.float32) * 0.2, "b": RNG.normal(size=(L, D)).astype(np.float32)}


def equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def whole_of(tree):
  return join_stack(tree) if isinstance(tree, SplitStack) else tree


def test_split_stack_places_the_first_rows_on_the_device_and_the_rest_in_host_memory():
  stack = split_stack({"w": jnp.asarray(VALUES["w"])}, 2)
  assert stack.resident["w"].shape == (2, D, D) and stack.streamed["w"].shape == (L - 2, D, D)
  assert stack.resident["w"].sharding.memory_kind == "device"
  assert stack.streamed["w"].sharding.memory_kind == "pinned_host"
  assert (stack.resident_layers, stack.num_layers) == (2, L)
  equal(join_stack(stack), {"w": VALUES["w"]})
  assert join_stack(stack)["w"].sharding.memory_kind == "pinned_host"
  # Abstract stacks stay abstract; a SplitStack is split again from its whole.
  abstract = split_stack(jax.ShapeDtypeStruct((L, D), jnp.float32), 1)
  assert isinstance(abstract.streamed, jax.ShapeDtypeStruct) and abstract.streamed.shape == (L - 1, D)
  assert split_stack(stack, 4).resident["w"].shape == (4, D, D)


def test_abstract_rows_placed_by_split_stack_are_traced_where_real_ones_are():
  """A ShapeDtypeStruct stack on one device (as a real, placed model's would be described) splits into parts that
  jit traces in the memory real arrays placed there are traced in: else its host rows would be compiled as device
  values (a GPU compile then fails with XLA's E1200: a host value returned in device memory)."""
  from optax_hybrid import _compat
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = split_stack({"w": jax.ShapeDtypeStruct((L, D), jnp.float32, sharding=device)}, 2)
  real = split_stack({"w": jax.device_put(VALUES["b"], device)}, 2)
  seen = {}

  def record(name):
    def traced(s):
      seen[name] = {part: str(_compat.memory_space_of(getattr(s, part)["w"])) for part in ("resident", "streamed")}
      return s
    return traced
  jax.jit(record("abstract")).trace(abstract)
  jax.jit(record("real")).trace(real)
  assert seen["abstract"] == seen["real"], seen
  assert seen["real"]["resident"] != seen["real"]["streamed"], seen
  assert abstract.streamed["w"].sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("bad, message", [(L + 1, "from 0 to the stack's 5 layers"), (-1, "from 0"),
                                          (True, "from 0"), (1.5, "from 0")])
def test_split_stack_refuses_a_split_outside_the_stack(bad, message):
  with pytest.raises(ValueError, match=message):
    split_stack({"w": jnp.asarray(VALUES["w"])}, bad)


def test_split_stack_refuses_layers_of_several_lengths():
  with pytest.raises(ValueError, match="one leading length"):
    split_stack({"w": jnp.ones((3, 2)), "b": jnp.ones((4, 2))}, 1)


def scan_loss(layers, shared, xs, x0):
  layer = lambda c, p, x: jnp.tanh(c @ p["w"] + p["b"] + x * shared)
  return jnp.sum(optax_hybrid.scan_layers(layer, x0, layers, xs) ** 2)


@pytest.mark.parametrize("resident", range(L + 1))
def test_scan_layers_runs_a_split_stack_as_the_whole_stack(resident):
  shared = jnp.asarray(RNG.normal(size=(D,)), jnp.float32)
  xs = jnp.asarray(np.random.default_rng(1).normal(size=(L, D)), jnp.float32)
  x0 = jnp.asarray(np.random.default_rng(2).normal(size=(3, D)), jnp.float32)
  grad = jax.jit(jax.value_and_grad(scan_loss, argnums=(0, 1, 2, 3)))
  want = grad(jax.device_put(VALUES, HOST), shared, xs, x0)
  got = grad(split_stack(VALUES, resident), shared, xs, x0)
  equal(want[0], got[0])
  equal(want[1][0], join_stack(got[1][0]))  # each layer's gradient
  equal(want[1][1:], got[1][1:])  # the shared weight's (summed over the layers in one order), xs', the carry's
  # Each part's gradient is where its layers live.
  assert got[1][0].resident["w"].sharding.memory_kind == "device"
  if resident < L:
    assert got[1][0].streamed["w"].sharding.memory_kind == "pinned_host"


def run_optimizer(layers, dtype, options, path, steps=3):
  split = isinstance(layers, SplitStack)
  params = {"layers": jax.tree.map(lambda a: a.astype(dtype) if split else a, layers), "e": jnp.ones(8, dtype)}
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, state_memory_kind="host_state", **options)
  params, state = optax_hybrid.commit((params, tx.init(params)))

  def run(p, s, g):
    if path == "step":
      return tx.step(p, s, g)
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  rng = np.random.default_rng(3)
  for _ in range(steps):
    g = {k: jnp.asarray(rng.normal(size=v.shape), dtype) for k, v in VALUES.items()}
    grads = {"layers": split_stack(g, layers.resident_layers) if split else g, "e": jnp.ones(8, dtype)}
    params, state = jax.jit(run)(params, state, grads)
  moments = optax_hybrid.moment_values(state)
  return whole_of(params["layers"]), [whole_of(m["layers"]) for m in moments]


@pytest.mark.parametrize("dtype, options", [
    (jnp.float32, {}), (jnp.bfloat16, dict(master="stochastic", moment_format="8bit")),
    (jnp.bfloat16, dict(master="kahan"))], ids=["float32", "stochastic-8bit", "kahan"])
@pytest.mark.parametrize("path", ["step", "update"])
def test_the_optimizer_steps_a_split_stack_as_the_whole_stack(dtype, options, path):
  whole = jax.device_put(jax.tree.map(lambda v: jnp.asarray(v, dtype), VALUES), HOST)
  want = run_optimizer(whole, dtype, options, path)
  for resident in (0, 2, L):
    equal(want, run_optimizer(split_stack(jax.tree.map(lambda v: jnp.asarray(v, dtype), VALUES), resident),
                              dtype, options, path))


def test_a_split_stacks_parts_draw_the_whole_stacks_random_bits():
  params = {"layers": split_stack(jax.tree.map(lambda v: jnp.asarray(v, jnp.bfloat16), VALUES), 2)}
  plan = optax_hybrid.hybrid_adamw(1e-3, master="stochastic").init(params).plan
  by_path = {lp.path: lp for lp in plan.leaves}
  streamed = by_path["['layers'].streamed['w']"]
  assert streamed.draws_as == ("['layers']['w']", 2 * D * D)
  assert by_path["['layers'].resident['w']"].draws_as == ("['layers']['w']", 0)


def embed(rest, b):
  return rest["embed"][b]


def layer(x, p, rest, b):
  return x + jnp.tanh(x @ p["w"] + p["b"]) * rest["gain"]


def head(rest, x, b):
  return jnp.mean((x @ rest["head"]) ** 2)


def backward_run(layers, dtype, options):
  rng = np.random.default_rng(4)
  params = {"embed": jnp.asarray(rng.normal(size=(16, D)) * 0.3, dtype), "gain": jnp.ones(D, dtype),
            "head": jnp.asarray(rng.normal(size=(D, 4)), dtype), "layers": layers}
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, state_memory_kind="host_state", **options)
  params, state = optax_hybrid.commit((params, tx.init(params)))
  step = jax.jit(optax_hybrid.step_in_backward(tx, embed, layer, head), donate_argnums=(0, 1))
  losses = []
  for _ in range(3):
    params, state, loss = step(params, state, jnp.asarray(rng.integers(0, 16, size=(8,)), jnp.int32))
    losses.append(float(loss))
  assert step._cache_size() == 1
  params["layers"] = whole_of(params["layers"])
  return losses, params


@pytest.mark.parametrize("dtype, options", [(jnp.float32, {}), (jnp.bfloat16, dict(master="stochastic"))],
                         ids=["float32", "stochastic"])
def test_step_in_backward_steps_a_split_stack_as_the_whole_stack(dtype, options):
  values = jax.tree.map(lambda v: jnp.asarray(v, dtype), VALUES)
  want = backward_run(jax.device_put(values, HOST), dtype, options)
  for resident in (0, 3, L):
    got = backward_run(split_stack(values, resident), dtype, options)
    assert got[0] == want[0]
    equal(want[1], got[1])


def test_a_split_stack_whose_parts_differ_is_refused():
  bad = SplitStack({"w": jnp.ones((1, 2, 2))}, {"v": jnp.ones((1, 2, 2))})
  with pytest.raises(ValueError, match="same arrays"):
    optax_hybrid.scan_layers(lambda c, p: c, jnp.ones(2), bad)


@pytest.mark.parametrize("saved_resident", [None, 2])
def test_a_checkpoint_restores_across_stack_placements_and_continues_bit_for_bit(saved_resident, tmp_path):
  """Saved whole or split at row 2, restored whole or split at 0, 2, 3 or 5 rows: the next step's bits are equal."""
  values = jax.tree.map(lambda v: jnp.asarray(v, jnp.bfloat16), VALUES)
  tx = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="host_state", master="kahan", moment_format="8bit")

  def params_at(resident):
    return {"layers": jax.device_put(values, HOST) if resident is None else split_stack(values, resident),
            "e": jnp.ones(3, jnp.bfloat16)}

  def grads_at(resident, scale):
    g = jax.tree.map(lambda v: np.full(v.shape, scale, np.float32).astype(jnp.bfloat16), VALUES)
    return {"layers": jax.device_put(g, HOST) if resident is None else split_stack(g, resident),
            "e": jnp.ones(3, jnp.bfloat16)}

  step = jax.jit(tx.step)
  params = params_at(saved_resident)
  params, state = step(params, tx.init(params), grads_at(saved_resident, 0.3))
  with optax_hybrid.checkpoint.manager(str(tmp_path)) as manager:
    optax_hybrid.checkpoint.save(manager, 1, {"params": params, "opt": state}, wait=True)
    want_params, want_state = step(params, state, grads_at(saved_resident, -0.2))
    for resident in (None, 0, 2, 3, L):
      like = params_at(resident)
      restored = optax_hybrid.checkpoint.restore(manager, like={"params": like, "opt": tx.init(like)})
      for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves({"params": like, "opt": tx.init(like)})):
        assert a.sharding == b.sharding, (resident, a.sharding, b.sharding)
      got_params, got_state = step(restored["params"], restored["opt"], grads_at(resident, -0.2))
      equal(whole_of(want_params["layers"]), whole_of(got_params["layers"]))
      for want, got in zip(optax_hybrid.moment_values(want_state), optax_hybrid.moment_values(got_state)):
        equal(whole_of(want["layers"]), whole_of(got["layers"]))
      equal(whole_of(want_state.master["layers"]), whole_of(got_state.master["layers"]))
