"""Tests for optax_hybrid.tiers: per-leaf tiers, offload_fraction and fp32 master weights."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from stepping import grads_like, placed_params, run_steps as run
from optax_hybrid import placement, tiers
from optax_hybrid.gpu_compile import jaxpr_check
from optax_hybrid._compat import HOST

needs_host = pytest.mark.skipif("pinned_host" not in placement.available_memory_kinds(),
                                reason="no pinned_host memory on this backend")


def make_params(dtype=jnp.float32, seed=0):
  return placed_params({"emb": (50, 8), "w1": (8, 16), "b1": (16,), "w2": (16, 4), "s": ()}, dtype, seed)


# --- choosing tiers ------------------------------------------------------------

def test_pick_by_fraction_takes_leaves_in_order_to_the_nearest_boundary():
  # 10 + 30 + 60 = 100; 24% -> the first leaf (10) and not the second (10 + 30/2 > 24).
  assert tiers.pick_by_fraction([10, 30, 60], 0.24, [True] * 3) == [True, False, False]
  # 30%: 10 + 30/2 = 25 <= 30, so the second leaf is taken too.
  assert tiers.pick_by_fraction([10, 30, 60], 0.30, [True] * 3) == [True, True, False]
  assert tiers.pick_by_fraction([10, 30, 60], 1.0, [True] * 3) == [True] * 3
  assert tiers.pick_by_fraction([10, 30, 60], 0.0, [True] * 3) == [False] * 3
  # Ineligible leaves are passed over but count in the total.
  assert tiers.pick_by_fraction([10, 30, 60], 0.5, [False, True, True]) == [False, True, False]


@needs_host
def test_tier_specs_string_callable_and_prefix():
  params = {"enc": {"w": jnp.ones((4, 4)), "b": jnp.ones(4)}, "head": jnp.ones((4, 2))}
  by_name = lambda t: tiers.resolve(params, tiers=t, state_memory_kind=None, offload_fraction=None)[0]
  # Leaves in jax.tree.leaves order: enc/b, enc/w, head.
  assert by_name("host") == ["host"] * 3
  assert by_name({"enc": "host_state", "head": "device"}) == ["host_state", "host_state", "device"]
  assert by_name(lambda path, p: "host" if p.ndim == 2 else None) == ["device", "host", "host"]
  names, kinds = tiers.resolve(params, tiers=None, state_memory_kind="pinned_host", offload_fraction=0.5)
  # 4 + 16 + 8 = 28 params; half is 14: enc/b (4) and enc/w (4 + 8 <= 14) move to the host tier.
  assert names == ["host", "host", "host_state"]
  assert kinds == ["pinned_host"] * 3


def test_bad_placement_arguments_are_named():
  with pytest.raises(ValueError, match="`state_memory_kind`='gpu' is not a placement; use one of 'device', "
                                       "'pinned_host', 'host_state', 'host', 'disk'"):
    optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind="gpu")
  with pytest.raises(ValueError, match=r"by_fraction: `host` must be a number in \[0, 1\]"):
    optax_hybrid.by_fraction(host=1.5)
  with pytest.raises(ValueError, match=r"by_fraction: `host` \+ `disk` is 1.2"):
    optax_hybrid.by_fraction(host=0.6, disk=0.6)
  with pytest.raises(ValueError, match="by_fraction: `rest`='gpu' is not a placement"):
    optax_hybrid.by_fraction(host=0.5, rest="gpu")
  with pytest.raises(TypeError, match="cannot be another by_fraction"):
    optax_hybrid.by_fraction(host=0.5, rest=optax_hybrid.by_fraction(disk=0.1))
  with pytest.raises(ValueError, match=r"unknown `master`=<class 'jax.numpy.int32'> \(dtype int32\)"):
    optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, master=jnp.int32)
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, state_memory_kind=lambda path, p: "nvme")
  with pytest.raises(ValueError, match=r"`state_memory_kind\(\['w'\]\)`='nvme' is not a placement"):
    tx.init({"w": jnp.ones(3)})


@needs_host
def test_memory_kinds_and_tiers_are_values_of_one_argument():
  """``"pinned_host"`` updates a param where it lives, ``"host_state"`` on the device; the others alike."""
  host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
  params = {"in_device": jnp.ones((4, 4)), "in_host": jax.device_put(jnp.ones((4, 4)), host)}
  tiers_of = lambda spec: optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=spec).init(params).plan.tiers
  assert tiers_of(None) == ("device", "host")  # leaves in key order: in_device, in_host
  assert tiers_of("pinned_host") == ("host_state", "host")
  assert tiers_of("host_state") == ("host_state", "host_state")
  assert tiers_of("host") == ("host", "host")
  assert tiers_of("device") == ("device", "host")
  assert tiers_of({"in_device": "disk", "in_host": None}) == ("disk", "host")


# --- every tier computes the same step -------------------------------------------

@needs_host
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("tier_spec", ["host_state", "host", {"emb": "host", "w1": "device", "b1": "host",
                                                               "w2": "host_state", "s": "host"}])
def test_every_tier_equals_the_device_step(tier_spec, fused):
  params, grads = make_params(), grads_like(make_params(), 4)
  sched = optax_hybrid.warmup_cosine_schedule(1e-2, 4, 1, 1e-3)
  kw = dict(weight_decay=0.1, mask={"emb": False, "w1": True, "b1": False, "w2": True, "s": True}, kernel="xla")
  want, want_state = run(optax_hybrid.hybrid_adamw(sched, **kw), params, grads, fused)
  got, state = run(optax_hybrid.hybrid_adamw(sched, state_memory_kind=tier_spec, **kw), params, grads, fused)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(state.mu[k]), np.asarray(want_state.mu[k]), rtol=1e-6, atol=1e-7)
    # The state stays where its tier keeps it; params stay on the device.
    expected = "device" if state.plan.tiers[list(sorted(params)).index(k)] == "device" else "pinned_host"
    assert state.mu[k].sharding.memory_kind == expected
    assert got[k].sharding.memory_kind == "device"



# A host_state leaf larger than a stage crosses a slice of rows at a time (plan.assign_slices): with the
# budget made small, a stacked (6, 64, 256) leaf is cut into slices of 1 or 2 rows, whatever its format.
SLICED_BUDGET = 70_000


@needs_host
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype, kw, rows", [
    (jnp.float32, {}, 1),  # 8 B per value: a row is 131 kB, over the budget
    (jnp.float32, {"moment_format": "8bit"}, 2),  # codes and scales: 33 kB per row
    (jnp.bfloat16, {"master": "float32"}, 1),
    (jnp.bfloat16, {"master": "kahan", "moment_format": "8bit"}, 1),
    (jnp.bfloat16, {"master": "stochastic"}, 1),  # every slice draws the bits the whole leaf draws there
])
def test_a_stacked_host_state_leaf_stepped_in_slices_of_rows_equals_the_device_step(dtype, kw, rows, fused,
                                                                                    monkeypatch):
  monkeypatch.setattr(optax_hybrid.plan, "STREAM_STAGE_BYTES", SLICED_BUDGET)
  params = placed_params({"stack": (6, 64, 256), "b": (256,)}, dtype)
  grads = grads_like(params, 3)
  kw = dict(weight_decay=0.1, kernel="xla", mask={"stack": True, "b": False}, **kw)
  want, want_state = run(optax_hybrid.hybrid_adamw(1e-2, **kw), params, grads, fused)
  tx = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="host_state", **kw)
  assert [lp.slice_rows for lp in tx.init(params).plan.leaves] == [0, rows]  # b is small: it crosses whole
  got, state = run(tx, params, grads, fused)
  exact = dtype == jnp.bfloat16  # a master writes the param once, rounded: the same bits
  for k in params:
    if exact:
      np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    else:
      np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7)
    for field in ("mu", "nu", "master", "mu_scales"):
      if getattr(want_state, field) is None:  # no master, or no 8-bit scales
        continue
      for a, b in zip(jax.tree.leaves(getattr(state, field)[k]), jax.tree.leaves(getattr(want_state, field)[k])):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-7)
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state.mu[k]))



@needs_host
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("master, moments", [("stochastic", "8bit"), ("float32", "float32")])
def test_host_resident_params_asked_for_host_state_are_stepped_on_the_device_and_stay_in_host_memory(
    master, moments, fused, monkeypatch):
  # Layers streamed by scan_layers live in pinned_host; state_memory_kind="host_state" steps them on the device a slice
  # at a time (the stack) or whole (the bias), where any other tier leaves them to the host tier.
  monkeypatch.setattr(optax_hybrid.plan, "STREAM_STAGE_BYTES", SLICED_BUDGET)
  on_device = placed_params({"stack": (6, 64, 256), "b": (256,)}, jnp.bfloat16)
  grads = grads_like(on_device, 3)
  in_host = jax.device_put(on_device, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))
  kw = dict(weight_decay=0.1, kernel="xla", master=master, moment_format=moments)
  want, _ = run(optax_hybrid.hybrid_adamw(1e-2, **kw), on_device, grads, fused)
  tx = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="host_state", **kw)
  assert [(lp.tier, lp.runs_on, lp.slice_rows > 0) for lp in tx.init(in_host).plan.leaves] == [
      ("host_state", "device", False), ("host_state", "device", True)]
  device = optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="device", **kw)
  assert {lp.tier for lp in device.init(in_host).plan.leaves} == {
      "host"}
  got, state = run(tx, in_host, [jax.device_put(g, HOST) for g in grads], fused)
  for k in on_device:
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]))
    assert got[k].sharding.memory_kind == "pinned_host"
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(state.mu[k]))


def transfers(jaxpr):
  """Bytes moved by device_put between memory spaces, (to host, to device), over a jaxpr and its sub-jaxprs."""
  to_host = to_device = 0

  def visit(jx):
    nonlocal to_host, to_device
    for eqn in jx.eqns:
      for sub in jaxpr_check.sub_jaxprs(eqn):
        visit(sub)
      if eqn.primitive.name != "device_put":
        continue
      for a, b in zip(eqn.invars, eqn.outvars):
        src, dst = getattr(a.aval, "memory_space", None), b.aval.memory_space
        size = int(np.prod(b.aval.shape)) * b.aval.dtype.itemsize
        if dst == HOST and src != HOST:
          to_host += size
        elif src == HOST and dst != HOST:
          to_device += size

  visit(jaxpr.jaxpr)
  return to_host, to_device


@needs_host
def test_host_tier_moves_only_the_gradient_and_the_new_param_for_bf16_with_a_master():
  params = make_params(jnp.bfloat16)
  n = sum(p.size for p in jax.tree.leaves(params))
  kw = dict(weight_decay=0.1, moment_format="float32", master="float32")
  host = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="host", **kw)
  host_state = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="host_state", **kw)
  g = grads_like(params, 1)[0]
  host_jaxpr = jax.make_jaxpr(host.step)(params, host.init(params), g)
  state_jaxpr = jax.make_jaxpr(host_state.step)(params, host_state.init(params), g)
  scalars = 64  # the step's few float32 scalars, moved to the host once
  to_host, to_device = transfers(host_jaxpr)
  assert 2 * n <= to_host <= 2 * n + scalars  # the bf16 gradient
  assert to_device == 2 * n  # the new bf16 param
  # host_state streams master and both moments (12 B/param) each way instead.
  assert transfers(state_jaxpr) == (12 * n, 12 * n)
  # No device arithmetic on host values: the host tier computes inside host compute.
  assert jaxpr_check.host_arithmetic_outside_host_compute(host_jaxpr) == []


def _depends_on(jaxpr, sources):
  """The variables that (transitively) depend on ``sources`` in a flat jaxpr."""
  tainted = set(sources)
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, jax.extend.core.Literal) and v in tainted for v in eqn.invars):
      tainted.update(eqn.outvars)
  return tainted


@needs_host
def test_host_and_device_work_are_independent_in_the_graph():
  params = make_params()
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, state_memory_kind=optax_hybrid.by_fraction(host=0.5),
                                 kernel="xla")
  state = tx.init(params)
  assert "host" in state.plan.tiers and "device" in state.plan.tiers
  jaxpr = jax.make_jaxpr(tx.step)(params, state, grads_like(params, 1)[0]).jaxpr
  host_calls = [e for e in jaxpr.eqns if e.primitive.name == "compute_on"]
  assert len(host_calls) == 1  # one host region for every host-tier leaf
  host_call = host_calls[0]
  # Nothing the host region reads comes from the device-side update (beyond
  # the per-step scalars, computed before both), and the device-side update
  # reads nothing the host region produces.
  device_math = [e for e in jaxpr.eqns if e.primitive.name in ("sqrt", "div") and e is not host_call
                 and e.outvars[0].aval.shape != ()]
  assert device_math
  after_host = _depends_on(jaxpr, host_call.outvars)
  assert not any(v in after_host for e in device_math for v in e.outvars)
  after_device = _depends_on(jaxpr, [v for e in device_math for v in e.outvars])
  assert not any(v in after_device for v in host_call.invars if not isinstance(v, jax.extend.core.Literal))


@needs_host
def test_offload_fraction_chooses_leaves_by_size_and_keeps_the_result():
  params, grads = make_params(), grads_like(make_params(), 3)
  want, _ = run(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel="xla"), params, grads)
  got, state = run(optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel="xla",
                                             state_memory_kind=optax_hybrid.by_fraction(host=0.7)),
                   params, grads)
  # Leaves in order b1 (16), emb (400), s (1), w1 (128), w2 (64): 609 params, 70% = 426.3:
  # b1 and emb (416) fit; s (416.5 <= 426.3) too; w1 would need 416 + 1 + 64 > 426.3.
  assert state.plan.tiers == ("host", "host", "host", "device", "device")
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=1e-7)


# --- master weights ----------------------------------------------------------------

@pytest.mark.parametrize("tier", [None, "host"])
def test_bf16_with_a_master_converges_where_plain_bf16_stalls(tier):
  if tier and "pinned_host" not in placement.available_memory_kinds():
    pytest.skip("no pinned_host")
  # Minimize 0.5 (w - 1.05)^2 from w = 1. Adam's steps are about lr = 1e-3,
  # under half a bf16 ulp at 1.0 (2**-8 = 0.0039): each one rounds away.
  target, lr, steps = 1.05, 1e-3, 120
  grad = lambda w: {"w": (w["w"].astype(jnp.float32) - target).astype(w["w"].dtype)}
  finals = {}
  for name, dtype, master in (("fp32", jnp.float32, None), ("bf16", jnp.bfloat16, None),
                              ("bf16+master", jnp.bfloat16, jnp.float32)):
    tx = optax_hybrid.hybrid_adamw(lr, weight_decay=0.0, moment_format="float32", master=master,
                                   state_memory_kind=tier)
    w = jax.device_put({"w": jnp.ones((4,), dtype)}, jax.devices()[0])
    state = tx.init(w)
    step = jax.jit(lambda w, s: tx.step(w, s, grad(w)))
    for _ in range(steps):
      w, state = step(w, state)
    finals[name] = np.asarray(w["w"], np.float32)
    if master:
      assert state.master["w"].dtype == jnp.float32
      # The param is the master rounded to bf16.
      np.testing.assert_array_equal(np.asarray(state.master["w"].astype(jnp.bfloat16), np.float32), finals[name])
  assert np.all(finals["bf16"] == 1.0)  # stalled
  assert np.all(finals["fp32"] > 1.04)  # 120 steps of ~1e-3 reach the target (overshooting a little)
  # With the master, bf16 follows fp32 to within bf16 resolution at 1.05.
  np.testing.assert_allclose(finals["bf16+master"], finals["fp32"], atol=2**-7)


@pytest.mark.parametrize("memory_kind", [None, "pinned_host"])
def test_master_update_lands_exactly_on_the_fused_step(memory_kind):
  if memory_kind and memory_kind not in placement.available_memory_kinds():
    pytest.skip("no pinned_host")
  params = make_params(jnp.bfloat16)
  grads = grads_like(params, 4)
  kw = dict(weight_decay=0.1, master="float32", moment_format="float32",
            state_memory_kind=memory_kind)
  fused, fused_state = run(optax_hybrid.hybrid_adamw(1e-2, **kw), params, grads, fused=True)
  contract, contract_state = run(optax_hybrid.hybrid_adamw(1e-2, **kw), params, grads, fused=False)
  for k in params:
    np.testing.assert_array_equal(np.asarray(fused[k], np.float32), np.asarray(contract[k], np.float32))
    np.testing.assert_array_equal(np.asarray(fused_state.master[k]), np.asarray(contract_state.master[k]))
  # Against a float64 AdamW on the master, rounded to bf16 at the end.
  from numpy_reference import adamw_steps
  p64 = {k: np.asarray(v, np.float64) for k, v in params.items()}
  g64 = [{k: np.asarray(v, np.float64) for k, v in g.items()} for g in grads]
  want, _, _ = adamw_steps(p64, g64, [1e-2] * 4, weight_decay=0.1)
  for k in params:
    np.testing.assert_allclose(np.asarray(fused_state.master[k]), want[-1][k], rtol=2e-5, atol=2e-6)


def test_master_weights_only_for_lower_precision_leaves_and_need_params_for_update():
  params = {"w": jnp.ones(3, jnp.bfloat16), "b": jnp.ones(3, jnp.float32)}
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, master="float32")
  state = tx.init(params)
  assert state.master["w"].dtype == jnp.float32
  # "b" keeps no master: an empty entry (one array per param leaf, no bytes).
  assert state.master["b"].shape == (0,) and state.master["b"].nbytes == 0
  assert optax.tree_utils.tree_get(state, "master")["w"].shape == (3,)
  with pytest.raises(ValueError, match="with master weights, `params` is required"):
    tx.update(params, state)


@needs_host
def test_tiers_and_master_survive_a_checkpoint(tmp_path):
  pytest.importorskip("orbax.checkpoint")
  params = make_params(jnp.bfloat16)
  tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0, master="float32", state_memory_kind={
      "emb": "host", "w1": "host_state", "b1": "device", "w2": "host", "s": "device"})
  params, state = run(tx, params, grads_like(params, 2))
  manager = optax_hybrid.checkpoint.manager(tmp_path / "ckpt")
  optax_hybrid.checkpoint.save(manager, 2, {"params": params, "opt_state": state}, wait=True)
  target = optax_hybrid.checkpoint.abstract_like({"params": params, "opt_state": state})
  restored = optax_hybrid.checkpoint.restore(manager, target)
  assert restored["opt_state"].plan == state.plan
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves({"params": params, "opt_state": state})):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    assert a.sharding.memory_kind == b.sharding.memory_kind


@needs_host
def test_host_tier_uses_the_native_kernel_inside_host_compute_on_a_cpu():
  from optax_hybrid.kernels import native_cpu
  if not native_cpu.available() or jax.default_backend() != "cpu" or jax.device_count() > 1:
    pytest.skip("the native kernel runs in host compute on a single-device CPU backend")
  params, grads = make_params(), grads_like(make_params(), 3)
  kw = dict(weight_decay=0.1, state_memory_kind="host", skip_nonfinite=True)
  native = optax_hybrid.hybrid_adamw(1e-2, kernel="native", **kw)
  text = jax.jit(native.step).lower(params, native.init(params), grads[0]).as_text()
  assert native_cpu.TARGET in text
  assert jaxpr_check.host_arithmetic_outside_host_compute(
      jax.make_jaxpr(native.step)(params, native.init(params), grads[0])) == []
  got, got_state = run(native, params, grads)
  want, want_state = run(optax_hybrid.hybrid_adamw(1e-2, kernel="xla", **kw), params, grads)
  for k in params:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=2e-6, atol=1e-7)
    assert got_state.mu[k].sharding.memory_kind == "pinned_host"


@needs_host
@pytest.mark.parametrize("fused", [True, False])
def test_a_host_group_lowered_for_cuda_runs_the_reference_not_the_devices_pallas_kernel(fused):
  # kernel="auto" lowered for CUDA: the device's leaves get the Pallas kernel; a host-tier leaf runs in host
  # compute, where a Triton launch cannot go: the reference (kernels_for(..., runs_on="host")). Traced on
  # the CPU: the choice follows the lowering platform (docs/architecture.md).
  from optax_hybrid import kernels
  params = {"d": jnp.ones((8, 8)), "h": jnp.ones((8, 8))}
  for spec, launches in (({"d": "device", "h": "host"}, 1), ("host", 0)):
    tx = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.1, state_memory_kind=spec)
    state = tx.init(params)
    step = tx.step if fused else (lambda p, s, g: tx.update(g, s, p))
    with kernels.lowering_for("cuda"):
      jaxpr = str(jax.make_jaxpr(step)(params, state, params))
    assert jaxpr.count("pallas_call") == launches, spec


# --- tests added for surviving mutants of tiers.py (mutation testing, docs/records/testing.md) ---

def test_pick_by_fraction_takes_a_leaf_exactly_half_inside_and_never_an_empty_one():
  # 10 + 30/2 = 25 is exactly 25% of 100: "at least half of it fits" takes it.
  assert tiers.pick_by_fraction([10, 30, 60], 0.25, [True] * 3) == [True, True, False]
  # A zero-size leaf has nothing to move, whatever the fraction.
  assert tiers.pick_by_fraction([0, 10, 0], 1.0, [True] * 3) == [False, True, False]


@needs_host
def test_fractions_zero_and_one_are_valid_and_mean_none_and_all():
  params = make_params()
  for tier in ("host", "disk"):
    none = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=optax_hybrid.by_fraction(**{tier: 0.0})).init(params)
    assert none.plan.tiers == ("device",) * 5
    every = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=optax_hybrid.by_fraction(**{tier: 1.0}))
    # The scalar "s" is one element: half of it fits in any fraction at the end.
    assert every.init(params).plan.tiers == (tier,) * 5
    every.close()


def test_the_plan_is_immutable_hashable_static_data():
  import dataclasses
  state = optax_hybrid.hybrid_adamw(1e-3, weight_decay=0.0,
                                    state_memory_kind=optax_hybrid.by_fraction(host=0.5)).init(make_params())
  plan = state.plan
  copy = optax_hybrid.plan.Plan(tuple(dataclasses.replace(leaf) for leaf in plan.leaves), plan.kernel, plan.split,
                                plan.mesh, plan.fields, plan.owner, plan.static_zeros, master=plan.master,
                                decay_mode=plan.decay_mode)
  assert hash(plan) == hash(copy) and plan == copy and plan is not copy
  # The static zeros are not compared: inject_hyperparams' init (under jit) records none (optax's AliasTest).
  other = dataclasses.replace(plan, static_zeros=plan.static_zeros ^ {"eps_root"})
  assert other.static_zeros != plan.static_zeros and hash(other) == hash(plan) and other == plan
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.leaves = ()
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.leaves[0].tier = "device"
  assert jax.tree.leaves(plan) == []  # static: no arrays in the tree


def test_each_tier_is_one_value_that_the_plan_reads():
  """docs/tiers.md, one row per tier: where the state lives, where the update runs, what crosses the bus."""
  t = tiers.BY_NAME
  assert set(t) == set(tiers.TIERS)
  assert [n for n in tiers.TIERS if t[n].state_kind == "device"] == ["device"]
  assert [n for n in tiers.TIERS if t[n].runs_on == "host"] == ["host"]
  assert [n for n in tiers.TIERS if t[n].streamed] == ["host_state", "host"]
  assert [n for n in tiers.TIERS if t[n].files] == ["disk"]
  assert [n for n in tiers.TIERS if t[n].single_device_why] == ["disk"]
  assert [n for n in tiers.TIERS if t[n].packable] == ["device"]
  params = {"w": jnp.ones((4, 8))}
  for name in tiers.TIERS:
    if name != "device" and "pinned_host" not in optax_hybrid.available_memory_kinds():
      continue
    lp = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=name).init(params).plan.leaves[0]
    assert (lp.runs_on, lp.streamed, lp.on_disk) == (t[name].runs_on, t[name].streamed, t[name].files), name


@pytest.mark.parametrize("name, param_space, in_row_slices, operands_to, results_to", [
    # docs/tiers.md, its rows read as what crosses: (state, param, master) in; (first, state, master) back.
    ("device", "D", False, (None, None, None), (None, None, None)),  # nothing crosses
    ("host_state", "D", False, ("D", None, "D"), (None, "H", "H")),  # state and master in and back out
    ("host_state", "H", False, ("D", "D", "D"), ("H", "H", "H")),  # a param in host memory (scan_layers) too
    ("host_state", "D", True, ("D", None, "D"), (None, None, None)),  # slices written where they live
    ("host", "D", False, (None, "H", None), ("D", None, None)),  # the param out; only the new param back
    ("disk", "D", False, (None, None, "D"), (None, None, "H")),  # moments are files, loaded on the device
])
def test_each_tier_says_how_its_data_crosses(name, param_space, in_row_slices, operands_to, results_to):
  space = {"D": optax_hybrid._compat.DEVICE, "H": HOST, None: None}
  tier = tiers.BY_NAME[name]
  state_space = placement.space_of_kind(tier.state_kind)
  assert tier.crossing(state_space, space[param_space], in_row_slices) == (
      tuple(map(space.get, operands_to)), tuple(map(space.get, results_to)))


@needs_host
def test_a_tier_defined_in_a_test_alone_places_and_steps(monkeypatch):
  """A new tier is one value in ``tiers.BY_NAME``: the placement, the plan, the step's crossing and the memory
  report take it, and it computes optax.adamw's step. This one keeps the state in host memory and steps every
  leaf on the device at once, unstaged, beside device-tier leaves (one group, each leaf crossing its own way)."""
  whole = tiers.Tier("host_state_whole", "pinned_host")
  monkeypatch.setitem(tiers.BY_NAME, whole.name, whole)
  params = make_params()
  grads = grads_like(params, 3)
  spec = {"emb": "host_state_whole", "w1": "device", "b1": "host_state_whole", "w2": "host_state", "s": "device"}
  tx = optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, state_memory_kind=spec)
  state = tx.init(params)
  names = sorted(params)  # the leaves' order
  assert state.plan.tiers == tuple(spec[k] for k in names)
  plans = dict(zip(names, state.plan.leaves))
  assert not plans["emb"].streamed and plans["emb"].group == plans["b1"].group == plans["w1"].group
  got, got_state = run(tx, params, grads, state=state)
  ref, ref_state = params, optax.adamw(1e-2, weight_decay=0.1).init(params)
  for g in grads:
    u, ref_state = optax.adamw(1e-2, weight_decay=0.1).update(g, ref_state, ref)
    ref = optax.apply_updates(ref, u)
  for k in names:
    np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(np.asarray(got_state.nu[k]), np.asarray(ref_state[0].nu[k]), rtol=1e-4, atol=1e-9)
    assert got_state.mu[k].sharding.memory_kind == ("device" if spec[k] == "device" else "pinned_host"), k
    assert got[k].sharding.memory_kind == "device", k
  report = optax_hybrid.memory_report(got, got_state)
  assert report.weights_by_tier["host_state_whole"] == 50 * 8 + 16
  assert report.by_tier["host_state_whole"]["host"] == 2 * 4 * (50 * 8 + 16)  # mu and nu, float32
  with pytest.raises(ValueError, match="use one of 'device', 'pinned_host', 'host_state', 'host', 'disk', "
                                       "'host_state_whole'"):
    optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="host_state_hole")
