"""How many steps the "xla" path's forward projects at a time: its chunks.

`_xla._chunked_scan` runs the forward recurrence as a scan over chunks of
steps, each projecting its chunk's inputs in one matmul and then running its
steps unrolled (`_xla`'s docstring says why). This module holds the rule for
the chunks' length, with the measurements behind it.

Compiling takes about twice as long (the unrolled steps), so sequences shorter
than `MIN_CHUNKED_STEPS` (32), and numbers of steps with no divisor in [4, 16],
run step by step, as the reference does. The chunks are near 8 steps for the
forward alone (`INFERENCE_CHUNK`; near 16 for a GRU's from 64 steps on, and for
the other cells' in lanes, `inference_chunk`; step by step for an LSTM's or
a GRU's in one lane with small matrices, `forward_chunk`) and near 4 for the
forward of the derivative (`DERIVATIVE_CHUNK`, training; step by step for a
small matrix over many sequences, `derivative_chunk`): there the forward is a
smaller part of the work, and chunks of 4 measured as fast as chunks of 8-10 in
forward+backward (ms: LSTM B32 T100 I256 H256 2 bidirectional layers 307 vs
305, step by step 327; GRU, same shape, 378 vs 378; LSTM B16 T256 I128 H256 106
vs 108; GRU, same shape, 96 vs 94; LSTM B64 T32 I128 H256 31 vs 33; the
bfloat16 LSTM B16 T256 57 vs 58), and compiled in 16-33% less time (s: the LSTM
B16 T256 0.88 -> 0.59, the 2-layer LSTM 1.60 -> 1.09, a 3-layer GRU B32 T100
1.18 -> 0.99, the bfloat16 LSTM B8 T32 I64 H128 0.93 -> 0.68;
benchmarks/NOTES.md, session 18). For the forward alone, 4-step chunks were 5%
slower than 10-step ones (80.0 vs 75.8 ms, step by step 108.5, at the 2-layer
LSTM shape).

DESIGN §4 has no module for this: the "xla" path (`_xla.py`, itself a departure
from DESIGN's layout, its docstring says why) keeps its computation there and
its measured rules here and in `_lanes.py`, each file one idea.
"""

from __future__ import annotations

import jax
import numpy as np

# Shorter sequences run step by step: there the unrolled steps' compile time
# (about twice the step-by-step scan's) outweighs the little they save.
MIN_CHUNKED_STEPS = 32
# The chunk length sought: for the forward alone, and for the forward that the
# derivative runs (with the coefficients), where shorter chunks compile faster
# for the same speed (the module docstring).
INFERENCE_CHUNK = 8
DERIVATIVE_CHUNK = 4
# A GRU's forward alone over `LONG_STEPS` steps or more seeks chunks of
# `LONG_CHUNK`; in lanes (`_lanes.forward_lanes`), so does every other cell's
# forward at any length. On a 2-core Xeon (AMX) the GRU's chunk-8 forward ran at one
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
  batch in `lanes` lanes (`_lanes.forward_lanes`): for a GRU, `LONG_CHUNK` from
  `LONG_STEPS` steps on; for the other cells, `LONG_CHUNK` in lanes; else
  `INFERENCE_CHUNK`."""
  if not isinstance(steps, (int, np.integer)):
    return INFERENCE_CHUNK
  if mode == "gru":
    return LONG_CHUNK if steps >= LONG_STEPS else INFERENCE_CHUNK
  return LONG_CHUNK if lanes > 1 else INFERENCE_CHUNK


# The forward alone of an LSTM or a GRU in one lane goes step by step where its
# recurrent matrix has 32-64 Ki elements (LSTM H91-H128, GRU H105-H147) and its
# input matrix at most 64 Ki (I x gH: I up to 128 at an LSTM's H128, 170 at a
# GRU's). There the chunks lost. Traced on a 2-core Xeon (jax 0.10.2, LSTM B16
# T50 I64 H128): YNNPACK splits a chunk's projection (`[160, 64] x [64, 512]`)
# over the thread pool, whose worker, asleep since the last chunk, took about
# 70 us to start while the loop's thread waited; it splits none of the per-step
# products of that size (`[16, 64] x [64, 512]`, `[16, 128] x [128, 512]`),
# each of which took about a tenth of the chunk's projection, so a step by step
# loop, whose 8 operations XLA:CPU also runs on one thread without its
# concurrent executor, spent less (2.13 against 2.48 ms in the loop; 5 against
# 9 voluntary context switches a call). Forward, float32, interleaved in one
# process, ms, chunks -> step by step (two processes where two figures;
# benchmarks/NOTES.md, session 68): B16 T50 I64 H128 3.47 -> 2.90, 3.18 ->
# 2.73; with seq_lengths 3.12 -> 2.69, 3.18 -> 2.72; bidirectional 6.40 ->
# 5.74; two layers 7.52 -> 6.51; bfloat16 3.83 -> 3.64; B24 T64 5.04 -> 4.68,
# 5.28 -> 4.77; B31 T40 I100 H112 5.11 -> 4.21, 5.19 -> 4.12; B16 T256 I128
# 15.61 -> 15.04, 15.84 -> 15.21; B16 T32 2.11 -> 2.01, 2.10 -> 1.98; B12 T48
# 2.32 -> 2.20, 2.29 -> 2.16; B8 T100 I128 3.62 -> 3.37, 3.61 -> 3.40; H96 B24
# T64 3.79 -> 3.61, 3.31 -> 3.24; even at B4 T64 (1.05 -> 1.06, 1.20 -> 1.20),
# B8 T32 (1.26 -> 1.24) and bidirectional I128 (7.43 -> 6.98, 7.10 -> 7.11). On
# one core (`taskset -c 0`) too: B16 T50 2.62 -> 2.44, B8 T32 0.73 -> 0.69.
# Outside the window step by step lost where a step's own products are split
# too: I256 H128 (`[16, 256] x [256, 512]`) B16 T100 11.1 -> 13.4; H160 B16 T64
# 3.89 -> 5.95; two bidirectional layers B16 T50 I64 H128 (the second's input
# 256 wide) 14.4 -> 19.0 (with the rule, which keeps the second layer's chunks,
# 16.1 -> 15.8). It gained nothing at H64 (B16 T64 I32 1.27 -> 1.29) or I192
# H128 (4.65 -> 4.60); in lanes by batch it went both ways (LSTM B64 T32 I64
# H128 5.86 -> 6.58, B32 T100 I128 H128 12.95 -> 12.30), so lanes keep their
# chunks. The GRU's forward, one lane, the same way: B16 T50 I128 H128 3.31 ->
# 2.80 (its `[160, 128] x [128, 384]` projection split), with seq_lengths 3.00
# -> 2.69, bidirectional 6.29 -> 5.79; B24 T64 I128 6.14 -> 5.07; B31 T40 I100
# H112 3.43 -> 3.19; B16 T64 I170 4.04 -> 3.71; B32 T100 I128 10.23 -> 9.91;
# B16 T256 I128 12.34 -> 12.09; B8 T32 I64 0.99 -> 0.95; B16 T50 I64 2.20 ->
# 2.11 and 2.25 -> 2.20 (that projection, `[160, 64] x [64, 384]`, is not
# split); bfloat16 B16 T50 I128 3.90 -> 3.92; H160 (outside) B16 T50 I64 3.85
# -> 3.67. Which products YNNPACK splits is its own choice (at jax 0.10.2, for
# 512 columns: from 144 rows at up to 128 deep, from 96 at 192, at any at 256),
# free to change.
STEP_FORWARD_WEIGHTS = (32 * 1024, 64 * 1024)  # elements of R, both included
STEP_FORWARD_MAX_INPUT_WEIGHTS = 64 * 1024  # elements of W
STEP_FORWARD_MODES = frozenset({"lstm", "gru"})


def forward_chunk(mode: str, xs, W, R, lanes: int = 1) -> int:
  """The steps per chunk of the forward alone of a `mode` layer over `xs`
  (its inputs, a tuple over directions) with input and recurrent weights `W`
  (None without an input matrix) and `R`, its batch in `lanes` lanes: 1 (step
  by step) where the comment above says, else `chunk_steps` near
  `inference_chunk`."""
  steps = xs[0].shape[0]
  low, high = STEP_FORWARD_WEIGHTS
  if (mode in STEP_FORWARD_MODES and lanes == 1 and low <= R[0].size <= high
      and (W is None or W[0].size <= STEP_FORWARD_MAX_INPUT_WEIGHTS)
      and jax.default_backend() == "cpu"):
    return 1
  return chunk_steps(steps, inference_chunk(mode, steps, lanes))


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
