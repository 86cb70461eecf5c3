// cuDNN handles pooled per CUDA stream.
//
// Creating a cuDNN handle is expensive (milliseconds), so handlers borrow one
// bound to their stream and give it back when the borrow goes out of scope.
// A handle is only ever used by one borrower at a time.
#ifndef JAX_CUDNN_RNN_HANDLE_POOL_H_
#define JAX_CUDNN_RNN_HANDLE_POOL_H_

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "xla/ffi/api/ffi.h"

namespace jcr {

class BorrowedHandle {
 public:
  BorrowedHandle() = default;
  BorrowedHandle(const BorrowedHandle&) = delete;
  BorrowedHandle& operator=(const BorrowedHandle&) = delete;
  ~BorrowedHandle();

  cudnnHandle_t get() const { return handle_; }

  // Borrows a handle bound to `stream` into `*out`.
  static ::xla::ffi::Error Borrow(cudaStream_t stream, BorrowedHandle* out);

 private:
  cudaStream_t stream_ = nullptr;
  cudnnHandle_t handle_ = nullptr;
};

}  // namespace jcr

#endif  // JAX_CUDNN_RNN_HANDLE_POOL_H_
