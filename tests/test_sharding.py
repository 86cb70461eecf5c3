"""Data parallelism: both backends, run with the batch sharded over four CPU
devices, give what one device gives (`sharded_cases.py`, in a child pytest:
the device count is fixed when JAX starts, and this run has one)."""

import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def test_batch_sharded_runs_over_four_devices():
  env = dict(os.environ, XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                                    " --xla_force_host_platform_device_count=4").strip(),
             JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                         str(HERE / "sharded_cases.py")], cwd=HERE.parent, env=env,
                        capture_output=True, text=True, timeout=1200)
  assert done.returncode == 0, done.stdout[-12000:] + done.stderr[-4000:]
