"""Which lanes the "xla" path's forward alone runs in, on a CPU.

`_xla._layer` runs a layer's forward alone either in one lane (one
recurrence per direction) or in `LANES` lanes, by batch
(`_xla._forward_in_batch_lanes`) or by hidden unit
(`_xla._forward_in_unit_lanes`); `forward_lanes` decides which, by the
rules below and the measurements behind them.

DESIGN §4 has no module for this: the "xla" path (`_xla.py`, itself a departure
from DESIGN's layout, its docstring says why) keeps its computation there and
its measured rules here and in `_chunks.py`, each file one idea.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cudnn_rnn import _chunks, _cpu, _rounded_dot

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
# bfloat16 operands (`_xla.operand_dtype`), whose products are quick on that
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
# A core's L2 cache. On a 2-core Zen 3 (AVX2, 512 KiB of L2 a core), the
# window's lanes from 8 sequences lost or tied at an LSTM's H256 (1 MiB), where
# the Xeon's (2 MiB of L2) and the Zen 5's (1 MiB) gained; below it they gained
# or tied. Forward, float32, ms, one lane / by batch / by unit, in one process,
# 15 interleaved rounds (benchmarks/NOTES.md, session 65):
#   LSTM H256 B64 T32 I128 25.8 / 29.8 / 26.9 and 19.7 / 24.0 / 23.1 (Flax's
#   scan 25.6, 22.1); B16 T256 I128 55.4 / 65.6 / 54.5; B32 T100 I128 42.6 /
#   42.5 / 41.9; 3 layers B32 T100 I256 120.8 / 125.5 / 120.4;
#   LSTM H224 (784 KiB) B64 T32 I64 16.1 / 15.7 / 16.5; H192 B32 T32 I64 7.0 /
#   5.1 / 10.0; GRU H256 (768 KiB) B8 T256 I128 23.6 / 20.1 / 22.3, B16 T256
#   43.3 / 40.2 / 34.7, B64 T32 17.1 / 17.0 / 17.3.
# So from 8 sequences lanes run only where the matrix has less than
# `LANE_L2_MULTIPLE` times a core's L2 cache (`_cpu.l2_bytes`; no bound where
# it is unknown). On the Xeon and the Zen 5 that bound lies at or above the
# window's top and changes nothing measured there (on the Xeon an LSTM's H512,
# 4 MiB, twice its L2, lost: above). Below 8 sequences (lanes by unit) the
# rule is unchanged: on the Zen 3 its lanes went both ways (T128 I128, one lane
# -> by unit: LSTM H256 B4 14.0 -> 12.6, B2 7.68 -> 7.73, H320 B4 14.5 -> 16.0;
# GRU H384 B4 16.0 -> 14.1).
LANE_L2_MULTIPLE = 2
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
# Where a CPU multiplies the rounded bfloat16 operands in float32
# (`_rounded_dot.float32_products`: the Xeon without AMX, session 69), the
# window above kept its gains and this narrower one lost them (forward, ms,
# one lane / by batch / by unit, forced): LSTM B16 T256 I128 H256 37.7 / 44.8
# / 31.6, B64 T32 I128 H256 15.0 / 17.7 / 13.6, GRU B16 T256 I128 H256 34.1 /
# 38.8 / 22.9; but LSTM B32 T32 I64 H192 5.60 / 5.83 / 7.56, GRU B32 T64 I128
# H224 9.56 / 9.06 / 12.06. There it takes the window above only (lanes run
# from 32 steps, as float32 products do: `_xla.WIDEN_MIN_STEPS`).
BFLOAT16_NARROW_UNIT_LANE_BYTES = 256 * 1024  # of R in bfloat16, included
BFLOAT16_NARROW_UNIT_LANE_BATCH = {"avx512_bf16": (24, 112), "amx": (48, 112)}  # both included


def forward_lanes(mode, operands, xs, R) -> str | None:
  """How the forward alone of a `mode` layer over `xs` (its inputs, a tuple
  over directions) runs in `LANES` lanes: "units"
  (`_xla._forward_in_unit_lanes`) or "batch" (`_xla._forward_in_batch_lanes`)
  where the comments above say (for a matrix below `LANE_WEIGHT_BYTES`,
  `SMALL_LANE_MIN_CELLS`; float32 products from `LANE_MIN_BATCH` sequences
  only below `LANE_L2_MULTIPLE` times a core's L2 cache), else None (one lane). `operands`:
  `_xla.operand_dtype` of the model; `R` its recurrent weights in the
  computation dtype. The window's bytes are those of `R` as the products read
  it: float32 (float16 models too), or bfloat16."""
  steps, batch = xs[0].shape[:2]
  products = np.dtype(R[0].dtype if operands is None else operands)
  bfloat16 = products == np.dtype(jnp.bfloat16)
  if len(xs) != 1 or not (products in LANE_DTYPES or bfloat16):
    return None
  if not all(isinstance(n, (int, np.integer)) for n in (steps, batch)):
    return None  # symbolic (a shape-polymorphic `jax.export`)
  if steps < _chunks.MIN_CHUNKED_STEPS or not _cpu.sole_device():
    return None
  nbytes = R[0].size * products.itemsize
  if bfloat16:
    kind = _cpu.bfloat16_products()
    if mode not in BFLOAT16_UNIT_LANE_MODES or kind not in BFLOAT16_NARROW_UNIT_LANE_BATCH:
      return None
    low, high = BFLOAT16_UNIT_LANE_BYTES
    fewest, most = BFLOAT16_NARROW_UNIT_LANE_BATCH[kind]
    narrow = not _rounded_dot.float32_products(products)
    window = (low <= nbytes <= high and batch >= LANES) or (
        narrow and BFLOAT16_NARROW_UNIT_LANE_BYTES <= nbytes < low and fewest <= batch <= most)
    return "units" if window else None
  units = nbytes >= UNIT_LANE_MIN_BYTES.get(mode, np.inf)
  if batch >= LANE_MIN_BATCH:
    low, high = LANE_WEIGHT_BYTES
    l2 = _cpu.l2_bytes()
    if l2 is not None and nbytes >= LANE_L2_MULTIPLE * l2:
      return None
    if nbytes <= low:
      cells = batch * R[0].shape[0]
      small = (nbytes >= SMALL_LANE_MIN_BYTES.get(mode, np.inf)
               and cells >= SMALL_LANE_MIN_CELLS.get(mode, np.inf))
      return "batch" if small else None
    if nbytes > high:
      return None
    return "units" if units and batch <= UNIT_LANE_MAX_BATCH.get(mode, 0) else "batch"
  return "units" if units and batch >= LANES else None
