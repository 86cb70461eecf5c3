"""The oldest JAX this package works with, checked when it is imported.

Not in DESIGN §4's layout: a file of its own because the check has to run
before anything else in the package is imported, and it owns one idea.

The "xla" path's gradient is a `custom_jvp` whose tangent is a second
`lax.scan`, transposed by JAX for reverse mode. JAX before 0.10 fails to
transpose it: jax 0.6 and 0.7 stop on an internal `AssertionError` in the scan
transpose rule, jax 0.8 and 0.9 on a `TypeError` about a `ValAccum` (measured
with jax 0.6.2, 0.7.2, 0.8.3 and 0.9.2: `tests/test_transforms.py`). jax 0.10.0
transposes it, but its XLA:CPU cannot compile a bfloat16 model's gradient at
some small sizes: a bfloat16 x bfloat16 -> float32 product inside a loop, such
as `[2, 12] x [12, 4]`, fails with "UNIMPLEMENTED: unsupported operand type BF16
in op dot" (a one-layer bfloat16 GRU of batch 2 and 4 units, for one; jax
0.10.1 and later compile it). pip enforces `pyproject.toml`'s `jax>=0.10.1`,
but an install with `--no-deps`, or a JAX downgraded afterwards, would reach
those errors from deep inside JAX at the first `jax.grad`; this check says what
is wrong at import instead.

The optional dependencies (Flax for the adapters and the Flax converters,
optax for the demo, torch for tensors from `interop.to_torch_state_dict`) are
imported through `optional_import`, so that a missing one says which part of
the package needs it and what to install, rather than only "No module named
'flax'" (`pip install jax-cudnn-rnn` installs none of them).
"""

from __future__ import annotations

import importlib
import re
from types import ModuleType

import jax

MIN_JAX = (0, 10, 1)


def version_tuple(version: str) -> tuple[int, ...]:
  """The leading numeric release of a version string: "0.11.0.dev2026" -> (0, 11, 0)."""
  match = re.match(r"\d+(?:\.\d+)*", version)
  if match is None:
    raise ValueError(f"not a version: {version!r}")
  return tuple(int(part) for part in match.group(0).split("."))


def jax_older_than(bound: tuple[int, ...], version: str | None = None) -> bool:
  """Whether JAX's `version` (the installed one's by default) is older than
  the release `bound`, `(0, 11)` say: the version gates of the measured rules
  (`_one_step.fuses_matvec`, `_xla.stacked_max_bytes`) and of `check_jax`."""
  return version_tuple(jax.__version__ if version is None else version) < bound


def check_jax(version: str | None = None) -> None:
  """Raises ImportError when JAX's `version` (the installed one's by default)
  is older than `MIN_JAX`."""
  version = jax.__version__ if version is None else version
  if jax_older_than(MIN_JAX, version):
    minimum = ".".join(map(str, MIN_JAX))
    raise ImportError(
        f"jax_cudnn_rnn needs jax >= {minimum}, but jax {version} is installed: older JAX "
        f"cannot differentiate its RNNs (before 0.10) or compile some of their gradients "
        f"(0.10.0). Upgrade with `pip install -U 'jax>={minimum}'`.")


# How to install each optional dependency, by its top-level module.
OPTIONAL = {
    "flax": "pip install 'jax-cudnn-rnn[flax]'",
    "optax": "pip install optax",
    "torch": "pip install torch",
}


def optional_import(module: str, needed_by: str) -> ModuleType:
  """Imports `module` of an optional dependency (`OPTIONAL`). Where that
  dependency is not installed, raises a `ModuleNotFoundError` saying that
  `needed_by` needs it and how to install it; any other import error (a
  dependency of the dependency missing, say) is raised as it is."""
  top = module.split(".")[0]
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    if top not in OPTIONAL or (e.name or "").split(".")[0] != top:
      raise
    raise ModuleNotFoundError(f"{needed_by} needs {top}, which is not installed: "
                              f"{OPTIONAL[top]}", name=e.name) from None
