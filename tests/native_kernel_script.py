"""Run in a fresh process by the tests: the native kernel against the reference rule, in whichever build it imports.

    OPTAX_HYBRID_NATIVE_ISA=baseline python tests/native_kernel_script.py --expect-isa baseline

Every dtype combination of tests/test_kernels.py (its COMBOS and SIZES, one
custom call for all of them), under each of the four rules (AdamW or L2 decay;
update or new params), and one skipped step. The instruction set is chosen
when the library loads, so a forced one needs a process of its own
(test_kernels.py); test_wheel.py runs this with the Python of a virtual
environment that has only the built wheel. Prints one JSON line: where
optax_hybrid and its kernel came from and which instruction set ran. Exits
non-zero on any mismatch.
"""

import argparse
import json
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import optax_hybrid  # noqa: E402
from optax_hybrid.kernels import native_cpu, reference  # noqa: E402
from stepping import adam_scalars, call_kernel, isas_this_cpu_runs, random_leaves  # noqa: E402
from test_kernels import COMBOS, SIZES, ulps  # noqa: E402


def leaves_of_every_combination():
  g, m, v, p = [], [], [], []
  for seed, (pdtype, mdtype) in enumerate(COMBOS):
    for into, new in zip((g, m, v, p), random_leaves(SIZES, pdtype, mdtype, seed=seed)):
      into += new
  return g, m, v, p


def compare(adamw_mode, write_params, step_ok=None):
  g, m, v, p = leaves_of_every_combination()
  decays = [i % 2 == 0 for i in range(len(g))]
  out_dtypes = [b.dtype for b in p] if write_params else [jnp.result_type(a.dtype, b.dtype) for a, b in zip(g, m)]
  ok = None if step_ok is None else jnp.asarray(step_ok)
  s = adam_scalars(jnp.int32(4), 3e-2, 0.9, 0.99, 1e-6, 0.1, True, ok)
  run = lambda kernel, g, m, v, p: call_kernel(kernel, g, m, v, p, decays, out_dtypes, s, adamw_mode=adamw_mode,
                                               write_params=write_params)
  native = jax.jit(lambda *leaves: run(native_cpu.update_leaves, *leaves))(g, m, v, p)
  # The reference op by op: its small executables are compiled once for all five calls
  # (jitted, each call's 30 leaves would be compiled anew: seconds each).
  want = run(reference.update_leaves, g, m, v, p)
  for got, expected in zip(jax.tree.leaves(native), jax.tree.leaves(want)):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, expected.dtype)
    # Same float32 arithmetic; at most one rounding step apart in the stored dtype.
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expected, np.float64),
                               rtol=ulps(got.dtype), atol=1e-7)
  return len(g)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--expect-isa", help="fail unless the kernel runs this instruction set")
  args = parser.parse_args()
  assert native_cpu.available(), native_cpu.why_unavailable()
  assert args.expect_isa in (None, native_cpu.isa()), (args.expect_isa, native_cpu.isa())
  leaves = 0
  for adamw_mode in (True, False):
    for write_params in (False, True):
      leaves += compare(adamw_mode, write_params)
  leaves += compare(True, True, step_ok=False)
  print(json.dumps({"optax_hybrid": optax_hybrid.__file__, "native_cpu": native_cpu.__file__,
                    "isa": native_cpu.isa(), "isas_this_cpu_runs": isas_this_cpu_runs(),
                    "leaves_compared": leaves}))


if __name__ == "__main__":
  main()
