"""`_rounded_dot`: the product of bfloat16-rounded operands, and its
derivatives, against `lax.dot_general` of operands rounded by hand (in
float32 at HIGHEST precision, which multiplies bfloat16 values exactly)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_cudnn_rnn import _rounded_dot

BF16, F32 = jnp.bfloat16, jnp.float32

# name: (lhs shape, rhs shape, dimension numbers)
CASES = {
    "matmul": ((3, 5, 7), (7, 4), (((2,), (0,)), ((), ()))),
    "weight-gradient": ((3, 5, 7), (3, 5, 6), (((0, 1), (0, 1)), ((), ()))),
    "rhs-transposed": ((5, 7), (4, 7), (((1,), (1,)), ((), ()))),
    "batched": ((3, 5, 7), (3, 5, 2), (((1,), (1,)), ((0,), (0,)))),
    # Its transposes' products come out in another axis order than their operand's.
    "permuted": ((3, 5, 7), (3, 7, 2), (((2, 0), (1, 0)), ((), ()))),
}


def _round(v):
  return v.astype(BF16).astype(F32)


def _ref(a, b, dims):
  return jax.lax.dot_general(_round(a), _round(b), dims, precision="highest")


def _operands(case, seed=0):
  a_shape, b_shape, dims = CASES[case]
  ka, kb = jax.random.split(jax.random.key(seed))
  return jax.random.normal(ka, a_shape, F32), jax.random.normal(kb, b_shape, F32), dims


def _dot(dims):
  return lambda a, b: _rounded_dot.rounded_dot(a, b, dims, operands=BF16, result=F32)


@pytest.mark.usefixtures("products")
@pytest.mark.parametrize("case", sorted(CASES))
def test_value(case):
  a, b, dims = _operands(case)
  got = _dot(dims)(a, b)
  assert got.dtype == F32
  np.testing.assert_allclose(got, _ref(a, b, dims), rtol=1e-5, atol=1e-5)
  # Rounding is what it does: the unrounded product differs.
  exact = jax.lax.dot_general(a, b, dims, precision="highest")
  assert np.abs(np.asarray(got - exact)).max() > 1e-3


@pytest.mark.usefixtures("products")
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_vjp_rounds_the_cotangent(case, jit):
  """Both transposes are products of bfloat16-rounded operands, the cotangent
  rounded too: exactly what the rounded reference's transposes give when fed
  the rounded cotangent (under `jit` too, where XLA:CPU must not be handed a
  bfloat16 product it has no kernel for: `_rounded_dot._impl`)."""
  a, b, dims = _operands(case)
  ct = jax.random.normal(jax.random.key(5), _dot(dims)(a, b).shape, F32)
  vjp = lambda a, b, ct: jax.vjp(_dot(dims), a, b)[1](ct)
  got = (jax.jit(vjp) if jit else vjp)(a, b, ct)
  want = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"),
                 _round(a), _round(b))[1](_round(ct))
  for g, w, primal in zip(got, want, (a, b)):
    assert g.shape == primal.shape and g.dtype == F32
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)
  unrounded = jax.vjp(lambda a, b: _ref(a, b, dims), a, b)[1](ct)
  assert max(np.abs(np.asarray(g - u)).max() for g, u in zip(got, unrounded)) > 1e-3


@pytest.mark.parametrize("case", sorted(CASES))
def test_jvp(case):
  a, b, dims = _operands(case)
  ta, tb, _ = _operands(case, seed=1)
  value, tangent = jax.jvp(_dot(dims), (a, b), (ta, tb))
  np.testing.assert_allclose(value, _ref(a, b, dims), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tangent, _ref(ta, b, dims) + _ref(a, tb, dims), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("axes", [(0, None), (None, 0), (0, 0), (1, None), (None, 1), (2, 1)])
@pytest.mark.parametrize("case", ["matmul", "batched", "permuted"])
def test_vmap(case, axes):
  """Values and gradients, mapped over either operand or both, at any axis,
  against the same mapped over the rounded reference."""
  a, b, dims = _operands(case)
  ia, ib = axes
  a = a if ia is None else jnp.stack([a, 2 * a, -a], ia)
  b = b if ib is None else jnp.stack([b, -b, 0.5 * b], ib)
  np.testing.assert_allclose(jax.vmap(_dot(dims), axes)(a, b),
                             jax.vmap(lambda a, b: _ref(a, b, dims), axes)(a, b),
                             rtol=1e-5, atol=1e-4)
  ct = jax.random.normal(jax.random.key(3), jax.vmap(_dot(dims), axes)(a, b).shape, F32)
  got = jax.vmap(lambda a, b, ct: jax.vjp(_dot(dims), a, b)[1](ct), axes + (0,))(a, b, ct)
  want = jax.vmap(lambda a, b, ct: jax.vjp(
      lambda a, b: jax.lax.dot_general(a, b, dims, precision="highest"),
      _round(a), _round(b))[1](_round(ct)), axes + (0,))(a, b, ct)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def test_second_order():
  """The Hessian of `sum(rounded_dot(x, W)^2)` in `x` is `2 W W^T` per row
  pair, with `W` rounded once in the tangent and once in its transpose."""
  x = jax.random.normal(jax.random.key(0), (2, 6), F32)
  w = jax.random.normal(jax.random.key(1), (6, 3), F32)
  hessian = jax.hessian(lambda x: jnp.sum(_rounded_dot.matmul(x, w, operands=BF16) ** 2))(x)
  wr = np.asarray(_round(w), np.float64)
  want = np.einsum("ij,kl->ikjl", np.eye(2), 2 * wr @ wr.T)
  np.testing.assert_allclose(hessian, want, rtol=1e-5, atol=1e-4)


def test_matmul_result_dtype():
  """`matmul` returns the lhs's dtype unless told otherwise, and takes bfloat16
  operands as they are."""
  a = jnp.ones((2, 3), F32)
  b = jnp.full((3, 4), 1 / 3, BF16)
  out = _rounded_dot.matmul(a, b, operands=BF16)
  assert out.dtype == F32
  np.testing.assert_allclose(out, np.full((2, 4), 3 * float(b[0, 0])), rtol=1e-6)
  assert _rounded_dot.matmul(a, b, operands=BF16, result=BF16).dtype == BF16


def _lowered_operands(dims, **kwargs):
  """The operand types of a product's and its two transposes' dot_generals,
  lowered for a CPU whatever the host; each must have a float32 result."""
  a, b, _ = _operands("matmul")
  product = lambda a, b: _rounded_dot.rounded_dot(a, b, dims, operands=BF16, result=F32, **kwargs)
  f = lambda a, b: jnp.sum(product(a, b) ** 2)
  traced = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(a, b)
  text = traced.lower(lowering_platforms=("cpu",)).as_text()
  dots = [line for line in text.splitlines() if "dot_general" in line]
  assert len(dots) == 3, dots  # the product and its two transposes
  kinds = set()
  for line in dots:
    inputs, output = line.rsplit(":", 1)[1].split("->")
    assert output.strip().endswith("xf32>"), line
    kinds |= {kind for kind in ("bf16", "f32") if inputs.count(f"x{kind}>") == 2}
  return kinds


def test_cpu_lowering_multiplies_where_the_cpu_is_quick(products):
  """On a CPU the product's operands are bfloat16 where bfloat16 products are
  quick, else float32 (the rounded values widened back); its transposes' too;
  bfloat16 either way where the caller says not to widen. Other rounding
  dtypes are left alone."""
  dims = CASES["matmul"][2]
  assert _lowered_operands(dims) == {{"bfloat16": "bf16", "float32": "f32"}[products]}
  assert _lowered_operands(dims, widen=False) == {"bf16"}
  assert _rounded_dot.float32_products(BF16) == (products == "float32")
  assert not _rounded_dot.float32_products(jnp.float16)
  assert not _rounded_dot.float32_products(F32)
