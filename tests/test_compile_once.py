"""A jitted training step compiles once: steps 2 and later compile nothing (issues 22 and 42).

Compilations are counted from the records ``jax.log_compiles`` makes
(``Compiling jit(train_step) ...``, :mod:`compile_log`), what a user who sets
``JAX_LOG_COMPILES=1`` reads, over 4 steps: for Flax NNX (``nnx.Optimizer``
in an ``nnx.jit`` step), Flax Linen (``TrainState`` in a ``jax.jit`` step) and
a plain ``jax.jit`` loop, in every placement that runs on a CPU; and for two
loops shaped as Flax's NNX toy examples (``examples/nnx_toy_examples``
``02_lifted_transforms.py`` and ``03_train_state.py``, written here, not
copied) with only the optimizer line changed.

Why a line may be needed: a jitted program that moves values between memory
kinds (state outside device memory: every placement but ``"device"``)
returns committed arrays whatever its inputs (JAX: ``pxla.py``, ``committed =
... or transfer_mem_kind_in_jaxpr``), and JAX compiles again when an argument
that was uncommitted comes back committed. The params a framework makes, its
step counter (``nnx.Optimizer.step``, ``TrainState.step``) and Optax's
counters are uncommitted, so the second step compiled the whole program again
(NNX: 1.4 s here). The library cannot commit them itself (they are the
user's, or made around ``init``); the first step it traces says so, once,
with the line to add (:mod:`optax_hybrid._commit_check`), and not when the
line is there. On the ``device`` placement nothing is moved and ``init``
mirrors the params (an uncommitted state for uncommitted params), so the loop
written as for ``optax.adamw`` compiles once as it is.
"""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_hybrid
from compile_log import compile_log

nnx = pytest.importorskip("flax.nnx")
from flax import linen as nn  # noqa: E402
from flax.training import train_state  # noqa: E402

STEPS = 4
TIERS = ("device", "host_state", "host", "disk", "offload_fraction")


X = np.linspace(-1.0, 1.0, 32, dtype=np.float32).reshape(8, 4)
Y = np.sin(X.sum(axis=1, keepdims=True))


def compiles_per_step(step) -> list[int]:
  """Compilations during each of ``STEPS`` calls of ``step()`` (none is expected to warn: a warning fails)."""
  counts = []
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)
    for _ in range(STEPS):
      with compile_log() as log:
        jax.block_until_ready(step())
      counts.append(len(log.names))
  return counts


def hybrid(tier: str, tmp_path) -> optax.GradientTransformation:
  if tier == "offload_fraction":  # half the params updated on the host, half on the device
    return optax_hybrid.hybrid_adamw(1e-2, weight_decay=1e-4, state_memory_kind=optax_hybrid.by_fraction(host=0.5))
  if tier == "disk":
    return optax_hybrid.hybrid_adamw(1e-2, weight_decay=1e-4, state_memory_kind="disk",
                                     nvme_offload_dir=str(tmp_path))
  return optax_hybrid.hybrid_adamw(1e-2, weight_decay=1e-4, state_memory_kind=tier)


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
    tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, state_memory_kind="host_state")
  else:
    tx = optax.MultiSteps(optax_hybrid.hybrid_adamw(1e-2, state_memory_kind="host"), every_k_schedule=2)
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
  tx = optax.inject_hyperparams(optax_hybrid.hybrid_adamw)(learning_rate=1e-2, weight_decay=0.1,
                                                           state_memory_kind="host_state")
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
    with compile_log() as log:
      params, state = train_step(params, state)
    compiled = log.count("train_step")
    assert compiled >= 1 if expected is None else compiled == expected, (name, compiled)
    assert float(state.hyperparams["learning_rate"]) == np.float32(rate), name


# --- Flax's NNX toy examples, with only the optimizer line changed ---------------------------------------------

# Each placement a user names on that one line (the mission's own spelling first).
PLACEMENTS = {
    "device": "device",
    "pinned_host": "pinned_host",
    "host_state": "host_state",
    "host": "host",
    "disk": "disk",
    "by_fraction": optax_hybrid.by_fraction(host=0.5),
}
TOY_X = np.linspace(0, 1, 100)[:, None]
TOY_Y = 0.8 * TOY_X**2 + 0.1 + np.random.default_rng(0).normal(0, 0.1, size=TOY_X.shape)


def toy_batches(batch_size: int = 32):
  rng = np.random.default_rng(1)
  while True:
    idx = rng.choice(len(TOY_X), size=batch_size)
    yield TOY_X[idx], TOY_Y[idx]


class ToyLinear(nnx.Module):

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.uniform(rngs.params(), (din, dout)))
    self.b = nnx.Param(jnp.zeros((dout,)))

  def __call__(self, x):
    return x @ self.w[...] + self.b[...]


class ToyCount(nnx.Variable):
  pass


class ToyMLP(nnx.Module):

  def __init__(self, din, dhidden, dout, *, rngs: nnx.Rngs):
    self.count = ToyCount(jnp.array(0))
    self.linear1 = ToyLinear(din, dhidden, rngs=rngs)
    self.linear2 = ToyLinear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    self.count[...] += 1
    return self.linear2(jax.nn.relu(self.linear1(x)))


def lifted_transforms_loop(tx, line: str | None, steps: int = STEPS) -> int:
  """02_lifted_transforms.py's loop: nnx.Optimizer, nnx.jit, nnx.cached_partial; ``line`` added after the optimizer.

  Returns the times the model was called (the example prints it).
  """
  model = ToyMLP(din=1, dhidden=32, dout=1, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  if line is not None:
    exec(line, {"nnx": nnx, "optax_hybrid": optax_hybrid, "model": model, "optimizer": optimizer})  # noqa: S102

  @nnx.jit
  def train_step(model: ToyMLP, optimizer: nnx.Optimizer, batch):
    x, y = batch
    grads = nnx.grad(lambda model: jnp.mean((y - model(x)) ** 2))(model)
    optimizer.update(model, grads)

  @nnx.jit
  def test_step(model: ToyMLP, batch):
    x, y = batch
    return {"loss": jnp.mean((y - model(x)) ** 2)}

  cached_train_step = nnx.cached_partial(train_step, model, optimizer)
  cached_test_step = nnx.cached_partial(test_step, model)
  for step, batch in enumerate(toy_batches()):
    cached_train_step(batch)
    if step % 2 == 0:
      cached_test_step((TOY_X, TOY_Y))
    if step >= steps - 1:
      break
  return int(model.count[...])


class ToyTrainState(train_state.TrainState):
  counts: nnx.State
  graphdef: nnx.GraphDef


def train_state_loop(tx, line: str | None, steps: int = STEPS) -> int:
  """03_train_state.py's loop: nnx.split, a TrainState, jax.jit; ``line`` added after TrainState.create."""
  model = ToyMLP(din=1, dhidden=32, dout=1, rngs=nnx.Rngs(0))
  graphdef, params, counts = nnx.split(model, nnx.Param, ToyCount)
  state = ToyTrainState.create(apply_fn=None, graphdef=graphdef, params=params, tx=tx, counts=counts)
  del params, counts
  if line is not None:
    namespace = {"optax_hybrid": optax_hybrid, "state": state}
    exec(line, namespace)  # noqa: S102
    state = namespace["state"]

  @jax.jit
  def train_step(state: ToyTrainState, batch):
    x, y = batch

    def loss_fn(params):
      model = nnx.merge(state.graphdef, params, state.counts, copy=True)
      loss = jnp.mean((y - model(x)) ** 2)
      return loss, nnx.state(model, ToyCount)

    grads, counts = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, counts=counts)

  for step, batch in enumerate(toy_batches()):
    state = train_step(state, batch)
    if step >= steps - 1:
      break
  return int(nnx.merge(state.graphdef, state.params, state.counts).count[...])


# name -> (loop, how the line meant for it starts, the model calls it counts: train steps, and 02's test steps)
TOY_LOOPS = {"02_lifted_transforms": (lifted_transforms_loop, "nnx.update(", STEPS + (STEPS + 1) // 2),
             "03_train_state": (train_state_loop, "state = optax_hybrid.commit(state)", STEPS)}


def run_toy(loop_name: str, placement: str, tmp_path, line: str | None = None) -> tuple[int, list[str]]:
  """The loop with ``hybrid_adamw(..., state_memory_kind=placement)`` as its optimizer: its train step's compiles
  and the warnings it gave."""
  loop, _, calls = TOY_LOOPS[loop_name]
  tx = optax_hybrid.hybrid_adamw(1e-3, state_memory_kind=PLACEMENTS[placement], nvme_offload_dir=str(tmp_path))
  with warnings.catch_warnings(record=True) as caught, compile_log() as log:
    warnings.simplefilter("always")
    assert loop(tx, line) == calls
  tx.close()
  return log.count("train_step"), [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def line_to_add(message: str, loop_name: str) -> str:
  """The line of the warning meant for this loop (the warning lists one per way of holding the state)."""
  lines = [line.strip() for line in message.splitlines() if line.startswith("  ")]
  (line,) = [line for line in lines if line.startswith(TOY_LOOPS[loop_name][1])]
  return line


@pytest.mark.parametrize("placement", sorted(PLACEMENTS))
@pytest.mark.parametrize("loop_name", sorted(TOY_LOOPS))
def test_a_toy_example_with_only_its_optimizer_changed_compiles_once_or_says_the_line_that_makes_it(
    loop_name, placement, tmp_path):
  """As written, the loop compiles once, or it compiles twice and its first step said so once, naming the
  line; with that line added (read from the warning), it compiles once and says nothing."""
  compiles, said = run_toy(loop_name, placement, tmp_path)
  assert compiles in (1, 2), compiles
  assert len(said) == (compiles - 1), (compiles, said)  # said exactly when, and once
  if placement == "device":
    assert compiles == 1  # nothing moves between memory kinds: as with optax.adamw
  if said:
    assert re.search(r"this jitted step will compile twice\. With state_memory_kind=", said[0]), said[0]
    compiles, said_again = run_toy(loop_name, placement, tmp_path, line=line_to_add(said[0], loop_name))
    assert (compiles, said_again) == (1, []), (compiles, said_again)


def test_the_toy_loops_see_what_the_examples_see():
  """Without the line, the moving placements compile twice (JAX's committed outputs): the test above checks a
  real second compile, not a loop that never had one. With optax.adamw nothing changes."""
  for loop in (lifted_transforms_loop, train_state_loop):
    with compile_log() as log:
      loop(optax.adamw(1e-3), None)
    assert log.count("train_step") == 1, log.names
    with compile_log() as log, warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      loop(optax_hybrid.hybrid_adamw(1e-3, state_memory_kind="pinned_host"), None)
    assert log.count("train_step") == 2, log.names
