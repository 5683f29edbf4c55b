"""optax_hybrid: Optax optimizers whose state can live in host memory, on the host CPU or on disk.

Public API:

* :func:`hybrid_adamw` (AdamW, HybridAdam / ``optax.adamw`` / torch
  semantics) and one ``hybrid_<rule>`` per update rule of
  :mod:`optax_hybrid.rules` (``hybrid_lion``, ``hybrid_sgd``...): each takes its
  Optax counterpart's arguments, then the engine's keyword-only placement,
  storage and kernel options (:mod:`optax_hybrid.options`); a new rule
  implements the contract of :mod:`optax_hybrid.base` (``UpdateRule``).
* :func:`scale_by_hybrid_adam`: Adam's direction without the learning rate.
* :class:`HybridOptimizer`: what they return; adds the fused
  ``step(params, state, grads)``. ``HybridAdamW``, its name before every rule
  shared the engine, is a deprecated alias (a ``DeprecationWarning``).
* :class:`HybridAdamState` and one state type per rule (``count``, the rule's
  fields, ``skipped``, ``master``, ``plan``).
* :func:`moment_values`: the rule's state as float trees shaped like the params
  (8-bit values dequantized, disk values read).
* :func:`warmup_cosine_schedule`: linear warmup then a cosine to a floor.
* :func:`apply_updates`: ``optax.apply_updates`` that is correct for params in
  any memory kind.
* :func:`commit`: commits what a jitted step takes (params, state, a
  ``TrainState``, an NNX model and optimizer), so that a step with state in
  host memory compiles once.
* :func:`scan_layers`: ``jax.lax.scan`` over stacked layers that may live in
  host memory: one layer on the device at a time, the gradient written where
  the layers live (:mod:`optax_hybrid.streaming`).
* :func:`step_in_backward`: a train step whose optimizer steps each streamed
  layer inside the backward pass, so no gradient of the layers is kept.
* :func:`flatten_params` / :class:`FlatParams`: a many-leaf model's params in
  a few flat buffers (one per dtype, placement and group), read through
  ``FlatParams.as_tree()`` views, so that a step passes a few large buffers
  (:mod:`optax_hybrid.flat_params`).
* :func:`host_arithmetic_outside_host_compute`: finds device arithmetic on
  host-resident values in a jaxpr (from :mod:`optax_hybrid.gpu_compile`).
* :mod:`optax_hybrid.checkpoint`: Orbax save/restore that keeps memory kinds.
* :func:`memory_report` / :class:`MemoryReport`: where training memory went,
  by tier and by memory (device, host, disk).
* :func:`clip_by_global_norm` / :func:`global_norm`: Optax's, for gradients
  in any memory kind (host memory included), to chain in front of an optimizer.
* :func:`standard_optimizer`: clipping, AdamW with warmup-cosine,
  accumulation and parameter groups in one call; :func:`last_learning_rate`
  reads the rate of the latest update from its state.
* :mod:`optax_hybrid.masters`: the master weight formats of ``master=``
  (``"float32"``, ``"kahan"``, ``"stochastic"``).
* :mod:`optax_hybrid.tiers` and :mod:`optax_hybrid.disk`: placement tiers and
  the disk tier; :mod:`optax_hybrid.plan`: every per-leaf decision ``init``
  makes (``state.plan``).
* :mod:`optax_hybrid.gpu_compile`: compile a step for an H100/H200 without a
  GPU and read what XLA planned, and estimate its step time
  (:mod:`optax_hybrid.gpu_compile.step_time`); compiling needs JAX's CUDA
  plugin: ``gpu_compile.install_cuda_plugin()``.
"""

import warnings as _warnings

from optax_hybrid import base, checkpoint, disk, flat_params, masters, options, plan, recipe, report, rules, stacks, tiers
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
from optax_hybrid.stacks import SplitStack, join_stack, split_stack
from optax_hybrid.streaming import scan_layers, step_in_backward
from optax_hybrid.rules.adagrad import HybridAdagradState, hybrid_adagrad
from optax_hybrid.rules.adamw import HybridAdamState, hybrid_adamw, scale_by_hybrid_adam
from optax_hybrid.rules.lion import HybridLionState, hybrid_lion
from optax_hybrid.rules.sgd import HybridSgdState, hybrid_sgd
from optax_hybrid.transform import HybridOptimizer, StepInParts, moment_values
# A tool of the GPU-compile package, exported here as the check users run on their own train step.
from optax_hybrid.gpu_compile.jaxpr_check import host_arithmetic_outside_host_compute

__version__ = "0.1.0"

__all__ = [
    "FlatParams",
    "HybridAdagradState",
    "HybridAdamState",
    "HybridLionState",
    "HybridOptimizer",
    "HybridSgdState",
    "MemoryReport",
    "STATE_MEMORY_KINDS",
    "SplitStack",
    "StepInParts",
    "apply_updates",
    "checkpoint",
    "clip_by_global_norm",
    "commit",
    "disk",
    "flat_params",
    "flatten_params",
    "global_norm",
    "last_learning_rate",
    "masters",
    "memory_report",
    "moment_values",
    "options",
    "plan",
    "recipe",
    "report",
    "rules",
    "stacks",
    "standard_optimizer",
    "tiers",
    "available_memory_kinds",
    "base",
    "host_arithmetic_outside_host_compute",
    "hybrid_adagrad",
    "hybrid_adamw",
    "hybrid_lion",
    "hybrid_sgd",
    "join_stack",
    "scale_by_hybrid_adam",
    "scan_layers",
    "split_stack",
    "step_in_backward",
    "warmup_cosine_schedule",
]


def __getattr__(name: str):
  # HybridAdamW: the name hybrid_adamw's result had before every rule shared the engine (0.1.0's docs promise it).
  if name == "HybridAdamW":
    _warnings.warn("optax_hybrid.HybridAdamW is deprecated: use optax_hybrid.HybridOptimizer, what every hybrid_* "
                  "optimizer returns (HybridAdamW is that class).", DeprecationWarning, stacklevel=2)
    return HybridOptimizer
  raise AttributeError(f"module 'optax_hybrid' has no attribute {name!r}")
