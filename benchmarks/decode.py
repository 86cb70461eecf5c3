"""Decoding one step at a time, as a language model samples: ours against the peers.

    python benchmarks/decode.py               # a few minutes on a 2-core CPU
    python benchmarks/decode.py --quick

`run.py` times whole sequences; this times the other way an RNN runs, one
step per call with the state carried between calls, in the three patterns a
JAX user writes:
- "loop": `--steps` one-step calls inside one jitted `jax.lax.scan` (the fast
  way to decode in JAX; XLA compiles the whole loop). Ours ("xla", and
  "cudnn" on a GPU) and Flax's cells (`OptimizedLSTMCell` / `GRUCell`, one
  per layer, applied once a step). On a GPU the tables' "ours" is the cuDNN
  call; `implementation=None` runs a one-step call on the "xla" path up to
  `_ops.ONE_STEP_XLA_MAX_ELEMENTS` (`ours-xla`), which these timings chose.
- "step": one jitted one-step call made from Python per token (a sampling
  loop in Python, as `jax_cudnn_rnn.demo` does): ours, Flax's cells, and
  PyTorch's `nn.LSTM` / `nn.GRU` given a one-step input (eager, `no_grad`).
- "eager": the same one-step call made from Python without `jax.jit` (a
  notebook, a first sketch): ours (its eager calls run a compiled, cached
  program), Flax's cells (op by op), and PyTorch as in "step".
Each step also computes `tanh(y @ P)` of its output (a fixed projection
standing in for embedding a sampled token), which in the loop is the next
step's input; a timed call from Python starts from the same input and state
each time. Figures are per
token (a loop's time divided by its steps), medians over round-robin rounds
(`run._time_interleaved`), float32.

    python benchmarks/decode.py --large

times five larger models instead (LSTM and GRU, H512 and H1024), either side
of the size up to which `implementation=None` runs a one-step call on the
"xla" path rather than cuDNN (`_ops.one_step_on_xla`); such a run's files end
in `-large`.

    python benchmarks/decode.py --dtype bfloat16

runs every contender in bfloat16 instead (weights, inputs and states; Flax's
cells with `dtype` and `param_dtype` bfloat16, PyTorch's module cast); such a
run's shapes and files say so (`-bfloat16`).

Writes `<out-dir>/decode-<machine>-<date>.json` (every figure, the versions,
the device) and `.md` (ratios of each peer's time to ours: > 1 means we are
faster; and the same ratios paired round by round, with their spread:
`run.paired_table`).

    python benchmarks/decode.py --sync-dispatch

How JAX's CPU client dispatches is recorded too (`cpu_async_dispatch`). By
default it runs each call on a thread of its own, which the calling thread
wakes and then waits for. With `--sync-dispatch` (JAX's
`jax_cpu_enable_async_dispatch` off, which a decoding program can choose
too) it runs each call on the calling thread; such a run's files end in
`-sync`. JAX reads that setting when it makes its CPU client, so the option
sets it and drops the clients made before (`jax.extend.backend.clear_backends`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import sys

import jax
import jax.extend
import jax.numpy as jnp

from jax_cudnn_rnn import _cudnn

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import run as grid_run  # noqa: E402  (benchmarks/run.py: timing, versions, CPU description)


@dataclasses.dataclass(frozen=True)
class Shape:
  mode: str  # "lstm" | "gru"
  batch: int
  input_size: int
  hidden: int
  layers: int
  dtype: str = "float32"

  @property
  def name(self) -> str:
    name = f"{self.mode} B{self.batch} I{self.input_size} H{self.hidden} L{self.layers}"
    return name if self.dtype == "float32" else f"{name} {self.dtype}"

  def __post_init__(self):
    grid_run.spec_class(self.mode)

  def spec(self):
    return grid_run.spec_class(self.mode)(self.layers, self.hidden, self.input_size,
                                          dtype=jnp.dtype(self.dtype))


def shapes(quick: bool, large: bool = False) -> list[Shape]:
  if large:
    # Either side of the bound up to which `implementation=None` runs a
    # one-step call on the "xla" path rather than cuDNN (`_ops.one_step_on_xla`:
    # 2^22 elements), which was set from smaller models' timings on a GPU.
    return [Shape("lstm", 8, 512, 512, 1),    # 2.1M elements: "xla" under None
            Shape("gru", 8, 512, 512, 2),     # 3.1M: "xla"
            Shape("gru", 8, 1024, 1024, 1),   # 6.3M: cuDNN
            Shape("lstm", 8, 1024, 1024, 1),  # 8.4M: cuDNN
            Shape("lstm", 1, 512, 512, 4)]    # 8.4M: cuDNN
  if quick:
    return [Shape("lstm", 1, 64, 128, 1), Shape("lstm", 8, 64, 128, 1)]
  out = []
  for mode in ("lstm", "gru"):
    out += [Shape(mode, 1, 64, 128, 1),    # one sequence: a chat-style sampler
            Shape(mode, 8, 64, 128, 1),    # a small batch of samples
            Shape(mode, 1, 256, 256, 2),   # a deeper model, one sequence
            Shape(mode, 8, 256, 256, 1),
            Shape(mode, 32, 128, 256, 1)]  # a large batch
  return out


def _inputs(shape: Shape):
  x = jax.random.normal(jax.random.key(1), (shape.batch, shape.input_size), jnp.float32)
  proj = jax.random.normal(jax.random.key(2), (shape.hidden, shape.input_size), jnp.float32)
  proj = proj * 0.05
  return x.astype(shape.dtype), proj.astype(shape.dtype)


# -- the contenders: each returns {pattern: call} -----------------------------------
#
# The weights are arguments of the jitted calls, as in a real model: closed over, they
# would be constants that XLA may fold (the slicing and transposing of ours, say).


def _patterns(one, steps: int, params, x, state) -> dict:
  """The three patterns of a JAX contender whose `one(params, x, state)` makes
  one step and returns `(next x, next state)`: one jitted call, a jitted loop
  of `steps` of them, and one call without `jit`; each returns its result."""
  def loop(params, x, state):
    return jax.lax.scan(lambda carry, _: (one(params, *carry), None), (x, state), None,
                        length=steps)[0]

  step, loop = jax.jit(one), jax.jit(loop)
  return {"step": lambda: jax.block_until_ready(step(params, x, state)),
          "loop": lambda: jax.block_until_ready(loop(params, x, state)),
          "eager": lambda: jax.block_until_ready(one(params, x, state))}


def ours(shape: Shape, steps: int, implementation: str, algorithm: str | None = None) -> dict:
  """`algorithm`: a cuDNN algorithm policy (`_cudnn.ALGORITHM_POLICIES`) for every call,
  else the environment's."""
  spec = shape.spec()
  params = spec.init_params(jax.random.key(0))
  x, proj = _inputs(shape)
  zeros = jnp.zeros((shape.layers, shape.batch, shape.hidden), shape.dtype)
  state = (zeros, zeros if shape.mode == "lstm" else None)  # (h, c)

  def one(params, x, state):
    out = spec._run(x[None], *state, params, False, implementation=implementation)
    y, h, c = out if len(out) == 3 else (*out, None)  # a GRU returns (y, h)
    return jnp.tanh(y[0] @ proj), (h, c)

  patterns = _patterns(one, steps, params, x, state)
  if algorithm is None:
    return patterns
  # The policy is read when a call is traced, and by an eager call when it is
  # dispatched: each call runs under it.
  return {name: functools.partial(_under_policy, algorithm, call)
          for name, call in patterns.items()}


def _under_policy(algorithm: str, call):
  with grid_run._environment(_cudnn.ALGORITHM_ENV, algorithm):
    return call()


def flax_cells(shape: Shape, steps: int) -> dict:
  import flax.linen as nn
  dtype = jnp.dtype(shape.dtype)
  cell_class = nn.OptimizedLSTMCell if shape.mode == "lstm" else nn.GRUCell
  make = lambda: cell_class(shape.hidden, dtype=dtype, param_dtype=dtype,
                            recurrent_kernel_init=grid_run.flax_recurrent_init)
  cells = [make() for _ in range(shape.layers)]
  x, proj = _inputs(shape)
  params, carries = [], []
  for layer, cell in enumerate(cells):
    size = shape.input_size if layer == 0 else shape.hidden
    carry = cell.initialize_carry(jax.random.key(3), (shape.batch, size))
    params.append(cell.init(jax.random.key(layer), carry, jnp.zeros((shape.batch, size), dtype)))
    carries.append(carry)
  carries = tuple(carries)

  def one(params, x, carries):
    new, h = [], x
    for cell, p, carry in zip(cells, params, carries):
      carry, h = cell.apply(p, carry, h)
      new.append(carry)
    return jnp.tanh(h @ proj), tuple(new)

  return _patterns(one, steps, params, x, carries)


def torch_module(shape: Shape, device: str) -> dict:
  import torch
  cls = torch.nn.LSTM if shape.mode == "lstm" else torch.nn.GRU
  dtype = getattr(torch, shape.dtype)
  module = cls(shape.input_size, shape.hidden, shape.layers).to(device=device, dtype=dtype)
  x = torch.randn(1, shape.batch, shape.input_size, device=device, dtype=dtype)
  proj = torch.randn(shape.hidden, shape.input_size, device=device, dtype=dtype) * 0.05
  zeros = torch.zeros(shape.layers, shape.batch, shape.hidden, device=device, dtype=dtype)
  state = (zeros, zeros.clone()) if shape.mode == "lstm" else zeros
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def step():
    with torch.no_grad():
      y, new_state = module(x, state)
      torch.tanh(y[0] @ proj)
    sync()
    return new_state

  return {"step": step, "eager": step}  # PyTorch is eager either way


def contenders(shape: Shape, steps: int, gpu: bool, have_torch: bool) -> dict:
  out = {"ours-xla": lambda: ours(shape, steps, "xla"),
         "flax-cells": lambda: flax_cells(shape, steps)}
  if gpu:
    out["ours-cudnn"] = lambda: ours(shape, steps, "cudnn")
    inference, _ = _cudnn.choose_algorithms(shape.spec(), has_seq_lengths=False)
    if inference == _cudnn.ALGORITHMS["persist_static_small_h"]:
      # A one-step call under the persistent algorithm, which loads the weights for each
      # call, against the standard one: on an H100 a cuDNN step cost 56-130 us in the
      # loop, Flax's cells 10-26 (session 46 in NOTES.md).
      out["ours-cudnn-standard"] = lambda: ours(shape, steps, "cudnn", algorithm="standard")
  if have_torch:
    out["torch"] = lambda: torch_module(shape, "cuda" if gpu else "cpu")
  return out


# -- the report --------------------------------------------------------------------------


ASYNC_DISPATCH = "jax_cpu_enable_async_dispatch"


def async_dispatch() -> bool:
  """Whether JAX's CPU client runs calls on a thread of its own (the default)
  rather than on the calling thread (`--sync-dispatch`)."""
  return bool(jax.config.values.get(ASYNC_DISPATCH, True))


def dispatch_synchronously() -> None:
  """Has JAX make its CPU client anew, running calls on the calling thread:
  the setting is read when a client is made, so the ones made before are
  dropped (arrays on them with them: call this before making any)."""
  jax.config.update(ASYNC_DISPATCH, False)
  jax.extend.backend.clear_backends()


def markdown(results: list[dict], device: str, steps: int, asynchronous: bool = True,
             cpus: int | None = None) -> str:
  dispatch = ("" if asynchronous else
              " JAX's CPU client ran each call on the calling thread "
              f"(`--sync-dispatch`: `{ASYNC_DISPATCH}` off), not on a thread of its own.")
  lines = [f"# Decoding one step at a time on {device}", "",
           f"Microseconds per token; \"loop\": {steps} steps in one jitted `lax.scan`, "
           "\"step\": one jitted call per token from Python, \"eager\": one call per token "
           "without `jit` (PyTorch's is its \"step\" again). Ratio = the column's time / "
           "ours (`ours-cudnn` on a GPU, else `ours-xla`); > 1 means ours is faster."
           + dispatch, ""]
  ours = grid_run.ours_of(results)
  peers = sorted({r["impl"] for r in results} - {ours})
  for pattern in ("loop", "step", "eager"):
    section = [r for r in results if r["pattern"] == pattern]
    present = [p for p in peers if any(r["impl"] == p for r in section)]
    lines += [f"## {pattern}", ""]
    lines += grid_run.ratio_table(section, ours, present, "per_token_s", "us", 1e6, 1)
    lines.append("")
  lines += grid_run.paired_table(results, ours, "pattern", ("loop", "step", "eager"))
  lines += grid_run.stolen_table(results, cpus, "pattern", ("loop", "step", "eager"))
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="two shapes, few repeats")
  parser.add_argument("--large", action="store_true",
                      help="larger models, either side of the size up to which "
                           "implementation=None decodes on the \"xla\" path (files end in -large)")
  parser.add_argument("--steps", type=int, default=64, help="steps of the jitted loop")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
  parser.add_argument("--machine", default=None, help="name in the output files")
  parser.add_argument("--sync-dispatch", action="store_true",
                      help="run JAX's calls on the calling thread (files end in -sync)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                      help="every contender's weights, inputs and states (files end in "
                           "-bfloat16 for bfloat16)")
  args = parser.parse_args(argv)
  grid_run.check_arguments(parser, args)
  if args.sync_dispatch:
    dispatch_synchronously()
  repeats = args.repeats or (15 if args.quick else 41)
  gpu, have_torch, device_name, cpu, machine = grid_run.setting(args.machine)
  lead_in_s = grid_run.lead_in_seconds(gpu)
  results = []
  for shape in shapes(args.quick, args.large):
    shape = dataclasses.replace(shape, dtype=args.dtype)
    timed = {}
    for impl, make in contenders(shape, args.steps, gpu, have_torch).items():
      try:
        calls = make()
      except Exception as e:  # a peer that cannot run this shape
        print(f"{shape.name:28s} {impl:12s} skipped: {type(e).__name__}: {e}"[:200])
        continue
      timed.update({(impl, pattern): call for pattern, call in calls.items()})
    timings = grid_run._time_interleaved(timed, repeats, args.warmup, rounds=repeats,
                                         lead_in_s=lead_in_s)
    for (impl, pattern), r in timings.items():
      if "error" in r:
        print(f"{shape.name:28s} {impl:12s} {pattern}: failed: {r['error']}"[:200])
        continue
      tokens = args.steps if pattern == "loop" else 1
      r.update(shape=shape.name, impl=impl, pattern=pattern, tokens_per_call=tokens,
               per_token_s=r["median_s"] / tokens, **dataclasses.asdict(shape))
      results.append(r)
      print(f"{shape.name:28s} {impl:12s} {pattern:5s} {r['per_token_s'] * 1e6:9.1f} us/token "
            f"(iqr of a call {r['iqr_s'] * 1e6:.0f} us)", flush=True)
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  asynchronous = async_dispatch()
  stem = (f"decode-{machine}-{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}"
          f"{'-large' if args.large else ''}"
          f"{'' if asynchronous else '-sync'}{'' if args.dtype == 'float32' else '-' + args.dtype}")
  record = {"device": device_name, "machine": machine, "cpu_count": os.cpu_count(), "cpu": cpu,
            "versions": grid_run.versions(), "quick": args.quick, "steps": args.steps,
            "large": args.large, "repeats": repeats, "warmup": args.warmup,
            "lead_in_s": lead_in_s,
            "cpu_async_dispatch": asynchronous, "dtype": args.dtype, "results": results}
  (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1))
  table = markdown(results, device_name if gpu else grid_run.cpu_heading(device_name, cpu),
                   args.steps, asynchronous, record["cpu_count"])
  (out_dir / f"{stem}.md").write_text(table)
  print("\n" + table)
  print(f"wrote {out_dir / stem}.json/.md")
  return 0


if __name__ == "__main__":
  sys.exit(main())
