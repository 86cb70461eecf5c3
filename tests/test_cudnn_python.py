"""Pure-Python parts of the cuDNN backend that run on any machine."""

import jax
import jax.numpy as jnp
import numpy as np

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn
from helpers import random_canonical


def test_layer_params_equal_single_layer_spec_buffers():
  spec = jcr.CudnnLSTM(3, 4, 4, input_mode="skip_input", direction="bidirectional",
                       dtype=jnp.float64)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  w_at, b_at = 0, 0
  for layer in range(3):
    single = jcr.CudnnLSTM(1, 4, spec.layer_input_size(layer),
                           input_mode="skip_input" if layer == 0 else "linear_input",
                           direction="bidirectional", dtype=jnp.float64)
    nw = len(single.params_to_canonical(single.init_params(jax.random.key(0)))[0])
    expected = single.canonical_to_params(weights[w_at:w_at + nw], biases[b_at:b_at + 16])
    np.testing.assert_array_equal(_cudnn._layer_params(spec, params, layer), expected)
    w_at, b_at = w_at + nw, b_at + 16


def test_config_attributes_have_exact_ffi_types():
  cfg = _cudnn.Config("gru", 2, 8, 4, True, False, True, False, True)
  attrs = cfg.attrs()
  assert attrs["cell_mode"] == 3 and attrs["cell_mode"].dtype == np.int64
  assert attrs["bidirectional"].dtype == np.bool_ and bool(attrs["batch_major"])
  assert cfg.num_states == 4


def test_availability_explains_itself():
  available, why = _cudnn.availability()
  assert available or why
