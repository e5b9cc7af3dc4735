// The torch-free half of the copy extension: hk_sync::copy (multi_tensor_copy.h) dispatches the (source, target)
// dtype pair to the kernel and launcher of multi_tensor_copy_kernel.cuh.
#include <vector>

#include "multi_tensor_copy.h"
#include "multi_tensor_copy_kernel.cuh"

namespace hk_sync {
namespace {

template <typename S, typename D>
cudaError_t run(void* const* dst, const void* const* src, const int64_t* numel, int64_t n, cudaStream_t stream) {
  Launcher<S, D> launcher(stream);
  for (int64_t i = 0; i < n; ++i) {
    cudaError_t e = launcher.add(dst[i], src[i], numel[i]);
    if (e != cudaSuccess) return e;
  }
  return launcher.flush();
}

template <typename S>
cudaError_t run_dst(DType dt, void* const* dst, const void* const* src, const int64_t* numel, int64_t n,
                    cudaStream_t stream) {
  switch (dt) {
    case kF32: return run<S, F32>(dst, src, numel, n, stream);
    case kBF16: return run<S, BF16>(dst, src, numel, n, stream);
    case kF16: return run<S, F16>(dst, src, numel, n, stream);
  }
  return cudaErrorInvalidValue;
}

const char* text(cudaError_t e) { return e == cudaSuccess ? nullptr : cudaGetErrorString(e); }

}  // namespace

int max_tensors_per_launch() { return kMaxTensors; }

const char* current_device(int* device) { return text(cudaGetDevice(device)); }

const char* copy(DType src_dtype, DType dst_dtype, void* const* dst, const void* const* src, const int64_t* numel,
                 int64_t n, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  switch (src_dtype) {
    case kF32: return text(run_dst<F32>(dst_dtype, dst, src, numel, n, s));
    case kBF16: return text(run_dst<BF16>(dst_dtype, dst, src, numel, n, s));
    case kF16: return text(run_dst<F16>(dst_dtype, dst, src, numel, n, s));
  }
  return text(cudaErrorInvalidValue);
}

const char* copy_engine(void* const* dst, const void* const* src, const int64_t* bytes, int64_t n, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
#if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
  // A batch may not go to the legacy default stream (cuda_runtime_api.h); the per-copy loop below may.
  if (n > 0 && s != nullptr && s != cudaStreamLegacy) {
    std::vector<size_t> sizes(bytes, bytes + n);
    cudaMemcpyAttributes attr = {};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;  // the source is read in stream order, as copy_ reads it
    attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;    // a hint: the copy engines, not the step's SMs
    size_t first = 0;                                       // one attribute for every copy
    const cudaError_t e = cudaMemcpyBatchAsync(dst, src, sizes.data(), static_cast<size_t>(n), &attr, &first, 1, s);
    if (e != cudaErrorNotSupported) return text(e);
    cudaGetLastError();  // not sticky: clear it, then copy one by one
  }
#endif
  for (int64_t i = 0; i < n; ++i) {
    const cudaError_t e = cudaMemcpyAsync(dst[i], src[i], static_cast<size_t>(bytes[i]), cudaMemcpyDeviceToDevice, s);
    if (e != cudaSuccess) return text(e);
  }
  return nullptr;
}

}  // namespace hk_sync
