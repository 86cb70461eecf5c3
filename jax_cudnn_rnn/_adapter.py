"""What the Flax linen and nnx adapters share: building the spec and running it."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _dropout, _ops, _params, _spec

MODE_CLASSES = {"lstm": jcr.CudnnLSTM, "gru": jcr.CudnnGRU, "rnn_tanh": jcr.CudnnRNNTanh,
                "rnn_relu": jcr.CudnnRNNRelu}


def simple_rnn_mode(activation: str) -> str:
  if activation not in ("tanh", "relu"):
    raise ValueError(f"activation must be 'tanh' or 'relu', got {activation!r}")
  return f"rnn_{activation}"


def make_spec(rnn_mode: str, *, features: int, num_layers: int, input_size: int,
              input_mode: str, bidirectional: bool, dtype: Any, dropout_rate: float,
              input_name: str, dtype_name: str = "param_dtype"):
  """The spec of a module, its arguments checked first in the module's terms
  (the spec's own errors would say num_units, dropout, input_size or dtype):
  `input_name` is what the module calls the input's width, `dtype_name` the
  argument `dtype` came from."""
  _spec.check_positive_int("features", features)
  _spec.check_positive_int("num_layers", num_layers)
  _dropout.check_rate("dropout_rate", dropout_rate)
  _spec.check_bool("bidirectional", bidirectional)
  _spec.check_dtype(dtype, dtype_name)
  _spec.check_positive_int(input_name, input_size)
  if input_mode == "skip_input" and input_size != features:
    raise ValueError(f"input_mode='skip_input' needs {input_name} == features, got "
                     f"{input_size} and {features}")
  return MODE_CLASSES[rnn_mode](
      num_layers=num_layers, num_units=features, input_size=input_size, input_mode=input_mode,
      direction="bidirectional" if bidirectional else "unidirectional", dtype=dtype,
      dropout=dropout_rate)


def _real_array(name: str, value, dtype=None):
  """`value` as an array, cast to `dtype` when given, as Flax's modules cast
  what they are given; but only from a real dtype (`_params.as_array`'s `real`)."""
  array = _ops._as_array(name, value, dtype, real=True)
  return array if dtype is None else array.astype(dtype)


def as_inputs(inputs, time_major: bool):
  """The modules' `inputs` as an array of rank 3, or an error in their terms."""
  inputs = _real_array("inputs", inputs)
  if inputs.ndim != 3:
    layout = "[T, B, features]" if time_major else "[B, T, features]"
    raise ValueError(f"inputs must have rank 3 {layout} (time_major={time_major}), "
                     f"got shape {tuple(inputs.shape)}")
  return inputs


def init_params(spec, key, kernel_init, bias_init):
  """A fresh buffer of `spec`, its errors naming the modules' `kernel_init` and
  `bias_init`."""
  return _params.init_params(spec, key, weight_initializer=kernel_init, bias_initializer=bias_init,
                             names=("kernel_init", "bias_init"))


def _describe(value) -> str:
  if hasattr(value, "shape"):
    return f"an array of shape {tuple(value.shape)}"
  if isinstance(value, (tuple, list)):
    return f"a {type(value).__name__} of {len(value)}"
  return type(value).__name__


def _carry(spec, name: str, value, inputs, time_major: bool):
  """One state of `initial_carry` as an array of the compute dtype, its shape
  checked here so that the error names the module's terms (the spec's own
  check names `input_h`); an input of the wrong rank is left to the spec."""
  state = _real_array(name, value, spec.dtype)
  if inputs.ndim == 3:
    axes = _ops.Axes.of(inputs.shape, time_major, "inputs")
    _ops.check_state_shape(spec, name, state.shape, axes, unit_name="features")
  return state


# What an error about devices calls the six arrays of a call (`_ops.rnn`), in
# the modules' terms, by whether the model has a cell state.
_NAMES = {
    True: ("inputs", "initial_carry[0] (h)", "initial_carry[1] (c)", "opaque_params",
           "seq_lengths", "the dropout key"),
    False: ("inputs", "initial_carry", None, "opaque_params", "seq_lengths", "the dropout key"),
}


def run(spec, params, inputs, initial_carry, *, seq_lengths, dropout_key, training: bool,
        time_major: bool, implementation, return_carry: bool):
  """Runs `spec` (whose dtype is the compute dtype) on module-style arguments.

  `initial_carry` is None, `(h, c)` for the LSTM or `h` otherwise; returns
  `outputs`, or `(carry, outputs)` when `return_carry`.
  """
  dtype = spec.dtype
  inputs = jnp.asarray(inputs, dtype)
  params = jnp.asarray(params, dtype)
  if initial_carry is None:
    h0 = c0 = None
  elif spec.has_cell_state:
    if not isinstance(initial_carry, (tuple, list)) or len(initial_carry) != 2:
      raise TypeError("initial_carry of an LSTM must be a pair (h, c) of "
                      "[num_layers * num_dirs, batch, features] arrays, got "
                      f"{_describe(initial_carry)}")
    h0, c0 = (_carry(spec, f"initial_carry[{i}] ({n})", a, inputs, time_major)
              for i, (n, a) in enumerate(zip("hc", initial_carry)))
  else:
    h0, c0 = _carry(spec, "initial_carry", initial_carry, inputs, time_major), None
  out = spec._run(inputs, h0, c0, params, training, seq_lengths=seq_lengths,
                  dropout_key=dropout_key, time_major=time_major, implementation=implementation,
                  argument_names=_NAMES[spec.has_cell_state])
  outputs, carry = out[0], (tuple(out[1:]) if spec.has_cell_state else out[1])
  return (carry, outputs) if return_carry else outputs
