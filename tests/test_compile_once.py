"""A jitted training step compiles once: steps 2 and later compile nothing (issue 22).

Compilations are counted with ``jax.monitoring``'s backend-compile events over
4 steps, for Flax NNX (``nnx.Optimizer`` in an ``nnx.jit`` step), Flax Linen
(``TrainState`` in a ``jax.jit`` step) and a plain ``jax.jit`` loop, in every
tier that runs on a CPU.

Why a call is needed: a jitted program that moves values between memory kinds
(state in host memory: every tier but ``"device"``) returns committed arrays
whatever its inputs (JAX: ``pxla.py``, ``committed = ... or
transfer_mem_kind_in_jaxpr``), and JAX compiles again when an argument that
was uncommitted comes back committed. The params a framework makes, its step
counter (``nnx.Optimizer.step``, ``TrainState.step``) and Optax's counters
are uncommitted, so the second step compiled the whole program again (NNX:
1.4 s here). ``optax_hybrid.commit`` commits them before the first step. On
the ``device`` tier nothing is moved and ``init`` mirrors the params (an
uncommitted state for uncommitted params), so the loop written as for
``optax.adamw`` compiles once without it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid

nnx = pytest.importorskip("flax.nnx")
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402

STEPS = 4
TIERS = ("device", "host_state", "host", "disk", "offload_fraction")
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_compiles: list[str] = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, duration, **kwargs: _compiles.append(event) if event == COMPILE_EVENT else None)

X = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4)
Y = np.sin(X.sum(axis=1, keepdims=True))


def compiles_per_step(step) -> list[int]:
  """Backend compilations during each of ``STEPS`` calls of ``step()``."""
  counts = []
  for _ in range(STEPS):
    before = len(_compiles)
    jax.block_until_ready(step())
    counts.append(len(_compiles) - before)
  return counts


def hybrid(tier: str, tmp_path) -> optax.GradientTransformation:
  if tier == "offload_fraction":  # half the params updated on the host, half on the device
    return optax_hybrid.hybrid_adamw(1e-2, weight_decay=1e-4, offload_fraction=0.5)
  if tier == "disk":
    return optax_hybrid.hybrid_adamw(1e-2, weight_decay=1e-4, tiers="disk", nvme_offload_dir=str(tmp_path))
  return optax_hybrid.hybrid_adamw(1e-2, weight_decay=1e-4, tiers=tier)


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.out = nnx.Linear(8, 1, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.gelu(self.hidden(x)))


class LinenMLP(nn.Module):

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1)(nn.gelu(nn.Dense(8)(x)))


def nnx_loop(tx, commit: bool):
  model = NnxMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  if commit:
    nnx.update((model, optimizer), optax_hybrid.commit(nnx.state((model, optimizer))))

  @nnx.jit
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  x, y = jnp.asarray(X), jnp.asarray(Y)
  return lambda: train_step(model, optimizer, x, y), lambda: int(optimizer.step[...])


def linen_loop(tx, commit: bool):
  model = LinenMLP()
  params = model.init(jax.random.key(0), X)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  if commit:
    state = optax_hybrid.commit(state)

  @jax.jit
  def train_step(state, x, y):
    grads = jax.grad(lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads)

  box = [state]
  x, y = jnp.asarray(X), jnp.asarray(Y)

  def step():
    box[0] = train_step(box[0], x, y)
    return box[0]

  return step, lambda: int(box[0].step)


def jit_loop(tx, commit: bool):
  params = {"w": jnp.ones((4, 1)) * 0.1, "b": jnp.zeros(1)}
  state = tx.init(params)
  if commit:
    params, state = optax_hybrid.commit((params, state))

  @jax.jit
  def train_step(params, state, x, y):
    grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(params)
    updates, state = tx.update(grads, state, params)
    return optax_hybrid.apply_updates(params, updates), state

  box = [params, state]
  x, y = jnp.asarray(X), jnp.asarray(Y)

  def step():
    box[:] = train_step(*box, x, y)
    return box

  return step, lambda: len(jax.tree.leaves(box[1]))


LOOPS = {"nnx": nnx_loop, "linen": linen_loop, "jit": jit_loop}


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_committed_loop_compiles_once(framework, tier, tmp_path):
  step, steps_taken = LOOPS[framework](hybrid(tier, tmp_path), commit=True)
  counts = compiles_per_step(step)
  assert counts[0] >= 1 and counts[1:] == [0] * (STEPS - 1), counts
  if framework != "jit":
    assert steps_taken() == STEPS


@pytest.mark.parametrize("framework", sorted(LOOPS))
def test_device_tier_loop_written_as_for_optax_adamw_compiles_once(framework, tmp_path):
  """Nothing committed by hand, as users write the loop for ``optax.adamw``."""
  counts = compiles_per_step(LOOPS[framework](hybrid("device", tmp_path), commit=False)[0])
  assert counts[0] >= 1 and counts[1:] == [0] * (STEPS - 1), counts


@pytest.mark.parametrize("wrap", ["inject_hyperparams", "MultiSteps"])
def test_optax_wrappers_counters_committed_compile_once(wrap):
  """Optax's own counters (inject_hyperparams' values, MultiSteps' mini steps) are uncommitted too."""
  if wrap == "inject_hyperparams":
    tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, tiers="host_state")
  else:
    tx = optax.MultiSteps(optax_hybrid.hybrid_adamw(1e-2, tiers="host"), every_k_schedule=2)
  counts = compiles_per_step(jit_loop(tx, commit=True)[0])
  assert counts[0] >= 1 and counts[1:] == [0] * (STEPS - 1), counts


def test_commit_keeps_committed_arrays_and_commits_the_rest():
  device = jax.devices()[0]
  host = jax.device_put(np.ones(3, np.float32), jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
  loose = jnp.arange(4.0)
  abstract = jax.ShapeDtypeStruct((2,), jnp.float32)
  tree = {"host": host, "loose": loose, "count": 0, "rate": 0.5, "numpy": np.arange(3), "none": None,
          "abstract": abstract}
  assert not loose.committed
  out = optax_hybrid.commit(tree)
  assert out["host"] is host and out["none"] is None and out["abstract"] is abstract
  for name in ("loose", "count", "rate", "numpy"):
    x = out[name]
    assert isinstance(x, jax.Array) and x.committed, name
    assert x.sharding.device_set == {device} and x.sharding.memory_kind == "device", (name, x.sharding)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(tree[name]))
  # Numbers keep the weak type jit gives them, so the step traces as before.
  assert out["count"].dtype == jnp.int32 and out["count"].weak_type


def test_an_injected_value_recompiles_nothing_when_it_keeps_its_type():
  """docs/optimizer.md's condition: same shape, dtype, weak type and committedness as the value it replaces.

  ``jnp.full_like(old, value)`` keeps all four; a Python float (weakly
  typed, uncommitted) or a fresh ``jnp.asarray(value, jnp.float32)``
  (uncommitted) compiles the step once more, once per such kind, not per change.
  """
  tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, weight_decay=0.1, tiers="host_state")
  params = {"w": jnp.ones((4, 3)), "b": jnp.zeros(3)}
  params, state = optax_hybrid.commit((params, tx.init(params)))

  @jax.jit
  def train_step(params, state):
    updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    return optax_hybrid.apply_updates(params, updates), state

  changes = [("first", None, None), ("full_like", lambda old: jnp.full_like(old, 3e-3), 0),
             ("full_like", lambda old: jnp.full_like(old, 1e-3), 0), ("float", lambda old: 2e-3, 1),
             ("float", lambda old: 4e-3, 0), ("asarray", lambda old: jnp.asarray(5e-3, jnp.float32), 1)]
  for name, change, expected in changes:
    if change is not None:
      state.hyperparams["learning_rate"] = change(state.hyperparams["learning_rate"])
    rate = float(state.hyperparams["learning_rate"])
    before = len(_compiles)
    params, state = train_step(params, state)
    compiled = len(_compiles) - before
    assert compiled >= 1 if expected is None else compiled == expected, (name, compiled)
    assert float(state.hyperparams["learning_rate"]) == np.float32(rate), name
