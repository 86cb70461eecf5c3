// Where cuDNN puts every matrix and bias of an RNN in its weight space.
//
// Shared by the GPU query (`JcrRnnWeightLayout`, rnn_queries.cc) and the
// device-free test probe (layout_probe.cc), so both report the same rows.
#ifndef JAX_CUDNN_RNN_WEIGHT_LAYOUT_H_
#define JAX_CUDNN_RNN_WEIGHT_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include <cudnn.h>

#include "rnn_attrs.h"
#include "rnn_descriptors.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {

// The descriptor key to read a weight layout with: the layout does not depend
// on the data layout, the steps or the batch, so those are fixed (time-major,
// one step, one sequence). `algo` is there so tests can show that it does not
// depend on the algorithm either.
RnnKey WeightLayoutKey(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                       int64_t input_size, int32_t bidirectional, int32_t skip_input,
                       int32_t allow_tf32, int32_t data_type, int64_t algo);

// Number of int64 that `ReadWeightLayout` writes for `attrs`.
int64_t WeightLayoutSize(const RnnAttrs& attrs);

// Asks `cudnnGetRNNWeightParams` about every (pseudo-layer, linear-layer ID)
// of `rnn`, whose weight space of `space` bytes starts at `base`, and writes
// one row of 5 int64 each, in that order: [matrix offset, matrix rows, matrix
// columns, bias offset, bias length], offsets in elements of `element_size`
// bytes from `base`, -1 (and zero sizes) for what cuDNN reports absent.
// `capacity` is the length of `out`.
::xla::ffi::Error ReadWeightLayout(cudnnHandle_t handle, cudnnRNNDescriptor_t rnn,
                                   const RnnAttrs& attrs, size_t space, void* base,
                                   int64_t element_size, int64_t* out, int64_t capacity);

}  // namespace jcr

#endif  // JAX_CUDNN_RNN_WEIGHT_LAYOUT_H_
