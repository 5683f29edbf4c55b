"""AdamW step time on this machine: our kernels against optax.adamw and torch's fused AdamW.

    python benchmarks/step.py [--scale 1.0] [--reps 9] [--trees one,many,gpt2,many16] [--kernels xla,native]
                              [--dtype float32] [--compare-library LABEL=PATH ...] [--compare-isa avx2 ...]
                              [--moment-formats float32,8bit] [--variants 'native.*tx.step']
                              [--torch default,passive] [--pass-through] [--loop SECONDS]
                              [--layouts leaves,packed] [--master float32] [--params leaves,flat]

Trees: one leaf of 16M params; 1024 leaves of 16K; the GPT-2-small shapes
(124M params, 148 leaves; --scale shrinks every dimension's product by that
factor); ``many16``, 1024 leaves of 16 (the buffers of ``many`` with next to
no arithmetic: what a step costs per buffer). Every JAX variant is a donated,
jitted training-loop step (update and apply), warmed up, then timed in
interleaved rounds, each round in a new (seeded) random order so that no
variant always follows the same one (in a fixed order, the variant after the
native update+apply, whose full-size update buffer is allocated afresh each
step, measured slower in 7 of 9 runs); medians are reported.

torch's ``AdamW(fused=True)`` runs as its users run it: in a process of its
own (``--torch-worker``, started by this script), with its own threads and
environment, timed there, one step per round. ``--torch default`` leaves
OpenMP's wait policy at its default (idle threads spin a while, then sleep:
the "torch/ours" column); ``passive`` sets ``OMP_WAIT_POLICY=PASSIVE`` (threads
sleep at once), the setting of the figures before 2026-12-01, when this
script set it for torch in its own process. Each policy is a row.

``--pass-through``: a donated step that takes the params, m, v and the
gradients and returns the first three untouched: the runtime's cost per
buffer. ``--loop SECONDS``: no timing; each variant's step back to back for
that long, the process id printed first, so that a profiler can attach
(``perf record -F 499 -g -p PID``).

Columns: median ms; params per second; GB/s counting the bytes per param an
AdamW step must move (read p, g, m, v; write p, m, v: 28 for fp32); that as a
fraction of the memory bandwidth measured in the same run (a donated in-place
scale of a 256 MB buffer, counting its 8 bytes per element); and the ratio of
optax's and torch's times to ours (> 1: we are faster). Figures, not a test.

--dtype bfloat16 / float16: params and gradients in that dtype, our moments in
float32 (HybridAdam's mixed precision; optax.adamw gets mu_dtype=float32, its nu
follows the params); torch is left out.

--compare-library LABEL=PATH (repeatable): another build of native_cpu.cc (for
example today's source built with -march=native, or an older commit's) timed
in the same interleaved rounds as the installed one, as "ours native LABEL"
rows. Each is registered with XLA under its own custom-call name, and each
variant's lowered step is checked to call the build it is named after. To
compare two builds, pass both this way (a copy of the installed one too) with
--kernels none: the installed build's own rows measured a few percent slower
than a copy of the very same library loaded this way (2026-12-01), so only
builds loaded alike compare fairly.
The other build is called the way this checkout calls the kernel: a build
from before the 8-bit moments (whose call adds the code tables operand and the
block_size and quantized attributes) fails with "Wrong number of attributes";
time it with the step.py of its own commit.
--compare-isa NAME (repeatable): the installed build with its work loop forced to
that instruction set (a copy of it, loaded with OPTAX_HYBRID_NATIVE_ISA=NAME),
as "ours native isa NAME" rows.
--layouts leaves,packed: our variants once per state layout (``packed``:
``state_layout="packed"``, the state in a few flat buffers; device moments;
rows "ours KERNEL packed, ..."). --master float32 (or kahan, stochastic): our
variants with master weights (with --dtype bfloat16: bf16 params, a float32
master copy, float32 moments).
--params leaves,flat: optax.adamw and our variants once per form of the params
(``flat``: the same leaves as one ``optax_hybrid.FlatParams``, one buffer per
dtype, rows "..., flat params"; the step's params and gradients are then a few
buffers, not one per leaf); torch keeps its tensor per leaf, as its users run it.
--moment-formats: our variants once per moment format (``8bit``: 8-bit
block-wise moments, rows named "... 8bit moments ..."; the GB/s column still
counts the float32 step's bytes). --variants: only the variants whose names
match this regular expression (optax.adamw, the ratios' reference, always runs).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import math
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from unittest import mock

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir))
import optax_hybrid  # noqa: E402
from optax_hybrid.kernels import native_cpu  # noqa: E402

LR, WD = 1e-3, 0.1
MOMENT_BYTES = 4  # our moments are float32 whatever the param dtype


def bytes_per_param(dtype) -> int:
  """Read p, g, m, v and write p, m, v once: 28 for float32."""
  return 3 * jnp.dtype(dtype).itemsize + 4 * MOMENT_BYTES


def gpt2_small_shapes(scale: float) -> dict[str, tuple[int, ...]]:
  d, vocab, ctx, layers = 768, 50257, 1024, 12
  shapes = {"wte": (vocab, d), "wpe": (ctx, d), "ln_f.scale": (d,), "ln_f.bias": (d,)}
  for i in range(layers):
    for name, shape in {
        "ln_1.scale": (d,), "ln_1.bias": (d,), "attn.c_attn.w": (d, 3 * d), "attn.c_attn.b": (3 * d,),
        "attn.c_proj.w": (d, d), "attn.c_proj.b": (d,), "ln_2.scale": (d,), "ln_2.bias": (d,),
        "mlp.c_fc.w": (d, 4 * d), "mlp.c_fc.b": (4 * d,), "mlp.c_proj.w": (4 * d, d), "mlp.c_proj.b": (d,),
    }.items():
      shapes[f"h{i}.{name}"] = shape
  if scale != 1.0:
    shapes = {k: (max(1, int(round(math.prod(s) * scale))),) for k, s in shapes.items()}
  return shapes


TREE_NAMES = {"one": "1 leaf x 16M", "many": "1024 leaves x 16K", "gpt2": "GPT-2 small shapes",
              "many16": "1024 leaves x 16"}


def tree_shapes(key: str, scale: float) -> dict[str, tuple[int, ...]]:
  """The leaf shapes of tree ``key`` (``"one"``, ``"many"`` or ``"gpt2"``)."""
  if key == "one":
    return {"w": (max(1, int(16 * 2**20 * scale)),)}
  if key == "many":
    return {f"l{i:04d}": (max(1, int(16384 * scale)),) for i in range(1024)}
  if key == "gpt2":
    return gpt2_small_shapes(scale)
  if key == "many16":  # the buffers of "many" with next to no arithmetic: the per-buffer cost alone
    return {f"l{i:04d}": (max(1, int(16 * scale)),) for i in range(1024)}
  raise SystemExit(f"--trees: unknown tree {key!r}; choose from {', '.join(TREE_NAMES)}")


class JaxVariant:
  """A jitted step, compiled ahead; ``custom_call``: the native build's target name its step must call.

  ``flat``: the params and gradients as :class:`optax_hybrid.FlatParams` (one buffer per dtype).
  """

  def __init__(self, name, shapes, dtype, make_step, make_state, custom_call=None, flat=False):
    self.name = name
    device = jax.devices()[0]
    self.params = jax.device_put({k: jnp.full(s, 0.5, dtype) for k, s in shapes.items()}, device)
    self.grads = jax.device_put({k: jnp.full(s, 1e-3, dtype) for k, s in shapes.items()}, device)
    if flat:  # the same leaves laid out in one buffer per dtype: the step takes and returns a FlatParams
      self.params, self.grads = optax_hybrid.flatten_params(self.params), optax_hybrid.flatten_params(self.grads)
    self.state = make_state(self.params)
    with mock.patch.object(native_cpu, "TARGET", custom_call or native_cpu.TARGET):
      lowered = make_step().lower(self.params, self.state, self.grads)
    called = set(re.findall(r"custom_call @(optax_hybrid_adamw_\w*cpu\w*)\(", lowered.as_text()))
    if called != ({custom_call} if custom_call else set()):
      raise SystemExit(f"{name}: the lowered step calls {sorted(called)}, not {custom_call}")
    self.step = lowered.compile()

  def run(self) -> float:
    """One step; returns its time in seconds."""
    start = time.perf_counter()
    self.params, self.state = self.step(self.params, self.state, self.grads)
    jax.block_until_ready((self.params, self.state))
    return time.perf_counter() - start

  def close(self):
    del self.params, self.state, self.grads


# torch's variants: its fused AdamW as its users run it, in a process of its
# own with its own threads and defaults (OpenMP's default wait policy: idle
# threads spin a while before sleeping), and, for comparison with the figures
# of 2026-11-29/30, with OMP_WAIT_POLICY=PASSIVE (threads sleep at once, so
# each of the step's per-tensor parallel loops wakes them: slow on many leaves).
TORCH = "torch AdamW(fused=True)"
TORCH_POLICIES = {"default": (TORCH, {}),
                  "passive": (f"{TORCH}, OMP_WAIT_POLICY=PASSIVE", {"OMP_WAIT_POLICY": "PASSIVE"})}


class TorchVariant:
  """torch's step in a worker process (``--torch-worker``), timed there; ``environment`` added to its defaults."""

  def __init__(self, name, tree, scale, environment):
    self.name = name
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--torch-worker", tree, str(scale)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env={**env, **environment})
    ready = self.proc.stdout.readline().split()
    if not ready or ready[0] != "ready":
      raise SystemExit(f"{name}: the torch worker did not start")
    self.version = " ".join(ready[1:])

  def run(self) -> float:
    self.proc.stdin.write("step\n")
    self.proc.stdin.flush()
    return float(self.proc.stdout.readline())

  def close(self):
    self.proc.stdin.write("quit\n")
    self.proc.stdin.flush()
    self.proc.wait()


def torch_worker(tree: str, scale: float) -> None:
  """The worker's loop: one step per "step" line read, its time printed; "quit" ends it."""
  import torch
  params = [torch.full(s, 0.5, requires_grad=True) for s in tree_shapes(tree, scale).values()]
  for p in params:
    p.grad = torch.full(p.shape, 1e-3)
  opt = torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
  print(f"ready torch {torch.__version__} ({torch.get_num_threads()} threads)", flush=True)
  for line in sys.stdin:
    if line.strip() != "step":
      break
    start = time.perf_counter()
    opt.step()
    print(time.perf_counter() - start, flush=True)


def optax_contract_step(tx):
  def step(p, s, g):
    u, s = tx.update(g, s, p)
    return optax_hybrid.apply_updates(p, u), s
  return jax.jit(step, donate_argnums=(0, 1))


def compared_library(spec: str, isa: str | None = None) -> tuple[str, str]:
  """Loads LABEL=PATH, another build of native_cpu.cc, under its own target name; returns (label, target).

  ``isa``: the OPTAX_HYBRID_NATIVE_ISA it loads with (the library reads it then).
  """
  label, sep, path = spec.partition("=")
  if not sep or not label or not path:
    raise SystemExit(f"--compare-library {spec!r}: expected LABEL=PATH")
  with mock.patch.dict(os.environ, {} if isa is None else {native_cpu.ISA_VARIABLE: isa}):
    library = ctypes.CDLL(os.path.abspath(path))
  if isa is not None:
    library.OptaxHybridIsa.restype = ctypes.c_char_p
    if library.OptaxHybridIsa() != isa.encode():
      raise SystemExit(f"--compare-isa {isa}: the library runs {library.OptaxHybridIsa()}")
  target = f"{native_cpu.TARGET}_{re.sub(r'[^A-Za-z0-9]', '_', label)}"
  jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(library.OptaxHybridAdamWCpu), platform="cpu")
  _compared_libraries.append(library)  # keep it loaded
  return label, target


_compared_libraries = []


def installed_library_with_isa(isa: str, scratch: str) -> tuple[str, str]:
  """A copy of the installed build (a path never loaded before, so it reads the variable anew) forced to ``isa``."""
  here = os.path.dirname(native_cpu.__file__)
  built = next(p for s in importlib.machinery.EXTENSION_SUFFIXES if os.path.exists(p := f"{here}/_native_cpu{s}"))
  copy = shutil.copy(built, os.path.join(scratch, f"isa_{isa}.so"))
  return compared_library(f"isa {isa}={copy}", isa)


def pass_through_step(p, s, g):
  """The step's buffers in and out, donated, with no arithmetic: what the runtime costs per buffer."""
  del g
  return p, s


def variants(shapes, dtype, torch_policies, compared, kernels=("xla", "native"), moment_formats=("float32",),
             wanted=None, tree=None, scale=1.0, pass_through=False, layouts=("leaves",), master=None,
             params_forms=("leaves",)):
  """Makers of the variants to time.

  ``torch_policies``: keys of :data:`TORCH_POLICIES` to time torch with (its
  worker builds ``tree`` at ``scale``); ``compared``: (label, target) of other
  native builds, each timed in the tx.step variants; ``moment_formats``: our
  variants once per format; ``wanted``: a regular expression the names must
  match (None: all); ``layouts``: our variants once per ``state_layout``
  (``packed``: device moments only); ``master``: our ``master=`` option;
  ``params_forms``: optax.adamw and our variants once per form of the params
  (``flat``: a :class:`optax_hybrid.FlatParams`, rows named "..., flat params").
  """
  out = []
  for form in params_forms:
    out += jax_variants(shapes, dtype, compared, kernels, moment_formats, layouts, master, form == "flat")
  if pass_through:  # params, m and v in and out (donated), gradients in, as a float32 step
    name = "pass-through: params, m, v donated, no arithmetic"
    moments = lambda p: jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), (p, p))
    out.append((name, lambda name=name: JaxVariant(
        name, shapes, dtype, lambda: jax.jit(pass_through_step, donate_argnums=(0, 1)), moments)))
  if dtype == jnp.float32:
    for policy in torch_policies:
      name, environment = TORCH_POLICIES[policy]
      out.append((name, lambda name=name, environment=environment: TorchVariant(name, tree, scale, environment)))
  keep = lambda name: wanted is None or name == "optax.adamw" or re.search(wanted, name) is not None
  return [make for name, make in out if keep(name)]


def jax_variants(shapes, dtype, compared, kernels, moment_formats, layouts, master, flat):
  """(name, maker) of optax.adamw and our variants, on params as a tree or (``flat``) as FlatParams."""
  builds = [("xla", "", None)] if "xla" in kernels else []
  builds += [("native", "", native_cpu.TARGET)] if "native" in kernels and native_cpu.available() else []
  builds += [("native", f" {label}", target) for label, target in compared]
  out, form = [], ", flat params" if flat else ""
  tx = optax.adamw(LR, weight_decay=WD, **({} if dtype == jnp.float32 else {"mu_dtype": jnp.float32}))
  out.append((f"optax.adamw{form}", lambda: JaxVariant(f"optax.adamw{form}", shapes, dtype, lambda: jax.jit(
      lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx.update(g, s, p)), donate_argnums=(0, 1)),
      tx.init, flat=flat)))
  for moment_format, layout in ((f, l) for f in moment_formats for l in layouts):
    if moment_format == "float32":  # the rows' names unchanged
      moments, shown = ({} if dtype == jnp.float32 else {"mu_dtype": jnp.float32, "nu_dtype": jnp.float32}), ""
    else:
      moments, shown = {"moment_format": moment_format}, f" {moment_format}"
    options = {**moments, "state_layout": layout, **({} if master is None else {"master": master})}
    mastered = "" if master is None else f", {master} master"
    packed = " packed" if layout == "packed" else ""
    for kernel, label, target in builds:
      if packed and label:
        continue  # a compared build is timed with one array per leaf
      if target is not None and packed:
        target = native_cpu.PACKED_TARGET
      if master is not None and dtype != jnp.float32:
        target = None  # the native loops take no master copy: the XLA rule steps it
      for memory in ("device",) if packed else ("device", "pinned_host"):
        ours = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, kernel=kernel, state_memory_kind=memory, **options)
        name = f"ours {kernel}{label}{packed}, {memory}{shown} moments{mastered}, tx.step{form}"
        out.append((name, lambda ours=ours, name=name, target=target: JaxVariant(
            name, shapes, dtype, lambda: jax.jit(ours.step, donate_argnums=(0, 1)), ours.init, target, flat)))
      if not label:
        ours = optax_hybrid.hybrid_adamw(LR, weight_decay=WD, kernel=kernel, **options)
        name = f"ours {kernel}{packed}, device{shown} moments{mastered}, update+apply{form}"
        out.append((name, lambda ours=ours, name=name, target=target: JaxVariant(
            name, shapes, dtype, lambda: optax_contract_step(ours), ours.init, target, flat)))
  return out


def loop(built, seconds):
  """Each variant's step back to back for ``seconds`` (a profiler attaches to this process meanwhile)."""
  for v in built:
    for _ in range(2):
      v.run()
  print(f"pid {os.getpid()}", flush=True)
  for v in built:
    steps, end = 0, time.perf_counter() + seconds
    print(f"looping: {v.name}", flush=True)
    while time.perf_counter() < end:
      v.run()
      steps += 1
    print(f"  {steps} steps, {seconds / steps * 1e3:.1f} ms per step", flush=True)
    v.close()


def copy_bandwidth(reps):
  x = jnp.ones((64 * 2**20,), jnp.float32)  # 256 MB
  scale = jax.jit(lambda x: x * 1.0000001, donate_argnums=0)
  for _ in range(3):
    x = scale(x)
  jax.block_until_ready(x)
  times = []
  for _ in range(reps):
    t = time.perf_counter()
    x = scale(x)
    jax.block_until_ready(x)
    times.append(time.perf_counter() - t)
  return x.size * 8 / statistics.median(times) / 1e9


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  if argv[:1] == ["--torch-worker"]:
    return torch_worker(argv[1], float(argv[2]))
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--scale", type=float, default=1.0, help="shrink every tree by this factor")
  parser.add_argument("--reps", type=int, default=9, help="timed rounds (default 9)")
  parser.add_argument("--trees", default="one,many,gpt2", help="comma-separated subset of one,many,gpt2,many16")
  parser.add_argument("--kernels", default="xla,native",
                      help="our kernels to time (default xla,native; none: only optax.adamw and the compared builds)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                      help="params and gradients (default float32); our moments are float32")
  parser.add_argument("--compare-library", action="append", default=[], metavar="LABEL=PATH",
                      help="another build of native_cpu.cc to time side by side (repeatable)")
  parser.add_argument("--compare-isa", action="append", default=[], choices=("avx512vbmi", "avx512", "avx2", "baseline"),
                      help="the installed build forced to this instruction set, side by side (repeatable)")
  parser.add_argument("--moment-formats", default="float32",
                      help="comma-separated moment formats of our variants: float32 (default), 8bit")
  parser.add_argument("--layouts", default="leaves",
                      help="comma-separated state layouts of our variants: leaves (default), packed "
                           "(state_layout='packed': device moments only, rows named '... packed, ...')")
  parser.add_argument("--params", default="leaves",
                      help="comma-separated forms of the params for optax.adamw and our variants: leaves (default: "
                           "one array per leaf), flat (optax_hybrid.flatten_params: one buffer per dtype; rows "
                           "named '..., flat params'); torch keeps one tensor per leaf")
  parser.add_argument("--master", default=None, choices=("float32", "kahan", "stochastic"),
                      help="our variants with this master= (for --dtype bfloat16 / float16)")
  parser.add_argument("--variants", default=None,
                      help="a regular expression; keep the variants whose names match it (default: all)")
  parser.add_argument("--pass-through", action="store_true",
                      help="also time a donated step that passes params, m and v through with no arithmetic")
  parser.add_argument("--loop", type=float, default=0.0, metavar="SECONDS",
                      help="instead of timing: run each variant's step back to back for SECONDS, for a "
                           "profiler to attach (perf record -p PID); prints the pid and each variant's name")
  parser.add_argument("--torch", default="default,passive",
                      help="torch's OpenMP wait policies to time it with, each in its own process: default "
                           "(as its users run it; the torch/ours column), passive (OMP_WAIT_POLICY=PASSIVE); "
                           "none: no torch (default: default,passive)")
  args = parser.parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  compared = [compared_library(spec) for spec in args.compare_library]
  scratch = tempfile.mkdtemp(prefix="optax_hybrid_step_")
  compared += [installed_library_with_isa(isa, scratch) for isa in args.compare_isa]
  torch_policies = [p for p in args.torch.split(",") if p and p != "none"]
  if unknown := set(torch_policies) - set(TORCH_POLICIES):
    raise SystemExit(f"--torch: unknown {sorted(unknown)}; choose from default, passive, none")
  if importlib.util.find_spec("torch") is None:
    torch_policies = []
  torch_note = "torch in its own process" if torch_policies else "torch not installed or not timed"
  print("command: python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__), *argv]))
  print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; jax {jax.__version__}, "
        f"optax {optax.__version__}, {torch_note}; native kernel: "
        f"{f'built, isa {native_cpu.isa()}' if native_cpu.available() else native_cpu.why_unavailable()}; "
        f"{args.dtype} params")
  for label, target in compared:
    print(f"compared: ours native {label} ({target})")
  bandwidth = copy_bandwidth(args.reps)
  print(f"memory bandwidth (donated in-place scale, 8 B/element): {bandwidth:.1f} GB/s")
  for tree in args.trees.split(","):
    tree_name, shapes = TREE_NAMES.get(tree, tree), tree_shapes(tree, args.scale)
    n_params = sum(math.prod(s) for s in shapes.values())
    built = [make() for make in variants(shapes, dtype, torch_policies, compared, args.kernels.split(","),
                                         args.moment_formats.split(","), args.variants, tree, args.scale,
                                         args.pass_through, args.layouts.split(","), args.master,
                                         args.params.split(","))]
    if args.loop:
      loop(built, args.loop)
      continue
    for v in built:
      if isinstance(v, TorchVariant):
        print(f"{v.name}: {v.version}")
    for v in built:  # warm-up: compile and touch every buffer
      for _ in range(2):
        v.run()
    times = {v.name: [] for v in built}
    order = random.Random(0)
    for _ in range(args.reps):  # interleaved rounds
      for v in order.sample(built, len(built)):
        times[v.name].append(v.run())
    for v in built:
      v.close()
    med = {k: statistics.median(t) for k, t in times.items()}
    moved = bytes_per_param(dtype)
    width = max(42, *map(len, med))
    print(f"\n{tree_name}: {n_params / 1e6:.1f}M params, {len(shapes)} leaves")
    print(f"| {'variant':<{width}} | {'ms':>7} | {'Mparams/s':>9} | {f'GB/s @{moved}B':>9} | {'of bw':>5} | "
          f"{'optax/ours':>10} | {'torch/ours':>10} |")
    print(f"|{'-' * (width + 2)}|{'-' * 9}|{'-' * 11}|{'-' * 11}|{'-' * 7}|{'-' * 12}|{'-' * 12}|")
    torch_time = med.get(TORCH)
    for name, t in med.items():
      gbs = n_params * moved / t / 1e9
      vs_optax = f"{med['optax.adamw'] / t:10.2f}"
      vs_torch = f"{torch_time / t:10.2f}" if torch_time else f"{'-':>10}"
      print(f"| {name:<{width}} | {t * 1e3:7.1f} | {n_params / t / 1e6:9.0f} | {gbs:9.1f} | {gbs / bandwidth:5.2f} | "
            f"{vs_optax} | {vs_torch} |")


if __name__ == "__main__":
  main()
