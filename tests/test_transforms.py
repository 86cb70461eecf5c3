"""jit, grad (check_grads), vmap and jax.checkpoint on the pure-JAX path, eager
calls and eager transformations compiled once, and the library where implicit rank
promotion raises."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _ops, _reference, _xla
from helpers import SPEC_CLASSES, call, random_inputs, same_under


def _setup(cls, direction="bidirectional", layers=2):
  spec = cls(layers, 3, 2, direction=direction, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 4, 2)
  return spec, params, x, h, c


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("with_lengths", [False, True])
def test_gradients(cls, with_lengths):
  spec, params, x, h, c = _setup(cls)
  lengths = np.array([4, 2]) if with_lengths else None

  def f(x, h, c, params):
    return call(spec, x, h, c, params, seq_lengths=lengths, implementation="xla")

  args = (x, h, c, params) if spec.has_cell_state else (x, h, None, params)
  if spec.has_cell_state:
    check_grads(f, args, order=1, modes=("rev", "fwd"), atol=1e-6, rtol=1e-6)
  else:
    check_grads(lambda x, h, p: f(x, h, None, p)[:2], (x, h, params), order=1,
                modes=("rev", "fwd"), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_jit_matches_eager(cls):
  spec, params, x, h, c = _setup(cls)
  eager = call(spec, x, h, c, params, is_training=False)
  jitted = jax.jit(lambda *a: call(spec, *a, is_training=False))(x, h, c, params)
  for a, b in zip(eager, jitted):
    if a is not None:
      np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.fixture
def xla_traces(monkeypatch):
  """The input shapes `_xla.rnn` is traced with, in order, as the test runs."""
  traces = []
  traced_rnn = _xla.rnn
  monkeypatch.setattr(_xla, "rnn", lambda *a, **k: traces.append(a[1].shape) or traced_rnn(*a, **k))
  return traces


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_eager_calls_compile_once_per_shape(cls, xla_traces):
  """Eager calls run from a compiled cache: the recurrence is traced once for
  a spec, its options and shapes, not at every call; the values are the
  plain reference's. (conftest starts each test with an empty cache.)"""
  spec, params, _, _, _ = _setup(cls)
  traces = xla_traces

  def run(x, h, c, lengths, is_training):
    got = call(spec, x, h, c, params, seq_lengths=lengths, is_training=is_training)
    want = _reference.rnn(spec, x, h, c, params, seq_lengths=jnp.asarray(lengths))
    for a, b in zip(got, want):
      if b is not None:
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)

  for seed, lengths in enumerate(([4, 2], [1, 0], [3, 4])):
    run(*random_inputs(spec, 4, 2, seed=seed), np.array(lengths, np.int32), seed % 2 == 0)
  # is_training without dropout to apply is the same computation: one trace.
  assert traces == [(4, 2, 2)]
  run(*random_inputs(spec, 6, 2, seed=5), np.array([6, 5], np.int32), False)
  assert traces == [(4, 2, 2), (6, 2, 2)]
  # Traced calls trace the recurrence in the caller's trace, as before.
  jax.jit(lambda x: call(spec, x, None, None, params))(random_inputs(spec, 4, 2)[0])
  assert traces == [(4, 2, 2), (6, 2, 2), (4, 2, 2)]


def test_eager_programs_are_dropped_past_half_the_mappings_linux_allows(xla_traces, tmp_path,
                                                                        monkeypatch):
  """Where the process holds more than half the memory mappings Linux allows
  (`vm.max_map_count`; here a stand-in limit of 2, which any process passes),
  a call that compiled a program drops the dispatch `jit`s' programs, so that
  eager calls over many shapes cannot exhaust them (past the limit XLA's
  compiler crashes the process): a shape seen before compiles again, to the
  same values. Calls that compile nothing do not read the mappings."""
  spec, params, x, h, _ = _setup(jcr.CudnnGRU)
  dispatch, transformed = _ops._compiled_dispatch, _ops._compiled_transformed_dispatch
  reads = []
  past_half = _ops._mappings_past_half
  monkeypatch.setattr(_ops, "_mappings_past_half", lambda: reads.append(1) or past_half())
  limit = tmp_path / "max_map_count"
  monkeypatch.setattr(_ops, "MAX_MAP_COUNT", str(limit))
  limit.write_text(f"{10 ** 12}\n")  # never reached: programs are kept
  first = call(spec, x, h, None, params)
  call(spec, x, h, None, params)
  assert (xla_traces, dispatch._cache_size(), len(reads)) == ([(4, 2, 2)], 1, 1)
  limit.write_text("2\n")
  call(spec, np.ones((6, 2, 2)), h, None, params)  # compiled, then dropped
  assert (xla_traces, dispatch._cache_size(), len(reads)) == ([(4, 2, 2), (6, 2, 2)], 0, 2)
  again = call(spec, x, h, None, params)
  assert xla_traces[-1] == (4, 2, 2) and len(xla_traces) == 3
  for a, b in zip(again, first):
    if a is not None:
      np.testing.assert_array_equal(a, b)
  jax.grad(lambda p: call(spec, x, h, None, p)[0].sum())(params)  # an eager transformation
  assert (dispatch._cache_size(), transformed._cache_size()) == (0, 0)
  limit.unlink()  # a limit that cannot be read: nothing is dropped
  call(spec, x, h, None, params)
  assert dispatch._cache_size() == 1


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU])  # the dispatch is mode-blind
def test_eager_transformations_compile_once_per_shape(cls, xla_traces):
  """A transformation applied outside `jit` (`jax.grad`, `jax.jvp`,
  `jax.linearize`, `jax.vmap`) traces the "xla" recurrence once for a spec,
  options and shapes, and its values are autodiff's (and a loop's) of the
  plain reference; under `jit` or `jax.checkpoint` the call traces in the
  caller's trace, as before."""
  spec = cls(2, 3, 2, direction="bidirectional", dtype=jnp.float64, dropout=0.3)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 4, 2)
  key = jax.random.key(3)
  lengths = np.array([4, 2], np.int32)
  traces = xla_traces

  def loss(rnn):
    def f(x, h, c, params):
      y, hn, cn = rnn(x, h, c, params)
      return jnp.sum(jnp.sin(y)) + jnp.sum(hn ** 2) + (0 if cn is None else jnp.sum(jnp.cos(cn)))
    return f

  # "xla" named: forward mode below, which the cuDNN path (a GPU's default) has not.
  ours = loss(lambda *a: call(spec, *a, seq_lengths=lengths, dropout_key=key,
                              implementation="xla"))
  ref = loss(lambda x, h, c, p: _reference.rnn(spec, x, h, c, p, seq_lengths=jnp.asarray(lengths),
                                               dropout_key=key, apply_dropout=True))
  args = (x, h, c, params)
  argnums = (0, 1, 2, 3) if spec.has_cell_state else (0, 1, 3)
  want = jax.jit(jax.grad(ref, argnums))(*args)  # jitted: the reference's own speed is not tested
  for _ in range(3):
    got = jax.grad(ours, argnums)(*args)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
  assert traces == [(4, 2, 2)]
  # Forward mode and linearize differentiate the same traced program.
  tangents = tuple(jnp.ones_like(a) if a is not None else None for a in args)
  primal_out, tangent_out = jax.jvp(ours, args, tangents)
  want_out, want_tangent = jax.jit(lambda a, t: jax.jvp(ref, a, t))(args, tangents)
  np.testing.assert_allclose(primal_out, want_out, rtol=1e-12)
  np.testing.assert_allclose(tangent_out, want_tangent, rtol=1e-10)
  np.testing.assert_allclose(jax.linearize(ours, *args)[1](*tangents), want_tangent, rtol=1e-10)
  assert traces == [(4, 2, 2)]
  # A new length traces once more.
  x6 = random_inputs(spec, 6, 2)[0]
  jax.grad(ours, 3)(x6, h, c, params), jax.grad(ours, 3)(x6, h, c, params)
  assert traces == [(4, 2, 2), (6, 2, 2)]
  # vmap, of the call and of its gradient: the program traced above, batched.
  xs = jnp.stack([x, 2 * x])
  want = [jax.jit(ref)(v, h, c, params) for v in xs]
  want_grads = [jax.jit(jax.grad(ref, 3))(v, h, c, params) for v in xs]
  for _ in range(2):
    got = jax.vmap(ours, (0, None, None, None))(xs, h, c, params)
    np.testing.assert_allclose(got, want, rtol=1e-12)
    got = jax.vmap(jax.grad(ours, 3), (0, None, None, None))(xs, h, c, params)
    np.testing.assert_allclose(got, want_grads, rtol=1e-10, atol=1e-12)
  assert traces == [(4, 2, 2), (6, 2, 2)]
  # Under jit, or jax.checkpoint, the caller's trace, at every trace.
  jax.jit(jax.grad(ours, 3))(*args)
  jax.grad(jax.checkpoint(ours), 3)(*args)
  assert traces == [(4, 2, 2), (6, 2, 2), (4, 2, 2), (4, 2, 2)]


def test_spec_as_static_jit_argument():
  spec, params, x, h, c = _setup(jcr.CudnnLSTM)

  @functools.partial(jax.jit, static_argnums=0)
  def run(spec, x, h, c, params):
    return spec(x, h, c, params, is_training=False)[0]

  np.testing.assert_allclose(run(spec, x, h, c, params), spec(x, h, c, params)[0], rtol=1e-12)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_vmap_over_extra_batch_axis(cls):
  spec, params, _, _, _ = _setup(cls)
  xs, hs, cs = [], [], []
  for seed in range(3):
    x, h, c = random_inputs(spec, 4, 2, seed=seed + 10)
    xs.append(x), hs.append(h), cs.append(c)
  xs, hs = np.stack(xs), np.stack(hs)
  cs = np.stack(cs) if spec.has_cell_state else None
  lengths = np.array([[4, 1], [2, 3], [0, 4]])
  batched = jax.vmap(lambda x, h, c, l: call(spec, x, h, c, params, seq_lengths=l),
                     in_axes=(0, 0, 0 if cs is not None else None, 0))(xs, hs, cs, lengths)
  for i in range(3):
    single = call(spec, xs[i], hs[i], None if cs is None else cs[i], params, seq_lengths=lengths[i])
    for a, b in zip(batched, single):
      if b is not None:
        np.testing.assert_allclose(a[i], b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_vmap_over_params(cls):
  spec, _, x, h, c = _setup(cls)
  stacked = jnp.stack([spec.init_params(jax.random.key(i)) for i in range(3)])
  out = jax.vmap(lambda p: call(spec, x, h, c, p))(stacked)
  for i in range(3):
    single = call(spec, x, h, c, stacked[i])
    for a, b in zip(out, single):
      if b is not None:
        np.testing.assert_allclose(a[i], b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_checkpoint_gives_same_values_and_grads(cls):
  spec, params, x, h, c = _setup(cls)
  loss = lambda p, x: jnp.sum(call(spec, x, h, c, p)[0] ** 2)
  g1 = jax.grad(loss, argnums=(0, 1))(params, x)
  g2 = jax.jit(jax.grad(jax.checkpoint(loss), argnums=(0, 1)))(params, x)
  for a, b in zip(g1, g2):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_grad_through_canonical_conversion_matches_direct():
  spec, params, x, h, c = _setup(jcr.CudnnGRU)
  weights, biases = spec.params_to_canonical(params)
  loss_p = lambda p: jnp.sum(spec(x, h, p)[0])
  loss_c = lambda w, b: loss_p(spec.canonical_to_params(w, b))
  gw, gb = jax.grad(loss_c, argnums=(0, 1))(weights, biases)
  g_direct = jax.grad(loss_p)(params)
  np.testing.assert_allclose(spec.canonical_to_params(gw, gb), g_direct, rtol=1e-12)


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_runs_under_strict_dtype_promotion(cls, dtype):
  # A half-precision model computes in float32 (and multiplies bfloat16
  # operands: `_xla.operand_dtype`); none of that may lean on implicit dtype
  # promotion, which `jax_numpy_dtype_promotion="strict"` refuses. Its values,
  # gradient and forward-mode derivative there equal those under "standard".
  spec = cls(2, 4, 4, input_mode="skip_input", direction="bidirectional", dtype=dtype)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 40, 3)
  lengths = np.array([40, 1, 0], np.int32)

  def loss(p, x, h):
    out = call(spec, x, h, c, p, seq_lengths=lengths, implementation="xla")  # forward mode
    return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in out if o is not None)

  def derivatives():
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, h)
    tangent = jax.jvp(lambda p: loss(p, x, h), (params,), (params,))[1]
    return value, grads, tangent

  got = same_under(jax.numpy_dtype_promotion, "standard", "strict", derivatives)
  assert float(jnp.abs(got[1][0].astype(jnp.float32)).sum()) > 0


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("steps", [1, 40])  # one step; chunks of steps (`_xla._chunked_scan`)
def test_runs_where_implicit_rank_promotion_raises(cls, steps):
  # The values, gradient, forward-mode derivative and vmap under
  # `jax_numpy_rank_promotion="raise"` equal those under "allow". skip_input
  # with a tangent in the weights only leaves layer 0 a bias tangent alone, to
  # broadcast against `[T, B, g*H]` coefficients (a GRU's did so implicitly).
  spec = cls(2, 3, 3, input_mode="skip_input", direction="bidirectional", dropout=0.25)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, steps, 3)
  lengths = np.array([steps, 1, 0])

  def loss(p, x, h):
    out = call(spec, x, h, c, p, seq_lengths=lengths, dropout_key=jax.random.key(1),
               implementation="xla")  # forward mode below
    return sum(jnp.sum(o * o) for o in out if o is not None)

  def derivatives():
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(params, x, h)
    tangent = jax.jvp(lambda p: loss(p, x, h), (params,), (params,))[1]
    batched = jax.vmap(lambda x: loss(params, x, h))(np.stack([x, 2 * x]))
    return value, grads, tangent, batched

  got = same_under(jax.numpy_rank_promotion, "allow", "raise", derivatives)
  assert float(jnp.abs(got[1][0]).sum()) > 0
