"""cuDNN's own weight-space size and layout equal `_layout`'s analytic ones,
checked on a machine without a GPU.

`JcrProbeWeightLayout` (xla_ffi/layout_probe.cc, a test-only library that
.ci/run builds with `--target jcr_layout_probe` and names in JCR_LAYOUT_PROBE)
sets the RNN descriptor exactly as the handlers do and asks cuDNN's host-side
`cudnnGetRNNWeightSpaceSize` / `cudnnGetRNNWeightParams`, with a zero-filled
placeholder for the handle that only a device could make. It runs in a child
process (tests/layout_probe.py). Skipped where JCR_LAYOUT_PROBE is not set; the
GPU test `test_analytic_layout_equals_cudnn` checks the same with a real handle.
"""

import itertools
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import jax_cudnn_rnn as jcr
from jax_cudnn_rnn import _cudnn
from helpers import SPEC_CLASSES, assert_layout_is_analytic

DTYPES = (jnp.float32, jnp.float64, jnp.float16, jnp.bfloat16)
# (num_layers, num_units, input_size): tiny, odd, unaligned and large sizes.
SIZES = ((1, 1, 1), (3, 6, 4), (2, 5, 3), (3, 7, 1), (2, 33, 17), (4, 1, 9), (2, 256, 128),
         (1, 1023, 1))
CUDNN_DATA_INT8 = 3  # cudnnDataType_t: a type cuDNN's RNNs do not take
STANDARD, SMALL_H = (_cudnn.ALGORITHMS[a] for a in ("standard", "persist_static_small_h"))


def _library():
  path = os.environ.get("JCR_LAYOUT_PROBE")
  if not path:
    pytest.skip("JCR_LAYOUT_PROBE is not set (build the CMake target jcr_layout_probe)")
  assert pathlib.Path(path).exists(), f"JCR_LAYOUT_PROBE={path} does not exist"
  return path


def _query(spec, allow_tf32=False, data_type=None, algo=STANDARD):
  return [_cudnn.CELL_MODES[spec.rnn_mode], spec.num_layers, spec.num_units, spec.input_size,
          int(spec.num_dirs == 2), int(spec.input_mode == "skip_input"), int(allow_tf32),
          _cudnn.CUDNN_DATA_TYPES[spec.dtype] if data_type is None else data_type, algo,
          spec.dtype.itemsize, spec.num_layers * spec.num_dirs * 2 * spec.num_gates * 5]


def _probe(queries):
  """The child process's answers, one per query."""
  done = subprocess.run([sys.executable, str(pathlib.Path(__file__).with_name("layout_probe.py")),
                         _library()], input=json.dumps(queries), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, (f"the layout probe exited with {done.returncode}:\n"
                                f"{done.stderr[-4000:]}")
  answers = json.loads(done.stdout)
  assert len(answers) == len(queries)
  return answers


def _cases(cls, dtype):
  """(spec, allow_tf32, algo) for every size, direction and input mode; float32 with and
  without TF32; the standard algorithm and, but for float64 (which cuDNN runs with the
  standard one only), the persistent small-h one, which `_cudnn` picks for float32 at small
  sizes (half precision is checked too, for when it does there)."""
  for (layers, units, inputs), direction, mode in itertools.product(
      SIZES, ("unidirectional", "bidirectional"), ("linear_input", "skip_input")):
    spec = cls(layers, units, units if mode == "skip_input" else inputs, input_mode=mode,
               direction=direction, dtype=dtype)
    for tf32 in ((False, True) if dtype == jnp.float32 else (False,)):
      for algo in ((STANDARD,) if dtype == jnp.float64 else (STANDARD, SMALL_H)):
        yield spec, tf32, algo


@pytest.fixture(scope="module")
def sweep():
  """`{(cls, dtype): [(spec, allow_tf32, algo, answer), ...]}`, from one child process."""
  cases = {(cls, dtype): list(_cases(cls, dtype)) for cls in SPEC_CLASSES for dtype in DTYPES}
  flat = [case for group in cases.values() for case in group]
  answers = iter(_probe([_query(spec, tf32, algo=algo) for spec, tf32, algo in flat]))
  return {key: [(*case, next(answers)) for case in group] for key, group in cases.items()}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cls", SPEC_CLASSES, ids=lambda c: c.__name__)
def test_cudnn_layout_is_the_analytic_one(sweep, cls, dtype):
  """For every size, direction and input mode (float32 with and without TF32,
  both algorithms `_cudnn` asks for): cuDNN accepts the descriptor the handlers
  set, its weight space is the opaque buffer's size, and it places every matrix
  and bias where `_layout` does, so `_cudnn` hands the buffer over without a
  gather, whichever algorithm runs."""
  for spec, tf32, algo, answer in sweep[cls, dtype]:
    assert "error" not in answer, (spec, tf32, algo, answer)
    assert answer["weight_space"] == spec.params_size() * spec.dtype.itemsize, (spec, answer)
    rows = np.array(answer["layout"], np.int64).reshape(spec.num_layers * spec.num_dirs,
                                                         2 * spec.num_gates, 5)
    assert_layout_is_analytic(spec, rows)
    assert _cudnn.order_from_layout(spec, rows) is None, spec


def test_persistent_algorithm_refused_for_float64():
  """Why the native library falls back to the standard algorithm, and
  `_cudnn.choose_algorithms` never asks for the persistent one in float64:
  cuDNN refuses that descriptor."""
  (answer,) = _probe([_query(jcr.CudnnLSTM(1, 8, 4, dtype=jnp.float64), algo=SMALL_H)])
  assert "cudnnSetRNNDescriptor_v8" in answer.get("error", ""), answer
  assert "CUDNN_STATUS_NOT_SUPPORTED" in answer["error"], answer


def test_skip_input_keeps_layer_zero_biases():
  """What DESIGN asked to find out: under skip_input cuDNN has no input
  matrices for layer 0 (both directions) but keeps all its biases, input side
  included, right after the matrices; layer 1 has both."""
  spec = jcr.CudnnLSTM(2, 6, 6, input_mode="skip_input", direction="bidirectional")
  (answer,) = _probe([_query(spec)])
  rows = np.array(answer["layout"], np.int64).reshape(4, 8, 5)
  # Per direction, layer 0: 4 R of [6, 6]; layer 1: 4 W of [6, 12] and 4 R.
  matrices = 2 * 4 * 36 + 2 * 4 * (72 + 36)
  assert answer["weight_space"] == 4 * (matrices + 4 * 8 * 6)
  for p in (0, 1):
    assert rows[p, :4, :3].tolist() == [[-1, 0, 0]] * 4  # no W for layer 0
    assert rows[p, 4:, 1:3].tolist() == [[6, 6]] * 4  # R is there
    assert rows[p, :, 3].tolist() == [matrices + 6 * (8 * p + k) for k in range(8)]
    assert rows[p, :, 4].tolist() == [6] * 8
  assert rows[2:, :4, 1:3].tolist() == [[[6, 12]] * 4] * 2


def test_probe_reports_a_refused_descriptor():
  """The probe is not vacuous: cuDNN refuses an int8 RNN, and the refusal comes
  back as an error naming the call."""
  (answer,) = _probe([_query(jcr.CudnnGRU(1, 4, 3), data_type=CUDNN_DATA_INT8)])
  assert "cudnnSetRNNDescriptor_v8" in answer.get("error", ""), answer
