"""Prints pip constraints pinning every `name>=version` requirement of the
project and its `test` extra to that version: the oldest versions pyproject.toml
claims to work with, which .ci/run then tests."""

import pathlib
import re
import sys
import tomllib

project = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
requirements = project["dependencies"] + project["optional-dependencies"]["test"]
for requirement in requirements:
  match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
  if match is None:
    sys.exit(f"lowest_pins.py: cannot pin {requirement!r}; write it as name>=version")
  print(f"{match.group(1)}=={match.group(2)}")
