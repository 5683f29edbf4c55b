"""optax_hybrid: Optax optimizers whose state can live in host memory, on the host CPU or on disk.

Public API (``__all__``: what a training script calls):

* :func:`hybrid_adamw` (AdamW, HybridAdam / ``optax.adamw`` / torch
  semantics) and one ``hybrid_<rule>`` per update rule (``hybrid_lion``,
  ``hybrid_sgd``, ``hybrid_adagrad``): each takes its Optax counterpart's
  arguments, then a few keyword-only placement, storage and kernel options
  (``state_memory_kind``, ``moment_format``, ``master``, ...; one argument per
  choice: docs/optimizer.md); :func:`scale_by_hybrid_adam`: Adam's direction
  without the learning rate; :func:`by_fraction`: a placement by size.
* :class:`HybridOptimizer`: what they return; adds the fused
  ``step(params, state, grads)``; :class:`HybridAdamState` and one state type
  per rule; :func:`moment_values`: the rule's state as float trees shaped
  like the params (8-bit values dequantized, disk values read).
* :func:`standard_optimizer`: clipping, AdamW with warmup-cosine,
  accumulation and parameter groups in one call; :func:`last_learning_rate`,
  :func:`warmup_cosine_schedule`.
* :func:`apply_updates`, :func:`clip_by_global_norm`, :func:`global_norm`:
  Optax's, for params and gradients in any memory kind; :func:`commit`:
  commits what a jitted step takes, so that a step with state in host memory
  compiles once (the first such step says so when it is needed);
  :func:`available_memory_kinds`.
* :func:`scan_layers` and :func:`step_in_backward`: layers streamed from host
  memory, the optimizer inside the backward pass; :func:`split_stack` /
  :class:`SplitStack` / :func:`join_stack`: a stack of layers split between
  device and host memory; :func:`choose_placement` /
  :class:`StackPlacement`: the split that fits a model's two memories and
  moves the fewest bytes over the bus, chosen from XLA's compiled memory
  plan; :func:`flatten_params` /
  :class:`FlatParams`: a many-leaf model's params in a few flat buffers.
* :mod:`optax_hybrid.checkpoint`: Orbax save/restore that keeps memory kinds;
  :func:`memory_report` / :class:`MemoryReport`: where training memory went;
  :func:`host_arithmetic_outside_host_compute`: a check of a train step's jaxpr.

The modules below are the engine's parts, importable and documented for those
who extend it (a new rule implements :mod:`optax_hybrid.base`'s
``UpdateRule``) or read what ``init`` decided (:mod:`optax_hybrid.plan`,
:mod:`optax_hybrid.tiers`, :mod:`optax_hybrid.masters`,
:mod:`optax_hybrid.options`, :mod:`optax_hybrid.disk`); they are not in
``__all__``, as Optax keeps its own under ``optax._src``.
:mod:`optax_hybrid.gpu_compile` (imported on its own: it needs JAX's CUDA
plugin, ``gpu_compile.install_cuda_plugin()``) compiles a step for an
H100/H200 without a GPU and estimates its step time.
"""

import warnings as _warnings

from optax_hybrid import (base, checkpoint, disk, flat_params, masters, moments, options, plan, planner, recipe, report,
                          rules, stacks, tiers)
from optax_hybrid.flat_params import FlatParams, flatten_params
from optax_hybrid.placement import (
    STATE_MEMORY_KINDS,
    apply_updates,
    available_memory_kinds,
    commit,
)
from optax_hybrid.placed import clip_by_global_norm, global_norm
from optax_hybrid.recipe import last_learning_rate, standard_optimizer
from optax_hybrid.report import MemoryReport, memory_report
from optax_hybrid.schedules import warmup_cosine_schedule
from optax_hybrid.planner import StackPlacement, choose_placement
from optax_hybrid.stacks import SplitStack, join_stack, split_stack
from optax_hybrid.tiers import by_fraction
from optax_hybrid.streaming import scan_layers, step_in_backward
from optax_hybrid.rules.adagrad import HybridAdagradState, hybrid_adagrad
from optax_hybrid.rules.adamw import HybridAdamState, hybrid_adamw, scale_by_hybrid_adam
from optax_hybrid.rules.lion import HybridLionState, hybrid_lion
from optax_hybrid.rules.sgd import HybridSgdState, hybrid_sgd
from optax_hybrid.transform import HybridOptimizer, StepInParts, moment_values

__version__ = "0.1.0"

# What users call. The modules stay importable (optax_hybrid.plan, .tiers, ...) and have API pages, but
# they are the engine's parts, not its interface (as optax keeps its own under optax._src).
__all__ = [
    "FlatParams",
    "HybridAdagradState",
    "HybridAdamState",
    "HybridLionState",
    "HybridOptimizer",
    "HybridSgdState",
    "MemoryReport",
    "SplitStack",
    "apply_updates",
    "available_memory_kinds",
    "by_fraction",
    "checkpoint",
    "choose_placement",
    "clip_by_global_norm",
    "commit",
    "flatten_params",
    "global_norm",
    "host_arithmetic_outside_host_compute",
    "hybrid_adagrad",
    "hybrid_adamw",
    "hybrid_lion",
    "hybrid_sgd",
    "join_stack",
    "last_learning_rate",
    "memory_report",
    "moment_values",
    "scale_by_hybrid_adam",
    "scan_layers",
    "split_stack",
    "standard_optimizer",
    "step_in_backward",
    "warmup_cosine_schedule",
]


def __getattr__(name: str):
  if name == "host_arithmetic_outside_host_compute":
    # A tool of the GPU-compile package, exported as the check users run on their own train step; imported on use,
    # so that `import optax_hybrid` does not load the package.
    from optax_hybrid.gpu_compile.jaxpr_check import host_arithmetic_outside_host_compute
    return host_arithmetic_outside_host_compute
  # HybridAdamW: the name hybrid_adamw's result had before every rule shared the engine (0.1.0's docs promise it).
  if name == "HybridAdamW":
    _warnings.warn("optax_hybrid.HybridAdamW is deprecated: use optax_hybrid.HybridOptimizer, what every hybrid_* "
                  "optimizer returns (HybridAdamW is that class).", DeprecationWarning, stacklevel=2)
    return HybridOptimizer
  raise AttributeError(f"module 'optax_hybrid' has no attribute {name!r}")


def __dir__() -> list[str]:
  # The check imported on use (above) is listed as the module's own name.
  return sorted(set(globals()) | {"host_arithmetic_outside_host_compute"})
