"""Every leaf keeps its sharding through the step, on 8 simulated CPU devices (run by test_sharding.py).

An FSDP-style tree (stacked layers split on their middle axis, a matrix split on
its rows, one split on its last axis, a bias, a replicated scalar-like leaf) on
an 8-device mesh; for each case (tier x moment format x master x kernel x
path) one jitted, donated step from committed params and state, then:

* every param and state leaf comes back with its input sharding and memory
  kind (``is_equivalent_to`` the input's), each device holding its shard:
  the bytes of its addressable shard are the shard shape's, not the leaf's;
* the compiled step gathers nothing: no all-gather, all-to-all or
  collective-permute in its HLO (the step is elementwise per shard);
* its numbers equal the same step on one device (bit for bit for every
  kernel but the float-rounding differences of a partitioned program:
  rtol 1e-6 for float32; bf16 params exactly).

``python tests/sharding_script.py`` runs the CI subset (each value of every
dimension at least once); ``--all`` every combination (documented in
docs/tiers.md).
"""

import itertools
import os
import sys

assert "--xla_force_host_platform_device_count=8" in os.environ.get("XLA_FLAGS", "")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import optax_hybrid  # noqa: E402
import optax_hybrid.plan  # noqa: E402
from optax_hybrid.kernels import native_cpu  # noqa: E402
from optax_hybrid import _compat  # noqa: E402

assert jax.device_count() == 8
MESH = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
# shape, spec: the stack is cut into slices of rows along its first axis only (the second is split); the
# matrix is split on its rows (no axis to cut); "wide" is split on its last axis in whole 8-bit blocks.
LEAVES = {
    "stack": ((4, 256, 512), P(None, "fsdp", None)),
    "matrix": ((1024, 512), P("fsdp", None)),
    "wide": ((128, 4096), P(None, "fsdp")),
    "bias": ((512,), P("fsdp")),
    "scale": ((3,), P()),
}
TIERS = {"device": dict(tiers="device"), "host_state": dict(tiers="host_state"), "host": dict(tiers="host"),
         "offload_fraction": dict(offload_fraction=0.5)}
# host_state with a stage smaller than the stack's state: the stack's rows cross a slice at a time
# (LeafPlan.slice_rows; at full size, a stacked layer's state is larger than a stage).
SLICED_STAGE_BYTES = 64 * 2**10
FORMATS = {"float32": {}, "8bit": dict(moment_format="8bit")}
MASTERS = (None, "float32", "kahan", "stochastic")  # None: float32 params; else bf16 params with that master
KERNELS = ("xla", "pallas", "native")
PATHS = ("step", "update")
GATHERS = ("all-gather", "all-to-all", "collective-permute", "all-reduce")

RNG = np.random.default_rng(0)
VALUES = {k: RNG.normal(size=shape).astype(np.float32) for k, (shape, _) in LEAVES.items()}
GRADS = {k: RNG.normal(size=shape).astype(np.float32) * 0.1 for k, (shape, _) in LEAVES.items()}


def placed(values, dtype, one_device):
  if one_device:
    return {k: jax.device_put(jnp.asarray(v, dtype), jax.devices()[0]) for k, v in values.items()}
  return {k: jax.device_put(jnp.asarray(v, dtype), NamedSharding(MESH, LEAVES[k][1])) for k, v in values.items()}


def hybrid_adamw(tier, fmt, master, kernel):
  """The case's transformation; ``host_state sliced``: the host_state tier with a stage smaller than the stack."""
  optax_hybrid.plan.STREAM_STAGE_BYTES = SLICED_STAGE_BYTES if tier.endswith(" sliced") else DEFAULT_STAGE_BYTES
  return optax_hybrid.hybrid_adamw(1e-2, weight_decay=0.1, kernel=kernel, master=master,
                                   **TIERS[tier.removesuffix(" sliced")], **FORMATS[fmt])


DEFAULT_STAGE_BYTES = optax_hybrid.plan.STREAM_STAGE_BYTES


def run(tier, fmt, master, kernel, path, one_device=False):
  dtype = jnp.float32 if master is None else jnp.bfloat16
  tx = hybrid_adamw(tier, fmt, master, kernel)
  params = placed(VALUES, dtype, one_device)
  params, state = optax_hybrid.commit((params, tx.init(params)))
  grads = placed(GRADS, dtype, one_device)
  sliced = [lp.slice_rows for lp in state.plan.leaves if lp.slice_rows]
  assert bool(sliced) == tier.endswith(" sliced"), (tier, one_device, sliced)  # the stack crosses in slices

  def update_then_apply(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  fn = jax.jit(tx.step if path == "step" else update_then_apply, donate_argnums=(0, 1))
  before = jax.tree.map(lambda a: a.sharding, (params, state))
  text = None if one_device else fn.lower(params, state, grads).compile().as_text()
  return before, fn(params, state, grads), text


def check(case):
  before, (params, state), text = run(*case)
  for (path, a), sharding in zip(jax.tree_util.tree_leaves_with_path((params, state)), jax.tree.leaves(before)):
    where = f"{case} {jax.tree_util.keystr(path)}"
    assert a.sharding.memory_kind == sharding.memory_kind, (where, a.sharding, sharding)
    assert a.sharding.is_equivalent_to(sharding, a.ndim), (where, a.sharding, sharding)
    shard_bytes = int(np.prod(sharding.shard_shape(a.shape))) * a.dtype.itemsize
    assert all(s.data.nbytes == shard_bytes for s in a.addressable_shards), (where, shard_bytes, a.nbytes)
  gathers = [op for op in GATHERS if op + "(" in text or op + "-start(" in text]
  assert not gathers, (case, gathers)
  _, (params_1, state_1), _ = run(*case, one_device=True)
  compare(case, (params, state), (params_1, state_1))


def compare(case, got, want):
  """The 8-device step's results against one device's: the same bits, but for kernels whose shard rounds otherwise.

  The XLA rule, partitioned by XLA, gives the same bits. The C++ kernel's
  8-bit codes may differ by one at a near tie (its vector and scalar loops
  cover other elements in a shard than in the whole leaf), and the float32
  params of its update path by an ulp (XLA fuses the ``p + u`` that follows
  it otherwise on a shard, and the tests compile without FMA); the Pallas kernel
  (interpret mode here) rounds some float32 values of a shard an ulp
  otherwise than the whole leaf's: float32 within 1e-5, and a bf16 param or a
  code one unit off at a near tie (a Kahan term is compared added to its
  param: the tie moves a unit between them).
  """
  kernel, kahan = case[3], case[2] == "kahan"
  combined = set()  # a param with its Kahan term added: float32, to the term's own bf16 precision
  values = lambda tree: {jax.tree_util.keystr(k): np.asarray(jax.device_get(v))
                         for k, v in jax.tree_util.tree_leaves_with_path(tree)}
  got, want = values(got), values(want)
  if kahan and kernel == "pallas":
    for tree in (got, want):
      for k in [k for k in tree if ".master" in k]:
        param = k.replace("[1].master", "[0]")
        tree[param] = tree[param].astype(np.float32) + tree.pop(k).astype(np.float32)
        combined.add(param)
  for k, a in got.items():
    b, where = want[k], f"{case} {k}"
    if kernel == "xla" or (kernel == "native" and a.dtype not in (np.uint8, np.float32)):
      np.testing.assert_array_equal(a, b, err_msg=where)
    elif a.dtype == np.float32:  # the native update, then XLA's p + u: fused otherwise on a shard
      rtol = 1e-4 if k in combined else 1e-5 if kernel == "pallas" else 1e-6
      np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-8, err_msg=where)
    else:  # bf16 params, or uint8 codes: one unit at a few near ties
      unit = 1.0 if a.dtype == np.uint8 else 0.0
      a, b = a.astype(np.float32), b.astype(np.float32)
      off = ~np.isclose(a, b, rtol=2.0**-7, atol=unit)
      assert np.count_nonzero(off) <= 1e-4 * a.size, (where, np.count_nonzero(off))


def gpu_check(case):
  """``case`` compiled for one DGX H200 node (8 GPUs, deviceless) from abstract inputs.

  The compiled results' shardings are the arguments' (every param and state
  leaf), nothing is gathered, and each GPU's bytes are its shards': host
  arguments exactly the host-resident shards, device arguments at most the
  device-resident shards, device temporaries at most 8 bytes per value of
  the GPU's shards (float32 values of a few fields at once), where a
  replicated state would take 8 times as much.
  """
  from optax_hybrid import gpu_compile

  tier, fmt, master, kernel, path = case
  dtype = jnp.float32 if master is None else jnp.bfloat16
  tx = hybrid_adamw(tier, fmt, master, kernel)
  abstract = {k: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(MESH, spec))
              for k, (shape, spec) in LEAVES.items()}
  state = tx.init(abstract)

  def update_then_apply(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s

  report = gpu_compile.compile_for_gpu(tx.step if path == "step" else update_then_apply, abstract, state, abstract,
                                       target="h200", num_devices=8, donate_argnums=(0, 1))
  inputs = jax.tree.leaves((abstract, state))
  assert len(report.output_shardings) == len(inputs) and report.kept_shardings(inputs), (
      case, report.output_shardings, [str(_compat.hlo_sharding_of(x)) for x in inputs])
  gathers = [op for op in GATHERS if op + "(" in report.hlo or op + "-start(" in report.hlo]
  assert not gathers and not report.warnings, (case, gathers, report.warnings)
  shard_bytes = lambda x: int(np.prod(x.sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize
  on_host = sum(shard_bytes(x) for x in inputs if x.sharding.memory_kind == "pinned_host")
  on_device = sum(shard_bytes(x) for x in jax.tree.leaves((abstract, state, abstract))
                  if x.sharding.memory_kind != "pinned_host")
  values = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(abstract))
  figures = dict(host_args=report.host_argument_bytes, host_shards=on_host, device_args=report.device_argument_bytes,
                 device_shards=on_device, device_temp=report.device_temp_bytes, values=values)
  assert report.host_argument_bytes == on_host, (case, figures)
  assert report.device_argument_bytes <= on_device + 1024, (case, figures)
  assert report.device_temp_bytes <= 8 * values + 2**20, (case, figures)
  return figures


def ci_cases():
  """Each value of every dimension at least once, the 8-bit format with every tier, master and kernel."""
  return [("device", "8bit", "float32", "xla", "step"), ("host_state", "8bit", "stochastic", "xla", "step"),
          ("host", "8bit", "kahan", "xla", "update"), ("offload_fraction", "8bit", None, "xla", "step"),
          ("device", "8bit", "kahan", "pallas", "step"), ("host_state", "float32", "float32", "native", "update"),
          ("device", "8bit", None, "native", "update"), ("host", "float32", "stochastic", "xla", "step"),
          ("host_state sliced", "8bit", "stochastic", "pallas", "step"),
          ("host_state sliced", "float32", "float32", "native", "update")]


def all_cases():
  kernels = [k for k in KERNELS if k != "native" or native_cpu.available()]
  return list(itertools.product([*TIERS, "host_state sliced"], FORMATS, MASTERS, kernels, PATHS))


def gpu_cases():
  """The 8-bit format in every tier that runs on a node, with the kernels a GPU runs (Pallas, the XLA rule)."""
  return [("host_state", "8bit", "stochastic", "xla", "step"), ("device", "8bit", "float32", "pallas", "step"),
          ("host_state sliced", "8bit", "stochastic", "pallas", "step"),
          ("host", "8bit", "kahan", "xla", "update"), ("offload_fraction", "8bit", None, "auto", "step")]


if __name__ == "__main__" and "--gpu" in sys.argv:
  for case in gpu_cases():
    print("ok", case, gpu_check(case), flush=True)
  print("GPU SHARDING OK")
elif __name__ == "__main__":
  cases = all_cases() if "--all" in sys.argv else ci_cases()
  failed = []
  for case in cases:
    try:
      check(case)
      print("ok", case, flush=True)
    except AssertionError as e:
      failed.append(case)
      print("FAILED", case, str(e)[:2000], flush=True)
  print(f"{len(cases) - len(failed)} of {len(cases)} cases keep every leaf's sharding")
  if not failed:
    print("SHARDING OK")
