"""The import-time JAX version check, and its agreement with pyproject.toml."""

import pathlib
import re
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
