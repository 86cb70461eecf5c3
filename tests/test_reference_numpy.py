"""The pure-JAX RNN against the independent numpy loop, and hand-computed cases."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from helpers import SPEC_CLASSES, call, random_canonical, random_inputs
from numpy_rnn import numpy_rnn

CONFIGS = list(itertools.product(SPEC_CLASSES, (1, 2), ("unidirectional", "bidirectional"),
                                 ("linear_input", "skip_input")))


def _compare(spec, T=5, B=3, seq_lengths=None, time_major=True, rtol=1e-10, atol=1e-10):
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, T, B)
  ref_y, ref_h, ref_c = numpy_rnn(spec.rnn_mode, spec.num_layers, spec.num_dirs == 2,
                                  spec.input_mode == "skip_input", weights, biases, x, h, c,
                                  seq_lengths)
  x_in = x if time_major else np.swapaxes(x, 0, 1)
  y, h_out, c_out = call(spec, x_in, h, c, params, is_training=False, seq_lengths=seq_lengths,
                         time_major=time_major, implementation="xla")
  y = y if time_major else np.swapaxes(y, 0, 1)
  np.testing.assert_allclose(y, ref_y, rtol=rtol, atol=atol)
  np.testing.assert_allclose(h_out, ref_h, rtol=rtol, atol=atol)
  if spec.has_cell_state:
    np.testing.assert_allclose(c_out, ref_c, rtol=rtol, atol=atol)


@pytest.mark.parametrize("cls,layers,direction,mode", CONFIGS)
def test_matches_numpy(cls, layers, direction, mode):
  spec = cls(layers, 4, 4 if mode == "skip_input" else 3, input_mode=mode, direction=direction,
             dtype=jnp.float64)
  _compare(spec)


@pytest.mark.parametrize("cls,layers,direction,mode", CONFIGS)
def test_one_step_matches_numpy(cls, layers, direction, mode):
  """One step (decoding), with and without lengths (one of them 0: the state is
  kept, the output 0)."""
  spec = cls(layers, 4, 4 if mode == "skip_input" else 3, input_mode=mode, direction=direction,
             dtype=jnp.float64)
  _compare(spec, T=1)
  _compare(spec, T=1, seq_lengths=np.array([1, 0, 1]))


@pytest.mark.parametrize("cls,direction", list(itertools.product(SPEC_CLASSES, ("unidirectional", "bidirectional"))))
@pytest.mark.parametrize("time_major", [True, False])
def test_matches_numpy_with_seq_lengths(cls, direction, time_major):
  spec = cls(2, 4, 3, direction=direction, dtype=jnp.float64)
  _compare(spec, T=6, B=4, seq_lengths=np.array([6, 3, 1, 0]), time_major=time_major)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_batch_major_matches_numpy(cls):
  _compare(cls(3, 5, 2, direction="bidirectional", dtype=jnp.float64), time_major=False)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_float32_matches_numpy(cls):
  _compare(cls(2, 8, 3, direction="bidirectional", dtype=jnp.float32), T=7, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(jnp.bfloat16, 3e-2), (jnp.float16, 3e-3)])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_half_precision_matches_numpy(cls, dtype, tol):
  spec = cls(2, 8, 3, direction="bidirectional", dtype=dtype)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, 6, 2)
  up = lambda a: None if a is None else np.asarray(a, np.float64)
  ref_y, ref_h, _ = numpy_rnn(spec.rnn_mode, 2, True, False, [up(w) for w in weights],
                              [up(b) for b in biases], up(x), up(h), up(c))
  y, h_out, _ = call(spec, x, h, c, params, is_training=False, implementation="xla")
  assert y.dtype == dtype and h_out.dtype == dtype
  np.testing.assert_allclose(np.asarray(y, np.float64), ref_y, atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(h_out, np.float64), ref_h, atol=tol, rtol=tol)


def test_seq_lengths_equal_running_each_sequence_alone():
  spec = jcr.CudnnLSTM(2, 3, 2, direction="bidirectional", dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 6, 3)
  lengths = np.array([2, 6, 4])
  y, hn, cn = spec(x, h, c, params, is_training=False, seq_lengths=lengths)
  for b, n in enumerate(lengths):
    yb, hb, cb = spec(x[:n, b:b + 1], h[:, b:b + 1], c[:, b:b + 1], params, is_training=False)
    np.testing.assert_allclose(y[:n, b], yb[:, 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(y[n:, b], 0.0)
    np.testing.assert_allclose(hn[:, b], hb[:, 0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cn[:, b], cb[:, 0], rtol=1e-12, atol=1e-12)


def test_seq_lengths_out_of_range_raise_where_known():
  spec = jcr.CudnnGRU(1, 3, 2, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, _ = random_inputs(spec, 4, 2)
  with pytest.raises(ValueError, match=r"seq_lengths must be in \[0, 4\].*got 9 for sequence 0"):
    spec(x, h, params, seq_lengths=np.array([9, 1]))
  with pytest.raises(ValueError, match=r"got -2 for sequence 1"):
    spec(x, h, params, seq_lengths=[3, -2])
  # Known under jit too: a NumPy array or list closed over (jnp.asarray makes
  # a tracer of it there, so the values are read from what was passed).
  with pytest.raises(ValueError, match=r"got 9 for sequence 0"):
    jax.jit(lambda: spec(x, h, params, seq_lengths=np.array([9, 1])))()
  with pytest.raises(ValueError, match=r"got -2 for sequence 1"):
    jax.jit(lambda: spec(x, h, params, seq_lengths=[3, -2]))()
  # Read before JAX narrows them: without x64, 2**32 + 1 would become 1.
  with jax.enable_x64(False):
    x32, h32 = np.float32(x), np.float32(h)
    spec32 = jcr.CudnnGRU(1, 3, 2)
    params32 = spec32.init_params(jax.random.key(0))
    with pytest.raises(ValueError, match=r"got 4294967297 for sequence 0"):
      spec32(x32, h32, params32, seq_lengths=np.array([2**32 + 1, 1]))


def test_traced_seq_lengths_out_of_range_are_clamped():
  spec = jcr.CudnnGRU(1, 3, 2, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, _ = random_inputs(spec, 4, 2)
  run = jax.jit(lambda lengths: spec(x, h, params, seq_lengths=lengths))
  y1, h1 = run(np.array([9, -2]))
  # The same compiled function on in-range lengths: equal to the bit. (An eager call
  # may round differently: under this jit, XLA folds the constant inputs' projection.)
  y2, h2 = run(np.array([4, 0]))
  np.testing.assert_array_equal(y1, y2)
  np.testing.assert_array_equal(h1, h2)
  np.testing.assert_array_equal(h2[:, 1], h[:, 1])  # length 0 keeps the initial state


def test_hand_computed_relu_rnn():
  spec = jcr.CudnnRNNRelu(1, 1, 1, dtype=jnp.float64)
  params = spec.canonical_to_params([np.array([[2.0]]), np.array([[0.5]])],
                                    [np.array([0.1]), np.array([-0.2])])
  x = np.array([1.0, -1.0, 3.0]).reshape(3, 1, 1)
  y, h = spec(x, np.full((1, 1, 1), 0.4), params)
  # h1 = relu(2 + .1 + .5*.4 - .2) = 2.1; h2 = relu(-2 + .1 + 1.05 - .2) = 0;
  # h3 = relu(6 + .1 + 0 - .2) = 5.9
  np.testing.assert_allclose(y.ravel(), [2.1, 0.0, 5.9], rtol=1e-12)
  np.testing.assert_allclose(h.ravel(), [5.9], rtol=1e-12)


def test_hand_computed_lstm():
  spec = jcr.CudnnLSTM(1, 1, 1, dtype=jnp.float64)
  zero = np.zeros((1, 1))
  # Only W_g = 1 and bR_f = 1; every other matrix and bias is zero.
  weights = [zero, zero, np.ones((1, 1)), zero] + [zero] * 4
  biases = [np.zeros(1)] * 5 + [np.ones(1)] + [np.zeros(1)] * 2
  params = spec.canonical_to_params(weights, biases)
  y, h, c = spec(np.full((1, 1, 1), 0.5), np.zeros((1, 1, 1)), np.full((1, 1, 1), 2.0), params)
  sig = lambda v: 1 / (1 + math.exp(-v))
  c1 = sig(1.0) * 2.0 + 0.5 * math.tanh(0.5)
  h1 = 0.5 * math.tanh(c1)
  np.testing.assert_allclose(c.ravel(), [c1], rtol=1e-12)
  np.testing.assert_allclose(h.ravel(), [h1], rtol=1e-12)
  np.testing.assert_allclose(y.ravel(), [h1], rtol=1e-12)


def test_hand_computed_gru():
  spec = jcr.CudnnGRU(1, 1, 1, dtype=jnp.float64)
  one, zero = np.ones((1, 1)), np.zeros((1, 1))
  # W_r = W_z = W_n = 1, R_n = 2, bR_n = 0.5, the rest zero; h0 = 0.3, x = 1.
  weights = [one, one, one, zero, zero, 2 * one]
  biases = [np.zeros(1)] * 5 + [np.full(1, 0.5)]
  params = spec.canonical_to_params(weights, biases)
  y, h = spec(np.ones((1, 1, 1)), np.full((1, 1, 1), 0.3), params)
  sig = lambda v: 1 / (1 + math.exp(-v))
  r = z = sig(1.0)
  n = math.tanh(1.0 + r * (2 * 0.3 + 0.5))
  np.testing.assert_allclose(h.ravel(), [(1 - z) * n + z * 0.3], rtol=1e-12)


def test_skip_input_adds_input_to_every_gate():
  # skip_input equals linear_input with identity input matrices.
  skip = jcr.CudnnLSTM(1, 3, 3, input_mode="skip_input", dtype=jnp.float64)
  linear = jcr.CudnnLSTM(1, 3, 3, input_mode="linear_input", dtype=jnp.float64)
  weights, biases = random_canonical(skip)
  x, h, c = random_inputs(skip, 4, 2)
  y1, h1, c1 = skip(x, h, c, skip.canonical_to_params(weights, biases))
  y2, h2, c2 = linear(x, h, c, linear.canonical_to_params([np.eye(3)] * 4 + weights, biases))
  np.testing.assert_allclose(y1, y2, rtol=1e-12)
  np.testing.assert_allclose(c1, c2, rtol=1e-12)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_none_states_are_zeros(cls):
  spec = cls(2, 3, 2, direction="bidirectional", dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, _, _ = random_inputs(spec, 4, 2)
  zeros = np.zeros((4, 2, 3))
  a = call(spec, x, None, None, params)
  b = call(spec, x, zeros, zeros if spec.has_cell_state else None, params)
  for u, v in zip(a, b):
    if u is not None:
      np.testing.assert_array_equal(u, v)
