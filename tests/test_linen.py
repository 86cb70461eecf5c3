"""Flax linen adapters: equal to the functional API, to Flax cells, and trainable."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import flax.linen as nn

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import interop, linen


@pytest.mark.parametrize("module,cls", [
    (linen.LSTM, jcr.CudnnLSTM), (linen.GRU, jcr.CudnnGRU),
    (lambda **k: linen.SimpleRNN(activation="relu", **k), jcr.CudnnRNNRelu)])
def test_module_equals_functional_api(module, cls):
  m = module(features=6, num_layers=2, bidirectional=True, return_carry=True,
             param_dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(0), (3, 5, 4), jnp.float64)  # batch major
  variables = m.init(jax.random.key(1), x)
  buffer = variables["params"]["opaque_params"]
  spec = cls(2, 6, 4, direction="bidirectional", dtype=jnp.float64)
  assert buffer.shape == (spec.params_size(),)
  carry, y = m.apply(variables, x, seq_lengths=jnp.array([5, 2, 3]))
  ref = spec._run(x, None, None, buffer, False, seq_lengths=jnp.array([5, 2, 3]),
                  time_major=False)
  np.testing.assert_allclose(y, ref[0], rtol=1e-12)
  h = carry[0] if spec.has_cell_state else carry
  np.testing.assert_allclose(h, ref[1], rtol=1e-12)
  # The carry feeds back in.
  y2 = m.apply(variables, x, carry)[1]
  ref2 = spec._run(x, *(carry if spec.has_cell_state else (carry, None)), buffer, False,
                   time_major=False)
  np.testing.assert_allclose(y2, ref2[0], rtol=1e-12)


def test_lstm_equals_flax_cells():
  m = linen.LSTM(features=5, num_layers=2, param_dtype=jnp.float64)
  x = jax.random.normal(jax.random.key(0), (2, 7, 3), jnp.float64)
  variables = m.init(jax.random.key(1), x)
  spec = m.spec(3)
  cells = interop.to_flax_linen_cells(spec, variables["params"]["opaque_params"])
  h = x
  for layer in range(2):
    h = nn.RNN(nn.OptimizedLSTMCell(5, param_dtype=jnp.float64)).apply(
        {"params": {"cell": cells[layer][0]}}, h)
  np.testing.assert_allclose(m.apply(variables, x), h, rtol=1e-10, atol=1e-12)


def test_time_major_and_dtype():
  m = linen.GRU(features=4, time_major=True, dtype=jnp.bfloat16)
  x = jnp.ones((6, 2, 3), jnp.float32)
  variables = m.init(jax.random.key(0), x)
  assert variables["params"]["opaque_params"].dtype == jnp.float32
  y = m.apply(variables, x)
  assert y.shape == (6, 2, 4) and y.dtype == jnp.bfloat16
  # the bfloat16 spec's call on the parameters rounded to bfloat16
  params = variables["params"]["opaque_params"]
  expected = m.spec(3, jnp.bfloat16)(x.astype(jnp.bfloat16), None,
                                     params.astype(jnp.bfloat16), is_training=False)[0]
  np.testing.assert_array_equal(y, expected)
  # batch-major gives the same, transposed; the parameter gradient stays float32
  batch_major = m.clone(time_major=False)
  np.testing.assert_array_equal(batch_major.apply(variables, jnp.swapaxes(x, 0, 1)),
                                jnp.swapaxes(y, 0, 1))
  g = jax.grad(lambda v: jnp.sum(m.apply(v, x).astype(jnp.float32)))(variables)
  assert g["params"]["opaque_params"].dtype == jnp.float32
  assert float(jnp.abs(g["params"]["opaque_params"]).max()) > 0


def test_dropout_uses_rng_stream_and_deterministic_flag():
  m = linen.LSTM(features=8, num_layers=3, dropout_rate=0.5)
  x = jax.random.normal(jax.random.key(0), (2, 5, 3))
  variables = m.init(jax.random.key(1), x, deterministic=True)
  a = m.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(2)})
  b = m.apply(variables, x, deterministic=False, rngs={"dropout": jax.random.key(3)})
  c = m.apply(variables, x, deterministic=True)
  d = m.apply(variables, x, deterministic=True)
  assert not np.allclose(a, b)
  np.testing.assert_array_equal(c, d)
  with pytest.raises(Exception):
    m.apply(variables, x)  # deterministic must be given somewhere


def test_training_steps_lower_the_loss():
  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(1)(linen.LSTM(16, num_layers=2)(x)[:, -1])

  # Task: predict the sum of a short random sequence.
  x = jax.random.normal(jax.random.key(0), (64, 8, 1))
  y = x.sum(axis=(1, 2))[:, None]
  model = Model()
  params = model.init(jax.random.key(1), x)
  opt = optax.adam(1e-2)
  state = opt.init(params)

  @jax.jit
  def step(params, state):
    loss, g = jax.value_and_grad(lambda p: jnp.mean((model.apply(p, x) - y) ** 2))(params)
    updates, state = opt.update(g, state)
    return optax.apply_updates(params, updates), state, loss

  losses = []
  for _ in range(60):
    params, state, loss = step(params, state)
    losses.append(float(loss))
  assert losses[-1] < 0.3 * losses[0], losses[::10]


def test_orbax_checkpoint_of_train_state(tmp_path):
  import orbax.checkpoint as ocp
  m = linen.GRU(features=4, num_layers=2)
  x = jnp.ones((2, 3, 5))
  params = m.init(jax.random.key(0), x)
  opt = optax.adam(1e-3)
  state = {"params": params, "opt": opt.init(params), "step": 3}
  with ocp.CheckpointManager(tmp_path) as manager:
    manager.save(3, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    restored = manager.restore(3, args=ocp.args.StandardRestore(state))
  np.testing.assert_array_equal(restored["params"]["params"]["opaque_params"], params["params"]["opaque_params"])
  np.testing.assert_array_equal(m.apply(restored["params"], x), m.apply(params, x))


def test_bad_activation():
  with pytest.raises(ValueError, match="activation must be"):
    linen.SimpleRNN(4, activation="gelu").init(jax.random.key(0), jnp.ones((1, 2, 3)))


def test_lstm_carry_must_be_a_pair():
  m = linen.LSTM(4)
  x = jnp.ones((2, 3, 5), jnp.float32)
  variables = m.init(jax.random.key(0), x)
  h = jnp.zeros((1, 2, 4), jnp.float32)
  with pytest.raises(TypeError, match=r"initial_carry of an LSTM must be a pair \(h, c\).*"
                                      r"got an array of shape \(1, 2, 4\)"):
    m.apply(variables, x, h)
  with pytest.raises(TypeError, match="got a tuple of 3"):
    m.apply(variables, x, (h, h, h))
  c = jnp.full((1, 2, 4), 0.5, jnp.float32)
  _, outputs = m.clone(return_carry=True).apply(variables, x, (h, c))
  expected = m.spec(5)(jnp.swapaxes(x, 0, 1), h, c, variables["params"]["opaque_params"])[0]
  np.testing.assert_allclose(outputs, jnp.swapaxes(expected, 0, 1), rtol=1e-6)


def test_carry_shapes_are_checked_in_the_modules_terms():
  x = jnp.ones((2, 3, 5), jnp.float32)  # batch-major: batch 2
  gru = linen.GRU(4, num_layers=2, bidirectional=True)
  variables = gru.init(jax.random.key(0), x)
  wrong = r"^initial_carry must have shape \(4, 2, 4\) .*got "
  with pytest.raises(ValueError, match=wrong + r"\(4, 5, 4\)($|\n)"):
    gru.apply(variables, x, jnp.zeros((4, 5, 4)))
  # a carry whose batch is the inputs' steps: the layout is named
  with pytest.raises(ValueError, match=wrong + r"\(4, 3, 4\); read batch-major \(\[B, T, \.\.\.\], "
                     r"time_major=False\), the shape of inputs gives B=2 and T=3: time-major "
                     r"data needs time_major=True($|\n)"):
    gru.apply(variables, x, jnp.zeros((4, 3, 4)))
  lstm = linen.LSTM(4, time_major=True)  # time-major: batch 3
  variables = lstm.init(jax.random.key(0), x)
  good = jnp.zeros((1, 3, 4))
  with pytest.raises(ValueError, match=r"^initial_carry\[1\] \(c\) must have shape \(1, 3, 4\) "
                                       r".*got \(3, 4\); unlike flax.linen.RNN's cells"):
    lstm.apply(variables, x, (good, jnp.zeros((3, 4))))
  carry, _ = lstm.clone(return_carry=True).apply(variables, x, (good, good + 0.5))
  assert [a.shape for a in carry] == [(1, 3, 4)] * 2


@pytest.mark.parametrize("module,made_for,given", [
    (lambda: linen.LSTM(features=4), 3, 6),
    (lambda: linen.GRU(features=4, num_layers=2, bidirectional=True), 6, 1),
    (lambda: linen.SimpleRNN(features=4, input_mode="auto_select"), 3, 4),  # skip_input at 4
    (lambda: linen.SimpleRNN(features=4, input_mode="auto_select"), 4, 3)])
def test_inputs_of_another_width_than_the_params_name_both(module, made_for, given):
  m = module()
  variables = m.init(jax.random.key(0), jnp.ones((2, 5, made_for)))
  size = variables["params"]["opaque_params"].size
  needed = m.spec(given).params_size()
  message = (rf"^inputs have input_size {given} \(the last axis of shape \(2, 5, {given}\)\), "
             rf"but this module's opaque_params \({size} elements\) were made for input_size "
             rf"{made_for}; input_size {given} needs {needed}")
  for apply in (m.apply, jax.jit(m.apply)):
    with pytest.raises(ValueError, match=message):
      apply(variables, jnp.ones((2, 5, given)))
  foreign = {"params": {"opaque_params": jnp.zeros(size + 1)}}
  foreign_message = (r"\(%d elements\) fit this module at no input_size \(made for another "
                     r"features, num_layers, bidirectional or cell\?\)" % (size + 1))
  with pytest.raises(ValueError, match=foreign_message):
    m.apply(foreign, jnp.ones((2, 5, made_for)))
  y = m.apply(variables, jnp.ones((2, 5, made_for)))
  assert y.shape == (2, 5, m.spec(made_for).output_size)


def test_initializer_errors_name_kernel_init_and_bias_init():
  x = jnp.ones((2, 3, 3))
  with pytest.raises(TypeError, match=r"^kernel_init must be a callable init\(key, shape, dtype\)"):
    linen.GRU(features=4, kernel_init="glorot").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=r"^bias_init returned shape \(1,\) when asked for \(4,\)"):
    linen.GRU(features=4, bias_init=lambda k, shape, dtype: jnp.zeros((1,), dtype)).init(
        jax.random.key(0), x)


def test_inputs_are_arrays_of_rank_3_in_the_modules_terms():
  m = linen.GRU(features=3, time_major=True)
  variables = m.init(jax.random.key(0), jnp.ones((2, 1, 2)))
  with pytest.raises(ValueError, match=r"^inputs must have rank 3 \[T, B, features\] "
                                       r"\(time_major=True\), got shape \(\)"):
    m.apply(variables, 5.0)
  with pytest.raises(TypeError, match=r"^inputs must be an array, got str"):
    m.apply(variables, "abc")
  nested = [[[1.0, 2.0]], [[0.5, -1.0]]]  # a list, as jnp.asarray makes it
  np.testing.assert_array_equal(m.apply(variables, nested),
                                m.apply(variables, jnp.asarray(nested)))


def test_inputs_and_carry_of_no_real_dtype_name_the_argument():
  # The modules cast what they are given (as Flax's do), but only from a real
  # dtype: complex lost its imaginary part and an object array became NaN, silently.
  m = linen.LSTM(features=4, return_carry=True)
  x = jnp.ones((2, 3, 5), jnp.float32)
  variables = m.init(jax.random.key(0), x)
  h = np.zeros((1, 2, 4), np.float32)
  for apply in (m.apply, jax.jit(m.apply)):
    with pytest.raises(TypeError, match=r"^initial_carry\[0\] \(h\) must have a float, integer or "
                                        r"bool dtype, got complex64"):
      apply(variables, x, (h.astype(np.complex64), h))
    if apply is m.apply:  # (jit's own arguments cannot be object arrays)
      with pytest.raises(TypeError, match=r"^initial_carry\[1\] \(c\) must have a float, integer "
                                          r"or bool dtype, got object$"):
        apply(variables, x, (h, np.full(h.shape, None)))
    with pytest.raises(TypeError, match=r"^inputs must have a float, integer or bool dtype, got "
                                        r"key<fry>"):
      apply(variables, jax.random.split(jax.random.key(0), 30).reshape(2, 3, 5))
  # What is real is cast, as before: integer inputs and a float64 carry.
  carry, y = m.apply(variables, x.astype(jnp.int32), (h.astype(np.float64), h))
  want_carry, want_y = m.apply(variables, x, (h, h))
  np.testing.assert_array_equal(y, want_y)
  np.testing.assert_array_equal(carry[1], want_carry[1])


@pytest.mark.parametrize("attributes,exc,message", [
    (dict(features=0), ValueError, r"^features must be a positive int, got 0"),
    (dict(dropout_rate=1.5, num_layers=2), ValueError, r"^dropout_rate must be in \[0, 1\), got 1.5"),
    (dict(dropout_rate="a"), TypeError, r"^dropout_rate must be a float in \[0, 1\), got 'a'"),
    (dict(input_mode="skip_input"), ValueError,
     r"^input_mode='skip_input' needs the inputs' features == features, got 3 and 4"),
    (dict(bidirectional="yes"), TypeError, r"^bidirectional must be a bool, got 'yes'"),
    (dict(return_carry=1), TypeError, r"^return_carry must be a bool, got 1"),
    (dict(param_dtype=jnp.int32), TypeError, r"^param_dtype must be one of \[.*\], got int32"),
    (dict(dtype=jnp.complex64), TypeError, r"^dtype must be one of \[.*\], got complex64"),
])
def test_attributes_are_checked_in_the_modules_terms(attributes, exc, message):
  # The spec's own errors said num_units, dropout, input_size or dtype; "a" for
  # dropout_rate was Python's "'>' not supported", "yes" was taken as True.
  m = linen.GRU(**(dict(features=4) | attributes))
  with pytest.raises(exc, match=message):
    m.init(jax.random.key(0), jnp.ones((2, 5, 3)))
