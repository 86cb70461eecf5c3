// Turning CUDA and cuDNN statuses into ffi::Error, never throwing.
//
// Every failing call becomes an error carrying the call's text, the library's
// message, and the file and line, as jaxlib's gpu_kernel_helpers do.
#ifndef JAX_CUDNN_RNN_STATUS_H_
#define JAX_CUDNN_RNN_STATUS_H_

#include <string>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "xla/ffi/api/ffi.h"

namespace jcr {

inline std::string CallFailed(const char* call, const char* what, const char* file, int line) {
  return std::string(call) + " failed: " + what + " (" + file + ":" + std::to_string(line) + ")";
}

}  // namespace jcr

// Returns an ffi::Error from the enclosing function if a cuDNN call fails.
#define JCR_RETURN_IF_CUDNN_ERROR(expr)                                                   \
  do {                                                                                    \
    cudnnStatus_t jcr_status_ = (expr);                                                   \
    if (jcr_status_ != CUDNN_STATUS_SUCCESS) {                                            \
      return ::xla::ffi::Error::Internal(                                                 \
          ::jcr::CallFailed(#expr, cudnnGetErrorString(jcr_status_), __FILE__, __LINE__)); \
    }                                                                                     \
  } while (0)

// Returns an ffi::Error from the enclosing function if a CUDA runtime call fails.
#define JCR_RETURN_IF_CUDA_ERROR(expr)                                                    \
  do {                                                                                    \
    cudaError_t jcr_status_ = (expr);                                                     \
    if (jcr_status_ != cudaSuccess) {                                                     \
      return ::xla::ffi::Error::Internal(                                                 \
          ::jcr::CallFailed(#expr, cudaGetErrorString(jcr_status_), __FILE__, __LINE__)); \
    }                                                                                     \
  } while (0)

// Propagates a failed ffi::Error.
#define JCR_RETURN_IF_ERROR(expr)                     \
  do {                                                \
    ::xla::ffi::Error jcr_error_ = (expr);            \
    if (jcr_error_.failure()) return jcr_error_;      \
  } while (0)

#endif  // JAX_CUDNN_RNN_STATUS_H_
