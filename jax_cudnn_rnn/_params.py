"""Parameter creation and canonical <-> opaque conversion (pure `jnp`).

Both conversions are pure functions of arrays with static slicing, so they work
under `jit`, `grad`, `vmap` and on every backend; their layout is documented
in `_layout`.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping, Sequence

import numpy as np
import jax
import jax.numpy as jnp

from jax_cudnn_rnn import _layout

Initializer = Callable[[jax.Array, tuple[int, ...], jnp.dtype], jax.Array]


def as_array(where: str, value, convert=jnp.asarray, *, real: bool = False):
  """`convert(value)`, or a `TypeError` naming `where` where that fails (a
  ragged list, or one of strings or other objects, an object array).

  `real`: the result must also have a real dtype (`check_real`); an array
  given is checked before it is converted, so that an object or key array is
  said to have the wrong dtype, as a complex one is, whichever conversion
  would have failed on it (jnp's, numpy's) and however."""
  if real and isinstance(value, (np.ndarray, jax.Array)):
    check_real(where, value)
  try:
    array = convert(value)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{where} must be an array or a nested list of real numbers of one "
                    f"shape; converting the {type(value).__name__} failed: {e}") from e
  return check_real(where, array) if real else array


def has_real_dtype(array) -> bool:
  """Whether `array`'s dtype is float, integer or bool."""
  return any(jnp.issubdtype(array.dtype, kind) for kind in (jnp.floating, jnp.integer, jnp.bool_))


def check_real(where: str, array):
  """`array`, or a `TypeError` naming `where` unless its dtype is real (float,
  integer or bool): cast to a float, a complex array would lose its imaginary
  part and an object array would become NaN, silently; a key array holds no
  numbers."""
  if not has_real_dtype(array):
    raise TypeError(f"{where} must have a float, integer or bool dtype, got {array.dtype}")
  return array


def _check_params(spec, params) -> jax.Array:
  """Validates an opaque buffer's rank, size and dtype; returns it as an array."""
  size = _layout.params_size(spec)
  if not hasattr(params, "shape") or not hasattr(params, "dtype"):
    raise TypeError(f"params must be an array, got {type(params).__name__}: "
                    f"{_buffer_hint(params, size)}")
  if params.shape != (size,):
    raise ValueError(
        f"params must have shape ({size},) (params_size() of {spec}), got {tuple(params.shape)}")
  if params.dtype != spec.dtype:  # not np.dtype(): a PRNG key array's dtype is none of numpy's
    raise TypeError(f"params must have dtype {spec.dtype.name}, got {params.dtype}")
  return params if isinstance(params, jax.Array) else jnp.asarray(params)


def _buffer_hint(params, size: int) -> str:
  """What `params` is meant to be, for a caller who passed something else:
  most often the canonical `(weights, biases)` lists, or a Flax module's
  variables."""
  hint = (f"the opaque buffer, a 1-D array of params_size() = {size} elements "
          "(spec.init_params(key) makes one; spec.canonical_to_params(weights, biases) "
          "packs canonical weights and biases into one)")
  if isinstance(params, Mapping):
    hint += "; a Flax module's variables hold it at ['params']['opaque_params']"
  return hint


# Why a float64 buffer cannot be made or accepted: said by every check that meets one.
X64_HINT = "JAX makes float64 arrays only with jax.config.update('jax_enable_x64', True)"


def _check_dtype_available(spec, what: str) -> None:
  """A float64 spec's buffers can only be made with x64 on: JAX would make
  float32 ones instead (with a warning), which no call of the spec accepts."""
  if spec.dtype == np.float64 and not jax.config.jax_enable_x64:
    raise TypeError(f"{what} would make a float32 buffer for this float64 spec: {X64_HINT}")


@functools.cache
def _raw_key_shape(impl: str) -> tuple[int, ...]:
  """The shape of a raw key (`jax.random.PRNGKey`'s) of the PRNG `impl`:
  `(2,)` for threefry2x32, JAX's default, `(4,)` for "rbg" and "unsafe_rbg"."""
  return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl))).shape


def check_key(name: str, key):
  """`key` as `jax.random` takes a single key: a typed key (`jax.random.key`,
  shape `()`) or a raw one (`jax.random.PRNGKey`: `uint32` of the shape of
  the default PRNG's keys, `(2,)` but under `jax_default_prng_impl="rbg"`);
  not an integer seed, not a batch of keys. Returns it unchanged."""
  dtype = getattr(key, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if key.shape != ():
      raise ValueError(f"{name} must be a single PRNG key, got shape {key.shape}")
    return key
  impl = str(jax.config.jax_default_prng_impl)
  raw = _raw_key_shape(impl)
  if dtype is None or np.dtype(dtype) != np.uint32 or tuple(key.shape) != raw:
    got = (type(key).__name__ if dtype is None else
           f"an array of dtype {np.dtype(dtype).name} and shape {tuple(key.shape)}")
    raise TypeError(f"{name} must be a PRNG key (jax.random.key(seed), or a raw uint32{list(raw)} "
                    f"of the default PRNG, {impl}), got {got}")
  return key


def init_params(spec, key, *, weight_initializer: Initializer | None = None,
                bias_initializer: Initializer | None = None,
                names: tuple[str, str] = ("weight_initializer", "bias_initializer")) -> jax.Array:
  """Creates an opaque parameter buffer for `spec`.

  By default every weight and bias is drawn from `U(-1/sqrt(num_units),
  1/sqrt(num_units))`, the initialisation cuDNN, PyTorch and
  `jax.experimental.rnn` users expect.

  Args:
    spec: the RNN spec.
    key: a PRNG key.
    weight_initializer: optional `init(key, shape, dtype)` (as
      `jax.nn.initializers`) called for every canonical matrix.
    bias_initializer: optional `init(key, shape, dtype)` called for every
      canonical bias vector.
    names: what errors call the two initializers (the Flax modules' say
      `kernel_init` and `bias_init`, as their users named them).

  Returns:
    A 1-D array of shape `(spec.params_size(),)` and dtype `spec.dtype`.
  """
  check_key("key", key)
  _check_dtype_available(spec, "init_params")
  bound = 1.0 / np.sqrt(spec.num_units)
  default = lambda k, shape, dtype: jax.random.uniform(
      k, shape, dtype, minval=-bound, maxval=bound)
  if weight_initializer is None and bias_initializer is None:
    return default(key, (_layout.params_size(spec),), spec.dtype)
  weight_entries, bias_entries = _layout.tensors(spec)
  keys = jax.random.split(key, len(weight_entries) + len(bias_entries))
  given = lambda init: default if init is None else init  # not `or`: 0.0 is refused, not default
  weights = _draw(names[0], given(weight_initializer), keys, weight_entries, spec.dtype)
  biases = _draw(names[1], given(bias_initializer), keys[len(weight_entries):], bias_entries,
                 spec.dtype)
  return canonical_to_params(spec, weights, biases)


def _draw(name: str, init, keys, entries, dtype) -> list:
  """`init(key, shape, dtype)` for each entry, or an error naming the initializer."""
  if not callable(init):
    raise TypeError(f"{name} must be a callable init(key, shape, dtype), as "
                    f"jax.nn.initializers makes, got {type(init).__name__}")
  out = []
  for k, t in zip(keys, entries):
    value = as_array(f"{name}'s result", init(k, t.shape, dtype), real=True)
    if tuple(np.shape(value)) != t.shape:
      raise ValueError(f"{name} returned shape {tuple(np.shape(value))} when asked for {t.shape}")
    out.append(value)
  return out


def _check_canonical(name: str, arrays: Sequence, entries) -> list[jax.Array]:
  """`arrays` as arrays of a real dtype and the shapes of `entries`, or an
  error naming the one that is not."""
  if not isinstance(arrays, (list, tuple)):
    raise TypeError(f"{name} must be a list of arrays, got {type(arrays).__name__}")
  if len(arrays) != len(entries):
    raise ValueError(f"{name} must hold {len(entries)} arrays, got {len(arrays)}")
  return [canonical_entry(f"{name}[{i}]", a, t.shape)
          for i, (a, t) in enumerate(zip(arrays, entries))]


def canonical_entry(where: str, value, shape: tuple[int, ...]) -> jax.Array:
  """`value` as an array of a real dtype and `shape`, or an error naming `where`."""
  array = as_array(where, value, real=True)
  if array.shape != shape:
    raise ValueError(f"{where} must have shape {shape}, got {array.shape}")
  return array


def canonical_to_params(spec, weights: Sequence, biases: Sequence) -> jax.Array:
  """Packs canonical weights and biases (cast to `spec.dtype`) into an opaque buffer."""
  _check_dtype_available(spec, "canonical_to_params")
  weight_entries, bias_entries = _layout.tensors(spec)
  weights = _check_canonical("weights", weights, weight_entries)
  biases = _check_canonical("biases", biases, bias_entries)
  flat = [jnp.ravel(a).astype(spec.dtype) for a in (*weights, *biases)]
  return jnp.concatenate(flat)


def params_to_canonical(spec, params) -> tuple[list[jax.Array], list[jax.Array]]:
  """Unpacks an opaque buffer into `(weights, biases)` in canonical order."""
  params = _check_params(spec, params)
  weight_entries, bias_entries = _layout.tensors(spec)
  unpack = lambda t: params[t.offset:t.offset + t.size].reshape(t.shape)
  return [unpack(t) for t in weight_entries], [unpack(t) for t in bias_entries]
