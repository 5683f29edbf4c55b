"""The options of :func:`optax_hybrid.hybrid_adamw`, validated once into one frozen object.

Every check that needs no params happens here, when the optimizer is built,
before any backend starts (so ``jax.distributed.initialize`` may come after);
the checks that need the params happen in :func:`optax_hybrid.plan.make_plan`,
at ``init``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from optax_hybrid import _compat, disk, placement, tiers as tiers_lib
from optax_hybrid.kernels import check_kernel_name

# moment_format values: a storage dtype for both moments, or 8-bit block-wise
# codes and scales (optax_hybrid.kernels.quantized).
QUANTIZED_8BIT = "8bit"
MOMENT_FORMATS = ("float32", "bfloat16", "float16", QUANTIZED_8BIT)

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
MaskOrFn = Optional[Union[Any, Callable[[optax.Params], Any]]]


@dataclasses.dataclass(frozen=True)
class Options:
  """What :func:`optax_hybrid.hybrid_adamw` was asked for, checked.

  Hyperparameters (``learning_rate`` to ``weight_decay``) may be traced
  values; everything else is static. See ``hybrid_adamw`` for each field and
  its default (written there once).
  """

  learning_rate: Any
  b1: Any
  b2: Any
  eps: Any
  weight_decay: Any
  bias_correction: bool
  adamw_mode: bool
  mask: MaskOrFn
  mu_dtype: Any
  nu_dtype: Any
  state_memory_kind: placement.MemoryKindSpec
  kernel: str
  skip_nonfinite: bool
  tiers: tiers_lib.TierSpec
  offload_fraction: float | None
  nvme_offload_fraction: float | None
  nvme_offload_dir: Any
  shard_state_over: str | None
  moment_format: str | None
  # Not an argument of scale_by_hybrid_adam: master weights need the learning
  # rate inside the step.
  master_dtype: Any = None

  @property
  def decay_is_static_zero(self) -> bool:
    """A concrete zero weight decay: decay is then left out of the step statically."""
    return not _compat.is_tracer(self.weight_decay) and float(np.asarray(self.weight_decay)) == 0.0

  @property
  def quantize_moments(self) -> bool:
    """8-bit block-wise moments (for the leaves that take them: :func:`quantized.quantizable`)."""
    return self.moment_format == QUANTIZED_8BIT


def make_options(**kwargs: Any) -> Options:
  """Checks :func:`hybrid_adamw`'s arguments and returns them as :class:`Options`.

  Raises:
    ValueError: for a value out of range or options that contradict each other.
    TypeError: for arguments of the wrong type.
  """
  o = Options(**kwargs)
  _check_range("b1", o.b1, low=0.0, high=1.0, high_open=True)
  _check_range("b2", o.b2, low=0.0, high=1.0, high_open=True)
  _check_range("eps", o.eps, low=0.0)
  _check_range("weight_decay", o.weight_decay, low=0.0)
  for name in ("bias_correction", "adamw_mode", "skip_nonfinite"):
    if not isinstance(getattr(o, name), (bool, np.bool_)):
      raise TypeError(f"hybrid_adamw: `{name}` must be a Python bool, got {getattr(o, name)!r}.")
  dtypes = {}
  for name in ("mu_dtype", "nu_dtype"):
    dtype = None if getattr(o, name) is None else jnp.dtype(getattr(o, name))
    if dtype is not None and not is_inexact(dtype):
      raise ValueError(f"hybrid_adamw: `{name}` must be a floating dtype, got {dtype}.")
    dtypes[name] = dtype
  if o.moment_format is not None:
    if o.moment_format not in MOMENT_FORMATS:
      raise ValueError(f"hybrid_adamw: unknown `moment_format`={o.moment_format!r}; accepted values are "
                       f"{', '.join(repr(f) for f in MOMENT_FORMATS)} (or None: `mu_dtype` / `nu_dtype`).")
    if o.mu_dtype is not None or o.nu_dtype is not None:
      raise ValueError("hybrid_adamw: pass either `moment_format` or `mu_dtype` / `nu_dtype`, not both: "
                       f"moment_format={o.moment_format!r} sets the storage of both moments.")
  placement.check_memory_kind_spec(o.state_memory_kind)
  tiers_lib.check_tier_spec(o.tiers)
  if o.tiers is not None and o.state_memory_kind is not None:
    raise ValueError(
        "hybrid_adamw: pass either `tiers` or `state_memory_kind`, not both: a tier sets where the "
        "state lives ('device': device memory; 'host_state' and 'host': pinned_host).")
  fractions = {name: tiers_lib.check_fraction(name, getattr(o, name))
               for name in ("offload_fraction", "nvme_offload_fraction")}
  if sum(f or 0.0 for f in fractions.values()) > 1.0 + 1e-12:
    raise ValueError(
        f"hybrid_adamw: `offload_fraction` + `nvme_offload_fraction` is {sum(fractions.values())}"
        "; together they can place at most all of the params (sum <= 1).")
  if o.shard_state_over is not None and not isinstance(o.shard_state_over, str):
    raise TypeError(f"hybrid_adamw: `shard_state_over` must be a mesh axis name (a str), got "
                    f"{o.shard_state_over!r}.")
  if o.nvme_offload_dir is not None:
    disk.check_directory(o.nvme_offload_dir)  # before any step, and before init writes anything
  master_dtype = None
  if o.master_dtype is not None:
    master_dtype = jnp.dtype(o.master_dtype)
    if not jnp.issubdtype(master_dtype, jnp.floating):
      raise ValueError(f"hybrid_adamw: `master_dtype` must be a real floating dtype such as jnp.float32, "
                       f"got {master_dtype}.")
  check_kernel_name(o.kernel)
  return dataclasses.replace(o, master_dtype=master_dtype, **dtypes, **fractions)


def check_learning_rate(learning_rate: Any) -> None:
  """A schedule, or a number ``>= 0`` (``scale_by_hybrid_adam`` runs the step at -1, unchecked)."""
  if not callable(learning_rate):
    _check_range("learning_rate", learning_rate, low=0.0)


def is_inexact(dtype) -> bool:
  """Floating point or complex: the dtypes an optimizer can step."""
  return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


def _concrete_float(name: str, value: Any) -> float | None:
  """``value`` as a Python float, or None when it is traced (then it cannot be checked here)."""
  if _compat.is_tracer(value):
    return None
  if isinstance(value, bool):
    raise TypeError(f"hybrid_adamw: `{name}` must be a number, got the bool {value!r}.")
  if isinstance(value, numbers.Real):
    return float(value)
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if np.ndim(value) != 0 or not jnp.issubdtype(np.asarray(value).dtype, jnp.number):
      raise TypeError(
          f"hybrid_adamw: `{name}` must be a scalar number, got an array of "
          f"shape {np.shape(value)} and dtype {np.asarray(value).dtype}."
      )
    return float(np.asarray(value))
  raise TypeError(
      f"hybrid_adamw: `{name}` must be a number, got {value!r} of type {type(value).__name__}."
  )


def _check_range(name: str, value: Any, *, low: float, high: float | None = None, high_open: bool = False) -> None:
  x = _concrete_float(name, value)
  if x is None:
    return
  if not math.isfinite(x):
    raise ValueError(f"hybrid_adamw: `{name}` must be finite, got {x!r}.")
  if x < low or (high is not None and (x >= high if high_open else x > high)):
    if high is None:
      accepted = f">= {low}"
    else:
      accepted = f"in [{low}, {high}{')' if high_open else ']'}"
    hint = ""
    if high_open and x == high and not isinstance(value, numbers.Real):
      # A beta that rounded up to 1: typically optax.inject_hyperparams casting
      # hyperparameters to the dtype of bf16/fp16 params.
      hint = (" It is a low-precision array: with optax.inject_hyperparams and "
              "bf16/fp16 params pass hyperparam_dtype=jnp.float32.")
    raise ValueError(f"hybrid_adamw: `{name}` must be {accepted}, got {x!r}.{hint}")
