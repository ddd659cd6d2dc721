// extern "C" launcher of no-repeat-n-gram's bans as token-bitmask words (sequence_bans.h). No framework headers.
#include <cuda_runtime.h>

#include "sequence_bans.h"

namespace {

constexpr int kThreads = 256;

// One block a (row, tile) pair: the tile's positions in strides of the block, each compared with the suffix staged
// in shared memory; a banned token's bit is cleared with an atomic AND, since positions of several tiles (and
// repeats of one token) clear bits of the same word.
__global__ void sequence_bans_kernel(TsSequenceTiles t, uint32_t* words, int32_t words_per_row) {
  __shared__ int32_t suffix[TS_SEQUENCE_MAX_NEED];
  const int64_t pair = blockIdx.x;
  int64_t row, tile;
  if (t.instances != nullptr) {
    row = t.instances[2 * pair];
    tile = t.instances[2 * pair + 1];
  } else {
    tile = pair;
    row = t.tiles[pair * t.columns + t.row_column];
  }
  const int32_t* columns = t.tiles + tile * t.columns;
  const int need = columns[t.need_column];
  if (need >= t.off_need || need < 0) return;  // the whole block: need is the tile's
  for (int c = threadIdx.x; c < need; c += blockDim.x) suffix[c] = columns[t.suffix_column + c];
  __syncthreads();
  const int32_t* tokens = columns + t.tokens_column;
  uint32_t* row_words = words + row * words_per_row;
  for (int i = threadIdx.x; i < t.width; i += blockDim.x) {
    const int32_t token = tokens[i];
    if (token < 0) continue;  // padding past the sequence's span
    bool repeats = true;
    for (int c = 0; c < need && repeats; ++c) repeats = tokens[i + 1 + c] == suffix[c];
    if (repeats) atomicAnd(row_words + (token >> 5), ~(1u << (token & 31)));
  }
}

}  // namespace

extern "C" int ts_sequence_bans(const TsSequenceTiles* tiles, uint32_t* words, int32_t words_per_row, void* stream) {
  if (tiles->off_need < 0 || tiles->off_need > TS_SEQUENCE_MAX_NEED + 1 || words_per_row < 1 || tiles->width < 0)
    return cudaErrorInvalidValue;
  const int64_t blocks = tiles->instances != nullptr ? tiles->num_instances : tiles->num_tiles;
  if (blocks <= 0) return cudaSuccess;
  if (blocks > (int64_t{1} << 31) - 1) return cudaErrorInvalidValue;
  sequence_bans_kernel<<<dim3(static_cast<unsigned int>(blocks)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      *tiles, words, words_per_row);
  return cudaGetLastError();
}
