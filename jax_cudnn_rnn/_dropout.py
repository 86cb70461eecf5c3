"""Inter-layer dropout, shared by every backend so that they drop the same units.

The mask of layer `l`'s output is
`jax.random.bernoulli(jax.random.fold_in(dropout_key, l), np.float32(1 - dropout), shape)`
with `shape` the output's shape in the caller's layout (`[T, B, F]` time
major, `[B, T, F]` batch major); kept values are scaled by `1 / (1 - dropout)`
(inverted dropout). Only layers `0 .. num_layers - 2` are dropped.

The probability is a float32 whatever the model's dtype, so that a key draws
the same masks with `jax_enable_x64` on or off: `bernoulli` draws its uniform
numbers in the probability's dtype, and a Python float is a float64 under x64
(with a float, 430 of 1000 draws at 0.7 came out otherwise there).
"""

from __future__ import annotations

import numbers
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cudnn_rnn import _params


def check_rate(name: str, rate) -> float:
  """`rate` as a float, or an error naming `name` unless it is a real number
  in `[0, 1)` (at 1 nothing is kept, and inverted dropout divides by 0)."""
  if isinstance(rate, bool) or not isinstance(rate, numbers.Real):
    raise TypeError(f"{name} must be a float in [0, 1), got {rate!r}")
  if not 0.0 <= float(rate) < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {rate}")
  return float(rate)


def drops(spec) -> bool:
  """Whether a model of `spec` drops anything in training: a rate above 0,
  and a layer below the last (the last layer's output is never dropped)."""
  return spec.dropout > 0 and spec.num_layers > 1


def _is_int(value) -> bool:
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def keep_mask(dropout_key: jax.Array, layer: int, shape: Sequence[int],
              rate: float) -> jax.Array:
  """Boolean mask of the units of layer `layer`'s output that are kept.

  Args:
    dropout_key: the `dropout_key` of the call, a single PRNG key.
    layer: the layer whose output the mask drops, from 0.
    shape: the layer's output shape in the call's layout (`[T, B, F]` time
      major, `[B, T, F]` batch major).
    rate: the spec's `dropout`, in `[0, 1)`.

  Returns:
    A bool array of `shape`, True where a unit is kept.
  """
  dropout_key = _params.check_key("dropout_key", dropout_key)
  if not _is_int(layer) or not 0 <= layer < 2**32:
    raise (TypeError if not _is_int(layer) else ValueError)(
        f"layer must be an int in [0, 2**32) (it is folded into the key), got {layer!r}")
  if not isinstance(shape, Sequence) or isinstance(shape, str) or not all(map(_is_int, shape)):
    raise TypeError(f"shape must be a tuple of ints, got {shape!r}")
  if any(d < 0 for d in shape):
    raise ValueError(f"shape must have no negative dimension, got {tuple(shape)}")
  return _keep_mask(dropout_key, int(layer), tuple(int(d) for d in shape),
                    check_rate("rate", rate))


def _keep_mask(dropout_key, layer: int, shape: tuple[int, ...], rate: float) -> jax.Array:
  return jax.random.bernoulli(jax.random.fold_in(dropout_key, layer), np.float32(1.0 - rate),
                              shape)


def apply(y: jax.Array, dropout_key: jax.Array, layer: int, rate: float) -> jax.Array:
  """Inverted dropout of layer `layer`'s output `y` (in the caller's layout).
  Its arguments were checked with the call's (`_ops.rnn`, the spec)."""
  keep = _keep_mask(dropout_key, layer, y.shape, rate)
  return jnp.where(keep, y / jnp.asarray(1.0 - rate, y.dtype), jnp.zeros((), y.dtype))
