"""Test-wide settings, so that references can be compared tightly:
- float64 is enabled;
- on a GPU, float32 matmuls run in full float32. By default XLA and cuDNN may
  run them as TF32 there (a 10-bit mantissa), which is far outside the
  float32 tolerances of the tests comparing two float32 computations. Where
  TF32 is the point, tests ask for it explicitly (`test_cudnn_python.py`,
  `test_native_library.py`); on a CPU this setting changes nothing;
- implicit rank promotion raises (`jax_numpy_rank_promotion="raise"`), as in
  the codebases that set it: the library writes its broadcasts out
  (`_reference.lift`), so that it runs there too, and every test checks that.

Each test starts with empty caches of compiled eager calls
(`_ops._compiled_dispatch`, `_ops._compiled_transformed_dispatch`): tests stand
models in for cuDNN and patch what a trace reads (`handler_model.py`), and an
eager call must trace under the patches of its own test, not run a program
compiled under another's. Nor are those caches dropped as the process's
memory mappings grow (`_ops._bound_programs`, which reads the limit from
`_ops.MAX_MAP_COUNT`, here a path that does not exist): a test that counts
its traces would otherwise count again whenever the suite's own programs held
half the limit. `test_transforms.py` tests the bound with a limit of its own.

After each test file, JAX's caches are cleared (`jax.clear_caches`), releasing
the programs it compiled: one process runs the whole suite, and under the
oldest pinned jaxlib (0.10.1) it aborted inside XLA's compiler late in the
suite (`test_xla.py`, session 49), a file that passes alone; every compiled
program keeps its code mapped, and a process may hold 65530 mappings
(`vm.max_map_count`), a likely cause, not confirmed.

Each process of the run (each xdist worker, and each child pytest that a test
starts) compiles through a persistent compilation cache of its own, a fresh
temporary directory removed when the process's pytest ends, with no minimum
compile time: the suite compiles many identical programs (parametrized tests,
new closures over the same model, files after `jax.clear_caches`), and a
repeated one is then read back instead of compiled again. Every distinct
program is still compiled once in the run; what a test patches reaches the
lowered module, which keys the cache. On a 2-core Zen 4, the README's test
command 29:42 -> 25:07, `tests/test_transforms.py` 201 -> 128 s
(benchmarks/NOTES.md, session 97). A directory each, not one shared by the
workers (136 s there), so that no worker reads an entry that another is still
writing (JAX's cache locks its files only under a size limit, which needs the
`filelock` package). `JCR_TEST_COMPILATION_CACHE=0` turns it off, to
compile every program afresh (a compiler crash, say).

`products` (for the tests of bfloat16 models' products): either of the CPU
lowerings of `_rounded_dot`, whatever the host's.

`sizes` (for the test files that lower the cuDNN path on this CPU): cuDNN
said to be available, with the handler model's sizes and the analytic layout
(`handler_model.py`); the FFI calls themselves are left alone (they can be
lowered, not run).
"""

import os
import shutil
import tempfile

import jax
import pytest

_COMPILATION_CACHE = None
if os.environ.get("JCR_TEST_COMPILATION_CACHE", "1") != "0":
  # Before anything compiles: JAX reads the setting at its first compile.
  _COMPILATION_CACHE = tempfile.mkdtemp(prefix="jcr-test-compilation-cache-")
  jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

from jax_cudnn_rnn import _cpu, _ops
from handler_model import HandlerModel


def pytest_unconfigure(config):
  if _COMPILATION_CACHE is not None:
    shutil.rmtree(_COMPILATION_CACHE, ignore_errors=True)


jax.config.update("jax_enable_x64", True)
jax.config.update("jax_numpy_rank_promotion", "raise")
if jax.default_backend() == "gpu":
  jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(autouse=True)
def _fresh_eager_cache(monkeypatch):
  _ops._compiled_dispatch.clear_cache()
  _ops._compiled_transformed_dispatch.clear_cache()
  _ops._PROGRAMS.clear()  # the sizes `_bound_programs` last saw, now 0
  monkeypatch.setattr(_ops, "MAX_MAP_COUNT", "/nonexistent/max_map_count")
  yield


@pytest.fixture(autouse=True, scope="module")
def _fresh_jax_caches():
  yield
  jax.clear_caches()


@pytest.fixture
def sizes(monkeypatch):
  """cuDNN said to be available, with the handler model's sizes (module doc)."""
  return HandlerModel().install(monkeypatch.setattr, handlers=False)


@pytest.fixture(params=[True, False], ids=["bfloat16-products", "float32-products"])
def products(request, monkeypatch):
  """Either CPU lowering of `_rounded_dot`, whatever the host's: bfloat16
  products (AMX, or AVX512-BF16 on AMD), or the rounded operands multiplied
  in float32 (`_rounded_dot.float32_products`): "bfloat16" or "float32".
  Compiled afresh each (JAX caches a primitive's compiled call by its
  parameters, which do not name the lowering)."""
  monkeypatch.setattr(_cpu, "bfloat16_products_fast", lambda: request.param)
  jax.clear_caches()
  yield "bfloat16" if request.param else "float32"
  jax.clear_caches()
