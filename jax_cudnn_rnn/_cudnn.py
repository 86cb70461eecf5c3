"""Loads the native library (built from `xla_ffi/`) and tells whether cuDNN can run."""

from __future__ import annotations

import ctypes
import functools
import pathlib

import jax

LIBRARY_NAME = "libjax_cudnn_rnn.so"


@functools.lru_cache(maxsize=None)
def _load():
  """The native library, or None with the reason it is not available."""
  path = pathlib.Path(__file__).with_name(LIBRARY_NAME)
  if not path.exists():
    return None, (f"the native library {LIBRARY_NAME} was not built "
                  "(CUDA and cuDNN's headers were not found at install time)")
  try:
    return ctypes.cdll.LoadLibrary(str(path)), ""
  except OSError as e:
    return None, f"the native library {path} failed to load: {e}"


def availability() -> tuple[bool, str]:
  """`(True, "")` when cuDNN can run the computation, else `(False, why)`."""
  lib, why = _load()
  if lib is None:
    return False, why
  if jax.default_backend() != "gpu":
    return False, f"the default JAX backend is {jax.default_backend()!r}, not a CUDA GPU"
  return True, ""
