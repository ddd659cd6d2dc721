// extern "C" launchers of the sequence samplers' kernels (sequence_samplers.h). No framework headers.
#include <cuda_runtime.h>

#include "sequence_samplers.h"

namespace {

constexpr int kThreads = 256;

// The (row, tile) of block `pair`, and the tile's columns.
__device__ __forceinline__ const int32_t* pair_tile(const TsSequenceTiles& t, int64_t pair, int64_t& row) {
  int64_t tile = pair;
  if (t.instances != nullptr) {
    row = t.instances[2 * pair];
    tile = t.instances[2 * pair + 1];
  } else {
    row = t.tiles[pair * t.columns + t.row_column];
  }
  return t.tiles + tile * t.columns;
}

// The number of leading tokens after position i equal to the staged suffix, at most `most`.
__device__ __forceinline__ int repeat_at(const int32_t* tokens, int i, const int32_t* suffix, int most) {
  int c = 0;
  while (c < most && tokens[i + 1 + c] == suffix[c]) ++c;
  return c;
}

// One block a (row, tile) pair: the tile's positions in strides of the block, each compared with the suffix staged
// in shared memory; a banned token's bit is cleared with an atomic AND, since positions of several tiles (and
// repeats of one token) clear bits of the same word.
__global__ void sequence_bans_kernel(TsSequenceTiles t, uint32_t* words, int32_t words_per_row) {
  __shared__ int32_t suffix[TS_SEQUENCE_MAX_HALO];
  int64_t row;
  const int32_t* columns = pair_tile(t, blockIdx.x, row);
  const int need = columns[t.need_column];
  if (need >= t.off_need || need < 0) return;  // the whole block: need is the tile's
  for (int c = threadIdx.x; c < need; c += blockDim.x) suffix[c] = columns[t.suffix_column + c];
  __syncthreads();
  const int32_t* tokens = columns + t.tokens_column;
  uint32_t* row_words = words + row * words_per_row;
  for (int i = threadIdx.x; i < t.width; i += blockDim.x) {
    const int32_t token = tokens[i];
    if (token >= 0 && repeat_at(tokens, i, suffix, need) == need)  // token < 0: padding past the sequence's span
      atomicAnd(row_words + (token >> 5), ~(1u << (token & 31)));
  }
}

// DRY, first pass: each position's penalty into penalty[row, token] by an atomic max on the bits (penalties are >= 0,
// whose float order is their bits' integer order; +inf included).
__global__ void dry_max_kernel(TsSequenceTiles t, int64_t vocab, float* penalty) {
  __shared__ int32_t suffix[TS_SEQUENCE_MAX_HALO];
  __shared__ int32_t singles[TS_SEQUENCE_MAX_SINGLES];
  int64_t row;
  const int32_t* columns = pair_tile(t, blockIdx.x, row);
  for (int c = threadIdx.x; c < t.halo; c += blockDim.x) suffix[c] = columns[t.suffix_column + c];
  for (int c = threadIdx.x; c < t.singles; c += blockDim.x) singles[c] = columns[t.singles_column + c];
  __syncthreads();
  const int32_t* tokens = columns + t.tokens_column;
  const int dry_top = columns[t.dry_top_column], cap = columns[t.cap_column];
  for (int i = threadIdx.x; i < t.width; i += blockDim.x) {
    const int32_t token = tokens[i];
    if (token < 0) continue;  // padding: the reference's penalty there is table[0], which is 0
    int length = min(min(dry_top - i, cap), t.halo - 1);
    if (length <= 0) continue;
    length = repeat_at(tokens, i, suffix, length);
    for (int c = 0; c < t.singles; ++c) length = singles[c] == token ? 0 : length;
    const int bits = columns[t.table_column + length];
    if (__int_as_float(bits) > 0.f) atomicMax(reinterpret_cast<int*>(penalty + row * vocab + token), bits);
  }
}

// DRY, second pass: each penalised token's entry is taken (and zeroed) by exactly one of its positions, which
// subtracts it from the logit.
__global__ void dry_apply_kernel(TsSequenceTiles t, float* x, int64_t vocab, float* penalty) {
  int64_t row;
  const int32_t* columns = pair_tile(t, blockIdx.x, row);
  const int32_t* tokens = columns + t.tokens_column;
  for (int i = threadIdx.x; i < t.width; i += blockDim.x) {
    const int32_t token = tokens[i];
    if (token < 0) continue;
    const int64_t at = row * vocab + token;
    const float p = atomicExch(penalty + at, 0.f);
    if (p > 0.f) x[at] -= p;
  }
}

int64_t blocks_of(const TsSequenceTiles* t) { return t->instances != nullptr ? t->num_instances : t->num_tiles; }

bool fits(const TsSequenceTiles* t) {
  return t->halo >= 1 && t->halo <= TS_SEQUENCE_MAX_HALO && t->off_need >= 0 && t->off_need <= t->halo &&
         t->singles >= 0 && t->singles <= TS_SEQUENCE_MAX_SINGLES && t->width >= 0 &&
         blocks_of(t) <= (int64_t{1} << 31) - 1;
}

}  // namespace

extern "C" {

int ts_sequence_bans(const TsSequenceTiles* tiles, uint32_t* words, int32_t words_per_row, void* stream) {
  if (!fits(tiles) || words_per_row < 1) return cudaErrorInvalidValue;
  const int64_t blocks = blocks_of(tiles);
  if (blocks == 0) return cudaSuccess;
  sequence_bans_kernel<<<dim3(static_cast<unsigned int>(blocks)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *tiles, words, words_per_row);
  return cudaGetLastError();
}

int ts_sequence_penalties(const TsSequenceTiles* tiles, float* x, int64_t vocab, float* penalty, void* stream) {
  if (!fits(tiles) || vocab < 1) return cudaErrorInvalidValue;
  const int64_t blocks = blocks_of(tiles);
  if (blocks == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned int>(blocks));
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  dry_max_kernel<<<grid, kThreads, 0, s>>>(*tiles, vocab, penalty);
  if (cudaError_t e = cudaGetLastError()) return e;
  dry_apply_kernel<<<grid, kThreads, 0, s>>>(*tiles, x, vocab, penalty);
  return cudaGetLastError();
}

}  // extern "C"
