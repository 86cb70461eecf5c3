"""The cuDNN backend against the pure-JAX reference (needs a CUDA GPU and the native library).

Every test here is marked `gpu` and skipped where JAX sees no CUDA device or
the native library was not built; run them wherever a CUDA GPU is at hand:
`pytest -m gpu -v`. On any machine, `test_gpu_dry_run.py` runs each test not
marked `needs_device` once against a model of the handlers, so that a mistake
in this file shows before GPU time is spent on it.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, interop
from helpers import (SPEC_CLASSES, assert_layout_is_analytic, call, padding_changes_nothing,
                     random_inputs, same_under)

_available, _why = _cudnn.availability()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _available, reason=_why or "no CUDA")]
# Needs a real CUDA device or the real handlers: `gpu_dry_run.py`, which runs the
# other tests on a CPU against a model of the handlers, leaves these out.
needs_device = pytest.mark.needs_device

TOLERANCE = {jnp.float64: 1e-9, jnp.float32: 2e-5, jnp.float16: 2e-2, jnp.bfloat16: 8e-2}


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def _check_against_reference(spec, T=6, B=3, seq_lengths=None, time_major=True, key=None):
  params = spec.init_params(jax.random.key(1))
  x, h, c = random_inputs(spec, T, B, seed=2)
  if not time_major:
    x = np.swapaxes(x, 0, 1)
  x, h = jnp.asarray(x), jnp.asarray(h)
  c = None if c is None else jnp.asarray(c)
  opts = dict(seq_lengths=seq_lengths, time_major=time_major, dropout_key=key)

  def loss(impl, x, h, c, p):
    y, hn, cn = call(spec, x, h, c, p, implementation=impl, **opts)
    total = jnp.sum(jnp.sin(y.astype(jnp.float32))) + jnp.sum(hn.astype(jnp.float32) ** 2)
    if cn is not None:
      total += jnp.sum(jnp.cos(cn.astype(jnp.float32)))
    return total, (y, hn, cn)

  argnums = (0, 1, 2, 3) if spec.has_cell_state else (0, 1, 3)
  tol = TOLERANCE[spec.dtype.type]
  with jax.default_matmul_precision("highest"):
    results = {impl: jax.grad(loss, argnums=tuple(a + 1 for a in argnums), has_aux=True)(
        impl, x, h, c, params) for impl in ("xla", "cudnn")}
  (g_ref, out_ref), (g_cud, out_cud) = results["xla"], results["cudnn"]
  for name, a, b in zip(("y", "h", "c"), out_cud, out_ref):
    if b is not None:
      assert a.dtype == b.dtype
      assert _rel_err(a, b) < tol, (name, _rel_err(a, b))
  for name, a, b in zip(("dx", "dh", "dc", "dparams")[:len(g_ref)] if spec.has_cell_state
                        else ("dx", "dh", "dparams"), g_cud, g_ref):
    assert np.all(np.isfinite(np.asarray(a, np.float32))), name
    assert _rel_err(a, b) < 5 * tol, (name, _rel_err(a, b))


SWEEP = list(itertools.product(SPEC_CLASSES, (1, 2), ("unidirectional", "bidirectional"),
                               ("linear_input", "skip_input")))


@pytest.mark.parametrize("cls,layers,direction,mode", SWEEP)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_values_and_gradients(cls, layers, direction, mode, dtype):
  spec = cls(layers, 8, 8 if mode == "skip_input" else 5, input_mode=mode, direction=direction,
             dtype=dtype)
  _check_against_reference(spec)


@pytest.mark.parametrize("cls,direction", list(itertools.product(SPEC_CLASSES, ("unidirectional", "bidirectional"))))
@pytest.mark.parametrize("time_major", [True, False])
def test_seq_lengths_and_layouts(cls, direction, time_major):
  spec = cls(2, 8, 5, direction=direction, dtype=jnp.float32)
  _check_against_reference(spec, T=7, B=4, seq_lengths=jnp.array([7, 3, 1, 0], jnp.int32),
                           time_major=time_major)


@needs_device
@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("time_major", [True, False])
def test_inputs_past_the_lengths_reach_nothing(cls, time_major):
  """As on the "xla" path (tests/test_xla.py), inputs past each sequence's
  length, NaN or inf, change no output, final state or gradient of cuDNN's
  from those of zero padding, and the gradient with respect to them is zero:
  whether cuDNN reads padding (its backward weights over every step) is its
  own; this asks it (not yet run on a GPU when written, session 67)."""
  spec = cls(2, 8, 5, direction="bidirectional", dtype=jnp.float32)
  params = spec.init_params(jax.random.key(1))
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, 7, 4, seed=2))
  lengths = jnp.array([7, 3, 1, 0], jnp.int32)
  past = np.arange(7)[:, None] >= np.asarray(lengths)[None]
  if not time_major:
    x, past = jnp.swapaxes(x, 0, 1), past.T

  def loss(x, h, c, p):
    y, hn, cn = call(spec, x, h, c, p, implementation="cudnn", seq_lengths=lengths,
                     time_major=time_major)
    return jnp.sum(jnp.sin(y)) + jnp.sum(hn ** 2) + (0 if cn is None else jnp.sum(jnp.cos(cn)))

  argnums = (0, 1, 2, 3) if spec.has_cell_state else (0, 1, 3)
  run = jax.jit(jax.value_and_grad(loss, argnums=argnums))
  zeros = padding_changes_nothing(run, x, past, h, c, params)
  dx = np.asarray(zeros[1][0])
  assert np.all(np.isfinite(dx)) and not np.any(dx[past]) and np.any(dx[~past])


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision(cls, dtype):
  spec = cls(2, 16, 8, direction="bidirectional", dtype=dtype)
  try:
    _check_against_reference(spec, T=5, B=4)
  except ValueError as e:  # a clear error where cuDNN does not support the dtype
    assert "cuDNN rejected" in str(e) and dtype == jnp.bfloat16, e


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_under_strict_dtype_promotion(cls, dtype):
  """A half-precision model's cuDNN call, with sequence lengths, leans on no
  implicit dtype promotion: its values and gradient under
  `jax_numpy_dtype_promotion="strict"` equal those under "standard"
  (`test_transforms.py` holds the "xla" path there, forward mode too)."""
  spec = cls(2, 8, 8, input_mode="skip_input", direction="bidirectional", dtype=dtype)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 6, 3)
  lengths = np.array([6, 1, 0], np.int32)

  def loss(p, x, h):
    out = call(spec, x, h, c, p, seq_lengths=lengths, implementation="cudnn")
    return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in out if o is not None)

  derivatives = lambda: jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, h)
  try:
    got = same_under(jax.numpy_dtype_promotion, "standard", "strict", derivatives)
  except ValueError as e:  # as test_half_precision: where cuDNN does not support the dtype
    assert "cuDNN rejected" in str(e) and dtype == jnp.bfloat16, e
    return
  assert float(jnp.abs(got[1][0].astype(jnp.float32)).sum()) > 0


@needs_device
def test_default_implementation_runs_every_dtype():
  """implementation=None uses cuDNN where it accepts the dtype and XLA where it does not."""
  for dtype in (jnp.float16, jnp.bfloat16):
    spec = jcr.CudnnGRU(1, 8, 4, dtype=dtype)
    params = spec.init_params(jax.random.key(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 4)), dtype)
    supported, why = _cudnn.supports(spec, 5, 3, True)
    hlo = jax.jit(lambda x, p: spec(x, None, p)).lower(x, params).as_text()
    assert ("jcr_rnn_forward" in hlo) == supported, why
    y = spec(x, None, params)[0]
    ref = spec(x, None, params, implementation="xla")[0]
    assert _rel_err(y, ref) < TOLERANCE[dtype], (dtype, _rel_err(y, ref))


@needs_device
def test_forward_mode_on_gpu_takes_the_xla_path():
  """Documented: the cuDNN path is reverse mode only; jvp needs implementation="xla"."""
  spec = jcr.CudnnGRU(1, 8, 4, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x = jnp.asarray(np.random.default_rng(0).normal(size=(5, 3, 4)))
  f = lambda impl: lambda x: spec(x, None, params, implementation=impl)[0]
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(f(None), (x,), (x,))
  _, tangent = jax.jvp(f("xla"), (x,), (x,))
  eps = 1e-6
  numeric = (f("cudnn")(x + eps * x) - f("cudnn")(x - eps * x)) / (2 * eps)
  assert _rel_err(tangent, numeric) < 1e-6


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_dropout_matches_reference(cls):
  spec = cls(3, 8, 5, direction="bidirectional", dropout=0.5, dtype=jnp.float32)
  _check_against_reference(spec, key=jax.random.key(9))


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("mode", ["linear_input", "skip_input"])
def test_analytic_layout_equals_cudnn(cls, direction, mode):
  spec = cls(3, 6, 6 if mode == "skip_input" else 4, input_mode=mode, direction=direction)
  for algo in _cudnn.ALGORITHMS.values():  # one layout, whichever algorithm runs
    assert_layout_is_analytic(spec, _cudnn.weight_layout(spec, algo))
  assert _cudnn.cudnn_order(spec) is None  # the buffer goes to cuDNN without a gather
  assert 4 * spec.params_size() == _cudnn.query_sizes(
      _cudnn.Config(spec.rnn_mode, 3, 6, spec.input_size, direction == "bidirectional",
                    mode == "skip_input", False, False, False), spec.dtype, 1, 1)["weight_space"]


def _check_inference(spec, T, B, time_major=True):
  params = spec.init_params(jax.random.key(1))
  x, h, c = random_inputs(spec, T, B, seed=3)
  x = jnp.asarray(x if time_major else np.swapaxes(x, 0, 1))
  h, c = jnp.asarray(h), None if c is None else jnp.asarray(c)
  with jax.default_matmul_precision("highest"):
    got, want = (call(spec, x, h, c, params, is_training=False, time_major=time_major,
                      implementation=impl) for impl in ("cudnn", "xla"))
  for name, a, b in zip(("y", "h", "c"), got, want):
    if b is not None:
      assert _rel_err(a, b) < TOLERANCE[spec.dtype.type], (name, _rel_err(a, b))


@pytest.mark.parametrize("policy", _cudnn.ALGORITHM_POLICIES)
@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("time_major", [True, False])
def test_both_algorithms_match_the_reference(monkeypatch, policy, cls, time_major):
  """cuDNN's persistent small-h algorithm (what "auto" picks at this size, for
  inference and training; batch-major data then goes to cuDNN sequence-major)
  and its standard one: values and gradients against the reference in both
  layouts, and cuDNN runs the algorithm asked for (the native library would
  fall back to the standard one where cuDNN refused)."""
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, policy)
  spec = cls(2, 16, 8, direction="bidirectional", dtype=jnp.float32)
  T, B = 9, 5
  _check_against_reference(spec, T=T, B=B, time_major=time_major)
  _check_inference(spec, T, B, time_major)
  with jax.default_matmul_precision("highest"):
    cfg = _cudnn.call_config(spec, time_major, has_lengths=False)
  assert cfg.batch_major == (policy == "standard" and not time_major), cfg
  ran = _cudnn.query_sizes(cfg, spec.dtype, T, B)["algorithms"]
  assert ran == ((3, 3) if policy == "auto" else (0, 0)), ran


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("calls", ["inference", "all"])
def test_persistent_algorithm_on_batch_major_data(monkeypatch, cls, calls):
  """With `_cudnn.PERSISTENT_BATCH_MAJOR`, batch-major data goes to cuDNN's
  persistent small-h algorithm as it is, without the transposes, in the
  inference call or in every call: values and gradients against the reference
  (with and without sequence lengths), and cuDNN runs that algorithm on that
  layout. Session 46 timed "all" on an H100 (benchmarks/NOTES.md): the forward
  faster than with the transposes, training slower. This is what must pass
  before "inference" is made the default."""
  monkeypatch.setattr(_cudnn, "PERSISTENT_BATCH_MAJOR", calls)
  spec = cls(2, 16, 8, direction="bidirectional", dtype=jnp.float32)
  T, B = 9, 5
  _check_against_reference(spec, T=T, B=B, time_major=False)
  _check_against_reference(spec, T=T, B=B, time_major=False,
                           seq_lengths=jnp.array([9, 4, 1, 0, 6], jnp.int32))
  _check_inference(spec, T, B, time_major=False)
  with jax.default_matmul_precision("highest"):
    cfg = _cudnn.call_config(spec, time_major=False, has_lengths=False, training=False)
    training = _cudnn.call_config(spec, time_major=False, has_lengths=False, training=True)
  assert cfg.batch_major and training.batch_major == (calls == "all"), (cfg, training)
  assert _cudnn.query_sizes(cfg, spec.dtype, T, B)["algorithms"] == (3, 3)


@pytest.mark.parametrize("cls,hidden", [(jcr.CudnnLSTM, 128), (jcr.CudnnLSTM, 192),
                                        (jcr.CudnnGRU, 160), (jcr.CudnnRNNTanh, 256),
                                        (jcr.CudnnRNNRelu, 384)])
def test_persistent_algorithm_at_its_hidden_size_limits(cls, hidden):
  """At the largest hidden sizes "auto" gives cuDNN's persistent small-h
  algorithm (inference, training, or both), cuDNN runs it and it matches the
  reference."""
  spec = cls(1, hidden, 24, dtype=jnp.float32)
  _check_against_reference(spec, T=5, B=4)
  _check_inference(spec, 5, 4)
  with jax.default_matmul_precision("highest"):
    cfg = _cudnn.Config.of(spec, True, has_seq_lengths=False)
  assert 3 in cfg.algorithms, cfg
  assert _cudnn.query_sizes(cfg, spec.dtype, 5, 4)["algorithms"] == cfg.algorithms


@needs_device
def test_default_implementation_uses_cudnn_on_gpu():
  spec = jcr.CudnnLSTM(1, 8, 4)
  params = spec.init_params(jax.random.key(0))
  x = jnp.ones((3, 2, 4), jnp.float32)
  hlo = jax.jit(lambda x, p: spec(x, None, None, p)).lower(x, params).as_text()
  assert "jcr_rnn_forward" in hlo
  loss = lambda impl: lambda x, p: spec(x, None, None, p, implementation=impl)[0].sum()
  compiled = lambda impl: jax.jit(jax.grad(loss(impl), (0, 1))).lower(x, params).compile()
  assert _cudnn.in_compiled(compiled(None))
  assert not _cudnn.in_compiled(compiled("xla"))


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_default_implementation_runs_one_step_on_xla(cls):
  """A one-step call (decoding) under implementation=None runs the "xla" path,
  the faster at every one-step shape timed on a GPU (`_ops.one_step_on_xla`):
  its program holds no cuDNN call, and its values and gradients are cuDNN's."""
  spec = cls(2, 8, 4, direction="bidirectional")
  _check_against_reference(spec, T=1, B=3)  # cuDNN's one step against the "xla" path's
  params = spec.init_params(jax.random.key(0))
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, 1, 3, seed=4))
  loss = lambda impl: lambda x, p: jnp.sum(call(spec, x, h, c, p, implementation=impl)[0] ** 2)
  compiled = lambda impl: jax.jit(jax.grad(loss(impl), (0, 1))).lower(x, params).compile()
  assert not _cudnn.in_compiled(compiled(None))
  infer = lambda impl: call(spec, x, h, c, params, is_training=False, implementation=impl)
  assert not _cudnn.in_compiled(
      jax.jit(lambda x, p: call(spec, x, h, c, p, is_training=False)).lower(x, params).compile())
  for a, b in zip(infer(None), infer("xla")):
    if b is not None:
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("time_major", [True, False])
def test_vmap_of_cudnn_matches_loop(time_major):
  """Inference folds the vmapped axis into cuDNN's batch; gradients are per element."""
  spec = jcr.CudnnLSTM(2, 8, 4, direction="bidirectional", dtype=jnp.float32)
  params = spec.init_params(jax.random.key(0))
  xs = jax.random.normal(jax.random.key(1), (3, 5, 2, 4), jnp.float32)
  if not time_major:
    xs = jnp.swapaxes(xs, 1, 2)
  lengths = jnp.array([[5, 1], [3, 4], [0, 5]], jnp.int32)
  run = lambda x, n, p: spec(x, None, None, p, seq_lengths=n, time_major=time_major,
                             implementation="cudnn")
  loss = lambda p, x, n: jnp.sum(run(x, n, p)[0] ** 2)
  with jax.default_matmul_precision("highest"):
    batched = jax.jit(jax.vmap(lambda x, n: run(x, n, params)))(xs, lengths)
    grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0, 0)))(params, xs, lengths)
    for i in range(3):
      single = run(xs[i], lengths[i], params)
      for a, b in zip(batched, single):
        np.testing.assert_allclose(a[i], b, rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(grads[i], jax.grad(loss)(params, xs[i], lengths[i]),
                                 rtol=1e-5, atol=1e-6)


@needs_device
def test_jax_experimental_rnn_cudnn_lstm_agrees():
  """jax.experimental.rnn's own cuDNN LSTM, on its weights buffer taken as ours:
  the same values and gradients (within valid steps) as our cuDNN path."""
  rnn = pytest.importorskip("jax.experimental.rnn")
  if not hasattr(rnn.gpu_rnn, "compute_rnn_workspace_reserve_space_sizes"):
    pytest.skip("this jaxlib has no CUDA RNN kernels for jax.experimental.rnn")
  spec = jcr.CudnnLSTM(2, 8, 5, direction="bidirectional", dtype=jnp.float32)
  weights = rnn.init_lstm_weight(jax.random.key(0), 5, 8, 2, True)
  params = interop.from_jax_experimental_rnn(spec, weights)
  x, h, c = random_inputs(spec, 6, 3)
  x, h, c = jnp.asarray(np.swapaxes(x, 0, 1)), jnp.asarray(h), jnp.asarray(c)  # batch-major, as theirs
  lengths = jnp.array([6, 3, 1], jnp.int32)
  valid = (jnp.arange(6)[None, :] < lengths[:, None])[..., None]
  ours = lambda x, h, c, p: spec(x, h, c, p, seq_lengths=lengths, time_major=False,
                                 implementation="cudnn")
  theirs = lambda x, h, c, w: rnn.lstm(x, h, c, w, lengths, 5, 8, 2, 0.0, True)

  def loss(f):
    def total(*args):
      y, hn, cn = f(*args)
      return jnp.sum(jnp.where(valid, jnp.sin(y), 0)) + jnp.sum(hn ** 2) + jnp.sum(jnp.cos(cn))
    return jax.jit(jax.grad(total, argnums=(0, 1, 2, 3)))

  with jax.default_matmul_precision("highest"):
    for name, a, b in zip(("y", "h", "c"), ours(x, h, c, params), theirs(x, h, c, weights)):
      a, b = (jnp.where(valid, a, 0), jnp.where(valid, b, 0)) if name == "y" else (a, b)
      assert _rel_err(a, b) < 1e-5, (name, _rel_err(a, b))
    for name, a, b in zip(("dx", "dh", "dc", "dweights"), loss(ours)(x, h, c, params),
                          loss(theirs)(x, h, c, weights)):
      assert _rel_err(a, b) < 1e-4, (name, _rel_err(a, b))


@needs_device
def test_memory_is_flat_over_many_calls():
  spec = jcr.CudnnLSTM(2, 64, 32, direction="bidirectional")
  params = spec.init_params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (20, 8, 32), jnp.float32)
  step = jax.jit(jax.grad(lambda p, x: jnp.sum(spec(x, None, None, p)[0] ** 2)))
  device = jax.devices("cuda")[0]
  g = step(params, x).block_until_ready()
  before = device.memory_stats()["bytes_in_use"]
  for _ in range(200):
    g = step(params, x)
  g.block_until_ready()
  del g
  after = device.memory_stats()["bytes_in_use"]
  assert after - before < 1 << 20, (before, after)


@needs_device
def test_bad_input_reaching_the_handler_is_an_error_not_a_crash():
  _cudnn._registered_library()
  cfg = _cudnn.Config("gru", 1, 8, 4, False, False, False, False, True)
  x = jnp.ones((5, 2, 4), jnp.float32)
  h = jnp.zeros((1, 2, 8), jnp.float32)
  spec = jcr.CudnnGRU(1, 8, 4)
  params = spec.init_params(jax.random.key(0))
  outs = (jax.ShapeDtypeStruct((5, 2, 8), jnp.float32), jax.ShapeDtypeStruct((1, 2, 8), jnp.float32),
          jax.ShapeDtypeStruct((0,), jnp.float32))
  forward = jax.ffi.ffi_call("jcr_rnn_forward_inference", outs)
  empty = jnp.zeros((0,), jnp.float32)
  with pytest.raises(Exception, match="seq_lengths\\[1\\] = 9 is outside"):
    jax.block_until_ready(forward(x, h, empty, params, jnp.array([5, 9], jnp.int32), **cfg.attrs()))
  with pytest.raises(Exception, match="hx must have shape"):
    jax.block_until_ready(forward(x, jnp.zeros((2, 2, 8), jnp.float32), empty, params,
                                  jnp.array([5, 5], jnp.int32), **cfg.attrs()))
  with pytest.raises(Exception, match="weight space"):
    jax.block_until_ready(forward(x, h, empty, params[:-1], jnp.array([5, 5], jnp.int32),
                                  **cfg.attrs()))
  # The process is still healthy: a good call works afterwards.
  y, _ = spec(x, h, params, implementation="cudnn")
  assert np.all(np.isfinite(y))


@needs_device
def test_exported_cudnn_model_runs_in_a_fresh_process(tmp_path):
  """`jax.export` with the cuDNN calls: serialized with its derivative, run here
  and, after `register_ffi_targets()`, in a process that never traced a model."""
  pytest.importorskip("flatbuffers")
  import subprocess
  import sys
  from jax import export
  spec = jcr.CudnnLSTM(2, 8, 5, direction="bidirectional")
  params = spec.init_params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (7, 3, 5), jnp.float32)
  run = lambda x, p: spec(x, None, None, p, is_training=True)
  exported = export.export(jax.jit(run), platforms=("cuda",),
                           disabled_checks=jcr.export_disabled_checks())(x, params)
  assert _cudnn.in_compiled(exported.mlir_module())
  blob = exported.serialize(vjp_order=1)
  artifact = export.deserialize(blob)
  want = run(x, params)
  for a, b in zip(artifact.call(x, params), want):
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
  loss = lambda f: lambda p: jnp.sum(f(x, p)[0] ** 2)
  np.testing.assert_allclose(jax.grad(loss(artifact.call))(params), jax.grad(loss(run))(params),
                             rtol=1e-5, atol=1e-6)

  (tmp_path / "model.bin").write_bytes(blob)
  np.save(tmp_path / "x.npy", np.asarray(x))
  np.save(tmp_path / "params.npy", np.asarray(params))
  script = (
      "import sys, numpy as np, jax_cudnn_rnn as jcr\n"
      "from jax import export\n"
      "jcr.register_ffi_targets()\n"
      "d = sys.argv[1]\n"
      "artifact = export.deserialize(bytearray(open(d + '/model.bin', 'rb').read()))\n"
      "y = artifact.call(np.load(d + '/x.npy'), np.load(d + '/params.npy'))[0]\n"
      "np.save(d + '/y.npy', np.asarray(y))\n")
  subprocess.run([sys.executable, "-c", script, str(tmp_path)], check=True, timeout=300)
  np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want[0], rtol=1e-6, atol=1e-6)


@needs_device
def test_symbolic_shapes_export_runs_cudnn_inference_with_xla_gradients():
  """A shape-polymorphic export: cuDNN's inference call, refined to each
  caller's shapes, gives the "xla" path's values; the derivative is the "xla"
  path's (`_symbolic`)."""
  pytest.importorskip("flatbuffers")
  from jax import export
  spec = jcr.CudnnGRU(2, 8, 5, direction="bidirectional")
  params = spec.init_params(jax.random.key(0))
  run = lambda x, p, impl=None: spec(x, None, p, is_training=False, time_major=False,
                                     implementation=impl)
  b, t = export.symbolic_shape("b, t")
  with jax.default_matmul_precision("highest"):
    exported = export.export(jax.jit(run), platforms=("cuda",),
                             disabled_checks=jcr.export_disabled_checks())(
        jax.ShapeDtypeStruct((b, t, 5), jnp.float32), params)
    assert _cudnn.in_compiled(exported.mlir_module())
    artifact = export.deserialize(exported.serialize(vjp_order=1))
    for shape in [(3, 7, 5), (9, 40, 5)]:
      x = jax.random.normal(jax.random.key(shape[1]), shape, jnp.float32)
      assert _cudnn.in_compiled(jax.jit(artifact.call).lower(x, params).compile())
      got, want = artifact.call(x, params), run(x, params, "xla")
      for a, w in zip(got, want):
        assert a.shape == w.shape
        assert _rel_err(a, w) < TOLERANCE[jnp.float32]
      loss = lambda f: lambda p: jnp.sum(jnp.sin(f(x, p)[0]))
      assert _rel_err(jax.grad(loss(artifact.call))(params),
                      jax.grad(loss(lambda x, p: run(x, p, "xla")))(params)) < 1e-5
