// Plain C entry points for Python (ctypes), used at trace time and by tests.
//
//   JcrRnnQuerySizes    weight-space, workspace and reserve-space sizes of a
//                       configuration, so that the reserve space can be an
//                       output of static shape.
//   JcrRnnWeightLayout  where cudnnGetRNNWeightParams puts every matrix and
//                       bias, so tests can prove `_layout.py` equals it.
//   JcrCudnnVersion     cudnnGetVersion() of the cuDNN this library loaded
//                       (needs no GPU), for logs and benchmark records.
//
// Both return 0 on success; on failure they return 1 and write a message
// (truncated to `error_size`) into `error`. Nothing throws across this ABI.
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "rnn_descriptors.h"
#include "status.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {
namespace {

using ::xla::ffi::Error;

int Report(const Error& error, char* out, size_t out_size) {
  if (error.success()) return 0;
  if (out != nullptr && out_size > 0) {
    std::strncpy(out, error.message().c_str(), out_size - 1);
    out[out_size - 1] = '\0';
  }
  return 1;
}

// One handle for queries on the calling thread's current device, made once.
Error QueryHandle(cudnnHandle_t* out) {
  static std::mutex* mu = new std::mutex();
  static cudnnHandle_t handle = nullptr;
  std::lock_guard<std::mutex> lock(*mu);
  if (handle == nullptr) JCR_RETURN_IF_CUDNN_ERROR(cudnnCreate(&handle));
  *out = handle;
  return Error::Success();
}

RnnKey MakeKey(int64_t cell_mode, int64_t num_layers, int64_t hidden_size, int64_t input_size,
               int32_t bidirectional, int32_t skip_input, int32_t batch_major,
               int32_t allow_tf32, int32_t data_type, int64_t max_seq_length,
               int64_t batch_size) {
  RnnAttrs attrs{cell_mode,         num_layers,          hidden_size,        input_size,
                 bidirectional != 0, skip_input != 0,    batch_major != 0,   allow_tf32 != 0,
                 /*has_seq_lengths=*/false};
  return RnnKey{attrs, static_cast<cudnnDataType_t>(data_type), max_seq_length, batch_size};
}

Error QuerySizes(const RnnKey& key, RnnSizes* sizes) {
  cudnnHandle_t handle;
  JCR_RETURN_IF_ERROR(QueryHandle(&handle));
  std::shared_ptr<const RnnDescriptors> desc;
  JCR_RETURN_IF_ERROR(GetRnnDescriptors(handle, key, &desc));
  *sizes = desc->sizes();
  return Error::Success();
}

Error WeightLayout(const RnnKey& key, int64_t element_size, int64_t* out, int64_t capacity) {
  cudnnHandle_t handle;
  JCR_RETURN_IF_ERROR(QueryHandle(&handle));
  std::shared_ptr<const RnnDescriptors> desc;
  JCR_RETURN_IF_ERROR(GetRnnDescriptors(handle, key, &desc));
  const int64_t pseudo_layers = NumStates(key.attrs);
  const int64_t linear_layers = 2 * NumGates(key.attrs.cell_mode);
  if (capacity < pseudo_layers * linear_layers * 5) {
    return Error::InvalidArgument("layout buffer too small: need " +
                                  std::to_string(pseudo_layers * linear_layers * 5));
  }
  const size_t space = desc->sizes().weight_space;
  void* base = nullptr;
  JCR_RETURN_IF_CUDA_ERROR(cudaMalloc(&base, space));
  std::unique_ptr<void, decltype(&cudaFree)> owned(base, &cudaFree);
  cudnnTensorDescriptor_t m_desc = nullptr, b_desc = nullptr;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&m_desc));
  std::unique_ptr<cudnnTensorStruct, decltype(&cudnnDestroyTensorDescriptor)> m_owned(
      m_desc, &cudnnDestroyTensorDescriptor);
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&b_desc));
  std::unique_ptr<cudnnTensorStruct, decltype(&cudnnDestroyTensorDescriptor)> b_owned(
      b_desc, &cudnnDestroyTensorDescriptor);
  for (int64_t p = 0; p < pseudo_layers; ++p) {
    for (int64_t id = 0; id < linear_layers; ++id) {
      void* m_addr = nullptr;
      void* b_addr = nullptr;
      JCR_RETURN_IF_CUDNN_ERROR(cudnnGetRNNWeightParams(
          handle, desc->rnn(), static_cast<int32_t>(p), space, base, static_cast<int32_t>(id),
          m_desc, &m_addr, b_desc, &b_addr));
      int64_t* row = out + (p * linear_layers + id) * 5;
      int m_dims[3] = {0, 0, 0}, m_strides[3], nb = 0;
      cudnnDataType_t type;
      if (m_addr != nullptr) {
        JCR_RETURN_IF_CUDNN_ERROR(
            cudnnGetTensorNdDescriptor(m_desc, 3, &type, &nb, m_dims, m_strides));
      }
      int b_dims[3] = {0, 0, 0}, b_strides[3];
      if (b_addr != nullptr) {
        JCR_RETURN_IF_CUDNN_ERROR(
            cudnnGetTensorNdDescriptor(b_desc, 3, &type, &nb, b_dims, b_strides));
      }
      auto offset = [&](void* addr) -> int64_t {
        if (addr == nullptr) return -1;
        return (static_cast<char*>(addr) - static_cast<char*>(base)) / element_size;
      };
      // [matrix offset, matrix rows, matrix cols, bias offset, bias length]
      row[0] = offset(m_addr);
      row[1] = m_addr ? m_dims[1] : 0;
      row[2] = m_addr ? m_dims[2] : 0;
      row[3] = offset(b_addr);
      row[4] = b_addr ? b_dims[1] : 0;
    }
  }
  return Error::Success();
}

}  // namespace
}  // namespace jcr

extern "C" {

// sizes_out: [weight_space, workspace_inference, workspace_training, reserve_space] in bytes.
int JcrRnnQuerySizes(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                     int64_t input_size, int32_t bidirectional, int32_t skip_input,
                     int32_t batch_major, int32_t allow_tf32, int32_t data_type,
                     int64_t max_seq_length, int64_t batch_size, uint64_t* sizes_out,
                     char* error, size_t error_size) {
  jcr::RnnKey key = jcr::MakeKey(cell_mode, num_layers, hidden_size, input_size, bidirectional,
                                 skip_input, batch_major, allow_tf32, data_type, max_seq_length,
                                 batch_size);
  jcr::RnnSizes sizes{};
  int status = jcr::Report(jcr::QuerySizes(key, &sizes), error, error_size);
  if (status == 0) {
    sizes_out[0] = sizes.weight_space;
    sizes_out[1] = sizes.workspace_inference;
    sizes_out[2] = sizes.workspace_training;
    sizes_out[3] = sizes.reserve_space;
  }
  return status;
}

// layout_out: 5 int64 per (pseudo-layer, linear-layer ID), see WeightLayout.
int JcrRnnWeightLayout(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                       int64_t input_size, int32_t bidirectional, int32_t skip_input,
                       int32_t data_type, int64_t element_size, int64_t* layout_out,
                       int64_t capacity, char* error, size_t error_size) {
  jcr::RnnKey key = jcr::MakeKey(cell_mode, num_layers, hidden_size, input_size, bidirectional,
                                 skip_input, /*batch_major=*/0, /*allow_tf32=*/0, data_type,
                                 /*max_seq_length=*/1, /*batch_size=*/1);
  return jcr::Report(jcr::WeightLayout(key, element_size, layout_out, capacity), error,
                     error_size);
}

// major * 10000 + minor * 100 + patch for cuDNN 9.
size_t JcrCudnnVersion() { return cudnnGetVersion(); }

}  // extern "C"
