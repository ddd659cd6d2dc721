"""The workloads beyond Sample on the GPU (csrc/workloads.h), and the dispatch the service calls.

Same signatures and answers as the torch references beside it (docs/semantics.md, choices 14-16):

- `diffusion_step_cuda`: one read of every masked position (max, argmax, sum of exponentials and the
  Gumbel-max sample in one pass), and the confidences and the commit rule of every request, run by the
  block that finishes the request's last row (a second, small kernel above 1024 positions). For
  requests without filters or processing; others go through the reference, whose
  sampling runs on the CUDA backend.
- `topk_probs_cuda`: one read of the logits with a per-chunk max and sum of exponentials and the chunk's
  top candidates, merged by each row's last block; k <= 255 (larger k: the torch reference on the GPU).
  Rows whose last ids the kernel cannot settle exactly (probability ties at the cut) are flagged and
  recomputed by the reference after the one synchronisation that returns the results.
- `verify_draft_cuda`: one read of the target and draft rows (sums, argmax, the bonus sample), then the
  accepted prefix and the correction drawn from the residual at the rejected position. For targets
  without filters or processing; others go through the torch reference on the GPU.
- `score_tokens_cuda` (score_cuda.py): one read of each row's logits, or of each block of logits a matmul of
  hidden states writes, for rows without top-k, top-p or min-p; others through the torch reference on the GPU.

Every launch goes on the current torch stream of the kernels' device, without synchronising (scoring from hidden
states also on a stream of its own, which that stream waits for).
"""

from __future__ import annotations

import threading
from dataclasses import replace

import torch

from tokensampler_server.backends.base import Backend
from tokensampler_server.backends.cuda_build import load_kernels
from tokensampler_server.backends.cuda_buffers import grown
from tokensampler_server.backends.cuda_kernels import DTYPE_CODES, stream_address
from tokensampler_server.workloads.diffusion import DiffusionStep, diffusion_step
from tokensampler_server.workloads.score import LogitSource, Scores, TokenScoring, score_tokens
from tokensampler_server.workloads.score_cuda import ScoreKernels, score_tokens_cuda
from tokensampler_server.workloads.topk_probs import topk_probs
from tokensampler_server.workloads.verify import DraftVerification, verify_draft

_FLAG_RECOMPUTE = 4


class WorkloadKernels:
    """The compiled workload kernels of one device with their reusable workspace.

    Consecutive launches reuse the workspace, which the stream orders: not for concurrent use from
    several threads or streams (the dispatch below holds `lock`).
    """

    kernel_names = ("row_stats_kernel", "diffusion_commit_kernel", "verify_finish_kernel", "topk_probs_kernel<32..256>")

    def __init__(self, device_index: int = 0) -> None:
        self.device = torch.device("cuda", device_index)
        self.module = load_kernels(device_index)
        self.lock = threading.Lock()
        self._counters = torch.zeros(0, dtype=torch.int32, device=self.device)
        self._scratch = torch.empty(0, dtype=torch.uint8, device=self.device)
        self._unused_hist = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self.fallback_count = torch.zeros(1, dtype=torch.int64, device=self.device)
        """Exact re-scores of a Gumbel-max sample made inside the kernels."""
        self._mailbox = torch.zeros(0, dtype=torch.int64, device=self.device)
        self._mailbox_steps = 0

    def _workspace(self, rows: int, scratch_bytes: int) -> list[int]:
        self._counters = grown(self._counters, rows, zeroed=True)  # the kernels leave them zeroed
        self._scratch = grown(self._scratch, scratch_bytes)
        return [self._counters.data_ptr(), self._unused_hist.data_ptr(), self._scratch.data_ptr(),
                self.fallback_count.data_ptr()]

    def _diffusion_mailbox(self, rows: int, vocab: int) -> int:
        """The diffusion steps' mailbox (ts_diffusion_mailbox_bytes), zeroed when new and before its
        32-bit step tags could wrap."""
        words = -(-self.module.diffusion_mailbox_bytes(rows, vocab) // 8)
        if self._mailbox.numel() < words:
            self._mailbox = grown(self._mailbox, words, zeroed=True)
            self._mailbox_steps = 0
        elif self._mailbox_steps >= _MAILBOX_STEPS_BEFORE_ZEROING:
            self._mailbox.zero_()
            self._mailbox_steps = 0
        self._mailbox_steps += 1
        return self._mailbox.data_ptr()

    def _stream(self) -> int:
        return stream_address(self.device)

    def _on_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return t.to(device=self.device, dtype=dtype or t.dtype, non_blocking=True).contiguous()

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in DTYPE_CODES:
            raise ValueError(f"logits: float32, float16 or bfloat16 expected, got {x.dtype}")
        return self._on_device(x)

    def topk_probs(self, logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probs float32 [N, k], ids int64 [N, k], flags uint8 [N]) on the device; 1 <= k <= 255.

        logits [N, V] (float32/bfloat16/float16), temperature float32 [N] > 0. flags & 4: recompute the row.
        """
        bucket = self.module.topk_probs_bucket(k)
        if bucket == 0:
            raise ValueError(f"k = {k}: the kernel takes k <= 255")
        x = self._logits(logits)
        num_rows, vocab = x.shape
        if not 1 <= k <= vocab:
            raise ValueError(f"k = {k} is outside [1, {vocab}]")
        t = self._on_device(temperature, torch.float32)
        probs = torch.empty(num_rows, k, dtype=torch.float32, device=self.device)
        ids = torch.empty(num_rows, k, dtype=torch.int64, device=self.device)
        flags = torch.empty(num_rows, dtype=torch.uint8, device=self.device)
        ws = self._workspace(num_rows, self.module.topk_probs_scratch_bytes(num_rows, vocab, bucket))
        self.module.topk_probs(x.data_ptr(), num_rows, vocab, DTYPE_CODES[x.dtype], t.data_ptr(), k, bucket,
                               probs.data_ptr(), ids.data_ptr(), flags.data_ptr(), ws, self._stream())
        return probs, ids, flags

    def row_stats(self, job: list[int], num_rows: int, vocab: int, stats: dict[str, torch.Tensor]) -> None:
        """ts_row_stats on the job's rows into `stats` (TsRowStats' names, [num_rows] each); the kernel
        writes only the outputs given."""
        # counters of the rows, of the aux rows (rows of their own), and the rows' best screening pilots
        ws = self._workspace(3 * num_rows, self.module.row_stats_scratch_bytes(num_rows, vocab))
        self.module.row_stats(job, _stats_pointers(stats), ws, self._stream())

    def diffusion(self, step: DiffusionStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens int64 [B, L], confidences float32 [B, L], the new mask bool [B, L], on the device.

        Every request samples without filters (greedy or T > 0) and without processing.
        """
        x = self._logits(step.logits)
        num_requests, length, vocab = x.shape
        mask = self._on_device(step.mask, torch.bool)
        temperature = self._on_device(step.temperature, torch.float32)
        seed, iteration = self._on_device(step.seed, torch.int64), self._on_device(step.iteration, torch.int64)
        threshold = self._on_device(step.threshold, torch.float32)
        count = self._on_device(step.count, torch.int64)
        rows = num_requests * length
        # position NULL: the noise position of slot l is l; draw_slot -1: every masked position samples
        job = [x.data_ptr(), vocab, DTYPE_CODES[x.dtype], rows, length, mask.data_ptr(), temperature.data_ptr(),
               seed.data_ptr(), 0, iteration.data_ptr(), -1, 0, 0]
        tokens = torch.empty(num_requests, length, dtype=torch.int64, device=self.device)
        confidences = torch.empty(num_requests, length, dtype=torch.float32, device=self.device)
        # the commit reads the token and its probability only, which the row pass writes to the output
        token = torch.empty(rows, dtype=torch.int64, device=self.device)
        stats = {"token": token, "confidence": confidences.view(rows)}
        new_mask = torch.empty(num_requests, length, dtype=torch.bool, device=self.device)
        # counters of the requests' finished rows and of the committed requests; partials go by the mailbox
        ws = self._workspace(num_requests + 1, 0)
        self.module.diffusion_step(job, _stats_pointers(stats), threshold.data_ptr(), count.data_ptr(),
                                   tokens.data_ptr(), confidences.data_ptr(), new_mask.data_ptr(), ws,
                                   self._diffusion_mailbox(rows, vocab), self._stream())
        return tokens, confidences, new_mask

    def verify(self, v: DraftVerification) -> tuple[torch.Tensor, torch.Tensor]:
        """(accepted int64 [B], tokens int64 [B, n + 1]) on the device, for targets without filters or
        processing. draft_probs are float32 probabilities (renormalised here, as by the reference)."""
        target = self._logits(v.target_logits)
        num_requests, positions, vocab = target.shape
        draft = self._on_device(v.draft_probs, torch.float32)
        draft_ids = self._on_device(v.draft_ids, torch.int64)
        temperature = self._on_device(v.temperature, torch.float32)
        seed, position = self._on_device(v.seed, torch.int64), self._on_device(v.position, torch.int64)
        iteration = self._on_device(v.iteration, torch.int64)
        n = positions - 1
        rows = num_requests * positions
        job = [target.data_ptr(), vocab, DTYPE_CODES[target.dtype], rows, positions, 0, temperature.data_ptr(),
               seed.data_ptr(), position.data_ptr(), iteration.data_ptr(), n, draft.data_ptr(), n]
        stats = {name: torch.empty(rows, dtype=dtype, device=self.device) for name, dtype in _VERIFY_STATS.items()}
        self.row_stats(job, rows, vocab, stats)
        accepted = torch.empty(num_requests, dtype=torch.int64, device=self.device)
        tokens = torch.empty(num_requests, positions, dtype=torch.int64, device=self.device)
        ws = self._workspace(num_requests, self.module.verify_scratch_bytes(num_requests, vocab))
        self.module.verify_finish(job, _stats_pointers(stats), draft_ids.data_ptr(), accepted.data_ptr(),
                                  tokens.data_ptr(), ws, self._stream())
        return accepted, tokens


_MAILBOX_STEPS_BEFORE_ZEROING = 1 << 31
"""Diffusion steps through one mailbox between zeroings: its step tags are 32-bit."""

_VERIFY_STATS = {"row_max": torch.float32, "row_sum": torch.float32, "argmax": torch.int64, "token": torch.int64,
                 "aux_sum": torch.float32}
"""The row pass's outputs that verify_finish reads."""


def _stats_pointers(stats: dict[str, torch.Tensor]) -> list[int]:
    names = ("row_max", "row_sum", "argmax", "token", "aux_sum", "confidence")
    return [stats[name].data_ptr() if name in stats else 0 for name in names]


def _unfiltered(top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, vocab: int) -> bool:
    """No row uses top-k (k < V), top-p or min-p: the kernels' case."""
    return not bool((((top_k > 0) & (top_k < vocab)) | (top_p < 1) | (min_p > 0)).any())


# -- the GPU implementations, with the references' signatures -----------------------------------------
def diffusion_step_cuda(step: DiffusionStep, kernels: WorkloadKernels, backend: Backend) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """workloads.diffusion.diffusion_step on the GPU; results on the GPU."""
    vocab = step.logits.shape[2]
    if step.processing is None and _unfiltered(step.top_k, step.top_p, step.min_p, vocab):
        return kernels.diffusion(step)
    return diffusion_step(step, backend)  # filters or processing: the reference, sampling on the backend


def topk_probs_cuda(logits: torch.Tensor, temperature: torch.Tensor, k: int, kernels: WorkloadKernels) -> tuple[torch.Tensor, torch.Tensor]:
    """workloads.topk_probs.topk_probs on the GPU; results on the GPU. Synchronises once (the flags)."""
    if kernels.module.topk_probs_bucket(k) == 0:
        return topk_probs(kernels._logits(logits), kernels._on_device(temperature, torch.float32), k)
    probs, ids, flags = kernels.topk_probs(logits, temperature, k)
    redo = (flags & _FLAG_RECOMPUTE).nonzero().squeeze(1)
    if redo.numel():
        x = kernels._logits(logits)[redo]
        probs[redo], ids[redo] = topk_probs(x, kernels._on_device(temperature, torch.float32)[redo], k)
    return probs, ids


def verify_draft_cuda(v: DraftVerification, kernels: WorkloadKernels) -> tuple[torch.Tensor, torch.Tensor]:
    """workloads.verify.verify_draft on the GPU, results on the GPU: the kernels where the target has no filters
    or processing, else the torch reference run on the GPU (no row leaves it)."""
    vocab = v.target_logits.shape[2]
    if v.processing is None and _unfiltered(v.top_k, v.top_p, v.min_p, vocab):
        return kernels.verify(v)
    return verify_draft(replace(v, target_logits=kernels._logits(v.target_logits)))


# -- the workloads of one backend, which the service builds once and calls ---------------------------
class Workloads:
    """The torch references, sampling through the backend where a workload samples (diffusion steps); results on
    the CPU. The workloads of a backend without kernels for them."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def diffusion_step(self, step: DiffusionStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return diffusion_step(step, self.backend)

    def topk_probs(self, logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_probs(logits, temperature, k)

    def verify_draft(self, v: DraftVerification) -> tuple[torch.Tensor, torch.Tensor]:
        return verify_draft(v)

    def score_tokens(self, source: LogitSource, scoring: TokenScoring) -> Scores:
        return score_tokens(source, scoring, self.backend.device)


class CudaWorkloads(Workloads):
    """The kernels of the backend's GPU, one call at a time (they share one workspace); results on the CPU."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self.kernels = WorkloadKernels(backend.device.index or 0)
        self.scorer = ScoreKernels(self.kernels.device, self.kernels.module)

    def diffusion_step(self, step: DiffusionStep) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        with self.kernels.lock, torch.cuda.device(self.kernels.device):
            return tuple(t.cpu() for t in diffusion_step_cuda(step, self.kernels, self.backend))

    def topk_probs(self, logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        with self.kernels.lock, torch.cuda.device(self.kernels.device):
            return tuple(t.cpu() for t in topk_probs_cuda(logits, temperature, k, self.kernels))

    def verify_draft(self, v: DraftVerification) -> tuple[torch.Tensor, torch.Tensor]:
        with self.kernels.lock, torch.cuda.device(self.kernels.device):
            return tuple(t.cpu() for t in verify_draft_cuda(v, self.kernels))

    def score_tokens(self, source: LogitSource, scoring: TokenScoring) -> Scores:
        with self.kernels.lock, torch.cuda.device(self.kernels.device):
            return score_tokens_cuda(source, scoring, self.scorer).cpu()


def workloads_of(backend: Backend) -> Workloads:
    """The workloads of `backend`: its GPU's kernels when it samples on one, else the references."""
    return CudaWorkloads(backend) if backend.device.type == "cuda" else Workloads(backend)
