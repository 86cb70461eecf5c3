"""The cuDNN path under symbolic shapes (a shape-polymorphic `jax.export`).

cuDNN's inference call needs no size fixed at trace time: the handler reads
the steps and the batch from its operands when it runs, and takes its
workspace from XLA's scratch allocator. So it lowers with symbolic shapes (an
FFI call whose result shapes are symbolic), and JAX refines the exported module
to the caller's concrete shapes before XLA compiles it: one artifact serves
every batch size and length at cuDNN's speed.

cuDNN's training call cannot: its reserve space is an XLA buffer whose size
cuDNN reports only for concrete steps and batch, by no documented formula. So
under symbolic shapes the values come from cuDNN's inference call, and a
derivative (`jax.grad`, `jax.vjp`, an export serialized with `vjp_order >= 1`):

- with `implementation=None`, is the "xla" path's, which recomputes the
  forward pass in XLA (its values agree with cuDNN's to rounding; dropout
  draws the same masks on both);
- with `implementation="cudnn"`, raises `ValueError`: cuDNN cannot compute it,
  and an explicit request does not fall back.

A separate file because it is one decision of its own, made around the whole
cuDNN path (`_cudnn.rnn`) rather than inside one of its calls.
"""

from __future__ import annotations

from typing import Callable

import jax

from jax_cudnn_rnn import _cudnn


def rnn(spec, x, h0, c0, params, *, derivative: Callable | None,
        seq_lengths=None, dropout_key=None, apply_dropout=False, time_major=True):
  """`_cudnn.rnn`'s values, with the reverse-mode derivative of `derivative`
  (which takes `_cudnn.rnn`'s arguments: `_xla.rnn`), or an error where it is
  None. Same contract as `_cudnn.rnn`."""
  static = dict(apply_dropout=apply_dropout, time_major=time_major)

  @jax.custom_vjp
  def run(x, h0, c0, params, lengths, key):
    return _cudnn.rnn(spec, x, h0, c0, params, seq_lengths=lengths, dropout_key=key, **static)

  def run_fwd(x, h0, c0, params, lengths, key):
    if derivative is None:
      raise ValueError(
          f"implementation='cudnn' cannot differentiate input_data of the symbolic shape "
          f"{tuple(x.shape)} (a shape-polymorphic jax.export): cuDNN's training call returns a "
          "reserve space sized at trace time. Use implementation=None (cuDNN's values, the "
          "'xla' path's derivative) or export with concrete shapes")
    out, vjp = jax.vjp(
        lambda x, h0, c0, params: derivative(spec, x, h0, c0, params, seq_lengths=lengths,
                                             dropout_key=key, **static), x, h0, c0, params)
    return out, vjp

  def run_bwd(vjp, cotangents):
    return (*vjp(cotangents), None, None)  # the lengths and the key: not differentiable

  run.defvjp(run_fwd, run_bwd)
  return run(x, h0, c0, params, seq_lengths, dropout_key)
