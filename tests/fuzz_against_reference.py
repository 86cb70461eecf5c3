"""Random models and calls of the public API, against `_reference.rnn` (by hand,
or a GPU session's `fuzz-cudnn` stage).

    python tests/fuzz_against_reference.py [--implementation xla|cudnn]
        [--seed 0] [--cases 50] [--budget-s 0]

The test files check chosen configurations; this draws them at random, to
reach the "xla" path's measured rules (`_chunks`, `_lanes`, `_one_step`, the
decoder loop's gate blocks), whose choices depend on the sizes, and, on a
GPU, cuDNN's, over more shapes than its tests can afford. Each case draws a
model (the four cells, one to three layers, either direction and input mode,
H 8-320, input 8-256 or 129, float32 or for a quarter bfloat16) and a call
(T 1-100, B 1-64, time-major or not, `seq_lengths` with zeros among them or
none, dropout in training), compares the outputs, and then one kind of
derivative (`Case.check`):
- "grad": reverse mode in the weights, the input and the states;
- "jvp": forward mode in all of them ("xla" only: cuDNN's derivative is a
  `custom_vjp`, reverse mode only);
- "hvp": forward over reverse in the weights ("xla" only);
- "vmap": an ensemble of three weight sets and inputs, outputs and gradients;
- "decode": a `lax.scan` of three one-step calls closing over the weights,
  each feeding its output back, outputs and gradients.

An error is the largest difference, element by element, over the largest
value of the reference's array (so a single wrong sequence shows), the worst
over the outputs or derivatives compared. Tolerances (`TOLERANCE`; the
derivatives' five times the outputs'): float32 2e-5 on the "xla" path (the
same products in another order; session 79's fuzz found at most 1.5e-6),
1e-4 against cuDNN (other kernels: `tests/helpers.CROSS_TOL` puts one step
7.3e-6 apart); bfloat16 3e-2 (operands rounded to bfloat16 where they meet a
weight matrix, `_rounded_dot`). A bfloat16 ReLU RNN's derivatives are shown,
not compared: rounding the state to bfloat16 before each product (as cuDNN
does, and the reference does not) flips the ReLU's mask where a
pre-activation lies within that rounding of 0, and the reference itself in
bfloat16 stands as far from its float32 self (benchmarks/NOTES.md, sessions
79 and 80: 0.5-0.7 of the largest tangent, both ways).

Prints a line a case and a summary; exits 1 where any case was out of
tolerance or raised. A configuration cuDNN rejects ("cuDNN rejected") is
counted apart, not as a failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn, _reference

CELLS = {"lstm": jcr.CudnnLSTM, "gru": jcr.CudnnGRU, "rnn_tanh": jcr.CudnnRNNTanh,
         "rnn_relu": jcr.CudnnRNNRelu}
TOLERANCE = {("xla", "float32"): 2e-5, ("cudnn", "float32"): 1e-4,
             ("xla", "bfloat16"): 3e-2, ("cudnn", "bfloat16"): 3e-2}
DERIVATIVE_FACTOR = 5
FORWARD_MODE = ("jvp", "hvp")  # what cuDNN's custom_vjp cannot do
DECODE_STEPS = 3


@dataclasses.dataclass(frozen=True)
class Case:
  mode: str
  layers: int
  direction: str
  input_mode: str
  inputs: int
  hidden: int
  steps: int
  batch: int
  dtype: str
  time_major: bool
  lengths: bool
  dropout: float
  check: str

  def spec(self):
    return CELLS[self.mode](self.layers, self.hidden, self.inputs, input_mode=self.input_mode,
                            direction=self.direction, dtype=jnp.dtype(self.dtype),
                            dropout=self.dropout)

  def __str__(self):
    return (f"{self.check} {self.mode} L{self.layers} {self.direction[:3]} {self.input_mode[:4]} "
            f"I{self.inputs} H{self.hidden} T{self.steps} B{self.batch} {self.dtype} "
            f"tm={self.time_major} len={self.lengths} drop={self.dropout}")


def draw(rng: random.Random, implementation: str = "xla") -> Case:
  """A random case; its sizes bounded so that a case takes seconds on a CPU."""
  mode = rng.choice(list(CELLS))
  hidden = rng.choice([8, 16, 32, 64, 96, 128, 160, 192, 256, 320])
  layers = rng.choice([1, 1, 2, 3])
  input_mode = rng.choice(["linear_input", "linear_input", "skip_input"])
  inputs = hidden if input_mode == "skip_input" else rng.choice([8, 32, 64, 128, 129, 256, hidden])
  steps = rng.choice([1, 2, 7, 16, 17, 32, 50, 64, 100])
  batch = rng.choice([1, 2, 4, 8, 16, 17, 32, 64])
  checks = ["grad", "grad", "vmap", "decode"] + (
      ["jvp", "jvp", "hvp"] if implementation == "xla" else [])
  check = rng.choice(checks)
  work = hidden * max(inputs, hidden) * batch
  if check == "decode":
    steps = 1
  while work * steps > (4e6 if check == "hvp" else 3e7) and steps > 1:
    steps //= 2
  return Case(mode=mode, layers=layers,
              direction=rng.choice(["unidirectional", "bidirectional"]),
              input_mode=input_mode, inputs=inputs, hidden=hidden, steps=steps, batch=batch,
              dtype=rng.choice(["float32", "float32", "float32", "bfloat16"]),
              time_major=rng.random() < 0.7 or check == "decode",
              lengths=rng.random() < 0.4,
              dropout=rng.choice([0.0, 0.0, 0.3]) if layers > 1 and check != "decode" else 0.0,
              check=check)


def public_call(spec, x, h0, c0, params, **options):
  """The spec's call as `(y, h, c)`, c None for models without a cell state."""
  if spec.has_cell_state:
    return tuple(spec(x, h0, c0, params, **options))
  return (*spec(x, h0, params, **options), None)


def _relative(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-6))


def _worst(got, want) -> float:
  pairs = list(zip(jax.tree.leaves(got), jax.tree.leaves(want)))
  assert pairs and len(jax.tree.leaves(got)) == len(jax.tree.leaves(want))
  return max(_relative(a, b) for a, b in pairs)


def errors(case: Case, seed: int, implementation: str = "xla", call=public_call) -> dict:
  """`{what: relative error}` of `call` (the public call by default; a test
  passes a broken one) with `implementation` against the reference: "out" for
  the outputs, and the case's derivative check."""
  spec = case.spec()
  dtype = jnp.dtype(case.dtype)
  T, B, S = case.steps, case.batch, case.layers * spec.num_dirs
  keys = jax.random.split(jax.random.key(seed), 9)
  params = spec.init_params(keys[0])
  normal = lambda k, shape, scale=1.0: (scale * jax.random.normal(k, shape)).astype(dtype)
  x = normal(keys[1], (T, B, case.inputs) if case.time_major else (B, T, case.inputs))
  h0 = normal(keys[2], (S, B, case.hidden), 0.5)
  c0 = normal(keys[3], (S, B, case.hidden), 0.5) if spec.has_cell_state else None
  lengths = (jnp.asarray(np.random.default_rng(seed).integers(0, T + 1, B), jnp.int32)
             if case.lengths else None)
  training = case.dropout > 0
  options = dict(seq_lengths=lengths, time_major=case.time_major,
                 dropout_key=keys[4] if training else None)

  def ours(p, x, h0, c0):
    return call(spec, x, h0, c0, p, is_training=training, implementation=implementation,
                **options)

  def ref(p, x, h0, c0):
    return _reference.rnn(spec, x, h0, c0, p, apply_dropout=training, **options)

  if case.check == "decode":
    ours, ref = _decoder(ours, case.inputs), _decoder(ref, case.inputs)
  found = {"out": _worst(jax.jit(ours)(params, x, h0, c0), jax.jit(ref)(params, x, h0, c0))}
  # Derivatives in the weights, the input and the states (c0 where there is one).
  argnums = (0, 1, 2, 3) if spec.has_cell_state else (0, 1, 2)
  primals = (params, x, h0, c0)
  loss = lambda f: lambda *a: _loss(f(*a))
  if case.check in ("grad", "decode"):
    grad = lambda f: jax.jit(jax.grad(loss(f), argnums))(*primals)
    found["grad"] = _worst(grad(ours), grad(ref))
  elif case.check == "jvp":
    tangents = tuple(normal(keys[5 + i], primals[i].shape) for i in argnums)
    rest = lambda f: lambda *a: f(*a, *primals[len(argnums):])
    jvp = lambda f: jax.jit(lambda p, t: jax.jvp(rest(f), p, t)[1])(primals[:len(argnums)],
                                                                   tangents)
    found["jvp"] = _worst(jvp(ours), jvp(ref))
  elif case.check == "hvp":
    v = normal(keys[5], params.shape)
    in_weights = lambda f: lambda p: loss(f)(p, x, h0, c0)
    hvp = lambda f: jax.jit(lambda p: jax.jvp(jax.grad(in_weights(f)), (p,), (v,))[1])(params)
    found["hvp"] = _worst(hvp(ours), hvp(ref))
  else:  # vmap: three weight sets and inputs, the states shared
    ensemble = (jnp.stack([params, spec.init_params(keys[5]), spec.init_params(keys[6])]),
                jnp.stack([x, x * 0.5, -x]))
    batched = lambda f: lambda p, x: f(p, x, h0, c0)
    vmapped = lambda f: jax.jit(jax.vmap(batched(f)))(*ensemble)
    found["vmap"] = _worst(vmapped(ours), vmapped(ref))
    vgrad = lambda f: jax.jit(jax.vmap(jax.grad(loss(batched(f)), (0, 1))))(*ensemble)
    found["grad"] = _worst(vgrad(ours), vgrad(ref))
  return found


def _loss(outputs):
  """A scalar every output reaches non-linearly, each with its own weight."""
  return sum(jnp.sum(jnp.sin(o.astype(jnp.float32) * (i + 1)))
             for i, o in enumerate(jax.tree.leaves(outputs)))


def _decoder(step, inputs: int):
  """`DECODE_STEPS` one-step calls of `step` in a `lax.scan` that closes over
  the weights, each feeding its output, cut or repeated to `inputs` wide, back
  as the next input: `(outputs [steps, B, D*H], h, c)`."""
  def decode(p, x, h0, c0):
    def body(carry, _):
      x, h, c = carry
      y, h, c = step(p, x, h, c)
      width = y.shape[-1]
      fed = jnp.tile(y, (1, 1, -(-inputs // width)))[..., :inputs]
      return (jnp.tanh(fed).astype(x.dtype), h, c), y[0]
    (_, h, c), ys = jax.lax.scan(body, (x, h0, c0), None, length=DECODE_STEPS)
    return ys, h, c
  return decode


def verdict(case: Case, implementation: str, found: dict) -> str:
  """"ok", "BAD" (out of tolerance or not finite) or "ok-relu-bf16" (a
  bfloat16 ReLU RNN whose derivatives were shown, not compared)."""
  tol = TOLERANCE[implementation, case.dtype]
  shown_only = case.mode == "rnn_relu" and case.dtype == "bfloat16"
  for what, err in found.items():
    if not np.isfinite(err):
      return "BAD"
    if what == "out" and err > tol:
      return "BAD"
    if what != "out" and not shown_only and err > DERIVATIVE_FACTOR * tol:
      return "BAD"
  return "ok-relu-bf16" if shown_only and len(found) > 1 else "ok"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--implementation", choices=["xla", "cudnn"], default="xla")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cases", type=int, default=50)
  parser.add_argument("--budget-s", type=float, default=0,
                      help="start no case after this many seconds (0: no limit)")
  args = parser.parse_args(argv)
  if args.implementation == "cudnn":
    available, why = _cudnn.availability()
    if not available:
      print(f"implementation='cudnn' cannot run here: {why}")
      return 1
  if jax.default_backend() == "gpu":  # the reference in full float32, as tests/conftest.py
    jax.config.update("jax_default_matmul_precision", "highest")
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"implementation={args.implementation}, seed {args.seed}", flush=True)
  rng = random.Random(args.seed)
  start, counts = time.time(), {"ok": 0, "ok-relu-bf16": 0, "BAD": 0, "rejected": 0, "raised": 0}
  for index in range(args.cases):
    if args.budget_s and time.time() - start > args.budget_s:
      print(f"budget spent after {index} cases")
      break
    case = draw(rng, args.implementation)
    try:
      found = errors(case, args.seed * 100003 + index, args.implementation)
      result = verdict(case, args.implementation, found)
      detail = " ".join(f"{what}={err:.1e}" for what, err in found.items())
    except ValueError as e:
      result = "rejected" if "cuDNN rejected" in str(e) else "raised"
      detail = f"{type(e).__name__}: {str(e)[:300]}"
    except Exception as e:  # reported, and counted as a failure
      result, detail = "raised", f"{type(e).__name__}: {str(e)[:300]}"
    counts[result] += 1
    print(f"{result} {index} {case} {detail}", flush=True)
  print(" ".join(f"{k}={v}" for k, v in counts.items()), f"in {time.time() - start:.0f} s")
  return 1 if counts["BAD"] or counts["raised"] else 0


if __name__ == "__main__":
  sys.exit(main())
