"""Runs the test-only layout probe (`JcrProbeWeightLayout`, xla_ffi/layout_probe.cc)
in this child process, so that a cuDNN which reads the placeholder handle it is
given crashes this process, never the test run.

    python tests/layout_probe.py LIBRARY < queries.json > answers.json

Each query is the probe's integer arguments, `[cell_mode, num_layers,
hidden_size, input_size, bidirectional, skip_input, allow_tf32, data_type, algo,
element_size, layout_length]`; each answer is `{"weight_space": bytes,
"layout": [layout_length ints]}` or `{"error": message}`.
"""

import ctypes
import json
import sys

from jax_cudnn_rnn import _cudnn


def _answer(lib, query):
  *args, layout_length = query
  types = [ctypes.c_int64] * 4 + [ctypes.c_int32] * 4 + [ctypes.c_int64] * 2
  layout = (ctypes.c_int64 * layout_length)()
  weight_space = ctypes.c_uint64()
  error = ctypes.create_string_buffer(1024)
  status = lib.JcrProbeWeightLayout(*(t(a) for t, a in zip(types, args)),
                                    ctypes.byref(weight_space), layout,
                                    ctypes.c_int64(layout_length), error,
                                    ctypes.c_size_t(len(error)))
  if status != 0:
    return {"error": error.value.decode(errors="replace")}
  return {"weight_space": weight_space.value, "layout": list(layout)}


def main(library):
  _cudnn._preload_cudnn_wheel()  # the probe links the wheel's libcudnn
  lib = ctypes.CDLL(library)
  json.dump([_answer(lib, q) for q in json.load(sys.stdin)], sys.stdout)


if __name__ == "__main__":
  main(sys.argv[1])
