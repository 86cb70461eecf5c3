"""The pure-JAX RNN against Flax linen cells run over the sequence with converted weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import flax.linen as nn

import jax_cudnn_rnn as jcr
from helpers import call, random_inputs


def _flax_cell_and_params(spec, weights, biases):
  """A Flax cell and its params for one (layer, direction), from canonical tensors."""
  W, R, bW, bR = weights[:len(weights) // 2], weights[len(weights) // 2:], biases[:len(biases) // 2], biases[len(biases) // 2:]
  H = spec.num_units
  if spec.rnn_mode == "lstm":
    p = {f"i{k}": {"kernel": W[j].T} for j, k in enumerate("ifgo")}
    p |= {f"h{k}": {"kernel": R[j].T, "bias": bW[j] + bR[j]} for j, k in enumerate("ifgo")}
    return nn.LSTMCell(H, param_dtype=spec.dtype, dtype=spec.dtype), p
  if spec.rnn_mode == "gru":
    p = {"ir": {"kernel": W[0].T, "bias": bW[0] + bR[0]}, "iz": {"kernel": W[1].T, "bias": bW[1] + bR[1]},
         "in": {"kernel": W[2].T, "bias": bW[2]}, "hr": {"kernel": R[0].T},
         "hz": {"kernel": R[1].T}, "hn": {"kernel": R[2].T, "bias": bR[2]}}
    return nn.GRUCell(H, param_dtype=spec.dtype, dtype=spec.dtype), p
  act = jnp.tanh if spec.rnn_mode == "rnn_tanh" else jax.nn.relu
  p = {"i": {"kernel": W[0].T, "bias": bW[0] + bR[0]}, "h": {"kernel": R[0].T}}
  return nn.SimpleCell(H, activation_fn=act, param_dtype=spec.dtype, dtype=spec.dtype), p


def flax_stack(spec, params, x, h0, c0, seq_lengths=None):
  """Runs the model as stacked `flax.linen.RNN`s (batch major), one per layer and direction."""
  weights, biases = spec.params_to_canonical(params)
  g, D = spec.num_gates, spec.num_dirs
  wi = bi = 0
  hs, cs = [], []
  for layer in range(spec.num_layers):
    outs = []
    for d in range(D):
      nw = 2 * g
      w = list(weights[wi:wi + nw])
      wi += nw
      b = list(biases[bi:bi + 2 * g])
      bi += 2 * g
      cell, p = _flax_cell_and_params(spec, w, b)
      s = layer * D + d
      carry = (c0[s], h0[s]) if spec.has_cell_state else h0[s]
      rnn = nn.RNN(cell, return_carry=True, reverse=d == 1, keep_order=True)
      carry, y = rnn.apply({"params": {"cell": p}}, x, initial_carry=carry, seq_lengths=seq_lengths)
      outs.append(y)
      if spec.has_cell_state:
        cs.append(carry[0])
        hs.append(carry[1])
      else:
        hs.append(carry)
    x = jnp.concatenate(outs, axis=-1)
  return x, jnp.stack(hs), (jnp.stack(cs) if cs else None)


@pytest.mark.parametrize("cls", [jcr.CudnnLSTM, jcr.CudnnGRU, jcr.CudnnRNNTanh, jcr.CudnnRNNRelu])
@pytest.mark.parametrize("direction", ["unidirectional", "bidirectional"])
def test_matches_flax_cells(cls, direction):
  spec = cls(2, 5, 3, direction=direction, dtype=jnp.float64)
  params = spec.init_params(jax.random.key(7))
  x, h, c = random_inputs(spec, 6, 3)
  lengths = np.array([6, 4, 1])
  xb = np.swapaxes(x, 0, 1)
  for seq_lengths in (None, lengths):
    ref_y, ref_h, ref_c = flax_stack(spec, params, xb, h, c, seq_lengths)
    y, hn, cn = call(spec, xb, h, c, params, is_training=False, time_major=False,
                     seq_lengths=seq_lengths, implementation="xla")
    if seq_lengths is None:
      np.testing.assert_allclose(y, ref_y, rtol=1e-10, atol=1e-12)
    else:  # Flax leaves the padding unspecified; ours is zero.
      for b, n in enumerate(lengths):
        np.testing.assert_allclose(y[b, :n], ref_y[b, :n], rtol=1e-10, atol=1e-12)
        np.testing.assert_array_equal(y[b, n:], 0.0)
    np.testing.assert_allclose(hn, ref_h, rtol=1e-10, atol=1e-12)
    if spec.has_cell_state:
      np.testing.assert_allclose(cn, ref_c, rtol=1e-10, atol=1e-12)
