"""Run in a fresh process by test_native_8bit.py: one native step on 8-bit moments, saved for comparison.

    OPTAX_HYBRID_NATIVE_ISA=avx512 python tests/native_8bit_script.py OUT.npz --expect-isa avx512

The leaves of test_native_8bit.py (its SHAPES, a tenth of the blocks all
zero), each storage dtype, updates and new params: every result array goes
into OUT.npz under the names that native_8bit_results gives them. The
instruction set is chosen when the library loads, so a forced one needs a
process of its own.
"""

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from optax_hybrid.kernels import native_cpu  # noqa: E402
from test_native_8bit import native_8bit_results  # noqa: E402


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("out", help="the .npz file to write")
  parser.add_argument("--expect-isa", help="fail unless the kernel runs this instruction set")
  args = parser.parse_args()
  assert native_cpu.available(), native_cpu.why_unavailable()
  assert args.expect_isa in (None, native_cpu.isa()), (args.expect_isa, native_cpu.isa())
  np.savez(args.out, **native_8bit_results())


if __name__ == "__main__":
  main()
