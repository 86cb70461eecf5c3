"""The built native library exports every FFI handler and query entry point.

Finds the library from JCR_NATIVE_LIBRARY (CI sets it to the CMake build
output) or in the installed package; skipped only when neither exists.
"""

import ctypes
import os
import pathlib

import pytest

from jax_cudnn_rnn import _cudnn


def _library_path():
  explicit = os.environ.get("JCR_NATIVE_LIBRARY")
  if explicit:
    return pathlib.Path(explicit)
  return next((p for p in _cudnn._library_candidates() if p.exists()), None)


def test_library_exports_every_handler():
  path = _library_path()
  if path is None:
    pytest.skip("the native library was not built on this machine")
  assert path.exists(), f"JCR_NATIVE_LIBRARY={path} does not exist"
  _cudnn._preload_cudnn_wheel()
  lib = ctypes.CDLL(str(path))
  for symbol in (*_cudnn.TARGETS.values(), "JcrRnnQuerySizes", "JcrRnnWeightLayout"):
    assert getattr(lib, symbol) is not None, symbol
