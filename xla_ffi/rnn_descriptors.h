// The RNN configuration, its cuDNN descriptors (RAII-owned), and their cache.
//
// A configuration (mode, sizes, direction, input mode, data type, math mode,
// algorithm, time steps, batch, layout) maps to one immutable `RnnDescriptors`
// per device, created on first use and cached for the life of the process, so
// steady-state calls create no descriptor. Data descriptors for explicit
// sequence lengths depend on the lengths and are made per call
// (`RnnDataDescriptor`).
#ifndef JAX_CUDNN_RNN_RNN_DESCRIPTORS_H_
#define JAX_CUDNN_RNN_RNN_DESCRIPTORS_H_

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include <cudnn.h>

#include "rnn_attrs.h"
#include "xla/ffi/api/ffi.h"

namespace jcr {

struct RnnKey {
  RnnAttrs attrs;
  cudnnDataType_t data_type;
  int64_t max_seq_length;
  int64_t batch_size;
};

// Sizes in bytes for one configuration.
struct RnnSizes {
  size_t weight_space;
  size_t workspace_inference;
  size_t workspace_training;
  size_t reserve_space;
};

// An RNN data descriptor, destroyed with its owner.
class RnnDataDescriptor {
 public:
  RnnDataDescriptor() = default;
  RnnDataDescriptor(const RnnDataDescriptor&) = delete;
  RnnDataDescriptor& operator=(const RnnDataDescriptor&) = delete;
  ~RnnDataDescriptor();
  // (Re)describes `[T, B, vector_size]` data with the given host lengths.
  ::xla::ffi::Error Set(const RnnKey& key, int64_t vector_size, const std::vector<int32_t>& lengths);
  cudnnRNNDataDescriptor_t get() const { return desc_; }

 private:
  cudnnRNNDataDescriptor_t desc_ = nullptr;
};

// Everything cuDNN needs for one configuration with full-length sequences.
//
// One instance serves every call of its configuration on its device, from any
// host thread. cuDNN calls itself thread-safe where no handle is shared, and
// says nothing of descriptors shared between threads, so a handler holds
// `Use()` from the end of its preparation (after any wait for sequence
// lengths) to its return, as TensorFlow's cuDNN RNN kernels hold theirs: two
// threads never pass these descriptors to cuDNN at once. The lock covers
// host-side launches only (cuDNN's RNN calls are asynchronous).
class RnnDescriptors {
 public:
  RnnDescriptors() = default;
  RnnDescriptors(const RnnDescriptors&) = delete;
  RnnDescriptors& operator=(const RnnDescriptors&) = delete;
  ~RnnDescriptors();

  // Creates the descriptors for `key` and queries the sizes. A persistent
  // algorithm that cuDNN turns down for this configuration (at the descriptor
  // or the size query) is replaced by the standard one, which serves every
  // configuration; `algo()` says which one the descriptors hold. The size
  // query and the handlers share this cache, so the reserve space sized at
  // trace time is the one the handlers' algorithm needs.
  ::xla::ffi::Error Init(cudnnHandle_t handle, const RnnKey& key);

  cudnnRNNDescriptor_t rnn() const { return rnn_; }
  cudnnTensorDescriptor_t state() const { return state_; }
  const RnnDataDescriptor& x_full() const { return x_full_; }
  const RnnDataDescriptor& y_full() const { return y_full_; }
  const RnnSizes& sizes() const { return sizes_; }
  cudnnRNNAlgo_t algo() const { return algo_; }
  std::unique_lock<std::mutex> Use() const { return std::unique_lock<std::mutex>(in_use_); }

 private:
  mutable std::mutex in_use_;
  cudnnDropoutDescriptor_t dropout_ = nullptr;
  cudnnRNNDescriptor_t rnn_ = nullptr;
  cudnnTensorDescriptor_t state_ = nullptr;
  RnnDataDescriptor x_full_;
  RnnDataDescriptor y_full_;
  RnnSizes sizes_{};
  cudnnRNNAlgo_t algo_ = CUDNN_RNN_ALGO_STANDARD;

  // Sets the descriptors (created once) to `key`, with `key.attrs.algo`, and
  // queries the sizes.
  ::xla::ffi::Error Configure(cudnnHandle_t handle, const RnnKey& key);
};

// Sets `rnn` to the configuration of `key`, its algorithm included, with
// cuDNN's dropout `dropout` (never applied: JAX draws the masks). Host-side
// only: needs no handle.
::xla::ffi::Error SetRnnDescriptor(const RnnKey& key, cudnnDropoutDescriptor_t dropout,
                                   cudnnRNNDescriptor_t rnn);

// The cached descriptors of `key` on the current CUDA device, created with
// `handle` (a handle on that device) on first use.
::xla::ffi::Error GetRnnDescriptors(cudnnHandle_t handle, const RnnKey& key,
                                    std::shared_ptr<const RnnDescriptors>* out);

// The key of a configuration given as the plain integers of the C entry
// points (rnn_queries.cc, layout_probe.cc); `has_seq_lengths` is false.
RnnKey MakeKey(int64_t cell_mode, int64_t num_layers, int64_t hidden_size, int64_t input_size,
               int32_t bidirectional, int32_t skip_input, int32_t batch_major,
               int32_t allow_tf32, int32_t data_type, int64_t max_seq_length,
               int64_t batch_size, int64_t algo);

// Number of gates (linear layers per side) of a cuDNN cell mode.
int NumGates(int64_t cell_mode);

}  // namespace jcr

#endif  // JAX_CUDNN_RNN_RNN_DESCRIPTORS_H_
