// Shared device helpers of the sampling kernels: typed loads, order-preserving keys, reductions,
// scans and sorts in shared memory. Framework-free.
#pragma once
#include <cstdint>
#include <type_traits>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace tokensampler {

enum DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

constexpr float kInf = __builtin_huge_valf();

// Words of a token bitmask row (or a row of kept bits) over `vocab` tokens: bit i % 32 of word i / 32.
__host__ __device__ inline int64_t words_of(int64_t vocab) { return (vocab + 31) / 32; }

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ float half_bits_to_f32(uint32_t bits) {
  if constexpr (sizeof(T) == 2 && std::is_same<T, __nv_bfloat16>::value) return __uint_as_float(bits << 16);
  else return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// The largest value of the input type T below x (x itself a finite T value): the next logit a row of T can hold.
template <typename T>
__device__ __forceinline__ float next_below(float x) {
  if constexpr (std::is_same<T, float>::value) {
    return nextafterf(x, -kInf);
  } else {
    uint32_t bits = std::is_same<T, __nv_bfloat16>::value ? __float_as_uint(x) >> 16
                                                          : __half_as_ushort(__float2half_rn(x));
    if ((bits & 0x7FFFu) == 0) bits = 0x8001u;  // +-0: the smallest negative value
    else bits += (bits & 0x8000u) ? 1 : -1;     // away from zero when negative, towards it when positive
    return half_bits_to_f32<T>(bits);
  }
}

// Tokens 4g .. 4g+3 of a row as one 16- or 8-byte load: the row start is aligned to a group and the group
// lies inside the row. `evict_first`: the load is marked evict-first in L1 and L2 (ld.global.cs), for rows
// read once.
template <typename T>
__device__ __forceinline__ void load_whole_group(const T* __restrict__ row, int64_t g, float (&v)[4],
                                                 bool evict_first = false) {
  if constexpr (sizeof(T) == 4) {
    const float4* p = reinterpret_cast<const float4*>(row + g * 4);
    const float4 q = evict_first ? __ldcs(p) : *p;
    v[0] = q.x; v[1] = q.y; v[2] = q.z; v[3] = q.w;
  } else {
    const uint2* p = reinterpret_cast<const uint2*>(row + g * 4);
    const uint2 q = evict_first ? __ldcs(p) : *p;
    v[0] = half_bits_to_f32<T>(q.x & 0xFFFFu); v[1] = half_bits_to_f32<T>(q.x >> 16);
    v[2] = half_bits_to_f32<T>(q.y & 0xFFFFu); v[3] = half_bits_to_f32<T>(q.y >> 16);
  }
}

// Row r's packed allowed-token words (a TsBitmask: docs/semantics.md, choice 17), or null when the row has no
// mask.
template <typename Bitmask>
__device__ __forceinline__ const uint32_t* row_bitmask(const Bitmask& bitmask, int64_t r) {
  if (bitmask.words == nullptr) return nullptr;
  const int64_t m = bitmask.row != nullptr ? bitmask.row[r] : r;
  return m < 0 ? nullptr : reinterpret_cast<const uint32_t*>(bitmask.words) + m * bitmask.row_words;
}

// A row's cut in the kernels' masked instances: its allowed-token words (row_bitmask) or its floor (TsBitmask.floor),
// in one 64-bit word, so that it holds the register pair the words' address alone held (a float beside it spilled
// 12-56 bytes in the masked top-k instances). A call gives one or the other; a words address is 4-byte aligned, so
// bit 0 tells them apart: 0 (none), the words' address, or the floor's bits << 32 | 1.
struct RowCut {
  uint64_t bits;

  __device__ __forceinline__ const uint32_t* words() const {
    return bits & 1u ? nullptr : reinterpret_cast<const uint32_t*>(bits);
  }
  __device__ __forceinline__ bool has_floor() const { return bits & 1u; }
  __device__ __forceinline__ float floor() const { return __uint_as_float(static_cast<uint32_t>(bits >> 32)); }
  // The floor, -inf without one (a comparison with it removes nothing).
  __device__ __forceinline__ float floor_or_none() const { return has_floor() ? floor() : -kInf; }
};

template <typename Bitmask>
__device__ __forceinline__ RowCut row_cut(const Bitmask& bitmask, int64_t r) {
  if (bitmask.floor != nullptr) {
    const float f = __ldg(bitmask.floor + r);
    return RowCut{f > -kInf ? (static_cast<uint64_t>(__float_as_uint(f)) << 32) | 1u : 0u};
  }
  return RowCut{reinterpret_cast<uint64_t>(row_bitmask(bitmask, r))};
}

// The tokens of a group below the row's floor read as -inf (NaN and +inf are not below it).
__device__ __forceinline__ void floor_group(float floor, float (&v)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = v[e] < floor ? -kInf : v[e];
}

// The allowed bits of tokens 4g .. 4g+3 (bit e: token 4g + e; group g inside the vocabulary). One read-only
// 4-byte load, which the 7 other groups of its word share through L1: a mask adds 1/32 of an fp32 row's bytes.
__device__ __forceinline__ uint32_t group_mask_bits(const uint32_t* mask, int64_t g) {
  return __ldg(mask + (g >> 3)) >> (4 * static_cast<uint32_t>(g & 7));
}

// The tokens of a group whose bit is clear read as -inf.
__device__ __forceinline__ void mask_group(uint32_t bits, float (&v)[4]) {
#pragma unroll
  for (int e = 0; e < 4; ++e) v[e] = (bits >> e) & 1u ? v[e] : -kInf;
}

// Tokens 4g .. 4g+3 of a row (one Philox call covers exactly these). Tokens past the vocabulary read
// as -inf. `aligned`: the row start is aligned to one group, so a group is one 16- or 8-byte load.
// `mask` (row_bitmask; null: none): the tokens it disallows read as -inf too.
template <typename T>
__device__ __forceinline__ void load_group(const T* __restrict__ row, int64_t g, int64_t vocab,
                                           bool aligned, float (&v)[4], bool evict_first = false,
                                           const uint32_t* mask = nullptr) {
  const int64_t i0 = g * 4;
  if (aligned && i0 + 4 <= vocab) {
    load_whole_group(row, g, v, evict_first);
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = i0 + j < vocab ? to_f32(row[i0 + j]) : -kInf;
  }
  if (mask != nullptr && i0 < vocab) mask_group(group_mask_bits(mask, g), v);  // past it: no word to read
}

// NaN and +inf read as -inf (docs/semantics.md, choice 1); returns whether x was one of them.
__device__ __forceinline__ bool sanitize(float& x) {
  const bool bad = !(x < kInf);
  if (bad) x = -kInf;
  return bad;
}

// fp32 -> uint32 preserving order (-0 and +0 map to the same key, as they compare equal).
__device__ __forceinline__ uint32_t order_key(float x) {
  uint32_t u = __float_as_uint(x);
  if (u == 0x80000000u) u = 0;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ float key_to_float(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}
// (value desc, index asc) as one unsigned key, larger = earlier. 0 is never a real token's key.
__device__ __forceinline__ uint64_t rank_key(float x, uint32_t idx) {
  return (static_cast<uint64_t>(order_key(x)) << 32) | (0xFFFFFFFFu - idx);
}
__device__ __forceinline__ uint32_t key_index(uint64_t key) {
  return 0xFFFFFFFFu - static_cast<uint32_t>(key);
}
__device__ __forceinline__ float key_value(uint64_t key) {
  return key_to_float(static_cast<uint32_t>(key >> 32));
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^x by the hardware approximation (<= 2 ulp, subnormal results flushed to 0): used only for the
// sums of exponentials, whose largest term is 1, so the flushed terms are below 2^-126 of the sum.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Probability mass in fixed point (2^-40 units): integer sums are exact, hence independent of the
// order of accumulation, of the number of blocks per row, and of the batch.
__device__ __forceinline__ uint64_t mass_fixed(float z) {
  return __float2ull_rn(expf(z) * 0x1p40f);
}
constexpr double kMassUnit = 0x1p-40;

template <typename T, typename Op>
__device__ __forceinline__ T warp_allreduce(T v, Op op) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The largest 64-bit key of a full warp, in every lane: two REDUXes (the high words, then the low words of
// the lanes that hold the highest high word) instead of five 64-bit shuffle rounds.
__device__ __forceinline__ uint64_t warp_max_key(uint64_t key) {
  constexpr unsigned int kAll = 0xffffffffu;
  const uint32_t hi = __reduce_max_sync(kAll, static_cast<uint32_t>(key >> 32));
  const uint32_t lo =
      __reduce_max_sync(kAll, static_cast<uint32_t>(key >> 32) == hi ? static_cast<uint32_t>(key) : 0u);
  return static_cast<uint64_t>(hi) << 32 | lo;
}

// Every thread gets the reduction of all `v`. `scratch` holds THREADS / 32 values.
template <int THREADS, typename T, typename Op>
__device__ __forceinline__ T block_allreduce(T v, Op op, T* scratch) {
  v = warp_allreduce(v, op);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  __syncthreads();
  v = scratch[0];
#pragma unroll
  for (int i = 1; i < THREADS / 32; ++i) v = op(v, scratch[i]);
  return v;
}

struct MaxOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a > b ? a : b; }
};
struct MinOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a < b ? a : b; }
};
struct SumOp {
  template <typename T>
  __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

// Inclusive prefix sum of v over the lanes of a warp.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const T up = __shfl_up_sync(0xffffffffu, v, o);
    if (lane >= o) v += up;
  }
  return v;
}

// In-place inclusive prefix sum of a[0, n) in shared memory. `scratch` holds THREADS / 32 values.
template <int THREADS, typename T>
__device__ void block_inclusive_scan(T* a, int n, T* scratch) {
  const int per = (n + THREADS - 1) / THREADS;
  const int begin = min(n, static_cast<int>(threadIdx.x) * per), end = min(n, begin + per);
  __syncthreads();
  T local = 0;
  for (int i = begin; i < end; ++i) local += a[i];
  // exclusive scan of the per-thread totals across the block
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T incl = warp_inclusive_scan(local, lane);
  if (lane == 31) scratch[warp] = incl;
  __syncthreads();
  T offset = incl - local;
  for (int w = 0; w < warp; ++w) offset += scratch[w];
  for (int i = begin; i < end; ++i) {
    offset += a[i];
    a[i] = offset;
  }
  __syncthreads();
}

// One compare-exchange pass of a bitonic sort of a[0, n) into descending order, by the threads
// first, first + step, ... of the group that sorts (a thread block or one warp).
__device__ __forceinline__ void bitonic_pass_desc(uint64_t* a, int n, int size, int stride, int first, int step) {
  for (int i = first; i < (n >> 1); i += step) {
    const int lo = 2 * i - (i & (stride - 1)), hi = lo + stride;
    const bool desc = (lo & size) == 0;
    const uint64_t x = a[lo], y = a[hi];
    if ((x < y) == desc) {
      a[lo] = y;
      a[hi] = x;
    }
  }
}

// Sorts a[0, n) in shared memory into descending order (n a power of two), by the whole block.
template <int THREADS>
__device__ void block_sort_desc(uint64_t* a, int n) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncthreads();
      bitonic_pass_desc(a, n, size, stride, threadIdx.x, THREADS);
    }
  }
  __syncthreads();
}

// The same by one warp (`lane` = its lane index), the rest of the block free to go on.
__device__ inline void warp_sort_desc_shared(uint64_t* a, int n, int lane) {
  for (int size = 2; size <= n; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      __syncwarp();
      bitonic_pass_desc(a, n, size, stride, lane, 32);
    }
  }
  __syncwarp();
}

// The last block of a row to finish (counted on a self-resetting counter) returns true. Callers
// write their partial results before, and read the other blocks' partials only after, this call.
__device__ __forceinline__ bool finish_and_elect_last(unsigned int* counter, unsigned int blocks) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int done = atomicAdd(counter, 1u);
    last = done == blocks - 1;
    if (last) *counter = 0u;
  }
  __syncthreads();
  if (last) __threadfence();
  return last;
}

// finish_and_elect_last with one fence and one barrier instead of a fence in every thread and two
// barriers: for blocks whose partial results thread 0 wrote, or other threads wrote before a barrier
// that thread 0 passed since. A fence is cumulative: it orders before the count every write its
// thread has observed, and a barrier makes its threads' earlier writes observed (the grid sync of
// cooperative groups relies on the same: a barrier, then one thread's fence and atomic). The count runs from
// start (0 unless the kernel before left the counter elsewhere: nucleus.cuh's row readiness); reset: the last
// block returns the counter to 0, as every kernel finds it.
__device__ __forceinline__ bool finish_by_thread0_and_elect_last(unsigned int* counter, unsigned int blocks,
                                                                 unsigned int start = 0, bool reset = true) {
  __shared__ bool last;
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(counter, 1u) == start + blocks - 1;
    if (last && reset) *counter = 0u;
    if (last) __threadfence();
  }
  __syncthreads();
  return last;
}

// Programmatic dependent launch (sm_90 and up; no-ops elsewhere and when not launched that way). A
// kernel launched with launch_after_previous (launch.h) may be scheduled while the previous kernel on
// the stream still runs; it calls wait_for_previous_grid before it touches anything that kernel
// writes (its results, the shared workspace). The previous kernel calls let_next_grid_launch once
// its blocks are under way, so the dependent grid takes the SMs its last wave leaves idle.
__device__ __forceinline__ void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

__device__ __forceinline__ unsigned int next_pow2(unsigned int n) {
  return n <= 1 ? 1 : 1u << (32 - __clz(n - 1));
}

}  // namespace tokensampler
