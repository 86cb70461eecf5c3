"""Every converter into the opaque buffer, given its input with one leaf
replaced by a value that holds no real numbers (complex, an object array, PRNG
keys, a ragged list): a `TypeError` naming that leaf. Before, a complex leaf
lost its imaginary part and an object array of None became NaN, silently, and
the others raised numpy's or JAX's errors naming nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import checkpoint, interop

SPEC = jcr.CudnnLSTM(2, 3, 2, direction="bidirectional", dtype=jnp.float32)

# name: (to the format, from it)
CONVERTERS = {
    "canonical lists": (lambda s, p: list(s.params_to_canonical(p)),
                        lambda s, wb: s.canonical_to_params(*wb)),
    "canonical tree": (checkpoint.to_canonical_tree, checkpoint.from_canonical_tree),
    "torch": (interop.to_torch_state_dict, interop.from_torch_state_dict),
    "flax linen cells": (interop.to_flax_linen_cells, interop.from_flax_linen_cells),
    "flax nnx cells": (lambda s, p: [[_nnx_pure_dict(c) for c in row]
                                     for row in interop.to_flax_nnx_cells(s, p)],
                       interop.from_flax_nnx_cells),
    "keras": (interop.to_keras_weights, interop.from_keras_weights),
    "tf1": (interop.to_tf1_checkpoint, interop.from_tf1_checkpoint),
    "jax.experimental.rnn": (interop.to_jax_experimental_rnn, interop.from_jax_experimental_rnn),
}


def _nnx_pure_dict(cell):
  from flax import nnx
  return nnx.to_pure_dict(nnx.state(cell, nnx.Param))


def _odd(shape):
  size = int(np.prod(shape))
  # Said alike by every converter, whichever conversion (jnp's, numpy's) would have failed.
  real = "must have a float, integer or bool dtype, got "
  yield "complex", np.full(shape, 1j, np.complex64), real + "complex64$"
  yield "object array", np.full(shape, None), real + "object$"
  yield "PRNG keys", jax.random.split(jax.random.key(0), size).reshape(shape), real + "key<fry>$"
  yield "ragged list", [[0.0], [0.0, 1.0]], "must be an array or a nested list of real numbers"


def _leaves(tree):
  """(path, leaf) of every array leaf, the path as indices and keys."""
  return jax.tree_util.tree_flatten_with_path(tree)[0]


def _replaced(tree, path, value):
  if not path:
    return value
  key = path[0].key if hasattr(path[0], "key") else path[0].idx
  copy = dict(tree) if isinstance(tree, dict) else list(tree)
  copy[key] = _replaced(tree[key], path[1:], value)
  return copy


KERAS_PARTS = ("kernel", "recurrent_kernel", "bias")


def _name(converter, path) -> str:
  """What an error must name: the leaf's own key or index (Keras's by role)."""
  if not path:
    return "weights"  # jax.experimental.rnn's one buffer
  last = path[-1]
  if hasattr(last, "key"):
    return str(last.key)
  return KERAS_PARTS[last.idx] if converter == "keras" else f"[{last.idx}]"


@pytest.mark.parametrize("converter", CONVERTERS)
def test_a_leaf_of_no_real_numbers_is_an_error_naming_it(converter):
  to, from_ = CONVERTERS[converter]
  params = SPEC.init_params(jax.random.key(0))
  good = to(SPEC, params)
  # The format round-trips (the buffer may not: some formats sum the two biases).
  for (_, want), (_, got) in zip(_leaves(good), _leaves(to(SPEC, from_(SPEC, good)))):
    np.testing.assert_array_equal(got, want)
  leaves = _leaves(good)
  for path, leaf in (leaves[0], leaves[-1]):
    for what, value, message in _odd(np.shape(leaf)):
      if converter == "flax nnx cells" and what == "ragged list":
        continue  # a list in a pytree is a subtree: its leaves are numbers, its shape wrong
      with pytest.raises(TypeError, match=message) as raised:
        from_(SPEC, _replaced(good, path, value))
      assert _name(converter, path) in str(raised.value).split("\n")[0], (what, path, raised.value)


def test_integer_and_bool_leaves_are_cast_as_before():
  params = jnp.arange(SPEC.params_size(), dtype=jnp.float32) % 3
  weights, biases = SPEC.params_to_canonical(params)
  as_ints = [np.asarray(w, np.int32) for w in weights]
  np.testing.assert_array_equal(SPEC.canonical_to_params(as_ints, biases), params)
  ones = [np.ones(np.shape(b), np.bool_) for b in biases]
  assert (SPEC.params_to_canonical(SPEC.canonical_to_params(weights, ones))[1][0] == 1).all()
