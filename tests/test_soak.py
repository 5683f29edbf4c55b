"""The crash-loop soak (benchmarks/soak.py) in its short version, as CI runs it.

One setup with every tier (disk included), 8-bit moments, bf16 params with
fp32 masters and skip_nonfinite over NaN batches; 30 steps with a save every
5; one SIGKILL the moment a save's temporary directory appears, one at a
random moment, then a run to the end. The full soak and its figures:
docs/records/testing.md.
"""

import json

import pytest
from loading import load_script

pytest.importorskip("orbax.checkpoint")


def test_a_crash_looped_run_ends_bit_identical_and_leaves_nothing_behind(tmp_path, capsys):
  soak = load_script("benchmarks/soak.py")
  rc = soak.main(["--quick", "--json", str(tmp_path / "soak.json")])
  out = capsys.readouterr().out
  assert rc == 0, out
  (result,) = json.loads((tmp_path / "soak.json").read_text())
  assert result["failures"] == [], out
  assert result["kills"] == 2 and result["kills_at_saves"] == 1, out
  assert result["saves_caught_unfinished"] >= 1, out  # the kill aimed at a save did land inside it
  assert result["bit_exact"] and result["arrays_compared"] >= 30, out
  assert result["leftovers_after_kills"] == [0, 0] and result["checkpoint_dir_strays"] == [], out
