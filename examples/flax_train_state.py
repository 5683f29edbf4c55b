"""Train a Flax Linen MLP classifier with ``TrainState`` and hybrid_adamw, moments in host memory.

    python examples/flax_train_state.py --steps 200

Two interleaved spirals, a classic small non-linear problem. The step is a
jitted function that donates the whole ``TrainState`` (params and optimizer
state), as a production loop does; the Adam moments stay in ``pinned_host``
memory across steps. It uses the fused one-pass ``tx.step`` (new params written
in place) rather than ``TrainState.apply_gradients`` (an update, then a second
pass that adds it); ``--optax-contract`` switches to the latter.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import optax_hybrid


class Classifier(nn.Module):
  width: int = 64

  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(self.width)(x))
    x = nn.relu(nn.Dense(self.width)(x))
    return nn.Dense(2)(x)


def spirals(n: int, rng: np.random.Generator):
  t = rng.uniform(0.25, 3.0, size=n) * np.pi
  label = rng.integers(0, 2, size=n)
  sign = np.where(label == 0, 1.0, -1.0)
  x = np.stack([sign * t * np.cos(t), sign * t * np.sin(t)], axis=1) / 5.0
  x += rng.normal(scale=0.05, size=x.shape)
  return jnp.asarray(x, jnp.float32), jnp.asarray(label, jnp.int32)


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
  parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (default 1e-2)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--optax-contract", action="store_true",
                      help="step with TrainState.apply_gradients (update + apply) instead of the fused tx.step")
  args = parser.parse_args(argv)
  if args.steps < 2:
    parser.error("--steps must be at least 2")

  rng = np.random.default_rng(args.seed)
  model = Classifier()
  params = model.init(jax.random.key(args.seed), jnp.zeros((1, 2)))["params"]
  schedule = optax_hybrid.warmup_cosine_schedule(
      args.lr, total_steps=args.steps, warmup_steps=max(1, args.steps // 20), eta_min=0.1 * args.lr)
  # No weight decay on biases, as usual.
  decay_mask = lambda p: jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != "bias", p)
  tx = optax_hybrid.hybrid_adamw(schedule, weight_decay=1e-4, mask=decay_mask,
                                 state_memory_kind="pinned_host")
  # Committed (params and TrainState's step): a step that moves state between
  # memory kinds returns committed arrays, and uncommitted inputs would make
  # its second call compile again.
  state = optax_hybrid.commit(train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx))

  def loss_fn(params, x, y):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), logits

  @jax.jit
  def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(state.apply_fn({"params": params}, x), -1) == y)

  def train_step(state, x, y):
    (loss, _), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, x, y)
    if args.optax_contract:
      return state.apply_gradients(grads=grads), loss
    params, opt_state = tx.step(state.params, state.opt_state, grads)  # one pass, in place
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), loss

  train_step = jax.jit(train_step, donate_argnums=0)
  x_test, y_test = spirals(2048, np.random.default_rng(args.seed + 1))
  initial = float(accuracy(state.params, x_test, y_test))
  for step in range(args.steps):
    x, y = spirals(256, rng)
    state, loss = train_step(state, x, y)
    if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
      print(f"step {step:5d}  loss {float(loss):.4f}")
  final = float(accuracy(state.params, x_test, y_test))
  mu = optax.tree_utils.tree_get(state.opt_state, "mu")
  memory_kinds = sorted({leaf.sharding.memory_kind for leaf in jax.tree.leaves(mu)})
  print(f"test accuracy {initial:.3f} -> {final:.3f}; Adam moments in {', '.join(memory_kinds)} memory")
  return {"initial_accuracy": initial, "final_accuracy": final, "moment_memory_kinds": memory_kinds}


if __name__ == "__main__":
  main()
