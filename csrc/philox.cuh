// Philox4x32-10 and the per-token Gumbel noise of docs/semantics.md ("Random numbers").
// Bit-identical words to server/tokensampler_server/backends/philox.py; the same u -> g evaluation.
// Framework-free device code: every kernel that samples includes this one file.
#pragma once
#include <cstdint>

namespace tokensampler {

constexpr uint32_t kPhiloxM0 = 0xD2511F53u;
constexpr uint32_t kPhiloxM1 = 0xCD9E8D57u;
constexpr uint32_t kPhiloxW0 = 0x9E3779B9u;
constexpr uint32_t kPhiloxW1 = 0xBB67AE85u;

// How a Philox round forms its two 32 x 32 -> 64-bit products; the words are the same either way.
// kWide: one 64-bit product each, for which ptxas adds a zero to the high word (an instruction a product);
// kSplit: __umulhi and a 32-bit product, without that add. The split form fits frontier_kernel in 48 registers
// (five blocks a SM, top-p 3-6 % faster from B = 64), but makes ptxas spill in the Gumbel kernels, where results were
// mixed: they keep the wide form (docs/design/logits-kernels.md).
enum class PhiloxProducts { kWide, kSplit };

// Philox4x32-10 (Salmon et al., 2011): counter (c.x, c.y, c.z, c.w), key (k0, k1).
template <PhiloxProducts kProducts = PhiloxProducts::kWide>
__host__ __device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint32_t k0, uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
#ifdef __CUDA_ARCH__
    if constexpr (kProducts == PhiloxProducts::kSplit) {
      c = make_uint4(__umulhi(kPhiloxM1, c.z) ^ c.y ^ k0, kPhiloxM1 * c.z, __umulhi(kPhiloxM0, c.x) ^ c.w ^ k1,
                     kPhiloxM0 * c.x);
      continue;
    }
#endif
    const uint64_t p0 = static_cast<uint64_t>(kPhiloxM0) * c.x;
    const uint64_t p1 = static_cast<uint64_t>(kPhiloxM1) * c.z;
    c = make_uint4(static_cast<uint32_t>(p1 >> 32) ^ c.y ^ k0, static_cast<uint32_t>(p1),
                   static_cast<uint32_t>(p0 >> 32) ^ c.w ^ k1, static_cast<uint32_t>(p0));
  }
  return c;
}

// The noise stream of one row and one sample: token i uses word i mod 4 of counter (i div 4, ...).
template <PhiloxProducts kProducts = PhiloxProducts::kWide>
struct BasicNoiseStream {
  uint32_t k0, k1, position, iteration, sample;

  __host__ __device__ __forceinline__ static BasicNoiseStream make(int64_t seed, int64_t position,
                                                                  int64_t iteration, uint32_t sample) {
    const uint64_t s = static_cast<uint64_t>(seed);
    return BasicNoiseStream{static_cast<uint32_t>(s), static_cast<uint32_t>(s >> 32),
                            static_cast<uint32_t>(position), static_cast<uint32_t>(iteration), sample};
  }
  // The same stream, its words computed with product form kOther.
  template <PhiloxProducts kOther>
  __host__ __device__ __forceinline__ BasicNoiseStream<kOther> with_products() const {
    return BasicNoiseStream<kOther>{k0, k1, position, iteration, sample};
  }
  // The four words of tokens 4g .. 4g+3.
  __host__ __device__ __forceinline__ uint4 group(uint32_t g) const {
    return philox4x32_10<kProducts>(make_uint4(g, position, iteration, sample), k0, k1);
  }
  __host__ __device__ __forceinline__ uint32_t word(uint32_t token) const {
    const uint4 w = group(token >> 2);
    const uint32_t j = token & 3u;
    return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
  }
};

using NoiseStream = BasicNoiseStream<>;

__host__ __device__ __forceinline__ uint32_t word_of(const uint4& w, int j) {
  return j == 0 ? w.x : j == 1 ? w.y : j == 2 ? w.z : w.w;
}

#ifdef __CUDACC__
// g = -log(-log(u)), u = ((word >> 8) + 0.5) * 2^-24, in fp32 with correctly rounded-ish libm calls
// (logf / log1pf, never the fast intrinsics): the value every sampling decision is made on.
// Upper half (u >= 1/2): -log(u) = -log1p(-(1 - u)) from the exact fp32 value of 1 - u.
__device__ __forceinline__ float gumbel_exact(uint32_t word) {
  const uint32_t b = word >> 8;
  float neg_log_u;
  if (b >= (1u << 23)) {
    const float one_minus_u = __fmul_rn(__fsub_rn(static_cast<float>((1u << 24) - b), 0.5f), 0x1p-24f);
    neg_log_u = -log1pf(-one_minus_u);
  } else {
    const float u = __fmul_rn(__fadd_rn(static_cast<float>(b), 0.5f), 0x1p-24f);
    neg_log_u = -logf(u);
  }
  return -logf(neg_log_u);
}

// An upper bound of gumbel_exact(word) from integer operations only. Lower half (u < 1/2):
// g < -log(-log(1/2)) = 0.36651. Upper half: v = 1 - u = m 2^-25 with m odd, -log(u) > v, so
// g < -log(v) <= (25 - floor(log2 m)) ln 2. The 2e-5 covers the rounding of gumbel_exact.
__device__ __forceinline__ float gumbel_upper_bound(uint32_t word) {
  const uint32_t b = word >> 8;
  if (b < (1u << 23)) return 0.36653f;
  const uint32_t m = (1u << 25) - 2 * b - 1;
  return static_cast<float>(__clz(m) - 6) * 0.69314718f + 2e-5f;
}

// A cheap estimate of gumbel_exact with a bounded error (|error| < kGumbelFastError): used only to
// rank tokens; any decision closer than the error bound is re-made with gumbel_exact.
// Lower half: __log2f has at most 2 ulp error away from [0.5, 2] (u < 1/2 here). Upper half: a
// degree-6 fit of -log1p(-v)/v on [0, 1/2] (relative error 2.4e-6 in fp32). Outer log: __log2f,
// absolute error <= 2^-22 on [0.5, 2] and 2 ulp of |log2 E| <= 25 elsewhere. Total < 6e-6.
constexpr float kGumbelFastError = 1e-5f;

__device__ __forceinline__ float gumbel_fast(uint32_t word) {
  const uint32_t b = word >> 8;
  const float bf = static_cast<float>(b);  // exact; one conversion serves both halves
  const float u = (bf + 0.5f) * 0x1p-24f;
  const float v = (16777216.0f - bf - 0.5f) * 0x1p-24f;  // exact where b >= 2^23
  float q = 0.9799812436103821f;
  q = fmaf(q, v, -0.6320682168006897f);
  q = fmaf(q, v, 0.526207447052002f);
  q = fmaf(q, v, 0.18438094854354858f);
  q = fmaf(q, v, 0.3396669328212738f);
  q = fmaf(q, v, 0.4997529983520508f);
  q = fmaf(q, v, 1.0000022649765015f);
  const float e = b >= (1u << 23) ? v * q : -0.6931471805599453f * __log2f(u);
  return -0.6931471805599453f * __log2f(e);
}
#endif

}  // namespace tokensampler
