#include "weight_layout.h"

#include <memory>
#include <string>

#include "status.h"

namespace jcr {
namespace {

using ::xla::ffi::Error;
using TensorDescriptor =
    std::unique_ptr<cudnnTensorStruct, decltype(&cudnnDestroyTensorDescriptor)>;

Error NewTensorDescriptor(TensorDescriptor* out) {
  cudnnTensorDescriptor_t desc = nullptr;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&desc));
  out->reset(desc);
  return Error::Success();
}

// The second and third dimensions of a 3-D tensor descriptor (cuDNN describes
// a matrix as [1, rows, cols] and a bias as [1, length, 1]).
Error Dims(cudnnTensorDescriptor_t desc, int* rows, int* cols) {
  int dims[3] = {0, 0, 0}, strides[3] = {0, 0, 0}, rank = 0;
  cudnnDataType_t type;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnGetTensorNdDescriptor(desc, 3, &type, &rank, dims, strides));
  *rows = dims[1];
  *cols = dims[2];
  return Error::Success();
}

}  // namespace

int64_t WeightLayoutSize(const RnnAttrs& attrs) {
  return NumStates(attrs) * 2 * NumGates(attrs.cell_mode) * 5;
}

Error ReadWeightLayout(cudnnHandle_t handle, cudnnRNNDescriptor_t rnn, const RnnAttrs& attrs,
                       size_t space, void* base, int64_t element_size, int64_t* out,
                       int64_t capacity) {
  if (capacity < WeightLayoutSize(attrs)) {
    return Error::InvalidArgument("layout buffer too small: need " +
                                  std::to_string(WeightLayoutSize(attrs)));
  }
  TensorDescriptor m_desc(nullptr, &cudnnDestroyTensorDescriptor);
  TensorDescriptor b_desc(nullptr, &cudnnDestroyTensorDescriptor);
  JCR_RETURN_IF_ERROR(NewTensorDescriptor(&m_desc));
  JCR_RETURN_IF_ERROR(NewTensorDescriptor(&b_desc));
  const int64_t linear_layers = 2 * NumGates(attrs.cell_mode);
  auto offset = [&](void* addr) -> int64_t {
    if (addr == nullptr) return -1;
    return (static_cast<char*>(addr) - static_cast<char*>(base)) / element_size;
  };
  for (int64_t p = 0; p < NumStates(attrs); ++p) {
    for (int64_t id = 0; id < linear_layers; ++id) {
      void* m_addr = nullptr;
      void* b_addr = nullptr;
      JCR_RETURN_IF_CUDNN_ERROR(cudnnGetRNNWeightParams(
          handle, rnn, static_cast<int32_t>(p), space, base, static_cast<int32_t>(id),
          m_desc.get(), &m_addr, b_desc.get(), &b_addr));
      int m_rows = 0, m_cols = 0, b_length = 0, unused = 0;
      if (m_addr != nullptr) JCR_RETURN_IF_ERROR(Dims(m_desc.get(), &m_rows, &m_cols));
      if (b_addr != nullptr) JCR_RETURN_IF_ERROR(Dims(b_desc.get(), &b_length, &unused));
      int64_t* row = out + (p * linear_layers + id) * 5;
      row[0] = offset(m_addr);
      row[1] = m_rows;
      row[2] = m_cols;
      row[3] = offset(b_addr);
      row[4] = b_length;
    }
  }
  return Error::Success();
}

RnnKey WeightLayoutKey(int64_t cell_mode, int64_t num_layers, int64_t hidden_size,
                       int64_t input_size, int32_t bidirectional, int32_t skip_input,
                       int32_t allow_tf32, int32_t data_type, int64_t algo) {
  return MakeKey(cell_mode, num_layers, hidden_size, input_size, bidirectional, skip_input,
                 /*batch_major=*/0, allow_tf32, data_type, /*max_seq_length=*/1,
                 /*batch_size=*/1, algo);
}

}  // namespace jcr
