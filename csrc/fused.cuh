// Fused LM-head matmul + sampling (C API: fused.h; launchers: fused.cu). Framework-free device code.
//
// Stage 1 (fused_partials_kernel): a persistent CTA of 16 warps holds its batch tile of hidden states
// (8 or 16 rows, all of D) in shared memory and walks vocabulary tiles of 128 rows. Warp (g, h) owns
// rows 16g .. 16g+15 of the tile and half h of D: it streams those W rows once from HBM straight into
// registers (16-byte loads, a ring of PF chunks in flight, the next tile's first chunks issued before
// this tile's epilogue) and multiplies them with mma.sync m16n8k16 (fp32 accumulation). The two halves
// are added in shared memory, then one warp per batch row consumes the 128 logits: finish (bias,
// scale, soft cap, padded rows), running max and sum-exp, and either the Gumbel-max winner / argmax or
// a candidate buffer (the row's best keys so far above a rising threshold).
// Where its shared memory fits (and, for filtered rows, the vocabulary spans 64 CTAs or more), stage 1 is
// fused_stream_kernel (fused_stream.cuh) instead: W by the tensor memory accelerator, the epilogue in warps
// of its own (the same per-token arithmetic, a row's totals reduced across the warp per tile, a filtered
// row's best 16 keys a CTA) and the same partials.
// Stage 2 (fused_finish_kernel): one CTA per batch row merges the CTAs' partial results, selects the
// kCand best candidates exactly (unique rank keys, ranked by counting above two floors, or a radix select
// when more than a block's worth lie above them; fewer when a CTA's list was full above them), and
// finishes the semantics.
//
// Why registers and not shared memory for W: every W element is used by exactly one warp, so staging it
// would only add a shared-memory round trip. The k order inside a chunk is permuted (thread t loads 8
// consecutive elements and feeds them to two MMAs); a dot product does not care, as long as A and B
// use the same permutation — which is what lets each thread load 16 bytes at once.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "fused.h"
#include "philox.cuh"

namespace tokensampler {
namespace fused {

constexpr int kRowGroups = 8;                // 16-row MMA groups per tile
constexpr int kWarps = 2 * kRowGroups;       // x 2 halves of D
constexpr int kThreads = 32 * kWarps;
constexpr int kTileRows = 16 * kRowGroups;   // vocabulary rows per tile
constexpr int kChunk = 32;                   // D elements per warp step (64 bytes of each W row)
constexpr int kHPad = 32;                    // elements of padding per h row in shared memory
constexpr int kCand = 64;                    // candidates per (row, CTA), and merged per row
constexpr int kCandBuf = 256;                // candidate buffer per row in shared memory
constexpr int kFinishThreads = 256;
constexpr int kFinishWarps = kFinishThreads / 32;

enum RowMode : int { kGreedy = 0, kGumbel = 1, kCandidates = 2 };

// Whether stage 2 stages a row's candidate lists in shared memory (its dynamic shared memory, which the
// launcher sizes): only the ring's kCand a CTA, read in up to 8 radix passes. The streaming kernel's shorter
// lists are read from L2, so stage 2's CTAs fit beside it and wait there.
__host__ __device__ constexpr bool stages_candidates(int cands_per_part) { return cands_per_part == kCand; }

// Per (row, CTA) partial result of stage 1.
struct Partial {
  float max;       // max x over the CTA's tokens (-inf: none finite)
  float sum1;      // sum exp(x - max)         (raw log-probs)
  float sum_t;     // sum exp((x - max) / T)   (top-p without k)
  float best_score;
  float best_x;
  int32_t best_id; // -1: none
  int32_t nan;
  int32_t no_candidates;  // 1: a filtered row whose candidates this kernel did not collect
};

struct PartialsArgs {
  TsLmHead head;
  const uint16_t* states;
  int64_t num_rows;
  TsRows rows;
  int32_t want_sum1;
  int32_t first_tile;   // the CTAs walk tiles first_tile .. num_tiles - 1 (ids global: fused.cu's shard_view)
  int32_t num_tiles;
  int32_t full_rounds;        // the streaming kernel's walk (fused_stream.cuh's stream_unit): whole rounds of a tile
  int32_t last_round_units;   // a CTA, then a last round of this many units: its tiles, or, with last_round_halves,
  int32_t last_round_halves;  // twice as many half tiles
  int32_t vocab_ctas;   // fixed by V and the GPU, never by B: each row's arithmetic is batch invariant
  int32_t batch_tiles;
  Partial* partials;   // [num_rows, vocab_ctas]
  uint64_t* cands;     // [num_rows, vocab_ctas, kCand]
};

// Stage 2's input: one or more stage 1 outputs side by side, `shard_bytes` apart (fused.h ts_fused_finish), each
// partials [num_rows, parts_a_shard], then, with cands_per_part > 0, each CTA's best keys, descending, zero-filled,
// [num_rows, parts_a_shard, cands_per_part]. A row's parts are the shards' in turn.
struct FinishArgs {
  int64_t num_rows;
  TsRows rows;
  int32_t num_parts;  // a row's: parts_a_shard times the shards
  int32_t parts_a_shard;
  const unsigned char* shards;
  int64_t shard_bytes;
  int32_t cands_per_part;
  TsFusedOutputs out;
};

// Row b's entries of one kind (a shard holds `per_shard` of them, shard_bytes after the previous shard's) as one
// array: entry i of the row is entry i - s per_shard of shard s. shard_bytes 0: one shard, a plain array.
template <typename T>
struct RowEntries {
  const unsigned char* first;
  int64_t shard_bytes;
  int per_shard;
  __device__ __forceinline__ T operator[](int i) const {
    if (shard_bytes == 0) return reinterpret_cast<const T*>(first)[i];
    const int s = i / per_shard;
    return reinterpret_cast<const T*>(first + s * shard_bytes)[i - s * per_shard];
  }
};

// Row b's partial results, and its candidate keys (every part's list in turn).
__device__ __forceinline__ RowEntries<Partial> row_partials(const FinishArgs& a, int64_t b) {
  return RowEntries<Partial>{a.shards + b * a.parts_a_shard * sizeof(Partial), a.shard_bytes, a.parts_a_shard};
}
__device__ __forceinline__ RowEntries<uint64_t> row_candidates(const FinishArgs& a, int64_t b) {
  const int64_t per_shard = static_cast<int64_t>(a.parts_a_shard) * a.cands_per_part;
  const unsigned char* lists = a.shards + a.num_rows * a.parts_a_shard * sizeof(Partial);
  return RowEntries<uint64_t>{lists + b * per_shard * sizeof(uint64_t), a.shard_bytes, static_cast<int>(per_shard)};
}

__device__ __forceinline__ int row_mode(const TsRows& r, int64_t b) {
  if (!(r.temperature[b] > 0.f)) return kGreedy;
  const bool filtered = r.top_k[b] > 0 || r.top_p[b] < 1.f || r.min_p[b] > 0.f;
  return filtered ? kCandidates : kGumbel;
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// W is read exactly once: keep it out of L1 and ask L2 to fetch whole 256-byte lines ahead.
__device__ __forceinline__ uint4 load_streaming(const uint16_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// A row's candidate buffer: keys above `threshold` are appended; when it fills, it is sorted and cut
// to the best kCand, whose last key becomes the threshold (so later tiles append few keys).
struct CandidateBuffer {
  uint64_t* keys;
  int count;
  uint64_t threshold;

  __device__ void compact(int lane) {
    for (int i = count + lane; i < kCandBuf; i += 32) keys[i] = 0;
    warp_sort_desc_shared(keys, kCandBuf, lane);
    count = min(count, kCand);
    if (count == kCand) threshold = keys[kCand - 1];
  }
  __device__ void append(uint64_t key, int lane) {
    if (count + 32 > kCandBuf) compact(lane);
    const bool take = key > threshold;
    const unsigned ballot = __ballot_sync(0xffffffffu, take);
    if (take) keys[count + __popc(ballot & ((1u << lane) - 1u))] = key;
    count += __popc(ballot);
  }
};

// What one warp keeps of one batch row across the CTA's tiles (per lane, merged at the end).
struct RowState {
  int mode;
  float temperature;
  NoiseStream noise;
  float max = -kInf, sum1 = 0.f, sum_t = 0.f;
  float best_score = -kInf, best_x = -kInf;
  int32_t best_id = -1;
  bool nan = false;
};

__device__ __forceinline__ RowState make_row_state(const TsRows& r, int64_t b) {
  RowState s;
  s.mode = row_mode(r, b);
  s.temperature = s.mode == kGreedy ? 1.f : r.temperature[b];
  s.noise = NoiseStream::make(r.seed[b], r.position[b], r.iteration[b], 0u);
  return s;
}

__device__ __forceinline__ float finish_logit(float x, int64_t v, const TsLmHead& head) {
  if (head.bias != nullptr) x += head.bias[v];
  x *= head.logit_scale;
  if (head.soft_cap > 0.f) x = head.soft_cap * tanhf(x / head.soft_cap);
  return x;
}

// The allowed bits of tokens v0 .. v0+3 of a row (bit j: token v0 + j; v0 a multiple of 4) under its token
// bitmask, 0xF without one.
__device__ __forceinline__ uint32_t allowed_bits(const uint32_t* mask, int64_t v0, const TsLmHead& head) {
  return mask != nullptr && v0 < head.vocab ? group_mask_bits(mask, v0 >> 2) & 0xFu : 0xFu;
}

// Finishes tokens v0 .. v0+3 of this lane in place; returns whether one was NaN or +inf (now -inf). Tokens whose
// bit of `allowed` is clear become -inf first (step 2 masks them), so that a NaN among them is no NaN of the row.
__device__ __forceinline__ bool finish_group(float (&x)[4], int64_t v0, const TsLmHead& head, uint32_t allowed) {
  bool bad = false;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (v0 + j < head.vocab && ((allowed >> j) & 1u)) {
      x[j] = finish_logit(x[j], v0 + j, head);
      bad |= sanitize(x[j]);
    } else {
      x[j] = -kInf;  // padded rows, the tail of the last tile and masked tokens are never sampled
    }
  }
  return bad;
}

// The Gumbel screen of one finite token, shared by both stage 1 kernels: false when xt = x / T plus an
// integer-only upper bound of its noise (rounded as the score is) stays below `bound`, so its score
// cannot reach it and the two exact logs are skipped; otherwise true, with its exact score xt + g.
__device__ __forceinline__ bool screened_score(float xt, uint32_t word, float bound, float& score) {
  if (xt + gumbel_upper_bound(word) < bound) return false;
  score = xt + gumbel_exact(word);
  return true;
}

// Consumes tokens v0 .. v0+3 (one Philox group) of this lane: x already read from the tile. kMask: some row of the
// launch has a token bitmask (the kernels' masked instances; without, no register holds a mask), `mask` this row's.
template <bool kMask>
__device__ __forceinline__ void consume(RowState& s, const uint32_t* mask, CandidateBuffer& cand, float (&x)[4],
                                        int64_t v0, const TsLmHead& head, bool want_sum1, int lane) {
  s.nan |= finish_group(x, v0, head, kMask ? allowed_bits(mask, v0, head) : 0xFu);
  const float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
  if (tile_max > s.max) {
    if (s.max > -kInf) {
      s.sum1 *= expf(s.max - tile_max);
      s.sum_t *= expf((s.max - tile_max) / s.temperature);
    }
    s.max = tile_max;
  }
  if (s.max > -kInf) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (want_sum1) s.sum1 += expf(x[j] - s.max);
      if (s.mode == kCandidates) s.sum_t += expf((x[j] - s.max) / s.temperature);
    }
  }
  if (s.mode == kGreedy) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if (x[j] > s.best_score) {
        s.best_score = s.best_x = x[j];
        s.best_id = static_cast<int32_t>(v0 + j);
      }
    }
  } else if (s.mode == kGumbel) {
    // The row's best score so far, over every lane (the mode is the warp's: one row a warp). A token
    // whose score cannot reach it (x / T plus an integer-only upper bound of its noise, rounded the
    // same way) cannot be the row's winner, so it skips the two exact logs; the winner and its
    // partial are exactly those of scoring every token.
    const float bound = warp_allreduce(s.best_score, MaxOp{});
    if (tile_max > -kInf) {
      const uint4 words = s.noise.group(static_cast<uint32_t>(v0 >> 2));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (x[j] > -kInf) {
          float score;
          if (!screened_score(x[j] / s.temperature, word_of(words, j), bound, score)) continue;
          if (score > s.best_score) {
            s.best_score = score;
            s.best_x = x[j];
            s.best_id = static_cast<int32_t>(v0 + j);
          }
        }
      }
    }
  } else {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      cand.append(x[j] > -kInf ? rank_key(x[j], static_cast<uint32_t>(v0 + j)) : 0ull, lane);
  }
}

// Merges the lanes' state of one row and writes this CTA's partial result (and a filtered row's
// candidates) to its slot.
__device__ __forceinline__ void write_partial(const RowState& state, CandidateBuffer& cand, const PartialsArgs& a,
                                              int64_t slot, int lane) {
  const float row_max = warp_allreduce(state.max, MaxOp{});
  float sum1 = 0.f, sum_t = 0.f;
  if (state.max > -kInf) {
    sum1 = state.sum1 * expf(state.max - row_max);
    sum_t = state.sum_t * expf((state.max - row_max) / state.temperature);
  }
  sum1 = warp_allreduce(sum1, SumOp{});
  sum_t = warp_allreduce(sum_t, SumOp{});
  const uint64_t my_key = state.best_id >= 0 ? rank_key(state.best_score, static_cast<uint32_t>(state.best_id)) : 0ull;
  const uint64_t best_key = warp_allreduce(my_key, MaxOp{});
  const bool any_nan = __any_sync(0xffffffffu, state.nan);
  const int winner = __ffs(__ballot_sync(0xffffffffu, my_key == best_key)) - 1;
  const float best_x = __shfl_sync(0xffffffffu, state.best_x, winner);
  const float best_score = __shfl_sync(0xffffffffu, state.best_score, winner);
  if (lane == 0) {
    Partial p;
    p.max = row_max;
    p.sum1 = sum1;
    p.sum_t = sum_t;
    p.best_score = best_score;
    p.best_x = best_x;
    p.best_id = best_key != 0 ? static_cast<int32_t>(key_index(best_key)) : -1;
    p.nan = any_nan;
    p.no_candidates = 0;  // this kernel collects every filtered row's candidates
    a.partials[slot] = p;
  }
  if (state.mode == kCandidates) {
    cand.compact(lane);
    for (int i = lane; i < kCand; i += 32) a.cands[slot * kCand + i] = i < cand.count ? cand.keys[i] : 0ull;
  }
}

template <bool BF16, int NT, int PF, bool kMask>
__global__ void __launch_bounds__(kThreads, 1) fused_partials_kernel(const PartialsArgs a) {
  constexpr int kBatchTile = 8 * NT;
  extern __shared__ __align__(16) unsigned char smem[];
  const int dim = static_cast<int>(a.head.dim);
  const int h_stride = dim + kHPad;  // 64 bytes of padding: the 8 threads of a quarter warp hit 8 bank groups
  uint16_t* hs = reinterpret_cast<uint16_t*>(smem);
  float* halves = reinterpret_cast<float*>(hs + kBatchTile * h_stride);     // [kRowGroups][32][NT * 4]
  float* tile_x = halves + kRowGroups * 32 * NT * 4;                        // [kBatchTile][kTileRows]
  uint64_t* cand_keys = reinterpret_cast<uint64_t*>(tile_x + kBatchTile * kTileRows);  // [kBatchTile][kCandBuf]

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // Batch tiles vary fastest, so the CTAs that read the same W tiles run in the same wave (W from
  // HBM once, then from L2).
  const int cta = blockIdx.x / a.batch_tiles;
  const int64_t b0 = static_cast<int64_t>(blockIdx.x % a.batch_tiles) * kBatchTile;

  // The batch tile's hidden states, all of D, once per CTA.
  const int vecs = dim / 8;
  for (int i = threadIdx.x; i < kBatchTile * vecs; i += kThreads) {
    const int r = i / vecs, c = i - r * vecs;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (b0 + r < a.num_rows) v = *reinterpret_cast<const uint4*>(a.states + (b0 + r) * dim + c * 8);
    *reinterpret_cast<uint4*>(hs + r * h_stride + c * 8) = v;
  }

  // The epilogue warp of batch row `warp` (if any) keeps its row's state in registers.
  const int64_t my_row = b0 + warp;
  const bool has_row = warp < kBatchTile && my_row < a.num_rows;
  RowState state;
  CandidateBuffer cand{cand_keys + (warp % kBatchTile) * kCandBuf, 0, 0ull};
  if (has_row) state = make_row_state(a.rows, my_row);
  // The rows' token bitmasks (kMask), read by their warps from shared memory at each tile: held in registers
  // through the main loop, they spilled 8 more bytes.
  __shared__ const uint32_t* masks[kBatchTile];
  if (kMask && has_row && lane == 0) masks[warp] = row_bitmask(a.rows.bitmask, my_row);
  __syncthreads();

  // Main-loop role: rows 16 * group .. + 15 of each tile, half `half` of D.
  const int group = warp % kRowGroups, half = warp / kRowGroups;
  const int g = lane >> 2, t = lane & 3;
  const int chunks = dim / 2 / kChunk;
  const int k_begin = half * (dim / 2);
  const uint16_t* w = static_cast<const uint16_t*>(a.head.weight);
  const int64_t last_row = a.head.vocab - 1;
  auto row_ptr = [&](int tile, int r) {
    const int64_t row = min(static_cast<int64_t>(tile) * kTileRows + group * 16 + r, last_row);
    return w + row * dim + k_begin + t * 8;
  };

  uint4 ring_lo[PF], ring_hi[PF];  // rows g and g + 8 of the next PF chunks
  int tile = a.first_tile + cta;
  if (tile < a.num_tiles) {
    const uint16_t *lo = row_ptr(tile, g), *hi = row_ptr(tile, g + 8);
#pragma unroll
    for (int p = 0; p < PF; ++p) {
      ring_lo[p] = load_streaming(lo + p * kChunk);
      ring_hi[p] = load_streaming(hi + p * kChunk);
    }
  }
  for (; tile < a.num_tiles; tile += a.vocab_ctas) {
    const int next = tile + a.vocab_ctas;
    const uint16_t *lo = row_ptr(tile, g), *hi = row_ptr(tile, g + 8);
    const uint16_t *next_lo = row_ptr(next < a.num_tiles ? next : tile, g),
                   *next_hi = row_ptr(next < a.num_tiles ? next : tile, g + 8);
    float acc[NT][4] = {};
    for (int c0 = 0; c0 < chunks; c0 += PF) {
#pragma unroll
      for (int p = 0; p < PF; ++p) {
        const int c = c0 + p;
        const uint4 x_lo = ring_lo[p], x_hi = ring_hi[p];
        const int c_next = c + PF;
        if (c_next < chunks) {
          ring_lo[p] = load_streaming(lo + c_next * kChunk);
          ring_hi[p] = load_streaming(hi + c_next * kChunk);
        } else if (next < a.num_tiles) {
          ring_lo[p] = load_streaming(next_lo + (c_next - chunks) * kChunk);
          ring_hi[p] = load_streaming(next_hi + (c_next - chunks) * kChunk);
        }
        const int k = k_begin + c * kChunk + t * 8;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
          const uint4 h = *reinterpret_cast<const uint4*>(hs + (n * 8 + g) * h_stride + k);
          mma16816<BF16>(acc[n], x_lo.x, x_hi.x, x_lo.y, x_hi.y, h.x, h.y);
          mma16816<BF16>(acc[n], x_lo.z, x_hi.z, x_lo.w, x_hi.w, h.z, h.w);
        }
      }
    }
    // Add the two halves of D, then lay the tile out as [batch row][vocabulary row].
    float* mine = halves + (group * 32 + lane) * NT * 4;
    if (half == 1) {
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) mine[n * 4 + i] = acc[n][i];
    }
    __syncthreads();
    if (half == 0) {
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        const int col = n * 8 + 2 * t, row = group * 16 + g;
        tile_x[col * kTileRows + row] = acc[n][0] + mine[n * 4 + 0];
        tile_x[(col + 1) * kTileRows + row] = acc[n][1] + mine[n * 4 + 1];
        tile_x[col * kTileRows + row + 8] = acc[n][2] + mine[n * 4 + 2];
        tile_x[(col + 1) * kTileRows + row + 8] = acc[n][3] + mine[n * 4 + 3];
      }
    }
    __syncthreads();
    if (has_row) {
      const float4 q = *reinterpret_cast<const float4*>(tile_x + warp * kTileRows + 4 * lane);
      float x[4] = {q.x, q.y, q.z, q.w};
      consume<kMask>(state, kMask ? masks[warp] : nullptr, cand, x, static_cast<int64_t>(tile) * kTileRows + 4 * lane,
                     a.head, a.want_sum1 != 0, lane);
    }
  }

  if (has_row) write_partial(state, cand, a, my_row * a.vocab_ctas + cta, lane);
}

// The kCand-th best of the first `count` CTAs' best keys (`heads`, shared memory), which at least kCand keys
// match or beat, so it lies at or below the row's kCand-th best key: written to `*floor` by the one thread that
// holds it, and not at all when fewer than kCand heads hold a key. No barrier: the heads are visible before
// the call, and `*floor` is read after the next barrier.
__device__ void post_rank_floor(const uint64_t* heads, int count, uint64_t* floor) {
  for (int c = threadIdx.x; c < count; c += kFinishThreads) {
    const uint64_t h = heads[c];
    int above = 0;
    for (int j = 0; j < count; ++j) above += heads[j] > h;
    if (h != 0 && above == kCand - 1) *floor = h;  // keys are unique: one thread at most
  }
}

// A cut c such that exactly `want` of the keys[0, n) in [lower, highest] (all keys unique, lower >= 1,
// `highest` the largest) are >= c, by 8-bit radix select from the first byte where lower and highest
// differ: per pass a histogram of the next digit of the keys that match the digits so far, and warp 0
// finds the digit holding rank `want` (lane l owns digits 255 - 8l .. 248 - 8l). Stops once the wanted
// keys are exactly those above the digits so far and all of that digit's from `lower` up.
template <typename Keys>
__device__ uint64_t select_key(const Keys& keys, int n, int want, uint64_t lower, uint64_t highest,
                               unsigned int* hist, int* chosen) {
  const uint64_t differ = lower ^ highest;
  int shift = differ == 0 ? 0 : (63 - __clzll(static_cast<long long>(differ))) / 8 * 8;
  uint64_t mask = shift == 56 ? 0ull : ~0ull << (shift + 8);
  uint64_t prefix = lower & mask;
  const int lane = threadIdx.x & 31;
  for (; shift >= 0; shift -= 8) {
    for (int i = threadIdx.x; i < 256; i += kFinishThreads) hist[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += kFinishThreads) {
      const uint64_t k = keys[i];
      if (k >= lower && (k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1u);
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      unsigned int mine[8], total = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) total += mine[j] = hist[255 - 8 * lane - j];
      unsigned int above = total;  // inclusive scan over lanes, then made exclusive
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned int up = __shfl_up_sync(0xffffffffu, above, o);
        if (lane >= o) above += up;
      }
      above -= total;
      int digit = -1;
      unsigned int before = above;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (digit < 0 && before + mine[j] >= static_cast<unsigned int>(want)) digit = 255 - 8 * lane - j;
        else if (digit < 0) before += mine[j];
      }
      const int first = __ffs(__ballot_sync(0xffffffffu, digit >= 0)) - 1;
      if (lane == first) {
        chosen[0] = digit;
        chosen[1] = static_cast<int>(before);
        chosen[2] = static_cast<int>(hist[digit]);
      }
    }
    __syncthreads();
    prefix |= static_cast<uint64_t>(chosen[0]) << shift;
    mask |= 255ull << shift;
    want -= chosen[1];
    const bool whole_bucket = chosen[2] == want;  // every key with this prefix is wanted: it is the cut
    __syncthreads();
    if (whole_bucket) break;
  }
  return prefix > lower ? prefix : lower;  // keys below `lower` may share the prefix: they were not counted
}

// A candidate row's parameters: inputs, so stage 2 reads them before it waits for stage 1.
struct CandidateRow {
  float temperature, top_p, min_p;
  int32_t top_k;
  int64_t seed, position, iteration;

  __device__ static CandidateRow read(const TsRows& r, int64_t b) {
    return CandidateRow{r.temperature[b], r.top_p[b], r.min_p[b], r.top_k[b], r.seed[b], r.position[b], r.iteration[b]};
  }
};

// Steps 8-10 for a candidate row, by warp 0: top[0, count) sorted (x desc, id asc), the global
// max, sum exp(z) over every finite token, and whether the candidates are every finite token. Writes each
// sample's token and, when `logprobs` is set, its raw log-prob x - max - log_sum1.
// Returns false when the kept set reaches past the candidates (the row takes the logits path).
__device__ bool sample_candidates(const uint64_t* top, int count, bool complete, float row_max, float sum_t,
                                  float log_sum1, const CandidateRow& r, int64_t b, int num_samples, int64_t* tokens,
                                  float* logprobs, int lane) {
  const float temperature = r.temperature;
  const int k = r.top_k;
  const float p = r.top_p, m = r.min_p;
  float x[2], z[2];
  uint32_t id[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int i = lane + 32 * j;
    x[j] = i < count ? key_value(top[i]) : -kInf;
    z[j] = i < count ? (x[j] - row_max) / temperature : -kInf;
    id[j] = i < count ? key_index(top[i]) : 0u;
  }
  // L1: the top-k and min-p prefix; known when it ends inside the candidates.
  int limit = count;
  bool known = complete;
  if (k > 0 && k <= count) {
    limit = k;
    known = true;
  } else if (k > 0 && !complete) {
    return false;  // the top-k set reaches past the candidates
  }
  if (m > 0.f) {
    const int above = __popc(__ballot_sync(0xffffffffu, expf(z[0]) >= m && lane < count)) +
                      __popc(__ballot_sync(0xffffffffu, expf(z[1]) >= m && lane + 32 < count));
    if (above < limit) {
      limit = above;
      known = true;
    }
    if (!known) return false;  // min-p keeps every candidate and maybe more
  }
  // L2: top-p over the prefix, divided by the prefix's mass (every finite token's when L1 is the row):
  // the first candidate whose running mass reaches p, by a scan across the warp (candidate i: lane i % 32).
  int kept = limit;
  if (p < 1.f) {
    float e[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) e[j] = lane + 32 * j < limit ? expf(z[j]) : 0.f;
    const float total = known ? warp_allreduce(e[0] + e[1], SumOp{}) : sum_t;
    const float run0 = warp_inclusive_scan(e[0], lane);
    const float run1 = __shfl_sync(0xffffffffu, run0, 31) + warp_inclusive_scan(e[1], lane);
    const unsigned hit0 = __ballot_sync(0xffffffffu, lane < limit && run0 / total >= p);
    const unsigned hit1 = __ballot_sync(0xffffffffu, lane + 32 < limit && run1 / total >= p);
    const int reached = hit0 ? __ffs(hit0) : hit1 ? 32 + __ffs(hit1) : -1;  // how many are kept
    if (reached < 0 && !known) return false;
    kept = reached < 0 ? limit : reached;
  }
  // Step 10: Gumbel-max over the kept prefix, one noise draw per sample; the winner's lane writes it.
  for (int s = 0; s < num_samples; ++s) {
    const NoiseStream noise = NoiseStream::make(r.seed, r.position, r.iteration, static_cast<uint32_t>(s));
    uint64_t key[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 2; ++j)
      if (lane + 32 * j < kept) key[j] = rank_key(z[j] + gumbel_exact(noise.word(id[j])), id[j]);
    const uint64_t best = warp_max_key(max(key[0], key[1]));
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      if (key[j] != best || best == 0) continue;
      tokens[b * num_samples + s] = id[j];
      if (logprobs != nullptr) logprobs[b * num_samples + s] = x[j] - row_max - log_sum1;
    }
  }
  return true;
}

// A row's totals over CTA partials (stage 2): sums relative to `max` (-inf: no finite token; the sums are 0).
struct PartsTotals {
  float max, sum1, sum_t;
  uint64_t best;   // the best Gumbel / argmax key (0: none)
  uint32_t flags;  // kPartNan | kPartUncollected
};
constexpr uint32_t kPartNan = 1, kPartUncollected = 2;

// A sum relative to `from` made relative to `to` (>= from): times exp((from - to) / T), inv_t = 1 / T.
__device__ __forceinline__ float rebased(float sum, float from, float to, float inv_t) {
  return from > -kInf ? sum * expf((from - to) * inv_t) : 0.f;
}

// What stage 2 reads of a row's candidate lists before it selects: how many keys there are, the highest last
// key of a full list (`floor`; 0: none is full) and the highest key.
struct ListsScan {
  uint64_t floor, highest;
  int nonzero;
};

// Stage 2's shared memory besides the staged lists.
struct FinishShared {
  PartsTotals warp_totals[kFinishWarps];
  ListsScan warp_scans[kFinishWarps];
  unsigned int hist[256];
  int chosen[3];
  uint64_t top[kCand];            // a candidate row's best keys, sorted
  uint64_t keys[kFinishThreads];  // the first CTAs' best keys (the rank floor's), then the keys above the floors
  uint64_t lower_bound;
  int num_above, top_count, needs_logits_path;
  float best_x;
  CandidateRow params;
};

// A warp's totals in every lane: max first, so each lane's sums are rebased once; the sums by a butterfly,
// so every lane gets the same bits (float addition commutes). WIDTH lanes hold distinct totals.
template <int WIDTH>
__device__ __forceinline__ PartsTotals warp_parts_totals(const PartsTotals& t, float inv_t) {
  constexpr unsigned int kAll = 0xffffffffu;
  const float max = key_to_float(__reduce_max_sync(kAll, order_key(t.max)));
  float sum1 = rebased(t.sum1, t.max, max, 1.f), sum_t = rebased(t.sum_t, t.max, max, inv_t);
#pragma unroll
  for (int o = 1; o < WIDTH; o <<= 1) {
    sum1 += __shfl_xor_sync(kAll, sum1, o);
    sum_t += __shfl_xor_sync(kAll, sum_t, o);
  }
  return PartsTotals{max, sum1, sum_t, warp_max_key(t.best), __reduce_or_sync(kAll, t.flags)};
}

// The row's totals in every thread: each warp merges its lanes', then every warp the warps' (lane l takes
// warp l % kFinishWarps's). One barrier.
__device__ __forceinline__ PartsTotals block_row_totals(const PartsTotals& t, float inv_t, PartsTotals* warps) {
  const PartsTotals w = warp_parts_totals<32>(t, inv_t);
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = w;
  __syncthreads();
  return warp_parts_totals<kFinishWarps>(warps[threadIdx.x % kFinishWarps], inv_t);
}

// A candidate row's lists as this thread reads them (keys i = threadIdx.x + kFinishThreads j), the CTAs' heads
// into sh.keys and, when stages_candidates, every key into `staged`.
__device__ __forceinline__ ListsScan scan_lists(const FinishArgs& a, int64_t b, FinishShared& sh, uint64_t* staged) {
  const int per_part = a.cands_per_part, n = a.num_parts * per_part;
  const RowEntries<uint64_t> keys = row_candidates(a, b);
  const bool staging = stages_candidates(per_part);
  // A thread reads the same slot of a list at every step (per_part divides kFinishThreads), and its list
  // advances by kFinishThreads / per_part.
  const int slot = threadIdx.x % per_part, lists_a_step = kFinishThreads / per_part;
  ListsScan mine{0, 0, 0};
  for (int i = threadIdx.x, list = threadIdx.x / per_part; i < n; i += kFinishThreads, list += lists_a_step) {
    const uint64_t k = keys[i];
    if (staging) staged[i] = k;
    mine.nonzero += k != 0;
    mine.highest = max(mine.highest, k);
    if (slot == per_part - 1) mine.floor = max(mine.floor, k);
    if (slot == 0 && list < kFinishThreads) sh.keys[list] = k;
  }
  return mine;
}

// A warp's scans merged and posted for merged_lists, which reads them after the next barrier.
__device__ __forceinline__ void post_warp_lists(const ListsScan& t, ListsScan* warps) {
  const ListsScan w{warp_max_key(t.floor), warp_max_key(t.highest), __reduce_add_sync(0xffffffffu, t.nonzero)};
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = w;
}

// The row's scan in every thread, from the warps' (lane l takes warp l % kFinishWarps's).
__device__ __forceinline__ ListsScan merged_lists(const ListsScan* warps) {
  const ListsScan v = warps[threadIdx.x % kFinishWarps];
  return ListsScan{warp_max_key(v.floor), warp_max_key(v.highest),
                   __reduce_add_sync(0xffffffffu, (threadIdx.x & 31) < kFinishWarps ? v.nonzero : 0)};
}

// What select_candidates found: how many best keys sh.top holds, and whether they are every finite token.
struct Selected {
  int count;
  bool complete;
};

// A candidate row's kCand best keys, sorted descending into sh.top, and their count, from every CTA's sorted
// list (staged in shared memory or read from L2: stages_candidates) and the row's scan of them (the heads in
// sh.keys). A full list left out only keys below its last, so the keys at or above `floor` are exactly the
// row's best; when fewer than kCand are, only those are taken. `complete`: no list is full and there are at
// most kCand keys, so every finite token is a candidate.
__device__ __forceinline__ Selected select_candidates(const FinishArgs& a, int64_t b, const ListsScan& lists,
                                                      FinishShared& sh, const uint64_t* staged) {
  const int num_parts = a.num_parts, n = num_parts * a.cands_per_part;
  const RowEntries<uint64_t> keys = stages_candidates(a.cands_per_part)
                                        ? RowEntries<uint64_t>{reinterpret_cast<const unsigned char*>(staged), 0, n}
                                        : row_candidates(a, b);
  const bool complete = lists.floor == 0 && lists.nonzero <= kCand;
  post_rank_floor(sh.keys, min(num_parts, kFinishThreads), &sh.lower_bound);
  __syncthreads();
  // The kCand best trusted keys are at or above both floors (the rank floor lies at or below the kCand-th
  // best key); gather those, a warp's at a time, into sh.keys.
  const uint64_t lower = max(max(sh.lower_bound, lists.floor), uint64_t{1});
  const int lane = threadIdx.x & 31;
  for (int base = 0; base < n; base += kFinishThreads) {
    const int i = base + threadIdx.x;
    const uint64_t k = i < n ? keys[i] : 0;
    const unsigned int takers = __ballot_sync(0xffffffffu, k >= lower);
    int first = 0;
    if (lane == 0 && takers != 0) first = atomicAdd(&sh.num_above, __popc(takers));
    const int at = __shfl_sync(0xffffffffu, first, 0) + __popc(takers & ((1u << lane) - 1u));
    if (k >= lower && at < kFinishThreads) sh.keys[at] = k;
  }
  __syncthreads();
  const int above = sh.num_above;
  if (above <= kFinishThreads) {  // one key a thread, ranked by counting (keys are unique: ranks are distinct)
    if (threadIdx.x < above) {
      const uint64_t k = sh.keys[threadIdx.x];
      int rank = 0;
      for (int j = 0; j < above; ++j) rank += sh.keys[j] > k;
      if (rank < kCand) sh.top[rank] = k;
    }
    __syncthreads();
    return Selected{min(above, kCand), complete};
  }
  // More than the block has threads (many keys near the floors): the kCand-th best by radix select.
  const uint64_t cut = select_key(keys, n, kCand, lower, lists.highest, sh.hist, sh.chosen);
  for (int i = threadIdx.x; i < n; i += kFinishThreads)
    if (keys[i] >= cut) sh.top[atomicAdd(&sh.top_count, 1)] = keys[i];
  __syncthreads();
  if (threadIdx.x < 32) warp_sort_desc_shared(sh.top, kCand, threadIdx.x);
  __syncthreads();
  return Selected{kCand, complete};
}

// Adds a CTA's partial to this thread's totals.
__device__ __forceinline__ void add_partial(PartsTotals& t, float& best_x, const Partial& q, float inv_t) {
  const float top_max = fmaxf(t.max, q.max);
  t.sum1 = rebased(t.sum1, t.max, top_max, 1.f) + rebased(q.sum1, q.max, top_max, 1.f);
  t.sum_t = rebased(t.sum_t, t.max, top_max, inv_t) + rebased(q.sum_t, q.max, top_max, inv_t);
  t.max = top_max;
  const uint64_t key = q.best_id >= 0 ? rank_key(q.best_score, static_cast<uint32_t>(q.best_id)) : 0;
  if (key > t.best) {
    t.best = key;
    best_x = q.best_x;
  }
  t.flags |= (q.nan ? kPartNan : 0u) | (q.no_candidates ? kPartUncollected : 0u);
}

// One CTA a row. The minimum of one block a SM keeps ptxas from capping registers for occupancy, which spilled
// around the division slow paths; 48 registers a thread still fit beside stage 1's CTA.
__global__ void __launch_bounds__(kFinishThreads, 1) fused_finish_kernel(const FinishArgs a) {
  __shared__ FinishShared sh;
  extern __shared__ uint64_t staged[];  // [num_parts * cands_per_part]
  const int64_t b = blockIdx.x;
  // The row's parameters are inputs, not stage 1's results: read before the wait.
  const int mode = row_mode(a.rows, b);
  const float inv_t = mode == kGreedy ? 1.f : 1.f / a.rows.temperature[b];
  if (threadIdx.x == 0) {
    if (mode == kCandidates) sh.params = CandidateRow::read(a.rows, b);
    sh.lower_bound = 1;
    sh.num_above = 0;
    sh.top_count = 0;
  }
  wait_for_previous_grid();  // launched while stage 1 runs (launch_after_previous): its partials come first
  const int num_parts = a.num_parts;
  const RowEntries<Partial> parts = row_partials(a, b);
  // The first partial is loaded before a candidate row's lists are read, so that both reads overlap; both
  // are merged across the block under one barrier.
  Partial first{-kInf, 0.f, 0.f, 0.f, 0.f, -1, 0, 0};
  if (threadIdx.x < num_parts) first = parts[threadIdx.x];
  if (mode == kCandidates) post_warp_lists(scan_lists(a, b, sh, staged), sh.warp_scans);
  PartsTotals mine{-kInf, 0.f, 0.f, 0, 0};
  float mine_best_x = 0.f;
  add_partial(mine, mine_best_x, first, inv_t);
  for (int i = threadIdx.x + kFinishThreads; i < num_parts; i += kFinishThreads)
    add_partial(mine, mine_best_x, parts[i], inv_t);
  const PartsTotals row = block_row_totals(mine, inv_t, sh.warp_totals);
  const bool valid = row.max > -kInf;
  const bool uncollected = row.flags & kPartUncollected;
  const int ns = a.out.num_samples;
  int64_t* tokens = a.out.tokens;
  if (threadIdx.x == 0) sh.needs_logits_path = uncollected;

  if (valid && mode != kCandidates) {
    if (row.best != 0 && mine.best == row.best) sh.best_x = mine_best_x;
    for (int s = threadIdx.x; s < ns; s += kFinishThreads) tokens[b * ns + s] = key_index(row.best);
  } else if (valid && !uncollected) {
    const Selected selected = select_candidates(a, b, merged_lists(sh.warp_scans), sh, staged);
    if (threadIdx.x < 32 &&
        !sample_candidates(sh.top, selected.count, selected.complete, row.max, row.sum_t, logf(row.sum1),
                           sh.params, b, ns, tokens, a.out.logprobs, threadIdx.x) &&
        threadIdx.x == 0)
      sh.needs_logits_path = 1;
  }
  __syncthreads();
  const bool sampled_here = valid && !sh.needs_logits_path;
  if (threadIdx.x == 0)
    a.out.flags[b] =
        static_cast<uint8_t>((row.flags & kPartNan ? TS_ROW_NAN : 0) | (valid ? 0 : TS_ROW_INVALID) |
                             (sh.needs_logits_path ? TS_ROW_UNSETTLED : 0));
  for (int s = threadIdx.x; s < ns; s += kFinishThreads) {
    if (!valid) tokens[b * ns + s] = -1;
    // Sampled candidate rows have their log-probs from sample_candidates; NaN marks rows that are not valid
    // (choice 8) or not sampled here.
    if (a.out.logprobs == nullptr || (sampled_here && mode == kCandidates)) continue;
    a.out.logprobs[b * ns + s] = sampled_here ? sh.best_x - row.max - logf(row.sum1) : __int_as_float(0x7fc00000);
  }
}

}  // namespace fused
}  // namespace tokensampler
