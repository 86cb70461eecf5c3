"""A single one-step call multiplying the opaque buffer where it lies
(`_one_step`): the whole buffer, its blocks, or each matrix in place; its
values against numpy's RNN, its derivatives against the reference, and its
rules' bounds."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _one_step, _reference, _requirements, _xla
from helpers import (SPEC_CLASSES, call, every_output_loss, jaxpr_equations,
                     random_canonical, random_inputs)
from numpy_rnn import numpy_rnn


@pytest.fixture
def cpu_host(monkeypatch):
  """The rule as on a CPU host, which alone takes it (`_one_step.plan`); on a
  GPU host (`benchmarks/gpu_session.sh`'s suite) the programs are a CPU's,
  their values still checked."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")


FUSES_MATVEC = _one_step.fuses_matvec  # the real gate, which the fixture replaces


@pytest.fixture(autouse=True)
def fused_matvec(monkeypatch):
  """The rules as measured under jax 0.10, whose XLA:CPU vectorizes the
  fused matrix-vector products, whatever JAX runs the tests
  (`_one_step.fuses_matvec`, which `test_fuses_matvec_under_jax_0_10`
  checks); `lanes` gives the rules of a newer JAX."""
  monkeypatch.setattr(_one_step, "fuses_matvec", lambda version=None: True)


@pytest.fixture
def lanes(monkeypatch):
  """The rules of jax 0.11 and newer: one sequence's products summed in
  lanes (`_one_step._lanes_product`)."""
  monkeypatch.setattr(_one_step, "fuses_matvec", lambda version=None: False)


def _product_shapes(fn, *args) -> list:
  """The `(lhs, rhs)` shapes of `fn`'s products, nested ones too."""
  eqns = jaxpr_equations(jax.make_jaxpr(fn)(*args).jaxpr)
  return [tuple(v.aval.shape for v in e.invars) for e in eqns
          if e.primitive.name == "dot_general"]


def _products(fn, *args) -> list:
  """The shapes of the left operands of `fn`'s products, nested ones too."""
  return [lhs for lhs, _ in _product_shapes(fn, *args)]


def _temp_bytes(fn, *args) -> int:
  """The bytes of the temporary buffers of `fn` jitted and compiled for `args`."""
  return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _smallest_matrix_bytes(spec, params) -> int:
  """The bytes of `spec`'s smallest weight matrix (its gates together) in the
  model's dtype: what copying one matrix out of the buffer takes."""
  weights, _ = spec.params_to_canonical(params)
  return min(w.size for w in weights) * spec.num_gates * np.dtype(spec.dtype).itemsize


def _whole_buffer_products(fn, *args) -> list:
  """Those of `_products` that multiply the whole buffer (the last of `args`)."""
  return [s for s in _products(fn, *args) if len(s) == 2 and np.prod(s) == args[-1].size]


def _only_whole_buffer_products(spec, fn, *args) -> bool:
  """Whether every product of `fn` multiplies the whole buffer, one or two of
  them (the input's and the states' views) a layer."""
  products = _products(fn, *args)
  return (products == _whole_buffer_products(fn, *args)
          and spec.num_layers <= len(products) <= 2 * spec.num_layers)


def _numpy(spec, weights, biases, x, h, c, lengths=None):
  up = lambda a: None if a is None else np.asarray(a, np.float64)
  return numpy_rnn(spec.rnn_mode, spec.num_layers, spec.direction == "bidirectional",
                   spec.input_mode == "skip_input", [up(w) for w in weights],
                   [up(b) for b in biases], up(x), up(h), up(c), seq_lengths=lengths)


def _matches_numpy(spec, weights, biases, params, x, h, c, lengths, products):
  """A jitted one-step call, without and with `lengths`: `products(run)` holds
  of its function, and its values (outputs, final states) equal numpy's RNN
  in float64, to float32 rounding."""
  for seq_lengths in (None, lengths):
    run = lambda x, h, c, p: call(spec, x, h, c, p, is_training=False, implementation="xla",
                                  seq_lengths=seq_lengths)
    assert products(run)
    got = jax.jit(run)(x, h, c, params)
    want = _numpy(spec, weights, biases, x, h, c, seq_lengths)
    for a, b in zip(got, want):
      if b is not None:
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=2e-5, atol=2e-6)


def _no_blocks(monkeypatch):
  """The rules without the blocks (`Plan.blocks`), which a one-layer model
  of I = H on more than one sequence takes before the whole buffer."""
  monkeypatch.setattr(_one_step, "BLOCKS_MIN_BATCH", np.inf)


def _small_pieces(monkeypatch):
  """The whole buffer's rule for small models: pieces from 4 elements, any
  matrices, any extra products; no blocks."""
  _no_blocks(monkeypatch)
  monkeypatch.setattr(_one_step, "MIN_PIECE", 4)
  monkeypatch.setattr(_one_step, "MIN_ELEMENTS", 0)
  monkeypatch.setattr(_one_step, "MAX_EXTRA_PRODUCTS", dict.fromkeys(_one_step.MAX_EXTRA_PRODUCTS,
                                                                     np.inf))


# Small models through the rule with its bounds patched: views 4 to 16 wide (the
# input whole or in pieces of `gcd(I, H)`), both directions, skip_input, three
# layers.
SMALL = [(1, 8, 8, "unidirectional", "linear_input"),
         (2, 8, 12, "bidirectional", "linear_input"),
         (3, 4, 4, "bidirectional", "skip_input"),
         (2, 12, 4, "unidirectional", "linear_input")]


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("layers,units,inputs,direction,input_mode", SMALL)
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_whole_buffer_values_match_numpy(cls, layers, units, inputs, direction, input_mode,
                                         monkeypatch):
  """One jitted one-step call: only products of the whole buffer, one or two
  a layer, and values (outputs, final states) equal to numpy's RNN in float64, to float32
  rounding, with and without lengths (an empty sequence keeps its states)."""
  _small_pieces(monkeypatch)
  spec = cls(layers, units, inputs, direction=direction, input_mode=input_mode,
             dtype=jnp.float32)
  weights, biases = random_canonical(spec, seed=2)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, 1, 5)
  _matches_numpy(spec, weights, biases, params, x, h, c, np.array([1, 0, 1, 1, 0], np.int32),
                 lambda run: _only_whole_buffer_products(spec, run, x, h, c, params))


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_whole_buffer_at_its_own_sizes(cls):
  """The rule as it is, no bound patched: a two-layer model of I = H = 256 on
  4 sequences, and a bidirectional two-layer one of I = 512 (two pieces of the
  input, four of layer 1's) on 4, against numpy."""
  for spec, batch in ((cls(2, 256, 256, dtype=jnp.float32), 4),
                      (cls(2, 256, 512, direction="bidirectional", dtype=jnp.float32), 4)):
    _matches_numpy_at_size(spec, batch, 4, functools.partial(_only_whole_buffer_products, spec))


def _matches_numpy_at_size(spec, batch: int, seed: int, products):
  """A jitted one-step call of `spec` on `batch` sequences, weights of scale
  0.1: `products(run, *args)` holds of its function, and its values equal
  numpy's RNN in float64 (to float32 rounding over these sizes)."""
  weights, biases = random_canonical(spec, seed=seed, scale=0.1)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, 1, batch)
  run = lambda x, h, c, p: call(spec, x, h, c, p, is_training=False, implementation="xla")
  assert products(run, x, h, c, params)
  for a, b in zip(jax.jit(run)(x, h, c, params), _numpy(spec, weights, biases, x, h, c)):
    if b is not None:
      np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=1e-4, atol=1e-5)


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("batch,form", [(5, "fused"), (3, "fused"), (1, "fused"), (1, "lanes")])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_whole_buffer_derivatives_match_reference(cls, batch, form, monkeypatch, request):
  """The derivatives of a call that takes the whole buffer (or, on up to
  `MATVEC_MAX_BATCH` sequences, the matrices in place; on one, in lanes under
  a newer JAX's rules): gradients with respect to every
  operand, the buffer's included (its tangent reaches the output through
  the slices the derivative reads, `_xla._layer`), a JVP, and values under
  `vmap` over an ensemble of buffers, against the reference; two
  bidirectional layers, with lengths (in lanes, 32 units over 48 inputs:
  two, three and four terms)."""
  _small_pieces(monkeypatch)
  units, inputs = 8, 8
  if form == "lanes":
    request.getfixturevalue("lanes")
    units, inputs = 32, 48
  spec = cls(2, units, inputs, direction="bidirectional", dtype=jnp.float32)
  x, h, c = random_inputs(spec, 1, batch)
  params = spec.init_params(jax.random.key(5))
  lengths = jnp.array([1, 0, 1, 1, 0][:batch], jnp.int32)
  products = lambda *a: _xla.rnn(spec, *a)
  if batch <= _one_step.MATVEC_MAX_BATCH:
    assert _whole_buffer_products(products, x, h, c, params) == []
    plan = _one_step.plan(spec, 1, jax.ShapeDtypeStruct((1, batch, 2 * units), jnp.float32),
                          False)
    assert plan.matvec and plan.lanes == (form == "lanes")
  else:
    assert _only_whole_buffer_products(spec, products, x, h, c, params)
  _derivatives_match_reference(spec, x, h, c, params, lengths)


def _derivatives_match_reference(spec, x, h, c, params, lengths):
  """Gradients of a one-step call with respect to every operand, a JVP, and
  values under `vmap` over an ensemble of buffers, against the reference's."""
  fast, slow = (every_output_loss(_xla.rnn, spec, lengths),
                every_output_loss(_reference.rnn, spec, lengths))
  argnums = (0, 1, 3) if c is None else (0, 1, 2, 3)
  tol = dict(rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.jit(jax.grad(fast, argnums))(x, h, c, params),
                  jax.jit(jax.grad(slow, argnums))(x, h, c, params)):
    np.testing.assert_allclose(a, b, **tol)
  rng = np.random.default_rng(6)
  tangents = [rng.normal(size=np.shape(a)).astype(np.float32) for a in (x, h, params)]
  jvp = lambda f: jax.jit(lambda x, h, p, tx, th, tp: jax.jvp(
      lambda x, h, p: f(x, h, c, p), (x, h, p), (tx, th, tp)))(x, h, params, *tangents)
  for a, b in zip(jvp(fast), jvp(slow)):
    np.testing.assert_allclose(a, b, **tol)
  ensemble = jnp.stack([params, 0.5 * params])
  vmapped = lambda rnn: jax.jit(jax.vmap(lambda p: rnn(spec, x, h, c, p)))(ensemble)
  for a, b in zip(vmapped(_xla.rnn), vmapped(_reference.rnn)):
    if b is not None:
      np.testing.assert_allclose(a, b, **tol)


@pytest.mark.usefixtures("cpu_host")
def test_whole_buffer_rule(monkeypatch):
  """Where a one-step call takes the whole buffer (`_one_step.plan`), the
  blocks aside: not in a
  loop that closes over its weights, not over more than one step, not for a
  float64 or bfloat16 model, not with pieces below 128 or small matrices, nor past
  `MAX_EXTRA_PRODUCTS` (hand-counted by `extra_products`), nor on a GPU, nor
  where JAX has several devices (`sharded_cases.py` checks a sharded call)."""
  _no_blocks(monkeypatch)
  gru, lstm = jcr.CudnnGRU(1, 256, 256), jcr.CudnnLSTM(1, 256, 256)
  step = lambda batch, dtype=jnp.float32, steps=1: jax.ShapeDtypeStruct((steps, batch, 256),
                                                                        dtype)
  plan = _one_step.plan(gru, 0, step(32), looped=False)
  assert plan == _one_step.Plan(gru.params_size(), 256, 256, 256, (0,), (768,))
  assert _one_step.plan(gru, 0, step(32), looped=True) is None
  assert _one_step.plan(gru, 0, step(8, steps=2), looped=False) is None
  assert _one_step.plan(jcr.CudnnGRU(1, 256, 256, dtype=jnp.float64), 0,
                        step(8, jnp.float64), looped=False) is None
  assert _one_step.plan(jcr.CudnnGRU(1, 256, 256, dtype=jnp.bfloat16), 0, step(8),
                        looped=False) is None
  # Pieces of 128 with a direction's matrices of 128 Ki elements (an LSTM
  # I128 H128) or more; not a GRU's 96 Ki, nor pieces of 64.
  narrow = lambda inputs: jax.ShapeDtypeStruct((1, 8, inputs), jnp.float32)
  assert _one_step.plan(jcr.CudnnLSTM(1, 128, 128), 0, narrow(128), looped=False) is not None
  assert _one_step.plan(jcr.CudnnGRU(1, 256, 128), 0, narrow(128), looped=False) is not None
  assert _one_step.matrix_elements(jcr.CudnnGRU(1, 128, 128), 0) == 96 * 1024
  assert _one_step.plan(jcr.CudnnGRU(1, 128, 128), 0, narrow(128), looped=False) is None
  assert _one_step.plan(jcr.CudnnLSTM(1, 256, 64), 0, narrow(64), looped=False) is None
  # One layer of I = H: the extra products per copied element are the batch.
  assert _one_step.extra_products(gru, 0, 33) == 33
  assert _one_step.plan(gru, 0, step(33), looped=False) is None
  assert _one_step.plan(lstm, 0, step(24), looped=False) is not None
  assert _one_step.plan(lstm, 0, step(25), looped=False) is None
  # Three layers of one unit of matrices each: the buffer's 3 units times 2
  # pieces (x, h), less the layer's own unit, per unit: 5 a sequence.
  assert _one_step.extra_products(jcr.CudnnGRU(3, 256, 256), 1, 4) == 20
  # Bidirectional, layer 0, in units of `[4H, 256]`: the buffer's 2 * 2 (I 256)
  # + 2 * 3 (layer 1's I 512) units times 3 pieces (x, both states), less the
  # layer's own 4, per own unit: 6.5 a sequence.
  assert _one_step.extra_products(jcr.CudnnLSTM(2, 256, 256, direction="bidirectional"), 0,
                                  2) == 13
  # I128 H256: the input multiplies the buffer viewed 128 wide, the state 256
  # wide (768 rows of 128 in), one piece each: one layer's extra products are
  # the batch.
  narrow_gru = jcr.CudnnGRU(1, 256, 128)
  assert _one_step.plan(narrow_gru, 0, jax.ShapeDtypeStruct((1, 32, 128), jnp.float32),
                        looped=False) == _one_step.Plan(narrow_gru.params_size(), 128, 128,
                                                        256, (0,), (384,))
  assert _one_step.extra_products(narrow_gru, 0, 32) == 32
  # An LSTM of 8 units, inputs 12, bidirectional, in two layers: a direction's
  # matrices take 640 elements in layer 0 (`4 * 8 * (12 + 8)`), 768 in layer 1
  # (its input 16), the buffer 3072 with the biases. Layer 0's backward input
  # matrix at 640, no multiple of 12: pieces of 4 (12 and 8's divisor); layer
  # 1's at 1280 and 2048, multiples of 16: its input whole.
  small = jcr.CudnnLSTM(2, 8, 12, direction="bidirectional")
  assert small.params_size() == 3072
  assert [_one_step._input_piece(small, layer) for layer in (0, 1)] == [4, 16]
  b, = jax.export.symbolic_shape("b")
  assert _one_step.plan(gru, 0, jax.ShapeDtypeStruct((1, b, 256), jnp.float32),
                        looped=False) is None
  _only_on_a_sole_cpu(gru, step(8))


def _only_on_a_sole_cpu(spec, x):
  """No plan for a one-step call of `spec` on `x` on a GPU, nor where JAX has
  several devices."""
  with pytest.MonkeyPatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert _one_step.plan(spec, 0, x, looped=False) is None
  with pytest.MonkeyPatch.context() as m:
    m.setattr(jax, "device_count", lambda *backend: 4)
    assert _one_step.plan(spec, 0, x, looped=False) is None


def _only_block_products(spec, batch, fn, *args) -> bool:
  """Whether `fn`'s products are one batched product of the buffer's blocks
  (`[2D, g*H + g, H]` by the input and the states) and, for each matrix `j`
  but the first, its first `j*g` rows by its vector (`_block_products`)."""
  g, H, D = spec.num_gates, spec.num_units, spec.num_dirs
  want = [((2 * D, g * H + g, H), (2 * D, batch, H))]
  want += [((batch, H), (H, j * g)) for j in range(1, 2 * D)]
  return sorted(_product_shapes(fn, *args)) == sorted(want)


# One-layer models of I = H through the blocks: both directions, 1 to 3
# matrices' first rows in the block before; more sequences than
# `MATVEC_MAX_BATCH`, which multiply their matrices in place.
BLOCKS = [(8, "unidirectional", 4), (8, "bidirectional", 5), (12, "bidirectional", 6)]


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("units,direction,batch", BLOCKS)
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_blocks_values_match_numpy(cls, units, direction, batch):
  """One jitted one-step call of a one-layer model of I = H on more than one
  sequence (`Plan.blocks`), no bound patched: one batched product of the
  buffer's blocks and a small one a matrix for its rows in the block before,
  and values (outputs, final states) equal to numpy's RNN in float64, to
  float32 rounding, with and without lengths (an empty sequence keeps its
  states)."""
  spec = cls(1, units, units, direction=direction, dtype=jnp.float32)
  plan = _one_step.plan(spec, 0, jax.ShapeDtypeStruct((1, batch, units), jnp.float32), False)
  assert plan.blocks and not plan.matvec
  weights, biases = random_canonical(spec, seed=5, scale=0.5)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, 1, batch)
  lengths = np.array([1, 0, 1, 1, 0, 1][:batch], np.int32)
  _matches_numpy(spec, weights, biases, params, x, h, c, lengths,
                 lambda run: _only_block_products(spec, batch, run, x, h, c, params))


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_blocks_at_their_own_sizes(cls, lanes):
  """The blocks at the sizes they were measured at, under a newer JAX's
  bound (`BLOCKS_MIN_PRODUCTS`): a one-layer model of I = H = 256 on 64
  sequences, bidirectional on 48, against numpy."""
  for spec, batch in ((cls(1, 256, 256, dtype=jnp.float32), 64),
                      (cls(1, 256, 256, direction="bidirectional", dtype=jnp.float32), 48)):
    _matches_numpy_at_size(spec, batch, 6, functools.partial(_only_block_products, spec, batch))


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_blocks_derivatives_match_reference(cls):
  """The derivatives of a call that takes the blocks (read from the sliced
  matrices, as the whole buffer's): gradients with respect to every operand,
  a JVP, and values under `vmap` over an ensemble of buffers, against the
  reference; one bidirectional layer of I = H = 8, with lengths."""
  spec = cls(1, 8, 8, direction="bidirectional", dtype=jnp.float32)
  x, h, c = random_inputs(spec, 1, 5)
  params = spec.init_params(jax.random.key(7))
  assert _only_block_products(spec, 5, lambda *a: _xla.rnn(spec, *a), x, h, c, params)
  _derivatives_match_reference(spec, x, h, c, params, jnp.array([1, 0, 1, 1, 0], jnp.int32))


@pytest.mark.usefixtures("cpu_host")
def test_blocks_rule(monkeypatch):
  """Where a one-step call takes the buffer's blocks (`Plan.blocks`): a
  float32 model of one layer whose matrices are all H wide (I = H, linear
  input), either direction, on `BLOCKS_MIN_BATCH` sequences or more (one
  sequence multiplies its matrices in place), not in a loop that closes
  over its weights; under a newer JAX, only where a matrix's product makes
  at least `BLOCKS_MIN_PRODUCTS` multiplications; on a CPU that is JAX's
  only device. Before the whole buffer, and past its bounds."""
  gru = jcr.CudnnGRU(1, 256, 256)
  step = lambda batch, dtype=jnp.float32: jax.ShapeDtypeStruct((1, batch, 256), dtype)
  assert _one_step.block_count(gru) == 2
  assert _one_step.block_count(jcr.CudnnLSTM(1, 64, 64, direction="bidirectional")) == 4
  for spec in (jcr.CudnnGRU(2, 256, 256), jcr.CudnnGRU(1, 256, 128),
               jcr.CudnnGRU(1, 256, 256, input_mode="skip_input")):
    assert _one_step.block_count(spec) is None
    assert not getattr(_one_step.plan(spec, 0, step(8), looped=False), "blocks", False)
  assert _one_step.plan(gru, 0, step(8), looped=False) == _one_step.Plan(
      gru.params_size(), 256, 256, 256, (0,), (768,), blocks=True)
  # Past the whole buffer's `MAX_EXTRA_PRODUCTS` (33 a copied element).
  assert _one_step.plan(gru, 0, step(64), looped=False).blocks
  plan = _one_step.plan(gru, 0, step(1), looped=False)
  assert plan.matvec and not plan.blocks
  assert _one_step.plan(gru, 0, step(2), looped=False).matvec  # taken first
  assert _one_step.plan(gru, 0, step(8), looped=True) is None
  assert _one_step.plan(jcr.CudnnGRU(1, 256, 256, dtype=jnp.bfloat16), 0, step(8),
                        looped=False) is None
  # A newer JAX's XLA:CPU: from 3 Mi multiplications a matrix, `3 * 256 * 256 * 16`.
  monkeypatch.setattr(_one_step, "fuses_matvec", lambda version=None: False)
  assert _one_step.plan(gru, 0, step(16), looped=False).blocks
  assert not _one_step.plan(gru, 0, step(15), looped=False).blocks  # the whole buffer
  assert _one_step.plan(gru, 0, step(2), looped=False) == _one_step.Plan(
      gru.params_size(), 256, 256, 256, (0,), (768,))
  _only_on_a_sole_cpu(gru, step(16))  # where it was measured


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize(
    "layers,units,inputs,direction,input_mode,batch",
    [(*shape, 1) for shape in SMALL + [(2, 256, 256, "unidirectional", "linear_input")]]
    + [(*shape, batch) for shape in SMALL[:2] + [(1, 256, 128, "unidirectional", "linear_input")]
       for batch in (2, 3)])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_few_sequences_multiply_matrices_in_place(cls, layers, units, inputs, direction,
                                                  input_mode, batch):
  """One sequence's one-step call (`Plan.matvec`), and up to
  `MATVEC_MAX_BATCH` sequences' over small enough matrices, a sequence at a
  time, no bound patched: no product of the whole buffer, and values equal to
  numpy's RNN in float64, with and without lengths (an empty sequence keeps
  its states)."""
  spec = cls(layers, units, inputs, direction=direction, input_mode=input_mode,
             dtype=jnp.float32)
  assert all(_one_step.plan(spec, layer, jax.ShapeDtypeStruct((1, batch, spec.layer_input_size(
      layer)), jnp.float32), looped=False).matvec for layer in range(layers))
  weights, biases = random_canonical(spec, seed=3, scale=0.1 if units > 64 else 0.5)
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(spec.canonical_to_params(weights, biases), cpu)
  x, h, c = jax.device_put(random_inputs(spec, 1, batch), cpu)
  _matches_numpy(spec, weights, biases, params, x, h, c, np.array([0, 1, 0][:batch], np.int32),
                 lambda run: _whole_buffer_products(run, x, h, c, params) == [])


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("layers,units,inputs,direction", [(2, 256, 256, "unidirectional"),
                                                           (2, 64, 32, "bidirectional")])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_one_sequence_copies_no_matrix(cls, layers, units, inputs, direction):
  """One sequence's one-step call compiled for the CPU: its temporary
  buffers hold less than its smallest matrix, for XLA fused each slice into
  its product (copied out, as where the product is written as one
  `dot_general` contracting the matrix's rows, they take every matrix's
  size: this fails so)."""
  spec = cls(layers, units, inputs, direction=direction, dtype=jnp.float32)
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(spec.init_params(jax.random.key(2)), cpu)
  x, h, c = jax.device_put(random_inputs(spec, 1, 1), cpu)
  run = lambda x, h, c, p: call(spec, x, h, c, p, is_training=False, implementation="xla")
  temp, smallest = _temp_bytes(run, x, h, c, params), _smallest_matrix_bytes(spec, params)
  assert temp < smallest, (temp, smallest)


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("layers,units,inputs,direction", [(2, 256, 256, "unidirectional"),
                                                           (1, 384, 128, "bidirectional")])
@pytest.mark.parametrize("form", ["fused", "lanes"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_one_sequence_in_bfloat16(cls, layers, units, inputs, direction, form, monkeypatch,
                                  request):
  """A bfloat16 model's one sequence (`Plan.operands`): the values of the
  sliced matrices' products (the plan turned off), bit for bit where the
  products are fused (in lanes, which sum in another order, to a bfloat16
  rounding), for the input and states rounded to bfloat16 where they meet a
  weight matrix and the products accumulated in float32 as before; near the
  float32 reference; and, fused (or in lanes under jax 0.11 and newer:
  under 0.10.2 the lanes of the bidirectional H384 I128 copy its matrices,
  4.9 MB of temporary buffers for an LSTM against `_lanes_bound`'s 1.2), no
  matrix copied."""
  if form == "lanes":
    request.getfixturevalue("lanes")
  spec = cls(layers, units, inputs, direction=direction, dtype=jnp.bfloat16)
  plans = [_one_step.plan(spec, layer, jax.ShapeDtypeStruct(
      (1, 1, spec.layer_input_size(layer)), jnp.float32), looped=False)
      for layer in range(layers)]
  assert all(p.matvec and p.operands == jnp.bfloat16 and p.lanes == (form == "lanes")
             for p in plans), plans
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(spec.init_params(jax.random.key(4)), cpu)
  x, h, c = jax.device_put(random_inputs(spec, 1, 1, seed=5), cpu)
  run = lambda x, h, c, p: call(spec, x, h, c, p, is_training=False, implementation="xla")
  got = jax.jit(run)(x, h, c, params)
  temp = _temp_bytes(run, x, h, c, params)
  with monkeypatch.context() as m:
    m.setattr(_one_step, "plan", lambda *args: None)
    sliced = jax.jit(run)(x, h, c, params)
  up = lambda a: None if a is None else a.astype(jnp.float32)
  f32 = cls(layers, units, inputs, direction=direction, dtype=jnp.float32)
  reference = _reference.rnn(f32, *map(up, (x, h, c, params)))
  for a, b, r in zip(got, sliced, reference):
    if b is not None:
      if form == "fused":
        np.testing.assert_array_equal(up(a), up(b))
      else:
        np.testing.assert_allclose(up(a), up(b), rtol=2 ** -7, atol=2 ** -9)
      np.testing.assert_allclose(up(a), r, rtol=0, atol=0.03)
  if form == "fused":
    assert temp < _smallest_matrix_bytes(spec, params), temp
  elif not FUSES_MATVEC():
    assert temp < _lanes_bound(spec, params), (temp, _lanes_bound(spec, params))


@pytest.mark.usefixtures("cpu_host")
def test_fuses_matvec_under_jax_0_10(lanes):
  """The fused matrix-vector products under jax 0.10 alone (from 0.11 XLA:CPU
  runs them as scalar chains); a newer JAX's rules: one float32 sequence's
  products in lanes up to `LANES_MAX_ELEMENTS` (an LSTM I = H = 256), outside a
  loop alone, else the whole buffer or the slices; a bfloat16 model's from
  `MIN_ELEMENTS`, as under jax 0.10."""
  assert _one_step.MATVEC_JAX_BELOW == (0, 11)
  assert FUSES_MATVEC("0.10.2") and FUSES_MATVEC("0.10.1")
  assert not FUSES_MATVEC("0.11.0") and not FUSES_MATVEC("0.12.1")
  assert FUSES_MATVEC() == jax.__version__.startswith("0.10.")
  one = lambda spec, batch=1, looped=False: _one_step.plan(
      spec, 0, jax.ShapeDtypeStruct((1, batch, spec.input_size), jnp.float32), looped=looped)
  assert (_one_step.LANES_MAX_ELEMENTS, _one_step.LANES_MAX_BATCH) == (512 * 1024, 1)
  assert _one_step.matrix_elements(jcr.CudnnLSTM(1, 256, 256), 0) == 512 * 1024
  for spec in (jcr.CudnnGRU(2, 256, 256), jcr.CudnnLSTM(1, 256, 256), jcr.CudnnLSTM(1, 128, 64),
               jcr.CudnnGRU(1, 256, 128, direction="bidirectional"),
               jcr.CudnnLSTM(1, 512, 512, dtype=jnp.bfloat16)):
    plan = one(spec)
    assert plan.matvec and plan.lanes, (spec, plan)
  assert one(jcr.CudnnLSTM(1, 384, 384)).matvec is False  # 1.1 Mi: the whole buffer
  assert one(jcr.CudnnLSTM(1, 256, 264)) is None  # beyond the bound, no whole buffer: slices
  assert one(jcr.CudnnGRU(1, 256, 256), batch=2).matvec is False  # one sequence alone
  assert one(jcr.CudnnLSTM(1, 128, 64), batch=2) is None
  assert one(jcr.CudnnLSTM(1, 128, 64), looped=True) is None  # no loop
  assert one(jcr.CudnnGRU(1, 128, 128, dtype=jnp.bfloat16)) is None  # under MIN_ELEMENTS


def test_lane_terms_and_products():
  """The lanes a matrix's product is summed in (`lane_terms`: up to eight
  terms, lanes at least 16 wide, one term where none divides), and
  `_lanes_product`'s values against numpy's product in float64 (lanes 128
  wide halved to 32, 40 to 20, 33 left so)."""
  assert (_one_step.LANES_MAX_TERMS, _one_step.LANES_MIN_WIDTH) == (8, 16)
  terms = {256: 8, 1024: 8, 128: 8, 64: 4, 48: 3, 32: 2, 31: 1, 16: 1, 100: 5, 8: 1, 1: 1}
  assert {c: _one_step.lane_terms(c) for c in terms} == terms
  rng = np.random.default_rng(11)
  for rows, columns in [(384, 256), (7, 100), (5, 31), (3, 1), (12, 48), (4, 1024), (2, 320),
                        (6, 264)]:
    m = rng.normal(size=(rows, columns)).astype(np.float32)
    v = rng.normal(size=(1, columns)).astype(np.float32)
    got = jax.jit(_one_step._lanes_product)(v, m)
    assert got.shape == (1, rows)
    np.testing.assert_allclose(got, v.astype(np.float64) @ m.T.astype(np.float64),
                               rtol=1e-5, atol=1e-5)


def _lanes_bytes(spec) -> int:
  """The bytes of every float32 lanes buffer of a one-sequence call summed in
  lanes (`_one_step._lanes_product`): `[rows, columns / lane_terms]` for each
  matrix of every layer and direction."""
  total = 0
  for layer in range(spec.num_layers):
    widths = [spec.num_units] + ([spec.layer_input_size(layer)]
                                 if spec.layer_has_input_weights(layer) else [])
    for columns in widths:
      total += spec.num_dirs * spec.num_gates * spec.num_units * columns // _one_step.lane_terms(
          columns) * 4
  return total


def _lanes_bound(spec, params) -> int:
  """The bytes a call summed in lanes keeps under where it copies no matrix:
  its lanes (`_lanes_bytes`) and its smallest matrix together, for one
  matrix copied out of the buffer would take that much more."""
  return _lanes_bytes(spec) + _smallest_matrix_bytes(spec, params)


LANE_SHAPES = [(2, 256, 256, "unidirectional", "linear_input"),
               (1, 100, 31, "bidirectional", "linear_input"),
               (2, 48, 48, "bidirectional", "skip_input")]


@pytest.mark.usefixtures("cpu_host", "lanes")
@pytest.mark.parametrize("layers,units,inputs,direction,input_mode", LANE_SHAPES)
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_one_sequence_sums_lanes(cls, layers, units, inputs, direction, input_mode,
                                monkeypatch):
  """One sequence's one-step call under a newer JAX's rules, its products in
  lanes (`Plan.lanes`; five terms over 100 columns, one over 31, three over
  48): no product of the whole buffer, values equal to numpy's RNN in
  float64, with and without lengths; and no matrix copied: the compiled
  call's temporary buffers under `_lanes_bound`, which the slices' program,
  copying every matrix, exceeds from jax 0.10.2 (this checks it; under jax
  0.10.2 and 0.12.1 alike, a float32 model's lanes copy nothing: a two-layer
  GRU I = H = 256 0.30 MB, the bound 1.18, the slices 3.2; jax 0.10.1, the
  lowest pin, fuses the slices into the products and copies nothing either:
  11 KB there, so the bound cannot tell the two apart)."""
  spec = cls(layers, units, inputs, direction=direction, input_mode=input_mode,
             dtype=jnp.float32)
  plans = [_one_step.plan(spec, layer, jax.ShapeDtypeStruct(
      (1, 1, spec.layer_input_size(layer)), jnp.float32), looped=False) for layer in range(layers)]
  assert all(p.matvec and p.lanes for p in plans), plans
  weights, biases = random_canonical(spec, seed=12, scale=0.1 if units > 64 else 0.5)
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(spec.canonical_to_params(weights, biases), cpu)
  x, h, c = jax.device_put(random_inputs(spec, 1, 1, seed=13), cpu)
  _matches_numpy(spec, weights, biases, params, x, h, c, np.array([0], np.int32),
                 lambda run: _whole_buffer_products(run, x, h, c, params) == [])
  run = lambda x, h, c, p: call(spec, x, h, c, p, is_training=False, implementation="xla")
  temp, bound = _temp_bytes(run, x, h, c, params), _lanes_bound(spec, params)
  assert temp < bound, (temp, bound)
  monkeypatch.setattr(_one_step, "plan", lambda *args: None)
  sliced = _temp_bytes(lambda *args: run(*args), x, h, c, params)  # traced afresh
  if not _requirements.jax_older_than((0, 10, 2)):
    assert sliced >= bound, (sliced, bound)
  else:
    assert sliced < bound, (sliced, bound)  # a change here would restore the check


def test_row_blocks():
  """The blocks one matrix-vector product is cut into: the fewest, as even
  as can be, each under `MATVEC_MAX_BYTES` with its vector and result (all
  float32 but the block, of the model's dtype)."""
  assert _one_step.MATVEC_MAX_BYTES == 512 * 1024
  # A float32 [768, 256] (a GRU's 256 units over 256 inputs): 768 KiB in two.
  assert _one_step._row_blocks(768, 256, 4) == [384, 384]
  # [512, 128]: 256 KiB, whole; [509, 256] float32 with its vector and
  # result, 12 bytes under 512 KiB, whole; one row more, two.
  assert _one_step._row_blocks(512, 128, 4) == [512]
  assert _one_step._row_blocks(509, 256, 4) == [509]
  assert _one_step._row_blocks(510, 256, 4) == [255, 255]
  # bfloat16 [1024, 256]: 512 KiB alone, in two; [1536, 512] float32: 3 MiB
  # in seven of 219 or 220 rows.
  assert _one_step._row_blocks(1024, 256, 2) == [512, 512]
  assert _one_step._row_blocks(1536, 512, 4) == [220] * 3 + [219] * 4
  for rows, columns, itemsize in [(4096, 1024, 4), (3, 200_000, 4), (96, 8, 2), (1, 1, 8)]:
    blocks = _one_step._row_blocks(rows, columns, itemsize)
    assert sum(blocks) == rows and max(blocks) - min(blocks) <= 1
    fits = lambda r: r * columns * itemsize + 4 * (columns + r) < _one_step.MATVEC_MAX_BYTES
    assert all(fits(r) for r in blocks) or blocks == [1] * rows
    assert len(blocks) == 1 or not fits(-(-rows // (len(blocks) - 1)))


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
def test_one_sequence_keeps_each_kernel_on_one_thread(cls, monkeypatch):
  """One sequence's matrix-vector products compiled for the CPU: XLA:CPU
  splits none of the kernels over threads (no `outer_dimension_partitions`
  in the program) and their values are those of the products whole; with
  the bound lifted, a host of more than one core splits the 768 KiB or 1 MiB
  matrices' kernels (this test fails so)."""
  spec = cls(2, 256, 256, dtype=jnp.float32)
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(spec.init_params(jax.random.key(6)), cpu)
  x, h, c = jax.device_put(random_inputs(spec, 1, 1, seed=7), cpu)

  def compiled():
    # Traced afresh each time (a new function), under the bound as it is then.
    run = lambda x, h, c, p: call(spec, x, h, c, p, is_training=False, implementation="xla")
    return jax.jit(run).lower(x, h, c, params).compile()

  blocked = compiled()
  assert "outer_dimension_partitions" not in blocked.as_text()
  monkeypatch.setattr(_one_step, "MATVEC_MAX_BYTES", 1 << 40)
  whole = compiled()
  for a, b in zip(blocked(x, h, c, params), whole(x, h, c, params)):
    if b is not None:
      np.testing.assert_array_equal(a, b)
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  if cores > 1:
    assert "outer_dimension_partitions" in whole.as_text()


@pytest.mark.usefixtures("cpu_host")
def test_one_sequence_rule():
  """Where a one-step call takes the matrix-vector products: one sequence at
  any size, a lone layer whose input is narrower than its state too (it
  kept the whole buffer's products before they were cut in blocks); up to
  `MATVEC_MAX_BATCH` sequences where a direction's matrices of the layer
  hold at most `MATVEC_BATCH_MAX_ELEMENTS`; more sequences do not. In a
  decoder's loop, one sequence over middling matrices (`LOOP_MATVEC_*`)."""
  one = lambda spec, batch=1, layer=0: _one_step.plan(
      spec, layer, jax.ShapeDtypeStruct((1, batch, spec.layer_input_size(layer)), jnp.float32),
      looped=False)
  assert one(jcr.CudnnGRU(1, 256, 128)) == _one_step.Plan(
      jcr.CudnnGRU(1, 256, 128).params_size(), 128, 128, 256, (0,), (384,), matvec=True)
  assert one(jcr.CudnnLSTM(1, 256, 128)).matvec
  assert one(jcr.CudnnGRU(1, 384, 128)).matvec
  assert one(jcr.CudnnGRU(2, 256, 128)).matvec
  assert one(jcr.CudnnGRU(2, 256, 128), layer=1).matvec
  assert one(jcr.CudnnGRU(1, 256, 128, direction="bidirectional")).matvec
  assert one(jcr.CudnnGRU(1, 128, 256)).matvec  # an input wider than the state
  assert one(jcr.CudnnGRU(1, 256, 256)).matvec
  # Below the whole buffer's bounds: pieces of 64.
  assert one(jcr.CudnnLSTM(1, 256, 64)).matvec
  # A few sequences over small enough matrices: a GRU I = H = 256 holds 384 Ki
  # elements (the bound), an LSTM 512 Ki.
  assert _one_step.MATVEC_MAX_BATCH == 3
  assert _one_step.matrix_elements(jcr.CudnnGRU(1, 256, 256), 0) == 384 * 1024
  assert _one_step.MATVEC_BATCH_MAX_ELEMENTS == 384 * 1024
  for batch in (2, 3):
    assert one(jcr.CudnnLSTM(1, 256, 64), batch=batch).matvec
    assert one(jcr.CudnnGRU(1, 256, 256), batch=batch).matvec
    assert one(jcr.CudnnLSTM(1, 256, 256), batch=batch).matvec is False  # the whole buffer
    assert one(jcr.CudnnGRU(2, 256, 256), batch=batch, layer=1).matvec
  assert one(jcr.CudnnLSTM(1, 256, 64), batch=4) is None
  assert one(jcr.CudnnGRU(1, 256, 256), batch=4).matvec is False
  assert _one_step.plan(jcr.CudnnGRU(1, 256, 256), 0, jax.ShapeDtypeStruct((1, 1, 256),
                                                                          jnp.float32),
                        looped=True) is None
  # In a decoder's loop (`looped`): one float32 sequence, every matrix at
  # least 64 wide, a direction's matrices at most 256 Ki elements (an LSTM
  # H128 I384 holds 256 Ki).
  loop = lambda spec, batch=1: _one_step.plan(
      spec, 0, jax.ShapeDtypeStruct((1, batch, spec.input_size), jnp.float32), looped=True)
  assert (_one_step.LOOP_MATVEC_MIN_COLUMNS, _one_step.LOOP_MATVEC_MAX_ELEMENTS) == (64, 1 << 18)
  assert loop(jcr.CudnnLSTM(1, 128, 64)).matvec
  assert loop(jcr.CudnnGRU(1, 64, 64)).matvec
  assert loop(jcr.CudnnLSTM(1, 128, 384)).matvec
  assert loop(jcr.CudnnLSTM(1, 128, 392)) is None
  assert loop(jcr.CudnnLSTM(1, 64, 32)) is None and loop(jcr.CudnnGRU(1, 32, 64)) is None
  assert loop(jcr.CudnnLSTM(1, 128, 64), batch=2) is None
  assert loop(jcr.CudnnLSTM(1, 128, 64, dtype=jnp.bfloat16)) is None
  # A bfloat16 model from `MIN_ELEMENTS` in a direction's matrices (a GRU
  # I = H = 128 holds 96 Ki), on one sequence alone; not float16 nor float64.
  bf16 = lambda cls, units, inputs: cls(1, units, inputs, dtype=jnp.bfloat16)
  assert one(bf16(jcr.CudnnLSTM, 128, 128)).operands == jnp.bfloat16
  assert one(bf16(jcr.CudnnGRU, 256, 128)).matvec  # no whole-buffer exception
  assert one(bf16(jcr.CudnnGRU, 128, 128)) is None
  assert one(bf16(jcr.CudnnLSTM, 128, 128), batch=2) is None
  assert one(jcr.CudnnGRU(1, 256, 256)).operands is None
  for dtype in (jnp.float16, jnp.float64):
    assert one(jcr.CudnnGRU(1, 256, 256, dtype=dtype)) is None


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_decoders_loop_on_one_sequence_multiplies_in_place(cls, monkeypatch):
  """A decoder's `lax.scan` of one-step calls closing over the buffer, on
  one sequence over middling matrices (`LOOP_MATVEC_*`), no bound patched:
  the matrix-vector products, which copy no matrix out of the buffer (the
  compiled loop's temporary buffers hold less than its smallest matrix, as
  they do not with the loop's slices: this fails so); values and gradients
  against the reference's loop."""
  spec = cls(2, 128, 64, dtype=jnp.float32)
  assert all(_one_step.plan(spec, layer, jax.ShapeDtypeStruct((1, 1, spec.layer_input_size(
      layer)), jnp.float32), looped=True).matvec for layer in (0, 1))
  cpu = jax.devices("cpu")[0]
  params = jax.device_put(spec.init_params(jax.random.key(7)), cpu)
  x, h, c = jax.device_put(random_inputs(spec, 1, 1, seed=8), cpu)
  proj = jnp.asarray(np.random.default_rng(9).normal(size=(128, 64)) * 0.1, jnp.float32)

  def decode(rnn):
    def run(x, h, c, params):
      def body(carry, _):
        x, h, c = carry
        y, h, c = rnn(spec, x, h, c, params)
        return (jnp.tanh(y @ proj), h, c), None
      return jax.lax.scan(body, (x, h, c), None, length=4)[0]
    return run

  fast, slow = decode(_xla.rnn), decode(_reference.rnn)
  smallest = _smallest_matrix_bytes(spec, params)
  temp = lambda f: _temp_bytes(f, x, h, c, params)
  assert temp(fast) < smallest, (temp(fast), smallest)
  for a, b in zip(jax.jit(fast)(x, h, c, params), jax.jit(slow)(x, h, c, params)):
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)
  loss = lambda f: lambda x, h, p: jnp.sum(jnp.sin(f(x, h, c, p)[0]))
  for a, b in zip(jax.jit(jax.grad(loss(fast), (0, 1, 2)))(x, h, params),
                  jax.jit(jax.grad(loss(slow), (0, 1, 2)))(x, h, params)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  monkeypatch.setattr(_one_step, "LOOP_MATVEC_MAX_ELEMENTS", 0)
  sliced = decode(lambda *args: _xla.rnn(*args))  # traced afresh
  assert temp(sliced) >= smallest


@pytest.mark.usefixtures("cpu_host")
def test_decoders_loop_keeps_the_slices():
  """A decoder's `lax.scan` of one-step calls closing over the buffer keeps
  the slices, whose copies XLA hoists out of the loop; one carrying it
  (a call that cannot tell) multiplies the buffer as it lies each step: its
  blocks, for a model of one layer of I = H (`Plan.blocks`), else the whole
  buffer."""
  spec = jcr.CudnnGRU(1, 256, 256, dtype=jnp.float32)
  params = spec.init_params(jax.random.key(0))
  x, h, _ = random_inputs(spec, 1, 4)

  def decode(carried):
    def run(x, h, params):
      def body(carry, _):
        p, x, h = carry if carried else (params, *carry)
        y, h = spec(x, h, p, False, implementation="xla")
        return ((p, y, h) if carried else (y, h)), None
      return jax.lax.scan(body, (params, x, h) if carried else (x, h), None, length=3)[0]
    return run

  assert _whole_buffer_products(decode(False), x, h, params) == []
  assert ((2, 771, 256), (2, 4, 256)) not in _product_shapes(decode(False), x, h, params)
  assert ((2, 771, 256), (2, 4, 256)) in _product_shapes(decode(True), x, h, params)
  with pytest.MonkeyPatch.context() as m:
    _no_blocks(m)
    assert len(_whole_buffer_products(decode(True), x, h, params)) == 1
