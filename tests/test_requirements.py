"""The import-time JAX version check, its agreement with pyproject.toml, and
what a missing optional dependency says."""

import json
import pathlib
import re
import subprocess
import sys
import tomllib

import jax
import pytest

from jax_cudnn_rnn import _requirements

PYPROJECT = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"


@pytest.mark.parametrize("version,expected", [
    ("0.10.2", (0, 10, 2)),
    ("0.11.0.dev20261101", (0, 11, 0)),
    ("0.10.0rc1", (0, 10, 0)),
    ("1.0", (1, 0)),
])
def test_version_tuple(version, expected):
  assert _requirements.version_tuple(version) == expected


def test_version_tuple_refuses_what_is_no_version():
  with pytest.raises(ValueError, match="not a version: 'unknown'"):
    _requirements.version_tuple("unknown")


@pytest.mark.parametrize("bound,version,older", [
    ((0, 11), "0.10.2", True),
    ((0, 11), "0.11.0.dev20261101", False),
    ((0, 11), "0.12.1", False),
    ((0, 10, 2), "0.10.1", True),
    ((0, 10, 2), "0.10.2", False),
])
def test_jax_older_than(bound, version, older):
  assert _requirements.jax_older_than(bound, version) is older


def test_jax_older_than_the_installed_jax():
  mine = _requirements.version_tuple(jax.__version__)
  assert not _requirements.jax_older_than(mine)
  assert _requirements.jax_older_than(mine[:-1] + (mine[-1] + 1,))


@pytest.mark.parametrize("version", ["0.10.0", "0.9.2", "0.8.3", "0.6.0", "0.4.38"])
def test_older_jax_is_refused_naming_both_versions(version):
  with pytest.raises(ImportError, match=rf"needs jax >= 0\.10\.1, but jax {re.escape(version)} "
                                        r"is installed.*pip install -U 'jax>=0\.10\.1'"):
    _requirements.check_jax(version)


@pytest.mark.parametrize("version", ["0.10.1", "0.10.2", "0.11.0.dev20261101", "1.0"])
def test_supported_jax_is_accepted(version):
  _requirements.check_jax(version)


def test_the_installed_jax_is_accepted():
  assert _requirements.version_tuple(jax.__version__) >= _requirements.MIN_JAX
  _requirements.check_jax()


def test_pyproject_requires_the_same_minimum():
  dependencies = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
  (jax_requirement,) = [d for d in dependencies if re.match(r"jax\b", d)]
  bound = re.fullmatch(r"jax>=([\d.]+)", jax_requirement)
  assert bound, jax_requirement
  minimum = _requirements.version_tuple(bound.group(1))
  padded = minimum + (0,) * (len(_requirements.MIN_JAX) - len(minimum))
  assert padded == _requirements.MIN_JAX


# Run in a fresh interpreter where the optional dependencies cannot be
# imported (None in sys.modules: as if not installed), reporting what each
# entry that needs one raised, and that the rest of the package still works.
_WITHOUT_OPTIONAL = r"""
import json, sys
blocked = sys.argv[1].split(",")
for name in blocked:
  sys.modules[name] = None
import importlib
import jax, jax.numpy as jnp
import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import interop

spec = jcr.CudnnGRU(1, 4, 3)
params = spec.init_params(jax.random.key(0))
said = {"call": float(jnp.sum(spec(jnp.ones((2, 1, 3)), None, params)[0])),
        "arrays": sorted(interop.to_torch_state_dict(spec, params))[:1],
        "linen dicts": len(interop.to_flax_linen_cells(spec, params))}
entries = {
    "linen": lambda: importlib.import_module("jax_cudnn_rnn.linen"),
    "nnx": lambda: importlib.import_module("jax_cudnn_rnn.nnx"),
    "demo": lambda: importlib.import_module("jax_cudnn_rnn.demo"),
    "flax_linen_cell": lambda: interop.flax_linen_cell(spec),
    "flax_nnx_cell": lambda: interop.flax_nnx_cell(spec, 0),
    "to_flax_nnx_cells": lambda: interop.to_flax_nnx_cells(spec, params),
    "from_flax_nnx_cells": lambda: interop.from_flax_nnx_cells(spec, [[{}]]),
    "tensors": lambda: interop.to_torch_state_dict(spec, params, as_tensors=True),
}
for entry, call in entries.items():
  try:
    call()
    said[entry] = None
  except ImportError as e:
    said[entry] = [type(e).__name__, str(e), e.name]
print(json.dumps(said))
"""


def _without(*modules) -> dict:
  done = subprocess.run([sys.executable, "-c", _WITHOUT_OPTIONAL, ",".join(modules)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_missing_optional_dependency_says_who_needs_it_and_what_to_install():
  """`pip install jax-cudnn-rnn` installs none of Flax, optax and torch: the
  call, the checkpoints and the array converters work without them, and each
  entry that needs one says so in its own name (not only "No module named")."""
  said = _without("flax", "flax.linen", "flax.nnx", "optax", "torch")
  assert said["call"] != 0 and said["arrays"] and said["linen dicts"] == 1
  flax = "which is not installed: pip install 'jax-cudnn-rnn[flax]'"
  for entry, needed_by in (("linen", "jax_cudnn_rnn.linen"), ("nnx", "jax_cudnn_rnn.nnx"),
                           ("demo", "the demo (jax_cudnn_rnn.demo)"),
                           ("flax_linen_cell", "interop.flax_linen_cell"),
                           ("flax_nnx_cell", "interop.flax_nnx_cell"),
                           ("to_flax_nnx_cells", "interop.to_flax_nnx_cells"),
                           ("from_flax_nnx_cells", "interop.from_flax_nnx_cells")):
    kind, message, name = said[entry]
    assert (kind, message) == ("ModuleNotFoundError", f"{needed_by} needs flax, {flax}"), entry
    assert name.split(".")[0] == "flax"
  assert said["tensors"] == [
      "ModuleNotFoundError", "interop.to_torch_state_dict(as_tensors=True) needs torch, which is "
      "not installed: pip install torch", "torch"]
  # With Flax there, the demo's next need is optax.
  assert _without("optax")["demo"] == [
      "ModuleNotFoundError", "the demo (jax_cudnn_rnn.demo) needs optax, which is not installed: "
      "pip install optax", "optax"]


def test_an_install_hint_names_an_extra_that_exists():
  extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
  for module, hint in _requirements.OPTIONAL.items():
    extra = re.fullmatch(r"pip install 'jax-cudnn-rnn\[(\w+)\]'", hint)
    if extra:
      assert any(re.match(rf"{module}\b", d) for d in extras[extra.group(1)]), hint


def test_what_the_optional_dependency_itself_lacks_is_raised_as_it_is(monkeypatch):
  """Flax installed but missing a dependency of its own: that error, unchanged
  (installing Flax again would not help)."""
  def broken(module):
    raise ModuleNotFoundError("No module named 'msgpack'", name="msgpack")
  monkeypatch.setattr(_requirements.importlib, "import_module", broken)
  with pytest.raises(ModuleNotFoundError, match=r"^No module named 'msgpack'$"):
    _requirements.optional_import("flax.linen", "jax_cudnn_rnn.linen")
