"""Every bad input is a clear ValueError/TypeError at trace time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr

LSTM = jcr.CudnnLSTM(2, 4, 3, direction="bidirectional", dtype=jnp.float32)
GRU = jcr.CudnnGRU(2, 4, 3, dtype=jnp.float32)


def _good(spec):
  params = spec.init_params(jax.random.key(0))
  x = jnp.ones((5, 2, 3), jnp.float32)
  h = jnp.zeros((spec.num_layers * spec.num_dirs, 2, 4), jnp.float32)
  return x, h, params


def _lstm(**over):
  x, h, params = _good(LSTM)
  args = dict(input_data=x, input_h=h, input_c=h, params=params) | over
  return LSTM(args.pop("input_data"), args.pop("input_h"), args.pop("input_c"),
              args.pop("params"), **args)


@pytest.mark.parametrize("over,exc,message", [
    (dict(input_data=jnp.ones((5, 3))), ValueError, r"input_data must have rank 3 \[T, B, input_size\], got shape \(5, 3\)"),
    (dict(input_data=jnp.ones((5, 2, 4))), ValueError, r"last dimension must be input_size=3, got shape \(5, 2, 4\)"),
    (dict(input_data=jnp.ones((0, 2, 3))), ValueError, "at least one step"),
    (dict(input_data=jnp.ones((5, 2, 3), jnp.float64)), TypeError, "input_data must have dtype float32 .* got float64"),
    (dict(input_data="abc"), TypeError, "input_data must be an array, got str"),
    (dict(input_h=jnp.zeros((2, 2, 4))), ValueError, r"input_h must have shape \(4, 2, 4\) .* got \(2, 2, 4\)"),
    (dict(input_h=jnp.zeros((4, 3, 4))), ValueError, r"input_h must have shape \(4, 2, 4\)"),
    (dict(input_c=jnp.zeros((2, 4))), ValueError, r"^input_c must have shape \(4, 2, 4\) \(num_layers \* num_dirs, batch, num_units\), got \(2, 4\); unlike flax.linen.RNN's cells, the states have a leading axis of num_layers \* num_dirs even for one layer$"),
    (dict(input_h=jnp.zeros((4, 2, 4), jnp.float16)), TypeError, "input_h must have dtype float32"),
    # an LSTM's (h, c) carry, as Flax's cells hold one, given as input_h
    (dict(input_h=(jnp.zeros((4, 2, 4)), jnp.zeros((4, 2, 4))), input_c=None), ValueError,
     r"^input_h must have shape \(4, 2, 4\) \(num_layers \* num_dirs, batch, num_units\), got "
     r"\(2, 4, 2, 4\); it was given a pair of states: CudnnLSTM takes them apart, input_h then "
     r"input_c$"),
    (dict(input_c=[jnp.zeros((4, 2, 4)), jnp.zeros((4, 2, 4))]), ValueError,
     r"^input_c must have shape .* got \(2, 4, 2, 4\); it was given a pair of states"),
    # states or lengths whose batch is the input's steps: the layout is named
    (dict(input_h=jnp.zeros((4, 5, 4))), ValueError,
     r"^input_h must have shape \(4, 2, 4\) .* got \(4, 5, 4\); read time-major \(\[T, B, "
     r"\.\.\.\]\), the shape of input_data gives T=5 and B=2: batch-major data needs "
     r"time_major=False$"),
    (dict(seq_lengths=jnp.ones((5,), jnp.int32)), ValueError,
     r"^seq_lengths must have shape \(2,\) \(batch,\), got \(5,\); read time-major \(\[T, B, "
     r"\.\.\.\]\), the shape of input_data gives T=5 and B=2: batch-major data needs "
     r"time_major=False$"),
    (dict(input_data=jnp.ones((2, 5, 3), jnp.float32), input_c=jnp.zeros((4, 5, 4)),
          time_major=False),
     ValueError, r"^input_c must have shape \(4, 2, 4\) .* got \(4, 5, 4\); read batch-major "
     r"\(\[B, T, \.\.\.\], time_major=False\), the shape of input_data gives B=2 and T=5: "
     r"time-major data needs time_major=True$"),
    # a stacked array of that shape is no pair: no such hint
    (dict(input_h=jnp.zeros((2, 4, 2, 4))), ValueError,
     r"^input_h must have shape \(4, 2, 4\) \(num_layers \* num_dirs, batch, num_units\), got "
     r"\(2, 4, 2, 4\)$"),
    (dict(input_c=jnp.zeros((4, 2, 5))), ValueError, r"input_c must have shape \(4, 2, 4\) .* got \(4, 2, 5\)"),
    (dict(params=jnp.zeros(10, jnp.float32)), ValueError, r"params must have shape \(\d+,\)"),
    (dict(params=jnp.zeros(LSTM.params_size(), jnp.bfloat16)), TypeError, "params must have dtype float32, got bfloat16"),
    (dict(params=[1.0, 2.0]), TypeError, "params must be an array"),
    (dict(params=LSTM.params_to_canonical(jnp.zeros(LSTM.params_size(), jnp.float32))), TypeError,
     r"^params must be an array, got tuple: the opaque buffer, a 1-D array of params_size\(\) = "
     r"\d+ elements \(spec.init_params\(key\) makes one; spec.canonical_to_params\(weights, "
     r"biases\) packs canonical weights and biases into one\)$"),
    (dict(params={"params": {"opaque_params": jnp.zeros(LSTM.params_size(), jnp.float32)}}),
     TypeError, r"^params must be an array, got dict: the opaque buffer, .*; a Flax module's "
     r"variables hold it at \['params'\]\['opaque_params'\]$"),
    (dict(params=jax.random.split(jax.random.key(0), LSTM.params_size())), TypeError,
     r"^params must have dtype float32, got key<fry>$"),
    (dict(input_data=np.full((5, 2, 3), None)), TypeError,
     r"^input_data must have dtype float32 \(the spec's dtype\), got object$"),
    (dict(input_c=np.full((4, 2, 4), None)), TypeError,
     r"^input_c must have dtype float32 \(the spec's dtype\), got object$"),
    (dict(seq_lengths=np.full(2, None)), TypeError, r"^seq_lengths must have an integer dtype, got object$"),
    (dict(seq_lengths=[[5], [5]]), ValueError, r"seq_lengths must have shape \(2,\)"),
    (dict(seq_lengths=jnp.ones((3,), jnp.int32)), ValueError, r"seq_lengths must have shape \(2,\)"),
    (dict(seq_lengths=jnp.ones((2,), jnp.float32)), TypeError, "seq_lengths must have an integer dtype, got float32"),
    (dict(implementation="triton"), ValueError, "implementation must be one of"),
    (dict(is_training="yes"), TypeError, "is_training must be a Python bool"),
    (dict(time_major=1), TypeError, "time_major must be a Python bool"),
])
def test_bad_lstm_input(over, exc, message):
  with pytest.raises(exc, match=message):
    _lstm(**over)


def test_batch_major_rank_message_names_layout():
  with pytest.raises(ValueError, match=r"\[B, T, input_size\]"):
    _lstm(input_data=jnp.ones((2, 3)), time_major=False)


def test_errors_raise_at_trace_time_under_jit():
  x, h, params = _good(LSTM)
  with pytest.raises(ValueError, match="input_h must have shape"):
    jax.jit(lambda x, h, p: LSTM(x, h, h, p))(x, h[:2], params)


def test_input_c_given_to_gru():
  x, h, params = _good(GRU)
  with pytest.raises(TypeError, match="has no input_c"):
    GRU(x, h, h, params)  # input_c passed positionally
  with pytest.raises(TypeError, match="input_c"):
    GRU(x, h, params, input_c=h)


def test_input_c_missing_for_lstm():
  x, h, params = _good(LSTM)
  with pytest.raises(TypeError, match="params"):
    LSTM(x, h, params)  # pylint: disable=no-value-for-parameter


def test_dropout_needs_a_key_when_training():
  spec = jcr.CudnnGRU(2, 4, 3, dropout=0.5)
  x, h, params = _good(spec)
  with pytest.raises(ValueError, match="dropout_key is required"):
    spec(x, h, params, is_training=True)
  with pytest.raises(TypeError, match=r"^dropout_key must be a PRNG key \(jax.random.key\(seed\), "
                                      r"or a raw uint32\[2\] of the default PRNG, threefry2x32\), "
                                      r"got int$"):
    spec(x, h, params, is_training=True, dropout_key=3)
  with pytest.raises(ValueError, match=r"^dropout_key must be a single PRNG key, got shape \(2,\)$"):
    spec(x, h, params, is_training=True, dropout_key=jax.random.split(jax.random.key(0), 2))
  y, _ = spec(x, h, params, is_training=False)  # inference needs no key
  assert y.shape == (5, 2, 4)


def test_cudnn_unavailable_is_a_clear_error():
  if jax.default_backend() == "gpu":
    pytest.skip("a GPU is present")
  x, h, params = _good(GRU)
  with pytest.raises(RuntimeError, match="implementation='cudnn' cannot run here"):
    GRU(x, h, params, implementation="cudnn")


def test_float64_spec_without_x64_says_how_to_enable_it():
  spec = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  with jax.enable_x64(False):
    x = jnp.ones((5, 2, 3))  # float32: JAX cannot make float64 here
    params = jnp.zeros(spec.params_size(), jnp.float32)
    with pytest.raises(TypeError, match=r"must have dtype float64 .* got float32 .*jax_enable_x64"):
      spec(x, None, params)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_nested_lists_take_the_spec_dtype(dtype):
  # A list has no dtype of its own: under x64 (on in these tests) jnp.asarray
  # would make it float64, and for a bfloat16 model float32 without x64;
  # either was refused. It takes the spec's, and gives the array's answer.
  spec = jcr.CudnnGRU(1, 4, 3, dtype=dtype)
  params = spec.init_params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (5, 2, 3)).astype(dtype)
  h = jax.random.normal(jax.random.key(2), (1, 2, 4)).astype(dtype)
  want_y, want_h = spec(x, h, params)
  x_list = np.asarray(x.astype(jnp.float32)).tolist()  # exact: each value is a dtype value
  h_list = np.asarray(h.astype(jnp.float32)).tolist()
  y, h_out = spec(x_list, h_list, params)
  assert y.dtype == h_out.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y, np.float32))
  np.testing.assert_array_equal(np.asarray(h_out, np.float32), np.asarray(want_h, np.float32))
  with pytest.raises(TypeError, match="input_data must have dtype"):  # an array keeps its own
    spec(np.asarray(x_list), h, params)


@pytest.mark.parametrize("value,detail", [
    ([[[1.0, 2.0, 3.0]], [[1.0, 2.0]]], "inhomogeneous"),
    ([[["a", "b", "c"]]], "could not convert string"),
    ([[[1j, 2.0, 3.0]]], "complex"),
])
def test_a_list_that_is_no_array_names_the_argument(value, detail):
  with pytest.raises(TypeError, match=r"^input_data must be an array or a nested list of real "
                                      rf"numbers of one shape; converting the list failed: .*{detail}"):
    _lstm(input_data=value)
  with pytest.raises(TypeError, match=r"^input_h must be an array or a nested list"):
    _lstm(input_h=value)


def test_a_bad_dropout_key_is_an_error_even_where_no_dropout_runs():
  # It would be used by another call (training, or a model with dropout), so
  # it is refused where it is passed rather than where it first matters.
  for spec, training in ((GRU, True), (jcr.CudnnGRU(2, 4, 3, dropout=0.5), False)):
    x, h, params = _good(spec)
    with pytest.raises(TypeError, match=r"^dropout_key must be a PRNG key"):
      spec(x, h, params, is_training=training, dropout_key=3)
    with pytest.raises(ValueError, match=r"^dropout_key must be a single PRNG key, got shape \(2,\)"):
      spec(x, h, params, is_training=training, dropout_key=jax.random.split(jax.random.key(0)))
    y, _ = spec(x, h, params, is_training=training, dropout_key=jax.random.key(0))
    np.testing.assert_array_equal(y, spec(x, h, params, is_training=False)[0])
