"""Spec construction: validation, auto_select, properties, hashability."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from helpers import SPEC_CLASSES


@pytest.mark.parametrize("cls,mode,gates", [
    (jcr.CudnnLSTM, "lstm", 4), (jcr.CudnnGRU, "gru", 3),
    (jcr.CudnnRNNTanh, "rnn_tanh", 1), (jcr.CudnnRNNRelu, "rnn_relu", 1)])
def test_properties(cls, mode, gates):
  spec = cls(num_layers=3, num_units=7, input_size=5, direction="bidirectional",
             dtype=jnp.bfloat16, dropout=0.25, seed=4)
  assert (spec.num_layers, spec.num_units, spec.input_size) == (3, 7, 5)
  assert spec.input_mode == "linear_input" and spec.direction == "bidirectional"
  assert spec.dtype == np.dtype(jnp.bfloat16) and spec.dropout == 0.25 and spec.seed == 4
  assert spec.rnn_mode == mode and spec.num_gates == gates
  assert spec.num_dirs == 2 and spec.output_size == 14
  assert spec.has_cell_state == (mode == "lstm")


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_auto_select_resolves_at_construction(cls):
  assert cls(1, 4, 4, input_mode="auto_select").input_mode == "skip_input"
  assert cls(1, 4, 3, input_mode="auto_select").input_mode == "linear_input"


def test_specs_are_hashable_static_args():
  a, b = jcr.CudnnLSTM(2, 4, 3), jcr.CudnnLSTM(2, 4, 3)
  assert a == b and hash(a) == hash(b)
  assert a != jcr.CudnnGRU(2, 4, 3)
  assert jcr.CudnnLSTM(1, 4, 4, input_mode="auto_select") == jcr.CudnnLSTM(1, 4, 4, input_mode="skip_input")
  f = jax.jit(lambda s, p: s.params_to_canonical(p)[0][0].sum(), static_argnums=0)
  p = a.init_params(jax.random.key(0))
  np.testing.assert_allclose(f(a, p), a.params_to_canonical(p)[0][0].sum())
  with pytest.raises(dataclasses_frozen_error()):
    a.num_units = 5


@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_specs_are_static_as_ordinary_jit_arguments(cls):
  spec = cls(1, 4, 3, dtype=jnp.float32)
  other = cls(1, 5, 3, dtype=jnp.float32)
  assert jax.tree_util.tree_leaves(spec) == []
  state = {"spec": spec, "params": spec.init_params(jax.random.key(0))}
  assert len(jax.tree_util.tree_leaves(state)) == 1
  assert jax.tree.map(lambda a: a + 1, state)["spec"] is spec
  traces = []

  @jax.jit
  def outputs(s, p, x):
    traces.append(s)
    return s(x, *([None] * (1 + s.has_cell_state)), p, is_training=False)[0]

  x = jax.random.normal(jax.random.key(1), (6, 2, 3), jnp.float32)
  for s in (spec, cls(1, 4, 3, dtype=jnp.float32), other):
    p = s.init_params(jax.random.key(2))
    np.testing.assert_allclose(outputs(s, p, x), s(x, *([None] * (1 + s.has_cell_state)), p,
                                                    is_training=False)[0], rtol=1e-6, atol=1e-7)
  assert traces == [spec, other]  # an equal spec hits the cache; a different one retraces
  grads = jax.grad(lambda st: outputs(st["spec"], st["params"], x).sum())(state)
  assert grads["spec"] is spec and grads["params"].shape == state["params"].shape


def dataclasses_frozen_error():
  import dataclasses
  return dataclasses.FrozenInstanceError


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_units=-1), ValueError, "num_units"),
    (dict(input_size=0), ValueError, "input_size"),
    (dict(num_layers=1.5), TypeError, "num_layers"),
    (dict(num_units=True), TypeError, "num_units"),
    (dict(input_mode="linear"), ValueError, "input_mode"),
    (dict(input_mode="skip_input"), ValueError, "input_size == num_units"),
    (dict(direction="both"), ValueError, "direction"),
    (dict(dropout=1.0), ValueError, "dropout"),
    (dict(dropout=-0.1), ValueError, "dropout"),
    (dict(dropout="0.5"), TypeError, "dropout"),
    (dict(dtype=jnp.int32), TypeError, "dtype"),
    (dict(dtype="not-a-dtype"), TypeError, "dtype"),
    # numpy reads None as float64; JAX's None is its default float: neither is assumed
    (dict(dtype=None), TypeError, r"^dtype must be one of \['float16', 'bfloat16', 'float32', "
                                  r"'float64'\], got None$"),
    (dict(seed=1.0), TypeError, "seed"),
])
@pytest.mark.parametrize("cls", SPEC_CLASSES)
def test_invalid_configs_raise(cls, kwargs, exc, words):
  args = dict(num_layers=1, num_units=4, input_size=3) | kwargs
  with pytest.raises(exc, match=words):
    cls(**args)


def test_base_class_is_abstract():
  with pytest.raises(TypeError, match="abstract"):
    jcr.CudnnRNNBase(1, 2, 3)
