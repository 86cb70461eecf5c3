#!/usr/bin/env bash
# For a lent GPU machine (no network): build the native library, run the GPU
# tests, the demo, the whole suite and the benchmarks, and leave logs and
# results in $OUT (or ./gpu-out). From the repository root:
#
#   bash benchmarks/gpu_session.sh                  # build gpu-tests
#   bash benchmarks/gpu_session.sh suite bench-full # any stages, in order
#
# Stages: build (a failed build ends the run: nothing after it could pass),
# gpu-checks (the native library's checks, the layout with a real handle, and
# the tests that need a real device: dispatch, errors, memory, export),
# gpu-sweep (the rest of test_cudnn.py, the sweeps against the reference, spread
# over pytest-xdist's workers where it is installed), gpu-tests (both), demo,
# suite (every test, on the GPU backend: the adapters and the demo then run
# cuDNN through implementation=None; the plumbing tests are CPU-only and run
# there), bench-quick, bench-full, bench-sweep (run.py --sweep, cuDNN against our
# "xla" path over hidden sizes: where implementation=None should pick which; it
# starts no new shape after SWEEP_S seconds, default 150),
# bench-decode (benchmarks/decode.py),
# bench-decode-large (its --large models: either side of the size up to which
# implementation=None decodes on the "xla" path), profile
# (benchmarks/profile_gpu.py: the kernels of one call of each contender, at the small
# shapes where session 38 found our cuDNN forward slower than PyTorch's), profile-leads
# (session 45's leads: the smallest LSTM without XLA's command buffers, where the
# batch-major call's two transposes cost ~100 us of wall time for ~2 us of kernels on an
# H100, and in bfloat16, where cuDNN's persistent algorithm is not asked for), fuzz-cudnn
# (tests/fuzz_against_reference.py --implementation cudnn: random models and calls, values,
# gradients, vmap and a decoder's loop against the reference; it starts no new case after
# FUZZ_S seconds, default 120, seed FUZZ_SEED, default 0).
#
# A device command may run 10 minutes, so the stages of one call share a budget
# (BUDGET seconds, default 570): each gets what is left, a stage that would start
# with under 30 s is skipped, a benchmark starts no new shape in its last minute
# (run.py --budget-s, which writes its files after every shape), and pytest stops
# a test after TEST_TIMEOUT seconds (default 300) where pytest-timeout is
# installed. With PACK=<file>, everything in the output folder is packed into
# that .tgz after every stage (the device tool brings back only a few files, and
# nothing from a command killed at its limit but what it already wrote). The
# build stays between calls while the machine is warm, so a session can run,
# for example: `build gpu-checks demo gpu-sweep bench-quick`, then `bench-full`.
set -uo pipefail
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(build gpu-tests)
# Checked before anything runs: a typo found when its turn came used to end a
# call after the stages before it had spent the device's minutes.
known=(build gpu-checks gpu-sweep gpu-tests demo suite bench-quick bench-full bench-sweep
       bench-decode bench-decode-large profile profile-leads fuzz-cudnn)
for stage in "${stages[@]}"; do
  if [[ " ${known[*]} " != *" $stage "* ]]; then
    echo "unknown stage '$stage' (stages: ${known[*]}); nothing was run" >&2
    exit 2
  fi
done
for var in BUDGET WORKERS TEST_TIMEOUT SWEEP_S FUZZ_S FUZZ_SEED; do
  if [ -n "${!var:-}" ] && [[ ! "${!var}" =~ ^[0-9]+$ ]]; then
    echo "$var must be a whole number, got '${!var}'; nothing was run" >&2
    exit 2
  fi
done
out="${OUT:-gpu-out}"
mkdir -p "$out"
stamp=$(date +%Y-%m-%d)
budget="${BUDGET:-570}"
started=$(date +%s)

versions() {
  {
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())"
    python3 -c "import importlib.metadata as m; print('nvidia-cudnn-cu13', m.version('nvidia-cudnn-cu13'))"
    python3 -c "from jax_cudnn_rnn import _cudnn; print('cudnn availability:', _cudnn.availability(), 'version:', _cudnn.cudnn_version())"
    python3 -c "from jax._src.lib import cuda_versions as v; print('cudnn loaded by jax:', v.cudnn_get_version() if v else None)"
  } 2>&1 | tee "$out/versions.txt"
}

run_stage() {
  local name=$1; shift
  local left=$((budget - ($(date +%s) - started)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left}s of the budget left =="
    echo "$name skipped" >> "$out/stages.txt"
    return
  fi
  echo "== $name ($(date +%T), ${left}s left) =="
  STAGE_LEFT=$left PYTHONUNBUFFERED=1 timeout "$left" "$@"
  local rc=$?
  echo "== $name: exit $rc =="
  echo "$name $rc" >> "$out/stages.txt"
  [ -n "${PACK:-}" ] && tar czf "$PACK" -C "$out" .
  return $rc
}

# pytest's options common to the GPU stages.
pytest_opts="-rs"
python3 -c "import pytest_timeout" 2>/dev/null && pytest_opts+=" --timeout ${TEST_TIMEOUT:-300}"
workers=""
python3 -c "import xdist" 2>/dev/null && workers="-n ${WORKERS:-8}"
layout=tests/test_cudnn.py::test_analytic_layout_equals_cudnn

run_gpu_sweep() {
  # Each worker takes GPU memory as it needs it instead of 75% of it up front.
  run_stage gpu-sweep bash -c "set -o pipefail; XLA_PYTHON_CLIENT_PREALLOCATE=false \
    python3 -m pytest -v $pytest_opts $workers --durations=10 tests/test_cudnn.py \
    -m 'not needs_device' --deselect $layout 2>&1 | tee '$out/gpu-sweep-$stamp.log' | tail -40"
}

for stage in "${stages[@]}"; do
  case "$stage" in
    build)
      run_stage build bash -c "set -o pipefail; python3 -m pip install --no-build-isolation --no-deps -e . \
        -Ccmake.define.JCR_REQUIRE_CUDA=ON 2>&1 | tee '$out/build.log' | tail -40" \
        || { echo "the build failed: later stages are not run"; exit 1; }
      versions ;;
    gpu-checks|gpu-tests)
      # The quick checks first (the library, the layout with a real handle, dispatch,
      # errors, memory, export), so that a call cut short by its budget has them.
      run_stage gpu-checks bash -c "set -o pipefail; {
        rc=0
        python3 -m pytest -v $pytest_opts tests/test_native_library.py $layout || rc=1
        python3 -m pytest -v $pytest_opts tests/test_cudnn.py -m needs_device || rc=1
        exit \$rc; } 2>&1 | tee '$out/gpu-checks-$stamp.log' | tail -40"
      [ "$stage" = gpu-tests ] && run_gpu_sweep ;;
    gpu-sweep)
      run_gpu_sweep ;;
    demo)
      run_stage demo bash -c "set -o pipefail; python3 -m jax_cudnn_rnn.demo 2>&1 | sed -u 's/\r/\n/g' \
        | tee '$out/demo-$stamp.log' | tail -25" ;;
    suite)
      # Over xdist's workers, each taking GPU memory as it needs it: in one process
      # the suite outlasted a 255 s budget on an H100 (session 46); ten workers ran
      # half of it in 120 s. -v names each test as it ends, for a run cut short.
      run_stage suite bash -c "set -o pipefail; XLA_PYTHON_CLIENT_PREALLOCATE=false \
        python3 -m pytest -v -rf $pytest_opts $workers --deselect tests/test_cudnn.py 2>&1 \
        | tee '$out/suite-$stamp.log' | tail -40" ;;
    bench-quick)
      run_stage bench-quick bash -c "set -o pipefail; python3 benchmarks/run.py --quick --out-dir '$out' --budget-s \$((STAGE_LEFT - 60)) 2>&1 \
        | tee '$out/bench-quick-$stamp.log' | tail -40" ;;
    bench-full)
      run_stage bench-full bash -c "set -o pipefail; python3 benchmarks/run.py --out-dir '$out' --budget-s \$((STAGE_LEFT - 60)) 2>&1 \
        | tee '$out/bench-full-$stamp.log' | tail -60" ;;
    profile)
      run_stage profile bash -c "set -o pipefail; {
        python3 benchmarks/profile_gpu.py --out-dir '$out' &&
        python3 benchmarks/profile_gpu.py --out-dir '$out' --shape gru,16,50,64,128,1,uni,float32; } 2>&1 | tee '$out/profile-$stamp.log' | tail -60" ;;
    profile-leads)
      run_stage profile-leads bash -c "set -o pipefail; {
        XLA_FLAGS=--xla_gpu_enable_command_buffer= python3 benchmarks/profile_gpu.py --out-dir '$out' \
          --tag no-command-buffers &&
        python3 benchmarks/profile_gpu.py --out-dir '$out' --shape lstm,8,32,64,128,1,uni,bfloat16; } 2>&1 \
        | tee '$out/profile-leads-$stamp.log' | tail -60" ;;
    bench-decode)
      run_stage bench-decode bash -c "set -o pipefail; python3 benchmarks/decode.py --out-dir '$out' 2>&1 | tail -40" ;;
    bench-sweep)
      run_stage bench-sweep bash -c "set -o pipefail; python3 benchmarks/run.py --sweep --only ours-cudnn,ours-xla --repeats 9 --out-dir '$out' --budget-s \$((STAGE_LEFT - 45 < ${SWEEP_S:-150} ? STAGE_LEFT - 45 : ${SWEEP_S:-150})) 2>&1 \
        | tee '$out/bench-sweep-$stamp.log' | tail -40" ;;
    bench-decode-large)
      run_stage bench-decode-large bash -c "set -o pipefail; python3 benchmarks/decode.py --large --out-dir '$out' 2>&1 | tail -40" ;;
    fuzz-cudnn)
      run_stage fuzz-cudnn bash -c "set -o pipefail; python3 tests/fuzz_against_reference.py --implementation cudnn \
        --seed ${FUZZ_SEED:-0} --cases 10000 --budget-s \$((STAGE_LEFT - 45 < ${FUZZ_S:-120} ? STAGE_LEFT - 45 : ${FUZZ_S:-120})) 2>&1 \
        | tee '$out/fuzz-cudnn-$stamp.log' | tail -40" ;;
    *)  # in `known` above, but given no case here
      echo "stage $stage has no case in $0" >&2
      exit 2 ;;
  esac
done
