"""JAX version shims: every difference between the supported JAX releases lives here.

Supported: JAX 0.10.x and 0.11.x (and the one private Optax name the package
reads, :func:`is_optax_params_placeholder`). Nothing else in the package imports from
``jax.experimental.compute_on`` or reads memory spaces off abstract values.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
import jax.extend  # a submodule that ``import jax`` does not load
from jax.experimental import compute_on as _compute_on_module
from jax.experimental.layout import Layout as _Layout, with_layout_constraint as _with_layout_constraint

# ``jax.memory.Space`` names the two memory spaces a jitted value can be typed
# with. ``Host`` lowers to the ``pinned_host`` memory kind.
DEVICE = jax.memory.Space.Device
HOST = jax.memory.Space.Host


def _resolve_host_compute_decorator() -> Callable[..., Any]:
  """Returns the decorator form of ``compute_on`` for this JAX.

  JAX 0.10 has ``compute_on`` (a context manager) and ``compute_on2`` (a
  decorator taking ``out_memory_spaces``). JAX 0.11 dropped the context manager
  and renamed ``compute_on2`` to ``compute_on``.
  """
  decorator = getattr(_compute_on_module, "compute_on2", None)
  if decorator is not None:
    return decorator
  candidate = _compute_on_module.compute_on
  try:
    parameters = inspect.signature(candidate).parameters
  except (TypeError, ValueError):  # pragma: no cover - builtins without signature
    parameters = {}
  if "out_memory_spaces" not in parameters:  # pragma: no cover - unsupported JAX
    raise ImportError(
        "optax_hybrid needs jax.experimental.compute_on with an "
        "`out_memory_spaces` argument (JAX 0.10 or 0.11); found JAX "
        f"{jax.__version__}."
    )
  return candidate


_host_compute_decorator = _resolve_host_compute_decorator()


def host_compute(fn: Callable[..., Any], out_memory_spaces: Any) -> Callable[..., Any]:
  """Wraps ``fn`` so that it runs on the host CPU (XLA host compute).

  Every array argument of the wrapped function must already live in host
  memory (values computed on the device get there through
  :func:`optax_hybrid.placement.to_host`, in the row-major layout);
  ``out_memory_spaces`` is a pytree prefix of ``fn``'s outputs giving the
  memory space of each (``HOST`` keeps results in host memory).
  """
  return _host_compute_decorator(fn, compute_type="device_host", out_memory_spaces=out_memory_spaces)


def row_major(x: Any, sharding: Any = None) -> Any:
  """``x`` constrained to the row-major (default) layout, each shard of it for a multi-device ``sharding``.

  A no-op for scalars and vectors. Under SPMD partitioning the layout
  constraint is a custom call that the partitioner would give a whole
  (gathered) operand, so a sharded value is constrained shard by shard
  (``jax.shard_map`` over ``sharding``'s mesh and spec).
  """
  if np.ndim(x) < 2:
    return x
  constrain = lambda y: _with_layout_constraint(y, _Layout(tuple(range(np.ndim(y)))))
  if isinstance(sharding, jax.sharding.NamedSharding) and sharding.num_devices > 1:
    spec = sharding.spec
    return jax.shard_map(constrain, mesh=sharding.mesh, in_specs=spec, out_specs=spec, check_vma=False)(x)
  return constrain(x)


def memory_space_of(x: Any) -> Any:
  """The memory space (``DEVICE`` or ``HOST``) of an array or tracer."""
  space = getattr(jax.typeof(x), "memory_space", DEVICE)
  # ``MemorySpace.Any`` is what an unconstrained abstract value reports; it is
  # materialized in device memory.
  return HOST if space == HOST else DEVICE


# Types used to walk jaxprs and recognise traced values. ``jax.extend.core`` is
# their public home in both supported releases; ``jax.core.Tracer`` is too.
Tracer = jax.core.Tracer
ClosedJaxpr = jax.extend.core.ClosedJaxpr
Jaxpr = jax.extend.core.Jaxpr


HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def backends_are_initialized() -> bool:
  """Whether a JAX backend has started (after which ``jax.distributed.initialize`` fails).

  Private in JAX 0.10 and 0.11; assume started if it moves, which only loses
  the early check of a memory kind's availability.
  """
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except (ImportError, AttributeError):  # pragma: no cover - a future JAX
    return True


def is_host_kind(kind: Any) -> bool:
  """Whether a sharding's ``memory_kind`` names host memory."""
  return kind in HOST_MEMORY_KINDS


def abstract_sharding_in(sharding: Any, kind: str) -> Any:
  """``sharding`` in memory ``kind``, for a ``jax.ShapeDtypeStruct`` that JAX traces where real arrays would be.

  JAX 0.10 traces a ``ShapeDtypeStruct`` whose ``SingleDeviceSharding`` names
  host memory as a device value (a ``NamedSharding`` one as a host value, as it
  does real arrays placed there either way), so a one-device sharding in host
  memory is named on a one-device mesh of its device.
  """
  if isinstance(sharding, jax.sharding.SingleDeviceSharding) and is_host_kind(kind):
    mesh = jax.sharding.Mesh(np.array(list(sharding.device_set)), ("one",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind)
  return sharding.with_memory_kind(kind)


def explicit_sharding(like: Any, lead: int = 0) -> Any:
  """The sharding to make a buffer for ``like`` (after ``lead`` whole axes) with, where its type names Explicit axes.

  With Explicit mesh axes a value's sharding is part of its type, and a
  buffer made without one (on no mesh) cannot take slices of values typed on
  a mesh: ``jnp.zeros(..., out_sharding=...)`` it. None elsewhere (Auto axes,
  no mesh: the partitioner places a plain buffer).
  """
  sharding = typed_sharding(like)
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or explicit not in tuple(mesh.axis_types):
    return None
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*([None] * lead), *sharding.spec))


def typed_sharding(x: Any) -> Any:
  """The sharding a traced value's type carries (JAX's sharding in types): a ``NamedSharding`` on an abstract mesh.

  Its mesh is empty where the trace knows of none; its spec names only the
  mesh's Explicit axes. None where the type carries no sharding.
  """
  return getattr(jax.typeof(x), "sharding", None)


def move(x: Any, space: Any) -> Any:
  """Moves an array, or every array of a pytree, to a memory space, keeping its sharding; a no-op for one there."""
  return jax.tree.map(lambda a: a if memory_space_of(a) == space else jax.device_put(a, space), x)


# The platforms a step is declared to be lowered for (kernels.contract.lowering_for).
# A JAX config state with include_in_trace_context: jit's trace cache is keyed
# on it, so a step traced for CUDA is never reused for a CPU call or the
# reverse. Private in JAX 0.10 and 0.11; a plain context variable otherwise
# (then a jitted function must not be traced both ways).
try:
  from jax._src import config as _jax_config
  _LOWERING_PLATFORMS = _jax_config.optional_string_state(
      "optax_hybrid_lowering_platforms", None,
      "Comma-separated platforms optax_hybrid's steps are lowered for (set by kernels.lowering_for).",
      include_in_trace_context=True)
except (ImportError, AttributeError, TypeError):  # pragma: no cover - a future JAX
  import contextvars as _contextvars
  _LOWERING_PLATFORMS = None
  _LOWERING_FALLBACK = _contextvars.ContextVar("optax_hybrid_lowering_platforms", default=None)


@contextlib.contextmanager
def declared_lowering_platforms(platforms: Sequence[str]):
  """Within: steps are traced for ``platforms`` (see :func:`optax_hybrid.kernels.lowering_for`)."""
  value = ",".join(platforms)
  if _LOWERING_PLATFORMS is not None:
    with _LOWERING_PLATFORMS(value):
      yield
    return
  token = _LOWERING_FALLBACK.set(value)  # pragma: no cover
  try:  # pragma: no cover
    yield
  finally:  # pragma: no cover
    _LOWERING_FALLBACK.reset(token)


def lowering_platforms() -> tuple[str, ...]:
  """The platforms a step traced now is lowered for: the declared ones, else the default backend's
  (:func:`optax_hybrid.kernels.contract.lowering_platforms`)."""
  value = _LOWERING_PLATFORMS.value if _LOWERING_PLATFORMS is not None else _LOWERING_FALLBACK.get()
  if value:
    return tuple(value.split(","))
  backend = jax.default_backend()
  return {"gpu": ("cuda", "rocm")}.get(backend, (backend,))


_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def is_optax_params_placeholder(tree: Any) -> bool:
  """Whether ``tree`` is the stand-in for params that ``optax.tree_utils.tree_map_params`` gives ``init``.

  Optax keeps its class private (``optax.tree_utils._state_utils._ParamsPlaceholder``,
  optax 0.1.7 to 0.2.x), and ``optax.masked`` tests for it the same way.
  """
  try:
    from optax.tree_utils import _state_utils
  except ImportError:  # pragma: no cover - a future Optax
    return type(tree).__name__ == "_ParamsPlaceholder"
  placeholder = getattr(_state_utils, "_ParamsPlaceholder", None)
  if placeholder is None:  # pragma: no cover - a future Optax
    return type(tree).__name__ == "_ParamsPlaceholder"
  return isinstance(tree, placeholder)


def zeros_like(x: Any) -> Any:
  """Zeros with ``x``'s shape, dtype and memory space, also inside host compute.

  Inside ``compute_on('device_host')`` a broadcast constant (``jnp.zeros_like``,
  a scalar in ``jnp.where``) is typed as device memory in JAX 0.10, and mixing
  it with host values fails at trace time; clearing the bits of ``x`` keeps
  its type, and gives +0 whatever ``x`` holds (NaN and infinities included).
  """
  if memory_space_of(x) != HOST:
    return jnp.zeros_like(x)
  if jnp.iscomplexobj(x):
    return lax.complex(zeros_like(x.real), zeros_like(x.imag))
  utype = _UINT_OF_SIZE[x.dtype.itemsize]
  bits = lax.bitcast_convert_type(x, utype)
  return lax.bitcast_convert_type(lax.bitwise_and(bits, np.array(0, utype)), x.dtype)


def match_type_to_sharding(x: Any) -> Any:
  """Makes an array's type agree with its sharding's memory kind.

  Arrays assembled from per-device buffers (Orbax restores,
  ``jax.make_array_from_single_device_arrays``) can carry a ``pinned_host``
  sharding while their abstract type still says device memory; ``jit`` then
  traces them as device values and compiles the wrong placement. A real copy
  (``may_alias=False``) rebuilds the array with a consistent type.
  """
  if not isinstance(x, jax.Array) or isinstance(x, Tracer):
    return x
  wants_host = is_host_kind(getattr(x.sharding, "memory_kind", None))
  if wants_host != (memory_space_of(x) == HOST):
    return jax.device_put(x, x.sharding, may_alias=False)
  return x


# --- Deviceless GPU compilation (optax_hybrid.gpu_compile) --------------------
# Everything below is used only by ``optax_hybrid.gpu_compile``. The compile-only
# client of a deviceless topology takes an XLA ``CompileOptions`` and a
# ``DeviceList``, which JAX 0.10 and 0.11 build only through private modules.


def xla_compile_options(num_partitions: int, devices: Sequence[Any], dump_to: str | None = None,
                        disabled_passes: Sequence[str] = ()) -> Any:
  """XLA compile options for one replica partitioned over ``devices`` (SPMD).

  Args:
    num_partitions: the number of SPMD partitions (``len(devices)``).
    devices: the topology's devices, in device-assignment order.
    dump_to: a directory where XLA:GPU writes what it compiled, its thunk plan
      included (``--xla_dump_to`` and ``--xla_gpu_experimental_dump_gpu_executable``
      for this compile only); None: no dump.
    disabled_passes: names of XLA passes not to run in this compile
      (``--xla_disable_hlo_passes``).

  Returns:
    An ``xla_client.CompileOptions`` as ``jax.jit`` would build it.
  """
  from jax._src import compiler  # private in JAX 0.10 and 0.11
  # One row per replica, one column per partition.
  assignment = np.array(list(devices), dtype=object).reshape(1, num_partitions)
  options = compiler.get_compile_options(
      num_replicas=1, num_partitions=num_partitions, device_assignment=assignment)
  if dump_to is not None:  # per compile, as JAX itself overrides flags (env_option_overrides)
    options.env_option_overrides = list(options.env_option_overrides) + [
        ("xla_dump_to", dump_to), ("xla_gpu_experimental_dump_gpu_executable", True)]
  if disabled_passes:
    options.env_option_overrides = list(options.env_option_overrides) + [
        ("xla_disable_hlo_passes", ",".join(disabled_passes))]
  return options


def xla_device_list(devices: Sequence[Any]) -> Any:
  """An ``xla_client.DeviceList`` of ``devices`` (the executable's devices)."""
  from jax._src.lib import xla_client  # private in JAX 0.10 and 0.11
  return xla_client.DeviceList(tuple(devices))


def hlo_sharding_of(x: Any) -> Any:
  """The ``HloSharding`` of an array's (or ``jax.ShapeDtypeStruct``'s) sharding, as XLA writes a program's."""
  return x.sharding._to_xla_hlo_sharding(len(x.shape))  # private in JAX 0.10 and 0.11


def hlo_sharding(op_sharding: Any) -> Any:
  """The ``HloSharding`` of an ``OpSharding`` proto (what an executable's ``get_output_shardings`` gives)."""
  from jax._src.lib import xla_client  # private in JAX 0.10 and 0.11
  return op_sharding if isinstance(op_sharding, xla_client.HloSharding) else xla_client.HloSharding.from_proto(
      op_sharding)
