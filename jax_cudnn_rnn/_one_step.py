"""A single one-step call that multiplies the opaque buffer where it lies:
the whole buffer at once, a one-layer model of I = H its blocks, or, for one
sequence or a few, each matrix in place.

DESIGN §4 has no module for this: it is one rule of the "xla" path's forward
(`_xla._layer`), kept here beside its measurements, as `_lanes` and `_chunks`
keep theirs.

A one-step call (T = 1: decoding, one jitted call per token) multiplies each
weight matrix once. Read from the opaque buffer, a matrix is a slice, and
XLA:CPU copies a slice that a product reads: for a GRU I256 H256 two 768 KiB
copies, memory-bound, which took longer than the products (traced, B8: the
copies 54 + 113 us, the products 98 + 65; benchmarks/NOTES.md, session 74).
Viewed as `[N/k, k]`, the whole buffer is a bitcast, not a copy, and where
`k` divides the buffer's size and a block's offset, the block is whole rows
of that view. Every size and offset is a multiple of H (a matrix holds
`g*H` rows, a bias `H` elements a gate), so each state multiplies the view
`H` wide as it is; the input multiplies the view as wide as itself where that
holds rows (`_input_piece`), else the view as wide as the greatest common
divisor of its size and H, cut into pieces that wide. Where the two views are
one (I = H), the input and the states multiply it side by side in one product
(`P @ [x; h]^T`). Each matrix's product is then its rows of the small result,
and of those the columns of the pieces it meets. That multiplies every row of
the buffer by every piece (for one layer of I = H, twice the products'
arithmetic, and every other layer's rows besides), which a small batch does
not notice where the copies dominate.

Where it gained, and where it did not. In a loop that closes over its weights
(a decoder's `lax.scan` of one-step calls) XLA hoists the slices' copies out
of the loop, and the whole buffer multiplied every step lost (session 51: GRU
B32 I256 H256 146.8 -> 204.6 us a token, LSTM B8 I64 H128 15.0 -> 30.1); a
call that sees such a loop (`_xla.weights_from_enclosing_trace`) keeps the
slices (but for one sequence's matrix-vector products, below). A single
jitted call, on the 2-core Xeon with AMX, float32, each pair interleaved in
one process, us, the slices -> the whole buffer (Flax's cells;
benchmarks/NOTES.md, session 75):
- one layer, I = H = 256 (one view, 256 wide): GRU B1 (two layers) 559 ->
  424 (306), B4 609 -> 337 (221), B8 570 -> 278 (239), B16 710 -> 424 (454),
  B32 857 -> 688 (582); LSTM B1 (two layers) 813 -> 644 (820), B8 796 -> 319
  (880), B16 945 -> 548 and 843 -> 524, B24 815 -> 725, but B32 970 -> 1083,
  1122 -> 1184 and 923 -> 1104; tanh B8 587 -> 277, relu B32 645 -> 395; bidirectional GRU B8 899 ->
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
- the input's view 128 wide, in one process, and the state's 256 wide (the
  greatest common divisor before, in the second process of the next item):
  GRU I128 H256 B32 663 -> 546 (392), B16 551 -> 294 (344; before 543 ->
  531), B8 441 -> 273 (198); LSTM B8 689 -> 374 (690), B16 465 -> 379 (640);
  GRU I256 H512 B8 941 -> 677 (528). The states' and the input's products
  apart, where the views are one, lost (one product -> two, LSTM I = H = 256
  B1 272 -> 392, B8 359 -> 474, B16 526 -> 611; GRU B8 272 -> 367);
- every view 128 wide (before the state's view was as wide as the state), in
  two processes: LSTM I128 H128 B1 316 -> 234 and 219 -> 181, B8 927 -> 540
  and 479 -> 330, B16 470 -> 390 and 289 -> 226; LSTM I128 H256 B8 497 -> 339
  and 412 -> 326, B12 860 -> 612 and 605 -> 481; GRU I128 H256 B8 1186 -> 1283
  and 427 -> 321 (in two earlier processes 497 -> 357, 708 -> 359), B16 621 ->
  547 and 543 -> 531; GRU I256 H128 B4 248 -> 217 and 220 -> 182. But smaller
  matrices lost, whose slices copy quickly: GRU I128 H128 B8 169 -> 198 and
  102 -> 159 (one direction's matrices 96 Ki elements; session 74, 158 ->
  184), B1 189 -> 250; tanh I128 H256 B8 166 -> 210 and 137 -> 175 (96 Ki),
  I256 H128 229 -> 470 (48 Ki); and at B32 (`extra_products` 64) LSTM I128
  H256 919 -> 1131 (session 51: 264 -> 389, the GRU 223 -> 258; with the
  state's own view, 32, 892 -> 771, yet LSTM I = H = 256 B32, also 32, lost).
  Views of 64 went both ways (LSTM I64 H128 B8 857 -> 470, B1 158 -> 175; GRU
  I64 H512 B8 1431 -> 2384).
Hence `MIN_PIECE`, `MIN_ELEMENTS` and `MAX_EXTRA_PRODUCTS` (an LSTM's lower:
its B32 at I = H = 256 lost).
Measured for float32 models on a CPU only: other dtypes, and other backends,
keep the slices.

The blocks. Where every matrix is H wide (one layer, linear input, I = H),
each matrix and its gates' biases make `g*H + g` rows of the `[N/H, H]`
view, and the buffer, a bitcast, falls into `[2D, g*H + g, H]`, a block a
matrix: block `j` holds matrix `j` but its first `j*g` rows, which end block
`j - 1`. One batched product multiplies each block by its own matrix's
vector (the input, or its direction's state), the layer's own arithmetic and
the biases' rows' (half the whole buffer's), and the few rows in the block
before multiply their vector apart, from a slice of `j*g` rows
(`_block_products`). decode.py's step on the 2-core Zen 4, one process a
line, us, before (the whole buffer, or the slices past its bounds) -> the
blocks (Flax's cells), paired round by round (benchmarks/NOTES.md, session
98): under jax 0.10.2, GRU I = H = 256 B8 188.5 -> 136.3 (163.6; 0.74x), B16
365.1 -> 300.2 (0.77x), B32 445.9 -> 348.3 (0.79x; a first draft), B64 709.3 -> 661.6
(0.92x); LSTM B4 152.1 -> 122.5 (0.84x), B8 214.2 -> 199.9 (0.91x), B32
(the slices) 564.7 -> 406.4 (0.74x; the draft); LSTM I = H = 128 B16 211.5 -> 172.9
(0.82x); GRU I = H = 512 B32 1582.2 -> 1165.8 (0.73x); LSTM I = H = 1024 B8
2698.0 -> 1845.7 (0.67x); bidirectional GRU I = H = 256 B8 381.6 -> 268.6
(0.68x), LSTM 458.0 -> 340.6 (0.73x); level at GRU I = H = 256 B4 (1.02x,
0.98x), LSTM I = H = 128 B128 (1.05x, 1.00x), GRU I = H = 256 B256 (1.03x).
Under jax 0.12.1, whose XLA:CPU hands the batched product to YNNPACK, small
products lost: GRU I = H = 256 B2 193.6 -> 232.3 (1.19x), B4 182.1 -> 230.7
(1.24x), B8 208.6 -> 210.9 (1.10x; 1.06x in another process); LSTM I = H =
128 B8 154.6 -> 176.4 (1.16x), B32 237.9 -> 256.6 (1.04x); larger ones
gained: GRU I = H = 256 B16 301.8 -> 283.4 (0.95x), B32 517.2 -> 477.3
(0.85x); LSTM B16 371.7 -> 320.3 (0.85x), B32 746.3 -> 530.6 (0.74x); LSTM I
= H = 128 B128 760.0 -> 649.3 (0.87x); GRU I = H = 512 B8 437.2 -> 386.1
(0.86x); bidirectional LSTM B16 660.0 -> 541.5 (0.82x); and so under jax
0.11.2 (GRU I = H = 256 B16 389.0 -> 334.5). Hence `BLOCKS_MIN_BATCH`, and,
from jax 0.11 (`fuses_matvec` false), `BLOCKS_MIN_PRODUCTS` multiplications
a matrix (`g*H*H*B`). The blocks multiplied the other way round (the
vectors by the blocks, no transpose after) lost under jax 0.12.1 (GRU I = H
= 256 B8 1.17x, B4 1.41x). With more layers the blocks do not hold one
layer's matrices alone: the batched product over every layer's blocks, or
over the layer's blocks sliced out (a copy), went both ways (jax 0.10.2,
against the whole buffer: GRU two layers I = H = 256 B8 0.78x / 0.79x, LSTM
0.89x / 0.77x, GRU three layers B16 1.56x / 0.96x, LSTM two layers I = H =
128 B4 1.06x / 1.22x), and those keep the whole buffer's rule.

One sequence (B = 1) multiplies each matrix where it lies instead, as
`v @ m^T` for the slice `m` of the flat buffer, which XLA:CPU fuses, slice,
transpose and all, into one kernel of matrix-vector products
(`copy_dot_fusion`): nothing copied, and no row read but the matrix's own,
where the whole buffer's product reads every layer's rows for each layer (a
two-layer model's twice). Written as one `dot_general` contracting `m`'s
rows, the same product, XLA copied the slice out first and gained nothing
(a two-layer GRU I256 H256 call 391 -> 413 us).
The products go through a barrier, else XLA fuses an LSTM's two into one
kernel that needs the transposed matrix (a two-layer LSTM B1 I256 H256 call
took 1370 us so, 498 with the whole buffer). A batch of more than one gets
no such fusion: XLA copies the slice first. A single jitted call on the
2-core Zen 3, us, the whole buffer (or, in brackets where its bounds turn it
down, the slices) -> the matrix-vector products (Flax's cells), one process
a line, 400-600 calls in 20-30 interleaved rounds (benchmarks/NOTES.md,
session 92):
- more than one layer: GRU I256 H256 two layers 413 -> 323 (240), 409 -> 329
  (238); LSTM the same 508 -> 405 (830), 514 -> 389 (805); LSTM I64 H128
  three layers (365) -> 129 (389); LSTM I512 H512 four layers 10130 -> 2581
  (25560); GRU H256 I128 two layers 594 -> 273; two bidirectional GRU layers
  I = H = 256 914 -> 571;
- one layer below the bounds (the slices): LSTM I64 H128 (151) -> 73 (154),
  GRU (93) -> 71 (85); LSTM H256 I64 (516) -> 229, GRU (260) -> 190; GRU I32
  H32 (71) -> 72 (93);
- one layer within them: tanh I = H = 256 213 -> 114; LSTM I = H = 128 216
  -> 82; LSTM I = H = 256 286 -> 263 (423), 254 -> 217, 234 -> 235; GRU 249 ->
  242 (170); GRU I = H = 512 420 -> 411 (336), 347 -> 316; LSTM I = H = 1024
  2265 -> 2213 (27062); GRU H512 I256 354 -> 320, 402 -> 375, 336 -> 296;
  GRU H512 I128 341 -> 286; GRU H384 I128 241 -> 210; LSTM H384 I128 284 ->
  239; GRU H128 I256 102 -> 85; bidirectional: LSTM I = H = 256 339 -> 332,
  GRU 256 -> 233, GRU H256 I128 280 -> 226;
- but a lone layer over a small buffer whose input is narrower than its
  state lost: GRU H256 I128 164 -> 194, 165 -> 210, 128 -> 158, 154 -> 200,
  144 -> 193 (Flax's 120-159); LSTM the same 177 -> 233, 178 -> 238, 175 ->
  235, 160 -> 212; LSTM H192 I128 133 -> 178. Those kept the whole buffer
  until the products were cut in blocks (below).
On one core (`taskset`) the float32 products gained there too (GRU H256
I128 156 -> 132; I = H = 256 220 -> 148; two layers 537 -> 218): XLA:CPU's
`ParallelTaskAssigner` splits a loop kernel that its cost model deems bound
by memory over two threads from 512 KiB of bytes accessed (256 KiB a
thread), and on two cores the second thread's hand-offs cost more than they
gain. So each product is cut into blocks of rows that access less than
`MATVEC_MAX_BYTES` each (`_row_blocks`; a float32 `[768, 256]` matrix in
two), which XLA keeps whole (the compiled program has no
`outer_dimension_partitions`) and which, independent, may run side by side.
One jitted call per token (decode.py's step pattern: the call and a
projection of its output), us, one process a line, 400 calls in 20
interleaved rounds, the products whole -> in blocks (Flax's cells;
benchmarks/NOTES.md, session 93):
- GRU I = H = 256 two layers 224 -> 148 (159), 237 -> 152 (172); one layer
  151 -> 90 (97); bidirectional (the call alone) 229 -> 152; GRU H256 I128
  two layers 205 -> 132 (139); GRU I = H = 512 two layers 681 -> 497 (690),
  one layer 302 -> 304 (260); GRU H512 I256 343 -> 278 (232);
- LSTM I = H = 256 two layers 299 -> 209 (456), 339 -> 222 (538); one layer
  223 -> 144 (339), 232 -> 148 (393); I = H = 512 367 -> 347 (992), four
  layers 2246 -> 2182 (23921); I = H = 1024 2261 -> 1970 (25426);
- the lone layers that had kept the whole buffer, whole buffer -> blocks:
  GRU H256 I128 140 -> 109 (123), 113 -> 87 (95); GRU H256 I192 129 -> 105
  (112); GRU H192 I128 83 -> 72 (81); LSTM H256 I128 214 -> 162 (369); LSTM
  H256 I192 172 -> 145 (315); LSTM H192 I128 128 -> 108 (250);
- no block to cut (every matrix under the bound), the same program: LSTM
  I64 H128 65 -> 65, three layers 117 -> 116; GRU I64 H128 79 -> 79.
A few sequences (up to `MATVEC_MAX_BATCH`) take the matrix-vector
products too, a sequence at a time (each re-reading the matrices), where a
direction's matrices of the layer hold at most `MATVEC_BATCH_MAX_ELEMENTS`
(a GRU I = H = 256): the same step pattern, us, as before (the whole buffer
or the slices) -> a product a sequence (Flax's cells), one process a line:
GRU I = H = 256 B2 225 -> 188 (183), 211 -> 179 (175), B3 200 -> 198 (173);
two layers B2 330 -> 251 (235), B3 453 -> 277 (285); GRU H256 I128 B2 209
-> 127 (126), B3 281 -> 192 (183); LSTM H256 I128 B3 298 -> 248 (425); LSTM
I64 H128 B2 177 -> 104 (194), B3 164 -> 106 (167); GRU I64 H128 B2 137 ->
105 (128), B3 116 -> 100 (109). Through the library, the rule against
one sequence's alone: GRU I = H = 256 B2 174 -> 160 (158), two layers B3
618 -> 363 (380); GRU H256 I128 B2 320 -> 170 (178); LSTM H256 I128 B3 357
-> 318 (645); LSTM I64 H128 B2 187 -> 116 (211); GRU I64 H128 B3 119 -> 96
(113). Larger matrices lost: LSTM I = H = 256 B2 234 -> 262 (though two
layers of it gained, 328 -> 239), GRU I = H = 384 B2 276 -> 364, GRU I = H =
512 B2 377 -> 402, LSTM I = H = 384 B2 357 -> 380, LSTM I = H = 512 B2 460
-> 509; so did more sequences: GRU I = H = 256 B4 210 -> 254, B8 228 -> 303;
GRU H256 I128 B4 250 -> 254; GRU I64 H128 B8 97 -> 149 (though GRU I64
H128 B4 142 -> 131, LSTM I64 H128 B4 183 -> 128 and LSTM two layers I = H =
256 B4 513 -> 411 gained).
In a decoder's loop, which closes over its weights, XLA hoists the
slices' copies out of the loop; yet one sequence's matrix-vector products,
which copy nothing, ran faster there over middling matrices: a 64-step
`lax.scan` of decode.py's step, us a token, the slices -> the products
(Flax's cells), one process a line (benchmarks/NOTES.md, session 93): LSTM
I64 H128 13.5 -> 11.4 (12.5), 17.1 -> 14.0 (18.0), 12.8 -> 11.2 (13.1); two
layers 32.9 -> 27.0 (31.2); LSTM I = H = 128 20.2 -> 16.2 (19.5), two layers
37.8 -> 30.9 (35.5), 37.1 -> 29.9 (36.0); LSTM H192 I128 37.3 -> 31.2 (34.9),
32.0 -> 27.2 (31.9); LSTM H96 I64 9.8 -> 8.6 (9.6); LSTM I = H = 64 6.1 ->
4.6 (5.6); GRU I64 H128 10.6 -> 8.9 (10.5), 11.7 -> 10.0 (12.9), 9.9 -> 8.5
(10.3); GRU I = H = 128 17.7 -> 14.2 (16.6), 12.7 -> 10.6 (11.0); GRU H192
I64 22.7 -> 19.3 (20.6); GRU I = H = 96 9.6 -> 8.5 (10.3); GRU I = H = 64
6.7 -> 4.8 (6.7), 5.1 -> 3.6 (5.6). An input 32 wide lost (LSTM I32 H64 5.9
-> 6.6, 5.5 -> 6.2; GRU 5.0 -> 5.7), and larger matrices went both ways:
GRU H256 I128 (288 Ki elements) 34.6 -> 34.9 (31.8), 43.9 -> 38.7 (37.1);
GRU I = H = 256 (384 Ki) 56.2 -> 52.8 (51.3), two layers 102.3 -> 104.6
(90.9); LSTM I = H = 256 two layers (512 Ki) 119.3 -> 128.6 (127.2). Hence
`LOOP_MATVEC_MIN_COLUMNS` and `LOOP_MATVEC_MAX_ELEMENTS`, for a float32
model's one sequence alone (more sequences keep `_xla`'s loop rules).
A bfloat16 model's one sequence takes them too (its input and state
rounded to bfloat16 where they meet a weight matrix, the products
accumulated in float32: the values of its sliced products, bit for bit),
where a direction's matrices of the layer hold at least `MIN_ELEMENTS`: us,
the slices (which it took before at every size) -> the products: LSTM
I = H = 128 516 -> 291, 364 -> 211; GRU I = H = 192 428 -> 198; GRU I = H =
160 500 -> 142; GRU H256 I64 557 -> 396; GRU I = H = 256 288 -> 228; two
layers 327 -> 251; LSTM two layers 531 -> 317; LSTM I = H = 512 765 -> 405.
Smaller ones lost: LSTM H128 I96 120 -> 188, I64 108 -> 172 and 146 -> 222;
GRU H128 I64 121 -> 198; LSTM H64 I128 113 -> 190 (though the GRU I = H =
128 gained, 131 -> 104, and two layers of it 300 -> 111): the layer reads
a bfloat16 model's buffer widened to float32, so that each fused product
reads the whole buffer through the widening, whose flops make XLA:CPU's
cost model take the kernel for compute-bound and split it over both
threads at any size, blocks or not (on one core the products won: LSTM I64
H128 134 against the slices' 147 us; benchmarks/NOTES.md, session 93).
float16 and float64 models were not measured, and keep the slices.

From jax 0.11, XLA:CPU's new fusion emitter lowers a product fused with its
slice to one scalar chain of FMAs an output (jax 0.10.2's: eight lanes), and
the fused products ran slower than the slices (`fuses_matvec`). There one
sequence's products are summed in lanes instead (`_lanes_product`: the
matrix's column blocks times the vector's pieces, added into `[rows, in /
terms]` in one vectorized loop kernel with the slice fused, then the lanes
summed), in the same row blocks. decode.py's step on the 2-core Zen 3, jax
0.12.1 (Python 3.13), us, in lanes (their sum a reduction kernel of its
own, which the column sums of `_lanes_product` since replaced) / as before
(the whole buffer or the slices) / Flax's cells, one process a line
(benchmarks/NOTES.md, session 94):
- gained: GRU I = H = 256 two layers 235 / 346 / 229, 224 / 308 / 211; one
  layer 201 / 215 / 178, 136 / 154 / 118; LSTM I = H = 256 two layers 335 /
  433 / 772, one layer 163 / 180 / 309, 160 / 176 / 301; LSTM I = H = 128 two
  layers 153 / 229 / 341; LSTM I64 H128 192 / 202 / 229; GRU H512 I256 205 /
  281 / 181; GRU I = H = 512 two layers 507 / 594 / 520, 718 / 770 / 688;
  under jax 0.11.2 GRU I = H = 256 two layers 213 / 295 / 192, LSTM I64 H128
  106 / 143 / 145;
- level: GRU I64 H128 76 / 75 / 65; GRU H256 I128 122 / 126 / 108; GRU I = H
  = 384 178 / 174 / 146;
- lost, larger matrices (a direction's over 512 Ki elements), to the whole
  buffer: GRU I = H = 512 528 / 347 / 403; LSTM I = H = 384 247 / 194 / 433;
  LSTM H384 I128 291 / 250 / 359; LSTM I = H = 512 402 / 294 / 1043; LSTM I =
  H = 1024 3603 / 2793 / 24037 (blocks under 256 KiB to 64 MiB did not
  change that: LSTM I = H = 512 321-385 against 259);
- more sequences, a product a sequence, went both ways: GRU I = H = 256 two
  layers B2 221 / 264 / 190, B3 458 / 553 / 341; GRU H256 I128 B3 189 / 204
  / 153; but GRU I = H = 256 B2 171 / 168 / 137; LSTM I64 H128 B2 143 / 135 /
  141, B3 139 / 135 / 145; GRU I64 H128 B2 119 / 105 / 96, B3 177 / 113 /
  116; LSTM H256 I128 B3 323 / 285 / 444; and so again with the column sums
  of `_lanes_product`: GRU I = H = 256 two layers B2 319 / 345 / 226, B3 343 /
  469 / 283; LSTM I = H = 256 two layers B2 308 / 342 / 536; LSTM I64 H128
  B2 124 / 147 / 176; LSTM H256 I128 B3 231 / 239 / 352; but GRU I = H = 256
  B2 188 / 173 / 154; GRU I64 H128 B2 146 / 133 / 137, B3 163 / 135 / 135;
- in a decoder's loop they lost to the slices' copies hoisted out of it, us
  a token: LSTM I64 H128 22.9 / 8.2 / 8.4; GRU 22.6 / 7.8 / 7.4; LSTM I = H =
  128 two layers 58.7 / 32.6 / 34.0; GRU I = H = 128 24.4 / 11.9 / 11.2;
- a bfloat16 model's, under the bfloat16 rule above: LSTM I = H = 128 109 /
  131 / 140; GRU I = H = 256 321 / 356 / 189, two layers 467 / 474 / 364;
  LSTM I = H = 512 448 / 1157 / 1312.
Hence, from jax 0.11: a float32 model's one sequence alone
(`LANES_MAX_BATCH`), outside a loop, up to `LANES_MAX_ELEMENTS` (an LSTM I =
H = 256); a bfloat16 model's as under jax 0.10; no loop. The step of
decode.py's grid after, paired against Flax's cells
(`results/decode-cpu-2core-zen3-jax0.12.1-2026-12-07-lanes.md`, against
`-before-lanes.md`, run after it): GRU B1 I256 H256 two layers 0.72x ->
1.05x, LSTM 1.59x -> 2.23x; LSTM B1 I64 H128 1.15x -> 1.30x; GRU 1.00x ->
1.01x.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_cudnn_rnn import _cpu, _layout, _reference, _requirements, _spec

MIN_PIECE = 128
MIN_ELEMENTS = 128 * 1024
MAX_EXTRA_PRODUCTS = {"lstm": 24, "gru": 32, "rnn_tanh": 32, "rnn_relu": 32}
MATVEC_MAX_BYTES = 512 * 1024
MATVEC_MAX_BATCH = 3
MATVEC_BATCH_MAX_ELEMENTS = 384 * 1024
LOOP_MATVEC_MIN_COLUMNS = 64
LOOP_MATVEC_MAX_ELEMENTS = 256 * 1024
MATVEC_JAX_BELOW = (0, 11)
LANES_MAX_ELEMENTS = 512 * 1024
LANES_MAX_BATCH = 1
LANES_MAX_TERMS = 8
LANES_MIN_WIDTH = 16
LANES_SUMMED_WIDTH = 32
BLOCKS_MIN_BATCH = 2
BLOCKS_MIN_PRODUCTS = 3 * 1024 * 1024


class Plan(NamedTuple):
  """How one layer multiplies the buffer (`size` elements): its input by the
  buffer viewed as `[size / x_piece, x_piece]` (cut into `inputs / x_piece`
  pieces), each direction's state by it viewed as `[size / H, H]` (the
  state whole); one product where both views are one.

  `inputs`, `x_piece`: the layer's input size and its pieces' (None under
  skip_input: no input matrix); `w_rows[d]`, `r_rows[d]`: the first row of
  direction `d`'s input matrix in the input's view (None under skip_input)
  and of its recurrent matrix in the state's. `matvec`: one sequence or a
  few, whose products take each matrix where it lies instead (the module docstring),
  at the offset its rows give; `operands`: bfloat16 where those products
  round their vectors so (a bfloat16 model's), else None; `lanes`: those
  products summed in lanes (`_lanes_product`), not as XLA:CPU's fused
  products (`fuses_matvec`); `blocks`: the input and the states multiply
  the buffer's blocks instead, one matrix a block (`_block_products`), where
  the matrix-vector products do not apply."""
  size: int
  inputs: int | None
  x_piece: int | None
  hidden: int
  w_rows: tuple
  r_rows: tuple
  matvec: bool = False
  operands: np.dtype | None = None
  lanes: bool = False
  blocks: bool = False


def plan(spec, layer: int, x: jax.Array, looped: bool) -> Plan | None:
  """The plan of `layer`'s one-step call over the buffer as it lies, or None
  where it multiplies sliced matrices (`_xla._forward`), for a call of one
  step (`x [T, B, in]`, time-major, in the computation dtype, float32) on a
  CPU that is JAX's only device (`_cpu.sole_device`; the module docstring).

  Under a JAX whose XLA:CPU vectorizes a matrix-vector product fused with
  its slice (`fuses_matvec`): in a loop that closes over its weights
  (`looped`: a decoder's), a float32 model's one sequence alone takes the
  matrix-vector products (`matvec`), where each of the layer's matrices is
  at least `LOOP_MATVEC_MIN_COLUMNS` wide and a direction's hold at most
  `LOOP_MATVEC_MAX_ELEMENTS`; outside one, a float32 model takes them for one
  sequence, or up to `MATVEC_MAX_BATCH` where a direction's matrices of the
  layer hold at most `MATVEC_BATCH_MAX_ELEMENTS`. Under a newer JAX they are
  summed in lanes (`lanes`), outside a loop alone, for a float32 model's one
  sequence (`LANES_MAX_BATCH`) where a direction's matrices hold at most
  `LANES_MAX_ELEMENTS`.
  A float32 model that takes no matrix-vector products takes the whole buffer's
  products, where its views are at least `MIN_PIECE` wide (`_input_piece`),
  a direction's matrices of the layer hold at least `MIN_ELEMENTS`
  (`matrix_elements`), and they make at most `MAX_EXTRA_PRODUCTS`
  multiplications more than the layer's own products need for each weight
  they no longer copy (`extra_products`); before it, a float32 model of one
  layer of I = H (`block_count`) outside a loop that closes over its weights
  takes the blocks (`blocks`), on at least `BLOCKS_MIN_BATCH` sequences and,
  under a newer JAX, where a matrix's product makes at least
  `BLOCKS_MIN_PRODUCTS` multiplications. A bfloat16 model's one sequence
  takes the matrix-vector products (summed in lanes under a newer JAX)
  where its matrices hold at least `MIN_ELEMENTS`; other models none."""
  steps, batch = x.shape[:2]
  if not all(isinstance(n, (int, np.integer)) for n in (steps, batch)):
    return None
  if steps != 1 or np.dtype(x.dtype) != np.float32:
    return None
  model = np.dtype(spec.dtype)
  if model not in (np.float32, jnp.bfloat16) or not _cpu.sole_device():
    return None
  H, g = spec.num_units, spec.num_gates
  has_w = spec.layer_has_input_weights(layer)
  x_piece = _input_piece(spec, layer) if has_w else None
  elements = matrix_elements(spec, layer)
  fused = fuses_matvec()
  if looped:
    columns = min(H, spec.layer_input_size(layer)) if has_w else H
    whole = False
    matvec = (fused and model == np.float32 and batch == 1
              and columns >= LOOP_MATVEC_MIN_COLUMNS and elements <= LOOP_MATVEC_MAX_ELEMENTS)
  elif model == np.float32:
    whole = (min(H, x_piece or H) >= MIN_PIECE and elements >= MIN_ELEMENTS
             and extra_products(spec, layer, batch) <= MAX_EXTRA_PRODUCTS[spec.rnn_mode])
    if fused:
      matvec = batch == 1 or (batch <= MATVEC_MAX_BATCH and elements <= MATVEC_BATCH_MAX_ELEMENTS)
    else:
      matvec = batch <= LANES_MAX_BATCH and elements <= LANES_MAX_ELEMENTS
  else:
    whole, matvec = False, batch == 1 and elements >= MIN_ELEMENTS
  blocks = (model == np.float32 and not looped and block_count(spec) is not None
            and batch >= BLOCKS_MIN_BATCH
            and (fused or g * H * H * batch >= BLOCKS_MIN_PRODUCTS))
  if not (whole or matvec or blocks):
    return None
  weights, _ = _layout.tensors(spec)
  # Every block's size, a matrix's `g*H x in` or a bias's `H` times a gate
  # count, is a multiple of H: so is every offset, and the state's view
  # always holds whole rows.
  first = {(t.direction, t.index // g): t.offset
           for t in weights if t.layer == layer and t.index % g == 0}
  dirs = range(spec.num_dirs)
  return Plan(_layout.params_size(spec), spec.layer_input_size(layer) if has_w else None,
              x_piece, H, tuple(first[d, 0] // x_piece if has_w else None for d in dirs),
              tuple(first[d, 1] // H for d in dirs), matvec,
              None if model == np.float32 else model, matvec and not fused, blocks)


def block_count(spec) -> int | None:
  """The blocks of `[g*H + g, H]` into which the buffer of a one-layer model
  whose every matrix is H wide (linear input, I = H) falls, a matrix each
  (`_block_products`), else None."""
  H, g = spec.num_units, spec.num_gates
  if spec.num_layers != 1 or spec.input_mode != "linear_input" or spec.input_size != H:
    return None
  count = 2 * spec.num_dirs
  assert _layout.params_size(spec) == count * (g * H + g) * H
  return count


def _input_piece(spec, layer: int) -> int:
  """The width of the view `layer`'s input multiplies: the input size where
  the buffer's size and the offsets of the layer's input matrices are
  multiples of it (a view of whole rows), else the greatest common divisor
  of the input size and H (every size and offset is a multiple of H)."""
  inputs, g = spec.layer_input_size(layer), spec.num_gates
  offsets = [t.offset for t in _layout.tensors(spec)[0]
             if t.layer == layer and t.index < g]
  if all(n % inputs == 0 for n in [_layout.params_size(spec)] + offsets):
    return inputs
  return math.gcd(inputs, spec.num_units)


def matrix_elements(spec, layer: int) -> int:
  """The elements of one direction's weight matrices of `layer`."""
  inputs = spec.layer_input_size(layer) if spec.layer_has_input_weights(layer) else 0
  return spec.num_gates * spec.num_units * (inputs + spec.num_units)


def extra_products(spec, layer: int, batch: int) -> float:
  """The multiplications the whole buffer's products make beyond those of
  `layer`'s own products, per element of the layer's matrices (what the
  slices would copy): every element of the buffer's matrices times every
  piece of every sequence (each state one piece), less the layer's own
  elements times the sequences (the biases' few rows aside). One layer of one
  direction: the batch, where the input is one piece."""
  D = spec.num_dirs
  own = D * matrix_elements(spec, layer)
  pieces = D
  if spec.layer_has_input_weights(layer):
    pieces += spec.layer_input_size(layer) // _input_piece(spec, layer)
  matrices = sum(t.size for t in _layout.tensors(spec)[0])
  return batch * (matrices * pieces / own - 1)


def forward(mode, plan: Plan, xs, valid, h0, c0, bW, bR, buffer):
  """One step of every direction of a layer, as `_xla._forward` without
  coefficients returns it, `(ys, hT, cT)`, its products taken from `buffer`
  (flat, in the computation dtype) as `plan` says: the matrix-vector
  products, the blocks' batched product, or products of the whole buffer,
  one a view width.
  Arguments as `_reference.forward_scan`'s, but `xs[0]` alone is read: at one step
  every direction's input is the same, but where a sequence is empty, whose
  outputs the mask drops."""
  g, H = _spec.NUM_GATES[mode], plan.hidden
  x = xs[0][0]
  if plan.matvec:
    input_product, state_product = _matvec_products(g, plan, x, h0, buffer)
  elif plan.blocks:
    input_product, state_product = _block_products(g, plan, x, h0, buffer)
  else:
    input_product, state_product = _view_products(g, plan, x, h0, buffer)
  # The cell on the step axis kept, `[1, B, .]`, as `_reference.forward_scan`'s
  # `step_axis` runs it, for its reason: the new states are the outputs, not
  # reshapes of them, which XLA:CPU fused into kernels of their own (an LSTM's
  # cell five kernels -> two; a GRU's program is the same either way). One
  # jitted call, us, before -> after (Flax's cells), one process each: LSTM
  # I256 H256 B8 434.1 -> 425.7 (919.1; paired round by round 0.94x), two
  # layers B1 591.6 -> 591.7 (766.9; 0.99x); the GRU's unchanged program, as
  # a measure of the noise, B8 332.7 -> 321.7, B32 I128 619.5 -> 619.2
  # (benchmarks/NOTES.md, session 76).
  in_bias = _reference.input_bias(mode, bW, bR)
  ys, hT, cT = [], [], []
  for d in range(len(h0)):
    if plan.inputs is None:
      xp = _reference.project(x, None, g)
    else:
      xp = input_product(d)
    xp = xp[None] + _reference.lift(in_bias[d], 3)
    rec = state_product(d)[None]
    if mode == "gru":
      rec = rec + _reference.lift(bR[d], 3)
    h_prev, c_prev = h0[d][None], None if c0 is None else c0[d][None]
    h, c = _reference._cell(mode, xp, rec, h_prev, c_prev)
    h, c, out = _reference.mask(valid, h, c, h_prev, c_prev)
    ys.append(out)
    hT.append(h[0])
    cT.append(None if c is None else c[0])
  return tuple(ys), tuple(hT), None if c0 is None else tuple(cT)


def _matvec_products(g: int, plan: Plan, x, h0, buffer):
  """`(input_product, state_product)`: direction `d`'s `[B, g*H]` products
  of the input `x [B, in]` and state `h0[d]` with the matrices sliced where
  they lie in `buffer`, a sequence at a time, each fused with its slice, in
  blocks of rows (`_row_blocks`; the module docstring); the vectors rounded to
  `plan.operands` where it is set (the buffer's values already are: a
  bfloat16 model's weights)."""
  H = plan.hidden

  def product(offset, columns, v):
    if v.shape[0] > 1:
      return jnp.concatenate([product(offset, columns, v[b:b + 1]) for b in range(v.shape[0])])
    # The vector alone is rounded: the weights hold bfloat16 values already.
    # `_rounded_dot.matmul`, which rounds both operands in the kernel, kept
    # the fusion but lost most of the gain (LSTM I = H = 128 191 against 105
    # us, two layers I = H = 256 524 against 365; the slices 196 and 634).
    if plan.operands is not None:
      v = v.astype(plan.operands).astype(v.dtype)
    # `v @ m.T`, the form XLA:CPU fuses with the slice (the module docstring),
    # a block of rows at a time.
    blocks, start = [], offset
    for rows in _row_blocks(g * H, columns, buffer.dtype.itemsize):
      m = jax.lax.slice(buffer, (start,), (start + rows * columns,)).reshape(rows, columns)
      blocks.append(_lanes_product(v, m) if plan.lanes
                    else jax.lax.optimization_barrier(v @ m.T))
      start += rows * columns
    return blocks[0] if len(blocks) == 1 else jnp.concatenate(blocks, -1)

  return (lambda d: product(plan.w_rows[d] * plan.x_piece, plan.inputs, x),
          lambda d: product(plan.r_rows[d] * H, H, h0[d]))


def fuses_matvec(version: str | None = None) -> bool:
  """Whether JAX's `version` (the installed one's by default) is older than
  `MATVEC_JAX_BELOW`: its XLA:CPU vectorizes a matrix-vector product fused
  into a loop kernel with its slice (jax 0.10.2: eight lanes of FMAs, the
  vector in registers). From jax 0.11 its new fusion emitter lowers the
  product fused so to one scalar chain of FMAs an output (read in the
  kernels' code, session 94), and the products ran slower than the slices:
  decode.py's step on the 2-core Zen 3, us, the fused products / the slices
  / Flax's cells: GRU B1 I256 H256 two layers 1198 / 711 / 262 under jax
  0.12.1 (jax 0.10.2: 192 / 369 / 214); under 0.11.2 the fused products /
  the whole buffer / Flax's cells 1011 / 295 / 192. There the products are
  summed in lanes instead (`_lanes_product`)."""
  return _requirements.jax_older_than(MATVEC_JAX_BELOW, version)


def lane_terms(columns: int) -> int:
  """The terms `_lanes_product` sums for a matrix `columns` wide: the most,
  up to `LANES_MAX_TERMS`, that cut it into equal lanes at least
  `LANES_MIN_WIDTH` wide (one where none does)."""
  return max(t for t in range(1, LANES_MAX_TERMS + 1)
             if columns % t == 0 and (t == 1 or columns // t >= LANES_MIN_WIDTH))


def _lanes_product(v, m):
  """`v @ m.T` for a vector `v [1, in]` and a matrix `m [rows, in]` sliced
  from the buffer, as XLA:CPU from jax 0.11 runs it fast: `m` cut into
  `lane_terms` column blocks, each times its piece of `v`, summed into
  `[rows, in / terms]` lanes (one loop kernel, the slice fused and the lanes
  vectorized: nothing copied); the lanes halved, by adding their halves,
  down to `LANES_SUMMED_WIDTH`, then summed column by column, which XLA
  fuses into the kernel that reads the product (the cell's). The lanes go
  through a barrier: else XLA makes the whole a reduction whose kernel
  copies the slice out first (a one-layer GRU I = H = 256 call 136 -> 282
  us). Chains of four `[384, 256]` products sliced from one buffer, jax
  0.12.1, us: the fused products 531, eight terms 134, four 134, two 303,
  sixteen (the slice copied out) 272; the matrices as arguments of their
  own, multiplied by XLA's own product, 115. The lanes summed by a
  reduction (a YNNPACK kernel of its own) / column by column, decode.py's
  step, us (Flax's cells): GRU I64 H128 82.7 / 78.1 (75.6), 102.6 / 93.2
  (88.8); LSTM I64 H128 115.0 / 107.3 (146.9), 89.3 / 83.4 (130.9); GRU I = H
  = 256 two layers 191.6 / 172.8 (163.2), 151.2 / 145.2 (140.6); LSTM I = H =
  256 148.5 / 136.3 (368.9); GRU H128 I1024 (lanes 128 wide) 127.9 / 126.4
  (116.2), 152.4 / 155.1 (151.2). Halved first down to 16 or 8 lanes, in a
  kernel of their own, they ran level with either (129.6 and 144.7 at GRU
  H128 I1024). The halves bound the column sums to 32 (a matrix 2048 wide
  has 256 lanes).
  The vector rounded or not, the products are exact in float32 for a
  bfloat16 model's weights; the sums run in another order than a product's.
  """
  terms = lane_terms(m.shape[1])
  width = m.shape[1] // terms
  lanes = m[:, :width] * v[:, :width]
  for t in range(1, terms):
    lanes = lanes + m[:, t * width:(t + 1) * width] * v[:, t * width:(t + 1) * width]
  lanes = jax.lax.optimization_barrier(lanes)
  while lanes.shape[1] > LANES_SUMMED_WIDTH and lanes.shape[1] % 2 == 0:
    half = lanes.shape[1] // 2
    lanes = lanes[:, :half] + lanes[:, half:]
  columns = [lanes[None, :, j] for j in range(lanes.shape[1])]
  return sum(columns[1:], columns[0])


def _row_blocks(rows: int, columns: int, itemsize: int) -> list[int]:
  """The row counts, as even as can be, of the fewest blocks into which a
  `[rows, columns]` matrix of `itemsize`-byte elements is cut so that each
  block's product with a float32 vector accesses less than `MATVEC_MAX_BYTES`
  (the block, the vector and the block's float32 result): below that XLA:CPU
  runs the fused kernel on one thread (the module docstring)."""
  most = max(1, (MATVEC_MAX_BYTES - 1 - 4 * columns) // (columns * itemsize + 4))
  count = -(-rows // most)
  return [rows // count + (i < rows % count) for i in range(count)]


def _view_products(g: int, plan: Plan, x, h0, buffer):
  """`(input_product, state_product)`: direction `d`'s `[B, g*H]` products
  of the input `x [B, in]` and its state `h0[d]`, taken from products of the
  whole `buffer`, one a view width (the module docstring)."""
  B, H = x.shape[0], plan.hidden
  stacks = {}  # a view's width -> the `[B, width]` pieces that multiply it

  def add(width, pieces):
    """Stacks `pieces` for the view of `width`; their first's index there."""
    stack = stacks.setdefault(width, [])
    stack.extend(pieces)
    return len(stack) - len(pieces)

  if plan.inputs is not None:
    k = plan.x_piece
    x_first = add(k, [x[:, p * k:(p + 1) * k] for p in range(plan.inputs // k)])
  h_first = [add(H, [h]) for h in h0]
  products = {}
  for width, pieces in stacks.items():
    view = buffer.reshape(plan.size // width, width)
    product = jax.lax.dot_general(view, jnp.concatenate(pieces, 0), (((1,), (1,)), ((), ())))
    # Transposed after a barrier, as `_xla._opaque_matmul`'s: else XLA may
    # rewrite the pair into a product against the transposed view.
    products[width] = jax.lax.optimization_barrier(product)

  def matrix(width, row, columns, first):
    """`[B, g*H]`: the matrix at `row` of the view of `width`, of `columns`
    columns, times its pieces, the first of them `first` there."""
    m = columns // width
    block = products[width][row:row + g * H * m].reshape(g * H, m, -1)
    parts = [block[:, p, (first + p) * B:(first + p + 1) * B] for p in range(m)]
    return sum(parts[1:], parts[0]).T

  return (lambda d: matrix(plan.x_piece, plan.w_rows[d], plan.inputs, x_first),
          lambda d: matrix(H, plan.r_rows[d], H, h_first[d]))


def _block_products(g: int, plan: Plan, x, h0, buffer):
  """`(input_product, state_product)` as `_view_products`', for one layer
  whose every matrix is H wide (`block_count`): the buffer viewed as
  `[2D, g*H + g, H]`, a block a matrix, each block multiplied by its own
  matrix's vector (the input, or its direction's state) in one batched
  product, which makes the layer's own multiplications and the biases'
  rows'. Matrix `j` starts at row `j*g*H` of the `[size / H, H]` view and
  block `j` at `j*(g*H + g)`: the matrix's first `j*g` rows end the block
  before, and multiply its vector in a product of their own (a slice of `j*g`
  rows, the only copy)."""
  H, D = plan.hidden, len(h0)
  vectors = [v for d in range(D) for v in (x, h0[d])]
  view = buffer.reshape(2 * D, g * H + g, H)
  product = jax.lax.dot_general(view, jnp.stack(vectors), (((2,), (2,)), ((0,), (0,))))
  # Transposed after a barrier, as `_view_products`' products are.
  product = jax.lax.optimization_barrier(product)

  def matrix(j):
    head, v = j * g, vectors[j]
    tail = product[j, :g * H - head].T
    if head == 0:
      return tail
    start = j * g * H * H
    m = jax.lax.slice(buffer, (start,), (start + head * H,)).reshape(head, H)
    return jnp.concatenate([v @ m.T, tail], 1)

  return (lambda d: matrix(2 * d), lambda d: matrix(2 * d + 1))
