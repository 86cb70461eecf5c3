"""Converters: round trips, and outputs equal to PyTorch modules, Keras layers, Flax cells."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import interop
from helpers import SPEC_CLASSES, call, random_inputs

CONFIGS = [(cls, d, m) for cls in SPEC_CLASSES for d in ("unidirectional", "bidirectional")
           for m in ("linear_input", "skip_input")]


def _spec(cls, direction, mode, layers=2):
  return cls(layers, 4, 4 if mode == "skip_input" else 3, input_mode=mode, direction=direction,
             dtype=jnp.float64)


@pytest.mark.parametrize("cls,direction,mode", CONFIGS)
def test_torch_state_dict_round_trip(cls, direction, mode):
  spec = _spec(cls, direction, mode)
  params = spec.init_params(jax.random.key(0))
  sd = interop.to_torch_state_dict(spec, params)
  g = spec.num_gates
  assert sd["weight_hh_l1"].shape == (g * 4, 4)
  assert sd["weight_ih_l1"].shape == (g * 4, 4 * spec.num_dirs)
  np.testing.assert_array_equal(interop.from_torch_state_dict(spec, sd), params)


def test_torch_refusals():
  spec = jcr.CudnnLSTM(1, 4, 4, input_mode="skip_input")
  sd = interop.to_torch_state_dict(spec, spec.init_params(jax.random.key(0)))
  sd["weight_ih_l0"] = sd["weight_ih_l0"] + 1
  with pytest.raises(ValueError, match="skip_input"):
    interop.from_torch_state_dict(spec, sd)
  with pytest.raises(ValueError, match="no weight_hh_l0"):
    interop.from_torch_state_dict(spec, {"weight_ih_l0": sd["weight_ih_l0"]})
  good = interop.to_torch_state_dict(spec, spec.init_params(jax.random.key(0)))
  with pytest.raises(ValueError, match=r"weight_hr_l0.*LSTMs with proj_size are not supported"):
    interop.from_torch_state_dict(spec, good | {"weight_hr_l0": np.zeros((4, 4))})

  class Module:  # has a state_dict, as a torch module has
    def state_dict(self):
      return good
  with pytest.raises(TypeError, match=r"state_dict must be a mapping .*got Module "
                                      r"\(a module: pass module.state_dict\(\)\)"):
    interop.from_torch_state_dict(spec, Module())
  with pytest.raises(TypeError, match=r"state_dict must be a mapping .*got list$"):
    interop.from_torch_state_dict(spec, list(good.items()))
  gru = jcr.CudnnGRU(1, 4, 4)
  gru_sd = interop.to_torch_state_dict(gru, gru.init_params(jax.random.key(0)))
  with pytest.raises(ValueError, match=r"state_dict\['weight_ih_l0'\] has shape \(12, 4\), "
                                       r"expected \(16, 4\) \(4 gates of 4 units\)"):
    interop.from_torch_state_dict(spec, gru_sd)  # a GRU's state dict into an LSTM


def test_a_whole_models_torch_state_dict_names_the_rnns_prefix():
  """A model's state dict holding the RNN as a submodule (`encoder.rnn.weight_ih_l0`)
  is refused with the way to pass the RNN's alone, and that way works."""
  spec = jcr.CudnnGRU(2, 4, 3, direction="bidirectional")
  rnn = interop.to_torch_state_dict(spec, spec.init_params(jax.random.key(0)))
  model = {"embed.weight": np.zeros((9, 3))} | {f"encoder.rnn.{k}": v for k, v in rnn.items()}
  prefix = "encoder.rnn."
  with pytest.raises(ValueError, match=(
      r"no place for; they hold an RNN's keys under the prefix 'encoder\.rnn\.' \(a whole "
      r"model's state dict\): pass that RNN's, such as module\.get_submodule\('encoder\.rnn'\)"
      r"\.state_dict\(\) or \{k\.removeprefix\('encoder\.rnn\.'\): v for k, v in "
      r"state_dict\.items\(\) if k\.startswith\('encoder\.rnn\.'\)\}$")):
    interop.from_torch_state_dict(spec, model)
  state_dict = model  # the hint's expression, as written
  alone = {k.removeprefix(prefix): v for k, v in state_dict.items() if k.startswith(prefix)}
  np.testing.assert_array_equal(interop.from_torch_state_dict(spec, alone),
                                interop.from_torch_state_dict(spec, rnn))
  with pytest.raises(ValueError, match=r"has keys \['a', 1\] that .* no place for$"):
    interop.from_torch_state_dict(spec, rnn | {1: 0, "a": 0})  # keys of mixed types, no hint


def _torch_module(torch, rnn_mode: str, **kwargs):
  """`torch.nn.LSTM`, `GRU` or `RNN` for `rnn_mode`, made with `kwargs`."""
  if rnn_mode.startswith("rnn_"):
    return torch.nn.RNN(nonlinearity=rnn_mode.removeprefix("rnn_"), **kwargs)
  return {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[rnn_mode](**kwargs)


def _torch_outputs(torch, module, x, h, c):
  """The module's `(outputs, h, c)` (`c` None but for the LSTM) as numpy."""
  with torch.no_grad():
    state = (torch.from_numpy(h), torch.from_numpy(c)) if c is not None else torch.from_numpy(h)
    y, state = module(torch.from_numpy(x), state)
  h, c = state if c is not None else (state, None)
  return y.numpy(), h.numpy(), None if c is None else c.numpy()


@pytest.mark.parametrize("cls,direction", [(c, d) for c in SPEC_CLASSES
                                           for d in ("unidirectional", "bidirectional")])
def test_outputs_equal_torch_module(cls, direction):
  torch = pytest.importorskip("torch")
  spec = cls(2, 5, 3, direction=direction, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  kwargs = dict(input_size=3, hidden_size=5, num_layers=2, bidirectional=direction == "bidirectional",
                dtype=torch.float64)
  module = _torch_module(torch, spec.rnn_mode, **kwargs)
  module.load_state_dict(interop.to_torch_state_dict(spec, params, as_tensors=True))
  x, h, c = random_inputs(spec, 6, 2)
  ty, th, tc = _torch_outputs(torch, module, x, h, c)
  y, hn, cn = call(spec, x, h, c, params, is_training=False)
  np.testing.assert_allclose(y, ty, rtol=1e-10, atol=1e-12)
  np.testing.assert_allclose(hn, th, rtol=1e-10, atol=1e-12)
  if c is not None:
    np.testing.assert_allclose(cn, tc, rtol=1e-10, atol=1e-12)
  # And back from the module's own state dict.
  np.testing.assert_array_equal(interop.from_torch_state_dict(spec, module.state_dict()), params)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_a_torch_module_without_biases_reads_with_zero_biases(cls):
  """`torch.nn.LSTM(..., bias=False)` computes what our double-bias model
  computes with zero biases: its state dict reads so (it was refused), and the
  outputs are the module's."""
  torch = pytest.importorskip("torch")
  spec = cls(2, 5, 3, direction="bidirectional", dtype=jnp.float64)
  kwargs = dict(input_size=3, hidden_size=5, num_layers=2, bidirectional=True, bias=False,
                dtype=torch.float64)
  torch.manual_seed(0)
  module = _torch_module(torch, spec.rnn_mode, **kwargs)
  params = interop.from_torch_state_dict(spec, module.state_dict())
  _, biases = spec.params_to_canonical(params)
  assert all(np.all(np.asarray(b) == 0) for b in biases)
  x, h, c = random_inputs(spec, 6, 2)
  y, _, _ = call(spec, x, h, c, params, is_training=False)
  np.testing.assert_allclose(y, _torch_outputs(torch, module, x, h, c)[0], rtol=1e-10, atol=1e-12)
  # Some biases but not all is a state dict missing one.
  partial = dict(module.state_dict()) | {"bias_ih_l0": torch.zeros(spec.num_gates * 5)}
  with pytest.raises(ValueError, match=r"^state_dict has no bias_hh_l0 \(needed by Cudnn"):
    interop.from_torch_state_dict(spec, partial)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_torch_half_precision_state_dicts_both_ways(dtype):
  """A bfloat16 module's state dict (whose tensors numpy cannot hold) reads
  exactly, and `as_tensors` gives tensors of the spec's dtype."""
  torch = pytest.importorskip("torch")
  spec = jcr.CudnnGRU(2, 5, 3, direction="bidirectional", dtype=jnp.dtype(dtype))
  params = spec.init_params(jax.random.key(0))
  state = interop.to_torch_state_dict(spec, params, as_tensors=True)
  assert {v.dtype for v in state.values()} == {getattr(torch, dtype)}
  module = torch.nn.GRU(3, 5, 2, bidirectional=True).to(getattr(torch, dtype))
  module.load_state_dict(state)
  back = interop.from_torch_state_dict(spec, module.state_dict())
  assert back.dtype == spec.dtype
  np.testing.assert_array_equal(np.asarray(back, np.float32), np.asarray(params, np.float32))
  # Into a float32 spec: the same values, widened.
  wide = dataclasses.replace(spec, dtype=jnp.dtype(jnp.float32))
  np.testing.assert_array_equal(interop.from_torch_state_dict(wide, module.state_dict()),
                                np.asarray(params, np.float32))


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")  # deprecated in torch 2.13
def test_torch_tensors_however_they_hold_their_values():
  """Sparse tensors and lazily negated or conjugated views read as their
  values; a tensor with no values to give (meta, quantized, one inside a
  `torch.func` transform) is an error naming its key, not torch's naming none."""
  torch = pytest.importorskip("torch")
  spec = jcr.CudnnGRU(1, 4, 3)
  module = torch.nn.GRU(3, 4)
  state = module.state_dict()
  expected = np.asarray(interop.from_torch_state_dict(spec, state))
  views = {"sparse COO": lambda t: t.to_sparse(),
           "negated view": lambda t: (-t)._neg_view(),  # -(-t), the negation lazily
           "conjugated real view": lambda t: t.conj()}
  for name, view in views.items():
    got = interop.from_torch_state_dict(spec, {k: view(v) for k, v in state.items()})
    np.testing.assert_array_equal(got, expected, err_msg=name)
  with pytest.raises(TypeError, match=r"state_dict\['weight_ih_l0'\] must have a float.*complex64"):
    interop.from_torch_state_dict(spec, {k: v.to(torch.complex64).conj() for k, v in state.items()})
  with pytest.raises(ValueError, match=r"state_dict\['weight_ih_l0'\] is a meta tensor"):
    interop.from_torch_state_dict(spec, torch.nn.GRU(3, 4, device="meta").state_dict())
  quantized = {k: torch.quantize_per_tensor(v, 0.1, 0, torch.qint8) for k, v in state.items()}
  with pytest.raises(TypeError, match=r"state_dict\['weight_ih_l0'\] is a quantized tensor.*"
                                      r"dequantize\(\)"):
    interop.from_torch_state_dict(spec, quantized)

  def inside_grad(weight):
    interop.from_torch_state_dict(spec, {**state, "weight_hh_l0": weight})
    return weight.sum()

  with pytest.raises(TypeError, match=r"state_dict\['weight_ih_l0'\]: cannot read the values"):
    torch.func.grad(inside_grad)(state["weight_hh_l0"])


@pytest.mark.parametrize("cls,direction,mode", CONFIGS)
def test_flax_cells_round_trip_is_the_same_function(cls, direction, mode):
  spec = _spec(cls, direction, mode)
  params = spec.init_params(jax.random.key(0))
  back = interop.from_flax_linen_cells(spec, interop.to_flax_linen_cells(spec, params))
  x, h, c = random_inputs(spec, 5, 2)
  a = call(spec, x, h, c, params)
  b = call(spec, x, h, c, back)
  for u, v in zip(a, b):
    if u is not None:
      np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)
  # Matrices are carried exactly; only the bias split is normalised.
  for w1, w2 in zip(spec.params_to_canonical(params)[0], spec.params_to_canonical(back)[0]):
    np.testing.assert_array_equal(w1, w2)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("mode", ["linear_input", "skip_input"])
def test_flax_linen_cells_decode_as_our_one_step_calls(cls, mode):
  """The README's way to decode a token per call from Python at the speed of
  Flax's cells: the weights converted once (`to_flax_linen_cells`), then
  Flax's cell (`flax_linen_cell`) applied layer after layer, each step; the
  outputs and states equal our one-step calls' over several tokens."""
  spec = _spec(cls, "unidirectional", mode)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 6, 3)
  cell = interop.flax_linen_cell(spec)
  layers = interop.to_flax_linen_cells(spec, params)
  # Flax's carries, one a layer: (c, h) for an LSTM, h otherwise.
  carries = [(c[l], h[l]) if spec.has_cell_state else h[l] for l in range(spec.num_layers)]
  for t in range(x.shape[0]):
    y, h, c = call(spec, x[t:t + 1], h, c, params, is_training=False)
    out = x[t]
    for layer, (cell_params,) in enumerate(layers):  # [layer][direction], one direction
      carries[layer], out = cell.apply({"params": cell_params}, carries[layer], out)
    np.testing.assert_allclose(out, y[0], rtol=1e-12, atol=1e-12)
    if spec.has_cell_state:
      np.testing.assert_allclose(np.stack([h_ for _, h_ in carries]), h, rtol=1e-12, atol=1e-12)
      np.testing.assert_allclose(np.stack([c_ for c_, _ in carries]), c, rtol=1e-12, atol=1e-12)
    else:
      np.testing.assert_allclose(np.stack(carries), h, rtol=1e-12, atol=1e-12)


def test_flax_cells_refuse_wrong_cell():
  spec = jcr.CudnnGRU(1, 4, 3)
  cells = interop.to_flax_linen_cells(jcr.CudnnLSTM(1, 4, 3), jcr.CudnnLSTM(1, 4, 3).init_params(
      jax.random.key(0)))
  with pytest.raises(ValueError, match="not a Flax cell of gru"):
    interop.from_flax_linen_cells(spec, cells)
  with pytest.raises(ValueError, match="cell must be"):
    interop.flax_linen_cell(jcr.CudnnLSTM(1, 4, 3), "GRUCell")


def test_flax_cells_refuse_wrong_structure_and_shapes():
  spec = jcr.CudnnLSTM(2, 4, 3, direction="bidirectional")
  cells = interop.to_flax_linen_cells(spec, spec.init_params(jax.random.key(0)))
  with pytest.raises(ValueError, match=r"cells must hold 2 entries \(one per layer"):
    interop.from_flax_linen_cells(spec, cells[:1])
  with pytest.raises(ValueError, match=r"cells\[1\] must hold 2 entries \(one per direction\), got 1"):
    interop.from_flax_linen_cells(spec, [cells[0], cells[1][:1]])
  wider = dataclasses.replace(spec, num_units=5)
  with pytest.raises(ValueError, match=r"cells\[0\]\[0\]\['ii'\]\['kernel'\] has shape "
                                       r"\(3, 4\), expected \(3, 5\)"):
    interop.from_flax_linen_cells(wider, cells)


def test_flax_cells_inside_a_modules_variables_are_named():
  """An `nn.RNN`'s variables (or an `nn.Bidirectional`'s) hold the cell under
  'cell': passed whole, the error says where the cell is; passed there, it reads."""
  nn = pytest.importorskip("flax.linen")
  spec = jcr.CudnnGRU(1, 4, 3, direction="bidirectional", dtype=jnp.float64)
  cell = lambda: nn.GRUCell(4, param_dtype=jnp.float64)
  variables = nn.Bidirectional(nn.RNN(cell()), nn.RNN(cell())).init(
      jax.random.key(0), jnp.ones((2, 5, 3), jnp.float64))
  with pytest.raises(ValueError, match=(
      r"^cells\[0\]\[0\] has no 'ir': not a Flax cell of gru; it holds some at "
      r"\['params'\]\['forward_rnn'\]\['cell'\], \['params'\]\['backward_rnn'\]\['cell'\]: "
      r"pass the cell's own \(an nn.RNN holds its cell under 'cell'\)$")):
    interop.from_flax_linen_cells(spec, [[variables, variables]])
  with pytest.raises(ValueError, match=r"has no 'ir': .* it holds one at \['cell'\]: pass"):
    interop.from_flax_linen_cells(spec, [[variables["params"]["forward_rnn"]] * 2])
  cells = [[variables["params"]["forward_rnn"]["cell"], variables["params"]["backward_rnn"]["cell"]]]
  np.testing.assert_array_equal(
      interop.to_flax_linen_cells(spec, interop.from_flax_linen_cells(spec, cells))[0][1]["hn"]["bias"],
      cells[0][1]["hn"]["bias"])
  with pytest.raises(ValueError, match=r"^cells\[0\]\[0\] has no 'ir': not a Flax cell of gru$"):
    interop.from_flax_linen_cells(spec, [[{"dense": {"kernel": 0}}] * 2])  # nothing to point at


def _nnx_expressible_params(spec, seed=0):
  """Random params; for GRU the recurrent n-gate biases zeroed (nnx.GRUCell has none)."""
  params = spec.init_params(jax.random.key(seed))
  if spec.rnn_mode != "gru":
    return params
  weights, biases = spec.params_to_canonical(params)
  biases = [jnp.zeros_like(b) if i % 6 == 5 else b for i, b in enumerate(biases)]
  return spec.canonical_to_params(weights, biases)


def _run_nnx_cells(spec, cells, x_batch_major, h0, c0, seq_lengths):
  """The model as stacked `flax.nnx.RNN`s over the given cells `[layer][direction]`."""
  from flax import nnx
  x, hs, cs = x_batch_major, [], []
  for layer in range(spec.num_layers):
    outs = []
    for d in range(spec.num_dirs):
      s = layer * spec.num_dirs + d
      carry = (c0[s], h0[s]) if spec.has_cell_state else h0[s]
      rnn = nnx.RNN(cells[layer][d], return_carry=True, reverse=d == 1, keep_order=True)
      carry, y = rnn(x, initial_carry=carry, seq_lengths=seq_lengths)
      outs.append(y)
      hs.append(carry[1] if spec.has_cell_state else carry)
      cs.append(carry[0] if spec.has_cell_state else None)
    x = jnp.concatenate(outs, axis=-1)
  return x, jnp.stack(hs), (jnp.stack(cs) if spec.has_cell_state else None)


NNX_CONFIGS = [(cls, d, m, cell) for cls, d, m in CONFIGS
               for cell in (("LSTMCell", "OptimizedLSTMCell") if cls is jcr.CudnnLSTM else (None,))]


@pytest.mark.parametrize("cls,direction,mode,cell", NNX_CONFIGS)
def test_flax_nnx_cells_give_our_outputs_and_convert_back(cls, direction, mode, cell):
  pytest.importorskip("flax.nnx")
  spec = _spec(cls, direction, mode)
  params = _nnx_expressible_params(spec)
  cells = interop.to_flax_nnx_cells(spec, params, cell)
  assert type(cells[0][0]).__name__ == (cell or {"gru": "GRUCell"}.get(spec.rnn_mode, "SimpleCell"))
  x, h, c = random_inputs(spec, 6, 3)
  lengths = np.array([6, 3, 1])
  for seq_lengths in (None, lengths):
    y, hn, cn = call(spec, x, h, c, params, is_training=False, seq_lengths=seq_lengths)
    ry, rh, rc = _run_nnx_cells(spec, cells, np.swapaxes(x, 0, 1), h, c, seq_lengths)
    ry = np.swapaxes(ry, 0, 1)
    if seq_lengths is not None:  # Flax leaves the padding unspecified; ours is zero.
      ry = np.where(np.arange(6)[:, None, None] < lengths[None, :, None], ry, 0.0)
    np.testing.assert_allclose(y, ry, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(hn, rh, rtol=1e-10, atol=1e-12)
    if cn is not None:
      np.testing.assert_allclose(cn, rc, rtol=1e-10, atol=1e-12)
  # Back from the modules: the same function, matrices exactly.
  back = interop.from_flax_nnx_cells(spec, cells)
  for u, v in zip(call(spec, x, h, c, params), call(spec, x, h, c, back)):
    if u is not None:
      np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)
  for w1, w2 in zip(spec.params_to_canonical(params)[0], spec.params_to_canonical(back)[0]):
    np.testing.assert_array_equal(w1, w2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cls,cell", [
    (jcr.CudnnLSTM, "LSTMCell"), (jcr.CudnnLSTM, "OptimizedLSTMCell"), (jcr.CudnnGRU, None),
    (jcr.CudnnRNNTanh, None)])
def test_flax_nnx_cells_in_half_precision(cls, cell, dtype):
  """Flax's orthogonal initializers take a QR, which XLA:CPU has not in half
  precision: the cells are made in float32 and cast, so that a bfloat16 or
  float16 model converts like a float32 one, its weights exactly."""
  nnx = pytest.importorskip("flax.nnx")
  spec = cls(2, 4, 3, direction="bidirectional", dtype=jnp.dtype(dtype))
  fresh = interop.flax_nnx_cell(spec, 1, cell)
  assert {a.dtype for a in jax.tree.leaves(nnx.state(fresh, nnx.Param))} == {spec.dtype}
  params = _nnx_expressible_params(spec)
  cells = interop.to_flax_nnx_cells(spec, params, cell)
  assert {a.dtype for row in cells for c in row
          for a in jax.tree.leaves(nnx.state(c, nnx.Param))} == {spec.dtype}
  back = interop.from_flax_nnx_cells(spec, cells)
  assert back.dtype == spec.dtype
  for w1, w2 in zip(spec.params_to_canonical(params)[0], spec.params_to_canonical(back)[0]):
    np.testing.assert_array_equal(w1, w2)
  # The cells compute our model: against the float32 model of the same weights
  # (the cells multiply in half precision: a tolerance of its rounding).
  wide = dataclasses.replace(spec, dtype=jnp.dtype(jnp.float32))
  x, h, c = random_inputs(wide, 5, 2)
  y = call(wide, x, h, c, params.astype(jnp.float32), is_training=False)[0]
  cast = lambda a: None if a is None else jnp.asarray(a, spec.dtype)
  ry = _run_nnx_cells(spec, cells, cast(np.swapaxes(x, 0, 1)), cast(h), cast(c), None)[0]
  np.testing.assert_allclose(np.swapaxes(np.asarray(ry, np.float32), 0, 1), y, atol=2e-2)


def test_flax_nnx_cells_from_pure_dicts_and_refusals():
  nnx = pytest.importorskip("flax.nnx")
  gru = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  with pytest.raises(ValueError, match="no recurrent bias on the n gate"):
    interop.to_flax_nnx_cells(gru, gru.init_params(jax.random.key(0)))
  params = _nnx_expressible_params(gru)
  modules = interop.to_flax_nnx_cells(gru, params)
  trees = [[nnx.to_pure_dict(nnx.state(c, nnx.Param)) for c in row] for row in modules]
  np.testing.assert_array_equal(interop.from_flax_nnx_cells(gru, trees),
                                interop.from_flax_nnx_cells(gru, modules))
  # The GRU's r, z biases come back summed into the input side; n keeps its input bias.
  _, biases = gru.params_to_canonical(interop.from_flax_nnx_cells(gru, trees))
  _, original = gru.params_to_canonical(params)
  np.testing.assert_allclose(biases[0], original[0] + original[3], rtol=1e-15)
  np.testing.assert_array_equal(biases[2], original[2])
  np.testing.assert_array_equal(biases[3], 0.0)
  lstm = jcr.CudnnLSTM(1, 4, 3, dtype=jnp.float64)
  with pytest.raises(ValueError, match="not those of a Flax nnx cell of gru"):
    interop.from_flax_nnx_cells(gru, interop.to_flax_nnx_cells(lstm, lstm.init_params(
        jax.random.key(0)), "OptimizedLSTMCell"))
  with pytest.raises(ValueError, match="cell must be one of"):
    interop.to_flax_nnx_cells(lstm, lstm.init_params(jax.random.key(0)), "GRUCell")
  tanh = jcr.CudnnRNNTanh(1, 4, 3, dtype=jnp.float64)
  residual = nnx.SimpleCell(3, 4, residual=True, rngs=nnx.Rngs(0), param_dtype=jnp.float64)
  with pytest.raises(ValueError, match="residual"):
    interop.from_flax_nnx_cells(tanh, [[residual]])
  skip = jcr.CudnnRNNTanh(1, 4, 4, input_mode="skip_input", dtype=jnp.float64)
  with pytest.raises(ValueError, match="skip_input"):
    interop.from_flax_nnx_cells(skip, [[nnx.SimpleCell(4, 4, rngs=nnx.Rngs(0),
                                                       param_dtype=jnp.float64)]])


def test_flax_nnx_modules_holding_cells_are_named():
  """An `nnx.RNN` (or its state, or an `nnx.Bidirectional`) given for a cell:
  the error says where its cells are (its state's rng key had been read as a
  weight); the cell there reads."""
  nnx = pytest.importorskip("flax.nnx")
  lstm = jcr.CudnnLSTM(1, 4, 3, dtype=jnp.float64)
  make = lambda kind, seed: getattr(nnx, kind)(3, 4, rngs=nnx.Rngs(seed), param_dtype=jnp.float64)
  for kind in ("LSTMCell", "OptimizedLSTMCell"):
    rnn = nnx.RNN(make(kind, 0))
    for given in (rnn, nnx.state(rnn), nnx.to_pure_dict(nnx.state(rnn))):
      with pytest.raises(ValueError, match=(
          r"^cells\[0\]\[0\] is not a Flax nnx cell but holds one at \['cell'\]: pass the "
          r"cell itself \(an nnx.RNN's is its .cell\)$")):
        interop.from_flax_nnx_cells(lstm, [[given]])
    np.testing.assert_array_equal(
        interop.from_flax_nnx_cells(lstm, [[rnn.cell]]),
        interop.from_flax_nnx_cells(lstm, [[nnx.to_pure_dict(nnx.state(rnn.cell, nnx.Param))]]))
  both = nnx.Bidirectional(nnx.RNN(make("LSTMCell", 0)), nnx.RNN(make("LSTMCell", 1)))
  with pytest.raises(ValueError, match=r"holds some at \['backward_rnn'\]\['cell'\], "
                                       r"\['forward_rnn'\]\['cell'\]: pass"):
    interop.from_flax_nnx_cells(dataclasses.replace(lstm, direction="bidirectional"),
                                [[both, both]])


def _keras():
  os.environ.setdefault("KERAS_BACKEND", "jax")
  return pytest.importorskip("keras")


def _keras_layer(keras, rnn_mode: str, units: int, **kwargs):
  """The Keras layer of `rnn_mode` (a GRU with `reset_after`, cuDNN's), returning
  its sequences and states, made with `kwargs`."""
  kwargs |= dict(return_sequences=True, return_state=True)
  if rnn_mode.startswith("rnn_"):
    return keras.layers.SimpleRNN(units, activation=rnn_mode.removeprefix("rnn_"), **kwargs)
  if rnn_mode == "gru":
    return keras.layers.GRU(units, reset_after=True, **kwargs)
  return keras.layers.LSTM(units, **kwargs)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_outputs_equal_keras_layer(cls):
  keras = _keras()
  spec = cls(1, 5, 3, dtype=jnp.float32)
  params = spec.init_params(jax.random.key(0))
  layer = _keras_layer(keras, spec.rnn_mode, 5)
  x, h, c = random_inputs(spec, 6, 2)
  xb = np.swapaxes(x, 0, 1)
  init = [h[0], c[0]] if c is not None else [h[0]]
  # Keras's own initializers and cells broadcast implicitly (conftest.py has
  # JAX raise on that for the library's code).
  with jax.numpy_rank_promotion("allow"):
    layer.build(xb.shape)
    layer.set_weights(interop.to_keras_weights(spec, params)[0][0])
    outs = layer(xb, initial_state=init)
  y, hn, cn = call(spec, xb, h, c, params, time_major=False)
  np.testing.assert_allclose(y, np.asarray(outs[0]), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(hn[0], np.asarray(outs[1]), rtol=1e-4, atol=1e-5)
  if c is not None:
    np.testing.assert_allclose(cn[0], np.asarray(outs[2]), rtol=1e-4, atol=1e-5)
  back = interop.from_keras_weights(spec, [[layer.get_weights()]])
  np.testing.assert_allclose(call(spec, xb, h, c, back, time_major=False)[0], y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_a_keras_layer_without_biases_reads_with_zero_biases(cls):
  """A Keras layer with `use_bias=False` has `[kernel, recurrent_kernel]`
  weights (refused before): they read with zero biases, the same function. A
  Bidirectional layer's six arrays, given as one direction's, are named."""
  keras = _keras()
  spec = cls(1, 5, 3, dtype=jnp.float32)
  layer = _keras_layer(keras, spec.rnn_mode, 5, use_bias=False)
  x, h, c = random_inputs(spec, 6, 2)
  xb = np.swapaxes(x, 0, 1)
  # Keras's GRU without biases makes a float64 state under x64 (conftest.py).
  with jax.numpy_rank_promotion("allow"), jax.enable_x64(False):
    layer.build(xb.shape)
    weights = layer.get_weights()
    assert len(weights) == 2
    outs = layer(xb, initial_state=[h[0], c[0]] if c is not None else [h[0]])
  params = interop.from_keras_weights(spec, [[weights]])
  _, biases = spec.params_to_canonical(params)
  assert all(np.all(np.asarray(b) == 0) for b in biases)
  y, _, _ = call(spec, xb, h, c, params, time_major=False)
  np.testing.assert_allclose(y, np.asarray(outs[0]), rtol=1e-4, atol=1e-5)
  with pytest.raises(ValueError, match=r"^weights\[0\]\[0\] must be \[kernel, recurrent_kernel, "
                                       r"bias\] .* got 6 arrays \(a Bidirectional layer's\?"):
    interop.from_keras_weights(spec, [[weights + [np.zeros(1)] * 4]])


@pytest.mark.parametrize("cls,direction,mode", CONFIGS)
def test_keras_weights_round_trip(cls, direction, mode):
  spec = _spec(cls, direction, mode)
  params = spec.init_params(jax.random.key(0))
  back = interop.from_keras_weights(spec, interop.to_keras_weights(spec, params))
  x, h, c = random_inputs(spec, 4, 2)
  for u, v in zip(call(spec, x, h, c, params), call(spec, x, h, c, back)):
    if u is not None:
      np.testing.assert_allclose(u, v, rtol=1e-12, atol=1e-12)
  if spec.rnn_mode == "gru":  # GRU keeps both biases: exact
    np.testing.assert_array_equal(back, params)


def test_keras_weights_refuse_wrong_structure_and_shapes():
  lstm, gru = jcr.CudnnLSTM(2, 4, 3), jcr.CudnnGRU(2, 4, 3)
  gru_weights = interop.to_keras_weights(gru, gru.init_params(jax.random.key(0)))
  with pytest.raises(ValueError, match=r"weights\[0\]\[0\] kernel has shape \(3, 12\), "
                                       r"expected \(3, 16\) \(4 gates of 4 units\)"):
    interop.from_keras_weights(lstm, gru_weights)
  weights = interop.to_keras_weights(lstm, lstm.init_params(jax.random.key(0)))
  with pytest.raises(ValueError, match="weights must hold 2 entries"):
    interop.from_keras_weights(lstm, weights[:1])
  with pytest.raises(ValueError, match=r"must be \[kernel, recurrent_kernel, bias\] \(or "
                                       r"without the bias, use_bias=False\), got 1 arrays$"):
    interop.from_keras_weights(lstm, [weights[0], [weights[1][0][:1]]])
  kernel, recurrent, bias = weights[1][0]
  with pytest.raises(ValueError, match=r"weights\[1\]\[0\] recurrent_kernel has shape \(16, 4\)"):
    interop.from_keras_weights(lstm, [weights[0], [[kernel, recurrent.T, bias]]])
  with pytest.raises(ValueError, match=r"bias has shape \(2, 16\), expected \(16,\)"):
    interop.from_keras_weights(lstm, [weights[0], [[kernel, recurrent, np.stack([bias, bias])]]])


def test_keras_gru_without_reset_after_is_refused():
  spec = jcr.CudnnGRU(1, 4, 3)
  kernel, recurrent, bias = interop.to_keras_weights(spec, spec.init_params(jax.random.key(0)))[0][0]
  with pytest.raises(ValueError, match="reset_after"):
    interop.from_keras_weights(spec, [[[kernel, recurrent, bias[0]]]])


@pytest.mark.parametrize("name", [
    "to_torch_state_dict", "from_torch_state_dict", "flax_linen_cell", "to_flax_linen_cells",
    "from_flax_linen_cells", "to_flax_nnx_cells", "from_flax_nnx_cells", "to_keras_weights",
    "from_keras_weights", "tf1_checkpoint_names", "to_tf1_checkpoint", "from_tf1_checkpoint"])
def test_a_spec_that_is_not_one_is_a_type_error(name):
  convert = getattr(interop, name)
  args = () if name in ("flax_linen_cell", "tf1_checkpoint_names") else ({},)
  with pytest.raises(TypeError, match=rf"{name}: spec must be a CudnnLSTM, .* got dict \{{\}}"):
    convert({}, *args)
  with pytest.raises(TypeError, match=rf"{name}: spec must be .* got NoneType None"):
    convert(None, *args)


def test_option_arguments_that_are_none_of_theirs_are_type_errors():
  # Before: any layer gave a cell (5 for a 2-layer spec; 1.0 and "0" as layer 1 and 0),
  # rngs=3 was an AttributeError, as_tensors="yes" was taken as True, scope=3 and a
  # list of tensors were AttributeError / ValueError from inside.
  spec = jcr.CudnnLSTM(2, 3, 2, dtype=jnp.float32)
  params = spec.init_params(jax.random.key(0))
  with pytest.raises(ValueError, match=r"^layer must be in \[0, 2\) \(num_layers\), got 5$"):
    interop.flax_nnx_cell(spec, 5)
  with pytest.raises(TypeError, match=r"^layer must be an int, got '0'$"):
    interop.flax_nnx_cell(spec, "0")
  with pytest.raises(TypeError, match=r"^rngs must be an nnx.Rngs or None, got int$"):
    interop.flax_nnx_cell(spec, 0, rngs=3)
  with pytest.raises(TypeError, match=r"^as_tensors must be a bool, got 'yes'$"):
    interop.to_torch_state_dict(spec, params, as_tensors="yes")
  with pytest.raises(TypeError, match=r"^scope must be a str or None, got int$"):
    interop.tf1_checkpoint_names(spec, scope=3)
  with pytest.raises(TypeError, match=r"^tensors must be a mapping of names to arrays, got list$"):
    interop.from_tf1_checkpoint(spec, [1, 2])
  assert interop.flax_nnx_cell(spec, 1).in_features == spec.layer_input_size(1) == 3
  assert spec.layer_has_input_weights(0)
  with pytest.raises(ValueError, match=r"^layer must be in \[0, 2\)"):
    spec.layer_has_input_weights(-1)
