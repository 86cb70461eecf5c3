// Plain C entry points for Python (ctypes), used at trace time and by tests.
//
//   JcrRnnQuerySizes    weight-space, workspace and reserve-space sizes of a
//                       configuration, so that the reserve space can be an
//                       output of static shape, and the algorithm it runs.
//   JcrRnnWeightLayout  where cudnnGetRNNWeightParams puts every matrix and
//                       bias, so tests can prove `_layout.py` equals it.
//   JcrCudnnVersion     cudnnGetVersion() of the cuDNN this library loaded
//                       (needs no GPU), for logs and benchmark records.
//
// The first two return 0 on success; on failure they return 1 and write a message
// (truncated to `error_size`) into `error`. Nothing throws across this ABI.
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "rnn_descriptors.h"
#include "status.h"
#include "weight_layout.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {
namespace {

using ::xla::ffi::Error;

// A handle for queries on the calling thread's current device, made once per
// device (the descriptor cache is per device too).
Error QueryHandle(cudnnHandle_t* out) {
  int device = 0;
  JCR_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
  static std::mutex* mu = new std::mutex();
  static auto* handles = new std::map<int, cudnnHandle_t>();
  std::lock_guard<std::mutex> lock(*mu);
  cudnnHandle_t& handle = (*handles)[device];
  if (handle == nullptr) JCR_RETURN_IF_CUDNN_ERROR(cudnnCreate(&handle));
  *out = handle;
  return Error::Success();
}

Error QuerySizes(const RnnKey& key, RnnSizes* sizes, cudnnRNNAlgo_t* algo) {
  cudnnHandle_t handle;
  JCR_RETURN_IF_ERROR(QueryHandle(&handle));
  std::shared_ptr<const RnnDescriptors> desc;
  JCR_RETURN_IF_ERROR(GetRnnDescriptors(handle, key, &desc));
  *sizes = desc->sizes();
  *algo = desc->algo();
  return Error::Success();
}

Error WeightLayout(const RnnKey& key, int64_t element_size, int64_t* out, int64_t capacity) {
  cudnnHandle_t handle;
  JCR_RETURN_IF_ERROR(QueryHandle(&handle));
  std::shared_ptr<const RnnDescriptors> desc;
  JCR_RETURN_IF_ERROR(GetRnnDescriptors(handle, key, &desc));
  // A real device buffer, so cuDNN sees exactly what the handlers give it.
  const size_t space = desc->sizes().weight_space;
  void* base = nullptr;
  JCR_RETURN_IF_CUDA_ERROR(cudaMalloc(&base, space));
  std::unique_ptr<void, decltype(&cudaFree)> owned(base, &cudaFree);
  return ReadWeightLayout(handle, desc->rnn(), key.attrs, space, base, element_size, out,
                          capacity);
}

}  // namespace
}  // namespace jcr

extern "C" {

// sizes_out: [weight_space, workspace_inference, workspace_training, reserve_space] in
// bytes, then the cudnnRNNAlgo_t the descriptors hold: `algo`, or the standard
// algorithm where cuDNN turned `algo` down (`RnnDescriptors::Init`).
int JcrRnnQuerySizes(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                     int64_t input_size, int32_t bidirectional, int32_t skip_input,
                     int32_t batch_major, int32_t allow_tf32, int32_t data_type,
                     int64_t max_seq_length, int64_t batch_size, int64_t algo,
                     uint64_t* sizes_out, char* error, size_t error_size) {
  jcr::RnnKey key = jcr::MakeKey(cell_mode, num_layers, hidden_size, input_size, bidirectional,
                                 skip_input, batch_major, allow_tf32, data_type, max_seq_length,
                                 batch_size, algo);
  jcr::RnnSizes sizes{};
  cudnnRNNAlgo_t used = CUDNN_RNN_ALGO_STANDARD;
  int status = jcr::ReportToC(jcr::QuerySizes(key, &sizes, &used), error, error_size);
  if (status == 0) {
    sizes_out[0] = sizes.weight_space;
    sizes_out[1] = sizes.workspace_inference;
    sizes_out[2] = sizes.workspace_training;
    sizes_out[3] = sizes.reserve_space;
    sizes_out[4] = static_cast<uint64_t>(used);
  }
  return status;
}

// layout_out: 5 int64 per (pseudo-layer, linear-layer ID), see ReadWeightLayout.
int JcrRnnWeightLayout(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                       int64_t input_size, int32_t bidirectional, int32_t skip_input,
                       int32_t data_type, int64_t algo, int64_t element_size,
                       int64_t* layout_out, int64_t capacity, char* error, size_t error_size) {
  jcr::RnnKey key = jcr::WeightLayoutKey(cell_mode, num_layers, hidden_size, input_size,
                                         bidirectional, skip_input, /*allow_tf32=*/0, data_type,
                                         algo);
  return jcr::ReportToC(jcr::WeightLayout(key, element_size, layout_out, capacity), error,
                     error_size);
}

// major * 10000 + minor * 100 + patch for cuDNN 9.
size_t JcrCudnnVersion() { return cudnnGetVersion(); }

}  // extern "C"
