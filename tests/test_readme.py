"""The README's Python examples, run as the README prints them.

Each ```python block of README.md is taken from the file (not copied here)
and executed; the test then checks what the block's comments claim (shapes,
round trips) and its results' values against an independent path. A block
added to the README without a test here fails
`test_every_python_block_is_covered`, so the examples cannot drift from the
library unnoticed.

What a block needs but does not define (the TF1 reader, the function to
export, the decoder's spec and inputs) is given to it in its namespace; the
TF1 reader serves a checkpoint written by `interop.to_tf1_checkpoint`, as
`tf.train.load_checkpoint(...).get_tensor` would serve TensorFlow's.
"""

import contextlib
import pathlib
import re
import textwrap
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _reference, interop
from helpers import CROSS_TOL, relative_error

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"

# A distinctive line of each block, and the test that runs it.
MARKERS = {
    "quickstart": "lstm.init_params(jax.random.key(0))",
    "tf1": "tf.train.load_checkpoint",
    "export": "export.deserialize(blob)",
    "decode": "interop.flax_linen_cell(spec)",
}


def _python_blocks() -> list[str]:
  """The README's ```python blocks, dedented (some sit inside list items)."""
  text = README.read_text()
  return [textwrap.dedent(b) for b in re.findall(r"^[ \t]*```python\n(.*?)^[ \t]*```", text,
                                                 flags=re.M | re.S)]


def _block(name: str) -> str:
  found = [b for b in _python_blocks() if MARKERS[name] in b]
  assert len(found) == 1, f"README: {len(found)} python blocks contain {MARKERS[name]!r}"
  return found[0]


def _run(name: str, namespace: dict) -> dict:
  """Executes the block in `namespace` (what it needs), which then also holds
  what it defined, even where it raised."""
  exec(compile(_block(name), f"README.md ({name})", "exec"), namespace)
  return namespace


def test_every_python_block_is_covered():
  blocks = _python_blocks()
  assert blocks, "README.md has no ```python block: the pattern no longer matches"
  uncovered = [b for b in blocks if not any(m in b for m in MARKERS.values())]
  assert not uncovered, f"README python blocks with no test in {__file__}: {uncovered}"
  for name in MARKERS:
    _block(name)  # each marker names exactly one block


def test_quickstart():
  # As a user runs it: float32 arrays by default (the tests enable float64).
  with jax.enable_x64(False):
    ns = _run("quickstart", {})  # its own `assert` checks the canonical round trip
  lstm, params, x, y, h, c = (ns[k] for k in ("lstm", "params", "x", "y", "h", "c"))
  # The shapes its comments give.
  assert params.shape == (lstm.params_size(),)
  assert y.shape == (50, 32, 512) and h.shape == (4, 32, 256) and c.shape == h.shape
  shape = lambda a: str(list(a.shape))
  assert f"y: {shape(y)}; h, c: {shape(h)}" in _block("quickstart")
  zeros = jnp.zeros((4, 32, 256), x.dtype)
  want = _reference.rnn(lstm, x, zeros, zeros, params)
  for got, ref in zip((y, h, c), want):
    assert relative_error(got, ref) < 1e-5
  # The gradient against autodiff of the plain reference scan.
  ref_loss = lambda p: jnp.sum(_reference.rnn(lstm, x, zeros, zeros, p)[0] ** 2)
  want_grads = jax.jit(jax.grad(ref_loss))(params)
  assert ns["grads"].shape == params.shape
  assert relative_error(ns["grads"], want_grads) < 1e-4
  assert float(jnp.max(jnp.abs(ns["grads"]))) > 0


def test_tf1_checkpoint_reading():
  spec = jcr.CudnnLSTM(2, 5, 3, direction="bidirectional")
  params = spec.init_params(jax.random.key(1))
  saved = interop.to_tf1_checkpoint(spec, params, scope="cudnn_lstm")
  opened = []

  def load_checkpoint(path):
    opened.append(path)
    return types.SimpleNamespace(get_tensor=lambda name: saved[name])

  tf = types.SimpleNamespace(train=types.SimpleNamespace(load_checkpoint=load_checkpoint))
  ns = _run("tf1", dict(tf=tf, interop=interop, spec=spec))
  assert opened == ["model.ckpt"]
  assert sorted(ns["names"]) == sorted(saved)
  # TF1's cells keep one bias per gate, the sum of cuDNN's two: the weights
  # come back exactly, and the model computes the same.
  for got, want in zip(spec.params_to_canonical(ns["params"])[0], spec.params_to_canonical(params)[0]):
    np.testing.assert_array_equal(got, want)
  x = jax.random.normal(jax.random.key(2), (4, 2, 3), jnp.float32)
  for got, want in zip(spec(x, None, None, ns["params"], is_training=False),
                       spec(x, None, None, params, is_training=False)):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_export_for_cpu_and_cuda(sizes):
  """The block's export for CUDA is lowered with the handler model's sizes
  (conftest's `sizes`); on a CPU its cuDNN calls are not run, on a GPU they are."""
  pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers")
  from jax import export
  spec = jcr.CudnnGRU(2, 6, 3)
  params = spec.init_params(jax.random.key(2))
  x = jax.random.normal(jax.random.key(3), (7, 2, 3), jnp.float32)
  f = lambda x, params: spec(x, None, params, is_training=False)[0]
  ns = dict(export=export, jax=jax, jcr=jcr, f=f, x=x, params=params)
  # Without the native library, the serving process's `register_ffi_targets`
  # says so and the block stops there, before its last line, run below.
  stops = (pytest.raises(RuntimeError, match="native library") if _cudnn._load()[0] is None
           else contextlib.nullcontext())
  with stops:
    _run("export", ns)
  got = export.deserialize(ns["blob"]).call(x, params)  # its last line, on this device
  assert _cudnn.in_compiled(ns["exported"].mlir_module())
  want = spec(x, None, params, is_training=False, implementation="xla")[0]
  assert relative_error(got, want) < CROSS_TOL  # on a GPU, cuDNN's against XLA's


@pytest.mark.parametrize("cls", [jcr.CudnnGRU, jcr.CudnnRNNTanh])
def test_decoding_with_flax_cells(cls):
  pytest.importorskip("flax")
  spec = cls(2, 8, 5)
  params = spec.init_params(jax.random.key(4))
  h0 = jax.random.normal(jax.random.key(5), (2, 3, 8), jnp.float32)
  x_t = jax.random.normal(jax.random.key(6), (3, 5), jnp.float32)
  ns = _run("decode", dict(interop=interop, jax=jax, spec=spec, params=params, h0=h0, x_t=x_t))
  y, h = spec(x_t[None], h0, params, is_training=False)
  # The block steps layer 0; layer 1 "then" takes its output.
  # The Flax cells are XLA's; `spec` is cuDNN's on a GPU.
  np.testing.assert_allclose(ns["h1"], h[0], rtol=CROSS_TOL, atol=CROSS_TOL)
  h2, out = ns["step"](ns["layers"][1][0], h0[1], ns["out"])
  np.testing.assert_allclose(h2, h[1], rtol=CROSS_TOL, atol=CROSS_TOL)
  np.testing.assert_allclose(out, y[0], rtol=CROSS_TOL, atol=CROSS_TOL)
