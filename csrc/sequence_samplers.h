/* C API of the sequence samplers' kernels (csrc/sequence_samplers.cu): no-repeat-n-gram's bans (docs/semantics.md L2)
 * written as token-bitmask words, so that the sampling kernels apply them as they read the logits, and DRY's penalties
 * (L3) subtracted from float32 logits in place. Plain C types only; every pointer is device memory.
 *
 * The rows' sequences come in the tiles validation lays out (server/tokensampler_server/model/repetition.py,
 * TileLayout): a tile holds `width` positions of one sequence, latest first, then the tokens before them. Position
 * i's repeat is the number of leading tokens after it in the tile (before it in the sequence) equal to the tile's
 * suffix (the sequence's last tokens, latest first, ended by a sentinel no token equals). The column indices come
 * from the caller, which owns the layout. Every launcher returns a cudaError_t as int (0 = success). */
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
  int32_t halo;              /* suffix and penalty-table entries; tokens a tile holds past its last position */
  int32_t row_column;        /* the row a tile serves (when instances is NULL) */
  int32_t need_column;       /* no-repeat-n-gram's n - 1; off_need or more: the tile bans nothing */
  int32_t dry_top_column;    /* DRY: position i ends (this - i) window tokens, the most its repeat counts */
  int32_t cap_column;        /* DRY: the most any repeat counts */
  int32_t suffix_column;     /* first of the halo suffix columns */
  int32_t table_column;      /* first of the halo penalty columns: float32 bits, the penalty at each repeat */
  int32_t singles_column;    /* first of `singles` one-token breakers, which DRY never penalises */
  int32_t singles;
  int32_t tokens_column;     /* first of the width + halo tokens */
  int32_t off_need;
  const int32_t* instances;  /* [num_instances, 2] (row, tile); NULL: tile u serves the row in its row column */
  int64_t num_instances;
} TsSequenceTiles;

/* The most suffix entries and single breakers the kernels stage in shared memory. */
enum { TS_SEQUENCE_MAX_HALO = 64, TS_SEQUENCE_MAX_SINGLES = 64 };

/* Clears in words [rows, words_per_row] (bit t & 31 of word t >> 5: token t allowed) the bit of every token each
 * row's no-repeat-n-gram bans (a position whose repeat reaches n - 1); every other bit is left as it is. */
int ts_sequence_bans(const TsSequenceTiles* tiles, uint32_t* words, int32_t words_per_row, void* stream);

/* DRY: x[row, t] -= the largest penalty any position of the row gives token t, in float32 logits x [rows, vocab] in
 * place (fp32(x - p) falls as p grows, so this is the smallest of x - p over the positions, rounded once: the torch
 * reference's bits). A position's penalty is the table's entry at its repeat, bounded by its window and the cap, 0 for
 * a single breaker. penalty: float32 [rows, vocab] scratch, all zero before the call; the call leaves it all zero. */
int ts_sequence_penalties(const TsSequenceTiles* tiles, float* x, int64_t vocab, float* penalty, void* stream);

#ifdef __cplusplus
}
#endif
