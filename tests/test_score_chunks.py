"""The matmul blocks of scoring from hidden states on the GPU (workloads/score_cuda.py, docs/design/scoring.md)."""

from __future__ import annotations

import pytest
from tokensampler_server.workloads.score_cuda import CHUNK_BYTES, chunk_shape

BLOCK = 8192  # the kernel's tokens a block


@pytest.mark.parametrize("num_rows", [1, 7, 64, 300, 512, 513, 4096, 70000])
@pytest.mark.parametrize("vocab", [1, 111, 32000, 151936])
def test_blocks_fit_the_buffer_and_cover_the_rows(num_rows: int, vocab: int) -> None:
    rows, width = chunk_shape(num_rows, vocab, CHUNK_BYTES, BLOCK)
    assert 1 <= rows <= min(num_rows, 65535)
    assert rows * width * 4 <= CHUNK_BYTES
    assert width == vocab or width % BLOCK == 0  # whole blocks but for a vocabulary smaller than one chunk
    blocks = -(-num_rows // rows)
    assert blocks * rows - num_rows < blocks  # equal row blocks, the last short by less than one row a block


def test_the_largest_case_is_one_block_a_row_and_all_rows_below_a_buffer() -> None:
    assert chunk_shape(4096, 151936, CHUNK_BYTES, BLOCK) == (512, 8192)
    assert chunk_shape(7, 151936, CHUNK_BYTES, BLOCK) == (7, 151936)  # 4.3 MB: one matmul
