"""Random models and calls of the public API, against `_reference.rnn` (by hand,
or a GPU session's `fuzz-cudnn` stage).

    python tests/fuzz_against_reference.py [--implementation xla|cudnn]
        [--seed 0] [--cases 50] [--budget-s 0] [--one-step]

The test files check chosen configurations; this draws them at random, to
reach the "xla" path's measured rules (`_chunks`, `_lanes`, `_one_step`, the
decoder loop's gate blocks), whose choices depend on the sizes, and, on a
GPU, cuDNN's, over more shapes than its tests can afford. Each case draws a
model (the four cells, one to three layers, either direction and input mode,
H 8-320, input 8-256, 129 or H; float32 for half of them, bfloat16 for a
quarter, float16 and float64 for an eighth each) and a call
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
weight matrix, `_rounded_dot`); float16 4e-3 on the "xla" path (both sides
multiply float16 operands in float32 and round what they keep to float16:
session 89's 25 cases were at most 4.2e-4 apart, half of float16's unit in
the last place at 1) and 1e-2 against cuDNN (its own kernels; not yet
measured on a GPU); float64 1e-12 on the "xla" path (session 89's 25 cases:
at most 1.4e-15) and 1e-10 against cuDNN (not yet measured; a float64 case
runs with `jax.enable_x64`). Where a float32 case is out of tolerance, the
reference runs again in float64 (the same dropout masks: `_dropout`) and ours
is judged against that: a ReLU's mask flips where a pre-activation lies
within float32 rounding of 0, too (a float32 RNN-relu's tangent, L3 H96 T64
B16: ours 2.3e-7 from the float64 reference, the float32 reference 2.5e-2,
one unit of one step; session 80). A bfloat16 or float16 ReLU RNN's
derivatives are shown, not compared. In bfloat16, rounding the state to
bfloat16 before each product (as cuDNN does, and the reference does not)
flips the ReLU's mask where a pre-activation lies within that rounding of 0,
and the reference itself in bfloat16 stands as far from its float32 self
(benchmarks/NOTES.md, sessions 79 and 80: 0.5-0.7 of the largest tangent,
both ways). In float16, the "xla" path's derivative runs a forward of its
own (which keeps the tangent's coefficients), whose products and sums round
to float16 in another order than the plain forward's and the reference's;
where a pre-activation cancels to within that rounding of 0, its sign, and
the mask, can differ (session 89: a decoder, RNN-relu I160 H160 B64, one
unit of one sequence at the third step, 1.8e-6 in the plain forward and the
reference, 0 in the derivative's forward: its weight gradient 0.15 of the
largest from the reference's, which stood 0.096 from its own float64 self).

With `--one-step` every call is one step of one to three sequences outside
a loop (no "decode" check), as a language model's sampler makes them from
Python: those `_one_step` multiplies in place (in lanes from jax 0.11),
which the draws above reach in about one case in a hundred.

Prints a line a case ("ok", "ok-by-f64", "ok-relu-half", "BAD", "rejected",
"raised") and a summary; exits 1 where any case was out of
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
from helpers import call as public_call  # the spec's call as (y, h, c), c None without one

CELLS = {"lstm": jcr.CudnnLSTM, "gru": jcr.CudnnGRU, "rnn_tanh": jcr.CudnnRNNTanh,
         "rnn_relu": jcr.CudnnRNNRelu}
TOLERANCE = {("xla", "float32"): 2e-5, ("cudnn", "float32"): 1e-4,
             ("xla", "bfloat16"): 3e-2, ("cudnn", "bfloat16"): 3e-2,
             ("xla", "float16"): 4e-3, ("cudnn", "float16"): 1e-2,
             ("xla", "float64"): 1e-12, ("cudnn", "float64"): 1e-10}
DTYPES = ["float32"] * 4 + ["bfloat16"] * 2 + ["float16", "float64"]
DERIVATIVE_FACTOR = 5
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


def draw(rng: random.Random, implementation: str = "xla", one_step: bool = False) -> Case:
  """A random case; its sizes bounded so that a case takes seconds on a CPU.
  `one_step`: one step of one to three sequences, outside a loop."""
  mode = rng.choice(list(CELLS))
  hidden = rng.choice([8, 16, 32, 64, 96, 128, 160, 192, 256, 320])
  layers = rng.choice([1, 1, 2, 3])
  input_mode = rng.choice(["linear_input", "linear_input", "skip_input"])
  inputs = hidden if input_mode == "skip_input" else rng.choice([8, 32, 64, 128, 129, 256, hidden])
  steps = rng.choice([1, 2, 7, 16, 17, 32, 50, 64, 100])
  batch = rng.choice([1, 2, 4, 8, 16, 17, 32, 64])
  checks = ["grad", "grad", "vmap", "decode"] + (  # cuDNN's custom_vjp has no forward mode
      ["jvp", "jvp", "hvp"] if implementation == "xla" else [])
  if one_step:
    steps, batch = 1, rng.choice([1, 1, 2, 3])
    checks.remove("decode")
  check = rng.choice(checks)
  work = hidden * max(inputs, hidden) * batch
  if check == "decode":
    steps = 1
  while work * steps > (4e6 if check == "hvp" else 3e7) and steps > 1:
    steps //= 2
  return Case(mode=mode, layers=layers,
              direction=rng.choice(["unidirectional", "bidirectional"]),
              input_mode=input_mode, inputs=inputs, hidden=hidden, steps=steps, batch=batch,
              dtype=rng.choice(DTYPES),
              time_major=rng.random() < 0.7 or check == "decode",
              lengths=rng.random() < 0.4,
              dropout=rng.choice([0.0, 0.0, 0.3]) if layers > 1 and check != "decode" else 0.0,
              check=check)


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
  the outputs, and the case's derivative check. Where a float32 case is out
  of tolerance, the reference runs again in float64, and
  `what + "-f64"` holds ours against that, `"ref-" + what + "-f64"` the float32
  reference's (`verdict` judges by the former). A float64 case runs with
  64-bit types enabled, in the case alone."""
  if case.dtype == "float64":
    with jax.enable_x64(True):
      return _errors(case, seed, implementation, call)
  return _errors(case, seed, implementation, call)


def _errors(case: Case, seed: int, implementation: str, call) -> dict:
  spec = case.spec()
  arrays = _arrays(case, spec, seed)
  training = case.dropout > 0

  def model(spec, run):
    def f(p, x, h0, c0):
      return run(spec, x, h0, c0, p, seq_lengths=arrays["lengths"], time_major=case.time_major,
                 dropout_key=arrays["dropout_key"])
    return _decoder(f, case.inputs) if case.check == "decode" else f

  ours = lambda spec, *a, **o: call(spec, *a, is_training=training,
                                     implementation=implementation, **o)
  ref = lambda spec, *a, **o: _reference.rnn(spec, *a, apply_dropout=training, **o)
  got = _results(case, spec, model(spec, ours), arrays)
  want = _results(case, spec, model(spec, ref), arrays)
  found = {what: _worst(got[what], want[what]) for what in got}
  if case.dtype == "float32" and verdict(case, implementation, found) == "BAD":
    with jax.enable_x64(True):
      spec64 = dataclasses.replace(spec, dtype=jnp.float64)
      widen = lambda a: a.astype(jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a
      truth = _results(case, spec64, model(spec64, ref), jax.tree.map(widen, arrays))
      for what in got:
        found[f"{what}-f64"] = _worst(got[what], truth[what])
        found[f"ref-{what}-f64"] = _worst(want[what], truth[what])
  return found


def _arrays(case: Case, spec, seed: int) -> dict:
  """The case's weights, inputs, states, lengths, dropout key, and what its
  check needs besides (tangents, a direction in the weights, an ensemble)."""
  dtype = jnp.dtype(case.dtype)
  T, B, S = case.steps, case.batch, case.layers * spec.num_dirs
  keys = jax.random.split(jax.random.key(seed), 9)
  normal = lambda k, shape, scale=1.0: (scale * jax.random.normal(k, shape)).astype(dtype)
  arrays = dict(
      params=spec.init_params(keys[0]),
      x=normal(keys[1], (T, B, case.inputs) if case.time_major else (B, T, case.inputs)),
      h0=normal(keys[2], (S, B, case.hidden), 0.5),
      c0=normal(keys[3], (S, B, case.hidden), 0.5) if spec.has_cell_state else None,
      lengths=(jnp.asarray(np.random.default_rng(seed).integers(0, T + 1, B), jnp.int32)
               if case.lengths else None),
      dropout_key=keys[4] if case.dropout > 0 else None)
  primals = _primals(spec, arrays)
  if case.check == "jvp":
    arrays["tangents"] = tuple(normal(keys[5 + i], a.shape) for i, a in enumerate(primals))
  elif case.check == "hvp":
    arrays["v"] = normal(keys[5], arrays["params"].shape)
  elif case.check == "vmap":  # three weight sets and inputs, the states shared
    arrays["ensemble"] = (
        jnp.stack([arrays["params"], spec.init_params(keys[5]), spec.init_params(keys[6])]),
        jnp.stack([arrays["x"], arrays["x"] * 0.5, -arrays["x"]]))
  return arrays


def _primals(spec, arrays) -> tuple:
  """What the derivatives are in: the weights, the input and the states."""
  names = ("params", "x", "h0", "c0") if spec.has_cell_state else ("params", "x", "h0")
  return tuple(arrays[n] for n in names)


def _results(case: Case, spec, f, arrays) -> dict:
  """`{"out": f's outputs, check: its derivatives}` for `f(params, x, h0, c0)`."""
  primals = _primals(spec, arrays)
  h0, c0 = arrays["h0"], arrays["c0"]
  full = f if spec.has_cell_state else (lambda p, x, h0: f(p, x, h0, None))
  loss = lambda g: lambda *a: _loss(g(*a))
  results = {"out": jax.jit(full)(*primals)}
  if case.check in ("grad", "decode"):
    results["grad"] = jax.jit(jax.grad(loss(full), tuple(range(len(primals)))))(*primals)
  elif case.check == "jvp":
    results["jvp"] = jax.jit(lambda p, t: jax.jvp(full, p, t)[1])(primals, arrays["tangents"])
  elif case.check == "hvp":
    in_weights = lambda p: loss(full)(p, *primals[1:])
    results["hvp"] = jax.jit(lambda p: jax.jvp(jax.grad(in_weights), (p,), (arrays["v"],))[1])(
        arrays["params"])
  else:
    batched = lambda p, x: f(p, x, h0, c0)
    results["vmap"] = jax.jit(jax.vmap(batched))(*arrays["ensemble"])
    results["grad"] = jax.jit(jax.vmap(jax.grad(loss(batched), (0, 1))))(*arrays["ensemble"])
  return results


def _loss(outputs):
  """A scalar every output reaches non-linearly, each with its own weight."""
  return sum(jnp.sum(jnp.sin(o.astype(jnp.promote_types(o.dtype, jnp.float32)) * (i + 1)))
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
  """"BAD" (out of tolerance, or not finite), "ok-relu-half" (a bfloat16 or
  float16 ReLU RNN, whose derivatives are shown, not compared), "ok-by-f64" (in tolerance
  of the float64 reference, not of the float32 one: `errors`), or "ok"."""
  tol = TOLERANCE[implementation, case.dtype]
  shown_only = case.mode == "rnn_relu" and case.dtype in ("bfloat16", "float16")
  judged = [w for w in found if not w.endswith("-f64")]
  for what in judged:
    err = found.get(f"{what}-f64", found[what])
    if not np.isfinite(err):
      return "BAD"
    if what == "out" and err > tol:
      return "BAD"
    if what != "out" and not shown_only and err > DERIVATIVE_FACTOR * tol:
      return "BAD"
  if shown_only and len(judged) > 1:
    return "ok-relu-half"
  return "ok-by-f64" if any(w.endswith("-f64") for w in found) else "ok"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--implementation", choices=["xla", "cudnn"], default="xla")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--cases", type=int, default=50)
  parser.add_argument("--budget-s", type=float, default=0,
                      help="start no case after this many seconds (0: no limit)")
  parser.add_argument("--one-step", action="store_true",
                      help="every call one step of one to three sequences, outside a loop")
  args = parser.parse_args(argv)
  # A run of no case would report success having checked nothing.
  if args.cases < 1:
    parser.error(f"--cases must be at least 1, got {args.cases}")
  if not 0 <= args.budget_s < float("inf"):
    parser.error(f"--budget-s must be a finite number of seconds, at least 0, got {args.budget_s:g}")
  if args.implementation == "cudnn":
    available, why = _cudnn.availability()
    if not available:
      print(f"implementation='cudnn' cannot run here: {why}")
      return 1
  if jax.default_backend() == "gpu":  # the reference in full float32, as tests/conftest.py
    jax.config.update("jax_default_matmul_precision", "highest")
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, "
        f"implementation={args.implementation}, seed {args.seed}"
        + (", one step" if args.one_step else ""), flush=True)
  rng = random.Random(args.seed)
  start = time.time()
  counts = dict.fromkeys(["ok", "ok-by-f64", "ok-relu-half", "BAD", "rejected", "raised"], 0)
  for index in range(args.cases):
    if args.budget_s and time.time() - start > args.budget_s:
      print(f"budget spent after {index} cases")
      break
    case = draw(rng, args.implementation, args.one_step)
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
