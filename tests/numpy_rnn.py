"""An independent RNN in plain numpy, written from the equations of DESIGN §3.

One sequence and one step at a time, one gate at a time, walking the canonical
weight and bias lists in their documented order. Slow and obvious on purpose:
it shares no code with the library.
"""

import numpy as np

GATES = {"lstm": 4, "gru": 3, "rnn_tanh": 1, "rnn_relu": 1}


def sigmoid(v):
  return 1.0 / (1.0 + np.exp(-v))


def _step(mode, W, R, bW, bR, x, h, c, operand):
  xo, ho = operand(x), operand(h)
  pre = lambda k: W[k] @ xo + bW[k] + R[k] @ ho + bR[k]
  if mode == "lstm":
    i, f, g, o = sigmoid(pre(0)), sigmoid(pre(1)), np.tanh(pre(2)), sigmoid(pre(3))
    c = f * c + i * g
    return o * np.tanh(c), c
  if mode == "gru":
    r, z = sigmoid(pre(0)), sigmoid(pre(1))
    n = np.tanh(W[2] @ xo + bW[2] + r * (R[2] @ ho + bR[2]))
    return (1 - z) * n + z * h, c
  act = np.tanh if mode == "rnn_tanh" else (lambda v: np.maximum(v, 0))
  return act(pre(0)), c


def numpy_rnn(mode, num_layers, bidirectional, skip_input, weights, biases, x, h0,
              c0=None, seq_lengths=None, operand=lambda v: v):
  """Runs the RNN; `x [T, B, in]` time major. Returns `(y, h, c)` (c None unless LSTM).

  `operand(v)` is what the input and the state become where they multiply a
  weight matrix (under skip_input too, where that matrix is the identity):
  by default themselves; a rounding models low-precision matmul operands.
  """
  g = GATES[mode]
  D = 2 if bidirectional else 1
  T, B, _ = x.shape
  H = h0.shape[-1]
  lengths = [T] * B if seq_lengths is None else list(seq_lengths)
  weights, biases = iter(weights), iter(biases)
  h_out = np.zeros_like(h0)
  c_out = None if c0 is None else np.zeros_like(c0)
  layer_in = np.asarray(x, np.float64)
  for layer in range(num_layers):
    y = np.zeros((T, B, D * H))
    for d in range(D):
      if layer == 0 and skip_input:
        W = [np.eye(H)] * g
      else:
        W = [next(weights) for _ in range(g)]
      R = [next(weights) for _ in range(g)]
      bW = [next(biases) for _ in range(g)]
      bR = [next(biases) for _ in range(g)]
      s = layer * D + d
      for b in range(B):
        h = np.array(h0[s, b], np.float64)
        c = None if c0 is None else np.array(c0[s, b], np.float64)
        steps = range(lengths[b]) if d == 0 else reversed(range(lengths[b]))
        for t in steps:
          h, c = _step(mode, W, R, bW, bR, layer_in[t, b], h, c, operand)
          y[t, b, d * H:(d + 1) * H] = h
        h_out[s, b] = h
        if c0 is not None:
          c_out[s, b] = c
    layer_in = y
  return layer_in, h_out, c_out
