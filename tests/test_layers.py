"""The package's layers: no import runs back up (docs/architecture.md).

Each module of ``optax_hybrid`` (a subpackage counted as one, ``rules`` or
``kernels``) is a node and each of its imports of another an edge, function-level
imports included; the graph must have no cycle. The rule contract
(``optax_hybrid.base``) sits below the engine and the rules (``optax_hybrid.rules``)
above it: before it moved out of ``rules/__init__.py``, ``transform``,
``kernels/reference.py`` and ``kernels/native_cpu.py`` imported ``rules`` while
``rules/adamw.py`` imported ``transform``.
"""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "optax_hybrid")
# The GPU-compile tooling reads its step time with a function-level import each way (issue 34 moves the
# tooling into a group of its own); no module of the engine imports either.
TOOLING = {"gpu_compile", "step_time"}


def node(module: str) -> str:
  """The layer a dotted module name belongs to: the module, or its subpackage under optax_hybrid."""
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "__init__"


def imports() -> dict:
  """node -> {imported node: 'file:line' of one import}, the package's __init__ (which re-exports) left out."""
  edges = {}
  for dirpath, _, files in os.walk(PACKAGE):
    for name in (f for f in files if f.endswith(".py")):
      path = os.path.join(dirpath, name)
      module = os.path.relpath(path[:-3], os.path.dirname(PACKAGE)).replace(os.sep, ".").removesuffix(".__init__")
      source = node(module)
      for statement in ast.walk(ast.parse(open(path).read())):
        if isinstance(statement, ast.ImportFrom) and statement.module == "optax_hybrid":
          targets = [f"optax_hybrid.{a.name}" for a in statement.names]
        elif isinstance(statement, ast.ImportFrom) and (statement.module or "").startswith("optax_hybrid."):
          targets = [statement.module]
        elif isinstance(statement, ast.Import):
          targets = [a.name for a in statement.names if a.name.startswith("optax_hybrid.")]
        else:
          continue
        for target in map(node, targets):
          if source != "__init__" and target != source:
            edges.setdefault(source, {}).setdefault(target, f"{os.path.relpath(path, PACKAGE)}:{statement.lineno}")
  return edges


def test_no_import_runs_back_up():
  edges = imports()
  assert {"rules", "transform", "kernels"} <= set(edges), sorted(edges)

  def reaches(start, goal, seen):
    return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges.get(start, ()))

  back_up = [f"{source} -> {target} ({where})" for source, targets in edges.items() for target, where in targets.items()
             if reaches(target, source, {target}) and not {source, target} <= TOOLING]
  assert not back_up, f"imports that close a cycle: {back_up}"


def test_the_rule_contract_is_below_the_engine_and_the_rules_above_it():
  edges = imports()
  assert set(edges["base"]) <= {"_compat"}, edges["base"]
  assert {"transform", "base"} <= set(edges["rules"])
  for engine in ("transform", "kernels", "pipeline", "plan", "checkpoint", "report"):
    assert "rules" not in edges.get(engine, {}), f"{engine} imports rules at {edges[engine]['rules']}"
