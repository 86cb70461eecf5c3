"""Data-parallel runs over four CPU devices: the batch sharded, the weights
replicated. Run by `test_sharding.py` in a child pytest with
`--xla_force_host_platform_device_count=4` (the main run has one device);
not collected on its own (the name does not start with `test_`).

Each case runs a loss and its gradients under `jit` on sharded inputs and
compares them with the same computation on one device, for both of JAX's
sharding modes:
- "explicit": the mesh's axes are `AxisType.Explicit` (the default of
  `jax.make_mesh`), so shardings are part of the arrays' types and a
  computation that merges the batch axis away fails at trace time;
- "auto": `AxisType.Auto`, the partitioner decides, and a computation that
  cannot be split by batch is run on gathered, whole operands.
Both backends are run: "xla" as is, and "cudnn" with the native handlers
replaced by the pure-JAX model of their contract (`handler_model.py`), so
that what is checked is how the cuDNN calls are split over devices (each
call sees its device's part of the batch, weight gradients are summed over
devices), not cuDNN itself.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _one_step, _partition, _rounded_dot, linen
from handler_model import HandlerModel
from helpers import call, native_library, random_inputs, relative_error

DEVICES = 4
B = 8  # the global batch: 2 rows per device
T = 5


@pytest.fixture(scope="module", autouse=True)
def _four_devices():
  assert len(jax.devices()) == DEVICES, (
      f"run with XLA_FLAGS=--xla_force_host_platform_device_count={DEVICES}, "
      f"got {len(jax.devices())} devices")


@pytest.fixture
def model(monkeypatch):
  """The cuDNN calls answered by the handler model (see the module docstring)."""
  return HandlerModel().install(monkeypatch.setattr)


# The sharding modes: "explicit" and "auto" (the module docstring), and
# "explicit-unset": an explicit mesh whose arrays are placed and used without
# `jax.set_mesh` (JAX runs them so: the mesh is in their types), where the
# library must take the mesh from the arrays rather than from the context.
MODES = ["explicit", "explicit-unset", "auto"]


def _mesh(mode):
  axis_type = AxisType.Explicit if mode.startswith("explicit") else AxisType.Auto
  return jax.make_mesh((DEVICES,), ("data",), axis_types=(axis_type,))


@contextlib.contextmanager
def _in(mesh, mode):
  """Explicit meshes are used through `jax.set_mesh`, as JAX's guide has it
  (but for "explicit-unset"); auto ones through the arrays' shardings alone
  (plain `jit`)."""
  if mode == "explicit":
    with jax.set_mesh(mesh):
      yield
  else:
    yield


F64 = dict(dtype=jnp.float64)  # so that the comparisons can be tight
CASES = {
    # name: (spec, options)
    "lstm-2-layers-bidirectional": (jcr.CudnnLSTM(2, 6, 3, direction="bidirectional", **F64),
                                    {}),
    "gru-batch-major-lengths": (jcr.CudnnGRU(1, 5, 4, **F64),
                                dict(time_major=False, lengths=True)),
    "tanh-skip-input-lengths": (jcr.CudnnRNNTanh(2, 4, 4, input_mode="skip_input",
                                                 direction="bidirectional", **F64),
                                dict(lengths=True)),
    "relu-dropout": (jcr.CudnnRNNRelu(3, 4, 2, dropout=0.3, **F64), dict(dropout=True)),
    # Long enough for the "xla" forward to run in chunks of steps (`_chunks.chunk_steps`),
    # which reshapes the time axis while the batch axis stays split.
    "lstm-bidirectional-36-steps-lengths": (
        jcr.CudnnLSTM(1, 6, 3, direction="bidirectional", **F64), dict(steps=36, lengths=True)),
}


def _problem(spec, options):
  """Inputs (time-major unless `time_major=False`) and the loss over them."""
  time_major = options.get("time_major", True)
  steps = options.get("steps", T)
  x, h, c = random_inputs(spec, steps, B, seed=7)
  x = x if time_major else np.swapaxes(x, 0, 1)
  params = np.asarray(spec.init_params(jax.random.key(8)))
  lengths = None
  if options.get("lengths"):  # full, partial and empty sequences
    lengths = np.array([5, 1, 3, 0, 5, 2, 4, 5], np.int32) * steps // T
  kwargs = dict(time_major=time_major)
  if options.get("dropout"):
    kwargs["dropout_key"] = jax.random.key(9)

  def loss(x, h, c, params, lengths, implementation):
    y, hn, cn = call(spec, x, h, c, params, seq_lengths=lengths, implementation=implementation,
                     **kwargs)
    total = jnp.sum(jnp.sin(y)) + jnp.sum(hn ** 2)
    return total if cn is None else total + jnp.sum(jnp.cos(cn))

  return (x, h, c, params, lengths), loss, time_major


def _shard(mesh, operands, time_major):
  """x, h, c and the lengths split by batch over the mesh; params replicated."""
  x, h, c, params, lengths = operands
  put = lambda a, *spec: None if a is None else jax.device_put(a, NamedSharding(mesh, P(*spec)))
  data = ("data", None, None) if not time_major else (None, "data", None)
  return (put(x, *data), put(h, None, "data", None), put(c, None, "data", None),
          put(params), put(lengths, "data"))


def _values_and_grads(loss, operands, implementation):
  """The loss and its gradients, and the compiled computation's text."""
  argnums = (0, 1, 3) if operands[2] is None else (0, 1, 2, 3)
  f = jax.jit(jax.value_and_grad(loss, argnums=argnums), static_argnums=5)
  return f(*operands, implementation), f.lower(*operands, implementation).compile().as_text()


# One device's results, the reference of each mode and split, by problem and
# backend: each is a compilation of its own, computed once (when each case
# computed its own, this file's run took 290 s alone, against 214 s).
_ONE_DEVICE = {}


def _one_device(key, compute):
  if key not in _ONE_DEVICE:
    _ONE_DEVICE[key] = jax.device_get(compute())
  return _ONE_DEVICE[key]


def _spec_at(array, axis):
  spec = array.sharding.spec
  return spec[axis] if len(spec) > axis else None


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_batch_sharded_equals_one_device(request, case, implementation, mode):
  if implementation == "cudnn":
    model = request.getfixturevalue("model")
  spec, options = CASES[case]
  operands, loss, time_major = _problem(spec, options)
  want_value, want_grads = _one_device(
      (case, implementation), lambda: _values_and_grads(loss, operands, implementation)[0])

  mesh = _mesh(mode)
  with _in(mesh, mode):
    sharded = _shard(mesh, operands, time_major)
    (value, grads), compiled = _values_and_grads(loss, sharded, implementation)
  np.testing.assert_allclose(value, want_value, rtol=1e-12)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
  # Nothing was gathered: the data gradient comes back split like the data,
  # the weights' whole (summed over the devices).
  assert _spec_at(grads[0], 1 if time_major else 0) == "data", grads[0].sharding
  assert grads[-1].sharding.is_fully_replicated, grads[-1].sharding
  assert "all-gather" not in compiled
  if implementation == "cudnn":
    # Every cuDNN call ran on one device's part of the batch.
    batch_axis = 1 if time_major else 0
    local = [s for s in model.x_shapes if s[batch_axis] == B // DEVICES]
    assert local, model.x_shapes


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_inference_batch_sharded_equals_one_device(request, implementation, mode):
  """`is_training=False`: the cuDNN path's inference call (the one that folds
  `vmap`) is split too, and its outputs stay split."""
  if implementation == "cudnn":
    model = request.getfixturevalue("model")
  spec, options = CASES["gru-batch-major-lengths"]
  operands, _, _ = _problem(spec, options)

  def infer(x, h, c, params, lengths):
    return call(spec, x, h, c, params, is_training=False, seq_lengths=lengths,
                implementation=implementation, time_major=False)[:2]

  want = _one_device(("inference", implementation), lambda: jax.jit(infer)(*operands))
  mesh = _mesh(mode)
  with _in(mesh, mode):
    sharded = _shard(mesh, operands, time_major=False)
    f = jax.jit(infer)
    got = f(*sharded)
    compiled = f.lower(*sharded).compile().as_text()
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
  assert _spec_at(got[0], 0) == "data" and _spec_at(got[1], 1) == "data", got[0].sharding
  assert "all-gather" not in compiled
  if implementation == "cudnn":
    # The model is plain JAX, which XLA could split by itself: what shows that
    # the call was split is that it was traced with one device's rows.
    assert (B // DEVICES, T, spec.input_size) in model.x_shapes, model.x_shapes


@pytest.mark.parametrize("mode", MODES)
def test_one_step_call_moves_no_rows(monkeypatch, mode):
  """A one-step call of a float32 model at the sizes where, on one device,
  the "xla" path multiplies the whole opaque buffer (`_one_step.plan`): its
  pieces stacked along the batch, whose per-matrix columns cut across the
  devices' parts (an all-to-all and a collective-permute each call, before
  session 90). With several devices it multiplies the sliced matrices: no
  rows move, and the values are one device's."""
  spec = jcr.CudnnGRU(1, 256, 256)
  x, h, _ = random_inputs(spec, 1, B, seed=7)
  params = np.asarray(spec.init_params(jax.random.key(8)))
  lengths = np.array([1, 0, 1, 1, 0, 1, 1, 1], np.int32)
  with monkeypatch.context() as m:
    m.setattr(jax, "device_count", lambda *backend: 1)
    assert _one_step.plan(spec, 0, jax.ShapeDtypeStruct(x.shape, x.dtype), False) is not None

  def infer(x, h, params, lengths):
    return call(spec, x, h, None, params, is_training=False, seq_lengths=lengths,
                implementation="xla")[:2]

  want = _one_device(("one step", "xla"), lambda: jax.jit(infer)(x, h, params, lengths))
  mesh = _mesh(mode)
  with _in(mesh, mode):
    sharded = _shard(mesh, (x, h, None, params, lengths), time_major=True)
    f = jax.jit(infer)
    operands = sharded[:2] + sharded[3:]
    got = f(*operands)
    compiled = f.lower(*operands).compile().as_text()
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
  assert _spec_at(got[0], 1) == "data" and _spec_at(got[1], 1) == "data", got[0].sharding
  for collective in ("all-gather", "all-to-all", "collective-permute", "all-reduce"):
    assert collective not in compiled, collective


@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_inside_a_users_shard_map(request, implementation):
  """The README's way before the library split calls itself: the user's own
  `shard_map` over the batch, weights replicated (`P()`), loss summed with
  `psum`. The weights' gradient must come back summed and replicated, which
  JAX checks by type (`check_vma`)."""
  if implementation == "cudnn":
    request.getfixturevalue("model")
  case = "lstm-2-layers-bidirectional"
  operands, loss, _ = _problem(*CASES[case])
  want_value, want_grads = _one_device(
      (case, implementation), lambda: _values_and_grads(loss, operands, implementation)[0])

  mesh = _mesh("auto")
  data, state = P(None, "data", None), P(None, "data", None)

  def per_device(x, h, c, params):
    return jax.lax.psum(loss(x, h, c, params, None, implementation), "data")

  f = jax.jit(jax.value_and_grad(
      jax.shard_map(per_device, mesh=mesh, in_specs=(data, state, state, P()), out_specs=P()),
      argnums=(0, 1, 2, 3)))
  value, grads = f(*operands[:4])
  np.testing.assert_allclose(value, want_value, rtol=1e-12)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", MODES + ["shard_map"])
def test_bfloat16_batch_sharded(mode):
  """A bfloat16 model on the "xla" path, whose forward and backward products
  are `_rounded_dot`s, a primitive of this package's own (its sharding rules
  are its own code): split by batch it gives what one device gives, up to the
  order of float32 sums. The chunked forward (36 steps), with lengths, batch
  major."""
  spec = jcr.CudnnLSTM(2, 6, 3, direction="bidirectional", dtype=jnp.bfloat16)
  operands, loss, time_major = _problem(spec, dict(steps=36, lengths=True, time_major=False))
  want_value, want_grads = _one_device(
      ("bfloat16", "xla"), lambda: _values_and_grads(loss, operands, "xla")[0])
  if mode == "shard_map":
    x, h, c, params, lengths = operands
    batch, state = P("data", None, None), P(None, "data", None)

    def per_device(x, h, c, params, lengths):
      return jax.lax.psum(loss(x, h, c, params, lengths, "xla"), "data")

    f = jax.jit(jax.value_and_grad(
        jax.shard_map(per_device, mesh=_mesh("auto"), out_specs=P(),
                      in_specs=(batch, state, state, P(), P("data"))),
        argnums=(0, 1, 2, 3)))
    value, grads = f(x, h, c, params, lengths)
  else:
    mesh = _mesh(mode)
    with _in(mesh, mode):
      sharded = _shard(mesh, operands, time_major)
      (value, grads), compiled = _values_and_grads(loss, sharded, "xla")
    assert _spec_at(grads[0], 0) == "data", grads[0].sharding
    assert grads[-1].sharding.is_fully_replicated, grads[-1].sharding
    assert "all-gather" not in compiled
  np.testing.assert_allclose(np.float32(value), np.float32(want_value), rtol=1e-2)
  for got, want in zip(grads, want_grads):
    assert relative_error(got, want) <= 1e-2, relative_error(got, want)


# Operands split along other dimensions than the batch too, on a 2 x 2 mesh
# ("data" x "model"): (x, states, params, lengths) specs, time-major x.
OTHER_SPLITS = {
    "x over time": (P("model", "data", None), P(None, "data", None), P(), P("data")),
    "x over features": (P(None, "data", "model"), P(None, "data", None), P(), P("data")),
    "states over units": (P(None, "data", None), P(None, "data", "model"), P(), P("data")),
    "states over layers": (P(None, "data", None), P("model", "data", None), P(), P("data")),
    "params split": (P(None, "data", None), P(None, "data", None), P("model"), P("data")),
}


@pytest.mark.parametrize("mode", ["explicit", "explicit-unset"])
@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
@pytest.mark.parametrize("split", sorted(OTHER_SPLITS))
def test_other_splits_are_gathered(request, split, implementation, mode):
  """Under explicit sharding, an operand split along a dimension other than
  the batch (the time axis, the features, the states' units or layers, the
  weight buffer) is gathered before the RNN runs (`_partition.batch_like`):
  the "xla" path's scan and products are refused by JAX's sharding types
  otherwise (and were, before). Values and gradients as on one device, each
  gradient split like its operand."""
  if implementation == "cudnn":
    request.getfixturevalue("model")
  # Every split dimension even (features 4, units 6, 4 states, 36 steps: chunked).
  spec = jcr.CudnnLSTM(2, 6, 4, direction="bidirectional", **F64)
  operands, loss, _ = _problem(spec, dict(steps=36, lengths=True))
  want_value, want_grads = _one_device(
      ("other splits", implementation), lambda: _values_and_grads(loss, operands, implementation)[0])
  mesh = jax.make_mesh((2, DEVICES // 2), ("data", "model"),
                       axis_types=(AxisType.Explicit,) * 2)
  x_spec, state_spec, params_spec, lengths_spec = OTHER_SPLITS[split]
  x, h, c, params, lengths = operands
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  sharded = (put(x, x_spec), put(h, state_spec), put(c, state_spec), put(params, params_spec),
             put(lengths, lengths_spec))
  with _in(mesh, mode):
    (value, grads), _ = _values_and_grads(loss, sharded, implementation)
  np.testing.assert_allclose(value, want_value, rtol=1e-12)
  for got, want, operand in zip(grads, want_grads, sharded[:4]):
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)
    assert got.sharding.is_equivalent_to(operand.sharding, got.ndim), (got.sharding,
                                                                     operand.sharding)


def test_rounded_dot_vmapped_weights_explicit():
  """`vmap(grad)` over two weight sets of a `_rounded_dot`, the data split by
  batch on an explicit mesh: its weight-gradient transposes carry an output
  sharding, which its batching rule extends by the mapped axis."""
  x = jax.random.normal(jax.random.key(0), (B, 3, 5), jnp.float32)
  w = jax.random.normal(jax.random.key(1), (2, 5, 6), jnp.float32)
  rounded = lambda v: v.astype(jnp.bfloat16).astype(jnp.float32)
  loss = lambda w, x: jnp.sum(jnp.sin(_rounded_dot.matmul(x, w, operands=jnp.bfloat16)))
  ref = lambda w, x: jnp.sum(jnp.sin(jnp.matmul(rounded(x), rounded(w), precision="highest")))
  want = jax.vmap(jax.grad(ref), (0, None))(w, x)
  mesh = _mesh("explicit")
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P()))
    got = jax.jit(jax.vmap(jax.grad(loss), (0, None)))(ws, xs)
  assert got.sharding.is_fully_replicated, got.sharding
  # The cotangent is rounded to bfloat16 too (measured: 2.6e-3 of the largest).
  np.testing.assert_allclose(got, want, atol=1e-2 * float(jnp.abs(want).max()))


def test_reserve_rows_hold_every_even_split():
  """Hand-computed: a reserve of `100 + 3 * rows` bytes over a batch of 8 rows
  split into 1, 2 or 4 parts needs ceil(124/8) = 16, ceil(112/4) = 28 and
  ceil(106/2) = 53 bytes a row: 53 (3 and 5 parts do not divide 8; 8 parts
  would need more devices than the 4 here)."""
  assert _partition.reserve_row_bytes(lambda rows: 100 + 3 * rows, 8) == 53
  # And one row: whatever one device needs.
  assert _partition.reserve_row_bytes(lambda rows: 7 * rows + 1, 1) == 8


def test_native_handler_receives_its_devices_rows():
  """The real FFI plumbing, not the model: `JcrRnnCheckInputs` (the native
  library's CPU handler that decodes what the cuDNN handlers are sent and
  reports it) called through `_partition.over_batch` exactly as `_cudnn` calls
  the forward handlers, under auto sharding. Each device's handler is given 2
  of the 8 rows, and its input checks (lengths included) pass on them.
  Skipped where the native library is not built (CI builds it and runs this)."""
  lib = native_library()
  jax.ffi.register_ffi_target("jcr_rnn_check_inputs", jax.ffi.pycapsule(lib.JcrRnnCheckInputs),
                              platform="cpu")
  spec = jcr.CudnnGRU(2, 6, 4, direction="bidirectional")
  cfg = _cudnn.Config.of(spec, time_major=True, has_seq_lengths=True)
  x, h, _ = random_inputs(spec, T, B)
  lengths = np.array([5, 1, 3, 1, 5, 2, 4, 5], np.int32)
  mesh = _mesh("auto")
  x, h, _, params, lengths = _shard(mesh, (x, h, None, np.zeros(spec.params_size(), np.float32),
                                            lengths), time_major=True)
  cell = jnp.zeros((0,), jnp.float32)

  def check(x, h0, c0, params, lengths):
    call = jax.ffi.ffi_call("jcr_rnn_check_inputs", jax.ShapeDtypeStruct((13,), jnp.int64))
    # One report per device, each the same (2 rows apiece): a result with no
    # batch dimension, as `over_batch` requires.
    return (call(x, h0, c0, params, lengths, **cfg.attrs()),)

  run = jax.jit(lambda *operands: _partition.over_batch(
      check, operands, _cudnn._batch_axes(cfg, "xhcwn"), (None,))[0])
  report = np.asarray(run(x, h, cell, params, lengths)).tolist()
  steps, batch = report[10], report[11]
  assert (steps, batch) == (T, B // DEVICES), report
  # With sequence lengths, the standard algorithm (algo 0).
  assert report[:10] == [3, 2, 6, 4, 1, 0, 0, int(cfg.allow_tf32), 1, 0], report


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_linen_module_train_step(request, implementation, mode):
  """A Flax module (batch-major, initial state left to the module: zeros that
  carry no sharding of their own) in a jitted gradient step on a sharded batch."""
  if implementation == "cudnn":
    request.getfixturevalue("model")
  m = linen.LSTM(features=6, num_layers=2, bidirectional=True, param_dtype=jnp.float64,
                 implementation=implementation)
  x = np.asarray(jax.random.normal(jax.random.key(0), (B, T, 3), jnp.float64))
  variables = m.init(jax.random.key(1), x)

  def loss(variables, x):
    return jnp.sum(jnp.sin(m.apply(variables, x)))

  step = jax.jit(jax.value_and_grad(loss))
  want_value, want_grads = _one_device(("linen", implementation), lambda: step(variables, x))
  mesh = _mesh(mode)
  with _in(mesh, mode):
    xs = jax.device_put(x, NamedSharding(mesh, P("data", None, None)))
    vs = jax.device_put(variables, NamedSharding(mesh, P()))
    value, grads = step(vs, xs)
  np.testing.assert_allclose(value, want_value, rtol=1e-12)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12),
               grads, want_grads)


def test_uneven_batch_is_not_split(model):
  """Auto sharding, a batch of 6 constrained inside `jit` to be split 4 ways
  (XLA pads uneven splits; `device_put` refuses them): the cuDNN calls must
  not run on padded rows, so each runs on the whole batch and the results are
  still the one-device ones."""
  spec, options = CASES["lstm-2-layers-bidirectional"]
  operands, loss, _ = _problem(spec, options)
  x, h, c, params, _ = operands
  x, h, c = x[:, :6], h[:, :6], c[:, :6]
  mesh = _mesh("auto")
  split = lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, P(None, "data", None)))

  def constrained(x, h, c, params):
    return loss(split(x), split(h), split(c), params, None, "cudnn")

  want = jax.jit(jax.value_and_grad(lambda *a: loss(*a, None, "cudnn"), argnums=(0, 1, 2, 3)))(
      x, h, c, params)
  got = jax.jit(jax.value_and_grad(constrained, argnums=(0, 1, 2, 3)))(x, h, c, params)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-12)
  for g, w in zip(got[1], want[1]):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)
  assert not [s for s in model.x_shapes if 6 not in s], model.x_shapes  # never a part


def test_checkpoint_restores_replicated_or_split(tmp_path):
  """`checkpoint.restore(..., sharding=)` over the four devices: replicated,
  or split where the buffer's length allows it; else a clear error."""
  from jax_cudnn_rnn import checkpoint
  mesh = jax.make_mesh((DEVICES,), ("data",))
  for spec in (jcr.CudnnLSTM(2, 4, 3, direction="bidirectional"), jcr.CudnnGRU(1, 3, 2)):
    params = spec.init_params(jax.random.key(0))
    checkpoint.save(tmp_path / type(spec).__name__, spec, params)
    restore = lambda sharding: checkpoint.restore(tmp_path / type(spec).__name__, spec,
                                                  sharding=sharding)
    replicated = restore(NamedSharding(mesh, P()))
    assert replicated.sharding.is_fully_replicated
    assert len(replicated.addressable_shards) == DEVICES
    for shard in replicated.addressable_shards:
      np.testing.assert_array_equal(shard.data, params)
    split = NamedSharding(mesh, P("data"))
    if params.shape[0] % DEVICES == 0:
      restored = restore(split)
      parts = [shard.data for shard in restored.addressable_shards]
      assert [p.shape for p in parts] == [(params.shape[0] // DEVICES,)] * DEVICES
      np.testing.assert_array_equal(np.concatenate(parts), params)
    else:
      with pytest.raises(ValueError, match=rf"sharding: .* cannot place the parameter buffer "
                                           rf"of shape \({params.shape[0]},\)"):
        restore(split)


ARGUMENTS = ["input_data", "input_h", "input_c", "params", "seq_lengths", "dropout_key"]


@pytest.mark.parametrize("transform", ["eager", "grad", "vmap"])
@pytest.mark.parametrize("moved", ARGUMENTS)
def test_an_argument_on_another_device_is_named(moved, transform):
  """The arguments put on device 1 but one, put on device 0: JAX's error named
  `_dispatch`'s arguments (`x`, `lengths`), or a zero state the caller never
  passed; ours names the caller's arguments and their devices. All on device
  1, the call runs there and gives what it gives on the default device."""
  spec = jcr.CudnnLSTM(2, 4, 3, dropout=0.5, **F64)
  d0, d1 = jax.devices()[:2]
  x, h, c = random_inputs(spec, T, 3)
  given = dict(input_data=x, params=spec.init_params(jax.random.key(0)),
               seq_lengths=np.array([T, 2, 1], np.int32), dropout_key=jax.random.key(1))
  if moved in ("input_h", "input_c"):  # else None: zeros the library makes
    given |= dict(input_h=h, input_c=c)

  def run(arrays):
    def loss(params):
      y, *_ = spec(arrays["input_data"], arrays.get("input_h"), arrays.get("input_c"), params,
                   seq_lengths=arrays["seq_lengths"], dropout_key=arrays["dropout_key"])
      return (y ** 2).sum()
    if transform == "grad":
      return jax.grad(loss)(arrays["params"])
    if transform == "vmap":
      return jax.vmap(loss)(arrays["params"][None])
    return loss(arrays["params"])

  on_one = {k: jax.device_put(v, d1) for k, v in given.items()}
  got = run(on_one)
  assert got.devices() == {d1}
  np.testing.assert_allclose(got, run(given), rtol=1e-12)
  with pytest.raises(ValueError, match=(
      r"^the arrays of one call must lie on the same devices, got .*"
      + rf"{moved} on \[CpuDevice\(id=0\)\]")) as raised:
    run(on_one | {moved: jax.device_put(given[moved], d0)})
  named = {name for name in ARGUMENTS if f"{name} on [CpuDevice(id=1)]" in str(raised.value)}
  assert named == set(given) - {moved}, str(raised.value)


def test_the_flax_modules_name_their_own_arguments_on_other_devices():
  """As above, in the modules' terms: `inputs`, `initial_carry`, `opaque_params`."""
  from flax import nnx
  from jax_cudnn_rnn import nnx as jcr_nnx
  d0, d1 = jax.devices()[:2]
  x = jax.device_put(jnp.ones((3, T, 2)), d0)
  carry = jax.device_put(jnp.zeros((1, 3, 4)), d0)
  module = linen.GRU(4)
  variables = jax.device_put(module.init(jax.random.key(0), x), d1)
  expected = (r"^the arrays of one call must lie on the same devices, got inputs on "
              r"\[CpuDevice\(id=0\)\], initial_carry on \[CpuDevice\(id=0\)\], opaque_params on "
              r"\[CpuDevice\(id=1\)\]")
  with pytest.raises(ValueError, match=expected):
    module.apply(variables, x, carry)
  model = jcr_nnx.LSTM(2, 4, rngs=nnx.Rngs(0))
  nnx.update(model, jax.device_put(nnx.state(model), d1))
  with pytest.raises(ValueError, match=r"got inputs on \[CpuDevice\(id=0\)\], initial_carry\[0\] "
                                       r"\(h\) on \[CpuDevice\(id=0\)\], initial_carry\[1\] \(c\) "
                                       r"on \[CpuDevice\(id=0\)\], opaque_params on "):
    model(x, (carry, carry))
  np.testing.assert_allclose(model(jax.device_put(x, d1)),
                             model(np.asarray(x)), rtol=1e-6)


@pytest.mark.parametrize("devices", [DEVICES, 2])
@pytest.mark.parametrize("mode", ["explicit", "explicit-unset"])
@pytest.mark.parametrize("implementation", ["xla", "cudnn"])
def test_eager_calls_on_an_explicit_mesh(request, implementation, mode, devices):
  """Eager calls (no `jit`) with the data split over an explicit mesh (all
  four devices, or two of them) and the states and weights not placed (None,
  NumPy): those follow the data. `jax.sharding.reshard` refused them outside
  `jax.set_mesh` ("Length of device assignment 1 is not equal to the size of
  the mesh"); the values are one device's."""
  if implementation == "cudnn":
    request.getfixturevalue("model")
  spec, options = CASES["lstm-2-layers-bidirectional"]
  (x, h, c, params, _), _, _ = _problem(spec, options)
  want = call(spec, x, None, None, params, implementation=implementation)
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:devices])
  with _in(mesh, mode):
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "data", None)))
    got = call(spec, xs, None, None, params, implementation=implementation)
    given = call(spec, xs, h, c, params, implementation=implementation)  # NumPy states
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-14)
    assert g.sharding.device_set == set(jax.devices()[:devices]), g.sharding
  assert _spec_at(got[0], 1) == "data", got[0].sharding
  alone = call(spec, x, h, c, params, implementation=implementation)
  np.testing.assert_allclose(given[0], alone[0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("mode", ["explicit", "explicit-unset"])
def test_an_argument_off_an_explicit_mesh_is_named(mode):
  """Weights the caller put on a device outside the data's explicit mesh: the
  error is raised while the operands are split by batch (`batch_like`), and
  names them, rather than JAX's "Length of device assignment 1 is not equal to
  the size of the mesh 2 of aval f32[1,4@data,8]" (a zero state's)."""
  spec, options = CASES["lstm-2-layers-bidirectional"]
  (x, _, _, params, _), _, _ = _problem(spec, options)
  mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,),
                       devices=jax.devices()[:2])
  with _in(mesh, mode):
    xs = jax.device_put(x, NamedSharding(mesh, P(None, "data", None)))
    with pytest.raises(ValueError, match=r"^the arrays of one call must lie on the same "
                                         r"devices, got input_data on \[CpuDevice\(id=0\), "
                                         r"CpuDevice\(id=1\)\], params on \[CpuDevice\(id=3\)\]"):
      call(spec, xs, None, None, jax.device_put(params, jax.devices()[3]))
