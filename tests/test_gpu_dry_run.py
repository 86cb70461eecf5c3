"""The GPU tests' own code runs on this CPU against the handler model
(`gpu_dry_run.py`, in a child pytest: its patches must be in place before
`test_cudnn.py` is imported), so that a mistake in them is found here and not
on a lent GPU."""

import ast
import os
import pathlib
import re
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def _tests_that_need_no_device() -> set[str]:
  """The test functions of `test_cudnn.py` not marked `needs_device`, read from its source."""
  tree = ast.parse((HERE / "test_cudnn.py").read_text())
  return {node.name for node in tree.body
          if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
          and "needs_device" not in {ast.unparse(d) for d in node.decorator_list}}


def test_gpu_tests_run_on_the_cpu_against_the_handler_model():
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
  done = subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider",
                         "-p", "gpu_dry_run", str(HERE / "test_cudnn.py")],
                        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=1200)
  report = done.stdout[-12000:] + done.stderr[-4000:]
  assert done.returncode == 0, report
  passed = set(re.findall(r"test_cudnn\.py::(\w+)(?:\[[^\]]*\])? PASSED", done.stdout))
  expected = _tests_that_need_no_device()
  assert "test_values_and_gradients" in expected, expected  # the parse found the tests
  assert passed == expected, (sorted(expected - passed), report)
