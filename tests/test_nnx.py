"""Flax nnx adapters: equal to the functional API and to linen, dropout streams, training."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
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


def test_dropout_stream_and_eval():
  m = jnnx.LSTM(3, 8, num_layers=3, dropout_rate=0.5, rngs=nnx.Rngs(params=0, dropout=1))
  x = jax.random.normal(jax.random.key(0), (2, 5, 3))
  a, b = m(x), m(x)  # the stream advances: different masks
  assert not np.allclose(a, b)
  m.eval()
  np.testing.assert_array_equal(m(x), m(x))
  no_stream = jnnx.GRU(3, 8, num_layers=2, dropout_rate=0.5, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="dropout"):
    no_stream(x)
  assert no_stream(x, rngs=nnx.Rngs(dropout=3)).shape == (2, 5, 8)


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
