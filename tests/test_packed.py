"""state_layout="packed": every leaf's state in a few flat buffers (optax_hybrid.packing).

Each test compares the packed state with the default one array per leaf
(itself tested against float64 models elsewhere): same params, same moments,
through tx.step, the Optax contract, the Optax wrappers, checkpoints and the
memory report; and checks what the layout is for: a step that takes four state
buffers, updated in place.
"""

import math
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import kernels
from optax_hybrid.kernels import native_cpu

native = pytest.mark.skipif(not native_cpu.available(), reason="native kernel not built")

# 8-bit storage takes the (16, 512) leaf; the small ones keep float32 moments.
PARAMS = {"w": jnp.linspace(-1.0, 1.0, 8192).reshape(16, 512), "b": jnp.linspace(0.5, 1.5, 7),
          "block": {"scale": jnp.full((3, 5), 0.3), "s": jnp.asarray(0.7)}}
GRADS = jax.tree.map(lambda p: jnp.sin(3.0 * p) + 0.1, PARAMS)
MASK = {"w": True, "b": False, "block": {"scale": True, "s": False}}


def adamw(**kw):
  return optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, mask=MASK, **kw)


def stepped(tx, params=PARAMS, grads=GRADS, steps=3, fused=True):
  """``steps`` jitted, donated steps (``fused``: tx.step; else update + apply_updates)."""
  state = tx.init(params)
  if fused:
    step = jax.jit(tx.step, donate_argnums=(0, 1))
  else:
    step = jax.jit(lambda p, s, g: (lambda u, s: (optax_hybrid.apply_updates(p, u), s))(*tx.update(g, s, p)),
                   donate_argnums=(0, 1))
  params = jax.tree.map(jnp.copy, params)
  for _ in range(steps):
    params, state = step(params, state, grads)
  return params, state


def assert_trees(a, b, exact):
  """Equal trees; or within float32 rounding (one bf16 step for bf16 values: a float32 value a few ulps off
  may round to the other side)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    if exact:
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    else:
      rtol = 2**-7 if x.dtype == jnp.bfloat16 else 2e-6
      wide = lambda v: np.asarray(v, np.complex64 if jnp.iscomplexobj(v) else np.float32)
      np.testing.assert_allclose(wide(x), wide(y), rtol=rtol, atol=1e-7)


# Each kernel's path once with 8-bit pools (codes and scales beside float32
# ones) and the native kernel's once without; the native tx.step over float32
# pools is test_native_step_takes_four_state_buffers_and_updates_them_in_place.
@pytest.mark.parametrize("kernel, fused, moment_format", [
    pytest.param("native", True, "8bit", marks=native, id="native-step-8bit"),
    pytest.param("native", False, None, marks=native, id="native-update-float32"),
    pytest.param("xla", False, "8bit", id="xla-update-8bit"),
])
def test_packed_equals_one_array_per_leaf(kernel, fused, moment_format):
  kw = {"kernel": kernel, "moment_format": moment_format}
  want_params, want_state = stepped(adamw(**kw), fused=fused)
  params, state = stepped(adamw(state_layout="packed", **kw), fused=fused)
  exact = kernel == "native"  # the same C++ loops on the same values; XLA fuses slices differently
  assert_trees(params, want_params, exact)
  assert_trees(optax_hybrid.moment_values(state), optax_hybrid.moment_values(want_state), exact)
  assert int(state.count) == 3
  expected = {"float32": 8192 + 7 + 15 + 1} if moment_format is None else {"float32": 7 + 15 + 1, "uint8": 8192}
  assert {k: v.shape for k, v in state.mu.items()} == {k: (n,) for k, n in expected.items()}
  assert set(state.nu) == set(expected)


# A master pool, and none; kahan's bf16 term is packed by the same path as a float32 master.
@pytest.mark.parametrize("master", ["float32", "stochastic"])
def test_packed_with_master_weights(master):
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), PARAMS)
  params["b"] = PARAMS["b"]  # a float32 leaf beside them: no master, a group (and pools) of its own
  grads = jax.tree.map(lambda p, g: g.astype(p.dtype), params, GRADS)
  want_params, want_state = stepped(adamw(master=master), params, grads)
  got_params, state = stepped(adamw(master=master, state_layout="packed"), params, grads)
  assert_trees(got_params, want_params, exact=False)
  assert_trees(optax_hybrid.moment_values(state), optax_hybrid.moment_values(want_state), exact=False)
  assert set(state.mu) == {"float32", f"bfloat16 with {master} master"}  # moments in the params' dtype
  if master == "stochastic":
    assert state.master is None
  else:
    (kept,) = state.master.values()
    assert kept.shape == (8192 + 15 + 1,)
    assert_trees([jnp.concatenate([jnp.ravel(x) for i, x in enumerate(jax.tree.leaves(want_state.master))
                                   if i != 0])], [kept], exact=False)  # leaf 0 is "b": no master


@native
def test_native_step_takes_four_state_buffers_and_updates_them_in_place():
  n = 70  # two custom calls of at most 64 leaves, the pools passed from one to the next
  params = {f"l{i:03d}": jnp.full((5 + i % 7,), 0.1 * (i % 5)) for i in range(n)}
  grads = jax.tree.map(lambda p: jnp.cos(p) * 0.01, params)
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, state_layout="packed")
  state = tx.init(params)
  assert len(jax.tree.leaves(state)) == 4  # count, skipped, mu, nu
  compiled = jax.jit(tx.step, donate_argnums=(0, 1)).lower(params, state, grads).compile().as_text()
  assert compiled.count(f'custom_call_target="{native_cpu.PACKED_TARGET}"') == math.ceil(n / 64)
  pool = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
  assert not re.findall(rf"f32\[{pool}\]\{{0\}} copy\(", compiled)  # aliased in place: no copy of a pool
  assert_trees(stepped(tx, params, grads)[0],
               stepped(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1), params, grads)[0], exact=True)


@native
def test_leaves_the_kernel_does_not_take_run_beside_it_without_a_copy():
  params = {**PARAMS, "z": jnp.linspace(-1.0, 1.0, 6).astype(jnp.complex64) * (1 + 1j)}
  grads = {**GRADS, "z": jnp.full(6, 0.2 - 0.1j, jnp.complex64)}
  mask = {**MASK, "z": True}
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, mask=mask, kernel="native", state_layout="packed")
  want = stepped(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, mask=mask, kernel="native"), params, grads)
  got = stepped(tx, params, grads)
  assert_trees(got[0], want[0], exact=False)
  # The complex leaf's real second moment has a pool of its own: no pool is shared with the kernel's leaves.
  assert set(got[1].nu) == {"float32", "float32 of complex64 params"}
  compiled = jax.jit(tx.step, donate_argnums=(0, 1)).lower(params, tx.init(params), grads).compile().as_text()
  assert not re.findall(r"\[\d+\]\{0\} copy\(", compiled)


def test_auto_kernel_runs_the_native_call_for_update_too():
  tx = optax_hybrid.hybrid_adamw(1e-3, state_layout="packed")
  text = jax.jit(tx.update).lower(GRADS, tx.init(PARAMS), PARAMS).as_text()
  assert (native_cpu.PACKED_TARGET in text) == native_cpu.available()


@pytest.mark.parametrize("alias", ["hybrid_lion", "hybrid_adagrad", "hybrid_sgd"])
def test_a_rule_the_native_kernel_lacks_steps_a_packed_state_with_the_reference(alias):
  # kernel="auto" takes the native kernel for a packed state's update as for its step, where the kernel implements
  # the rule: these rules take the reference on a CPU (they reached the Adam-only C++ call and failed to trace).
  make = getattr(optax_hybrid, alias)
  tx = make(1e-2, state_layout="packed")
  table = tx.init(PARAMS).plan.kernels["device", True]
  assert table["cpu"] is kernels.reference.update_leaves, table
  for fused in (True, False):
    want_params, want_state = stepped(make(1e-2), fused=fused)
    params, state = stepped(tx, fused=fused)
    assert_trees(params, want_params, exact=False)
    assert_trees(optax_hybrid.moment_values(state), optax_hybrid.moment_values(want_state), exact=False)


def test_optax_wrappers_and_tree_map_params():
  tx = adamw(state_layout="packed")
  want = stepped(adamw(), fused=False)
  # inject_hyperparams: the injected rate is traced; the same numbers.
  injected = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, weight_decay=0.1, mask=MASK,
                                                                   state_layout="packed")
  assert_trees(stepped(injected, fused=False)[0], want[0], exact=False)
  # MultiSteps: an update every second call, the packed state inside.
  multi, multi_want = optax.MultiSteps(tx, 2), optax.MultiSteps(adamw(), 2)
  assert_trees(stepped(multi, fused=False, steps=4)[0], stepped(multi_want, fused=False, steps=4)[0], exact=False)
  # tree_map_params: the flat buffers are not params-shaped: transform_non_params gets them.
  state = tx.init(PARAMS)
  specs = optax.tree_utils.tree_map_params(tx, lambda p, spec: spec, state, jax.tree.map(lambda _: "param", PARAMS),
                                           transform_non_params=lambda x: ("not params", jax.tree.structure(x)))
  assert specs.mu == ("not params", jax.tree.structure(state.mu))
  assert specs.count[0] == "not params"


def test_memory_report_counts_each_leaf_s_slices():
  report = optax_hybrid.report.memory_report
  for kw in ({}, {"moment_format": "8bit"}):
    packed = report(PARAMS, adamw(state_layout="packed", **kw).init(PARAMS))
    leaves = report(PARAMS, adamw(**kw).init(PARAMS))
    assert packed.by_component == leaves.by_component
    assert [leaf.state for leaf in packed.leaves] == [leaf.state for leaf in leaves.leaves]
    assert packed.device_bytes_per_device == leaves.device_bytes_per_device


def test_abstract_init_and_eval_shape():
  tx = adamw(state_layout="packed", moment_format="8bit")
  concrete = tx.init(PARAMS)
  shaped = jax.eval_shape(tx.init, PARAMS)
  abstract = tx.init(jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), PARAMS))
  for other in (shaped, abstract):
    assert jax.tree.structure(other) == jax.tree.structure(concrete)
    for x, y in zip(jax.tree.leaves(other), jax.tree.leaves(concrete)):
      assert (x.shape, x.dtype) == (y.shape, y.dtype)


def test_checkpoint_round_trip_and_across_layouts():
  pytest.importorskip("orbax.checkpoint")
  tx = adamw(state_layout="packed", moment_format="8bit")
  params, state = stepped(tx)
  manager = optax_hybrid.checkpoint.manager(tempfile.mkdtemp())
  optax_hybrid.checkpoint.save(manager, 3, {"params": params, "opt": state}, wait=True)
  restored = optax_hybrid.checkpoint.restore(manager, like={"params": PARAMS, "opt": tx.init(PARAMS)})
  assert_trees(restored, {"params": params, "opt": state}, exact=True)
  # The next step from the restored state is the next step of the saved one.
  step = jax.jit(tx.step)
  assert_trees(step(restored["params"], restored["opt"], GRADS), step(params, state, GRADS), exact=True)
  with pytest.raises(ValueError, match="holds nothing at"):
    optax_hybrid.checkpoint.restore(manager, like={"params": PARAMS, "opt": adamw(moment_format="8bit").init(PARAMS)})


@pytest.mark.parametrize("options, names", [
    ({"state_memory_kind": "disk"}, ["'disk' tier"]),
    ({"state_memory_kind": "pinned_host"}, ["'host_state' tier", "'pinned_host'"]),
    ({"kernel": "pallas"}, ["kernel='pallas'"]),
])
def test_the_packed_layout_refuses_at_init_naming_both_and_writes_nothing(tmp_path, options, names):
  params = {"w": jnp.ones((4, 8)), "b": jnp.zeros((8,))}
  tx = optax_hybrid.hybrid_adamw(1e-3, state_layout="packed", nvme_offload_dir=tmp_path, **options)
  with pytest.raises(ValueError) as info:
    tx.init(params)
  for name in ["state_layout='packed'", *names]:
    assert name in str(info.value), str(info.value)
  assert not any(tmp_path.rglob("*")), "init wrote files before refusing the layout"
  # The same optimizer with the default layout still makes a state and steps.
  tx = optax_hybrid.hybrid_adamw(1e-3, nvme_offload_dir=tmp_path, **{k: v for k, v in options.items()
                                                                     if k != "kernel"})
  state = tx.init(params)
  updates, _ = tx.update(params, state, params)
  assert jax.tree.structure(updates) == jax.tree.structure(params)
