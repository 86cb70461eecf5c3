"""A single one-step call that multiplies the whole opaque buffer at once.

DESIGN §4 has no module for this: it is one rule of the "xla" path's forward
(`_xla._layer`), kept here beside its measurements, as `_lanes` and `_chunks`
keep theirs.

A one-step call (T = 1: decoding, one jitted call per token) multiplies each
weight matrix once. Read from the opaque buffer, a matrix is a slice, and
XLA:CPU copies a slice that a product reads: for a GRU I256 H256 two 768 KiB
copies, memory-bound, which took longer than the products (traced, B8: the
copies 54 + 113 us, the products 98 + 65; benchmarks/NOTES.md, session 74).
Viewed as `[N/k, k]`, the whole buffer is a bitcast, not a copy, where every
block starts on a row: `k` divides every layer's input size and `H`, as then
every block's size does. So the call multiplies the whole view by the layer's
input and states cut into `k`-wide pieces, side by side (`P @ [x; h]^T`), and
takes each matrix's product out of the small result: its rows, and of those
the columns of the pieces it meets. That multiplies every row by every piece
(for one layer of I = H = k, twice the products' arithmetic, and every other
layer's rows besides), which a small batch does not notice where the copies
dominate.

Where it gained, and where it did not. In a loop that closes over its weights
(a decoder's `lax.scan` of one-step calls) XLA hoists the slices' copies out
of the loop, and the whole buffer multiplied every step lost (session 51: GRU
B32 I256 H256 146.8 -> 204.6 us a token, LSTM B8 I64 H128 15.0 -> 30.1); a
call that sees such a loop (`_xla.weights_from_enclosing_trace`) keeps the
slices. A single jitted call, on the 2-core Xeon with AMX, float32, each
pair interleaved in one process, us, the slices -> the whole buffer (Flax's
cells; benchmarks/NOTES.md, session 75):
- one layer, I = H = 256 (pieces of 256): GRU B1 (two layers) 559 -> 424
  (306), B4 609 -> 337 (221), B8 570 -> 278 (239), B16 710 -> 424 (454), B32
  857 -> 688 (582);
  LSTM B1 (two layers) 813 -> 644 (820), B8 796 -> 319 (880), B16 945 -> 548
  and 843 -> 524, B24 815 -> 725, but B32 970 -> 1083, 1122 -> 1184 and 923 ->
  1104; tanh B8 587 -> 277, relu B32 645 -> 395; bidirectional GRU B8 899 ->
  500, LSTM B8 1997 -> 997;
- larger: GRU I512 H512 B8 1969 -> 913 (939), LSTM 3510 -> 1199 (4022);
  LSTM I1024 H1024 B4 23373 -> 3191 (its 32 MiB of slices fault in afresh
  on every call);
- more layers and directions went by `extra_products` (in brackets), in a
  process that lost time to other guests: LSTM two layers B8 1658 -> 1595
  (24); GRU three layers B16 1848 -> 2194 (80), two B32 2103 -> 2208 (96),
  bidirectional B32 3684 -> 4353 (64); LSTM three bidirectional layers B4
  9636 -> 12849 (44). The bounds forgo some gains: LSTM two layers B16 2867
  -> 2139 (48), GRU four layers B8 5619 -> 4146 (56), LSTM I1024 H1024 B32
  30979 -> 13641 (32);
- pieces of 128, in two processes: LSTM I128 H128
  B1 316 -> 234 and 219 -> 181, B8 927 -> 540 and 479 -> 330, B16 470 -> 390
  and 289 -> 226; LSTM I128 H256 B8 497 -> 339 and 412 -> 326, B12 860 -> 612
  and 605 -> 481; GRU I128 H256 B8 1186 -> 1283 and 427 -> 321 (in two
  earlier processes 497 -> 357, 708 -> 359), B16 621 -> 547 and 543 -> 531;
  GRU I256 H128 B4 248 -> 217 and 220 -> 182. But smaller matrices lost,
  whose slices copy quickly: GRU I128 H128 B8 169 -> 198 and 102 -> 159 (one
  direction's matrices 96 Ki elements; session 74, 158 -> 184), B1 189 ->
  250; tanh I128 H256 B8 166 -> 210 and 137 -> 175 (96 Ki), I256 H128 229 ->
  470 (48 Ki); and at B32 (`extra_products` 64) LSTM I128 H256 919 -> 1131
  (session 51: 264 -> 389, the GRU 223 -> 258). Pieces of 64 went both ways
  (LSTM I64 H128 B8 857 -> 470, B1 158 -> 175; GRU I64 H512 B8 1431 -> 2384).
Hence `MIN_PIECE`, `MIN_ELEMENTS` and `MAX_EXTRA_PRODUCTS` (an LSTM's lower:
its B32 at I = H = 256 lost).
Measured for float32 models on a CPU only: other dtypes, and other backends,
keep the slices.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_cudnn_rnn import _layout, _reference, _spec

MIN_PIECE = 128
MIN_ELEMENTS = 128 * 1024
MAX_EXTRA_PRODUCTS = {"lstm": 24, "gru": 32, "rnn_tanh": 32, "rnn_relu": 32}


class Plan(NamedTuple):
  """Where one layer's matrices lie in the buffer viewed as `[rows, piece]`.

  `inputs`: the layer's input size (None under skip_input: no input matrix);
  `w_rows[d]`, `r_rows[d]`: the first row of direction `d`'s input and
  recurrent matrices (None for the input one under skip_input)."""
  piece: int
  rows: int
  inputs: int | None
  hidden: int
  w_rows: tuple
  r_rows: tuple


def plan(spec, layer: int, x: jax.Array, looped: bool) -> Plan | None:
  """The plan of `layer`'s one-step call over the whole buffer, or None where
  it multiplies sliced matrices (`_xla._forward`): a call not in a loop that
  closes over its weights (`looped`), one step (`x [T, B, in]`, time-major,
  in the computation dtype), a float32 model, every layer's input size and `H`
  multiples of a piece of at least `MIN_PIECE`, at least `MIN_ELEMENTS` in
  a direction's matrices of the layer (`matrix_elements`), and at most
  `MAX_EXTRA_PRODUCTS` multiplications more than the layer's own products
  need for each weight they no longer copy (`extra_products`), on a CPU."""
  steps, batch = x.shape[:2]
  if looped or not all(isinstance(n, (int, np.integer)) for n in (steps, batch)):
    return None
  if steps != 1 or np.dtype(x.dtype) != np.float32:
    return None
  if np.dtype(spec.dtype) != np.float32 or jax.default_backend() != "cpu":
    return None
  piece = math.gcd(spec.num_units, *(spec.layer_input_size(l) for l in range(spec.num_layers)))
  if (piece < MIN_PIECE or matrix_elements(spec, layer) < MIN_ELEMENTS
      or extra_products(spec, layer, batch, piece) > MAX_EXTRA_PRODUCTS[spec.rnn_mode]):
    return None
  weights, _ = _layout.tensors(spec)
  first = {(t.direction, t.index // spec.num_gates): t.offset // piece
           for t in weights if t.layer == layer and t.index % spec.num_gates == 0}
  dirs = range(spec.num_dirs)
  has_w = spec.layer_has_input_weights(layer)
  return Plan(piece, _layout.params_size(spec) // piece,
              spec.layer_input_size(layer) if has_w else None, spec.num_units,
              tuple(first[d, 0] if has_w else None for d in dirs),
              tuple(first[d, 1] for d in dirs))


def matrix_elements(spec, layer: int) -> int:
  """The elements of one direction's weight matrices of `layer`."""
  inputs = spec.layer_input_size(layer) if spec.layer_has_input_weights(layer) else 0
  return spec.num_gates * spec.num_units * (inputs + spec.num_units)


def extra_products(spec, layer: int, batch: int, piece: int) -> float:
  """The multiplications the whole buffer's product makes beyond those of
  `layer`'s own products, per element of the layer's matrices (what the
  slices would copy): every element of the buffer's matrices times every
  piece of every sequence, less the layer's own elements times the sequences
  (the biases' few rows aside). One layer of one direction with I = H =
  `piece`: the batch."""
  D, H = spec.num_dirs, spec.num_units
  inputs = spec.layer_input_size(layer) if spec.layer_has_input_weights(layer) else 0
  own = D * matrix_elements(spec, layer)
  pieces = (inputs + D * H) // piece
  matrices = sum(t.size for t in _layout.tensors(spec)[0])
  return batch * (matrices * pieces / own - 1)


def forward(mode, plan: Plan, xs, valid, h0, c0, bW, bR, buffer):
  """One step of every direction of a layer, as `_xla._forward` without
  coefficients returns it, `(ys, hT, cT)`, its products taken from one
  product of the whole `buffer` (flat, in the computation dtype). Arguments
  as `_reference.forward_scan`'s, but `xs[0]` alone is read: at one step
  every direction's input is the same, but where a sequence is empty, whose
  outputs the mask drops."""
  k, g, H = plan.piece, _spec.NUM_GATES[mode], plan.hidden
  x = xs[0][0]
  B = x.shape[0]
  x_pieces = [] if plan.inputs is None else [x[:, p * k:(p + 1) * k]
                                             for p in range(plan.inputs // k)]
  h_pieces = [h[:, q * k:(q + 1) * k] for h in h0 for q in range(H // k)]
  stacked = jnp.concatenate(x_pieces + h_pieces, 0)  # [pieces * B, k]
  view = buffer.reshape(plan.rows, k)
  product = jax.lax.dot_general(view, stacked, (((1,), (1,)), ((), ())))
  # The small product transposed after a barrier, as `_xla._opaque_matmul`'s:
  # else XLA may rewrite the pair into a product against the transposed view.
  product = jax.lax.optimization_barrier(product)

  def matrix(row, width, first_piece):
    """`[B, g*H]`: the matrix at `row`, of `width` columns, times its pieces."""
    m = width // k
    block = product[row:row + g * H * m].reshape(g * H, m, -1)
    parts = [block[:, p, (first_piece + p) * B:(first_piece + p + 1) * B] for p in range(m)]
    return sum(parts[1:], parts[0]).T

  in_bias = _reference.input_bias(mode, bW, bR)
  valid_t = None if valid is None else valid[0]
  ys, hT, cT = [], [], []
  for d in range(len(h0)):
    if plan.inputs is None:
      xp = _reference.project(x, None, g)
    else:
      xp = matrix(plan.w_rows[d], plan.inputs, 0)
    xp = xp + _reference.lift(in_bias[d], 2)
    rec = matrix(plan.r_rows[d], H, len(x_pieces) + d * (H // k))
    if mode == "gru":
      rec = rec + _reference.lift(bR[d], 2)
    c_prev = None if c0 is None else c0[d]
    h, c = _reference._cell(mode, xp, rec, h0[d], c_prev)
    h, c, out = _reference.mask(valid_t, h, c, h0[d], c_prev)
    ys.append(out[None])
    hT.append(h)
    cT.append(c)
  return tuple(ys), tuple(hT), None if c0 is None else tuple(cT)

