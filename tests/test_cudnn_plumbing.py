"""`_cudnn`'s Python side on any machine, with the native handlers replaced by
a pure-JAX model of their contract (`handler_model.py`).

What this proves: given handlers that do what cuDNN's calls are documented to
do, the "cudnn" implementation returns the reference's values and gradients
through its `custom_vjp` (reserve space as the residual, updated by backward
data and read by backward weights), its per-layer calls with dropout masks
between them, its zero-length fix-up, both layouts and `vmap`. It also lowers
`implementation=None` (the functional API, the demo's train step, an nnx module)
for a CUDA device this machine lacks, and checks that it calls cuDNN there and
the scan on the CPU. What it cannot prove: that the C++ handlers and cuDNN do
what the model does, nor that XLA compiles the calls; `test_cudnn.py` checks
those on a GPU.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _ops
from helpers import SPEC_CLASSES, assert_gradient_is_one_concatenation, call, random_inputs


@pytest.fixture
def handlers(sizes, monkeypatch):
  """As conftest's `sizes`, and the FFI calls answered by the model."""
  return sizes.install(monkeypatch.setattr)


def _inputs(spec, T, B, time_major):
  x, h, c = random_inputs(spec, T, B, seed=3)
  if not time_major:
    x = np.swapaxes(x, 0, 1)
  params = spec.init_params(jax.random.key(4))
  return jnp.asarray(x), jnp.asarray(h), None if c is None else jnp.asarray(c), params


def _values_and_grads(spec, impl, x, h, c, params, **options):
  def loss(x, h, c, p):
    y, hn, cn = call(spec, x, h, c, p, implementation=impl, **options)
    total = jnp.sum(jnp.sin(y)) + jnp.sum(hn ** 2)
    if cn is not None:
      total += jnp.sum(jnp.cos(cn))
    return total, (y, hn, cn)

  argnums = (0, 1, 2, 3) if spec.has_cell_state else (0, 1, 3)
  grads, outs = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(x, h, c, params)
  return [o for o in outs if o is not None] + list(grads)


def _assert_same(spec, x, h, c, params, **options):
  got = _values_and_grads(spec, "cudnn", x, h, c, params, **options)
  want = _values_and_grads(spec, "xla", x, h, c, params, **options)
  names = ["y", "h", "c"][:2 + spec.has_cell_state] + (
      ["dx", "dh", "dc", "dparams"] if spec.has_cell_state else ["dx", "dh", "dparams"])
  for name, a, b in zip(names, got, want):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("cls,direction,input_mode,time_major", [
    (cls, d, m, tm) for (cls, d, m), tm in zip(
        itertools.product(SPEC_CLASSES, ("unidirectional", "bidirectional"),
                          ("linear_input", "skip_input")), itertools.cycle((True, False)))])
def test_fused_call_matches_reference(handlers, cls, direction, input_mode, time_major):
  spec = cls(2, 4, 4 if input_mode == "skip_input" else 3, input_mode=input_mode,
             direction=direction, dtype=jnp.float64)
  _assert_same(spec, *_inputs(spec, 5, 3, time_major), time_major=time_major)
  # One fused call for all layers, each way.
  assert handlers.calls == {"jcr_rnn_forward_training": 1, "jcr_rnn_backward_data": 1,
                            "jcr_rnn_backward_weights": 1}


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("time_major", [True, False])
def test_seq_lengths_with_empty_sequences(handlers, cls, time_major):
  spec = cls(2, 4, 3, direction="bidirectional", dtype=jnp.float64)
  lengths = jnp.array([5, 2, 0, 1], jnp.int32)
  _assert_same(spec, *_inputs(spec, 5, 4, time_major), time_major=time_major,
               seq_lengths=lengths)


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnRNNRelu])
def test_dropout_runs_layer_by_layer_with_the_reference_masks(handlers, cls):
  spec = cls(3, 4, 3, dropout=0.4, direction="bidirectional", dtype=jnp.float64)
  _assert_same(spec, *_inputs(spec, 4, 2, True), dropout_key=jax.random.key(7),
               seq_lengths=jnp.array([4, 3], jnp.int32))
  assert handlers.calls == {"jcr_rnn_forward_training": 3, "jcr_rnn_backward_data": 3,
                            "jcr_rnn_backward_weights": 3}


def test_eager_gradient_makes_only_the_training_calls(handlers):
  """A gradient taken outside `jit` on the cuDNN path is traced in the
  caller's trace, at every call (`_ops`: through a nested `jit` it traced
  cuDNN's inference call besides its training call), and matches the "xla"
  path."""
  spec = jcr.CudnnLSTM(2, 4, 3, direction="bidirectional", dtype=jnp.float64)
  x, h, c, params = _inputs(spec, 5, 2, True)
  loss = lambda p, impl: jnp.sum(jnp.sin(spec(x, h, c, p, implementation=impl)[0]))
  for _ in range(2):
    np.testing.assert_allclose(jax.grad(loss)(params, "cudnn"), jax.grad(loss)(params, "xla"),
                               rtol=1e-10, atol=1e-12)
  assert handlers.calls == {"jcr_rnn_forward_training": 2, "jcr_rnn_backward_data": 2,
                            "jcr_rnn_backward_weights": 2}


def test_dropout_params_gradient_is_one_concatenation(handlers):
  """With dropout each layer's call takes its own buffer (`_cudnn._layer_buffers`),
  cut from one split of the opaque buffer: the gradient is one concatenation of
  the blocks' cotangents, not a buffer-sized zero-padded array per layer summed."""
  spec = jcr.CudnnGRU(3, 4, 3, dropout=0.4, direction="bidirectional", dtype=jnp.float64)
  x, h, _, params = _inputs(spec, 4, 2, True)
  loss = lambda p: jnp.sum(jnp.sin(spec(x, h, p, dropout_key=jax.random.key(7),
                                        implementation="cudnn")[0]))
  assert_gradient_is_one_concatenation(jax.make_jaxpr(jax.grad(loss))(params), spec.params_size())


def test_inference_uses_the_inference_call(handlers):
  spec = jcr.CudnnLSTM(2, 4, 3, dtype=jnp.float64)
  x, h, c, params = _inputs(spec, 5, 2, True)
  got = jax.jit(lambda *a: spec(*a, is_training=False, implementation="cudnn"))(x, h, c, params)
  want = spec(x, h, c, params, is_training=False, implementation="xla")
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-12)
  assert handlers.calls == {"jcr_rnn_forward_inference": 1}


@pytest.mark.parametrize("hidden,lengths,policy,inference,training", [
    (8, False, "auto", 3, 3), (160, False, "auto", 3, 0), (8, True, "auto", 0, 0),
    (8, False, "standard", 0, 0)])
def test_each_call_gets_its_pass_algorithm(handlers, monkeypatch, hidden, lengths, policy,
                                           inference, training):
  """The inference call carries the inference algorithm, the training calls
  (forward and both backward passes, which share one reserve space) the
  training one: cuDNN's persistent small-h algorithm (3) where its limits allow
  (LSTM: hidden <= 192 inference, <= 128 training; full-length sequences), else
  the standard one (0), which `JAX_CUDNN_RNN_ALGORITHM=standard` asks for."""
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, policy)
  spec = jcr.CudnnLSTM(1, hidden, 3)
  x, h, c, params = _inputs(spec, 3, 2, True)
  options = dict(seq_lengths=jnp.array([3, 2], jnp.int32)) if lengths else {}
  run = lambda p, training, impl: spec(x, h, c, p, is_training=training, implementation=impl,
                                       **options)[0]
  np.testing.assert_allclose(jax.jit(run, static_argnums=(1, 2))(params, False, "cudnn"),
                             run(params, False, "xla"), rtol=1e-5, atol=1e-6)
  loss = lambda p, impl: jnp.sum(jnp.sin(run(p, True, impl)))
  np.testing.assert_allclose(jax.jit(jax.grad(loss), static_argnums=1)(params, "cudnn"),
                             jax.grad(loss)(params, "xla"), rtol=1e-4, atol=1e-5)
  assert handlers.algorithms == {
      "jcr_rnn_forward_inference": {inference}, "jcr_rnn_forward_training": {training},
      "jcr_rnn_backward_data": {training}, "jcr_rnn_backward_weights": {training}}


def test_eager_calls_follow_a_changed_algorithm_policy(handlers, monkeypatch):
  """An eager call runs a cached program (`_ops._compiled_dispatch`); the policy
  keys that cache, so a call made after `JAX_CUDNN_RNN_ALGORITHM` changed is
  traced again under the new policy, and a bad value is refused even where a
  program for the shape is cached."""
  spec = jcr.CudnnLSTM(1, 8, 3)
  x, h, c, params = _inputs(spec, 3, 2, True)
  want = spec(x, h, c, params, is_training=False, implementation="xla")[0]
  for policy, algorithms in (("auto", {3}), ("standard", {3, 0}), ("auto", {3, 0})):
    monkeypatch.setenv(_cudnn.ALGORITHM_ENV, policy)
    got = spec(x, h, c, params, is_training=False, implementation="cudnn")[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert handlers.algorithms["jcr_rnn_forward_inference"] == algorithms, policy
  # Two policies, two traces: the third call came from the cache.
  assert handlers.calls == {"jcr_rnn_forward_inference": 2}
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, "persistent")
  with pytest.raises(ValueError, match="JAX_CUDNN_RNN_ALGORITHM must be one of auto, "
                                       "standard; got 'persistent'"):
    spec(x, h, c, params, is_training=False, implementation="cudnn")


@pytest.mark.parametrize("persistent_batch_major", [*_cudnn.PERSISTENT_BATCH_MAJOR_CHOICES, None])
@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
@pytest.mark.parametrize("policy", _cudnn.ALGORITHM_POLICIES)
def test_batch_major_data_is_sequence_major_under_the_persistent_algorithm(
    handlers, monkeypatch, cls, policy, persistent_batch_major):
  """Batch-major data reaches cuDNN batch-major, but under the persistent
  small-h algorithm, which gets it transposed to sequence-major (the layout it
  is known to run in) unless `_cudnn.PERSISTENT_BATCH_MAJOR` names the calls
  that take it as it is; by default (None: not set) the inference call alone
  (session 63). Values and gradients are the same either way."""
  monkeypatch.setenv(_cudnn.ALGORITHM_ENV, policy)
  if persistent_batch_major is None:
    persistent_batch_major = "inference"  # what the library does unless told otherwise
  else:
    monkeypatch.setattr(_cudnn, "PERSISTENT_BATCH_MAJOR", persistent_batch_major)
  spec = cls(2, 6, 3, direction="bidirectional")
  x, h, c, params = _inputs(spec, 5, 3, time_major=False)

  def loss(x, h, p, impl):
    y, hn, _ = call(spec, x, h, c, p, time_major=False, implementation=impl)
    return jnp.sum(jnp.sin(y)) + jnp.sum(hn ** 2), y

  grad = lambda impl: jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True),
                              static_argnums=3)(x, h, params, impl)
  (got, y), (want, y_ref) = grad("cudnn"), grad("xla")
  np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  assert y.shape == (3, 5, 12)
  inference = jax.jit(lambda x: call(spec, x, h, c, params, is_training=False,
                                     time_major=False, implementation="cudnn")[0])(x)
  np.testing.assert_allclose(inference, y_ref, rtol=1e-5, atol=1e-6)
  as_given = policy == "standard" or persistent_batch_major == "all"
  assert handlers.batch_major == {
      t: {as_given or (persistent_batch_major == "inference"
                       and t == "jcr_rnn_forward_inference")}
      for t in _cudnn.TARGETS}, handlers.batch_major


def test_persistent_batch_major_must_be_a_choice(handlers, monkeypatch):
  monkeypatch.setattr(_cudnn, "PERSISTENT_BATCH_MAJOR", True)
  spec = jcr.CudnnGRU(1, 6, 3)
  x, h, _, params = _inputs(spec, 5, 3, time_major=False)
  with pytest.raises(ValueError, match="PERSISTENT_BATCH_MAJOR must be one of none, inference, "
                                       "all; got True"):
    spec(x, h, params, time_major=False, implementation="cudnn")


def test_vmap_of_gradients(handlers):
  spec = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  x, h, _, params = _inputs(spec, 5, 2, True)
  xs = jnp.stack([x, 2 * x, -x])

  def grad(impl):
    loss = lambda x, p: jnp.sum(jnp.tanh(spec(x, h, p, implementation=impl)[0]))
    return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(xs, params)

  for a, b in zip(grad("cudnn"), grad("xla")):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


# -- implementation=None, lowered for a CUDA device and for the CPU -----------------
#
# `jax.jit(f).trace(...).lower(lowering_platforms=(...,))` lowers for a platform
# this machine lacks. Lowered for CUDA, the default implementation must call
# cuDNN and contain no scan; lowered for the CPU, the reverse. (Compiling and
# running it for CUDA needs a GPU: `test_cudnn.py`, and the demo's own check.)


def _lowered(f, *args, platform):
  return jax.jit(f).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def _assert_dispatch(f, *args, targets):
  cuda, cpu = (_lowered(f, *args, platform=p) for p in ("cuda", "cpu"))
  found = {t for t in _cudnn.TARGETS if f"@{t}(" in cuda}
  assert found == set(targets), found
  assert _cudnn.in_compiled(cuda) and "stablehlo.while" not in cuda
  assert not _cudnn.in_compiled(cpu) and "stablehlo.while" in cpu


TRAINING = ("jcr_rnn_forward_training", "jcr_rnn_backward_data", "jcr_rnn_backward_weights")


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_default_implementation_lowers_to_cudnn_for_cuda(sizes, cls):
  spec = cls(2, 4, 3, direction="bidirectional", dropout=0.3)
  x, h, c, params = _inputs(spec, 5, 2, False)
  x, h, c = (None if a is None else a.astype(jnp.float32) for a in (x, h, c))
  opts = dict(time_major=False, dropout_key=jax.random.key(0))

  def loss(p):
    return jnp.sum(call(spec, x, h, c, p, **opts)[0] ** 2)

  _assert_dispatch(jax.grad(loss), params, targets=TRAINING)
  infer = lambda p: call(spec, x, h, c, p, is_training=False, time_major=False)
  _assert_dispatch(infer, params, targets=("jcr_rnn_forward_inference",))


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_default_implementation_runs_one_step_on_xla_for_cuda(sizes, monkeypatch, cls):
  """A one-step call (decoding) under `implementation=None` lowers for a CUDA
  device to the "xla" path, its gradient too (`_ops.one_step_on_xla`); two
  steps, `implementation="cudnn"` and a buffer past the bound lower to cuDNN."""
  spec = cls(2, 4, 3, direction="bidirectional")
  x, h, c, params = _inputs(spec, 2, 3, True)
  x, h, c = (None if a is None else a.astype(jnp.float32) for a in (x, h, c))

  def lowered(steps, **options):
    infer = lambda p: call(spec, x[:steps], h, c, p, is_training=False, **options)
    loss = lambda p: jnp.sum(call(spec, x[:steps], h, c, p, **options)[0] ** 2)
    return [_lowered(f, params, platform="cuda") for f in (infer, jax.grad(loss))]

  assert not any(_cudnn.in_compiled(text) for text in lowered(1))
  assert all(_cudnn.in_compiled(text) for text in lowered(2))
  assert all(_cudnn.in_compiled(text) for text in lowered(1, implementation="cudnn"))
  size = spec.params_size()
  monkeypatch.setattr(_ops, "ONE_STEP_XLA_MAX_ELEMENTS", size - 1)
  assert all(_cudnn.in_compiled(text) for text in lowered(1))
  monkeypatch.setattr(_ops, "ONE_STEP_XLA_MAX_ELEMENTS", size)
  assert not any(_cudnn.in_compiled(text) for text in lowered(1))


def test_demo_train_step_lowers_to_cudnn_for_cuda(sizes):
  import optax
  from jax_cudnn_rnn import demo

  model = demo.CharLM(hidden=16, layers=2, dropout=0.1)
  tokens = jnp.zeros((4, 8), jnp.int32)
  # Shapes only: lowering needs no values, and nothing is run (on a GPU the
  # fixture's faked cuDNN has no handlers to run).
  params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
  optimizer = optax.adam(1e-3)
  train_step, eval_loss = demo.make_steps(model, optimizer)
  args = (params, jax.eval_shape(optimizer.init, params), tokens, tokens, jax.random.key(1))
  _assert_dispatch(train_step, *args, targets=TRAINING)
  _assert_dispatch(eval_loss, params, tokens, tokens, targets=("jcr_rnn_forward_inference",))


def test_nnx_module_lowers_to_cudnn_for_cuda(sizes):
  from flax import nnx
  from jax_cudnn_rnn import nnx as jcr_nnx

  module = jcr_nnx.GRU(3, 5, num_layers=2, rngs=nnx.Rngs(0))
  x = jnp.ones((2, 6, 3), jnp.float32)

  def loss(module, x):
    return jnp.sum(module(x) ** 2)

  graphdef, state = nnx.split(module)
  step = lambda state, x: jax.grad(lambda s: loss(nnx.merge(graphdef, s), x))(state)
  _assert_dispatch(step, state, x, targets=TRAINING)


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
@pytest.mark.parametrize("time_major", [True, False])
def test_vmapped_inference_with_shared_weights_is_one_folded_call(handlers, cls, time_major):
  spec = cls(2, 4, 3, direction="bidirectional", dtype=jnp.float64)
  V, T, B = 3, 5, 2
  rng = np.random.default_rng(5)
  xs = jnp.asarray(rng.normal(size=(V, T, B, 3) if time_major else (V, B, T, 3)))
  hs = jnp.asarray(rng.normal(size=(V, 4, B, 4)))
  lengths = jnp.array([[5, 2], [0, 3], [4, 5]], jnp.int32)
  params = spec.init_params(jax.random.key(0))
  c = None if not spec.has_cell_state else jnp.asarray(rng.normal(size=(4, B, 4)))  # shared

  def infer(impl):
    def one(x, h, n):
      return call(spec, x, h, c, params, is_training=False, seq_lengths=n,
                  time_major=time_major, implementation=impl)
    return jax.jit(jax.vmap(one))(xs, hs, lengths)

  got = infer("cudnn")
  # custom_vmap traces the unbatched call once (for its type), then the fold rule
  # makes the call that runs, on all V * B sequences (one call: see the lowering test).
  folded = (T, V * B, 3) if time_major else (V * B, T, 3)
  assert handlers.x_shapes[-1] == folded, handlers.x_shapes
  for a, b in zip(got, infer("xla")):
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnRNNTanh])
def test_vmapped_inference_with_vmapped_weights_is_a_call_per_element(handlers, cls):
  spec = cls(1, 4, 3, dtype=jnp.float64)
  x, h, c, _ = _inputs(spec, 5, 2, True)
  params = jnp.stack([spec.init_params(jax.random.key(i)) for i in range(3)])

  def infer(impl):
    one = lambda p: call(spec, x, h, c, p, is_training=False, implementation=impl)
    return jax.jit(jax.vmap(one))(params)

  got = infer("cudnn")
  assert set(handlers.x_shapes) == {(5, 2, 3)}  # unfolded: a call per element, in a loop
  for a, b in zip(got, infer("xla")):
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)


def test_vmapped_inference_lowers_to_one_cudnn_call(sizes):
  spec = jcr.CudnnGRU(2, 4, 3)
  params = spec.init_params(jax.random.key(0))
  xs = jnp.ones((4, 2, 5, 3), jnp.float32)
  infer = jax.vmap(lambda x: spec(x, None, params, is_training=False, time_major=False)[0])
  cuda = _lowered(infer, xs, platform="cuda")
  assert cuda.count("@jcr_rnn_forward_inference(") == 1 and "stablehlo.while" not in cuda
  # Per-element weights: the one call sits in a loop over the elements.
  many = jnp.stack([params, 2 * params])
  per_element = jax.vmap(lambda p: spec(xs[0], None, p, is_training=False, time_major=False)[0])
  cuda = _lowered(per_element, many, platform="cuda")
  assert cuda.count("@jcr_rnn_forward_inference(") == 1 and "stablehlo.while" in cuda
