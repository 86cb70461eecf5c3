"""Checkpoints from a multi-host run: two processes joined by
`jax.distributed` on this machine (CPU, two devices each), each running
`multiprocess_checkpoint_case.py`, save and restore through one directory.
Before `save` knew about processes, they raced: each staged its own
directory and Orbax's barriers saw different names (so one process failed
and the other hung), and a buffer split over both processes could not be
fetched to write."""

import json
import os
import pathlib
import socket
import subprocess
import sys

HERE = pathlib.Path(__file__).parent


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_save_and_restore_one_checkpoint(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=2").strip())
  port = _free_port()
  script = str(HERE / "multiprocess_checkpoint_case.py")
  processes = [subprocess.Popen([sys.executable, script, str(i), str(port), str(tmp_path)],
                                cwd=HERE.parent, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in (0, 1)]
  outputs = []
  try:
    for p in processes:
      outputs.append(p.communicate(timeout=600))
  finally:
    for p in processes:
      p.kill()
  results = []
  for i, (p, (out, err)) in enumerate(zip(processes, outputs)):
    assert p.returncode == 0, f"process {i}:\n{out[-6000:]}\n{err[-6000:]}"
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"process {i}:\n{out[-6000:]}\n{err[-6000:]}"
    results.append(json.loads(lines[0][len("RESULT "):]))
  expected = {"split saved, restored split", "split saved, restored replicated",
              "replicated saved, restored split", "a checkpoint replaced",
              "restored without a sharding, on this process's default device",
              "bfloat16, restored as float32", "through a CheckpointManager",
              "a foreign directory refused on every process",
              "a failure on process 0 raised on both", "no staging directory left"}
  for i, checks in enumerate(results):
    assert set(checks) == expected, (i, checks)
    failed = {name: why for name, why in checks.items() if why is not True}
    assert not failed, (i, failed, outputs[i][1][-6000:])
  # One checkpoint of each, written once, where both processes read it.
  assert sorted(os.listdir(tmp_path)) == ["bf16", "foreign", "manager", "replicated", "split"]
