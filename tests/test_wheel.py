"""The package as it ships: ``python -m build`` makes an sdist and, from it, a wheel whose native kernel
runs on any CPU of its architecture, picking its instruction set when it loads.

The wheel is built once per run (the C++ compile is most of the time), from a
copy of this checkout so that nothing is written into it.
"""

import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from loading import ROOT

pytestmark = pytest.mark.skipif(not (shutil.which("c++") or shutil.which("g++")),
                                reason="native kernel: no C++ compiler to build the wheel's")

X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
LIBRARY = re.compile(r"optax_hybrid/kernels/_native_cpu\.[^/]+\.(so|pyd|dylib)$")


def run(*command, **kwargs):
  result = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=600, **kwargs)
  assert result.returncode == 0, f"{command}:\n{result.stdout}\n{result.stderr}"
  return result.stdout


@pytest.fixture(scope="session")
def built(tmp_path_factory):
  """``(sdist, wheel)`` from ``python -m build`` (sdist first, the wheel built from the unpacked sdist).

  Under pytest-xdist the workers share one build: whichever asks first builds
  in their common temporary directory while the others wait on a lock.
  """
  tmp = tmp_path_factory.getbasetemp()
  if os.environ.get("PYTEST_XDIST_WORKER"):
    tmp = tmp.parent  # this run's directory, shared by its workers
  tmp = tmp / "wheel"
  tmp.mkdir(exist_ok=True)
  with open(tmp / "lock", "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    if not (tmp / "built").exists():
      source = tmp / "source"
      shutil.rmtree(source, ignore_errors=True)
      shutil.rmtree(tmp / "dist", ignore_errors=True)
      shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
          ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "*.so", "*.pyd", "runs", ".pytest_cache",
          ".hypothesis", "_build", "mutants"))  # mutants/: mutmut's mutated copy (docs/records/testing.md)
      # --no-isolation: the build requirements (setuptools, jax) are the test
      # environment's, so nothing is downloaded.
      run(sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", source)
      (tmp / "built").touch()
  (sdist,), (wheel,) = sorted((tmp / "dist").glob("*.tar.gz")), sorted((tmp / "dist").glob("*.whl"))
  return sdist, wheel


def test_the_sdist_carries_the_source_and_the_wheel_the_compiled_kernel(built):
  sdist, wheel = built
  with tarfile.open(sdist) as f:
    in_sdist = f.getnames()
  assert any(n.endswith("/optax_hybrid/kernels/native_cpu.cc") for n in in_sdist)
  assert any(n.endswith("/setup.py") for n in in_sdist)
  assert not any(LIBRARY.search(n) for n in in_sdist)  # compiled by the wheel's build, not carried over
  with zipfile.ZipFile(wheel) as f:
    in_wheel = f.namelist()
  assert len([n for n in in_wheel if LIBRARY.fullmatch(n)]) == 1
  assert "optax_hybrid/kernels/native_cpu.cc" in in_wheel


def functions_and_instructions(disassembly: str) -> dict[str, list[str]]:
  """``objdump -d`` text as {function name: its instruction lines}."""
  functions, current = {}, None
  for line in disassembly.splitlines():
    if match := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
      current = functions.setdefault(match.group(1), [])
    elif current is not None and re.match(r"^\s+[0-9a-f]+:\s", line):
      current.append(line)
  return functions


@pytest.mark.skipif(not X86, reason="the instruction-set copies are x86's")
def test_only_the_avx_copies_of_the_wheels_kernel_use_avx(built, tmp_path):
  objdump = shutil.which("objdump")
  if objdump is None:
    pytest.skip("native kernel: no objdump (binutils) to read the wheel's library")
  _, wheel = built
  with zipfile.ZipFile(wheel) as f:
    library = f.extract(next(n for n in f.namelist() if LIBRARY.fullmatch(n)), tmp_path)
  functions = functions_and_instructions(run(objdump, "-d", "--no-show-raw-insn", "-C", library))
  copies = {isa: next(lines for name, lines in functions.items() if f"run_chunk_{isa}(" in name)
            for isa in ("avx512vbmi", "avx512", "avx2", "baseline")}
  count = lambda lines, register: sum(line.count(f"%{register}") for line in lines)
  assert count(copies["avx512"], "zmm") > 100 and count(copies["avx512vbmi"], "zmm") > 100  # 512-bit vectors
  assert count(copies["avx2"], "ymm") > 100 and count(copies["avx2"], "zmm") == 0
  # Nothing else in the library uses AVX (no VEX/EVEX instruction, no ymm/zmm):
  # what runs before the choice, and the baseline copy, run on any x86-64 CPU.
  # (The VBMI copy calls its dequantization out of line.)
  avx = re.compile(r":\s+v[a-z0-9]+\s|%[yz]mm")
  own = re.compile(r"run_chunk_avx(2|512|512vbmi)\(|dequantize_by_permutes\(")
  elsewhere = [(name, line) for name, lines in functions.items() if not own.search(name)
               for line in lines if avx.search(line)]
  assert not elsewhere, elsewhere[:5]
  assert len(copies["baseline"]) > 100


def test_the_wheel_in_a_fresh_virtual_environment_runs_the_native_kernel_against_the_reference(built, tmp_path):
  _, wheel = built
  venv = tmp_path / "venv"
  run(sys.executable, "-m", "venv", "--without-pip", venv)
  python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
  run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", "--no-deps", "--no-index",
      "--force-reinstall", wheel)
  site_packages = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
  # Its dependencies (jax, ...) from this test environment rather than downloaded: its
  # site-packages on the path, after the venv's own, and without its .pth files (so
  # an editable install of this checkout there is not imported).
  ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
  with open(os.path.join(site_packages, "test_environment_packages.pth"), "w") as f:
    f.write("\n".join(sorted(ours)) + "\n")
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OPTAX_HYBRID_NATIVE_ISA")}
  out = run(python, os.path.join(ROOT, "tests", "native_kernel_script.py"), cwd=tmp_path,
            env=dict(env, JAX_PLATFORMS="cpu"))
  ran = json.loads(out.splitlines()[-1])
  for module in ("optax_hybrid", "native_cpu"):
    assert os.path.commonpath([os.path.realpath(ran[module]), os.path.realpath(site_packages)]) == \
        os.path.realpath(site_packages), ran
  assert ran["isa"] == ran["isas_this_cpu_runs"][0]  # the widest (test_kernels checks that list)
  assert ran["leaves_compared"] > 0
