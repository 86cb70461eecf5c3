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
#include "xla/ffi/api/ffi.h"

namespace jcr {

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
