"""The built native library: it exports every FFI handler and query entry
point, and (on the CPU, through `JcrRnnCheckInputs`) its handlers decode the
attributes Python sends and refuse bad input with an error.

Finds the library from JCR_NATIVE_LIBRARY (CI sets it to the CMake build
output) or in the installed package; skipped only when neither exists.
"""

import ctypes
import dataclasses
import functools
import importlib.metadata
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn
from helpers import native_library as _loaded_library


def test_library_exports_every_handler():
  lib = _loaded_library()
  for symbol in (*_cudnn.TARGETS.values(), "JcrRnnQuerySizes", "JcrRnnWeightLayout",
                 "JcrRnnCheckInputs", "JcrCudnnVersion"):
    assert getattr(lib, symbol) is not None, symbol


def test_library_reports_the_cudnn_it_loaded():
  """`JcrCudnnVersion` is cudnnGetVersion() of the loaded cuDNN, the wheel's here."""
  lib = _loaded_library()
  wheel = importlib.metadata.version("nvidia-cudnn-cu13")
  lib.JcrCudnnVersion.restype = ctypes.c_size_t
  v = int(lib.JcrCudnnVersion())
  assert (v // 10000, v // 100 % 100) == tuple(int(n) for n in wheel.split(".")[:2]), (v, wheel)


def test_register_ffi_targets_registers_the_built_library(monkeypatch):
  """`jcr.register_ffi_targets()` hands XLA every handler of the library (for
  CUDA: on this CPU the registration is accepted, not used); the fresh-process
  run of an exported model on a GPU is `test_cudnn.py`'s."""
  lib = _loaded_library()
  monkeypatch.setattr(_cudnn, "_load", lambda: (lib, ""))
  monkeypatch.setattr(_cudnn, "_registered_library",
                      functools.lru_cache(_cudnn._registered_library.__wrapped__))
  jcr.register_ffi_targets()
  assert _cudnn._registered_library.cache_info().misses == 1
  jcr.register_ffi_targets()  # once only
  assert _cudnn._registered_library.cache_info().hits == 1


# -- the handlers' attribute decoding and input checks, run on the CPU ------------
#
# `JcrRnnCheckInputs` decodes the cuDNN handlers' attribute dictionary and runs
# their input checks (xla_ffi/rnn_input_check.cc). Called exactly as `_cudnn`
# calls the forward handlers (operands, zero-size cell state, `Config.attrs()`),
# it proves on a machine without a GPU that the handlers read what Python sends,
# and that bad input comes back as an error rather than a crash.

CHECK_TARGET = "jcr_rnn_check_inputs"
REPORT_FIELDS = ("cell_mode", "num_layers", "hidden_size", "input_size", "bidirectional",
                 "skip_input", "batch_major", "allow_tf32", "has_seq_lengths", "algo", "steps",
                 "batch", "cudnn_type")


@pytest.fixture(scope="module")
def check_inputs():
  jax.ffi.register_ffi_target(CHECK_TARGET, jax.ffi.pycapsule(_loaded_library().JcrRnnCheckInputs),
                              platform="cpu")

  cpu = jax.devices("cpu")[0]  # also on a GPU machine, where the default device is the GPU

  def run(cfg, x, h0, c0, params, lengths, training=False):
    cell = c0 if c0 is not None else jnp.zeros((0,), x.dtype)
    operands = jax.device_put((x, h0, cell, params, lengths), cpu)
    call = jax.ffi.ffi_call(CHECK_TARGET, jax.ShapeDtypeStruct((len(REPORT_FIELDS),), jnp.int64))
    with jax.enable_x64(), jax.default_device(cpu):
      report = call(*operands, **cfg.attrs(training))
    return dict(zip(REPORT_FIELDS, np.asarray(report).tolist()))

  return run


def _operands(spec, T, B, time_major):
  dtype = spec.dtype
  S = spec.num_layers * spec.num_dirs
  shape = (T, B, spec.input_size) if time_major else (B, T, spec.input_size)
  x = jnp.ones(shape, dtype)
  h0 = jnp.zeros((S, B, spec.num_units), dtype)
  c0 = jnp.zeros((S, B, spec.num_units), dtype) if spec.has_cell_state else None
  params = jnp.zeros((spec.params_size(),), dtype)
  return x, h0, c0, params


@pytest.mark.parametrize("cls,direction,input_mode,time_major,has_lengths", [
    (jcr.CudnnLSTM, "unidirectional", "linear_input", True, False),
    (jcr.CudnnLSTM, "bidirectional", "skip_input", False, True),
    (jcr.CudnnGRU, "bidirectional", "linear_input", False, False),
    (jcr.CudnnGRU, "unidirectional", "skip_input", True, True),
    (jcr.CudnnRNNTanh, "bidirectional", "linear_input", True, True),
    (jcr.CudnnRNNRelu, "unidirectional", "skip_input", False, False),
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("training", [False, True])
def test_handlers_decode_what_python_sends(check_inputs, cls, direction, input_mode, time_major,
                                           has_lengths, dtype, training):
  spec = cls(3, 6, 6 if input_mode == "skip_input" else 4, input_mode=input_mode,
             direction=direction, dtype=dtype)
  T, B = 5, 2
  cfg = _cudnn.Config.of(spec, time_major, has_lengths)
  lengths = jnp.array([5, 2], jnp.int32)
  report = check_inputs(cfg, *_operands(spec, T, B, time_major), lengths, training)
  # Hidden size 6 is within every cell's limit for the persistent algorithm,
  # asked for with full-length float32 sequences.
  persistent = not has_lengths and np.dtype(dtype) == np.float32
  assert report == dict(
      cell_mode={"lstm": 2, "gru": 3, "rnn_tanh": 1, "rnn_relu": 0}[spec.rnn_mode],  # cudnnRNNMode_t
      num_layers=3, hidden_size=6, input_size=spec.input_size,
      bidirectional=int(direction == "bidirectional"), skip_input=int(input_mode == "skip_input"),
      batch_major=int(not time_major), allow_tf32=int(cfg.allow_tf32),
      has_seq_lengths=int(has_lengths), algo=3 if persistent else 0, steps=T, batch=B,
      # The handler's type (from the buffer) is the one the size query sends from Python.
      cudnn_type=_cudnn.CUDNN_DATA_TYPES[np.dtype(dtype)])


def test_allow_tf32_follows_jax_matmul_precision(check_inputs):
  spec = jcr.CudnnGRU(1, 4, 3)
  operands = _operands(spec, 2, 1, True)
  lengths = jnp.array([2], jnp.int32)
  with jax.default_matmul_precision("highest"):
    assert check_inputs(_cudnn.Config.of(spec, True, False), *operands, lengths)["allow_tf32"] == 0
  with jax.default_matmul_precision("tensorfloat32"):
    assert check_inputs(_cudnn.Config.of(spec, True, False), *operands, lengths)["allow_tf32"] == 1


@pytest.mark.parametrize("cls,hidden,inference,training", [
    (jcr.CudnnLSTM, 128, 3, 3), (jcr.CudnnLSTM, 160, 3, 0), (jcr.CudnnGRU, 192, 3, 0),
    (jcr.CudnnGRU, 193, 0, 0), (jcr.CudnnRNNTanh, 256, 3, 3), (jcr.CudnnRNNRelu, 300, 3, 0),
    (jcr.CudnnRNNRelu, 385, 0, 0)])
def test_handlers_get_each_pass_algorithm(check_inputs, cls, hidden, inference, training,
                                          monkeypatch):
  """The inference call carries the inference algorithm and the training calls
  theirs (0 standard, 3 persistent small-h), by cuDNN's limits on the hidden
  size; and "standard" in the environment takes the standard one everywhere."""
  spec = cls(1, hidden, 8)
  operands = _operands(spec, 2, 1, True)
  lengths = jnp.array([2], jnp.int32)
  cfg = _cudnn.Config.of(spec, True, False)
  assert [check_inputs(cfg, *operands, lengths, t)["algo"] for t in (False, True)] == [
      inference, training]
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, "standard")
  cfg = _cudnn.Config.of(spec, True, False)
  assert [check_inputs(cfg, *operands, lengths, t)["algo"] for t in (False, True)] == [0, 0]


def _bad_inputs():
  """(case name, spec, operand changes, expected fragment of the handler's error)."""
  lstm = jcr.CudnnLSTM(2, 6, 4)
  gru = jcr.CudnnGRU(1, 6, 4, direction="bidirectional")
  return [
      ("hx wrong batch", lstm, dict(h0=jnp.zeros((2, 3, 6))), "hx must have shape [2, 2, 6], got [2, 3, 6]"),
      ("hx bidirectional count", gru, dict(h0=jnp.zeros((1, 2, 6))), "hx must have shape [2, 2, 6], got [1, 2, 6]"),
      ("x wrong features", lstm, dict(x=jnp.ones((5, 2, 3))), "x must have shape [5, 2, 4], got [5, 2, 3]"),
      ("x rank", lstm, dict(x=jnp.ones((5, 8))), "x must have rank 3, got shape [5, 8]"),
      ("x integer", lstm, dict(x=jnp.ones((5, 2, 4), jnp.int32)), "x must be float16, bfloat16, float32 or float64"),
      ("hx type", lstm, dict(h0=jnp.zeros((2, 2, 6), jnp.float16)), "hx must have x's element type float32, got float16"),
      ("weights type", gru, dict(params=jnp.zeros((10,), jnp.float64)), "weights must have x's element type float32, got float64"),
      ("LSTM without a cell state", lstm, dict(c0=jnp.zeros((0,))), "cx must have shape [2, 2, 6], got [0]"),
      ("GRU with a cell state", gru, dict(c0=jnp.zeros((2, 2, 6))), "cx must be empty for a model without a cell state"),
      ("lengths shape", gru, dict(lengths=jnp.array([5, 5, 5], jnp.int32)), "seq_lengths must have shape [2], got [3]"),
      ("length 0", gru, dict(lengths=jnp.array([5, 0], jnp.int32), has_lengths=True), "seq_lengths[1] = 0 is outside [1, 5]"),
      ("length past T", lstm, dict(lengths=jnp.array([6, 1], jnp.int32), has_lengths=True), "seq_lengths[0] = 6 is outside [1, 5]"),
      ("hidden size 0", gru, dict(cfg=dict(hidden_size=0)), "hidden_size=0"),
      ("cell mode", gru, dict(cfg=dict(rnn_mode="bogus")), "cell_mode=7"),
      ("skip_input sizes", lstm, dict(cfg=dict(skip_input=True)), "skip_input needs input_size == hidden_size, got input_size=4, hidden_size=6"),
      ("algorithm", gru, dict(cfg=dict(algorithms=(1, 1))), "algo must be 0 (standard) or 3 (persist_static_small_h), got 1"),
  ]


@pytest.mark.parametrize("name,spec,changes,message", _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_handlers_refuse_bad_input_with_an_error(check_inputs, name, spec, changes, message,
                                                  monkeypatch):
  x, h0, c0, params = _operands(spec, 5, 2, True)
  operands = dict(x=x, h0=h0, c0=c0, params=params, lengths=jnp.array([5, 5], jnp.int32))
  operands.update({k: v for k, v in changes.items() if k in operands})
  cfg = _cudnn.Config.of(spec, True, changes.get("has_lengths", False))
  if "cfg" in changes:
    if changes["cfg"].get("rnn_mode") == "bogus":
      monkeypatch.setitem(_cudnn.CELL_MODES, "bogus", 7)
    cfg = dataclasses.replace(cfg, **changes["cfg"])
  with pytest.raises(jax.errors.JaxRuntimeError, match=re.escape(message)):
    check_inputs(cfg, operands["x"], operands["h0"], operands["c0"], operands["params"],
                 operands["lengths"])
