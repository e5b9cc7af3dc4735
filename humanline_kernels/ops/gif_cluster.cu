// GRPO's gradient in the forward on sm_90: each logits row held on chip by a thread-block cluster
// (ops/cluster.py builds this with NVRTC at first use and launches it; docs/kernels.md, "GRPO gradient in forward").
//
// A row of V logits is cut into CL slices of `slice` elements (a multiple of 16 bytes), one CTA of the cluster
// each. A CTA copies its slice into shared memory with bulk asynchronous copies (cp.async.bulk, all on one
// mbarrier: the whole slice in flight at once), reduces it to (max, sum of 2^(x c - max c)) and publishes that pair,
// and the label's logit if the label falls in its slice, in its shared memory. After a cluster barrier every CTA
// reads its peers' pairs through distributed shared memory and has the row's log-sum-exp; thread 0 of each CTA
// then computes the token's GRPO terms (the same numbers in every CTA: same inputs, same instructions), CTA 0
// writes them to the [B, T] planes, and every CTA writes its slice's gradient from shared memory. Bytes: one read
// of the logits and one write of the gradient (the 2-pass floor), no global round trip for the exchange. In place
// (g == x) is safe: a CTA overwrites only its own slice, after it has read all of it, and the label's logit is
// exchanged through shared memory, never re-read from global memory.
//
// The math follows the Triton device functions of ops/common.py one-to-one (cited at each step): row_stats and
// stats_step (the softmax statistics), row_logp, row_terms (MODE 2: GRPO's terms), grad_row and row_grad_store
// (the gradient). The GPU tests (tests/ops/test_gif_cluster.py) hold both to hk.reference.
//
// No #include: NVRTC compiles this with its built-in declarations only (a user's machine has no CUDA headers).
// ops/cluster.py appends the entry point of one configuration (HK_GIF_CLUSTER) and static_asserts of the Params
// layout against its ctypes mirror.

typedef long long hk_i64;
typedef unsigned int hk_u32;
typedef unsigned long long hk_u64;

// One launch's arguments, passed by value (ops/cluster.py's ctypes `Params` mirrors it field for field).
struct Params {
  const void* x;          // logits, row r at (r / T) * x_sb + (r % T) * x_st elements
  void* g;                // the gradient, same dtype (may be x: in place)
  const hk_i64* y;        // labels [B, T] (strides y_sb, y_st)
  const hk_i64* tok;      // token map (a packed batch: row r is token tok[r]) or null
  const float* ref;       // reference log-probs [B, T] contiguous
  const float* klref;     // the KL reference's (used when has_kl_ref)
  const float* adv;       // advantages, [B] (adv_st 0) or [B, T]
  const float* w;         // row weights w[b] = d loss / d val (the weights-only finalize's)
  float* val;             // [B, T] planes at token q: the term, its derivative, the log-sum-exp
  float* coef;
  float* lse;
  float* aux;             // [5, plane]: in band, low clip, high clip, k3, log-prob
  hk_i64 x_sb, x_st, g_sb, g_st, y_sb, y_st, adv_sb, adv_st;
  hk_i64 plane;           // aux's plane stride
  hk_i64 Q;               // tokens: a map entry is clamped into [0, Q)
  hk_i64 ignore_index;
  int T, V, slice;        // tokens a sequence (row split), vocabulary, elements a CTA
  int has_tok, clip, has_kl_ref;
  float inv_temperature, log_eps_p, log_eps_r, ratio_low, ratio_high, beta;
};

namespace {

constexpr float kLog2e = 1.4426950408889634f;  // common.py LOG2E
constexpr float kLn2 = 0.6931471805599453f;     // common.py LN2
constexpr float kNoShift = -3.4028234663852886e38f;  // common.py NO_SHIFT: the shift of a group of -inf
constexpr hk_u32 kCopyBytes = 32768;            // one bulk copy (a slice is several, all on one mbarrier)

struct alignas(16) Vec16 {
  hk_u32 w[4];
};

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }
__device__ __forceinline__ float nan_f() { return __int_as_float(0x7fffffffu); }

// common.py exp2_ftz: ex2.approx.ftz.f32 (the softmax sweep's terms)
__device__ __forceinline__ float ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// tl.exp2 (row_grad_store keeps denormal results) and tl.exp (x log2(e) into ex2), as Triton lowers them for fp32
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float exp_(float x) { return ex2(x * kLog2e); }

// tl.maximum / tl.minimum with propagate_nan=ALL (common.py clamp: NaN stays NaN, as torch.clamp)
__device__ __forceinline__ float max_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
__device__ __forceinline__ float min_nan(float a, float b) {
  float y;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}
__device__ __forceinline__ float clamp(float x, float lo, float hi) { return min_nan(max_nan(x, lo), hi); }

// common.py stats_step: the shift a running max is taken against (k = m c; -FLT_MAX while m is -inf, so that
// exp2 gives 0, not NaN)
__device__ __forceinline__ float shift(float m, float c) { return m == neg_inf() ? kNoShift : m * c; }

// Two (max, sum of 2^(x c - shift(max))) pairs into one, each sum rescaled by the change of its shift
// (stats_step's alpha; row_stats' final rescale of the groups to the row's shift)
__device__ __forceinline__ void combine(float& m, float& d, float m2, float d2, float c) {
  const float mn = fmaxf(m, m2);
  const float kn = shift(mn, c);
  d = d * ex2_ftz(shift(m, c) - kn) + d2 * ex2_ftz(shift(m2, c) - kn);
  m = mn;
}

// ---------------------------------------------------------------- elements: 16 bytes as floats and back
template <int DT> struct Elem;
template <> struct Elem<0> {  // bf16
  static constexpr int kVec = 8;
  static __device__ __forceinline__ void unpack(const Vec16& v, float* f) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(v.w[k] << 16);
      f[2 * k + 1] = __uint_as_float(v.w[k] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ void pack(const float* f, Vec16& v) {  // round to nearest even
#pragma unroll
    for (int k = 0; k < 4; ++k) asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(v.w[k]) : "f"(f[2 * k + 1]), "f"(f[2 * k]));
  }
  static __device__ __forceinline__ float load(const void* p) {
    return __uint_as_float(static_cast<hk_u32>(*static_cast<const unsigned short*>(p)) << 16);
  }
};
template <> struct Elem<1> {  // fp16
  static constexpr int kVec = 8;
  static __device__ __forceinline__ float half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  static __device__ __forceinline__ void unpack(const Vec16& v, float* f) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = half_to_float(static_cast<unsigned short>(v.w[k] & 0xffffu));
      f[2 * k + 1] = half_to_float(static_cast<unsigned short>(v.w[k] >> 16));
    }
  }
  static __device__ __forceinline__ void pack(const float* f, Vec16& v) {
#pragma unroll
    for (int k = 0; k < 4; ++k) asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(v.w[k]) : "f"(f[2 * k + 1]), "f"(f[2 * k]));
  }
  static __device__ __forceinline__ float load(const void* p) {
    return half_to_float(*static_cast<const unsigned short*>(p));
  }
};
template <> struct Elem<2> {  // fp32
  static constexpr int kVec = 4;
  static __device__ __forceinline__ void unpack(const Vec16& v, float* f) {
#pragma unroll
    for (int k = 0; k < 4; ++k) f[k] = __uint_as_float(v.w[k]);
  }
  static __device__ __forceinline__ void pack(const float* f, Vec16& v) {
#pragma unroll
    for (int k = 0; k < 4; ++k) v.w[k] = __float_as_uint(f[k]);
  }
  static __device__ __forceinline__ float load(const void* p) { return *static_cast<const float*>(p); }
};

// ---------------------------------------------------------------- sm_90 primitives (PTX)
__device__ __forceinline__ hk_u32 smem_addr(const void* p) {
  return static_cast<hk_u32>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ hk_u32 cluster_rank() {
  hk_u32 r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_arrive() { asm volatile("barrier.cluster.arrive.release;" ::: "memory"); }
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire;" ::: "memory"); }
__device__ __forceinline__ float peer_load(const float* local, hk_u32 rank) {  // distributed shared memory
  hk_u32 remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(smem_addr(local)), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
__device__ __forceinline__ void mbar_init(hk_u64* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");  // the init, before the async proxy uses it
}
__device__ __forceinline__ void mbar_expect(hk_u64* bar, hk_u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, hk_u32 bytes, hk_u64* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}
__device__ __forceinline__ bool mbar_try(hk_u64* bar, hk_u32 phase) {
  hk_u32 done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(phase)
               : "memory");
  return done != 0;
}
__device__ __forceinline__ void store_stream(void* p, const Vec16& v) {  // .cs: the gradient is not read again here
  asm volatile("st.global.cs.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.w[0]), "r"(v.w[1]), "r"(v.w[2]),
               "r"(v.w[3])
               : "memory");
}

// The token's inputs, loaded by one thread while the slice is in flight, and what thread 0 hands every thread
struct Token {
  hk_i64 q, y;
  float ref, klref, adv, w;
};
struct Row {
  float lse, gs;  // log-sum-exp of z = x / T; the gradient's scale w coef / T (0 for an ignored token)
  int at;         // the label's column in this slice, or -1
  int valid;
};

// common.py row_terms, MODE 2 (GRPO), one-to-one; returns coef and writes the planes when `write` (CTA 0)
__device__ __forceinline__ float grpo_terms(const Params& p, const Token& k, bool valid, float logp, float lse,
                                            bool write) {
  const float delta = logp - k.ref;
  float dh;
  bool inside, dpass;
  if (p.clip) {
    dh = clamp(delta, p.log_eps_p, p.log_eps_r);
    inside = valid && (delta > p.log_eps_p) && (delta < p.log_eps_r);
    dpass = (delta >= p.log_eps_p) && (delta <= p.log_eps_r);
  } else {
    dh = delta;
    inside = valid;
    dpass = valid;
  }
  dh = valid ? dh : 0.f;
  const float a = k.adv;
  const float rho = exp_(dh);
  const float a1 = a * rho;
  const float a2 = a * clamp(rho, p.ratio_low, p.ratio_high);
  const float u = -min_nan(a1, a2);
  const float du = ((a1 <= a2) && dpass) ? -a1 : 0.f;
  const float lkl = p.has_kl_ref ? k.klref : k.ref;
  const float x = valid ? lkl - logp : 0.f;
  const float ex = exp_(x);
  const float k3 = ex - x - 1.f;
  // beta == 0 must not turn an infinite k3 into NaN (the reference drops the term then)
  const float val = valid ? (p.beta != 0.f ? u + p.beta * k3 : u) : 0.f;
  const float coef = valid ? (p.beta != 0.f ? du + p.beta * (1.f - ex) : du) : 0.f;
  if (write) {
    const hk_i64 q = k.q;
    p.aux[q] = inside ? 1.f : 0.f;
    p.aux[p.plane + q] = (valid && (rho < p.ratio_low) && (a < 0.f)) ? 1.f : 0.f;
    p.aux[2 * p.plane + q] = (valid && (rho > p.ratio_high) && (a > 0.f)) ? 1.f : 0.f;
    p.aux[3 * p.plane + q] = k3;
    p.aux[4 * p.plane + q] = logp;
    p.val[q] = val;
    p.coef[q] = coef;
    p.lse[q] = lse;
  }
  return coef;
}

template <int DT, int CL, int THREADS>
__device__ __forceinline__ void gif_cluster(const Params& p) {
  using E = Elem<DT>;
  constexpr int kVec = E::kVec;
  constexpr int kSize = 16 / kVec;  // bytes an element
  constexpr int kWarps = THREADS / 32;
  extern __shared__ __align__(128) unsigned char slice[];
  __shared__ hk_u64 bar;
  __shared__ float part[3];  // (max, sum, the label's logit if it is in this slice): read by the peers
  __shared__ float warp_m[kWarps], warp_d[kWarps];
  __shared__ Token tok;
  __shared__ Row row;

  const hk_u32 rank = cluster_rank();
  const hk_i64 r = blockIdx.x / CL;  // the logits row
  const int V = p.V;
  const int lo = min(static_cast<int>(rank) * p.slice, V);  // this CTA's columns [lo, lo + n)
  const int n = min(p.slice, V - lo);
  // common.py row_base / split_token: (b, t) = (r // T, r % T) in int32, the offsets in int64
  const int rb = static_cast<int>(r) / p.T, rt = static_cast<int>(r) - rb * p.T;
  const char* src = static_cast<const char*>(p.x) + (rb * p.x_sb + rt * p.x_st + lo) * kSize;
  char* dst = static_cast<char*>(p.g) + (rb * p.g_sb + rt * p.g_st + lo) * kSize;

  if (threadIdx.x == 0) {
    mbar_init(&bar);
    const hk_u32 bytes = static_cast<hk_u32>(n) * kSize;
    mbar_expect(&bar, bytes);
    for (hk_u32 off = 0; off < bytes; off += kCopyBytes) bulk_load(slice + off, src + off, min(kCopyBytes, bytes - off), &bar);
  } else if (threadIdx.x == 32) {  // the token's inputs while the slice is in flight (common.py row_token)
    hk_i64 q = r;
    if (p.has_tok) q = max(static_cast<hk_i64>(0), min(p.tok[r], p.Q - 1));
    const int qb = static_cast<int>(q) / p.T, qt = static_cast<int>(q) - qb * p.T;
    tok.q = q;
    tok.y = p.y[qb * p.y_sb + qt * p.y_st];
    tok.ref = p.ref[q];
    tok.klref = p.klref[q];
    tok.adv = p.adv[qb * p.adv_sb + qt * p.adv_st];
    tok.w = p.w[qb];
  }
  __syncthreads();  // the barrier's init before anyone waits on it; tok for thread 0 later
  while (!mbar_try(&bar, 0)) {
  }

  // common.py row_stats / stats_step: the raw logits x with 1/T and log2(e) folded into c; per thread a running
  // max m and sum d of 2^(x c - m c), rescaled by 2^(k_old - k_new) when the max grows
  const float inv_t = p.inv_temperature;
  const float c = inv_t * kLog2e;
  const Vec16* v = reinterpret_cast<const Vec16*>(slice);
  const int nvec = n / kVec;
  float m = neg_inf(), d = 0.f;
  for (int i = threadIdx.x; i < nvec; i += THREADS) {
    float f[kVec];
    E::unpack(v[i], f);
    float mv = f[0];
#pragma unroll
    for (int e = 1; e < kVec; ++e) mv = fmaxf(mv, f[e]);
    const float m_new = fmaxf(m, mv);
    const float k_new = shift(m_new, c);
    float acc = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc += ex2_ftz(fmaf(f[e], c, -k_new));
    d = d * ex2_ftz(shift(m, c) - k_new) + acc;
    m = m_new;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) combine(m, d, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, d, o), c);
  if ((threadIdx.x & 31) == 0) {
    warp_m[threadIdx.x >> 5] = m;
    warp_d[threadIdx.x >> 5] = d;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float bm = warp_m[0], bd = warp_d[0];
    for (int w = 1; w < kWarps; ++w) combine(bm, bd, warp_m[w], warp_d[w], c);
    part[0] = bm;
    part[1] = bd;
    // common.py row_logp: the label's logit, read only when the label is valid and in [0, V); from this slice
    const hk_i64 y = tok.y;
    part[2] = (y >= lo && y < lo + n) ? E::load(slice + (y - lo) * kSize) : 0.f;
  }
  cluster_arrive();  // every CTA's pair is published
  cluster_wait();
  if (threadIdx.x == 0) {
    // row_stats' end: the pairs against the row's shift kr = fp32(mx c); lse = mx / T + (log2 dsum - (mx c - kr)) ln 2
    float mx = neg_inf();
    float pm[CL], pd[CL];
#pragma unroll
    for (int k = 0; k < CL; ++k) {
      pm[k] = peer_load(&part[0], k);
      pd[k] = peer_load(&part[1], k);
      mx = fmaxf(mx, pm[k]);
    }
    const float kr = mx == neg_inf() ? 0.f : mx * c;
    float dsum = 0.f;
#pragma unroll
    for (int k = 0; k < CL; ++k) dsum += pd[k] * ex2_ftz(shift(pm[k], c) - kr);
    const float lse = mx * inv_t + (log2f(dsum) - (mx == neg_inf() ? 0.f : fmaf(mx, c, -kr))) * kLn2;
    // row_logp: logp = z_y - lse, 0 where ignored, NaN for a label outside [0, V)
    const Token k = tok;
    const bool valid = k.y != p.ignore_index;
    const bool in_vocab = k.y >= 0 && k.y < V;
    float logp = 0.f;
    if (valid) logp = in_vocab ? peer_load(&part[2], static_cast<hk_u32>(k.y / p.slice)) * inv_t - lse : nan_f();
    const float coef = grpo_terms(p, k, valid, logp, lse, rank == 0);
    // grad_row (ROW_WEIGHT): g = coef w[b]; row_grad_store: gs = g / T, the one-hot at the label's column
    row.lse = lse;
    row.gs = coef * k.w * inv_t;
    row.at = (valid && in_vocab && k.y >= lo && k.y < lo + n) ? static_cast<int>(k.y - lo) : -1;
    row.valid = valid;
  }
  __syncthreads();
  cluster_arrive();  // done reading the peers' shared memory (each waits for this before it exits)

  // common.py row_grad_store: g (onehot(y) - 2^((x / T - lse) log2(e))) / T, the FFMA then the multiply before
  // exp2 (denormal results kept); grad_row: zeros where ignored
  const float lse = row.lse, gs = row.gs;
  const int at = row.at;
  const bool valid = row.valid != 0;
  for (int i = threadIdx.x; i < nvec; i += THREADS) {
    float f[kVec];
    Vec16 o;
    if (valid) {
      E::unpack(v[i], f);
#pragma unroll
      for (int e = 0; e < kVec; ++e)
        f[e] = fmaf(-gs, ex2(fmaf(f[e], inv_t, -lse) * kLog2e), (i * kVec + e == at) ? gs : 0.f);
      E::pack(f, o);
    } else {
      o.w[0] = o.w[1] = o.w[2] = o.w[3] = 0u;
    }
    store_stream(dst + static_cast<hk_i64>(i) * 16, o);
  }
  cluster_wait();  // no CTA leaves while a peer may still read its `part`
}

}  // namespace

// One entry point a configuration: dtype (0 bf16, 1 fp16, 2 fp32), CTAs a cluster, threads a CTA. The cluster
// dimension is compiled in, so a plain cuLaunchKernel with grid (CL * rows) launches clusters.
#define HK_GIF_CLUSTER(DT, CL, THREADS)                                                              \
  extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(THREADS)                  \
      hk_gif_cluster_##DT##_##CL##_##THREADS(const __grid_constant__ Params p) {                    \
    gif_cluster<DT, CL, THREADS>(p);                                                                 \
  }
