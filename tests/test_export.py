"""`jax.export`: models serialized, deserialized and run again, with concrete
and symbolic (shape-polymorphic) shapes, their gradients through the artifact,
and the cuDNN path's part (its custom calls in an export for CUDA, the checks
to disable, cuDNN's inference under symbolic shapes with the "xla" path's
derivative) lowered for a CUDA device this machine lacks, with the handler
model's sizes (`handler_model.py`), and run here with the model's calls.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _chunks, _cudnn, _symbolic, _xla
from jax_cudnn_rnn import linen as jcr_linen
from handler_model import HandlerModel
from helpers import CROSS_TOL, SPEC_CLASSES, call, random_inputs, relative_error

pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")


def _round_trip(fun, *arg_specs):
  """`fun` exported for `arg_specs` on this machine's platform, serialized with
  its first derivative and deserialized: what a serving process gets. On a GPU,
  implementation=None exports cuDNN's calls, which JAX serializes only when told
  to (README, `jax.export`); on a CPU there are none and the checks change nothing."""
  exported = export.export(jax.jit(fun), disabled_checks=jcr.export_disabled_checks())(
      *arg_specs)
  return export.deserialize(exported.serialize(vjp_order=1))


def _relative_error(got, want):
  """The largest `relative_error` over the leaves: the artifact's derivative
  is compiled apart from its primal, so the two round differently."""
  return max(relative_error(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.__name__)
def test_concrete_shapes_round_trip_values_and_gradients(cls):
  spec = cls(num_layers=2, num_units=6, input_size=3, direction="bidirectional")
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, 40, 3, seed=5))
  params = spec.init_params(jax.random.key(1))

  def run(x, h, c, params):
    return call(spec, x, h, c, params, is_training=True, implementation="xla")

  artifact = _round_trip(run, x, h, c, params)
  np.testing.assert_allclose(np.concatenate([np.ravel(a) for a in artifact.call(x, h, c, params)
                                             if a is not None]),
                             np.concatenate([np.ravel(a) for a in run(x, h, c, params)
                                             if a is not None]), rtol=1e-6, atol=1e-6)

  def loss(call_):
    return lambda x, params: sum(jnp.sum(jnp.sin(a)) for a in call_(x, h, c, params)
                                 if a is not None)

  got = jax.grad(loss(artifact.call), argnums=(0, 1))(x, params)
  want = jax.grad(loss(run), argnums=(0, 1))(x, params)
  assert _relative_error(got, want) < 1e-5
  assert float(jnp.max(jnp.abs(got[1]))) > 1e-3  # the gradient is not trivially zero


def test_symbolic_batch_and_time_with_lengths_and_dropout():
  """One artifact for every batch size and length: a 3-layer bidirectional GRU,
  batch-major, with sequence lengths and inter-layer dropout, called at shapes
  where the direct call runs chunks (T = 40) and where it runs step by step."""
  gru = jcr.CudnnGRU(num_layers=3, num_units=8, input_size=4, direction="bidirectional",
                     dropout=0.3)
  params = gru.init_params(jax.random.key(0))
  key = jax.random.key(7)

  def run(x, params, lengths, implementation=None):
    return gru(x, None, params, is_training=True, seq_lengths=lengths, dropout_key=key,
               time_major=False, implementation=implementation)

  b, t = export.symbolic_shape("b, t")
  # implementation=None: under symbolic shapes the "xla" path on a CPU; on a GPU,
  # cuDNN's inference with the "xla" path's derivative.
  artifact = _round_trip(run, jax.ShapeDtypeStruct((b, t, 4), jnp.float32), params,
                         jax.ShapeDtypeStruct((b,), jnp.int32))
  direct = lambda x, params, lengths: run(x, params, lengths, "xla")
  assert _chunks.chunk_steps(40) > 1  # the direct call at T = 40 is chunked, the artifact is not
  for batch, steps, lengths in [(3, 40, [40, 5, 0]), (5, 7, [7, 1, 3, 7, 2])]:
    x = jax.random.normal(jax.random.key(steps), (batch, steps, 4), jnp.float32)
    lengths = jnp.asarray(lengths, jnp.int32)
    got, want = artifact.call(x, params, lengths), direct(x, params, lengths)
    assert got[0].shape == (batch, steps, 16) and got[1].shape == (6, batch, 8)
    assert _relative_error(got, want) < 1e-5
    assert float(jnp.max(jnp.abs(got[0][1, 5:]))) == 0.0  # past its length: zeros

    loss = lambda call_: lambda x, params: jnp.sum(call_(x, params, lengths)[0] ** 2)
    got = jax.grad(loss(artifact.call), argnums=(0, 1))(x, params)
    want = jax.grad(loss(direct), argnums=(0, 1))(x, params)
    assert _relative_error(got, want) < 1e-4


def test_chunk_steps_of_a_symbolic_length_is_one():
  (t,) = export.symbolic_shape("t")
  assert _chunks.chunk_steps(t) == 1
  assert _chunks.chunk_steps(t, _chunks.DERIVATIVE_CHUNK) == 1


def test_linen_module_with_symbolic_batch_and_time():
  model = jcr_linen.LSTM(features=8, num_layers=2, bidirectional=True)
  x = jax.random.normal(jax.random.key(1), (3, 37, 4), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  b, t = export.symbolic_shape("b, t")
  artifact = _round_trip(lambda variables, x: model.apply(variables, x), variables,
                         jax.ShapeDtypeStruct((b, t, 4), jnp.float32))
  xla = jcr_linen.LSTM(features=8, num_layers=2, bidirectional=True, implementation="xla")
  apply = lambda variables, x: xla.apply(variables, x)
  for shape in [(3, 37, 4), (1, 2, 4)]:
    x = jax.random.normal(jax.random.key(2), shape, jnp.float32)
    y = artifact.call(variables, x)
    assert y.shape == shape[:2] + (16,)
    np.testing.assert_allclose(y, apply(variables, x), rtol=CROSS_TOL, atol=CROSS_TOL)


# -- the cuDNN path, lowered for CUDA on this machine (the handler model's sizes) --------


def _lstm():
  spec = jcr.CudnnLSTM(num_layers=2, num_units=6, input_size=3, direction="bidirectional")
  return spec, spec.init_params(jax.random.key(2))


def test_export_for_cuda_and_cpu_holds_the_cudnn_calls_and_runs_on_cpu(sizes):
  spec, params = _lstm()
  x = jax.random.normal(jax.random.key(3), (12, 2, 3), jnp.float32)
  run = lambda x, params: spec(x, None, None, params, is_training=False)
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    export.export(jax.jit(run), platforms=("cpu", "cuda"))(x, params)

  exported = export.export(jax.jit(run), platforms=("cpu", "cuda"),
                           disabled_checks=jcr.export_disabled_checks())(x, params)
  assert _cudnn.in_compiled(exported.mlir_module())
  artifact = export.deserialize(exported.serialize())
  assert artifact.platforms == ("cpu", "cuda")
  # On the CPU the artifact runs its "xla" branch.
  x, params = jax.device_put((x, params), jax.devices("cpu")[0])
  want = spec(x, None, None, params, is_training=False, implementation="xla")
  assert _relative_error(artifact.call(x, params), want) < 1e-6


def test_export_disabled_checks_name_every_target():
  checks = jcr.export_disabled_checks()
  assert len(checks) == len(_cudnn.TARGETS)
  assert checks == [export.DisabledSafetyCheck.custom_call(t) for t in _cudnn.TARGETS]


def _cudnn_calls(module_text: str) -> list[str]:
  """The cuDNN calls in a lowered module's text, in order."""
  return re.findall(r"custom_call @(jcr_rnn_\w+)\(", module_text)


def test_symbolic_shapes_lower_cudnn_inference_for_cuda_with_the_xla_derivative(sizes):
  """Under symbolic shapes cuDNN's inference call lowers, its result shapes
  computed from the operands' (refined to the caller's shapes when the artifact
  is called); the derivative is the "xla" path's: no cuDNN call in it."""
  spec, params = _lstm()
  t, b = export.symbolic_shape("t, b")
  x = jax.ShapeDtypeStruct((t, b, 3), jnp.float32)
  auto = lambda x, params: spec(x, None, None, params, is_training=True)
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    export.export(jax.jit(auto), platforms=("cuda",))(x, params)
  exported = export.export(jax.jit(auto), platforms=("cuda",),
                           disabled_checks=jcr.export_disabled_checks())(x, params)
  text = exported.mlir_module()
  assert _cudnn_calls(text) == ["jcr_rnn_forward_inference"]
  call = re.search(r"custom_call @jcr_rnn_forward_inference\([^\n]*", text).group(0)
  assert "indices_of_shape_operands" in call
  vjp = export.deserialize(exported.serialize(vjp_order=1)).vjp()
  assert _cudnn_calls(vjp.mlir_module()) == []
  assert "stablehlo.while" in vjp.mlir_module()  # the "xla" path's loops
  # With concrete shapes the training call is lowered instead, for its reserve space.
  concrete = export.export(jax.jit(jax.grad(lambda x, p: jnp.sum(auto(x, p)[0]), argnums=1)),
                           platforms=("cuda",), disabled_checks=jcr.export_disabled_checks())(
      jax.ShapeDtypeStruct((5, 2, 3), jnp.float32), params)
  assert _cudnn_calls(concrete.mlir_module()) == [
      "jcr_rnn_forward_training", "jcr_rnn_backward_data", "jcr_rnn_backward_weights"]


def test_symbolic_shapes_with_implementation_cudnn_infer_and_refuse_a_derivative(sizes):
  spec, params = _lstm()
  t, b = export.symbolic_shape("t, b")
  x = jax.ShapeDtypeStruct((t, b, 3), jnp.float32)
  cudnn = lambda x, params: spec(x, None, None, params, implementation="cudnn")
  exported = export.export(jax.jit(cudnn), platforms=("cuda",),
                           disabled_checks=jcr.export_disabled_checks())(x, params)
  assert _cudnn_calls(exported.mlir_module()) == ["jcr_rnn_forward_inference"]
  refusal = (r"implementation='cudnn' cannot differentiate input_data of the symbolic shape "
             r"\(t, b, 3\).*Use implementation=None")
  with pytest.raises(ValueError, match=refusal):
    exported.serialize(vjp_order=1)
  loss = lambda x, params: jnp.sum(cudnn(x, params)[0])
  with pytest.raises(ValueError, match=refusal):
    export.export(jax.jit(jax.grad(loss, argnums=1)), platforms=("cuda",),
                  disabled_checks=jcr.export_disabled_checks())(x, params)


def test_the_cudnn_training_call_itself_refuses_symbolic_shapes(sizes):
  """Below `_symbolic`, which keeps it away: a clear error, not a C size query."""
  spec, params = _lstm()
  t, b = export.symbolic_shape("t, b")

  def loss(x, params):
    h0 = jnp.zeros((4, x.shape[1], 6), x.dtype)
    return jnp.sum(_cudnn.rnn(spec, x, h0, h0, params)[0])

  with pytest.raises(ValueError, match="cuDNN's training call needs concrete shapes, got "
                                       "steps t and batch b"):
    export.export(jax.jit(jax.grad(loss, argnums=1)), platforms=("cuda",))(
        jax.ShapeDtypeStruct((t, b, 3), jnp.float32), params)


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU], ids=lambda c: c.__name__)
def test_symbolic_shapes_cudnn_values_xla_gradients_on_the_handler_model(cls, monkeypatch):
  """The cuDNN branch of an artifact with symbolic batch and time, run on this
  machine with the handler model answering its calls (batch-major, lengths,
  inter-layer dropout): the inference call's values, the "xla" path's
  gradients, and never a training call. (`_ops` picks this derivative for
  `implementation=None`; the test above shows it in an export for CUDA.)"""
  model = HandlerModel().install(monkeypatch.setattr)
  spec = cls(num_layers=3, num_units=5, input_size=4, direction="bidirectional", dropout=0.25)
  params = spec.init_params(jax.random.key(0))
  options = dict(dropout_key=jax.random.key(3), apply_dropout=True, time_major=False)

  def states(h0c0):
    return h0c0 if spec.has_cell_state else (h0c0[0], None)

  def cudnn(x, h0c0, params, lengths):
    return _symbolic.rnn(spec, x, *states(h0c0), params, derivative=_xla.rnn,
                         seq_lengths=lengths, **options)

  def xla(x, h0c0, params, lengths):
    return _xla.rnn(spec, x, *states(h0c0), params, seq_lengths=lengths, **options)

  b, t = export.symbolic_shape("b, t")
  state = jax.ShapeDtypeStruct((6, b, 5), jnp.float32)
  artifact = _round_trip(cudnn, jax.ShapeDtypeStruct((b, t, 4), jnp.float32),
                         (state,) * (2 if spec.has_cell_state else 1), params,
                         jax.ShapeDtypeStruct((b,), jnp.int32))
  assert set(model.calls) == {"jcr_rnn_forward_inference"}
  for batch, steps, lengths in [(3, 40, [40, 5, 0]), (2, 7, [7, 2])]:
    keys = jax.random.split(jax.random.key(steps), 3)
    x = jax.random.normal(keys[0], (batch, steps, 4), jnp.float32)
    h0c0 = tuple(jax.random.normal(k, (6, batch, 5), jnp.float32)
                 for k in keys[1:1 + (2 if spec.has_cell_state else 1)])
    lengths = jnp.asarray(lengths, jnp.int32)
    got, want = artifact.call(x, h0c0, params, lengths), xla(x, h0c0, params, lengths)
    assert got[0].shape == (batch, steps, 10)
    assert _relative_error(got, want) < 1e-5
    assert float(jnp.max(jnp.abs(got[0][1, 5:]))) == 0.0  # past its length: zeros

    loss = lambda call_: lambda *a: sum(jnp.sum(jnp.sin(r)) for r in call_(*a, lengths)
                                        if r is not None)
    got = jax.grad(loss(artifact.call), argnums=(0, 1, 2))(x, h0c0, params)
    want = jax.grad(loss(xla), argnums=(0, 1, 2))(x, h0c0, params)
    assert _relative_error(got, want) < 1e-4
    assert float(jnp.max(jnp.abs(got[2]))) > 1e-3
  assert set(model.calls) == {"jcr_rnn_forward_inference"}


def test_register_ffi_targets():
  library, why = _cudnn._load()
  if library is None:
    with pytest.raises(RuntimeError, match="native library"):
      jcr.register_ffi_targets()
    assert why
  else:
    jcr.register_ffi_targets()
    jcr.register_ffi_targets()  # idempotent
