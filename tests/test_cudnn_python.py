"""Pure-Python parts of the cuDNN backend that run on any machine."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _layout
from helpers import random_canonical


def test_layer_buffers_equal_single_layer_spec_buffers():
  spec = jcr.CudnnLSTM(3, 4, 4, input_mode="skip_input", direction="bidirectional",
                       dtype=jnp.float64)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  w_at, b_at = 0, 0
  for layer in range(3):
    single = jcr.CudnnLSTM(1, 4, spec.layer_input_size(layer),
                           input_mode="skip_input" if layer == 0 else "linear_input",
                           direction="bidirectional", dtype=jnp.float64)
    nw = len(single.params_to_canonical(single.init_params(jax.random.key(0)))[0])
    expected = single.canonical_to_params(weights[w_at:w_at + nw], biases[b_at:b_at + 16])
    np.testing.assert_array_equal(_cudnn._layer_buffers(spec, params)[layer], expected)
    w_at, b_at = w_at + nw, b_at + 16


def test_config_attributes_have_exact_ffi_types():
  cfg = _cudnn.Config("gru", 2, 8, 4, True, False, True, False, True)
  attrs = cfg.attrs()
  assert attrs["cell_mode"] == 3 and attrs["cell_mode"].dtype == np.int64
  assert attrs["bidirectional"].dtype == np.bool_ and bool(attrs["batch_major"])
  assert cfg.num_states == 4


@pytest.mark.parametrize("cls,limits", [
    (jcr.CudnnLSTM, (192, 128)), (jcr.CudnnGRU, (192, 128)), (jcr.CudnnRNNTanh, (384, 256)),
    (jcr.CudnnRNNRelu, (384, 256))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_persistent_algorithm_within_cudnn_limits(cls, limits, dtype):
  """`(inference, training)` algorithms at each side of the hidden-size limits
  of cuDNN's persistent small-h algorithm (3; else the standard one, 0), in
  float32; half precision keeps the standard one (not measured faster)."""
  infer, train = limits
  for hidden, want in [(1, (3, 3)), (train, (3, 3)), (train + 1, (3, 0)), (infer, (3, 0)),
                       (infer + 1, (0, 0))]:
    if dtype != jnp.float32:
      want = (0, 0)
    spec = cls(2, hidden, 5, direction="bidirectional", dtype=dtype)
    assert _cudnn.choose_algorithms(spec, has_seq_lengths=False) == want, (hidden, want)
    assert _cudnn.choose_algorithms(spec, has_seq_lengths=True) == (0, 0), hidden
    cfg = _cudnn.Config.of(spec, True, False)
    assert (cfg.attrs()["algo"], cfg.attrs(training=True)["algo"]) == want
    assert cfg.attrs()["algo"].dtype == np.int64


def test_standard_algorithm_for_float64_and_on_request(monkeypatch):
  assert _cudnn.choose_algorithms(jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64), False) == (0, 0)
  spec = jcr.CudnnGRU(1, 4, 3)
  assert _cudnn.choose_algorithms(spec, False) == (3, 3)
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, "standard")
  assert _cudnn.choose_algorithms(spec, False) == (0, 0)
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, "auto")
  assert _cudnn.choose_algorithms(spec, False) == (3, 3)
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, "fast")
  with pytest.raises(ValueError, match="JAX_CUDNN_RNN_ALGORITHM must be one of auto, "
                                       "standard; got 'fast'"):
    _cudnn.Config.of(spec, True, False)


def test_availability_explains_itself():
  available, why = _cudnn.availability()
  assert available or why


@pytest.fixture
def library_missing(monkeypatch):
  """A process without the native library (what an install with pip's build
  isolation gives, even on a GPU machine), whose once-a-process warning has not
  been given yet; the computation itself runs on this machine's CPU."""
  monkeypatch.setattr(_cudnn, "_load", lambda: (None, "the native library was not built"))
  _cudnn.warn_if_gpu_without_library.cache_clear()
  yield
  _cudnn.warn_if_gpu_without_library.cache_clear()


@pytest.fixture
def gpu_without_library(library_missing, monkeypatch):
  monkeypatch.setattr(_cudnn, "_has_cuda_device", lambda: True)


def _small_lstm_call(implementation):
  spec = jcr.CudnnLSTM(2, 5, 3, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (4, 2, 3), jnp.float64)
  return spec(x, None, None, params, implementation=implementation)


def test_gpu_without_library_warns_once_and_runs_the_xla_path(gpu_without_library):
  with pytest.warns(RuntimeWarning) as record:
    y, h, c = _small_lstm_call(None)
  assert len(record) == 1
  message = str(record[0].message)
  assert "JAX sees a CUDA device" in message and "the native library was not built" in message
  assert "--no-build-isolation" in message and "implementation='xla'" in message
  for got, want in zip((y, h, c), _small_lstm_call("xla")):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once a process: a second call is silent
    _small_lstm_call(None)


def test_gpu_without_library_is_silent_when_xla_is_asked_for(gpu_without_library):
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _small_lstm_call("xla")
  with pytest.raises(RuntimeError, match="cannot run here: the native library was not built"):
    _small_lstm_call("cudnn")


def test_no_warning_without_a_cuda_device(library_missing, monkeypatch):
  monkeypatch.setattr(_cudnn, "_has_cuda_device", lambda: False)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    _small_lstm_call(None)


def _layer_major_rows(spec):
  """`weight_layout` rows for a hypothetical cuDNN that stores each pseudo-layer's
  matrices then its biases before the next pseudo-layer (not the analytic layout)."""
  g, H, D = spec.num_gates, spec.num_units, spec.num_dirs
  rows = np.zeros((spec.num_layers * D, 2 * g, 5), np.int64)
  offset = 0
  for p in range(spec.num_layers * D):
    layer = p // D
    for lin in range(2 * g):
      if lin < g and not spec.layer_has_input_weights(layer):
        rows[p, lin, :3] = (-1, 0, 0)
        continue
      cols = spec.layer_input_size(layer) if lin < g else H
      rows[p, lin, :3] = (offset, H, cols)
      offset += H * cols
    for lin in range(2 * g):
      rows[p, lin, 3:] = (offset, H)
      offset += H
  return rows


def test_cudnn_order_gathers_into_a_differing_cudnn_layout(monkeypatch):
  spec = jcr.CudnnGRU(2, 3, 3, input_mode="skip_input", direction="bidirectional",
                      dtype=jnp.float64)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  rows = _layer_major_rows(spec)
  monkeypatch.setattr(_cudnn, "weight_layout", lambda s: rows)
  _cudnn.cudnn_order.cache_clear()
  try:
    order = _cudnn.cudnn_order(spec)
    assert order is not None
    cudnn_buffer = np.asarray(params)[order]
    w_entries, b_entries = _layout.tensors(spec)
    for array, t in zip((*weights, *biases), (*w_entries, *b_entries)):
      row = rows[t.layer * 2 + t.direction, t.index]
      start = row[0] if t.kind == "weight" else row[3]
      np.testing.assert_array_equal(cudnn_buffer[start:start + t.size], np.ravel(array))
    # A layout equal to the analytic one needs no gather.
    analytic = np.zeros_like(rows)
    for t in w_entries:
      analytic[t.layer * 2 + t.direction, t.index, :3] = (t.offset, *t.shape)
    analytic[0, :3, :3] = (-1, 0, 0)
    for t in b_entries:
      analytic[t.layer * 2 + t.direction, t.index, 3:] = (t.offset, t.shape[0])
    monkeypatch.setattr(_cudnn, "weight_layout", lambda s: analytic)
    _cudnn.cudnn_order.cache_clear()
    assert _cudnn.cudnn_order(spec) is None
    # Overlapping placements are refused, not silently used.
    broken = analytic.copy()
    broken[1, 0, 3] = broken[1, 1, 3]
    monkeypatch.setattr(_cudnn, "weight_layout", lambda s: broken)
    _cudnn.cudnn_order.cache_clear()
    with pytest.raises(RuntimeError, match="exactly once"):
      _cudnn.cudnn_order(spec)
  finally:
    _cudnn.cudnn_order.cache_clear()


def test_layer_spec_describes_the_layer_buffer():
  spec = jcr.CudnnLSTM(3, 4, 4, input_mode="skip_input", direction="bidirectional",
                       dropout=0.5, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  for layer in range(3):
    single = _cudnn._layer_spec(spec, layer)
    assert single.num_layers == 1 and single.dropout == 0.0
    assert single.input_mode == ("skip_input" if layer == 0 else "linear_input")
    assert _cudnn._layer_buffers(spec, params)[layer].shape == (single.params_size(),)


def test_default_implementation_falls_back_to_xla_where_cudnn_rejects_the_config(monkeypatch):
  """On a machine where cuDNN can run but rejects this configuration (say, a data type
  it lacks), implementation=None runs the XLA path instead of failing."""
  spec = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 2, 3)))
  asked = []
  monkeypatch.setattr(_cudnn, "availability", lambda: (True, ""))
  monkeypatch.setattr(_cudnn, "supports", lambda *a: asked.append(a) or (False, "no bf16 here"))
  monkeypatch.setattr(_cudnn, "rnn", lambda *a, **k: pytest.fail("the cuDNN path was traced"))
  y, h = spec(x, None, params)
  assert asked == [(spec, 5, 2, True)]
  y_ref, h_ref = spec(x, None, params, implementation="xla")
  np.testing.assert_array_equal(y, y_ref)
  np.testing.assert_array_equal(h, h_ref)


def test_in_compiled_finds_the_custom_calls_only():
  assert _cudnn.in_compiled('%cc = custom-call(%x), custom_call_target="jcr_rnn_backward_data"')
  assert not _cudnn.in_compiled('custom_call_target="jcr_rnn_forward_trainingX"')
  spec = jcr.CudnnGRU(1, 4, 3)
  x = jnp.ones((2, 1, 3), jnp.float32)
  step = jax.jit(jax.grad(lambda p: spec(x, None, p, implementation="xla")[0].sum()))
  compiled = step.lower(spec.init_params(jax.random.key(0))).compile()
  assert not _cudnn.in_compiled(compiled)


@pytest.mark.parametrize("precision,allowed", [
    (None, True), ("default", True), ("high", True), ("tensorfloat32", True),
    ("bfloat16", True), ("TF32_TF32_F32", True), ("BF16_BF16_F32", True),
    ("highest", False), ("float32", False), ("F32_F32_F32", False), ("F64_F64_F64", False),
    ("TF32_TF32_F32_X3", False), ("BF16_BF16_F32_X6", False), ("BF16_BF16_F32_X9", False)])
def test_tf32_only_where_jax_matmul_precision_allows_it(precision, allowed):
  with jax.default_matmul_precision(precision):
    assert _cudnn._allow_tf32() is allowed
    assert _cudnn.Config.of(jcr.CudnnLSTM(1, 4, 3), True, False).allow_tf32 is allowed


def test_supports_refuses_a_weight_space_the_opaque_layout_does_not_describe(monkeypatch):
  """A cuDNN whose weight space differs from `_layout`'s (in size, or in a placement
  `cudnn_order` cannot map) is not used by implementation=None."""
  spec = jcr.CudnnLSTM(1, 4, 4, input_mode="skip_input", dtype=jnp.float32)
  right = spec.params_size() * 4
  sizes = dict(weight_space=right, workspace_inference=0, workspace_training=0, reserve_space=8)
  monkeypatch.setattr(_cudnn, "query_sizes", lambda *a: dict(sizes))
  monkeypatch.setattr(_cudnn, "cudnn_order", lambda s: None)
  assert _cudnn.supports(spec, 5, 2, True) == (True, "")
  sizes["weight_space"] = right - 4 * 16  # say, no layer-0 input biases under skip_input
  ok, why = _cudnn.supports(spec, 5, 2, True)
  assert not ok and f"has {right - 64} bytes, the opaque buffer {right}" in why
  sizes["weight_space"] = right

  def overlapping(s):
    raise RuntimeError("cuDNN's weight layout does not cover the opaque buffer exactly once")

  monkeypatch.setattr(_cudnn, "cudnn_order", overlapping)
  assert _cudnn.supports(spec, 5, 2, True) == (
      False, "cuDNN's weight layout does not cover the opaque buffer exactly once")
