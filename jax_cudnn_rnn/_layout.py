"""Canonical shapes and the opaque layout (pure Python ints).

Canonical order (the seeds' `tf.contrib.cudnn_rnn` order): layer by layer,
forward direction then backward; inside each (layer, direction), the weights
`W_0 .. W_{g-1}` (applied to the layer's input, shape `[num_units, in]`) then
`R_0 .. R_{g-1}` (applied to the recurrent state, `[num_units, num_units]`),
and the biases `bW_0 .. bW_{g-1}, bR_0 .. bR_{g-1}` (each `[num_units]`) in the
same order. `g` is 4 for LSTM (gates i, f, g, o), 3 for GRU (r, z, n), 1 for
the Elman RNNs. `weights` and `biases` are two flat lists in that order.

Under `skip_input`, layer 0 has no input matrices: its `W_k` are absent from
`weights` (both directions), while all its biases stay: so cuDNN's layout has
it (`cudnnGetRNNWeightParams` reports those matrices absent and the biases in
place; `tests/test_layout_probe.py`).

The opaque buffer is cuDNN's weight space for `CUDNN_RNN_DOUBLE_BIAS`: a
*pseudo-layer* is one (layer, direction) pair, numbered `layer * num_dirs +
direction`. All matrices come first, pseudo-layer by pseudo-layer, each
pseudo-layer's matrices in linear-layer-ID order (`W_0..W_{g-1},
R_0..R_{g-1}`, each row-major `[num_units, in]`); then all biases, in the same
order. That is exactly the canonical order, so the opaque buffer is the
concatenation of the flattened weights followed by the biases: packing and
unpacking are a concatenation and static slices. The GPU test
`test_analytic_layout_equals_cudnn` (tests/test_cudnn.py) checks these offsets
against `cudnnGetRNNWeightParams` for every mode, direction and input mode, and
`tests/test_layout_probe.py` checks them without a GPU, over every dtype and a
sweep of sizes, against cuDNN's host-side layout arithmetic;
should a cuDNN version lay the buffer out otherwise, `_cudnn.cudnn_order`
gathers it into cuDNN's layout before each call, so results stay right.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Iterator

GATE_NAMES = {
    "lstm": ("i", "f", "g", "o"),
    "gru": ("r", "z", "n"),
    "rnn_tanh": ("h",),
    "rnn_relu": ("h",),
}


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One canonical tensor and where it sits in the opaque buffer.

  Attributes:
    layer: 0-based layer.
    direction: 0 forward, 1 backward.
    kind: "weight" or "bias".
    index: linear-layer ID in `0 .. 2g-1`: `< g` applies to the layer input
      (`W_k`/`bW_k`), `>= g` to the recurrent state (`R_k`/`bR_k`).
    shape: `(num_units, in)` for a weight, `(num_units,)` for a bias.
    offset: first element in the opaque buffer.
  """

  layer: int
  direction: int
  kind: str
  index: int
  shape: tuple[int, ...]
  offset: int

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def _canonical_entries(spec) -> Iterator[tuple[int, int, str, int, tuple[int, ...]]]:
  g, h = spec.num_gates, spec.num_units
  for kind in ("weight", "bias"):
    for layer in range(spec.num_layers):
      for direction in range(spec.num_dirs):
        for index in range(2 * g):
          is_input = index < g
          if kind == "weight":
            if is_input and not spec.layer_has_input_weights(layer):
              continue
            fan_in = spec.layer_input_size(layer) if is_input else h
            yield layer, direction, kind, index, (h, fan_in)
          else:
            yield layer, direction, kind, index, (h,)


@functools.lru_cache(maxsize=256)
def tensors(spec) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
  """The canonical `(weights, biases)` entries of `spec`, with their offsets."""
  weights, biases, offset = [], [], 0
  for layer, direction, kind, index, shape in _canonical_entries(spec):
    entry = Tensor(layer, direction, kind, index, shape, offset)
    offset += entry.size
    (weights if kind == "weight" else biases).append(entry)
  return tuple(weights), tuple(biases)


@functools.lru_cache(maxsize=256)
def params_size(spec) -> int:
  """Number of elements of the opaque buffer of `spec` (cached: every call
  checks its buffer against it, which took 9.8 us of an eager call uncached,
  3.2 cached; session 75)."""
  weights, biases = tensors(spec)
  return sum(t.size for t in weights) + sum(t.size for t in biases)


def tensor_name(spec, t: Tensor) -> str:
  """A readable name such as `layer1/bw/R_f` or `layer0/fw/bW_r`."""
  g = spec.num_gates
  gate = GATE_NAMES[spec.rnn_mode][t.index % g]
  side = "W" if t.index < g else "R"
  prefix = "" if t.kind == "weight" else "b"
  return f"layer{t.layer}/{('fw', 'bw')[t.direction]}/{prefix}{side}_{gate}"
