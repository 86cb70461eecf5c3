"""The `rnn()` entry: input validation, defaults, and dispatch to a backend.

Every check happens at trace time on static shapes and dtypes, so bad input
raises `ValueError`/`TypeError` naming the argument, the expected and the
actual value before anything reaches XLA or cuDNN.

`seq_lengths` values are checked where they are known (outside `jit`, or a
NumPy array or list closed over): a length outside `[0, T]` raises
`ValueError`. Traced values cannot be checked at trace time; they are clamped to
`[0, T]` on every backend, so both give the same answer (a length of 0 leaves
the initial state as the final state and an all-zero output).

Under symbolic shapes (a shape-polymorphic `jax.export`), the cuDNN path runs
cuDNN's inference call, whose sizes are read when it runs; a derivative there
is the "xla" path's under `implementation=None` and an error under "cudnn"
(`_symbolic`). An export for CUDA holds the cuDNN calls
(`_cudnn.export_disabled_checks`, `_cudnn.register_ffi_targets`).

A call (eager, or under an eager `grad` or `vmap`) whose arrays lie on
different devices (one `jax.device_put` to another device than the rest) is
a `ValueError` naming the arguments and their devices. JAX's own error names
this module's inner names, or a zero state made here that the caller never
passed (`_raise_where_devices_differ`). The devices are asked only once JAX
has refused, so that a call pays nothing for them.

An eager call compiles a program for each new shape, which the two dispatch
`jit`s below keep; on a CPU each program's kernels are mapped into memory one
by one (about 100-210 mappings a program), and a process that passes Linux's
limit on mappings (`vm.max_map_count`, 65530 by default) crashes inside XLA's
compiler. So after a call that compiled one, where the process holds more
than half that limit, the dispatch `jit`s drop their programs
(`_bound_programs`): later calls compile again what they need. Measured: a
two-layer bidirectional GRU's eager calls at 60 lengths took 6481 mappings,
208 after the drop (session 85).

Where DESIGN §2 has `implementation=None` pick cuDNN on a CUDA device, a call
of one step (decoding a token at a time) runs the "xla" path instead
(`one_step_on_xla`, which says why): cuDNN's fixed cost per call is more than
a step's whole work there, and the two paths give the same values (within
cuDNN's rounding).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import jax
import jax.numpy as jnp

from jax_cudnn_rnn import (_cudnn, _dropout, _layout, _params, _partition, _reference,
                           _symbolic, _xla)

IMPLEMENTATIONS = (None, "xla", "cudnn")

# A one-step cuDNN call is slow: decoding on a GPU (benchmarks/decode.py,
# float32, ten shapes B1-B32, H128-H256, one and two layers, buffers of up to
# 1.05M elements), the "xla" path took this share of a cuDNN call's time per
# token, on an H100 (session 46) and an H200 (session 63; benchmarks/NOTES.md):
# in a jitted 64-step `lax.scan` 0.22-0.32x and 0.22-0.38x (15-31 us against
# 45-130), one jitted call per token 0.58-0.68x and 0.52-0.76x, an eager call
# 0.69-0.80x and 0.68-0.82x: faster at all sixty. What a cuDNN call costs
# beyond its products (host-side work and launches, under the standard
# algorithm as under the persistent one) does not grow with the model, while
# the products are the same work on either path; but in a loop XLA:GPU copies
# the weights out of the buffer at every step (session 63), which does grow.
# Those copies bound the rule: 2^22 elements (16 MiB in float32) copy in about
# 10 us at an H100's bandwidth, under the 30-100 us a cuDNN step cost beyond
# the "xla" path's in the loops above. Larger models, and calls of more steps
# (neither measured), keep cuDNN.
ONE_STEP_XLA_MAX_ELEMENTS = 1 << 22


def one_step_on_xla(spec, steps) -> bool:
  """Whether `implementation=None` runs a call of `steps` steps on the "xla"
  path where cuDNN could run it: one step (a concrete one: a symbolic time
  axis keeps cuDNN), of a model whose buffer holds at most
  `ONE_STEP_XLA_MAX_ELEMENTS`."""
  return (_reference.is_known_one(steps)
          and _layout.params_size(spec) <= ONE_STEP_XLA_MAX_ELEMENTS)


def _as_array(name: str, value, dtype=None, *, real: bool = False) -> jax.Array:
  """`value` as an array. An array keeps its dtype (the caller checks it); a
  nested list or a Python number has none of its own, so it takes `dtype`
  when given (the spec's: without it, a list would be float64 under x64, or
  float32 for a bfloat16 model, and refused). `real`: as `_params.as_array`'s."""
  if isinstance(value, jax.Array):  # tracers too; jnp.asarray would take 20-30 us to return it
    return _params.check_real(name, value) if real else value
  if (not real and isinstance(value, np.ndarray)
      and not _params.has_real_dtype(value)):  # (an object array cannot even be converted)
    return value  # refused by the caller's dtype check, in its terms
  own_dtype = isinstance(value, np.ndarray) or hasattr(value, "__jax_array__")
  if not own_dtype and not isinstance(value, (list, tuple, int, float)):
    raise TypeError(f"{name} must be an array, got {type(value).__name__}")
  return _params.as_array(name, value, lambda v: jnp.asarray(v, None if own_dtype else dtype),
                          real=real)


def _check_dtype(name: str, array: jax.Array, dtype: np.dtype) -> None:
  if array.dtype != dtype:  # not np.dtype(): a PRNG key array's dtype is none of numpy's
    hint = ""
    if dtype == np.float64 and not jax.config.jax_enable_x64:
      hint = f" ({_params.X64_HINT})"
    raise TypeError(f"{name} must have dtype {dtype.name} (the spec's dtype), "
                    f"got {array.dtype}{hint}")


class Axes(NamedTuple):
  """How a call read its input's first two axes: `steps` and `batch` as
  `time_major` says; `input_name`, what the caller calls the input."""
  steps: int
  batch: int
  time_major: bool
  input_name: str = "input_data"

  @classmethod
  def of(cls, shape, time_major: bool, input_name: str = "input_data") -> Axes:
    """The axes of an input of `shape` (`[T, B, .]`, or `[B, T, .]` unless
    `time_major`)."""
    steps, batch = shape[:2] if time_major else shape[1::-1]
    return cls(steps, batch, bool(time_major), input_name)


def other_layout_hint(axes: Axes, given_batch) -> str:
  """For an array whose batch axis holds `given_batch` rather than the
  input's batch: where that is the input's number of steps, the input was
  most likely given in the other layout, and a hint says so; else ""."""
  sizes = (given_batch, axes.steps)  # (symbolic ones are not compared)
  if not all(isinstance(n, (int, np.integer)) for n in sizes) or given_batch != axes.steps:
    return ""
  if axes.time_major:
    return (f"; read time-major ([T, B, ...]), the shape of {axes.input_name} gives "
            f"T={axes.steps} and B={axes.batch}: batch-major data needs time_major=False")
  return (f"; read batch-major ([B, T, ...], time_major=False), the shape of {axes.input_name} "
          f"gives B={axes.batch} and T={axes.steps}: time-major data needs time_major=True")


def check_state_shape(spec, name: str, shape, axes: Axes, *, unit_name: str = "num_units",
                      pair: bool = False):
  """Raises a `ValueError` unless `shape` is that of an initial state of
  `spec` for the input read as `axes` says (its batch, and its steps for
  the hint of a state whose batch they are); `unit_name` is what the caller
  calls the last axis (the Flax adapters say features). `pair`: the state was
  given as a tuple or list of two (an LSTM's `(h, c)` carry, as Flax's cells
  hold one)."""
  expected = (spec.num_layers * spec.num_dirs, axes.batch, spec.num_units)
  if tuple(shape) != expected:
    hint = ""
    if len(shape) == 3 and (shape[0], shape[2]) == (expected[0], expected[2]):
      hint = other_layout_hint(axes, shape[1])
    elif tuple(shape) == expected[1:]:
      hint = ("; unlike flax.linen.RNN's cells, the states have a leading axis of "
              "num_layers * num_dirs even for one layer")
    elif pair and tuple(shape) == (2, *expected) and spec.has_cell_state:
      hint = (f"; it was given a pair of states: {type(spec).__name__} takes them apart, "
              "input_h then input_c")
    raise ValueError(f"{name} must have shape {expected} (num_layers * num_dirs, batch, "
                     f"{unit_name}), got {tuple(shape)}{hint}")


def _check_state(spec, name, state, axes: Axes):
  if state is None:
    return jnp.zeros((spec.num_layers * spec.num_dirs, axes.batch, spec.num_units), spec.dtype)
  pair = isinstance(state, (tuple, list)) and len(state) == 2
  state = _as_array(name, state, spec.dtype)
  check_state_shape(spec, name, state.shape, axes, pair=pair)
  _check_dtype(name, state, spec.dtype)
  return state


def _known_values(value):
  """The values of `value` where they are known: a concrete array, or a NumPy
  array or list even under `jit` (where `jnp.asarray` makes a tracer of it),
  read before JAX narrows it (without x64, 2**32 would become 0); else None."""
  if isinstance(value, jax.core.Tracer):
    return None
  try:
    return np.asarray(value)
  except jax.errors.TracerArrayConversionError:  # a list holding tracers
    return None


def _check_seq_lengths(seq_lengths, axes: Axes):
  if seq_lengths is None:
    return None
  batch, steps = axes.batch, axes.steps
  given = seq_lengths
  seq_lengths = _as_array("seq_lengths", seq_lengths)
  if seq_lengths.shape != (batch,):
    hint = other_layout_hint(axes, seq_lengths.shape[0]) if seq_lengths.ndim == 1 else ""
    raise ValueError(f"seq_lengths must have shape ({batch},) (batch,), "
                     f"got {tuple(seq_lengths.shape)}{hint}")
  if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
    raise TypeError(f"seq_lengths must have an integer dtype, got {seq_lengths.dtype}")
  values = _known_values(given)
  if values is not None:
    bad = np.flatnonzero((values < 0) | (values > steps))
    if bad.size:
      raise ValueError(f"seq_lengths must be in [0, {steps}] (0 to the number of steps), got "
                       f"{values[bad[0]]} for sequence {bad[0]}")
  return jnp.clip(seq_lengths, 0, steps).astype(jnp.int32)


def resolve_implementation(implementation):
  """Returns "xla", "cudnn" or "auto" (cuDNN on CUDA devices, XLA elsewhere)."""
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
  if implementation == "xla":
    return "xla"
  available, why = _cudnn.availability()
  if implementation == "cudnn" and not available:
    raise RuntimeError(f"implementation='cudnn' cannot run here: {why}. "
                       "Use implementation=None or 'xla' for the pure-JAX path.")
  if implementation == "cudnn":
    return "cudnn"
  if not available:
    _cudnn.warn_if_gpu_without_library()
  return "auto" if available else "xla"


ARGUMENTS = ("input_data", "input_h", "input_c", "params", "seq_lengths", "dropout_key")


def rnn(spec, input_data, input_h, input_c, params, *, is_training=True,
        seq_lengths=None, dropout_key=None, time_major=True, implementation=None,
        argument_names=ARGUMENTS):
  """Validates the call of `spec` and runs it; see the spec's `__call__`.

  `argument_names`: what the devices' error calls the six arrays, and the
  layout hint (`other_layout_hint`) the input (the Flax modules' own terms,
  `_adapter.run`)."""
  if not isinstance(is_training, (bool, np.bool_)):
    raise TypeError(
        f"is_training must be a Python bool, got {type(is_training).__name__}"
        + ("" if spec.has_cell_state else
           f"; {type(spec).__name__} takes (input_data, input_h, params): it has no input_c"))
  if not isinstance(time_major, (bool, np.bool_)):
    raise TypeError(f"time_major must be a Python bool, got {type(time_major).__name__}")
  x = _as_array("input_data", input_data, spec.dtype)
  if x.ndim != 3:
    layout = "[T, B, input_size]" if time_major else "[B, T, input_size]"
    raise ValueError(f"input_data must have rank 3 {layout}, got shape {tuple(x.shape)}")
  if x.shape[-1] != spec.input_size:
    raise ValueError(f"input_data's last dimension must be input_size={spec.input_size}, "
                     f"got shape {tuple(x.shape)}")
  axes = Axes.of(x.shape, time_major, argument_names[0])
  steps, batch = axes.steps, axes.batch
  if steps == 0 or batch == 0:
    raise ValueError(f"input_data must have at least one step and one sequence, got shape "
                     f"{tuple(x.shape)} (time_major={time_major})")
  _check_dtype("input_data", x, spec.dtype)
  h0 = _check_state(spec, "input_h", input_h, axes)
  if spec.has_cell_state:
    c0 = _check_state(spec, "input_c", input_c, axes)
  elif input_c is not None:
    raise ValueError(f"input_c must be None for {type(spec).__name__}: it has no cell state")
  else:
    c0 = None
  params = _params._check_params(spec, params)
  lengths = _check_seq_lengths(seq_lengths, axes)
  # Data parallelism under explicit sharding: every operand is split by the
  # data's batch alone (`_partition.batch_like`): the states and lengths
  # follow it (zeros made above have none of their own), and any other split
  # (time, features, units, layers, the weight buffer) is gathered first.
  # (Asked of the data once: asked for each operand, it took 14 us of an eager
  # call, once 2.4; session 75.)
  if _partition.explicitly_sharded(x):
    data_axis = 1 if time_major else 0
    try:
      h0, c0 = (_partition.batch_like(s, 1, x, data_axis) for s in (h0, c0))
      lengths = _partition.batch_like(lengths, 0, x, data_axis)
      params = _partition.batch_like(params, None, x, data_axis)
      x = _partition.batch_like(x, data_axis, x, data_axis)
    except ValueError as e:
      _raise_where_devices_differ(e, (x, h0, c0, params, lengths, dropout_key),
                                  (input_h, input_c), argument_names)
      raise
  apply_dropout = bool(is_training) and _dropout.drops(spec)
  if apply_dropout and dropout_key is None:
    raise ValueError(f"dropout_key is required when is_training=True and dropout="
                     f"{spec.dropout} > 0: pass dropout_key=jax.random.key(...)")
  if dropout_key is not None:  # checked even where unused: it would be used elsewhere
    dropout_key = _params.check_key("dropout_key", dropout_key)

  backend = resolve_implementation(implementation)
  # None means "the best that runs": the "xla" path where cuDNN is the slower
  # (one step) or cannot run the call (e.g. a data type this cuDNN lacks).
  if backend == "auto" and (one_step_on_xla(spec, steps)
                            or not _cudnn.supports(spec, steps, batch, bool(time_major))[0]):
    backend = "xla"
  operands = (x, h0, c0, params, lengths, dropout_key)
  traced = [a for a in jax.tree.leaves(operands) if isinstance(a, jax.core.Tracer)]
  if not traced:
    run = _compiled_dispatch
  elif backend == "xla" and all(_has_value(t) for t in traced):
    run = _compiled_transformed_dispatch
  else:
    run = _dispatch
  # cuDNN's algorithm policy (JAX_CUDNN_RNN_ALGORITHM) is read while the cuDNN
  # call is traced; read here too, it keys the compiled caches below, so that a
  # policy changed between two eager calls is not answered by the program
  # traced under the old one (and a bad value is refused at every call).
  policy = None if backend == "xla" else _cudnn.algorithm_policy()
  try:
    y, h, c = run(spec, backend, apply_dropout, bool(time_major), policy, *operands)
  except ValueError as e:
    _raise_where_devices_differ(e, operands, (input_h, input_c), argument_names)
    raise
  if run is not _dispatch:
    _bound_programs(run)
  return (y, h, c) if spec.has_cell_state else (y, h)


def _raise_where_devices_differ(error: ValueError, operands, states_given, names) -> None:
  """Where the operands a caller placed (committed arrays: `jax.device_put`,
  or results of computations there; under an eager `grad` or `vmap`, the
  values traced) lie on different devices, which no one computation can
  take, raises a ValueError naming each with its devices, from `error` (what
  JAX raised: it names inner arguments); else returns. Arrays JAX placed by
  default (numpy converted, zero states made here) follow the others, so
  they are left out, as are a `jit`'s tracers, which have no devices, and
  the zero states made for an `input_h` or `input_c` given as None
  (`states_given`: the two as given), which under `jax.set_mesh` lie on its
  mesh. Asked only once JAX has refused: a call pays nothing for it."""
  x, h0, c0, *rest = operands
  h_given, c_given = states_given
  operands = (x, None if h_given is None else h0, None if c_given is None else c0, *rest)
  values = {name: _value(a) for name, a in zip(names, operands)}
  placed = {name: sorted(a.sharding.device_set, key=lambda d: d.id)
            for name, a in values.items() if isinstance(a, jax.Array) and a.committed}
  if len({tuple(devices) for devices in placed.values()}) < 2:
    return
  where = ", ".join(f"{name} on {devices}" for name, devices in placed.items())
  raise ValueError(f"the arrays of one call must lie on the same devices, got {where} (move "
                   "them with jax.device_put; arrays not put anywhere follow the others)"
                   ) from error


def _dispatch(spec, backend, apply_dropout, time_major, policy, x, h0, c0, params, lengths,
              dropout_key):
  """Runs the validated call on `backend` ("xla", "cudnn" or "auto"). `policy`,
  the cuDNN algorithm policy the call was made under, is only a cache key: the
  cuDNN path reads the same policy while it is traced (`_cudnn.choose_algorithms`).

  Its operations are named for the spec (`jax.named_scope`): in a profile or
  an HLO dump the call reads as `jit(step)/CudnnLSTM/...`, differentiated
  `jvp(CudnnLSTM)` and `transpose(jvp(CudnnLSTM))`, on either path
  (tests/test_op_names.py)."""
  with jax.named_scope(type(spec).__name__):
    options = dict(seq_lengths=lengths, dropout_key=dropout_key, apply_dropout=apply_dropout,
                   time_major=time_major)
    xla = lambda *a: _xla.rnn(spec, *a, **options)
    if any(jax.export.is_symbolic_dim(d) for d in x.shape):
      # Shape-polymorphic jax.export: cuDNN's values, another derivative (_symbolic).
      derivative = None if backend == "cudnn" else _xla.rnn
      cudnn = lambda *a: _symbolic.rnn(spec, *a, derivative=derivative, **options)
    else:
      cudnn = lambda *a: _cudnn.rnn(spec, *a, **options)
    if backend == "xla":
      return xla(x, h0, c0, params)
    if backend == "cudnn":
      return cudnn(x, h0, c0, params)
    # Decided at lowering: cuDNN when the computation is placed on a CUDA
    # device, the pure-JAX path on any other (a CPU device of a GPU machine).
    return jax.lax.platform_dependent(x, h0, c0, params, cuda=cudnn, default=xla)


# An eager call (no operand traced: a notebook, a loop outside `jit`) runs
# through a `jax.jit` of `_dispatch`, so that it compiles once per spec,
# options and shapes and then runs from the cache. Called op by op, the
# recurrence's scan and derivative rules were traced and compiled anew at every
# call: 0.75 s a call against 1-2 ms (an LSTM, 2 layers, 64 units, T=50, B=8,
# XLA:CPU). `inline=True` inlines the call into an enclosing `jit` that closes
# over concrete operands.
_compiled_dispatch = jax.jit(_dispatch, static_argnums=(0, 1, 2, 3, 4), inline=True)

# A transformation applied eagerly (`jax.grad`, `jax.jvp`, `jax.linearize`,
# `jax.vmap`, outside `jit`: operands traced, but holding values) of the "xla"
# path goes through a `jit` of its own too. JAX transforms a `jit` by
# transforming its program, and memoizes that; the transposed linear part of a
# gradient stays a call of its own, compiled once (hence `inline=False`:
# inlined, the backward loop ran op by op, compiled anew every time). A
# 2-layer LSTM (64 units, T=50, B=8, XLA:CPU), eager `jax.grad`: 0.95 s a call
# before (Flax's scan: 0.86 s), 4-6 ms now; eager `jax.vmap` over 4 such
# batches: 0.9 s -> 4 ms; the `jax.vmap` of its `jax.grad`: 1 s -> 15 ms.
# Not for cuDNN: differentiated through a nested `jit`, the cuDNN path traced
# cuDNN's inference call besides its training call
# (tests/test_cudnn_plumbing.py counts the calls traced; whether XLA then
# drops the extra one is not known without a GPU).
# Any other traced call (under `jit`, `jax.checkpoint`, `shard_map`; any on
# the cuDNN path) calls `_dispatch` itself, in the caller's trace, and makes
# the same program as before these caches.
_compiled_transformed_dispatch = jax.jit(_dispatch, static_argnums=(0, 1, 2, 3, 4))

# How many programs each dispatch `jit` held after the last call through it.
_PROGRAMS = {}
# Linux's limit on a process's memory mappings, and the process's mappings.
MAX_MAP_COUNT = "/proc/sys/vm/max_map_count"
MAPS = "/proc/self/maps"


def _bound_programs(run) -> None:
  """After a call through `run` (a dispatch `jit`) that compiled a program:
  where the process's memory mappings are past half of Linux's limit, both
  dispatch `jit`s drop the programs they keep (the module docstring). A call
  that compiled nothing asks the `jit` its size only (about 30 ns)."""
  size_of = getattr(run, "_cache_size", None)
  if size_of is None:  # a JAX whose jit does not say: nothing to bound by
    return
  size = size_of()
  changed = size != _PROGRAMS.get(run, 0)  # compiled one (or was cleared elsewhere)
  _PROGRAMS[run] = size
  if changed and _mappings_past_half():
    for jitted in (_compiled_dispatch, _compiled_transformed_dispatch):
      jitted.clear_cache()
      _PROGRAMS[jitted] = 0


def _mappings_past_half() -> bool:
  """Whether this process holds more than half the memory mappings Linux
  allows it; False where either is not known (no /proc: another system)."""
  try:
    with open(MAX_MAP_COUNT) as limit, open(MAPS, "rb") as maps:
      return maps.read().count(b"\n") > int(limit.read()) // 2
  except (OSError, ValueError):
    return False

# Where each transformation's tracer keeps what it wraps: a value, outside `jit`.
_WRAPPED = {"JVPTracer": "primal", "LinearizeTracer": "primal", "BatchTracer": "val"}


def _value(operand):
  """The value `operand` holds: itself, or where it is differentiation's or
  `vmap`'s tracer over a value (an operand of a transformation applied
  outside `jit`), that value; else None (a `jit`'s or `jax.checkpoint`'s
  tracer, or a tracer of a JAX that keeps its values elsewhere)."""
  while isinstance(operand, jax.core.Tracer):
    operand = getattr(operand, _WRAPPED.get(type(operand).__name__, ""), None)
  return operand if isinstance(operand, (jax.Array, np.ndarray)) else None


def _has_value(tracer) -> bool:
  """Whether `tracer` holds a value (`_value`): where not, the call is traced
  as under `jit`."""
  return _value(tracer) is not None
