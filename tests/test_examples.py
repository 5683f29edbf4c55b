"""The examples run for a few steps, keep the moments on host and actually learn."""

import os
import shutil

import jax
import numpy as np
import pytest
from loading import load_script

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")


def load(name):
  pytest.importorskip("flax")
  return load_script(f"examples/{name}.py")


def test_flax_nnx_mlp(capsys):
  result = load("flax_nnx_mlp").main(["--steps", "150"])
  assert result["moment_memory_kinds"] == ["pinned_host"]
  assert result["final_loss"] < 0.25 * result["initial_loss"]
  assert "Adam moments in pinned_host memory" in capsys.readouterr().out


@pytest.mark.parametrize("contract", [[], ["--optax-contract"]], ids=["fused-step", "apply-gradients"])
def test_flax_train_state(capsys, contract):
  result = load("flax_train_state").main(["--steps", "120"] + contract)
  assert result["moment_memory_kinds"] == ["pinned_host"]
  assert result["final_accuracy"] > 0.9 > result["initial_accuracy"] + 0.2
  assert "test accuracy" in capsys.readouterr().out


def test_nnx_example_rejects_bad_steps(capsys):
  with pytest.raises(SystemExit):
    load("flax_nnx_mlp").main(["--steps", "1"])
  assert "--steps" in capsys.readouterr().err


def test_flax_nnx_mlp_resumes_from_a_checkpoint_exactly(tmp_path, capsys):
  pytest.importorskip("orbax.checkpoint")
  example = load("flax_nnx_mlp")
  args = ["--steps", "40", "--checkpoint-dir", str(tmp_path), "--checkpoint-every", "20"]
  straight = example.main(args)
  assert sorted(os.listdir(tmp_path)) == ["20", "40"]
  # Lose the last checkpoint, as if the run had died after step 20.
  shutil.rmtree(tmp_path / "40")
  resumed = example.main(args)
  assert resumed["first_step"] == 20 and "resumed from" in capsys.readouterr().out
  assert resumed["moment_memory_kinds"] == ["pinned_host"]
  for a, b in zip(jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
