// The host API of the multi-tensor copy/cast kernel, between its two translation units: the PyTorch binding
// (multi_tensor_copy.cpp: torch headers, the host compiler) and the kernels with their launcher
// (multi_tensor_copy_kernel.cu: nvcc, no torch headers). Neither torch nor CUDA types cross it, so the binding
// needs no CUDA headers and nvcc never parses torch's (that parse was most of the extension's build time).
#pragma once
#include <cstdint>

namespace hk_sync {

enum DType : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Tensors one launch holds (the kernel-parameter table's size for the CUDA version the kernels were built with).
int max_tensors_per_launch();

// The current CUDA device into *device; nullptr, or the CUDA error's text.
const char* current_device(int* device);

// dst[i] <- src[i] (numel[i] elements, cast from src_dtype to dst_dtype) for i < n, on `stream` (a cudaStream_t)
// of the current device, one launch per max_tensors_per_launch() tensors; nullptr, or the CUDA error's text.
const char* copy(DType src_dtype, DType dst_dtype, void* const* dst, const void* const* src, const int64_t* numel,
                 int64_t n, void* stream);

// dst[i] <- src[i] (bytes[i] bytes, device to device) for i < n, on `stream`, by the copy engines where the runtime
// takes the hint: one cudaMemcpyBatchAsync with cudaMemcpyFlagPreferOverlapWithCompute (CUDA >= 13), else (older
// runtimes, the legacy default stream) cudaMemcpyAsync per copy; nullptr, or the CUDA error's text.
const char* copy_engine(void* const* dst, const void* const* src, const int64_t* bytes, int64_t n, void* stream);

}  // namespace hk_sync
