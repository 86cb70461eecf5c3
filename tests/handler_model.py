"""A pure-JAX model of the native handlers' contract, for testing `_cudnn`'s
Python side (custom_vjp, residuals, per-layer dropout calls, zero lengths,
layouts, vmap) on a machine without a GPU.

It stands in for `jax.ffi.ffi_call` and `_cudnn.query_sizes`, and answers each
of the four targets the way cuDNN's calls are documented to behave, computed
with the plain-scan reference (`_reference.rnn`):

- forward inference: `x, hx, cx, weights, seq_lengths -> y, hy, cy`;
- forward training: the same plus a reserve space. cuDNN keeps there what its
  backward passes need and are not given; the model keeps `x, hx, cx, weights`
  (so its size is not proportional to the batch, like cuDNN's), at the start
  of whatever larger buffer Python declares;
- backward data: `y, dy, hx, dhy, cx, dcy, weights, seq_lengths, reserve ->
  dx, dhx, dcx, reserve`, reading `x` from the reserve and writing `dy, dhy,
  dcy` into the returned one (cuDNN updates it in place for the weights pass);
- backward weights: `x, hx, y, seq_lengths, reserve -> dweights`, reading the
  cell state, the weights and the cotangents from the reserve and `x`, `hx`
  from its operands.

Attributes are decoded back into a `_cudnn.Config` from the dictionary
Python sends, so they must describe the call; every declared result shape and
dtype, the `vmap` method and the reserve's input/output alias are checked.
This proves the Python plumbing right given a right native library; the
native library itself is tested against the same reference on a GPU
(`test_cudnn.py`).
"""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _layout, _reference

SPECS = {"lstm": jcr.CudnnLSTM, "gru": jcr.CudnnGRU, "rnn_tanh": jcr.CudnnRNNTanh,
         "rnn_relu": jcr.CudnnRNNRelu}
ALIASES = {"jcr_rnn_backward_data": {8: 3}}


def config_of(attrs: dict) -> _cudnn.Config:
  modes = {v: k for k, v in _cudnn.CELL_MODES.items()}
  fields = {f.name for f in dataclasses.fields(_cudnn.Config)}
  assert set(attrs) == fields - {"rnn_mode", "algorithms"} | {"cell_mode", "algo"}, attrs
  assert all(isinstance(v, (np.int64, np.bool_)) for v in attrs.values()), attrs
  assert int(attrs["algo"]) in _cudnn.ALGORITHMS.values(), attrs
  return _cudnn.Config(modes[int(attrs["cell_mode"])], int(attrs["num_layers"]),
                       int(attrs["hidden_size"]), int(attrs["input_size"]),
                       bool(attrs["bidirectional"]), bool(attrs["skip_input"]),
                       bool(attrs["batch_major"]), bool(attrs["allow_tf32"]),
                       bool(attrs["has_seq_lengths"]), (int(attrs["algo"]),) * 2)


def spec_of(cfg: _cudnn.Config, dtype):
  return SPECS[cfg.rnn_mode](
      cfg.num_layers, cfg.hidden_size, cfg.input_size,
      input_mode="skip_input" if cfg.skip_input else "linear_input",
      direction="bidirectional" if cfg.bidirectional else "unidirectional", dtype=dtype)


def _to_bytes(*arrays):
  return jnp.concatenate([jax.lax.bitcast_convert_type(a.ravel(), jnp.uint8).ravel()
                          for a in arrays])


def _reserve_parts(cfg, dtype, x_shape):
  """What the model's reserve space holds, in order: `(name, shape)`, all of
  the call's dtype. The forward pass fills the first four, backward data the
  cotangents."""
  batch = x_shape[0] if cfg.batch_major else x_shape[1]
  y_shape = x_shape[:2] + (cfg.hidden_size * (2 if cfg.bidirectional else 1),)
  state = (cfg.num_states, batch, cfg.hidden_size)
  cell = state if cfg.rnn_mode == "lstm" else (0,)
  params = (_layout.params_size(spec_of(cfg, dtype)),)
  return [("x", x_shape), ("h0", state), ("c0", cell), ("params", params), ("dy", y_shape),
          ("dh", state), ("dc", cell)]


def _reserve_size(cfg, dtype, x_shape):
  return sum(int(np.prod(s)) for _, s in _reserve_parts(cfg, dtype, x_shape)) * np.dtype(
      dtype).itemsize


def _from_bytes(reserve, cfg, dtype, x_shape):
  """The reserve's parts by name (from its first bytes: it may be larger)."""
  reserve = reserve.reshape(-1)
  out, at, size = {}, 0, np.dtype(dtype).itemsize
  for name, shape in _reserve_parts(cfg, dtype, x_shape):
    n = int(np.prod(shape)) * size
    chunk = reserve[at:at + n].reshape(-1, size)
    out[name] = jax.lax.bitcast_convert_type(chunk, dtype).reshape(shape)
    at += n
  return out


class HandlerModel:
  """Stands in for `jax.ffi.ffi_call` and `_cudnn`'s queries (`install`; see
  the module docstring)."""

  def __init__(self):
    self.calls = collections.Counter()
    self.x_shapes = []  # the first operand's shape, per traced call
    self.algorithms = collections.defaultdict(set)  # target -> the `algo` attributes it got
    self.batch_major = collections.defaultdict(set)  # target -> its `batch_major` attributes

  def query_sizes(self, cfg, dtype, steps, batch):
    # The native query takes C integers: a symbolic dimension must not reach it.
    assert isinstance(steps, (int, np.integer)) and isinstance(batch, (int, np.integer)), (
        steps, batch)
    spec = spec_of(cfg, dtype)
    x_shape = (batch, steps, cfg.input_size) if cfg.batch_major else (steps, batch, cfg.input_size)
    return dict(weight_space=_layout.params_size(spec) * np.dtype(dtype).itemsize,
                workspace_inference=0, workspace_training=0,
                reserve_space=_reserve_size(cfg, dtype, x_shape), algorithms=cfg.algorithms)

  def install(self, set_attribute, *, handlers=True):
    """Stands the model in for cuDNN: `_cudnn` reports it available, with the
    model's sizes and layout (the analytic one, so no gather); with `handlers`,
    the model also answers the FFI calls (without, they can be lowered, not
    run). `set_attribute` is `setattr`, or pytest's `monkeypatch.setattr`, which
    undoes it after the test."""
    set_attribute(_cudnn, "availability", lambda: (True, ""))
    set_attribute(_cudnn, "query_sizes", self.query_sizes)
    set_attribute(_cudnn, "weight_layout", self.weight_layout)
    set_attribute(_cudnn, "cudnn_order", lambda spec: None)
    if handlers:
      set_attribute(jax.ffi, "ffi_call", self.ffi_call)
    return self

  @staticmethod
  def weight_layout(spec, algo=_cudnn.ALGORITHMS["standard"]):
    """`_cudnn.weight_layout`'s rows for the model: the analytic layout, with
    no input matrices for layer 0 under skip_input (offset -1, size 0), under
    either algorithm."""
    assert algo in _cudnn.ALGORITHMS.values(), algo
    weights, biases = _layout.tensors(spec)
    rows = np.zeros((spec.num_layers * spec.num_dirs, 2 * spec.num_gates, 5), np.int64)
    rows[..., 0] = rows[..., 3] = -1
    for t in weights:
      rows[t.layer * spec.num_dirs + t.direction, t.index, :3] = (t.offset, *t.shape)
    for t in biases:
      rows[t.layer * spec.num_dirs + t.direction, t.index, 3:] = (t.offset, t.shape[0])
    return rows

  def ffi_call(self, target, result_shape_dtypes, *, vmap_method=None,
               input_output_aliases=None, **unused):
    assert vmap_method == "sequential", (target, vmap_method)
    assert (input_output_aliases or {}) == ALIASES.get(target, {}), (target, input_output_aliases)
    run = getattr(self, target)

    def call(*operands, **attrs):
      self.calls[target] += 1
      self.x_shapes.append(operands[0].shape)
      self.algorithms[target].add(int(attrs["algo"]))
      self.batch_major[target].add(bool(attrs["batch_major"]))
      results = run(config_of(attrs), *operands)
      declared = (result_shape_dtypes if isinstance(result_shape_dtypes, (tuple, list))
                  else (result_shape_dtypes,))
      assert len(results) == len(declared), target
      results = tuple(self._fit_reserve(r, want) for r, want in zip(results, declared))
      for got, want in zip(results, declared):
        assert got.shape == want.shape and got.dtype == want.dtype, (target, got, want)
      return results if isinstance(result_shape_dtypes, (tuple, list)) else results[0]

    return call

  @staticmethod
  def _fit_reserve(result, declared):
    """The model's reserve bytes, padded into the reserve Python declared, which
    may be larger than cuDNN's size (`_partition.reserve_row_bytes`) but never
    smaller: the handlers refuse that."""
    if declared.dtype != jnp.uint8 or result.shape == declared.shape:
      return result
    assert result.ndim == 1 and result.size <= declared.size, (result.shape, declared.shape)
    return jnp.pad(result, (0, declared.size - result.size)).reshape(declared.shape)

  # -- the four targets ------------------------------------------------------------

  @staticmethod
  def _run(cfg, x, h0, c0, params, lengths):
    spec = spec_of(cfg, x.dtype)
    lstm = cfg.rnn_mode == "lstm"
    assert lstm or c0.shape == (0,), c0.shape  # no cell state: an empty buffer
    y, h, c = _reference.rnn(spec, x, h0, c0 if lstm else None, params,
                             seq_lengths=lengths if cfg.has_seq_lengths else None,
                             time_major=not cfg.batch_major)
    return y, h, (c if lstm else jnp.zeros((0,), x.dtype))

  @staticmethod
  def _differentiable(cfg):
    """How many of `_run`'s results carry a cotangent: not the empty cell state
    of a model without one (under `shard_map` its cotangent's type says it
    varies over devices, and the empty placeholder's does not)."""
    return 3 if cfg.rnn_mode == "lstm" else 2

  def jcr_rnn_forward_inference(self, cfg, x, h0, c0, params, lengths):
    return self._run(cfg, x, h0, c0, params, lengths)

  def jcr_rnn_forward_training(self, cfg, x, h0, c0, params, lengths):
    y, h, c = self._run(cfg, x, h0, c0, params, lengths)
    unfilled = sum(int(np.prod(s)) for _, s in _reserve_parts(cfg, x.dtype, x.shape)[4:])
    return y, h, c, _to_bytes(x, h0, c0, params, jnp.zeros((unfilled,), x.dtype))

  def jcr_rnn_backward_data(self, cfg, y, dy, h0, dh, c0, dc, params, lengths, reserve):
    x_shape = (*y.shape[:2], cfg.input_size)
    x = _from_bytes(reserve, cfg, y.dtype, x_shape)["x"]  # not an operand: cuDNN keeps it
    n = self._differentiable(cfg)
    _, vjp = jax.vjp(lambda x, h0, c0: self._run(cfg, x, h0, c0, params, lengths)[:n], x, h0, c0)
    dx, dh0, dc0 = vjp((dy, dh, dc)[:n])
    return dx, dh0, dc0, _to_bytes(x, h0, c0, params, dy, dh, dc)

  def jcr_rnn_backward_weights(self, cfg, x, h0, y, lengths, reserve):
    # Not operands here: the cell state, the weights and the cotangents.
    kept = _from_bytes(reserve, cfg, x.dtype, x.shape)
    n = self._differentiable(cfg)
    _, vjp = jax.vjp(lambda p: self._run(cfg, x, h0, kept["c0"], p, lengths)[:n], kept["params"])
    (dparams,) = vjp((kept["dy"], kept["dh"], kept["dc"])[:n])
    return (dparams,)
