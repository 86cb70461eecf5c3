// The operand lists of the FFI handlers, written once.
//
// The forward handlers and the CPU input check (`rnn_input_check.cc`) take
// their operands from `WithForwardOperands`, so the check binds exactly what
// the forward handlers bind; the result lists follow each handler's comment
// in rnn_handlers.cc.
#ifndef JAX_CUDNN_RNN_RNN_BINDINGS_H_
#define JAX_CUDNN_RNN_RNN_BINDINGS_H_

#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jcr {

// Appends x, hx, cx, weights, seq_lengths to `binding`.
template <typename Binding>
auto WithForwardOperands(Binding binding) {
  namespace ffi = ::xla::ffi;
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // x
      .template Arg<ffi::AnyBuffer>()           // hx
      .template Arg<ffi::AnyBuffer>()           // cx
      .template Arg<ffi::AnyBuffer>()           // weights
      .template Arg<ffi::Buffer<ffi::S32>>();   // seq_lengths
}

}  // namespace jcr

#endif  // JAX_CUDNN_RNN_RNN_BINDINGS_H_
