"""One process of a multi-process (multi-controller) training run, started by test_multiprocess.py.

Every process runs this same program, as on a multi-host cluster: it joins the
others through ``jax.distributed.initialize``, builds the global mesh over all
processes' devices, trains a small MLP with ``optax_hybrid.hybrid_adamw`` both
through ``tx.update`` + ``optax_hybrid.apply_updates`` and through the fused
``tx.step``, checks where the optimizer state lives, and saves the gathered
global params and moments to ``<out-dir>/process_<id>.npz``.

The data and the initial params are plain NumPy from fixed seeds (see
``problem``), so the test can recompute the same training on one device.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

D_IN, HIDDEN, D_OUT, BATCH, STEPS = 8, 16, 4, 32, 5
PEAK_LR, WARMUP, TOTAL, ETA_MIN = 3e-2, 2, 4, 3e-3  # TOTAL < STEPS: the last step runs on the floor
B1, B2, EPS, WEIGHT_DECAY = 0.9, 0.95, 1e-8, 0.1
# No weight decay on biases: the mask is part of what must agree across processes.
DECAY = {"w1": True, "b1": False, "w2": True, "b2": False}


def problem() -> tuple[dict[str, np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
  """Initial params and one (x, y) batch per step, float32, from fixed seeds.

  Imported by the test for its single-device reference; it only uses NumPy.
  """
  rng = np.random.default_rng(20240611)
  params = {
      "w1": rng.normal(scale=0.5, size=(D_IN, HIDDEN)),
      "b1": rng.normal(scale=0.1, size=(HIDDEN,)),
      "w2": rng.normal(scale=0.5, size=(HIDDEN, D_OUT)),
      "b2": rng.normal(scale=0.1, size=(D_OUT,)),
  }
  teacher = rng.normal(size=(D_IN, D_OUT))
  batches = []
  for _ in range(STEPS):
    x = rng.normal(size=(BATCH, D_IN))
    batches.append((x, np.sin(x @ teacher)))
  cast = lambda a: np.asarray(a, np.float32)
  return {k: cast(v) for k, v in params.items()}, [(cast(x), cast(y)) for x, y in batches]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--coordinator", required=True, help="host:port of process 0's coordinator")
  parser.add_argument("--num-processes", type=int, required=True)
  parser.add_argument("--process-id", type=int, required=True)
  parser.add_argument("--local-devices", type=int, default=2)
  parser.add_argument("--memory-kind", default="pinned_host")
  parser.add_argument("--out-dir", required=True)
  parser.add_argument("--checkpoint", action="store_true",
                      help="also save and restore through optax_hybrid.checkpoint (needs orbax-checkpoint)")
  args = parser.parse_args()

  import jax

  # Built before initialize, as a training script may do at import time:
  # building the optimizer must not start a backend.
  import optax_hybrid

  sched = optax_hybrid.warmup_cosine_schedule(PEAK_LR, total_steps=TOTAL, warmup_steps=WARMUP, eta_min=ETA_MIN)
  tx = optax_hybrid.hybrid_adamw(sched, b1=B1, b2=B2, eps=EPS, weight_decay=WEIGHT_DECAY,
                                 mask=DECAY, state_memory_kind=args.memory_kind)

  # Both settings must precede the first use of a backend. "gloo" is already
  # the default on JAX 0.10; naming it keeps the run independent of any
  # JAX_CPU_COLLECTIVES_IMPLEMENTATION in the environment.
  jax.config.update("jax_num_cpu_devices", args.local_devices)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
      coordinator_address=args.coordinator,
      num_processes=args.num_processes,
      process_id=args.process_id,
      initialization_timeout=120,
  )

  import jax.numpy as jnp
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  n_devices = args.num_processes * args.local_devices
  assert jax.process_count() == args.num_processes, jax.process_count()
  assert jax.process_index() == args.process_id, jax.process_index()
  assert jax.device_count() == n_devices, jax.devices()
  assert len(jax.local_devices()) == args.local_devices, jax.local_devices()
  kinds = optax_hybrid.available_memory_kinds(jax.local_devices()[0])
  assert args.memory_kind in kinds, f"{args.memory_kind!r} not offered in multi-process mode: {kinds}"

  mesh = jax.make_mesh((n_devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  # w1 and b1 are split along the hidden dimension, so each process holds only
  # part of them (and of their moments); w2 and b2 are replicated everywhere.
  specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P(), "b2": P()}
  batch_spec = P("data")

  def global_array(value: np.ndarray, spec: P) -> jax.Array:
    # Every process holds the full NumPy value and hands JAX only the slices
    # of its own devices, as a data loader on a cluster would.
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])

  init_np, batches_np = problem()

  def init_params() -> dict[str, jax.Array]:
    return {k: global_array(v, specs[k]) for k, v in init_np.items()}

  batches = [(global_array(x, batch_spec), global_array(y, batch_spec)) for x, y in batches_np]
  assert not batches[0][0].is_fully_addressable  # the batch really is split across processes

  def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)

  def update_step(params, state, x, y):
    grads = jax.grad(loss_fn)(params, x, y)
    updates, state = tx.update(grads, state, params)
    return optax_hybrid.apply_updates(params, updates), state

  def fused_step(params, state, x, y):
    return tx.step(params, state, jax.grad(loss_fn)(params, x, y))

  def check_placement(params, state, where: str) -> None:
    for name in ("mu", "nu"):
      for k, leaf in getattr(state, name).items():
        expected = NamedSharding(mesh, specs[k], memory_kind=args.memory_kind)
        assert leaf.sharding.memory_kind == args.memory_kind, (where, name, k, leaf.sharding)
        assert leaf.sharding.mesh == mesh, (where, name, k, leaf.sharding)
        assert leaf.sharding.is_equivalent_to(expected, leaf.ndim), (where, name, k, leaf.sharding)
        # The moments stay beside their param: same devices, same shards.
        assert leaf.sharding.is_equivalent_to(params[k].sharding.with_memory_kind(args.memory_kind), leaf.ndim), (
            where, name, k, leaf.sharding, params[k].sharding)
        # Host memory is per process: this process holds exactly the shards
        # of its own devices, in that memory, and no more.
        shards = leaf.addressable_shards
        assert {shard.device for shard in shards} == set(jax.local_devices()), (where, name, k, shards)
        for shard in shards:
          assert shard.data.sharding.memory_kind == args.memory_kind, (where, name, k, shard.data.sharding)
          assert shard.data.shape == leaf.sharding.shard_shape(leaf.shape), (where, name, k, shard.data.shape)
    for k, p in params.items():
      assert p.sharding.memory_kind == "device", (where, k, p.sharding)
      assert p.sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), p.ndim), (where, k, p.sharding)
    assert set(state.count.sharding.device_set) == set(mesh.devices.flat), (where, state.count.sharding)

  def check_checkpoint_round_trip(params, state, jitted) -> None:
    # Every process calls save and restore; Orbax has each write only the
    # shards it owns into the one (shared) directory, and read back its own.
    tree = {"params": params, "opt": state}
    manager = optax_hybrid.checkpoint.manager(os.path.join(args.out_dir, "ckpt"))
    optax_hybrid.checkpoint.save(manager, STEPS, tree, wait=True)
    restored = optax_hybrid.checkpoint.restore(manager, like=tree)
    for (where, a), b in zip(jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(tree)):
      assert a.sharding == b.sharding, (jax.tree_util.keystr(where), a.sharding, b.sharding)
      for sa, sb in zip(a.addressable_shards, b.addressable_shards):
        assert sa.device == sb.device, (jax.tree_util.keystr(where), sa.device, sb.device)
        np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data), err_msg=jax.tree_util.keystr(where))
    check_placement(restored["params"], restored["opt"], "restored")
    # Training resumes from the restored tree with the step already compiled.
    params, state = jitted(restored["params"], restored["opt"], *batches[0])
    check_placement(params, state, "resumed")
    assert int(jax.device_get(state.count)) == STEPS + 1, state.count

  results = {}
  for path, step_fn in (("update", update_step), ("step", fused_step)):
    params = init_params()
    state = tx.init(params)  # eager, on the global params
    # Right after init the sharding is the param's own, memory kind swapped.
    for name in ("mu", "nu"):
      for k, leaf in getattr(state, name).items():
        assert leaf.sharding == params[k].sharding.with_memory_kind(args.memory_kind), (path, name, k, leaf.sharding)
    check_placement(params, state, f"{path}/init")
    jitted = jax.jit(step_fn, donate_argnums=(0, 1))
    for x, y in batches:
      params, state = jitted(params, state, x, y)
    check_placement(params, state, f"{path}/trained")
    assert int(jax.device_get(state.count)) == STEPS, state.count
    gathered = multihost_utils.process_allgather({"params": params, "mu": state.mu, "nu": state.nu}, tiled=True)
    for group, tree in gathered.items():
      for k, v in tree.items():
        results[f"{path}/{group}/{k}"] = np.asarray(v)

  if args.checkpoint:
    check_checkpoint_round_trip(params, state, jitted)

  os.makedirs(args.out_dir, exist_ok=True)
  np.savez(os.path.join(args.out_dir, f"process_{args.process_id}.npz"), **results)
  # No process may exit while another still needs it for a collective.
  multihost_utils.sync_global_devices("multiprocess_script done")
  print(f"MULTIPROCESS OK process {args.process_id}/{args.num_processes} "
        f"devices={jax.device_count()} memory_kind={args.memory_kind} "
        f"checkpoint={'restored' if args.checkpoint else 'skipped'}", flush=True)


if __name__ == "__main__":
  main()
