"""Scoring given tokens on the GPU (csrc/score.h; docs/design/scoring.md): a StreamedScorer for
workloads/score.py's score_tokens, whose rows with top-k, top-p or min-p keep the torch reference's whole-row
path on the GPU.

- From logits [N, V]: one launch reads every row once, several blocks a row, merged by the row's last block.
- From hidden states [N, D] through a registered head: cuBLAS writes the fp32 logits of R rows by C tokens
  (logit_slice) into one of two reused buffers, and the kernel folds them into the rows' running state on a
  second stream while the next block of logits is multiplied. No [N, V] tensor exists: the extra memory is the
  two buffers (2·R·C·4 bytes, CHUNK_BYTES each) and O(N·top_logprobs).

Every launch goes on the current torch stream of the kernels' device, or on the scorer's own stream ordered
after it and waited for before returning.
"""

from __future__ import annotations

import weakref
from types import ModuleType

import torch

from tokensampler_server.backends.cuda_buffers import grown
from tokensampler_server.backends.cuda_kernels import DTYPE_CODES, stream_address
from tokensampler_server.backends.cuda_streams import exclusive_stream, give_back
from tokensampler_server.resources.weights import RegisteredWeight
from tokensampler_server.workloads.score import LogitSource, Scores, TokenScoring, row_temperature, score_tokens

_MAX_ROWS = 65535
"""Rows of one launch (the grid's rows)."""

CHUNK_BYTES = 16 << 20
"""fp32 logits one matmul writes from hidden states: the buffer it writes and the kernel reads back, twice over,
stays inside the H200's 50 MB L2 beside the matmul's own operands (docs/design/scoring.md)."""


def score_tokens_cuda(source: LogitSource, scoring: TokenScoring, scorer: ScoreKernels) -> Scores:
    """workloads.score.score_tokens on the GPU, results on the GPU: the rows without filters through the kernel
    (top_logprobs up to its limit, else the reference), those with filters through the reference."""
    return score_tokens(source, scoring, scorer.device, scorer.streamed if scorer.takes(scoring) else None)


def chunk_shape(num_rows: int, vocab: int, chunk_bytes: int, block_tokens: int) -> tuple[int, int]:
    """(R, C): the rows and vocabulary tokens of one matmul's logits, R·C·4 <= chunk_bytes where one block's
    tokens a row allow it. C is a multiple of block_tokens (the kernel's blocks read whole chunks) but for the
    last slice; the rows are split into equal blocks."""
    most_rows = max(1, min(_MAX_ROWS, chunk_bytes // (4 * block_tokens)))
    blocks = -(-num_rows // most_rows)
    rows = -(-num_rows // blocks)
    width = max(block_tokens, chunk_bytes // (4 * rows) // block_tokens * block_tokens)
    return rows, min(width, vocab)


class ScoreKernels:
    """The scoring kernel of one device with its workspace, buffers and second stream: one call at a time (the
    caller holds a lock), on the caller's current stream."""

    def __init__(self, device: torch.device, module: ModuleType, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.device = device
        self.module = module
        self.chunk_bytes = chunk_bytes
        self._side = exclusive_stream(device)  # never one a colocated loop blocks
        # The pool has 32: a dropped scorer must not keep one. Work it left queued runs before the next holder's.
        weakref.finalize(self, give_back, self._side)
        self._counters = torch.zeros(0, dtype=torch.int32, device=device)
        self._scratch = torch.empty(0, dtype=torch.uint8, device=device)
        self._state = torch.empty(0, dtype=torch.uint8, device=device)
        self._buffers = [torch.empty(0, dtype=torch.float32, device=device) for _ in range(2)]
        self._buffer_read = [torch.cuda.Event() for _ in range(2)]
        """Recorded on the second stream once the kernel has read the buffer."""
        self._written = torch.cuda.Event()
        """Recorded on the caller's stream once a buffer holds its logits (a wait takes the latest record)."""

    def takes(self, scoring: TokenScoring) -> bool:
        """Whether the kernel lists this many top log-probs (else the reference scores the rows)."""
        return scoring.top_logprobs <= self.module.score_max_top

    def streamed(self, source: LogitSource, scoring: TokenScoring, rows: torch.Tensor, device: torch.device,
                 out: Scores) -> None:
        """score_streamed's results for `rows` (CPU indices) through the kernel: a StreamedScorer."""
        whole = rows.numel() == source.num_rows
        index = None if whole else rows.to(self.device, non_blocking=True)
        tokens = self._on_device(scoring.token_ids if whole else scoring.token_ids[rows], torch.int64)
        t = row_temperature(scoring, rows)
        temperature = None if t is None else self._on_device(t, torch.float32)
        target = out if whole else _empty_scores(rows.numel(), scoring, self.device)
        rows_of = lambda r0: _row_pointers(tokens, temperature, scoring.top_logprobs, target, r0)  # noqa: E731
        if source.logits is not None:
            self._from_logits(source.logits, index, scoring.top_logprobs, rows_of)
        else:
            hidden = source.hidden if whole else source.hidden[index if source.hidden.device == self.device else rows]
            self._from_hidden(hidden, source.lm_head, scoring.top_logprobs, rows_of)
        if not whole:
            for name in ("logprobs", "entropy", "top_ids", "top_values"):
                if getattr(out, name) is not None:
                    getattr(out, name)[index] = getattr(target, name)

    def _from_logits(self, logits: torch.Tensor, index: torch.Tensor | None, top_n: int, rows_of) -> None:
        x = logits if logits.dtype in DTYPE_CODES else logits.float()
        x = self._on_device(x, x.dtype)
        vocab = x.shape[1]
        num_rows = x.shape[0] if index is None else index.numel()
        row_start = None if index is None else index * vocab  # the rows read in place, no gathered copy
        stream = stream_address(self.device)
        for r0 in range(0, num_rows, _MAX_ROWS):
            r1 = min(num_rows, r0 + _MAX_ROWS)
            data, starts = ((x.data_ptr() + r0 * vocab * x.element_size(), 0) if row_start is None
                            else (x.data_ptr(), row_start.data_ptr() + r0 * row_start.element_size()))
            ws, state = self._workspace(r1 - r0, vocab, top_n)
            self.module.score_slice([data, r1 - r0, vocab, DTYPE_CODES[x.dtype], starts], 0, rows_of(r0), True, True,
                                    state, ws, stream)

    def _from_hidden(self, hidden: torch.Tensor, head: RegisteredWeight, top_n: int, rows_of) -> None:
        vocab, num_rows = head.finish.vocab_size, hidden.shape[0]
        hidden = hidden.to(head.weight.device, non_blocking=True)
        rows, width = chunk_shape(num_rows, vocab, self.chunk_bytes, self.module.score_block_tokens())
        buffers = self._buffers_of(rows * width)
        ws, state = self._workspace(rows, width, top_n)
        main, side = torch.cuda.current_stream(self.device), self._side
        views: dict[tuple[int, int, int], torch.Tensor] = {}  # (slot, rows, width): at most 8, made once a call
        chunk = 0
        for r0 in range(0, num_rows, rows):
            r1 = min(num_rows, r0 + rows)
            block_rows, row_pointers = hidden[r0:r1], rows_of(r0)
            for start in range(0, vocab, width):
                stop = min(vocab, start + width)
                slot, shape = chunk % 2, (r1 - r0, stop - start)
                chunk += 1
                out = views.get((slot, *shape))
                if out is None:
                    out = views[(slot, *shape)] = buffers[slot][:shape[0] * shape[1]].view(shape)
                main.wait_event(self._buffer_read[slot])  # the kernel two chunks back has read this buffer
                head.logit_slice(block_rows, start, stop, out=out)
                self._written.record(main)
                side.wait_event(self._written)
                self.module.score_slice([out.data_ptr(), *shape, 0, 0], start, row_pointers, start == 0, stop == vocab,
                                        state, ws, side.cuda_stream)
                self._buffer_read[slot].record(side)
        main.wait_stream(side)

    def _on_device(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        # non_blocking: a pageable source is staged at once, without waiting for the stream
        return t.to(device=self.device, dtype=dtype, non_blocking=True).contiguous()

    def _workspace(self, num_rows: int, width: int, top_n: int) -> tuple[list[int], int]:
        """([counters, scratch], state) addresses for launches over num_rows rows of width-token slices; the counters
        zeroed once (the kernel leaves them zeroed)."""
        self._counters = grown(self._counters, num_rows, zeroed=True, double=False)
        self._scratch = grown(self._scratch, self.module.score_scratch_bytes(num_rows, width, top_n), double=False)
        self._state = grown(self._state, self.module.score_state_bytes(num_rows, top_n), double=False)
        return [self._counters.data_ptr(), self._scratch.data_ptr()], self._state.data_ptr()

    def _buffers_of(self, elements: int) -> list[torch.Tensor]:
        self._buffers = [grown(buffer, elements, double=False) for buffer in self._buffers]
        return self._buffers


def _empty_scores(num_rows: int, scoring: TokenScoring, device: torch.device) -> Scores:
    """Outputs of `num_rows` rows, every entry of which the kernel writes."""
    n = scoring.top_logprobs
    return Scores(logprobs=torch.empty(num_rows, device=device),
                  top_ids=torch.empty(num_rows, n, dtype=torch.int64, device=device) if n else None,
                  top_values=torch.empty(num_rows, n, device=device) if n else None,
                  entropy=torch.empty(num_rows, device=device) if scoring.entropy else None)


def _row_pointers(tokens: torch.Tensor, temperature: torch.Tensor | None, top_n: int, out: Scores,
                  r0: int) -> list[int]:
    """TsScoreRows of the rows from r0 on as the binding takes it (0: NULL). Addresses by arithmetic, not slices:
    a few µs of host time a launch, which small launches feel."""
    def at(t: torch.Tensor | None) -> int:
        return 0 if t is None else t.data_ptr() + r0 * t.stride(0) * t.element_size()

    return [at(tokens), at(temperature), top_n, at(out.logprobs), at(out.entropy), at(out.top_ids), at(out.top_values)]
