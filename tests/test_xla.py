"""The fast "xla" backend (`_xla`, hand-derived tangent) against the plain reference scan.

Values, reverse-mode gradients with respect to every subset of inputs (each
subset leaves different tangents symbolically zero), forward-mode JVPs and
second order, over every mode, direction, input mode, depth and with lengths,
on short sequences, whose forward runs step by step; and the same on sequences
long enough for the forward to run a chunk of steps at a time; one step and
one sequence, whose products read the opaque weight blocks as they lie, and
a decoding loop around a call, out of which XLA must hoist the weights. Last, bfloat16
models, whose forward and backward passes multiply bfloat16 operands: the
operand dtypes, the values against numpy with the same rounding, the
gradients, forward mode and `vmap` (`test_rounded_dot.py` holds the product
itself against a hand-rounded one).
"""

import contextlib
import functools
import itertools

import jax
import jax.extend
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _chunks, _cpu, _lanes, _one_step, _reference, _rounded_dot, _xla
from helpers import (SPEC_CLASSES, assert_gradient_is_one_concatenation, every_output_loss,
                     jaxpr_equations, padding_changes_nothing, random_canonical, random_inputs,
                     relative_error)
from numpy_rnn import numpy_rnn

TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture
def cpu_host(monkeypatch):
  """The "xla" path's rules as on a CPU host (`jax.default_backend()` "cpu"),
  for the tests of those rules and of the programs they shape. On a GPU host
  (`benchmarks/gpu_session.sh`'s suite stage) the rules shape no lanes and no
  step-by-step derivative, so those tests would find none; patched, the
  programs are a CPU's, run on the GPU there, and their values still checked.
  A core's L2 cache is the Xeon's 2 MiB, whatever the host's (`_cpu.l2_bytes`:
  below 1 MiB it bounds the lanes, `test_lanes_bounded_by_the_l2_cache`)."""
  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  monkeypatch.setattr(_cpu, "l2_bytes", lambda: XEON_L2)


XEON_L2, ZEN3_L2 = 2 * 1024 * 1024, 512 * 1024


def _setup(cls, layers, direction, input_mode, T=6, B=3):
  input_size = 4 if input_mode == "skip_input" else 5
  spec = cls(layers, 4, input_size, direction=direction, input_mode=input_mode,
             dtype=jnp.float64)
  x, h, c = random_inputs(spec, T, B)
  params = spec.init_params(jax.random.key(3))
  return spec, (x, h, c, params)


_loss = every_output_loss


CONFIGS = list(itertools.product(SPEC_CLASSES, ["unidirectional", "bidirectional"],
                                 ["linear_input", "skip_input"], [False, True]))

def _lengths(T):
  """Full, partial and empty sequences (already clamped, as `_ops.rnn` passes them)."""
  return jnp.array([T, 2, 0], jnp.int32)


def _assert_close(a, b):
  assert np.all(np.isfinite(b)), "the reference produced non-finite values"
  np.testing.assert_allclose(a, b, **TOL)


def _all_derivatives(f, args, tangents, argnums):
  """Value, gradient with respect to `argnums` and the JVP along `tangents`, in one jit."""
  def run(*diff):
    full = list(args)
    for i, d in zip(argnums, diff):
      full[i] = d
    partial = lambda *d: f(*[d[argnums.index(i)] if i in argnums else full[i]
                             for i in range(len(full))])
    value, grads = jax.value_and_grad(partial, argnums=tuple(range(len(diff))))(*diff)
    _, jvp = jax.jvp(partial, diff, tuple(tangents[i] for i in argnums))
    return value, grads, jvp
  return jax.jit(run)(*[args[i] for i in argnums])


def _compare(spec, args, lengths, argnums):
  rng = np.random.default_rng(5)
  tangents = [None if a is None else rng.normal(size=np.shape(a)) for a in args]
  fast = _all_derivatives(_loss(_xla.rnn, spec, lengths), args, tangents, argnums)
  ref = _all_derivatives(_loss(_reference.rnn, spec, lengths), args, tangents, argnums)
  for a, b in zip(jax.tree.leaves(fast), jax.tree.leaves(ref)):
    _assert_close(a, b)


@pytest.mark.parametrize("cls,direction,input_mode,with_lengths", CONFIGS)
def test_values_gradients_and_jvp_match_reference(cls, direction, input_mode, with_lengths):
  """Two layers: layer 0 has the input mode's shapes, layer 1 the stacked input."""
  spec, args = _setup(cls, 2, direction, input_mode)
  lengths = _lengths(6) if with_lengths else None
  y_fast = jax.jit(lambda *a: _xla.rnn(spec, *a, seq_lengths=lengths))(*args)
  y_ref = jax.jit(lambda *a: _reference.rnn(spec, *a, seq_lengths=lengths))(*args)
  for a, b in zip(y_fast, y_ref):
    if b is not None:
      _assert_close(a, b)
  _compare(spec, args, lengths, tuple(i for i, a in enumerate(args) if a is not None))


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("argnum", [0, 1, 2, 3])
def test_single_input_derivatives(cls, argnum):
  """Only one input differentiated: the others' tangents are symbolic zeros."""
  spec, args = _setup(cls, 1, "bidirectional", "linear_input")
  if args[argnum] is None:
    pytest.skip(f"{cls.__name__} has no cell state")
  _compare(spec, args, _lengths(6), (argnum,))


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_second_order_matches_reference(cls):
  """Hessian-vector products (forward over reverse, reverse over reverse)."""
  spec, (x, h, c, params) = _setup(cls, 2, "bidirectional", "linear_input", T=4, B=3)
  v = np.random.default_rng(6).normal(size=params.shape)

  def hvps(impl):
    f = lambda p: _loss(impl, spec, _lengths(4))(x, h, c, p)
    fwd_over_rev = jax.jvp(jax.grad(f), (params,), (v,))[1]
    rev_over_rev = jax.grad(lambda p: jnp.vdot(jax.grad(f)(p), v))(params)
    return fwd_over_rev, rev_over_rev

  for a, b in zip(jax.jit(lambda: hvps(_xla.rnn))(), jax.jit(lambda: hvps(_reference.rnn))()):
    _assert_close(a, b)


def test_second_order_numerically():
  spec, (x, h, c, params) = _setup(SPEC_CLASSES[0], 1, "bidirectional", "linear_input", T=3,
                                   B=2)
  f = jax.jit(lambda x, p: _loss(_xla.rnn, spec, jnp.array([3, 1], jnp.int32))(x, h, c, p))
  check_grads(f, (x, params), order=2, modes=("rev", "fwd"), atol=1e-5, rtol=1e-5)


def test_chunk_steps():
  """From 32 steps on, a divisor in [4, 16], the nearest to the target (8 for the
  forward alone, 16 from 64 steps on for a GRU's and at any length for the other
  cells' in lanes, 4 for the derivative's forward; the smaller on a tie); else 1."""
  expected = {1: 1, 4: 1, 12: 1, 24: 1, 31: 1, 32: 8, 36: 9, 50: 10, 60: 6, 100: 10,
              101: 1, 256: 8}
  assert {t: _chunks.chunk_steps(t) for t in expected} == expected
  assert {t: _chunks.chunk_steps(t, _chunks.INFERENCE_CHUNK) for t in expected} == expected
  expected = {1: 1, 31: 1, 32: 4, 36: 4, 50: 5, 60: 4, 77: 7, 100: 4, 101: 1, 256: 4}
  assert {t: _chunks.chunk_steps(t, _chunks.DERIVATIVE_CHUNK) for t in expected} == expected
  expected = {32: 8, 63: 7, 64: 16, 100: 10, 128: 16, 150: 15, 256: 16}
  gru = {t: _chunks.chunk_steps(t, _chunks.inference_chunk("gru", t)) for t in expected}
  assert gru == expected
  assert {_chunks.inference_chunk(m, 256) for m in ("lstm", "rnn_tanh", "rnn_relu")} == {8}
  modes = ("lstm", "gru", "rnn_tanh", "rnn_relu")
  assert {m: _chunks.inference_chunk(m, 256, lanes=2) for m in modes} == dict.fromkeys(modes, 16)
  in_lanes = {m: _chunks.inference_chunk(m, 32, lanes=2) for m in modes}
  assert in_lanes == {"lstm": 16, "gru": 8, "rnn_tanh": 16, "rnn_relu": 16}
  assert _chunks.chunk_steps(63, _chunks.inference_chunk("lstm", 63, lanes=2)) == 9
  assert _chunks.chunk_steps(63, _chunks.inference_chunk("gru", 63, lanes=2)) == 7


def _scan_lengths(jaxpr) -> list[int]:
  """The trip counts of every `scan` in a jaxpr, nested ones included."""
  return [eqn.params["length"] for eqn in jaxpr_equations(jaxpr) if eqn.primitive.name == "scan"]


def test_forward_and_derivative_chunk_lengths():
  """The forward alone runs chunks of 8 steps (4 loop trips over 32 steps), the
  derivative's forward chunks of 4 (8 trips) and its tangent loop step by step."""
  spec, (x, h, c, params) = _setup(SPEC_CLASSES[0], 1, "unidirectional", "linear_input", T=32)
  forward = jax.make_jaxpr(lambda x: _xla.rnn(spec, x, h, c, params)[0])(x)
  assert _scan_lengths(forward) == [4]
  grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(_xla.rnn(spec, x, h, c, params)[0])))(x)
  assert sorted(_scan_lengths(grad)) == [8, 32], _scan_lengths(grad)


def _derivative_chunk(mode, B, T, H, *, directions=1):
  """`_chunks.derivative_chunk` for a layer of `mode` with these sizes, as
  `_xla._forward` sees it."""
  g = _xla._spec.NUM_GATES[mode]
  S = jax.ShapeDtypeStruct
  xs = (S((T, B, 16), jnp.float32),) * directions
  h0 = (S((B, H), jnp.float32),) * directions
  R = (S((H, g * H), jnp.float32),) * directions
  return _chunks.derivative_chunk(mode, xs, h0, R)


@pytest.mark.usefixtures("cpu_host")
def test_derivative_chunk_rule(monkeypatch):
  """On a CPU, the forward that the derivative runs goes step by step for a
  unidirectional LSTM or GRU whose recurrent matrix has at most 64 Ki elements
  (LSTM H128, GRU H147) where batch x units reach 4096; else in chunks near 4
  steps (and step by step below 32 steps, as any forward)."""
  steps = [("lstm", 32, 32, 128), ("lstm", 64, 32, 128), ("lstm", 512, 32, 8),
           ("lstm", 64, 64, 64), ("gru", 28, 32, 147), ("gru", 64, 50, 128),
           ("lstm", 256, 100, 16)]
  chunked = [("lstm", 31, 32, 128), ("lstm", 64, 32, 129), ("gru", 27, 32, 147),
             ("gru", 64, 32, 148), ("rnn_tanh", 64, 32, 128), ("rnn_relu", 128, 32, 128),
             ("lstm", 8, 32, 128), ("lstm", 16, 256, 256)]
  assert [_derivative_chunk(*case) for case in steps] == [1] * len(steps)
  assert [_derivative_chunk(*case) for case in chunked] == [4] * len(chunked)
  assert _derivative_chunk("gru", 64, 50, 148) == 5  # chunked: the divisor of 50 nearest 4
  assert _derivative_chunk("lstm", 64, 32, 128, directions=2) == 4
  assert _derivative_chunk("lstm", 64, 31, 128) == 1  # below 32 steps, step by step anyway
  symbolic_batch, = jax.export.symbolic_shape("b")
  assert _derivative_chunk("lstm", symbolic_batch, 32, 128) == 4
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert _derivative_chunk("lstm", 64, 32, 128) == 4


def _forward_chunk(mode, T, I, H, *, lanes=1, directions=1, skip_input=False):
  """`_chunks.forward_chunk` for a layer of `mode` with these sizes, as
  `_xla._forward` sees it (its batch, which the rule does not read, 16)."""
  g = _xla._spec.NUM_GATES[mode]
  S = jax.ShapeDtypeStruct
  xs = (S((T, 16, I), jnp.float32),) * directions
  W = None if skip_input else (S((I, g * H), jnp.float32),) * directions
  R = (S((H, g * H), jnp.float32),) * directions
  return _chunks.forward_chunk(mode, xs, W, R, lanes)


@pytest.mark.usefixtures("cpu_host")
def test_forward_chunk_rule(monkeypatch):
  """On a CPU, an LSTM's or a GRU's forward alone in one lane goes step by step
  where its recurrent matrix has 32-64 Ki elements (LSTM H91-H128, GRU
  H105-H147) and its input matrix at most 64 Ki (I up to 128 at an LSTM's H128,
  170 at a GRU's), either direction, with or without an input matrix; else in
  the chunks `chunk_steps` gives (`_chunks.forward_chunk`)."""
  steps = [("lstm", 50, 64, 128), ("lstm", 32, 128, 128), ("lstm", 256, 8, 91),
           ("lstm", 64, 170, 96), ("gru", 50, 64, 128), ("gru", 50, 170, 128),
           ("gru", 50, 8, 105), ("gru", 50, 8, 147)]
  chunked = [("lstm", 50, 129, 128), ("lstm", 50, 64, 129), ("lstm", 50, 64, 90),
             ("lstm", 50, 256, 128), ("gru", 50, 171, 128), ("gru", 50, 8, 104),
             ("gru", 50, 8, 148), ("rnn_tanh", 50, 64, 128), ("rnn_tanh", 50, 64, 200),
             ("rnn_relu", 50, 64, 200)]
  assert [_forward_chunk(*case) for case in steps] == [1] * len(steps)
  assert [_forward_chunk(*case) for case in chunked] == [10] * len(chunked)
  assert _forward_chunk("lstm", 50, 64, 128, directions=2) == 1
  assert _forward_chunk("lstm", 50, 128, 128, skip_input=True) == 1
  assert _forward_chunk("lstm", 50, 64, 128, lanes=2) == 10  # lanes: chunks near 16
  assert _forward_chunk("lstm", 64, 64, 128, lanes=2) == 16
  assert _forward_chunk("lstm", 256, 64, 64) == 8  # below the window, chunks near 8
  assert _forward_chunk("gru", 256, 64, 96) == 16  # a GRU's long forward, chunks near 16
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert _forward_chunk("lstm", 50, 64, 128) == 10


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls,hidden", [(jcr.CudnnLSTM, 96), (jcr.CudnnGRU, 112)])
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("with_lengths", [False, True])
def test_forward_in_the_step_window_runs_step_by_step(cls, hidden, direction, with_lengths):
  """An LSTM H96 and a GRU H112 (36 and 37 Ki elements of `R`) over 40 steps:
  the forward alone is a scan of 40 steps, not 5 chunks of 8, and its outputs
  and final states are the reference's, with and without `seq_lengths`; the
  derivative's forward keeps chunks of 4. Compared at float32's rounding."""
  spec = cls(1, hidden, 8, direction=direction)
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, 40, 3))
  params = spec.init_params(jax.random.key(2))
  lengths = jnp.array([40, 17, 0], jnp.int32) if with_lengths else None
  run = lambda rnn, x: rnn(spec, x, h, c, params, seq_lengths=lengths)
  assert _scan_lengths(jax.make_jaxpr(lambda x: run(_xla.rnn, x)[0])(x)) == [40]
  grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(run(_xla.rnn, x)[0])))(x)
  assert min(_scan_lengths(grad)) == 10, _scan_lengths(grad)  # 10 chunks of 4
  for a, b in zip(jax.jit(lambda x: run(_xla.rnn, x))(x), run(_reference.rnn, x)):
    assert (a is None) == (b is None)  # a GRU has no cell state
    if b is not None:
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
def test_derivative_of_a_small_matrix_over_many_sequences_runs_step_by_step(cls):
  """An LSTM and a GRU with H64 over 64 sequences (batch x units 4096): the
  derivative's forward is a scan of 32 steps, not 8 chunks of 4, and the
  values, gradients and JVP (every input) are the reference's. Float64, so
  that they compare at the suite's tolerance; the rule counts elements, not
  bytes."""
  spec = cls(1, 64, 8, dtype=jnp.float64)
  x, h, c = random_inputs(spec, 32, 64)
  params = spec.init_params(jax.random.key(3))
  loss = lambda x: jnp.sum(jnp.sin(_xla.rnn(spec, x, h, c, params)[0]))
  assert sorted(_scan_lengths(jax.make_jaxpr(jax.grad(loss))(x))) == [32, 32]
  _compare(spec, (x, h, c, params), None, [0, 1, 2, 3] if c is not None else [0, 1, 3])


@pytest.mark.parametrize("cls,steps,trips", [
    (jcr.CudnnGRU, 64, 4), (jcr.CudnnGRU, 48, 6), (jcr.CudnnLSTM, 64, 8),
    (jcr.CudnnRNNTanh, 64, 8)])
def test_long_gru_forward_runs_longer_chunks(cls, steps, trips):
  """A GRU's forward alone over 64 steps or more seeks chunks of 16 steps
  (`_chunks.inference_chunk`), the other cells' and shorter ones 8; the derivative's
  forward keeps chunks of 4 either way. Values as the reference's."""
  spec = cls(1, 3, 2)
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, steps, 2, seed=5))
  params = spec.init_params(jax.random.key(0))
  forward = lambda x: _xla.rnn(spec, x, h, c, params)[0]
  assert _scan_lengths(jax.make_jaxpr(forward)(x)) == [trips]
  grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(forward(x))))(x)
  assert sorted(_scan_lengths(grad)) == [steps // 4, steps], _scan_lengths(grad)
  _assert_close(forward(x), _reference.rnn(spec, x, h, c, params)[0])


def _scan_carry_shapes(jaxpr) -> list[list[tuple]]:
  """The shapes of the carried values of every `scan` in a jaxpr. A scan's
  parameters count its constants and carried values (`num_consts`,
  `num_carry`) up to jax 0.11; from jax 0.12 a tree of its inputs holds them
  (`ft_in`, whose `unpack()` gives constants, carried values and scanned
  values, as jax's own Pallas lowerings read it)."""
  out = []
  for eqn in jaxpr_equations(jaxpr):
    if eqn.primitive.name == "scan":
      if "num_consts" in eqn.params:
        start, carried = eqn.params["num_consts"], eqn.params["num_carry"]
      else:
        start, carried, scanned = (len(group) for group in eqn.params["ft_in"].unpack())
        assert start + carried + scanned == len(eqn.invars), eqn.params["ft_in"]
      out.append([v.aval.shape for v in eqn.invars[start:start + carried]])
  return out


def _scan_carries(jaxpr) -> list[int]:
  """The number of carried values of every `scan` in a jaxpr."""
  return [len(shapes) for shapes in _scan_carry_shapes(jaxpr)]


def _forward_carry(h_shapes, cell_state, with_lengths):
  """What a forward alone's loop carries, for lanes' hidden states of
  `h_shapes`: those, then, with a cell state, each lane's cell state, and
  with `seq_lengths` the cell state at each sequence's last valid step
  beside it (the masked chain's kept state, `_xla._carries_last_cells`)."""
  if not cell_state:
    return list(h_shapes)
  return list(h_shapes) + [s for s in h_shapes for _ in range(2 if with_lengths else 1)]


def _lanes_of(mode, B, T, H, *, dtype=jnp.float32, directions=1):
  """`_lanes.forward_lanes` for a layer of `mode` with these sizes, as `_xla._layer`
  sees it: the weights in the computation dtype (float32 for half-precision models)."""
  g = _xla._spec.NUM_GATES[mode]
  S = jax.ShapeDtypeStruct
  compute = _reference._compute_dtype(np.dtype(dtype))
  xs = (S((T, B, 16), compute),) * directions
  R = (S((H, g * H), compute),) * directions
  return _lanes.forward_lanes(mode, _xla.operand_dtype(dtype), xs, R)


@pytest.mark.usefixtures("cpu_host")
def test_forward_lanes_rule(monkeypatch):
  """Multiplied in float32 (float32 and float16 models), over 32 steps or more,
  on a single CPU device: from 8 sequences, lanes where the one direction's
  recurrent matrix has more than 256 KiB and at most 2 MiB, by unit for an
  LSTM's of at least 1 MiB over at most 16 sequences, else by batch; and by
  batch where it has at most 256 KiB but at least 64 KiB (an LSTM's) or 96 KiB
  (a GRU's) and batch x units reach 4096 (LSTM) or 7168 (GRU); below 8,
  lanes by unit for an LSTM's of at least 1 MiB or a GRU's of at least
  1.25 MiB, from 2 sequences; else one lane."""
  units = [("lstm", 2, 256, 256), ("lstm", 7, 32, 256), ("gru", 4, 64, 384),
           ("gru", 4, 128, 331), ("lstm", 3, 256, 363), ("gru", 7, 100, 1024),
           ("lstm", 4, 32, 2048), ("lstm", 8, 256, 256), ("lstm", 16, 32, 362),
           ("lstm", 12, 64, 300)]
  batch = [("lstm", 17, 256, 256), ("gru", 16, 256, 256), ("rnn_tanh", 16, 256, 511),
           ("rnn_relu", 16, 256, 300), ("lstm", 256, 32, 256), ("gru", 8, 64, 192),
           ("lstm", 9, 64, 160), ("gru", 64, 32, 384), ("lstm", 17, 256, 362),
           ("gru", 8, 256, 418), ("rnn_tanh", 8, 256, 257), ("rnn_tanh", 16, 256, 724),
           ("lstm", 16, 256, 255), ("gru", 16, 256, 384),
           # small matrices, many cells
           ("lstm", 32, 32, 128), ("lstm", 64, 32, 64), ("lstm", 48, 100, 96),
           ("gru", 64, 32, 112), ("gru", 96, 32, 96), ("gru", 256, 64, 128)]
  one = [("lstm", 16, 256, 128), ("lstm", 16, 256, 512), ("gru", 16, 256, 128),
         ("rnn_tanh", 16, 256, 256), ("gru", 16, 256, 1024), ("lstm", 4, 256, 255),
         ("lstm", 16, 256, 363), ("gru", 8, 256, 419), ("rnn_tanh", 16, 256, 725),
         ("lstm", 7, 256, 192), ("gru", 4, 256, 330), ("lstm", 1, 256, 256),
         ("lstm", 4, 31, 256), ("lstm", 16, 31, 256), ("lstm", 16, 1, 256),
         ("rnn_relu", 4, 256, 512), ("rnn_tanh", 7, 256, 1024),
         # small matrices: too few cells, or too small a matrix, or not LSTM/GRU
         ("lstm", 31, 32, 128), ("lstm", 32, 32, 96), ("lstm", 256, 32, 63),
         ("gru", 64, 32, 96), ("gru", 128, 32, 64), ("gru", 63, 32, 112),
         ("rnn_tanh", 128, 32, 128), ("rnn_relu", 256, 32, 128), ("lstm", 64, 31, 128)]
  assert [_lanes_of(*case) for case in units] == ["units"] * len(units)
  assert [_lanes_of(*case) for case in batch] == ["batch"] * len(batch)
  assert [_lanes_of(*case) for case in one] == [None] * len(one)
  assert _lanes_of("lstm", 4, 256, 256, dtype=jnp.float16) == "units"
  assert _lanes_of("lstm", 16, 256, 256, dtype=jnp.float16) == "units"
  assert _lanes_of("lstm", 32, 256, 256, dtype=jnp.float16) == "batch"
  monkeypatch.setattr(_cpu, "flags", lambda: frozenset({"avx2", "fma"}))
  assert _lanes_of("lstm", 16, 256, 256, dtype=jnp.bfloat16) is None  # no bfloat16 products
  assert _lanes_of("lstm", 4, 256, 256, dtype=jnp.bfloat16) is None
  assert _lanes_of("rnn_tanh", 16, 256, 256, dtype=jnp.float64) is None  # 512 KiB, float64
  assert _lanes_of("lstm", 16, 256, 256, directions=2) is None
  assert _lanes_of("lstm", 4, 256, 256, directions=2) is None
  symbolic_batch, = jax.export.symbolic_shape("b")
  assert _lanes_of("lstm", symbolic_batch, 256, 256) is None
  for backend, devices in (("cpu", 4), ("gpu", 1)):
    with monkeypatch.context() as m:
      m.setattr(jax, "device_count", lambda: devices)
      m.setattr(jax, "default_backend", lambda: backend)
      assert _lanes_of("lstm", 17, 256, 256) is None
      assert _lanes_of("lstm", 4, 256, 256) is None


@pytest.mark.usefixtures("cpu_host")
def test_forward_lanes_in_the_program():
  """A model the rule gives two lanes carries each lane's states in its forward
  loop, with `seq_lengths` too (and then each lane's kept cell state): LSTM
  H256 over 4 or 12 sequences, h and c of each lane's 128 units; over 18, of
  each lane's 9 sequences. Its
  derivative's loops carry one lane's; a bidirectional model's forward
  carries one lane per direction."""
  lengths = lambda B: jnp.array([32] * (B - 1) + [5], jnp.int32)
  for B, direction, with_lengths, lane in (
      (4, "unidirectional", False, (4, 128)), (4, "unidirectional", True, (4, 128)),
      (12, "unidirectional", False, (12, 128)), (12, "unidirectional", True, (12, 128)),
      (18, "unidirectional", False, (9, 256)), (18, "unidirectional", True, (9, 256)),
      (8, "bidirectional", False, (8, 256)), (4, "bidirectional", False, (4, 256))):
    spec = jcr.CudnnLSTM(1, 256, 8, direction=direction)
    x, h, c = (jnp.asarray(a) for a in random_inputs(spec, 32, B))
    params = spec.init_params(jax.random.key(0))
    forward = lambda x: _xla.rnn(spec, x, h, c, params,
                                 seq_lengths=lengths(B) if with_lengths else None)[0]
    assert _scan_carry_shapes(jax.make_jaxpr(forward)(x)) == [
        _forward_carry([lane] * 2, True, with_lengths)], (B, direction)
  spec = jcr.CudnnLSTM(1, 256, 8)
  params = spec.init_params(jax.random.key(0))
  for B in (4, 8):
    x, h, c = (jnp.asarray(a) for a in random_inputs(spec, 32, B))
    grad = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(_xla.rnn(spec, x, h, c, params)[0])))(x)
    assert _scan_carry_shapes(grad) == [[(B, 256)] * 2] * 2, B


@pytest.mark.usefixtures("cpu_host")
def test_small_matrix_over_many_sequences_runs_in_lanes():
  """An LSTM with a small recurrent matrix (H64: 64 KiB) over 64 sequences runs
  its forward in two lanes by batch (`_lanes.SMALL_LANE_MIN_CELLS`), each carrying
  32 sequences' states; its values, final states and gradient as the
  reference's (float32: the lanes apply to float32 products only)."""
  spec = jcr.CudnnLSTM(1, 64, 8)
  x, h, c = (jnp.asarray(a) for a in random_inputs(spec, 32, 64))
  params = spec.init_params(jax.random.key(0))
  run = lambda rnn, x: rnn(spec, x, h, c, params)
  forward = jax.jit(lambda x: run(_xla.rnn, x))
  assert _scan_carry_shapes(jax.make_jaxpr(lambda x: run(_xla.rnn, x)[0])(x)) == [[(32, 64)] * 4]
  for a, b in zip(forward(x), run(_reference.rnn, x)):  # float32: rounding apart
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  loss = lambda rnn: lambda x: jnp.sum(jnp.sin(run(rnn, x)[0]))
  np.testing.assert_allclose(jax.grad(loss(_xla.rnn))(x), jax.grad(loss(_reference.rnn))(x),
                             rtol=1e-4, atol=1e-6)


def _assert_lanes_match_reference(run, forward, x):
  """`forward(x)` (the "xla" path of `run(rnn, x)`, jitted) against the
  reference's outputs and final states; the gradient of a loss of the outputs
  (one lane) and `vmap` over two inputs too. The gradient and `vmap` are
  jitted, each path's program compiled whole: run eagerly, op by op, they
  took about a third of the lane tests' time (session 66) for the same
  transformations of the same function."""
  for a, b in zip(forward(x), run(_reference.rnn, x)):
    if b is not None:
      _assert_close(a, b)
  grad = lambda rnn: jax.jit(jax.grad(lambda x: jnp.sum(jnp.sin(run(rnn, x)[0]))))
  _assert_close(grad(_xla.rnn)(x), grad(_reference.rnn)(x))
  xs = jnp.stack([x, 2 * x])
  vmapped = jax.jit(jax.vmap(lambda x: run(_xla.rnn, x)[0]))(xs)
  _assert_close(vmapped, jnp.stack([run(_reference.rnn, a)[0] for a in xs]))


@pytest.fixture
def lanes_everywhere(monkeypatch, cpu_host):
  """The forward alone in two lanes by batch at any batch of two or more, any
  weight size, and float64 (for the tests' tolerance)."""
  monkeypatch.setattr(_lanes, "LANE_MIN_BATCH", 2)
  monkeypatch.setattr(_lanes, "LANE_WEIGHT_BYTES", (0, np.inf))
  monkeypatch.setattr(_lanes, "LANE_DTYPES", frozenset({np.dtype(np.float64)}))


AVX512_BF16 = frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})  # no AMX: a Zen 5's
AMX = AVX512_BF16 | {"amx_tile", "amx_bf16"}  # a recent Xeon's
XEON_WITHOUT_AMX = AVX512_BF16 | {"avx512_fp16"}  # one in a virtual machine hiding AMX


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("flags,vendor", [(AVX512_BF16, "AuthenticAMD"), (AMX, "GenuineIntel"),
                                          (XEON_WITHOUT_AMX, "GenuineIntel")],
                         ids=["avx512_bf16", "amx", "xeon-without-amx"])
def test_bfloat16_forward_lanes_rule(flags, vendor, monkeypatch):
  """bfloat16 products on a CPU with AVX512-BF16 (a Zen 5) or AMX (a Xeon):
  lanes by unit for an LSTM's or GRU's forward alone whose recurrent matrix
  has 384 KiB to 2 MiB in bfloat16 (LSTM H222-H512, GRU H256-H591), over 2
  sequences or more, and from 256 KiB (LSTM H182, GRU H210) over 24 (the Zen
  5) or 48 (AMX) to 112 sequences; over 32 steps or more, on a single CPU
  device; else one lane, as on a CPU with neither or whose flags are
  unknown. A Xeon whose virtual machine hides AMX multiplies the rounded
  operands in float32 (`_rounded_dot.float32_products`), and there the
  narrower window from 256 KiB runs in one lane."""
  monkeypatch.setattr(_cpu, "flags", lambda: flags)
  monkeypatch.setattr(_cpu, "vendor", lambda: vendor)
  float32_products = flags == XEON_WITHOUT_AMX
  assert _rounded_dot.float32_products(jnp.bfloat16) == float32_products
  lanes = lambda *case, directions=1: _lanes_of(*case, dtype=jnp.bfloat16, directions=directions)
  units = [("lstm", 16, 256, 256), ("lstm", 2, 32, 256), ("lstm", 256, 32, 256),
           ("lstm", 8, 128, 222), ("lstm", 16, 64, 512), ("gru", 16, 256, 256),
           ("gru", 64, 32, 384), ("gru", 4, 128, 591), ("gru", 2, 100, 300)]
  one = [("lstm", 1, 128, 256), ("lstm", 16, 31, 256), ("lstm", 16, 256, 221),
         ("lstm", 16, 64, 513), ("gru", 16, 128, 255), ("gru", 16, 64, 592),
         ("rnn_tanh", 16, 256, 512), ("rnn_relu", 16, 256, 400), ("lstm", 16, 256, 128)]
  assert [lanes(*case) for case in units] == ["units"] * len(units)
  assert [lanes(*case) for case in one] == [None] * len(one)
  # Below 384 KiB, from 256 KiB: only over 24 (AMX: 48) to 112 sequences.
  narrow = [("lstm", 48, 32, 182), ("lstm", 112, 100, 221), ("lstm", 64, 32, 192),
            ("gru", 48, 64, 210), ("gru", 112, 32, 255)]
  narrow_one = [("lstm", 23, 32, 192), ("lstm", 113, 32, 192), ("lstm", 64, 32, 181),
                ("gru", 64, 32, 209), ("gru", 16, 128, 224), ("gru", 128, 100, 224),
                ("lstm", 64, 31, 192), ("rnn_tanh", 64, 32, 400)]
  assert [lanes(*case) for case in narrow] == [None if float32_products else "units"] * len(narrow)
  assert [lanes(*case) for case in narrow_one] == [None] * len(narrow_one)
  from_24 = [("lstm", 24, 32, 182), ("lstm", 47, 100, 221), ("gru", 24, 64, 210),
             ("gru", 32, 64, 224)]
  assert [lanes(*case) for case in from_24] == (
      [None] * len(from_24) if flags == AMX or float32_products else ["units"] * len(from_24))
  assert lanes("lstm", 64, 32, 192, directions=2) is None
  assert lanes("lstm", 16, 256, 256, directions=2) is None
  symbolic_batch, = jax.export.symbolic_shape("b")
  assert lanes("lstm", symbolic_batch, 256, 256) is None
  # float16 models multiply in float32: the float32 rule (by batch here).
  assert _lanes_of("lstm", 32, 256, 256, dtype=jnp.float16) == "batch"
  for backend, devices in (("cpu", 4), ("gpu", 1)):
    with monkeypatch.context() as m:
      m.setattr(jax, "device_count", lambda: devices)
      m.setattr(jax, "default_backend", lambda: backend)
      assert lanes("lstm", 16, 256, 256) is None
  for other in (frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512f"}), None):
    monkeypatch.setattr(_cpu, "flags", lambda: other)
    assert lanes("lstm", 16, 256, 256) is None, other
    assert lanes("gru", 4, 128, 384) is None, other
    assert lanes("lstm", 64, 32, 192) is None, other


@pytest.mark.usefixtures("cpu_host")
def test_lanes_bounded_by_the_l2_cache(monkeypatch):
  """From 8 sequences, lanes only where the recurrent matrix has less than
  twice a core's L2 cache: with a Zen 3's 512 KiB, an LSTM's H256 (1 MiB) runs
  in one lane, by batch or by unit as it would otherwise; a GRU's H256 (768
  KiB), an LSTM's H255 and the small matrices keep their lanes, and so do
  lanes by unit below 8 sequences. Where L2 is unknown, no bound (the Xeon's
  rule); with 1 MiB (a Zen 5's), none of the window's integer sizes reach it."""
  cases = {("lstm", 16, 256, 256): "units", ("lstm", 64, 32, 256): "batch",
           ("lstm", 8, 256, 256): "units", ("lstm", 17, 256, 362): "batch",
           ("gru", 16, 256, 256): "batch", ("gru", 8, 256, 256): "batch",
           ("lstm", 64, 32, 255): "batch", ("lstm", 64, 32, 224): "batch",
           ("lstm", 64, 32, 64): "batch", ("gru", 64, 32, 128): "batch",
           ("lstm", 4, 256, 256): "units", ("gru", 4, 64, 384): "units",
           ("rnn_tanh", 16, 256, 511): "batch", ("rnn_tanh", 16, 256, 512): "batch"}
  assert {case: _lanes_of(*case) for case in cases} == cases  # the Xeon's L2
  for l2 in (None, 1024 * 1024):
    monkeypatch.setattr(_cpu, "l2_bytes", lambda: l2)
    assert {case: _lanes_of(*case) for case in cases} == cases, l2
  monkeypatch.setattr(_cpu, "l2_bytes", lambda: ZEN3_L2)
  bounded = {("lstm", 16, 256, 256), ("lstm", 64, 32, 256), ("lstm", 8, 256, 256),
             ("lstm", 17, 256, 362), ("rnn_tanh", 16, 256, 512)}
  assert {case: _lanes_of(*case) for case in cases} == {
      case: None if case in bounded else lanes for case, lanes in cases.items()}
  # bfloat16 products have a rule of their own, measured on CPUs with AVX512-BF16 or AMX
  # (none with 512 KiB of L2), which the bound leaves alone.
  monkeypatch.setattr(_cpu, "flags", lambda: AVX512_BF16)
  assert _lanes_of("lstm", 16, 256, 256, dtype=jnp.bfloat16) == "units"


def test_l2_bytes_reads_sysfs(monkeypatch, tmp_path):
  """`_cpu.l2_bytes` finds the level-2 cache among sysfs's cache indices and
  reads its size ("512K", "1M"); None where there is none or it cannot be
  read."""
  def caches(*entries):
    root = tmp_path / str(len(list(tmp_path.iterdir())))
    for i, (level, kind, size) in enumerate(entries):
      index = root / f"index{i}"
      index.mkdir(parents=True)
      for name, text in (("level", level), ("type", kind), ("size", size)):
        (index / name).write_text(text + "\n")
    return root
  for entries, expected in (
      ([("1", "Data", "32K"), ("1", "Instruction", "32K"), ("2", "Unified", "512K"),
        ("3", "Unified", "32768K")], 512 * 1024),
      ([("1", "Data", "48K"), ("2", "Unified", "2048K")], 2 * 1024 * 1024),
      ([("2", "Unified", "1M")], 1024 * 1024),
      ([("1", "Data", "32K"), ("2", "Instruction", "1M")], None),
      ([("1", "Data", "32K")], None),
      ([("2", "Unified", "lots")], None)):
    monkeypatch.setattr(_cpu, "CACHES", caches(*entries))
    _cpu.l2_bytes.cache_clear()
    assert _cpu.l2_bytes() == expected, entries
  monkeypatch.setattr(_cpu, "CACHES", tmp_path / "missing")
  _cpu.l2_bytes.cache_clear()
  assert _cpu.l2_bytes() is None
  _cpu.l2_bytes.cache_clear()  # the host's again for the tests after


def test_bfloat16_products_reads_the_cpu_flags(monkeypatch):
  for flags, kind in ((AMX, "amx"), (AVX512_BF16, "avx512_bf16"),
                      (frozenset({"avx2", "fma", "avx512f"}), None), (frozenset(), None),
                      (None, None)):
    monkeypatch.setattr(_cpu, "flags", lambda: flags)
    assert _cpu.bfloat16_products() == kind, flags


def test_avx512_reads_the_cpu_flags(monkeypatch):
  for flags, has in ((frozenset({"avx2", "fma", "avx512f"}), True), (AVX512_BF16, True),
                     (frozenset({"avx2", "fma"}), False), (frozenset(), False), (None, None)):
    monkeypatch.setattr(_cpu, "flags", lambda: flags)
    assert _cpu.avx512() is has, flags


def test_bfloat16_products_fast_by_cpu(monkeypatch):
  """Quick where measured so: AMX, or AVX512-BF16 on an AMD CPU; slow where
  measured so: an Intel CPU with AVX512-BF16 and AVX512-FP16 but no AMX (a
  virtual machine hiding it), an x86 one with neither; unknown on an Intel
  one with AVX512-BF16 alone (a Cooper Lake), off x86, or without flags."""
  neither = frozenset({"avx2", "fma", "avx512f"})
  for flags, vendor, fast in (
      (AMX, "GenuineIntel", True), (AVX512_BF16, "AuthenticAMD", True),
      (XEON_WITHOUT_AMX, "GenuineIntel", False), (AVX512_BF16, "GenuineIntel", None),
      (neither, "AuthenticAMD", False),
      (neither, "GenuineIntel", False), (frozenset({"fp", "asimd", "bf16"}), None, None),
      (AVX512_BF16, "HygonGenuine", None), (None, "GenuineIntel", None)):
    monkeypatch.setattr(_cpu, "flags", lambda: flags)
    monkeypatch.setattr(_cpu, "vendor", lambda: vendor)
    assert _cpu.bfloat16_products_fast() is fast, (flags, vendor)


def test_vendor_and_flags_read_cpuinfo(monkeypatch, tmp_path):
  """`_cpu.vendor` and `_cpu.flags` read /proc/cpuinfo's first CPU; None where
  a field is missing or empty, or the file cannot be read."""
  for text, vendor, flags in (
      ("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512_bf16\n\n"
       "processor\t: 1\nvendor_id\t: AuthenticAMD\n", "GenuineIntel",
       frozenset({"fpu", "avx2", "avx512_bf16"})),
      ("processor\t: 0\nFeatures\t: fp asimd bf16\n", None, frozenset({"fp", "asimd", "bf16"})),
      ("vendor_id\t: \n", None, None)):
    path = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
    path.write_text(text)
    monkeypatch.setattr(_cpu, "CPUINFO", path)
    _cpu.vendor.cache_clear()
    _cpu.flags.cache_clear()
    assert (_cpu.vendor(), _cpu.flags()) == (vendor, flags), text
  monkeypatch.setattr(_cpu, "CPUINFO", tmp_path / "missing")
  _cpu.vendor.cache_clear()
  _cpu.flags.cache_clear()
  assert (_cpu.vendor(), _cpu.flags()) == (None, None)
  _cpu.vendor.cache_clear()  # the host's again for the tests after
  _cpu.flags.cache_clear()


@pytest.fixture
def unit_lanes_everywhere(monkeypatch, cpu_host):
  """The forward alone in two lanes by unit for any cell, weight size and batch
  of two to seven, and float64."""
  monkeypatch.setattr(_lanes, "UNIT_LANE_MIN_BYTES", {mode: 0 for mode in _xla._CELLS})
  monkeypatch.setattr(_lanes, "LANE_DTYPES", frozenset({np.dtype(np.float64)}))


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("H", [4, 5], ids=["even", "uneven"])
@pytest.mark.parametrize("input_mode,T,with_lengths", [
    ("linear_input", 32, True), ("skip_input", 37, False)], ids=["chunks", "steps_skip_input"])
def test_forward_in_unit_lanes_matches_reference(cls, H, input_mode, T, with_lengths,
                                                 unit_lanes_everywhere):
  """Two layers' forward in two lanes by unit (of 2 and 2 units, or 2 and 3),
  in chunks of steps with `seq_lengths` and step by step (37 steps) under
  skip_input: every loop carries each lane's part of the states, and the
  outputs and final states are the reference's; the gradient (one lane) and
  `vmap` too."""
  spec = cls(2, H, H if input_mode == "skip_input" else 5, input_mode=input_mode,
             dtype=jnp.float64)
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, T, 3, seed=2))
  params = spec.init_params(jax.random.key(3))
  lengths = jnp.array([T, 7, 0], jnp.int32) if with_lengths else None
  run = lambda rnn, x: rnn(spec, x, h, c, params, seq_lengths=lengths)
  forward = jax.jit(lambda x: run(_xla.rnn, x))
  states = _forward_carry([(3, H // 2), (3, H - H // 2)], spec.has_cell_state, with_lengths)
  assert _scan_carry_shapes(jax.make_jaxpr(forward)(x)) == [states] * 2
  _assert_lanes_match_reference(run, forward, x)


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("direction,T,lanes", [
    ("unidirectional", 6, None), ("unidirectional", 32, None), ("unidirectional", 32, "batch"),
    ("unidirectional", 32, "units"), ("bidirectional", 6, None), ("bidirectional", 32, None),
    ("bidirectional", 32, "batch")],
    ids=["steps", "chunks", "batch_lanes", "unit_lanes", "bi_steps", "bi_chunks", "bi_batch_lanes"])
def test_lstm_forward_alone_ignores_inputs_past_the_lengths(direction, T, lanes, monkeypatch):
  """An LSTM's forward alone with `seq_lengths` runs its cell state on
  unmasked past each sequence's end, and keeps the state at its last valid
  step beside it (`_xla._carries_last_cells`), step by step, in chunks and in
  lanes: its outputs (zeros past the ends) and final states are the
  reference's, a sequence of length 0 keeps its initial states exactly, and
  inputs past the ends of NaN or inf change no bit (`_reference.rnn` zeroes
  them, `test_inputs_past_the_lengths_reach_no_gradient`). Returning the
  running state instead of the kept one fails every case."""
  monkeypatch.setattr(_lanes, "forward_lanes", lambda *args: lanes)
  spec = jcr.CudnnLSTM(2, 4, 5, direction=direction, dtype=jnp.float64)
  x, h, c = (jnp.asarray(a) for a in random_inputs(spec, T, 4, seed=7))
  params = spec.init_params(jax.random.key(8))
  lengths = jnp.array([T, 5, 0, 3], jnp.int32)
  past = np.arange(T)[:, None] >= np.asarray(lengths)[None]
  forward = jax.jit(lambda x: _xla.rnn(spec, x, h, c, params, seq_lengths=lengths))
  y, h_out, c_out = zeros = padding_changes_nothing(forward, x, past)
  assert not np.any(np.asarray(y)[past]) and np.all(np.isfinite(np.asarray(y)))
  np.testing.assert_array_equal(h_out[:, 2], h[:, 2])
  np.testing.assert_array_equal(c_out[:, 2], c[:, 2])
  x_zero_padded = jnp.where(past[..., None], 0.0, x)
  reference = _reference.rnn(spec, x_zero_padded, h, c, params, seq_lengths=lengths)
  for got, want in zip(zeros, reference):
    _assert_close(got, want)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("T", [6, 32], ids=["steps", "chunks"])
def test_inputs_past_the_lengths_reach_no_gradient(cls, T):
  """Inputs past each sequence's length (NaN or inf) change no bit of the
  "xla" path's or the reference's outputs, final states or gradients, which
  are those of zero padding; the gradient with respect to them is zero.
  (Unzeroed, the weights' gradient summed padding times a zero cotangent:
  NaN.)"""
  spec = cls(2, 4, 5, direction="bidirectional", dtype=jnp.float64)
  x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, T, 4, seed=9))
  params = spec.init_params(jax.random.key(10))
  lengths = jnp.array([T, 5, 0, 3], jnp.int32)
  past = np.arange(T)[:, None] >= np.asarray(lengths)[None]
  for rnn in (_xla.rnn, _reference.rnn):
    run = jax.jit(jax.value_and_grad(_loss(rnn, spec, lengths), argnums=(0, 1, 2, 3)
                                     if spec.has_cell_state else (0, 1, 3)))
    zeros = padding_changes_nothing(run, x, past, h, c, params)
    dx = zeros[1][0]
    assert np.all(np.isfinite(dx)) and not np.any(dx[past]) and np.any(dx[~past])


def test_lstm_forward_in_unit_lanes_from_eight_sequences(lanes_everywhere, unit_lanes_everywhere):
  """From 8 sequences the rule takes an LSTM's forward in lanes by unit (up to
  `UNIT_LANE_MAX_BATCH`), with `seq_lengths`: 9 sequences of 5 units, each
  loop carrying 2 and 3 units of all 9; outputs, final states, the gradient
  and `vmap` as the reference's. A GRU's stays in lanes by batch."""
  for cls, states in ((jcr.CudnnLSTM, _forward_carry([(9, 2), (9, 3)], True, True)),
                      (jcr.CudnnGRU, [(4, 5), (5, 5)])):
    spec = cls(2, 5, 6, dtype=jnp.float64)
    x, h, c = (None if a is None else jnp.asarray(a) for a in random_inputs(spec, 32, 9, seed=4))
    params = spec.init_params(jax.random.key(5))
    lengths = jnp.array([32, 7, 0, 32, 31, 1, 16, 32, 3], jnp.int32)
    run = lambda rnn, x: rnn(spec, x, h, c, params, seq_lengths=lengths)
    forward = jax.jit(lambda x: run(_xla.rnn, x))
    assert _scan_carry_shapes(jax.make_jaxpr(forward)(x)) == [states] * 2, cls
    _assert_lanes_match_reference(run, forward, x)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("B", [3, 4], ids=["uneven", "even"])
@pytest.mark.parametrize("input_mode", ["linear_input", "skip_input"])
@pytest.mark.parametrize("with_lengths", [False, True], ids=["full", "lengths"])
def test_forward_in_lanes_matches_reference(cls, B, input_mode, with_lengths, lanes_everywhere):
  """Two layers' forward in two lanes (of 1 and 2 sequences, or 2 and 2), with
  and without `seq_lengths`: outputs and final states as the reference's; the
  gradient (one lane) and `vmap` too."""
  spec, (x, h, c, params) = _setup(cls, 2, "unidirectional", input_mode, T=32, B=B)
  x, h, c = (None if a is None else jnp.asarray(a) for a in (x, h, c))
  lengths = jnp.array([32, 7, 0, 19][:B], jnp.int32) if with_lengths else None
  run = lambda rnn, x: rnn(spec, x, h, c, params, seq_lengths=lengths)
  forward = jax.jit(lambda x: run(_xla.rnn, x))
  per_lane = len(_forward_carry([None], spec.has_cell_state, with_lengths))
  assert _scan_carries(jax.make_jaxpr(forward)(x)) == [2 * per_lane] * 2
  _assert_lanes_match_reference(run, forward, x)


@pytest.mark.parametrize("cls,T,B,trips,carries", [
    (jcr.CudnnLSTM, 64, 3, 4, 4), (jcr.CudnnLSTM, 64, 1, 8, 2), (jcr.CudnnGRU, 64, 3, 4, 2),
    (jcr.CudnnLSTM, 32, 3, 2, 4), (jcr.CudnnRNNRelu, 48, 3, 3, 2), (jcr.CudnnRNNTanh, 32, 1, 4, 1),
    (jcr.CudnnGRU, 32, 3, 4, 2)],
    ids=["lstm_two_lanes", "lstm_one_lane", "gru_two_lanes", "lstm_two_lanes_T32",
         "relu_two_lanes_T48", "tanh_one_lane_T32", "gru_two_lanes_T32"])
def test_forward_in_lanes_runs_chunks_of_16(cls, T, B, trips, carries, lanes_everywhere):
  """A forward alone in two lanes seeks chunks of 16 steps (an LSTM's over 64
  steps: 4 loop trips, each carrying two lanes' h and c; over 32, 2 trips; an
  RNN-relu's over 48, 3), but a GRU's only from 64 steps on (8 below), and in
  one lane only a GRU's (`_chunks.inference_chunk`). Outputs and final states as
  the reference's."""
  spec, (x, h, c, params) = _setup(cls, 1, "unidirectional", "linear_input", T=T, B=B)
  forward = jax.jit(lambda x: _xla.rnn(spec, x, h, c, params))
  jaxpr = jax.make_jaxpr(forward)(x)
  assert (_scan_lengths(jaxpr), _scan_carries(jaxpr)) == ([trips], [carries])
  for a, b in zip(forward(x), _reference.rnn(spec, x, h, c, params)):
    if b is not None:
      _assert_close(a, b)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
@pytest.mark.parametrize("input_mode", ["linear_input", "skip_input"])
def test_param_blocks_hold_the_canonical_tensors(cls, direction, input_mode):
  """Each block is its side's g canonical tensors stacked (weights `[g*H, in]`,
  biases `[g*H]`), and the blocks, in the dict's order, tile the buffer:
  skip_input's layer 0 has no input weight block."""
  spec = cls(2, 4, 4, input_mode=input_mode, direction=direction)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  blocks = _reference.param_blocks(spec, params)
  np.testing.assert_array_equal(np.concatenate([v.reshape(-1) for v in blocks.values()]), params)
  g, D = spec.num_gates, spec.num_dirs
  expected = {}
  w, b = iter(weights), iter(biases)
  for layer in range(2):
    for d in range(D):
      for side in (0, 1):
        if not (side == 0 and layer == 0 and input_mode == "skip_input"):
          expected[(layer, d, "weight", side)] = np.concatenate([next(w) for _ in range(g)])
      for side in (0, 1):
        expected[(layer, d, "bias", side)] = np.concatenate([next(b) for _ in range(g)])
  assert next(w, None) is None and next(b, None) is None
  assert sorted(blocks) == sorted(expected)
  for key, want in expected.items():
    np.testing.assert_array_equal(blocks[key], want, err_msg=str(key))
  assert sum(v.size for v in blocks.values()) == spec.params_size()


def test_params_gradient_is_one_concatenation():
  """The gradient of the opaque buffer is assembled by one concatenation of
  the blocks' cotangents, with no buffer-sized zero padding summed per layer
  (`_reference.param_blocks`: XLA:CPU fused such a sum with every layer's
  weight-gradient matmuls, keeping each layer's cotangents alive to the end),
  and it equals the reference's."""
  spec, (x, h, c, params) = _setup(jcr.CudnnGRU, 3, "unidirectional", "linear_input", T=5)
  loss = lambda p: jnp.sum(_xla.rnn(spec, x, h, c, p)[0] ** 2)
  assert_gradient_is_one_concatenation(jax.make_jaxpr(jax.grad(loss))(params), spec.params_size())
  ref = jax.grad(lambda p: jnp.sum(_reference.rnn(spec, x, h, c, p)[0] ** 2))(params)
  assert relative_error(jax.grad(loss)(params), ref) < 1e-5


@pytest.mark.parametrize("cls, dtype, inputs_first", [
    (jcr.CudnnGRU, jnp.float32, True),
    (jcr.CudnnGRU, jnp.bfloat16, True),
    (jcr.CudnnLSTM, jnp.float32, False),
    (jcr.CudnnLSTM, jnp.bfloat16, True),
    (jcr.CudnnRNNTanh, jnp.float32, False),
])
def test_weight_gradient_orientation(cls, dtype, inputs_first):
  """The weight gradients multiply the layer's inputs by the cotangent
  (`x^T du`, `[in, g*H]`) for a GRU and for bfloat16 models, and the cotangent
  by the inputs (`du^T x`, `[g*H, in]`) otherwise
  (`_xla._weight_tangent_matmul`); either way they equal the reference's."""
  T, B = 7, 3
  spec = cls(2, 4, 5, direction="bidirectional", dtype=dtype)
  x, h, c = random_inputs(spec, T, B)
  params = spec.init_params(jax.random.key(3))
  loss = lambda impl: lambda p: jnp.sum(jnp.sin(impl(spec, x, h, c, p)[0].astype(jnp.float32)))
  eqns = list(jaxpr_equations(jax.make_jaxpr(jax.grad(loss(_xla.rnn)))(params)))
  # The weight gradients: products of the cotangents by a layer's inputs (5 or
  # 8 wide) or its states (4 wide), contracting time and batch. A GRU's R
  # meets two cotangents, one for its n block alone (4 wide; `_xla._layer_jvp`).
  gH = spec.num_gates * 4
  products = [e.outvars[0].aval.shape for e in eqns
              if e.primitive.name in ("dot_general", "jcr_rounded_dot")
              and len(e.params["dimension_numbers"][0][0]) == 2]
  gru = cls is jcr.CudnnGRU
  # W and R of 2 layers x 2 directions, and a GRU's R's n block
  assert len(products) == 2 * 2 * (3 if gru else 2), products
  widths = [p[1] if inputs_first else p[0] for p in products]
  assert sorted(widths) == sorted([gH] * 8 + ([4] * 4 if gru else [])), products
  assert all(p[0 if inputs_first else 1] in (4, 5, 8) for p in products), products
  want = jax.grad(loss(_reference.rnn))(params)
  assert relative_error(jax.grad(loss(_xla.rnn))(params), want) < (
      1e-5 if dtype == jnp.float32 else 4e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gru_gradient_stacks_one_gate_wide_cotangent(dtype):
  """A GRU's gradient multiplies one `[T, B, 3H]` cotangent per layer and
  direction, by the layer's inputs (`dW`), its states (`dR`, its n block
  masked off) and `W` (`dx`); R's n block meets a `[T, B, H]` one of its own
  (`_xla._layer_jvp`). It stacked two of `[T, B, 3H]` before (session 54:
  forward+backward in 78% of the memory at B64 T100 I128 H128). Gradients
  against the reference, also with the r and z blocks of R and of the biases
  zeroed, so that the recurrent terms reach the loss through the n gate alone."""
  T, B, H = 7, 3, 4
  spec = jcr.CudnnGRU(2, H, 5, direction="bidirectional", dtype=dtype)
  x, h, _ = random_inputs(spec, T, B)
  params = spec.init_params(jax.random.key(3))
  loss = lambda impl: lambda x, p: jnp.sum(jnp.sin(impl(spec, x, h, None, p)[0].astype(
      jnp.float32)))
  jaxpr = jax.make_jaxpr(jax.grad(loss(_xla.rnn), argnums=(0, 1)))(x, params)
  operands = {}
  for e in jaxpr_equations(jaxpr):
    if e.primitive.name in ("dot_general", "jcr_rounded_dot"):
      for v in e.invars:
        if hasattr(v, "aval") and v.aval.shape[:2] == (T, B):
          operands.setdefault(v.aval.shape[2], set()).add(v)
  assert len(operands[3 * H]) == 2 * 2, operands  # one per layer and direction
  assert len(operands[H]) == 2 * 2 * 2, operands  # the states h_{t-1}, and that one
  tol = 1e-5 if dtype == jnp.float32 else 1e-2
  for got, want in zip(jax.grad(loss(_xla.rnn), argnums=(0, 1))(x, params),
                       jax.grad(loss(_reference.rnn), argnums=(0, 1))(x, params)):
    assert relative_error(got, want) < tol
  weights, biases = spec.params_to_canonical(params)
  n_only = lambda t, k: t if k % 3 == 2 else jnp.zeros_like(t)
  weights = [n_only(w, k) if (k // 3) % 2 else w for k, w in enumerate(weights)]
  p2 = spec.canonical_to_params(weights, [n_only(b, k) for k, b in enumerate(biases)])
  for got, want in zip(jax.grad(loss(_xla.rnn), argnums=(0, 1))(x, p2),
                       jax.grad(loss(_reference.rnn), argnums=(0, 1))(x, p2)):
    assert relative_error(got, want) < tol


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
def test_chunked_forward_matches_reference(cls, direction):
  """36 steps: four chunks of nine (the forward alone) or nine of four (the
  derivative's forward). One sequence ends inside the third chunk of nine, the
  sixth of four."""
  assert _chunks.chunk_steps(36) == 9
  spec, args = _setup(cls, 1, direction, "linear_input", T=36, B=3)
  lengths = jnp.array([36, 22, 0], jnp.int32)
  for seq_lengths in (None, lengths):
    for a, b in zip(_xla.rnn(spec, *args, seq_lengths=seq_lengths),
                    _reference.rnn(spec, *args, seq_lengths=seq_lengths)):
      if b is not None:
        _assert_close(a, b)
  _compare(spec, args, lengths, tuple(i for i, a in enumerate(args) if a is not None))


def test_chunked_forward_two_layers_skip_input_and_second_order():
  spec, (x, h, c, params) = _setup(SPEC_CLASSES[0], 2, "bidirectional", "skip_input", T=32)
  assert _chunks.chunk_steps(32) == 8
  lengths = jnp.array([32, 13, 0], jnp.int32)
  _compare(spec, (x, h, c, params), lengths, (0, 1, 2, 3))
  v = np.random.default_rng(6).normal(size=params.shape)
  hvp = lambda impl: jax.jvp(jax.grad(lambda p: _loss(impl, spec, lengths)(x, h, c, p)),
                             (params,), (v,))[1]
  _assert_close(jax.jit(lambda: hvp(_xla.rnn))(), jax.jit(lambda: hvp(_reference.rnn))())


def test_float32_gradients_match_reference():
  """The computation dtype path (float32 and, through it, float16/bfloat16)."""
  spec, (x, h, c, params) = _setup(SPEC_CLASSES[0], 2, "bidirectional", "linear_input")
  spec = type(spec)(2, 4, 5, direction="bidirectional", dtype=jnp.float32)
  args = (x.astype(np.float32), h.astype(np.float32), c.astype(np.float32),
          params.astype(np.float32))
  g_fast = jax.grad(_loss(_xla.rnn, spec, None), argnums=(0, 3))(*args)
  g_ref = jax.grad(_loss(_reference.rnn, spec, None), argnums=(0, 3))(*args)
  for a, b in zip(g_fast, g_ref):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-5)


# -- one step or one sequence: the weights in the opaque orientation; loops around a call --


@pytest.mark.parametrize("T,B", [(1, 3), (6, 1), (32, 1), (1, 1)],
                         ids=["one-step", "one-sequence", "one-sequence-chunked", "both"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_one_step_or_one_sequence_matches_reference(cls, T, B):
  """One step (decoding) or one sequence: the forward multiplies by the opaque
  buffer's blocks as they lie (`_reads_opaque_orientation`) instead of
  transposed. Values, gradients, JVPs, two bidirectional layers, with lengths."""
  assert _xla._reads_opaque_orientation(jnp.zeros((T, B, 1)))
  spec, args = _setup(cls, 2, "bidirectional", "linear_input", T=T, B=B)
  lengths = jnp.array([T, 0, 1][:B], jnp.int32)
  for seq_lengths in (None, lengths):
    for a, b in zip(jax.jit(lambda *a: _xla.rnn(spec, *a, seq_lengths=seq_lengths))(*args),
                    jax.jit(lambda *a: _reference.rnn(spec, *a, seq_lengths=seq_lengths))(*args)):
      if b is not None:
        _assert_close(a, b)
  _compare(spec, args, lengths, tuple(i for i, a in enumerate(args) if a is not None))


def test_opaque_orientation_only_for_one_step_or_one_sequence():
  reads = lambda *shape: _xla._reads_opaque_orientation(jax.ShapeDtypeStruct(shape, jnp.float32))
  assert reads(1, 8, 4) and reads(7, 1, 4) and reads(1, 1, 4)
  assert not reads(2, 2, 4) and not reads(32, 8, 4)
  t, b = jax.export.symbolic_shape("t, b")
  assert not reads(t, b, 4) and reads(1, b, 4) and reads(t, 1, 4)


def test_weights_from_enclosing_trace():
  """A call sees a loop that closes over its weights: the weights a tracer of
  an enclosing trace, its input or states tracers of its own. Not a jitted
  call given them as an argument, an eager call, weights closed over as
  concrete values, nor a loop that carries them."""
  seen = []

  def one(p, x):
    seen.append(_xla.weights_from_enclosing_trace(p, (x, None)))
    return x + jnp.sum(p)

  p, x = jnp.ones(3), jnp.ones(2)
  jax.jit(one)(p, x)
  one(p, x)
  jax.jit(lambda x: one(p, x))(x)
  jax.jit(lambda p, x: jax.lax.scan(lambda c, _: ((c[0], one(*c)), None), (p, x), None,
                                    length=2)[0])(p, x)
  assert seen == [False] * 4
  seen.clear()
  jax.jit(lambda p, x: jax.lax.scan(lambda c, _: (one(p, c), None), x, None, length=2)[0])(p, x)
  jax.jit(lambda p, x: jax.lax.fori_loop(0, 2, lambda i, c: one(p, c), x))(p, x)
  assert seen == [True, True]


def _decoder(spec, rnn, carried=False, seq_lengths=None):
  """A decoder's loop: `rnn` one step at a time, 4 steps, each step's output
  (its first `input_size` units) the next step's input, in a `lax.scan` that
  closes over the weights (or, `carried`, carries them), each step given
  `seq_lengths`; returns the outputs and the final states."""
  def decode(x, h, c, params):
    def step(carry, _):
      if carried:
        p, (x, h, c) = carry[0], carry[1]
      else:
        p, (x, h, c) = params, carry
      y, h, c = rnn(spec, x, h, c, p, seq_lengths=seq_lengths)
      new = (jnp.tanh(y[..., :x.shape[-1]]), h, c)  # the input's width, where narrower
      return ((p, new) if carried else new), y[0]
    carry, ys = jax.lax.scan(step, ((params, (x, h, c)) if carried else (x, h, c)), None,
                             length=4)
    return ys, *(carry[1] if carried else carry)[1:]
  return decode


def _decoder_body(decode, *args):
  """The jaxpr of the body of `_decoder`'s loop (its 4 steps)."""
  loops = [e for e in jax.make_jaxpr(decode)(*args).jaxpr.eqns
           if e.primitive.name == "scan" and e.params["length"] == 4]
  assert len(loops) == 1, len(loops)
  return loops[0].params["jaxpr"]


def _loops_per_token(decode, *args) -> int:
  """The loops (scans) inside the body of `_decoder`'s loop."""
  return sum(e.primitive.name == "scan" for e in jaxpr_equations(_decoder_body(decode, *args)))


def _products_per_token(decode, *args) -> int:
  """The products in the body of `_decoder`'s loop, nested ones too."""
  return len(list(_dots(_decoder_body(decode, *args))))


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_one_step_in_a_loop_multiplies_transposed_weights(cls):
  """A one-step float32 call in a loop that closes over its weights, on more
  than one sequence, with a small recurrent matrix, multiplies by them
  transposed (`_xla._transposes_in_loop`: XLA hoists the transposes out of
  the loop): an LSTM's and the plain RNNs' two matrices stacked, one product
  a step (`_products_per_token`), a GRU's two; one sequence, or a larger
  matrix keep the opaque blocks (two products), and so does the loop
  carrying its weights where it does not take the buffer's blocks
  (`_one_step`); the step runs without a loop of its own where the weights
  are transposed, on the buffer's blocks, or on one sequence. Values and
  gradients against the reference's loop, and values with a sequence of
  length 0."""
  spec = cls(1, 8, 8, dtype=jnp.float32)  # the output is the next step's input
  # More sequences than one-step calls multiply in place (`_one_step.plan`).
  x, h, c = random_inputs(spec, 1, _one_step.MATVEC_MAX_BATCH + 1)
  params = spec.init_params(jax.random.key(3))
  stacks = cls is not jcr.CudnnGRU
  fast, slow = _decoder(spec, _xla.rnn), _decoder(spec, _reference.rnn)
  assert _products_per_token(fast, x, h, c, params) == (1 if stacks else 2)
  # ... and the step runs without a loop of its own, on the step axis kept
  # (`_reference.forward_scan`'s `step_axis`); against the opaque blocks, in one.
  assert _loops_per_token(fast, x, h, c, params) == 0
  # The loop carrying its weights: the buffer's blocks (`_one_step`'s
  # `Plan.blocks`, under any JAX: one batched product, and one for the
  # recurrent matrix's first rows), no loop; without them, the opaque
  # blocks, in a loop.
  with pytest.MonkeyPatch.context() as m:
    m.setattr(_one_step, "BLOCKS_MIN_PRODUCTS", 0)
    carried = _decoder(spec, _xla.rnn, carried=True)
    assert _loops_per_token(carried, x, h, c, params) == 0
    assert _products_per_token(carried, x, h, c, params) == 2
  with pytest.MonkeyPatch.context() as m:
    m.setattr(_one_step, "BLOCKS_MIN_BATCH", np.inf)
    carried = _decoder(spec, _xla.rnn, carried=True)
    assert _loops_per_token(carried, x, h, c, params) == 1
    assert _products_per_token(carried, x, h, c, params) == 2
  one = tuple(None if a is None else a[:, :1] for a in (x, h, c))
  assert _products_per_token(fast, *one, params) == 2
  # One sequence's feature-major product is batch-major: its step runs on the
  # step axis kept against the opaque blocks too, with no loop of its own (on
  # a CPU, where it was measured).
  assert _loops_per_token(fast, *one, params) == 0
  other = cls(1, 6, 6, dtype=jnp.float32)  # not traced before (JAX caches traces)
  with pytest.MonkeyPatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert _loops_per_token(_decoder(other, _xla.rnn), *random_inputs(other, 1, 1),
                            other.init_params(jax.random.key(3))) == 1
  tol = dict(rtol=2e-6, atol=2e-6)
  for lengths in (None, jnp.array([1], jnp.int32), jnp.array([0], jnp.int32)):
    got, want = (jax.jit(_decoder(spec, r, seq_lengths=lengths))(*one, params)
                 for r in (_xla.rnn, _reference.rnn))
    for a, b in zip(got, want):
      if b is not None:
        np.testing.assert_allclose(a, b, **tol)
  np.testing.assert_array_equal(got[1], one[1])  # length 0: the state kept
  deep = cls(2, 8, 8, input_mode="skip_input", direction="bidirectional", dtype=jnp.float32)
  args = (*random_inputs(deep, 1, 1), deep.init_params(jax.random.key(4)))
  assert _loops_per_token(_decoder(deep, _xla.rnn), *args) == 0
  for a, b in zip(jax.jit(_decoder(deep, _xla.rnn))(*args),
                  jax.jit(_decoder(deep, _reference.rnn))(*args)):
    if b is not None:
      np.testing.assert_allclose(a, b, **tol)
  for a, b in zip(jax.jit(fast)(x, h, c, params), jax.jit(slow)(x, h, c, params)):
    if b is not None:
      np.testing.assert_allclose(a, b, **tol)
  loss = lambda rnn: lambda x, h, p: jnp.sum(jnp.sin(rnn(x, h, c, p)[0]))
  for a, b in zip(jax.jit(jax.grad(loss(fast), argnums=(0, 1, 2)))(x, h, params),
                  jax.jit(jax.grad(loss(slow), argnums=(0, 1, 2)))(x, h, params)):
    np.testing.assert_allclose(a, b, **tol)
  # A sequence of length 0 keeps its state and outputs zeros (the mask, and an
  # LSTM's last cells, on the step axis kept: `_reference.forward_scan`).
  lengths = jnp.array([1, 0, 1, 1], jnp.int32)
  masked, reference = (_decoder(spec, r, seq_lengths=lengths) for r in (_xla.rnn, _reference.rnn))
  assert _products_per_token(masked, x, h, c, params) == (1 if stacks else 2)
  got, want = jax.jit(masked)(x, h, c, params), jax.jit(reference)(x, h, c, params)
  for a, b in zip(got, want):
    if b is not None:
      np.testing.assert_allclose(a, b, **tol)
  np.testing.assert_array_equal(got[0][:, 1], 0)
  np.testing.assert_array_equal(got[1][:, 1], h[:, 1])
  large = cls(1, 384, 384, dtype=jnp.float32)  # R: 576 KiB (RNN) to 2.25 MiB (LSTM)
  assert 384 * 384 * 4 > _xla.LOOP_TRANSPOSED_MAX_BYTES
  assert _products_per_token(_decoder(large, _xla.rnn), *random_inputs(large, 1, 3),
                            large.init_params(jax.random.key(3))) == 2
  # A larger R, up to 1 MiB, is transposed under an input at most 128 wide
  # (no loop of its own: the step axis kept), not under a wider one.
  hidden = {jcr.CudnnLSTM: 256, jcr.CudnnGRU: 256}.get(cls, 512)  # R: 768 KiB to 1 MiB
  g = spec.num_gates
  assert (_xla.LOOP_TRANSPOSED_MAX_BYTES < g * hidden * hidden * 4
          <= _xla.LOOP_TRANSPOSED_NARROW_MAX_BYTES)
  # (More sequences than a GRU's or an LSTM's gate blocks take: the test below.)
  batch = _xla.GATE_BLOCKS_BATCH[1] + 1
  for inputs, transposed in ((_xla.LOOP_TRANSPOSED_NARROW_INPUT, True),
                             (_xla.LOOP_TRANSPOSED_NARROW_INPUT + 1, False)):
    wide = cls(1, hidden, inputs, dtype=jnp.float32)
    decode = _decoder(wide, _xla.rnn)
    args = (*random_inputs(wide, 1, batch), wide.init_params(jax.random.key(3)))
    assert _loops_per_token(decode, *args) == (0 if transposed else 1), inputs
    assert _products_per_token(decode, *args) == (1 if stacks and transposed else 2), inputs


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
def test_decoder_loop_multiplies_gate_blocks(cls, monkeypatch):
  """In a decoder's loop closing over its float32 weights, an LSTM or GRU with
  `GATE_BLOCKS_HIDDEN` units over `GATE_BLOCKS_BATCH` sequences (an LSTM's
  input at most `LOOP_TRANSPOSED_NARROW_INPUT` wide, a GRU's wider one over
  at most `GATE_BLOCKS_WIDE_INPUT_BATCH`) multiplies by each gate's
  transposed columns apart, one product a gate for the input and one for the
  state, on the step axis kept (`_xla._gate_blocks_in_loop`); one sequence,
  one more, a hidden size either side of the window, an LSTM's wider input
  or AMD CPU, a CPU without AVX-512, bfloat16, or a GPU keep the stacked or
  opaque products. Values and gradients against the reference's loop, with
  lengths (0 among them), over two bidirectional layers. On an Intel CPU
  with AVX-512, as measured, whatever the host's."""
  monkeypatch.setattr(_cpu, "vendor", lambda: "GenuineIntel")
  monkeypatch.setattr(_cpu, "avx512", lambda: True)
  low, high = _xla.GATE_BLOCKS_HIDDEN
  narrow = _xla.LOOP_TRANSPOSED_NARROW_INPUT
  g = cls(1, 8, 8).num_gates
  def products(hidden, inputs, batch, dtype=jnp.float32, **kw):
    spec = cls(1, hidden, inputs, dtype=dtype, **kw)
    args = (*random_inputs(spec, 1, batch), spec.init_params(jax.random.key(3)))
    return _products_per_token(_decoder(spec, _xla.rnn), *args)
  lo_batch, hi_batch = _xla.GATE_BLOCKS_BATCH
  assert products(low, narrow, lo_batch) == 2 * g
  assert products(high, narrow, hi_batch) == 2 * g
  # skip_input: no input matrix; an LSTM's input as wide as its state keeps one product.
  assert products(high, high, 4, input_mode="skip_input") == (g if cls is jcr.CudnnGRU else 1)
  assert products(low, narrow + 1, 4) == (2 * g if cls is jcr.CudnnGRU else 2)
  wide_batch = _xla.GATE_BLOCKS_WIDE_INPUT_BATCH
  assert lo_batch < wide_batch < hi_batch
  assert products(low, narrow + 1, wide_batch) == (2 * g if cls is jcr.CudnnGRU else 2)
  assert products(low, narrow + 1, wide_batch + 1) < 2 * g
  for hidden, batch in ((low - 1, 4), (high + 1, 4), (low, 1), (low, hi_batch + 1)):
    assert products(hidden, narrow, batch) < 2 * g, (hidden, batch)
  # An AMD CPU's LSTM keeps its stacked or opaque products; its GRU, the blocks.
  # (A vendor not known keeps them: as measured first.) A CPU without AVX-512
  # (the Zen 3 measured) keeps them for either cell, of either vendor; one
  # whose flags are unknown takes the blocks. A wide input's blocks: a GRU's.
  gru = cls is jcr.CudnnGRU
  for vendor, avx512, blocks in (("AuthenticAMD", True, gru), (None, True, True),
                                 ("AuthenticAMD", False, False), ("GenuineIntel", False, False),
                                 ("GenuineIntel", None, True)):
    with pytest.MonkeyPatch.context() as m:
      m.setattr(_cpu, "vendor", lambda: vendor)
      m.setattr(_cpu, "avx512", lambda: avx512)
      assert (products(low, narrow, 4) == 2 * g) is blocks, (vendor, avx512)
      assert (products(high, narrow, hi_batch) == 2 * g) is blocks, (vendor, avx512)
      assert (products(high, narrow + 1, 8) == 2 * g) is (blocks and gru), (vendor, avx512)
  assert products(low, narrow, 4, dtype=jnp.bfloat16) == 2
  with pytest.MonkeyPatch.context() as m:
    m.setattr(jax, "default_backend", lambda: "gpu")
    assert products(low + 1, narrow, 4) == 2  # a shape not traced before
  spec = cls(2, low, narrow, direction="bidirectional", dtype=jnp.float32)
  x, h, c = random_inputs(spec, 1, 3)
  params = spec.init_params(jax.random.key(5))
  fast, slow = _decoder(spec, _xla.rnn), _decoder(spec, _reference.rnn)
  # Layer 0 in gate blocks, both directions, on the step axis kept; layer 1's
  # input (2H) is wider than an LSTM's blocks take: the opaque blocks, in a
  # loop of their own.
  assert _products_per_token(fast, x, h, c, params) == (8 * g if gru else 4 * g + 2 * 2)
  assert _loops_per_token(fast, x, h, c, params) == (0 if gru else 1)
  tol = dict(rtol=2e-5, atol=2e-5)
  for lengths in (None, jnp.array([1, 0, 1], jnp.int32)):
    got, want = (jax.jit(_decoder(spec, r, seq_lengths=lengths))(x, h, c, params)
                 for r in (_xla.rnn, _reference.rnn))
    for a, b in zip(got, want):
      if b is not None:
        np.testing.assert_allclose(a, b, **tol)
  np.testing.assert_array_equal(got[1][:, 1], h[:, 1])  # length 0: the state kept
  loss = lambda decode: lambda x, h, p: jnp.sum(jnp.sin(decode(x, h, c, p)[0]))
  for a, b in zip(jax.jit(jax.grad(loss(fast), argnums=(0, 1, 2)))(x, h, params),
                  jax.jit(jax.grad(loss(slow), argnums=(0, 1, 2)))(x, h, params)):
    np.testing.assert_allclose(a, b, **tol)


def _products_per_step(fn, *args) -> int:
  """The products in the body of the one `scan` of `fn`'s jaxpr."""
  scans = [e for e in jaxpr_equations(jax.make_jaxpr(fn)(*args).jaxpr)
           if e.primitive.name == "scan"]
  assert len(scans) == 1, len(scans)
  return sum(len(list(_dots(sub))) for sub in jax.extend.core.jaxprs_in_params(scans[0].params))


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("dtype", [jnp.float64, jnp.float32])
def test_step_by_step_forward_stacks_its_weights(cls, dtype):
  """Step by step, one direction, the forward alone of an LSTM and of the
  plain RNNs multiplies input and state side by side by the stacked matrices,
  one product a step (`_xla._stacks_weights`); a GRU keeps two. Values against
  the reference, with lengths too, and the rule's bounds."""
  spec = cls(1, 4, 5, dtype=dtype)
  x, h, c = random_inputs(spec, 6, 3)
  params = spec.init_params(jax.random.key(3))
  stacks = cls is not jcr.CudnnGRU
  fast = lambda *a, seq_lengths=None: _xla.rnn(spec, *a, seq_lengths=seq_lengths)
  assert _products_per_step(fast, x, h, c, params) == (1 if stacks else 2)
  assert _products_per_step(lambda *a: _reference.rnn(spec, *a), x, h, c, params) == 2
  tol = TOL if dtype == jnp.float64 else dict(rtol=2e-6, atol=2e-6)
  for seq_lengths in (None, _lengths(6)):
    for a, b in zip(jax.jit(functools.partial(fast, seq_lengths=seq_lengths))(x, h, c, params),
                    jax.jit(lambda *a: _reference.rnn(spec, *a, seq_lengths=seq_lengths))(
                        x, h, c, params)):
      if b is not None:
        np.testing.assert_allclose(a, b, **tol)
  # Not in a bidirectional or skip_input layer, nor for bfloat16 operands, one
  # step (in the opaque orientation; but transposed in a loop: `opaque` False)
  # or in chunks, nor past `stacked_max_bytes()`: 2 MiB under jax 0.10, 1.5 MiB
  # from 0.11.
  def stacks_weights(mode, operands, xs, W, R, chunk, opaque=None):
    opaque = _xla._reads_opaque_orientation(xs[0]) if opaque is None else opaque
    return _xla._stacks_weights(mode, operands, xs, W, R, chunk, opaque)

  W, R = jnp.zeros((5, 4 * spec.num_gates)), jnp.zeros((4, 4 * spec.num_gates))
  xs = (jnp.zeros((6, 3, 5)),)
  assert stacks_weights(spec.rnn_mode, None, xs, (W,), (R,), 1) == stacks
  assert not stacks_weights(spec.rnn_mode, None, xs * 2, (W,) * 2, (R,) * 2, 1)
  assert not stacks_weights(spec.rnn_mode, None, xs, None, (R,), 1)
  assert not stacks_weights(spec.rnn_mode, None, xs, (W,), (R,), 2)
  assert not stacks_weights(spec.rnn_mode, jnp.bfloat16, xs, (W,), (R,), 1)
  assert not stacks_weights(spec.rnn_mode, None, (jnp.zeros((1, 3, 5)),), (W,), (R,), 1)
  assert stacks_weights(spec.rnn_mode, None, (jnp.zeros((1, 3, 5)),), (W,), (R,), 1,
                        opaque=False) == stacks
  H = 256
  big = lambda I: ((jax.ShapeDtypeStruct((I, 4 * H), jnp.float32),),
                   (jax.ShapeDtypeStruct((H, 4 * H), jnp.float32),))
  assert [_xla.stacked_max_bytes(v) for v in ("0.10.1", "0.10.2", "0.11.0", "0.12.1")] == [
      2 << 20, 2 << 20, 3 << 19, 3 << 19]
  largest = _xla.stacked_max_bytes() // (4 * H * 4) - H  # the widest input stacked
  assert largest == (256 if jax.__version__.startswith("0.10.") else 128), largest
  assert stacks_weights("lstm", None, xs, *big(largest), 1)
  assert not stacks_weights("lstm", None, xs, *big(largest + 1), 1)


def _loop_states(hlo: str) -> list[str]:
  """The state shapes of every `while` loop in compiled HLO text."""
  return [line.split("=", 1)[1].split(" while(")[0] for line in hlo.splitlines()
          if " while(" in line]


def _decode(spec, impl, params, x, h, c):
  """A decoder: five calls of `impl` (`_xla.rnn` or `_reference.rnn`) in a
  `lax.scan`, each fed the previous one's output through a `tanh`; the last
  step's output of each."""
  def body(carry, _):
    x, h, c = carry
    y, h, c = impl(spec, x, h, c, params)
    return (jnp.tanh(y), h, c), y[-1]
  return jax.lax.scan(body, (x, h, c), None, length=5)[1]


@pytest.mark.parametrize("T,B", [(1, 4), (1, 1), (8, 4)],
                         ids=["one-step", "one-step-one-sequence", "eight-steps"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_weights_prepared_once_in_a_loop_around_the_call(cls, T, B):
  """Decoding a step at a time in a jitted loop: XLA hoists the slicing (and
  transposing) of the weights and biases out of the loop, because the forward
  pins them behind an `optimization_barrier`; the loop then never carries the
  opaque buffer. Without the barrier it sliced them out of it on every trip
  (decoding 64 steps of an LSTM, B8 H256: 11.2 ms, Flax 4.6; B1: 26.4 ms,
  Flax 2.5; benchmarks/NOTES.md, session 22). The decoded values match the
  reference's. The program is compiled for the CPU on any host: XLA:GPU keeps
  the buffer in the loop's state (an H200, session 63; what that costs there
  was not measured)."""
  spec = cls(2, 16, 16, dtype=jnp.float32)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, T, B)
  x, h = jnp.asarray(x, jnp.float32), jnp.asarray(h, jnp.float32)
  c = None if c is None else jnp.asarray(c, jnp.float32)

  fast = jax.jit(functools.partial(_decode, spec, _xla.rnn))
  np.testing.assert_allclose(fast(params, x, h, c),
                             jax.jit(functools.partial(_decode, spec, _reference.rnn))(
                                 params, x, h, c),
                             rtol=1e-5, atol=1e-5)
  with jax.default_device(jax.devices("cpu")[0]):
    states = _loop_states(fast.lower(params, x, h, c).compile().as_text())
  assert states, "no loop in the compiled decoder"
  buffer = f"f32[{spec.params_size()}]"
  assert not any(buffer in s for s in states), (buffer, states)


@pytest.mark.parametrize("large", [False, True], ids=["small", "past-the-single-call-bound"])
@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
def test_bfloat16_decoder_widens_its_weights_once(cls, products, large, monkeypatch):
  """A bfloat16 model decoding a step at a time in a jitted loop, batch 4:
  where the CPU multiplies the rounded operands in float32 (`products`), the
  weights are widened once, before the loop, which carries them in float32
  (a 64-step decoder, LSTM B8 I256 H256: 287 -> 200 us a token;
  benchmarks/NOTES.md, session 70); else it carries them in bfloat16. So too
  for weights past `_xla.WIDEN_ONE_STEP_MAX_WEIGHTS` (`large`), which a
  single call keeps in bfloat16 (`test_bfloat16_products_widen_from_32_steps`)
  but a loop closing over them widens once (session 75). The decoded values
  are the reference's to bfloat16 accuracy either way."""
  if large:
    monkeypatch.setattr(_xla, "WIDEN_ONE_STEP_MAX_WEIGHTS", 0)
  spec = cls(2, 16, 16, dtype=jnp.bfloat16)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 1, 4)

  fast = jax.jit(functools.partial(_decode, spec, _xla.rnn))
  ref = jax.jit(functools.partial(_decode, spec, _reference.rnn))(params, x, h, c)
  assert relative_error(fast(params, x, h, c), ref) < 1e-2
  with jax.default_device(jax.devices("cpu")[0]):
    (state,) = _loop_states(fast.lower(params, x, h, c).compile().as_text())
  rows = _xla._spec.NUM_GATES[spec.rnn_mode] * 16
  widened, kept = state.count(f"f32[{rows},16]"), state.count(f"bf16[{rows},16]")
  assert (widened, kept) == ((4, 0) if products == "float32" else (0, 4)), state


# -- bfloat16: the matmuls take bfloat16 operands ------------------------------------


def _dots(jaxpr):
  """`(operand dtypes, result dtype)` of every product in a jaxpr and in the
  jaxprs nested in it (scans, custom_jvp): `dot_general`s, and
  `_rounded_dot`'s, whose operands are rounded to the dtype it names."""
  for eqn in jaxpr_equations(jaxpr):
    if eqn.primitive.name == "dot_general":
      yield [v.aval.dtype for v in eqn.invars], eqn.outvars[0].aval.dtype
    if eqn.primitive is _rounded_dot.rounded_dot_p:
      yield [eqn.params["operands"]] * 2, eqn.outvars[0].aval.dtype


SHAPES = [(6, 3), (32, 3), (1, 3), (32, 1)]  # (T, B); the last two read the opaque blocks
SHAPE_IDS = ["step-by-step", "chunked", "one-step", "one-sequence-chunked"]


@pytest.mark.parametrize("T,B", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype,operands", [(jnp.bfloat16, jnp.bfloat16),
                                            (jnp.float16, jnp.float32),
                                            (jnp.float32, jnp.float32)])
def test_forward_matmul_operand_dtypes(dtype, operands, T, B):
  """bfloat16 models multiply bfloat16 operands, accumulating in float32 (on
  CPUs with AMX or AVX512-BF16 several times faster; benchmarks/NOTES.md,
  session 15); float16 ones multiply in float32 (no faster in float16 there);
  the reference always multiplies in float32."""
  spec = jcr.CudnnLSTM(2, 8, 5, direction="bidirectional", dtype=dtype)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, T, B)
  for impl, want in ((_xla.rnn, operands), (_reference.rnn, jnp.float32)):
    jaxpr = jax.make_jaxpr(lambda x, h, c, p: impl(spec, x, h, c, p))(x, h, c, params)
    dots = list(_dots(jaxpr.jaxpr))
    assert len(dots) >= 8, len(dots)  # 2 layers x 2 directions x (projection, recurrence)
    for operands, result in dots:
      assert operands == [want, want], (impl, operands)
      assert result == jnp.float32, (impl, result)


@pytest.mark.parametrize("dtype,operands", [(jnp.bfloat16, jnp.bfloat16),
                                            (jnp.float16, jnp.float32),
                                            (jnp.float32, jnp.float32)])
def test_gradient_matmul_operand_dtypes(dtype, operands):
  """The backward pass of a bfloat16 model multiplies bfloat16 operands too:
  every product in its gradient's jaxpr (the forward, the tangent, and the
  transposes that are the backward pass: `_rounded_dot`) does. Chunked, with
  lengths, skip_input for the first layer."""
  spec = jcr.CudnnGRU(2, 8, 8, direction="bidirectional", input_mode="skip_input", dtype=dtype)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 32, 3)
  lengths = jnp.array([32, 13, 0], jnp.int32)
  grad = jax.grad(_loss(_xla.rnn, spec, lengths), argnums=(0, 1, 3))
  dots = list(_dots(jax.make_jaxpr(grad)(x, h, c, params).jaxpr))
  # Per layer and direction: the forward's recurrence (and projection, but for
  # layer 0), and in the backward the data, input-weight and recurrent-weight
  # gradients and the recurrence's transpose.
  assert len(dots) >= 4 * 5, len(dots)
  for got_operands, result in dots:
    assert got_operands == [operands, operands], got_operands
    assert result == jnp.float32, result


def _round_to_bfloat16(v):
  return np.asarray(v, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _float32_layers(spec, params, x, h, c, lengths=None):
  """The float32 output of a bfloat16 model's layers through `_xla.run_layer`,
  before the final cast, given float32 values as `_reference.rnn` hands
  each layer: the products' operands rounded to bfloat16, nothing else."""
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
  y, blocks, D = f32(x), _reference.param_blocks(spec, f32(params)), spec.num_dirs
  for layer in range(spec.num_layers):
    states = slice(D * layer, D * (layer + 1))
    y, _, _ = _xla.run_layer(spec, y, f32(h)[states], None if c is None else f32(c)[states],
                             blocks, layer, lengths)
  return y


@pytest.mark.usefixtures("products")
@pytest.mark.parametrize("T", [6, 32, 1], ids=["step-by-step", "chunked", "one-step"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_bfloat16_rounds_only_the_matmul_operands(cls, T):
  """The float32 output of two bfloat16 layers, before the final cast, against
  numpy in float64 with each layer's input and state rounded to bfloat16
  where they multiply a weight matrix, and nowhere else: equal to float32
  accuracy (measured 2e-8 to 1.6e-7; held to 1e-6). Without that rounding
  numpy differs by 1.2e-4 (the LSTM's one step) to 9e-3, so this tells the
  two apart. (A state within float32 rounding of a
  bfloat16 midpoint could round the other way here than in numpy; these
  inputs have none.) The same whether the CPU multiplies bfloat16 operands
  or the rounded values in float32 (`products`)."""
  spec = cls(2, 8, 5, direction="bidirectional", dtype=jnp.bfloat16)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, T, 3)
  y = _float32_layers(spec, params, x, h, c)
  up = lambda a: None if a is None else np.asarray(a, np.float64)
  args = (spec.rnn_mode, 2, True, False, [up(w) for w in weights], [up(b) for b in biases],
          up(x), up(h), up(c))
  rounded = numpy_rnn(*args, operand=_round_to_bfloat16)[0]
  exact = numpy_rnn(*args)[0]
  y = np.asarray(y, np.float64)
  np.testing.assert_allclose(y, rounded, rtol=0, atol=1e-6)
  assert np.abs(y - exact).max() > 1e-4


@pytest.mark.usefixtures("cpu_host")
@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])
def test_bfloat16_forward_in_unit_lanes(cls, monkeypatch):
  """A bfloat16 model's forward alone in two lanes by unit (of 2 and 3 of 5
  units), chunked, with `seq_lengths`, two layers: every loop carries each
  lane's part of the states; the float32 outputs before the final cast are
  numpy's in float64 with the products' operands rounded to bfloat16 (as
  `test_bfloat16_rounds_only_the_matmul_operands`), and the one-lane
  forward's but for float32 summation order; the model's own bfloat16 outputs
  and final states the one-lane forward's to a bfloat16 rounding, and under
  `vmap` too."""
  monkeypatch.setattr(_cpu, "flags", lambda: AVX512_BF16)
  monkeypatch.setattr(_lanes, "BFLOAT16_UNIT_LANE_BYTES", (0, np.inf))
  spec = cls(2, 5, 6, dtype=jnp.bfloat16)
  weights, biases = random_canonical(spec)
  params = spec.canonical_to_params(weights, biases)
  x, h, c = random_inputs(spec, 32, 3, seed=6)
  lengths = jnp.array([32, 7, 0], jnp.int32)
  f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)

  def programs():  # fresh functions, so that `jit` traces them again (not its cached trace)
    layers = lambda x, h, c: _float32_layers(spec, params, x, h, c, lengths)
    whole = lambda x: _xla.rnn(spec, x, h, c, params, seq_lengths=lengths)
    carries = _scan_carry_shapes(jax.make_jaxpr(layers)(f32(x), f32(h), f32(c)))
    assert _scan_carry_shapes(jax.make_jaxpr(whole)(x)) == carries
    return (carries, np.asarray(jax.jit(layers)(f32(x), f32(h), f32(c)), np.float64),
            [jax.jit(whole)(x), jax.jit(jax.vmap(whole))(jnp.stack([x, -x]))])

  carries, in_lanes, outputs = programs()
  assert carries == [_forward_carry([(3, 2), (3, 3)], spec.has_cell_state, True)] * 2
  monkeypatch.setattr(_lanes, "forward_lanes", lambda *args: None)
  carries, one_lane, one_lane_outputs = programs()
  assert carries == [_forward_carry([(3, 5)], spec.has_cell_state, True)] * 2
  np.testing.assert_allclose(in_lanes, one_lane, rtol=0, atol=1e-6)
  up = lambda a: None if a is None else np.asarray(a, np.float64)
  rounded = numpy_rnn(spec.rnn_mode, 2, False, False, [up(w) for w in weights],
                      [up(b) for b in biases], up(x), up(h), up(c), np.asarray(lengths),
                      operand=_round_to_bfloat16)[0]
  np.testing.assert_allclose(in_lanes, rounded, rtol=0, atol=5e-5)
  assert np.abs(in_lanes).max() > 0.1
  for got, want in zip(jax.tree.leaves(outputs), jax.tree.leaves(one_lane_outputs)):
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    # At most one bfloat16 rounding step apart (a float32 sum on either side of a midpoint).
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=2 ** -7, atol=2 ** -8)


@contextlib.contextmanager
def _products_exact(exact, **patches):
  """Within it, `_rounded_dot`'s CPU products multiply bfloat16 operands
  (`exact` False: every layer's, whatever the host), or the rounded operands
  widened to float32, where each product is exact (`exact` True: every
  layer's). `patches`: `_xla`'s attributes to set besides. Compiled afresh
  (JAX caches a primitive's compiled call by its parameters, which do not
  name the lowering), and the caches cleared again after."""
  with pytest.MonkeyPatch.context() as m:
    m.setattr(_cpu, "bfloat16_products_fast", lambda: not exact)
    if exact:
      m.setattr(_xla, "_widens", lambda *args: True)
    for name, value in patches.items():
      m.setattr(_xla, name, value)
    jax.clear_caches()
    try:
      yield
    finally:
      jax.clear_caches()


@pytest.mark.parametrize("T,B", [(1, 3), (32, 1), (1, 1)],
                         ids=["one-step", "one-sequence-chunked", "both"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_bfloat16_opaque_products_round_as_the_transposed_ones(cls, T, B):
  """A bfloat16 model's one-step and one-sequence forward, whose products read
  the opaque blocks (`_opaque_matmul`) in bfloat16, against the same forward
  made to multiply transposed weights (the form the test above holds against
  numpy) with the rounded operands widened to float32, where their products
  are exact: the same operands rounded, so equal but for float32 summation
  order. (Against numpy directly, a one-sequence RNN-tanh here meets a state
  within float32 rounding of a bfloat16 midpoint, which numpy rounds the other
  way: both forms then differ from it by 2e-3, and from each other by 1e-7.)

  Why the reference widens. Under jax 0.12.1, XLA:CPU rounds each product of
  a bfloat16 vector-matrix `dot` to bfloat16 before summing them where it
  fuses the matrix's change of layout into the `dot` (a loop fusion): the
  transposed form at one step on one sequence did (off by up to 2.5e-3; a
  minimal JAX program does too: benchmarks/NOTES.md, session 87). 0.12.0.1
  and 0.10.2 did not. The library never runs that form in bfloat16 (it reads
  the opaque blocks there); the opaque form stays bfloat16, as the library
  runs it, so a kernel that rounded its products would fail here."""
  spec = cls(2, 8, 5, direction="bidirectional", dtype=jnp.bfloat16)
  params = jnp.asarray(spec.init_params(jax.random.key(0)), jnp.float32)
  x, h, c = (None if a is None else jnp.asarray(a, jnp.float32)
             for a in random_inputs(spec, T, B))

  def forward(opaque):  # a fresh function each time, so that `jit` traces it again
    with _products_exact(not opaque, _reads_opaque_orientation=lambda x: opaque):
      y = jax.jit(lambda x, h, c: _float32_layers(spec, params, x, h, c))(x, h, c)
      return np.asarray(y, np.float64)

  opaque, transposed = forward(True), forward(False)
  assert np.all(np.isfinite(transposed))
  np.testing.assert_allclose(opaque, transposed, rtol=0, atol=1e-6)


@pytest.mark.parametrize("T,B", SHAPES + [(1, 1)], ids=SHAPE_IDS + ["one-step-one-sequence"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_bfloat16_gradient_products_are_exact(cls, T, B):
  """The gradient through two bidirectional bfloat16 layers (with respect to
  the weights, the input and the initial state), whose products multiply
  bfloat16 operands as the library runs them, forward and backward, against
  the same gradient with every product's rounded operands widened to float32,
  where each product is exact: equal but for float32 summation order, which
  can move a value within float32 rounding of a bfloat16 midpoint to round
  the other way where it is rounded for a product (a cotangent, in the
  backward pass); that moves the few elements it multiplies, one row (LSTM
  T32 B3 under jax 0.10.2: 17 of 3200 elements, by 1.5e-5 of the largest).
  A kernel that rounded its products to bfloat16 (jax 0.12.1's, where the
  forward is made to multiply transposed weights at one step on one
  sequence: `test_bfloat16_opaque_products_round_as_the_transposed_ones`)
  moves 7-100% of them, by 4e-4 to 1.8e-3 of the largest. The value tests of
  bfloat16 gradients elsewhere hold them to bfloat16 accuracy, which that
  would pass."""
  spec = cls(2, 8, 5, direction="bidirectional", dtype=jnp.bfloat16)
  params = jnp.asarray(spec.init_params(jax.random.key(0)), jnp.float32)
  x, h, c = (None if a is None else jnp.asarray(a, jnp.float32)
             for a in random_inputs(spec, T, B))
  weights = jnp.asarray(np.random.default_rng(1).standard_normal((T, B, 16)), jnp.float32)

  def gradient(exact):  # a fresh function each time, so that `jit` traces it again
    with _products_exact(exact):
      loss = lambda p, x, h: jnp.sum(_float32_layers(spec, p, x, h, c) * weights)
      return [np.asarray(g, np.float64)
              for g in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(params, x, h)]

  moved = []
  for got, want in zip(gradient(False), gradient(True)):
    largest = np.abs(want).max()
    assert np.all(np.isfinite(want)) and largest > 1e-2
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * largest)
    moved.append((np.abs(got - want) > 1e-6 * largest).ravel())
  moved = np.concatenate(moved)
  assert moved.mean() <= 0.02, f"{moved.sum()} of {moved.size} elements beyond float32 order"


def test_bfloat16_products_widen_from_32_steps(monkeypatch):
  """Where the CPU multiplies the rounded operands in float32, a layer of
  fewer than 32 steps keeps bfloat16 products (widening its weights would
  cost a call more than its steps save: `_xla.WIDEN_MIN_STEPS`), forward and
  backward; from 32 steps every product is float32. So does one step on one
  sequence, and one step on a batch over weight matrices larger than
  `_xla.WIDEN_ONE_STEP_MAX_WEIGHTS` elements; one step on a batch over
  smaller ones (decoding, where a loop of calls widens once) widens."""
  monkeypatch.setattr(_cpu, "bfloat16_products_fast", lambda: False)
  spec = jcr.CudnnLSTM(1, 8, 5, dtype=jnp.bfloat16)
  params = spec.init_params(jax.random.key(0))

  def operand_types(T, B=3):
    x, h, c = random_inputs(spec, T, B)
    loss = lambda x, p: jnp.sum(spec(x, h, c, p, implementation="xla")[0].astype(jnp.float32))
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, params).lower(
        lowering_platforms=("cpu",)).as_text()
    dots = [line.rsplit(":", 1)[1].split("->")[0] for line in text.splitlines()
            if "dot_general" in line]
    assert dots
    return {kind for line in dots for kind in ("bf16", "f32") if f"x{kind}>" in line}

  assert operand_types(31) == {"bf16"}
  assert operand_types(2) == {"bf16"}
  assert operand_types(1, B=1) == {"bf16"}
  assert operand_types(32) == {"f32"}
  assert operand_types(40, B=1) == {"f32"}
  assert operand_types(1) == {"f32"}
  elements = 4 * 8 * (5 + 8)  # W and R of the LSTM's one direction
  monkeypatch.setattr(_xla, "WIDEN_ONE_STEP_MAX_WEIGHTS", elements)
  assert operand_types(1) == {"f32"}
  monkeypatch.setattr(_xla, "WIDEN_ONE_STEP_MAX_WEIGHTS", elements - 1)
  assert operand_types(1) == {"bf16"}
  assert operand_types(32) == {"f32"}


@pytest.mark.usefixtures("products")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_bfloat16_gradients_match_reference(cls):
  """Gradients of a bfloat16 model (chunked forward, with lengths), against
  the reference's float32 arithmetic. Measured relative errors, with the
  backward pass's products rounded too (`_rounded_dot`): 4e-4 to 4e-3 for
  LSTM, GRU and RNN-tanh (the reference itself is 2e-3 from float64 here);
  RNN-relu, whose states are unbounded, 1e-2 to 5e-2, which is what rounding
  its states to bfloat16 at each of 64 matmuls costs. Either way the CPU
  multiplies (`products`)."""
  spec = cls(2, 8, 5, direction="bidirectional", dtype=jnp.bfloat16)
  _assert_bfloat16_gradients_match_reference(spec, 32, jnp.array([32, 13, 0], jnp.int32))


@pytest.mark.usefixtures("products")
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_bfloat16_one_step_gradients_match_reference(cls):
  """The same at one step on a batch of three (decoding, whose products widen
  where the CPU multiplies in float32: `_xla.WIDEN_ONE_STEP_MAX_WEIGHTS`),
  one sequence of length 0."""
  spec = cls(2, 8, 5, direction="bidirectional", dtype=jnp.bfloat16)
  _assert_bfloat16_gradients_match_reference(spec, 1, jnp.array([1, 0, 1], jnp.int32))


def _assert_bfloat16_gradients_match_reference(spec, T, lengths):
  """The gradients in the inputs, the initial state and the parameters, of the
  "xla" path against the reference's; tolerances as measured above."""
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, T, lengths.shape[0])
  grads = [jax.jit(jax.grad(_loss(impl, spec, lengths), argnums=(0, 1, 3)))(x, h, c, params)
           for impl in (_xla.rnn, _reference.rnn)]
  for fast, ref in zip(*grads):
    assert fast.dtype == jnp.bfloat16
    assert float(jnp.abs(ref.astype(jnp.float32)).max()) > 0
    tol = 1e-1 if spec.rnn_mode == "rnn_relu" else 1e-2
    assert relative_error(fast, ref) <= tol, relative_error(fast, ref)


@pytest.mark.parametrize("T", [6, 32], ids=["step-by-step", "chunked"])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_bfloat16_gradients_at_small_sizes(cls, T):
  """A one-layer bfloat16 model of batch 2 and 4 units: its gradient's loops
  multiply bfloat16 products as small as `[2, 12] x [12, 4]`, which jax
  0.10.0's XLA:CPU could not compile (`_requirements`). Against the reference,
  tolerances as above."""
  _assert_bfloat16_gradients_match_reference(cls(1, 4, 3, dtype=jnp.bfloat16), T,
                                             jnp.array([T, 3], jnp.int32))


def test_bfloat16_forward_mode_and_vmapped_gradients():
  """Through `_rounded_dot`'s JVP and batching rules: a bfloat16 GRU's
  `jax.jvp` in its weights, and `vmap(grad)` over two weight sets, against
  the float32 reference's."""
  spec = jcr.CudnnGRU(2, 8, 5, direction="bidirectional", dtype=jnp.bfloat16)
  params = spec.init_params(jax.random.key(0))
  other = spec.init_params(jax.random.key(1))
  x, h, _ = random_inputs(spec, 32, 3)
  lengths = jnp.array([32, 13, 0], jnp.int32)
  out = lambda impl: lambda p: impl(spec, x, h, None, p, seq_lengths=lengths)[0]
  jvp = lambda impl: jax.jit(lambda p, t: jax.jvp(out(impl), (p,), (t,)))(params, other)
  for fast, ref in zip(jvp(_xla.rnn), jvp(_reference.rnn)):
    assert relative_error(fast, ref) <= 1e-2, relative_error(fast, ref)
  both = jnp.stack([params, other])
  grads = lambda impl: jax.jit(jax.vmap(jax.grad(
      lambda p: _loss(impl, spec, lengths)(x, h, None, p).astype(jnp.float32))))(both)
  fast, ref = grads(_xla.rnn), grads(_reference.rnn)
  assert fast.shape == both.shape
  for a, b in zip(fast, ref):
    assert relative_error(a, b) <= 1e-2, relative_error(a, b)
