"""Flax nnx adapters: `LSTM`, `GRU`, `SimpleRNN` backed by the fused RNN.

The nnx twins of `jax_cudnn_rnn.linen`: the parameters are one opaque buffer,
`module.opaque_params` (an `nnx.Param` of shape `(module.spec.params_size(),)`
and dtype `param_dtype`); `module.spec` is the spec (for conversions and
checkpoints). Dropout between layers draws from the `dropout` stream of the
`rngs` given at construction, or its `default` stream where it has none, as
`nnx.Dropout` does (at call time, `rngs` may also be an `nnx.RngStream` or a
PRNG key), and is off when `deterministic` is True (set by `module.eval()`, or
in a view by `nnx.view(module, deterministic=True)` through `set_view`, as
for `nnx.Dropout`).
Batch-major by default; `return_carry=True` returns `(carry, outputs)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from jax_cudnn_rnn import _adapter, _dropout, _params, _requirements, _spec

nnx = _requirements.optional_import("flax.nnx", "jax_cudnn_rnn.nnx")

Initializer = Callable[[jax.Array, tuple[int, ...], Any], jax.Array]


class _FusedRNN(nnx.Module):
  """Shared implementation; use `LSTM`, `GRU` or `SimpleRNN`."""

  rnn_mode = "lstm"

  def __init__(self, in_features: int, features: int, *, num_layers: int = 1,
               bidirectional: bool = False, dropout_rate: float = 0.0,
               input_mode: str = "linear_input", time_major: bool = False,
               return_carry: bool = False, deterministic: bool = False, dtype: Any = None,
               param_dtype: Any = jnp.float32, kernel_init: Optional[Initializer] = None,
               bias_init: Optional[Initializer] = None, implementation: Optional[str] = None,
               rngs: nnx.Rngs):
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"rngs must be an nnx.Rngs, got {type(rngs).__name__}")
    self.spec = _adapter.make_spec(
        self._rnn_mode(), features=features, num_layers=num_layers, input_size=in_features,
        input_mode=input_mode, bidirectional=bidirectional, dtype=param_dtype,
        dropout_rate=dropout_rate, input_name="in_features")
    if dtype is not None:
      _spec.check_dtype(dtype)
    _spec.check_bool("return_carry", return_carry)
    _spec.check_bool("deterministic", deterministic)
    self.opaque_params = nnx.Param(
        _adapter.init_params(self.spec, rngs.params(), kernel_init, bias_init))
    self.time_major, self.return_carry = time_major, return_carry
    self.deterministic, self.dtype, self.implementation = deterministic, dtype, implementation
    stream = _dropout_stream(rngs) if "dropout" in rngs or _dropout.drops(self.spec) else None
    self.rngs = stream.fork() if stream is not None else nnx.data(None)  # as nnx.Dropout

  def _rnn_mode(self) -> str:
    return self.rnn_mode

  def set_view(self, deterministic: Optional[bool] = None):
    """Used by `nnx.view`, as `nnx.Dropout`'s: `deterministic=True` turns
    dropout off in the view, False on.

    Args:
      deterministic: if True, disables dropout between layers.
    """
    if deterministic is not None:
      self.deterministic = _spec.check_bool("deterministic", deterministic)

  def __call__(self, inputs, initial_carry=None, *, seq_lengths=None,
               deterministic: Optional[bool] = None, rngs: Any = None):
    """Runs the RNN; arguments and results as `jax_cudnn_rnn.linen`'s modules."""
    deterministic = self.deterministic if deterministic is None else deterministic
    inputs = _adapter.as_inputs(inputs, self.time_major)
    if inputs.shape[-1] != self.spec.input_size:  # in the module's terms, not the spec's
      raise ValueError(f"inputs' last axis must be in_features={self.spec.input_size} (the "
                       f"module's), got shape {tuple(inputs.shape)}")
    params = self.opaque_params[...]
    dtype = self.dtype if self.dtype is not None else jnp.result_type(inputs, params)
    training = not deterministic and _dropout.drops(self.spec)
    key = None
    if training:
      if rngs is None:
        stream = self.rngs
      elif isinstance(rngs, jax.Array):
        stream = _params.check_key("rngs", rngs)
      else:
        stream = _dropout_stream(rngs)
      if stream is None:
        raise ValueError("dropout needs rngs with a 'dropout' (or 'default') stream, at "
                         "construction or call time, or deterministic=True")
      key = stream if isinstance(stream, jax.Array) else stream()
    return _adapter.run(dataclasses.replace(self.spec, dtype=dtype), params, inputs,
                        initial_carry, seq_lengths=seq_lengths, dropout_key=key,
                        training=training, time_major=self.time_major,
                        implementation=self.implementation, return_carry=self.return_carry)


def _dropout_stream(rngs):
  """The stream dropout draws from, as `nnx.Dropout` takes `rngs`: an
  `nnx.Rngs`'s 'dropout' stream, its 'default' one where it has none (None
  where it has neither), or an `nnx.RngStream` itself."""
  if isinstance(rngs, nnx.RngStream):
    return rngs
  if not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"rngs must be an nnx.Rngs, an nnx.RngStream or (at call time) a PRNG "
                    f"key, got {type(rngs).__name__}")
  try:
    return rngs["dropout"]
  except KeyError:  # neither a 'dropout' nor a 'default' stream
    return None


class LSTM(_FusedRNN):
  """Multi-layer, optionally bidirectional LSTM (cuDNN's gates i, f, g, o)."""

  rnn_mode = "lstm"


class GRU(_FusedRNN):
  """Multi-layer, optionally bidirectional GRU."""

  rnn_mode = "gru"


class SimpleRNN(_FusedRNN):
  """Multi-layer Elman RNN; `activation` is "tanh" (default) or "relu"."""

  def __init__(self, in_features: int, features: int, *, activation: str = "tanh", **kwargs):
    self.activation = activation
    super().__init__(in_features, features, **kwargs)

  def _rnn_mode(self) -> str:
    return _adapter.simple_rnn_mode(self.activation)
