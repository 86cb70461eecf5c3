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
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "handle_pool.h"
#include "rnn_bindings.h"
#include "rnn_descriptors.h"
#include "rnn_input_checks.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {
namespace {

namespace ffi = ::xla::ffi;
using ffi::AnyBuffer;
using ffi::Error;

// What every handler needs before calling cuDNN: a handle on the stream, the
// cached descriptors (held for this call's use: `RnnDescriptors::Use`), and the
// data descriptors for these sequence lengths.
struct Call {
  BorrowedHandle handle;
  RnnKey key{};
  std::shared_ptr<const RnnDescriptors> desc;
  std::unique_lock<std::mutex> desc_in_use;  // after `desc`: released before it
  RnnDataDescriptor x_with_lengths;
  RnnDataDescriptor y_with_lengths;
  cudnnRNNDataDescriptor_t x_desc = nullptr;
  cudnnRNNDataDescriptor_t y_desc = nullptr;
  InputShapes shapes;
};

// Checks `x_like` (x or dx: only its shape and type are read), the initial
// state, the weights and the lengths against `attrs` (`CheckInputs`, then the
// weight-space size cuDNN reports), and fills `call`.
Error Prepare(cudaStream_t stream, const RnnAttrs& attrs, const AnyBuffer& x_like,
              const AnyBuffer& hx, const AnyBuffer& weights,
              const ffi::Buffer<ffi::S32>& seq_lengths, Call* call) {
  JCR_RETURN_IF_ERROR(CheckInputs(attrs, x_like, hx, weights, seq_lengths, &call->shapes));
  const int64_t steps = call->shapes.steps, batch = call->shapes.batch;
  call->key = RnnKey{attrs, call->shapes.cudnn_type, steps, batch};
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
    call->desc_in_use = call->desc->Use();
    return Error::Success();
  }
  std::vector<int32_t> lengths(static_cast<size_t>(batch));
  JCR_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(lengths.data(), seq_lengths.typed_data(),
                                           lengths.size() * sizeof(int32_t),
                                           cudaMemcpyDeviceToHost, stream));
  JCR_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream));
  JCR_RETURN_IF_ERROR(CheckLengths(lengths.data(), batch, steps));
  JCR_RETURN_IF_ERROR(call->x_with_lengths.Set(call->key, attrs.input_size, lengths));
  JCR_RETURN_IF_ERROR(call->y_with_lengths.Set(call->key, OutputSize(attrs), lengths));
  call->x_desc = call->x_with_lengths.get();
  call->y_desc = call->y_with_lengths.get();
  call->desc_in_use = call->desc->Use();  // after the wait for the lengths, not during it
  return Error::Success();
}

// The status of one of cuDNN's RNN calls as an error. Under a persistent
// algorithm the message names it, and how to run the standard one instead
// (the algorithm is chosen in Python: `_cudnn.choose_algorithms`).
Error Checked(const char* call, cudnnStatus_t status, const Call& c, const char* file, int line) {
  if (status == CUDNN_STATUS_SUCCESS) return Error::Success();
  std::string message = CallFailed(call, cudnnGetErrorString(status), file, line);
  if (c.desc->algo() == CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H) {
    message += " with cuDNN's algorithm CUDNN_RNN_ALGO_PERSIST_STATIC_SMALL_H; set the "
               "environment variable JAX_CUDNN_RNN_ALGORITHM=standard for the standard one";
  }
  return Error::Internal(message);
}
#define JCR_CHECKED(call, c, ...) Checked(#call, call(__VA_ARGS__), c, __FILE__, __LINE__)

// XLA's scratch allocator refuses any alignment above 16 bytes
// (XLA_FFI_DeviceMemory_Allocate's kMaxAlignment; seen on an H200 with jax 0.11.2,
// where asking for 256 failed every call), so the workspace is over-allocated by
// kWorkspaceAlignment - 1 bytes and its start rounded up to cuDNN's preferred alignment.
constexpr size_t kScratchAlignment = 16;
constexpr size_t kWorkspaceAlignment = 256;
static_assert(kScratchAlignment <= 16, "XLA's scratch allocator refuses alignments above 16");
static_assert((kWorkspaceAlignment & (kWorkspaceAlignment - 1)) == 0,
              "the workspace is rounded up with a mask: a power of two");

Error Allocate(ffi::ScratchAllocator& scratch, size_t size, void** out) {
  *out = nullptr;
  if (size == 0) return Error::Success();
  std::optional<void*> memory =
      scratch.Allocate(size + kWorkspaceAlignment - 1, kScratchAlignment);
  if (!memory.has_value()) {
    return Error(ffi::ErrorCode::kResourceExhausted,
                 "could not allocate " + std::to_string(size) +
                     " bytes of cuDNN RNN workspace from XLA's scratch allocator");
  }
  const uintptr_t start = reinterpret_cast<uintptr_t>(*memory);
  *out = reinterpret_cast<void*>((start + kWorkspaceAlignment - 1) & ~(kWorkspaceAlignment - 1));
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
  JCR_RETURN_IF_ERROR(CheckBuffer("y", *y, call.shapes.y_dims, call.shapes));
  JCR_RETURN_IF_ERROR(CheckBuffer("hy", *hy, call.shapes.state_dims, call.shapes));
  JCR_RETURN_IF_ERROR(CheckCellState("cx", cx, call.shapes));
  JCR_RETURN_IF_ERROR(CheckCellState("cy", *cy, call.shapes));
  const RnnSizes& sizes = call.desc->sizes();
  if (kTraining && reserve_bytes < sizes.reserve_space) {
    return Error::InvalidArgument("reserve_space has " + std::to_string(reserve_bytes) +
                                  " bytes, cuDNN needs " + std::to_string(sizes.reserve_space));
  }
  void* workspace;
  JCR_RETURN_IF_ERROR(Allocate(
      scratch, kTraining ? sizes.workspace_training : sizes.workspace_inference, &workspace));
  JCR_RETURN_IF_ERROR(JCR_CHECKED(
      cudnnRNNForward, call, call.handle.get(), call.desc->rnn(),
      kTraining ? CUDNN_FWD_MODE_TRAINING : CUDNN_FWD_MODE_INFERENCE, seq_lengths.typed_data(),
      call.x_desc, x.untyped_data(), call.y_desc, y->untyped_data(), call.desc->state(),
      hx.untyped_data(), hy->untyped_data(), call.desc->state(),
      call.shapes.lstm ? cx.untyped_data() : nullptr, call.shapes.lstm ? cy->untyped_data() : nullptr,
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
  JCR_RETURN_IF_ERROR(CheckBuffer("y", y, call.shapes.y_dims, call.shapes));
  JCR_RETURN_IF_ERROR(CheckBuffer("dy", dy, call.shapes.y_dims, call.shapes));
  JCR_RETURN_IF_ERROR(CheckBuffer("dhy", dhy, call.shapes.state_dims, call.shapes));
  JCR_RETURN_IF_ERROR(CheckBuffer("dhx", *dhx, call.shapes.state_dims, call.shapes));
  JCR_RETURN_IF_ERROR(CheckCellState("cx", cx, call.shapes));
  JCR_RETURN_IF_ERROR(CheckCellState("dcy", dcy, call.shapes));
  JCR_RETURN_IF_ERROR(CheckCellState("dcx", *dcx, call.shapes));
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
  JCR_RETURN_IF_ERROR(JCR_CHECKED(
      cudnnRNNBackwardData_v8, call, call.handle.get(), call.desc->rnn(),
      seq_lengths.typed_data(), call.y_desc, y.untyped_data(), dy.untyped_data(), call.x_desc,
      dx->untyped_data(), call.desc->state(), hx.untyped_data(), dhy.untyped_data(),
      dhx->untyped_data(), call.desc->state(), call.shapes.lstm ? cx.untyped_data() : nullptr,
      call.shapes.lstm ? dcy.untyped_data() : nullptr,
      call.shapes.lstm ? dcx->untyped_data() : nullptr, weights.size_bytes(), weights.untyped_data(),
      sizes.workspace_training, workspace, sizes.reserve_space, reserve_out->untyped_data()));
  return Error::Success();
}

Error BackwardWeights(cudaStream_t stream, ffi::ScratchAllocator scratch, AnyBuffer x,
                      AnyBuffer hx, AnyBuffer y, ffi::Buffer<ffi::S32> seq_lengths,
                      ffi::Buffer<ffi::U8> reserve_space, ffi::Result<AnyBuffer> dweights,
                      RnnAttrs attrs) {
  Call call;
  JCR_RETURN_IF_ERROR(Prepare(stream, attrs, x, hx, *dweights, seq_lengths, &call));
  JCR_RETURN_IF_ERROR(CheckBuffer("y", y, call.shapes.y_dims, call.shapes));
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
  JCR_RETURN_IF_ERROR(JCR_CHECKED(
      cudnnRNNBackwardWeights_v8, call, call.handle.get(), call.desc->rnn(),
      CUDNN_WGRAD_MODE_ADD, seq_lengths.typed_data(), call.x_desc, x.untyped_data(),
      call.desc->state(), hx.untyped_data(), call.y_desc, y.untyped_data(), dweights->size_bytes(),
      dweights->untyped_data(), sizes.workspace_training, workspace, sizes.reserve_space,
      reserve_space.untyped_data()));
  return Error::Success();
}

// The context every cuDNN handler takes first: its stream and scratch memory.
auto CudaBinding() {
  return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>().Ctx<ffi::ScratchAllocator>();
}

// x, hx, cx, weights, seq_lengths -> y, hy, cy.
auto ForwardBinding() {
  return WithForwardOperands(CudaBinding())
      .Ret<AnyBuffer>()   // y
      .Ret<AnyBuffer>()   // hy
      .Ret<AnyBuffer>();  // cy
}

}  // namespace
}  // namespace jcr

namespace ffi = ::xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnForwardInference, jcr::ForwardInference,
                              jcr::ForwardBinding().Attrs<jcr::RnnAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnForwardTraining, jcr::ForwardTraining,
                              jcr::ForwardBinding()
                                  .Ret<ffi::Buffer<ffi::U8>>()      // reserve_space
                                  .Attrs<jcr::RnnAttrs>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcrRnnBackwardData, jcr::BackwardData,
                              jcr::CudaBinding()
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
                              jcr::CudaBinding()
                                  .Arg<ffi::AnyBuffer>()            // x
                                  .Arg<ffi::AnyBuffer>()            // hx
                                  .Arg<ffi::AnyBuffer>()            // y
                                  .Arg<ffi::Buffer<ffi::S32>>()     // seq_lengths
                                  .Arg<ffi::Buffer<ffi::U8>>()      // reserve_space
                                  .Ret<ffi::AnyBuffer>()            // dweights
                                  .Attrs<jcr::RnnAttrs>());
