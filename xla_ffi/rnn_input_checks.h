// What every RNN handler checks about its buffers before touching cuDNN.
//
// Pure functions of the attributes and the buffers' shapes and element types:
// no CUDA or cuDNN call, so the CPU input check (`rnn_input_check.cc`) runs
// exactly this code where CI has no GPU. Each failure is an InvalidArgument
// error naming the buffer, the expected and the actual value.
#ifndef JAX_CUDNN_RNN_RNN_INPUT_CHECKS_H_
#define JAX_CUDNN_RNN_RNN_INPUT_CHECKS_H_

#include <cstdint>
#include <vector>

#include <cudnn.h>

#include "rnn_attrs.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {

// Shapes and types of one call, derived from the attributes and `x`.
struct InputShapes {
  ::xla::ffi::DataType type;  // x's element type, which every float buffer shares
  cudnnDataType_t cudnn_type;
  int64_t steps = 0;
  int64_t batch = 0;
  std::vector<int64_t> x_dims, y_dims, state_dims;
  bool lstm = false;
};

// Checks the attributes, `x_like` (x, or dx: the [T, B, input] side), `hx`,
// the weights' element type and `seq_lengths`, and fills `*out`.
::xla::ffi::Error CheckInputs(const RnnAttrs& attrs, const ::xla::ffi::AnyBuffer& x_like,
                              const ::xla::ffi::AnyBuffer& hx,
                              const ::xla::ffi::AnyBuffer& weights,
                              const ::xla::ffi::Buffer<::xla::ffi::S32>& seq_lengths,
                              InputShapes* out);

// Every length is in [1, steps] (cuDNN's rule; Python runs length 0 as 1).
::xla::ffi::Error CheckLengths(const int32_t* lengths, int64_t batch, int64_t steps);

// `buffer` has shape `dims` and x's element type.
::xla::ffi::Error CheckBuffer(const char* name, const ::xla::ffi::AnyBuffer& buffer,
                              const std::vector<int64_t>& dims, const InputShapes& shapes);

// A cell-state buffer: state-shaped for an LSTM, zero elements otherwise.
::xla::ffi::Error CheckCellState(const char* name, const ::xla::ffi::AnyBuffer& buffer,
                                 const InputShapes& shapes);

}  // namespace jcr

#endif  // JAX_CUDNN_RNN_RNN_INPUT_CHECKS_H_
