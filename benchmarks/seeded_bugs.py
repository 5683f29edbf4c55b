"""Seeded bugs: plant each known-bad change in a scratch copy and list the tests that fail.

    python benchmarks/seeded_bugs.py                 # every bug
    python benchmarks/seeded_bugs.py --bug decay_lr_twice

The repository itself is never modified: each bug is applied to a fresh copy
(in a temporary directory) by an exact text replacement, which must match, so
a refactoring that moves the code makes this script fail loudly instead of
testing nothing. The native kernel is rebuilt in the copy when a bug changes
it. Each bug runs the tests listed with it as CI runs the suite (pyproject's
options: two pytest-xdist workers, each running whole files) and prints the
failing tests.
The table it prints is recorded in docs/records/testing.md.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE = "optax_hybrid/kernels/reference.py"  # the engine around every rule: decay, storage, skip
ADAM = "optax_hybrid/rules/adamw.py"  # Adam's own update
RULE_TESTS = ["tests/test_char_gpt.py", "tests/test_properties.py", "tests/test_kernels.py::test_leaf_update_against_float64"]
TIER_TESTS = ["tests/test_memory_kinds.py", "-k", "xla", "tests/test_tiers.py"]
OTHER_RULE_TESTS = ["tests/test_rules.py"]

# name: (description, file, [(old, new), ...], pytest arguments)
BUGS = {
    "b1_b2_swapped": (
        "b1 and b2 swapped in the reference rule", ADAM,
        [("m = s.b1 * mu + (1.0 - s.b1) * grad", "m = s.b2 * mu + (1.0 - s.b2) * grad"),
         ("v = s.b2 * nu + (1.0 - s.b2) * g_sq", "v = s.b1 * nu + (1.0 - s.b1) * g_sq")],
        RULE_TESTS),
    "no_v_bias_correction": (
        "no bias correction of the second moment", ADAM,
        [("denom = jnp.sqrt(v) / s.bias_correction2_sqrt + s.eps", "denom = jnp.sqrt(v) + s.eps")],
        RULE_TESTS),
    "decay_lr_twice": (
        "weight decay scaled by lr twice", REFERENCE,
        [("update = update - (s.learning_rate * s.weight_decay) * p",
          "update = update - (s.learning_rate * s.learning_rate * s.weight_decay) * p")],
        RULE_TESTS),
    "decay_on_p_plus_adam": (
        "decay applied to p + adam step", REFERENCE,
        [("update = update - (s.learning_rate * s.weight_decay) * p",
          "update = update - (s.learning_rate * s.weight_decay) * (p + update)")],
        RULE_TESTS),
    "lion_sign_with_b2": (
        "Lion's sign taken of the b2 blend (the momentum's update) instead of the b1 one", "optax_hybrid/rules/lion.py",
        [("direction = jnp.sign((1.0 - s.b1) * grad + s.b1 * mu)", "direction = jnp.sign((1.0 - s.b2) * grad + s.b2 * mu)")],
        OTHER_RULE_TESTS),
    "adagrad_sum_of_magnitudes": (
        "Adagrad summing |g| instead of g^2", "optax_hybrid/rules/adagrad.py",
        [("else grad * grad) + sum_of_squares", "else jnp.abs(grad)) + sum_of_squares")],
        OTHER_RULE_TESTS),
    "sgd_nesterov_ignored": (
        "SGD's Nesterov look-ahead dropped", "optax_hybrid/rules/sgd.py",
        [("(grad + s.momentum * trace if self.nesterov else trace)", "trace")],
        OTHER_RULE_TESTS),
    "warmup_from_k_over_w": (
        "warmup starting at k/W", "optax_hybrid/schedules.py",
        [("value = (k + 1.0) / warmup_steps * peak_value", "value = k / warmup_steps * peak_value"),
         ("warmup = (k + 1.0) * (peak_value / warmup_steps)", "warmup = k * (peak_value / warmup_steps)")],
        ["tests/test_schedules.py"]),
    "eps_inside_sqrt_native": (
        "eps inside the square root in the C++ kernel", "optax_hybrid/kernels/native_cpu.cc",
        [("const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;", "const float denom = std::sqrt(v + c.eps) / c.bc2_sqrt;")],
        ["tests/test_kernels.py"]),
    "offload_fraction_moments_on_device": (
        "offload_fraction leaves on the host tier with their moments in device memory", "optax_hybrid/tiers.py",
        [("names[i], kinds[i] = tier, STATE_KIND[tier]",
          "names[i], kinds[i] = tier, (STATE_KIND[tier] if tier == DISK_TIER else kinds[i])")],
        TIER_TESTS),
    "host_state_moments_on_device": (
        "host_state moments in device memory", "optax_hybrid/tiers.py",
        [("HOST_STATE_TIER: placement.HOST_KIND,", "HOST_STATE_TIER: placement.DEVICE_KIND,")],
        TIER_TESTS),
}


def build_native(work: str) -> None:
  """Compiles the copy's native kernel in place, as setup.py does."""
  import jax.ffi
  ext = sysconfig.get_config_var("EXT_SUFFIX")
  out = os.path.join(work, "optax_hybrid", "kernels", f"_native_cpu{ext}")
  cmd = ["g++", "-O3", "-std=c++17", "-fno-math-errno", "-w", "-shared", "-fPIC",
         f"-I{jax.ffi.include_dir()}", f"-I{sysconfig.get_paths()['include']}",
         os.path.join(work, "optax_hybrid", "kernels", "native_cpu.cc"), "-o", out]
  subprocess.run(cmd, check=True)


def run_bug(name: str) -> tuple[list[str], float]:
  description, path, replacements, tests = BUGS[name]
  work = tempfile.mkdtemp(prefix=f"optax_hybrid_seeded_{name}_")
  try:
    shutil.copytree(REPO, work, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs", "*.egg-info"))
    target = os.path.join(work, path)
    with open(target) as f:
      text = f.read()
    for old, new in replacements:
      if text.count(old) != 1:
        raise SystemExit(f"{name}: {old!r} is not in {path} exactly once; update this script")
      text = text.replace(old, new)
    with open(target, "w") as f:
      f.write(text)
    if path.endswith(".cc"):
      build_native(work)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=work, PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--hypothesis-profile=mutation", *tests], cwd=work, env=env, capture_output=True, text=True)
    failed = sorted({re.sub(r" - .*", "", l.split(" ", 1)[1]) for l in result.stdout.splitlines()
                     if l.startswith(("FAILED ", "ERROR "))})
    return failed, time.monotonic() - start
  finally:
    shutil.rmtree(work, ignore_errors=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--bug", action="append", choices=sorted(BUGS))
  args = parser.parse_args()
  rows = []
  for name in args.bug or list(BUGS):
    failed, seconds = run_bug(name)
    rows.append((name, failed))
    print(f"{name} ({BUGS[name][0]}): {len(failed)} failed in {seconds:.0f} s", flush=True)
    for t in failed:
      print(f"    {t}", flush=True)
  missed = [name for name, failed in rows if not failed]
  print(f"\n{len(rows) - len(missed)}/{len(rows)} seeded bugs caught" + (f"; missed: {', '.join(missed)}" if missed else ""))
  sys.exit(1 if missed else 0)


if __name__ == "__main__":
  main()
