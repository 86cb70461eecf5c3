#include "rnn_input_checks.h"

#include <string>

#include "status.h"

namespace jcr {
namespace {

namespace ffi = ::xla::ffi;
using ffi::Error;

std::string DimsString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

std::string TypeName(ffi::DataType type) {
  switch (type) {
    case ffi::DataType::F16:
      return "float16";
    case ffi::DataType::BF16:
      return "bfloat16";
    case ffi::DataType::F32:
      return "float32";
    case ffi::DataType::F64:
      return "float64";
    default:
      return "XLA element type " + std::to_string(static_cast<int>(type));
  }
}

Error ToCudnnType(ffi::DataType type, cudnnDataType_t* out) {
  switch (type) {
    case ffi::DataType::F16:
      *out = CUDNN_DATA_HALF;
      return Error::Success();
    case ffi::DataType::BF16:
      *out = CUDNN_DATA_BFLOAT16;
      return Error::Success();
    case ffi::DataType::F32:
      *out = CUDNN_DATA_FLOAT;
      return Error::Success();
    case ffi::DataType::F64:
      *out = CUDNN_DATA_DOUBLE;
      return Error::Success();
    default:
      return Error::InvalidArgument("x must be float16, bfloat16, float32 or float64, got " +
                                    TypeName(type));
  }
}

Error CheckAttrs(const RnnAttrs& a) {
  if (a.num_layers < 1 || a.hidden_size < 1 || a.input_size < 1 || a.cell_mode < CUDNN_RNN_RELU ||
      a.cell_mode > CUDNN_GRU) {
    return Error::InvalidArgument(
        "invalid RNN attributes: cell_mode=" + std::to_string(a.cell_mode) +
        " (expected 0..3), num_layers=" + std::to_string(a.num_layers) +
        ", hidden_size=" + std::to_string(a.hidden_size) + ", input_size=" +
        std::to_string(a.input_size) + " (expected >= 1)");
  }
  if (a.skip_input && a.input_size != a.hidden_size) {
    return Error::InvalidArgument("skip_input needs input_size == hidden_size, got input_size=" +
                                  std::to_string(a.input_size) + ", hidden_size=" +
                                  std::to_string(a.hidden_size));
  }
  if (a.algo != CUDNN_RNN_ALGO_STANDARD && a.algo != CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H) {
    return Error::InvalidArgument("algo must be " + std::to_string(CUDNN_RNN_ALGO_STANDARD) +
                                  " (standard) or " +
                                  std::to_string(CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H) +
                                  " (persist_static_small_h), got " + std::to_string(a.algo));
  }
  return Error::Success();
}

}  // namespace

Error CheckBuffer(const char* name, const ffi::AnyBuffer& buffer, const std::vector<int64_t>& dims,
                  const InputShapes& shapes) {
  auto actual = buffer.dimensions();
  bool same = actual.size() == dims.size();
  for (size_t i = 0; same && i < dims.size(); ++i) same = actual[i] == dims[i];
  if (!same) {
    return Error::InvalidArgument(std::string(name) + " must have shape " +
                                  DimsString(ffi::Span<const int64_t>(dims.data(), dims.size())) +
                                  ", got " + DimsString(actual));
  }
  if (buffer.element_type() != shapes.type) {
    return Error::InvalidArgument(std::string(name) + " must have x's element type " +
                                  TypeName(shapes.type) + ", got " +
                                  TypeName(buffer.element_type()));
  }
  return Error::Success();
}

Error CheckCellState(const char* name, const ffi::AnyBuffer& buffer, const InputShapes& shapes) {
  if (shapes.lstm) return CheckBuffer(name, buffer, shapes.state_dims, shapes);
  if (buffer.element_count() != 0) {
    return Error::InvalidArgument(std::string(name) + " must be empty for a model without a "
                                  "cell state, got shape " + DimsString(buffer.dimensions()));
  }
  return Error::Success();
}

Error CheckLengths(const int32_t* lengths, int64_t batch, int64_t steps) {
  for (int64_t b = 0; b < batch; ++b) {
    if (lengths[b] < 1 || lengths[b] > steps) {
      return Error::InvalidArgument("seq_lengths[" + std::to_string(b) + "] = " +
                                    std::to_string(lengths[b]) + " is outside [1, " +
                                    std::to_string(steps) + "]");
    }
  }
  return Error::Success();
}

Error CheckInputs(const RnnAttrs& attrs, const ffi::AnyBuffer& x_like, const ffi::AnyBuffer& hx,
                  const ffi::AnyBuffer& weights, const ffi::Buffer<ffi::S32>& seq_lengths,
                  InputShapes* out) {
  JCR_RETURN_IF_ERROR(CheckAttrs(attrs));
  out->type = x_like.element_type();
  JCR_RETURN_IF_ERROR(ToCudnnType(out->type, &out->cudnn_type));
  auto x_dims = x_like.dimensions();
  if (x_dims.size() != 3) {
    return Error::InvalidArgument("x must have rank 3, got shape " + DimsString(x_dims));
  }
  out->steps = attrs.batch_major ? x_dims[1] : x_dims[0];
  out->batch = attrs.batch_major ? x_dims[0] : x_dims[1];
  if (out->steps < 1 || out->batch < 1) {
    return Error::InvalidArgument("x must have at least one step and one sequence, got shape " +
                                  DimsString(x_dims));
  }
  out->lstm = attrs.cell_mode == CUDNN_LSTM;
  const int64_t T = out->steps, B = out->batch;
  out->x_dims = attrs.batch_major ? std::vector<int64_t>{B, T, attrs.input_size}
                                  : std::vector<int64_t>{T, B, attrs.input_size};
  out->y_dims = attrs.batch_major ? std::vector<int64_t>{B, T, OutputSize(attrs)}
                                  : std::vector<int64_t>{T, B, OutputSize(attrs)};
  out->state_dims = {NumStates(attrs), B, attrs.hidden_size};
  JCR_RETURN_IF_ERROR(CheckBuffer("x", x_like, out->x_dims, *out));
  JCR_RETURN_IF_ERROR(CheckBuffer("hx", hx, out->state_dims, *out));
  if (weights.element_type() != out->type) {
    return Error::InvalidArgument("weights must have x's element type " + TypeName(out->type) +
                                  ", got " + TypeName(weights.element_type()));
  }
  auto seq_dims = seq_lengths.dimensions();
  if (seq_dims.size() != 1 || seq_dims[0] != B) {
    return Error::InvalidArgument("seq_lengths must have shape [" + std::to_string(B) +
                                  "], got " + DimsString(seq_dims));
  }
  return Error::Success();
}

}  // namespace jcr
