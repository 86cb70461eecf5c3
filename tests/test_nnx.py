"""Flax nnx adapters: equal to the functional API and to linen, dropout streams, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax
from flax import nnx

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import nnx as jnnx


@pytest.mark.parametrize("module,cls", [
    (jnnx.LSTM, jcr.CudnnLSTM), (jnnx.GRU, jcr.CudnnGRU),
    (lambda *a, **k: jnnx.SimpleRNN(*a, activation="relu", **k), jcr.CudnnRNNRelu)])
def test_module_equals_functional_api(module, cls):
  m = module(4, 6, num_layers=2, bidirectional=True, return_carry=True, param_dtype=jnp.float64,
             rngs=nnx.Rngs(0))
  assert isinstance(m.spec, cls)
  x = jax.random.normal(jax.random.key(0), (3, 5, 4), jnp.float64)
  carry, y = m(x, seq_lengths=jnp.array([5, 2, 3]))
  ref = m.spec._run(x, None, None, m.opaque_params[...], False,
                    seq_lengths=jnp.array([5, 2, 3]), time_major=False)
  np.testing.assert_allclose(y, ref[0], rtol=1e-12)
  np.testing.assert_allclose(carry[0] if m.spec.has_cell_state else carry, ref[1], rtol=1e-12)


def test_carry_shape_is_checked_in_the_modules_terms():
  m = jnnx.GRU(4, 6, rngs=nnx.Rngs(0))
  x = jnp.ones((3, 5, 4), jnp.float32)
  with pytest.raises(ValueError, match=r"initial_carry must have shape \(1, 3, 6\) .*got \(3, 6\); "
                                       r"unlike flax.linen.RNN's cells"):
    m(x, jnp.zeros((3, 6)))
  h = jnp.full((1, 3, 6), 0.25, jnp.float32)
  np.testing.assert_array_equal(m(x, h), m.spec._run(x, h, None, m.opaque_params[...], False,
                                                     time_major=False)[0])


def test_inputs_of_another_width_name_in_features():
  m = jnnx.LSTM(4, 6, rngs=nnx.Rngs(0))
  message = r"inputs' last axis must be in_features=4 \(the module's\), got shape \(3, 5, 7\)"
  x = jnp.ones((3, 5, 7))
  with pytest.raises(ValueError, match=message):
    m(x)
  with pytest.raises(ValueError, match=message):
    nnx.jit(lambda m, x: m(x))(m, x)
  assert m(x[..., :4]).shape == (3, 5, 6)
  with pytest.raises(ValueError, match=r"^inputs must have rank 3 \[B, T, features\] "
                                       r"\(time_major=False\), got shape \(5, 4\)$"):
    m(jnp.ones((5, 4)))
  nested = [[[1.0, 2.0, 3.0, 4.0]]]  # a list, as jnp.asarray makes it
  np.testing.assert_array_equal(m(nested), m(jnp.asarray(nested)))


def test_initializer_errors_name_kernel_init_and_bias_init():
  with pytest.raises(TypeError, match=r"^bias_init must be a callable init\(key, shape, dtype\)"):
    jnnx.GRU(3, 4, bias_init=0.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"^kernel_init returned shape \(1,\) when asked for "
                                       r"\(3, 3\)$"):
    jnnx.LSTM(3, 3, kernel_init=lambda k, shape, dtype: jnp.zeros((1,), dtype), rngs=nnx.Rngs(0))


def test_dropout_stream_and_eval():
  m = jnnx.LSTM(3, 8, num_layers=3, dropout_rate=0.5, rngs=nnx.Rngs(params=0, dropout=1))
  x = jax.random.normal(jax.random.key(0), (2, 5, 3))
  a, b = m(x), m(x)  # the stream advances: different masks
  assert not np.allclose(a, b)
  m.eval()
  np.testing.assert_array_equal(m(x), m(x))
  no_stream = jnnx.GRU(3, 8, num_layers=2, dropout_rate=0.5, rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match=r"dropout needs rngs with a 'dropout' \(or 'default'\) "
                                       r"stream, at construction or call time"):
    no_stream(x)
  assert no_stream(x, rngs=nnx.Rngs(dropout=3)).shape == (2, 5, 8)


def test_nnx_view_sets_deterministic():
  """`nnx.view(model, deterministic=True)` turns dropout off in the view, as
  for `nnx.Dropout` (it raised "Unused keys" though the docstring promised it),
  and leaves the model as it was; a model holding one views with its dropout."""
  if not hasattr(nnx, "view"):
    pytest.skip(f"nnx.view is newer than flax {flax.__version__}")
  x = jax.random.normal(jax.random.key(0), (2, 5, 3), jnp.float32)
  m = jnnx.GRU(3, 8, num_layers=2, dropout_rate=0.5, rngs=nnx.Rngs(0))
  evaluated = nnx.view(m, deterministic=True)
  assert evaluated.deterministic and not m.deterministic
  np.testing.assert_array_equal(evaluated(x), m(x, deterministic=True))
  assert not np.allclose(m(x), m(x, deterministic=True))  # the model keeps its dropout

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.rnn = jnnx.LSTM(3, 4, num_layers=2, dropout_rate=0.5, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

  block = nnx.view(Block(nnx.Rngs(0)), deterministic=True)
  assert block.rnn.deterministic and block.dropout.deterministic
  np.testing.assert_array_equal(block.rnn(x), block.rnn(x))
  with pytest.raises(TypeError, match=r"^deterministic must be a bool, got 'yes'$"):
    nnx.view(m, deterministic="yes")
  with pytest.raises(TypeError, match=r"^deterministic must be a bool, got None$"):
    jnnx.GRU(3, 8, deterministic=None, rngs=nnx.Rngs(0))


def test_dropout_takes_rngs_as_nnx_dropout_does():
  """A `default` stream stands in for a `dropout` one, as in `nnx.Dropout`: a
  model built with `nnx.Rngs(0)` trains with dropout (it raised before); at
  call time `rngs` may also be a stream or a key, which draws the masks the
  functional call draws from it."""
  x = jax.random.normal(jax.random.key(0), (2, 5, 3), jnp.float32)
  m = jnnx.GRU(3, 8, num_layers=2, dropout_rate=0.5, rngs=nnx.Rngs(0))
  a, b = m(x), m(x)
  assert not np.allclose(a, b)
  assert not np.allclose(a, m(x, deterministic=True))
  # The default stream forked at construction (after the parameters' draw), as
  # nnx.Dropout forks it: the same keys.
  m, rngs = jnnx.GRU(3, 8, num_layers=2, dropout_rate=0.5, rngs=nnx.Rngs(0)), nnx.Rngs(0)
  rngs.params()
  dropout = nnx.Dropout(0.5, rngs=rngs)
  for _ in range(2):
    np.testing.assert_array_equal(jax.random.key_data(m.rngs()),
                                  jax.random.key_data(dropout.rngs()))
  key = jax.random.key(7)
  call = lambda k: m.spec(x, None, m.opaque_params[...], dropout_key=k, time_major=False)[0]
  np.testing.assert_array_equal(m(x, rngs=key), call(key))
  stream = nnx.Rngs(dropout=7)["dropout"]
  expected_key = nnx.Rngs(dropout=7)["dropout"]()
  np.testing.assert_array_equal(m(x, rngs=stream), call(expected_key))
  for rngs, message in ((3, r"^rngs must be an nnx.Rngs, an nnx.RngStream or \(at call time\) a "
                            r"PRNG key, got int$"),
                        (jnp.zeros(3, jnp.uint32), r"^rngs must be a PRNG key")):
    with pytest.raises(TypeError, match=message):
      m(x, rngs=rngs)
  with pytest.raises(TypeError, match=r"^rngs must be an nnx.Rngs, got int$"):
    jnnx.GRU(3, 8, rngs=3)
  # Without dropout to apply, nothing is drawn and a model without a stream is as before.
  assert jnnx.GRU(3, 8, rngs=nnx.Rngs(params=0))(x).shape == (2, 5, 8)


def test_training_steps_lower_the_loss():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.rnn = jnnx.GRU(1, 16, num_layers=2, rngs=rngs)
      self.head = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
      return self.head(self.rnn(x)[:, -1])

  x = jax.random.normal(jax.random.key(0), (64, 8, 1))
  y = x.sum(axis=(1, 2))[:, None]
  model = Model(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(60)]
  assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_time_major_and_mixed_precision():
  """float32 parameters, bfloat16 compute: the call is the bfloat16 spec's on the
  parameters rounded to bfloat16, its outputs bfloat16, its parameter gradient
  float32; time-major gives the batch-major module's outputs transposed."""
  batch_major = jnnx.LSTM(3, 4, num_layers=2, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  time_major = jnnx.LSTM(3, 4, num_layers=2, dtype=jnp.bfloat16, time_major=True,
                         rngs=nnx.Rngs(0))
  params = batch_major.opaque_params[...]
  assert params.dtype == jnp.float32
  np.testing.assert_array_equal(time_major.opaque_params[...], params)
  x = jax.random.normal(jax.random.key(1), (2, 6, 3), jnp.float32)
  y = batch_major(x)
  assert y.shape == (2, 6, 4) and y.dtype == jnp.bfloat16
  bf16_spec = jcr.CudnnLSTM(num_layers=2, num_units=4, input_size=3, dtype=jnp.bfloat16)
  spec_call = lambda p: bf16_spec(x.astype(jnp.bfloat16), None, None, p.astype(jnp.bfloat16),
                                  is_training=False, time_major=False)[0]
  np.testing.assert_array_equal(y, spec_call(params))
  np.testing.assert_array_equal(time_major(jnp.swapaxes(x, 0, 1)), jnp.swapaxes(y, 0, 1))

  grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(batch_major)
  g = grads.opaque_params[...]
  assert g.dtype == jnp.float32
  expected_g = jax.grad(lambda p: jnp.sum(spec_call(p).astype(jnp.float32)))(params)
  np.testing.assert_array_equal(g, expected_g)
  assert float(jnp.abs(g).max()) > 0


def test_orbax_checkpoint_of_train_state(tmp_path):
  """The whole train state (model and optimizer) through Orbax into a model
  and optimizer built from another seed: same outputs, and the next training
  step is the same on both."""
  import orbax.checkpoint as ocp

  def build(seed):
    model = jnnx.GRU(5, 4, num_layers=2, bidirectional=True, rngs=nnx.Rngs(seed))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  x = jax.random.normal(jax.random.key(0), (2, 3, 5))

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  model, optimizer = build(0)
  for _ in range(3):
    step(model, optimizer)
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(3, args=ocp.args.StandardSave(nnx.state((model, optimizer))))
    manager.wait_until_finished()
    other_model, other_optimizer = build(7)
    assert not np.allclose(other_model(x), model(x))
    restored = manager.restore(3, args=ocp.args.StandardRestore(
        nnx.state((other_model, other_optimizer))))
  nnx.update((other_model, other_optimizer), restored)
  np.testing.assert_array_equal(other_model.opaque_params[...], model.opaque_params[...])
  np.testing.assert_array_equal(other_model(x), model(x))
  np.testing.assert_array_equal(step(other_model, other_optimizer), step(model, optimizer))
  np.testing.assert_array_equal(other_model.opaque_params[...], model.opaque_params[...])


def test_inputs_and_carry_of_no_real_dtype_name_the_argument():
  m = jnnx.GRU(4, 6, rngs=nnx.Rngs(0))
  x = jnp.ones((3, 5, 4), jnp.float32)
  with pytest.raises(TypeError, match=r"^initial_carry must have a float, integer or bool dtype, "
                                      r"got complex64"):
    m(x, jnp.zeros((1, 3, 6), jnp.complex64))
  with pytest.raises(TypeError, match=r"^inputs must have a float, integer or bool dtype, got "
                                      r"complex64"):
    nnx.jit(lambda m, x: m(x))(m, x.astype(jnp.complex64))
  np.testing.assert_array_equal(m(x.astype(jnp.bool_)), m(x))  # a real dtype is cast


@pytest.mark.parametrize("arguments,exc,message", [
    (dict(features=2.5), TypeError, r"^features must be an int, got 2.5 \(float\)$"),
    (dict(num_layers=0), ValueError, r"^num_layers must be a positive int, got 0$"),
    (dict(dropout_rate=-0.1), ValueError, r"^dropout_rate must be in \[0, 1\), got -0.1$"),
    (dict(input_mode="skip_input"), ValueError,
     r"^input_mode='skip_input' needs in_features == features, got 3 and 4$"),
    (dict(bidirectional=None), TypeError, r"^bidirectional must be a bool, got None$"),
    (dict(return_carry="yes"), TypeError, r"^return_carry must be a bool, got 'yes'$"),
    (dict(param_dtype=None), TypeError, r"^param_dtype must be one of \[.*\], got None$"),
    (dict(dtype="foo"), TypeError, r"^dtype must be one of \[.*\], got 'foo'$"),
])
def test_arguments_are_checked_in_the_modules_terms(arguments, exc, message):
  with pytest.raises(exc, match=message):
    jnnx.GRU(**(dict(in_features=3, features=4) | arguments), rngs=nnx.Rngs(0))
