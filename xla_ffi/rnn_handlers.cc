// XLA FFI handlers running cuDNN's fused RNN (v8 API, current in cuDNN 9).
//
//   JcrRnnForwardInference  x, hx, cx, weights, seq_lengths -> y, hy, cy
//   JcrRnnForwardTraining   same inputs -> y, hy, cy, reserve_space
//   JcrRnnBackwardData      y, dy, hx, dhy, cx, dcy, weights, seq_lengths, reserve_space
//                             -> dx, dhx, dcx, reserve_space (aliased to the input)
//   JcrRnnBackwardWeights   x, hx, y, seq_lengths, reserve_space -> dweights
//
// All share one attribute dictionary (`RnnAttrs`). For models without a cell
// state, cx/cy/dcy/dcx are zero-element buffers and are never touched.
// `seq_lengths` is always an int32 [B] device buffer; only when the
// `has_seq_lengths` attribute is set is it copied to the host (cuDNN's data
// descriptors need the lengths there), which is the one host synchronisation,
// and it happens on that path only.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "handle_pool.h"
#include "rnn_descriptors.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(
    jcr::RnnAttrs, ::xla::ffi::StructMember<int64_t>("cell_mode"),
    ::xla::ffi::StructMember<int64_t>("num_layers"),
    ::xla::ffi::StructMember<int64_t>("hidden_size"),
    ::xla::ffi::StructMember<int64_t>("input_size"),
    ::xla::ffi::StructMember<bool>("bidirectional"),
    ::xla::ffi::StructMember<bool>("skip_input"),
    ::xla::ffi::StructMember<bool>("batch_major"),
    ::xla::ffi::StructMember<bool>("allow_tf32"),
    ::xla::ffi::StructMember<bool>("has_seq_lengths"));

namespace jcr {
namespace {

namespace ffi = ::xla::ffi;
using ffi::AnyBuffer;
using ffi::Error;

std::string DimsString(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

Error CheckDims(const char* name, const AnyBuffer& buffer, std::vector<int64_t> expected) {
  auto dims = buffer.dimensions();
  bool same = dims.size() == expected.size();
  for (size_t i = 0; same && i < expected.size(); ++i) same = dims[i] == expected[i];
  if (!same) {
    return Error::InvalidArgument(std::string(name) + " must have shape " +
                                  DimsString(ffi::Span<const int64_t>(expected.data(), expected.size())) +
                                  ", got " + DimsString(dims));
  }
  return Error::Success();
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
      return Error::InvalidArgument("RNN data must be float16, bfloat16, float32 or float64, got "
                                    "XLA element type " + std::to_string(static_cast<int>(type)));
  }
}

Error CheckSameType(const char* name, const AnyBuffer& buffer, ffi::DataType type) {
  if (buffer.element_type() != type) {
    return Error::InvalidArgument(std::string(name) + " must have the element type of x (" +
                                  std::to_string(static_cast<int>(type)) + "), got " +
                                  std::to_string(static_cast<int>(buffer.element_type())));
  }
  return Error::Success();
}

// What every handler needs before calling cuDNN: a handle on the stream, the
// cached descriptors, and the data descriptors for these sequence lengths.
struct Call {
  BorrowedHandle handle;
  RnnKey key{};
  std::shared_ptr<const RnnDescriptors> desc;
  RnnDataDescriptor x_with_lengths;
  RnnDataDescriptor y_with_lengths;
  cudnnRNNDataDescriptor_t x_desc = nullptr;
  cudnnRNNDataDescriptor_t y_desc = nullptr;
  std::vector<int64_t> x_dims, y_dims, state_dims;
  bool lstm = false;
};

// Validates `x`-like data, the initial state and the weights against `attrs`,
// and fills `call`. `x_dims_source` is x or dx (the [T, B, in] side) and
// `y_dims_source` y or dy; only their shapes are read.
Error Prepare(cudaStream_t stream, const RnnAttrs& attrs, const AnyBuffer& x_like,
              const AnyBuffer& hx, const AnyBuffer& weights,
              const ffi::Buffer<ffi::S32>& seq_lengths, Call* call) {
  const ffi::DataType type = x_like.element_type();
  cudnnDataType_t cudnn_type;
  JCR_RETURN_IF_ERROR(ToCudnnType(type, &cudnn_type));
  auto x_dims = x_like.dimensions();
  if (x_dims.size() != 3) {
    return Error::InvalidArgument("x must have rank 3, got " + DimsString(x_dims));
  }
  const int64_t steps = attrs.batch_major ? x_dims[1] : x_dims[0];
  const int64_t batch = attrs.batch_major ? x_dims[0] : x_dims[1];
  if (steps < 1 || batch < 1) {
    return Error::InvalidArgument("x must have at least one step and one sequence, got " +
                                  DimsString(x_dims));
  }
  if (attrs.num_layers < 1 || attrs.hidden_size < 1 || attrs.input_size < 1 ||
      attrs.cell_mode < CUDNN_RNN_RELU || attrs.cell_mode > CUDNN_GRU) {
    return Error::InvalidArgument("invalid RNN attributes: cell_mode=" +
                                  std::to_string(attrs.cell_mode) + " num_layers=" +
                                  std::to_string(attrs.num_layers) + " hidden_size=" +
                                  std::to_string(attrs.hidden_size) + " input_size=" +
                                  std::to_string(attrs.input_size));
  }
  auto seq_dims = seq_lengths.dimensions();
  if (seq_dims.size() != 1 || seq_dims[0] != batch) {
    return Error::InvalidArgument("seq_lengths must have shape [" + std::to_string(batch) +
                                  "], got " + DimsString(seq_dims));
  }
  call->lstm = attrs.cell_mode == CUDNN_LSTM;
  call->x_dims = attrs.batch_major ? std::vector<int64_t>{batch, steps, attrs.input_size}
                                   : std::vector<int64_t>{steps, batch, attrs.input_size};
  call->y_dims = attrs.batch_major ? std::vector<int64_t>{batch, steps, OutputSize(attrs)}
                                   : std::vector<int64_t>{steps, batch, OutputSize(attrs)};
  call->state_dims = {NumStates(attrs), batch, attrs.hidden_size};
  JCR_RETURN_IF_ERROR(CheckDims("x", x_like, call->x_dims));
  JCR_RETURN_IF_ERROR(CheckDims("hx", hx, call->state_dims));
  JCR_RETURN_IF_ERROR(CheckSameType("hx", hx, type));
  JCR_RETURN_IF_ERROR(CheckSameType("weights", weights, type));

  call->key = RnnKey{attrs, cudnn_type, steps, batch};
  JCR_RETURN_IF_ERROR(BorrowedHandle::Borrow(stream, &call->handle));
  JCR_RETURN_IF_ERROR(GetRnnDescriptors(call->handle.get(), call->key, &call->desc));
  if (weights.size_bytes() != call->desc->sizes().weight_space) {
    return Error::InvalidArgument(
        "weights has " + std::to_string(weights.size_bytes()) +
        " bytes but cuDNN's weight space for this configuration has " +
        std::to_string(call->desc->sizes().weight_space) +
        " bytes: the analytic opaque layout disagrees with cuDNN");
  }

  if (!attrs.has_seq_lengths) {
    call->x_desc = call->desc->x_full().get();
    call->y_desc = call->desc->y_full().get();
    return Error::Success();
  }
  std::vector<int32_t> lengths(static_cast<size_t>(batch));
  JCR_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(lengths.data(), seq_lengths.typed_data(),
                                           lengths.size() * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, stream));
  JCR_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  for (size_t b = 0; b < lengths.size(); ++b) {
    if (lengths[b] < 1 || lengths[b] > steps) {
      return Error::InvalidArgument("seq_lengths[" + std::to_string(b) + "] = " +
                                    std::to_string(lengths[b]) + " is outside [1, " +
                                    std::to_string(steps) + "]");
    }
  }
  JCR_RETURN_IF_ERROR(call->x_with_lengths.Set(call->key, attrs.input_size, lengths));
  JCR_RETURN_IF_ERROR(call->y_with_lengths.Set(call->key, OutputSize(attrs), lengths));
  call->x_desc = call->x_with_lengths.get();
  call->y_desc = call->y_with_lengths.get();
  return Error::Success();
}

// Cell-state buffers: state-shaped for an LSTM, zero elements otherwise.
Error CheckCellState(const Call& call, const char* name, const AnyBuffer& buffer) {
  if (call.lstm) return CheckDims(name, buffer, call.state_dims);
  if (buffer.element_count() != 0) {
    return Error::InvalidArgument(std::string(name) + " must be empty for a model without a "
                                  "cell state, got " + DimsString(buffer.dimensions()));
  }
  return Error::Success();
}

Error Allocate(ffi::ScratchAllocator& scratch, size_t size, void** out) {
  *out = nullptr;
  if (size == 0) return Error::Success();
  std::optional<void*> memory = scratch.Allocate(size, /*alignment=*/256);
  if (!memory.has_value()) {
    return Error(ffi::ErrorCode::kResourceExhausted,
                 "could not allocate " + std::to_string(size) + " bytes of cuDNN RNN workspace");
  }
  *out = *memory;
  return Error::Success();
}

template <bool kTraining>
Error ForwardImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, AnyBuffer x, AnyBuffer hx,
                  AnyBuffer cx, AnyBuffer weights, ffi::Buffer<ffi::S32> seq_lengths,
                  ffi::Result<AnyBuffer> y, ffi::Result<AnyBuffer> hy,
                  ffi::Result<AnyBuffer> cy, void* reserve, size_t reserve_bytes,
                  const RnnAttrs& attrs) {
  Call call;
  JCR_RETURN_IF_ERROR(Prepare(stream, attrs, x, hx, weights, seq_lengths, &call));
  JCR_RETURN_IF_ERROR(CheckDims("y", *y, call.y_dims));
  JCR_RETURN_IF_ERROR(CheckDims("hy", *hy, call.state_dims));
  JCR_RETURN_IF_ERROR(CheckCellState(call, "cx", cx));
  JCR_RETURN_IF_ERROR(CheckCellState(call, "cy", *cy));
  const RnnSizes& sizes = call.desc->sizes();
  if (kTraining && reserve_bytes < sizes.reserve_space) {
    return Error::InvalidArgument("reserve_space has " + std::to_string(reserve_bytes) +
                                  " bytes, cuDNN needs " + std::to_string(sizes.reserve_space));
  }
  void* workspace;
  JCR_RETURN_IF_ERROR(Allocate(
      scratch, kTraining ? sizes.workspace_training : sizes.workspace_inference, &workspace));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnRNNForward(
      call.handle.get(), call.desc->rnn(),
      kTraining ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE, seq_lengths.typed_data(),
      call.x_desc, x.untyped_data(), call.y_desc, y->untyped_data(), call.desc->state(),
      hx.untyped_data(), hy->untyped_data(), call.desc->state(),
      call.lstm ? cx.untyped_data() : nullptr, call.lstm ? cy->untyped_data() : nullptr,
      weights.size_bytes(), weights.untyped_data(),
      kTraining ? sizes.workspace_training : sizes.workspace_inference, workspace,
      kTraining ? sizes.reserve_space : 0, kTraining ? reserve : nullptr));
  return Error::Success();
}

Error ForwardInference(cudaStream_t stream, ffi::ScratchAllocator scratch, AnyBuffer x,
                       AnyBuffer hx, AnyBuffer cx, AnyBuffer weights,
                       ffi::Buffer<ffi::S32> seq_lengths, ffi::Result<AnyBuffer> y,
                       ffi::Result<AnyBuffer> hy, ffi::Result<AnyBuffer> cy, RnnAttrs attrs) {
  return ForwardImpl<false>(stream, std::move(scratch), x, hx, cx, weights, seq_lengths, y, hy,
                            cy, nullptr, 0, attrs);
}

Error ForwardTraining(cudaStream_t stream, ffi::ScratchAllocator scratch, AnyBuffer x,
                      AnyBuffer hx, AnyBuffer cx, AnyBuffer weights,
                      ffi::Buffer<ffi::S32> seq_lengths, ffi::Result<AnyBuffer> y,
                      ffi::Result<AnyBuffer> hy, ffi::Result<AnyBuffer> cy,
                      ffi::Result<ffi::Buffer<ffi::U8>> reserve_space, RnnAttrs attrs) {
  return ForwardImpl<true>(stream, std::move(scratch), x, hx, cx, weights, seq_lengths, y, hy,
                           cy, reserve_space->untyped_data(), reserve_space->size_bytes(), attrs);
}

Error BackwardData(cudaStream_t stream, ffi::ScratchAllocator scratch, AnyBuffer y, AnyBuffer dy,
                   AnyBuffer hx, AnyBuffer dhy, AnyBuffer cx, AnyBuffer dcy, AnyBuffer weights,
                   ffi::Buffer<ffi::S32> seq_lengths, ffi::Buffer<ffi::U8> reserve_in,
                   ffi::Result<AnyBuffer> dx, ffi::Result<AnyBuffer> dhx,
                   ffi::Result<AnyBuffer> dcx, ffi::Result<ffi::Buffer<ffi::U8>> reserve_out,
                   RnnAttrs attrs) {
  Call call;
  JCR_RETURN_IF_ERROR(Prepare(stream, attrs, *dx, hx, weights, seq_lengths, &call));
  JCR_RETURN_IF_ERROR(CheckDims("y", y, call.y_dims));
  JCR_RETURN_IF_ERROR(CheckDims("dy", dy, call.y_dims));
  JCR_RETURN_IF_ERROR(CheckDims("dhy", dhy, call.state_dims));
  JCR_RETURN_IF_ERROR(CheckDims("dhx", *dhx, call.state_dims));
  JCR_RETURN_IF_ERROR(CheckCellState(call, "cx", cx));
  JCR_RETURN_IF_ERROR(CheckCellState(call, "dcy", dcy));
  JCR_RETURN_IF_ERROR(CheckCellState(call, "dcx", *dcx));
  const RnnSizes& sizes = call.desc->sizes();
  if (reserve_in.size_bytes() < sizes.reserve_space ||
      reserve_out->size_bytes() != reserve_in.size_bytes()) {
    return Error::InvalidArgument("reserve_space has " + std::to_string(reserve_in.size_bytes()) +
                                  " bytes, cuDNN needs " + std::to_string(sizes.reserve_space));
  }
  // cuDNN updates the reserve space in place for the weights pass. The output
  // is aliased to the input, so this copy only runs if XLA did not alias them.
  if (reserve_out->untyped_data() != reserve_in.untyped_data()) {
    JCR_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(reserve_out->untyped_data(), reserve_in.untyped_data(),
                                             reserve_in.size_bytes(), cudaMemcpyDeviceToDevice,
                                             stream));
  }
  void* workspace;
  JCR_RETURN_IF_ERROR(Allocate(scratch, sizes.workspace_training, &workspace));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnRNNBackwardData_v8(
      call.handle.get(), call.desc->rnn(), seq_lengths.typed_data(), call.y_desc, y.untyped_data(),
      dy.untyped_data(), call.x_desc, dx->untyped_data(), call.desc->state(), hx.untyped_data(),
      dhy.untyped_data(), dhx->untyped_data(), call.desc->state(),
      call.lstm ? cx.untyped_data() : nullptr, call.lstm ? dcy.untyped_data() : nullptr,
      call.lstm ? dcx->untyped_data() : nullptr, weights.size_bytes(), weights.untyped_data(),
      sizes.workspace_training, workspace, sizes.reserve_space, reserve_out->untyped_data()));
  return Error::Success();
}

Error BackwardWeights(cudaStream_t stream, ffi::ScratchAllocator scratch, AnyBuffer x,
                      AnyBuffer hx, AnyBuffer y, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Buffer<ffi::U8> reserve_space, ffi::Result<AnyBuffer> dweights,
                      RnnAttrs attrs) {
  Call call;
  JCR_RETURN_IF_ERROR(Prepare(stream, attrs, x, hx, *dweights, seq_lengths, &call));
  JCR_RETURN_IF_ERROR(CheckDims("y", y, call.y_dims));
  const RnnSizes& sizes = call.desc->sizes();
  if (reserve_space.size_bytes() < sizes.reserve_space) {
    return Error::InvalidArgument("reserve_space has " +
                                  std::to_string(reserve_space.size_bytes()) +
                                  " bytes, cuDNN needs " + std::to_string(sizes.reserve_space));
  }
  void* workspace;
  JCR_RETURN_IF_ERROR(Allocate(scratch, sizes.workspace_training, &workspace));
  // cuDNN only accumulates weight gradients (CUDNN_WGRAD_MODE_ADD): start from zero.
  JCR_RETURN_IF_CUDA_ERROR(
      cudaMemsetAsync(dweights->untyped_data(), 0, dweights->size_bytes(), stream));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnRNNBackwardWeights_v8(
      call.handle.get(), call.desc->rnn(), CUDNN_WGRAD_MODE_ADD, seq_lengths.typed_data(),
      call.x_desc, x.untyped_data(), call.desc->state(), hx.untyped_data(), call.y_desc,
      y.untyped_data(), dweights->size_bytes(), dweights->untyped_data(), sizes.workspace_training,
      workspace, sizes.reserve_space, reserve_space.untyped_data()));
  return Error::Success();
}

}  // namespace
}  // namespace jcr

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnForwardInference, jcr::ForwardInference,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // hx
                                  .Arg<ffi::AnyBuffer>()            // cx
                                  .Arg<ffi::AnyBuffer>()            // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lengths
                                  .Ret<ffi::AnyBuffer>()            // y
                                  .Ret<ffi::AnyBuffer>()            // hy
                                  .Ret<ffi::AnyBuffer>()            // cy
                                  .Attrs<jcr::RnnAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnForwardTraining, jcr::ForwardTraining,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // hx
                                  .Arg<ffi::AnyBuffer>()            // cx
                                  .Arg<ffi::AnyBuffer>()            // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lengths
                                  .Ret<ffi::AnyBuffer>()            // y
                                  .Ret<ffi::AnyBuffer>()            // hy
                                  .Ret<ffi::AnyBuffer>()            // cy
                                  .Ret<ffi::Buffer<ffi::U8>>()      // reserve_space
                                  .Attrs<jcr::RnnAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnBackwardData, jcr::BackwardData,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()            // y
                                  .Arg<ffi::AnyBuffer>()            // dy
                                  .Arg<ffi::AnyBuffer>()            // hx
                                  .Arg<ffi::AnyBuffer>()            // dhy
                                  .Arg<ffi::AnyBuffer>()            // cx
                                  .Arg<ffi::AnyBuffer>()            // dcy
                                  .Arg<ffi::AnyBuffer>()            // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lengths
                                  .Arg<ffi::Buffer<ffi::U8>>()      // reserve_space (in)
                                  .Ret<ffi::AnyBuffer>()            // dx
                                  .Ret<ffi::AnyBuffer>()            // dhx
                                  .Ret<ffi::AnyBuffer>()            // dcx
                                  .Ret<ffi::Buffer<ffi::U8>>()      // reserve_space (out, aliased)
                                  .Attrs<jcr::RnnAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnBackwardWeights, jcr::BackwardWeights,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::ScratchAllocator>()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // hx
                                  .Arg<ffi::AnyBuffer>()            // y
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lengths
                                  .Arg<ffi::Buffer<ffi::U8>>()      // reserve_space
                                  .Ret<ffi::AnyBuffer>()            // dweights
                                  .Attrs<jcr::RnnAttrs>());
