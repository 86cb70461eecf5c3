// Turning CUDA and cuDNN statuses into ffi::Error, and ffi::Error into the C
// entry points' return codes, never throwing.
//
// Every failing call becomes an error carrying the call's text, the library's
// message, and the file and line, as jaxlib's gpu_kernel_helpers do.
#ifndef JAX_CUDNN_RNN_STATUS_H_
#define JAX_CUDNN_RNN_STATUS_H_

#include <cstddef>
#include <cstring>
#include <string>

#include <cuda_runtime_api.h>
#include <cudnn.h>

#include "xla/ffi/api/ffi.h"

namespace jcr {

inline std::string CallFailed(const char* call, const char* what, const char* file, int line) {
  return std::string(call) + " failed: " + what + " (" + file + ":" + std::to_string(line) + ")";
}

// For plain C entry points: 0 on success; else 1, with the message copied
// (truncated to `out_size`) into `out`.
inline int ReportToC(const ::xla::ffi::Error& error, char* out, size_t out_size) {
  if (error.success()) return 0;
  if (out != nullptr && out_size > 0) {
    std::strncpy(out, error.message().c_str(), out_size - 1);
    out[out_size - 1] = '\0';
  }
  return 1;
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
