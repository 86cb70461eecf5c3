"""Every argument of the call, one at a time, replaced by an odd value: a
`TypeError` or `ValueError` whose first line names the argument, eagerly and
under `jit`, for each of the four cells (never an error from inside JAX, a
crash, or a run on a value that means nothing). `test_validation.py` pins the
messages; this file sweeps the values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr

T, B = 5, 2


def _odd_arrays(shape):
  """Values that are no array of `shape` and float32 (the spec's dtype)."""
  yield "rank - 1", np.zeros(shape[:-1], np.float32)
  yield "rank + 1", np.zeros(shape + (1,), np.float32)
  yield "scalar", np.float32(0)
  yield "last axis + 1", np.zeros(shape[:-1] + (shape[-1] + 1,), np.float32)
  for dtype in (np.int32, np.float64, np.float16, np.bool_, np.complex64, np.uint8, jnp.bfloat16):
    yield f"dtype {np.dtype(dtype).name}", np.zeros(shape, dtype)
  yield "object array", np.full(shape, None)
  yield "PRNG keys", jax.random.split(jax.random.key(0), int(np.prod(shape))).reshape(shape)
  yield "ragged list", [[0.0]] * (shape[0] - 1) + [[0.0, 1.0]]
  yield "list of None", [None] * shape[0]
  for value in ("abc", b"abc", {"a": 1}, {1, 2}, object()):
    yield type(value).__name__, value


def _odd_arguments(spec):
  state = (spec.num_layers * spec.num_dirs, B, spec.num_units)
  yield from (("input_data", *odd) for odd in _odd_arrays((T, B, spec.input_size)))
  for name in ("input_h", "input_c") if spec.has_cell_state else ("input_h",):
    yield from ((name, *odd) for odd in _odd_arrays(state))
  yield from (("params", *odd) for odd in _odd_arrays((spec.params_size(),))
              if not odd[0].startswith("rank - 1"))  # rank - 1 of a vector: a scalar, again
  for what, value in [("float", np.array([1.0, 2.0])), ("bool", np.array([True, False])),
                      ("2-D", np.ones((B, 1), np.int32)), ("negative", np.array([-1, 2])),
                      ("past T", np.array([T + 1, 2])), ("past T, a list", [T, T + 1]),
                      ("2**32 + 1", np.array([2**32 + 1, 1])), ("2**63", np.array([2**63, 1], np.uint64)),
                      ("float list", [1.5, 2.0]), ("list with None", [None, 1]), ("scalar", 3),
                      ("complex", np.array([1j, 2])), ("str", "ab"), ("PRNG key", jax.random.key(0))]:
    yield "seq_lengths", what, value
  for what, value in [("int", 3), ("float", 1.5), ("str", "k"), ("list", [0, 1]),
                      ("batch", jax.random.split(jax.random.key(0), 2)),
                      ("typed, shape (1,)", jax.random.split(jax.random.key(0), 1)),
                      ("raw, shape (3,)", np.zeros(3, np.uint32)), ("raw int32", np.zeros(2, np.int32)),
                      ("raw float32", np.zeros(2, np.float32))]:
    yield "dropout_key", what, value
  for name in ("is_training", "time_major"):
    for what, value in [("int", 1), ("None", None), ("str", "x"), ("jnp bool", jnp.array(True)),
                        ("array of one bool", np.array([True]))]:
      yield name, what, value
  for what, value in [("int", 1), ("other name", "gpu"), ("upper case", "XLA"), ("list", ["xla"]),
                      ("True", True)]:
    yield "implementation", what, value


SPECS = [jcr.CudnnLSTM(2, 4, 3, dropout=0.5, direction="bidirectional", dtype=jnp.float32),
         jcr.CudnnGRU(1, 4, 4, input_mode="skip_input", dtype=jnp.float32),
         jcr.CudnnRNNTanh(2, 3, 2, dropout=0.2, dtype=jnp.float32),
         jcr.CudnnRNNRelu(1, 5, 3, direction="bidirectional", dtype=jnp.float32)]


def _call(spec, arguments, jit):
  arguments = dict(arguments)
  positional = [arguments.pop("input_data"), arguments.pop("input_h")]
  input_c = arguments.pop("input_c")
  if spec.has_cell_state:
    positional.append(input_c)
  positional += [arguments.pop("params"), arguments.pop("is_training")]
  if jit:  # every argument closed over: static to the trace as it was given
    return jax.jit(lambda: spec(*positional, **arguments))()
  return spec(*positional, **arguments)


def _good(spec):
  state = jnp.zeros((spec.num_layers * spec.num_dirs, B, spec.num_units), jnp.float32)
  return dict(input_data=jax.random.normal(jax.random.key(1), (T, B, spec.input_size), jnp.float32),
              input_h=state, input_c=state, params=spec.init_params(jax.random.key(0)),
              is_training=True, seq_lengths=np.array([T, 3], np.int32),
              dropout_key=jax.random.key(2), time_major=True, implementation=None)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_each_odd_argument_is_an_error_naming_it(spec):
  good = _good(spec)
  faults = []
  for (name, what, value) in _odd_arguments(spec):
    for jit in (False, True):
      try:
        _call(spec, good | {name: value}, jit)
      except (TypeError, ValueError) as e:
        if name not in str(e).split("\n")[0]:
          faults.append(f"{name} = {what} (jit={jit}): {type(e).__name__} not naming it: {e}")
      except Exception as e:  # pylint: disable=broad-except
        faults.append(f"{name} = {what} (jit={jit}): {type(e).__name__}: {e}")
      else:
        faults.append(f"{name} = {what} (jit={jit}) ran")
  assert not faults, "\n".join(f[:300] for f in faults)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint32, np.int64])
def test_lengths_of_any_integer_dtype_are_those_of_int32(dtype):
  spec = SPECS[0]
  good = _good(spec)
  want = _call(spec, good, jit=False)
  for jit in (False, True):
    got = _call(spec, good | {"seq_lengths": good["seq_lengths"].astype(dtype)}, jit)
    for g, w in zip(got, want):
      np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
