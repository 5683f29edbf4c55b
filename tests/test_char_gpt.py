"""The character GPT example learns, reports the right baseline and writes a complete run folder."""

from __future__ import annotations

import collections
import csv
import glob
import io
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from loading import load_script

pytest.importorskip("flax")

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)

STEPS = 40
TINY = ["--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32", "--layers", "1", "--d-model", "32",
        "--heads", "2", "--lr", "1e-2", "--sample-chars", "24", "--seed", "1"]


def load():
  return load_script("examples/char_gpt.py")


@pytest.fixture(scope="module")
def char_gpt():
  return load()


@pytest.fixture(scope="module")
def run(char_gpt, tmp_path_factory):
  out_dir = tmp_path_factory.mktemp("char_gpt_run")
  summary = char_gpt.main(TINY + ["--out-dir", str(out_dir)])
  return out_dir, summary


def test_streamed_layers_train_to_the_same_losses(char_gpt, tmp_path):
  """--stream-layers: the blocks stacked in pinned_host and run by scan_layers learn what the unrolled blocks learn."""
  short = TINY + ["--steps", "12", "--layers", "2", "--sample-chars", "0"]
  streamed = char_gpt.main(short + ["--stream-layers", "--out-dir", str(tmp_path)])
  plain = char_gpt.main(short + ["--out-dir", str(tmp_path / "plain")])
  assert streamed["stream_layers"] and not plain["stream_layers"]
  for key in ("initial_val_loss", "first_train_loss", "final_train_loss", "final_val_loss"):
    assert streamed[key] == pytest.approx(plain[key], rel=1e-4), key
  # The stacked blocks' params (and so their state) live in host memory: the host tier updates them there.
  assert streamed["memory"]["weights_by_tier"]["host"] > 0
  assert plain["memory"]["weights_by_tier"]["host"] == 0


def test_metrics_csv_has_one_row_per_step(run, char_gpt):
  out_dir, summary = run
  with open(out_dir / "metrics.csv", newline="") as f:
    reader = csv.DictReader(f)
    assert tuple(reader.fieldnames) == ("step", "loss", "lr", "tokens_per_s", "val_loss")
    rows = list(reader)
  assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
  assert all(math.isfinite(float(r["loss"])) for r in rows)
  lrs = [float(r["lr"]) for r in rows]
  # Warmup to the 1e-2 peak, then a cosine down to its 10% floor.
  assert max(lrs) == pytest.approx(1e-2, rel=1e-5)
  assert lrs[-1] == pytest.approx(1e-3, rel=0.05) and lrs[-1] < lrs[len(lrs) // 2] < max(lrs)
  # Step 1's time is compilation: no throughput for it, a positive one after.
  assert rows[0]["tokens_per_s"] == ""
  assert all(float(r["tokens_per_s"]) > 0 for r in rows[1:])
  measured = [int(r["step"]) for r in rows if r["val_loss"]]
  assert measured == list(range(STEPS // char_gpt.EVALS, STEPS + 1, STEPS // char_gpt.EVALS))
  assert float(rows[-1]["val_loss"]) == pytest.approx(summary["final_val_loss"], rel=1e-5)


def test_summary_json_is_the_returned_summary_with_finite_numbers(run):
  out_dir, summary = run
  with open(out_dir / "summary.json") as f:
    written = json.load(f)
  assert written == json.loads(json.dumps(summary))

  def numbers(tree):
    if isinstance(tree, dict):
      for value in tree.values():
        yield from numbers(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
      yield tree

  assert all(math.isfinite(x) for x in numbers(written))
  for key in ("final_train_loss", "final_val_loss", "unigram_baseline", "tokens_per_s", "params",
              "wall_time_s", "memory"):
    assert key in written, key
  assert written["tokens_per_s"] > 0 and written["wall_time_s"] > 0
  # Token and position tables, one block (two LayerNorms, qkv, output, MLP
  # 32 -> 128 -> 32) and the final LayerNorm; the output layer is the token table.
  d, vocab = 32, written["corpus"]["vocab_size"]
  block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
  assert written["params"] == written["memory"]["num_params"] == vocab * d + 32 * d + block + 2 * d


def test_moments_live_in_host_memory_and_the_report_says_so(run):
  _, summary = run
  assert summary["moment_memory_kinds"] == ["pinned_host"]
  memory = summary["memory"]
  # fp32 moments m and v: 8 bytes per weight in host memory, nothing else there.
  assert memory["bytes_per_weight_host"] == pytest.approx(8.0)
  assert memory["host_bytes"] == 8 * memory["num_params"]
  # Params and gradients on the device, 4 bytes each, plus a few scalars of state.
  assert 8.0 <= memory["bytes_per_weight_device"] < 8.01
  # The figure's comparison, optax.adamw's state: fp32 m and v per weight, and an int32 count.
  assert memory["optax_adamw_state_bytes"] == 8 * memory["num_params"] + 4


def test_plot_is_written(run):
  pytest.importorskip("matplotlib")
  out_dir, summary = run
  path = out_dir / "char_gpt.png"
  assert summary["plot"] == str(path.resolve())
  data = path.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_a_few_dozen_steps_learn(run):
  _, summary = run
  vocab = summary["corpus"]["vocab_size"]
  # Untrained, the model is close to guessing uniformly over the vocabulary
  # (random logits of std about 1 cost about half a nat more).
  assert abs(summary["initial_val_loss"] - math.log(vocab)) < 1.0
  assert abs(summary["first_train_loss"] - math.log(vocab)) < 1.0
  assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0
  assert summary["final_train_loss"] < summary["first_train_loss"] - 1.0


def test_unigram_baseline_is_the_entropy_of_the_training_characters(run, char_gpt):
  _, summary = run
  corpus = char_gpt.load_corpus()
  counts = collections.Counter(corpus.train_text)
  total = sum(counts.values())
  entropy = -sum(n / total * math.log(n / total) for n in counts.values())
  assert summary["unigram_baseline"] == pytest.approx(entropy, rel=1e-9)
  assert summary["corpus"]["train_chars"] == total
  assert summary["corpus"]["vocab_size"] == len(set(corpus.train_text) | set(corpus.val_text))


def test_corpus_is_the_standard_library_split_by_file(char_gpt):
  corpus = char_gpt.load_corpus()
  names = sorted(os.path.basename(p) for p in glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
  assert sorted(corpus.train_files + corpus.val_files) == names
  assert not set(corpus.train_files) & set(corpus.val_files)
  assert len(corpus.val_files) == len(names) // 10
  with open(os.path.join(corpus.source, corpus.train_files[0]), encoding="utf-8", errors="replace") as f:
    assert corpus.train_text.startswith(f.read())


def test_vocab_round_trips_and_rejects_unknown_characters(char_gpt):
  vocab = char_gpt.Vocab("hello, world\n\u00e9")
  text = "\u00e9 world, hello"
  assert vocab.decode(vocab.encode(text)) == text
  with pytest.raises(ValueError, match="outside the vocabulary"):
    vocab.encode("hello?")


def random_model(char_gpt, vocab=11, seq_len=6, seed=3):
  """A one-block model with large random weights (drawn in NumPy: no initializer to compile)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  abstract = nnx.eval_shape(lambda: char_gpt.CharGPT(vocab, seq_len, 1, 16, 2, nnx.Rngs(0)))
  graphdef, shapes = nnx.split(abstract)
  rng = np.random.default_rng(seed)
  state = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 1.0, s.shape), s.dtype), shapes)
  forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
  return graphdef, state, forward


def test_model_is_causal(char_gpt):
  _, state, forward = random_model(char_gpt)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, 11, size=(1, 6)).astype(np.int32)
  changed = tokens.copy()
  changed[0, 3:] = (tokens[0, 3:] + 1 + rng.integers(0, 10, size=3)) % 11
  a, b = np.asarray(forward(state, tokens)), np.asarray(forward(state, changed))
  # Positions before the change cannot see it; the changed ones do.
  np.testing.assert_allclose(a[0, :3], b[0, :3], rtol=1e-5, atol=1e-5)
  assert np.abs(a[0, 3:] - b[0, 3:]).min() > 1e-3


def test_next_logits_reads_the_window_before_the_position(char_gpt):
  import jax
  import jax.numpy as jnp
  from flax import nnx

  seq_len = 6
  graphdef, state, forward = random_model(char_gpt, seq_len=seq_len)
  buffer = np.random.default_rng(1).integers(0, 11, size=15).astype(np.int32)
  logits = jax.jit(
      lambda state, buffer, t: char_gpt.next_logits(nnx.merge(graphdef, state), buffer, t, seq_len))
  for t in range(1, len(buffer)):
    start = max(0, t - seq_len)
    # The model on exactly the seq_len characters from `start`; its output at
    # position t - 1 - start predicts character t (causality is tested above).
    expected = np.asarray(forward(state, buffer[None, start:start + seq_len]))[0, t - 1 - start]
    got = np.asarray(logits(state, jnp.asarray(buffer), t))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_greedy_sampler_is_the_plain_loop(char_gpt):
  import jax
  import jax.numpy as jnp

  seq_len, prompt, chars = 6, [3, 1, 4, 1], 10
  graphdef, state, forward = random_model(char_gpt, seq_len=seq_len)
  sampler = char_gpt.make_sampler(graphdef, seq_len, len(prompt), chars, temperature=0.0)
  got = np.asarray(sampler(state, jnp.asarray(prompt, jnp.int32), jax.random.key(0)))
  ids = list(prompt)
  while len(ids) < len(prompt) + chars:
    # The last seq_len characters, padded with junk the causal model ignores:
    # one input shape, so one compilation.
    window = (ids[-seq_len:] + [7] * seq_len)[:seq_len]
    logits = np.asarray(forward(state, jnp.asarray([window], jnp.int32)))[0, min(len(ids), seq_len) - 1]
    ids.append(int(np.argmax(logits)))
  assert got.tolist() == ids
  assert len(set(ids[len(prompt):])) > 1


def test_progress_redraws_in_place_on_a_terminal(char_gpt):

  class Terminal(io.StringIO):

    def isatty(self):
      return True

  stream = Terminal()
  progress = char_gpt.Progress(3, stream=stream)
  progress.update(1, 5.0, 1e-3, "compiled in 2.0 s")
  progress.note("step 1: validation loss 4.0")
  progress.update(3, 2.0, 1e-4, "1,234 tok/s")
  progress.close()
  text = stream.getvalue()
  # tqdm's bar, redrawn in place ("\r"); the note on a line of its own above it; the finished bar ends its line.
  assert "\r" in text and text.endswith("\n")
  assert "\nstep 1: validation loss 4.0\n" in "\n" + text.replace("\r", "\n")
  final = text.replace("\r", "\n").rstrip("\n").splitlines()[-1]
  assert "100%" in final and "3/3" in final and final.rstrip().endswith("loss 2.0000  lr 1.00e-04  1,234 tok/s]")


def test_progress_prints_plain_lines_in_a_log(char_gpt):
  stream = io.StringIO()
  progress = char_gpt.Progress(100, stream=stream)
  for step in range(1, 101):
    progress.update(step, 1.0, 1e-3, "1 tok/s")
  progress.close()
  lines = stream.getvalue().splitlines()
  assert "\r" not in stream.getvalue()
  assert [int(line.split()[1].split("/")[0]) for line in lines] == [1] + list(range(10, 101, 10))


def test_plot_is_skipped_without_matplotlib(char_gpt, run, monkeypatch, tmp_path):
  _, summary = run
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
  assert char_gpt.plot_run(str(tmp_path / "plot.png"), [{"step": 1, "loss": 1.0, "lr": 1e-3}], summary) is False
  assert not (tmp_path / "plot.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["--d-model", "30", "--heads", "4"], "--d-model 30 is not divisible by --heads 4"),
    (["--steps", "0"], "--steps: must be a positive integer, got 0"),
    (["--seed", "-1"], "--seed: must be >= 0, got -1"),
    (["--lr", "nan"], "--lr: must be a finite number > 0"),
    (["--placement", "disk"], "--placement: invalid choice"),
    (["--seq-len", "1"], "--seq-len must be at least 2"),
])
def test_bad_flags_exit_with_a_clear_message(char_gpt, capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    char_gpt.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_help_runs_as_a_module_from_the_repo_root():
  env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT))
  result = subprocess.run([sys.executable, "-m", "examples.char_gpt", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr
  for flag in ("--steps", "--batch-size", "--seq-len", "--layers", "--d-model", "--heads", "--lr", "--seed",
               "--placement", "--kernel", "--out-dir", "--sample-chars"):
    assert flag in result.stdout, flag
