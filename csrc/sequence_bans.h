/* C API of no-repeat-n-gram's bans (docs/semantics.md L2) written as token-bitmask words (csrc/sequence_bans.cu), so
 * that the sampling kernels apply them as they read the logits, as they apply a structured-output mask. Plain C
 * types only; every pointer is device memory.
 *
 * The rows' sequences come in the tiles validation lays out (server/tokensampler_server/model/repetition.py,
 * TileLayout): a tile holds `width` positions of one sequence, latest first, then the tokens before them; position i
 * is banned when its token is a token (>= 0) and the `need` tokens after it in the tile (the n - 1 before it in the
 * sequence) equal the tile's suffix (the sequence's last tokens, latest first). The column indices come from the
 * caller, which owns the layout. Every launcher returns a cudaError_t as int (0 = success). */
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct {
  const int32_t* tiles;      /* [num_tiles, columns] */
  int64_t num_tiles;
  int32_t columns;
  int32_t width;             /* positions a tile */
  int32_t row_column;        /* the row a tile serves (when instances is NULL) */
  int32_t need_column;       /* n - 1; off_need or more: the tile bans nothing */
  int32_t suffix_column;     /* first of the suffix's columns */
  int32_t tokens_column;     /* first of the width + halo tokens */
  int32_t off_need;
  const int32_t* instances;  /* [num_instances, 2] (row, tile); NULL: tile u serves the row in its row column */
  int64_t num_instances;
} TsSequenceTiles;

/* The largest n - 1 the kernel compares (its suffix is staged in shared memory). */
enum { TS_SEQUENCE_MAX_NEED = 63 };

/* Clears in words [rows, words_per_row] (bit t & 31 of word t >> 5: token t allowed) the bit of every token each
 * row's no-repeat-n-gram bans; every other bit is left as it is. Requires off_need <= TS_SEQUENCE_MAX_NEED + 1. */
int ts_sequence_bans(const TsSequenceTiles* tiles, uint32_t* words, int32_t words_per_row, void* stream);

#ifdef __cplusplus
}
#endif
