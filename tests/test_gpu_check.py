"""benchmarks/gpu_check.py runs end to end (tiny sizes, interpret mode) so that it is ready for a GPU."""

import jax
import pytest
from loading import load_script


def load():
  return load_script("benchmarks/gpu_check.py")


def test_smoke_run_passes_its_checks_and_prints_every_section(capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("on a GPU run the full script instead")
  gpu_check = load()
  assert gpu_check.main(["--smoke", "--trees", "one", "--reps", "1"]) == 0
  out = capsys.readouterr().out
  for heading in ("## 1. correctness", "## 2. copy bandwidth", "## 3. Pallas block size", "## 4. step time",
                  "## 5. placement tiers", "overlap: the halves alone", "## 6. layers streamed",
                  "deepest streamed run"):
    assert heading in out
  assert "FAIL" not in out and "all checks passed" in out
  for variant in ("optax.adamw", "ours pallas, tx.step", "ours xla, update+apply",
                  "ours pallas, pinned_host moments, tx.step", "ours pallas, 8-bit moments, tx.step"):
    assert f"| {variant}" in out
  # Every timed table has the estimate beside the measurement, a number in every row.
  for header in ("| variant", "| tier", "| setup"):
    lines = out[out.index(header):].splitlines()
    table = lines[:next((k for k, l in enumerate(lines) if not l.startswith("|")), len(lines))]
    column = [c.strip() for c in table[0].split("|")].index("est. ms")
    rows = [[c.strip() for c in l.split("|")][column] for l in table[2:]]
    assert rows and all(float(x) >= 0 for x in rows if x != "-") and rows.count("-") <= 1, (header, rows)
  assert "(estimated " in out
  # The streamed steps: the estimate's kernels, launches and loop trips beside what a profiled step ran
  # ("-" here: a CPU trace has no GPU stream).
  lines = out[out.index("| setup"):].splitlines()
  header = [c.strip() for c in lines[0].split("|")]
  for row in [[c.strip() for c in l.split("|")] for l in lines[2:6]]:
    kernels, launches, trips = (row[header.index(k)] for k in ("kernels est. / run", "launches est. / run",
                                                               "est. loop trips"))
    assert int(kernels.split(" / ")[0]) > 0 and int(launches.split(" / ")[0]) > 0 and int(trips) > 0, row
  for check in ("8-bit moments: pallas == the XLA rule", "8-bit moments: pallas == the float64 model",
                "8-bit moments: one Triton launch", "streamed losses == all-on-device losses",
                "the deepest streamed model ran a finite step"):
    assert f"PASS  {check}" in out


def test_without_a_gpu_the_full_run_refuses_instead_of_timing_interpret_mode(capsys):
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is here")
  assert load().main([]) == 2
  assert "no GPU here" in capsys.readouterr().out


def test_a_section_that_raises_is_a_failure_and_the_run_goes_on(capsys):
  gpu_check = load()
  assert gpu_check.guarded(lambda: 7, "fine") == 7
  assert gpu_check.guarded(lambda: 1 / 0, "broken") is None
  assert gpu_check.FAILURES == ["broken raised"]
  captured = capsys.readouterr()
  assert "ZeroDivisionError" in captured.err and "FAIL  broken raised" in captured.out


def test_a_trace_counts_the_gpu_streams_kernels_and_the_hosts_launches():
  meta = lambda kind, pid, name, tid=0: dict(ph="M", name=kind, pid=pid, tid=tid, args=dict(name=name))
  span = lambda pid, tid, name: dict(ph="X", pid=pid, tid=tid, name=name, ts=0, dur=1)
  events = [meta("process_name", 1, "/device:GPU:0"), meta("process_name", 2, "/host:CPU"),
            meta("thread_name", 1, "Stream #13(Compute)", 13), meta("thread_name", 1, "XLA Ops", 99),
            span(1, 13, "loop_add_fusion"), span(1, 13, "gemm_fusion_dot"), span(1, 13, "MemcpyH2D"),
            span(1, 99, "loop_add_fusion"),  # XLA's op line, derived from the kernels: not counted again
            span(2, 5, "cuLaunchKernelEx"), span(2, 5, "cudaGraphLaunch"), span(2, 5, "cuMemcpyHtoDAsync")]
  assert load().trace_counts(events) == (2, 2)
  assert load().trace_counts([meta("process_name", 2, "/host:CPU"), span(2, 5, "cuLaunchKernel")]) is None
