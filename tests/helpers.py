"""Shared test helpers: the spec classes, random canonical params, uniform calls,
the built native library, the benchmark scripts."""

import ctypes
import importlib.util
import os
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _layout

SPEC_CLASSES = (jcr.CudnnLSTM, jcr.CudnnGRU, jcr.CudnnRNNTanh, jcr.CudnnRNNRelu)
GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


# Where cuDNN's float32 results meet XLA's. On a CPU, implementation=None is the
# "xla" path, so both sides are XLA's and agree to 1e-6. On a GPU it is cuDNN,
# whose kernels compute the same function apart: an H100 (session 46, full
# float32 precision on both sides) put one GRU or RNN-tanh step up to 7.3e-6
# apart, relative, and a 2-layer GRU's outputs 2.6e-6 apart in the norm.
CROSS_TOL = 2e-5 if jax.default_backend() == "gpu" else 1e-6

# For tests that imitate a machine on a CPU host (a CPU run, or a GPU with the
# handler model answering cuDNN's calls) and expect what such a host has. On a
# real GPU, benchmarks/gpu_session.sh's stages run the real thing.
on_a_cpu_host = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason=f"imitates a CPU host; this backend is {jax.default_backend()}")


def relative_error(got, want) -> float:
  """`|got - want| / |want|` in the Frobenius norm, in float64; `want` must not be zero."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert np.linalg.norm(want) > 0
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def jaxpr_equations(jaxpr):
  """Every equation of a jaxpr and of the jaxprs nested in it (scans, custom_jvp)."""
  for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:  # a ClosedJaxpr's Jaxpr
    yield eqn
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          yield from jaxpr_equations(sub)


def assert_gradient_is_one_concatenation(grad_jaxpr, size: int) -> None:
  """The gradient of a `size`-element opaque buffer in `grad_jaxpr` is built by
  exactly one buffer-sized concatenation, with no buffer-sized pad or sum."""
  eqns = list(jaxpr_equations(grad_jaxpr))
  full = lambda e, name: e.primitive.name == name and e.outvars[0].aval.shape == (size,)
  assert sum(full(e, "concatenate") for e in eqns) == 1
  assert not any(full(e, "pad") or full(e, "add_any") for e in eqns)


def canonical_shapes(spec):
  """Canonical shapes from the documented order, computed independently of `_layout`."""
  g, H, D = GATES[spec.rnn_mode], spec.num_units, 2 if spec.direction == "bidirectional" else 1
  weights, biases = [], []
  for layer in range(spec.num_layers):
    fan_in = spec.input_size if layer == 0 else D * H
    for _ in range(D):
      if not (layer == 0 and spec.input_mode == "skip_input"):
        weights += [(H, fan_in)] * g
      weights += [(H, H)] * g
      biases += [(H,)] * (2 * g)
  return weights, biases


def random_canonical(spec, seed=0, scale=0.5):
  rng = np.random.default_rng(seed)
  w_shapes, b_shapes = canonical_shapes(spec)
  draw = lambda s: (rng.uniform(-scale, scale, s)).astype(spec.dtype)
  return [draw(s) for s in w_shapes], [draw(s) for s in b_shapes]


def call(spec, x, h, c, params, **kwargs):
  """Calls any spec, returning `(y, h, c)` with c None for models without one."""
  if spec.has_cell_state:
    return spec(x, h, c, params, **kwargs)
  y, h_out = spec(x, h, params, **kwargs)
  return y, h_out, None


def same_under(setting, loose, strict, derivatives):
  """`derivatives()` under `setting(strict)` (a JAX config context), checked
  equal, leaf by leaf, to it under `setting(loose)`; returns the former."""
  with setting(loose):
    expected = derivatives()
  with setting(strict):
    got = derivatives()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(a, b)
  return got


def padding_changes_nothing(run, x, past, *args):
  """`run(x, *args)` with zeros where `past` (`[T, B]`, in `x`'s layout: the
  steps past each sequence's length), checked equal bit for bit, leaf by
  leaf, to it with NaN and with inf there; returns the zero-padded result."""
  padded = lambda value: jax.numpy.where(past[..., None], value, x)
  zeros = run(padded(0.0), *args)
  for value in (np.nan, np.inf):
    for got, want in zip(jax.tree.leaves(run(padded(value), *args)), jax.tree.leaves(zeros)):
      np.testing.assert_array_equal(got, want)
  return zeros


def random_inputs(spec, T, B, seed=1):
  rng = np.random.default_rng(seed)
  S = spec.num_layers * (2 if spec.direction == "bidirectional" else 1)
  x = rng.normal(size=(T, B, spec.input_size)).astype(spec.dtype)
  h = (0.5 * rng.normal(size=(S, B, spec.num_units))).astype(spec.dtype)
  c = (0.5 * rng.normal(size=(S, B, spec.num_units))).astype(spec.dtype) if spec.has_cell_state else None
  return x, h, c


def assert_layout_is_analytic(spec, rows):
  """`rows` (`_cudnn.weight_layout`'s format: `[pseudo_layer, linear_id] ->
  (matrix offset, rows, cols, bias offset, bias length)`, as cuDNN reports
  them) place every canonical tensor where `_layout` does; the input matrices
  that skip_input drops are reported absent, while their biases stay."""
  weights, biases = _layout.tensors(spec)
  by_id = {(t.layer * spec.num_dirs + t.direction, t.index): t for t in weights}
  for t in biases:
    row = rows[t.layer * spec.num_dirs + t.direction, t.index]
    assert (row[3], row[4]) == (t.offset, t.shape[0]), (spec, t, row)
  for p in range(rows.shape[0]):
    for lin in range(2 * spec.num_gates):
      row = rows[p, lin]
      t = by_id.get((p, lin))
      if t is None:  # skip_input: layer 0 has no input matrices
        assert row[0] == -1 or row[1] * row[2] == 0, (spec, p, lin, row)
      else:
        assert (row[0], row[1], row[2]) == (t.offset, *t.shape), (spec, t, row)


def native_library() -> ctypes.CDLL:
  """The built native library, from JCR_NATIVE_LIBRARY (CI sets it to the CMake
  build output) or the installed package, loaded after the cuDNN wheel it
  links; skips the test where it was not built."""
  explicit = os.environ.get("JCR_NATIVE_LIBRARY")
  if explicit:
    path = pathlib.Path(explicit)
    assert path.exists(), f"JCR_NATIVE_LIBRARY={path} does not exist"
  else:
    path = next((p for p in _cudnn._library_candidates() if p.exists()), None)
  if path is None:
    pytest.skip("the native library was not built on this machine")
  _cudnn._preload_cudnn_wheel()
  return ctypes.CDLL(str(path))


def load_benchmark(name: str):
  """`benchmarks/<name>.py` as a module (the benchmarks are scripts, not a package)."""
  path = pathlib.Path(__file__).parent.parent / "benchmarks" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module  # its dataclasses look their module up there
  spec.loader.exec_module(module)
  return module


def has_torch() -> bool:
  return importlib.util.find_spec("torch") is not None


def every_output_loss(impl, spec, lengths):
  """A scalar touching every output of `impl(spec, x, h, c, params,
  seq_lengths=lengths)` non-linearly, so each gradient path is exercised."""
  def f(x, h, c, params):
    y, h_out, c_out = impl(spec, x, h, c, params, seq_lengths=lengths)
    total = jnp.sum(jnp.sin(y)) + jnp.sum(h_out ** 2)
    return total if c_out is None else total + jnp.sum(1.5 * c_out)
  return f


def assert_usage_error(main, argv, message: str, capsys) -> None:
  """`main(argv)` exits as argparse does on a usage error (status 2), its message
  matching the regex `message`."""
  with pytest.raises(SystemExit) as exit_info:
    main(argv)
  assert exit_info.value.code == 2
  assert re.search(message, capsys.readouterr().err)
