"""The four cuDNN-style RNN specs: construction-time validation and properties.

A spec is a frozen, hashable dataclass that describes a multi-layer,
optionally bidirectional RNN the way `tf.contrib.cudnn_rnn` did. It owns no
arrays: parameters are one flat opaque buffer created by `init_params` or
`canonical_to_params`, and passed to `__call__` explicitly.

Every spec class is a pytree with no leaves (`jax.tree_util.register_static`):
a spec passed to a jitted function as an ordinary argument is static, as
under `static_argnums`, and a pytree holding specs (a train state, say) keeps
them in its structure. Without this, JAX would take a spec, which has a
`dtype` attribute, for a scalar of that dtype, and trace it.

`input_mode="auto_select"` is resolved at construction: the stored
`input_mode` is `"skip_input"` when `input_size == num_units`, else
`"linear_input"`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from typing import Any, ClassVar

import numpy as np
import jax
import jax.numpy as jnp

from jax_cudnn_rnn import _dropout

INPUT_MODES = ("linear_input", "skip_input", "auto_select")
DIRECTIONS = ("unidirectional", "bidirectional")
SUPPORTED_DTYPES = (
    np.dtype(jnp.float16),
    np.dtype(jnp.bfloat16),
    np.dtype(jnp.float32),
    np.dtype(jnp.float64),
)

# Gates per rnn_mode: each gate has one input matrix W_k and one recurrent
# matrix R_k (and a bias for each), as cuDNN's CUDNN_RNN_DOUBLE_BIAS.
NUM_GATES = {"rnn_tanh": 1, "rnn_relu": 1, "lstm": 4, "gru": 3}


def check_positive_int(name: str, value: Any) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
  if value <= 0:
    raise ValueError(f"{name} must be a positive int, got {value}")
  return int(value)


def check_bool(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def check_dtype(value: Any, name: str = "dtype") -> np.dtype:
  """`value` as one of `SUPPORTED_DTYPES`, or a `TypeError` naming `name`."""
  try:
    if value is None:  # numpy's float64, where JAX's None means its default float
      raise TypeError
    dtype = np.dtype(value)
  except TypeError:
    raise TypeError(
        f"{name} must be one of {[d.name for d in SUPPORTED_DTYPES]}, got {value!r}"
    ) from None
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{name} must be one of {[d.name for d in SUPPORTED_DTYPES]}, got {dtype.name}"
    )
  return dtype


@dataclasses.dataclass(frozen=True)
class CudnnRNNBase:
  """Common spec of the cuDNN RNN models; use one of the four subclasses.

  Attributes:
    num_layers: number of stacked layers.
    num_units: hidden size of every layer and direction.
    input_size: feature size of `input_data`.
    input_mode: "linear_input" (layer 0 multiplies the input by its input
      matrices), "skip_input" (layer 0 has no input matrices: the input is
      added to every gate as is; needs `input_size == num_units`), or
      "auto_select" (resolved at construction to "skip_input" exactly when
      `input_size == num_units`).
    direction: "unidirectional" or "bidirectional".
    dtype: dtype of params, inputs and states: float16, bfloat16, float32 or
      float64.
    dropout: probability in [0, 1) of dropping each output of every layer but
      the last, when `is_training`.
    seed: kept for compatibility with `tf.contrib.cudnn_rnn`; dropout masks
      come from the `dropout_key` passed to `__call__`, never from hidden
      state, so that calls stay pure functions.
  """

  num_layers: int
  num_units: int
  input_size: int
  input_mode: str = "linear_input"
  direction: str = "unidirectional"
  dtype: Any = jnp.float32
  dropout: float = 0.0
  seed: int = 0

  rnn_mode: ClassVar[str] = ""

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    jax.tree_util.register_static(cls)  # the module docstring

  def __post_init__(self):
    if type(self) is CudnnRNNBase:
      raise TypeError(
          "CudnnRNNBase is abstract: use CudnnLSTM, CudnnGRU, CudnnRNNTanh or CudnnRNNRelu"
      )
    set_ = lambda k, v: object.__setattr__(self, k, v)
    set_("num_layers", check_positive_int("num_layers", self.num_layers))
    set_("num_units", check_positive_int("num_units", self.num_units))
    set_("input_size", check_positive_int("input_size", self.input_size))
    if self.input_mode not in INPUT_MODES:
      raise ValueError(f"input_mode must be one of {INPUT_MODES}, got {self.input_mode!r}")
    if self.input_mode == "auto_select":
      set_("input_mode",
           "skip_input" if self.input_size == self.num_units else "linear_input")
    if self.input_mode == "skip_input" and self.input_size != self.num_units:
      raise ValueError(
          "input_mode='skip_input' needs input_size == num_units, got "
          f"input_size={self.input_size}, num_units={self.num_units}")
    if self.direction not in DIRECTIONS:
      raise ValueError(f"direction must be one of {DIRECTIONS}, got {self.direction!r}")
    set_("dtype", check_dtype(self.dtype))
    set_("dropout", _dropout.check_rate("dropout", self.dropout))
    if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
      raise TypeError(f"seed must be an int, got {self.seed!r}")
    set_("seed", int(self.seed))

  # -- derived properties ----------------------------------------------------

  @property
  def num_dirs(self) -> int:
    """1 for unidirectional, 2 for bidirectional."""
    return 2 if self.direction == "bidirectional" else 1

  @property
  def num_gates(self) -> int:
    """Gates per direction and layer: LSTM 4, GRU 3, RNN 1."""
    return NUM_GATES[self.rnn_mode]

  @property
  def has_cell_state(self) -> bool:
    """True for the LSTM, the only mode with a cell state `c`."""
    return self.rnn_mode == "lstm"

  @property
  def output_size(self) -> int:
    """Feature size of the output sequence: `num_dirs * num_units`."""
    return self.num_dirs * self.num_units

  def layer_input_size(self, layer: int) -> int:
    """Feature size of the input of `layer` (0-based)."""
    return self.input_size if self._layer(layer) == 0 else self.output_size

  def layer_has_input_weights(self, layer: int) -> bool:
    """False for layer 0 under skip_input: it has no input matrices W_k."""
    return not (self._layer(layer) == 0 and self.input_mode == "skip_input")

  def _layer(self, layer) -> int:
    """`layer`, or an error unless it is one of this spec's layers."""
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral):
      raise TypeError(f"layer must be an int, got {layer!r}")
    if not 0 <= layer < self.num_layers:
      raise ValueError(f"layer must be in [0, {self.num_layers}) (num_layers), got {layer}")
    return int(layer)

  # -- parameters --------------------------------------------------------------

  def params_size(self) -> int:
    """Number of elements of the opaque parameter buffer."""
    from jax_cudnn_rnn import _layout
    return _layout.params_size(self)

  def init_params(self, key, *, weight_initializer=None, bias_initializer=None):
    """A fresh opaque buffer, `(params_size(),)` of the spec's dtype.

    Every weight and bias is drawn from `U(-1/sqrt(num_units), 1/sqrt(num_units))`
    (cuDNN's, PyTorch's and `jax.experimental.rnn`'s users' initialisation),
    unless `weight_initializer` (called for every canonical matrix) or
    `bias_initializer` (every canonical bias) is given: `init(key, shape,
    dtype)`, as `jax.nn.initializers` makes.
    """
    from jax_cudnn_rnn import _params
    return _params.init_params(self, key, weight_initializer=weight_initializer,
                               bias_initializer=bias_initializer)

  def canonical_to_params(self, weights, biases):
    """Packs canonical weights and biases into an opaque buffer.

    Args:
      weights: list of matrices in canonical order: layer by layer, the
        forward direction then the backward, in each the input matrices
        `W_0..W_{g-1}` (`[num_units, in]`; none in a skip_input layer 0) then
        the recurrent ones `R_0..R_{g-1}` (`[num_units, num_units]`).
      biases: list of `[num_units]` vectors in the same order (`bW`s, `bR`s).

    Returns:
      A 1-D array of shape `(params_size(),)` and this spec's dtype (the
      arrays cast to it).
    """
    from jax_cudnn_rnn import _params
    return _params.canonical_to_params(self, weights, biases)

  def params_to_canonical(self, params):
    """Unpacks an opaque buffer into `(weights, biases)`, two canonical lists."""
    from jax_cudnn_rnn import _params
    return _params.params_to_canonical(self, params)

  def _run(self, input_data, input_h, input_c, params, is_training, **options):
    from jax_cudnn_rnn import _ops
    return _ops.rnn(self, input_data, input_h, input_c, params,
                    is_training=is_training, **options)


_CALL_DOC = """Runs the RNN over a sequence.

    Args:
      input_data: `[T, B, input_size]` (`[B, T, input_size]` when
        `time_major=False`). Arrays here, in the states and in `params` must
        have the spec's dtype; a nested list (input data and states only)
        takes it.
      input_h: `[num_layers * num_dirs, B, num_units]` initial hidden states,
        or None for zeros. Index `layer * num_dirs + direction`.
{c_arg}      params: the opaque buffer, `[params_size()]`, of the spec's dtype.
      is_training: whether dropout (if the spec has any) is applied.
      seq_lengths: optional `[B]` integer lengths; outputs past each length
        are zero, final states are those at step `length - 1`, and the
        backward direction starts at step `length - 1`.
      dropout_key: PRNG key for inter-layer dropout; required when
        `is_training` and `dropout > 0`, and checked wherever given.
      time_major: layout of `input_data` and `output`.
      implementation: None (cuDNN where it can run, else XLA; XLA for a
        single step of a model of up to 2^22 parameters, where it is the
        faster), "xla" or "cudnn".

    Returns:
      `output` `[T, B, num_dirs * num_units]` (`[B, T, ...]` when batch
      major), then the final states `output_h`{c_ret}, each
      `[num_layers * num_dirs, B, num_units]`.
"""


class CudnnLSTM(CudnnRNNBase):
  """cuDNN-style LSTM: gates i, f, g, o; `(output, h, c) = lstm(x, h0, c0, params)`."""

  rnn_mode: ClassVar[str] = "lstm"

  def __call__(self, input_data, input_h, input_c, params, is_training=True, *,
               seq_lengths=None, dropout_key=None, time_major=True,
               implementation=None):
    return self._run(input_data, input_h, input_c, params, is_training,
                     seq_lengths=seq_lengths, dropout_key=dropout_key,
                     time_major=time_major, implementation=implementation)

  __call__.__doc__ = _CALL_DOC.format(
      c_arg="      input_c: initial cell states, same shape as `input_h`, or None.\n",
      c_ret=" and `output_c`")


class _CudnnRNNNoC(CudnnRNNBase):
  """Models without a cell state: `(output, h) = rnn(x, h0, params)`."""

  def __call__(self, input_data, input_h, params, is_training=True, *,
               seq_lengths=None, dropout_key=None, time_major=True,
               implementation=None):
    return self._run(input_data, input_h, None, params, is_training,
                     seq_lengths=seq_lengths, dropout_key=dropout_key,
                     time_major=time_major, implementation=implementation)

  __call__.__doc__ = _CALL_DOC.format(c_arg="", c_ret="")


class CudnnGRU(_CudnnRNNNoC):
  """cuDNN-style GRU: gates r, z (update), n; `n` applies `r` after `R_n h + bR_n`."""

  rnn_mode: ClassVar[str] = "gru"


class CudnnRNNTanh(_CudnnRNNNoC):
  """cuDNN-style Elman RNN: `h' = tanh(W x + bW + R h + bR)`."""

  rnn_mode: ClassVar[str] = "rnn_tanh"


class CudnnRNNRelu(_CudnnRNNNoC):
  """cuDNN-style Elman RNN: `h' = relu(W x + bW + R h + bR)`."""

  rnn_mode: ClassVar[str] = "rnn_relu"


def check_spec(spec, where: str) -> None:
  """A `TypeError` naming `where` and what was passed, unless `spec` is one of
  the four specs (rather than an `AttributeError` from deep inside)."""
  if not isinstance(spec, CudnnRNNBase):
    shown = repr(spec)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    raise TypeError(f"{where}: spec must be a CudnnLSTM, CudnnGRU, CudnnRNNTanh or "
                    f"CudnnRNNRelu, got {type(spec).__name__} {shown}")


def takes_spec(fn):
  """Decorates a public function with a `spec` argument with `check_spec`."""
  signature = inspect.signature(fn)

  @functools.wraps(fn)
  def checked(*args, **kwargs):
    check_spec(signature.bind_partial(*args, **kwargs).arguments.get("spec"), fn.__name__)
    return fn(*args, **kwargs)

  return checked
