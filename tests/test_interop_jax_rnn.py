"""`jax.experimental.rnn` LSTM weights: its buffer is our opaque buffer, and its
reference (`lstm_ref`, pure JAX, runs anywhere) computes the same function as
ours, values and gradients. On a GPU, `test_cudnn.py` also holds its cuDNN
LSTM against ours."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import interop
from helpers import CROSS_TOL, random_inputs

rnn = pytest.importorskip("jax.experimental.rnn")

CONFIGS = [(layers, bidirectional) for layers in (1, 2) for bidirectional in (False, True)]


def _spec(layers, bidirectional, input_size=3, units=4, input_mode="linear_input"):
  return jcr.CudnnLSTM(layers, units, input_size, input_mode=input_mode,
                       direction="bidirectional" if bidirectional else "unidirectional",
                       dtype=jnp.float32)


def _their_args(spec):
  """`input_size, hidden_size, num_layers, dropout, bidirectional` of `rnn.lstm`."""
  return (spec.input_size, spec.num_units, spec.num_layers, 0.0, spec.num_dirs == 2)


def _inputs(spec, B=3, T=5):
  """Batch-major `x` and the initial states, as `jax.experimental.rnn` takes them."""
  x, h, c = random_inputs(spec, T, B)
  return jnp.asarray(np.swapaxes(x, 0, 1)), jnp.asarray(h), jnp.asarray(c)


def _theirs(spec, x, h, c, weights, lengths=None):
  """`jax.experimental.rnn`'s pure-JAX LSTM on its own unpacked weights."""
  if lengths is None:
    lengths = jnp.full((x.shape[0],), x.shape[1], jnp.int32)
  unpacked = rnn.unpack_lstm_weights(weights, *_their_args(spec)[:3], spec.num_dirs == 2)
  return rnn.lstm_ref(x, h, c, *unpacked, lengths, *_their_args(spec))


def _loss(y, h, c):
  return jnp.sum(jnp.sin(y)) + jnp.sum(h ** 2) + jnp.sum(jnp.cos(c))


@pytest.mark.parametrize("layers,bidirectional", CONFIGS)
def test_their_unpacking_finds_our_canonical_tensors(layers, bidirectional):
  spec = _spec(layers, bidirectional)
  weights = rnn.init_lstm_weight(jax.random.key(0), *_their_args(spec)[:3], bidirectional)
  params = interop.from_jax_experimental_rnn(spec, weights)
  np.testing.assert_array_equal(params, weights)
  W_ih, W_hh, b_ih, b_hh = rnn.unpack_lstm_weights(weights, *_their_args(spec)[:3],
                                                   bidirectional)
  ours_w, ours_b = spec.params_to_canonical(params)
  for p in range(layers * spec.num_dirs):  # pseudo-layer: 8 matrices and 8 biases each
    np.testing.assert_array_equal(W_ih[p], np.concatenate(ours_w[8 * p:8 * p + 4]))
    np.testing.assert_array_equal(W_hh[p], np.concatenate(ours_w[8 * p + 4:8 * p + 8]))
    np.testing.assert_array_equal(b_ih[p], np.concatenate(ours_b[8 * p:8 * p + 4]))
    np.testing.assert_array_equal(b_hh[p], np.concatenate(ours_b[8 * p + 4:8 * p + 8]))
  np.testing.assert_array_equal(interop.to_jax_experimental_rnn(spec, params), weights)


@pytest.mark.parametrize("layers,bidirectional", CONFIGS)
@pytest.mark.parametrize("ragged", [False, True])
def test_same_function_values_and_gradients(layers, bidirectional, ragged):
  spec = _spec(layers, bidirectional)
  weights = rnn.init_lstm_weight(jax.random.key(1), *_their_args(spec)[:3], bidirectional)
  params = interop.from_jax_experimental_rnn(spec, weights)
  x, h, c = _inputs(spec)
  lengths = jnp.array([5, 2, 1] if ragged else [5, 5, 5], jnp.int32)
  ours = lambda x, h, c, p: spec(x, h, c, p, seq_lengths=lengths, time_major=False,
                                 implementation="xla")
  theirs = lambda x, h, c, w: _theirs(spec, x, h, c, w, lengths)
  for a, b in zip(ours(x, h, c, params), theirs(x, h, c, weights)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  grad = lambda f, p: jax.grad(lambda *a: _loss(*f(*a)), argnums=(0, 1, 2, 3))(x, h, c, p)
  for name, a, b in zip(("dx", "dh", "dc", "dweights"), grad(ours, params),
                        grad(theirs, weights)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6, err_msg=name)


def test_skip_input_writes_and_reads_identities():
  spec = _spec(2, True, input_size=4, input_mode="skip_input")
  params = spec.init_params(jax.random.key(2))
  weights = interop.to_jax_experimental_rnn(spec, params)
  assert weights.shape == (_spec(2, True, input_size=4).params_size(),)
  W_ih, _, _, _ = rnn.unpack_lstm_weights(weights, 4, 4, 2, True)
  for p in (0, 1):  # layer 0, both directions: four stacked identities
    np.testing.assert_array_equal(W_ih[p], np.tile(np.eye(4, dtype=np.float32), (4, 1)))
  np.testing.assert_array_equal(interop.from_jax_experimental_rnn(spec, weights), params)
  x, h, c = _inputs(spec)
  for a, b in zip(spec(x, h, c, params, time_major=False), _theirs(spec, x, h, c, weights)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=CROSS_TOL)  # cuDNN's on a GPU


def test_dtype_is_the_specs():
  spec = jcr.CudnnLSTM(1, 4, 3, dtype=jnp.float64)
  weights = rnn.init_lstm_weight(jax.random.key(3), 3, 4, 1, False)
  params = interop.from_jax_experimental_rnn(spec, weights)
  assert params.dtype == jnp.float64
  np.testing.assert_array_equal(params, np.asarray(weights, np.float64))


def test_refusals():
  lstm = _spec(1, False)
  with pytest.raises(ValueError, match=r"LSTMs only.*CudnnGRU"):
    interop.from_jax_experimental_rnn(jcr.CudnnGRU(1, 4, 3), np.zeros(60, np.float32))
  with pytest.raises(ValueError, match=r"LSTMs only"):
    interop.to_jax_experimental_rnn(jcr.CudnnRNNTanh(1, 4, 3), np.zeros(40, np.float32))
  size = lstm.params_size()
  with pytest.raises(ValueError, match=rf"weights has shape \({size + 1},\), expected \({size},\)"):
    interop.from_jax_experimental_rnn(lstm, np.zeros(size + 1, np.float32))
  with pytest.raises(TypeError, match="params must have dtype float32, got float64"):
    interop.to_jax_experimental_rnn(lstm, np.zeros(size, np.float64))
  with pytest.raises(TypeError, match="spec"):
    interop.to_jax_experimental_rnn("lstm", np.zeros(size, np.float32))
  skip = _spec(1, False, input_size=4, input_mode="skip_input")
  weights = interop.to_jax_experimental_rnn(skip, skip.init_params(jax.random.key(4)))
  weights[0] += 1  # layer 0's first input matrix is no longer the identity
  with pytest.raises(ValueError, match="skip_input"):
    interop.from_jax_experimental_rnn(skip, weights)
