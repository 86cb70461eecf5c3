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

import jax
import jax.numpy as jnp
import numpy as np


def keep_mask(dropout_key: jax.Array, layer: int, shape: tuple[int, ...],
              rate: float) -> jax.Array:
  """Boolean mask of the units of layer `layer`'s output that are kept."""
  return jax.random.bernoulli(jax.random.fold_in(dropout_key, layer), np.float32(1.0 - rate),
                              shape)


def apply(y: jax.Array, dropout_key: jax.Array, layer: int, rate: float) -> jax.Array:
  """Inverted dropout of layer `layer`'s output `y` (in the caller's layout)."""
  keep = keep_mask(dropout_key, layer, y.shape, rate)
  return jnp.where(keep, y / jnp.asarray(1.0 - rate, y.dtype), jnp.zeros((), y.dtype))
