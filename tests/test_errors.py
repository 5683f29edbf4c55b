"""One test per row of docs/errors.md: each bad input raises what the table says.

The table is parsed, so a row without a trigger here (or a trigger without a
row) fails too. Every update error is also checked to leave the state intact,
even through a jitted step that donates it.
"""

import dataclasses
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from optax_hybrid import placement

TABLE = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "errors.md")


def table_rows():
  rows = {}
  with open(TABLE) as f:
    for line in f:
      cells = [c.strip() for c in line.strip().strip("|").split("|")]
      if len(cells) == 5 and re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", cells[0]) and cells[0] != "id":
        rows[cells[0]] = (cells[3], cells[4])
  return rows


PARAMS = {"w": jnp.ones((5, 7)), "b": jnp.zeros(7)}
GRADS = {"w": jnp.full((5, 7), 0.5), "b": jnp.full(7, 0.25)}


@dataclasses.dataclass(frozen=True)
class FormatWithItsOwnSuffix(optax_hybrid.moments.Blockwise8bit):
  """8-bit storage whose scales go under a suffix no rule's state type declares."""
  name: str = "8bit, amax"
  suffixes: tuple = ("_amax",)


def hybrid(**kwargs):
  return optax_hybrid.hybrid_adamw(**{"learning_rate": 1e-3, **kwargs})


def recipe(**kw):
  kw.setdefault("learning_rate", 1e-3)
  kw.setdefault("total_steps", 100)
  return optax_hybrid.recipe.standard_optimizer(**kw)


def update_with(tx, grads=GRADS, params=PARAMS, jit=False):
  """``tx.update``: a row whose function is ``update`` must not raise at ``init`` already."""
  try:
    state = tx.init(PARAMS)
  except Exception as e:  # noqa: BLE001: any exception here means the table names the wrong function
    raise AssertionError(f"raised by init, not update: {e!r}") from e
  update = jax.jit(tx.update) if jit else tx.update
  return update(grads, state, params)


def fake_device_without_host():
  return types.SimpleNamespace(platform="fakegpu", id=0,
                               addressable_memories=lambda: [types.SimpleNamespace(kind="device")])


def update_with_state(tx, change):
  """``tx.update`` with its own state changed by ``change`` (a state that does not fit its plan)."""
  return tx.update(GRADS, change(tx.init(PARAMS)), PARAMS)


def tmp_file():
  import tempfile
  fd, path = tempfile.mkstemp()
  os.close(fd)
  return path


HOST_MEMORY = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
PARAMS_BF16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)
GRADS_BF16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), GRADS)


def closed_disk_state():
  tx = hybrid(state_memory_kind="disk")
  state = tx.init(PARAMS)
  tx.close()
  return tx.update(GRADS, state, PARAMS)


class FakeShardedParam:
  """A param whose sharding spans two devices (this process may have only one)."""

  shape, dtype, ndim = (4,), np.dtype(np.float32), 1

  def __init__(self):
    memories = lambda: [types.SimpleNamespace(kind="device"), types.SimpleNamespace(kind="pinned_host")]
    devices = [types.SimpleNamespace(platform="cpu", id=i, addressable_memories=memories) for i in range(2)]
    self.sharding = types.SimpleNamespace(device_set=devices, memory_kind="device")


class FakeParamWithoutHost:
  """A param on a device that has device memory only (a GPU whose runtime offers no pinned_host)."""

  shape, dtype, ndim = (4,), np.dtype(np.float32), 1

  def __init__(self):
    self.sharding = types.SimpleNamespace(device_set=[fake_device_without_host()], memory_kind="device")


def empty_manager():
  import tempfile
  return optax_hybrid.checkpoint.manager(tempfile.mkdtemp())


def manager_with_step_1():
  manager = empty_manager()
  optax_hybrid.checkpoint.save(manager, 1, {"x": jnp.zeros(2)}, wait=True)
  return manager


def manager_with_unreadable_steps(*steps):
  """A manager whose steps (each {"x": 1000 floats}) have their array file cut in half."""
  from checkpoint_script import cut_largest_array_file
  manager = empty_manager()
  for step in steps:
    optax_hybrid.checkpoint.save(manager, step, {"x": jnp.arange(1000.0) * step}, wait=True)
    cut_largest_array_file(os.path.join(manager.directory, str(step)))
  return manager


def restore_masters(masters_from=None, params_like=PARAMS_BF16):
  """Restores a checkpoint saved without master weights into a state that keeps them."""
  manager = empty_manager()
  optax_hybrid.checkpoint.save(manager, 1, {"params": PARAMS_BF16, "opt": hybrid().init(PARAMS_BF16)}, wait=True)
  like = {"params": PARAMS_BF16, "opt": hybrid(master="float32").init(PARAMS_BF16)}
  kw = {} if masters_from is None else {"masters_from": masters_from}
  return optax_hybrid.checkpoint.restore(manager, like=like, **kw)


def restore_other_master_format():
  """Restores a checkpoint saved with float32 master weights into a state that keeps Kahan terms."""
  manager = empty_manager()
  optax_hybrid.checkpoint.save(manager, 1, {"params": PARAMS_BF16, "opt": hybrid(master="float32").init(PARAMS_BF16)},
                               wait=True)
  like = {"params": PARAMS_BF16, "opt": hybrid(master="kahan").init(PARAMS_BF16)}
  return optax_hybrid.checkpoint.restore(manager, like=like)


def disk_state_without_its_plan(restore=False):
  """A disk-tier state as a plain dict (as nnx.state gives it): the plan naming its files is left out."""
  tx = hybrid(state_memory_kind="disk")
  state = tx.init(PARAMS)
  manager = empty_manager()
  if not restore:
    return optax_hybrid.checkpoint.save(manager, 1, {"opt": state._asdict()}, wait=True)
  optax_hybrid.checkpoint.save(manager, 1, {"opt": state}, wait=True)
  return optax_hybrid.checkpoint.restore(manager, like={"opt": tx.init(PARAMS)._asdict()})


S = optax_hybrid.warmup_cosine_schedule
def _update_without_scales():
  big = {"w": jnp.ones((16, 512))}
  tx = hybrid(moment_format="8bit")
  state = tx.init(big)
  tx.update(big, state._replace(mu_scales=None, nu_scales=None), big)


def _init_with_a_route_without_default():
  from optax_hybrid import kernels
  kernels.ROUTES["no-default"] = lambda **where: {"cpu": kernels.reference.update_leaves}
  try:
    hybrid(kernel="no-default").init(PARAMS)
  finally:
    del kernels.ROUTES["no-default"]


TRIGGERS = {
    "schedule-total": lambda: S(1.0, total_steps=10, warmup_steps=10),
    "schedule-total-too-large": lambda: S(1.0, total_steps=2**63),
    "schedule-warmup": lambda: S(1.0, total_steps=10, warmup_steps=-1),
    "schedule-peak": lambda: S(-1.0, total_steps=10),
    "schedule-eta-negative": lambda: S(1.0, total_steps=10, eta_min=-0.5),
    "schedule-eta-above-peak": lambda: S(1.0, total_steps=10, eta_min=2.0),
    "schedule-nonfinite": lambda: S(float("inf"), total_steps=10),
    "schedule-step-type": lambda: S(1.0, total_steps=10.0),
    "schedule-value-type": lambda: S(1.0, total_steps=10, eta_min="0.1"),
    "schedule-count-dtype": lambda: S(1.0, total_steps=10)(jnp.asarray(True)),
    "b1-range": lambda: hybrid(b1=1.0),
    "b2-range": lambda: hybrid(b2=-0.1),
    "beta-rounded-to-one": lambda: optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-3).init(
        jax.tree.map(lambda x: x.astype(jnp.bfloat16), PARAMS)),
    "eps-range": lambda: hybrid(eps=-1e-8),
    "eps-nonfinite": lambda: hybrid(eps=float("inf")),
    "weight-decay-range": lambda: hybrid(weight_decay=-0.1),
    "lr-range": lambda: hybrid(learning_rate=-1e-3),
    "lr-nonfinite": lambda: hybrid(learning_rate=float("nan")),
    "hyperparameter-type": lambda: hybrid(b1=jnp.ones(3)),
    "flag-type": lambda: hybrid(adamw_mode="yes"),
    "kernel-unknown": lambda: hybrid(kernel="cuda"),
    "kernel-route": _init_with_a_route_without_default,
    "moment-format-unknown": lambda: hybrid(moment_format="int8"),
    "moment-format-suffix": lambda: hybrid(moment_format=FormatWithItsOwnSuffix()),
    "moment-format-and-dtypes": lambda: hybrid(moment_format="8bit", mu_dtype=jnp.bfloat16),
    "quantized-state-no-scales": lambda: _update_without_scales(),
    "memory-kind-unknown": lambda: hybrid(state_memory_kind="unpinned_host"),
    "memory-kind-missing": lambda: hybrid(state_memory_kind="host").init({"w": FakeParamWithoutHost()}),
    "memory-kind-callable": lambda: hybrid(state_memory_kind=lambda path, p: "vram").init({"w": PARAMS["w"]}),
    "moment-dtype": lambda: hybrid(mu_dtype=jnp.int8),
    "mask-alias-twice": lambda: hybrid(mask={"w": True, "b": False}, weight_decay_mask={"w": True, "b": False}),
    "param-dtype": lambda: hybrid().init({"w": PARAMS["w"], "step": jnp.zeros((), jnp.int32)}),
    "complex-mu-dtype": lambda: hybrid(mu_dtype=jnp.float32).init({"z": jnp.ones(3, jnp.complex64)}),
    "complex-nu-dtype": lambda: hybrid(nu_dtype=jnp.complex64).init({"z": jnp.ones(3, jnp.complex64)}),
    "state-type": lambda: hybrid().update(GRADS, optax.adamw(1e-3).init(PARAMS), PARAMS),
    "state-no-plan": lambda: hybrid().update(GRADS, hybrid().init(PARAMS)._replace(plan=None), PARAMS),
    "grad-tree": lambda: update_with(hybrid(), grads={"w": GRADS["w"]}),
    "grad-shape": lambda: update_with(hybrid(), grads={**GRADS, "w": jnp.ones((7, 5))}),
    "grad-dtype": lambda: update_with(hybrid(), grads={**GRADS, "w": jnp.ones((5, 7), jnp.int32)}),
    "grad-complex": lambda: update_with(hybrid(), grads={**GRADS, "b": jnp.ones(7, jnp.complex64)}),
    "params-missing": lambda: update_with(hybrid(weight_decay=0.1), params=None),
    "params-tree": lambda: update_with(hybrid(weight_decay=0.1), params={"w": PARAMS["w"]}),
    "mask-callable-no-params": lambda: update_with(hybrid(weight_decay=0.1, mask=lambda p: {"w": True, "b": False}),
                                                   params=None),
    "mask-tree": lambda: hybrid(weight_decay=0.1, mask={"w": True, "x": False}).init(PARAMS),
    "mask-leaf": lambda: hybrid(weight_decay=0.1, mask={"w": 1.0, "b": True}).init(PARAMS),
    "mask-traced": lambda: jax.jit(
        hybrid(weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.sum() > 0, p)).init)(PARAMS),
    "fused-needs-params": lambda: hybrid().step(None, hybrid().init(PARAMS), GRADS),
    "placement-unknown": lambda: hybrid(state_memory_kind={"w": "gpu", "b": "host"}),
    "placement-disk-host-param": lambda: hybrid(state_memory_kind="disk").init({"w": jax.device_put(
        jnp.ones(3), jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"))}),
    "tiers-and-kind": lambda: hybrid(tiers="host", state_memory_kind="pinned_host"),
    "placement-tree": lambda: hybrid(state_memory_kind={"w": "host", "x": "device"}).init(PARAMS),
    "by-fraction-range": lambda: optax_hybrid.by_fraction(host=-0.1),
    "by-fraction-sum": lambda: optax_hybrid.by_fraction(host=0.7, disk=0.4),
    "by-fraction-rest": lambda: optax_hybrid.by_fraction(host=0.5, rest=optax_hybrid.by_fraction(disk=0.1)),
    "by-fraction-twice": lambda: hybrid(offload_fraction=0.2, state_memory_kind=optax_hybrid.by_fraction(host=0.1)),
    "offload-fraction": lambda: hybrid(offload_fraction=-0.1),
    "master-dtype": lambda: hybrid(master=jnp.complex64),
    "master-needs-params": lambda: hybrid(master="float32", weight_decay=0.0).update(
        GRADS_BF16, hybrid(master="float32", weight_decay=0.0).init(PARAMS_BF16)),
    "master-name": lambda: hybrid(master="bf16"),
    "master-both": lambda: hybrid(master="kahan", master_dtype=jnp.float32),
    "state-layout-unknown": lambda: hybrid(state_layout="flat"),
    "packed-placement": lambda: hybrid(state_layout="packed", state_memory_kind="host").init(PARAMS),
    "packed-pallas": lambda: hybrid(state_layout="packed", kernel="pallas").init(PARAMS),
    "packed-sharded": lambda: hybrid(state_layout="packed").init({"w": FakeShardedParam()}),
    "packed-state": lambda: update_with_state(hybrid(state_layout="packed"),
                                              lambda s: s._replace(mu={"float32": jnp.zeros(3)})),
    "flat-params-empty": lambda: optax_hybrid.flatten_params({}),
    "flat-params-leaf-type": lambda: optax_hybrid.flatten_params({"w": jnp.ones(3), "lr": 0.1}),
    "flat-params-group-key": lambda: optax_hybrid.flatten_params(PARAMS, group=lambda path, leaf: [path]),
    "flat-params-stacked-scalar": lambda: optax_hybrid.flatten_params(
        {"w": jnp.ones((2, 3)), "gain": jnp.ones(())}, stacked=True),
    "flat-params-stacked-length": lambda: optax_hybrid.flatten_params(
        {"w": jnp.ones((2, 3)), "b": jnp.ones((3, 3))}, stacked=True),
    "flat-params-view-shape": lambda: jax.tree.map(lambda a: a[:11], optax_hybrid.flatten_params(
        {"w": jnp.ones((3, 4))})).as_tree(),
    "flat-params-mask-shape": lambda: optax_hybrid.flatten_params(PARAMS).mask_from_tree({"w": True}),
    "flat-params-mask-mixed": lambda: optax_hybrid.flatten_params(PARAMS).mask_from_tree({"w": True, "b": False}),
    "packed-in-parts": lambda: hybrid(state_layout="packed").begin_step(
        STACKED, hybrid(state_layout="packed").init(STACKED), {"embed": False, "layers": True}),
    "nvme-dir-missing": lambda: hybrid(state_memory_kind="disk", nvme_offload_dir="/nonexistent/optax_hybrid"),
    "nvme-dir-not-dir": lambda: hybrid(state_memory_kind="disk", nvme_offload_dir=tmp_file()),
    "nvme-closed": closed_disk_state,
    "nvme-sharded": lambda: hybrid(state_memory_kind="disk").init({"w": FakeShardedParam()}),
    "zero1-type": lambda: hybrid(shard_state_over=0),
    "zero1-no-mesh": lambda: hybrid(shard_state_over="data").init(PARAMS),
    "recipe-lr-range": lambda: recipe(learning_rate=-1e-3),
    "recipe-lr-callable": lambda: recipe(learning_rate=optax.constant_schedule(1e-3)),
    "recipe-total-steps": lambda: optax_hybrid.recipe.standard_optimizer(1e-3),
    "recipe-schedule-conflict": lambda: optax_hybrid.recipe.standard_optimizer(
        schedule=optax.constant_schedule(1e-3), warmup=10),
    "recipe-warmup-fraction": lambda: recipe(warmup=1.0),
    "recipe-warmup-too-long": lambda: recipe(warmup=100),
    "recipe-min-lr-twice": lambda: recipe(min_lr=1e-4, min_lr_ratio=0.1),
    "recipe-min-lr-above-peak": lambda: recipe(min_lr=1e-2),
    "recipe-clip-zero": lambda: recipe(max_grad_norm=0.0),
    "recipe-accumulation": lambda: recipe(accumulation_steps=0),
    "recipe-group-key": lambda: recipe(param_groups={"head/*": {"lr_mult": 2.0}}),
    "recipe-group-frozen-options": lambda: recipe(param_groups={"b": {"frozen": True, "lr_multiplier": 2.0}}),
    "recipe-group-pattern-type": lambda: recipe(param_groups={3: {}}),
    "recipe-decay-mask-type": lambda: recipe(decay_mask={"w": True, "b": False}),
    "recipe-mask-option": lambda: recipe(mask={"w": True, "b": False}),
    "recipe-unknown-option": lambda: recipe(weight_decy=0.1),
    "recipe-group-unmatched": lambda: recipe(param_groups={"haed/*": {"lr_multiplier": 2.0}}).init(PARAMS),
    "recipe-group-shadowed": lambda: recipe(param_groups={"*": {"lr_multiplier": 2.0},
                                                          "w": {"frozen": True}}).init(PARAMS),
    "recipe-decay-mask-result": lambda: recipe(decay_mask=lambda path, p: p.ndim).init(PARAMS),
    "last-lr-no-record": lambda: optax_hybrid.recipe.last_learning_rate(optax.adamw(1e-3).init(PARAMS)),
    "last-lr-needs-rate": lambda: optax_hybrid.recipe.last_learning_rate(hybrid().init(PARAMS)),
    "last-lr-rate-and-record": lambda: optax_hybrid.recipe.last_learning_rate(recipe().init(PARAMS), 1e-3),
    "report-traced": lambda: jax.jit(lambda p, s: optax_hybrid.report.memory_report(p, s).device_bytes)(
        PARAMS, hybrid().init(PARAMS)),
    "report-param-type": lambda: optax_hybrid.report.memory_report({"w": np.ones(3, np.float32)}, ()),
    "report-state-path": lambda: optax_hybrid.report.memory_report({"v": PARAMS["w"]},
                                                                   hybrid().init({"w": PARAMS["w"]})),
    "report-state-shape": lambda: optax_hybrid.report.memory_report(
        {"w": jnp.ones((7, 5))}, hybrid().init({"w": PARAMS["w"]})),
    "apply-tree": lambda: optax_hybrid.apply_updates(PARAMS, {"w": GRADS["w"]}),
    "checkpoint-not-dir": lambda: optax_hybrid.checkpoint.manager(tmp_file()),
    "checkpoint-none": lambda: optax_hybrid.checkpoint.restore(empty_manager(), like={"x": jnp.zeros(2)}),
    "checkpoint-step": lambda: optax_hybrid.checkpoint.restore(manager_with_step_1(), like={"x": jnp.zeros(2)}, step=7),
    "checkpoint-master-missing": restore_masters,
    "checkpoint-disk-without-plan": disk_state_without_its_plan,
    "checkpoint-restore-disk-without-plan": lambda: disk_state_without_its_plan(restore=True),
    "checkpoint-master-format": restore_other_master_format,
    "checkpoint-masters-from-param": lambda: restore_masters(lambda restored: {"w": restored["params"]["w"]}),
    "checkpoint-masters-from-type": lambda: restore_masters("params"),
    "checkpoint-unreadable": lambda: optax_hybrid.checkpoint.restore(manager_with_unreadable_steps(1),
                                                                     like={"x": jnp.zeros(1000)}),
    "checkpoint-none-readable": lambda: optax_hybrid.checkpoint.restore(
        manager_with_unreadable_steps(1), like={"x": jnp.zeros(1000)}, skip_unreadable=True),
    "checkpoint-skip-with-step": lambda: optax_hybrid.checkpoint.restore(
        manager_with_step_1(), like={"x": jnp.zeros(2)}, step=1, skip_unreadable=True),
    "checkpoint-like-shape": lambda: optax_hybrid.checkpoint.restore(manager_with_step_1(), like={"x": jnp.zeros(3)}),
    "checkpoint-like-lacks": lambda: optax_hybrid.checkpoint.restore(manager_with_step_1(), like={}),
    "checkpoint-like-extra": lambda: optax_hybrid.checkpoint.restore(manager_with_step_1(),
                                                                     like={"x": jnp.zeros(2), "y": jnp.zeros(2)}),
}

STACKED = {"embed": jnp.ones((3, 4)), "layers": {"w": jnp.ones((2, 4, 4)), "gain": jnp.ones(2)}}
# The layers in host memory, as scan_layers streams them.
STACKED_IN_HOST = {"embed": STACKED["embed"], "layers": jax.device_put(STACKED["layers"], HOST_MEMORY)}


def step_in_backward(tx, params=STACKED, head=lambda rest, x, b: x.sum(), embed=lambda rest, b: rest["embed"][b],
                     layer=lambda x, p, rest, b: x @ p["w"] * p["gain"], state=None, **kw):
  step = optax_hybrid.step_in_backward(tx, embed, layer, head, **kw)
  return jax.jit(step)(params, tx.init(params) if state is None else state, jnp.array([0, 1]))


def step_in_backward_results_unpacked_in_the_old_order():
  tx = hybrid()
  loss, params, state = jax.jit(optax_hybrid.step_in_backward(
      tx, lambda rest, b: rest["embed"][b], lambda x, p, rest, b: x @ p["w"] * p["gain"],
      lambda rest, x, b: x.sum()))(STACKED, tx.init(STACKED), jnp.array([0, 1]))
  return step_in_backward(tx, params=params, state=state)


def scan_layers(layer=lambda c, p: jnp.tanh(c @ p["w"]), layers=STACKED["layers"], **kw):
  return optax_hybrid.scan_layers(layer, jnp.ones((2, 4)), layers, **kw)


def split_layers_state():
  """A state whose plan says the stacked layers' first axis is split over devices, as init records it for
  PartitionSpec("fsdp", ...) on a mesh (this process has one device; tests/test_streaming_fsdp.py has the mesh)."""
  import dataclasses
  tx = hybrid()
  state = tx.init(STACKED)
  leaves = tuple(dataclasses.replace(lp, row_axes=0) if "layers" in lp.path else lp for lp in state.plan.leaves)
  return tx, state._replace(plan=dataclasses.replace(state.plan, leaves=leaves))


TRIGGERS.update({
    "backward-split-layers": lambda: (lambda tx, state: tx.begin_step(STACKED, state, {"embed": False,
                                                                                        "layers": True}))(
        *split_layers_state()),
    "backward-tx": lambda: optax_hybrid.step_in_backward(optax.chain(hybrid()), None, None, None),
    "backward-layers-key": lambda: step_in_backward(hybrid(), {"embed": STACKED["embed"], "blocks": STACKED["layers"]}),
    "backward-host-layers-pinned-host": lambda: step_in_backward(hybrid(state_memory_kind="pinned_host"),
                                                                 params=STACKED_IN_HOST),
    "backward-host-layers-default": lambda: step_in_backward(hybrid(), params=STACKED_IN_HOST),
    "backward-host-placement": lambda: step_in_backward(hybrid(state_memory_kind="host")),
    "backward-disk-placement": lambda: step_in_backward(hybrid(state_memory_kind={"embed": None, "layers": "disk"})),
    "backward-loss": lambda: step_in_backward(hybrid(), head=lambda rest, x, b: x.sum(-1)),
    "backward-skip-nonfinite": lambda: step_in_backward(hybrid(skip_nonfinite=True)),
    "backward-results-order": step_in_backward_results_unpacked_in_the_old_order,
    "backward-layer-fn-args": lambda: step_in_backward(hybrid(), layer=lambda x, p: x @ p["w"]),
    "backward-closed-over-param": lambda: step_in_backward(
        hybrid(), layer=lambda x, p, rest, b: x @ p["w"] + STACKED["embed"][0]),
    "backward-xs-length": lambda: step_in_backward(
        hybrid(), layer=lambda x, p, key, rest, b: x @ p["w"],
        xs=lambda rest, b: jax.random.split(jax.random.key(0), 3)),
    "embed-fn-carry": lambda: step_in_backward(hybrid(), embed=lambda rest, b: None),
    "layer-fn-carry": lambda: scan_layers(layer=lambda c, p: jnp.tanh(c @ p["w"]).astype(jnp.bfloat16)),
    "layer-fn-scan-pair": lambda: step_in_backward(hybrid(), layer=lambda x, p, rest, b: (x @ p["w"], None)),
    "scan-layers-empty": lambda: scan_layers(layers={}),
    "scan-layers-length": lambda: scan_layers(layers={"w": jnp.ones((2, 4, 4)), "gain": jnp.ones(3)}),
    "scan-layers-xs-length": lambda: scan_layers(layer=lambda c, p, x: c @ p["w"] * x, xs=jnp.ones(3)),
    "clip-max-norm": lambda: optax_hybrid.clip_by_global_norm(0.0),
    "optax-clip-host": lambda: jax.jit(optax.clip_by_global_norm(1.0).update)(
        {"w": jax.device_put(jnp.ones(3), HOST_MEMORY), "b": jnp.ones(2)}, optax.EmptyState()),
    "begin-step-by-rows": lambda: hybrid().begin_step(STACKED, hybrid().init(STACKED), {"layers": True}),
    "begin-step-scalar": lambda: hybrid().begin_step({"s": jnp.ones(())}, hybrid().init({"s": jnp.ones(())}),
                                                     {"s": True}),
    "step-rows-grads": lambda: (lambda parts: parts.step_rows(parts.buffers, {"w": STACKED["layers"]["w"][0]}, 0))(
        hybrid().begin_step(STACKED, hybrid().init(STACKED), {"embed": False, "layers": True})),
    "finish-grads": lambda: (lambda parts: parts.finish(parts.buffers, {"layers": None}))(
        hybrid().begin_step(STACKED, hybrid().init(STACKED), {"embed": False, "layers": True})),
})

# Split stacks and the planner: the checks made before anything is compiled.
ABSTRACT_MODEL = {"embed": jax.ShapeDtypeStruct((64, 8), jnp.float32),
                  "layers": {"w": jax.ShapeDtypeStruct((3, 8, 8), jnp.float32)}}


def choose(**kw):
  kw = {"target": "h200", "device_bytes": 1e9, "host_bytes": 1e9, **kw}
  return optax_hybrid.choose_placement(lambda kinds: hybrid(state_memory_kind=kinds), lambda tx: None,
                                       ABSTRACT_MODEL, jax.ShapeDtypeStruct((4,), jnp.int32), **kw)


def placement_for(layers):
  cost = optax_hybrid.planner.Cost(0, 0, 0, 0)
  return optax_hybrid.StackPlacement("layers", layers, 1, "host_state", "host_state", "h200", 1e9, 1e9, cost, cost,
                                     0.0, 0.0)


TRIGGERS.update({
    "split-stack-rows": lambda: optax_hybrid.split_stack({"w": jnp.ones((3, 2))}, 4),
    "split-stack-lengths": lambda: optax_hybrid.split_stack({"w": jnp.ones((3, 2)), "b": jnp.ones((4, 2))}, 1),
    "choose-stack": lambda: choose(stack="blocks"),
    "choose-budget": lambda: choose(host_bytes=0),
    "choose-fraction": lambda: choose(budget_fraction=1.5),
    "choose-device-short": lambda: choose(device_bytes=1000),
    "choose-no-target": lambda: choose(target=None),
    "choose-callables": lambda: optax_hybrid.choose_placement(hybrid(), None, ABSTRACT_MODEL, None, target="h200"),
    "place-length": lambda: placement_for(5).place(ABSTRACT_MODEL),
})

ROWS = table_rows()


def test_table_and_tests_list_the_same_rows():
  assert len(ROWS) >= 40
  assert set(ROWS) == set(TRIGGERS)


@pytest.mark.parametrize("row", sorted(TRIGGERS))
def test_row(row):
  if row.startswith("checkpoint"):
    pytest.importorskip("orbax.checkpoint")
  exception_name, message = ROWS[row]
  with pytest.raises(Exception) as info:
    TRIGGERS[row]()
  assert type(info.value).__name__ == exception_name, info.value
  assert message.strip("`").replace("`", "") in str(info.value).replace("`", ""), (message, str(info.value))


@pytest.mark.parametrize("grads", [
    {"w": GRADS["w"]},
    {**GRADS, "w": jnp.ones((7, 5))},
    {**GRADS, "b": jnp.ones(7, jnp.complex64)},
])
def test_update_errors_leave_donated_state_intact(grads):
  params = jax.device_put(jax.tree.map(jnp.copy, PARAMS), jax.devices()[0])
  tx = hybrid(weight_decay=0.1, state_memory_kind="pinned_host")
  state = tx.init(params)
  _, state = tx.update(GRADS, state, params)
  before = jax.device_get(state)

  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  step = jax.jit(step, donate_argnums=(0, 1))
  with pytest.raises((ValueError, TypeError)):
    step(params, state, grads)
  # Nothing was consumed or changed: the same state still steps correctly.
  assert not any(x.is_deleted() for x in jax.tree.leaves((params, state)))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), before)
  new_params, new_state = step(params, state, GRADS)
  assert int(new_state.count) == 2


@pytest.mark.parametrize("name", ["hybrid_adamw", "hybrid_lion", "hybrid_adagrad", "hybrid_sgd"])
def test_a_bad_learning_rate_is_reported_by_the_function_called(name):
  # The rows above check the text after the name; the message starts with the optimizer the user called
  # (options.check_learning_rate with owner None survived mutation testing: docs/records/testing.md).
  with pytest.raises(ValueError, match=rf"^{name}: `learning_rate` must be >= 0.0, got -0.001\.$"):
    getattr(optax_hybrid, name)(-1e-3)


@pytest.mark.parametrize("name", ["hybrid_adamw", "hybrid_lion", "hybrid_adagrad", "hybrid_sgd"])
@pytest.mark.parametrize("value,message", [
    (True, "must be a number, got the bool True."),
    ("0.5", "must be a number, got '0.5' of type str."),
    (np.ones(2), "must be a scalar number, got an array of shape (2,) and dtype float64."),
])
def test_a_hyperparameter_that_is_not_a_number_is_reported_by_the_function_called(name, value, message):
  # mutmut: _checks.hyperparameter 3 (the owner None in the not-a-number messages) survived.
  argument = {"hybrid_adamw": "b1", "hybrid_lion": "b1", "hybrid_adagrad": "eps", "hybrid_sgd": "momentum"}[name]
  with pytest.raises(TypeError, match="^" + re.escape(f"{name}: `{argument}` {message}") + "$"):
    getattr(optax_hybrid, name)(1e-3, **{argument: value})
