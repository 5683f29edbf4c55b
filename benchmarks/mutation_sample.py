"""A fixed-seed random sample of mutmut's mutants, N per module, run and scored per module.

A whole run of mutmut over ``optax_hybrid/`` is about 9,200 mutants, some 12
hours with one worker on a 2-core machine; a sample of a few mutants per
module, drawn with a fixed seed, gives each module a score in minutes to an
hour and names its survivors (docs/records/testing.md, "Mutation testing (mutmut)").
The draw depends only on the seed, the module and its mutants' names (not on
which other modules are asked for), so a module's sample is the same whether
it is run alone or with others, and reruns report the same mutants.

Run from the repository root, with the ``dev`` extra (mutmut) installed::

  python benchmarks/mutation_sample.py --per-module 8 --seed 0 \
      --modules optax_hybrid.paths optax_hybrid.disk      # sample, run, table
  python benchmarks/mutation_sample.py --per-module 8 --seed 0 --table-only   # the table of what ran
  python benchmarks/mutation_sample.py --per-module 8 --seed 0 --list        # the sampled names

It runs ``mutmut run --max-children 1 NAME...`` on the sample (one worker:
the machine's other core stays free), then prints, per module, how many
mutants it has, how many were sampled, and the sample's killed, survived,
timeout and "no tests" counts, from mutmut's own results (``mutants/*.meta``
read through ``mutmut.mutation.data.SourceFileMutationData``, the class
``mutmut results`` reads them with). ``mutmut show NAME`` gives a survivor's
diff.
"""

import argparse
import collections
import os
import random
import shutil
import subprocess
import sys
import time

from mutmut.mutation.data import SourceFileMutationData
from mutmut.stats import status_by_exit_code
from mutmut.utils.file_utils import walk_mutatable_files

COLUMNS = ("killed", "survived", "timeout", "no tests", "not checked")


def module_of(path):
  """``optax_hybrid/kernels/reference.py`` -> ``optax_hybrid.kernels.reference``."""
  module = os.path.splitext(str(path))[0].replace(os.sep, ".")
  return module[:-len(".__init__")] if module.endswith(".__init__") else module


def mutants_by_module():
  """Every module's mutants: ``{module: {name: exit code or None}}``, from mutmut's meta files."""
  found = {}
  for path in walk_mutatable_files():
    data = SourceFileMutationData(path=path)
    data.load()
    if data.exit_code_by_key:
      found[module_of(path)] = dict(data.exit_code_by_key)
  return found


def generate_mutants():
  """Writes mutants/ as ``mutmut run`` does before it runs anything (mutmut has no command for this step)."""
  from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants, setup_source_paths
  os.makedirs("mutants", exist_ok=True)
  copy_src_dir()
  copy_also_copy_files()
  setup_source_paths()
  create_mutants(1)


def draw(names, per_module, seed, module):
  """``per_module`` of a module's mutant names, drawn with a generator seeded by the seed and the module."""
  names = sorted(names)
  return sorted(random.Random(f"{seed}:{module}").sample(names, min(per_module, len(names))))


def table(sample, results):
  """Lines of a Markdown table: per module, its mutants, the sample's size and its outcomes."""
  lines = ["| module | mutants | sampled | " + " | ".join(COLUMNS) + " | survivors |",
           "|---|---:|---:|" + "---:|" * len(COLUMNS) + "---|"]
  totals = collections.Counter()
  for module, names in sample.items():
    counts = collections.Counter(status_by_exit_code[results[module][n]] for n in names)
    totals.update(counts)
    totals["mutants"] += len(results[module])
    totals["sampled"] += len(names)
    survivors = ", ".join(n.rsplit(".", 1)[-1] for n in names if status_by_exit_code[results[module][n]] == "survived")
    lines.append(f"| {module} | {len(results[module])} | {len(names)} | "
                 + " | ".join(str(counts[c]) for c in COLUMNS) + f" | {survivors} |")
  lines.append(f"| all | {totals['mutants']} | {totals['sampled']} | "
               + " | ".join(str(totals[c]) for c in COLUMNS) + " | |")
  return lines


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--per-module", type=int, default=8, help="mutants drawn per module (all if it has fewer)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--modules", nargs="*", help="dotted module names (default: every module of optax_hybrid/)")
  parser.add_argument("--list", action="store_true", help="print the sampled names and stop")
  parser.add_argument("--table-only", action="store_true", help="print the table of the results so far, run nothing")
  args = parser.parse_args(argv)

  results = mutants_by_module()
  if not results:
    generate_mutants()
    results = mutants_by_module()
  unknown = sorted(set(args.modules or ()) - set(results))
  if unknown:
    parser.error(f"--modules: no mutants for {unknown}; modules with mutants: {sorted(results)}")
  modules = args.modules or sorted(results)
  sample = {m: draw(results[m], args.per_module, args.seed, m) for m in modules}
  names = [n for m in modules for n in sample[m]]
  if args.list:
    print("\n".join(names))
    return
  if not args.table_only:
    # mutmut's own script beside this Python (`python -m mutmut` re-imports its __main__, which it warns against)
    mutmut = shutil.which("mutmut", path=os.path.dirname(sys.executable)) or "mutmut"
    command = [mutmut, "run", "--max-children", "1", *names]
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: mutmut run --max-children 1 with {len(names)} mutants "
          f"of {len(modules)} modules (seed {args.seed}, {args.per_module} per module)", flush=True)
    start = time.monotonic()
    returncode = subprocess.run(command).returncode
    print(f"mutmut exited with {returncode} after {(time.monotonic() - start) / 60:.1f} min", flush=True)
    results = mutants_by_module()
  print(f"\nseed {args.seed}, {args.per_module} mutants per module:")
  print("\n".join(table(sample, results)))


if __name__ == "__main__":
  sys.exit(main())
