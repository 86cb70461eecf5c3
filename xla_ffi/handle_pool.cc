#include "handle_pool.h"

#include <mutex>
#include <unordered_map>
#include <vector>

#include "status.h"

namespace jcr {
namespace {

struct Pool {
  std::mutex mu;
  std::unordered_map<cudaStream_t, std::vector<cudnnHandle_t>> free_handles;
};

Pool& GetPool() {
  // Leaked on purpose: handles may still be returned during process teardown.
  static Pool* pool = new Pool();
  return *pool;
}

}  // namespace

::xla::ffi::Error BorrowedHandle::Borrow(cudaStream_t stream, BorrowedHandle* out) {
  Pool& pool = GetPool();
  cudnnHandle_t handle = nullptr;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    std::vector<cudnnHandle_t>& handles = pool.free_handles[stream];
    if (!handles.empty()) {
      handle = handles.back();
      handles.pop_back();
    }
  }
  if (handle == nullptr) {
    JCR_RETURN_IF_CUDNN_ERROR(cudnnCreate(&handle));
    cudnnStatus_t status = cudnnSetStream(handle, stream);
    if (status != CUDNN_STATUS_SUCCESS) {
      cudnnDestroy(handle);
      JCR_RETURN_IF_CUDNN_ERROR(status);
    }
  }
  out->stream_ = stream;
  out->handle_ = handle;
  return ::xla::ffi::Error::Success();
}

BorrowedHandle::~BorrowedHandle() {
  if (handle_ == nullptr) return;
  Pool& pool = GetPool();
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.free_handles[stream_].push_back(handle_);
}

}  // namespace jcr
