"""Converters under `jit`, `grad` and `vmap`: the `from_*` ones trace and
differentiate; the `to_*` ones, and a `skip_input` spec's reading, refuse a
trace with a `TypeError` saying why.

Each converter's foreign format comes from its `to_*` function (tested against
the other libraries in test_interop*.py); here the traced `from_*` must give
what the eager one gives, and its gradient must be the eager map's adjoint:
`<grad, t> == <from(t), v>` for the functional `p -> <p, v>` and any tree `t`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import interop


def _nnx_pure(spec, params):
  from flax import nnx
  return [[nnx.to_pure_dict(nnx.state(cell, nnx.Param)) for cell in layer]
          for layer in interop.to_flax_nnx_cells(spec, params)]


def _tf1(spec, params):
  return interop.to_tf1_checkpoint(spec, params, scope="cudnn")


# name: (the foreign format of params, the converter back)
CONVERTERS = {
    "torch": (interop.to_torch_state_dict, interop.from_torch_state_dict),
    "flax_linen": (interop.to_flax_linen_cells, interop.from_flax_linen_cells),
    "flax_nnx": (_nnx_pure, interop.from_flax_nnx_cells),
    "keras": (interop.to_keras_weights, interop.from_keras_weights),
    "tf1": (_tf1, lambda spec, t: interop.from_tf1_checkpoint(spec, t, scope="cudnn")),
    "jax_experimental_rnn": (interop.to_jax_experimental_rnn,
                             interop.from_jax_experimental_rnn),
}
SPECS = [jcr.CudnnLSTM(2, 3, 4, direction="bidirectional", dtype=jnp.float64),
         jcr.CudnnGRU(2, 3, 4, dtype=jnp.float64),
         jcr.CudnnRNNRelu(1, 3, 2, direction="bidirectional", dtype=jnp.float64)]
CASES = [(name, spec) for name in CONVERTERS for spec in SPECS
         if name != "jax_experimental_rnn" or spec.rnn_mode == "lstm"]


def _params(spec, seed):
  """Random params every converter can express (nnx.GRUCell has no
  recurrent n-gate bias: those are zero)."""
  params = spec.init_params(jax.random.key(seed))
  weights, biases = spec.params_to_canonical(params)
  g = spec.num_gates
  biases = [b if spec.rnn_mode != "gru" or i % (2 * g) != 2 * g - 1 else jnp.zeros_like(b)
            for i, b in enumerate(biases)]
  return spec.canonical_to_params(weights, biases)


def _foreign(name, spec, seed):
  """Params of seed `seed` in converter `name`'s format, as jax arrays."""
  return jax.tree.map(jnp.asarray, CONVERTERS[name][0](spec, _params(spec, seed)))


@pytest.mark.parametrize("name,spec", CASES)
def test_from_converters_under_jit_give_the_eager_values(name, spec):
  convert = CONVERTERS[name][1]
  tree = _foreign(name, spec, 0)
  eager = convert(spec, tree)
  np.testing.assert_array_equal(jax.jit(lambda t: convert(spec, t))(tree), eager)
  assert jnp.abs(eager).max() > 0


@pytest.mark.parametrize("name,spec", CASES)
def test_from_converters_gradient_is_the_adjoint_of_the_conversion(name, spec):
  convert = CONVERTERS[name][1]
  v = jax.random.normal(jax.random.key(7), (spec.params_size(),), jnp.float64)
  grad = jax.grad(lambda t: jnp.vdot(convert(spec, t), v))(_foreign(name, spec, 0))
  for seed in (1, 2):
    t = _foreign(name, spec, seed)
    inner = sum(jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(t)))
    np.testing.assert_allclose(inner, jnp.vdot(convert(spec, t), v), rtol=1e-12)


@pytest.mark.parametrize("name,spec", CASES[::2])
def test_from_converters_under_vmap_give_each_trees_values(name, spec):
  convert = CONVERTERS[name][1]
  trees = [_foreign(name, spec, seed) for seed in range(3)]
  stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)
  np.testing.assert_array_equal(jax.vmap(lambda t: convert(spec, t))(stacked),
                                jnp.stack([convert(spec, t) for t in trees]))


def test_from_flax_nnx_cells_takes_modules_under_nnx_jit():
  from flax import nnx
  spec = SPECS[0]
  params = _params(spec, 0)
  cells = interop.to_flax_nnx_cells(spec, params)
  np.testing.assert_array_equal(
      nnx.jit(lambda cells: interop.from_flax_nnx_cells(spec, cells))(cells),
      interop.from_flax_nnx_cells(spec, cells))


@pytest.mark.parametrize("name", [n for n in CONVERTERS if n != "jax_experimental_rnn"])
def test_to_converters_refuse_a_traced_params_naming_themselves(name):
  to, _ = CONVERTERS[name]
  spec = SPECS[0]
  function = {"flax_nnx": "to_flax_nnx_cells", "tf1": "to_tf1_checkpoint"}.get(name, to.__name__)
  with pytest.raises(TypeError, match=rf"^{function} returns values, not a computation, so params "
                                      r"must be a concrete array, got a traced float64\[480\]"):
    jax.jit(lambda p: to(spec, p))(_params(spec, 0))


def test_to_jax_experimental_rnn_refuses_a_traced_params_in_either_layout():
  for mode in ("linear_input", "skip_input"):  # the first returns the buffer as it is
    spec = jcr.CudnnLSTM(1, 3, 3, input_mode=mode, dtype=jnp.float64)
    with pytest.raises(TypeError, match=r"^to_jax_experimental_rnn returns values"):
      jax.grad(lambda p: interop.to_jax_experimental_rnn(spec, p).sum())(_params(spec, 0))


@pytest.mark.parametrize("name", CONVERTERS)
def test_a_skip_input_spec_refuses_traced_weights_it_cannot_check(name):
  spec = jcr.CudnnLSTM(1, 3, 3, input_mode="skip_input", dtype=jnp.float64)
  to, convert = CONVERTERS[name]
  tree = _foreign(name, spec, 0)
  for a, b in zip(jax.tree.leaves(to(spec, convert(spec, tree))), jax.tree.leaves(tree)):
    np.testing.assert_array_equal(a, b)  # eagerly it reads
  with pytest.raises(TypeError, match=r"uses skip_input, so layer 0's input matrices must be "
                                      r"identities, which needs their values, but they are traced"):
    jax.jit(lambda t: convert(spec, t))(tree)
