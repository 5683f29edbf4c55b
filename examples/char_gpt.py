"""Train a small GPT-style character model (Flax NNX) on the Python standard library's own source.

    python examples/char_gpt.py                  # 1.5 minutes on 2 CPU cores, writes runs/char_gpt-<time>/
    python -m examples.char_gpt --out-dir /tmp/gpt --steps 2000 --layers 4 --d-model 128  # a longer run
    python examples/char_gpt.py --placement device --kernel xla
    python examples/char_gpt.py --stream-layers   # blocks in host memory, one on the device at a time
    python examples/char_gpt.py --help

Run from the repository root with the package importable (``pip install -e .``
or ``PYTHONPATH=.``); needs flax, and matplotlib for the figure.

The text is every ``*.py`` file directly in the standard library's directory
(``os.path.dirname(os.__file__)``), sorted by name and read as UTF-8, so every
machine with Python has it and no download is needed. Every tenth file is held
out for validation. The model is a decoder-only transformer over characters:
token and learned position embeddings, pre-LayerNorm blocks of causal
multi-head self-attention and a GELU MLP, and an output layer tied to the token
embedding.

It trains with ``optax_hybrid.recipe.standard_optimizer`` (gradient clipping,
AdamW with warmup and cosine decay) through ``nnx.Optimizer``; by default the
Adam moments live in ``pinned_host`` memory. The run prints the memory report
once, a progress line with the loss, the learning rate and tokens/s, the
unigram baseline (the entropy of the training text's character frequencies: the
best loss a model that ignores context can reach), the validation loss and a
generated sample, and writes to ``--out-dir`` (default
``runs/char_gpt-<timestamp>``):

* ``metrics.csv``: one row per update: ``step, loss, lr, tokens_per_s,
  val_loss``; ``tokens_per_s`` is empty for step 1 (its time is compilation)
  and ``val_loss`` is empty where it was not measured;
* ``summary.json``: the final numbers, the configuration and the memory report;
* ``char_gpt.png``: loss, learning rate and memory per weight, beside
  ``optax.adamw``'s (needs matplotlib; without it the plot is skipped with one
  printed line).

Losses are in nats per character.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import glob
import json
import math
import os
import sys
import time
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import optax_hybrid
from optax_hybrid.recipe import last_learning_rate, standard_optimizer
from optax_hybrid.report import memory_report

VAL_EVERY = 10  # every tenth file is validation text
FILE_SEPARATOR = "\n\n"
EVAL_TOKENS = 32_768  # validation characters scored per evaluation (the same ones each time)
EVALS = 20  # evaluations during training, besides the one before it
SMOOTH = 20  # final train loss: the mean over this many last updates


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Corpus:
  """The training and validation text, and the files they came from."""

  source: str
  train_files: tuple
  val_files: tuple
  train_text: str
  val_text: str


def load_corpus(source: Optional[str] = None) -> Corpus:
  """The standard library's top-level ``*.py`` files, sorted by name; every tenth one is validation.

  Holding out whole files spread over the alphabet, rather than the tail of
  the concatenation, keeps the validation text as varied as the training text
  and keeps any one file from being on both sides.
  """
  source = source or os.path.dirname(os.__file__)
  paths = sorted(glob.glob(os.path.join(source, "*.py")))
  train, val = [], []
  for i, path in enumerate(paths):
    # errors="replace": a stray non-UTF-8 byte must not stop the run.
    with open(path, encoding="utf-8", errors="replace") as f:
      (val if i % VAL_EVERY == VAL_EVERY - 1 else train).append((os.path.basename(path), f.read()))
  if not val:
    raise RuntimeError(f"found {len(paths)} *.py files in {source}; need at least {VAL_EVERY}")
  join = lambda files: FILE_SEPARATOR.join(text for _, text in files)
  return Corpus(source, tuple(n for n, _ in train), tuple(n for n, _ in val), join(train), join(val))


class Vocab:
  """Characters to ids and back; the characters are those of the whole corpus, sorted."""

  def __init__(self, text: str):
    self.chars = sorted(set(text))
    self.codes = np.array([ord(c) for c in self.chars], np.uint32)

  def __len__(self) -> int:
    return len(self.chars)

  def encode(self, text: str) -> np.ndarray:
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    ids = np.searchsorted(self.codes, codes)
    # searchsorted gives where a code would go; a code not in the table lands
    # on a different code (or past the end).
    found = self.codes[np.minimum(ids, len(self.codes) - 1)] == codes
    if not found.all():
      raise ValueError(f"text holds characters outside the vocabulary: {chr(codes[~found][0])!r}")
    return ids.astype(np.int32)

  def decode(self, ids: Sequence[int]) -> str:
    return "".join(self.chars[int(i)] for i in ids)


def unigram_entropy(ids: np.ndarray, vocab_size: int) -> float:
  """The entropy of the character frequencies of ``ids``, in nats per character."""
  counts = np.bincount(ids, minlength=vocab_size).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


def train_batch(ids: np.ndarray, step: int, batch_size: int, seq_len: int, seed: int):
  """Random windows of the training text; a function of (seed, step) alone, so runs repeat."""
  rng = np.random.default_rng((seed, step))
  starts = rng.integers(0, len(ids) - seq_len - 1, size=batch_size)
  windows = ids[starts[:, None] + np.arange(seq_len + 1)]
  return windows[:, :-1], windows[:, 1:]


def eval_windows(ids: np.ndarray, seq_len: int, batch_size: int):
  """Evenly spaced validation windows (the same every evaluation), in whole batches."""
  count = max(batch_size, EVAL_TOKENS // seq_len // batch_size * batch_size)
  starts = np.linspace(0, len(ids) - seq_len - 1, count).astype(np.int64)
  windows = ids[starts[:, None] + np.arange(seq_len + 1)]
  return windows[:, :-1].reshape(-1, batch_size, seq_len), windows[:, 1:].reshape(-1, batch_size, seq_len)


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------


class CausalSelfAttention(nnx.Module):

  def __init__(self, d_model: int, heads: int, rngs: nnx.Rngs):
    self.heads = heads
    self.qkv = nnx.Linear(d_model, 3 * d_model, rngs=rngs)
    self.out = nnx.Linear(d_model, d_model, rngs=rngs)

  def __call__(self, x):
    b, t, d = x.shape
    qkv = self.qkv(x).reshape(b, t, 3, self.heads, d // self.heads)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    scores = jnp.einsum("bqhc,bkhc->bhqk", q, k) / math.sqrt(d // self.heads)
    # Position q may look at positions k <= q only: what it has to predict is q + 1.
    causal = jnp.tril(jnp.ones((t, t), bool))
    scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return self.out(jnp.einsum("bhqk,bkhc->bqhc", weights, v).reshape(b, t, d))


class Block(nnx.Module):

  def __init__(self, d_model: int, heads: int, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = CausalSelfAttention(d_model, heads, rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc = nnx.Linear(d_model, 4 * d_model, rngs=rngs)
    self.proj = nnx.Linear(4 * d_model, d_model, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln1(x))
    return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class StackedBlocks(nnx.Module):
  """The same blocks with their params stacked on a leading layer axis, run by ``optax_hybrid.scan_layers``.

  Built from the list of blocks (so the same seed initializes the same
  weights) into a block made with ``nnx.vmap``; its params can then live in
  host memory, and each layer visits the device once for its forward and once
  for its backward.
  """

  def __init__(self, blocks: Sequence[Block], d_model: int, heads: int):
    keys = jax.random.split(jax.random.key(0), len(blocks))  # placeholders: overwritten just below
    self.stack = nnx.vmap(lambda key: Block(d_model, heads, nnx.Rngs(key)))(keys)
    nnx.update(self.stack, jax.tree.map(lambda *layers: jnp.stack(layers), *[nnx.state(b) for b in blocks]))

  def __call__(self, x):
    graphdef, state = nnx.split(self.stack)
    return optax_hybrid.scan_layers(lambda x, layer: nnx.merge(graphdef, layer)(x), x, state)


class CharGPT(nnx.Module):

  def __init__(self, vocab_size: int, seq_len: int, layers: int, d_model: int, heads: int, rngs: nnx.Rngs,
               stream_layers: bool = False):
    # Flax's default init (std 1/sqrt(d_model)) starts the tied logits at std
    # about 1, half a nat above uniform guessing; GPT-2's 0.02 starts nearer
    # ln(vocab_size) but learned clearly slower here (2.56 against 2.24 after
    # 150 default steps).
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    # Named *embedding so that the recipe's Flax naming rule leaves it undecayed.
    self.pos_embedding = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq_len, d_model)))
    blocks = [Block(d_model, heads, rngs) for _ in range(layers)]
    self.blocks = StackedBlocks(blocks, d_model, heads) if stream_layers else nnx.List(blocks)
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos_embedding[: tokens.shape[1]]
    if isinstance(self.blocks, StackedBlocks):
      x = self.blocks(x)
    else:
      for block in self.blocks:
        x = block(x)
    # Tied output layer: the logits score x against every character's embedding.
    return self.embed.attend(self.ln_f(x))


def cross_entropy(model: CharGPT, x, y):
  logits = model(x).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def next_logits(model: CharGPT, buffer, t, seq_len: int):
  """The logits of the character at position ``t`` of ``buffer``, from the (up to) ``seq_len`` before it.

  The window always has ``seq_len`` positions, so that one compiled program
  serves every ``t``; near the start it runs past ``t`` into characters not
  yet written, which the causal mask keeps from mattering.
  """
  start = jnp.maximum(0, t - seq_len)
  window = jax.lax.dynamic_slice(buffer, (start,), (seq_len,))
  return model(window[None])[0, t - 1 - start].astype(jnp.float32)


def make_sampler(graphdef, seq_len: int, prompt_len: int, chars: int, temperature: float):
  """A jitted ``(state, prompt_ids, key) -> ids``: the prompt and ``chars`` generated characters."""
  total = prompt_len + chars

  @jax.jit
  def sample(state, prompt, key):
    model = nnx.merge(graphdef, state)
    buffer = jnp.zeros(max(total, seq_len), jnp.int32).at[:prompt_len].set(prompt)

    def body(t, carry):
      buffer, key = carry
      logits = next_logits(model, buffer, t, seq_len)
      key, sub = jax.random.split(key)
      if temperature > 0:
        token = jax.random.categorical(sub, logits / temperature)
      else:
        token = jnp.argmax(logits)
      return buffer.at[t].set(token.astype(jnp.int32)), key

    buffer, _ = jax.lax.fori_loop(prompt_len, total, body, (buffer, key))
    return buffer[:total]

  return sample


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


class Progress:
  """tqdm's progress bar on a terminal; in a log (not a terminal) a plain line every tenth of the run."""

  def __init__(self, total: int, stream=None, lines: int = 10):
    self.total = total
    self.stream = stream or sys.stdout
    self.every = max(1, total // lines)
    tty = hasattr(self.stream, "isatty") and self.stream.isatty()
    self.bar = tqdm(total=total, file=self.stream, unit="step", dynamic_ncols=True, disable=not tty)

  def update(self, step: int, loss: float, lr: float, rate: str) -> None:
    text = f"loss {loss:.4f}  lr {lr:.2e}  {rate}"
    if not self.bar.disable:
      self.bar.set_postfix_str(text, refresh=False)
      self.bar.update(step - self.bar.n)
    elif step == 1 or step % self.every == 0 or step == self.total:
      print(f"step {step:{len(str(self.total))}d}/{self.total}  {text}", file=self.stream, flush=True)

  def note(self, text: str) -> None:
    """A line printed above the bar."""
    tqdm.write(text, file=self.stream)
    self.stream.flush()

  def close(self) -> None:
    self.bar.close()


METRIC_COLUMNS = ("step", "loss", "lr", "tokens_per_s", "val_loss")


def write_metrics(path: str, rows: list) -> None:
  with open(path, "w", newline="") as f:
    writer = csv.writer(f)
    writer.writerow(METRIC_COLUMNS)
    cell = lambda v: "" if v is None else f"{v:.6g}" if isinstance(v, float) else v
    for row in rows:
      writer.writerow([cell(row.get(c)) for c in METRIC_COLUMNS])


def plot_run(path: str, rows: list, summary: dict) -> bool:
  """Loss, learning rate and memory per weight in one figure; False when matplotlib is missing."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return False
  steps = np.array([r["step"] for r in rows])
  loss = np.array([r["loss"] for r in rows])
  fig, (ax_loss, ax_lr, ax_mem) = plt.subplots(
      1, 3, figsize=(16, 4.8), gridspec_kw={"width_ratios": [1.4, 1, 1]})

  ax_loss.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8, label="train (per batch)")
  window = min(SMOOTH, len(loss))
  if window > 1:
    smooth = np.convolve(loss, np.ones(window) / window, mode="valid")
    ax_loss.plot(steps[window - 1:], smooth, color="tab:blue", lw=1.8, label=f"train ({window}-step mean)")
  val = [(0, summary["initial_val_loss"])]
  val += [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
  ax_loss.plot(*zip(*val), "o-", color="tab:orange", lw=1.5, label="validation")
  ax_loss.axhline(summary["unigram_baseline"], color="gray", ls="--",
                  label=f"unigram baseline ({summary['unigram_baseline']:.2f})")
  ax_loss.set(xlabel="step", ylabel="loss (nats per character)", title="Cross-entropy")
  ax_loss.set_ylim(0, max(summary["initial_val_loss"], float(loss.max())) * 1.05)
  ax_loss.legend(loc="upper right", fontsize=8)
  ax_loss.grid(alpha=0.3)

  ax_lr.plot(steps, [r["lr"] for r in rows], color="tab:green")
  ax_lr.set(xlabel="step", ylabel="learning rate", title="Learning rate (warmup, cosine to 10%)")
  ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
  ax_lr.grid(alpha=0.3)

  memory = summary["memory"]
  # Whatever components the report splits into; the ones with no bytes are left out.
  names = {"params": "params", "gradients": "gradients", "moments": "Adam moments",
           "adam_state": "Adam moments", "master_weights": "master weights", "other_state": "other state"}
  # Device and host always; any further memory the report knows only when used.
  splits = memory["by_component"].values()
  kinds = [k for k in dict.fromkeys(k for split in splits for k in split)
           if k in ("device", "host") or any(split[k] for split in splits)]
  # The comparison: optax.adamw keeps the same params and gradients, and its
  # whole state (measured from its init), on the device.
  adamw = {"params": sum(memory["by_component"]["params"].values()),
           "gradients": sum(memory["by_component"]["gradients"].values()),
           "moments": memory["optax_adamw_state_bytes"]}
  labels = [f"{k} memory" for k in kinds] + ["optax.adamw:\ndevice memory"]
  bottom = np.zeros(len(labels))
  for i, (component, split) in enumerate(memory["by_component"].items()):
    per_weight = np.array([split.get(k, 0) for k in kinds] + [adamw.get(component, 0)]) / memory["num_params"]
    if not per_weight.any():
      continue
    bars = ax_mem.bar(labels, per_weight, bottom=bottom, color=f"C{i}",
                      label=names.get(component, component.replace("_", " ")), width=0.55)
    bars[-1].set(hatch="//", edgecolor="white", alpha=0.75)
    bottom += per_weight
  for x, total in enumerate(bottom):
    ax_mem.text(x, total + 0.2, f"{total:.2f} B", ha="center")
  ax_mem.axvline(len(kinds) - 0.5, color="gray", lw=0.8, ls=":")
  ax_mem.set_ylim(0, max(18.0, bottom.max() + 1.5))
  ax_mem.set(ylabel="bytes per weight", title="Training memory per weight",
             xlabel=f"{memory['num_params']:,} weights, Adam moments in {summary['placement']}")
  ax_mem.legend(fontsize=8, loc="upper left")
  ax_mem.grid(alpha=0.3, axis="y")

  layers = f"{summary['layers']} layer{'s' if summary['layers'] > 1 else ''}"
  fig.suptitle(f"char_gpt: {layers}, d_model {summary['d_model']}, {summary['heads']} heads, "
               f"context {summary['seq_len']}, {summary['steps']} steps of {summary['batch_size']} windows; "
               f"val loss {summary['final_val_loss']:.3f} vs unigram {summary['unigram_baseline']:.3f}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return True


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def positive_int(text: str) -> int:
  value = int(text)
  if value < 1:
    raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
  return value


def nonnegative_int(text: str) -> int:
  value = int(text)
  if value < 0:
    raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
  return value


def positive_float(text: str) -> float:
  value = float(text)
  if not (math.isfinite(value) and value > 0):
    raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
  return value


def nonnegative_float(text: str) -> float:
  value = float(text)
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
  return value


def make_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="char_gpt", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  add = parser.add_argument
  add("--steps", type=positive_int, default=400, help="optimizer updates (default 400)")
  add("--batch-size", type=positive_int, default=32, help="windows per batch (default 32)")
  add("--seq-len", type=positive_int, default=96, help="context length in characters (default 96)")
  add("--layers", type=positive_int, default=2, help="transformer blocks (default 2)")
  add("--d-model", type=positive_int, default=96, help="model width (default 96)")
  add("--heads", type=positive_int, default=4, help="attention heads; must divide --d-model (default 4)")
  add("--lr", type=positive_float, default=6e-3, help="peak learning rate (default 6e-3)")
  add("--seed", type=nonnegative_int, default=0,
      help="seed of the initialization, the batches and the sample (default 0)")
  add("--placement", choices=("pinned_host", "device"), default="pinned_host",
      help="where the Adam moments live between steps (default pinned_host)")
  add("--kernel", choices=("auto", "xla", "native", "pallas"), default="auto",
      help="hybrid_adamw's update kernel (default auto; pallas off a GPU runs interpreted: slow)")
  add("--stream-layers", action="store_true",
      help="keep the blocks' params stacked in pinned_host memory and run them with optax_hybrid.scan_layers "
           "(each layer on the device only for its forward and its backward; updated on the host)")
  add("--moment-format", choices=("float32", "bfloat16", "8bit"), default=None,
      help="how the Adam moments are stored (default: in the params' dtype, float32); 8bit: block-wise "
           "8-bit codes and scales, 2.03 bytes per weight for both moments")
  add("--out-dir", default=None,
      help="run folder (default runs/char_gpt-<timestamp> under the current directory)")
  add("--sample-chars", type=nonnegative_int, default=200,
      help="characters to generate at the end; 0 skips sampling (default 200)")
  add("--prompt", default="def ", help="the text generation starts from (default 'def ')")
  add("--temperature", type=nonnegative_float, default=0.8,
      help="sampling temperature; 0 picks the most likely character (default 0.8)")
  return parser


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
  parser = make_parser()
  args = parser.parse_args(argv)
  if args.d_model % args.heads:
    parser.error(f"--d-model {args.d_model} is not divisible by --heads {args.heads}: "
                 "each head takes d_model / heads dimensions")
  if args.seq_len < 2:
    parser.error(f"--seq-len must be at least 2, got {args.seq_len}")
  if args.sample_chars and not args.prompt:
    parser.error("--prompt must not be empty when sampling (--sample-chars > 0)")
  if args.placement not in optax_hybrid.available_memory_kinds():
    parser.error(f"--placement {args.placement}: this backend has memory kinds "
                 f"{', '.join(optax_hybrid.available_memory_kinds())}")
  if args.stream_layers and "pinned_host" not in optax_hybrid.available_memory_kinds():
    parser.error("--stream-layers needs pinned_host memory, which this backend lacks")
  args.parser = parser
  return args


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> dict:
  """Trains, evaluates, samples and writes the run folder; returns the summary (also in summary.json)."""
  started = time.perf_counter()
  args = parse_args(argv)
  corpus = load_corpus()
  vocab = Vocab(corpus.train_text + corpus.val_text)
  train_ids, val_ids = vocab.encode(corpus.train_text), vocab.encode(corpus.val_text)
  if len(val_ids) < 2 * (args.seq_len + 1):
    args.parser.error(f"--seq-len {args.seq_len} is too long for the {len(val_ids):,} validation characters")
  bad = sorted(set(args.prompt) - set(vocab.chars))
  if args.sample_chars and bad:
    args.parser.error(f"--prompt holds characters the corpus never uses: {''.join(bad)!r}")
  baseline = unigram_entropy(train_ids, len(vocab))
  out_dir = args.out_dir or os.path.join("runs", time.strftime("char_gpt-%Y%m%d-%H%M%S"))
  os.makedirs(out_dir, exist_ok=True)
  print(f"corpus: {len(corpus.train_files)} train files ({len(train_ids):,} chars), {len(corpus.val_files)} "
        f"validation files ({len(val_ids):,} chars) from {corpus.source}; vocabulary {len(vocab)} characters")
  print(f"unigram baseline {baseline:.4f} nats/char (uniform over the vocabulary: {math.log(len(vocab)):.4f})")

  # Built under jit: one compiled program instead of a compilation per eager
  # initializer (seconds of a short run).
  model = nnx.jit(lambda: CharGPT(len(vocab), args.seq_len, args.layers, args.d_model, args.heads,
                                  nnx.Rngs(args.seed), stream_layers=args.stream_layers))()
  if args.stream_layers:  # the stacked blocks' params move to host memory; the host tier updates them there
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    nnx.update(model.blocks, jax.device_put(nnx.state(model.blocks), host))
  tx = standard_optimizer(args.lr, args.steps, state_memory_kind=args.placement, kernel=args.kernel,
                          moment_format=args.moment_format)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  # A step that moves state between memory kinds returns committed arrays: the
  # weights and nnx.Optimizer's step counter, uncommitted so far, are committed
  # now, or the second call would compile the step again.
  nnx.update((model, optimizer), optax_hybrid.commit(nnx.state((model, optimizer))))
  report = memory_report(nnx.state(model, nnx.Param), optimizer.opt_state)
  layers = f"{args.layers} layer{'s' if args.layers > 1 else ''}"
  print(f"model: {layers}, d_model {args.d_model}, {args.heads} heads, context {args.seq_len}; "
        f"Adam moments in {args.placement} memory"
        + ("; blocks streamed from pinned_host (scan_layers), updated on the host" if args.stream_layers else ""))
  print(report)

  # Donating model and optimizer together lets XLA update weights and moments
  # in place (the donation advice of docs/optimizer.md: params and state as one).
  @nnx.jit(donate_argnums=(0, 1))
  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(cross_entropy)(model, x, y)
    optimizer.update(model, grads)
    return loss, last_learning_rate(optimizer.opt_state)

  eval_step = nnx.jit(cross_entropy)
  eval_x, eval_y = eval_windows(val_ids, args.seq_len, args.batch_size)

  def evaluate() -> float:
    return float(np.mean([eval_step(model, x, y) for x, y in zip(eval_x, eval_y)]))

  initial_val = evaluate()
  print(f"validation loss before training {initial_val:.4f}")
  eval_every = max(1, args.steps // EVALS)
  tokens_per_step = args.batch_size * args.seq_len
  progress = Progress(args.steps)
  rows = []
  timed_tokens, timed_seconds, compile_s = 0, 0.0, 0.0
  train_started = time.perf_counter()
  tick = time.perf_counter()
  for step in range(1, args.steps + 1):
    x, y = train_batch(train_ids, step, args.batch_size, args.seq_len, args.seed)
    loss, lr = train_step(model, optimizer, x, y)
    loss, lr = float(loss), float(lr)  # waits for the step: the time below is the step's
    now = time.perf_counter()
    if step == 1:
      compile_s, tokens_per_s = now - tick, None
    else:
      timed_tokens += tokens_per_step
      timed_seconds += now - tick
      tokens_per_s = tokens_per_step / (now - tick)
    row = {"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s, "val_loss": None}
    rows.append(row)
    if not math.isfinite(loss):
      progress.close()
      raise FloatingPointError(f"the loss is {loss} at step {step}; lower --lr")
    rate = f"{timed_tokens / timed_seconds:,.0f} tok/s" if timed_seconds else f"compiled in {compile_s:.1f} s"
    progress.update(step, loss, lr, rate)
    if step % eval_every == 0 or step == args.steps:
      row["val_loss"] = evaluate()
      progress.note(f"step {step}: validation loss {row['val_loss']:.4f}")
    tick = time.perf_counter()  # evaluation time is not training throughput
  progress.close()
  train_s = time.perf_counter() - train_started

  final_train = float(np.mean([r["loss"] for r in rows[-SMOOTH:]]))
  final_val = rows[-1]["val_loss"]
  tokens_per_s = timed_tokens / timed_seconds if timed_seconds else float("nan")
  print(f"trained {args.steps} steps in {train_s:.1f} s (first step, with compilation, {compile_s:.1f} s; "
        f"{tokens_per_s:,.0f} tokens/s after it)")
  print(f"final train loss {final_train:.4f} (mean of the last {min(SMOOTH, len(rows))} steps), validation loss "
        f"{final_val:.4f}, unigram baseline {baseline:.4f} nats/char")

  sample = None
  if args.sample_chars:
    graphdef, state = nnx.split(model)
    sampler = make_sampler(graphdef, args.seq_len, len(args.prompt), args.sample_chars, args.temperature)
    ids = sampler(state, jnp.asarray(vocab.encode(args.prompt)), jax.random.key(args.seed))
    sample = vocab.decode(np.asarray(ids))
    how = f"temperature {args.temperature}" if args.temperature > 0 else "greedy"
    print(f"sample ({args.sample_chars} characters, {how}):\n{'-' * 60}\n{sample}\n{'-' * 60}")

  mu = optax.tree_utils.tree_get(optimizer.opt_state, "mu")
  summary = {
      "steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len, "layers": args.layers,
      "d_model": args.d_model, "heads": args.heads, "lr": args.lr, "seed": args.seed,
      "placement": args.placement, "kernel": args.kernel, "moment_format": args.moment_format,
      "stream_layers": args.stream_layers,
      "corpus": {"source": corpus.source, "train_files": len(corpus.train_files),
                 "val_files": len(corpus.val_files), "train_chars": int(len(train_ids)),
                 "val_chars": int(len(val_ids)), "vocab_size": len(vocab)},
      "unigram_baseline": baseline, "uniform_loss": math.log(len(vocab)),
      "initial_val_loss": initial_val, "first_train_loss": rows[0]["loss"],
      "final_train_loss": final_train, "final_val_loss": final_val,
      "tokens_per_s": tokens_per_s, "params": report.num_params,
      "compile_s": compile_s, "train_s": train_s,
      "moment_memory_kinds": sorted({str(leaf.sharding.memory_kind) for leaf in jax.tree.leaves(mu)}),
      "memory": {
          "num_params": report.num_params, "device_bytes": report.device_bytes, "host_bytes": report.host_bytes,
          "bytes_per_weight_device": report.bytes_per_weight_device,
          "bytes_per_weight_host": report.bytes_per_weight_host,
          "saved_device_bytes": report.saved_device_bytes,
          "serving_bytes_per_weight": report.serving_bytes_per_weight,
          "weights_by_tier": report.weights_by_tier, "by_tier": report.by_tier,
          "by_component": report.by_component,
          # optax.adamw's state for the same params, all in device memory: the figure's comparison.
          "optax_adamw_state_bytes": sum(
              x.size * x.dtype.itemsize
              for x in jax.tree.leaves(jax.eval_shape(optax.adamw(args.lr).init, nnx.state(model, nnx.Param))))},
      "sample": sample, "out_dir": os.path.abspath(out_dir),
  }
  write_metrics(os.path.join(out_dir, "metrics.csv"), rows)
  plot = os.path.join(out_dir, "char_gpt.png")
  if plot_run(plot, rows, summary):
    summary["plot"] = os.path.abspath(plot)
  else:
    summary["plot"] = None
    print("matplotlib is not installed: skipping the plot (pip install matplotlib)")
  summary["wall_time_s"] = time.perf_counter() - started
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  print(f"wrote {out_dir}/: metrics.csv, summary.json{', char_gpt.png' if summary['plot'] else ''} "
        f"({summary['wall_time_s']:.1f} s in all)")
  return summary


if __name__ == "__main__":
  main()
