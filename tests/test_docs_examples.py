"""Every Python block of the README and of the pages under docs/ runs and says what it claims.

A block runs in a fresh namespace. What it claims is checked two ways:

* a trailing ``expr  # value`` line states the value the reader will see:
  ``repr(expr)`` must equal ``value``;
* a block followed directly by a ```` ```text ```` block prints that text: its
  standard output must equal it (trailing spaces aside).

A block that trains runs as written in a loop and compiles once: each of its
train-step statements (``params, state, loss = train_step(params, state, x)``:
a call of a jitted function, at the top level or in a top-level ``for`` loop,
whose results are some of its arguments) runs once more after the block, fed
its own results, and over the block and that run JAX must have compiled the
function once: counted from the records ``jax.log_compiles`` makes
(``Compiling jit(train_step) ...``, :mod:`compile_log`), what a user who sets
``JAX_LOG_COMPILES=1`` reads. (A jitted function's ``_cache_size()`` is no
count of compiles: under FSDP, specs that differ only in trailing ``None`` s
make two cache entries for one compiled program.)

Blocks that call ``jax.distributed.initialize()`` are multi-host examples: they
run as two processes on this machine, joined on loopback, each with 2 CPU
devices, the way ``tests/test_multiprocess.py`` runs its script (the test plays
the cluster launcher: it supplies the coordinator address, the process count
and ids that a cluster's environment would, and a temporary directory for the
shared checkpoint path). ``bash`` blocks are not run here (they install
packages and run the test suite and the benchmarks); the scripts, test files
and flags they name must exist.

Run as a script (``python tests/test_docs_examples.py PAGE LINE``), this file
runs one block: the multi-host test starts it once per process.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import glob
import io
import os
import re
import subprocess
import sys
import time

import pytest

from compile_log import compile_log

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
PAGES = [README] + sorted(
    p for p in glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True)
    if os.sep + "_build" + os.sep not in p)
MULTI_HOST_PROCESSES = 2
# A shared directory every host sees, in the multi-host example; a temporary
# directory here.
SHARED_PATH = "/shared/run"
# A guard against a hung collective (a passing run takes ~10 s here).
MULTI_HOST_TIMEOUT_S = 300

FENCE = re.compile(r"^(`{3,}|~{3,})\s*([^\s`]*)")


def code_blocks(path: str) -> list[tuple[int, str, str]]:
  """The fenced blocks of a Markdown page: ``(line of the opening fence, language, text)``."""
  blocks, lines = [], open(path).read().splitlines(keepends=True)
  i = 0
  while i < len(lines):
    opening = FENCE.match(lines[i])
    if not opening:
      i += 1
      continue
    fence, language, start = opening.group(1), opening.group(2), i
    i += 1
    body = []
    closing = re.compile(re.escape(fence[0]) + "{%d,}" % len(fence))
    while i < len(lines) and not closing.fullmatch(lines[i].rstrip()):
      body.append(lines[i])
      i += 1
    blocks.append((start + 1, language, "".join(body)))
    i += 1
  return blocks


def python_examples() -> list[tuple[str, int, str, str | None]]:
  """Every ``python`` block: ``(page, line, code, printed text or None)``."""
  examples = []
  for page in PAGES:
    blocks = code_blocks(page)
    lines = open(page).read().splitlines()
    for k, (line, language, text) in enumerate(blocks):
      if language != "python":
        continue
      printed = None
      if k + 1 < len(blocks) and blocks[k + 1][1] == "text":
        end_of_block = line + text.count("\n") + 1  # the closing fence's line
        between = lines[end_of_block:blocks[k + 1][0] - 1]
        if not any(s.strip() for s in between):
          printed = blocks[k + 1][2]
      examples.append((page, line, text, printed))
  return examples


def example_id(page: str, line: int) -> str:
  return f"{os.path.relpath(page, REPO)}:{line}"


def is_multi_host(code: str) -> bool:
  return "jax.distributed.initialize(" in code


def run_example(code: str, filename: str, printed: str | None) -> dict:
  """Runs ``code`` in a fresh namespace and checks its claimed value and its printed text; returns the namespace."""
  namespace = {}
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, filename, "exec"), namespace)  # noqa: S102
  last = [line for line in code.strip().splitlines() if line.strip()][-1]
  if "  # " in last and not last.lstrip().startswith("#"):
    expr, claimed = last.split("  # ", 1)
    assert repr(eval(expr, namespace)) == claimed.strip(), (filename, expr, claimed)  # noqa: S307
  if printed is not None:
    strip = lambda text: [line.rstrip() for line in text.strip("\n").splitlines()]
    assert strip(out.getvalue()) == strip(printed), (filename, out.getvalue())
  return namespace


def _names(node: ast.AST) -> set[str]:
  return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def train_steps(code: str, namespace: dict) -> list[tuple[ast.stmt, str]]:
  """The block's train-step statements: ``outs = f(args)``, ``f`` a jitted function fed its own results back.

  At the top level, or in the body of a top-level ``for`` loop.
  """
  found = []
  for top in ast.parse(code).body:
    for stmt in (top.body if isinstance(top, ast.For) else [top]):
      call = getattr(stmt, "value", None)
      if not (isinstance(stmt, ast.Assign) and isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
        continue
      if hasattr(namespace.get(call.func.id), "_cache_size") and _names(ast.Tuple(stmt.targets)) & set().union(
          *(_names(a) for a in call.args)):
        found.append((stmt, call.func.id))
  return found


def check_compiles_once(code: str, namespace: dict, filename: str, log) -> None:
  """Each train step of the block runs once more, fed its results; over the block and that run it compiled once.

  ``log`` is the :class:`compile_log.CompileLog` that listened while the block ran.
  """
  with contextlib.redirect_stdout(io.StringIO()):
    for stmt, name in train_steps(code, namespace):
      exec(compile(ast.Module([stmt], type_ignores=[]), filename, "exec"), namespace)  # noqa: S102
      compiles = log.count(namespace[name].__name__)
      assert compiles == 1, f"{filename}: `{name}` compiled {compiles} times when run in a loop ({log.names})"


EXAMPLES = python_examples()
SINGLE = [e for e in EXAMPLES if not is_multi_host(e[2])]
MULTI = [e for e in EXAMPLES if is_multi_host(e[2])]


def test_every_python_block_is_found():
  """An indented or oddly fenced block would otherwise be skipped silently."""
  for page in PAGES:
    found = sum(1 for p, *_ in EXAMPLES if p == page)
    assert open(page).read().count("```python") == found, page
  assert len(EXAMPLES) >= 10 and MULTI


@pytest.mark.parametrize("page, line, code, printed", SINGLE, ids=[example_id(e[0], e[1]) for e in SINGLE])
def test_example_runs(page, line, code, printed, request):
  if "gpu_compile" in code:  # compiles for a GPU: needs JAX's CUDA plugin (tests/conftest.py)
    request.getfixturevalue("cuda_compiler_plugin")
  with compile_log() as log:
    namespace = run_example(code, example_id(page, line), printed)
    check_compiles_once(code, namespace, example_id(page, line), log)


def jitted_names(code: str) -> set[str]:
  """Names a block binds to a jitted function: ``f = jax.jit(...)`` or ``@jax.jit`` (read from the code)."""
  names = set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Assign) and "jax.jit(" in ast.unparse(node.value).replace(" ", "")[:8]:
      names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    if isinstance(node, ast.FunctionDef) and any("jax.jit" in ast.unparse(d) for d in node.decorator_list):
      names.add(node.name)
  return names


def test_the_compile_once_check_reaches_the_train_steps():
  """Read from the code: the pages' train steps that check_compiles_once reruns (and the records it counts)."""
  import jax
  import jax.numpy as jnp

  def train_step(x):
    return x + 1
  step = jax.jit(train_step)
  with compile_log() as log:
    x = step(jnp.zeros(2))
    x = step(x)  # committed now: the same program here (no memory kinds move)
    step(jnp.zeros(3))  # another shape: another program
  assert log.count("train_step") == 2, log.names  # what check_compiles_once counts
  steps = {}
  for page, line, code, _ in SINGLE:
    jitted = jitted_names(code)
    steps[example_id(page, line)] = [name for _, name in train_steps(code, dict.fromkeys(jitted, jax.jit(abs)))]
  assert sum(map(len, steps.values())) >= 8, steps
  assert any(steps[k] for k in steps if "streaming.md" in k) and any(steps[k] for k in steps if "README" in k), steps


def multi_host_env(coordinator: str, process_id: int) -> dict[str, str]:
  env = dict(os.environ, JAX_PLATFORMS="cpu", DOCS_COORDINATOR=coordinator, DOCS_PROCESS_ID=str(process_id))
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
  # Each process asks for its own 2 devices; an inherited forced count would contradict it.
  flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
  env["XLA_FLAGS"] = " ".join(flags)
  return env


@pytest.mark.parametrize("page, line, code, printed", MULTI, ids=[example_id(e[0], e[1]) for e in MULTI])
def test_multi_host_example_runs(page, line, code, printed, tmp_path):
  from test_multiprocess import reserve_port  # one port-holding scheme for both multi-process tests

  with reserve_port() as port:
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), page, str(line), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(tmp_path),
        env=multi_host_env(f"127.0.0.1:{port}", i)) for i in range(MULTI_HOST_PROCESSES)]
    deadline = time.monotonic() + MULTI_HOST_TIMEOUT_S
    try:
      # A failed process leaves its peer blocked in a collective: stop both at the first failure.
      while any(p.poll() is None for p in procs) and all(p.poll() in (None, 0) for p in procs):
        assert time.monotonic() < deadline, f"timed out after {MULTI_HOST_TIMEOUT_S} s"
        time.sleep(0.1)
    finally:
      for p in procs:
        if p.poll() is None:
          p.kill()
      outputs = [p.communicate()[0] for p in procs]
  report = "\n".join(f"--- process {i}:\n{out}" for i, out in enumerate(outputs))
  assert [p.returncode for p in procs] == [0] * MULTI_HOST_PROCESSES, report
  assert os.listdir(os.path.join(tmp_path, "ckpt")), "the example's checkpoint was not written"


def run_multi_host_process(page: str, line: int, shared_dir: str) -> None:
  """One process of a multi-host example (started by :func:`test_multi_host_example_runs`)."""
  import jax

  ((_, _, code, printed),) = [e for e in EXAMPLES if e[0] == os.path.abspath(page) and e[1] == line]
  jax.config.update("jax_num_cpu_devices", 2)
  # What a cluster's environment (SLURM, Open MPI, Cloud TPU) would tell initialize().
  jax.distributed.initialize = functools.partial(
      jax.distributed.initialize, coordinator_address=os.environ["DOCS_COORDINATOR"],
      num_processes=MULTI_HOST_PROCESSES, process_id=int(os.environ["DOCS_PROCESS_ID"]),
      initialization_timeout=120)
  assert SHARED_PATH in code, f"the example no longer writes under {SHARED_PATH}: update this test"
  run_example(code.replace(SHARED_PATH, shared_dir), example_id(page, line), printed)
  assert jax.process_count() == MULTI_HOST_PROCESSES and jax.device_count() == 2 * MULTI_HOST_PROCESSES


# --- bash blocks: what they name exists ---


def bash_commands() -> list[tuple[str, str]]:
  return [(example_id(page, line), command) for page in PAGES for line, language, text in code_blocks(page)
          if language in ("bash", "sh", "console") for command in text.splitlines() if command.strip()]


def test_bash_blocks_name_what_exists():
  with open(os.path.join(REPO, "pyproject.toml")) as f:
    section = f.read().split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
  extras = set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, flags=re.M))
  assert {"test", "examples"} <= extras, extras
  commands = bash_commands()
  assert commands
  for where, command in commands:
    command = command.split("#", 1)[0]
    for extra in re.findall(r'"\.\[([^\]]+)\]"', command):
      assert set(extra.split(",")) <= extras, (where, command)
    for script_and_args in re.split(r"&&|;", command):
      words = script_and_args.split()
      scripts = [w for w in words if w.endswith(".py")]
      for script in scripts:
        assert os.path.exists(os.path.join(REPO, script)), (where, script)
        source = open(os.path.join(REPO, script)).read()
        for flag in (w for w in words if w.startswith("--")):
          if "pytest" not in words and "pip" not in words:
            assert f'"{flag}"' in source, (where, f"{script} has no flag {flag}")


def test_quick_start_has_exactly_two_commands():
  with open(README) as f:
    text = f.read()
  block = re.search(r"## Quick start\n\n```bash\n(.*?)```", text, flags=re.S).group(1)
  lines = [line for line in block.splitlines() if line.strip()]
  assert len(lines) == 2
  assert "examples/char_gpt.py" in lines[0] and "pytest" in lines[1]


if __name__ == "__main__":
  try:
    run_multi_host_process(sys.argv[1], int(sys.argv[2]), sys.argv[3])
  except BaseException:
    import traceback
    traceback.print_exc()
    sys.stdout.flush()
    # At once: a normal exit would wait in jax.distributed's shutdown barrier
    # for the peer, itself blocked in a collective waiting for this process.
    os._exit(1)
