"""Pure-JAX RNNs: the ground truth, and the "xla" backend on every device.

The equations are DESIGN §3 (cuDNN's, with a double bias). How the work is
arranged, for speed on CPU (measured with XLA:CPU, jax 0.10, 2 cores; see
benchmarks/):
- the input projection is computed inside the recurrent scan, one matmul per
  step and direction, next to the recurrent one. DESIGN asks for one matmul
  over all steps outside the scan; on XLA:CPU that variant measured 1.3-1.5x
  slower (LSTM B64 T100 H256: forward 100 vs 68 ms, forward+backward 270 vs
  210 ms), because the loop then reads a `[T, B, 4H]` buffer through a
  dynamic slice fused into the gate arithmetic. The cuDNN path does its own
  projection, and the fast "xla" backend (`_xla.py`) projects a chunk of
  steps at a time;
- both directions of a bidirectional layer run in the same `lax.scan`, as two
  plain matmuls per step (a batched matmul over a stacked direction axis
  measured no faster), the backward direction reading its input reversed per
  sequence (so with `seq_lengths` it starts at `length - 1`);
- without `seq_lengths` no masking is done at all.
float16 and bfloat16 are computed in float32 (as cuDNN computes them) and the
results cast back. (The "xla" backend multiplies a bfloat16 model's matmul
operands in bfloat16, accumulating in float32: `_xla.operand_dtype`.)

Inputs arrive validated by `_ops.rnn`, with `None` states replaced by zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_cudnn_rnn import _dropout, _layout, _spec


def _compute_dtype(dtype: np.dtype) -> np.dtype:
  return np.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def param_blocks(spec, params: jax.Array) -> dict:
  """The opaque buffer cut into its blocks, in one `split`.

  A block is the `g` tensors of one side of one (layer, direction), which lie
  contiguous in the buffer: the input matrices `W_0..W_{g-1}`, the recurrent
  ones `R_0..R_{g-1}`, or either side's biases. The blocks tile the buffer.

  Cutting them all at once, rather than slicing each layer's out of the whole
  buffer, makes the gradient a single concatenation of the blocks' cotangents
  (the transpose of a split) instead of a sum of zero-padded full-size arrays
  (the transpose of each slice). XLA:CPU fused that sum, together with every
  layer's weight-gradient matmuls, into one kernel at the very end of the
  backward pass, which kept each layer's `[T, B, 3H]` GRU cotangents alive
  until then. GRU forward+backward, interleaved A/B (ms, MiB of XLA temp
  buffers): B32 T100 I256 H256 3 layers 224 -> 191, 139.5 -> 99.0; 2
  bidirectional layers 325 -> 289, 196.4 -> 141.7 (in bfloat16 228 -> 202);
  B64 T100 I128 H256 2 bidirectional layers 602 -> 549, 369 -> 272. The
  LSTM's matmuls were not fused so, and it and one-layer models are unchanged
  (benchmarks/NOTES.md, session 26).

  Returns:
    `{(layer, direction, kind, side): block}`, in the buffer's order,
    `kind` "weight" or "bias",
    `side` 0 (input) or 1 (recurrent); a weight block is `[g*H, in]` (`in`
    being `H` on the recurrent side), as the opaque buffer holds it, a bias
    block `[g*H]`. Under skip_input layer 0 has no input weight block.
  """
  weight_entries, bias_entries = _layout.tensors(spec)
  g = spec.num_gates
  firsts = sorted((t for t in weight_entries + bias_entries if t.index % g == 0),
                  key=lambda t: t.offset)
  pieces = jnp.split(params, [t.offset for t in firsts[1:]])
  return {(t.layer, t.direction, t.kind, t.index // g):
          piece.reshape((g * t.shape[0],) + t.shape[1:]) for t, piece in zip(firsts, pieces)}


def _layer_params(spec, blocks: dict, layer: int):
  """Per-direction params of `layer`, as lists indexed by direction.

  Args:
    blocks: `param_blocks` of the opaque buffer.

  Returns:
    `(W, R, bW, bR)`: `W[d] [in, g*H]` (W is None under skip_input at layer
    0), `R[d] [H, g*H]` (both transposed for `x @ W`), `bW[d], bR[d] [g*H]`.
  """
  def side(kind, index):
    out = [blocks.get((layer, d, kind, index)) for d in range(spec.num_dirs)]
    return None if out[0] is None else out

  W, R = side("weight", 0), side("weight", 1)
  W = None if W is None else [w.T for w in W]
  return W, [r.T for r in R], side("bias", 0), side("bias", 1)


def _reverse_in_time(x: jax.Array, seq_lengths: jax.Array | None) -> jax.Array:
  """Reverses `x [T, B, ...]` along time, per sequence when lengths are given.

  With lengths, step t of sequence b maps to `len_b - 1 - t` for `t < len_b`
  and stays in place in the padding, so the operation is its own inverse.
  """
  if seq_lengths is None:
    return jnp.flip(x, axis=0)
  t = jnp.arange(x.shape[0], dtype=jnp.int32)[:, None]
  index = jnp.where(t < seq_lengths[None, :], seq_lengths[None, :] - 1 - t, t)
  index = index.reshape(index.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, index, axis=0)


def valid_steps(steps, seq_lengths: jax.Array) -> jax.Array:
  """The `[T, B]` mask of the steps within each sequence's length."""
  return jnp.arange(steps, dtype=jnp.int32)[:, None] < seq_lengths[None, :]


def _cell(rnn_mode: str, xp, rec, h, c):
  """One step for all directions: `xp`, `rec` are `[D, B, g*H]` pre-activations."""
  if rnn_mode == "lstm":
    i, f, g, o = jnp.split(xp + rec, 4, axis=-1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c
  if rnn_mode == "gru":
    x_r, x_z, x_n = jnp.split(xp, 3, axis=-1)
    r_r, r_z, r_n = jnp.split(rec, 3, axis=-1)
    r = jax.nn.sigmoid(x_r + r_r)
    z = jax.nn.sigmoid(x_z + r_z)
    n = jnp.tanh(x_n + r * r_n)
    return (1 - z) * n + z * h, c
  pre = xp + rec
  return (jnp.tanh(pre) if rnn_mode == "rnn_tanh" else jax.nn.relu(pre)), c


def lift(a, ndim: int):
  """`a` with leading axes of size 1 up to rank `ndim`: the broadcast jnp would
  make implicitly, written out so that the library also runs under
  `jax_numpy_rank_promotion="raise"` (the same program either way)."""
  return a.reshape((1,) * (ndim - a.ndim) + a.shape)


def project(x: jax.Array, W: jax.Array | None, gates: int, matmul=jnp.matmul) -> jax.Array:
  """`x @ W`, or the input added to every gate as is (skip_input: W is None).

  `matmul` (here and below) is how the step multiplies by a weight matrix:
  `_xla` passes one taking bfloat16 operands for bfloat16 models."""
  return jnp.tile(x, gates) if W is None else matmul(x, W)


def project_inputs(xs, W, in_bias, gates: int, matmul=jnp.matmul) -> list:
  """Every direction's input pre-activations, `project(xs[d], W[d]) + in_bias[d]`
  (`xs[d]`: one step's `[B, in]` or a chunk's `[steps, B, in]`)."""
  xps = []
  for d, x in enumerate(xs):
    xp = project(x, None if W is None else W[d], gates, matmul)
    xps.append(xp + lift(in_bias[d], xp.ndim))
  return xps


def mask(valid_t, h, c, h_prev, c_prev):
  """Past a sequence's length the state is carried and the output is zero.

  Returns `(h, c, out)`; `c` stays None for cells without one. Linear in
  `(h, c, h_prev, c_prev)`, so `_xla` applies it to tangents too.
  """
  if valid_t is None:
    return h, c, h
  keep = valid_t[..., None]
  h = jnp.where(keep, h, h_prev)
  c = None if c is None else jnp.where(keep, c, c_prev)
  return h, c, jnp.where(keep, h, jnp.zeros((), h.dtype))


def input_bias(mode, bW, bR):
  """The bias added to the input pre-activations, per direction. The recurrent
  bias of GRU's n gate sits inside `r * (R_n h + bR_n)`, so GRU adds only bW."""
  return bW if mode == "gru" else tuple(a + b for a, b in zip(bW, bR))


def recurrent_step(mode, cell, R, bR, hs, cs, xps, valid_t, matmul=jnp.matmul,
                   joined=False, last_cells=False, x_t=None):
  """One step of every direction, given its input pre-activations `xps[d]`
  (with the input bias). `cs` is None without a cell state. The operands are
  `[B, .]`, or `[1, B, .]` with the step axis kept (`forward_scan`'s one
  step). `valid_t`: None, the step's `[B]` (or `[1, B]`) mask for every
  direction, or a tuple of each direction's
  (`_xla` cuts a batch into lanes that run as directions of their own).
  `joined`: the "directions" are lanes of one direction's hidden units
  (`_xla`'s lanes by unit), each with its columns of every gate in `R[d]`,
  `xps[d]`, `bR[d]`: each multiplies the whole state, its lanes' parts
  joined, and runs the cell on its own part. `last_cells` (with a cell
  state and a mask): each direction's cell state is a pair `(c, c_last)`,
  where `c` runs on unmasked past the sequence's end and `c_last` is what
  the mask keeps, the state at the last valid step
  (`_xla._carries_last_cells` says why); the hidden state is masked as ever.
  `x_t` (a tuple over directions of the step's inputs, or None): each
  direction's `R[d]` is its input and recurrent matrices stacked,
  `[in + H, g*H]`, multiplied by the input and state side by side, and
  `xps[d]` holds the input bias alone (`_xla._stacks_weights`).

  Returns `(hs, cs, outs, res)`, tuples over directions.
  """
  lstm, gru = mode == "lstm", mode == "gru"
  whole = jnp.concatenate(hs, -1) if joined else None
  new_hs, new_cs, outs, res = [], [], [], []
  for d in range(len(hs)):
    if x_t is not None:
      rec = matmul(jnp.concatenate([x_t[d], hs[d]], -1), R[d])
    else:
      rec = matmul(whole if joined else hs[d], R[d])
    if gru:
      rec = rec + lift(bR[d], rec.ndim)
    c_prev = cs[d] if lstm else None
    if last_cells:
      c_prev, c_last = c_prev
    h, c, r = cell(xps[d], rec, hs[d], c_prev)
    valid_d = valid_t[d] if isinstance(valid_t, tuple) else valid_t
    if last_cells:
      h, c_last, out = mask(valid_d, h, c, hs[d], c_last)
      c = (c, c_last)
    else:
      h, c, out = mask(valid_d, h, c, hs[d], c_prev)
    new_hs.append(h)
    new_cs.append(c)
    outs.append(out)
    res.append(r)
  return tuple(new_hs), tuple(new_cs) if lstm else None, tuple(outs), tuple(res)


def forward_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR, matmul=jnp.matmul,
                 joined=False, last_cells=False, stacked=False, step_axis=False):
  """The forward recurrence of one layer, all directions in one `lax.scan`.

  `xs`, `h0`, `c0`, `R`, `bW`, `bR` (and `W`, unless None: skip_input) are
  tuples over directions, inputs in step order; `c0` is None without a cell
  state; `valid` None, a `[T, B]` mask or a tuple of them (`recurrent_step`).
  `cell(xp, rec, h, c)` returns `(h', c', res)`, `xp` holding the input
  pre-activations with the input bias, `rec` the recurrent ones (with the
  recurrent bias for GRU only), `res` anything to stack over time; `joined`
  and `last_cells` as `recurrent_step`'s (with `last_cells`, `c0` and `cT`
  hold its pairs). `stacked`: `R[d]` is each direction's input and recurrent
  matrices stacked (`recurrent_step`'s `x_t`), and W is not read.
  `step_axis`: where `xs` holds one step (`is_known_one`), run it without a
  loop and with the step axis kept, the states `[1, B, H]` (below).

  Returns per-direction tuples `(ys, hT, cT, res)`.
  """
  g = _spec.NUM_GATES[mode]
  in_bias = input_bias(mode, bW, bR)

  def step(carry, inputs):
    x_t, valid_t = inputs
    if stacked:
      xps = [lift(b, x_t[0].ndim) for b in in_bias]
    else:
      xps = project_inputs(x_t, W, in_bias, g, matmul)
    hs, cs, outs, res = recurrent_step(mode, cell, R, bR, *carry, xps, valid_t, matmul,
                                       joined, last_cells, x_t if stacked else None)
    return (hs, cs), (outs, res)

  carry0 = (tuple(h0), None if c0 is None else tuple(c0))
  if step_axis and is_known_one(xs[0].shape[0]):
    # The states lifted to `[1, B, H]` are the final states as the caller
    # stacks them, so that the new cell state is the output itself, not a
    # reshape of it: XLA:CPU fused such a reshape into a kernel of its own,
    # which computed the cell state again, and split an LSTM's cell into five
    # kernels where two do (`_xla._forward` says where this is used).
    (hT, cT), (ys, res) = step(jax.tree.map(lambda a: a[None], carry0), (tuple(xs), valid))
    return ys, *jax.tree.map(lambda a: a[0], (hT, cT)), res
  (hT, cT), (ys, res) = jax.lax.scan(step, carry0, (tuple(xs), valid))
  return ys, hT, cT, res


def is_known_one(n) -> bool:
  """Whether an axis of size `n` (one step, one sequence) is known to hold
  one: a concrete 1, not a symbolic size."""
  return isinstance(n, (int, np.integer)) and n == 1


def _recurrence(mode, xs, valid, h0, c0, W, R, bW, bR):
  """The plain recurrence: `forward_scan` over `_cell`, differentiated by JAX."""
  cell = lambda xp, rec, h, c: _cell(mode, xp, rec, h, c) + ((),)
  return forward_scan(mode, cell, xs, valid, h0, c0, W, R, bW, bR)[:3]


def _run_layer(spec, x, h0, c0, blocks, layer, seq_lengths, recurrence=_recurrence):
  """One layer, all directions. `x [T, B, in]`, `h0/c0 [D, B, H]`, `blocks`
  the `param_blocks` of the opaque buffer.

  `recurrence` has the signature of `_recurrence` (`_xla._layer` is the fast one).
  """
  W, R, bW, bR = _layer_params(spec, blocks, layer)
  D = spec.num_dirs
  xs = (x,) if D == 1 else (x, _reverse_in_time(x, seq_lengths))
  valid = None
  if seq_lengths is not None:
    valid = valid_steps(x.shape[0], seq_lengths)
  has_c = c0 is not None
  ys, hs, cs = recurrence(spec.rnn_mode, xs, valid, tuple(h0[d] for d in range(D)),
                          tuple(c0[d] for d in range(D)) if has_c else None,
                          None if W is None else tuple(W), tuple(R), tuple(bW), tuple(bR))
  ys = list(ys)  # each [T, B, H], in step order
  if D == 2:
    ys[1] = _reverse_in_time(ys[1], seq_lengths)
  y = ys[0] if D == 1 else jnp.concatenate(ys, axis=-1)
  return y, jnp.stack(hs), (jnp.stack(cs) if has_c else None)


def rnn(spec, x, h0, c0, params, *, seq_lengths=None, dropout_key=None,
        apply_dropout=False, time_major=True, run_layer=_run_layer):
  """The whole multi-layer RNN in pure JAX.

  Args:
    spec: the RNN spec.
    x: `[T, B, in]` (`[B, T, in]` when not `time_major`).
    h0, c0: `[L*D, B, H]`; `c0` is None for models without a cell state.
    params: the opaque buffer.
    seq_lengths: None or `[B]` int32, already clamped to `[0, T]`.
    dropout_key: PRNG key, used when `apply_dropout`.
    apply_dropout: whether to drop the outputs of layers `0 .. L-2`.
    time_major: layout of `x` and of the returned output.
    run_layer: runs one layer, all directions, as `_run_layer` (`_xla.run_layer`
      is the fast one).

  Returns:
    `(y, h, c)` with `c` None for models without a cell state.
  """
  out_dtype = x.dtype
  cdt = _compute_dtype(np.dtype(out_dtype))
  x, h0, params = x.astype(cdt), h0.astype(cdt), params.astype(cdt)
  c0 = None if c0 is None else c0.astype(cdt)
  if not time_major:
    x = jnp.swapaxes(x, 0, 1)
  if seq_lengths is not None:
    # No output reads an input past its sequence's length, but a gradient
    # would: the weights' gradient sums `x^T du` over every step, where a
    # NaN or inf of padding times its zero cotangent is NaN. Zeroed, padding
    # reaches neither values nor gradients (whose part for it is zero).
    x = jnp.where(valid_steps(x.shape[0], seq_lengths)[..., None], x, jnp.zeros((), x.dtype))
  D = spec.num_dirs
  blocks = param_blocks(spec, params)
  hs, cs = [], []
  for layer in range(spec.num_layers):
    sl = slice(layer * D, (layer + 1) * D)
    x, h, c = run_layer(spec, x, h0[sl], None if c0 is None else c0[sl], blocks,
                         layer, seq_lengths)
    hs.append(h)
    cs.append(c)
    if apply_dropout and layer < spec.num_layers - 1:
      # Masks are drawn in the caller's layout, as every backend draws them.
      x = x if time_major else jnp.swapaxes(x, 0, 1)
      x = _dropout.apply(x.astype(out_dtype), dropout_key, layer, spec.dropout).astype(cdt)
      x = x if time_major else jnp.swapaxes(x, 0, 1)
  y = x if time_major else jnp.swapaxes(x, 0, 1)
  h = jnp.concatenate(hs).astype(out_dtype)
  c = None if c0 is None else jnp.concatenate(cs).astype(out_dtype)
  return y.astype(out_dtype), h, c
