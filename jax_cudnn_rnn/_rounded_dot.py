"""A matmul that rounds its operands, and whose transposes round theirs too.

`rounded_dot(a, b, dims, operands=bfloat16, result=float32)` is
`lax.dot_general(a.astype(bfloat16), b.astype(bfloat16), dims,
preferred_element_type=float32)`: the product of the rounded operands,
accumulated in float32. What it adds over writing that out is its
derivative: it is a bilinear JAX primitive whose transposes are again
`rounded_dot`s, so the cotangent is rounded too and the backward pass's
matmuls also multiply bfloat16 operands.

Why a primitive. JAX's transpose of `dot_general(a_bf16, b_bf16,
preferred_element_type=f32)` multiplies the float32 cotangent by the other
operand as it stands. XLA:CPU runs that mixed product as a float32 matmul,
as it does a product of two float32 operands converted from bfloat16
values: about 150 GFLOP/s on a 2-core AVX-512/AMX machine, against 500-1000
for bfloat16 operands with a float32 result (benchmarks/NOTES.md, session 16). `_xla`'s
backward pass is JAX's transpose of its hand-written tangent, so the fast
product has to be what that tangent is made of. A `custom_vjp` cannot be:
JAX cannot transpose one inside a `custom_jvp` rule's tangent (it raises
"Transpose rule ... for 'custom_vjp_call' not implemented"), and
`jax.custom_transpose` is not public API. A primitive keeps forward mode,
higher orders, `vmap` and sharding working, through the rules below.

What it means for `_xla`'s gradients: each matmul of the backward pass
multiplies the cotangent and the weights (or the layer's inputs and states)
rounded to bfloat16, and accumulates in float32, as tensor-core matmuls take
them; everything element-wise stays float32.

Where it multiplies. On a CPU whose bfloat16 products are slower than
float32 ones (`_cpu.bfloat16_products_fast` False: a Zen 3, a Xeon without
AMX), the operands rounded to bfloat16 are widened back to float32 and
multiplied there (`float32_products`), unless the caller says not to
(`widen`). The product of two bfloat16 values is exact in float32, so the
result is the same but for the order of the float32 sums, which no kernel
promises anyway. On that Xeon, bfloat16 products -> float32 products
(interleaved, ms): the bfloat16 LSTM B16 T50 I64 H128 forward 3.76 -> 2.61,
forward+backward 9.67 -> 7.62; B16 T256 I128 H256 42.1 -> 32.9, 168 -> 138;
the GRU B16 T50 3.0 -> 2.1, 7.9 -> 6.4 (benchmarks/NOTES.md, session 69).
XLA moves the widening of a weight matrix out of the loop that reads it, so
a call pays for it once, a pass over the weights: that lost where a call has
few steps to spread it over (a one-step LSTM B8 I1024 H1024 call 5.4 -> 13.3
ms, B8 T16 I256 H256 3.2 -> 3.5), and the caller says where not to widen
(`widen`; `_xla` does so below 32 steps but for one-step calls on a batch
over small weights, which a decoder's loop widens once). The choice is made
where the program is lowered: a program exported for CPUs keeps the
exporting host's.

A file DESIGN's layout does not list (nor `_xla`, whose docstring says why
it exists): it holds one idea, a JAX primitive with its own abstract
evaluation, lowering, differentiation and batching rules, which knows
nothing of RNNs; `_xla` uses it for bfloat16 models, and, rounding to the
operands' own dtype (no rounding), for a GRU's weight gradients, for the
orientation its transposes take (`_xla._weight_tangent_matmul`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_cudnn_rnn import _cpu

rounded_dot_p = Primitive("jcr_rounded_dot")


def _dims(dimension_numbers):
  """`((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))` as nested tuples of ints."""
  return tuple(tuple(tuple(int(i) for i in axes) for axes in pair) for pair in dimension_numbers)


def _same_varying_axes(a, b):
  """Inside `shard_map`, an operand invariant along a mesh axis that the other
  varies along is cast to varying, as JAX's own operations do (the transpose
  of that cast sums the cotangent over the axis: a replicated weight's
  gradient comes back summed)."""
  def vma(v):  # the aval's `mat.varying` (jax 0.10 to 0.12 at least; `vma` before)
    aval = jax.typeof(v)
    return frozenset(getattr(getattr(aval, "mat", None), "varying", None)
                     or getattr(aval, "vma", ()))

  missing_a, missing_b = vma(b) - vma(a), vma(a) - vma(b)
  if missing_a:
    a = jax.lax.pcast(a, tuple(sorted(missing_a)), to="varying")
  if missing_b:
    b = jax.lax.pcast(b, tuple(sorted(missing_b)), to="varying")
  return a, b


def rounded_dot(a, b, dimension_numbers, *, operands, result, widen=True, out_sharding=None):
  """`lax.dot_general` of `a` and `b` rounded to `operands`, accumulated and
  returned in `result`; its derivatives are `rounded_dot`s too (module
  docstring). `widen`: whether a CPU lowering may multiply the rounded
  operands in float32 (`float32_products`), which its transposes inherit.
  `out_sharding` is `lax.dot_general`'s."""
  a, b = _same_varying_axes(a, b)
  return rounded_dot_p.bind(a, b, dimension_numbers=_dims(dimension_numbers),
                            operands=np.dtype(operands), result=np.dtype(result),
                            widen=bool(widen), out_sharding=out_sharding)


def matmul(a, b, *, operands, result=None, widen=True):
  """`a @ b` for `a [..., K]` and `b [K, N]`, as a `rounded_dot` (result: `a`'s dtype)."""
  dims = (((a.ndim - 1,), (0,)), ((), ()))
  return rounded_dot(a, b, dims, operands=operands, result=result or a.dtype, widen=widen)


def _impl(a, b, *, dimension_numbers, operands, result, widen, out_sharding):
  # The barrier keeps XLA from rewriting the product with what follows it:
  # XLA:CPU folds a transpose of a dot's result into the dot (as another
  # output layout, or by swapping its operands), and then runs it with a
  # kernel that has no bfloat16 x bfloat16 -> float32 case, failing at run
  # time with "UNIMPLEMENTED: Unsupported element type for DotThunk::Execute:
  # BF16 x BF16 = F32" (jax 0.10.2 and 0.12.0.1; the weight gradients, whose
  # transposes into the opaque layout follow them, did). It cost nothing
  # measurable in the forward pass (LSTM B16 T256 I128 H256: 14.7 vs 14.9 ms).
  out = jax.lax.dot_general(a.astype(operands), b.astype(operands), dimension_numbers,
                            preferred_element_type=result, out_sharding=out_sharding)
  return jax.lax.optimization_barrier(out)


def _abstract_eval(a, b, **params):
  out = jax.eval_shape(functools.partial(_impl, **params),
                       jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                       jax.ShapeDtypeStruct(b.shape, b.dtype, sharding=b.sharding))
  return a.update(shape=out.shape, dtype=out.dtype, sharding=out.sharding, weak_type=False)


def _impl_in_float32(a, b, *, dimension_numbers, operands, result, widen, out_sharding):
  """`_impl` with the rounded operands widened back to float32 and multiplied
  there: the same products (exact in float32), summed in float32."""
  up = lambda v: v.astype(operands).astype(np.float32)
  out = jax.lax.dot_general(up(a), up(b), dimension_numbers,
                            preferred_element_type=np.float32, out_sharding=out_sharding)
  return jax.lax.optimization_barrier(out.astype(result))


def float32_products(operands) -> bool:
  """Whether a CPU lowering multiplies operands rounded to `operands` in
  float32 (the module docstring): for bfloat16 where this CPU's bfloat16
  products are slower than float32 ones (`_cpu.bfloat16_products_fast`)."""
  return np.dtype(operands) == np.dtype(jnp.bfloat16) and _cpu.bfloat16_products_fast() is False


def _cpu_lowering(ctx, a, b, **params):
  widen = params["widen"] and float32_products(params["operands"])
  impl = _impl_in_float32 if widen else _impl
  return mlir.lower_fun(impl, multiple_results=False)(ctx, a, b, **params)


rounded_dot_p.def_impl(_impl)
rounded_dot_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(rounded_dot_p, mlir.lower_fun(_impl, multiple_results=False))
mlir.register_lowering(rounded_dot_p, _cpu_lowering, platform="cpu")


# -- transposes ------------------------------------------------------------------------
#
# A product's axes are its batch axes, then its first operand's free axes,
# then its second's (each in their operand's order). The transpose with
# respect to one operand, `x`, multiplies the cotangent by the other operand,
# `y`: it contracts the cotangent's axes that came from `y`'s free axes with
# those, and keeps the batch axes. Of the two orders of that product's
# operands, the one whose axes come out in `x`'s own order is taken where
# there is one (a matmul's transposes always have one), saving a transpose.


def _free(ndim, contract, batch):
  return [i for i in range(ndim) if i not in contract and i not in batch]


def _transpose(ct, y, x_aval, x_contract, y_contract, x_batch, y_batch, x_free, ct_y_free,
               params):
  """The cotangent of `x` in the product of `x` and `y` (in either order);
  `ct_y_free`: the cotangent's axes that came from `y`'s free ones."""
  nb = len(x_batch)
  y_free = _free(y.ndim, y_contract, y_batch)
  ct_batch = tuple(range(nb))
  partners = [x_contract[j] for j in np.argsort(y_contract)]  # x's axes left on y's side
  candidates = [  # (operands, dimension numbers, the product's axes named as x's)
      ((ct, y), ((ct_y_free, tuple(y_free)), (ct_batch, y_batch)),
       list(x_batch) + x_free + partners),
      ((y, ct), ((tuple(y_free), ct_y_free), (y_batch, ct_batch)),
       list(x_batch) + partners + x_free),
  ]
  identity = [c for c in candidates if c[2] == sorted(c[2])]
  (lhs, rhs), dims, order = (identity or candidates)[0]
  spec = None
  sharding = x_aval.sharding
  if not sharding.mesh.empty:  # where lax.dot_general's own transposes place theirs
    spec = sharding.update(spec=sharding.spec.update(
        partitions=tuple(sharding.spec[o] if o < len(sharding.spec) else None for o in order)))
  out = rounded_dot(lhs, rhs, dims, operands=params["operands"], result=x_aval.dtype,
                    widen=params["widen"],
                    out_sharding=spec)
  if identity:
    return out
  return jax.lax.transpose(out, tuple(int(i) for i in np.argsort(order)))


def _transpose_lhs(ct, a, b, *, dimension_numbers, **params):
  (ca, cb), (ba, bb) = dimension_numbers
  a_free = _free(a.aval.ndim, ca, ba)
  b_free = _free(b.ndim, cb, bb)
  start = len(ba) + len(a_free)
  ct_b_free = tuple(range(start, start + len(b_free)))
  return _transpose(ct, b, a.aval, ca, cb, ba, bb, a_free, ct_b_free, params)


def _transpose_rhs(ct, a, b, *, dimension_numbers, **params):
  (ca, cb), (ba, bb) = dimension_numbers
  a_free = _free(a.ndim, ca, ba)
  b_free = _free(b.aval.ndim, cb, bb)
  ct_a_free = tuple(range(len(ba), len(ba) + len(a_free)))
  return _transpose(ct, a, b.aval, cb, ca, bb, ba, b_free, ct_a_free, params)


ad.defbilinear(rounded_dot_p, _transpose_lhs, _transpose_rhs)


# -- vmap ------------------------------------------------------------------------------


def _batch(args, batch_axes, *, dimension_numbers, out_sharding, **params):
  """The mapped axis moved to the front of each mapped operand: a new batch
  axis when both are mapped, else a free axis of the mapped one."""
  (a, b), (da, db) = args, batch_axes
  (ca, cb), (ba, bb) = dimension_numbers
  up = lambda axes: tuple(i + 1 for i in axes)
  if da is not None:
    a, ca, ba = jax.numpy.moveaxis(a, da, 0), up(ca), up(ba)
  if db is not None:
    b, cb, bb = jax.numpy.moveaxis(b, db, 0), up(cb), up(bb)
  if da is not None and db is not None:
    ba, bb, out_axis = (0,) + ba, (0,) + bb, 0
  elif da is not None:
    out_axis = len(ba)
  else:
    out_axis = len(ba) + len(_free(a.ndim, ca, ba))
  if out_sharding is not None:  # unmapped along the new axis
    ndim = len(ba) + len(_free(a.ndim, ca, ba)) + len(_free(b.ndim, cb, bb)) - 1
    partitions = list(out_sharding.spec) + [None] * (ndim - len(out_sharding.spec))
    partitions.insert(out_axis, None)
    out_sharding = out_sharding.update(spec=out_sharding.spec.update(partitions=partitions))
  out = rounded_dot_p.bind(a, b, dimension_numbers=((ca, cb), (ba, bb)),
                           out_sharding=out_sharding, **params)
  return out, out_axis


batching.primitive_batchers[rounded_dot_p] = _batch
