"""Side-by-side RNN benchmarks: ours ("xla", "cudnn") against the peers, in one process.

    python benchmarks/run.py --quick          # a few minutes on a 2-core CPU
    python benchmarks/run.py                  # the full grid
    python benchmarks/run.py --out-dir benchmarks/results
    python benchmarks/run.py --quick --cores 1  # every contender on one core
    python benchmarks/run.py --plot benchmarks/results/NAME.json  # its PNG, running nothing
    python benchmarks/run.py --sweep --only ours-cudnn,ours-xla  # a GPU: which path is faster

Peers, each run on the same inputs and shapes:
- `flax`: `flax.linen.RNN` over `OptimizedLSTMCell` / `GRUCell`, layers stacked,
  `nn.Bidirectional` for two directions (the `lax.scan` RNN users have today);
- `jax.experimental.rnn`: its cuDNN LSTM (GPU, float32 only);
- `torch`: `torch.nn.LSTM` / `nn.GRU` (CPU; cuDNN on a GPU), when installed.
Forward ("fwd", inference) and forward+backward ("fwd+bwd", gradient of a sum
with respect to the input and all weights). Each figure is the median of
`--repeats` timings (after warm-up and compilation) and the spread
(interquartile range), timed in round-robin rounds across the contenders so that
a slow stretch of a noisy machine falls on all alike, each timed call led in by an
untimed call of the same contender (`--lead-in`), with the minor page faults of each
timed call and the CPU time a hypervisor gave other guests during it (its steal time,
tabled where there was any: `_time_interleaved`); and the memory each call
needs beyond its inputs (`MEMORY_MEASURE`): for JAX contenders XLA's temporary
and output buffers of the compiled computation (`memory_analysis()`, any
backend), plus, for `ours-cudnn`, the cuDNN workspace its handlers take from
XLA's scratch allocator at run time, which `memory_analysis` does not count (a
peer such as `jax.experimental.rnn` keeps its workspace in an XLA buffer, so it
is counted there); for PyTorch on a GPU the peak allocated during one call less
what was allocated before it. For JAX contenders also the time each phase took
to trace and compile (`COMPILE_MEASURE`): the "xla" path's chunked forward
unrolls its steps, and a user pays that once per shape.

Writes `<out-dir>/<machine>-<date>.json` (every figure, versions, device),
`<machine>-<date>.md` (ratios of each peer's time to ours: > 1 means we are
faster; the same ratios paired round by round, with their spread, `paired_table`)
and `<machine>-<date>.png` (when matplotlib is installed: it is in the `test`
extra; `--plot` draws the PNG of a run recorded without it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time
from unittest import mock

try:
  import resource
except ImportError:  # not on Windows
  resource = None

import numpy as np
import jax
import jax.numpy as jnp

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cpu, _cudnn


# The cells the benchmarks time, and our spec class for each: the peers (Flax's
# cells, PyTorch's modules) are built for these two.
CELLS = {"lstm": jcr.CudnnLSTM, "gru": jcr.CudnnGRU}


def spec_class(mode: str):
  """Our spec class for a benchmark shape's `mode`; a `ValueError` for any other
  (which the peers could not time either)."""
  if mode not in CELLS:
    raise ValueError(f"mode: expected one of {sorted(CELLS)}, got {mode!r}")
  return CELLS[mode]


@dataclasses.dataclass(frozen=True)
class Shape:
  mode: str  # "lstm" | "gru"
  batch: int
  seq_len: int
  input_size: int
  hidden: int
  layers: int
  bidirectional: bool
  dtype: str

  @property
  def name(self) -> str:
    d = "bi" if self.bidirectional else "uni"
    return (f"{self.mode} B{self.batch} T{self.seq_len} I{self.input_size} H{self.hidden} "
            f"L{self.layers} {d} {self.dtype}")

  def __post_init__(self):
    spec_class(self.mode)

  def spec(self):
    return spec_class(self.mode)(
        self.layers, self.hidden, self.input_size,
        direction="bidirectional" if self.bidirectional else "unidirectional",
        dtype=jnp.dtype(self.dtype))


# `--sweep`: one layer of either cell and dtype over hidden sizes, at one batch
# and length, to tell on a GPU where our "xla" path is faster than cuDNN, which
# `implementation=None` picks there. On an H100 (session 45's grid,
# results/gpu-NVIDIA-H100-80GB-HBM3-2026-11-27.json) the "xla" path took
# 0.35-0.68x cuDNN's time at H256 in float32 and 0.27-0.61x at H128-H256 in
# bfloat16, but 1.56-1.67x in training at H128 in float32 (cuDNN's persistent
# algorithm) and 0.91-1.38x at H1024: too few sizes to draw a line between.
SWEEP_HIDDEN = (128, 192, 256, 384, 512, 768, 1024)


def sweep() -> list[Shape]:
  """The `--sweep` shapes: float32 first, then bfloat16; per cell, the hidden sizes up."""
  return [Shape(mode, 32, 64, hidden, hidden, 1, False, dtype)
          for dtype in ("float32", "bfloat16") for mode in ("lstm", "gru")
          for hidden in SWEEP_HIDDEN]


def grid(quick: bool, gpu: bool) -> list[Shape]:
  shapes = []
  if quick:
    for mode in ("lstm", "gru"):
      shapes += [Shape(mode, 16, 50, 64, 128, 1, False, "float32"),
                 Shape(mode, 64, 100, 128, 256, 2, True, "float32")]
    shapes += [Shape("lstm", 16, 50, 64, 128, 1, False, "bfloat16")]
    return shapes
  big = 4 if gpu else 1
  for mode in ("lstm", "gru"):
    for dtype in ("float32", "bfloat16"):
      shapes += [
          Shape(mode, 8, 32, 64, 128, 1, False, dtype),             # small batch, short
          Shape(mode, 64 * big, 32, 64, 128, 1, False, dtype),      # many sequences, small R
          Shape(mode, 64 * big, 32, 128, 256, 1, False, dtype),     # large batch, short
          Shape(mode, 16, 256, 128, 256, 1, False, dtype),          # long sequence
          Shape(mode, 32 * big, 100, 256, 256 * big, 2, True, dtype),  # deep, bidirectional
          Shape(mode, 32 * big, 100, 256, 256 * big, 3, False, dtype),
      ]
  return shapes


# -- timing ---------------------------------------------------------------------------


# How long, at least, each contender's untimed lead-in lasts in every round
# (`_time_interleaved`). PyTorch's OpenMP threads (libgomp) keep spinning for a
# while after its call: on a 2-core AMD EPYC (Zen 5), our LSTM B64 T32 I128 H256
# forward took 7.7-8.9, 6.9, then 5.2-5.3 ms in the calls right after two of
# PyTorch's, 5.1-5.6 ms for every call after a 30 ms pause, so that one
# lead-in call of its own (5 ms) still left the timed call 18-36% slow, and a
# call of 0.4 ms (B8 T32 I64 H128) was wholly inside that stretch
# (benchmarks/NOTES.md, session 44).
# Not on a GPU, whose device time is scarce (a lent GPU's session has minutes)
# and where this was not seen (`lead_in_seconds`).
LEAD_IN_S = 0.03


def lead_in_seconds(gpu: bool, ms: float | None = None) -> float:
  """The lead-in's least duration for a run: `ms` where given, else `LEAD_IN_S`
  on a CPU and none on a GPU."""
  return ms / 1e3 if ms is not None else (0.0 if gpu else LEAD_IN_S)


def _time_interleaved(fns: dict, repeats: int, warmup: int, rounds: int,
                      lead_in: int = 1, lead_in_s: float = LEAD_IN_S) -> dict:
  """Times every `fns[name]()` in round-robin rounds, so that a slow stretch of a noisy
  machine falls on all contenders alike; per name the median and interquartile range of
  all `repeats` timings (after `warmup` untimed calls each), and the timings. In every round each
  contender first makes untimed calls, `lead_in` of them and for at least `lead_in_s`
  seconds, so that each timed call follows calls of its own, as a training loop's steps
  do, and not another contender's: on a 2-core CPU, a JAX call made right after a PyTorch
  call ran 6-38% slower than one made after itself (PyTorch's OpenMP threads, still
  spinning; benchmarks/NOTES.md, sessions 17 and 44; `LEAD_IN_S`). `lead_in` 0 makes no
  untimed calls, whatever `lead_in_s`.
  Per timed call also the process's minor page faults (`minor_faults`; None where
  `resource` is missing): XLA:CPU takes a call's temporary buffers afresh, and glibc maps
  one over its mmap threshold (at most 32 MiB) anew on every call, so that each of its
  pages faults in, about 1 us each on these machines (README's tip on `GLIBC_TUNABLES`;
  benchmarks/NOTES.md, sessions 25 and 54), a cost that differs between contenders whose
  buffers fall on either side of the threshold.
  And the CPU time the hypervisor gave to other guests during each timed call
  (`stolen_s`, `stolen_seconds`; None off Linux): on a shared virtual machine a
  stretch of it slows every contender timed in it (`stolen_percent`).
  A contender that fails is reported as `{"error": ...}`."""
  samples, faults, failed = {name: [] for name in fns}, {name: [] for name in fns}, {}
  stolen = {name: [] for name in fns}
  for name, fn in fns.items():
    try:
      for _ in range(warmup):
        fn()
    except Exception as e:
      failed[name] = f"{type(e).__name__}: {e}"
  per_round = max(1, -(-repeats // rounds))
  for _ in range(rounds):
    for name, fn in fns.items():
      if name in failed:
        continue
      try:  # a contender may also fail later (out of memory on a GPU): drop it, keep the rest
        if lead_in:
          lead_in_until, made = time.perf_counter() + lead_in_s, 0
          while made < lead_in or time.perf_counter() < lead_in_until:
            fn()
            made += 1
        for _ in range(per_round):
          faults_before, stolen_before = _minor_faults(), stolen_seconds()
          start = time.perf_counter()
          fn()
          samples[name].append(time.perf_counter() - start)
          faults_after, stolen_after = _minor_faults(), stolen_seconds()
          if faults_before is not None:
            faults[name].append(faults_after - faults_before)
          if stolen_before is not None and stolen_after is not None:
            stolen[name].append(stolen_after - stolen_before)
      except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
  out = {}
  for name in fns:
    if name in failed:
      out[name] = {"error": failed[name]}
      continue
    q1, median, q3 = np.percentile(samples[name], [25, 50, 75])
    # Every timing too, in the order taken: a median with a wide range may hide two
    # populations (session 31 in benchmarks/NOTES.md), which only the timings show.
    out[name] = {"median_s": float(median), "iqr_s": float(q3 - q1),
                 "repeats": len(samples[name]), "times_s": [float(t) for t in samples[name]],
                 "minor_faults": faults[name] or None, "stolen_s": stolen[name] or None}
  return out


def _minor_faults() -> int | None:
  """The process's minor page faults so far; None where `resource` is missing (Windows)."""
  return None if resource is None else resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def stolen_seconds(stat: str = "/proc/stat") -> float | None:
  """CPU time the hypervisor ran other guests while this machine's CPUs were
  ready to run (`steal` in `/proc/stat`, summed over every CPU), in seconds
  since boot; None where unknown (no `/proc/stat`: not Linux; no such field).
  On a shared virtual machine the same code then runs slower: session 71's
  first quick grid, on a host that had lost 14% of its CPU time so since boot,
  took 9:08 against 4:12 for the next run, in a quieter stretch
  (benchmarks/NOTES.md)."""
  try:
    with open(stat) as f:
      fields = f.readline().split()
  except OSError:
    return None
  if len(fields) < 9 or fields[0] != "cpu":
    return None
  return int(fields[8]) / os.sysconf("SC_CLK_TCK")


def stolen_percent(record: dict, cpus: int) -> float | None:
  """The share of the machine's CPU time (`cpus` CPUs) the hypervisor took
  during a contender's timed calls (`_time_interleaved`'s `stolen_s` and
  `times_s`), in percent; None where not recorded."""
  if not record.get("stolen_s"):
    return None
  return 100 * sum(record["stolen_s"]) / (sum(record["times_s"]) * cpus)


MEMORY_MEASURE = ("bytes a call needs beyond its inputs: XLA temp + outputs - aliased "
                  "(+ cuDNN run-time workspace for ours-cudnn); PyTorch: peak allocated "
                  "during the call - allocated before")
STOLEN_MEASURE = ("the steal time of `/proc/stat` during the contender's timed calls, "
                  "as a share of their wall time on all {cpus} CPUs (CPU time the "
                  "hypervisor gave to other guests: on a shared virtual machine, figures "
                  "taken while it is high run slower, for every contender in that stretch)")
PAIRED_MEASURE = ("each timing of the peer divided by ours taken at the same place in the same "
                  "round-robin round (`_time_interleaved`: seconds apart at most), so that a "
                  "stretch that slows the machine slows both sides of a ratio; the median of "
                  "those ratios, and in brackets their middle half (interquartile range): "
                  "where that range holds 1.00x, the two traded places from round to round")
COMPILE_MEASURE = ("wall time of `jax.jit(f).lower(*args).compile()`, once per phase, in "
                   "one process after a warm-up compile (no persistent compilation cache); "
                   "PyTorch runs eagerly and has none")


def _jax_contender(fwd, grad, args, scratch=None):
  """Compiles `fwd(*args)` and `grad(*args)` once each; returns the two compiled calls,
  the bytes each needs beyond its inputs (`MEMORY_MEASURE`), adding `scratch[phase]`: what
  the computation allocates at run time outside XLA's buffers, and the seconds each took
  to trace and compile (`COMPILE_MEASURE`)."""
  calls, memory, compile_s = [], {}, {}
  for phase, fn in (("fwd", fwd), ("fwd+bwd", grad)):
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s[phase] = time.perf_counter() - start
    try:
      m = compiled.memory_analysis()
      memory[phase] = int(m.temp_size_in_bytes + m.output_size_in_bytes
                          - m.alias_size_in_bytes + (scratch or {}).get(phase, 0))
    except Exception:  # a backend without memory analysis
      memory[phase] = None
    calls.append(lambda compiled=compiled: jax.block_until_ready(compiled(*args)))
  return calls[0], calls[1], memory, compile_s


# -- the contenders ------------------------------------------------------------------
#
# Each returns `(fwd, fwd_bwd, memory[, compile_s])`: two calls to time, the bytes each
# needs (`{"fwd": .., "fwd+bwd": ..}`, None where unknown) and, for a contender compiled
# ahead of its calls, the seconds each phase took to trace and compile; or None when it
# cannot run the shape.


def ours(shape: Shape, implementation: str, time_major: bool = False,
         algorithm: str | None = None, persistent_batch_major: str | None = None):
  """Ours on batch-major input, as the peers take it; or, with `time_major`, on the
  same input laid out [T, B, I] (on a GPU, cuDNN's sequence-major layout: session 38
  in benchmarks/NOTES.md). `algorithm`: a cuDNN algorithm policy to trace it under
  (`_cudnn.ALGORITHM_POLICIES`), else the environment's (by default "auto", which
  picks the persistent small-h algorithm where cuDNN's limits allow).
  `persistent_batch_major`: `_cudnn.PERSISTENT_BATCH_MAJOR` to trace it under (which calls
  of that algorithm get batch-major data as it is, not transposed; sessions 45-46 and 63),
  else the library's default."""
  with (_environment(_cudnn.ALGORITHM_ENV, algorithm),
        mock.patch.object(_cudnn, "PERSISTENT_BATCH_MAJOR",
                          persistent_batch_major or _cudnn.PERSISTENT_BATCH_MAJOR)):
    return _ours(shape, implementation, time_major)


@contextlib.contextmanager
def _environment(name: str, value: str | None):
  """`name=value` in the environment for the block (unchanged for None), restored after."""
  if value is None:
    yield
    return
  before = os.environ.get(name)
  os.environ[name] = value
  try:
    yield
  finally:
    if before is None:
      del os.environ[name]
    else:
      os.environ[name] = before


def _ours(shape: Shape, implementation: str, time_major: bool):
  spec = shape.spec()
  params = spec.init_params(jax.random.key(0))
  x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq_len, shape.input_size),
                        jnp.dtype(shape.dtype))
  if time_major:
    x = jnp.swapaxes(x, 0, 1)

  def run(x, p):
    return spec._run(x, None, None, p, False, time_major=time_major,
                     implementation=implementation)[0]

  scratch = None
  if implementation == "cudnn":  # one fused call per phase (no dropout)
    sizes = {training: _cudnn.query_sizes(
        _cudnn.call_config(spec, time_major, has_lengths=False, training=training),
        spec.dtype, shape.seq_len, shape.batch) for training in (False, True)}
    scratch = {"fwd": sizes[False]["workspace_inference"],
               "fwd+bwd": sizes[True]["workspace_training"]}
  return _jax_contender(run, jax.grad(lambda x, p: jnp.sum(run(x, p).astype(jnp.float32)),
                                      argnums=(0, 1)), (x, params), scratch)


def flax_recurrent_init(key, init_shape, init_dtype):
  """Flax's orthogonal recurrent initializer, in float32 and cast: it takes a QR,
  which XLA:CPU has no bfloat16 kernel for (and newer Flax evaluates a
  parameter's initializer even in `apply`, to check its shape)."""
  import flax.linen as nn
  return nn.initializers.orthogonal()(key, init_shape, jnp.float32).astype(init_dtype)


def flax_scan(shape: Shape):
  import flax.linen as nn
  dtype = jnp.dtype(shape.dtype)

  class Stack(nn.Module):

    @nn.compact
    def __call__(self, x):
      kwargs = dict(dtype=dtype, param_dtype=dtype, recurrent_kernel_init=flax_recurrent_init)
      for _ in range(shape.layers):
        cell = (lambda: nn.OptimizedLSTMCell(shape.hidden, **kwargs)) \
            if shape.mode == "lstm" else (lambda: nn.GRUCell(shape.hidden, **kwargs))
        if shape.bidirectional:
          x = nn.Bidirectional(nn.RNN(cell()), nn.RNN(cell()))(x)
        else:
          x = nn.RNN(cell())(x)
      return x

  model = Stack()
  x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq_len, shape.input_size), dtype)
  params = model.init(jax.random.key(0), x)
  return _jax_contender(model.apply,
                        jax.grad(lambda p, x: jnp.sum(model.apply(p, x).astype(jnp.float32)),
                                 argnums=(0, 1)), (params, x))


def jax_experimental(shape: Shape):
  """`jax.experimental.rnn.lstm` (`contenders` lists it for float32 LSTMs only: the one
  cell and dtype it has)."""
  from jax.experimental import rnn
  D = 2 if shape.bidirectional else 1
  w = rnn.init_lstm_weight(jax.random.key(0), shape.input_size, shape.hidden, shape.layers,
                           shape.bidirectional)
  x = jax.random.normal(jax.random.key(1), (shape.batch, shape.seq_len, shape.input_size))
  h0 = jnp.zeros((shape.layers * D, shape.batch, shape.hidden))
  lengths = jnp.full((shape.batch,), shape.seq_len, jnp.int32)

  def run(x, w):
    return rnn.lstm(x, h0, h0, w, lengths, input_size=shape.input_size, hidden_size=shape.hidden,
                    num_layers=shape.layers, dropout=0.0, bidirectional=shape.bidirectional)[0]

  return _jax_contender(run, jax.grad(lambda x, w: jnp.sum(run(x, w)), argnums=(0, 1)), (x, w))


def torch_rnn(shape: Shape, device: str):
  import torch
  dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[shape.dtype]
  cls = torch.nn.LSTM if shape.mode == "lstm" else torch.nn.GRU
  module = cls(shape.input_size, shape.hidden, shape.layers, batch_first=True,
               bidirectional=shape.bidirectional).to(device=device, dtype=dtype)
  x = torch.randn(shape.batch, shape.seq_len, shape.input_size, device=device, dtype=dtype,
                  requires_grad=True)
  sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

  def fwd():
    with torch.no_grad():
      module(x)
    sync()

  def fwd_bwd():
    module.zero_grad(set_to_none=True)
    x.grad = None
    module(x)[0].float().sum().backward()
    sync()

  memory = {"fwd": None, "fwd+bwd": None}
  if device == "cuda":
    for phase, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
      fn()
      module.zero_grad(set_to_none=True)
      x.grad = None
      torch.cuda.synchronize()
      before = torch.cuda.memory_allocated()
      torch.cuda.reset_peak_memory_stats()
      fn()
      memory[phase] = int(torch.cuda.max_memory_allocated() - before)
  return fwd, fwd_bwd, memory


# -- the driver ------------------------------------------------------------------------


# Every name `contenders` may give (which ones it gives depends on the shape and device).
CONTENDER_NAMES = ("ours-xla", "flax-scan", "ours-cudnn", "ours-cudnn-time-major",
                   "ours-cudnn-standard", "ours-cudnn-transposed", "jax.experimental.rnn",
                   "torch")


def contenders(shape: Shape, gpu: bool, have_torch: bool):
  out = {"ours-xla": lambda: ours(shape, "xla"), "flax-scan": lambda: flax_scan(shape)}
  if gpu:
    out["ours-cudnn"] = lambda: ours(shape, "cudnn")
    out["ours-cudnn-time-major"] = lambda: ours(shape, "cudnn", time_major=True)
    if (_cudnn.ALGORITHMS["persist_static_small_h"]
        in _cudnn.choose_algorithms(shape.spec(), has_seq_lengths=False)):
      # A shape where ours-cudnn runs cuDNN's persistent small-h algorithm: the
      # standard one beside it (session 39 in benchmarks/NOTES.md).
      out["ours-cudnn-standard"] = lambda: ours(shape, "cudnn", algorithm="standard")
      # And batch-major data transposed to sequence-major around every call of that
      # algorithm ("none"), where the default ("inference") gives its inference call
      # the data as it is: the default before session 63 (benchmarks/NOTES.md).
      out["ours-cudnn-transposed"] = lambda: ours(shape, "cudnn", persistent_batch_major="none")
    if shape.mode == "lstm" and shape.dtype == "float32":
      out["jax.experimental.rnn"] = lambda: jax_experimental(shape)
  if have_torch:
    out["torch"] = lambda: torch_rnn(shape, "cuda" if gpu else "cpu")
  return out


def versions() -> dict:
  v = {"python": platform.python_version(), "jax": jax.__version__,
       "jaxlib": getattr(jax.lib, "__version__", None) or jax.__version__,
       "numpy": np.__version__}
  for name in ("flax", "torch"):
    try:
      v[name] = __import__(name).__version__
    except ImportError:
      pass
  lib, _ = _cudnn._load()
  v["cudnn_native_library"] = lib is not None
  v["cudnn"] = _cudnn.cudnn_version()  # the one our library runs on
  try:
    import torch
    if torch.backends.cudnn.is_available():
      v["cudnn (torch)"] = torch.backends.cudnn.version()
  except Exception:
    pass
  try:
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True,
                                    cwd=pathlib.Path(__file__).parent).stdout.strip()
    v["commit"] = git("rev-parse", "HEAD")
    # Files changed since that commit, if any: the figures are then not the commit's.
    v["uncommitted changes"] = git("status", "--porcelain", "--untracked-files=no").splitlines()
  except OSError:
    pass
  return v


def cpu_description() -> dict:
  """The host CPU: its model, the vector extensions that set XLA's and
  oneDNN's matmul speed (the lent machines differ between sessions: AVX2 on
  one, AVX-512 and AMX on another), its family and model numbers (a virtual
  machine may name only the vendor, "AMD EPYC", for several generations) and
  a core's L2 cache (which bounds the forward's lanes: `_lanes.LANE_WEIGHT_BYTES`,
  `_lanes.LANE_L2_MULTIPLE`), from /proc/cpuinfo and sysfs where there are."""
  model, family, number = platform.processor() or platform.machine(), None, None
  flags = _cpu.flags() or frozenset()  # the library's own reading, which its lane rule uses
  try:
    for line in _cpu.CPUINFO.read_text().splitlines():
      key, _, value = line.partition(":")
      key = key.strip()
      if key == "model name":
        model = value.strip()
      elif key == "cpu family" and family is None:
        family = value.strip()
      elif key == "model" and number is None:
        number = value.strip()
  except OSError:
    pass
  l2 = _cpu.l2_bytes()  # the library's own reading, which its lane rule uses
  l2 = None if l2 is None else f"{l2 // 1024}K"  # as sysfs writes it
  isa = [f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
  return {"model": model, "isa": isa, "family": family, "model_number": number, "l2_per_core": l2}


def ours_of(results: list[dict]) -> str:
  """The contender the tables call ours: `ours-cudnn` where the run has it (a GPU),
  else `ours-xla`. A shape where it failed shows "—", never the other path's figure."""
  return "ours-cudnn" if any(r["impl"] == "ours-cudnn" for r in results) else "ours-xla"


def ratio_table(results: list[dict], ours: str, peers: list[str], value: str, unit: str,
                scale: float, digits: int) -> list[str]:
  """The lines of one markdown table of `results` (one section's): per shape,
  `ours`' and each peer's `value`, times `scale`, in `unit`, and the peer's ratio
  to ours."""
  lines = ["| shape | ours (" + unit + ") | " +
           " | ".join(f"{p} ({unit}) | ratio" for p in peers) + " |",
           "|---|---:|" + "---:|---:|" * len(peers)]
  for shape in dict.fromkeys(r["shape"] for r in results):
    rows = {r["impl"]: r for r in results if r["shape"] == shape}
    mine = rows.get(ours)
    cells = [f"{mine[value] * scale:.{digits}f}" if mine else "—"]
    for p in peers:
      r = rows.get(p)
      cells += [f"{r[value] * scale:.{digits}f}" if r else "—",
                f"{r[value] / mine[value]:.2f}x" if r and mine else "—"]
    lines.append(f"| {shape} | " + " | ".join(cells) + " |")
  return lines


def per_contender_table(results: list[dict], title: str, measure: str, value, digits: int,
                        key: str = "phase", kinds: tuple = ("fwd", "fwd+bwd")) -> list[str]:
  """The lines of a markdown table of `value(record)` per shape and contender,
  one cell per contender holding its `kinds` of `record[key]` ("fwd / fwd+bwd"),
  for the contenders with a value anywhere; none where no contender has one."""
  impls = [i for i in dict.fromkeys(r["impl"] for r in results)
           if any(value(r) is not None for r in results if r["impl"] == i)]
  if not impls:
    return []
  cell = lambda r: "—" if r is None or value(r) is None else f"{value(r):.{digits}f}"
  out = [title, "", f"Measure: {measure}.", "",
         "| shape | " + " | ".join(impls) + " |", "|---|" + "---:|" * len(impls)]
  for shape in dict.fromkeys(r["shape"] for r in results):
    rows = {(r["impl"], r[key]): r for r in results if r["shape"] == shape}
    out.append(f"| {shape} | " + " | ".join(
        " / ".join(cell(rows.get((i, kind))) for kind in kinds) for i in impls) + " |")
  return out + [""]


def paired_ratios(mine: dict | None, theirs: dict | None) -> np.ndarray | None:
  """`theirs`' timings divided by `mine`'s, each by the one of the same index
  (`PAIRED_MEASURE`): `_time_interleaved` times every contender in turn, the same
  number of times a round, so the i-th timings of two contenders of one run fell in
  one round. None where either record is missing or the two hold no timings of
  equal count (records of different runs, or of a contender that failed)."""
  a, b = (None if r is None else r.get("times_s") for r in (mine, theirs))
  if not a or not b or len(a) != len(b):
    return None
  return np.asarray(b, float) / np.asarray(a, float)


def paired_table(results: list[dict], ours: str, key: str = "phase",
                 kinds: tuple = ("fwd", "fwd+bwd")) -> list[str]:
  """The lines of a markdown table of `paired_ratios` against `ours`: per shape,
  a column per peer and kind of `record[key]` where any shape has them, each
  cell the ratios' median and [quartiles]; none where no pair has timings."""
  records = {(r["shape"], r["impl"], r[key]): r for r in results}
  shapes = list(dict.fromkeys(r["shape"] for r in results))
  cells = {}
  for (shape, impl, kind), r in records.items():
    ratios = None if impl == ours else paired_ratios(records.get((shape, ours, kind)), r)
    if ratios is not None:
      q1, median, q3 = np.percentile(ratios, [25, 50, 75])
      cells[shape, impl, kind] = f"{median:.2f}x [{q1:.2f}-{q3:.2f}]"
  columns = [(impl, kind) for impl in sorted({impl for _, impl, _ in cells})
             for kind in kinds if any((s, impl, kind) in cells for s in shapes)]
  if not columns:
    return []
  out = ["## each peer's time / ours, paired by round", "", f"Measure: {PAIRED_MEASURE}.", "",
         "| shape | " + " | ".join(f"{impl} {kind}" for impl, kind in columns) + " |",
         "|---|" + "---:|" * len(columns)]
  for shape in shapes:
    out.append(f"| {shape} | " + " | ".join(cells.get((shape, impl, kind), "—")
                                            for impl, kind in columns) + " |")
  return out + [""]


def stolen_table(results: list[dict], cpus: int | None, key: str = "phase",
                 kinds: tuple = ("fwd", "fwd+bwd")) -> list[str]:
  """`per_contender_table` of `stolen_percent`, where the hypervisor took any
  CPU time during the timed calls (a shared virtual machine); else none."""
  cpus = cpus or os.cpu_count() or 1
  if not any(stolen_percent(r, cpus) for r in results):
    return []
  return per_contender_table(
      results, f"## CPU time stolen by the hypervisor, {' / '.join(kinds)} (%)",
      STOLEN_MEASURE.format(cpus=cpus), lambda r: stolen_percent(r, cpus), 1, key, kinds)


def markdown(results: list[dict], device: str, cpus: int | None = None) -> str:
  ours = ours_of(results)
  lines = [f"# RNN benchmarks on {device}", "",
           f"Ours = `{ours}`: `ours-cudnn` where it ran (a GPU, where our \"xla\" path is "
           "then a column of its own), else `ours-xla`. Ratio = the column's median time / "
           "ours; > 1 means ours is faster; — where a contender did not run.", ""]
  peers = sorted({r["impl"] for r in results} - {ours})
  for phase in ("fwd", "fwd+bwd"):
    lines += [f"## {phase}", ""]
    lines += ratio_table([r for r in results if r["phase"] == phase], ours, peers, "median_s",
                         "ms", 1e3, 2)
    lines.append("")
  def training_table(title, measure, cell):  # a figure per shape and contender, fwd+bwd
    out = [title, "", f"Measure: {measure}.", "",
           "| shape | ours | " + " | ".join(peers) + " |", "|---|---:|" + "---:|" * len(peers)]
    for shape in dict.fromkeys(r["shape"] for r in results):
      rows = {r["impl"]: r for r in results if r["shape"] == shape and r["phase"] == "fwd+bwd"}
      out.append(f"| {shape} | {cell(rows.get(ours))} | "
                 + " | ".join(cell(rows.get(p)) for p in peers) + " |")
    return out + [""]

  lines += paired_table(results, ours)
  lines += training_table(
      "## memory, fwd+bwd (MiB)", MEMORY_MEASURE,
      lambda r: "—" if r is None or r.get("memory_bytes") is None else
      f"{r['memory_bytes'] / 2**20:.1f}")
  if any(r.get("minor_faults") for r in results):
    lines += training_table(
        "## page faults a call, fwd+bwd (median)",
        "minor page faults of the whole process during each timed call (`getrusage`)",
        lambda r: "—" if r is None or not r.get("minor_faults") else
        f"{np.median(r['minor_faults']):.0f}")
  # Compile times: for the contenders compiled ahead of their calls (not PyTorch).
  lines += per_contender_table(results, "## compile time, fwd / fwd+bwd (s)", COMPILE_MEASURE,
                               lambda r: r.get("compile_s"), 2)
  # Where the hypervisor took CPU time during the timings (a shared virtual machine).
  lines += stolen_table(results, cpus)
  return "\n".join(lines)


def plot(results: list[dict], path: pathlib.Path, device: str) -> bool:
  """A bar chart of `results`' medians at `path`; False, and no file, where there
  is nothing to plot (a budget that ran out before the first shape) or no
  matplotlib."""
  if not results:
    return False
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no plot", file=sys.stderr)
    return False
  shapes = list(dict.fromkeys(r["shape"] for r in results))
  impls = list(dict.fromkeys(r["impl"] for r in results))
  fig, axes = plt.subplots(1, 2, figsize=(16, 0.5 * len(shapes) + 2), sharey=True)
  for ax, phase in zip(axes, ("fwd", "fwd+bwd")):
    height = 0.8 / len(impls)
    for i, impl in enumerate(impls):
      values = [next((r["median_s"] * 1e3 for r in results if r["shape"] == s and
                      r["impl"] == impl and r["phase"] == phase), 0.0) for s in shapes]
      ax.barh(np.arange(len(shapes)) + i * height, values, height, label=impl)
    ax.set_title(f"{phase} on {device} (ms, lower is better)")
    ax.set_xscale("log")
  axes[0].set_yticks(np.arange(len(shapes)) + 0.4, shapes, fontsize=7)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return True


def plot_label(record: dict) -> str:
  """What a plot's titles call the machine of the run `record`: its device, and on a
  CPU (whose device JAX names "cpu" alone) the CPU's model and, for a run on fewer
  cores than the machine has (`--cores`), how many, from the record."""
  device = record.get("device", record.get("machine", "?"))
  model = (record.get("cpu") or {}).get("model")
  if not (device.startswith("cpu") and model):
    return device
  cores, every = len(record.get("cores") or []), record.get("cpu_count")
  return f"{device} ({model}" + (f", {cores} of {every} cores)" if 0 < cores < (every or 0)
                                 else ")")


def plot_records(paths: list[str]) -> int:
  """`--plot`: draws the PNG of each run recorded at `paths` (its JSON) beside it,
  as the run itself would have; returns the exit status (1 where a file was not
  drawn, with the reason)."""
  failed = 0
  for name in paths:
    path = pathlib.Path(name)
    try:
      if path.suffix != ".json":
        raise ValueError(f"expected a run's .json record, got {name!r}")
      record = json.loads(path.read_text())
      if not isinstance(record, dict) or not isinstance(record.get("results"), list):
        raise ValueError(f"{name} is not a run's record (no \"results\" list)")
      if not record["results"]:
        raise ValueError(f"{name} holds no results to plot")
      keys = {"shape", "impl", "phase", "median_s"}
      if not all(isinstance(r, dict) and keys <= set(r) for r in record["results"]):
        raise ValueError(f"{name} is not a record of this script's (each result needs "
                         f"{sorted(keys)}; decode.py's records have no phase)")
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
      print(f"--plot: {e}", file=sys.stderr)
      failed = 1
      continue
    png = path.with_name(path.name[:-len(".json")] + ".png")
    if plot(record["results"], png, plot_label(record)):
      print(f"wrote {png}")
    else:  # no matplotlib: `plot` said so
      failed = 1
  return failed


def cpu_heading(device_name: str, cpu: dict) -> str:
  """How a CPU run's table names its machine: the device, the CPU's model, vector
  extensions and (where known) family, model number and a core's L2 cache; and, for a
  run on fewer cores than the machine has (`--cores`, or an affinity set from outside),
  how many."""
  known = [f"{label} {cpu[key]}" for key, label in
           (("family", "family"), ("model_number", "model"), ("l2_per_core", "L2"))
           if cpu.get(key)]
  cores, every = len(usable_cores()), os.cpu_count() or 1
  if cores < every:
    known.append(f"on {cores} of its {every} cores")
  return f"{device_name} ({'; '.join([cpu['model'], ', '.join(cpu['isa']) or 'no AVX2'] + known)})"


def usable_cores() -> list[int]:
  """The cores this process may run on (its affinity; every core where the platform
  cannot say)."""
  try:
    return sorted(os.sched_getaffinity(0))
  except AttributeError:  # not on Linux
    return list(range(os.cpu_count() or 1))


def run_on_cores(n: int, argv: list[str]) -> int:
  """Runs this script with `argv` (less its `--cores`) in a process of its own confined
  to the first `n` of this process's `usable_cores()` from its start, so that JAX's and
  PyTorch's thread pools, XLA:CPU's split of a fusion and YNNPACK's of a product are all
  sized for those cores, as on a machine with that many; returns its exit status."""
  usable = usable_cores()
  if not hasattr(os, "sched_setaffinity"):
    raise ValueError("--cores needs os.sched_setaffinity (Linux); this platform has none")
  if not 1 <= n <= len(usable):
    raise ValueError(f"--cores must be between 1 and {len(usable)}, the cores this process "
                     f"may use ({usable}), got {n}")
  rest, skip = [], False
  for arg in argv:
    if skip:
      skip = False
    elif arg == "--cores":
      skip = True
    elif not arg.startswith("--cores="):
      rest.append(arg)
  # A child takes the affinity of the thread that starts it: this one's, for as long
  # as the start takes (a `preexec_fn` would fork this multithreaded process).
  previous = os.sched_getaffinity(0)
  os.sched_setaffinity(0, usable[:n])
  try:
    child = subprocess.Popen([sys.executable, str(pathlib.Path(__file__).resolve()), *rest])
  finally:
    os.sched_setaffinity(0, previous)
  return child.wait()


def setting(machine: str | None):
  """`(gpu, have_torch, device_name, cpu, machine)` for a run: whether the cuDNN path
  can run, whether PyTorch is installed (then set to use every core the process may
  use: `usable_cores()`), JAX's first device, `cpu_description()`, and the machine's
  name in the output files (`machine`, or one made from the device)."""
  gpu = _cudnn.availability()[0]
  try:
    import torch
    have_torch = True
    torch.set_num_threads(len(usable_cores()))
  except ImportError:
    have_torch = False
    print("torch is not installed: no PyTorch comparison", file=sys.stderr)
  device = jax.devices()[0]
  cpu = cpu_description()
  # Named for what sets the speed: AVX-512 machines get a suffix, so their
  # figures do not overwrite an AVX2 machine's of the same day.
  machine = machine or ("gpu-" + device.device_kind.replace(" ", "-") if gpu
                        else f"cpu-{len(usable_cores())}core"
                        + ("-avx512" if "avx512f" in cpu["isa"] else ""))
  return gpu, have_torch, f"{device.platform}:{device.device_kind}", cpu, machine


def _write(out_dir: pathlib.Path, stem: str, record: dict, device: str) -> str:
  """Writes the JSON record and the markdown table; returns the table."""
  (out_dir / f"{stem}.json").write_text(json.dumps(record, indent=1))
  table = markdown(record["results"], device, record.get("cpu_count"))
  (out_dir / f"{stem}.md").write_text(table)
  return table


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
  """Usage errors (argparse's exit 2) for what would otherwise fail or mislead in
  the middle of a run: no repeats or steps, a lead-in of no finite time, an
  `--only` naming no contender (a run that times nothing and writes an empty
  record), an output "directory" that is a file, a machine name that is no file
  name. Of the options `args` has (this script's, decode.py's and profile_gpu.py's)."""
  for name, least in (("repeats", 1), ("rounds", 1), ("steps", 1), ("calls", 1), ("warmup", 0),
                      ("lead_in", 0), ("top", 0)):
    value = getattr(args, name, None)
    if value is not None and value < least:
      parser.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
  lead_in_ms = getattr(args, "lead_in_ms", None)
  if lead_in_ms is not None and not 0 <= lead_in_ms < math.inf:  # inf: a round never ended
    parser.error(f"--lead-in-ms must be a finite number of milliseconds, at least 0, "
                 f"got {lead_in_ms:g}")
  if getattr(args, "only", None) is not None:
    unknown = sorted(set(args.only.split(",")) - set(CONTENDER_NAMES))
    if unknown:
      parser.error(f"--only names no contender {unknown}: choose from "
                   f"{', '.join(CONTENDER_NAMES)}")
  if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
    parser.error(f"--out-dir {args.out_dir} exists and is not a directory")
  above = pathlib.Path(args.out_dir).absolute()
  while not above.exists():  # the nearest that exists, where the directory would be made
    above = above.parent
  if not above.is_dir():
    parser.error(f"--out-dir {args.out_dir} cannot be made: {above} is not a directory")
  if args.machine is not None and (not args.machine or os.sep in args.machine):
    parser.error(f"--machine must be a name for the output files, without {os.sep!r}, "
                 f"got {args.machine!r}")
  if os.sep in getattr(args, "tag", ""):  # profile_gpu.py's, which ends its file's name
    parser.error(f"--tag must be part of a file name, without {os.sep!r}, got {args.tag!r}")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--quick", action="store_true", help="a few shapes, few repeats")
  parser.add_argument("--sweep", action="store_true",
                      help="instead of the grid, one layer of each cell and dtype over hidden "
                           "sizes (`sweep`: on a GPU, where cuDNN or our \"xla\" path is the "
                           "faster); files end in -sweep")
  parser.add_argument("--repeats", type=int, default=None)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--rounds", type=int, default=None,
                      help="the repeats are split into this many round-robin rounds "
                           "(default: one per repeat, each contender timed once a round)")
  parser.add_argument("--lead-in", type=int, default=1,
                      help="untimed calls each contender makes before its timed ones in "
                           "every round, so that no timing follows another contender's call")
  parser.add_argument("--lead-in-ms", type=float, default=None,
                      help="the least time each contender's untimed calls take in every "
                           "round (another contender's threads may still be busy after it; "
                           f"default {LEAD_IN_S * 1e3:g} on a CPU, 0 on a GPU)")
  parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
  parser.add_argument("--machine", default=None, help="name in the output files")
  parser.add_argument("--only", default=None, help="comma-separated contenders to run")
  parser.add_argument("--budget-s", type=float, default=None,
                      help="start no new shape after this many seconds (the files written "
                           "after each shape then hold the shapes finished)")
  parser.add_argument("--cores", type=int, default=None,
                      help="run every contender on the first N of the cores this process "
                           "may use (PyTorch with N threads): to compare them per core, "
                           "and what each gains from more (benchmarks/NOTES.md, session 57)")
  parser.add_argument("--plot", nargs="+", metavar="JSON", default=None,
                      help="time nothing: draw the PNG of each run recorded in these JSON "
                           "files, beside each (for a run made without matplotlib)")
  args = parser.parse_args(argv)
  check_arguments(parser, args)
  if args.plot:
    return plot_records(args.plot)
  if args.cores is not None:
    return run_on_cores(args.cores, sys.argv[1:] if argv is None else list(argv))
  repeats = args.repeats or (12 if args.quick else 21)
  # One timing per contender per round by default: on a noisy machine (this
  # 2-core VM drifts by 20-30%), coarser rounds put a slow stretch on one
  # contender. With 3 rounds of 4, the unchanged GRU B16 forward measured 0.88x
  # of Flax; fully interleaved over 150 rounds, 1.05x (benchmarks/NOTES.md).
  rounds = args.rounds or repeats
  gpu, have_torch, device_name, cpu, machine = setting(args.machine)
  lead_in_s = lead_in_seconds(gpu, args.lead_in_ms)
  only = set(args.only.split(",")) if args.only else None
  # A first compilation pays once for what every later one reuses (the backend's
  # start-up, JAX's own first traces): not on the first contender's account.
  jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.ones((2, 2))).compile()
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  # Names built whole, not with `with_suffix`: a machine name may hold a dot ("jax0.12").
  stem = (f"{machine}-{datetime.date.today().isoformat()}{'-quick' if args.quick else ''}"
          f"{'-sweep' if args.sweep else ''}")
  record = {"device": device_name, "machine": machine, "cpu_count": os.cpu_count(),
            "cores": usable_cores(),
            "cpu": cpu, "versions": versions(), "quick": args.quick, "sweep": args.sweep,
            "repeats": repeats,
            "warmup": args.warmup, "rounds": rounds, "lead_in": args.lead_in,
            "lead_in_s": lead_in_s,
            "memory_measure": MEMORY_MEASURE, "compile_measure": COMPILE_MEASURE,
            "results": []}
  table_device = device_name if gpu else cpu_heading(device_name, cpu)
  results = record["results"]
  started = time.perf_counter()
  shapes = sweep() if args.sweep else grid(args.quick, gpu)
  for done, shape in enumerate(shapes):
    if args.budget_s is not None and time.perf_counter() - started > args.budget_s:
      record["cut_short"] = f"--budget-s {args.budget_s:g}: {len(shapes) - done} shapes not run"
      print(record["cut_short"])
      break
    timed, memory, compile_s = {}, {}, {}
    for impl, make in contenders(shape, gpu, have_torch).items():
      if only and impl not in only:
        continue
      try:
        fns = make()
      except Exception as e:  # a peer that cannot run this shape
        print(f"{shape.name:55s} {impl:22s} skipped: {type(e).__name__}: {e}"[:200])
        continue
      timed.update({(impl, phase): fn for phase, fn in zip(("fwd", "fwd+bwd"), fns[:2])})
      memory.update({(impl, phase): fns[2][phase] for phase in ("fwd", "fwd+bwd")})
      seconds = fns[3] if len(fns) > 3 else {}  # none for an eager contender
      compile_s.update({(impl, phase): seconds.get(phase) for phase in ("fwd", "fwd+bwd")})
    timings = _time_interleaved(timed, repeats, args.warmup, rounds, args.lead_in, lead_in_s)
    for (impl, phase), r in timings.items():
      if "error" in r:
        print(f"{shape.name:55s} {impl:22s} {phase}: failed: {r['error']}"[:200])
        continue
      r.update(shape=shape.name, impl=impl, phase=phase, memory_bytes=memory[impl, phase],
               compile_s=compile_s[impl, phase], **dataclasses.asdict(shape))
      results.append(r)
      print(f"{shape.name:55s} {impl:22s} {phase:8s} {r['median_s'] * 1e3:9.2f} ms "
            f"(iqr {r['iqr_s'] * 1e3:.2f})", flush=True)
    # After every shape, so that a run stopped from outside keeps what it measured.
    _write(out_dir, stem, record, table_device)
  table = _write(out_dir, stem, record, table_device)
  plotted = plot(results, out_dir / f"{stem}.png", plot_label(record))
  print("\n" + table)
  print(f"wrote {out_dir / stem}.json/.md{'/.png' if plotted else ''}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
