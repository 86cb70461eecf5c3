"""params_size, init_params and the canonical <-> opaque conversions."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_cudnn_rnn as jcr
from helpers import SPEC_CLASSES, canonical_shapes, random_canonical

CONFIGS = list(itertools.product(SPEC_CLASSES, (1, 3), ("unidirectional", "bidirectional"),
                                 ("linear_input", "skip_input")))


def _spec(cls, layers, direction, mode, dtype=jnp.float64):
  return cls(num_layers=layers, num_units=4, input_size=4 if mode == "skip_input" else 3,
             input_mode=mode, direction=direction, dtype=dtype)


def test_params_size_hand_computed():
  # LSTM, 1 layer, in=3, H=2: 4 gates * (2*3 + 2*2) matrices + 8 biases * 2.
  assert jcr.CudnnLSTM(1, 2, 3).params_size() == 4 * (6 + 4) + 16
  # GRU, 2 layers bidirectional, in=5, H=3: layer0 per dir 3*(15+9)+6*3 = 90;
  # layer1 input is 6: per dir 3*(18+9)+18 = 99; both dirs.
  assert jcr.CudnnGRU(2, 3, 5, direction="bidirectional").params_size() == 2 * (90 + 99)
  # RNN skip_input, 1 layer, H=4: only R (16) and two biases (8).
  assert jcr.CudnnRNNTanh(1, 4, 4, input_mode="skip_input").params_size() == 24


@pytest.mark.parametrize("cls,layers,direction,mode", CONFIGS)
def test_round_trips(cls, layers, direction, mode):
  spec = _spec(cls, layers, direction, mode)
  w_shapes, b_shapes = canonical_shapes(spec)
  assert spec.params_size() == sum(map(np.prod, w_shapes)) + sum(map(np.prod, b_shapes))
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  assert params.shape == (spec.params_size(),) and params.dtype == spec.dtype
  w2, b2 = spec.params_to_canonical(params)
  assert [w.shape for w in w2] == w_shapes and [b.shape for b in b2] == b_shapes
  for a, b in zip(weights + biases, w2 + b2):
    np.testing.assert_array_equal(a, b)
  fresh = spec.init_params(jax.random.key(3))
  np.testing.assert_array_equal(spec.canonical_to_params(*spec.params_to_canonical(fresh)), fresh)


def test_opaque_layout_is_matrices_then_biases():
  # Hand-placed values: the opaque buffer is every matrix (pseudo-layer by
  # pseudo-layer, linear-layer ID order, row major), then every bias.
  spec = jcr.CudnnRNNRelu(1, 1, 2, direction="bidirectional", dtype=jnp.float64)
  weights = [np.array([[1., 2.]]), np.array([[3.]]), np.array([[4., 5.]]), np.array([[6.]])]
  biases = [np.array([7.]), np.array([8.]), np.array([9.]), np.array([10.])]
  np.testing.assert_array_equal(spec.canonical_to_params(weights, biases), np.arange(1., 11.))


def test_conversions_are_jittable_and_differentiable():
  spec = jcr.CudnnGRU(2, 3, 2, direction="bidirectional", dtype=jnp.float64)
  weights, biases = random_canonical(spec)
  to_params = jax.jit(spec.canonical_to_params)
  np.testing.assert_array_equal(to_params(weights, biases), spec.canonical_to_params(weights, biases))
  check_grads(lambda w, b: spec.canonical_to_params(w, b), (weights, biases), order=2)
  params = spec.canonical_to_params(weights, biases)
  check_grads(lambda p: spec.params_to_canonical(p), (params,), order=2)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_init_params_default_bound_and_dtype(cls):
  spec = cls(2, 16, 5, dtype=jnp.bfloat16)
  params = spec.init_params(jax.random.key(0))
  assert params.shape == (spec.params_size(),) and params.dtype == jnp.bfloat16
  bound = 1 / np.sqrt(16)
  values = np.asarray(params, np.float32)
  assert np.all(np.abs(values) <= bound + 1e-3)
  assert values.max() > 0.9 * bound and values.min() < -0.9 * bound
  assert not np.array_equal(values, np.asarray(spec.init_params(jax.random.key(1)), np.float32))


def test_init_params_custom_initializers():
  spec = jcr.CudnnLSTM(2, 4, 3, direction="bidirectional")
  params = spec.init_params(jax.random.key(0), weight_initializer=jax.nn.initializers.orthogonal(),
                            bias_initializer=jax.nn.initializers.constant(0.25))
  weights, biases = spec.params_to_canonical(params)
  for b in biases:
    np.testing.assert_array_equal(b, 0.25)
  square = [w for w in weights if w.shape == (4, 4)]
  assert square
  for w in square:
    np.testing.assert_allclose(w @ w.T, np.eye(4), atol=1e-5)


def test_init_params_initializer_errors_name_the_initializer():
  spec = jcr.CudnnGRU(1, 4, 3)
  key = jax.random.key(0)
  with pytest.raises(ValueError, match=r"^weight_initializer returned shape \(2, 2\) when asked "
                                       r"for \(4, 3\)$"):
    spec.init_params(key, weight_initializer=lambda k, shape, dtype: jnp.zeros((2, 2), dtype))
  with pytest.raises(ValueError,
                     match=r"^bias_initializer returned shape \(\) when asked for \(4,\)$"):
    spec.init_params(key, bias_initializer=lambda k, shape, dtype: 0.0)
  with pytest.raises(TypeError, match=r"^bias_initializer must be a callable init\(key, shape, "
                                      r"dtype\), as jax.nn.initializers makes, got str$"):
    spec.init_params(key, bias_initializer="zeros")
  with pytest.raises(TypeError, match=r"^weight_initializer's result must have a float, integer "
                                      r"or bool dtype, got complex64$"):
    spec.init_params(key, weight_initializer=lambda k, shape, dtype: jnp.ones(shape, jnp.complex64))
  # Another dtype is cast to the spec's, as canonical_to_params does.
  params = spec.init_params(key,
                            weight_initializer=lambda k, shape, dtype: jnp.ones(shape, jnp.float16))
  assert params.dtype == spec.dtype
  np.testing.assert_array_equal(spec.params_to_canonical(params)[0][0], np.ones((4, 3)))


def test_conversion_errors():
  spec = jcr.CudnnLSTM(1, 2, 3, dtype=jnp.float32)
  weights, biases = random_canonical(spec)
  with pytest.raises(ValueError, match="weights must hold 8"):
    spec.canonical_to_params(weights[:-1], biases)
  with pytest.raises(ValueError, match=r"biases\[2\] must have shape \(2,\)"):
    spec.canonical_to_params(weights, biases[:2] + [np.zeros(3)] + biases[3:])
  with pytest.raises(TypeError, match="weights must be a list"):
    spec.canonical_to_params(np.zeros(3), biases)
  with pytest.raises(ValueError, match=r"params must have shape \(56,\)"):
    spec.params_to_canonical(jnp.zeros(55, jnp.float32))
  with pytest.raises(TypeError, match="params must have dtype float32, got float64"):
    spec.params_to_canonical(jnp.zeros(56, jnp.float64))


@pytest.mark.parametrize("key, got", [
    (0, "int"), (None, "NoneType"),
    (np.zeros(2, np.int32), r"an array of dtype int32 and shape \(2,\)"),
    (jnp.zeros(2, jnp.float32), r"an array of dtype float32 and shape \(2,\)"),
    (np.zeros(3, np.uint32), r"an array of dtype uint32 and shape \(3,\)")])
def test_init_params_needs_a_prng_key(key, got):
  with pytest.raises(TypeError, match=r"^key must be a PRNG key \(jax.random.key\(seed\), or a raw "
                                      r"uint32\[2\] of the default PRNG, threefry2x32\), "
                                      f"got {got}$"):
    jcr.CudnnGRU(1, 4, 3).init_params(key)


def test_init_params_takes_one_key_not_a_batch():
  with pytest.raises(ValueError, match=r"^key must be a single PRNG key, got shape \(2,\)$"):
    jcr.CudnnGRU(1, 4, 3).init_params(jax.random.split(jax.random.key(0), 2))


def test_init_params_takes_raw_and_typed_keys_alike():
  spec = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float32)
  np.testing.assert_array_equal(spec.init_params(jax.random.PRNGKey(7)),
                                spec.init_params(jax.random.key(7)))
  batched = jax.vmap(spec.init_params)(jax.random.split(jax.random.key(7), 2))
  assert batched.shape == (2, spec.params_size()) and not np.array_equal(*batched)


def test_float64_spec_without_x64_makes_no_float32_buffer():
  spec = jcr.CudnnLSTM(1, 2, 3, dtype=jnp.float64)
  weights, biases = random_canonical(spec)
  with jax.enable_x64(False):
    with pytest.raises(TypeError, match=r"init_params would make a float32 buffer .*jax_enable_x64"):
      spec.init_params(jax.random.key(0))
    with pytest.raises(TypeError, match=r"canonical_to_params would make a float32 .*jax_enable_x64"):
      spec.canonical_to_params(weights, biases)
  assert spec.init_params(jax.random.key(0)).dtype == jnp.float64
