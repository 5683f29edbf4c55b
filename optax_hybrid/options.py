"""The engine's options, by concern, written once: where state lives, how it is stored, which kernel runs.

Every ``hybrid_*`` optimizer takes its Optax counterpart's arguments and then
these, keyword-only: :class:`Placement`, :class:`Storage` and
:class:`Execution`. Their fields (names, defaults, meaning) are written here
and nowhere else; :func:`takes_options` adds them to each optimizer's
signature, and :func:`make_options` checks them into one frozen
:class:`Options` when the optimizer is built.

Every check that needs no params happens in :func:`make_options`, before any
backend starts (so ``jax.distributed.initialize`` may come after); the checks
that need the params happen in :func:`optax_hybrid.plan.make_plan`, at ``init``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from typing import Any, Callable, Optional, Union

import jax
import jax.numpy as jnp
import optax

from optax_hybrid import _checks, _deprecations, disk, masters, moments as moments_lib, tiers as tiers_lib
from optax_hybrid.kernels import check_kernel_name

#: ``moment_format`` values: a storage dtype for every field a rule keeps, or
#: the name of a format that encodes them (:mod:`optax_hybrid.moments`: 8-bit
#: block-wise codes and scales).
MOMENT_FORMATS = ("float32", "bfloat16", "float16", *moments_lib.BY_NAME)
#: ``state_layout`` values: one array per param leaf in each params-shaped
#: field (the Optax contract), or every leaf's in a few flat buffers
#: (:mod:`optax_hybrid.packing`).
STATE_LAYOUTS = ("leaves", "packed")

ScalarOrSchedule = Union[float, jax.Array, optax.Schedule]
MaskOrFn = Optional[Union[Any, Callable[[optax.Params], Any]]]


def _deprecated(default: Any = None) -> Any:
  """A field kept for an older spelling: not in the signatures; :func:`make_options` warns and translates it."""
  return dataclasses.field(default=default, metadata={"deprecated": True})


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where each leaf's state lives and where its update runs (:mod:`optax_hybrid.tiers`).

  Attributes:
    state_memory_kind: where the state lives, and so where the update runs
      (docs/tiers.md): ``None`` (beside each param); a memory kind,
      ``"device"`` or ``"pinned_host"`` (the state there, the update where the
      param lives: on the device for a param in device memory, the state
      streamed in and out); or a tier that also says where the update runs:
      ``"host_state"`` (state in ``pinned_host``, updated on the device, also
      for params that live in host memory), ``"host"`` (state and master in
      ``pinned_host``, updated on the host CPU: the gradient moves to the
      host, only the new param moves back), ``"disk"`` (the rule's state in
      files under ``nvme_offload_dir``, read and written around each step).
      Per leaf: a callable ``(path, param) -> one of those or None``, or a
      tree of them shaped like the params (or a prefix of it). By size:
      :func:`optax_hybrid.by_fraction` (``by_fraction(host=0.5)``: half the
      params, by size, updated on the host).
    nvme_offload_dir: the directory for the disk tier's file (it must exist
      and be writable: checked when the optimizer is built); ``None``: the
      temporary directory. The file is owner-only and has no name:
      ``tx.close()`` or the end of the process, however it ends, frees it
      (:mod:`optax_hybrid.disk`).
    shard_state_over: ZeRO-1: a mesh axis name (e.g. ``"data"``) over which
      the state (and master) is split even where the params are replicated:
      each leaf's first dimension that its param leaves unsharded and that the
      axis divides is split over it (:func:`optax_hybrid.tiers.zero1_sharding`).
      Each device then updates its shard and the update is gathered back to
      the param's sharding. Params must be placed with a ``NamedSharding`` on
      a mesh with that axis.
    tiers, offload_fraction, nvme_offload_fraction: older spellings of
      ``state_memory_kind`` (the same values; ``by_fraction(host=...)``,
      ``by_fraction(disk=...)``), removed in 0.3. :func:`make_options`
      translates them (they are then None here).
  """

  state_memory_kind: tiers_lib.PlacementSpec = None
  tiers: tiers_lib.TierSpec = _deprecated()
  offload_fraction: Optional[float] = _deprecated()
  nvme_offload_fraction: Optional[float] = _deprecated()
  nvme_offload_dir: Any = None
  shard_state_over: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Storage:
  """How the rule's state and the master copy are stored.

  Attributes:
    moment_format: how every field the rule keeps is stored, instead of its
      own dtype arguments (``mu_dtype``...): ``"float32"``, ``"bfloat16"``,
      ``"float16"``, or ``"8bit"``: block-wise 8-bit (Dettmers et al. 2021),
      uint8 codes into a dynamic code map plus one float32 scale per block of
      256 values along the last axis, 1.02 bytes per weight per field instead
      of 4 (leaves of fewer than 4096 values, non-float leaves, and leaves
      whose state shards would split a block keep float32). Every tier and
      kernel takes it; the update uses the new values before they are
      quantized (:mod:`optax_hybrid.kernels.quantized`). Or a format of your
      own, a :class:`optax_hybrid.moments.MomentFormat` value.
    master: master weights for each lower-precision param (bf16, fp16), so
      that small steps accumulate instead of rounding away
      (:mod:`optax_hybrid.masters`): ``"float32"`` (a float32 copy, 4 bytes
      per weight; ``jnp.float32`` says the same, and any other real floating
      dtype keeps a copy in that dtype where it is wider than the param),
      ``"kahan"`` (an error term in the param's dtype, 2 bytes: compensated
      summation) or ``"stochastic"`` (nothing kept: the new value rounded up
      or down at random, unbiased). What is kept lives with the
      leaf's state. The step is computed on the float32 value the format
      gives; the new param is written by the format (``tx.step``), and
      ``update`` returns, in float32, the difference that makes
      ``apply_updates`` land exactly on it.
    master_dtype: the older spelling of ``master`` (the same values),
      removed in 0.3; :func:`make_options` translates it.
    state_layout: ``"leaves"`` (the default: every params-shaped field of
      the state holds one array per param leaf, as Optax expects) or
      ``"packed"``: each holds a dict of a few flat arrays, one per storage
      dtype, every leaf's state a static slice of one (:mod:`optax_hybrid.packing`).
      A jitted step then takes and returns four state buffers instead of two
      per leaf, which is what a step over many small leaves mostly costs on
      a CPU. For one CPU device and the ``device`` tier;
      ``optax.tree_utils.tree_map_params`` sees the packed state as
      non-params state, and checkpoints restore into the same layout only.
  """

  moment_format: Any = None
  master: Any = None
  master_dtype: Any = _deprecated()
  state_layout: str = "leaves"

  @property
  def master_format(self) -> masters.MasterFormat:
    """The :class:`~optax_hybrid.masters.MasterFormat` asked for by ``master`` or ``master_dtype``
    (:data:`~optax_hybrid.masters.NO_MASTER` for neither)."""
    return masters.resolve(self.master, self.master_dtype, "Storage")

  @property
  def moments(self) -> moments_lib.MomentFormat:
    """The :class:`~optax_hybrid.moments.MomentFormat` asked for by ``moment_format`` (for the leaves it applies
    to; the others keep :data:`~optax_hybrid.moments.AS_STORED`)."""
    return moments_lib.resolve(self.moment_format)


@dataclasses.dataclass(frozen=True)
class Execution:
  """Which kernel computes the update, and what a step does with non-finite gradients.

  Attributes:
    kernel: ``"auto"`` (the fastest measured: on a GPU the Pallas kernel; on
      a CPU the native kernel for ``tx.step`` and XLA for ``update``), ``"xla"``
      (one fused XLA loop per leaf), ``"native"`` (the compiled CPU kernel: one
      custom call for all CPU-resident leaves), ``"pallas"`` (the fused Pallas
      GPU kernel: one launch per 64 device-resident leaves; interpret mode off
      the GPU, for tests). A kernel runs the rules it implements
      (:mod:`optax_hybrid.kernels`); other leaves take the rule's reference in
      the same step.
    skip_nonfinite: skip a step whose gradients hold a NaN or an infinity:
      zero updates, state and ``count`` unchanged, ``state.skipped``
      incremented. Costs one reduction over the gradients, no extra pass over
      the state (the choice is made inside the fused step).
  """

  kernel: str = "auto"
  skip_nonfinite: bool = False


_CONCERNS = (Placement, Storage, Execution)
#: Every option's name -> the concern (dataclass) it belongs to (the older spellings included).
OPTION_NAMES = {f.name: concern for concern in _CONCERNS for f in dataclasses.fields(concern)}
#: The options' older spellings, which warn (:mod:`optax_hybrid._deprecations`).
DEPRECATED_OPTIONS = tuple(f.name for concern in _CONCERNS for f in dataclasses.fields(concern)
                           if f.metadata.get("deprecated"))


@dataclasses.dataclass(frozen=True)
class Options:
  """What an optimizer was asked for besides its rule, checked. Static (no traced values).

  Attributes:
    owner: the public function, for messages (``"hybrid_adamw"``).
    placement, storage, execution: the options by concern.
    mask: which leaves take weight decay: a tree of bools with the structure
      of the params (or a prefix of it), a callable ``params -> tree``, or
      None (every leaf); resolved once by the plan.
  """

  owner: str
  placement: Placement = Placement()
  storage: Storage = Storage()
  execution: Execution = Execution()
  mask: MaskOrFn = None


def takes_options(*, without: tuple[str, ...] = ()) -> Callable:
  """Decorator: ``fn(..., **options)`` shows every option of :data:`OPTION_NAMES` (less ``without``) as keyword-only.

  The function keeps its ``**options``; its ``__signature__`` (what
  ``inspect``, ``help`` and the API reference show, and what
  ``optax.inject_hyperparams`` binds) lists each option with its default,
  then ``**deprecated``: the older spellings (:data:`DEPRECATED_OPTIONS`),
  which still bind and warn.
  """
  def decorate(fn):
    signature = inspect.signature(fn)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    extra = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
                               annotation=typing.get_type_hints(concern)[f.name])
             for concern in _CONCERNS for f in dataclasses.fields(concern)
             if f.name not in without and not f.metadata.get("deprecated")]
    rest = inspect.Parameter("deprecated", inspect.Parameter.VAR_KEYWORD)

    @functools.wraps(fn)
    def taking_options(*args, deprecated=None, **kwargs):
      # optax.inject_hyperparams binds by this signature: the older spellings come gathered in `deprecated`.
      return fn(*args, **(deprecated or {}), **kwargs)

    taking_options.__signature__ = signature.replace(parameters=own + extra + [rest])
    return taking_options
  return decorate


def make_options(owner: str, rule: Any, *, mask: MaskOrFn = None, accepted: tuple[str, ...] | None = None,
                 **options: Any) -> Options:
  """Checks ``options`` (by name, as :data:`OPTION_NAMES`) for ``rule`` and returns :class:`Options`.

  Args:
    owner: the public function, for messages.
    rule: the :class:`optax_hybrid.base.UpdateRule` the options go with (its
      fields' dtype arguments may conflict with ``moment_format``).
    mask: the weight decay mask.
    accepted: the option names ``owner`` takes (default: all).
    **options: the options by name.

  Raises:
    TypeError: for an option ``owner`` does not take, or of the wrong type.
    ValueError: for a value out of range or options that contradict each other.
  """
  accepted = tuple(OPTION_NAMES) if accepted is None else accepted
  unknown = [name for name in options if name not in accepted]
  if unknown:
    raise TypeError(f"{owner}() got an unexpected keyword argument {unknown[0]!r}; its options are "
                    f"{', '.join(accepted)}.")
  options = _translated(owner, options)
  by_concern = {concern: {k: v for k, v in options.items() if OPTION_NAMES[k] is concern} for concern in _CONCERNS}
  o = Options(owner, *(concern(**by_concern[concern]) for concern in _CONCERNS), mask=mask)
  o = dataclasses.replace(o, placement=_checked_placement(owner, o.placement),
                          storage=_checked_storage(owner, o.storage, rule),
                          execution=_checked_execution(owner, o.execution))
  return o


def _translated(owner: str, options: dict[str, Any]) -> dict[str, Any]:
  """``options`` with each older spelling given (not None) warned about and written as its replacement."""
  options = dict(options)
  old = {name: options.pop(name) for name in DEPRECATED_OPTIONS if options.get(name) is not None}
  for name in old:
    _deprecations.warn(owner, name, _deprecations.SPELLINGS[name])
  if "tiers" in old:
    if options.get("state_memory_kind") is not None:
      raise ValueError(f"{owner}: pass either `tiers` or `state_memory_kind`, not both: `tiers` is the older "
                       "spelling of `state_memory_kind`, which takes the same values.")
    options["state_memory_kind"] = old["tiers"]
  if "offload_fraction" in old or "nvme_offload_fraction" in old:
    options["state_memory_kind"] = _fractions(owner, old, options.get("state_memory_kind"))
  if "master_dtype" in old:
    if options.get("master") is not None:
      raise ValueError(f"{owner}: pass either `master` or `master_dtype`, not both: `master_dtype` is the older "
                       "spelling of `master` (master=jnp.float32 is master='float32').")
    options["master"] = old["master_dtype"]
  return options


def _fractions(owner: str, old: dict[str, Any], rest: Any) -> tiers_lib.Fractions:
  """``by_fraction`` for ``offload_fraction`` / ``nvme_offload_fraction``, checked under those names."""
  host, disk = (tiers_lib.check_fraction(name, old.get(name), owner) or 0.0
                for name in ("offload_fraction", "nvme_offload_fraction"))
  if host + disk > 1.0 + 1e-12:
    raise ValueError(f"{owner}: `offload_fraction` + `nvme_offload_fraction` is {host + disk}; together they can "
                     "place at most all of the params (sum <= 1).")
  if isinstance(rest, tiers_lib.Fractions):
    raise ValueError(f"{owner}: state_memory_kind={rest!r} already places by size; drop `offload_fraction` / "
                     "`nvme_offload_fraction` (their older spelling).")
  return tiers_lib.by_fraction(host=host, disk=disk, rest=rest)


def _checked_placement(owner: str, p: Placement) -> Placement:
  tiers_lib.check_placement_spec(p.state_memory_kind, owner)
  if p.shard_state_over is not None and not isinstance(p.shard_state_over, str):
    raise TypeError(f"{owner}: `shard_state_over` must be a mesh axis name (a str), got {p.shard_state_over!r}.")
  if p.nvme_offload_dir is not None:
    disk.check_directory(p.nvme_offload_dir)  # before any step, and before init writes anything
  return p


def _checked_storage(owner: str, s: Storage, rule: Any) -> Storage:
  asked = [f.dtype_argument for f, d in zip(rule.fields, rule.field_dtypes) if d is not None]
  for field, dtype in zip(rule.fields, rule.field_dtypes):
    if dtype is not None and not is_inexact(jnp.dtype(dtype)):
      raise ValueError(f"{owner}: `{field.dtype_argument}` must be a floating dtype, got {jnp.dtype(dtype)}.")
  if s.moment_format is not None:
    if not isinstance(s.moment_format, moments_lib.MomentFormat) and s.moment_format not in MOMENT_FORMATS:
      raise ValueError(f"{owner}: unknown `moment_format`={s.moment_format!r}; accepted values are "
                       f"{', '.join(repr(f) for f in MOMENT_FORMATS)}, an optax_hybrid.moments.MomentFormat (or "
                       f"None: each field's own dtype).")
    held = getattr(rule.state_type, "_fields", ())
    missing = [f.name + suffix for suffix in moments_lib.resolve(s.moment_format).suffixes for f in rule.fields
               if f.name + suffix not in held]
    if missing:  # a format keeps its other arrays in params-shaped attributes the rule's state type declares
      raise ValueError(
          f"{owner}: `moment_format`={s.moment_format!r} keeps {', '.join(map(repr, missing))} beside the rule's "
          f"fields, which its state type {rule.state_type.__name__} does not hold (it holds {', '.join(held)}). "
          "A format keeps at most one array beside each field, under the suffix the rules' state types declare: "
          "suffixes=(\"_scales\",).")
    if asked:
      names = " / ".join(f"`{f.dtype_argument}`" for f in rule.fields if f.dtype_argument)
      raise ValueError(f"{owner}: pass either `moment_format` or {names}, not both: "
                       f"moment_format={s.moment_format!r} sets the storage of every field the rule keeps.")
  master = masters.resolve(s.master, None, owner)  # raises for a bad value
  if s.state_layout not in STATE_LAYOUTS:
    raise ValueError(f"{owner}: unknown `state_layout`={s.state_layout!r}; accepted values are "
                     f"{', '.join(repr(x) for x in STATE_LAYOUTS)}.")
  # One value per format (master=jnp.float32 is master="float32"): equal options make equal plans.
  return dataclasses.replace(s, master=None if master is masters.NO_MASTER else master.name)


def _checked_execution(owner: str, e: Execution) -> Execution:
  check_kernel_name(e.kernel, owner)
  return dataclasses.replace(e, skip_nonfinite=_checks.flag(owner, "skip_nonfinite", e.skip_nonfinite))


def placement_words(o: Options) -> str:
  """Where the state was asked to live, as the user wrote it, for messages (``"state_memory_kind='pinned_host'"``)."""
  spec = o.placement.state_memory_kind
  if callable(spec) and not isinstance(spec, tiers_lib.Fractions):
    return "the state_memory_kind callable"
  if spec is not None and not isinstance(spec, (str, tiers_lib.Fractions)):
    return "the state_memory_kind tree"
  return f"state_memory_kind={spec!r}"


def check_learning_rate(owner: str, learning_rate: Any) -> None:
  """A schedule, or a number ``>= 0`` (a building block without its rate runs the step at -1, unchecked)."""
  if not callable(learning_rate):
    _checks.hyperparameter(owner, "learning_rate", learning_rate, low=0.0)


def is_inexact(dtype) -> bool:
  """Floating point or complex: the dtypes an optimizer can step."""
  return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.complexfloating)


__all__ = ["DEPRECATED_OPTIONS", "Execution", "MOMENT_FORMATS", "OPTION_NAMES", "STATE_LAYOUTS", "Options",
           "Placement", "Storage", "make_options", "placement_words", "takes_options"]
