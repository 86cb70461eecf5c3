"""Flax linen adapters: `LSTM`, `GRU`, `SimpleRNN` backed by the fused RNN.

Each module holds its parameters as one opaque buffer named `"opaque_params"`
(shape `(spec.params_size(),)`, dtype `param_dtype`) and runs
`jax_cudnn_rnn`'s spec on it: cuDNN on a GPU without any flag, the exact
pure-JAX path elsewhere. `module.spec(input_size)` gives the spec, so the
buffer can be converted with `spec.params_to_canonical` or saved with
`jax_cudnn_rnn.checkpoint`.

Conventions follow `flax.linen.RNN`: batch-major by default
(`time_major=False`), `return_carry=True` returns `(carry, outputs)`. The
carry is `(h, c)` for the LSTM and `h` otherwise, each
`[num_layers * num_dirs, batch, features]`. Dropout between layers draws from
the `"dropout"` rng stream.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Optional

import jax
import jax.numpy as jnp

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _adapter, _dropout, _requirements, _spec

nn = _requirements.optional_import("flax.linen", "jax_cudnn_rnn.linen")

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


class _FusedRNN(nn.Module):
  """Shared implementation; use `LSTM`, `GRU` or `SimpleRNN`."""

  features: int
  num_layers: int = 1
  bidirectional: bool = False
  dropout_rate: float = 0.0
  input_mode: str = "linear_input"
  time_major: bool = False
  return_carry: bool = False
  deterministic: Optional[bool] = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Optional[Initializer] = None
  bias_init: Optional[Initializer] = None
  implementation: Optional[str] = None

  rnn_mode: ClassVar[str] = "lstm"

  def _rnn_mode(self) -> str:
    return self.rnn_mode

  def spec(self, input_size: int, dtype: Any = None) -> jcr.CudnnRNNBase:
    """The spec of this module for inputs of `input_size` features (in
    `param_dtype`, or `dtype` where given)."""
    return _adapter.make_spec(
        self._rnn_mode(), features=self.features, num_layers=self.num_layers,
        input_size=input_size, input_mode=self.input_mode, bidirectional=self.bidirectional,
        dtype=self.param_dtype if dtype is None else dtype, dropout_rate=self.dropout_rate,
        input_name="the inputs' features", dtype_name="param_dtype" if dtype is None else "dtype")

  @nn.compact
  def __call__(self, inputs, initial_carry=None, *, seq_lengths=None, deterministic=None):
    """Runs the RNN.

    Args:
      inputs: `[B, T, in]` (`[T, B, in]` when `time_major`).
      initial_carry: None (zeros), or `(h, c)` for the LSTM / `h` otherwise.
      seq_lengths: optional `[B]` integer lengths.
      deterministic: disables dropout; merged with the module attribute, and
        required (here or there) only when the module has dropout to apply.

    Returns:
      `outputs` `[B, T, num_dirs * features]`, or `(carry, outputs)` when
      `return_carry`.
    """
    inputs = _adapter.as_inputs(inputs, self.time_major)
    input_size = inputs.shape[-1]
    param_spec = self.spec(input_size)  # checks the attributes it is made of
    _spec.check_bool("return_carry", self.return_carry)
    if _dropout.drops(param_spec):
      deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    else:  # nothing to drop: no need to say
      deterministic = True
    self._check_input_size(inputs.shape, param_spec)
    params = self.param(
        "opaque_params",
        lambda key: _adapter.init_params(param_spec, key, self.kernel_init, self.bias_init))
    dtype = self.dtype if self.dtype is not None else jnp.result_type(inputs, params)
    key = None if deterministic else self.make_rng("dropout")
    return _adapter.run(self.spec(input_size, dtype), params, inputs, initial_carry,
                        seq_lengths=seq_lengths, dropout_key=key, training=not deterministic,
                        time_major=self.time_major, implementation=self.implementation,
                        return_carry=self.return_carry)

  def _check_input_size(self, inputs_shape: tuple, param_spec) -> None:
    """Inputs of another width than the existing buffer was made for: a
    ValueError naming both widths, rather than Flax's about the buffer's shape."""
    if not self.has_variable("params", "opaque_params"):
      return
    size = int(jnp.size(self.get_variable("params", "opaque_params")))
    if size == param_spec.params_size():
      return
    # Under linear_input the buffer grows by the same number of elements a
    # feature (layer 0's input matrices), so one width fits; auto_select may
    # have picked skip_input, which only `features` fits.
    linear = lambda n: dataclasses.replace(param_spec, input_size=n,
                                           input_mode="linear_input").params_size()
    width = (size - linear(1)) // (linear(2) - linear(1)) + 1

    def fits(n: int) -> bool:
      try:
        return n > 0 and self.spec(n).params_size() == size
      except ValueError:  # skip_input: only `features` wide
        return False

    candidates = [n for n in (width, self.features) if fits(n)]
    made_for = (f"were made for input_size {candidates[0]}" if candidates else
                "fit this module at no input_size (made for another features, num_layers, "
                "bidirectional or cell?)")
    raise ValueError(
        f"inputs have input_size {param_spec.input_size} (the last axis of shape "
        f"{tuple(inputs_shape)}), but this module's opaque_params ({size} elements) "
        f"{made_for}; input_size {param_spec.input_size} needs {param_spec.params_size()}")


class LSTM(_FusedRNN):
  """Multi-layer, optionally bidirectional LSTM (cuDNN's gates i, f, g, o)."""

  rnn_mode: ClassVar[str] = "lstm"


class GRU(_FusedRNN):
  """Multi-layer, optionally bidirectional GRU (cuDNN's: reset applied after `R_n h + bR_n`)."""

  rnn_mode: ClassVar[str] = "gru"


class SimpleRNN(_FusedRNN):
  """Multi-layer Elman RNN; `activation` is "tanh" (default) or "relu"."""

  activation: str = "tanh"

  def _rnn_mode(self) -> str:
    return _adapter.simple_rnn_mode(self.activation)
