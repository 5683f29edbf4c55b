"""Mutation testing: small AST mutations of the rule, the schedule and the tiers, each run against its tests.

    python benchmarks/mutation.py                    # every target, every mutant
    python benchmarks/mutation.py --list             # the mutants, without running anything
    python benchmarks/mutation.py --target schedules --limit 5

Each mutant changes one operator or constant of one module (``+`` to ``-``,
``<`` to ``<=``, ``and`` to ``or``, ``True`` to ``False``, ``0`` to ``1``, a
dropped ``not``, ...), is written into a scratch copy of the repository, and
the module's targeted tests run against it (``pytest -x``, Hypothesis without
shrinking). A mutant is *killed* when a test fails (or the run times out),
*survives* otherwise. Docstrings, error messages and other strings are not
mutated. Single process, on purpose: CPU time is scarce where this runs (so
``-n 0``: no pytest-xdist workers, which pyproject.toml asks for by default).

The report lists the survivors with their line, so each can be killed by a
new test or explained. Not part of CI: a full run takes about 30 minutes on a
2-core CPU. Results are recorded in docs/testing.md.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Module -> the fast tests that should kill its mutants, fastest first (-x stops at
# the first failure). Entries with "*" are globs over collected node IDs.
TARGETS = {
    "schedules": ("optax_hybrid/schedules.py", ["tests/test_schedules.py"]),  # all of it: 5 s
    "reference": ("optax_hybrid/kernels/reference.py", [
        "tests/test_kernels.py::test_leaf_update_against_float64",
        "tests/test_properties.py::test_two_steps_equal_the_float64_model",
        "tests/test_kernels.py::test_negative_learning_rate_gives_the_raw_direction",
        "tests/test_transform.py::test_matches_float64_reference",
        "tests/test_transform.py::test_nonfinite_steps_are_skipped_in_every_tier",
        "tests/test_transform.py::test_step_equals_update_then_apply",
        "tests/test_transform.py::test_complex_params_match_optax_adamw",
        "tests/test_kernels.py::test_one_custom_call_for_many_leaves_and_fallback_for_the_rest",
    ]),
    # Each rule's own arithmetic (the engine around it is "reference").
    "adamw": ("optax_hybrid/rules/adamw.py", [
        "tests/test_kernels.py::test_leaf_update_against_float64",
        "tests/test_transform.py::test_matches_float64_reference",
        "tests/test_transform.py::test_same_calls_give_the_same_numbers_as_optax_adamw",
        "tests/test_errors.py",
    ]),
    **{rule: (f"optax_hybrid/rules/{module}.py", [
        f"tests/test_rules.py::test_matches_its_optax_counterpart_over_50_steps_in_every_tier[{rule}-device]",
        f"tests/test_rules.py::test_8bit_state_follows_the_float64_model[{rule}-device]",
        "tests/test_rules.py::test_each_signature_is_its_optax_counterparts_then_keyword_only_options",
    ]) for rule, module in (("lion", "lion"), ("adagrad", "adagrad"), ("sgd_nesterov", "sgd"))},
    "tiers": ("optax_hybrid/tiers.py", [
        "tests/test_memory_kinds.py::*-xla-f32-step]",
        "tests/test_memory_kinds.py::test_params_in_host_memory_are_on_the_host_tier_whatever_the_state_kind[*-xla-*]",
        "tests/test_memory_kinds.py::test_a_state_without_a_plan_runs_device_leaves_on_the_device",
        "tests/test_tiers.py::test_pick_by_fraction_takes_leaves_in_order_to_the_nearest_boundary",
        "tests/test_tiers.py::test_pick_by_fraction_takes_a_leaf_exactly_half_inside_and_never_an_empty_one",
        "tests/test_tiers.py::test_fractions_zero_and_one_are_valid_and_mean_none_and_all",
        "tests/test_tiers.py::test_master_needed_only_for_lower_precision_floats_and_only_with_a_master_dtype",
        "tests/test_tiers.py::test_the_plan_is_immutable_hashable_static_data",
        "tests/test_tiers.py::test_tier_specs_string_callable_and_prefix",
        "tests/test_tiers.py::test_bad_tier_arguments_are_named",
        "tests/test_tiers.py::test_master_weights_only_for_lower_precision_leaves_and_need_params_for_update",
        "tests/test_memory_kinds.py::*-xla-bf16_fp32_master-update_apply]",
        "tests/test_tiers.py::test_offload_fraction_chooses_leaves_by_size_and_keeps_the_result",
        "tests/test_disk.py::test_nvme_offload_fraction_picks_leaves_by_size",
        "tests/test_disk.py::test_bad_directories_are_refused_before_any_step",
    ]),
}
# Functions left unmutated, with why (reported with the score): their tests are
# too slow to run once per mutant.
NOT_MUTATED = {
    "tiers": {
        "zero1_sharding": "ZeRO-1 needs several devices: tests/test_multidevice.py runs an 8-device script",
        "device_sharding_of": "multi-device placements only: tests/test_multidevice.py",
    },
}

BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.Pow: ast.Mult,
               ast.FloorDiv: ast.Div, ast.Mod: ast.FloorDiv}
CMP_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
             ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}


@dataclasses.dataclass
class Mutant:
  target: str
  index: int
  line: int
  description: str
  source: str = dataclasses.field(repr=False, default="")


def _skip_nodes(tree: ast.AST, functions: set[str] = frozenset()) -> set[int]:
  """ids of nodes not to mutate: docstrings, raise statements, type annotations, __all__, ``functions``."""
  skip = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.FunctionDef) and node.name in functions:
      skip.update(id(n) for n in ast.walk(node))
    body = getattr(node, "body", None)
    if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
      skip.update(id(n) for n in ast.walk(body[0]))
    if isinstance(node, ast.Raise):
      skip.update(id(n) for n in ast.walk(node))
    for ann in ("annotation", "returns"):
      if getattr(node, ann, None) is not None:
        skip.update(id(n) for n in ast.walk(getattr(node, ann)))
    if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
      skip.update(id(n) for n in ast.walk(node))
  return skip


def _mutation_sites(tree: ast.AST, functions: set[str] = frozenset()):
  """Yields (node, description, apply) for every mutation of ``tree`` outside ``functions``."""
  skip = _skip_nodes(tree, functions)
  for node in ast.walk(tree):
    if id(node) in skip:
      continue
    if isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
      new = BINOP_SWAPS[type(node.op)]
      yield node, f"{type(node.op).__name__} -> {new.__name__}", lambda n, new=new: setattr(n, "op", new())
    elif isinstance(node, ast.AugAssign) and type(node.op) in BINOP_SWAPS:
      new = BINOP_SWAPS[type(node.op)]
      yield node, f"{type(node.op).__name__}= -> {new.__name__}=", lambda n, new=new: setattr(n, "op", new())
    elif isinstance(node, ast.Compare):
      for i, op in enumerate(node.ops):
        if type(op) in CMP_SWAPS:
          new = CMP_SWAPS[type(op)]
          yield node, f"{type(op).__name__} -> {new.__name__}", \
              lambda n, i=i, new=new: n.ops.__setitem__(i, new())
    elif isinstance(node, ast.BoolOp):
      new = ast.Or if isinstance(node.op, ast.And) else ast.And
      yield node, f"{type(node.op).__name__} -> {new.__name__}", lambda n, new=new: setattr(n, "op", new())
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
      yield node, f"drop {type(node.op).__name__}", "unwrap"
    elif isinstance(node, ast.Constant) and not isinstance(node.value, str) and node.value is not None \
        and node.value is not Ellipsis:
      if isinstance(node.value, bool):
        yield node, f"{node.value} -> {not node.value}", lambda n: setattr(n, "value", not n.value)
      elif isinstance(node.value, (int, float)):
        new_value = node.value + 1
        yield node, f"{node.value!r} -> {new_value!r}", lambda n, v=new_value: setattr(n, "value", v)
    elif isinstance(node, ast.IfExp):
      yield node, "swap the branches of a conditional expression", \
          lambda n: (lambda b, o: (setattr(n, "body", o), setattr(n, "orelse", b)))(n.body, n.orelse)


def mutants_of(target: str) -> list[Mutant]:
  path, _ = TARGETS[target]
  with open(os.path.join(REPO, path)) as f:
    original = f.read()
  tree = ast.parse(original)
  excluded = set(NOT_MUTATED.get(target, {}))
  sites = list(_mutation_sites(tree, excluded))
  out = []
  for index in range(len(sites)):
    fresh = ast.parse(original)
    node, description, apply = list(_mutation_sites(fresh, excluded))[index]
    line = node.lineno
    if apply == "unwrap":
      operand = node.operand
      for parent in ast.walk(fresh):
        for field, value in ast.iter_fields(parent):
          if value is node:
            setattr(parent, field, operand)
          elif isinstance(value, list):
            for i, item in enumerate(value):
              if item is node:
                value[i] = operand
    else:
      apply(node)
    source = ast.unparse(fresh)
    src_line = original.splitlines()[line - 1].strip()
    out.append(Mutant(target, index, line, f"{description}: {src_line[:90]}", source))
  return out


def expand_tests(tests: list[str], work: str) -> list[str]:
  """pytest arguments for ``tests``: globs are matched against the collected node IDs of their file."""
  out = []
  for t in tests:
    if "*" not in t:
      out.append(t)
      continue
    path = t.split("::", 1)[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=work)
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path],
                            cwd=work, env=env, capture_output=True, text=True, check=True).stdout.splitlines()
    # "*" is the only wildcard: brackets in parametrized IDs are literal.
    pattern = re.compile(".*".join(re.escape(part) for part in t.split("*")) + r"\Z")
    matched = [n for n in listed if pattern.match(n)]
    if not matched:
      raise SystemExit(f"{t!r} matches no test: update TARGETS")
    out.extend(matched)
  return out


def run_mutant(mutant: Mutant, work: str, tests: list[str], timeout: float) -> tuple[str, float, str]:
  """Writes the mutant into ``work``, runs ``tests``; returns (killed/survived/timeout, seconds, the first failure)."""
  path, _ = TARGETS[mutant.target]
  dest = os.path.join(work, path)
  with open(os.path.join(REPO, path)) as f:
    original = f.read()
  with open(dest, "w") as f:
    f.write(mutant.source)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=work, PYTHONDONTWRITEBYTECODE="1")
  cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-n", "0", "-p", "no:cacheprovider", "--hypothesis-profile=mutation",
         *tests]
  start = time.monotonic()
  try:
    result = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    status = "survived" if result.returncode == 0 else "killed"
    first = next((l for l in result.stdout.splitlines() if l.startswith(("FAILED", "ERROR"))), "")
  except subprocess.TimeoutExpired:
    status, first = "timeout", ""
  finally:
    with open(dest, "w") as f:
      f.write(original)
  return status, time.monotonic() - start, first


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="module(s) to mutate (default: all)")
  parser.add_argument("--limit", type=int, default=None, help="at most this many mutants per module")
  parser.add_argument("--timeout", type=float, default=180.0, help="seconds per mutant (a timeout counts as killed)")
  parser.add_argument("--list", action="store_true", help="list the mutants and exit")
  parser.add_argument("--mutant", action="append", default=None, metavar="TARGET:INDEX",
                      help="run only these mutants (as --list numbers them), e.g. schedules:0")
  parser.add_argument("--json", default=None, help="write the results here")
  args = parser.parse_args()
  targets = args.target or list(TARGETS)
  mutants = [m for t in targets for m in mutants_of(t)[:args.limit]]
  if args.mutant:
    wanted = {(t, int(i)) for t, i in (x.split(":") for x in args.mutant)}
    mutants = [m for m in mutants if (m.target, m.index) in wanted]
    targets = [t for t in targets if any(m.target == t for m in mutants)]
  if args.list:
    for m in mutants:
      print(f"{m.target}:{m.line} #{m.index} {m.description}")
    print(f"{len(mutants)} mutants")
    return
  work = tempfile.mkdtemp(prefix="optax_hybrid_mutation_")
  shutil.copytree(REPO, work, dirs_exist_ok=True,
                  ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs", "*.egg-info"))
  for root, dirs, _ in os.walk(work):  # stale bytecode could stand in for a same-size mutant
    for d in [d for d in dirs if d == "__pycache__"]:
      shutil.rmtree(os.path.join(root, d))
  print(f"{len(mutants)} mutants of {', '.join(targets)}; scratch copy {work}", flush=True)
  start = time.monotonic()
  tests = {t: expand_tests(TARGETS[t][1], work) for t in targets}
  results = []
  for i, m in enumerate(mutants):
    status, seconds, why = run_mutant(m, work, tests[m.target], args.timeout)
    results.append({**dataclasses.asdict(m), "status": status, "seconds": round(seconds, 1), "failed": why})
    del results[-1]["source"]
    print(f"[{i + 1}/{len(mutants)}] {status:8s} {seconds:5.1f}s {m.target}:{m.line} {m.description}", flush=True)
  shutil.rmtree(work, ignore_errors=True)
  wall = time.monotonic() - start
  killed = sum(r["status"] != "survived" for r in results)
  print(f"\nmutation score: {killed}/{len(results)} killed ({100 * killed / max(1, len(results)):.1f}%), "
        f"{wall / 60:.1f} min, {datetime.date.today()}")
  for t in targets:
    rs = [r for r in results if r["target"] == t]
    k = sum(r["status"] != "survived" for r in rs)
    print(f"  {t}: {k}/{len(rs)}")
  for t in targets:
    for function, why in NOT_MUTATED.get(t, {}).items():
      print(f"  not mutated: {TARGETS[t][0]} {function}: {why}")
  survivors = [r for r in results if r["status"] == "survived"]
  if survivors:
    print("\nsurvivors:")
    for r in survivors:
      print(f"  {TARGETS[r['target']][0]}:{r['line']} {r['description']}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"date": str(datetime.date.today()), "wall_s": round(wall), "results": results}, f, indent=1)


if __name__ == "__main__":
  main()
