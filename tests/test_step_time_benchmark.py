"""benchmarks/step_time.py's arithmetic: extrapolation in depth and the smallest batch whose compute covers the bus.

The compiles themselves (minutes each at full width) are the benchmark's to run;
here its two pieces of arithmetic are checked on figures made up for the test.
"""

import pytest

from loading import load_script

bench = load_script("benchmarks/step_time.py")


def figures(layers, batch, **values):
  base = dict(setup="s", layers=layers, batch=batch, params=0, device_bytes=0, host_bytes=0, to_device=0,
              to_host=0, seconds=0.0, compute=0.0, bus_in=0.0, bus_out=0.0, host=0.0, host_memory=0.0, collectives=0.0,
              launch_time=0.0, launch_wait=0.0, launches=0, loop_trips=0, bus_busy=0.0, bus_hidden=0.0, flops=0.0)
  return dict(base, **values)


def test_figures_at_a_depth_follow_the_line_through_two_compiled_depths():
  a = figures(4, 1, seconds=1.0, compute=0.5, bus_in=0.8, params=100, device_bytes=10)
  b = figures(8, 1, seconds=3.0, compute=1.5, bus_in=1.6, params=180, device_bytes=14)
  r = bench.at_depth(a, b, 32)
  assert (r["layers"], r["seconds"], r["compute"], r["bus_in"], r["params"], r["device_bytes"]) == (
      32, 15.0, 7.5, pytest.approx(6.4), 660, 38)
  assert r["lower_bound"] == 7.5  # the compute: more than the bus in (6.4) there
  assert bench.at_depth(a, b, 4)["seconds"] == 1.0


class Linear:
  """A runner whose compute grows by 0.1 s per sequence over a bus of 0.55 s in and 0.3 s out."""

  def figures(self, name, layers, batch):
    return figures(layers, batch, compute=0.1 * batch, bus_in=0.55, bus_out=0.3, seconds=1.0)


def test_the_covering_batch_is_the_smallest_whose_compute_reaches_both_bus_directions():
  r = bench.covering_batch(Linear(), "s", 32, [1, 4, 16])
  assert r["batch"] == 6 and r["compute"] >= r["bus_in"] and 0.1 * 5 < 0.55


def test_a_setup_without_bus_has_no_covering_batch():
  class NoBus(Linear):
    def figures(self, name, layers, batch):
      return figures(layers, batch, compute=0.1 * batch)
  assert bench.covering_batch(NoBus(), "s", 32, [1, 16]) is None


def test_the_lower_bound_counts_host_memory_and_launches_too():
  a, b = figures(4, 1, compute=0.5, bus_in=0.8, host_memory=1.0), figures(8, 1, compute=1.0, bus_in=1.2, host_memory=3.0)
  assert bench.at_depth(a, b, 16)["lower_bound"] == 7.0  # host memory: 1 + 12 x 0.5
  a, b = figures(4, 1, compute=0.5, launch_time=1.0), figures(8, 1, compute=1.0, launch_time=2.0)
  assert bench.at_depth(a, b, 16)["lower_bound"] == 4.0  # the host's launches: 1 + 12 x 0.25
