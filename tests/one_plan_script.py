"""One plan per model in any process (issue 44), run by test_one_plan.py with 1, 2 or 8 devices.

``plans``: for every tier that keeps its state in memory, moment format,
master format and kernel, ``jax.eval_shape(tx.init, params)`` and
``tx.init(params)`` give equal tree structures and plans, for params on one
device (in a process of 1, 2 or 8 devices: the same plan in each, the kernel
run directly) and, with several devices, for params split over a mesh with
Explicit axes (the trace sees the split). Split over a mesh with Auto axes,
the trace cannot see how: ``eval_shape`` gives the plan of an unseen split,
and ``tx.init(checkpoint.abstract_like(params))`` the placed params' own.
A step of a state rebuilt in the abstract state's structure from the fresh
state's arrays reuses the fresh state's compiled program: one compile,
counted with ``jax.log_compiles``.

``save DIR`` / ``resume DIR`` (8 devices): a run on FSDP-split params with
its stacked layers streamed (``scan_layers`` in a ``jax.value_and_grad``,
then ``tx.step``; layers and their state in ``pinned_host``), saved with
Orbax after 2 steps; a new process restores it into an ``eval_shape`` target
(params from ``checkpoint.abstract_like``), steps 2 more with one compile, and
ends bit for bit where the uninterrupted 4 steps end (written by ``save``).
"""

import itertools
import logging
import os
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import optax_hybrid
from optax_hybrid import placement

N = jax.device_count()


class CompileLog(logging.Handler):
  """Counts the programs JAX compiles (``jax.log_compiles``' "Compiling <name>" records) by name."""

  def __init__(self):
    super().__init__(logging.DEBUG)
    self.names = []

  def emit(self, record):
    message = record.getMessage()
    if message.startswith("Compiling "):
      self.names.append(message.split()[1])

  def count(self, name):
    return sum(1 for n in self.names if n == f"jit({name})")


COMPILES = CompileLog()
logging.getLogger("jax").addHandler(COMPILES)


def params_on(sharding_of=None):
  """The issue's two leaves, a bf16 matrix (8-bit moments, masters) and a stacked (layers, rows, cols) leaf.

  On one device (``sharding_of`` None) ``a`` is the issue's (3, 4); split, (8, 4).
  """
  rng = np.random.default_rng(0)
  values = {"a": np.linspace(-1, 1, 12 if sharding_of is None else 32, dtype=np.float32).reshape(-1, 4),
            "b": np.ones(4, np.float32),
            "w": rng.normal(size=(16, 512)).astype(jnp.bfloat16),
            "layers": rng.normal(size=(3, 8, 512)).astype(np.float32)}
  out = {}
  for name, value in values.items():
    out[name] = jnp.asarray(value) if sharding_of is None else jax.device_put(value, sharding_of(name))
  return out


def split_over(mesh):
  """FSDP: each matrix split on its first axis over the mesh (the stack on its rows), vectors replicated."""
  def sharding_of(name):
    spec = {"a": P("d", None), "w": P("d", None), "layers": P(None, "d", None)}.get(name, P())
    return NamedSharding(mesh, spec)
  return sharding_of


def mesh(axis_type):
  return jax.make_mesh((N,), ("d",), axis_types=(axis_type,))


OPTIONS = {
    "tier": [dict(state_memory_kind="device"), dict(state_memory_kind="host_state"), dict(state_memory_kind="host"),
             dict(state_memory_kind="pinned_host")],
    "moments": [dict(), dict(moment_format="8bit")],
    "master": [dict(), dict(master="float32"), dict(master="kahan"), dict(master="stochastic")],
    "kernel": [dict(kernel="auto"), dict(kernel="xla"), dict(kernel="native"), dict(kernel="pallas")],
}


def every_option():
  for combo in itertools.product(*OPTIONS.values()):
    yield {k: v for part in combo for k, v in part.items()}


def covering_options():
  """Each value of each option at least once: a compile per row."""
  rows = max(len(v) for v in OPTIONS.values())
  for i in range(rows):
    yield {k: v for values in OPTIONS.values() for k, v in values[i % len(values)].items()}


def tx_of(options):
  return optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, **options)


def check_equal_plans(params, where):
  for options in every_option():
    tx = tx_of(options)
    fresh, abstract = tx.init(params), jax.eval_shape(tx.init, params)
    assert jax.tree.structure(abstract) == jax.tree.structure(fresh), (where, options)
    assert abstract.plan == fresh.plan and abstract.plan.leaves == fresh.plan.leaves, (where, options)
  print("equal plans:", where, flush=True)


def grads_like(params, scale):
  return jax.tree.map(lambda p: (jnp.asarray(p, jnp.float32) * scale).astype(p.dtype), params)


def check_one_compile(params, where):
  """A state rebuilt from the abstract state's structure steps with the fresh state's program."""
  grads = grads_like(params, 0.5)
  for options in covering_options():
    tx = tx_of(options)
    fresh = tx.init(params)
    rebuilt = jax.tree.unflatten(jax.tree.structure(jax.eval_shape(tx.init, params)), jax.tree.leaves(fresh))
    for path in ("step", "update"):
      def run(p, s, g, path=path, tx=tx):
        if path == "step":
          return tx.step(p, s, g)
        u, s = tx.update(g, s, p)
        return optax_hybrid.apply_updates(p, u), s
      run.__name__ = f"run_{path}"
      jitted = jax.jit(run)
      before = COMPILES.count(run.__name__)
      with jax.log_compiles(True):
        want = jitted(params, fresh, grads)
        got = jitted(params, rebuilt, grads)
      compiled = COMPILES.count(run.__name__) - before
      assert compiled == 1, (where, options, path, compiled)
      for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_array_equal(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)))
  print("one compile:", where, flush=True)


def check_plans():
  one = params_on()
  check_equal_plans(one, f"one device of {N}")
  tx = tx_of({})
  plan = tx.init(one).plan
  # The same plan in any process: on one device, the kernel runs directly whatever the device count.
  assert plan.split == "direct" and all(lp.row_axes is None for lp in plan.leaves), plan
  check_one_compile(one, f"one device of {N}")
  if N == 1:
    print("PLANS OK", flush=True)
    return
  explicit = params_on(split_over(mesh(jax.sharding.AxisType.Explicit)))
  check_equal_plans(explicit, f"split over {N} (Explicit axes)")
  check_one_compile(explicit, f"split over {N} (Explicit axes)")
  assert tx.init(explicit).plan.split == "shard_map"
  # A state made for one device and then moved over a mesh: its plan chose for one device; the step says so.
  replicated = NamedSharding(mesh(jax.sharding.AxisType.Auto), P())
  moved_state = jax.device_put(tx.init(one), replicated)
  moved_params = jax.device_put(one, replicated)
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    jax.jit(tx.step)(moved_params, moved_state, grads_like(moved_params, 0.5))
  assert any("made for params on one device" in str(w.message) and "jax.set_mesh" in str(w.message)
             for w in caught), [str(w.message) for w in caught]
  # Gradients that do not fit the state: the error, raised before (and so without) that warning.
  misshapen = jax.tree.map(lambda g: g[None], grads_like(moved_params, 0.5))
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      jax.jit(tx.step)(moved_params, moved_state, misshapen)
    except ValueError as e:
      assert "has shape" in str(e), e
    else:
      raise AssertionError("misshapen gradients stepped")
  assert not any("made for params on one device" in str(w.message) for w in caught), [str(w.message) for w in caught]
  auto = params_on(split_over(mesh(jax.sharding.AxisType.Auto)))
  for options in every_option():
    tx = tx_of(options)
    fresh = tx.init(auto)
    # Placed ShapeDtypeStructs: the placed params' own plan.
    assert tx.init(optax_hybrid.checkpoint.abstract_like(auto)).plan == fresh.plan, options
    # Traced on Auto axes: the split is unseen; nothing a device may not hold whole is cut.
    unseen = jax.eval_shape(tx.init, auto).plan
    assert unseen.split == "xla" and all(lp.row_axes == 0 and lp.state_sharding is None
                                         for lp in unseen.leaves), (options, unseen)
    assert placement.sharding_of(auto["a"]) == fresh.plan.leaves[0].state_sharding
  print("PLANS OK", flush=True)


# ---------------------------------------------------------------------------
# A checkpoint of FSDP-split params with streamed layers, restored into an eval_shape target
# ---------------------------------------------------------------------------

STEPS, SAVE_AT = 4, 2


def fsdp_run(devices=None):
  """The params (split over 8 devices, Explicit axes: JAX's default; the stack in pinned_host), tx and step."""
  devices = jax.devices() if devices is None else devices
  m = jax.make_mesh((len(devices),), ("d",), devices=devices)
  rng = np.random.default_rng(1)
  split = lambda spec, kind="device": NamedSharding(m, spec, memory_kind=kind)
  params = {"embed": jax.device_put(rng.normal(size=(64, 32)).astype(np.float32) * 0.1, split(P("d", None))),
            "layers": jax.device_put(rng.normal(size=(3, 32, 32)).astype(np.float32) * 0.1,
                                     split(P(None, "d", None), "pinned_host")),
            "head": jax.device_put(rng.normal(size=(32, 64)).astype(np.float32) * 0.1, split(P(None, "d")))}
  tx = optax_hybrid.hybrid_adamw(optax_hybrid.warmup_cosine_schedule(1e-2, total_steps=STEPS, warmup_steps=1),
                                 weight_decay=0.1, state_memory_kind={"embed": "device", "layers": "host_state",
                                                          "head": "host"})

  whole = lambda w: jax.sharding.reshard(w, NamedSharding(m, P()))  # FSDP, Explicit axes: gathered where used

  def loss_fn(p, tokens):
    x = whole(p["embed"])[tokens]
    x = optax_hybrid.scan_layers(lambda c, w: jnp.tanh(c @ whole(w)), x, p["layers"])
    logits = x @ whole(p["head"])
    return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(tokens.shape[0]), tokens])

  def train_step(p, s, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(p, tokens)
    p, s = tx.step(p, s, grads)
    return p, s, loss

  tokens = [jax.device_put(rng.integers(0, 64, size=(16,)).astype(np.int32), split(P())) for _ in range(STEPS)]
  return params, tx, jax.jit(train_step, donate_argnums=(0, 1)), tokens


def leaves_of(tree):
  return [np.asarray(jax.device_get(x)) for x in jax.tree.leaves(tree)]


def save(directory):
  params, tx, step, tokens = fsdp_run()
  state = tx.init(params)
  with optax_hybrid.checkpoint.manager(directory) as manager:
    for t in range(STEPS):
      params, state, _ = step(params, state, tokens[t])
      if t + 1 == SAVE_AT:
        optax_hybrid.checkpoint.save(manager, SAVE_AT, {"params": params, "opt": state}, wait=True)
  np.savez(os.path.join(directory, "uninterrupted.npz"), *leaves_of((params, state)))
  # The same run on one device: the same numbers, to float rounding of partitioned matmuls.
  one, tx, step, tokens = fsdp_run(jax.devices()[:1])
  one_state = tx.init(one)
  for t in range(STEPS):
    one, one_state, _ = step(one, one_state, tokens[t])
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(one)):
    np.testing.assert_allclose(np.asarray(jax.device_get(a)), np.asarray(jax.device_get(b)), rtol=1e-5, atol=1e-6)
  print("SAVED", flush=True)


def resume(directory):
  params, tx, step, tokens = fsdp_run()
  # On Auto axes eval_shape cannot see the split: restore says so, naming the target that can.
  auto_mesh = jax.make_mesh((N,), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
  auto = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(auto_mesh, x.sharding.spec,
                                                                memory_kind=x.sharding.memory_kind)), params)
  with optax_hybrid.checkpoint.manager(directory) as manager:
    try:
      optax_hybrid.checkpoint.restore(manager, like={"params": auto, "opt": jax.eval_shape(tx.init, auto)},
                                      step=SAVE_AT)
    except ValueError as e:
      assert "tx.init(checkpoint.abstract_like(params))" in str(e), e
    else:
      raise AssertionError("restored into a state whose split its plan does not know")
  target = {"params": optax_hybrid.checkpoint.abstract_like(params), "opt": jax.eval_shape(tx.init, params)}
  assert target["opt"].plan == tx.init(params).plan  # Explicit axes: the trace sees the split
  with optax_hybrid.checkpoint.manager(directory) as manager:
    restored = optax_hybrid.checkpoint.restore(manager, like=target, step=SAVE_AT)
  params, state = restored["params"], restored["opt"]
  kinds = {x.sharding.memory_kind for x in jax.tree.leaves((state.mu["layers"], state.nu["layers"]))}
  assert kinds == {"pinned_host"}, kinds
  for field in (state.mu, state.nu):
    for name, x in field.items():
      assert x.sharding.spec == params[name].sharding.spec and not x.sharding.is_fully_replicated, (name, x.sharding)
  before = COMPILES.count("train_step")
  with jax.log_compiles(True):
    for t in range(SAVE_AT, STEPS):
      params, state, _ = step(params, state, tokens[t])
  assert COMPILES.count("train_step") - before == 1, COMPILES.names
  want = np.load(os.path.join(directory, "uninterrupted.npz"))
  got = leaves_of((params, state))
  assert len(got) == len(want.files)
  for i, value in enumerate(got):
    np.testing.assert_array_equal(value, want[f"arr_{i}"], err_msg=f"leaf {i}")
  print("RESUMED BIT FOR BIT", flush=True)


if __name__ == "__main__":
  mode = sys.argv[1]
  if mode == "plans":
    check_plans()
  elif mode == "save":
    save(sys.argv[2])
  else:
    resume(sys.argv[2])
