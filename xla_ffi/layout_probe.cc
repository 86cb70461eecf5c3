// A test-only probe (built for CI, never installed): cuDNN's own weight-space
// size and layout for a configuration, on a machine without a GPU.
//
//   JcrProbeWeightLayout  sets the RNN descriptor exactly as the handlers do
//                         (`SetRnnDescriptor`), then reports
//                         cudnnGetRNNWeightSpaceSize and, through the same
//                         `ReadWeightLayout` as the GPU query, where
//                         cudnnGetRNNWeightParams puts every matrix and bias.
//
// Why a probe, and its one liberty. Both calls are host-side arithmetic over
// the RNN descriptor, but cuDNN's API takes a handle, and making one
// (cudnnCreate) needs a device. Here a zero-filled placeholder stands in for
// the handle, and a host buffer for the weight space (cuDNN only computes
// addresses inside it). That cuDNN reads nothing from the handle in these two
// calls is observed (cuDNN 9.28), not promised by NVIDIA. (The workspace and
// reserve sizes cannot be probed so: cudnnGetRNNTempSpaceSizes asks the CUDA
// runtime for the current device, and fails without one.) Should a version
// read the handle, the probe would most likely fail or crash (tests run it in
// a child process), and a pass still means every offset matched. So this is
// evidence for the analytic layout where
// CI has no GPU; the GPU test `test_analytic_layout_equals_cudnn`, with a real
// handle and device memory, stays the authority.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include <cudnn.h>

#include "rnn_descriptors.h"
#include "status.h"
#include "weight_layout.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {
namespace {

using ::xla::ffi::Error;

// Comfortably larger than cuDNN's handle structure; zero bytes throughout.
constexpr size_t kPlaceholderHandleBytes = 1 << 20;

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

Error Probe(const RnnKey& key, int64_t element_size, uint64_t* weight_space, int64_t* out,
            int64_t capacity) {
  std::unique_ptr<void, FreeDeleter> placeholder(std::calloc(1, kPlaceholderHandleBytes));
  if (placeholder == nullptr) return Error::Internal("out of host memory");
  auto handle = static_cast<cudnnHandle_t>(placeholder.get());

  cudnnDropoutDescriptor_t dropout_raw = nullptr;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateDropoutDescriptor(&dropout_raw));
  std::unique_ptr<cudnnDropoutStruct, decltype(&cudnnDestroyDropoutDescriptor)> dropout(
      dropout_raw, &cudnnDestroyDropoutDescriptor);
  cudnnRNNDescriptor_t rnn_raw = nullptr;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateRNNDescriptor(&rnn_raw));
  std::unique_ptr<cudnnRNNStruct, decltype(&cudnnDestroyRNNDescriptor)> rnn(
      rnn_raw, &cudnnDestroyRNNDescriptor);
  // The dropout descriptor stays unset: setting it needs a real handle, and
  // with dropout off it plays no part in the layout.
  JCR_RETURN_IF_ERROR(SetRnnDescriptor(key, dropout.get(), rnn.get()));

  size_t space = 0;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnGetRNNWeightSpaceSize(handle, rnn.get(), &space));
  *weight_space = space;
  std::unique_ptr<void, FreeDeleter> base(std::aligned_alloc(256, (space + 255) / 256 * 256));
  if (base == nullptr) return Error::Internal("out of host memory");
  return ReadWeightLayout(handle, rnn.get(), key.attrs, space, base.get(), element_size, out,
                          capacity);
}

}  // namespace
}  // namespace jcr

extern "C" {

// weight_space_out: bytes; layout_out: 5 int64 per (pseudo-layer, linear-layer
// ID), see ReadWeightLayout. Returns 0, or 1 with a message in `error`.
int JcrProbeWeightLayout(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                         int64_t input_size, int32_t bidirectional, int32_t skip_input,
                         int32_t allow_tf32, int32_t data_type, int64_t algo,
                         int64_t element_size, uint64_t* weight_space_out, int64_t* layout_out,
                         int64_t capacity, char* error, size_t error_size) {
  jcr::RnnKey key = jcr::WeightLayoutKey(cell_mode, num_layers, hidden_size, input_size,
                                         bidirectional, skip_input, allow_tf32, data_type, algo);
  return jcr::ReportToC(jcr::Probe(key, element_size, weight_space_out, layout_out, capacity),
                        error, error_size);
}

}  // extern "C"
