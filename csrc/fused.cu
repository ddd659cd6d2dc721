// Launchers of the fused LM-head matmul + sampling kernels (fused.h; device code: fused.cuh).
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <algorithm>

#include "fused.cuh"
#include "fused_stream.cuh"
#include "launch.h"

namespace {

using namespace tokensampler;
using namespace tokensampler::fused;

size_t partials_smem_bytes(int rows_per_tile, int64_t dim) {
  const int nt = rows_per_tile / 8;
  return static_cast<size_t>(rows_per_tile) * (dim + kHPad) * sizeof(uint16_t)  // hidden states
         + static_cast<size_t>(kRowGroups) * 32 * nt * 4 * sizeof(float)        // the second half of D
         + static_cast<size_t>(rows_per_tile) * kTileRows * sizeof(float)       // one tile of logits
         + static_cast<size_t>(rows_per_tile) * kCandBuf * sizeof(uint64_t);    // candidate buffers
}

// The deepest register ring (chunks of 64 bytes per W row in flight) that divides a half of D.
int ring_depth(int64_t dim) {
  const int64_t chunks = dim / 2 / kChunk;
  return chunks % 4 == 0 ? 4 : chunks % 2 == 0 ? 2 : 1;
}

template <bool BF16, bool kMask, int NT, int PF>
cudaError_t launch_partials(const PartialsArgs& args, const TsFusedPlan& plan, cudaStream_t stream) {
  auto kernel = fused_partials_kernel<BF16, NT, PF, kMask>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(plan.smem_bytes));
  if (err != cudaSuccess) return err;
  kernel<<<plan.vocab_ctas * plan.batch_tiles, kThreads, plan.smem_bytes, stream>>>(args);
  return cudaGetLastError();
}

template <bool BF16, bool kMask, int NT>
cudaError_t launch_partials_ring(const PartialsArgs& args, const TsFusedPlan& plan, cudaStream_t stream) {
  switch (ring_depth(args.head.dim)) {
    case 4: return launch_partials<BF16, kMask, NT, 4>(args, plan, stream);
    case 2: return launch_partials<BF16, kMask, NT, 2>(args, plan, stream);
    default: return launch_partials<BF16, kMask, NT, 1>(args, plan, stream);
  }
}

size_t stream_smem_bytes(int rows_per_tile) {
  switch (rows_per_tile) {
    case 8: return StreamLayout<8>::kBytes;
    case 16: return StreamLayout<16>::kBytes;
    case 32: return StreamLayout<32>::kBytes;
    case 64: return StreamLayout<64>::kBytes;
    default: return StreamLayout<128>::kBytes;
  }
}

// A 2-D tensor map over rows x dim elements of 2 bytes (row stride dim), boxes of kStageK x box_rows,
// 128-byte swizzled; rows past the end read as zeros. No L2 promotion: with 256-byte promotion the stream
// kernel ran 3-9 µs slower at every batch (two H200s; docs/design/fused-lm-head.md). The
// driver's encoder is reached through the runtime, so nothing links against libcuda.
cudaError_t encode_rows(CUtensorMap* map, const void* base, int32_t dtype, int64_t rows, int64_t dim, int box_rows) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult found;
    void* fn = nullptr;
    const cudaError_t err = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (err != cudaSuccess) return err;
    if (found != cudaDriverEntryPointSuccess || fn == nullptr) return cudaErrorNotSupported;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(dim), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(dim) * 2};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(kStageK), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t unit[2] = {1, 1};
  const CUresult res = encode(map, dtype == 2 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                              const_cast<void*>(base), dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
                              CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return res == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

template <bool BF16, bool kMask, int N>
cudaError_t launch_stream(const PartialsArgs& args, const TsFusedPlan& plan, cudaStream_t stream) {
  CUtensorMap w_map, w_half_map, h_map;
  // The maps cover the weight's own rows (a shard's, from args.first_tile on): the producer's row coordinates are
  // relative to them. Tiles and half tiles (a split last round: fused_stream.cuh's stream_unit) have a map each.
  const int64_t first_row = static_cast<int64_t>(args.first_tile) * kTileRows, rows = args.head.vocab - first_row;
  const void* weight = static_cast<const uint16_t*>(args.head.weight) + first_row * args.head.dim;
  cudaError_t err = encode_rows(&w_map, weight, args.head.dtype, rows, args.head.dim, kTileRows);
  if (err == cudaSuccess) err = encode_rows(&w_half_map, weight, args.head.dtype, rows, args.head.dim, kHalfTileRows);
  if (err == cudaSuccess) err = encode_rows(&h_map, args.states, args.head.dtype, args.num_rows, args.head.dim, N);
  if (err != cudaSuccess) return err;
  auto kernel = fused_stream_kernel<BF16, N, kMask>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(plan.smem_bytes));
  if (err != cudaSuccess) return err;
  const int grid = plan.vocab_ctas * plan.batch_tiles;
  kernel<<<grid, StreamLayout<N>::kThreads, plan.smem_bytes, stream>>>(w_map, w_half_map, h_map, args);
  return cudaGetLastError();
}

template <bool BF16, bool kMask>
cudaError_t launch_stream_typed(const PartialsArgs& args, const TsFusedPlan& plan, cudaStream_t stream) {
  switch (plan.rows_per_tile) {
    case 8: return launch_stream<BF16, kMask, 8>(args, plan, stream);
    case 16: return launch_stream<BF16, kMask, 16>(args, plan, stream);
    case 32: return launch_stream<BF16, kMask, 32>(args, plan, stream);
    case 64: return launch_stream<BF16, kMask, 64>(args, plan, stream);
    default: return launch_stream<BF16, kMask, 128>(args, plan, stream);
  }
}

// kMask: the instances that read the rows' token bitmasks (args.rows.bitmask), for launches where a row has one;
// the others hold no register for a mask (the streaming kernel's epilogue went from 56 to 64 registers with a
// run-time test).
template <bool BF16, bool kMask>
cudaError_t launch_partials_typed(const PartialsArgs& args, const TsFusedPlan& plan, cudaStream_t stream) {
  if (plan.kernel != TS_FUSED_RING) return launch_stream_typed<BF16, kMask>(args, plan, stream);
  return plan.rows_per_tile == 16 ? launch_partials_ring<BF16, kMask, 2>(args, plan, stream)
                                  : launch_partials_ring<BF16, kMask, 1>(args, plan, stream);
}

template <bool BF16>
cudaError_t launch_partials_masked(const PartialsArgs& args, const TsFusedPlan& plan, cudaStream_t stream) {
  return args.rows.bitmask.words ? launch_partials_typed<BF16, true>(args, plan, stream)
                                 : launch_partials_typed<BF16, false>(args, plan, stream);
}

// Below this many CTAs along the vocabulary (V < 8192 on 132 SMs) a row's best 64 tokens crowd into a few
// CTAs' lists of kStreamCand and would often come back flagged: filtered batches take the ring's 64 a CTA.
constexpr int64_t kStreamCandMinCtas = 64;

// Keys each CTA keeps of a filtered row (0: the kernel collects none). Stage 2 reads a list's slots by thread,
// so each count divides its block.
static_assert(kFinishThreads % kCand == 0 && kFinishThreads % kStreamCand == 0,
              "a candidate list's length must divide kFinishThreads");
int cands_per_part(int kernel) {
  return kernel == TS_FUSED_RING ? kCand : kernel == TS_FUSED_STREAM_CANDIDATES ? kStreamCand : 0;
}

// The streaming kernel's rounds over the shard's tiles (fused_stream.cuh's stream_unit): whole rounds of one tile a
// CTA, then the rest, split into halves when at most half the CTAs would have a tile.
void walk_rounds(PartialsArgs* args) {
  const int32_t tiles = args->num_tiles - args->first_tile, rest = tiles % args->vocab_ctas;
  args->full_rounds = tiles / args->vocab_ctas;
  args->last_round_halves = rest > 0 && 2 * rest <= args->vocab_ctas;
  args->last_round_units = args->last_round_halves ? 2 * rest : rest;
}

// A shard's head as the rows first_token .. of a head that starts at token 0: the weight's and the bias's
// addresses moved back by first_token rows (never read there: the CTAs start at tile first_token / kTileRows), so
// that tile indices, ids, noise and bitmask words are the whole vocabulary's and no kernel knows of shards.
TsLmHead whole_vocabulary_view(const TsLmHead& head) {
  TsLmHead view = head;
  const uintptr_t rows_back = static_cast<uintptr_t>(head.first_token);
  view.weight = reinterpret_cast<const void*>(reinterpret_cast<uintptr_t>(head.weight) -
                                              rows_back * static_cast<uintptr_t>(head.dim) * sizeof(uint16_t));
  if (head.bias != nullptr)
    view.bias = reinterpret_cast<const float*>(reinterpret_cast<uintptr_t>(head.bias) - rows_back * sizeof(float));
  view.vocab = head.first_token + head.vocab;
  view.first_token = 0;
  return view;
}

// W[v]·h[r] of 8 elements a lane (one 16-byte load of each), in fp32.
template <bool BF16>
__device__ __forceinline__ float dot8(const uint4& w, const uint4& h) {
  const uint32_t wv[4] = {w.x, w.y, w.z, w.w}, hv[4] = {h.x, h.y, h.z, h.w};
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 a, b;
    if constexpr (BF16) {
      a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&wv[i]));
      b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hv[i]));
    } else {
      a = __half22float2(*reinterpret_cast<const __half2*>(&wv[i]));
      b = __half22float2(*reinterpret_cast<const __half2*>(&hv[i]));
    }
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
  }
  return acc;
}

constexpr int kHeadRowsThreads = 256;
constexpr int kHeadRowsWarps = kHeadRowsThreads / 32;
constexpr int kHeadRowsMaxBlocks = 1024;

// A warp a token: its logit in every flagged row, the W row re-read from L1 for each. The rows a fused call
// flags are few (a kept set past its candidates), so the blocks of a call that flagged none leave after
// reading B flags: a few µs, which is what a prepared call pays on every step.
template <bool BF16>
__global__ void __launch_bounds__(kHeadRowsThreads)
    head_rows_kernel(TsLmHead head, const uint16_t* states, int64_t num_rows, const uint8_t* flags, float* logits) {
  int flagged = 0;
  for (int64_t r = threadIdx.x; r < num_rows; r += kHeadRowsThreads) flagged |= flags[r] & TS_ROW_UNSETTLED;
  if (!__syncthreads_or(flagged)) return;
  const int lane = threadIdx.x & 31;
  const int64_t chunks = head.dim / 8;
  const auto* weight = static_cast<const uint4*>(head.weight);
  const auto* hidden = reinterpret_cast<const uint4*>(states);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * kHeadRowsWarps + (threadIdx.x >> 5); v < head.vocab;
       v += static_cast<int64_t>(gridDim.x) * kHeadRowsWarps) {
    for (int64_t r = 0; r < num_rows; ++r) {
      if (!(flags[r] & TS_ROW_UNSETTLED)) continue;
      float acc = 0.f;
      for (int64_t c = lane; c < chunks; c += 32)
        acc += dot8<BF16>(__ldg(weight + v * chunks + c), __ldg(hidden + r * chunks + c));
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
      if (lane == 0) logits[r * head.vocab + v] = finish_logit(acc, v, head);
    }
  }
}

}  // namespace

extern "C" TsFusedPlan ts_fused_plan(int64_t num_rows, int64_t dim, int64_t vocab, int32_t num_sms,
                                     int32_t max_smem, int32_t filtered) {
  TsFusedPlan plan{0, 0, 0, 0, 0, 0};
  if (dim <= 0 || dim % 64 != 0 || num_rows <= 0 || vocab <= 0 || num_sms <= 0) return plan;
  const int64_t num_tiles = (vocab + kTileRows - 1) / kTileRows;
  // One wave of one CTA per SM per batch tile. The vocabulary split depends on V and the GPU only,
  // never on B, so that a row's partial sums, and hence its result, do not depend on its batch.
  const int64_t vocab_ctas = num_tiles < num_sms ? num_tiles : num_sms;
  int kernel = TS_FUSED_RING, rows_per_tile = 8;
  // The streaming kernel with the smallest batch tile that holds the batch, 128 rows at most, where it fits;
  // the register ring otherwise.
  while (rows_per_tile < 128 && rows_per_tile < num_rows) rows_per_tile *= 2;
  if (stream_smem_bytes(rows_per_tile) <= static_cast<size_t>(max_smem) &&
      (!filtered || vocab_ctas >= kStreamCandMinCtas)) {
    kernel = filtered ? TS_FUSED_STREAM_CANDIDATES : TS_FUSED_STREAM;
  } else if (num_rows > 8 && partials_smem_bytes(16, dim) <= static_cast<size_t>(max_smem)) {
    // 16 rows per CTA halve the number of passes over W when they fit; 8 otherwise.
    rows_per_tile = 16;
  } else if (partials_smem_bytes(8, dim) <= static_cast<size_t>(max_smem)) {
    rows_per_tile = 8;
  } else {
    return plan;
  }
  const int64_t batch_tiles = (num_rows + rows_per_tile - 1) / rows_per_tile;
  plan.kernel = kernel;
  plan.rows_per_tile = rows_per_tile;
  plan.vocab_ctas = static_cast<int32_t>(vocab_ctas);
  plan.batch_tiles = static_cast<int32_t>(batch_tiles);
  plan.smem_bytes = kernel == TS_FUSED_RING ? partials_smem_bytes(rows_per_tile, dim) : stream_smem_bytes(rows_per_tile);
  const size_t parts = static_cast<size_t>(num_rows) * vocab_ctas;
  plan.scratch_bytes = parts * (sizeof(Partial) + cands_per_part(kernel) * sizeof(uint64_t));
  return plan;
}


extern "C" int32_t ts_fused_candidates(int32_t kernel) { return cands_per_part(kernel); }

static_assert(TS_FUSED_MAX_TOP_K + 1 == kCand, "a top-k row's cut lies inside its kCand candidates");

extern "C" int32_t ts_fused_preferred(int64_t num_rows, int32_t filtered) {
  constexpr int64_t kMaxRows = 128, kMaxFilteredRows = 64;
  return num_rows > 0 && num_rows <= (filtered ? kMaxFilteredRows : kMaxRows);
}

extern "C" int ts_fused_partials(const TsLmHead* head, const void* states, int64_t num_rows, const TsRows* rows,
                                 const TsFusedPlan* plan, int32_t want_sum1, void* scratch, void* stream) {
  static_assert(sizeof(Partial) == TS_FUSED_PARTIAL_BYTES, "fused.h gives the size of a partial result");
  if (plan->rows_per_tile == 0 || rows->rows != nullptr || (head->dtype != 1 && head->dtype != 2) ||
      head->first_token < 0 || head->first_token % kTileRows != 0 ||
      head->first_token + head->vocab > INT32_MAX ||
      (rows->bitmask.words && rows->bitmask.row_words < words_of(head->first_token + head->vocab)) ||
      rows->bitmask.floor)
    return cudaErrorInvalidValue;
  const size_t parts = static_cast<size_t>(num_rows) * plan->vocab_ctas;
  Partial* partials = static_cast<Partial*>(scratch);
  PartialsArgs args;
  args.head = whole_vocabulary_view(*head);
  args.states = static_cast<const uint16_t*>(states);
  args.num_rows = num_rows;
  args.rows = *rows;
  args.want_sum1 = want_sum1;
  args.first_tile = static_cast<int32_t>(head->first_token / kTileRows);
  args.num_tiles = static_cast<int32_t>((args.head.vocab + kTileRows - 1) / kTileRows);
  args.vocab_ctas = plan->vocab_ctas;
  walk_rounds(&args);
  args.batch_tiles = plan->batch_tiles;
  args.partials = partials;
  args.cands = cands_per_part(plan->kernel) == 0 ? nullptr : reinterpret_cast<uint64_t*>(partials + parts);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  return head->dtype == 2 ? launch_partials_masked<true>(args, *plan, s) : launch_partials_masked<false>(args, *plan, s);
}

extern "C" int ts_fused_finish(int64_t num_rows, const TsRows* rows, int32_t num_shards, int32_t parts_a_shard,
                               const void* shards, size_t shard_bytes, int32_t cands_per_part,
                               const TsFusedOutputs* out, void* stream) {
  if (num_shards <= 0 || parts_a_shard <= 0 || rows->rows != nullptr ||
      (cands_per_part != 0 && cands_per_part != kCand && cands_per_part != kStreamCand))
    return cudaErrorInvalidValue;
  FinishArgs finish;
  finish.num_rows = num_rows;
  finish.rows = *rows;
  finish.num_parts = num_shards * parts_a_shard;
  finish.parts_a_shard = parts_a_shard;
  finish.shards = static_cast<const unsigned char*>(shards);
  finish.shard_bytes = num_shards == 1 ? 0 : static_cast<int64_t>(shard_bytes);
  finish.cands_per_part = cands_per_part;
  finish.out = *out;
  const size_t staged_bytes = stages_candidates(cands_per_part)
                                  ? static_cast<size_t>(finish.num_parts) * cands_per_part * sizeof(uint64_t)
                                  : 0;
  cudaError_t err = cudaFuncSetAttribute(fused_finish_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(staged_bytes));
  if (err != cudaSuccess) return err;
  return launch_after_previous(&fused_finish_kernel, dim3(static_cast<unsigned>(num_rows)), dim3(kFinishThreads),
                               staged_bytes, static_cast<cudaStream_t>(stream), finish);
}

extern "C" int ts_fused_sample(const TsLmHead* head, const void* states, int64_t num_rows, const TsRows* rows,
                               const TsFusedPlan* plan, const TsFusedOutputs* out, void* scratch, void* stream) {
  const int err = ts_fused_partials(head, states, num_rows, rows, plan, out->logprobs != nullptr, scratch, stream);
  if (err != cudaSuccess) return err;
  return ts_fused_finish(num_rows, rows, 1, plan->vocab_ctas, scratch, plan->scratch_bytes,
                         cands_per_part(plan->kernel), out, stream);
}

extern "C" int ts_fused_head_rows(const TsLmHead* head, const void* states, int64_t num_rows, const uint8_t* flags,
                                  float* logits, void* stream) {
  if (num_rows <= 0 || head->dim <= 0 || head->dim % 8 != 0 || head->first_token != 0 ||
      (head->dtype != 1 && head->dtype != 2))
    return cudaErrorInvalidValue;
  const int64_t blocks = std::min<int64_t>((head->vocab + kHeadRowsWarps - 1) / kHeadRowsWarps, kHeadRowsMaxBlocks);
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const auto* h = static_cast<const uint16_t*>(states);
  if (head->dtype == 2)
    head_rows_kernel<true><<<static_cast<unsigned>(blocks), kHeadRowsThreads, 0, s>>>(*head, h, num_rows, flags, logits);
  else
    head_rows_kernel<false><<<static_cast<unsigned>(blocks), kHeadRowsThreads, 0, s>>>(*head, h, num_rows, flags, logits);
  return cudaGetLastError();
}
