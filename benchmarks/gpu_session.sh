#!/usr/bin/env bash
# One command for a lent GPU machine (no network): build the native library,
# run the GPU tests and the benchmarks, and leave logs and results in $OUT
# (or ./gpu-out). Usage, from the repository root:  bash benchmarks/gpu_session.sh [--full]
set -uo pipefail
out="${OUT:-gpu-out}"
mkdir -p "$out"
stamp=$(date +%Y-%m-%d)
{
  echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
  python3 -c "import importlib.metadata as m; print('nvidia-cudnn-cu13', m.version('nvidia-cudnn-cu13'))"
} 2>&1 | tee "$out/versions.txt"
PYTHONUNBUFFERED=1 python3 -m pip install --no-build-isolation --no-deps -e . \
  -Ccmake.define.JCR_REQUIRE_CUDA=ON 2>&1 | tail -20 | tee "$out/build.log"
python3 -c "from jax_cudnn_rnn import _cudnn; print('cudnn availability:', _cudnn.availability())" \
  2>&1 | tee -a "$out/versions.txt"
PYTHONUNBUFFERED=1 python3 -m pytest -m gpu -v -rs tests/test_cudnn.py 2>&1 \
  | tee "$out/gpu-tests-$stamp.log" | tail -40
if [ "${1:-}" = "--full" ]; then
  PYTHONUNBUFFERED=1 python3 benchmarks/run.py --out-dir "$out" 2>&1 | tail -60
else
  PYTHONUNBUFFERED=1 python3 benchmarks/run.py --quick --out-dir "$out" 2>&1 | tail -40
fi
