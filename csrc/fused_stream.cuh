// Stage 1 of the fused path for greedy and temperature-only rows, W streamed by the tensor memory
// accelerator (launcher: fused.cu; stage 2 and the epilogue's arithmetic: fused.cuh).
//
// One persistent CTA per SM and batch tile of N rows (8, 16 or 32) walks the same vocabulary tiles of
// 128 W rows as fused_partials_kernel. A producer warp issues bulk tensor copies of each tile in stages
// of 64 D elements (W: 128 rows x 128 bytes; h: N rows x 128 bytes, rows past the batch read as zeros)
// into a ring of shared-memory stages, 128-byte swizzled; an mbarrier per stage says "full" (bytes
// landed) and another "empty" (every consumer warp is done with it). Two consumer warpgroups multiply
// their 64 W rows of the stage with the batch by wgmma (fp32 accumulation over D in order; mma.sync in
// the portable build). At the end of a tile the logits go through shared memory to the same per-lane
// epilogue as fused_partials_kernel (`consume`), each warp taking batch rows warp, warp + 8, ..., while
// the producer already fills the ring with the next tile.
//
// Why: the register ring of fused_partials_kernel holds 64 KB a SM in flight at its 128-register
// ceiling and reached 97 % of the HBM roofline at best; the copy engine keeps the whole ring in flight
// without registers and without the consumer warps issuing loads.
#pragma once
#include <cuda.h>

#include "fused.cuh"

namespace tokensampler {
namespace fused {

constexpr int kStreamConsumers = 8;                    // warps; 16 W rows of the tile each
constexpr int kStreamThreads = 32 * (kStreamConsumers + 1);
constexpr int kStageK = 64;                            // D elements a stage: one 128-byte swizzle span
constexpr int kStageW = kTileRows * kStageK * 2;       // bytes of W a stage
constexpr int kTileStride = kTileRows + 4;             // floats a batch row of the logits tile (spreads banks)

template <int N>
struct StreamLayout {
  static constexpr int kStageBytes = kStageW + N * kStageK * 2;  // multiple of 1024 (the swizzle atom)
  static constexpr int kStages = 8;
  static constexpr int kTileBytes = N * kTileStride * 4;
  static constexpr int kBytes = 1024 + kStages * kStageBytes + kTileBytes + 2 * kStages * 8;  // 1024: alignment
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
  } else {
    static_assert(N == 32, "batch tiles of 8, 16 or 32 rows");
    TS_WGMMA(32, "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15", "%16", "%17", "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]))
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
// wgmma for its 64 W rows (operands read from shared memory by the tensor cores); the portable build
// loads fragments with ldmatrix and multiplies with mma.sync, with the same C layout.
template <bool BF16, int N>
__device__ __forceinline__ void multiply_stage(float (&acc)[N / 2], uint32_t w_tile, uint32_t h_tile, int warp, int lane) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint64_t a_desc = tile_descriptor(w_tile + (warp / 4) * 64 * 128), b_desc = tile_descriptor(h_tile);
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
  for (int kk = 0; kk < kStageK / 16; ++kk) wgmma_k16<BF16, N>(acc, a_desc + 2 * kk, b_desc + 2 * kk);
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
  for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(acc[i])::"memory");  // no read before the wait
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

template <bool BF16, int N>
__global__ void __launch_bounds__(kStreamThreads, 1)
    fused_stream_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap h_map,
                        const PartialsArgs a) {
  using L = StreamLayout<N>;
  constexpr int kRowsPerWarp = N / kStreamConsumers;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = shared_address(smem_raw);
  const uint32_t ring = (raw + 1023u) & ~1023u;
  float* tile_x = reinterpret_cast<float*>(smem_raw + (ring - raw) + L::kStages * L::kStageBytes);
  const uint32_t full = shared_address(tile_x + N * kTileStride);  // kStages mbarriers, then kStages "empty"
  const uint32_t empty = full + 8 * L::kStages;

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int cta = blockIdx.x / a.batch_tiles;
  const int b0 = (blockIdx.x % a.batch_tiles) * N;
  const int k_stages = static_cast<int>(a.head.dim / kStageK);

  if (threadIdx.x == 0) {
    for (int s = 0; s < L::kStages; ++s) {
      mbarrier_init(full + 8 * s, 1);
      mbarrier_init(empty + 8 * s, kStreamConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == kStreamConsumers) {  // the producer
    if (lane == 0) {
      int step = 0;
      for (int tile = cta; tile < a.num_tiles; tile += a.vocab_ctas) {
        for (int k = 0; k < k_stages; ++k, ++step) {
          const int s = step % L::kStages;
          mbarrier_wait(empty + 8 * s, ((step / L::kStages) & 1) ^ 1);
          const uint32_t stage = ring + s * L::kStageBytes;
          mbarrier_expect_bytes(full + 8 * s, L::kStageBytes);
          bulk_tensor_load(stage, &w_map, k * kStageK, tile * kTileRows, full + 8 * s);
          bulk_tensor_load(stage + kStageW, &h_map, k * kStageK, b0, full + 8 * s);
        }
      }
    }
    return;
  }

  // Consumer warp `warp`: W rows 16 warp .. + 15 of each tile; epilogue of batch rows warp + 8 r.
  RowState state[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = b0 + warp + kStreamConsumers * r;
    if (row < a.num_rows) state[r] = make_row_state(a.rows, row);
  }
  CandidateBuffer no_candidates{nullptr, 0, 0ull};  // filtered rows are not collected here (write_partial)
  const int g = lane >> 2, t = lane & 3;

  int step = 0;
  for (int tile = cta; tile < a.num_tiles; tile += a.vocab_ctas) {
    float acc[N / 2] = {};
    for (int k = 0; k < k_stages; ++k, ++step) {
      const int s = step % L::kStages;
      mbarrier_wait(full + 8 * s, (step / L::kStages) & 1);
      const uint32_t w_tile = ring + s * L::kStageBytes;
      multiply_stage<BF16, N>(acc, w_tile, w_tile + kStageW, warp, lane);
      __syncwarp();
      if (lane == 0) mbarrier_arrive(empty + 8 * s);
    }
    // The tile's logits as [batch row][W row], then each warp's batch rows through the epilogue.
    asm volatile("bar.sync 1, %0;\n" ::"n"(32 * kStreamConsumers) : "memory");  // last tile's epilogue read
#pragma unroll
    for (int n = 0; n < N / 8; ++n) {
      const int col = n * 8 + 2 * t, row = warp * 16 + g;
      tile_x[col * kTileStride + row] = acc[4 * n];
      tile_x[(col + 1) * kTileStride + row] = acc[4 * n + 1];
      tile_x[col * kTileStride + row + 8] = acc[4 * n + 2];
      tile_x[(col + 1) * kTileStride + row + 8] = acc[4 * n + 3];
    }
    asm volatile("bar.sync 1, %0;\n" ::"n"(32 * kStreamConsumers) : "memory");
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int n = warp + kStreamConsumers * r;
      if (b0 + n >= a.num_rows || state[r].mode == kCandidates) continue;
      const float4 q = *reinterpret_cast<const float4*>(tile_x + n * kTileStride + 4 * lane);
      float x[4] = {q.x, q.y, q.z, q.w};
      consume(state[r], no_candidates, x, static_cast<int64_t>(tile) * kTileRows + 4 * lane, a.head,
              a.want_sum1 != 0, lane);
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t row = b0 + warp + kStreamConsumers * r;
    if (row < a.num_rows) write_partial(state[r], no_candidates, a, row * a.vocab_ctas + cta, false, lane);
  }
}

}  // namespace fused
}  // namespace tokensampler
