"""What the host CPU offers, where the "xla" path's choices depend on it.

XLA:CPU multiplies bfloat16 operands with whatever the CPU has: AMX tiles on
recent Xeons, AVX512-BF16 dot products on recent AMD EPYCs (Zen 4, Zen 5).
How fast those products run, against the memory they read, decides whether
a bfloat16 model's forward gains from lanes (`_xla.forward_lanes`), and the
two kinds of machine measured answered differently (benchmarks/NOTES.md,
sessions 41 and 50). This module reads the CPU's feature flags once; on a
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


def bfloat16_dot_products() -> bool:
  """Whether bfloat16 products run as AVX512-BF16 dot products, without AMX:
  the kind of CPU on which a bfloat16 forward's lanes by unit were measured
  faster (a 2-core AMD EPYC, Zen 5; benchmarks/NOTES.md, session 50). False
  where the flags are unknown."""
  f = flags()
  return f is not None and "avx512_bf16" in f and "amx_bf16" not in f
