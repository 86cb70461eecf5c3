"""The "xla" backend: the reference's recurrence with a hand-derived tangent.

DESIGN §4 has `_reference.py` serve as both the ground truth and the "xla"
backend. This file departs from that for speed, and keeps the reference as the
plain, obviously-correct scan that the tests hold this one against.

Differentiating the reference's `lax.scan` makes XLA keep every step's
intermediate values and accumulate the weight gradients inside the reverse
loop, one small matmul per step. Here each layer is a `jax.custom_jvp`:
- the primal is the reference's forward scan;
- the JVP rule runs the same scan and has it also emit, per step, the
  derivative coefficients of the cell (the gate derivatives already multiplied
  together, e.g. for LSTM `i(1-i)g, f(1-f)c_{t-1}, (1-g^2)i, o(1-o)tanh c`);
- the tangent is then a *linear* recurrence, `u_t = (A_t + dh_{t-1} R) * K_t`,
  whose input term `A_t = dx_t W + x_t dW + h_{t-1} dR + db` is computed for
  all steps at once, outside the loop, as matmuls over `[T, B, .]` (kept
  three-dimensional: reshaping to `[T*B, .]` would merge a sharded batch axis
  away, which explicit sharding refuses; see tests/sharded_cases.py). LSTM
  and GRU add those terms already multiplied by `K_t` to `dc_t`, `dh_t`
  instead (`_layer_jvp`).
Reverse mode is JAX transposing that linear tangent: the loop carries only
`dh, dc` and does one matmul per step (`du_t R^T`), and the weight gradients
become single large matmuls (`x^T du`, `h_{t-1}^T du`) after it, the way cuDNN
and PyTorch arrange their backward pass. Forward mode (`jax.jvp`, `jacfwd`),
higher orders, `vmap` and `jax.checkpoint` keep working, since all of this is
ordinary JAX.

Measured on XLA:CPU, 2 cores, LSTM forward+backward (see benchmarks/NOTES.md):
B16 T50 H128: 17 -> 11-12 ms; B64 T100 H256: 235 -> 210-215 ms (PyTorch: 180-190).

The forward recurrence projects its inputs a chunk of steps at a time
(`_chunked_scan`): a scan over chunks of 4 to 16 steps (`_chunks`), each
making one `[chunk, B, in] x [in, g*H]` matmul and then running its steps
unrolled. The reference projects step by step, one `[B, in]` matmul each, and
at small batch those run far below XLA:CPU's matmul peak; projecting all steps
at once before the loop was slower still (`_reference`'s docstring). Forward,
LSTM, interleaved A/B against step-by-step (benchmarks/NOTES.md, session 14):
B16 T256 I128 H256 52.7 -> 47.6 ms, B32 T100 I256 H256 56.8 -> 44.2 ms, the
same with 2 bidirectional layers 240 -> 182 ms, B64 T100 I128 55.0 -> 53.4 ms.
How long the chunks are, and where the forward runs step by step instead,
is `_chunks`'s rule, with its measurements.

A bfloat16 model's forward multiplies bfloat16 operands, accumulating in
float32 (`operand_dtype`): its weights (exact: they are stored in bfloat16),
and its layer inputs and states rounded to bfloat16 where they meet a weight
matrix; everything element-wise stays float32 (the operands cuDNN's
bfloat16 matmuls on tensor cores take, too). The reference multiplies in
float32 instead, which XLA:CPU ran at about 150 GFLOP/s on a 2-core
AVX-512/AMX machine, against about 1000 for bfloat16 operands (a
[2048, 128] x [128, 1024] product, 6.1 vs 0.95 ms). Interleaved A/Bs there,
forward / forward+backward (ms): LSTM B16 T256 I128 H256 33 -> 18 / 109 -> 91;
GRU same shape 25 -> 15 / 93 -> 82; LSTM B32 T100 I256 H256, 2 bidirectional
layers, 133 -> 57 / 475 -> 398 (benchmarks/NOTES.md, session 15). The
tangent's matmuls, and so the backward pass's (their transposes), multiply
bfloat16 operands too, the cotangents rounded where they meet a weight
matrix or a layer's inputs: they are `_rounded_dot`s, a primitive whose
transposes round their operands (JAX's own transpose of a bfloat16 matmul
with a float32 result multiplies the float32 cotangent as it is, and XLA then
multiplies in float32). Forward+backward, interleaved A/Bs (ms): LSTM B16
T256 I128 H256 94 -> 69, GRU same shape 66 -> 49, LSTM B32 T100 I256 H256,
2 bidirectional layers, 344 -> 234 (session 16). On a CPU whose bfloat16
products are slower than its float32 ones, the rounded operands are
multiplied in float32, the same products (`_rounded_dot.float32_products`),
in a layer of 32 steps or more (`WIDEN_MIN_STEPS`; session 69), and in a
one-step call on a batch over small enough weights, which a decoder's loop
widens once (`WIDEN_ONE_STEP_MAX_WEIGHTS`; session 70). float16 operands were
no faster on that machine than float32 ones, so float16 models multiply in
float32.

On a single CPU device, a unidirectional layer's forward alone cuts its batch
into two lanes that run as directions of their own, side by side, where XLA:CPU
splitting each small per-step product over its threads gained little
(`_lanes.forward_lanes`; LSTM B16 T256 I128 H256 float32 28.2 -> 23.1 ms, GRU
20.6 -> 14.0; benchmarks/NOTES.md, session 41). Below 8 sequences an LSTM's or GRU's
with a large recurrent matrix runs in two lanes by hidden unit instead, each
multiplying the whole state by half of every gate's columns (LSTM B4 T128 I128
H320 4.4 -> 2.7 ms, GRU H384 B2 4.1 -> 2.4; session 48), and so does an
LSTM's up to 16 sequences (B16 T256 I128 H256 12.7-14.1 -> 10.6-11.1 ms in five
runs; session 49). A bfloat16 LSTM's or GRU's forward alone runs in lanes by
unit at any batch from 2, on a CPU whose bfloat16 products are AVX512-BF16
dot products or AMX tiles (`_cpu`; on the Zen 5, LSTM B16 T256 I128 H256
10.5-11.4 -> 7.8-8.2 ms, GRU B64 T32 3.7 -> 2.6; session 50; on the AMX Xeon,
20.0 -> 14.7 and 5.5 -> 4.2; session 60).

With `seq_lengths`, an LSTM's forward alone carries its cell state unmasked
and the state at each sequence's last valid step beside it, where the masked
state made XLA:CPU repeat a chunk's earlier steps in each later step's kernel
(`_carries_last_cells`; LSTM B16 T256 I128 H256 29.7 -> 23.0 ms, session 67).

How the forward reads the weights. `_reference._layer_params` takes them from
the opaque buffer's blocks (`_reference.param_blocks`) and transposes them
(`W [in, g*H]`, `R [H, g*H]`), which XLA:CPU does at about 1 ns an element (an
LSTM I256 H256's two matrices, 2 MiB: about 0.35 ms a call). For one step
(T = 1: decoding) or one sequence (B = 1: matrix-vector products), `_forward`
multiplies by the opaque blocks as they lie instead
(`_reads_opaque_orientation`, `_opaque_matmul`): a one-step LSTM call B1 I256
H256 took 0.52 -> 0.27 ms. Either way the prepared weights and biases go
through an `optimization_barrier`, so that XLA hoists their slicing (and
transposes) out of a loop around the call, a decoder's `lax.scan` of one-step
calls: without it, XLA sliced (copied) them out of the buffer on every trip,
for a slice is not worth hoisting on its own (a decoder of 16 one-step calls,
LSTM B8 I256 H256: 3.69 -> 1.82 ms, Flax's cell 2.39; B1: 7.27 -> 0.87 ms,
Flax's 1.17). A one-step call on a batch of more than one is a compromise: in
a loop, the per-step products against the opaque blocks can be slower than
against transposed ones (LSTM B8 I64 H128, 16 steps: 0.68 ms; transposed and
hoisted, 0.61 ms), but transposing makes a single call about twice as slow
(LSTM B8 I256 H256: 0.34 ms opaque, 0.85 ms transposed; 0.43 ms before), and a
single call from Python per token is the other common way to decode; so
one-step calls keep the opaque blocks, faster than before in both patterns but
for the smallest models' single call (GRU B1 I64 H128: 25 -> 57 us); all
figures from one process, interleaved (benchmarks/NOTES.md, session 22).
But a one-step call that sees it runs in a loop closing over its weights
(`weights_from_enclosing_trace`: a decoder's `lax.scan`) multiplies by them
transposed where the recurrent matrix is small (`_transposes_in_loop`; LSTM
B8 I64 H128, 64 steps: 52.7 -> 40.8 us a token, Flax's cell 36.1; session 74),
and for middling hidden sizes as a product per gate, as Flax's cells do
(`_gate_blocks_in_loop`; GRU B8 I256 H256 117.6 -> 81.8; session 78); on
one sequence over middling matrices it multiplies each matrix where it lies
in the buffer instead (`_one_step.plan`; LSTM B1 I64 H128 12.8 -> 11.2 us a
token, Flax's cell 13.1; session 93).
And a float32 one-step call outside such a loop, over large enough matrices
and a small batch, slices nothing: it multiplies the whole buffer, viewed as
rows as wide as its input and as its states (`_one_step`'s rule; GRU B8 I256
H256 570 -> 278 us a call, Flax's cell 239; LSTM 796 -> 319, Flax's 880;
session 75); on one sequence, at any size, and on up to three over small
enough matrices, it multiplies each matrix where it lies in the buffer,
fused with its slice, in blocks of rows that XLA:CPU runs each on one thread
(GRU B1 I256 H256 two layers 371-413 -> 285-329 us, session 92, and in
blocks 224 -> 148, Flax's cells 159; B3 618 -> 363; session 93).
A step-by-step forward alone of an LSTM or a plain RNN, one direction, stacks
its two transposed matrices instead and multiplies `[x_t, h]` by them, one
product a step, the transposes one pass (`_stacks_weights`; LSTM B8 T32 I64
H128 1.07-1.16x faster, session 72), up to 2 MiB stacked, from jax 0.11 up to
1.5 MiB (an LSTM I = H = 256 B8 T20's forward stacked took 1.06-1.16x the two
products' time, session 95).

The per-step recurrence and the per-layer plumbing are the reference's
(`_reference.recurrent_step`, `_reference.forward_scan`,
`_reference._run_layer`), given this file's cells, which also return the
coefficients, and this file's `custom_jvp` recurrence.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero

from jax_cudnn_rnn import (_chunks, _cpu, _lanes, _one_step, _reference, _requirements,
                            _rounded_dot, _spec)


def _blocksum(u: jax.Array, blocks: int) -> jax.Array:
  """Sums the `blocks` equal parts of the last axis."""
  parts = jnp.split(u, blocks, axis=-1)
  return functools.reduce(jnp.add, parts)


# -- one step of each cell, with the coefficients of its tangent ----------------------
#
# `cell(xp, rec, h, c, coefficients)` returns `(h', c', res)`, where `res` is
# `()` unless `coefficients`, and otherwise the per-step coefficients that
# the tangent step reads. `xp` holds the input pre-activations with the input
# bias, `rec` the recurrent ones (with the recurrent bias for GRU only).


def _lstm_cell(xp, rec, h, c, coefficients):
  if coefficients:
    # With the coefficients, the four gates go through one element-wise tanh over
    # all 4H columns, sigmoid(x) = (1 + tanh(x/2)) / 2, whose derivative is then
    # (1 - tanh^2) / 4 (the g gate: tanh, and 1 - tanh^2). Each gate's value
    # feeds both the state and a coefficient, and XLA:CPU runs a value with
    # several consumers as a kernel of its own: computed gate by gate, a step
    # made about 15 small kernels, now 10. Interleaved A/Bs, float32, ms, the
    # training forward (`jax.vjp`) and forward+backward: B16 T256 I128 H256
    # 33.5 -> 30.0 and 97.9 -> 92.6; B64 T32 13.7 -> 11.9 and 33.4 -> 32.2;
    # B32 T100 I256 H256, 2 bidirectional layers, 116 -> 120 and 365 -> 364;
    # bfloat16 B16 T256 26.8 -> 22.8 and 68.8 -> 67.5 (benchmarks/NOTES.md,
    # session 29). Its values differ from the plain forward's by rounding
    # (float32: 1.5e-7 at most there).
    scale = _reference.lift(_lstm_gate_scale(c.shape[-1], xp.dtype), xp.ndim)
    t = jnp.tanh((xp + rec) * scale)
    i, f, g, o = jnp.split(t * scale + (1 - scale), 4, axis=-1)
  else:
    i, f, g, o = _split_gates(xp + rec, 4)
    i, f, g, o = jax.nn.sigmoid(i), jax.nn.sigmoid(f), jnp.tanh(g), jax.nn.sigmoid(o)
  c_new = f * c + i * g
  tc = jnp.tanh(c_new)
  h_new = o * tc
  if not coefficients:
    return h_new, c_new, ()
  # dc' = di g + df c + i dg + f dc,  dh' = do tanh c' + o (1 - tanh^2 c') dc'
  K = (1 - t * t) * (scale * scale) * jnp.concatenate([g, c, i, tc], -1)
  return h_new, c_new, (K, f, o * (1 - tc * tc))


def _lstm_gate_scale(H: int, dtype) -> np.ndarray:
  """1/2 for the columns of the sigmoid gates (i, f, o), 1 for g's (tanh)."""
  return np.where(np.arange(4 * H) // H == 2, 1.0, 0.5).astype(dtype)


def _gru_cell(xp, rec, h, c, coefficients):
  x_r, x_z, x_n = _split_gates(xp, 3)
  r_r, r_z, r_n = _split_gates(rec, 3)
  r = jax.nn.sigmoid(x_r + r_r)
  z = jax.nn.sigmoid(x_z + r_z)
  n = jnp.tanh(x_n + r * r_n)
  h_new = (1 - z) * n + z * h
  if not coefficients:
    return h_new, c, ()
  # dh' = (1-z) dn + (h-n) dz + z dh, with dn = (1-n^2)(dx_n + dr r_n + r dr_n),
  # dr = r(1-r)(dx_r + drec_r), dz = z(1-z)(dx_z + drec_z).
  # The input part is multiplied by K = [k_r, k_z, k_n], the recurrent part by
  # the same with k_n * r in the last block (formed where it is used, so that
  # only K, r and z are kept per step).
  k_n = (1 - n * n) * (1 - z)
  k_r = k_n * r * (1 - r) * r_n
  k_z = z * (1 - z) * (h - n)
  return h_new, c, (jnp.concatenate([k_r, k_z, k_n], -1), r, z)


def _tanh_cell(xp, rec, h, c, coefficients):
  h_new = jnp.tanh(xp + rec)
  return h_new, c, ((1 - h_new * h_new,) if coefficients else ())


def _relu_cell(xp, rec, h, c, coefficients):
  pre = xp + rec
  h_new = jax.nn.relu(pre)
  return h_new, c, (((pre > 0).astype(pre.dtype),) if coefficients else ())


_CELLS = {"lstm": _lstm_cell, "gru": _gru_cell, "rnn_tanh": _tanh_cell, "rnn_relu": _relu_cell}


# -- the forward recurrence, a chunk of steps at a time ---------------------------------


def _chunked_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR, matmul, chunk, joined=False,
                  last_cells=False):
  """`_reference.forward_scan`, with the input projection made for `chunk`
  steps at once: a scan over chunks, each projecting its `[chunk, B, in]`
  inputs in one matmul and then running its steps unrolled. Same arguments
  and results; `chunk` divides the number of steps."""
  T, g = xs[0].shape[0], _spec.NUM_GATES[mode]
  in_bias = _reference.input_bias(mode, bW, bR)

  def chunk_step(carry, inputs):
    x_c, valid_c = inputs
    xps = _reference.project_inputs(x_c, W, in_bias, g, matmul)
    steps = []
    for k in range(chunk):
      hs, cs, outs, res = _reference.recurrent_step(
          mode, cell, R, bR, *carry, [xp[k] for xp in xps], jax.tree.map(lambda v: v[k], valid_c),
          matmul, joined, last_cells)
      carry = (hs, cs)
      steps.append((outs, res))
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *steps)

  split = lambda a: a.reshape((T // chunk, chunk) + a.shape[1:])
  carry0 = (tuple(h0), None if c0 is None else tuple(c0))
  (hT, cT), (ys, res) = jax.lax.scan(
      chunk_step, carry0, (tuple(split(x) for x in xs), jax.tree.map(split, valid)))
  merge = lambda a: a.reshape((T,) + a.shape[2:])
  return jax.tree.map(merge, ys), hT, cT, jax.tree.map(merge, res)


def operand_dtype(dtype) -> np.dtype | None:
  """The dtype the forward's matmul operands take for a model of `dtype`:
  bfloat16 for bfloat16 models, None (the computation dtype) otherwise."""
  return np.dtype(jnp.bfloat16) if np.dtype(dtype) == jnp.bfloat16 else None


# A CPU whose bfloat16 products are slow multiplies the rounded operands in
# float32 (`_rounded_dot.float32_products`), widening each weight matrix once
# a call: a pass over the weights, which a call of few steps does not earn
# back. bfloat16 products -> float32 products, LSTM I256 H256 B8, forward, ms,
# by steps: T1 0.58 / 0.60, T4 1.29 / 1.44, T16 3.2 / 3.5, T32 4.46 / 3.59, T64
# 8.87 / 6.20; a one-step call at H1024 5.4 / 13.3 (benchmarks/NOTES.md,
# session 69). So a layer of fewer steps keeps bfloat16 products, but for a
# one-step call on a batch (decoding), which multiplies by the opaque blocks as
# they lie (`_reads_opaque_orientation`): there widening is a plain pass, and
# in a decoder's `lax.scan` of one-step calls XLA hoists it out of the loop
# with the weights' slicing, once a loop. bfloat16 products -> float32
# products, us a token, a 64-step scan of one-step calls / one jitted call:
# LSTM B8 I256 H256 287 -> 200 / 796 -> 863, 254 -> 152 / 753 -> 716; B2 179 ->
# 104 / 751 -> 751; B32 559 -> 501 / 961 -> 903; B8 I128 H128 86 -> 45 / 330
# -> 299; B8 I512 H512 709 -> 504 / 1736 -> 1344, 982 -> 782 / 2031 -> 2140;
# B4 565 -> 308 / 1348 -> 1144; GRU B8 I512 H512 540 -> 399 / 1155 -> 1215.
# Not on one sequence (B1: matrix-vector products, as fast in bfloat16; LSTM
# I256 H256 loop 83 -> 90, 86 -> 92), nor past `WIDEN_ONE_STEP_MAX_WEIGHTS`
# elements of a direction's matrices (LSTM H512's): larger, a single call's
# widening outweighs its products (B8 I768 GRU 1833 -> 1991, B32 LSTM 4276 ->
# 5255; B8 I1024 LSTM 7221 -> 18585, its 32 MiB of float32 weights faulting
# in afresh on every call), though the loop still gains (1070 -> 633, 2964 ->
# 2159, 2978 -> 2010) (benchmarks/NOTES.md, session 70). So a call that sees
# a loop closing over its weights (`weights_from_enclosing_trace`) widens
# whatever their size (session 75).
WIDEN_MIN_STEPS = 32
WIDEN_ONE_STEP_MAX_WEIGHTS = 1 << 21


def _widens(xs, W, R, looped=False) -> bool:
  """Whether a layer over `xs [T, B, .]` whose directions' weight matrices
  are `W` (None for `skip_input`) and `R` lets `_rounded_dot` widen its
  operands: from `WIDEN_MIN_STEPS` steps, or in one step on more than one
  sequence, over at most `WIDEN_ONE_STEP_MAX_WEIGHTS` elements of a
  direction's matrices unless `looped` (`_forward`'s). A symbolic size counts
  as large: a symbolic length as long, a symbolic batch as more than one."""
  steps, batch = xs[0].shape[:2]
  if jax.export.is_symbolic_dim(steps) or steps >= WIDEN_MIN_STEPS:
    return True
  elements = R[0].size + (0 if W is None else W[0].size)
  return (steps == 1 and (jax.export.is_symbolic_dim(batch) or batch > 1)
          and (looped or elements <= WIDEN_ONE_STEP_MAX_WEIGHTS))


def _products(operands, widen):
  """`(dot_general, matmul, round_)` for a model whose matmul operands are
  `operands` (`operand_dtype`): JAX's own products where None, else
  `_rounded_dot`s rounding to `operands` (accumulating in, and returning,
  the first operand's dtype; `widen` as theirs), with `round_` casting a
  weight matrix once rather than in every step."""
  if operands is None:
    return jax.lax.dot_general, jnp.matmul, lambda w: w
  dot_general = lambda a, b, dims: _rounded_dot.rounded_dot(a, b, dims, operands=operands,
                                                            result=a.dtype, widen=widen)
  return (dot_general, functools.partial(_rounded_dot.matmul, operands=operands, widen=widen),
          lambda w: w.astype(operands))


def _reads_opaque_orientation(x: jax.Array) -> bool:
  """Whether the forward over `x [T, B, .]` multiplies by the weights in the
  opaque buffer's orientation rather than transposed: for one step (each
  matrix meets one product, cheaper than its transpose) or one sequence (the
  per-step products are matrix-vector ones, as fast either way). A symbolic
  size counts as more than one."""
  return any(not jax.export.is_symbolic_dim(n) and n == 1 for n in x.shape[:2])


# One step in a loop. In a decoder's `lax.scan` (or `fori_loop`, `while_loop`)
# of one-step calls that closes over the weights, XLA hoists their slicing and
# transposes out of the loop (the barrier in `_forward`), so that a step pays
# for the products alone; there products against transposed weights (batch-
# major, an LSTM's two matrices stacked: `_stacks_weights`) beat the opaque
# blocks' feature-major ones where the recurrent matrix is small, while a
# single call, which pays for the transposes, loses with them (session 70: by
# 20-94%). A call cannot see a loop around it, but it can see where its
# operands come from (`weights_from_enclosing_trace`). 2-core Xeon with AMX,
# jax 0.10.2, float32, a 64-step scan of one-step calls, us a token, opaque
# -> transposed (Flax's cells), interleaved in one process
# (benchmarks/NOTES.md, session 74): LSTM I64 H128 B8 52.7 -> 40.8 (36.1) and
# 45.6 -> 36.7 (32.7), B4 29.1 -> 21.4 (18.0); I128 H128 B16 97.3 -> 91.5
# (79.1); GRU I64 H128 B8 39.8 -> 29.2 (32.2) and 39.3 -> 30.8 (31.9). Larger
# matrices went both ways (GRU I128 H256 B16 180.8 -> 174.4, B32 277.9 ->
# 246.3, but GRU I256 H256 B8 146.3 -> 149.9; LSTM I128 H256 B32 381.5 ->
# 361.8, but LSTM I256 H256 B8 151.3 -> 178.4, 157.9 unstacked, 2 layers 315.6
# -> 374.1, I128 H512 B8 381.1 -> 476.5), and so did one sequence (LSTM I64
# H128 B1 12.9 -> 14.8, matrix-vector products): those keep the opaque blocks.
# Not measured for bfloat16 products (`operands`), which keep them too.
# Session 76 sorted the larger matrices by the input's width (with the step
# axis kept, `_forward`), opaque -> transposed (Flax's cells), one process
# each: at most 128 wide they gained, LSTM I128 H256 (R 1 MiB) B4 90.8 -> 72.0
# (75.4), B8 123.2 -> 116.3 (123.8), B16 179.5 -> 175.2 (169.6), B32 399.9 ->
# 361.6 (380.3), B64 639.7 -> 543.0 (565.6), I64 H256 B8 103.2 -> 91.6 (92.4);
# GRU I128 H256 B8 108.0 -> 112.1 (paired round by round 1.00x), B16 173.3 ->
# 142.2, B32 342.9 -> 320.0 and 326.9 -> 321.4; but not LSTM I128 H192 B8 91.0
# -> 90.8 (paired 1.02x). Wider, they lost: LSTM I256 H256 B8 159.1 -> 191.8
# (190.9), B32 445.4 -> 500.6; GRU I256 H256 B8 145.6 -> 157.2; LSTM I256 H512
# B32 1083.1 -> 1258.9, GRU 856.7 -> 916.4. Against transposed weights ours
# ran as Flax's cells did; the opaque blocks' products were the quicker
# where the input is as wide as the state (256), the slower at 64-128.
LOOP_TRANSPOSED_MAX_BYTES = 256 * 1024  # of a direction's R, included
LOOP_TRANSPOSED_NARROW_INPUT = 128  # an input at most this wide ...
LOOP_TRANSPOSED_NARROW_MAX_BYTES = 1 << 20  # ... transposes an R up to this, included


# Gate blocks in a loop. Past H128 a gate-stacked product `[B, in] x [in, g*H]`
# is one that YNNPACK splits over the two threads of a 2-core CPU, and in a
# decoder's loop its second thread sleeps between steps: traced (GRU B32 I128
# H256, 64-step loop), each of the step's two products posted work whose
# worker started 40-70 us later, the input's `[32, 128] x [128, 768]` taking
# 70-123 us where it takes 36 unsplit, while Flax's cells' six `[32, 256]`
# products ran unsplit on one thread. There a product per gate, `[B, in] x
# [in, H]` from weights cut into column blocks before the loop (hoisted with
# the transposes), gained (measured with the products joined, as below; kept
# apart since, `_GateProducts`); from H320 (the blocks split
# anyway) and at H160 and below (the stacked product not split) it lost, and
# so it did past 32 sequences and, for an LSTM, under an input wider than 128
# (whose opaque blocks' products were the quicker). 2-core Xeon with AMX, jax
# 0.10.2, float32, a 64-step scan of one-step calls, us a token, now -> gate
# blocks (Flax's cells), interleaved in one process, paired round by round in
# brackets (benchmarks/NOTES.md, session 78):
# - GRU I256 H256: B2 61.8 -> 35.1 (0.61x), B4 51.5 -> 50.8 (0.99x), B8 117.6
#   -> 81.8 (0.71x), 111.3 -> 81.7 (0.73x), B16 167.7 -> 141.9 (0.83x), B32
#   252.8 -> 248.3 (1.00x); GRU I128 H256: B4 34.9 -> 28.9 (0.84x), B16 121.6
#   -> 91.1 (0.75x), B24 182.1 -> 132.9 (0.73x), B32 234.7 -> 175.9 (0.74x),
#   B48 293.0 -> 259.4 (0.89x), B64 342.1 -> 429.3 (1.25x); GRU I64 H256 B8
#   50.8 -> 45.0 (0.88x); I128 H192 B8 39.4 -> 35.8 (0.91x), B16 79.2 -> 60.4
#   (0.76x), B32 133.9 -> 112.7 (0.85x); I256 H224 B8 83.1 -> 63.7 (0.77x);
#   but I256 H320 B8 118.5 -> 124.8 (1.05x), I512 H512 B8 334.0 -> 404.5
#   (1.23x), I128 H160 B8 25.8 -> 29.7 (1.13x), I64 H128 B16 24.4 -> 28.8
#   (1.18x), two layers I256 H256 B1 122.4 -> 130.8 (1.07x). Flax's cells ran
#   0.51-0.81x of "now" at H192-H256.
# - LSTM I128 H256: B4 48.0 -> 47.5 (0.98x), B8 82.1 -> 73.5 (0.96x), B16
#   178.8 -> 133.0 (0.74x), B24 206.8 -> 176.1 (0.84x), B32 263.6 -> 248.2
#   (0.93x), B48 320.6 -> 336.4 (1.06x); I64 H256 B8 66.4 -> 59.3 (0.91x);
#   I128 H192 B8 57.9 -> 45.3 (0.78x); I64 H192 B16 80.6 -> 65.9 (0.82x), B8
#   34.0 -> 34.7 (1.02x); but I256 H256 B4 57.0 -> 84.5 (1.46x), B8 118.5 ->
#   131.3 (1.13x), B16 180.3 -> 197.5 (1.10x), I256 H192 B8 65.0 -> 68.4
#   (1.06x), I512 H512 B8 358.9 -> 528.7 (1.48x), I64 H128 B8 19.8 -> 22.8
#   (1.15x). Two gates a block (`[in, 2H]`) gained less or lost (GRU r and z
#   together: B16 I128 H256 1.10x, LSTM B16 I128 H256 1.09x).
# On a quieter host than earlier sessions' (every contender about twice as
# fast as in session 77's grid), where this loop's GRU had run level with
# Flax's cells. Another CPU's thread count, and YNNPACK's own choices, may
# draw the window elsewhere.
# And on a 2-core AMD EPYC (Zen 4, family 25 model 17, 1 MiB of L2 a core)
# they did, now -> without gate blocks (Flax's cells), us a token, each line
# one process, interleaved (benchmarks/NOTES.md, session 86):
# - an LSTM's gate blocks lost at every batch: I128 H256 B4 50.8 -> 34.1
#   (38.9), B8 79.8 -> 58.8 (64.4) and 89.2 -> 70.3 (64.8), B16 149.2 -> 149.6
#   (154.0) and 150.3 -> 142.0 (148.2), B24 221.2 -> 192.6 (201.4), B32 303.2
#   -> 240.3 (245.0) and 316.2 -> 269.9 (266.0); I128 H192 B8 63.6 -> 60.3
#   (50.5), B16 98.5 -> 80.1 (74.5); I64 H256 B8 71.5 -> 58.7 (70.5). So an
#   AMD CPU's LSTM keeps the stacked or opaque products
#   (`GATE_BLOCKS_LSTM_EXCEPT_VENDORS`);
# - a GRU's gained up to 24 sequences (I256 H256 B8 83.7 -> 101.2, B16 159.0 ->
#   171.1, B24 235.4 -> 243.3; I128 H256 B16 121.6 -> 135.3; I128 H192 B16 80.2 -> 91.4) and
#   ran level at 32 under an input of 128 (238.0 -> 231.7, 254.9 -> 246.5,
#   236.9 -> 255.7), but lost at 32 under a wider one (I256 H256 336.3 ->
#   297.5 and 341.9 -> 289.2, Flax's 323.4 and 328.4), where the Xeon had run
#   level (252.8 -> 248.3): a wider input takes blocks up to
#   `GATE_BLOCKS_WIDE_INPUT_BATCH` sequences, on any CPU.
# And on a 2-core AMD EPYC Zen 3 (family 25 model 1, AVX2 without AVX-512,
# 512 KiB of L2 a core) a GRU's blocks lost too, with gate blocks (the same
# program timed twice, its spread) -> without (Flax's cells), us a token
# (benchmarks/NOTES.md, session 91):
# - under an input of 128 or less, at every batch: I128 H256 B2 66.6, 64.9 ->
#   56.9 (56.9), B4 87.8, 91.9 -> 75.9 (81.6), B8 157.7, 156.9 -> 133.1
#   (139.0), B16 246.2, 251.0 -> 194.0 (223.8) and 248.3, 250.5 -> 210.6
#   (236.1), B24 302.1, 312.5 -> 271.0 (291.2), B32 434.8, 416.4 -> 331.9
#   (406.3); I64 H256 B8 134.5, 136.1 -> 115.3 (125.6);
# - level elsewhere: I256 H256 B4 127.4, 127.6 -> 128.2, B8 213.0, 212.3 ->
#   211.2, B16 341.1, 352.1 -> 346.4, B24 438.8, 434.0 -> 429.0; I128 H192 B8
#   97.9, 102.7 -> 94.2, B16 145.8, 150.6 -> 152.8, B32 307.2, 301.3 -> 304.3;
#   I256 H192 B8 110.1, 126.7 -> 129.0.
# So gate blocks are taken only on a CPU with AVX-512 (`_cpu.avx512`; the
# Xeon and the Zen 4 have it), or whose flags are unknown (as measured
# first); which of the Zen 3's differences decides it was not taken apart.
GATE_BLOCKS_HIDDEN = (192, 256)  # the hidden sizes, included
GATE_BLOCKS_BATCH = (2, 32)  # the sequences, included
GATE_BLOCKS_WIDE_INPUT_BATCH = 24  # ... under an input wider than LOOP_TRANSPOSED_NARROW_INPUT
# The CPU vendors whose LSTM loops take gate blocks: all but AMD's, where they
# lost (a vendor not known keeps them, as measured first).
GATE_BLOCKS_LSTM_EXCEPT_VENDORS = ("AuthenticAMD",)


def _gate_blocks_in_loop(mode, operands, xs, R) -> bool:
  """Whether a one-step forward in a loop that closes over its weights
  multiplies by each gate's transposed columns apart (the comment above): an
  LSTM's or GRU's layer, the model's own float32 products (`operands` None),
  `GATE_BLOCKS_HIDDEN` units, `GATE_BLOCKS_BATCH` sequences (at most
  `GATE_BLOCKS_WIDE_INPUT_BATCH` under an input wider than
  `LOOP_TRANSPOSED_NARROW_INPUT`), for an LSTM an input at most that wide and
  a CPU not of `GATE_BLOCKS_LSTM_EXCEPT_VENDORS`, on a CPU with AVX-512 or
  whose flags are unknown (`_cpu.avx512`). `R`: the transposed recurrent
  matrices, `[H, g*H]`."""
  batch, hidden = xs[0].shape[1], R[0].shape[0]
  narrow = xs[0].shape[-1] <= LOOP_TRANSPOSED_NARROW_INPUT
  return (mode in ("lstm", "gru") and _float32_loop_on_cpu(operands, R, batch)
          and GATE_BLOCKS_BATCH[0] <= batch
          and batch <= (GATE_BLOCKS_BATCH[1] if narrow else GATE_BLOCKS_WIDE_INPUT_BATCH)
          and GATE_BLOCKS_HIDDEN[0] <= hidden <= GATE_BLOCKS_HIDDEN[1]
          and _cpu.avx512() is not False
          and (mode == "gru"
               or (narrow and _cpu.vendor() not in GATE_BLOCKS_LSTM_EXCEPT_VENDORS)))


def _gate_blocks(m: jax.Array, hidden: int) -> tuple:
  """`m [in, g*H]`'s column blocks of `hidden`, one a gate."""
  return tuple(m[:, k:k + hidden] for k in range(0, m.shape[1], hidden))


def _blocked_matmul(matmul):
  """A `matmul(a, blocks)` multiplying `a` by each of `_gate_blocks`' blocks
  with `matmul`: `a @ m` of the joined blocks, as `_GateProducts`."""
  return lambda a, blocks: _GateProducts(matmul(a, b) for b in blocks)


class _GateProducts(tuple):
  """Each gate's pre-activations apart, as `_blocked_matmul` makes them: a
  bias added (`_reference.project_inputs`, a GRU's `R_n h + bR_n`) or another
  such sum goes to each block, and the cells take the blocks as their gates
  (`_split_gates`), where an array is split. Joined (`jnp.concatenate`), the
  products were a copy a step which XLA did not fuse into the cell; apart,
  the loop body's kernels are those of Flax's cells, and its time a token,
  paired round by round against the joined products: GRU B32 I128 H256
  0.95x, B16 I128 H192 0.95x, B8 I256 H256 0.99x, B2 1.01x; LSTM B16 I128
  H256 0.97x, B4 0.95x, I128 H192 B8 0.96x (benchmarks/NOTES.md, session 78)."""

  def __add__(self, other):
    parts = other if isinstance(other, _GateProducts) else jnp.split(other, len(self), -1)
    return _GateProducts(a + b for a, b in zip(self, parts))

  @property
  def ndim(self) -> int:
    return self[0].ndim


def _split_gates(a, gates: int) -> tuple:
  """A cell's pre-activations gate by gate: `_GateProducts`' blocks, or an
  array's `gates` equal parts of its last axis."""
  return tuple(a) if isinstance(a, _GateProducts) else jnp.split(a, gates, axis=-1)


def weights_from_enclosing_trace(params, operands) -> bool:
  """Whether `params` is a tracer of a trace enclosing the call's own, where
  some of `operands` (the input and states; None for absent ones) are
  tracers of another: the call runs in a loop body (or a `cond` branch, a
  nested `jit`, `vmap` under `jit`) that closes over its weights. A
  decoder's `lax.scan` of one-step calls does; a jitted call given its
  weights as an argument, an eager call, or a loop carrying its weights does
  not. Read from the tracers' `_trace`, JAX's own attribute (not public API):
  a JAX that keeps it elsewhere answers False, and calls keep the single-call
  form, as before this rule."""
  outer = getattr(params, "_trace", None) if isinstance(params, jax.core.Tracer) else None
  if outer is None:
    return False
  return any(isinstance(a, jax.core.Tracer) and getattr(a, "_trace", outer) is not outer
             for a in operands if a is not None)


def _transposes_in_loop(operands, xs, R) -> bool:
  """Whether a one-step forward in a loop that closes over its weights
  multiplies by them transposed (the comment above): one step on more than
  one sequence, the model's own float32 products (`operands` None), a
  recurrent matrix of at most `LOOP_TRANSPOSED_MAX_BYTES`, or of at most
  `LOOP_TRANSPOSED_NARROW_MAX_BYTES` under an input at most
  `LOOP_TRANSPOSED_NARROW_INPUT` wide, on a CPU."""
  batch = xs[0].shape[1]  # asked where `_reads_opaque_orientation`: one step if batch > 1
  size = R[0].size * R[0].dtype.itemsize
  narrow = xs[0].shape[-1] <= LOOP_TRANSPOSED_NARROW_INPUT
  return (_float32_loop_on_cpu(operands, R, batch) and batch > 1
          and size <= (LOOP_TRANSPOSED_NARROW_MAX_BYTES if narrow else LOOP_TRANSPOSED_MAX_BYTES))


def _float32_loop_on_cpu(operands, R, batch) -> bool:
  """What the loop rules (`_transposes_in_loop`, `_gate_blocks_in_loop`)
  ask first: the model's own float32 products (`operands` None, `R` float32),
  a concrete batch, on a CPU, where they were measured."""
  return (operands is None and np.dtype(R[0].dtype) == np.float32
          and not jax.export.is_symbolic_dim(batch) and jax.default_backend() == "cpu")


def _opaque_matmul(operands, widen, a: jax.Array, w: jax.Array) -> jax.Array:
  """`a @ w^T` for `a [..., K]` and a weight block `w [N, K]` as the opaque
  buffer holds it, multiplied feature-major: `w @ a^T`, whose result (small:
  `[N, rows of a]`) is then transposed. Its result goes through a barrier,
  else XLA rewrites the pair as `a @ w^T`, which packs the transposed `w` on
  every call, up to 20% slower (benchmarks/NOTES.md, session 22). `operands` as
  `operand_dtype`; `widen` as `_products`'."""
  flat = a.reshape(-1, a.shape[-1])
  dims = (((1,), (1,)), ((), ()))
  if operands is None:
    product = jax.lax.dot_general(w, flat, dims)
  else:
    product = _rounded_dot.rounded_dot(w, flat, dims, operands=operands, result=a.dtype,
                                       widen=widen)
  return jax.lax.optimization_barrier(product).T.reshape(a.shape[:-1] + (w.shape[0],))


def _forward(mode, operands, xs, valid, h0, c0, W, R, bW, bR, coefficients, lanes=1,
             joined=False, looped=False):
  """The forward recurrence over this file's cells (`_reference.forward_scan`
  or, where the number of steps allows, `_chunked_scan`); `res` holds the
  coefficients stacked over time when `coefficients`, else empty tuples.
  `operands`: `operand_dtype` of the model; `lanes`: how many lanes of one
  direction `xs` holds (`_lanes.forward_lanes`), for the chunk length; `joined`:
  whether they are lanes by unit (`_reference.recurrent_step`); `looped`:
  whether the call runs in a loop that closes over its weights
  (`weights_from_enclosing_trace`)."""
  cell = functools.partial(_CELLS[mode], coefficients=coefficients)
  widen = _widens(xs, W, R, looped)
  _, matmul, round_ = _products(operands, widen)
  W = None if W is None else tuple(round_(w) for w in W)
  R = tuple(round_(r) for r in R)
  loop_step = looped and not coefficients  # a decoder's step: the forward alone, in a loop
  blocked = loop_step and _gate_blocks_in_loop(mode, operands, xs, R)
  transposed_in_loop = blocked or (loop_step and _transposes_in_loop(operands, xs, R))
  opaque = _reads_opaque_orientation(xs[0]) and not transposed_in_loop
  if opaque:
    # Back to the opaque buffer's `[g*H, .]` blocks (XLA cancels the two
    # transposes), multiplied as they lie.
    W = None if W is None else tuple(w.T for w in W)
    R = tuple(r.T for r in R)
    matmul = functools.partial(_opaque_matmul, operands, widen)
  if coefficients:
    chunk = _chunks.derivative_chunk(mode, xs, h0, R)
  else:
    chunk = _chunks.forward_chunk(mode, xs, W, R, lanes)
  stacked = (not coefficients and not blocked
             and _stacks_weights(mode, operands, xs, W, R, chunk, opaque))
  if stacked:
    R, W = tuple(jnp.concatenate([w, r]) for w, r in zip(W, R)), None
  if blocked:
    hidden = R[0].shape[0]
    W = None if W is None else tuple(_gate_blocks(w, hidden) for w in W)
    R = tuple(_gate_blocks(r, hidden) for r in R)
    matmul = _blocked_matmul(matmul)
  # Pins the prepared weights and biases, so that XLA hoists their slicing
  # (and transposes) out of a loop around this call (the module docstring).
  W, R, bW, bR = jax.lax.optimization_barrier((W, R, bW, bR))
  last_cells = _carries_last_cells(mode, valid, coefficients)
  if last_cells:
    c0 = tuple((c, c) for c in c0)
  if chunk == 1:
    # A decoder's step against transposed weights runs on the step axis kept
    # (`forward_scan`'s `step_axis`): its cell reads the product batch-major,
    # in two kernels, and the loop body runs inline, 7 kernels against 11.
    # Its loop, us a token, before -> after (Flax's cells), interleaved in one
    # process each: LSTM B8 I64 H128 43.8 -> 39.7 (37.6), 48.9 -> 42.2, 50.7
    # -> 46.0; B1 14.5 -> 14.0, 18.6 -> 17.9 (paired round by round 1.06x);
    # B32 I64 H128 129.4 -> 131.7 (123.8); GRU B8 I64 H128 (one copy fewer)
    # 29.2 -> 28.8, 37.6 -> 36.9. Against the opaque blocks (a larger model's
    # loop) the cell reads the product feature-major, and its two kernels lost
    # to the five it made before (three of them independent, which XLA:CPU may
    # run side by side): LSTM B32 I128 H256 387.8 -> 415.4, 378.8 -> 425.4,
    # 382.1 -> 413.8 (benchmarks/NOTES.md, session 76). But one sequence's
    # feature-major product is its batch-major one (`[g*H, 1]`, a bitcast),
    # so a decoder's loop on one sequence keeps the step axis against the
    # opaque blocks too, us a token, before -> after (Flax's cells), three
    # processes: LSTM B1 I64 H128 13.5 -> 12.7 (13.4), 15.2 -> 13.6 (14.2),
    # 14.9 -> 13.8 (13.4), paired round by round 0.91-0.96x; GRU 0.90-0.97x;
    # LSTM I128 H256 0.98-1.00x; two layers I256 H256 1.00-1.01x, where the
    # products read memory; bfloat16 0.97-0.99x (session 77). On a CPU, as
    # measured; a GPU's fusions may differ.
    step_axis = transposed_in_loop or (loop_step
                                       and _reference.is_known_one(xs[0].shape[1])
                                       and jax.default_backend() == "cpu")
    ys, hT, cT, res = _reference.forward_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR,
                                              matmul, joined, last_cells, stacked,
                                              step_axis=step_axis)
  else:
    ys, hT, cT, res = _chunked_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR, matmul, chunk,
                                    joined, last_cells)
  if last_cells:
    cT = tuple(c_last for _, c_last in cT)
  return ys, hT, cT, res


# A step-by-step forward's weights, stacked. Traced on the 2-core Xeon with AMX
# (jax 0.10.2, LSTM B8 T32 I64 H128, float32; benchmarks/NOTES.md, session 72),
# the call spent its extra time against Flax's scan before the loop: each
# matrix sliced out of the buffer and then transposed (XLA:CPU transposes at
# about 1.2 ns an element, a plain copy at 0.5), 12 thunks against Flax's 10;
# given its matrices already transposed, the same program ran 1.06-1.20 ms
# against the library's 1.33-1.60 and Flax's 1.14-1.22. Stacked, the
# transposes are one pass writing `[in + H, g*H]` (`copy_concatenate_fusion`),
# the entry 9 thunks, and each step one product and 8 thunks. Forward, ms, two
# products -> stacked, interleaved in one process, one figure a process:
# LSTM B8 T32 I64 H128 1.554 -> 1.357, 1.642 -> 1.503, 1.497 -> 1.287, 1.698
# -> 1.549, 1.473 -> 1.382 (Flax's scan 1.225 in the first); B16 T50 I64 H128
# 3.58 -> 3.46, 3.80 -> 3.43, 3.96 -> 3.48, 4.22 -> 3.59, 3.84 -> 3.77; B4 T8
# I32 H64 0.249 -> 0.226, 0.306 -> 0.242; B16 T50 I128 H128 4.40 -> 4.10,
# 5.12 -> 4.96; B16 T20 I128 H256 4.98 -> 4.64, 6.25 -> 5.65; B8 T20 I256
# H256 (2 MiB stacked) 5.95 -> 4.46, 4.84 -> 4.39, 5.51 -> 5.25; B32 T20 I256
# H256 10.22 -> 9.98, 11.90 -> 11.71. Past 2 MiB it lost (`STACKED_MAX_BYTES`):
# I512 H256 9.58 -> 10.15, 10.77 -> 12.46; I256 H384 10.77 -> 10.61, 12.38 ->
# 15.31; I256 H512 18.4 -> 22.9; I512 H512 25.9 -> 39.0, 26.8 -> 39.9. No
# gain where tried and left out: two directions (B16 T50 I64 H128 7.28 ->
# 7.42, 7.64 -> 7.43, 7.49 -> 7.11, 7.67 -> 7.71, 6.89 -> 7.12), the
# derivative's step-by-step forward (LSTM B64 T32 I64 H128 forward+backward
# 21.4 -> 21.1, 24.7 -> 24.7, 28.2 -> 25.9, 24.1 -> 26.6), a bfloat16 model's
# (B16 T50 I64 H128 2.19 -> 2.22, 2.10 -> 2.30). A GRU stacked with zero
# blocks (`[x, h] @ [[W_rz, W_n, 0], [R_rz, 0, R_n]]`, a third more work),
# prototyped alone, lost: B8 T32 I64 H128 0.91 -> 1.23, B64 T32 6.45 -> 8.06.
# Between processes the same program moved by up to 10% here, so each figure
# above is one process's interleaved pair.
# From jax 0.11 (under 0.12.1 XLA:CPU's products are YNNPACK's kernels), the
# stacked matrix of I = H = 256, 2 MiB, lost on the 2-core Zen 3: a forward, ms,
# stacked -> two products (Flax's scan), one process a line (session 95): jax
# 0.12.1 B8 T20 4.23 -> 3.71 (4.03), 4.67 -> 4.18 (4.36), B4 3.01 -> 2.79, B16
# 7.28 -> 6.10 (6.02), B32 10.89 -> 10.08 (10.28), B8 T50 5.54 -> 5.38; jax
# 0.11.2 B8 T20 3.69 -> 3.35 (3.18); but jax 0.10.2 4.89 -> 4.97 (5.44). Through
# the library after (the bound patched back to 2 MiB), jax 0.12.1, paired round
# by round, 40 rounds, the stacked time / the two products': B8 T20 1.12, 1.06,
# 1.16; B16 T20 1.04, 1.08, 1.10 (one process each). Between 1.5 and 2 MiB
# stacking lost a little or went level (jax 0.12.1: I256 H192 3.65 -> 3.55, I192
# H256 5.77 -> 5.81, I = H = 224 3.53 -> 3.11, paired 0.95x -> 0.98x of Flax's),
# and up to 1.5 MiB stacking still gained: I96 H256 B16 5.22 -> 6.50, I64 H256
# 4.35 -> 4.83, I = H = 128 B32 4.27 -> 4.65 (4.76), I192 H128 B16 2.53 -> 3.76,
# I384 H128 3.44 -> 3.89; or went either way: I128 H256 B8 3.52 -> 3.79 but
# paired 1.11x -> 1.17x of Flax's, I64 H128 B16 T50 4.42 -> 4.24 (4.29), I = H =
# 192 B32 (jax 0.12.1 5.44 -> 4.98, jax 0.11.2 8.22 -> 8.70). Hence, from jax
# 0.11, the smaller bound (`stacked_max_bytes`). A decoder's loop stacks nothing
# there (its weights blocked or opaque; LSTM B8 I = H = 256 143.7 against 142.5
# us a token).
STACKED_MAX_BYTES = 2 << 20
STACKED_MAX_BYTES_FROM_JAX_0_11 = 3 << 19
STACKED_SMALLER_FROM_JAX = (0, 11)


def stacked_max_bytes(version: str | None = None) -> int:
  """The most bytes `_stacks_weights` stacks under JAX's `version` (the
  installed one's by default): `STACKED_MAX_BYTES` before
  `STACKED_SMALLER_FROM_JAX`, `STACKED_MAX_BYTES_FROM_JAX_0_11` (1.5 MiB) from it."""
  if _requirements.jax_older_than(STACKED_SMALLER_FROM_JAX, version):
    return STACKED_MAX_BYTES
  return STACKED_MAX_BYTES_FROM_JAX_0_11


def _stacks_weights(mode, operands, xs, W, R, chunk, opaque) -> bool:
  """Whether a step-by-step forward (`chunk` 1) multiplies each step's input
  and state side by side by the two matrices stacked (`[x_t, h] @ [W; R]`,
  `_reference.recurrent_step`'s `x_t`): one product a step instead of two,
  and one pass over the weights before the loop. For an LSTM's and the plain
  RNNs' layers with an input matrix (a GRU's `n` gate keeps its two terms
  apart), for the forward alone (the caller's `coefficients` False), in one
  direction and one lane (`xs` holds one: lanes, by batch or by unit, are
  directions of their own), products in the model's own dtype (`operands`
  None: not a bfloat16 model), where the weights are transposed (not
  `opaque`: `_reads_opaque_orientation`, for one step or one sequence, but for
  `_transposes_in_loop`), and the stacked matrix takes at most
  `stacked_max_bytes()`."""
  if (chunk != 1 or mode == "gru" or W is None or operands is not None
      or len(xs) != 1):
    return False
  return (not opaque
          and ((W[0].shape[0] + R[0].shape[0]) * R[0].shape[1] * R[0].dtype.itemsize
               <= stacked_max_bytes())
          and jax.default_backend() == "cpu")


def _carries_last_cells(mode, valid, coefficients) -> bool:
  """Whether `_forward` carries an LSTM's cell state unmasked, and the state
  at each sequence's last valid step beside it (`_reference.recurrent_step`'s
  `last_cells`): for the forward alone with a mask.

  Masked, the cell state is a chain of cheap element-wise operations from
  step to step (`where(valid, f c + i g, c)`), and XLA:CPU fuses each link
  into its consumers, the next link's and the step's `tanh(c)`, so a chunk's
  later steps recompute the links before them: the kernel of its sixth step
  ran 34 us where an unmasked one ran 6-10 (LSTM B16 T50 I64 H128, traced).
  Unmasked, the running state's step is one kernel with its gates, as without
  `seq_lengths`, and the kept state's select reads it: traced, every step's
  element-wise kernels then ran 4-10 us.
  Past a sequence's end its running state is never read: the hidden state
  (and with it the next step's product) is still masked, its outputs are
  zeros, and its final cell state is the kept one; so padding, NaN or not,
  changes nothing. The forward alone with `seq_lengths` on a 2-core Xeon,
  masked -> kept, interleaved in one process, ms (without `seq_lengths`):
  LSTM B16 T50 I64 H128 3.17 -> 1.99 (2.00) and 3.50 -> 2.95 (2.62); B16
  T256 I128 H256 (lanes by unit) 29.7 -> 23.0 (22.6); B64 T32 I128 H256 11.5
  -> 10.6 (9.9); B64 T32 I64 H128 (lanes by batch) 5.12 -> 4.29 (4.48); 2
  bidirectional layers B64 T100 I128 H256 182 -> 163 (165); bfloat16 B16 T50
  I64 H128 4.05 -> 3.04 (3.12); even at B8 T32 I64 H128 (0.84 -> 0.87), step
  by step (B8 T20, 0.51 -> 0.50) and B4 T128 I128 H320 (9.5 -> 9.2;
  benchmarks/NOTES.md, session 67). The derivative's forward keeps the masked
  chain: in training `seq_lengths` cost 0-5% (B16 T50 I64 H128 7.09 -> 7.43
  ms, B16 T256 I128 H256 137.9 -> 136.9, B64 T32 I128 H256 45.5 -> 47.5)."""
  return mode == "lstm" and valid is not None and not coefficients


# -- the forward alone in lanes ------------------------------------------------------
#
# Where a layer's forward alone runs in lanes, by batch or by hidden unit, and
# what that was measured to gain, is `_lanes`'s rule (`_lanes.forward_lanes`).


def _forward_in_batch_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR):
  """`_forward` without coefficients, each direction's batch cut into `_lanes.LANES`
  parts that run as directions of their own (each with its part of the
  `valid` mask), joined after."""
  B, lanes = xs[0].shape[1], _lanes.LANES
  cuts = [B * k // lanes for k in range(1, lanes)]
  cut = lambda t, axis: None if t is None else tuple(
      part for a in t for part in jnp.split(a, cuts, axis))
  each = lambda t: None if t is None else tuple(a for a in t for _ in range(lanes))
  valid = None if valid is None else cut((valid,) * len(xs), 1)
  ys, hT, cT, _ = _forward(mode, operands, cut(xs, 1), valid, cut(h0, 0), cut(c0, 0), each(W),
                           each(R), each(bW), each(bR), coefficients=False, lanes=lanes)
  join = lambda t, axis: None if t is None else tuple(
      jnp.concatenate(t[d * lanes:(d + 1) * lanes], axis) for d in range(len(xs)))
  return join(ys, 1), join(hT, 0), join(cT, 0)


def _forward_in_unit_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR):
  """`_forward` without coefficients for one direction, its hidden units cut
  into `_lanes.LANES` parts: each lane holds its units' columns of every gate of the
  weights and biases (its units of the input itself under skip_input, W
  None) and its units' part of the states, and multiplies the whole state
  each step (`joined`). The parts are joined after."""
  (x,), (r,) = xs, R
  H, g, lanes = r.shape[0], _spec.NUM_GATES[mode], _lanes.LANES
  units = [(H * k // lanes, H * (k + 1) // lanes) for k in range(lanes)]
  columns = lambda a, lo, hi: jnp.concatenate(
      [a[..., gate * H + lo:gate * H + hi] for gate in range(g)], -1)
  per_lane = lambda t: None if t is None else tuple(
      columns(t[0], lo, hi) for lo, hi in units)
  part = lambda t: None if t is None else tuple(t[0][..., lo:hi] for lo, hi in units)
  x_lanes = (x,) * lanes if W is not None else part(xs)
  ys, hT, cT, _ = _forward(mode, operands, x_lanes, valid, part(h0), part(c0), per_lane(W),
                           per_lane(R), per_lane(bW), per_lane(bR), coefficients=False,
                           lanes=lanes, joined=True)
  join = lambda t: None if t is None else (jnp.concatenate(t, -1),)
  return join(ys), join(hT), join(cT)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _layer(mode, operands, looped, plan, xs, valid, h0, c0, W, R, bW, bR, buffer):
  """One layer's forward, all directions: `(ys, hT, cT)`. `operands` as
  `operand_dtype`; `looped` as `_forward`'s; `plan`: None, or the
  `_one_step.Plan` by which a one-step call multiplies the whole opaque
  `buffer` (flat, in the computation dtype; else None) rather than `W` and
  `R`, the same weights sliced out of it. The derivative (`_layer_jvp`) reads
  `W` and `R`, and gives `buffer` no tangent of its own: the caller's `W`
  and `R` are slices of it, through which its tangent reaches the output."""
  if plan is not None:
    return _one_step.forward(mode, plan, xs, valid, h0, c0, bW, bR, buffer)
  lanes = _lanes.forward_lanes(mode, operands, xs, R)
  if lanes == "batch":
    return _forward_in_batch_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR)
  if lanes == "units":
    return _forward_in_unit_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR)
  ys, hT, cT, _ = _forward(mode, operands, xs, valid, h0, c0, W, R, bW, bR, coefficients=False,
                           looped=looped)
  return ys, hT, cT


def _zero(t) -> bool:
  return t is None or isinstance(t, SymbolicZero)


def _of(t, f):
  """`f(t)`, or None where `t` is a symbolic zero."""
  return None if _zero(t) else f(t)


def _sum(*terms):
  """Sum of the terms that are not symbolic zeros (a bias's `[g*H]` broadcast
  against the others' `[T, B, g*H]`); None when all are."""
  terms = [t for t in terms if not _zero(t)]
  if not terms:
    return None
  ndim = max(t.ndim for t in terms)
  return functools.reduce(jnp.add, [_reference.lift(t, ndim) for t in terms])


def _weight_tangent_matmul(mode, operands, matmul, dtype):
  """How the tangent multiplies a layer's inputs or states `[T, B, in]` by a
  weight matrix's tangent `[in, g*H]` (`x dW`, `h_{t-1} dR`): `matmul`, but
  for a GRU multiplying in its own dtype (`operands` None), a `_rounded_dot`
  in that dtype (no rounding).

  The product's transpose is the weight gradient, a contraction over time and
  batch. JAX's own transpose multiplies the cotangent by the inputs (`du^T x`,
  `[g*H, in]`), and XLA:CPU runs that by first copying `du` transposed
  (`[g*H, T*B]`, as large as the cotangent stacked over the steps) for a
  YNNPACK matmul. `_rounded_dot`'s transpose multiplies the inputs by the
  cotangent (`x^T du`, `[in, g*H]`, its result behind a barrier, transposed
  into the opaque layout by the gradient's concatenation), for which XLA copies
  the smaller `x` transposed instead (the bfloat16 models' products always
  did). A GRU's input and recurrent weights then met different cotangents
  (`_gru_cell`), and that saved two copies of `[T, B, 3H]`: forward+backward,
  interleaved A/Bs (ms, MiB): GRU B16 T256 I128 H256 73.8 -> 71.9, 57.5 ->
  49.5; B64 T32 I128 H256 30.8 -> 27.4, 28.5 -> 24.5; B32 T100 I256 H256, 3
  layers, 99.0 -> 92.7 MiB at the same speed (benchmarks/NOTES.md, session 27).
  They now share one (`_layer_jvp`), and this orientation is still the faster
  for a GRU (ms, `du^T x` -> `x^T du`: B16 T256 I128 H256 50.1 -> 42.3, B64
  T32 I128 H256 18.0 -> 15.2, B64 T100 I128 H128 22.0 -> 20.2; 3 layers B32
  T100 I256 H256 106.8 -> 107.5; session 54).
  The LSTM and the plain RNNs share one cotangent between their two weight
  gradients, whose one copy feeds both matmuls; there the other orientation
  measured slower (LSTM B32 T100 I256 H256, 3 layers: 235.5 -> 242.7 ms).
  """
  if mode != "gru" or operands is not None:
    return matmul
  return functools.partial(_rounded_dot.matmul, operands=dtype)


def _layer_jvp(mode, operands, looped, plan, primals, tangents):
  xs, valid, h0, c0, W, R, bW, bR, _ = primals
  txs, _, th0, tc0, tW, tR, tbW, tbR, _ = tangents
  ys, hT, cT, res = _forward(mode, operands, xs, valid, h0, c0, W, R, bW, bR, coefficients=True)
  D, g = len(xs), _spec.NUM_GATES[mode]
  T, B = xs[0].shape[:2]
  lstm, gru = mode == "lstm", mode == "gru"

  # The input term of the tangent for every step at once: A_t (added to the
  # recurrent pre-activation tangent inside the loop) for the plain RNNs; for
  # LSTM and GRU, X_t: the same terms already multiplied by their coefficients
  # and summed per gate into what the step adds to dc' and dh' (LSTM,
  # `[T, B, 2H]`) or to dh' (GRU, `[T, B, H]`), so that the loop adds nothing
  # to the pre-activations. Reverse mode then stacks that narrower cotangent
  # over the steps instead of one of `[T, B, g*H]`. Forward+backward,
  # interleaved A/Bs: GRU B16 T256 I128 H256 81 -> 74 ms, 61.5 -> 57.5 MiB; in
  # bfloat16 66 -> 56 ms, 49.8 -> 43.8 MiB; LSTM B32 T100 I256 H256, 2
  # bidirectional layers, 188.7 -> 163.6 MiB at the same speed
  # (benchmarks/NOTES.md, session 24).
  # A GRU's `n` gate multiplies its recurrent terms by other coefficients than
  # the rest, `k_n * r` (`_gru_cell`). Its recurrent weights' terms were
  # multiplied apart from the input terms (dx W, x dW, dbW), so that reverse
  # mode stacked two `[T, B, 3H]` cotangents; now only the n block of the
  # recurrent terms is, and it stacks one `[T, B, 3H]` and one `[T, B, H]`, at
  # the price of an `[H, H]` weight-gradient product more. Forward+backward,
  # interleaved A/Bs, float32 unless said (ms, MiB): GRU B64 T100 I128 H128
  # 31.1 -> 21.2, 41.2 -> 32.0 (Flax's scan 25.0, 35.4: XLA:CPU takes a
  # call's temporary buffers afresh, and glibc maps those over 32 MiB anew on
  # each call, so that every page faults in; README's Performance); in
  # bfloat16 23.1 -> 14.6, 34.6 -> 32.5; B16 T256 I128 H256 46.4 -> 43.5,
  # 49.5 -> 45.5; B128 T32 I64 H128 11.4 -> 11.2, 24.4 -> 22.4; B32 T100
  # I256 H256 2 bidirectional layers 168 -> 167, 141.7 -> 138.5
  # (benchmarks/NOTES.md, session 54).
  def term(*terms):  # a [T, B, .] sum of [T, B, .] and bias terms, None if all zero
    total = _sum(*terms)
    return None if total is None else jnp.broadcast_to(total, (T, B, total.shape[-1]))

  # A bfloat16 model's tangent multiplies bfloat16 operands too, through
  # `_rounded_dot`, whose transposes (the backward pass's matmuls) do as well.
  dot_general, matmul, round_ = _products(operands, _widens(xs, W, R))
  weights_matmul = _weight_tangent_matmul(mode, operands, matmul, xs[0].dtype)
  A, X = [], []
  for d in range(D):
    hprev = jnp.concatenate([h0[d][None], ys[d][:-1]])
    Wd = None if W is None else round_(W[d])
    dx = _of(txs[d], lambda t: _reference.project(t, Wd, g, matmul))
    dw = None if W is None else _of(tW[d], lambda t: weights_matmul(xs[d], t))
    dr = lambda cols=lambda t: t: _of(  # h_{t-1} dR, of some columns
        tR[d], lambda t: weights_matmul(hprev, cols(t)))
    if gru:
      # R's tangent is multiplied twice: with its n block zeroed (a mask,
      # whose transpose masks the `[H, 3H]` gradient), into the terms that
      # K multiplies, and its n block alone, which k_n * r multiplies (above).
      K, r, _ = res[d]
      H = r.shape[-1]
      rz = (np.arange(g * H) < 2 * H).astype(K.dtype)  # the r and z blocks' columns
      rz_cols = lambda t: t * _reference.lift(rz, t.ndim)
      n_cols = lambda t: t[..., 2 * H:]
      a = _sum(dx, dw, dr(rz_cols), tbW[d], _of(tbR[d], rz_cols))
      x_t = None if a is None else _blocksum(_reference.lift(a, K.ndim) * K, g)
      an = _sum(dr(n_cols), _of(tbR[d], n_cols))
      if an is not None:
        n_rec = _reference.lift(an, K.ndim) * (K[..., 2 * H:] * r)
        x_t = n_rec if x_t is None else x_t + n_rec
      X.append(None if x_t is None else term(x_t))
      A.append(None)
    elif lstm:  # X_t = [the i, f, g blocks of A K summed (into dc'), the o block (into dh')]
      a = _sum(dx, dw, dr(), tbW[d], tbR[d])
      if a is None:
        X.append(None)
      else:
        a_i, a_f, a_g, a_o = jnp.split(a * res[d][0], 4, axis=-1)
        X.append(term(jnp.concatenate([a_i + a_f + a_g, a_o], -1)))
      A.append(None)
    else:
      A.append(term(dx, dw, dr(), tbW[d], tbR[d]))
      X.append(None)

  # The recurrent term is written against R^T ([g*H, H], the opaque buffer's
  # own block, which XLA then reads directly) so that its transpose, the
  # reverse loop's per-step `du_t R^T`, contracts R^T's leading axis. Written
  # as `dh @ R`, the reverse loop contracted R's trailing axis, which XLA:CPU
  # runs much slower at small batch: LSTM B16 H128, 57 -> 32 us a step
  # (benchmarks/NOTES.md, session 12). Forward mode gets the slow orientation
  # instead, and is the rarer use (`jax.jvp` of that LSTM: 11.4 -> 12.4 ms).
  RT = [round_(r).T for r in R]

  def tangent_step(carry, inputs):
    dhs, dcs = carry
    A_t, X_t, res_t, valid_t = inputs
    new_dhs, new_dcs, outs = [], [], []
    for d in range(D):
      rec = dot_general(dhs[d], RT[d], (((1,), (1,)), ((), ())))  # dh @ R
      pre = rec if A_t[d] is None else A_t[d] + rec
      if lstm:
        K, f, k_h = res_t[d]
        u_i, u_f, u_g, u_o = jnp.split(pre * K, 4, axis=-1)
        dc = u_i + u_f + u_g + f * dcs[d]
        if X_t[d] is not None:
          x_c, x_h = jnp.split(X_t[d], 2, axis=-1)
          dc = dc + x_c
          u_o = u_o + x_h
        dh = u_o + k_h * dc
      elif gru:
        K, r, z = res_t[d]
        u_r, u_z, u_n = jnp.split(pre * K, 3, axis=-1)
        dh = u_r + u_z + u_n * r + z * dhs[d]
        if X_t[d] is not None:
          dh = dh + X_t[d]
        dc = None
      else:
        dh, dc = pre * res_t[d][0], None
      dh, dc, out = _reference.mask(valid_t, dh, dc, dhs[d], dcs[d] if lstm else None)
      new_dhs.append(dh)
      new_dcs.append(dc)
      outs.append(out)
    return (tuple(new_dhs), tuple(new_dcs) if lstm else None), tuple(outs)

  zeros_like = lambda t, p: jnp.zeros_like(p) if _zero(t) else t
  carry0 = (tuple(zeros_like(t, p) for t, p in zip(th0, h0)),
            tuple(zeros_like(t, p) for t, p in zip(tc0, c0)) if lstm else None)
  (dhT, dcT), dys = jax.lax.scan(tangent_step, carry0, (tuple(A), tuple(X), res, valid))
  return (ys, hT, cT), (dys, dhT, dcT)


_layer.defjvp(_layer_jvp, symbolic_zeros=True)


def run_layer(spec, x, h0, c0, blocks, layer, seq_lengths, looped=False):
  """`_reference._run_layer` over this file's recurrence, for `spec`'s dtype;
  `blocks` the `_reference.param_blocks` of the opaque buffer; `looped` as
  `_forward`'s. A one-step call may multiply the whole buffer
  (`_one_step.plan`), which joining the blocks gives back: XLA folds their
  split and the join away."""
  plan = _one_step.plan(spec, layer, x, looped)
  buffer = None
  if plan is not None:
    buffer = jnp.concatenate([b.reshape(-1) for b in blocks.values()])
  recurrence = lambda mode, *args: _layer(mode, operand_dtype(spec.dtype), looped, plan, *args,
                                          buffer)
  return _reference._run_layer(spec, x, h0, c0, blocks, layer, seq_lengths,
                               recurrence=recurrence)


def rnn(spec, x, h0, c0, params, **options):
  """`_reference.rnn` over `run_layer`: the "xla" path's whole RNN, its
  options `_reference.rnn`'s."""
  looped = weights_from_enclosing_trace(params, (x, h0, c0))
  return _reference.rnn(spec, x, h0, c0, params,
                        run_layer=functools.partial(run_layer, looped=looped), **options)
