"""The cuDNN backend: loads the native library, registers its FFI targets, and
wraps them in a `custom_vjp` whose residual is cuDNN's reserve space.

- The library (`libjax_cudnn_rnn.so`, built from `xla_ffi/`) is looked up next
  to this file and in the installed package folders (an editable install puts
  it in site-packages). cuDNN itself is the one the JAX CUDA plugin loads, or
  the `nvidia-cudnn-cu13` wheel's. Where JAX sees a CUDA device but the
  library is missing or does not load, `implementation=None` warns once and
  runs the "xla" path (`warn_if_gpu_without_library`).
- Sizes (weight space, reserve space) are queried from cuDNN at trace time
  through a plain C entry point and cached per configuration, so the reserve
  space is an output of static shape.
- The algorithm: cuDNN's persistent small-hidden-size one where its limits
  allow (float32, no `seq_lengths`, small hidden sizes), else the standard one
  (`choose_algorithms`, per pass; `JAX_CUDNN_RNN_ALGORITHM=standard` for the
  standard one everywhere). Under the persistent one, batch-major data goes to
  cuDNN sequence-major, transposed around the call: a departure from DESIGN's
  "no transposes" for that layout, whose reason `_run_fused` gives.
- Without `seq_lengths`, the handler gets a device array of full lengths and
  never synchronises with the host. cuDNN needs lengths >= 1: zero lengths are
  run as 1 and their outputs and final states replaced afterwards (outside the
  `custom_vjp`, so gradients are right too).
- Inter-layer dropout runs each layer as its own fused call, with the same
  JAX-drawn masks as the "xla" path (`_dropout`); without dropout all layers
  are one call.
- The opaque buffer is handed to cuDNN as is when cuDNN's reported weight
  layout equals `_layout`'s (expected; a GPU test checks it), and gathered into
  cuDNN's layout otherwise (`cudnn_order`), so a differing cuDNN still gives
  right values and gradients.
- Several devices (`_partition`): each call runs on its own device's rows of
  a batch-sharded input, under explicit sharding (`shard_map`) and auto
  sharding (`custom_partitioning`); the reserve space is `[batch, row_bytes]`
  so that it can be split too.
- Symbolic shapes (a shape-polymorphic `jax.export`): only the inference call
  runs (its sizes are read when it runs; a query asks for one step and one
  sequence, `_query_dims`); a derivative there is decided in `_symbolic`.
- `vmap`: inference with shared weights folds the vmapped axis into cuDNN's
  batch (one call, `_inference`); everything else is one call per element.
- Reverse mode only: cuDNN has no forward-mode derivative, and JAX refuses
  `jvp` of a `custom_vjp`; forward mode on a GPU takes `implementation="xla"`
  (the README says so). Not verified on a GPU yet.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import os
import pathlib
import sysconfig
import warnings

import numpy as np
import jax
import jax.numpy as jnp

from jax_cudnn_rnn import _dropout, _layout, _partition, _reference

LIBRARY_NAME = "libjax_cudnn_rnn.so"
CELL_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}
# cudnnDataType_t values.
CUDNN_DATA_TYPES = {
    np.dtype(jnp.float32): 0,
    np.dtype(jnp.float64): 1,
    np.dtype(jnp.float16): 2,
    np.dtype(jnp.bfloat16): 9,
}
TARGETS = {
    "jcr_rnn_forward_inference": "JcrRnnForwardInference",
    "jcr_rnn_forward_training": "JcrRnnForwardTraining",
    "jcr_rnn_backward_data": "JcrRnnBackwardData",
    "jcr_rnn_backward_weights": "JcrRnnBackwardWeights",
}


def _library_candidates() -> list[pathlib.Path]:
  here = pathlib.Path(__file__).resolve().parent
  folders = [here]
  for scheme_key in ("platlib", "purelib"):
    folders.append(pathlib.Path(sysconfig.get_paths()[scheme_key]) / "jax_cudnn_rnn")
  return [f / LIBRARY_NAME for f in dict.fromkeys(folders)]


def _preload_cudnn_wheel() -> None:
  """Loads the cuDNN wheel's libcudnn globally so our library's dependency resolves."""
  spec = importlib.util.find_spec("nvidia.cudnn")
  if spec is None or not spec.submodule_search_locations:
    return
  for folder in spec.submodule_search_locations:
    candidate = pathlib.Path(folder) / "lib" / "libcudnn.so.9"
    if candidate.exists():
      try:
        ctypes.CDLL(str(candidate), mode=ctypes.RTLD_GLOBAL)
      except OSError:
        pass
      return


@functools.lru_cache(maxsize=None)
def _load():
  """The native library, or None with the reason it is not available."""
  path = next((p for p in _library_candidates() if p.exists()), None)
  if path is None:
    return None, (f"the native library {LIBRARY_NAME} was not built (the CUDA toolkit, "
                  "cuDNN's headers or JAX's FFI headers were not found at install time)")
  _preload_cudnn_wheel()
  try:
    return ctypes.CDLL(str(path)), ""
  except OSError as e:
    return None, f"the native library {path} failed to load: {e}"


def _has_cuda_device() -> bool:
  try:
    return bool(jax.devices("cuda"))
  except RuntimeError:
    return False


@functools.lru_cache(maxsize=None)
def _registered_library():
  lib, why = _load()
  if lib is None:
    raise RuntimeError(why)
  for target, symbol in TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="CUDA")
  lib.JcrRnnQuerySizes.restype = ctypes.c_int
  lib.JcrRnnWeightLayout.restype = ctypes.c_int
  return lib


def register_ffi_targets() -> None:
  """Registers the native library's FFI targets with XLA for CUDA.

  Tracing a model on the cuDNN path does this by itself; a process that only
  runs a deserialized `jax.export` artifact holding cuDNN calls never traces
  one, so it calls this first (`import jax_cudnn_rnn` alone does not load the
  library). Raises `RuntimeError` where the native library is not built or does
  not load, saying why. Needs no GPU."""
  _registered_library()


def export_disabled_checks() -> list:
  """The `disabled_checks` that let `jax.export.export` serialize a model whose
  cuDNN path is lowered (`platforms` including "cuda", concrete shapes): JAX
  refuses custom calls it does not know to be stable, and these are this
  library's. An artifact holding them runs with the same version of this
  library, after `register_ffi_targets()`; the "xla" path needs neither."""
  return [jax.export.DisabledSafetyCheck.custom_call(target) for target in TARGETS]


def cudnn_version() -> str | None:
  """The version of the cuDNN the native library runs on (e.g. "9.14.0"), or None
  where the library is not built. Needs no GPU."""
  lib, _ = _load()
  if lib is None:
    return None
  lib.JcrCudnnVersion.restype = ctypes.c_size_t
  v = int(lib.JcrCudnnVersion())
  return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def availability() -> tuple[bool, str]:
  """`(True, "")` when cuDNN can run the computation, else `(False, why)`."""
  lib, why = _load()
  if lib is None:
    return False, why
  if not _has_cuda_device():
    return False, "JAX sees no CUDA device"
  return True, ""


@functools.lru_cache(maxsize=None)
def warn_if_gpu_without_library() -> None:
  """Warns, once a process, where JAX sees a CUDA device but the native
  library is missing or does not load: `implementation=None` then runs the
  pure-JAX path on that GPU instead of cuDNN's fused kernels, which a user
  would not otherwise learn (an install with pip's build isolation, for
  instance, builds without the library: its build environment has no jax)."""
  lib, why = _load()
  if lib is None and _has_cuda_device():
    warnings.warn(
        f"jax_cudnn_rnn: JAX sees a CUDA device, but {why}, so implementation=None runs the "
        "pure-JAX 'xla' path there, not cuDNN. To build the library, install the package "
        "with `pip install --no-build-isolation` in an environment that has jax[cuda13] and "
        "nvidia-cudnn-cu13 (README); pass implementation='xla' to choose the pure-JAX "
        "path and silence this warning.", RuntimeWarning, stacklevel=2)


def in_compiled(compiled) -> bool:
  """Whether a computation calls cuDNN's RNN: the proof that
  `implementation=None` picked it. Takes a compiled computation
  (`jax.jit(f).lower(...).compile()`), a lowered one (`.lower(...)`, for
  instance for another platform: `.trace(...).lower(lowering_platforms=
  ("cuda",))`), or the text of either (HLO or StableHLO)."""
  text = compiled if isinstance(compiled, str) else compiled.as_text()
  return any(f'"{target}"' in text or f"@{target}(" in text for target in TARGETS)


# -- the algorithm -----------------------------------------------------------------
#
# cuDNN's standard algorithm runs each step as separate kernels. Its persistent
# small-hidden-size algorithm, CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H, keeps the
# recurrent weights in registers and runs the recurrence in one kernel: much
# faster at small hidden sizes (PyTorch measured up to 10x, pytorch#62143, and
# picks it by default). Its limits, which PyTorch's heuristic encodes and
# cuDNN's RNN feature table documents: no float64, no per-sequence lengths,
# and a largest hidden size per cell and pass. A training forward and its two
# backward passes share one reserve space, so they share one algorithm: the
# backward's limit decides for all three. Only float32 asks for it: on the H200
# (benchmarks/NOTES.md, sessions 38-39) PyTorch, running it at H128, was 2.9-5x
# faster than our standard algorithm in float32 but slower in bfloat16, and
# float16 was not measured. The cuDNN this library loaded keeps
# the weight layout of both algorithms identical (tests/test_layout_probe.py
# checks it on a CPU, test_cudnn.py on a GPU), and where cuDNN turns a persistent
# algorithm down for a configuration the native library falls back to the
# standard one (`RnnDescriptors::Init`; `query_sizes` reports which ran).

# cudnnRNNAlgo_t values this library asks for.
ALGORITHMS = {"standard": 0, "persist_static_small_h": 3}
# How the algorithm is chosen: "auto" (the default) picks the persistent one
# within its limits; "standard" always takes the standard one.
ALGORITHM_ENV = "JAX_CUDNN_RNN_ALGORITHM"
ALGORITHM_POLICIES = ("auto", "standard")
# The largest hidden size CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H runs at, per
# cell: (forward inference, training: forward and backward).
SMALL_H_LIMITS = {"lstm": (192, 128), "gru": (192, 128), "rnn_tanh": (384, 256),
                  "rnn_relu": (384, 256)}


def algorithm_policy() -> str:
  """The policy `JAX_CUDNN_RNN_ALGORITHM` sets, read when a call is traced."""
  value = os.environ.get(ALGORITHM_ENV, "auto")
  if value not in ALGORITHM_POLICIES:
    raise ValueError(f"environment variable {ALGORITHM_ENV} must be one of "
                     f"{', '.join(ALGORITHM_POLICIES)}; got {value!r}")
  return value


def choose_algorithms(spec, has_seq_lengths: bool) -> tuple[int, int]:
  """The cudnnRNNAlgo_t of `spec`'s inference call and of its training calls."""
  standard, small_h = ALGORITHMS["standard"], ALGORITHMS["persist_static_small_h"]
  if (algorithm_policy() == "standard" or has_seq_lengths
      or np.dtype(spec.dtype) != np.dtype(np.float32)):
    return standard, standard
  return tuple(small_h if spec.num_units <= limit else standard
               for limit in SMALL_H_LIMITS[spec.rnn_mode])


# -- configuration and size queries ---------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
  """Static description of one fused cuDNN call (hashable: a custom_vjp static arg).

  `algorithms`: the cudnnRNNAlgo_t of the inference call and of the training
  calls (`choose_algorithms`); `attrs(training)` sends the one a call runs."""

  rnn_mode: str
  num_layers: int
  hidden_size: int
  input_size: int
  bidirectional: bool
  skip_input: bool
  batch_major: bool
  allow_tf32: bool
  has_seq_lengths: bool
  algorithms: tuple[int, int] = (ALGORITHMS["standard"],) * 2

  def attrs(self, training: bool = False) -> dict:
    return dict(cell_mode=np.int64(CELL_MODES[self.rnn_mode]),
                num_layers=np.int64(self.num_layers), hidden_size=np.int64(self.hidden_size),
                input_size=np.int64(self.input_size), bidirectional=np.bool_(self.bidirectional),
                skip_input=np.bool_(self.skip_input), batch_major=np.bool_(self.batch_major),
                allow_tf32=np.bool_(self.allow_tf32),
                has_seq_lengths=np.bool_(self.has_seq_lengths),
                algo=np.int64(self.algorithms[int(training)]))

  @classmethod
  def of(cls, spec, time_major: bool, has_seq_lengths: bool) -> "Config":
    """The configuration that runs all of `spec`'s layers in one call."""
    return cls(spec.rnn_mode, spec.num_layers, spec.num_units, spec.input_size,
               spec.num_dirs == 2, spec.input_mode == "skip_input", not time_major,
               _allow_tf32(), has_seq_lengths, choose_algorithms(spec, has_seq_lengths))

  @property
  def num_states(self) -> int:
    return self.num_layers * (2 if self.bidirectional else 1)


# `jax_default_matmul_precision` values that ask float32 matmuls for float32
# accuracy (or better): the legacy names, and the dot algorithm presets that
# compute in float32 or emulate it with several passes. cuDNN's RNN then runs
# with plain FMA math. Every other value (unset, "default", "high", "tensorfloat32",
# one-pass TF32/BF16/F16/F8 presets) allows a TF32 pass.
FULL_FLOAT32_PRECISIONS = frozenset({
    "highest", "float32", "f32_f32_f32", "f64_f64_f64", "tf32_tf32_f32_x3",
    "bf16_bf16_f32_x6", "bf16_bf16_f32_x9"})


def _allow_tf32() -> bool:
  """TF32 only when JAX's default matmul precision allows it for float32."""
  precision = jax.config.jax_default_matmul_precision
  return precision is None or str(precision).lower() not in FULL_FLOAT32_PRECISIONS


def _error_buffer():
  return ctypes.create_string_buffer(1024)


@functools.lru_cache(maxsize=1024)
def query_sizes(cfg: Config, dtype: np.dtype, steps: int, batch: int) -> dict:
  """cuDNN's weight-space, workspace and reserve-space sizes in bytes: the
  inference workspace under `cfg`'s inference algorithm, the rest under its
  training algorithm; and `algorithms`, the two that cuDNN runs (`cfg`'s, or
  the standard one where cuDNN turned a persistent one down)."""
  inference = _query(cfg, dtype, steps, batch, cfg.algorithms[0])
  training = (inference if cfg.algorithms[1] == cfg.algorithms[0]
              else _query(cfg, dtype, steps, batch, cfg.algorithms[1]))
  if inference[0] != training[0]:
    raise ValueError(f"cuDNN's weight space for {cfg} has {inference[0]} bytes under "
                     f"algorithm {cfg.algorithms[0]} but {training[0]} under "
                     f"{cfg.algorithms[1]}; set {ALGORITHM_ENV}=standard")
  return dict(weight_space=training[0], workspace_inference=inference[1],
              workspace_training=training[2], reserve_space=training[3],
              algorithms=(int(inference[4]), int(training[4])))


def _query(cfg: Config, dtype: np.dtype, steps: int, batch: int, algo: int) -> tuple:
  """`JcrRnnQuerySizes`: weight space, workspaces, reserve space, algorithm run."""
  lib = _registered_library()
  out = (ctypes.c_uint64 * 5)()
  err = _error_buffer()
  status = lib.JcrRnnQuerySizes(
      ctypes.c_int64(CELL_MODES[cfg.rnn_mode]), ctypes.c_int64(cfg.num_layers),
      ctypes.c_int64(cfg.hidden_size), ctypes.c_int64(cfg.input_size),
      ctypes.c_int32(cfg.bidirectional), ctypes.c_int32(cfg.skip_input),
      ctypes.c_int32(cfg.batch_major), ctypes.c_int32(cfg.allow_tf32),
      ctypes.c_int32(CUDNN_DATA_TYPES[np.dtype(dtype)]), ctypes.c_int64(steps),
      ctypes.c_int64(batch), ctypes.c_int64(algo), out, err, ctypes.c_size_t(len(err)))
  if status != 0:
    raise ValueError(f"cuDNN rejected the RNN configuration {cfg} with dtype "
                     f"{np.dtype(dtype).name}, {steps} steps, batch {batch}: "
                     f"{err.value.decode(errors='replace')}")
  return tuple(out)


def _query_dims(steps, batch) -> tuple[int, int]:
  """`(steps, batch)` for a size query: a symbolic dimension is asked as 1.
  Only the inference call runs under symbolic shapes (`_symbolic`), and what
  it takes from a query (cuDNN's support of the configuration, its weight-space
  size) does not depend on either."""
  return tuple(1 if jax.export.is_symbolic_dim(d) else d for d in (steps, batch))


def supports(spec, steps: int, batch: int, time_major: bool) -> tuple[bool, str]:
  """Whether this cuDNN can run `spec` at this size: `(True, "")`, or `(False,
  why)`. It cannot where it rejects the configuration (a cuDNN may lack a data
  type, e.g. bfloat16 RNNs), or where its weight space is not the opaque buffer
  `_layout` describes (a size or placement that `cudnn_order` cannot map), so
  that `implementation=None` then runs the XLA path rather than failing."""
  cfg = call_config(spec, time_major, has_lengths=False)
  try:
    sizes = query_sizes(cfg, spec.dtype, *_query_dims(steps, batch))
  except ValueError as e:
    return False, str(e)
  expected = _layout.params_size(spec) * spec.dtype.itemsize
  if sizes["weight_space"] != expected:
    return False, (f"cuDNN's weight space for {spec} has {sizes['weight_space']} bytes, the "
                   f"opaque buffer {expected}")
  try:
    cudnn_order(spec)
  except RuntimeError as e:
    return False, str(e)
  return True, ""


def weight_layout(spec, algo: int = ALGORITHMS["standard"]) -> np.ndarray:
  """`[pseudo_layers, 2g, 5]` int64 rows from `cudnnGetRNNWeightParams`, with
  the RNN descriptor set to the algorithm `algo` (a cudnnRNNAlgo_t).

  Each row is `(matrix offset, rows, cols, bias offset, bias length)` in
  elements; a matrix cuDNN does not have (skip_input) has offset -1.
  """
  lib = _registered_library()
  rows = spec.num_layers * spec.num_dirs * 2 * spec.num_gates
  out = (ctypes.c_int64 * (rows * 5))()
  err = _error_buffer()
  status = lib.JcrRnnWeightLayout(
      ctypes.c_int64(CELL_MODES[spec.rnn_mode]), ctypes.c_int64(spec.num_layers),
      ctypes.c_int64(spec.num_units), ctypes.c_int64(spec.input_size),
      ctypes.c_int32(spec.num_dirs == 2), ctypes.c_int32(spec.input_mode == "skip_input"),
      ctypes.c_int32(CUDNN_DATA_TYPES[spec.dtype]), ctypes.c_int64(algo),
      ctypes.c_int64(spec.dtype.itemsize), out, ctypes.c_int64(rows * 5), err,
      ctypes.c_size_t(len(err)))
  if status != 0:
    raise RuntimeError(f"cudnnGetRNNWeightParams failed for {spec}: "
                       f"{err.value.decode(errors='replace')}")
  return np.frombuffer(out, np.int64).reshape(spec.num_layers * spec.num_dirs,
                                              2 * spec.num_gates, 5).copy()


# -- the custom_vjp around the FFI calls -------------------------------------------


def _shapes(cfg: Config, x, h0, c0):
  y_shape = x.shape[:2] + (cfg.hidden_size * (2 if cfg.bidirectional else 1),)
  return (jax.ShapeDtypeStruct(y_shape, x.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype),
          jax.ShapeDtypeStruct(c0.shape, c0.dtype))


def _steps_batch(cfg: Config, x):
  return (x.shape[1], x.shape[0]) if cfg.batch_major else (x.shape[0], x.shape[1])


# The batch dimension of each operand and result of the calls (`_partition`):
# data (x, y and their cotangents), states, the cell state (a zero-element
# buffer without one), the weights (none) and the lengths and reserve rows.
def _batch_axes(cfg: Config, arrays: str) -> tuple:
  axes = dict(x=0 if cfg.batch_major else 1, h=1, c=1 if cfg.rnn_mode == "lstm" else None,
              w=None, n=0)
  return tuple(axes[a] for a in arrays)


def _forward(cfg: Config, x, h0, c0, params, lengths, training: bool):
  steps, batch = _steps_batch(cfg, x)
  dtype = np.dtype(x.dtype)
  sizes = query_sizes(cfg, dtype, *_query_dims(steps, batch))
  if sizes["weight_space"] != params.size * params.dtype.itemsize:
    raise ValueError(f"params has {params.size * params.dtype.itemsize} bytes but cuDNN's "
                     f"weight space for {cfg} has {sizes['weight_space']}: the analytic "
                     "layout in _layout.py disagrees with this cuDNN version")
  if not training:
    return (*_inference(cfg)(x, h0, c0, params, lengths), None)
  if any(jax.export.is_symbolic_dim(d) for d in (steps, batch)):  # `_symbolic` keeps it away
    raise ValueError(f"cuDNN's training call needs concrete shapes, got steps {steps} and "
                     f"batch {batch}")
  row_bytes = _partition.reserve_row_bytes(
      lambda rows: query_sizes(cfg, dtype, steps, rows)["reserve_space"], batch)

  def train(x, h0, c0, params, lengths):
    reserve = jax.ShapeDtypeStruct((_steps_batch(cfg, x)[1], row_bytes), jnp.uint8)
    call = jax.ffi.ffi_call("jcr_rnn_forward_training", (*_shapes(cfg, x, h0, c0), reserve),
                            vmap_method="sequential")
    return tuple(call(x, h0, c0, params, lengths, **cfg.attrs(training=True)))

  return _partition.over_batch(train, (x, h0, c0, params, lengths), _batch_axes(cfg, "xhcwn"),
                               _batch_axes(cfg, "xhcn"))


def _inference(cfg: Config):
  """The inference call of `cfg`, `(x, h0, c0, params, lengths) -> (y, h, c)`.

  Under `vmap` with shared weights the sequences of every vmapped element are
  independent rows of one bigger batch, so they are folded into cuDNN's batch
  axis: one call, not one per element (batch-major data folds without a copy;
  time-major data and the states take a transpose). With vmapped weights it is
  one call per element. Training calls stay one per element: their weight
  gradients must be per element under `vmap(grad(...))`.
  """

  def run(x, h0, c0, params, lengths):
    call = jax.ffi.ffi_call("jcr_rnn_forward_inference", _shapes(cfg, x, h0, c0),
                            vmap_method="sequential")
    return tuple(call(x, h0, c0, params, lengths, **cfg.attrs()))

  @jax.custom_batching.custom_vmap
  def infer(x, h0, c0, params, lengths):
    return _partition.over_batch(run, (x, h0, c0, params, lengths), _batch_axes(cfg, "xhcwn"),
                                 _batch_axes(cfg, "xhc"))

  @infer.def_vmap
  def fold(axis_size, in_batched, *args):
    V = axis_size
    x, h0, c0, params, lengths = (a if batched else jnp.broadcast_to(a, (V, *a.shape))
                                  for a, batched in zip(args, in_batched))
    if in_batched[3]:  # per-element weights: a call each
      return jax.lax.map(lambda a: infer(*a), (x, h0, c0, params, lengths)), (True,) * 3
    lstm = cfg.rnn_mode == "lstm"  # else c0 is [V, 0]: no cell state
    B = x.shape[1] if cfg.batch_major else x.shape[2]
    merge = lambda a, axis: jnp.moveaxis(a, 0, axis).reshape(
        a.shape[1:axis + 1] + (V * B,) + a.shape[axis + 2:])
    split = lambda a, axis: jnp.moveaxis(
        a.reshape(a.shape[:axis] + (V, B) + a.shape[axis + 1:]), axis, 0)
    data_axis = 0 if cfg.batch_major else 1
    y, h, c = infer(merge(x, data_axis), merge(h0, 1), merge(c0, 1) if lstm else c0[0],
                    args[3], lengths.reshape(V * B))  # the shared weights
    return (split(y, data_axis), split(h, 1), split(c, 1) if lstm else c), (True, True, lstm)

  return infer


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(cfg: Config, x, h0, c0, params, lengths):
  y, h, c, _ = _forward(cfg, x, h0, c0, params, lengths, training=False)
  return y, h, c


def _fused_fwd(cfg, x, h0, c0, params, lengths):
  y, h, c, reserve = _forward(cfg, x, h0, c0, params, lengths, training=True)
  # A zero-element cell state (no cell state) is not kept: as a residual it
  # would be an operand of the backward's shard_map under explicit sharding,
  # which crashes jax 0.11.2's Shardy (see `_run_fused`).
  return (y, h, c), (x, h0, c0 if c0.size else None, params, lengths, y, reserve)


def _fused_bwd(cfg, residuals, cotangents):
  x, h0, c0, params, lengths, y, reserve = residuals
  if c0 is None:
    c0 = jnp.zeros((0,), x.dtype)
  dy, dh, dc = cotangents

  def backward_data(y, dy, h0, dh, c0, dc, params, lengths, reserve):
    x_shape = y.shape[:2] + (cfg.input_size,)
    outs = (jax.ShapeDtypeStruct(x_shape, y.dtype), jax.ShapeDtypeStruct(h0.shape, h0.dtype),
            jax.ShapeDtypeStruct(c0.shape, c0.dtype),
            jax.ShapeDtypeStruct(reserve.shape, reserve.dtype))
    call = jax.ffi.ffi_call("jcr_rnn_backward_data", outs, vmap_method="sequential",
                            input_output_aliases={8: 3})
    return tuple(call(y, dy, h0, dh, c0, dc, params, lengths, reserve,
                      **cfg.attrs(training=True)))

  def backward_weights(x, h0, y, lengths, reserve):
    call = jax.ffi.ffi_call("jcr_rnn_backward_weights",
                            jax.ShapeDtypeStruct(params.shape, params.dtype),
                            vmap_method="sequential")
    return (call(x, h0, y, lengths, reserve, **cfg.attrs(training=True)),)

  dx, dh0, dc0, reserve = _partition.over_batch(
      backward_data, (y, dy, h0, dh, c0, dc, params, lengths, reserve),
      _batch_axes(cfg, "xxhhccwnn"), _batch_axes(cfg, "xhcn"))
  (dparams,) = _partition.over_batch(backward_weights, (x, h0, y, lengths, reserve),
                                     _batch_axes(cfg, "xhxnn"), (None,), summed=True)
  grads = (dx, dh0, dc0, dparams)
  return (*(_partition.sum_to_match(g, p) for g, p in zip(grads, (x, h0, c0, params))), None)


_fused.defvjp(_fused_fwd, _fused_bwd)


def _layer_buffers(spec, params) -> list:
  """The opaque buffer of each layer alone, as a one-layer spec would have it.

  The one-layer layout is the whole buffer's restricted to the layer (its
  weight blocks, then its bias blocks), so a layer's buffer is its blocks in
  the buffer's order, taken from one `_reference.param_blocks` split of the
  whole buffer: the gradient of `params` is then one concatenation of the
  blocks' cotangents rather than a sum of a zero-padded buffer-sized array
  per layer (the reason `param_blocks` exists; benchmarks/NOTES.md, session 26).
  """
  blocks = _reference.param_blocks(spec, params)
  return [jnp.concatenate([block.reshape(-1) for (l, *_), block in blocks.items() if l == layer])
          for layer in range(spec.num_layers)]


def _layer_spec(spec, layer: int):
  """The one-layer spec whose buffer is `_layer_buffers(spec, .)[layer]`."""
  skip = spec.input_mode == "skip_input" and layer == 0
  return dataclasses.replace(spec, num_layers=1, input_size=spec.layer_input_size(layer),
                             input_mode="skip_input" if skip else "linear_input", dropout=0.0)


@functools.lru_cache(maxsize=256)
def cudnn_order(spec) -> np.ndarray | None:
  """Indices that gather an opaque buffer (`_layout`'s analytic layout) into the
  layout cuDNN reports through `cudnnGetRNNWeightParams`; None when the two are
  the same (the expected case, which the GPU tests check).

  This keeps results right even on a cuDNN whose layout departs from the
  analytic one: the gather is differentiable, so gradients come back in the
  analytic layout.
  """
  return order_from_layout(spec, weight_layout(spec))


def order_from_layout(spec, rows: np.ndarray) -> np.ndarray | None:
  """`cudnn_order` for the rows `weight_layout` reports (a pure function, so
  that it can also judge rows cuDNN reported elsewhere): None where they are
  the analytic layout; raises RuntimeError where they cannot be mapped."""
  weights, biases = _layout.tensors(spec)
  size = _layout.params_size(spec)
  order = np.full(size, -1, np.int64)
  for t in (*weights, *biases):
    row = rows[t.layer * spec.num_dirs + t.direction, t.index]
    offset, shape = (row[0], (row[1], row[2])) if t.kind == "weight" else (row[3], (row[4],))
    if offset < 0 or tuple(int(n) for n in shape) != t.shape or offset + t.size > size:
      raise RuntimeError(f"cuDNN places {_layout.tensor_name(spec, t)} of {spec} at offset "
                         f"{offset} with shape {tuple(shape)}; expected shape {t.shape} inside "
                         f"a buffer of {size} elements")
    order[offset:offset + t.size] = np.arange(t.offset, t.offset + t.size)
  # Every analytic element is placed once, so a position left unfilled means two
  # tensors overlap (or cuDNN leaves a gap).
  if (order < 0).any():
    raise RuntimeError(f"cuDNN's weight layout for {spec} does not cover the opaque buffer "
                       "exactly once")
  return None if (order == np.arange(size)).all() else order


# Which of the persistent small-h algorithm's calls get batch-major data as it
# is (cuDNN's batch-major layout) rather than transposed to sequence-major around
# them: "none", "inference" (the forward with no derivative taken: cuDNN's
# inference call; a derivative's calls stay sequence-major) or "all". PyTorch
# gives that algorithm sequence-major data only. On an H100 (benchmarks/NOTES.md,
# sessions 45-46) the two transposes cost 60-100 us a call at LSTM B8 T32 I64
# H128, far more than their kernels; given batch-major data, cuDNN 9.19 ran the
# forward faster (GRU B16 T50 H128: 0.27 against 0.35 ms) and training slower
# (0.43 against 0.38 ms: its backward launched 31 kernels against 15). On an H200
# (session 63) its values and gradients matched the reference in both
# ("inference" and "all"; `tests/test_cudnn.py`,
# `test_persistent_algorithm_on_batch_major_data`), and "inference" ran the
# forward faster than the transposes (B16 T50 H128 float32: LSTM 0.37 against
# 0.41 ms, GRU 0.29 against 0.35) and training as fast, within the runs' spread
# (it runs the same calls). Hence the default, "inference". `benchmarks/run.py`
# times "none" beside it (`ours-cudnn-transposed`). Read when the call is traced.
PERSISTENT_BATCH_MAJOR = "inference"
PERSISTENT_BATCH_MAJOR_CHOICES = ("none", "inference", "all")


def call_config(spec, time_major: bool, has_lengths: bool, training: bool = True) -> Config:
  """The configuration of `spec`'s fused call on data in this layout, for
  training (the forward and backward calls of a derivative) or not (cuDNN's
  inference call): as given, but sequence-major under the persistent small-h
  algorithm, unless `PERSISTENT_BATCH_MAJOR` says otherwise for these calls."""
  if PERSISTENT_BATCH_MAJOR not in PERSISTENT_BATCH_MAJOR_CHOICES:
    raise ValueError(f"_cudnn.PERSISTENT_BATCH_MAJOR must be one of "
                     f"{', '.join(PERSISTENT_BATCH_MAJOR_CHOICES)}; got {PERSISTENT_BATCH_MAJOR!r}")
  cfg = Config.of(spec, time_major, has_lengths)
  as_given = PERSISTENT_BATCH_MAJOR == "all" or (
      PERSISTENT_BATCH_MAJOR == "inference" and not training)
  if (cfg.batch_major and not as_given
      and ALGORITHMS["persist_static_small_h"] in cfg.algorithms):
    return Config.of(spec, True, has_lengths)
  return cfg


def _run_fused(spec, x, h0, c0, params, lengths, has_lengths, time_major):
  """`spec`'s layers as one fused call (`spec` may be a `_layer_spec`).

  Batch-major data goes to cuDNN as it is (its batch-major layout), but to the
  calls of a derivative that run the persistent small-h algorithm: there it is
  transposed to sequence-major around the calls (the layout PyTorch gives that
  algorithm, and the faster for its backward), as `PERSISTENT_BATCH_MAJOR` says.
  A departure from DESIGN's "no transposes" for the batch-major layout, costing
  four transposes of the data in a derivative at the small hidden sizes where
  that algorithm runs.
  """
  infer, train = (call_config(spec, time_major, has_lengths, training=t) for t in (False, True))
  if infer != train:  # the inference call's layout differs from the derivative's
    return _inference_in_its_own_layout(spec, infer, train, x, h0, c0, params, lengths)
  return _run_in(spec, train, x, h0, c0, params, lengths, time_major)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _inference_in_its_own_layout(spec, infer, train, x, h0, c0, params, lengths):
  """Batch-major data in the inference call's configuration `infer` (as given)
  for the value, and in the derivative's, `train` (sequence-major), for the
  forward of a derivative and its backward."""
  return _run_in(spec, infer, x, h0, c0, params, lengths, time_major=False)


def _inference_in_its_own_layout_fwd(spec, infer, train, x, h0, c0, params, lengths):
  run = lambda x, h0, c0, params: _run_in(spec, train, x, h0, c0, params, lengths,
                                          time_major=False)
  return jax.vjp(run, x, h0, c0, params)  # the vjp function (a pytree) is the residual


def _inference_in_its_own_layout_bwd(spec, infer, train, vjp, cotangents):
  return (*vjp(cotangents), None)


_inference_in_its_own_layout.defvjp(_inference_in_its_own_layout_fwd,
                                    _inference_in_its_own_layout_bwd)


def _run_in(spec, cfg, x, h0, c0, params, lengths, time_major):
  """`_run_fused` in `cfg`'s layout: batch-major data (`time_major` False) is
  transposed to sequence-major around the call where `cfg` is sequence-major."""
  if not time_major and not cfg.batch_major:  # batch-major data, run sequence-major
    y, h, c = _run_in(spec, cfg, jnp.swapaxes(x, 0, 1), h0, c0, params, lengths,
                      time_major=True)
    return jnp.swapaxes(y, 0, 1), h, c
  order = cudnn_order(spec)
  if order is not None:
    params = params[order]
  if c0 is not None:
    return _partition.explicit_over_batch(lambda *args: _fused(cfg, *args),
                                          (x, h0, c0, params, lengths),
                                          _batch_axes(cfg, "xhcwn"), _batch_axes(cfg, "xhc"))
  # Without a cell state the calls take a zero-element buffer in its place,
  # made inside the shard_map rather than passed in: a zero-element operand of
  # a shard_map crashes jax 0.11.2's Shardy (a segfault in its
  # ManualComputationUnusedInputsPattern, compiling the gradient under explicit
  # sharding; tests/sharded_cases.py under jax 0.11.2, in .ci/run).
  no_cell = lambda x: jnp.zeros((0,), x.dtype)
  y, h = _partition.explicit_over_batch(
      lambda x, h0, params, lengths: _fused(cfg, x, h0, no_cell(x), params, lengths)[:2],
      (x, h0, params, lengths), _batch_axes(cfg, "xhwn"), _batch_axes(cfg, "xh"))
  return y, h, None


def rnn(spec, x, h0, c0, params, *, seq_lengths=None, dropout_key=None, apply_dropout=False,
        time_major=True):
  """The multi-layer RNN through cuDNN; same contract as `_reference.rnn`."""
  steps, batch = (x.shape[0], x.shape[1]) if time_major else (x.shape[1], x.shape[0])
  has_lengths = seq_lengths is not None
  if has_lengths:
    lengths = jnp.maximum(seq_lengths, 1)
  else:
    lengths = jnp.full((batch,), steps, jnp.int32)
  if not apply_dropout:
    y, h, c = _run_fused(spec, x, h0, c0, params, lengths, has_lengths, time_major)
  else:
    D = spec.num_dirs
    hs, cs, y = [], [], x
    layer_buffers = _layer_buffers(spec, params)
    for layer in range(spec.num_layers):
      sl = slice(layer * D, (layer + 1) * D)
      y, h, c = _run_fused(_layer_spec(spec, layer), y, h0[sl],
                           None if c0 is None else c0[sl], layer_buffers[layer],
                           lengths, has_lengths, time_major)
      hs.append(h)
      cs.append(c)
      if layer < spec.num_layers - 1:
        y = _dropout.apply(y, dropout_key, layer, spec.dropout)
    h = jnp.concatenate(hs)
    c = None if c0 is None else jnp.concatenate(cs)
  if has_lengths:
    # Sequences of length 0 ran one step: give them their defined results.
    empty = seq_lengths == 0
    y = jnp.where(empty[None, :, None] if time_major else empty[:, None, None],
                  jnp.zeros((), y.dtype), y)
    h = jnp.where(empty[None, :, None], h0, h)
    if c is not None:
      c = jnp.where(empty[None, :, None], c0, c)
  return y, h, c
