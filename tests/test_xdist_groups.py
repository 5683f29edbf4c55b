"""pytest-xdist's ``--dist loadgroup`` runs each group in one worker with the installed pytest.

The suite relies on it (tests/conftest.py makes each test file a group, and
the GPU-compile files group their cases by model or tier): a group's module
caches and subprocess compiles are built once. With pytest 9.2 and
pytest-xdist 3.8 the groups are silently ignored (pytest-xdist#1386) and each
worker compiled the same models again; pyproject.toml pins pytest below it.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("xdist")

GROUPED = textwrap.dedent('''
    import os
    import pytest

    def record(name):
      with open(os.environ["WORKERS_LOG"], "a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER')}\\n")

    @pytest.mark.xdist_group("one")
    @pytest.mark.parametrize("i", range(4))
    def test_one(i):
      record("one")

    @pytest.mark.parametrize("i", [pytest.param(i, marks=pytest.mark.xdist_group("two")) for i in range(4)])
    def test_two(i):
      record("two")
    ''')


def test_each_group_runs_in_one_worker(tmp_path):
  (tmp_path / "test_grouped.py").write_text(GROUPED)
  log = tmp_path / "workers.log"
  env = dict(os.environ, WORKERS_LOG=str(log))
  proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                         "no:cacheprovider", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path)],
                        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  workers = {}
  for line in log.read_text().splitlines():
    group, worker = line.split()
    workers.setdefault(group, set()).add(worker)
  assert set(workers) == {"one", "two"}
  assert all(len(w) == 1 for w in workers.values()), (
      f"pytest {pytest.__version__} and pytest-xdist spread a group over workers: {workers}")
