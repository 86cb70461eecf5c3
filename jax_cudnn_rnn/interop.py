"""Converters between the opaque buffer and other libraries' RNN weights.

Lossless where the target can express the weights, an error where it cannot:
- PyTorch `nn.LSTM` / `nn.GRU` / `nn.RNN` state dicts (same gate orders and
  double bias as cuDNN): exact both ways (a `bias=False` module's reads with
  zero biases, the same function). Under skip_input, layer 0's
  `weight_ih` is the stacked identity; reading a state dict into a
  skip_input spec refuses any other matrix.
- Flax linen cells (`LSTMCell`, `OptimizedLSTMCell`, `GRUCell`, `SimpleCell`),
  one per layer and direction. Where the cell has one bias per gate, the two
  cuDNN biases are summed; reading back puts the sum in `bW` and zero in `bR`
  (the same function). GRU keeps both biases of the `n` gate, as Flax does.
- Flax nnx cells (`LSTMCell`, `OptimizedLSTMCell`, `GRUCell`, `SimpleCell`),
  modules built with the weights, or read back from modules or their
  pure-dict states; biases summed as for linen. `nnx.GRUCell` has no
  recurrent bias on the `n` gate, so a GRU whose one is nonzero is refused.
- Keras 3 `LSTM`, `GRU(reset_after=True)`, `SimpleRNN` weight lists
  (`[kernel, recurrent_kernel, bias]`): Keras orders GRU gates z, r, h; its
  LSTM and SimpleRNN have one bias (summed as for Flax). Keras GRU without
  `reset_after` computes a different function and is refused.
- TensorFlow 1 `tf.contrib.cudnn_rnn` checkpoints: the tensors its
  `CudnnOpaqueParamsSaveable` writes, under the same names
  (`[scope/]rnn/multi_rnn_cell/cell_<l>/cudnn_compatible_lstm_cell/kernel`,
  `.../stack_bidirectional_rnn/cell_<l>/bidirectional_rnn/fw/...`), in the
  format of its cuDNN-compatible cells: one `[in + H, g*H]` kernel (LSTM
  gates in TF's i, c, f, o order), the two cuDNN biases summed; GRU keeps its
  candidate's input and hidden projections apart, as cuDNN does. Reading back
  splits each summed bias into two halves, as TF1's restore does (the same
  function). Nothing here needs TensorFlow: read a checkpoint with
  `tf.train.load_checkpoint` and pass `{name: reader.get_tensor(name)}`.
- `jax.experimental.rnn` LSTM weights: its flat buffer is cuDNN's weight space
  for a double-bias LSTM with input matrices in every layer, which is the
  opaque buffer of a `linear_input` `CudnnLSTM`: taken as it is (checked and
  cast to the spec's dtype). A `skip_input` spec takes it when layer 0's input
  matrices are identities, and gives them back as identities.

The `to_*` functions return numpy arrays (torch tensors for
`to_torch_state_dict` when `as_tensors=True`; nnx modules for
`to_flax_nnx_cells`); the `from_*` ones return the opaque buffer, a
`jax.Array` in the spec's dtype, as `canonical_to_params` does. They read
each array of any real dtype (float, integer, bool); any other (complex,
object, PRNG keys) is a `TypeError` naming it (`_array`). A torch tensor is read
on any device and in any layout (sparse ones densified); one that holds no
values to read (a meta or quantized tensor) is an error naming it.

The `from_*` functions also trace: under `jit`, `grad` and `vmap` they take
traced arrays and are differentiable, so weights kept in another library's
format can be converted inside the step that trains them. A `skip_input`
spec is the exception: reading one checks that layer 0's input matrices are
identities, which needs their values, so traced ones are a `TypeError`. The
`to_*` functions return values (numpy arrays, torch tensors, nnx modules): a
traced `params` is a `TypeError` naming the function.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jax_cudnn_rnn import _layout, _params, _requirements, _spec


def _traced(*arrays) -> bool:
  return any(isinstance(a, jax.core.Tracer) for a in arrays)


def _split(a, parts: int, axis: int = 0) -> list:
  """`np.split`, or `jnp.split` for a traced `a`."""
  return (jnp if _traced(a) else np).split(a, parts, axis=axis)


def _zeros_like(a):
  return (jnp if _traced(a) else np).zeros_like(a)


def _array(where: str, a):
  """`a` (an array, a torch tensor or a nested list) as numpy, or an error
  naming `where` unless it holds real numbers (`_params.as_array`'s `real`);
  a traced array (under `jit`, `grad`, `vmap`) stays as it is, checked alike."""
  if _traced(a):
    return _params.check_real(where, a)
  if hasattr(a, "detach"):  # torch tensor
    a = _torch_values(where, a)
  return _params.as_array(where, a, np.asarray, real=True)


def _torch_values(where: str, tensor) -> np.ndarray:
  """A torch tensor's values as numpy, however it holds them: on any device, in
  a sparse layout, as a lazily conjugated or negated view, in a float type
  numpy lacks. A tensor that holds no values it can give (a meta tensor, a
  quantized one, one inside `torch.func`) is an error naming `where`, not
  torch's own message naming none."""
  import torch  # imported already: a tensor was given

  tensor = tensor.detach()
  if tensor.is_meta:
    raise ValueError(f"{where} is a meta tensor, which holds no values (a module built on the "
                     "meta device: load its weights before converting them)")
  if tensor.is_quantized:
    raise TypeError(f"{where} is a quantized tensor ({tensor.dtype}); pass its dequantize()")
  try:
    if tensor.layout != torch.strided:  # a sparse layout
      tensor = tensor.to_dense()
    tensor = tensor.cpu().resolve_conj().resolve_neg()
    if tensor.is_floating_point() and tensor.element_size() < 4:
      tensor = tensor.float()  # exact; numpy has no bfloat16 (or float8) for .numpy() to make
    return tensor.numpy()
  except (RuntimeError, TypeError) as e:  # e.g. a torch.func transform's wrapped tensor
    raise TypeError(f"{where}: cannot read the values of this {type(tensor).__name__} "
                    f"({tensor.dtype}, layout {tensor.layout}): {e}") from e


def _shaped(where: str, value, shape: tuple, context: str):
  """`value` as `_array` gives it, or a ValueError naming `where` unless it has `shape`."""
  array = _array(where, value)
  if array.shape != shape:
    raise ValueError(f"{where} has shape {array.shape}, expected {shape} {context}")
  return array


def _concrete(where: str, params) -> None:
  """A TypeError unless `params` is concrete: `where`, a `to_*` converter,
  returns values, which a traced buffer has none of."""
  if _traced(params):
    raise TypeError(
        f"{where} returns values, not a computation, so params must be a concrete array, "
        f"got a traced "
        f"{np.dtype(params.dtype).name}{list(params.shape)} (call it outside jit, grad and "
        "vmap, on the values they return)")


def _per_direction(spec, params):
  """`{(layer, direction): (W list | None, R list, bW list, bR list)}` as numpy
  (traced arrays for a traced `params`)."""
  weights, biases = spec.params_to_canonical(params)
  if not _traced(params):
    weights, biases = [np.asarray(w) for w in weights], [np.asarray(b) for b in biases]
  w_entries, b_entries = _layout.tensors(spec)
  g = spec.num_gates
  out = {}
  for layer in range(spec.num_layers):
    for d in range(spec.num_dirs):
      ws = [w for w, t in zip(weights, w_entries) if (t.layer, t.direction) == (layer, d)]
      bs = [b for b, t in zip(biases, b_entries) if (t.layer, t.direction) == (layer, d)]
      W = ws[:g] if len(ws) == 2 * g else None
      out[layer, d] = (W, ws[-g:], bs[:g], bs[g:])
  return out


def _from_per_direction(spec, per_direction):
  weights, biases = [], []
  for layer in range(spec.num_layers):
    for d in range(spec.num_dirs):
      W, R, bW, bR = per_direction[layer, d]
      if spec.layer_has_input_weights(layer):
        weights += list(W)
      weights += list(R)
      biases += list(bW) + list(bR)
  return spec.canonical_to_params(weights, biases)


def _identity_inputs(spec):
  return [np.eye(spec.num_units, dtype=spec.dtype)] * spec.num_gates


def _check_skip_identity(spec, W, where: str):
  if _traced(*W):
    raise TypeError(
        f"{where}: {spec} uses skip_input, so layer 0's input matrices must be identities, "
        "which needs their values, but they are traced (under jit, grad or vmap): convert "
        "outside them, or use a linear_input spec, which keeps those matrices")
  eye = np.eye(spec.num_units)
  if not all(np.array_equal(np.asarray(w, np.float64), eye) for w in W):
    raise ValueError(f"{where}: the spec uses skip_input, so layer 0's input matrices must be "
                     "identities; these are not, and cannot be represented")


def _grid(name: str, value, spec):
  """`value` checked to be `[num_layers][num_dirs]` nested sequences."""
  layers, dirs = spec.num_layers, spec.num_dirs
  if not isinstance(value, Sequence) or len(value) != layers:
    raise ValueError(f"{name} must hold {layers} entries (one per layer of {spec}), got "
                     f"{len(value) if isinstance(value, Sequence) else type(value).__name__}")
  for layer, entry in enumerate(value):
    if not isinstance(entry, Sequence) or len(entry) != dirs:
      raise ValueError(f"{name}[{layer}] must hold {dirs} entries (one per direction), got "
                       f"{len(entry) if isinstance(entry, Sequence) else type(entry).__name__}")
  return value


# -- PyTorch -------------------------------------------------------------------------


def _torch_keys(layer, d) -> list[str]:
  """The state-dict keys of one layer and direction: `weight_ih`, `weight_hh`,
  `bias_ih`, `bias_hh` (the order of `W, R, bW, bR`)."""
  suffix = f"l{layer}" + ("_reverse" if d == 1 else "")
  return [f"{k}_{suffix}" for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]


@_spec.takes_spec
def to_torch_state_dict(spec, params, *, as_tensors: bool = False) -> dict:
  """Keys and values of `torch.nn.LSTM/GRU/RNN(..., bias=True)` with the same config:
  numpy arrays, or with `as_tensors` torch tensors of the spec's dtype (a
  bfloat16 spec's are `torch.bfloat16`, as `module.to(torch.bfloat16)` holds)."""
  _concrete("to_torch_state_dict", params)
  _spec.check_bool("as_tensors", as_tensors)
  out = {}
  for (layer, d), (W, R, bW, bR) in _per_direction(spec, params).items():
    W = _identity_inputs(spec) if W is None else W
    out.update(zip(_torch_keys(layer, d), map(np.concatenate, (W, R, bW, bR))))
  if as_tensors:
    torch = _requirements.optional_import("torch", "interop.to_torch_state_dict(as_tensors=True)")
    dtype = getattr(torch, spec.dtype.name)  # the four spec dtypes have torch's names
    # torch.from_numpy takes no bfloat16 array: through float32, exactly.
    out = {k: torch.from_numpy(np.ascontiguousarray(v, np.float32 if v.dtype.itemsize < 4
                                                    else v.dtype)).to(dtype)
           for k, v in out.items()}
  return out


def _torch_prefix_hint(keys) -> str:
  """Where `keys` hold an RNN's under a submodule's prefix (a whole model's
  state dict, `rnn.weight_ih_l0`), how to pass that RNN's alone."""
  prefixes = sorted({k[:-len("weight_ih_l0")] for k in keys if isinstance(k, str)
                     and k.endswith(".weight_ih_l0")})
  if not prefixes:
    return ""
  first = prefixes[0]
  return (f"; they hold an RNN's keys under the prefix{'es' if len(prefixes) > 1 else ''} "
          f"{', '.join(map(repr, prefixes))} (a whole model's state dict): pass that "
          f"RNN's, such as module.get_submodule({first[:-1]!r}).state_dict() or "
          f"{{k.removeprefix({first!r}): v for k, v in state_dict.items() if "
          f"k.startswith({first!r})}}")


@_spec.takes_spec
def from_torch_state_dict(spec, state_dict: Mapping[str, Any]):
  """An opaque buffer from a torch RNN state dict (numpy arrays or tensors, of
  any float dtype: cast to the spec's, bfloat16 and float16 ones exactly).

  A module made with `bias=False` (a state dict with no `bias_*` key) reads
  with zero biases, the same function."""
  if not isinstance(state_dict, Mapping):
    hint = " (a module: pass module.state_dict())" if hasattr(state_dict, "state_dict") else ""
    raise TypeError(f"state_dict must be a mapping of names to arrays or tensors, got "
                    f"{type(state_dict).__name__}{hint}")
  g = spec.num_gates
  extra = set(state_dict) - {k for l in range(spec.num_layers) for d in range(spec.num_dirs)
                             for k in _torch_keys(l, d)}
  if extra:
    projection = any(isinstance(k, str) and k.startswith("weight_hr_") for k in extra)
    raise ValueError(f"state_dict has keys {sorted(extra, key=repr)} that {spec} has no place for"
                     + ("; LSTMs with proj_size are not supported" if projection else "")
                     + _torch_prefix_hint(extra))
  biased = any(isinstance(k, str) and k.startswith("bias_") for k in state_dict)
  per = {}
  for layer in range(spec.num_layers):
    for d in range(spec.num_dirs):
      keys = _torch_keys(layer, d) if biased else _torch_keys(layer, d)[:2]
      missing = [k for k in keys if k not in state_dict]
      if missing:
        raise ValueError(f"state_dict has no {missing[0]} (needed by {spec})")
      rows, units = g * spec.num_units, spec.num_units
      expected = ((rows, spec.layer_input_size(layer)), (rows, units), (rows,), (rows,))
      parts = [_shaped(f"state_dict['{k}']", state_dict[k], shape,
                       f"({g} gates of {units} units) for {spec}")
               for k, shape in zip(keys, expected)]
      if not biased:  # bias=False: zero biases compute the same function
        parts += [np.zeros(rows, parts[0].dtype)] * 2
      W, R, bW, bR = (_split(p, g) for p in parts)
      if not spec.layer_has_input_weights(layer):
        _check_skip_identity(spec, W, keys[0])
      per[layer, d] = (W, R, bW, bR)
  return _from_per_direction(spec, per)


# -- Flax linen cells ----------------------------------------------------------------

_LSTM_GATES = "ifgo"


@_spec.takes_spec
def flax_linen_cell(spec, cell: str = "LSTMCell"):
  """The Flax linen cell module matching `spec` (one per layer and direction)."""
  nn = _requirements.optional_import("flax.linen", "interop.flax_linen_cell")
  H = spec.num_units
  if spec.rnn_mode == "lstm":
    if cell not in ("LSTMCell", "OptimizedLSTMCell"):
      raise ValueError(f"cell must be 'LSTMCell' or 'OptimizedLSTMCell' for an LSTM, got {cell!r}")
    return getattr(nn, cell)(H, param_dtype=spec.dtype)
  if spec.rnn_mode == "gru":
    return nn.GRUCell(H, param_dtype=spec.dtype)
  act = jax.numpy.tanh if spec.rnn_mode == "rnn_tanh" else jax.nn.relu
  return nn.SimpleCell(H, activation_fn=act, param_dtype=spec.dtype)


@_spec.takes_spec
def to_flax_linen_cells(spec, params) -> list[list[dict]]:
  """Flax linen cell params `[layer][direction]` (each `{"kernel"...}` trees under cell names)."""
  _concrete("to_flax_linen_cells", params)
  out = [[None] * spec.num_dirs for _ in range(spec.num_layers)]
  for (layer, d), (W, R, bW, bR) in _per_direction(spec, params).items():
    W = _identity_inputs(spec) if W is None else W
    if spec.rnn_mode == "lstm":
      p = {f"i{k}": {"kernel": W[j].T} for j, k in enumerate(_LSTM_GATES)}
      p |= {f"h{k}": {"kernel": R[j].T, "bias": bW[j] + bR[j]} for j, k in enumerate(_LSTM_GATES)}
    elif spec.rnn_mode == "gru":
      p = {"ir": {"kernel": W[0].T, "bias": bW[0] + bR[0]},
           "iz": {"kernel": W[1].T, "bias": bW[1] + bR[1]},
           "in": {"kernel": W[2].T, "bias": bW[2]},
           "hr": {"kernel": R[0].T}, "hz": {"kernel": R[1].T},
           "hn": {"kernel": R[2].T, "bias": bR[2]}}
    else:
      p = {"i": {"kernel": W[0].T, "bias": bW[0] + bR[0]}, "h": {"kernel": R[0].T}}
    out[layer][d] = p
  return out


@_spec.takes_spec
def from_flax_linen_cells(spec, cells: Sequence[Sequence[Mapping]]):
  """An opaque buffer from Flax linen cell params `[layer][direction]`."""
  cells = _grid("cells", cells, spec)
  per = {}
  for layer in range(spec.num_layers):
    for d in range(spec.num_dirs):
      cell = c = cells[layer][d]
      c = c.get("params", c)
      H = spec.num_units

      def leaf(name, part, shape):
        return _shaped(f"cells[{layer}][{d}]['{name}']['{part}']", c[name][part], shape,
                       f"for {spec}")

      # Input kernels are named i*, recurrent ones h*; Flax kernels are [in, out].
      k = lambda name: leaf(name, "kernel", (
          (spec.layer_input_size(layer) if name[0] == "i" else H), H)).T
      b = lambda name: leaf(name, "bias", (H,))
      try:
        if spec.rnn_mode == "lstm":
          W = [k(f"i{q}") for q in _LSTM_GATES]
          R = [k(f"h{q}") for q in _LSTM_GATES]
          bW = [b(f"h{q}") for q in _LSTM_GATES]
          bR = [_zeros_like(x) for x in bW]
        elif spec.rnn_mode == "gru":
          W = [k("ir"), k("iz"), k("in")]
          R = [k("hr"), k("hz"), k("hn")]
          bW = [b("ir"), b("iz"), b("in")]
          bR = [_zeros_like(bW[0]), _zeros_like(bW[1]), b("hn")]
        else:
          W, R, bW = [k("i")], [k("h")], [b("i")]
          bR = [_zeros_like(bW[0])]
      except KeyError as e:
        inside = _paths_to(cell, e.args[0])
        hint = (f"; it holds {'one' if len(inside) == 1 else 'some'} at {', '.join(inside)}: "
                "pass the cell's own (an nn.RNN holds its cell under 'cell')") if inside else ""
        raise ValueError(f"cells[{layer}][{d}] has no {e.args[0]!r}: not a Flax cell of "
                         f"{spec.rnn_mode}{hint}") from None
      if not spec.layer_has_input_weights(layer):
        _check_skip_identity(spec, W, f"cells[0][{d}]")
      per[layer, d] = (W, R, bW, bR)
  return _from_per_direction(spec, per)


def _paths_to(tree, key, depth: int = 4) -> list[str]:
  """The paths (`['params']['cell']`) of the mappings inside `tree` holding
  `key`, at most `depth` levels down: where a module's variables hold the cell
  that was asked for."""
  if depth == 0 or not isinstance(tree, Mapping):
    return []
  found = []
  for name, value in tree.items():
    if isinstance(value, Mapping):
      if key in value:
        found.append(f"[{name!r}]")
      found += [f"[{name!r}]{path}" for path in _paths_to(value, key, depth - 1)]
  return found


# -- Flax nnx cells -----------------------------------------------------------------

_NNX_CELLS = {"lstm": ("LSTMCell", "OptimizedLSTMCell"), "gru": ("GRUCell",),
              "rnn_tanh": ("SimpleCell",), "rnn_relu": ("SimpleCell",)}


# Parameter names that one of each kind of nnx cell has (LSTMCell's `hi`, the
# others' `dense_h`): where a tree holds them deeper down, it holds cells.
_NNX_CELL_MARKS = ("hi", "dense_h")


def _nnx_cell_kind(spec, cell: str) -> str:
  kinds = _NNX_CELLS[spec.rnn_mode]
  if cell is None:
    return kinds[0]
  if cell not in kinds:
    raise ValueError(f"cell must be one of {kinds} for {spec.rnn_mode}, got {cell!r}")
  return cell


@_spec.takes_spec
def flax_nnx_cell(spec, layer: int, cell: str | None = None, *, rngs=None):
  """A Flax nnx cell module for `layer` of `spec` (its weights freshly initialised)."""
  nnx = _requirements.optional_import("flax.nnx", "interop.flax_nnx_cell")
  kind = _nnx_cell_kind(spec, cell)
  rngs = nnx.Rngs(0) if rngs is None else rngs
  if not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"rngs must be an nnx.Rngs or None, got {type(rngs).__name__}")
  cls = getattr(nnx, kind)
  kwargs = dict(param_dtype=spec.dtype, dtype=spec.dtype, rngs=rngs)
  if spec.rnn_mode in ("rnn_tanh", "rnn_relu"):
    kwargs["activation_fn"] = jax.numpy.tanh if spec.rnn_mode == "rnn_tanh" else jax.nn.relu
  if spec.dtype.itemsize < 4:
    # Flax's orthogonal initializers take a QR, which XLA:CPU has not in
    # bfloat16 or float16: the cell's own initializers, run in float32 and cast.
    kwargs |= {name: _in_float32(p.default)
               for name, p in inspect.signature(cls.__init__).parameters.items()
               if name.endswith("_init") and callable(p.default)}
  return cls(spec.layer_input_size(layer), spec.num_units, **kwargs)


def _in_float32(init):
  """`init(key, shape, dtype)` computed in float32, then cast to `dtype`."""
  return lambda key, shape, dtype=jnp.float32: init(key, shape, jnp.float32).astype(dtype)


def _nnx_tree(kind, W, R, bW, bR, where):
  """The pure-dict params of one nnx cell of `kind` from per-gate tensors."""
  cat = lambda ms: np.concatenate([m.T for m in ms], axis=1)
  if kind == "LSTMCell":  # per-gate modules, as in linen (`if` is spelled `if_`)
    names = ["ii", "if_", "ig", "io"]
    tree = {n: {"kernel": W[j].T} for j, n in enumerate(names)}
    return tree | {f"h{k}": {"kernel": R[j].T, "bias": bW[j] + bR[j]}
                   for j, k in enumerate(_LSTM_GATES)}
  if kind == "OptimizedLSTMCell":
    return {"dense_i": {"kernel": cat(W)},
            "dense_h": {"kernel": cat(R), "bias": np.concatenate([a + b for a, b in zip(bW, bR)])}}
  if kind == "GRUCell":
    if np.any(bR[2] != 0):
      raise ValueError(
          f"{where}: nnx.GRUCell has no recurrent bias on the n gate (it computes "
          "n = tanh(W_n x + b_n + r * (R_n h))), but this GRU's recurrent n bias is nonzero "
          f"(max |b| = {np.max(np.abs(bR[2])):.3g}): the weights cannot be expressed exactly. "
          "Use the linen GRUCell (to_flax_linen_cells), which keeps that bias")
    return {"dense_i": {"kernel": cat(W), "bias": np.concatenate([bW[0] + bR[0], bW[1] + bR[1],
                                                                   bW[2]])},
            "dense_h": {"kernel": cat(R)}}
  return {"dense_i": {"kernel": W[0].T, "bias": bW[0] + bR[0]}, "dense_h": {"kernel": R[0].T}}


def _from_nnx_tree(kind, tree, g, units):
  """`(W, R, bW, bR)` from one nnx cell's pure-dict params (the inverse of `_nnx_tree`),
  their leaves numpy arrays already."""
  if kind == "LSTMCell":
    W = [tree[n]["kernel"].T for n in ("ii", "if_", "ig", "io")]
    R = [tree[f"h{q}"]["kernel"].T for q in _LSTM_GATES]
    bW = [tree[f"h{q}"]["bias"] for q in _LSTM_GATES]
  else:
    for name in ("dense_i", "dense_h"):
      if tree[name]["kernel"].shape[-1] != g * units:
        raise ValueError(name)
    kernel_i, kernel_h = tree["dense_i"]["kernel"].T, tree["dense_h"]["kernel"].T
    bias = tree["dense_h" if kind == "OptimizedLSTMCell" else "dense_i"]["bias"]
    W, R, bW = _split(kernel_i, g), _split(kernel_h, g), _split(bias, g)
  if any(r.shape != (units, units) for r in R):
    raise ValueError("R")
  return W, R, bW, [_zeros_like(b) for b in bW]


@_spec.takes_spec
def to_flax_nnx_cells(spec, params, cell: str | None = None) -> list[list[Any]]:
  """Flax nnx cell modules `[layer][direction]` holding the weights of `params`.

  `cell`: "LSTMCell" (default) or "OptimizedLSTMCell" for an LSTM; GRUs give
  `nnx.GRUCell`, which has no recurrent bias on the n gate, so a GRU whose
  recurrent n bias is nonzero is refused (the linen cells can hold it);
  RNNs give `nnx.SimpleCell` with the matching activation. Run them with
  `nnx.RNN(cell)` (the backward direction with `reverse=True, keep_order=True`).
  """
  _concrete("to_flax_nnx_cells", params)
  nnx = _requirements.optional_import("flax.nnx", "interop.to_flax_nnx_cells")
  kind = _nnx_cell_kind(spec, cell)
  out = [[None] * spec.num_dirs for _ in range(spec.num_layers)]
  for (layer, d), (W, R, bW, bR) in _per_direction(spec, params).items():
    W = _identity_inputs(spec) if W is None else W
    module = flax_nnx_cell(spec, layer, kind)
    state = nnx.state(module, nnx.Param)
    tree = _nnx_tree(kind, W, R, bW, bR, f"layer {layer}, direction {d}")
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(lambda a: a.astype(spec.dtype), tree))
    nnx.update(module, state)
    out[layer][d] = module
  return out


@_spec.takes_spec
def from_flax_nnx_cells(spec, cells: Sequence[Sequence[Any]]):
  """An opaque buffer from Flax nnx cells `[layer][direction]`: modules, or their
  `nnx.to_pure_dict(nnx.state(cell, nnx.Param))` trees."""
  nnx = _requirements.optional_import("flax.nnx", "interop.from_flax_nnx_cells")
  cells = _grid("cells", cells, spec)
  g = spec.num_gates
  per = {}
  for layer in range(spec.num_layers):
    for d in range(spec.num_dirs):
      c = cells[layer][d]
      where = f"cells[{layer}][{d}]"
      if isinstance(c, nnx.Module):
        if getattr(c, "residual", False):
          raise ValueError(f"{where} is a residual SimpleCell (h' = h + ...): not an RNN of "
                           f"{spec.rnn_mode}")
        tree = nnx.to_pure_dict(nnx.state(c, nnx.Param))
      elif isinstance(c, Mapping):
        tree = c
      else:
        raise TypeError(f"{where} must be a Flax nnx cell or its pure-dict params, got "
                        f"{type(c).__name__}")
      if not any(k in tree for k in _NNX_CELL_MARKS):  # a module holding cells, say an nnx.RNN
        inside = sorted({p for k in _NNX_CELL_MARKS for p in _paths_to(tree, k)})
        if inside:
          raise ValueError(f"{where} is not a Flax nnx cell but holds "
                           f"{'one' if len(inside) == 1 else 'some'} at {', '.join(inside)}: "
                           "pass the cell itself (an nnx.RNN's is its .cell)")
      tree = jax.tree_util.tree_map_with_path(
          lambda path, leaf: _array(where + jax.tree_util.keystr(path), leaf), tree)
      kind = "LSTMCell" if spec.rnn_mode == "lstm" and "ii" in tree else \
          _NNX_CELLS[spec.rnn_mode][-1]
      try:
        W, R, bW, bR = _from_nnx_tree(kind, tree, g, spec.num_units)
      except (KeyError, TypeError, ValueError):
        raise ValueError(f"{where} has params {sorted(tree)} with shapes that are not those of "
                         f"a Flax nnx cell of {spec.rnn_mode} "
                         f"(one of {_NNX_CELLS[spec.rnn_mode]}, {spec.num_units} features)"
                         ) from None
      if not spec.layer_has_input_weights(layer):
        _check_skip_identity(spec, W, where)
      per[layer, d] = (W, R, bW, bR)
  return _from_per_direction(spec, per)


# -- Keras 3 ---------------------------------------------------------------------------

# Keras's gate order, as indices into cuDNN's: GRU is (z, r, h).
_KERAS_ORDER = {"lstm": [0, 1, 2, 3], "gru": [1, 0, 2], "rnn_tanh": [0], "rnn_relu": [0]}


@_spec.takes_spec
def to_keras_weights(spec, params) -> list[list[list[np.ndarray]]]:
  """Keras 3 layer weights `[layer][direction] = [kernel, recurrent_kernel, bias]`.

  For GRU the layer must be `GRU(reset_after=True)` (bias shape `[2, 3H]`).
  """
  _concrete("to_keras_weights", params)
  order = _KERAS_ORDER[spec.rnn_mode]
  out = [[None] * spec.num_dirs for _ in range(spec.num_layers)]
  for (layer, d), (W, R, bW, bR) in _per_direction(spec, params).items():
    W = _identity_inputs(spec) if W is None else W
    kernel = np.concatenate([W[j].T for j in order], axis=1)
    recurrent = np.concatenate([R[j].T for j in order], axis=1)
    if spec.rnn_mode == "gru":
      bias = np.stack([np.concatenate([bW[j] for j in order]),
                       np.concatenate([bR[j] for j in order])])
    else:
      bias = np.concatenate([bW[j] + bR[j] for j in order])
    out[layer][d] = [kernel, recurrent, bias]
  return out


@_spec.takes_spec
def from_keras_weights(spec, weights: Sequence[Sequence[Sequence[Any]]]):
  """An opaque buffer from Keras 3 weights `[layer][direction] = [kernel, recurrent, bias]`
  (`[kernel, recurrent]` from a layer with `use_bias=False`: zero biases)."""
  order = _KERAS_ORDER[spec.rnn_mode]
  inverse = np.argsort(order)
  g = spec.num_gates
  weights = _grid("weights", weights, spec)
  per = {}
  for layer in range(spec.num_layers):
    for d in range(spec.num_dirs):
      where, given = f"weights[{layer}][{d}]", weights[layer][d]
      if len(given) not in (2, 3):
        raise ValueError(f"{where} must be [kernel, recurrent_kernel, bias] (or without the "
                         f"bias, use_bias=False), got {len(given)} arrays"
                         + (" (a Bidirectional layer's? its forward layer's are the first "
                            "three, its backward's the last)" if len(given) == 6 else ""))
      kernel, recurrent, *rest = given
      cols = g * spec.num_units
      # use_bias=False: zero biases compute the same function.
      bias = rest[0] if rest else np.zeros((2, cols) if spec.rnn_mode == "gru" else cols,
                                           np.float32)
      gates = f"({g} gates of {spec.num_units} units) for {spec}"
      kernel = _shaped(f"{where} kernel", kernel, (spec.layer_input_size(layer), cols), gates)
      recurrent = _shaped(f"{where} recurrent_kernel", recurrent, (spec.num_units, cols), gates)
      bias = (_array(f"{where} bias", bias)
              if spec.rnn_mode == "gru"  # its own check below names reset_after
              else _shaped(f"{where} bias", bias, (cols,), f"for {spec}"))

      def split(m):  # into gates, in cuDNN's order
        parts = _split(m, g, axis=-1)
        return [parts[j] for j in inverse]

      W = [w.T for w in split(kernel)]
      R = [r.T for r in split(recurrent)]
      if spec.rnn_mode == "gru":
        if bias.shape != (2, g * spec.num_units):
          raise ValueError(f"GRU bias must have shape (2, {g * spec.num_units}) "
                           f"(Keras GRU(reset_after=True)), got {bias.shape}: a GRU without "
                           "reset_after computes a different function")
        bW, bR = split(bias[0]), split(bias[1])
      else:
        bW = split(bias)
        bR = [_zeros_like(x) for x in bW]
      if not spec.layer_has_input_weights(layer):
        _check_skip_identity(spec, W, f"weights[0][{d}] kernel")
      per[layer, d] = (W, R, bW, bR)
  return _from_per_direction(spec, per)


# -- TensorFlow 1 (tf.contrib.cudnn_rnn checkpoints) ---------------------------------

_TF1_CELLS = {"lstm": "cudnn_compatible_lstm_cell", "gru": "cudnn_compatible_gru_cell",
              "rnn_tanh": "basic_rnn_cell", "rnn_relu": "basic_rnn_cell"}
# TF1's LSTM cells order the gates i, c, f, o; as indices into cuDNN's i, f, c, o.
_TF1_LSTM_ORDER = [0, 2, 1, 3]
_TF1_GRU_WEIGHTS = ("gates/kernel", "candidate/input_projection/kernel",
                    "candidate/hidden_projection/kernel")
_TF1_GRU_BIASES = ("gates/bias", "candidate/input_projection/bias",
                   "candidate/hidden_projection/bias")


def _tf1_prefix(spec, layer: int, d: int, scope: str | None) -> str:
  if scope is not None and not isinstance(scope, str):
    raise TypeError(f"scope must be a str or None, got {type(scope).__name__}")
  cell = _TF1_CELLS[spec.rnn_mode]
  if spec.num_dirs == 1:
    prefix = f"rnn/multi_rnn_cell/cell_{layer}/{cell}"
  else:
    prefix = f"stack_bidirectional_rnn/cell_{layer}/bidirectional_rnn/{('fw', 'bw')[d]}/{cell}"
  return f"{scope.rstrip('/')}/{prefix}" if scope else prefix


def _tf1_leaves(spec) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """Weight and bias leaf names of one cell."""
  if spec.rnn_mode == "gru":
    return _TF1_GRU_WEIGHTS, _TF1_GRU_BIASES
  return ("kernel",), ("bias",)


@_spec.takes_spec
def tf1_checkpoint_names(spec, *, scope: str | None = None) -> list[str]:
  """The names TF1's `CudnnOpaqueParamsSaveable` saves for `spec`, in its order:
  every weight (layer by layer, forward then backward direction), then every bias.

  `scope` is the saveable's variable scope: for the `tf.contrib.cudnn_rnn.CudnnLSTM`
  *layer* it is the layer's scope (for example "cudnn_lstm"); None for none.
  """
  weights, biases = _tf1_leaves(spec)
  prefixes = [_tf1_prefix(spec, layer, d, scope) for layer in range(spec.num_layers)
              for d in range(spec.num_dirs)]
  return ([f"{p}/{leaf}" for p in prefixes for leaf in weights]
          + [f"{p}/{leaf}" for p in prefixes for leaf in biases])


@_spec.takes_spec
def to_tf1_checkpoint(spec, params, *, scope: str | None = None) -> dict[str, np.ndarray]:
  """`{name: array}` as TF1's `CudnnOpaqueParamsSaveable` saves `params` (see module doc).

  Under skip_input, layer 0's kernel holds identity input rows (what cuDNN applies).
  """
  _concrete("to_tf1_checkpoint", params)
  weights, biases = {}, {}
  for (layer, d), (W, R, bW, bR) in _per_direction(spec, params).items():
    W = _identity_inputs(spec) if W is None else W
    prefix = _tf1_prefix(spec, layer, d, scope)
    both = lambda j: np.concatenate([W[j], R[j]], axis=1)  # [H, in + H]
    if spec.rnn_mode == "lstm":
      weights[f"{prefix}/kernel"] = np.concatenate([both(j) for j in _TF1_LSTM_ORDER]).T
      biases[f"{prefix}/bias"] = np.concatenate([bW[j] + bR[j] for j in _TF1_LSTM_ORDER])
    elif spec.rnn_mode == "gru":
      for leaf, value in zip(_TF1_GRU_WEIGHTS,
                             (np.concatenate([both(0), both(1)]).T, W[2].T, R[2].T)):
        weights[f"{prefix}/{leaf}"] = value
      for leaf, value in zip(_TF1_GRU_BIASES,
                             (np.concatenate([bW[0] + bR[0], bW[1] + bR[1]]), bW[2], bR[2])):
        biases[f"{prefix}/{leaf}"] = value
    else:
      weights[f"{prefix}/kernel"] = both(0).T
      biases[f"{prefix}/bias"] = bW[0] + bR[0]
  return weights | biases


def _tf1_missing_message(spec, tensors, missing: list[str], scope) -> str:
  message = (f"tensors has no {missing[0]!r}" + (f" (and {len(missing) - 1} more names)"
                                                  if len(missing) > 1 else "")
             + f", needed by {spec} with scope={scope!r}")
  leaf = missing[0].split("/rnn/")[-1].split("/stack_bidirectional_rnn/")[-1]
  similar = sorted(k for k in tensors if str(k).endswith(leaf))
  if similar:
    message += f"; names ending alike: {similar[:3]} (is the scope right?)"
  return message


@_spec.takes_spec
def from_tf1_checkpoint(spec, tensors: Mapping[str, Any], *, scope: str | None = None):
  """An opaque buffer from TF1 `tf.contrib.cudnn_rnn` checkpoint tensors.

  `tensors` maps names to arrays; only the names `tf1_checkpoint_names(spec,
  scope=scope)` are read, so a whole checkpoint's variables may be passed. A
  missing name or a wrong shape raises `ValueError` naming it.
  """
  if not isinstance(tensors, Mapping):
    raise TypeError(f"tensors must be a mapping of names to arrays, got {type(tensors).__name__}")
  missing = [n for n in tf1_checkpoint_names(spec, scope=scope) if n not in tensors]
  if missing:
    raise ValueError(_tf1_missing_message(spec, tensors, missing, scope))
  H, g = spec.num_units, spec.num_gates

  def get(name, shape):
    value = _array(f"tensors[{name!r}]", tensors[name])
    if value.shape != shape:
      raise ValueError(f"tensors[{name!r}] must have shape {shape}, got {value.shape}")
    return value

  per = {}
  for layer in range(spec.num_layers):
    in_size = spec.layer_input_size(layer)
    for d in range(spec.num_dirs):
      prefix = _tf1_prefix(spec, layer, d, scope)
      if spec.rnn_mode == "gru":
        gates_k, input_k, hidden_k = (f"{prefix}/{leaf}" for leaf in _TF1_GRU_WEIGHTS)
        gates_b, input_b, hidden_b = (f"{prefix}/{leaf}" for leaf in _TF1_GRU_BIASES)
        gates = get(gates_k, (in_size + H, 2 * H)).T
        W = [gates[:H, :in_size], gates[H:, :in_size], get(input_k, (in_size, H)).T]
        R = [gates[:H, in_size:], gates[H:, in_size:], get(hidden_k, (H, H)).T]
        summed = _split(get(gates_b, (2 * H,)), 2)
        bW = [summed[0] / 2, summed[1] / 2, get(input_b, (H,))]
        bR = [summed[0] / 2, summed[1] / 2, get(hidden_b, (H,))]
      else:
        order = _TF1_LSTM_ORDER if spec.rnn_mode == "lstm" else [0]
        inverse = np.argsort(order)
        blocks = _split(get(f"{prefix}/kernel", (in_size + H, g * H)).T, g)
        summed = _split(get(f"{prefix}/bias", (g * H,)), g)
        W = [blocks[j][:, :in_size] for j in inverse]
        R = [blocks[j][:, in_size:] for j in inverse]
        bW = bR = [summed[j] / 2 for j in inverse]
      if not spec.layer_has_input_weights(layer):
        _check_skip_identity(spec, W, f"{prefix}: the kernel's input rows")
      per[layer, d] = (W, R, bW, bR)
  return _from_per_direction(spec, per)


# -- jax.experimental.rnn ------------------------------------------------------------


def _jax_rnn_twin(spec, where: str):
  """The `linear_input` LSTM spec whose opaque buffer is `jax.experimental.rnn`'s."""
  if spec.rnn_mode != "lstm":
    raise ValueError(f"{where}: jax.experimental.rnn has LSTMs only, got {spec}")
  return dataclasses.replace(spec, input_mode="linear_input")


@_spec.takes_spec
def from_jax_experimental_rnn(spec, weights):
  """An opaque buffer from `jax.experimental.rnn`'s LSTM `weights`.

  The buffer of `jax.experimental.rnn.init_lstm_weight(key, input_size,
  hidden_size, num_layers, bidirectional)` belongs to
  `CudnnLSTM(num_layers, hidden_size, input_size, direction=...)`, and
  `rnn.lstm(x, h0, c0, weights, seq_lengths, input_size, hidden_size,
  num_layers, dropout=0.0, bidirectional)` is then
  `spec(x, h0, c0, params, seq_lengths=seq_lengths, time_major=False)`.

  Args:
    spec: a `CudnnLSTM`.
    weights: `[params_size]` for the `linear_input` twin of `spec` (equal to
      `spec.params_size()` unless `spec` uses `skip_input`).

  Returns:
    The `[spec.params_size()]` opaque buffer, in `spec.dtype`.
  """
  twin = _jax_rnn_twin(spec, "from_jax_experimental_rnn")
  flat = _shaped("weights", weights, (twin.params_size(),),
                 f"(jax.experimental.rnn's buffer for {twin})")
  flat = jnp.asarray(flat, spec.dtype)
  if twin == spec:  # the same layout: nothing moves
    return flat
  per = _per_direction(twin, flat)
  for d in range(spec.num_dirs):
    _check_skip_identity(spec, per[0, d][0], f"weights (layer 0, direction {d})")
  return _from_per_direction(spec, per)


@_spec.takes_spec
def to_jax_experimental_rnn(spec, params) -> np.ndarray:
  """`jax.experimental.rnn`'s flat LSTM weights from an opaque buffer of `spec`.

  In `spec.dtype`: `jax.experimental.rnn` itself computes in float32 only.
  Under `skip_input`, layer 0's input matrices are written as identities.
  """
  _concrete("to_jax_experimental_rnn", params)
  twin = _jax_rnn_twin(spec, "to_jax_experimental_rnn")
  if twin == spec:  # the same layout: nothing moves
    return np.array(_params._check_params(spec, params))
  per = {key: (_identity_inputs(spec) if W is None else W, R, bW, bR)
         for key, (W, R, bW, bR) in _per_direction(spec, params).items()}
  return np.array(_from_per_direction(twin, per))
