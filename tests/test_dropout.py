"""Inter-layer dropout: the documented masks, inverted scaling, and inference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from helpers import random_inputs


@pytest.mark.parametrize("time_major", [True, False])
def test_dropout_equals_layers_composed_with_documented_masks(time_major):
  rate = 0.4
  spec = jcr.CudnnLSTM(3, 4, 3, direction="bidirectional", dropout=rate, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, c = random_inputs(spec, 5, 2)
  if not time_major:
    x = np.swapaxes(x, 0, 1)
  key = jax.random.key(42)
  y, hn, cn = spec(x, h, c, params, is_training=True, dropout_key=key, time_major=time_major)

  # Rebuild by hand: one single-layer LSTM per layer, canonical tensors split per layer.
  weights, biases = spec.params_to_canonical(params)
  layer_in = x
  per_layer_w = 16  # 2 directions * 8 matrices
  for layer in range(3):
    single = jcr.CudnnLSTM(1, 4, layer_in.shape[-1], direction="bidirectional", dtype=jnp.float64)
    p = single.canonical_to_params(weights[layer * per_layer_w:(layer + 1) * per_layer_w],
                                   biases[layer * per_layer_w:(layer + 1) * per_layer_w])
    s = slice(2 * layer, 2 * layer + 2)
    out, hl, cl = single(layer_in, h[s], c[s], p, is_training=True, time_major=time_major)
    np.testing.assert_allclose(hn[s], hl, rtol=1e-12)
    np.testing.assert_allclose(cn[s], cl, rtol=1e-12)
    if layer < 2:
      keep = jax.random.bernoulli(jax.random.fold_in(key, layer), np.float32(1 - rate),
                                  out.shape)
      out = np.where(keep, out / (1 - rate), 0.0)
    layer_in = out
  np.testing.assert_allclose(y, layer_in, rtol=1e-12)


def test_masks_do_not_depend_on_x64():
  """A key draws the same masks with `jax_enable_x64` on (as in these tests)
  and off, and a float32 model's outputs under dropout are the same."""
  key = jax.random.key(3)
  with jax.enable_x64(False):
    without = np.asarray(jcr.dropout_keep_mask(key, 1, (7, 5, 6), 0.3))
    spec = jcr.CudnnRNNTanh(2, 6, 4, dropout=0.3)
    x, h, _ = random_inputs(spec, 7, 5)
    params = spec.init_params(jax.random.key(0))
    y_without = np.asarray(spec(x, h, params, dropout_key=key, implementation="xla")[0])
  with jax.enable_x64(True):
    np.testing.assert_array_equal(jcr.dropout_keep_mask(key, 1, (7, 5, 6), 0.3), without)
    y_with = spec(x, h, params, dropout_key=key, implementation="xla")[0]
  assert 0.5 < without.mean() < 0.9
  np.testing.assert_array_equal(y_with, y_without)


def test_dropout_rate_and_scaling_statistics():
  rate = 0.3
  keep = jcr.dropout_keep_mask(jax.random.key(1), 0, (200, 50, 16), rate)
  assert abs(1 - float(keep.mean()) - rate) < 0.01


def test_no_dropout_when_not_training_or_last_layer_only():
  spec = jcr.CudnnGRU(2, 4, 3, dropout=0.5, dtype=jnp.float64)
  nodrop = jcr.CudnnGRU(2, 4, 3, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, _ = random_inputs(spec, 5, 2)
  np.testing.assert_array_equal(spec(x, h, params, is_training=False)[0], nodrop(x, h, params)[0])
  one_layer = jcr.CudnnGRU(1, 4, 3, dropout=0.5, dtype=jnp.float64)
  p1 = one_layer.init_params(jax.random.key(0))
  # A single layer has no inter-layer output to drop: no key needed, no change.
  np.testing.assert_array_equal(one_layer(x, h[:1], p1, is_training=True)[0],
                                one_layer(x, h[:1], p1, is_training=False)[0])


def test_keys_change_masks_and_grads_flow():
  spec = jcr.CudnnRNNTanh(2, 8, 3, dropout=0.5, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(0))
  x, h, _ = random_inputs(spec, 5, 2)
  y1, _ = spec(x, h, params, dropout_key=jax.random.key(1))
  y2, _ = spec(x, h, params, dropout_key=jax.random.key(2))
  y1b, _ = spec(x, h, params, dropout_key=jax.random.key(1))
  assert not np.allclose(y1, y2)
  np.testing.assert_array_equal(y1, y1b)
  legacy = spec(x, h, params, dropout_key=jax.random.PRNGKey(1))[0]
  assert legacy.shape == y1.shape
  g = jax.grad(lambda p: jnp.sum(spec(x, h, p, dropout_key=jax.random.key(1))[0]))(params)
  assert np.all(np.isfinite(g)) and np.any(g != 0)


@pytest.mark.parametrize("args,exc,message", [
    (dict(dropout_key=3), TypeError, r"^dropout_key must be a PRNG key"),
    (dict(rate=1.5), ValueError, r"^rate must be in \[0, 1\), got 1.5$"),  # was all dropped
    (dict(rate=-0.5), ValueError, r"^rate must be in \[0, 1\), got -0.5$"),  # was all kept
    (dict(rate="0.5"), TypeError, r"^rate must be a float in \[0, 1\), got '0.5'$"),
    (dict(layer=0.5), TypeError, r"^layer must be an int in \[0, 2\*\*32\)"),  # was layer 0's mask
    (dict(layer=-1), ValueError, r"^layer must be an int in \[0, 2\*\*32\) .*got -1$"),
    (dict(shape=7), TypeError, r"^shape must be a tuple of ints, got 7$"),
    (dict(shape=(7, -5, 6)), ValueError, r"^shape must have no negative dimension, got \(7, -5, 6\)$"),
])
def test_keep_mask_checks_its_arguments(args, exc, message):
  good = dict(dropout_key=jax.random.key(3), layer=1, shape=(7, 5, 6), rate=0.3)
  with pytest.raises(exc, match=message):
    jcr.dropout_keep_mask(**(good | args))


def test_keep_mask_is_the_documented_formula_under_jit_and_any_int_shape():
  key = jax.random.key(11)
  want = jax.random.bernoulli(jax.random.fold_in(key, 2), np.float32(1 - 0.4), (7, 5, 6))
  np.testing.assert_array_equal(jcr.dropout_keep_mask(key, np.int64(2), (np.int64(7), 5, 6), 0.4),
                                want)
  traced = jax.jit(lambda k: jcr.dropout_keep_mask(k, 2, [7, 5, 6], np.float32(0.4)))(key)
  np.testing.assert_array_equal(traced, want)
  assert 0.5 < float(want.mean()) < 0.7


def test_raw_keys_of_the_default_prng_are_taken_as_jax_random_takes_them():
  """Under `jax_default_prng_impl="rbg"` (common on accelerators)
  `jax.random.PRNGKey` gives a uint32[4]: `init_params`, a dropout call and
  the Flax modules take it, as `jax.random` does, and draw what the typed key
  of its data draws; a uint32[2] is then no key, as it is not to JAX."""
  from flax import nnx
  from jax_cudnn_rnn import linen, nnx as jcr_nnx
  spec = jcr.CudnnGRU(2, 4, 3, dropout=0.5)
  x, h, _ = random_inputs(spec, 5, 2)
  with jax.default_prng_impl("rbg"):
    raw = jax.random.PRNGKey(3)
    assert raw.shape == (4,) and raw.dtype == jnp.uint32
    typed = jax.random.wrap_key_data(raw, impl="rbg")
    params = spec.init_params(raw)
    np.testing.assert_array_equal(params, spec.init_params(typed))
    y = spec(x, h, params, dropout_key=raw)[0]
    np.testing.assert_array_equal(y, spec(x, h, params, dropout_key=typed)[0])
    assert not np.allclose(y, spec(x, h, params, is_training=False)[0])  # something dropped
    module = linen.GRU(4, num_layers=2, dropout_rate=0.5)
    variables = module.init(raw, x, deterministic=True)
    np.testing.assert_array_equal(
        module.apply(variables, x, deterministic=False, rngs={"dropout": raw}),
        module.apply(variables, x, deterministic=False, rngs={"dropout": typed}))
    model = jcr_nnx.GRU(3, 4, num_layers=2, dropout_rate=0.5, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(model(x, rngs=raw), model(x, rngs=typed))
    with pytest.raises(TypeError, match=r"^dropout_key must be a PRNG key \(jax.random.key\("
                                        r"seed\), or a raw uint32\[4\] of the default PRNG, rbg\), "
                                        r"got an array of dtype uint32 and shape \(2,\)$"):
      spec(x, h, params, dropout_key=np.zeros(2, np.uint32))
