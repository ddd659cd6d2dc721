// Stage 1 of the fused path, W streamed by the tensor memory accelerator (launcher: fused.cu; stage 2 and
// the epilogue's arithmetic: fused.cuh).
//
// One persistent CTA per SM and batch tile of N rows (8, 16, 32, 64 or 128) walks the same vocabulary tiles of
// 128 W rows as fused_partials_kernel, but for a short last round, split in halves (`stream_unit`). Three kinds of
// warps:
// - a producer warp issues bulk tensor copies of each tile in stages of 64 D elements (W: 128 rows x 128
//   bytes; h: N rows x 128 bytes, rows past the batch read as zeros) into a ring of shared-memory stages,
//   128-byte swizzled; an mbarrier per stage says "full" (bytes landed), another "empty" (every multiply
//   warp is done with it);
// - two multiply warpgroups multiply their 64 W rows of each stage with the batch by wgmma (fp32
//   accumulation over D in order; mma.sync in the portable build) and write the tile's logits into one
//   of two shared-memory tile buffers (one at N = 128);
// - fourteen epilogue warps (eleven at N = 128) take the batch rows of the other buffer, warp e rows e,
//   e + 14, ..., one row at a time with the whole warp (`consume_row_tile`: 4 tokens a lane,
//   fused_partials_kernel's arithmetic per token), and lane r keeps the running totals of the warp's row r;
//   a filtered row's best kStreamCand keys so far are kept in shared memory (`keep_best_keys`). A 128-row tile
//   with neither candidates nor log-probs to collect takes `lane_row_epilogue` instead: one thread a row and
//   half tile, no warp-wide step.
// Each tile buffer has a "full" and an "empty" mbarrier, so the multiply warps go on to the next tile
// while the epilogue of this one runs: the epilogue is hidden under the stream instead of stalling it.
// (Measured: run by the multiply warps themselves, four rows a warp, it cost 20 µs at N = 32; with a
// whole per-lane state for each of a warp's rows, as `consume` keeps, the states spilled and a tile's
// epilogue took 50 µs at N = 64.)
//
// Why: the register ring of fused_partials_kernel holds 64 KB a SM in flight at its 128-register
// ceiling and reached 97 % of the HBM roofline at best; the copy engine keeps the whole ring in flight
// without registers and without the consumer warps issuing loads.
#pragma once
#include <cuda.h>

#include "fused.cuh"

namespace tokensampler {
namespace fused {

constexpr int kStreamMmaWarps = 8;                    // two warpgroups; 16 W rows of the tile each
constexpr int kStageK = 64;                            // D elements a stage: one 128-byte swizzle span
constexpr int kStageW = kTileRows * kStageK * 2;       // bytes of W a stage
constexpr int kTileStride = kTileRows + 4;             // floats a batch row of the logits tile (spreads banks)

// Batch rows e, e + 14, ... each. The last tile's epilogue, which nothing hides, is a chain of row tiles on the
// busiest warp (~1 µs each on the H200), so more warps shorten it: twelve rather than eight took 1 µs off 32 rows
// and 3 off 64, fourteen rather than twelve 0.9 off 64 (5 rows a warp, not 6). Sixteen lose the room stage 2's
// CTAs wait in (fused.cu): by our reading, the scheduler holding seven of 25 warps has room for one of stage 2's
// warps, not two; 24 warps fit.
constexpr int kStreamEpilogueWarps = 14;

// A filtered row's best keys kept by each CTA (stage 2 takes the best kCand of all CTAs'). Fewer than
// kCand: a CTA sees 1/132 of the vocabulary, so the row's best 64 rarely put more than a few in one CTA,
// and stage 2 trusts only the keys no full list can have cut off (rows whose kept set reaches below them
// take the logits path); 16 keep the per-tile update and stage 2's selection short (H200: top-k + top-p
// rows in 313-333 µs at B = 1-64, against 312-347 through cuBLAS fp32 logits + the logits kernels).
constexpr int kStreamCand = 16;

// W rows [start, start + rows) of the whole vocabulary that a CTA multiplies in one round: a tile of kTileRows, or
// a half tile; rows 0: the CTA's walk has ended.
struct StreamUnit {
  int64_t start;
  int rows;
};
constexpr int kHalfTileRows = kTileRows / 2;

// Round u of CTA cta's walk. The CTAs take the shard's tiles in turn, C = vocab_ctas at a time; when the last round
// has r <= C / 2 tiles, its tiles are split into 2r halves, one a CTA, so that it takes half the time of a round
// instead of a whole one (fused.cu's `walk_rounds` decides). Why: a shard of V = 151936 split over two GPUs is
// 593-594 tiles, 4.5 rounds of 132, and whole tiles made its stage 1 take 5 rounds. A last round of more than
// C / 2 tiles would leave some CTA two halves, no shorter than a tile. A function of V, the shard and the GPU only,
// like the tiles' walk, so that a row's sums are batch invariant.
__device__ __forceinline__ StreamUnit stream_unit(const PartialsArgs& a, int cta, int u) {
  const int64_t round_start = static_cast<int64_t>(a.first_tile) + static_cast<int64_t>(u) * a.vocab_ctas;
  if (u < a.full_rounds) return StreamUnit{(round_start + cta) * kTileRows, kTileRows};
  if (u > a.full_rounds || cta >= a.last_round_units) return StreamUnit{0, 0};
  if (!a.last_round_halves) return StreamUnit{(round_start + cta) * kTileRows, kTileRows};
  const int64_t start = (round_start + cta / 2) * kTileRows + (cta & 1) * kHalfTileRows;
  return start < a.head.vocab ? StreamUnit{start, kHalfTileRows} : StreamUnit{0, 0};
}

// What the epilogue needs of a batch row besides its logits (shared memory, one copy a row).
struct RowConstants {
  int mode;
  float temperature;
  NoiseStream noise;
  int want_sum_t;  // a filtered row without top-k: stage 2 may need the row's mass at T (top-p)
};

__device__ __forceinline__ RowConstants row_constants(const TsRows& r, int64_t b) {
  const RowState s = make_row_state(r, b);
  return RowConstants{s.mode, s.temperature, s.noise, s.mode == kCandidates && !(r.top_k[b] > 0)};
}

template <int N>
struct StreamLayout {
  static constexpr int kStageBytes = kStageW + N * kStageK * 2;  // multiple of 1024 (the swizzle atom)
  // Two tile buffers let the multiply run a tile ahead of the epilogue; at N = 128 one (66 KB) is what fits
  // beside a ring of four stages, and the multiply then waits for the epilogue only to write its tile.
  static constexpr int kTileBuffers = N <= 64 ? 2 : 1;
  static constexpr int kStages = N <= 32 ? 8 : N == 64 ? 6 : 4;  // what fits beside the tile buffers
  static constexpr int kTileBytes = N * kTileStride * 4;
  static constexpr int kBarriers = 2 * kStages + 4;              // ring full / empty, tile full / empty
  // At N = 128 the multiply's 64 accumulators a thread need 90 registers or more; ptxas allots registers as if
  // warps came in fours, so 20 warps (96 registers) rather than 23 (80).
  static constexpr int kEpilogueWarps = N <= 64 ? kStreamEpilogueWarps : 11;
  static constexpr int kThreads = 32 * (kStreamMmaWarps + kEpilogueWarps + 1);  // + the producer warp
  static constexpr int kBytes = 1024 + kStages * kStageBytes + kTileBuffers * kTileBytes + 8 * kBarriers +
                                N * static_cast<int>(sizeof(RowConstants)) +
                                N * kStreamCand * 8 + N * 8;  // 1024: alignment; the rows' best keys and masks
};

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbarrier_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// Box (c0 .. c0+63, c1 .. c1+box rows-1) of a 2-D tensor map into shared memory; completes on `bar`.
__device__ __forceinline__ void bulk_tensor_load(uint32_t dst, const CUtensorMap* map, int c0, int c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t addr, uint32_t& r0, uint32_t& r1) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r0), "=r"(r1) : "r"(addr));
}
// Byte offset of 16-byte chunk `chunk` of row `row` in a tile of 128-byte rows swizzled by the copy
// engine's 128-byte mode (the chunk index XOR the row's place in its group of 8).
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return static_cast<uint32_t>(row * 128 + ((chunk ^ (row & 7)) << 4));
}
// d (64 x N fp32; this thread's N / 2 values, in mma.sync's C layout per 8 columns) += A (64 x 16) B (16 x N),
// A and B K-major in shared memory behind their descriptors. Issued by a whole warpgroup, asynchronously.
#define TS_WGMMA_TEXT(N, TYPE, D, A, B)                                                                   \
  "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE \
  " {" D "}, " A ", " B ", p, 1, 1, 0, 0;\n}\n"
#define TS_WGMMA(N, D, A, B, ...)                                                                                     \
  if constexpr (BF16)                                                                                                \
    asm volatile(TS_WGMMA_TEXT(N, "bf16", D, A, B) : __VA_ARGS__ : "l"(a_desc), "l"(b_desc));                        \
  else                                                                                                               \
    asm volatile(TS_WGMMA_TEXT(N, "f16", D, A, B) : __VA_ARGS__ : "l"(a_desc), "l"(b_desc));
template <bool BF16, int N>
__device__ __forceinline__ void wgmma_k16(float (&d)[N / 2], uint64_t a_desc, uint64_t b_desc) {
  if constexpr (N == 8) {
    TS_WGMMA(8, "%0, %1, %2, %3", "%4", "%5", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]))
  } else if constexpr (N == 16) {
    TS_WGMMA(16, "%0, %1, %2, %3, %4, %5, %6, %7", "%8", "%9", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]))
  } else if constexpr (N == 32) {
    TS_WGMMA(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16", "%17", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]))
  } else if constexpr (N == 64) {
    TS_WGMMA(64, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31", "%32", "%33", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]))
  } else {
    static_assert(N == 128, "batch tiles of 8, 16, 32, 64 or 128 rows");
    TS_WGMMA(128, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63", "%64", "%65", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]))
  }
}
#undef TS_WGMMA
#undef TS_WGMMA_TEXT

// Shared-memory matrix descriptor of a K-major tile of 128-byte rows, 128-byte swizzled (the copy
// engine's layout): start address, stride 1024 bytes between groups of 8 rows, swizzle mode 1. Moving
// 16 elements along K adds 32 bytes to the start (the swizzle is a function of the address bits).
__device__ __forceinline__ uint64_t tile_descriptor(uint32_t address) {
  return static_cast<uint64_t>((address & 0x3FFFFu) >> 4) | (1ull << 16) | (static_cast<uint64_t>(1024 >> 4) << 32) |
         (1ull << 62);
}

// acc (W rows 16 warp .. + 15 of the tile x the N batch rows, mma.sync's C layout per 8 columns) += one
// stage: W tile [128 x 64] and h tile [N x 64], both 128-byte swizzled. On sm_90a each warpgroup issues
// wgmma for its 64 W rows (operands read from shared memory by the tensor cores) and returns with them
// in flight (`wait_stages` retires them); the portable build loads fragments with ldmatrix and multiplies
// with mma.sync, with the same C layout, and is done on return.
template <bool BF16, int N>
__device__ __forceinline__ void multiply_stage(float (&acc)[N / 2], uint32_t w_tile, uint32_t h_tile, int warp, int lane) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint64_t a_desc = tile_descriptor(w_tile + (warp / 4) * 64 * 128), b_desc = tile_descriptor(h_tile);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < kStageK / 16; ++kk) wgmma_k16<BF16, N>(acc, a_desc + 2 * kk, b_desc + 2 * kk);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  const int a_row = warp * 16 + (lane & 15), a_chunk = lane >> 4;
  // ldmatrix x4 over h: matrices (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15).
  const int b_row = (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
#pragma unroll
  for (int kk = 0; kk < kStageK / 16; ++kk) {
    uint32_t a0, a1, a2, a3;
    ldmatrix_x4(w_tile + swizzled(a_row, 2 * kk + a_chunk), a0, a1, a2, a3);
    if constexpr (N == 8) {
      uint32_t q0, q1;
      ldmatrix_x2(h_tile + swizzled(lane & 7, 2 * kk + b_chunk), q0, q1);
      mma16816<BF16>(reinterpret_cast<float(&)[4]>(acc[0]), a0, a1, a2, a3, q0, q1);
    } else {
#pragma unroll
      for (int np = 0; np < N / 16; ++np) {
        uint32_t q0, q1, q2, q3;
        ldmatrix_x4(h_tile + swizzled(np * 16 + b_row, 2 * kk + b_chunk), q0, q1, q2, q3);
        mma16816<BF16>(reinterpret_cast<float(&)[4]>(acc[8 * np]), a0, a1, a2, a3, q0, q1);
        mma16816<BF16>(reinterpret_cast<float(&)[4]>(acc[8 * np + 4]), a0, a1, a2, a3, q2, q3);
      }
    }
  }
#endif
}

// Waits until the stages issued by multiply_stage are multiplied, so that they may be refilled and acc read.
template <int N>
__device__ __forceinline__ void wait_stages(float (&acc)[N / 2]) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // no read before the wait
#endif
}

// A batch row's running result over the tiles so far, kept by one lane of its epilogue warp.
struct RowTotals {
  float max = -kInf;   // max x
  float sum1 = 0.f;    // sum exp(x - max), when raw log-probs are wanted
  float sum_t = 0.f;   // sum exp((x - max) / T), for RowConstants::want_sum_t
  float best_score = -kInf;
  float best_x = -kInf;
  uint64_t best_key = 0;  // rank_key(best_score, id); 0: none yet
};

// Folds this lane's keys into a row's best kStreamCand keys (`best`: shared memory, descending, zeros past
// the last). The warp takes the best key left above the list's last, inserts it, and repeats until none
// is left: at most kStreamCand rounds, and after the first tiles usually none (the first test fails).
__device__ __forceinline__ void keep_best_keys(uint64_t* best, uint64_t (&key)[4], int lane) {
  uint64_t floor = best[kStreamCand - 1];
  if (!__any_sync(0xffffffffu, key[0] > floor || key[1] > floor || key[2] > floor || key[3] > floor)) return;
  uint64_t mine = lane < kStreamCand ? best[lane] : 0ull;  // lane i holds entry i
  while (true) {
    uint64_t top = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) top = key[j] > floor && key[j] > top ? key[j] : top;
    top = warp_allreduce(top, MaxOp{});
    if (top == 0) break;
#pragma unroll
    for (int j = 0; j < 4; ++j) key[j] = key[j] == top ? 0ull : key[j];  // keys are unique
    // Entries below `top` move down one place; the first of them becomes `top`.
    const uint64_t above = __shfl_up_sync(0xffffffffu, mine, 1);
    if (mine < top) mine = lane == 0 || above > top ? top : above;
    floor = __shfl_sync(0xffffffffu, mine, kStreamCand - 1);
  }
  if (lane < kStreamCand) best[lane] = mine;
}

// finish_group for a head without bias and soft cap (`plain_head`): the same values, with no branch a token.
// `in_vocab`: how many of the four tokens lie inside the vocabulary (any int; 4 or more: all), so that the
// bound costs one 32-bit compare a token. A full group takes one test for the four: a NaN or +inf makes their sum
// NaN or +inf (so may a finite sum past the float range, and the tokens' own tests then change nothing). A group
// with a masked token (`allowed` not 0xF) sets it to -inf before the test, as finish_group does.
__device__ __forceinline__ bool finish_group_plain(float (&x)[4], int in_vocab, float logit_scale, uint32_t allowed) {
  bool bad = false;
  if (in_vocab >= 4) {
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] *= logit_scale;
    if (allowed != 0xFu)
#pragma unroll
      for (int j = 0; j < 4; ++j) x[j] = (allowed >> j) & 1u ? x[j] : -kInf;
    if (!(x[0] + x[1] + x[2] + x[3] < kInf))
#pragma unroll
      for (int j = 0; j < 4; ++j) bad |= sanitize(x[j]);
    return bad;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float scaled = x[j] * logit_scale;
    const bool kept = j < in_vocab && ((allowed >> j) & 1u);
    bad |= kept && !(scaled < kInf);
    x[j] = kept && scaled < kInf ? scaled : -kInf;  // padded rows, the last tile's tail, masked tokens, NaN, +inf
  }
  return bad;
}

// Folds a greedy row's tokens v0 .. v0 + 3 into a best key (by x, the lowest id first) and its logit.
__device__ __forceinline__ void fold_greedy_group(const float (&x)[4], int64_t v0, uint64_t& key, float& key_x,
                                                  float& key_score) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint64_t k = x[j] > -kInf ? rank_key(x[j], static_cast<uint32_t>(v0 + j)) : 0ull;
    if (k > key) key = k, key_x = key_score = x[j];
  }
}

// Folds a Gumbel row's tokens v0 .. v0 + 3 (noise `words`) into a best key by exact score x / T + g; a token is
// scored only if `screened_score` lets it reach `bound`.
__device__ __forceinline__ void fold_gumbel_group(const float (&x)[4], float temperature, const uint4& words,
                                                  int64_t v0, float bound, uint64_t& key, float& key_x,
                                                  float& key_score) {
  const bool unit_t = temperature == 1.f;  // x / T is exactly x
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    float score;
    if (!(x[j] > -kInf) || !screened_score(unit_t ? x[j] : x[j] / temperature, word_of(words, j), bound, score))
      continue;
    const uint64_t k = rank_key(score, static_cast<uint32_t>(v0 + j));
    if (k > key) key = k, key_x = x[j], key_score = score;
  }
}

// Tokens v0 .. v0 + span - 1 inside the vocabulary, as an int (span at most that of a tile).
__device__ __forceinline__ int tokens_in_vocab(int64_t v0, int span, const TsLmHead& head) {
  return static_cast<int>(max(min(head.vocab - v0, static_cast<int64_t>(span)), int64_t{0}));
}

__device__ __forceinline__ bool plain_head(const TsLmHead& head) {
  return head.bias == nullptr && !(head.soft_cap > 0.f);
}

// The warp consumes one batch row's 128 logits of a tile (tokens v0 .. v0 + 3 in this lane's x); lane
// `owner` holds the row's totals and folds the tile in. Tokens are ranked by the same exact scores as
// `consume` (x / T + gumbel_exact, or x for greedy rows), but per tile across the warp: a lane scores a
// token exactly only if an integer-only upper bound of its noise can lift it past the row's best so
// far, and the warp merges the lanes' best only when one beats the row's. A filtered row's tokens go
// to its best keys (`best_keys`) instead; tokens whose bit of `unit_bits` is clear are left out, as masked tokens
// are. Returns whether this lane saw a NaN or +inf logit.
// The last tile's epilogue, which nothing hides, ends stage 1 (H200, B = 64, twelve epilogue warps: 6 rows a
// warp, 8.3 us), so a row's tile is kept short: the max by one REDUX, no branch a token for a plain head (PLAIN)
// or at T = 1, the Philox words drawn whatever the lane holds (~6.1 us). Two rows interleaved a warp gained
// nothing more and took 70-78 registers, and then stage 2 ended 0.4-3.3 us later: past 64, by our reading, not
// all eight of its waiting warps fit beside this kernel's (then 21; a scheduler holding six of them at 72
// registers has 16K - 6 x 2304 left, room for one of stage 2's 56-register warps, not two).
template <bool PLAIN, bool kMask>
__device__ __forceinline__ bool consume_row_tile(const RowConstants& c, const uint32_t* mask, uint32_t unit_bits,
                                                 RowTotals& totals, uint64_t* best_keys, int owner, float (&x)[4],
                                                 int64_t v0, const TsLmHead& head, bool want_sum1, int lane) {
  const uint32_t allowed = (kMask ? allowed_bits(mask, v0, head) : 0xFu) & unit_bits;
  const bool bad = PLAIN ? finish_group_plain(x, tokens_in_vocab(v0, 4, head), head.logit_scale, allowed)
                         : finish_group(x, v0, head, allowed);
  const float lane_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  const float old_max = __shfl_sync(0xffffffffu, totals.max, owner);
  const float new_max = fmaxf(old_max, key_to_float(__reduce_max_sync(0xffffffffu, order_key(lane_max))));
  float added = 0.f;
  if (want_sum1 && new_max > -kInf) {
#pragma unroll
    for (int j = 0; j < 4; ++j) added += expf(x[j] - new_max);
    added = warp_allreduce(added, SumOp{});
  }
  float added_t = 0.f;
  if (c.want_sum_t && new_max > -kInf) {
#pragma unroll
    for (int j = 0; j < 4; ++j) added_t += expf((x[j] - new_max) / c.temperature);
    added_t = warp_allreduce(added_t, SumOp{});
  }
  uint64_t key = 0;
  float key_x = -kInf, key_score = -kInf;
  if (c.mode == kCandidates) {
    uint64_t keys[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) keys[j] = x[j] > -kInf ? rank_key(x[j], static_cast<uint32_t>(v0 + j)) : 0ull;
    keep_best_keys(best_keys, keys, lane);
  } else if (c.mode == kGreedy) {
    fold_greedy_group(x, v0, key, key_x, key_score);
  } else {
    const float bound = __shfl_sync(0xffffffffu, totals.best_score, owner);
    fold_gumbel_group(x, c.temperature, c.noise.group(static_cast<uint32_t>(v0 >> 2)), v0, bound, key, key_x,
                      key_score);
  }
  if (__any_sync(0xffffffffu, key > __shfl_sync(0xffffffffu, totals.best_key, owner))) {
    const uint64_t top = warp_max_key(key);
    const int from = __ffs(__ballot_sync(0xffffffffu, key == top)) - 1;
    const float top_x = __shfl_sync(0xffffffffu, key_x, from), top_score = __shfl_sync(0xffffffffu, key_score, from);
    if (lane == owner) totals.best_key = top, totals.best_x = top_x, totals.best_score = top_score;
  }
  if (lane == owner) {
    if (want_sum1 && new_max > -kInf) totals.sum1 = (old_max > -kInf ? totals.sum1 * expf(old_max - new_max) : 0.f) + added;
    if (c.want_sum_t && new_max > -kInf)
      totals.sum_t = (old_max > -kInf ? totals.sum_t * expf((old_max - new_max) / c.temperature) : 0.f) + added_t;
    totals.max = new_max;
  }
  return bad;
}

// One Philox group (tokens v .. v + 3, read from the tile) of a Gumbel or greedy row in the lane-row epilogue: the
// lane alone keeps the row's totals over its span of each tile. The same exact scores and keys as
// `consume_row_tile`; the screen is taken once a group: x / T and the noise's integer bound both grow with their
// argument, so when the group's largest x / T plus the bound of its largest word stays below the best score so
// far, no token of the group can reach it (`screened_score`'s test, for all four at once). Returns whether a logit
// was NaN or +inf.
template <bool PLAIN, bool kMask>
__device__ __forceinline__ bool consume_lane_group(const RowConstants& c, const uint32_t* mask, RowTotals& t,
                                                   float (&x)[4], int64_t v, int in_vocab, const TsLmHead& head) {
  const uint32_t allowed = kMask ? allowed_bits(mask, v, head) : 0xFu;
  const bool bad =
      PLAIN ? finish_group_plain(x, in_vocab, head.logit_scale, allowed) : finish_group(x, v, head, allowed);
  const float group_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  t.max = fmaxf(t.max, group_max);
  if (!(group_max > -kInf)) return bad;
  if (c.mode == kGreedy) {
    fold_greedy_group(x, v, t.best_key, t.best_x, t.best_score);
    return bad;
  }
  const uint4 words = c.noise.group(static_cast<uint32_t>(v >> 2));
  const uint32_t top_word = max(max(words.x, words.y), max(words.z, words.w));
  const float xt_max = c.temperature == 1.f ? group_max : group_max / c.temperature;
  if (xt_max + gumbel_upper_bound(top_word) < t.best_score) return bad;
  fold_gumbel_group(x, c.temperature, words, v, t.best_score, t.best_key, t.best_x, t.best_score);
  return bad;
}

// A lane-row epilogue lane's totals, handed to the lane that keeps the same row's other half of each tile.
struct LaneHalf {
  uint64_t best_key;
  float max, best_score, best_x;
  int32_t nan;
};

// This CTA's partial result of a row, from the lane that kept its totals (write_partial's for the ring kernel).
__device__ __forceinline__ void write_stream_partial(const RowTotals& t, bool nan, bool uncollected, const PartialsArgs& a,
                                                     int64_t slot) {
  Partial p;
  p.max = t.max;
  p.sum1 = t.sum1;
  p.sum_t = t.sum_t;
  p.best_score = t.best_score;
  p.best_x = t.best_x;
  p.best_id = t.best_key != 0 ? static_cast<int32_t>(key_index(t.best_key)) : -1;
  p.nan = nan;
  p.no_candidates = uncollected;
  a.partials[slot] = p;
}

// The epilogue of a 128-row batch tile with neither candidates nor log-probs to collect (its rows greedy or Gumbel;
// filtered rows come back flagged): epilogue thread t < 256 keeps batch row t % 128 alone over half t / 128 of
// each tile, 16 Philox groups a tile with no shuffle, reduction or vote, and the two halves' totals meet once,
// after the last tile (threads from 256 on only arrive on the barriers). Why: beside the m64n128 multiply, the
// warp-per-row `consume_row_tile` took ~2.85 us a row's tile, its warp-wide steps and per-token screen waiting for
// dispatch behind the tensor pipe, and at B >= 128 the epilogue bounds the kernel; this form issues ~2.7x fewer
// instructions a tile (docs/design/fused-lm-head.md).
// Tokens and flags are the same as the warp-per-row form's (the best key decomposes over any split of the
// vocabulary); split in halves, a row's sums would be added in another order than the warp's, and log-probs would
// then depend on the batch, so rows that want them keep the warp form.
template <int N, bool kMask>
__device__ __forceinline__ void lane_row_epilogue(const PartialsArgs& a, const float* tiles, uint32_t tile_full,
                                                  uint32_t tile_empty, const RowConstants* constants,
                                                  const uint32_t* const* masks, LaneHalf* halves, int cta, int b0,
                                                  int tile_rows, int t) {
  using L = StreamLayout<N>;
  constexpr int kEpilogueThreads = 32 * L::kEpilogueWarps;
  static_assert(2 * N <= kEpilogueThreads && N * kStreamCand * 8 >= N * static_cast<int>(sizeof(LaneHalf)),
                "two epilogue threads a row, and room for the halves in the best keys' memory");
  const int n = t % N, half = t / N;
  const bool active = half < 2 && n < tile_rows && constants[n].mode != kCandidates;
  const RowConstants c = constants[n];
  const uint32_t* mask = kMask && active ? masks[n] : nullptr;
  const bool plain = plain_head(a.head);
  RowTotals totals;
  bool nan = false;
  int round = 0;
  for (StreamUnit unit = stream_unit(a, cta, 0); unit.rows != 0; unit = stream_unit(a, cta, ++round)) {
    const int buf = round % L::kTileBuffers;
    mbarrier_wait(tile_full + 8 * buf, (round / L::kTileBuffers) & 1);
    if (active && kHalfTileRows * half < unit.rows) {  // a half tile's other half belongs to another CTA
      // Lanes of a warp read consecutive batch rows at one column: 16-byte loads, conflict-free (stride 132 floats).
      const float* xs = tiles + (buf * N + n) * kTileStride + kHalfTileRows * half;
      const int64_t v0 = unit.start + kHalfTileRows * half;
      const int in_vocab = tokens_in_vocab(v0, kHalfTileRows, a.head);
#pragma unroll 2
      for (int g = 0; g < kHalfTileRows / 4; ++g) {
        const float4 q = *reinterpret_cast<const float4*>(xs + 4 * g);
        float x[4] = {q.x, q.y, q.z, q.w};
        nan |= plain ? consume_lane_group<true, kMask>(c, mask, totals, x, v0 + 4 * g, in_vocab - 4 * g, a.head)
                     : consume_lane_group<false, kMask>(c, mask, totals, x, v0 + 4 * g, in_vocab - 4 * g, a.head);
      }
    }
    mbarrier_arrive(tile_empty + 8 * buf);
  }
  if (active && half == 1) halves[n] = LaneHalf{totals.best_key, totals.max, totals.best_score, totals.best_x, nan};
  asm volatile("bar.sync 1, %0;\n" ::"n"(kEpilogueThreads) : "memory");
  if (half != 0 || n >= tile_rows) return;
  if (active) {
    const LaneHalf other = halves[n];
    totals.max = fmaxf(totals.max, other.max);
    if (other.best_key > totals.best_key)
      totals.best_key = other.best_key, totals.best_score = other.best_score, totals.best_x = other.best_x;
    nan |= other.nan != 0;
  }
  write_stream_partial(totals, nan, !active, a, (b0 + n) * a.vocab_ctas + cta);
}

template <bool BF16, int N, bool kMask>
__global__ void __launch_bounds__(StreamLayout<N>::kThreads, 1)
    fused_stream_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap w_half_map,
                        const __grid_constant__ CUtensorMap h_map, const PartialsArgs a) {
  using L = StreamLayout<N>;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = shared_address(smem_raw);
  const uint32_t ring = (raw + 1023u) & ~1023u;
  float* tiles = reinterpret_cast<float*>(smem_raw + (ring - raw) + L::kStages * L::kStageBytes);  // [buf][N][stride]
  const uint32_t full = shared_address(tiles + L::kTileBuffers * N * kTileStride);  // kStages mbarriers, then "empty"
  const uint32_t empty = full + 8 * L::kStages;
  const uint32_t tile_full = empty + 8 * L::kStages;  // room for two "tile full", then two "tile empty"
  const uint32_t tile_empty = tile_full + 16;
  RowConstants* constants = reinterpret_cast<RowConstants*>(smem_raw + (tile_empty + 16 - raw));  // [N]
  uint64_t* best_keys = reinterpret_cast<uint64_t*>(constants + N);                              // [N][kStreamCand]
  // [N]: the rows' token bitmasks (kMask), apart from the constants: a pointer in RowConstants took the unmasked
  // instances from 56 to 62-64 registers.
  const uint32_t** masks = reinterpret_cast<const uint32_t**>(best_keys + N * kStreamCand);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cta = blockIdx.x / a.batch_tiles;
  const int b0 = (blockIdx.x % a.batch_tiles) * N;
  const int k_stages = static_cast<int>(a.head.dim / kStageK);
  constexpr int kMmaThreads = 32 * kStreamMmaWarps, kEpilogueThreads = 32 * L::kEpilogueWarps;

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbarrier_init(full + 8 * s, 1);
      mbarrier_init(empty + 8 * s, kStreamMmaWarps);
    }
    for (int i = 0; i < L::kTileBuffers; ++i) {
      mbarrier_init(tile_full + 8 * i, kMmaThreads);
      mbarrier_init(tile_empty + 8 * i, kEpilogueThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();
  let_next_grid_launch();  // stage 2's CTAs may take their place beside this one and wait for it

  if (warp == kStreamMmaWarps + L::kEpilogueWarps) {  // the producer
    if (lane == 0) {
      int step = 0, round = 0;
      for (StreamUnit unit = stream_unit(a, cta, 0); unit.rows != 0; unit = stream_unit(a, cta, ++round)) {
        // The maps start at the shard's first row. A half tile's other 64 rows are left as they are in the stage
        // (another tile's W, or never written: their logits may be NaN): its second warpgroup multiplies them, and
        // the epilogues set those tokens to -inf before any test, as masked ones (unit_bits, lane_row_epilogue).
        const bool half = unit.rows == kHalfTileRows;
        const int row = static_cast<int>(unit.start - static_cast<int64_t>(a.first_tile) * kTileRows);
        for (int k = 0; k < k_stages; ++k, ++step) {
          const int s = step % L::kStages;
          mbarrier_wait(empty + 8 * s, ((step / L::kStages) & 1) ^ 1);
          const uint32_t stage = ring + s * L::kStageBytes;
          mbarrier_expect_bytes(full + 8 * s, L::kStageBytes - (half ? kStageW / 2 : 0));
          bulk_tensor_load(stage, half ? &w_half_map : &w_map, k * kStageK, row, full + 8 * s);
          bulk_tensor_load(stage + kStageW, &h_map, k * kStageK, b0, full + 8 * s);
        }
      }
    }
    return;
  }

  if (warp < kStreamMmaWarps) {  // multiply warp: W rows 16 warp .. + 15 of each tile
    const int g = lane >> 2, t = lane & 3;
    int step = 0, round = 0;
    for (StreamUnit unit = stream_unit(a, cta, 0); unit.rows != 0; unit = stream_unit(a, cta, ++round)) {
      float acc[N / 2] = {};
      // Each stage goes back to the producer as soon as its multiply is done, before the next one is awaited. Held
      // until the next stage had landed and been issued (one multiply in flight), a stage stayed out of the stream
      // while the data was late (H200: stage 1 -10 us at B = 128, -1 to -2 at 64).
      for (int k = 0; k < k_stages; ++k, ++step) {
        const int s = step % L::kStages;
        mbarrier_wait(full + 8 * s, (step / L::kStages) & 1);
        const uint32_t w_tile = ring + s * L::kStageBytes;
        multiply_stage<BF16, N>(acc, w_tile, w_tile + kStageW, warp, lane);
        wait_stages<N>(acc);
        __syncwarp();
        if (lane == 0) mbarrier_arrive(empty + 8 * s);
      }
      // The tile's logits as [batch row][W row] into buffer round % kTileBuffers, once the epilogue is done with it.
      const int buf = round % L::kTileBuffers;
      if (round >= L::kTileBuffers) mbarrier_wait(tile_empty + 8 * buf, (round / L::kTileBuffers - 1) & 1);
      float* tile_x = tiles + buf * N * kTileStride;
#pragma unroll
      for (int n = 0; n < N / 8; ++n) {
        const int col = n * 8 + 2 * t, row = warp * 16 + g;
        tile_x[col * kTileStride + row] = acc[4 * n];
        tile_x[(col + 1) * kTileStride + row] = acc[4 * n + 1];
        tile_x[col * kTileStride + row + 8] = acc[4 * n + 2];
        tile_x[(col + 1) * kTileStride + row + 8] = acc[4 * n + 3];
      }
      mbarrier_arrive(tile_full + 8 * buf);
    }
    return;
  }

  // Epilogue warp e: batch rows e + kEpilogueWarps r of each tile, row by row; lane r keeps row r's totals.
  const int e = warp - kStreamMmaWarps;
  for (int n = threadIdx.x - kMmaThreads; n < N; n += kEpilogueThreads)
    if (b0 + n < a.num_rows) {
      constants[n] = row_constants(a.rows, b0 + n);
      if (kMask) masks[n] = row_bitmask(a.rows.bitmask, b0 + n);
    }
  for (int i = threadIdx.x - kMmaThreads; i < N * kStreamCand; i += kEpilogueThreads) best_keys[i] = 0;
  asm volatile("bar.sync 1, %0;\n" ::"n"(kEpilogueThreads) : "memory");
  const int tile_rows = static_cast<int>(min(static_cast<int64_t>(N), a.num_rows - b0));  // this batch tile's
  if constexpr (N == 128) {
    if (a.cands == nullptr && a.want_sum1 == 0) {
      lane_row_epilogue<N, kMask>(a, tiles, tile_full, tile_empty, constants, masks,
                                  reinterpret_cast<LaneHalf*>(best_keys), cta, b0, tile_rows,
                                  threadIdx.x - kMmaThreads);
      return;
    }
  }
  const int rows = (tile_rows - e + L::kEpilogueWarps - 1) / L::kEpilogueWarps;          // this warp's
  const bool plain = plain_head(a.head), want_sum1 = a.want_sum1 != 0;
  RowTotals totals;
  uint32_t nan_rows = 0;  // bit r: a NaN / +inf logit of row r seen by this lane
  int round = 0;
  for (StreamUnit unit = stream_unit(a, cta, 0); unit.rows != 0; unit = stream_unit(a, cta, ++round)) {
    const int buf = round % L::kTileBuffers;
    mbarrier_wait(tile_full + 8 * buf, (round / L::kTileBuffers) & 1);
    const float* tile_x = tiles + buf * N * kTileStride;
    const uint32_t unit_bits = 4 * lane < unit.rows ? 0xFu : 0u;  // a half tile's other half: another CTA's
#pragma unroll 1
    for (int r = 0; r < rows; ++r) {
      const int n = e + L::kEpilogueWarps * r;
      const RowConstants c = constants[n];
      if (c.mode == kCandidates && a.cands == nullptr) continue;  // no candidates collected: flagged below
      const uint32_t* mask = kMask ? masks[n] : nullptr;
      const float4 q = *reinterpret_cast<const float4*>(tile_x + n * kTileStride + 4 * lane);
      float x[4] = {q.x, q.y, q.z, q.w};
      const int64_t v0 = unit.start + 4 * lane;
      if (plain ? consume_row_tile<true, kMask>(c, mask, unit_bits, totals, best_keys + n * kStreamCand, r, x, v0,
                                                a.head, want_sum1, lane)
                : consume_row_tile<false, kMask>(c, mask, unit_bits, totals, best_keys + n * kStreamCand, r, x, v0,
                                                 a.head, want_sum1, lane))
        nan_rows |= 1u << r;
    }
    mbarrier_arrive(tile_empty + 8 * buf);
  }
  for (int r = 0; r < rows; ++r) {
    const int n = e + L::kEpilogueWarps * r;
    const bool nan = __any_sync(0xffffffffu, (nan_rows >> r) & 1u);
    const int64_t slot = (b0 + n) * a.vocab_ctas + cta;
    const bool filtered = constants[n].mode == kCandidates;
    if (lane == r) write_stream_partial(totals, nan, filtered && a.cands == nullptr, a, slot);
    if (filtered && a.cands != nullptr && lane < kStreamCand)
      a.cands[slot * kStreamCand + lane] = best_keys[n * kStreamCand + lane];
  }
}

}  // namespace fused
}  // namespace tokensampler
