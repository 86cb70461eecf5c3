// A CPU handler that runs the cuDNN handlers' attribute decoding and input
// checks, without cuDNN, so that a machine with no GPU (CI) can prove that
// what Python sends is what the handlers read, and that bad input comes back
// as an error, not a crash.
//
//   JcrRnnCheckInputs  x, hx, cx, weights, seq_lengths -> int64 [13]:
//     cell_mode, num_layers, hidden_size, input_size, bidirectional,
//     skip_input, batch_major, allow_tf32, has_seq_lengths, algo (as decoded),
//     then steps and batch (as derived from x) and the cudnnDataType_t of x's type.
//
// It takes the forward handlers' operands and attributes and runs the same
// `CheckInputs`, `CheckCellState` and, when `has_seq_lengths`, `CheckLengths`
// (on the CPU the lengths are host memory). Only the weight-space size is left
// out: that needs cuDNN. Registered by tests on the "cpu" platform.
#include <cstdint>

#include "rnn_attrs.h"
#include "rnn_bindings.h"
#include "rnn_input_checks.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {
namespace {

namespace ffi = ::xla::ffi;

constexpr int64_t kReportSize = 13;

ffi::Error CheckInputsOnHost(ffi::AnyBuffer x, ffi::AnyBuffer hx, ffi::AnyBuffer cx,
                             ffi::AnyBuffer weights, ffi::Buffer<ffi::S32> seq_lengths,
                             ffi::Result<ffi::Buffer<ffi::S64>> report, RnnAttrs attrs) {
  if (report->element_count() != kReportSize) {
    return ffi::Error::InvalidArgument("the report must have " + std::to_string(kReportSize) +
                                       " elements, got " +
                                       std::to_string(report->element_count()));
  }
  InputShapes shapes;
  JCR_RETURN_IF_ERROR(CheckInputs(attrs, x, hx, weights, seq_lengths, &shapes));
  JCR_RETURN_IF_ERROR(CheckCellState("cx", cx, shapes));
  if (attrs.has_seq_lengths) {
    JCR_RETURN_IF_ERROR(CheckLengths(seq_lengths.typed_data(), shapes.batch, shapes.steps));
  }
  int64_t* out = report->typed_data();
  const int64_t values[kReportSize] = {
      attrs.cell_mode,  attrs.num_layers,  attrs.hidden_size,     attrs.input_size,
      attrs.bidirectional, attrs.skip_input, attrs.batch_major,   attrs.allow_tf32,
      attrs.has_seq_lengths, attrs.algo,  shapes.steps,          shapes.batch,
      shapes.cudnn_type};
  for (int64_t i = 0; i < kReportSize; ++i) out[i] = values[i];
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jcr

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnCheckInputs, jcr::CheckInputsOnHost,
                              jcr::WithForwardOperands(::xla::ffi::Ffi::Bind())
                                  .Ret<::xla::ffi::Buffer<::xla::ffi::S64>>()   // report
                                  .Attrs<jcr::RnnAttrs>());
