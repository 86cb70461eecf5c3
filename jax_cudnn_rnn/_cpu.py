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

Whether bfloat16 products are quicker than float32 ones at all depends on
the CPU too (`bfloat16_products_fast`): they were on those two kinds, and
slower on a Zen 3 (neither) and on a Xeon whose virtual machine shows
AVX512-BF16 but not AMX (benchmarks/NOTES.md, session 69). Where they are
slower, `_rounded_dot` multiplies the rounded operands in float32.

It also reads the size of a core's L2 cache, which bounds where a float32
forward runs in lanes from 8 sequences (`_lanes.LANE_L2_MULTIPLE`): measured on
a 2-core Zen 3 (512 KiB of L2 a core), whose lanes by batch lost at an LSTM's
H256 where those of the Xeon (2 MiB) and the Zen 5 (1 MiB) gained (session 65).

Its vendor decides one rule more: a decoder's loop multiplies an LSTM's
gate blocks apart (`_xla._gate_blocks_in_loop`) except on AMD's CPUs, where
that lost on a Zen 4 (session 86) though it gained on the Xeon (session 78).

And whether it has AVX-512 (`avx512`): a decoder's loop multiplies gate blocks
(`_xla._gate_blocks_in_loop`) only where it does, or where the flags are
unknown; on a 2-core Zen 3 (AVX2 without AVX-512) a GRU's blocks lost where
those of the Xeon and the Zen 4 (both with AVX-512) gained (session 91).

And whether a CPU is JAX's only device (`sole_device`): the rules that cut a
layer's batch into lanes or stack its sequences into one product
(`_lanes.forward_lanes`, `_one_step.plan`) were measured there, and with the
batch split over several devices they would cut across the devices' parts.

DESIGN §4 has no module for this: it is here, rather than in `_xla.py`, so
that tests can stand in a CPU of either kind (`flags`).
"""

from __future__ import annotations

import functools
import pathlib

import jax

CPUINFO = pathlib.Path("/proc/cpuinfo")
CACHES = pathlib.Path("/sys/devices/system/cpu/cpu0/cache")


def sole_device() -> bool:
  """Whether JAX computes on a CPU, its only device (read at each call: the
  tests stand in other hosts)."""
  return jax.default_backend() == "cpu" and jax.device_count() == 1


@functools.cache
def flags() -> frozenset[str] | None:
  """The first CPU's feature flags (Linux's /proc/cpuinfo), or None where
  they cannot be read."""
  value = _cpuinfo_field(("flags", "Features"))
  return None if value is None else frozenset(value.split())


@functools.cache
def vendor() -> str | None:
  """The first CPU's vendor as /proc/cpuinfo names it ("GenuineIntel",
  "AuthenticAMD"), or None where it cannot be read (or names none: an Arm)."""
  value = _cpuinfo_field(("vendor_id",))
  if value is None:
    return None
  return value.strip() or None


def _cpuinfo_field(keys: tuple[str, ...]) -> str | None:
  """The value of the first of /proc/cpuinfo's lines whose key is one of
  `keys`, or None where there is none or the file cannot be read."""
  try:
    text = CPUINFO.read_text()
  except OSError:
    return None
  for line in text.splitlines():
    key, _, value = line.partition(":")
    if key.strip() in keys:
      return value
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


def avx512() -> bool | None:
  """Whether this CPU has AVX-512 (its foundation, `avx512f`), or None where
  the flags are unknown."""
  f = flags()
  return None if f is None else "avx512f" in f


X86_VENDORS = ("GenuineIntel", "AuthenticAMD")


def bfloat16_products_fast() -> bool | None:
  """Whether this CPU multiplies bfloat16 operands faster than float32 ones,
  as measured (XLA:CPU's products, jax 0.10.2): True with AMX (the AMX Xeon)
  or with AVX512-BF16 on an AMD CPU (Zen 4, Zen 5). False on an x86 CPU with
  neither (a Zen 3, whose bfloat16 LSTM ran at 0.60-0.90x of its float32
  one), and on an Intel one with AVX512-BF16 and AVX512-FP16 but no AMX (a
  Xeon whose virtual machine hides AMX: its bfloat16 products took 1.3-1.8x
  as long as float32 ones, from `[16, 64] x [64, 512]` to `[512, 256] x
  [256, 1024]`; benchmarks/NOTES.md, session 69). Why that Xeon's are slow
  where the Zens' with the same AVX512-BF16 are quick was not found, so an
  Intel CPU with AVX512-BF16 but neither AVX512-FP16 nor AMX (a Cooper
  Lake) is left unmeasured: None, as off x86 and where the flags are
  unknown."""
  kind, f = bfloat16_products(), flags()
  if f is None or vendor() not in X86_VENDORS:
    return None
  if kind == "amx":
    return True
  if kind is None:
    return False
  if vendor() == "AuthenticAMD":
    return True
  return False if "avx512_fp16" in f else None


@functools.cache
def l2_bytes() -> int | None:
  """The size of the first CPU's level-2 cache, in bytes (Linux's sysfs), or
  None where it cannot be read."""
  try:
    for index in sorted(CACHES.glob("index*")):
      if ((index / "level").read_text().strip() == "2"
          and (index / "type").read_text().strip() in ("Unified", "Data")):
        return _size_bytes((index / "size").read_text().strip())
  except (OSError, ValueError):
    return None
  return None


def _size_bytes(text: str) -> int:
  """sysfs's cache size ("512K", "2048K", "1M") in bytes; ValueError for
  anything else."""
  units = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}
  if text[-1:].upper() in units:
    return int(text[:-1]) * units[text[-1].upper()]
  return int(text)
