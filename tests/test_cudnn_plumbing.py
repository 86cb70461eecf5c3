"""`_cudnn`'s Python side on any machine, with the native handlers replaced by
a pure-JAX model of their contract (`handler_model.py`).

What this proves: given handlers that do what cuDNN's calls are documented to
do, the "cudnn" implementation returns the reference's values and gradients
through its `custom_vjp` (reserve space as the residual, updated by backward
data and read by backward weights), its per-layer calls with dropout masks
between them, its zero-length fix-up, both layouts and `vmap`. What it cannot
prove: that the C++ handlers and cuDNN do that; `test_cudnn.py` checks those
on a GPU.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn
from handler_model import HandlerModel
from helpers import SPEC_CLASSES, call, random_inputs


@pytest.fixture
def handlers(monkeypatch):
  model = HandlerModel()
  monkeypatch.setattr(jax.ffi, "ffi_call", model.ffi_call)
  monkeypatch.setattr(_cudnn, "query_sizes", model.query_sizes)
  monkeypatch.setattr(_cudnn, "cudnn_order", lambda spec: None)  # the analytic layout
  monkeypatch.setattr(_cudnn, "availability", lambda: (True, ""))
  return model


def _inputs(spec, T, B, time_major):
  x, h, c = random_inputs(spec, T, B, seed=3)
  if not time_major:
    x = np.swapaxes(x, 0, 1)
  params = spec.init_params(jax.random.key(4))
  return jnp.asarray(x), jnp.asarray(h), None if c is None else jnp.asarray(c), params


def _values_and_grads(spec, impl, x, h, c, params, **options):
  def loss(x, h, c, p):
    y, hn, cn = call(spec, x, h, c, p, implementation=impl, **options)
    total = jnp.sum(jnp.sin(y)) + jnp.sum(hn ** 2)
    if cn is not None:
      total += jnp.sum(jnp.cos(cn))
    return total, (y, hn, cn)

  argnums = (0, 1, 2, 3) if spec.has_cell_state else (0, 1, 3)
  grads, outs = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(x, h, c, params)
  return [o for o in outs if o is not None] + list(grads)


def _assert_same(spec, x, h, c, params, **options):
  got = _values_and_grads(spec, "cudnn", x, h, c, params, **options)
  want = _values_and_grads(spec, "xla", x, h, c, params, **options)
  names = ["y", "h", "c"][:2 + spec.has_cell_state] + (
      ["dx", "dh", "dc", "dparams"] if spec.has_cell_state else ["dx", "dh", "dparams"])
  for name, a, b in zip(names, got, want):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize("cls,direction,input_mode,time_major", [
    (cls, d, m, tm) for (cls, d, m), tm in zip(
        itertools.product(SPEC_CLASSES, ("unidirectional", "bidirectional"),
                          ("linear_input", "skip_input")), itertools.cycle((True, False)))])
def test_fused_call_matches_reference(handlers, cls, direction, input_mode, time_major):
  spec = cls(2, 4, 4 if input_mode == "skip_input" else 3, input_mode=input_mode,
             direction=direction, dtype=jnp.float64)
  _assert_same(spec, *_inputs(spec, 5, 3, time_major), time_major=time_major)
  # One fused call for all layers, each way.
  assert handlers.calls == {"jcr_rnn_forward_training": 1, "jcr_rnn_backward_data": 1,
                            "jcr_rnn_backward_weights": 1}


@pytest.mark.parametrize("cls", SPEC_CLASSES)
@pytest.mark.parametrize("time_major", [True, False])
def test_seq_lengths_with_empty_sequences(handlers, cls, time_major):
  spec = cls(2, 4, 3, direction="bidirectional", dtype=jnp.float64)
  lengths = jnp.array([5, 2, 0, 1], jnp.int32)
  _assert_same(spec, *_inputs(spec, 5, 4, time_major), time_major=time_major,
               seq_lengths=lengths)


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnRNNRelu])
def test_dropout_runs_layer_by_layer_with_the_reference_masks(handlers, cls):
  spec = cls(3, 4, 3, dropout=0.4, direction="bidirectional", dtype=jnp.float64)
  _assert_same(spec, *_inputs(spec, 4, 2, True), dropout_key=jax.random.key(7),
               seq_lengths=jnp.array([4, 3], jnp.int32))
  assert handlers.calls == {"jcr_rnn_forward_training": 3, "jcr_rnn_backward_data": 3,
                            "jcr_rnn_backward_weights": 3}


def test_inference_uses_the_inference_call(handlers):
  spec = jcr.CudnnLSTM(2, 4, 3, dtype=jnp.float64)
  x, h, c, params = _inputs(spec, 5, 2, True)
  got = jax.jit(lambda *a: spec(*a, is_training=False, implementation="cudnn"))(x, h, c, params)
  want = spec(x, h, c, params, is_training=False, implementation="xla")
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-12)
  assert handlers.calls == {"jcr_rnn_forward_inference": 1}


def test_vmap_of_gradients(handlers):
  spec = jcr.CudnnGRU(1, 4, 3, dtype=jnp.float64)
  x, h, _, params = _inputs(spec, 5, 2, True)
  xs = jnp.stack([x, 2 * x, -x])

  def grad(impl):
    loss = lambda x, p: jnp.sum(jnp.tanh(spec(x, h, p, implementation=impl)[0]))
    return jax.jit(jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None)))(xs, params)

  for a, b in zip(grad("cudnn"), grad("xla")):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
