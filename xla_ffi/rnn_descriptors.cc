#include "rnn_descriptors.h"

#include <cstring>
#include <map>
#include <mutex>
#include <tuple>

#include <cuda_runtime_api.h>

#include "status.h"

namespace jcr {
namespace {

using ::xla::ffi::Error;

auto KeyTuple(const RnnKey& k) {
  const RnnAttrs& a = k.attrs;
  return std::make_tuple(a.cell_mode, a.num_layers, a.hidden_size, a.input_size, a.bidirectional,
                         a.skip_input, a.batch_major, a.allow_tf32, static_cast<int>(k.data_type),
                         k.max_seq_length, k.batch_size, a.algo);
}

// Compute precision and tensor-core policy for a data type.
void MathFor(const RnnKey& key, cudnnDataType_t* math_prec, cudnnMathType_t* math_type) {
  switch (key.data_type) {
    case CUDNN_DATA_DOUBLE:
      *math_prec = CUDNN_DATA_DOUBLE;
      *math_type = CUDNN_DEFAULT_MATH;
      return;
    case CUDNN_DATA_FLOAT:
      // DEFAULT lets cuDNN use TF32 tensor cores; FMA forbids them. Not
      // TENSOR_OP_MATH_ALLOW_CONVERSION: for float RNNs that down-converts
      // weights and intermediate results to half precision.
      *math_prec = CUDNN_DATA_FLOAT;
      *math_type = key.attrs.allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
      return;
    default:  // half and bfloat16: accumulate in float32, on tensor cores
      *math_prec = CUDNN_DATA_FLOAT;
      *math_type = CUDNN_TENSOR_OP_MATH;
      return;
  }
}

}  // namespace

RnnKey MakeKey(int64_t cell_mode, int64_t num_layers, int64_t hidden_size, int64_t input_size,
               int32_t bidirectional, int32_t skip_input, int32_t batch_major,
               int32_t allow_tf32, int32_t data_type, int64_t max_seq_length,
               int64_t batch_size, int64_t algo) {
  RnnAttrs attrs{cell_mode,         num_layers,          hidden_size,        input_size,
                 bidirectional != 0, skip_input != 0,    batch_major != 0,   allow_tf32 != 0,
                 /*has_seq_lengths=*/false, algo};
  return RnnKey{attrs, static_cast<cudnnDataType_t>(data_type), max_seq_length, batch_size};
}

int NumGates(int64_t cell_mode) {
  switch (cell_mode) {
    case CUDNN_LSTM:
      return 4;
    case CUDNN_GRU:
      return 3;
    default:
      return 1;
  }
}

RnnDataDescriptor::~RnnDataDescriptor() {
  if (desc_ != nullptr) cudnnDestroyRNNDataDescriptor(desc_);
}

Error RnnDataDescriptor::Set(const RnnKey& key, int64_t vector_size,
                             const std::vector<int32_t>& lengths) {
  if (desc_ == nullptr) JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateRNNDataDescriptor(&desc_));
  // Zero bits are 0.0 in every floating type: padding of outputs is zeroed.
  double padding_fill = 0.0;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnSetRNNDataDescriptor(
      desc_, key.data_type,
      key.attrs.batch_major ? CUDNN_RNN_DATA_LAYOUT_BATCH_MAJOR_UNPACKED
                            : CUDNN_RNN_DATA_LAYOUT_SEQ_MAJOR_UNPACKED,
      static_cast<int>(key.max_seq_length), static_cast<int>(key.batch_size),
      static_cast<int>(vector_size), lengths.data(), &padding_fill));
  return Error::Success();
}

RnnDescriptors::~RnnDescriptors() {
  if (state_ != nullptr) cudnnDestroyTensorDescriptor(state_);
  if (rnn_ != nullptr) cudnnDestroyRNNDescriptor(rnn_);
  if (dropout_ != nullptr) cudnnDestroyDropoutDescriptor(dropout_);
}

Error SetRnnDescriptor(const RnnKey& key, cudnnDropoutDescriptor_t dropout,
                       cudnnRNNDescriptor_t rnn) {
  const RnnAttrs& a = key.attrs;
  cudnnDataType_t math_prec;
  cudnnMathType_t math_type;
  MathFor(key, &math_prec, &math_type);
  JCR_RETURN_IF_CUDNN_ERROR(cudnnSetRNNDescriptor_v8(
      rnn, static_cast<cudnnRNNAlgo_t>(a.algo), static_cast<cudnnRNNMode_t>(a.cell_mode),
      CUDNN_RNN_DOUBLE_BIAS, a.bidirectional ? CUDNN_BIDIRECTIONAL : CUDNN_UNIDIRECTIONAL,
      a.skip_input ? CUDNN_SKIP_INPUT : CUDNN_LINEAR_INPUT, key.data_type, math_prec, math_type,
      static_cast<int32_t>(a.input_size), static_cast<int32_t>(a.hidden_size),
      /*projSize=*/static_cast<int32_t>(a.hidden_size), static_cast<int32_t>(a.num_layers),
      dropout, CUDNN_RNN_PADDED_IO_ENABLED));
  return Error::Success();
}

Error RnnDescriptors::Init(cudnnHandle_t handle, const RnnKey& key) {
  // Dropout between layers is applied by JAX (same masks on every backend),
  // so cuDNN's own dropout is always off and needs no state buffer.
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateDropoutDescriptor(&dropout_));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnSetDropoutDescriptor(dropout_, handle, 0.0f, nullptr, 0, 0));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateRNNDescriptor(&rnn_));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnCreateTensorDescriptor(&state_));
  if (key.attrs.algo != CUDNN_RNN_ALGO_STANDARD && Configure(handle, key).success()) {
    return Error::Success();
  }
  // The standard algorithm: asked for, or in place of a persistent one that
  // cuDNN turned down (cuDNN 9 refuses persistent algorithms for double at
  // the descriptor, and may refuse a size at the size query).
  RnnKey standard = key;
  standard.attrs.algo = CUDNN_RNN_ALGO_STANDARD;
  return Configure(handle, standard);
}

Error RnnDescriptors::Configure(cudnnHandle_t handle, const RnnKey& key) {
  const RnnAttrs& a = key.attrs;
  JCR_RETURN_IF_ERROR(SetRnnDescriptor(key, dropout_, rnn_));

  const int dims[3] = {static_cast<int>(NumStates(a)), static_cast<int>(key.batch_size),
                       static_cast<int>(a.hidden_size)};
  const int strides[3] = {dims[1] * dims[2], dims[2], 1};
  JCR_RETURN_IF_CUDNN_ERROR(cudnnSetTensorNdDescriptor(state_, key.data_type, 3, dims, strides));

  std::vector<int32_t> full(static_cast<size_t>(key.batch_size),
                            static_cast<int32_t>(key.max_seq_length));
  JCR_RETURN_IF_ERROR(x_full_.Set(key, a.input_size, full));
  JCR_RETURN_IF_ERROR(y_full_.Set(key, OutputSize(a), full));

  JCR_RETURN_IF_CUDNN_ERROR(cudnnGetRNNWeightSpaceSize(handle, rnn_, &sizes_.weight_space));
  size_t unused_reserve = 0;
  JCR_RETURN_IF_CUDNN_ERROR(cudnnGetRNNTempSpaceSizes(handle, rnn_, CUDNN_FWD_MODE_INFERENCE,
                                                      x_full_.get(), &sizes_.workspace_inference,
                                                      &unused_reserve));
  JCR_RETURN_IF_CUDNN_ERROR(cudnnGetRNNTempSpaceSizes(handle, rnn_, CUDNN_FWD_MODE_TRAINING,
                                                      x_full_.get(), &sizes_.workspace_training,
                                                      &sizes_.reserve_space));
  algo_ = static_cast<cudnnRNNAlgo_t>(a.algo);
  return Error::Success();
}

Error GetRnnDescriptors(cudnnHandle_t handle, const RnnKey& key,
                        std::shared_ptr<const RnnDescriptors>* out) {
  // Per device as well: descriptors made with one device's handle are never
  // handed to another device's calls (which XLA runs on their own threads),
  // and sizes are queried on the device that uses them.
  int device = 0;
  JCR_RETURN_IF_CUDA_ERROR(cudaGetDevice(&device));
  using CacheKey = decltype(std::tuple_cat(std::make_tuple(device), KeyTuple(key)));
  static std::mutex* mu = new std::mutex();
  static auto* cache = new std::map<CacheKey, std::shared_ptr<const RnnDescriptors>>();
  const CacheKey cache_key = std::tuple_cat(std::make_tuple(device), KeyTuple(key));
  {
    std::lock_guard<std::mutex> lock(*mu);
    auto it = cache->find(cache_key);
    if (it != cache->end()) {
      *out = it->second;
      return Error::Success();
    }
  }
  auto descriptors = std::make_shared<RnnDescriptors>();
  JCR_RETURN_IF_ERROR(descriptors->Init(handle, key));
  std::lock_guard<std::mutex> lock(*mu);
  *out = cache->emplace(cache_key, std::move(descriptors)).first->second;
  return Error::Success();
}

}  // namespace jcr
