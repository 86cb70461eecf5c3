"""Which kernels one call of each contender runs, and for how long: for a lent GPU.

    python benchmarks/profile_gpu.py                                   # LSTM B8 T32 I64 H128
    python benchmarks/profile_gpu.py --shape gru,16,50,64,128,1,uni,float32 --out-dir DIR

Session 38 (benchmarks/NOTES.md) found, on an H200, our cuDNN forward taking 3-5x as long as
PyTorch's with the same cuDNN at small float32 shapes, and `jax.experimental.rnn` as long as
ours. This asks where the time goes. For each contender of `run.py` at one shape (on a GPU:
ours on batch-major and on time-major input, `jax.experimental.rnn`, PyTorch, our "xla"
path, Flax's scan), and each phase, it times `--calls` calls, then records as many under
`torch.profiler` with CUDA activity (CUPTI records the kernels of the whole process, JAX's
too), and reports per call: the wall time, the kernels' summed time and their count, and the
kernels by time. Wall time well above kernel time is spent around the kernels (the call,
launches, waits); kernel time above PyTorch's is the kernels themselves, as configured.

Writes `<out-dir>/profile-<machine>-<shape>-<date>.md` and prints it. Needs PyTorch (for its
profiler). On a machine without CUDA it runs too, and records no kernels: the CPU run is only
a check that the script works (tests/test_benchmarks.py).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import run as grid_run  # noqa: E402


def parse_shape(text: str) -> grid_run.Shape:
  """`mode,batch,seq_len,input_size,hidden,layers,uni|bi,dtype`: checked here,
  before a lent GPU's minutes go to a run that would fail on it."""
  fields = text.split(",")
  sizes = fields[1:6]
  if (len(fields) != 8 or fields[0] not in ("lstm", "gru") or fields[6] not in ("uni", "bi")
      or fields[7] not in ("float32", "bfloat16")
      or not all(v.isdigit() and int(v) > 0 for v in sizes)):
    raise argparse.ArgumentTypeError(
        f"expected mode,batch,seq_len,input_size,hidden,layers,uni|bi,dtype (mode lstm or "
        f"gru, sizes positive integers, dtype float32 or bfloat16), got {text!r}")
  mode, *_, direction, dtype = fields
  return grid_run.Shape(mode, *(int(v) for v in sizes), direction == "bi", dtype)


def kernels_of(prof) -> list:
  """The device (CUDA) events a `torch.profiler.profile` recorded: (name, microseconds)."""
  from torch.autograd import DeviceType
  return [(e.name, e.time_range.elapsed_us()) for e in prof.events()
          if e.device_type == DeviceType.CUDA]


def profile_call(fn, calls: int, cuda: bool) -> dict:
  """Per call: the median wall time unprofiled, then the kernels of `calls` profiled calls."""
  from torch.profiler import ProfilerActivity, profile
  fn()
  walls = []
  for _ in range(calls):
    start = time.perf_counter()
    fn()
    walls.append(time.perf_counter() - start)
  activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
  with profile(activities=activities) as prof:
    for _ in range(calls):
      fn()
  by_name = collections.defaultdict(lambda: [0, 0.0])
  for name, us in kernels_of(prof):
    by_name[name][0] += 1
    by_name[name][1] += us
  return {"wall_us": float(np.median(walls)) * 1e6,
          "kernel_us": sum(t for _, t in by_name.values()) / calls,
          "kernels": sum(n for n, _ in by_name.values()) / calls,
          "by_kernel": sorted(((name, n / calls, t / calls) for name, (n, t) in by_name.items()),
                              key=lambda k: -k[2])}


def report(shape, device: str, results: dict, top: int, versions: dict | None = None,
           xla_flags: str | None = None) -> str:
  """The markdown report; `versions` (`run.versions()`) and the `XLA_FLAGS` in force,
  if any, go under the heading, so that a profile names what it ran on and under."""
  lines = [f"# Kernels per call on {device}: {shape.name}", ""]
  if versions:
    lines += ["Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()), ""]
  if xla_flags:
    lines += [f"`XLA_FLAGS={xla_flags}`", ""]
  lines += ["Per call: wall time (median, unprofiled), summed kernel time and kernel count "
            "(profiled, `torch.profiler` with CUDA activity).", "",
           "| contender | phase | wall (us) | kernels (us) | kernels |", "|---|---|---:|---:|---:|"]
  for (impl, phase), r in results.items():
    if "error" in r:
      lines.append(f"| {impl} | {phase} | failed: {r['error'][:80]} | | |")
      continue
    lines.append(f"| {impl} | {phase} | {r['wall_us']:.1f} | {r['kernel_us']:.1f} | "
                 f"{r['kernels']:.1f} |")
  for (impl, phase), r in results.items():
    if "error" in r or not r["by_kernel"]:
      continue
    lines += ["", f"## {impl}, {phase}: the {top} longest kernels", "",
              "| kernel | per call | us per call |", "|---|---:|---:|"]
    for name, n, us in r["by_kernel"][:top]:
      lines.append(f"| `{name[:110]}` | {n:.1f} | {us:.1f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--shape", type=parse_shape,
                      default=grid_run.Shape("lstm", 8, 32, 64, 128, 1, False, "float32"),
                      help="mode,batch,seq_len,input_size,hidden,layers,uni|bi,dtype")
  parser.add_argument("--calls", type=int, default=20)
  parser.add_argument("--top", type=int, default=12, help="kernels listed per contender")
  parser.add_argument("--out-dir", default=str(pathlib.Path(__file__).parent / "results"))
  parser.add_argument("--machine", default=None, help="name in the output file")
  parser.add_argument("--tag", default="",
                      help="appended to the output file's name (e.g. for a run under other "
                           "XLA_FLAGS, which the report records)")
  args = parser.parse_args(argv)
  grid_run.check_arguments(parser, args)
  gpu, have_torch, device_name, _, machine = grid_run.setting(args.machine)
  if not have_torch:
    print("profile_gpu.py needs PyTorch (its profiler records the kernels)", file=sys.stderr)
    return 2
  import torch
  cuda = torch.cuda.is_available()
  results = {}
  for impl, make in grid_run.contenders(args.shape, gpu, have_torch).items():
    try:
      fns = make()
    except Exception as e:  # a peer that cannot run this shape
      results[impl, "fwd"] = {"error": f"{type(e).__name__}: {e}"}
      continue
    for phase, fn in zip(("fwd", "fwd+bwd"), fns[:2]):
      try:
        results[impl, phase] = profile_call(fn, args.calls, cuda)
      except Exception as e:
        results[impl, phase] = {"error": f"{type(e).__name__}: {e}"}
  text = report(args.shape, device_name, results, args.top, grid_run.versions(),
                os.environ.get("XLA_FLAGS"))
  out_dir = pathlib.Path(args.out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  slug = args.shape.name.replace(" ", "-")
  tag = f"-{args.tag}" if args.tag else ""
  path = out_dir / f"profile-{machine}-{slug}{tag}-{datetime.date.today().isoformat()}.md"
  path.write_text(text)
  print(text)
  print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
