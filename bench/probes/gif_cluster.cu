// Issue 53, target 2, the second bare calibration (bench/probes/gif_cluster.py builds and times it): GRPO's
// gradient in the forward with each row held on chip by a thread-block cluster.
//
// A row of V bf16 logits is cut into CL equal slices, one CTA of the cluster each. A CTA copies its slice into
// shared memory with bulk asynchronous copies (cp.async.bulk, completion counted on an mbarrier: the whole slice in
// flight at once), reduces it to (max, sum-exp), publishes the pair in its shared memory, and after a cluster barrier
// reads its peers' pairs through distributed shared memory. With the row's log-sum-exp it writes its slice's gradient
// from shared memory: one read of the logits from HBM and one write of the gradient, the 2-pass floor's bytes.
// (quack's cross-entropy keeps a row on chip across a cluster the same way; this is not its code.)
//
//   lse = logsumexp(x / t),  logp = x_y / t - lse,  coef = -exp(logp - r) * a   (GRPO's ratio term)
//   grad_j = coef * (1[j = y] - exp(x_j / t - lse)) / t
//
// One kernel per (CL, THREADS), extern "C" so that the probe finds it by name; launched with grid (CL, N): the
// cluster dimension is compiled in (__cluster_dims__), so a plain cuLaunchKernel launches clusters. Requirements the
// probe checks on the host: V % (8 * CL) == 0 (16-byte vectors, 16-byte aligned slices), slice bytes <= 227 KiB.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace cg = cooperative_groups;

namespace {

constexpr unsigned kCopyBytes = 32768;  // one bulk copy (several per slice, all on the same mbarrier)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the init, before the async proxy uses it
}

__device__ __forceinline__ void mbar_expect(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}

__device__ __forceinline__ bool mbar_try(uint64_t* bar, unsigned phase) {
  unsigned done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(phase)
      : "memory");
  return done;
}

__device__ __forceinline__ void store_stream(uint4* p, uint4 v) {  // evict-first: the gradient is not read again
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

__device__ __forceinline__ void unpack(uint4 v, float inv_t, float f[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 t = __bfloat1622float2(h[k]);
    f[2 * k] = t.x * inv_t;
    f[2 * k + 1] = t.y * inv_t;
  }
}

__device__ __forceinline__ void combine(float& m, float& s, float m2, float s2) {  // (max, sum-exp) pairs
  const float nm = fmaxf(m, m2);
  s = (m == -INFINITY ? 0.f : s * __expf(m - nm)) + (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - nm));
  m = nm;
}

template <int CL, int THREADS>
__device__ __forceinline__ void gif_cluster(const __nv_bfloat16* __restrict__ x, const int* __restrict__ y,
                                            const float* __restrict__ r, float adv, __nv_bfloat16* __restrict__ out,
                                            float* __restrict__ logp_out, int V, float inv_t) {
  extern __shared__ __align__(128) unsigned char slice[];
  __shared__ uint64_t bar;
  __shared__ float2 part;  // this CTA's (max, sum-exp): its peers read it through distributed shared memory
  __shared__ float warp_m[THREADS / 32], warp_s[THREADS / 32];
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.y;
  const int S = V / CL;  // elements in this CTA's slice
  const int64_t first = row * V + static_cast<int64_t>(rank) * S;
  const unsigned bytes = static_cast<unsigned>(S) * 2u;

  if (threadIdx.x == 0) {
    mbar_init(&bar);
    mbar_expect(&bar, bytes);
    const char* src = reinterpret_cast<const char*>(x + first);
    for (unsigned off = 0; off < bytes; off += kCopyBytes)
      bulk_load(slice + off, src + off, min(kCopyBytes, bytes - off), &bar);
  }
  __syncthreads();  // the barrier's init before anyone waits on it
  while (!mbar_try(&bar, 0)) {
  }

  const uint4* v = reinterpret_cast<const uint4*>(slice);
  const int nvec = S / 8;
  float m = -INFINITY, s = 0.f;
  for (int i = threadIdx.x; i < nvec; i += THREADS) {
    float f[8];
    unpack(v[i], inv_t, f);
    float mv = f[0];
#pragma unroll
    for (int k = 1; k < 8; ++k) mv = fmaxf(mv, f[k]);
    const float nm = fmaxf(m, mv);
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < 8; ++k) acc += __expf(f[k] - nm);
    s = (m == -INFINITY ? 0.f : s * __expf(m - nm)) + acc;
    m = nm;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) combine(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
  if ((threadIdx.x & 31) == 0) {
    warp_m[threadIdx.x >> 5] = m;
    warp_s[threadIdx.x >> 5] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = warp_m[0], bs = warp_s[0];
    for (int w = 1; w < THREADS / 32; ++w) combine(bm, bs, warp_m[w], warp_s[w]);
    part = make_float2(bm, bs);
  }
  cluster.sync();  // every CTA's pair is published
  float gm = -INFINITY, gs = 0.f;
#pragma unroll
  for (int k = 0; k < CL; ++k) {
    const float2 p = *cluster.map_shared_rank(&part, k);
    combine(gm, gs, p.x, p.y);
  }
  const float lse = gm + __logf(gs);
  const int label = y[row];
  const float logp = __bfloat162float(x[row * V + label]) * inv_t - lse;
  const float c = -__expf(logp - r[row]) * adv * inv_t;
  if (rank == 0 && threadIdx.x == 0) logp_out[row] = logp;
  const int at = label - rank * S;  // the label's index in this slice, if it is here

  uint4* dst = reinterpret_cast<uint4*>(out + first);
  for (int i = threadIdx.x; i < nvec; i += THREADS) {
    float f[8];
    unpack(v[i], inv_t, f);
    uint4 o;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int j = 8 * i + 2 * k;
      const float g0 = c * ((j == at ? 1.f : 0.f) - __expf(f[2 * k] - lse));
      const float g1 = c * ((j + 1 == at ? 1.f : 0.f) - __expf(f[2 * k + 1] - lse));
      h[k] = __floats2bfloat162_rn(g0, g1);
    }
    store_stream(dst + i, o);
  }
  cluster.sync();  // no CTA leaves while a peer may still read its `part`
}

}  // namespace

#define HK_GIF_CLUSTER(CL, T)                                                                                     \
  extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(T)                                      \
      gif_cluster_##CL##_##T(const __nv_bfloat16* x, const int* y, const float* r, float adv, __nv_bfloat16* out, \
                             float* logp, int V, float inv_t) {                                                   \
    gif_cluster<CL, T>(x, y, r, adv, out, logp, V, inv_t);                                                        \
  }

HK_GIF_CLUSTER(1, 512)
HK_GIF_CLUSTER(2, 256)
HK_GIF_CLUSTER(2, 512)
HK_GIF_CLUSTER(2, 1024)
HK_GIF_CLUSTER(4, 256)
HK_GIF_CLUSTER(4, 512)
HK_GIF_CLUSTER(8, 256)
HK_GIF_CLUSTER(8, 512)
