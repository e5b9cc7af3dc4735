// Multi-tensor copy/cast kernel for the humanline reference sync (torch-free; instantiated in
// multi_tensor_copy_kernel.cu, bound in multi_tensor_copy.cpp). One launch copies up to kMaxTensors tensors: the
// tensor table travels in the kernel parameter space (32 KiB since CUDA 12.1, 4 KiB before), each block copies one
// fixed-size chunk of one tensor with 16-byte loads, and casts fp32/bf16/fp16 on the fly (round to nearest even, as
// torch's copy_ does).
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace hk_sync {

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxTensors = 320;  // ~9.3 KiB of kernel parameters
#else
constexpr int kMaxTensors = 96;   // fits the classic 4 KiB limit
#endif

#if defined(__CUDACC_VER_MAJOR__) && (__CUDACC_VER_MAJOR__ > 11 || (__CUDACC_VER_MAJOR__ == 11 && __CUDACC_VER_MINOR__ >= 7))
#define HK_GRID_CONSTANT __grid_constant__  // index the table in place instead of copying it to local memory
#else
#define HK_GRID_CONSTANT
#endif

constexpr int kThreads = 256;
constexpr int kIters = 4;  // 16-byte vectors in flight per thread

struct CopyArgs {
  const void* src[kMaxTensors];
  void* dst[kMaxTensors];
  int64_t numel[kMaxTensors];
  int block_start[kMaxTensors + 1];  // prefix sum of chunks: tensor t owns blocks [block_start[t], block_start[t+1])
  unsigned char aligned[kMaxTensors];  // both pointers aligned for the vector path
  int n;
};

// Element types as raw bits, so a same-dtype copy is bit-exact (NaN payloads included).
struct F32 {
  using raw = float;
  static __device__ __forceinline__ float to_f(raw x) { return x; }
  static __device__ __forceinline__ raw from_f(float x) { return x; }
};
struct BF16 {
  using raw = unsigned short;
  static __device__ __forceinline__ float to_f(raw x) { return __bfloat162float(__ushort_as_bfloat16(x)); }
  static __device__ __forceinline__ raw from_f(float x) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
};
struct F16 {
  using raw = unsigned short;
  static __device__ __forceinline__ float to_f(raw x) { return __half2float(__ushort_as_half(x)); }
  static __device__ __forceinline__ raw from_f(float x) { return __half_as_ushort(__float2half_rn(x)); }
};

template <typename S, typename D>
struct Convert {
  static __device__ __forceinline__ typename D::raw f(typename S::raw x) { return D::from_f(S::to_f(x)); }
};
template <typename T>
struct Convert<T, T> {
  static __device__ __forceinline__ typename T::raw f(typename T::raw x) { return x; }
};

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// One 16-byte source vector to target elements. A same-dtype copy moves the vector as it is: converting it element
// by element made ptxas put the vector on the stack in the tail loop (16 bytes of spill per thread).
template <typename S, typename D, int N>
__device__ __forceinline__ Vec<typename D::raw, N> convert_vec(const Vec<typename S::raw, N>& in) {
  if constexpr (std::is_same<S, D>::value) {
    return in;
  } else {
    Vec<typename D::raw, N> out;
#pragma unroll
    for (int j = 0; j < N; ++j) out.v[j] = Convert<S, D>::f(in.v[j]);
    return out;
  }
}

template <typename S>
struct Traits {
  static constexpr int kVec = 16 / sizeof(typename S::raw);  // elements per 16-byte source load
  static constexpr int64_t kChunk = int64_t(kThreads) * kVec * kIters;
};

template <typename S, typename D>
__global__ void __launch_bounds__(kThreads) multi_tensor_copy_kernel(const HK_GRID_CONSTANT CopyArgs a) {
  using SR = typename S::raw;
  using DR = typename D::raw;
  constexpr int V = Traits<S>::kVec;
  constexpr int64_t C = Traits<S>::kChunk;
  const int b = blockIdx.x;
  int lo = 0, hi = a.n - 1;  // last t with block_start[t] <= b
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (a.block_start[mid] <= b) lo = mid; else hi = mid - 1;
  }
  const int t = lo;
  const int64_t begin = int64_t(b - a.block_start[t]) * C;
  const int64_t len = a.numel[t] - begin < C ? a.numel[t] - begin : C;
  const SR* __restrict__ src = static_cast<const SR*>(a.src[t]) + begin;
  DR* __restrict__ dst = static_cast<DR*>(a.dst[t]) + begin;
  if (a.aligned[t]) {
    const Vec<SR, V>* vs = reinterpret_cast<const Vec<SR, V>*>(src);
    Vec<DR, V>* vd = reinterpret_cast<Vec<DR, V>*>(dst);
    if (len == C) {  // full chunk: issue all loads before any store
      Vec<SR, V> in[kIters];
#pragma unroll
      for (int k = 0; k < kIters; ++k) in[k] = vs[threadIdx.x + k * kThreads];
#pragma unroll
      for (int k = 0; k < kIters; ++k) vd[threadIdx.x + k * kThreads] = convert_vec<S, D, V>(in[k]);
      return;
    }
    const int64_t nvec = len / V;
    // the tail loops run at most a few times per thread: kept rolled, their unrolled same-dtype versions spilled
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < nvec; i += kThreads) vd[i] = convert_vec<S, D, V>(vs[i]);
#pragma unroll 1
    for (int64_t i = nvec * V + threadIdx.x; i < len; i += kThreads) dst[i] = Convert<S, D>::f(src[i]);
  } else {
#pragma unroll 1
    for (int64_t i = threadIdx.x; i < len; i += kThreads) dst[i] = Convert<S, D>::f(src[i]);
  }
}

// Host side: fill CopyArgs tensor by tensor and launch whenever the table is full.
template <typename S, typename D>
class Launcher {
 public:
  explicit Launcher(cudaStream_t stream) : stream_(stream) { reset(); }

  static bool aligned(const void* s, const void* d) {
    constexpr uintptr_t dv = uintptr_t(Traits<S>::kVec) * sizeof(typename D::raw);
    return reinterpret_cast<uintptr_t>(s) % 16 == 0 && reinterpret_cast<uintptr_t>(d) % dv == 0;
  }

  cudaError_t add(void* dst, const void* src, int64_t numel) {
    if (numel <= 0) return cudaSuccess;
    const int64_t chunks = (numel + Traits<S>::kChunk - 1) / Traits<S>::kChunk;
    if (a_.n == kMaxTensors || int64_t(blocks_) + chunks > int64_t(0x7fffffff)) {
      cudaError_t e = flush();
      if (e != cudaSuccess) return e;
    }
    const int i = a_.n++;
    a_.src[i] = src;
    a_.dst[i] = dst;
    a_.numel[i] = numel;
    a_.aligned[i] = aligned(src, dst) ? 1 : 0;
    a_.block_start[i] = blocks_;
    blocks_ += static_cast<int>(chunks);
    a_.block_start[i + 1] = blocks_;
    return cudaSuccess;
  }

  cudaError_t flush() {
    if (a_.n > 0) {
      multi_tensor_copy_kernel<S, D><<<blocks_, kThreads, 0, stream_>>>(a_);
      reset();
      return cudaGetLastError();
    }
    return cudaSuccess;
  }

 private:
  void reset() {
    a_.n = 0;
    blocks_ = 0;
    a_.block_start[0] = 0;
  }
  CopyArgs a_;
  int blocks_;
  cudaStream_t stream_;
};

}  // namespace hk_sync
