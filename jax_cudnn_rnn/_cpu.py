"""What the host CPU offers, where the "xla" path's choices depend on it.

XLA:CPU multiplies bfloat16 operands with whatever the CPU has: AMX tiles on
recent Xeons, AVX512-BF16 dot products on recent AMD EPYCs (Zen 4, Zen 5).
Whether a bfloat16 model's forward gains from lanes (`_lanes.forward_lanes`)
was measured on one CPU of each kind (benchmarks/NOTES.md, sessions 50, 55
and 60): lanes by unit gained on both at the same recurrent-matrix sizes,
and, for the smallest of those matrices, from fewer sequences on the Zen 5
than on the AMX Xeon. This module reads the CPU's feature flags once; on a
system without /proc/cpuinfo they are unknown, and the rules that need them
keep the choice made before them.

DESIGN §4 has no module for this: it is here, rather than in `_xla.py`, so
that tests can stand in a CPU of either kind (`flags`).
"""

from __future__ import annotations

import functools
import pathlib

CPUINFO = pathlib.Path("/proc/cpuinfo")


@functools.cache
def flags() -> frozenset[str] | None:
  """The first CPU's feature flags (Linux's /proc/cpuinfo), or None where
  they cannot be read."""
  try:
    text = CPUINFO.read_text()
  except OSError:
    return None
  for line in text.splitlines():
    key, _, value = line.partition(":")
    if key.strip() in ("flags", "Features"):
      return frozenset(value.split())
  return None


def bfloat16_products() -> str | None:
  """How this CPU multiplies bfloat16 operands: "amx" (AMX tiles, as on the
  2-core Xeon measured), "avx512_bf16" (AVX512-BF16 dot products without AMX,
  as on the 2-core AMD EPYC, Zen 5), or None: neither (not measured), or the
  flags are unknown."""
  f = flags()
  if f is None:
    return None
  if "amx_bf16" in f:
    return "amx"
  return "avx512_bf16" if "avx512_bf16" in f else None
