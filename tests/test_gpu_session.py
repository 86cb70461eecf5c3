"""benchmarks/gpu_session.sh refuses what it cannot run before it runs
anything: a lent GPU's minutes are few, and a typo in the last stage named
used to end the call only once the stages before it had spent them."""

import os
import pathlib
import re
import subprocess

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_session.sh"


def _run(tmp_path, *stages, **env):
  out = tmp_path / "out"
  done = subprocess.run(["bash", str(SCRIPT), *stages], capture_output=True, text=True,
                        timeout=60, env=dict(os.environ, OUT=str(out), **env))
  return done, out


@pytest.mark.parametrize("stages,env,message", [
    (("build", "gpu-check"), {}, r"^unknown stage 'gpu-check' \(stages: build gpu-checks .*\); "
                                 r"nothing was run$"),
    (("build",), {"BUDGET": "5m"}, r"^BUDGET must be a whole number, got '5m'; nothing was run$"),
    (("fuzz-cudnn",), {"FUZZ_S": "-3"}, r"^FUZZ_S must be a whole number, got '-3'"),
    (("gpu-tests",), {"WORKERS": "eight"}, r"^WORKERS must be a whole number, got 'eight'"),
])
def test_what_it_cannot_run_is_refused_before_anything_runs(tmp_path, stages, env, message):
  done, out = _run(tmp_path, *stages, **env)
  assert done.returncode == 2, (done.stdout, done.stderr)
  assert re.search(message, done.stderr.strip()), done.stderr
  assert done.stdout == "" and not out.exists()  # not even the build began


def test_every_stage_it_knows_has_a_case():
  text = SCRIPT.read_text()
  known = re.search(r"^known=\(([^)]*)\)", text, re.MULTILINE).group(1).split()
  labels = set()
  for label in re.findall(r"^    ([a-z|-]+)\)", text, re.MULTILINE):
    labels.update(label.split("|"))
  assert len(known) == 14 and set(known) == labels, (known, labels)
  # and the header's list names each
  header = text.split("set -uo pipefail")[0]
  assert all(stage in header for stage in known), [s for s in known if s not in header]
