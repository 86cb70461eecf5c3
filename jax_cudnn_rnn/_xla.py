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
(`_chunked_scan`): a scan over chunks of 4 to 16 steps (`chunk_steps`), each
making one `[chunk, B, in] x [in, g*H]` matmul and then running its steps
unrolled. The reference projects step by step, one `[B, in]` matmul each, and
at small batch those run far below XLA:CPU's matmul peak; projecting all steps
at once before the loop was slower still (`_reference`'s docstring). Forward,
LSTM, interleaved A/B against step-by-step (benchmarks/NOTES.md, session 14):
B16 T256 I128 H256 52.7 -> 47.6 ms, B32 T100 I256 H256 56.8 -> 44.2 ms, the
same with 2 bidirectional layers 240 -> 182 ms, B64 T100 I128 55.0 -> 53.4 ms.
Compiling takes about twice as long (the unrolled steps), so sequences shorter
than `MIN_CHUNKED_STEPS` (32), and numbers of steps with no divisor in [4, 16],
run step by step, as the reference does. The chunks are near 8 steps for the
forward alone (`INFERENCE_CHUNK`; near 16 for a GRU's from 64 steps on, and for
the other cells' in lanes, `inference_chunk`) and near 4 for the forward of the
derivative (`DERIVATIVE_CHUNK`, training; step by step for a small matrix over
many sequences, `derivative_chunk`): there the forward is a smaller part
of the work, and chunks of 4 measured as fast as chunks of 8-10 in
forward+backward (ms: LSTM B32 T100 I256 H256 2 bidirectional layers 307 vs
305, step by step 327; GRU, same shape, 378 vs 378; LSTM B16 T256 I128 H256 106
vs 108; GRU, same shape, 96 vs 94; LSTM B64 T32 I128 H256 31 vs 33; the
bfloat16 LSTM B16 T256 57 vs 58), and compiled in 16-33% less time (s: the LSTM
B16 T256 0.88 -> 0.59, the 2-layer LSTM 1.60 -> 1.09, a 3-layer GRU B32 T100
1.18 -> 0.99, the bfloat16 LSTM B8 T32 I64 H128 0.93 -> 0.68;
benchmarks/NOTES.md, session 18). For the forward alone, 4-step chunks were 5%
slower than 10-step ones (80.0 vs 75.8 ms, step by step 108.5, at the 2-layer
LSTM shape).

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
2 bidirectional layers, 344 -> 234 (session 16).
float16 operands were no faster on that machine than float32 ones, so float16
models multiply in float32.

On a single CPU device, a unidirectional layer's forward alone cuts its batch
into two lanes that run as directions of their own, side by side, where XLA:CPU
splitting each small per-step product over its threads gained little
(`forward_lanes`; LSTM B16 T256 I128 H256 float32 28.2 -> 23.1 ms, GRU 20.6 ->
14.0; benchmarks/NOTES.md, session 41). Below 8 sequences an LSTM's or GRU's
with a large recurrent matrix runs in two lanes by hidden unit instead, each
multiplying the whole state by half of every gate's columns (LSTM B4 T128 I128
H320 4.4 -> 2.7 ms, GRU H384 B2 4.1 -> 2.4; session 48), and so does an
LSTM's up to 16 sequences (B16 T256 I128 H256 12.7-14.1 -> 10.6-11.1 ms in five
runs; session 49). A bfloat16 LSTM's or GRU's forward alone runs in lanes by
unit at any batch from 2, on a CPU whose bfloat16 products are AVX512-BF16
dot products or AMX tiles (`_cpu`; on the Zen 5, LSTM B16 T256 I128 H256
10.5-11.4 -> 7.8-8.2 ms, GRU B64 T32 3.7 -> 2.6; session 50; on the AMX Xeon,
20.0 -> 14.7 and 5.5 -> 4.2; session 60).

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

from jax_cudnn_rnn import _cpu, _reference, _rounded_dot, _spec


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
    i, f, g, o = jnp.split(xp + rec, 4, axis=-1)
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
  x_r, x_z, x_n = jnp.split(xp, 3, axis=-1)
  r_r, r_z, r_n = jnp.split(rec, 3, axis=-1)
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


# Shorter sequences run step by step: there the unrolled steps' compile time
# (about twice the step-by-step scan's) outweighs the little they save.
MIN_CHUNKED_STEPS = 32
# The chunk length sought: for the forward alone, and for the forward that the
# derivative runs (with the coefficients), where shorter chunks compile faster
# for the same speed (the module docstring).
INFERENCE_CHUNK = 8
DERIVATIVE_CHUNK = 4
# A GRU's forward alone over `LONG_STEPS` steps or more seeks chunks of
# `LONG_CHUNK`; in lanes (`forward_lanes`), so does every other cell's forward
# at any length. On a 2-core Xeon (AMX) the GRU's chunk-8 forward ran at one
# of two speeds, by process (B16 T256 I128 H256, float32: 23-27 ms in most
# processes, 20.2 ms in one; on one CPU, 20.0), its loop waiting more on
# XLA:CPU's second thread when slow; chunks of 16 ran at the faster speed in
# every process (18.2-22.3 ms; Flax's scan 18.8-20.6). Forward, ms, chunks of
# 8 -> 16 interleaved in one process: where 8 was slow, B16 T256 24.4 -> 20.4,
# bfloat16 13.4 -> 12.3, B16 T128 12.5 -> 10.2, B16 T64 6.35 -> 5.24, B64 T128
# 35.0 -> 34.4, 2 bidirectional layers B16 T256 71.1 -> 67.1; where 8 was
# fast, B16 T256 20.2 -> 19.7, B16 T64 5.29 -> 5.16. At 32 steps (B8-B64) 16
# was 2-3% slower, so both keep 8 there. The price: the GRU's forward compiles
# in 1.3-1.5x the time (0.31 -> 0.46 s at B16 T64; benchmarks/NOTES.md,
# session 40). In two lanes, the GRU's forward, chunks of 16 -> 8 (ms, two
# runs where two figures): one layer B16 T64-T256 within 2%, B64 T128 31.8 /
# 27.2 -> 26.6 / 26.0, but three layers B32 T256 I256 108.6 / 112.1 -> 114.9 /
# 117.9 and B32 T128 52.4 -> 53.9; so it keeps 16 there (and 8 below 64 steps:
# chunks of 16 at B16 T32 2.02 -> 2.20, B8-B32 T32-T48 within 3%; session 43).
# The LSTM's forward in one lane moved within the noise (-5% to +4% at
# T128-T256), so it keeps 8; in two lanes, float32 H256, ms, chunks of 8 -> 16
# (two runs where two figures): B8 T256 16.6 / 15.9 -> 13.5 / 13.5, B8 T128
# 8.71 -> 7.60, B16 T256 24.3 / 25.0 -> 23.0 / 23.6, B16 T64 6.51 -> 5.97, 3
# layers B32 T128 I256 71.2 -> 70.1, H192 B8 T256 9.35 -> 9.17, B64 T128 36.1
# -> 37.3 (session 42); below 64 steps, B16 T32 3.23 -> 2.92, B8 T48 3.16 ->
# 2.70, B64 T32 8.41 -> 8.29 (session 43). Its forward compiles in 1.5-1.7x
# the time (0.41 -> 0.67 s at B16 T256, 0.37 -> 0.61 s at B16 T32). RNN-tanh
# and RNN-relu in two lanes, float32 I128 H512 unless said, ms, one lane /
# chunks of 8 / of 16 (session 43): tanh B16 T256 22.5 / 17.9 / 16.0, B8 T256
# 13.3 / 10.6 / 9.7, B16 T64 6.25 / 5.08 / 4.42, B16 T32 3.37 / 2.93 / 2.49,
# B64 T32 7.73 / 6.84 / 7.15, B64 T128 I256 H384 27.2 / 22.0 / 21.0; relu B16
# T256 22.0 / 25.7 / 18.1, B8 T256 11.7 / 18.4 / 10.8, B16 T128 10.4 / 14.1 /
# 8.8, B16 T32 3.08 / 4.18 / 2.73, B8 T32 2.13 / 2.91 / 1.87, B64 T32 7.71 /
# 9.01 / 7.85, 3 layers B32 T128 I512 74.0 / 82.3 / 73.3: in chunks of 8, two
# lanes of RNN-relu were slower than one. Their forward compiles in 1.3-1.9x
# the time (relu B16 T32 0.25 -> 0.47 s).
LONG_STEPS = 64
LONG_CHUNK = 16


def inference_chunk(mode: str, steps, lanes: int = 1) -> int:
  """The chunk length the forward alone seeks (`chunk_steps`'s `target`), its
  batch in `lanes` lanes (`forward_lanes`): for a GRU, `LONG_CHUNK` from
  `LONG_STEPS` steps on; for the other cells, `LONG_CHUNK` in lanes; else
  `INFERENCE_CHUNK`."""
  if not isinstance(steps, (int, np.integer)):
    return INFERENCE_CHUNK
  if mode == "gru":
    return LONG_CHUNK if steps >= LONG_STEPS else INFERENCE_CHUNK
  return LONG_CHUNK if lanes > 1 else INFERENCE_CHUNK


def chunk_steps(steps: int, target: int = INFERENCE_CHUNK) -> int:
  """The steps per chunk of the forward scan: for `MIN_CHUNKED_STEPS` steps or
  more, a divisor of `steps` in [4, 16], the nearest to `target` (the smaller
  on a tie); else, or where there is no such divisor (a prime number of steps,
  say), 1: no chunking. A symbolic number of steps (shape-polymorphic
  `jax.export`) runs step by step: no chunk length divides every value."""
  if not isinstance(steps, (int, np.integer)):
    return 1
  divisors = [k for k in range(4, 17) if steps % k == 0]
  if steps < MIN_CHUNKED_STEPS or not divisors:
    return 1
  return min(divisors, key=lambda k: (abs(k - target), k))


# The forward that the derivative runs goes step by step where an LSTM's or a
# GRU's recurrent matrix is small and each step's cells (batch x hidden units)
# many. In chunks, each step's cell fusion reads its slice of the chunk's
# projection, and XLA:CPU splits those fusions over its two threads
# (`outer_dimension_partitions: 2`; a hand-off and a wait each); step by step
# it does not (LSTM B64 T32 I64 H128: the loop's four cell fusions split in
# chunks, none step by step; benchmarks/NOTES.md, sessions 53 and 58; traced on
# the Xeon, 17.5 us each on one core, 45 on two). Forward+backward, float32, T32
# I64 unless said, ms, chunks of 4 -> step by step, interleaved in one process:
#   2-core Xeon with AMX (session 58): LSTM H128 B32 6.89 -> 6.66 and 6.88 ->
#   6.84, B64 16.58 -> 14.94 and 16.98 -> 15.38, B128 28.89 -> 28.49, B32 T64
#   13.47 -> 12.90, B32 T100 21.59 -> 20.89, B64 T50 27.64 -> 25.41, B64 T100
#   I128 73.85 -> 69.04, 3 layers B32 23.76 -> 22.89; H96 B48 6.84 -> 6.87;
#   H64 B64 5.63 -> 5.52, B128 11.44 -> 10.06, B256 23.66 -> 23.12; H32 B128
#   5.54 -> 5.48; GRU H128 B48 7.99 -> 7.62, B64 12.20 -> 10.69 and 11.74 ->
#   10.59, B128 23.65 -> 22.89, B64 T50 19.51 -> 16.52; GRU H96 B64 7.47 ->
#   7.31; bfloat16 LSTM H128 B64 9.56 -> 8.16 and 9.87 -> 8.87, GRU 7.38 ->
#   6.13;
#   2-core Zen 5 (session 53): LSTM H128 B64 11.3 / 11.7 -> 10.1 / 10.2, B32
#   T100 11.6 / 11.7 -> 11.4 / 11.5, B64 T100 I128 40.5 / 39.6 -> 40.2 / 39.8;
#   H64 B128 6.1 / 6.2 -> 5.4 / 5.5; GRU H128 B64 6.3 / 6.0 -> 6.1 / 5.8, B128
#   12.1 / 12.0 -> 12.0 / 12.0.
# Outside the rule they went both ways, so keep chunks: fewer cells (LSTM H128
# B24 5.19 -> 5.41, B16 T50 5.32 -> 5.46; GRU H128 B8 1.74 -> 1.81), a larger
# matrix (GRU H160 B64 15.10 -> 15.61, but LSTM H144 B64 18.35 -> 17.10; on the
# Zen 5, LSTM B16 T256 I128 H256 53.4 -> 58.1), two bidirectional layers (LSTM
# B64 T32 I128 H128 90.2 -> 94.7; GRU 73.7 -> 72.9), and RNN-tanh and RNN-relu,
# whose steps have one small fusion (tanh H128 B64 3.27 -> 3.33, relu B128 6.43
# -> 6.34). Nor on a device other than a CPU, where it was not measured.
DERIVATIVE_STEP_MIN_CELLS = 4096  # batch x hidden units of the one direction
DERIVATIVE_STEP_MAX_WEIGHTS = 64 * 1024  # elements of R: LSTM up to H128, GRU up to H147
DERIVATIVE_STEP_MODES = frozenset({"lstm", "gru"})


def derivative_chunk(mode: str, xs, h0, R) -> int:
  """The steps per chunk of the forward that the derivative of a `mode` layer
  runs, over `xs` (its inputs, a tuple over directions) from states `h0` with
  recurrent weights `R`: 1 (step by step) where the comment above says, else
  `chunk_steps` near `DERIVATIVE_CHUNK`."""
  steps = xs[0].shape[0]
  cells = h0[0].shape
  concrete = all(isinstance(n, (int, np.integer)) for n in (steps, *cells))
  if (concrete and len(xs) == 1 and mode in DERIVATIVE_STEP_MODES
      and R[0].size <= DERIVATIVE_STEP_MAX_WEIGHTS
      and cells[0] * cells[1] >= DERIVATIVE_STEP_MIN_CELLS
      and jax.default_backend() == "cpu"):
    return 1
  return chunk_steps(steps, DERIVATIVE_CHUNK)


def _chunked_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR, matmul, chunk, joined=False):
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
          matmul, joined)
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


def _products(operands):
  """`(dot_general, matmul, round_)` for a model whose matmul operands are
  `operands` (`operand_dtype`): JAX's own products where None, else
  `_rounded_dot`s rounding to `operands` (accumulating in, and returning,
  the first operand's dtype), with `round_` casting a weight matrix once
  rather than in every step."""
  if operands is None:
    return jax.lax.dot_general, jnp.matmul, lambda w: w
  dot_general = lambda a, b, dims: _rounded_dot.rounded_dot(a, b, dims, operands=operands,
                                                            result=a.dtype)
  return (dot_general, functools.partial(_rounded_dot.matmul, operands=operands),
          lambda w: w.astype(operands))


def _reads_opaque_orientation(x: jax.Array) -> bool:
  """Whether the forward over `x [T, B, .]` multiplies by the weights in the
  opaque buffer's orientation rather than transposed: for one step (each
  matrix meets one product, cheaper than its transpose) or one sequence (the
  per-step products are matrix-vector ones, as fast either way). A symbolic
  size counts as more than one."""
  return any(not jax.export.is_symbolic_dim(n) and n == 1 for n in x.shape[:2])


def _opaque_matmul(operands, a: jax.Array, w: jax.Array) -> jax.Array:
  """`a @ w^T` for `a [..., K]` and a weight block `w [N, K]` as the opaque
  buffer holds it, multiplied feature-major: `w @ a^T`, whose result (small:
  `[N, rows of a]`) is then transposed. Its result goes through a barrier,
  else XLA rewrites the pair as `a @ w^T`, which packs the transposed `w` on
  every call, up to 20% slower (benchmarks/NOTES.md, session 22). `operands` as
  `operand_dtype`."""
  flat = a.reshape(-1, a.shape[-1])
  dims = (((1,), (1,)), ((), ()))
  if operands is None:
    product = jax.lax.dot_general(w, flat, dims)
  else:
    product = _rounded_dot.rounded_dot(w, flat, dims, operands=operands, result=a.dtype)
  return jax.lax.optimization_barrier(product).T.reshape(a.shape[:-1] + (w.shape[0],))


def _forward(mode, operands, xs, valid, h0, c0, W, R, bW, bR, coefficients, lanes=1,
             joined=False):
  """The forward recurrence over this file's cells (`_reference.forward_scan`
  or, where the number of steps allows, `_chunked_scan`); `res` holds the
  coefficients stacked over time when `coefficients`, else empty tuples.
  `operands`: `operand_dtype` of the model; `lanes`: how many lanes of one
  direction `xs` holds (`forward_lanes`), for the chunk length; `joined`:
  whether they are lanes by unit (`_reference.recurrent_step`)."""
  cell = functools.partial(_CELLS[mode], coefficients=coefficients)
  _, matmul, round_ = _products(operands)
  W = None if W is None else tuple(round_(w) for w in W)
  R = tuple(round_(r) for r in R)
  if _reads_opaque_orientation(xs[0]):
    # Back to the opaque buffer's `[g*H, .]` blocks (XLA cancels the two
    # transposes), multiplied as they lie.
    W = None if W is None else tuple(w.T for w in W)
    R = tuple(r.T for r in R)
    matmul = functools.partial(_opaque_matmul, operands)
  # Pins the prepared weights and biases, so that XLA hoists their slicing
  # (and transposes) out of a loop around this call (the module docstring).
  W, R, bW, bR = jax.lax.optimization_barrier((W, R, bW, bR))
  steps = xs[0].shape[0]
  if coefficients:
    chunk = derivative_chunk(mode, xs, h0, R)
  else:
    chunk = chunk_steps(steps, inference_chunk(mode, steps, lanes))
  if chunk == 1:
    return _reference.forward_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR, matmul, joined)
  return _chunked_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR, matmul, chunk, joined)


# -- the forward alone in lanes ------------------------------------------------------
#
# XLA:CPU splits each of the loop's small per-step products over its threads
# and waits for them, and on a 2-core Xeon (AMX) that gained almost nothing:
# the LSTM B16 T256 I128 H256 float32 forward took 29.6 ms on both cores and
# 31.0 on one (PyTorch: 14.2 and 23.7). XLA can run independent operations of
# one program side by side, though, as it can a bidirectional layer's two
# directions: a unidirectional layer's forward alone cuts its batch into
# `LANES` lanes, each a recurrence of its own in the same loop, with its part
# of the `seq_lengths` mask. (Whether it does at a given step is XLA:CPU's
# choice: its thunk executor hands ready operations to a second thread only
# when more than 8 are ready, so two lanes' products run side by side only
# where the first one's work goes to the thread pool; a trace shows both
# cases. The gains below are measured; their mechanism is not taken apart:
# benchmarks/NOTES.md, session 52.) Forward, float32, interleaved in one
# process, ms, one lane -> two (benchmarks/NOTES.md, session 41):
#   LSTM B16 T256 I128 H256 28.2 -> 23.1, with seq_lengths 31.9 -> 26.6;
#   GRU, same shape, 20.6 -> 14.0, with seq_lengths 22.0 -> 14.3;
#   B64 T32 I128 H256: LSTM 9.27 -> 8.82, GRU 8.54 -> 6.12;
#   B32 T100 I256 H256, 3 layers: LSTM 60.5 -> 51.3, GRU 55.0 -> 38.5;
#   B8 T256 I128 H256: LSTM 23.6 -> 17.8, GRU 14.1 -> 11.3; GRU B8 T32 2.24 -> 1.59;
#   LSTM B256 T32 I128 H256 38.0 -> 34.7; RNN-tanh B16 T256 I128 H512 24.4 -> 21.3.
# Not where the recurrent matrix is small or large (its bytes outside
# `LANE_WEIGHT_BYTES`; but for small ones over many sequences, below):
# LSTM B16 T256 H128 12.0 -> 12.5, B16 T32 I64 H128 1.44 -> 1.50; H512 (4 MiB,
# more than a core's 2 MiB L2 cache) B16 T128 48.6 -> 56.5, GRU 35.0 -> 38.2,
# LSTM B64 T64 72.8 -> 76.2; GRU H1024 152.7 -> 154.9.
# Nor for a bidirectional layer (two recurrences already: 2 layers B32 T64
# I256 H256 in four lanes, LSTM 59.2 -> 67.8, GRU 42.3 -> 46.5), nor for
# bfloat16 operands (`operand_dtype`), whose products are quick on that
# machine's AMX: B16 T256 LSTM 19.2 -> 12.8, but B32 T100 I256 H256 31.6 ->
# 39.3 with 3 layers and 10.8 -> 13.3 with 1, GRU B64 T32 5.24 -> 6.22. Nor on
# a device other than a CPU (a GPU runs one operation at a time), or with
# several devices (a batch sharded over them would be cut across devices).
# The derivative's forward and tangent run in one lane: in lanes,
# forward+backward went both ways (LSTM and GRU B16 T256 105 -> 92 and 94 ->
# 81, but GRU B64 T32 28 -> 29, GRU 3 layers 201 -> 213, the bfloat16 GRU 59
# -> 71). On one CPU (`taskset -c 0`), two lanes ran as fast as one. The
# forward compiles in up to 1.3x the time (3 layers, LSTM 0.52 -> 0.66 s).
# The window's top was 1 MiB until session 47. On a 2-core Zen 5 (1 MiB of L2
# a core) two lanes gained above it too, forward, float32, ms, one lane ->
# two: GRU H384 (1.7 MiB) B16 T256 I128 19.2 -> 16.9, B8 T256 13.3 -> 9.9, B64
# T32 7.9 -> 6.9 (at these three one lane was slower than Flax's scan), B32
# T100 I256 16.4 -> 13.6; LSTM H320 (1.6 MiB) B16 T256 20.8 -> 16.8, B64 T32
# 8.4 -> 7.0, B8 T256 11.5 -> 10.4; RNN-tanh H640 (1.6 MiB) B16 T256 20.9 ->
# 15.9, B8 T256 12.7 -> 9.4; RNN-relu H640 B16 T256 18.8 -> 14.0, B64 T32 6.4
# -> 6.3. Beyond 2 MiB, LSTM H384 (2.25 MiB) B16 T256 20.5 -> 20.6, GRU H512
# (3 MiB) B16 T128 13.0 -> 12.5. Not measured in (1, 2] MiB on the Xeon (2 MiB
# of L2 a core).
# Each lane projects its own part of a chunk's inputs. One projection of the
# whole batch, cut into the lanes' parts after, ran 0-10% faster (LSTM, GRU at
# small batch; a GRU at B64 up to 7% slower) but compiled the forward in
# 1.3-1.7x the time (XLA:CPU compiles a kernel per lane for step fusions that
# read one shared buffer at different offsets; sessions 43 and 47).
# Lanes by unit. Below `LANE_MIN_BATCH` sequences, where lanes by batch do not
# run, an LSTM's or GRU's recurrent matrix of at least
# `UNIT_LANE_MIN_BYTES` (more than a Zen 5 core's 1 MiB of L2 cache holds)
# runs in lanes that each take half of every gate's columns (hidden units):
# each step, both lanes multiply the whole state, their halves joined, by
# their half of the matrix, and each runs the cell on its own units. Forward,
# float32, I128, ms, one lane -> by unit, in one process (two runs where two
# figures; benchmarks/NOTES.md, session 48):
#   LSTM T128 H256 (1 MiB) B2 2.11 / 2.02 -> 1.51 / 1.55, B4 2.86 / 2.51 ->
#   1.86 / 1.70; H288 B4 3.96 / 3.89 -> 1.99 / 1.91; H320 B4 4.44 / 4.00 ->
#   2.66 / 2.55; H352 B4 2.68 / 3.17 / 3.27 -> 2.85 / 2.80 / 2.85; H384 B4
#   4.74 / 6.43 -> 4.06 / 5.77; H512 B4 8.65 / 11.34 -> 8.08 / 9.39; T256
#   H768 B4 31.6 -> 25.4; T48 H256 B2 0.84 -> 0.74;
#   GRU T128 H336 B4 2.66 / 2.56 -> 2.06 / 2.00; H384 B2 4.05 / 3.90 -> 2.40 /
#   2.21, B4 6.60 / 4.79 -> 4.25 / 2.44; T32 H384 B4 1.35 / 1.19 -> 1.03 /
#   0.92; H512 B4 5.58 / 5.56 -> 5.70 / 5.38.
# Some short sequences lost: LSTM T32 I64 H256 B4 0.67 / 0.65 -> 0.72 / 0.69,
# T32 H512 B4 2.57 / 2.91 -> 3.13 / 2.77. GRU H304-H320 lost (B4 H320 2.08 /
# 2.03 / 2.11 -> 2.37 / 2.41 / 2.31, H304 2.11 -> 2.54), hence the GRU's
# higher bound, and below 1 MiB the LSTM lost (H192 B4 1.23 / 1.28 -> 1.64 /
# 1.77). From 8 sequences, an LSTM's lanes are by unit too, up to 16 sequences
# (`UNIT_LANE_MAX_BATCH`) and within `LANE_WEIGHT_BYTES`: by batch -> by unit,
# forward, float32, I128, ms, in one process, two or three runs (session 49):
# H256 B16 T256 14.3 / 13.1 / 14.6 -> 11.7 / 11.1 / 11.4, B12 T48 2.57 / 2.67 ->
# 1.70 / 1.70, B16 T32 1.72 / 1.72 -> 1.51 / 1.57, B8 T256 7.61 / 7.95 / 7.84 ->
# 7.79 / 8.06 / 7.54 (tied); H272 B16 T128 6.68 / 6.83 -> 6.32 / 6.34; H320 B8
# T128 5.39 / 5.30 -> 5.03 / 4.87; H352 B8 T128 5.88 / 5.69 -> 5.39 / 5.35; H288
# B8 T128 4.20 / 4.12 -> 4.37 / 4.30 (lost by 2-4% in three runs of four). From
# 24 sequences they went both ways (H256 B24 T128 10.94 -> 11.38, B32 T128 12.51
# -> 10.90; H320 B32 T100 I256 13.48 -> 14.45), and a GRU's from 8 lost (B8 T128
# H352 4.30 / 4.36 -> 5.18 / 5.08, H368 5.32 / 4.74 -> 5.87 / 5.39), so those
# stay by batch. In stretches where the machine ran slow for every contender,
# the lanes by unit, which wait for each other every step, lost (H256 B16 T256
# 16.4 -> 17.6). Nor for RNN-tanh and RNN-relu, whose one matrix a step went
# both ways (tanh T128 H512 B4 1.82 -> 1.99, relu H640 B4 4.07 -> 3.63).
# Measured on the Zen 5 alone.
# Small matrices, large batches. Below the window, an LSTM's or GRU's forward
# alone runs in lanes by batch too where each step's cells are many (batch x
# hidden units, `SMALL_LANE_MIN_CELLS`) and the matrix not tiny
# (`SMALL_LANE_MIN_BYTES`). There one lane's chunked forward ran at or behind
# Flax's scan at B32-B128 H96-H128 (each step's cell fusions, reading a slice
# of the chunk's projection, are split over both threads; step by step they
# were not, and ran at Flax's speed). Forward, float32, I64 unless said, ms, one lane ->
# two, two runs each (Flax's scan in brackets; benchmarks/NOTES.md, session 53):
#   LSTM H128 (256 KiB) B32 T32 1.42 / 1.43 -> 1.03 / 1.04 (1.36), B40 T32 1.60
#   / 1.65 -> 1.19 / 1.20 (1.54), B64 T32 2.74 / 2.71 -> 1.63 / 1.67 (2.67), B128
#   T32 4.84 / 4.68 -> 4.56 / 3.95 (5.2), B32 T100 4.11 / 4.56 -> 3.96 / 3.98
#   (3.86), B64 T100 I128 8.77 / 8.82 -> 6.06 / 6.27 (9.2); H96 B48 1.21 / 1.14
#   -> 0.94 / 0.90 (1.31), B64 1.77 / 1.85 -> 1.14 / 1.14 (1.71), B128 T100 9.89
#   / 9.86 -> 7.06 / 7.33 (9.7); H80 I128 B64 1.55 / 1.51 -> 1.36 / 1.34 (1.80);
#   H64 (64 KiB) B64 0.98 / 1.00 -> 0.77 / 0.80 (1.02), B128 1.71 / 1.73 ->
#   1.29 / 1.27 (1.85);
#   GRU H128 (192 KiB) B64 2.37 / 2.32 -> 1.88 / 1.97 (1.98), B128 3.80 / 3.86
#   -> 2.71 / 2.74 (3.94), B64 T100 I128 7.83 / 7.70 -> 5.13 / 5.17 (7.9); H112
#   B64 1.95 / 2.08 -> 1.63 / 1.65 (1.86); H96 B96 2.14 / 2.17 -> 1.59 / 1.57
#   (2.10), B128 2.54 / 2.75 -> 2.02 / 2.09 (2.59).
# Where the cells were fewer, lanes tied or lost: LSTM H128 B16 0.75 -> 0.77,
# H96 B32 0.87 -> 0.88, H64 B16 0.29 -> 0.30; GRU H128 B32 1.00 -> 1.01 and
# T100 2.71 -> 3.05, H96 B64 1.39 -> 1.39, H64 B128 (48 KiB) 1.34 -> 1.60 (but
# B256 2.90 -> 2.51).
SMALL_LANE_MIN_CELLS = {"lstm": 4096, "gru": 7168}  # batch x units; other cells: none
SMALL_LANE_MIN_BYTES = {"lstm": 64 * 1024, "gru": 96 * 1024}  # of R
LANES = 2
LANE_MIN_BATCH = 8
LANE_WEIGHT_BYTES = (256 * 1024, 2 * 1024 * 1024)  # (above, at most): one direction's R
UNIT_LANE_MIN_BYTES = {"lstm": 1024 * 1024, "gru": 1280 * 1024}  # of R; other cells: none
UNIT_LANE_MAX_BATCH = {"lstm": 16}  # by unit from LANE_MIN_BATCH; other cells: by batch
LANE_DTYPES = frozenset({np.dtype(np.float32)})  # of the products (float16 models': float32)
# bfloat16 products. On the AMX Xeon two lanes by batch lost (above); on the
# Zen 5, whose bfloat16 products are AVX512-BF16 dot products (it has no AMX),
# lanes by unit gained at every batch from 2 sequences where the recurrent
# matrix, in bfloat16, has 384 KiB to 2 MiB: forward, bfloat16, I128, ms, one
# lane / by batch / by unit, in one process (benchmarks/NOTES.md, session 50):
#   LSTM H256 (512 KiB) B16 T256 11.35 / 10.66 / 8.16, B8 T256 12.04 / 18.40 /
#   7.74, B4 T128 5.20 / 8.81 / 3.26, B2 T128 1.94 / 3.38 / 1.86, B8 T32 1.09
#   / 1.80 / 0.76, B64 T32 3.52 / 4.63 / 3.35, B128 T32 7.14 / 8.13 / 6.22,
#   B256 T32 14.53 / 27.06 / 13.76, 3 layers B32 T100 I256 21.38 / 26.72 /
#   20.87; H224 B16 T128 3.95 / 4.20 / 3.43 (B8 2.29 / 3.34 / 2.33); H512 (2
#   MiB) B16 T128 17.52 / 19.23 / 16.32, B64 T32 13.02 / 14.49 / 11.97;
#   GRU H256 (384 KiB) B16 T256 7.98 / 7.69 / 7.20, B64 T32 3.66 / 4.21 / 2.64,
#   B8 T256 5.87 / 5.38 / 4.52, 3 layers B32 T100 I256 22.88 / 20.28 / 17.15;
#   H384 B4 T128 3.36 / 5.21 / 2.96; H512 B16 T128 10.39 / 11.82 / 9.90.
# Below 384 KiB they lost (LSTM H192 B16 T128 3.78 -> 4.43, H208 3.54 -> 5.05;
# GRU H240 3.23 -> 4.94, B8 2.12 -> 3.05), and above 2 MiB they gained little
# or lost (LSTM H576 7.65 -> 7.32, H768 B16 T64 13.44 -> 14.41, H1024 28.18 ->
# 32.73; GRU H640 7.13 -> 7.21, H1024 19.32 -> 22.79); one sequence tied (LSTM
# H256 B1 1.73 -> 1.73). RNN-tanh and RNN-relu went both ways (tanh B4 T128
# H512 2.38 -> 1.70, relu B64 T32 H512 2.69 -> 3.05) and keep one lane; so
# does a CPU that multiplies bfloat16 with neither AMX nor AVX512-BF16 (not
# measured), or whose flags are unknown (`_cpu.bfloat16_products`).
# On the 2-core Xeon with AMX (session 60), lanes by unit gained in that
# window at every shape measured but one, which tied (the 3 layers under
# 0.10.2), under jax 0.10.2 and 0.12.0.1 alike (one
# lane / by unit, ms, 0.10.2, then 0.12.0.1 where given; 15 interleaved
# rounds): LSTM H256 B16 T256 20.03 / 14.72, 22.07 / 16.18; B64 T32 5.61 /
# 4.88, 6.83 / 5.13; 3 layers B32 T100 I256 35.60 / 35.22, 44.79 / 38.18; B8
# T256 14.03 / 9.34, 17.70 / 10.20; B4 T128 5.94 / 3.92; B2 T128 5.55 / 3.50,
# 6.31 / 3.80; B8 T32 2.20 / 1.76, 2.42 / 1.72; B128 T32 10.50 / 9.05, 12.75 /
# 9.81; H224 B16 T128 8.20 / 6.38, B8 6.26 / 4.47; H512 B16 T128 26.83 /
# 20.21, 25.16 / 19.19, B64 T32 13.91 / 12.73, 13.73 / 12.32; GRU H256 B16
# T256 14.44 / 13.58, 15.02 / 14.47; B64 T32 5.51 / 4.21, 5.59 / 4.29; 3
# layers 35.54 / 28.45, 36.80 / 29.54; B8 T256 9.49 / 8.06; H384 B4 T128 6.85
# / 5.95, 8.88 / 7.06; H512 B16 T128 15.36 / 13.96, 17.60 / 14.97. Outside it
# as on the Zen 5: LSTM H256 B1 T128 2.79 / 2.73; above 2 MiB LSTM H576 B16
# T64 13.17 / 12.37, H768 22.67 / 22.08, H1024 40.92 / 44.84, GRU H592 10.87 /
# 10.52, H640 11.13 / 11.07, H1024 29.49 / 29.33; below 256 KiB LSTM H128 B8
# T32 I64 0.54 / 0.77, B64 3.37 / 3.05, H160 B64 T100 12.59 / 11.27, GRU
# H192 B16 T128 5.55 / 4.99. Inside it, through the library (the rule
# against one lane, 21 rounds), under jax 0.10.2 an LSTM's lanes tied or lost
# at 32-48 sequences with a 256-wide input: B32 T100 I256 H256 17.54 /
# 17.36, 14.00 / 15.03, 3 layers 40.99 / 41.19, 39.49 / 42.78, 40.65 / 47.32,
# 41.75 / 46.10, 39.04 / 41.57, B48 T100 I256 21.23 / 21.93, B32 T32 I128 5.61
# / 5.78 (but I128 T100 B24-B64 1.22-1.25x, e.g. B32 12.12 / 9.81); under
# 0.12.0.1 those 3 layers gained (54.12 / 47.02). The GRU B16 T256 I128 H256
# went both ways (16.44 / 17.22, 17.05 / 15.81, 17.43 / 18.56). Kept for the
# window's gains elsewhere, and for jax 0.12, the newest for Python 3.12.
BFLOAT16_UNIT_LANE_BYTES = (384 * 1024, 2 * 1024 * 1024)  # of R in bfloat16, both included
BFLOAT16_UNIT_LANE_MODES = frozenset({"lstm", "gru"})
# Below that window, from 256 KiB (LSTM H182-H221, GRU H210-H255), lanes by
# unit gained over 24 to 112 sequences (or tied: GRU H248 B24 T32), and went
# both ways outside them. There YNNPACK splits many of one lane's per-step
# products over the two cores, and the caller waits for the other
# (`SlinkyThreadPool::Await`: a bare loop of an LSTM's product, B64, waited on
# 26 of 32 steps at H192, on 7 at H224), by the product's shape in no order
# found: one lane, T32 I64 B64, ms: H176 2.04, H192 3.31, H216 5.80, H224
# 2.69. Forward, bfloat16, ms, one lane / by unit, two runs each
# (benchmarks/NOTES.md, session 55):
#   LSTM T32 I64 B32: H184 1.84 / 1.26, H192 1.60 / 1.17, H200 2.71 / 1.42,
#   H208 3.18 / 2.60, H216 3.80 / 3.01; B64: 2.93 / 2.23, 3.31 / 2.03, 2.97 /
#   2.47, 3.31 / 2.30 (5.04 / 4.18 in one run), 5.80 / 4.59; T100 I64 B48:
#   13.4 / 9.1, 13.1 / 9.3, -, 8.4 / 5.4, 7.7 / 5.8; T64 I128 H192 B24 2.88 /
#   1.97, B112 10.1 / 7.3; T50 I256 H208 B64 7.0 / 4.8; GRU T64 I128 H224 B32
#   4.6 / 2.6, H240 B64 7.4 / 5.1; T32 I64 H232 B48 2.38 / 1.86, H248 B96
#   4.18 / 3.56; T100 I64 H224 B112 13.1 / 10.4;
# but outside those batches: LSTM B16 T128 I128 H192 3.53 / 4.28, H208 3.54 /
# 4.97; B16 T32 I64 H192 0.96 / 1.04; B128 T32 I64 H216 5.04 / 6.53; GRU
# B128 T100 I64 H224 22.4 / 23.2; and below 256 KiB the LSTM lost (T100 I64
# H160 B64 5.46 / 7.65, H176 B32 3.82 / 4.54; T32 I64 H128 B128 2.46 / 3.37),
# gaining at a few batches only (T32 I64 H176 B64 2.04 / 1.85, H128 B32 1.16 /
# 1.03).
# On the AMX Xeon (session 60) that narrower window gained from 48 sequences
# under both jax versions, and from 24 under jax 0.10.2 alone (one lane / by
# unit, ms, 0.10.2 / 0.12.0.1): LSTM T32 I64 H192 B64 5.84 / 4.01, 5.87 /
# 4.25; T100 I64 H200 B48 14.56 / 9.94, 14.59 / 10.83; T64 I64 H220 B112 16.70
# / 15.75, 17.94 / 15.35; GRU T32 I64 H232 B48 4.60 / 3.46, 4.20 / 3.44; T64
# I128 H240 B64 11.78 / 8.19, 11.22 / 7.95; T32 I64 H248 B96 7.36 / 6.90,
# 6.71 / 6.30; T100 I64 H224 B112 22.53 / 18.59, 22.59 / 17.45; but below 48
# under 0.12.0.1: LSTM T32 I64 H184 B24 3.81 / 2.41, 2.07 / 3.05; GRU T64 I128
# H224 B32 7.08 / 4.32, 5.00 / 6.27 (and 4.58 / 6.57); T32 I64 H216 B24 3.76
# / 3.24, 2.07 / 2.27. At B16 it lost there too (LSTM H192 B16 T128 6.52 /
# 7.40, GRU H240 B8 T256 8.70 / 10.49).
BFLOAT16_NARROW_UNIT_LANE_BYTES = 256 * 1024  # of R in bfloat16, included
BFLOAT16_NARROW_UNIT_LANE_BATCH = {"avx512_bf16": (24, 112), "amx": (48, 112)}  # both included


def forward_lanes(mode, operands, xs, R) -> str | None:
  """How the forward alone of a `mode` layer over `xs` (its inputs, a tuple
  over directions) runs in `LANES` lanes: "units" (`_forward_in_unit_lanes`)
  or "batch" (`_forward_in_batch_lanes`) where the comments above say (for a
  matrix below `LANE_WEIGHT_BYTES`, `SMALL_LANE_MIN_CELLS`), else None (one
  lane). `operands`: `operand_dtype` of the model; `R` its recurrent
  weights in the computation dtype. The window's bytes are those of `R` as the
  products read it: float32 (float16 models too), or bfloat16."""
  steps, batch = xs[0].shape[:2]
  products = np.dtype(R[0].dtype if operands is None else operands)
  bfloat16 = products == np.dtype(jnp.bfloat16)
  if len(xs) != 1 or not (products in LANE_DTYPES or bfloat16):
    return None
  if not all(isinstance(n, (int, np.integer)) for n in (steps, batch)):
    return None  # symbolic (a shape-polymorphic `jax.export`)
  if steps < MIN_CHUNKED_STEPS or jax.default_backend() != "cpu" or jax.device_count() != 1:
    return None
  nbytes = R[0].size * products.itemsize
  if bfloat16:
    kind = _cpu.bfloat16_products()
    if mode not in BFLOAT16_UNIT_LANE_MODES or kind not in BFLOAT16_NARROW_UNIT_LANE_BATCH:
      return None
    low, high = BFLOAT16_UNIT_LANE_BYTES
    fewest, most = BFLOAT16_NARROW_UNIT_LANE_BATCH[kind]
    window = (low <= nbytes <= high and batch >= LANES) or (
        BFLOAT16_NARROW_UNIT_LANE_BYTES <= nbytes < low and fewest <= batch <= most)
    return "units" if window else None
  units = nbytes >= UNIT_LANE_MIN_BYTES.get(mode, np.inf)
  if batch >= LANE_MIN_BATCH:
    low, high = LANE_WEIGHT_BYTES
    if nbytes <= low:
      cells = batch * R[0].shape[0]
      small = (nbytes >= SMALL_LANE_MIN_BYTES.get(mode, np.inf)
               and cells >= SMALL_LANE_MIN_CELLS.get(mode, np.inf))
      return "batch" if small else None
    if nbytes > high:
      return None
    return "units" if units and batch <= UNIT_LANE_MAX_BATCH.get(mode, 0) else "batch"
  return "units" if units and batch >= LANES else None


def _forward_in_batch_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR):
  """`_forward` without coefficients, each direction's batch cut into `LANES`
  parts that run as directions of their own (each with its part of the
  `valid` mask), joined after."""
  B, lanes = xs[0].shape[1], LANES
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
  into `LANES` parts: each lane holds its units' columns of every gate of the
  weights and biases (its units of the input itself under skip_input, W
  None) and its units' part of the states, and multiplies the whole state
  each step (`joined`). The parts are joined after."""
  (x,), (r,) = xs, R
  H, g, lanes = r.shape[0], _spec.NUM_GATES[mode], LANES
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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1))
def _layer(mode, operands, xs, valid, h0, c0, W, R, bW, bR):
  lanes = forward_lanes(mode, operands, xs, R)
  if lanes == "batch":
    return _forward_in_batch_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR)
  if lanes == "units":
    return _forward_in_unit_lanes(mode, operands, xs, valid, h0, c0, W, R, bW, bR)
  ys, hT, cT, _ = _forward(mode, operands, xs, valid, h0, c0, W, R, bW, bR, coefficients=False)
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


def _layer_jvp(mode, operands, primals, tangents):
  xs, valid, h0, c0, W, R, bW, bR = primals
  txs, _, th0, tc0, tW, tR, tbW, tbR = tangents
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
  dot_general, matmul, round_ = _products(operands)
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


def run_layer(spec, x, h0, c0, blocks, layer, seq_lengths):
  """`_reference._run_layer` over this file's recurrence, for `spec`'s dtype;
  `blocks` the `_reference.param_blocks` of the opaque buffer."""
  recurrence = lambda mode, *args: _layer(mode, operand_dtype(spec.dtype), *args)
  return _reference._run_layer(spec, x, h0, c0, blocks, layer, seq_lengths,
                               recurrence=recurrence)


rnn = functools.partial(_reference.rnn, run_layer=run_layer)
