"""Splitting the cuDNN calls over devices by batch (data parallelism).

A custom call is opaque to XLA's partitioner: given operands sharded by batch
it gathers them and runs the whole batch on every device. The RNN's rows are
independent, so each device can run cuDNN on its own rows instead; only the
weight gradient is a sum over rows (one all-reduce). JAX has two sharding
modes, and each needs its own mechanism:

- Explicit axes (`AxisType.Explicit`, `jax.make_mesh`'s default): shardings
  are part of the arrays' types, known while tracing. `explicit_over_batch`
  runs the whole fused RNN (its `custom_vjp` included) under `jax.shard_map`
  over the axes that split the batch; JAX then sums the replicated weights'
  gradient over them. The mesh is the one in the data's type, named in every
  resharding (`NamedSharding`, not a bare `PartitionSpec`): arrays placed on
  an explicit mesh run under `jit` without `jax.set_mesh` too, and a bare
  spec would need it.
- Auto axes (`jit` on sharded arrays, shardings decided by the partitioner):
  `over_batch` wraps each FFI call in `custom_partitioning`, whose rule ties
  every operand's and result's batch dimension to one factor, keeps every
  other dimension whole, and, for the weights pass, sums the per-device
  results (`psum`) over the batch's mesh axes.

A batch that the mesh does not divide evenly is not split (XLA would pad it
with rows that are not the user's), nor is a symbolic batch (a shape-polymorphic
`jax.export`, whose divisibility is unknown), and on a single device nothing is
wrapped.

cuDNN's reserve space is the one buffer whose size is not proportional to the
batch, yet the partitioner needs every result's global shape before it knows
the split. It is therefore laid out `[batch, row_bytes]` (`reserve_row_bytes`),
with rows long enough that every even split over at most `jax.device_count()`
parts leaves each part at least what cuDNN asks for its own rows; the handlers
accept a reserve larger than cuDNN's size. On one device that costs under
`batch` bytes.

DESIGN §4 has no file for this; it is one idea of its own, which `_cudnn.py`
uses and tests/sharded_cases.py checks over four CPU devices. Of it, the
"xla" path needs only `batch_like` (every operand split by the data's batch
alone, under explicit sharding, applied in `_ops.rnn` for both paths): XLA
partitions its scan by batch itself.
"""

from __future__ import annotations

import math
import string
from typing import Callable, Sequence

import jax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

Axes = Sequence[int | None]  # per array: its batch dimension, or None


def reserve_row_bytes(reserve_bytes: Callable[[int], int], batch: int) -> int:
  """Bytes per row of a `[batch, row]` reserve space that holds, for every even
  split of `batch` into at most `jax.device_count()` parts, a part's own
  reserve (`reserve_bytes(rows)`) in that part's rows."""
  parts = [n for n in range(1, min(batch, jax.device_count()) + 1) if batch % n == 0]
  return max(-(-reserve_bytes(batch // n) // (batch // n)) for n in parts)


def _mesh_axes(entry) -> tuple:
  """The mesh axis names in one entry of a PartitionSpec."""
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _split(mesh_shape, entry, batch: int):
  """`(entry, axes)` for splitting `batch` rows as `entry` says, or `(None, ())`
  where the split would be uneven."""
  axes = _mesh_axes(entry)
  parts = math.prod(mesh_shape[a] for a in axes)
  if not axes or batch % parts:
    return None, ()
  return entry, axes


def _spec(entry, axis: int | None, ndim: int) -> P:
  return P(*(entry if d == axis else None for d in range(ndim)))


def _lead(in_axes: Axes) -> int:
  """The index of the first operand with a batch dimension."""
  return next(i for i, axis in enumerate(in_axes) if axis is not None)


# -- explicit sharding: shard_map over the batch ----------------------------------------


def _explicit(x):
  """`(mesh, spec)` of `x`'s type where it carries an explicit mesh, else None."""
  sharding = jax.typeof(x).sharding
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or AxisType.Explicit not in mesh.axis_types:
    return None
  return mesh, sharding.spec


def explicitly_sharded(x) -> bool:
  """Whether `x`'s type carries an explicit mesh (`batch_like` changes
  nothing otherwise)."""
  return _explicit(x) is not None


def _entry(spec, axis: int):
  return spec[axis] if len(spec) > axis else None


def batch_like(array, axis: int | None, like, like_axis: int):
  """`array` split, under explicit sharding, along its dimension `axis` alone,
  as `like`'s dimension `like_axis` is, and whole along every other (`axis`
  None: whole everywhere, replicated); as is otherwise, or where it is split so
  already.

  The initial states a caller leaves out are zeros with no sharding of their
  own, and a `lax.scan` whose carry starts replicated and comes back split by
  batch is refused; so the states and lengths follow the data's batch. In an
  eager call, an array JAX placed by default (uncommitted) is put on the
  data's mesh, which `reshard` refuses outside `jax.set_mesh`. Any
  other split is undone (gathered): the "xla" path's scan cannot run over a
  time axis split across devices, nor its products and slices over weights,
  states or units split so (JAX refuses each at trace time), and the cuDNN
  path runs each device's rows whole anyway (`explicit_over_batch`).
  """
  explicit = _explicit(like)
  if array is None or explicit is None:
    return array
  mesh, spec = explicit
  target = _spec(_entry(spec, like_axis), axis, array.ndim)
  own = _explicit(array)
  if own is not None and _axes(own[1], array.ndim) == _axes(target, array.ndim):
    return array
  if (not isinstance(array, jax.core.Tracer) and not getattr(array, "committed", True)
      and isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer)):
    # Eager, and placed by default (zeros made here, a converted NumPy
    # array): it follows the data onto its devices (the concrete mesh of
    # `like`'s sharding; its type's is abstract), as JAX's own eager ops move
    # it. `reshard` refuses it outside `jax.set_mesh` (its device is not the mesh).
    return jax.device_put(array, NamedSharding(like.sharding.mesh, target))
  return jax.sharding.reshard(array, NamedSharding(mesh, target))


def _axes(spec, ndim: int) -> tuple:
  """The mesh axes splitting each of `ndim` dimensions under `spec`."""
  return tuple(_mesh_axes(_entry(spec, d)) for d in range(ndim))


def explicit_over_batch(fn, operands, in_axes: Axes, out_axes: Axes):
  """`fn(*operands)`, run under `jax.shard_map` over the mesh axes that split
  the batch where the arrays' types carry an explicit mesh; as is otherwise.

  `fn` returns a tuple of arrays whose batch dimensions are `out_axes`; the
  operands without one (the weights) are replicated, so their gradients are
  summed over the batch's devices.
  """
  lead = _lead(in_axes)
  x, axis = operands[lead], in_axes[lead]
  explicit = _explicit(x)
  if explicit is None or jax.export.is_symbolic_dim(x.shape[axis]):
    return fn(*operands)
  mesh, spec = explicit
  entry, _ = _split(dict(mesh.shape), _entry(spec, axis), x.shape[axis])
  in_specs = tuple(_spec(entry, a, o.ndim) for o, a in zip(operands, in_axes))
  operands = tuple(jax.sharding.reshard(o, NamedSharding(mesh, s))
                   for o, s in zip(operands, in_specs))
  out_ndims = [o.ndim for o in jax.eval_shape(fn, *operands)]
  out_specs = tuple(_spec(entry, a, n) for a, n in zip(out_axes, out_ndims))
  # check_vma=False: JAX then sums the replicated weights' cotangents over the
  # mesh itself, without reading how values vary (whose attribute has changed
  # names across JAX versions; see `varying_axes`).
  return jax.shard_map(lambda *args: tuple(fn(*args)), mesh=mesh, in_specs=in_specs,
                       out_specs=out_specs, check_vma=False)(*operands)


def varying_axes(x) -> frozenset:
  """The manual mesh axes (inside `shard_map`) over which `x`'s value varies.

  JAX tracks this in the type (`check_vma`); the attribute's name changed
  across JAX versions, so both spellings are read."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)
  if vma is None:
    vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
  return frozenset(vma)


def sum_to_match(cotangent, primal):
  """`cotangent`, summed over the manual axes it varies over and `primal` does
  not. Inside a user's `shard_map` (with `check_vma`, its default), weights
  replicated over the batch's devices get per-device partial gradients from
  the cuDNN calls; a `custom_vjp` must return their sum, with the replicated
  type of the weights. (Where the vma attribute cannot be read, nothing is
  summed and JAX refuses the mismatched type: an error, not a wrong sum.)"""
  extra = varying_axes(cotangent) - varying_axes(primal)
  return jax.lax.psum(cotangent, tuple(sorted(extra))) if extra else cotangent


# -- auto sharding: a partitioning rule for each FFI call -------------------------------


def _factor_names():
  """Factor names for the sharding rule: letters only, never "b" (the batch)."""
  letters = [c for c in string.ascii_lowercase if c != "b"]
  for first in letters:
    for second in letters:
      yield first + second


def _rule(in_shapes, in_axes, out_shapes, out_axes):
  """An einsum-like rule: the batch dimensions share the factor "b", every
  other dimension has a factor of its own. Returns `(rule, other factors)`."""
  names = _factor_names()
  others = []

  def dims(shape, axis):
    out = []
    for d in range(len(shape)):
      if d == axis:
        out.append("b")
      else:
        others.append(next(names))
        out.append(others[-1])
    return " ".join(out)

  lhs = ", ".join(dims(s.shape, a) for s, a in zip(in_shapes, in_axes))
  rhs = ", ".join(dims(s.shape, a) for s, a in zip(out_shapes, out_axes))
  return f"{lhs} -> {rhs}", tuple(others)


def over_batch(fn, operands, in_axes: Axes, out_axes: Axes, *, summed: bool = False):
  """`fn(*operands)`, which XLA's partitioner may split by batch (auto sharding).

  `fn` takes arrays and returns a tuple of arrays; it must work on any part of
  the batch (it is traced again with each device's shapes). Results whose
  `out_axes` entry is None are whole on every device: with `summed`, `fn`'s
  results are sums over the batch rows, added up over the devices; without,
  they must not depend on the batch at all. Under `vmap`, one call per element
  (`custom_partitioning` has no batching rule).
  """
  lead = _lead(in_axes)
  batch = operands[lead].shape[in_axes[lead]]
  if jax.device_count() == 1 or jax.export.is_symbolic_dim(batch):
    return tuple(fn(*operands))
  outs = jax.eval_shape(fn, *operands)
  rule, others = _rule(operands, in_axes, outs, out_axes)

  def partition(mesh, arg_shapes, result_shapes):
    sharding = arg_shapes[lead].sharding
    spec = sharding.spec if isinstance(sharding, NamedSharding) else P()
    entry, axes = _split(dict(mesh.shape), _entry(spec, in_axes[lead]), batch)
    arg_shardings = tuple(NamedSharding(mesh, _spec(entry, a, s.ndim))
                          for s, a in zip(arg_shapes, in_axes))
    result_shardings = tuple(NamedSharding(mesh, _spec(entry, a, s.ndim))
                             for s, a in zip(result_shapes, out_axes))

    def lower(*local):
      results = tuple(fn(*local))
      if summed and axes:
        results = tuple(jax.lax.psum(r, axes) for r in results)
      return results

    return mesh, lower, result_shardings, arg_shardings

  call = custom_partitioning(lambda *args: tuple(fn(*args)))
  call.def_partition(partition, sharding_rule=rule, need_replication_factors=others,
                     reduction_factors=("b",) if summed else ())
  return tuple(jax.custom_batching.sequential_vmap(call)(*operands))
