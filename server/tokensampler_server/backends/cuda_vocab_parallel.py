"""Hidden states through an LM head split by vocabulary rows over several GPUs of this process
(docs/design/vocab-parallel.md, "The fused path").

Each GPU holds a contiguous slice of W's rows and runs the fused kernel's first stage on it: its CTAs' partial
results (row max, sums, the Gumbel-max or argmax winner, a filtered row's best keys) with global token ids and
noise keyed by the global id. One NCCL all-gather brings every shard's partials to the first GPU, whose second
stage merges them as it merges one GPU's CTAs. The winner and the candidates are maxima over tokens, so the tokens
are those of the whole head on one GPU; only the sums (log-probs, top-p's mass) add the CTAs' partials in another
grouping, within fp32 rounding. Requests the fused kernel does not take, and rows it flags (a kept set reaching
past its candidates), take the logits path: every shard's logits gathered on the first GPU, then the single-GPU
logits kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from tokensampler_server.model.sampling import HiddenInput, SamplingBatch, SamplingResult, merge_rows, select_rows
from tokensampler_server.resources.weights import RegisteredWeight
from tokensampler_server.backends import cuda_fused
from tokensampler_server.backends.cuda_buffers import row_states
from tokensampler_server.backends.cuda_kernels import RowParams, stream_address
from tokensampler_server.backends.nccl import NcclGroup
from tokensampler_server.backends.vocab_parallel import shard_head

TILE_ROWS = 128
"""The fused kernel's vocabulary tile: a shard starts at a multiple of it (csrc/fused.h, TsLmHead.first_token)."""
PARTIAL_BYTES = 32
"""One (row, CTA) partial result (csrc/fused.h, TS_FUSED_PARTIAL_BYTES)."""
_BUFFERED = 8
"""Call shapes whose buffers a head keeps."""


def shard_bounds(vocab: int, num_shards: int) -> list[tuple[int, int]]:
    """Token ranges [start, stop) of num_shards shards of a vocabulary: whole tiles, as even as tiles allow; a
    function of V and N only, so every row's result is independent of its batch."""
    tiles = -(-vocab // TILE_ROWS)
    if not 1 <= num_shards <= tiles:
        raise ValueError(f"devices: {num_shards} shards of a vocabulary of {vocab} tokens ({tiles} tiles of "
                         f"{TILE_ROWS}); expected 1 to {tiles}")
    cuts = [shard * tiles // num_shards * TILE_ROWS for shard in range(num_shards)] + [vocab]
    return [(cuts[shard], min(cuts[shard + 1], vocab)) for shard in range(num_shards)]


@dataclass(frozen=True)
class _CallBuffers:
    """What a call of one shape reuses: the launch plan, and the device memory each step writes."""

    plan: cuda_fused.FusedPlan
    per_part: int
    inputs: list[torch.Tensor | None]
    """The hidden states' copy on each device but the first (None there)."""
    scratch: list[torch.Tensor]
    """Each shard's stage 1 output, uint8 [plan.scratch_bytes]."""
    receives: list[torch.Tensor]
    """Each device's all-gather output, uint8 [N, plan.scratch_bytes] (none without an exchange)."""
    streams: list[int] | None
    """The devices' streams when the buffers were made (None without an exchange): the buffers are theirs."""
    partials: torch.Tensor | None
    """[B, N, CTAs * 32] on the first device: each row's partials side by side (None for one shard: stage 1's own)."""
    cands: torch.Tensor | None
    """[B, N, CTAs * candidates * 8] likewise, or None for one shard or when stage 1 keeps none."""


@dataclass(frozen=True)
class _Shard:
    start: int
    head: RegisteredWeight
    """Rows start.. of the whole head, on this shard's device, with their own finish (bias slice)."""

    @property
    def device(self) -> torch.device:
        return self.head.weight.device


class VocabParallelHead:
    """A registered head split over `devices` (CUDA indices; the first one answers), sampled by `sample`. One index
    repeated puts every shard on one GPU: the same merge without an exchange (the tests' single-GPU form).

    The shards are copies of W's rows on their devices; `head` itself may live anywhere. Calls are serialised: the
    communicators take one collective at a time. A collective that misses `timeout_s` (a GPU stalled) aborts the
    communicators and raises NcclError; the next call builds new ones.
    """

    def __init__(self, head: RegisteredWeight, devices: Sequence[int], timeout_s: float = 10.0) -> None:
        weight = head.weight
        if weight.dtype not in (torch.bfloat16, torch.float16) or weight.shape[1] % 64:
            raise ValueError(f"a vocabulary-parallel head takes a bf16/fp16 weight of hidden size a multiple of 64, "
                             f"got {weight.dtype} [{weight.shape[0]}, {weight.shape[1]}]")
        if not devices or len(set(devices)) not in (1, len(devices)):
            raise ValueError(f"devices: distinct CUDA device indices (or one index repeated: every shard on one GPU) "
                             f"expected, got {list(devices)}")
        sms = {torch.cuda.get_device_properties(d).multi_processor_count for d in devices}
        if len(sms) != 1:
            raise ValueError(f"devices: GPUs of one kind expected (one launch plan), got SM counts {sorted(sms)}")
        self.head = head
        self.devices = list(devices)
        self.timeout_s = timeout_s
        self._shards = [self._place(head, start, stop, torch.device("cuda", device))
                        for (start, stop), device in zip(shard_bounds(head.finish.vocab_size, len(devices)), devices)]
        self._lock = threading.Lock()
        self._group: NcclGroup | None = None
        self._calls: dict[tuple, _CallBuffers] = {}

    @property
    def main(self) -> torch.device:
        return self._shards[0].device

    @property
    def bounds(self) -> list[tuple[int, int]]:
        return [(s.start, s.start + s.head.finish.vocab_size) for s in self._shards]

    @staticmethod
    def _place(head: RegisteredWeight, start: int, stop: int, device: torch.device) -> _Shard:
        part = shard_head(head, start, stop)
        finish = part.finish
        bias = None if finish.bias is None else finish.bias.to(device, torch.float32).contiguous()
        return _Shard(start, replace(part, weight=part.weight.to(device).contiguous(),
                                     finish=replace(finish, bias=bias), region=None))

    def launch(self, states: torch.Tensor, params: Sequence[RowParams], num_samples: int, logprobs: bool,
               filtered: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Enqueues a call on each device's current stream, without a host synchronisation: hidden states [B, D]
        (W's dtype, on the first device), the rows' parameters on each device (params[r] on devices[r]). Returns
        fused_sample's tokens, raw log-probs and flags, on the first device. The caller holds the call's lock; the
        call's buffers are reused by the next call of its shape, after it on the same streams."""
        num_rows, dim = states.shape
        buffers = self._buffers(num_rows, dim, filtered)
        # Every copy first: a copy waits for the source device's stream, which must not hold the first shard's
        # stage 1 yet, or the shards would run one after the other.
        inputs = [states if copy is None else copy.copy_(states, non_blocking=True) for copy in buffers.inputs]
        for shard, shard_params, local, scratch in zip(self._shards, params, inputs, buffers.scratch):
            with torch.cuda.device(shard.device):
                finish = shard.head.finish
                cuda_fused.fused_partials(shard.head.weight, local, shard_params, buffers.plan, scratch,
                                          first_token=shard.start, bias=finish.bias, logit_scale=finish.logit_scale,
                                          soft_cap=finish.soft_cap, want_sum1=logprobs)
        count = len(self._shards)
        if buffers.streams is None:  # every shard on one GPU: no exchange
            gathered = torch.stack(buffers.scratch) if count > 1 else buffers.scratch[0].view(1, -1)
        else:
            self._communicators().all_gather(buffers.scratch, buffers.receives, buffers.streams)
            gathered = buffers.receives[0]
        split = num_rows * buffers.plan.vocab_ctas * PARTIAL_BYTES
        partials, cands = gathered[0, :split], gathered[0, split:] if buffers.per_part else None
        with torch.cuda.device(self.main):
            if count > 1:  # [shard, row, CTA] to [row, shard, CTA]: a row's partials side by side, as one GPU's CTAs'
                partials = buffers.partials.copy_(gathered[:, :split].view(count, num_rows, -1).transpose(0, 1))
                if cands is not None:
                    cands = buffers.cands.copy_(gathered[:, split:].view(count, num_rows, -1).transpose(0, 1))
            parts = partials.view(num_rows, count * buffers.plan.vocab_ctas, PARTIAL_BYTES)
            return cuda_fused.fused_finish(params[0], parts, cands, buffers.per_part, num_samples, logprobs)

    def _buffers(self, num_rows: int, dim: int, filtered: bool) -> _CallBuffers:
        """The launch plan and buffers of a call shape on the devices' current streams, made once (the last
        _BUFFERED are kept)."""
        key = (num_rows, dim, filtered, tuple(stream_address(s.device) for s in self._shards))
        found = self._calls.pop(key, None)
        if found is None:
            found = self._make_buffers(num_rows, dim, filtered)
        self._calls[key] = found  # the most recent last
        while len(self._calls) > _BUFFERED:
            self._calls.pop(next(iter(self._calls)))
        return found

    def _make_buffers(self, num_rows: int, dim: int, filtered: bool) -> _CallBuffers:
        shortest = min(s.head.finish.vocab_size for s in self._shards)
        # One plan for every shard (the shortest's CTAs along V), so their partials line up for one all-gather.
        plan = cuda_fused.plan(num_rows, dim, shortest, self.main.index, filtered)
        if plan is None:
            raise ValueError(f"hidden size {dim} does not fit the fused kernel")
        per_part = cuda_fused.candidates_per_part(plan, self.main.index)
        count, dtype = len(self._shards), self.head.weight.dtype
        exchanged = len(set(self.devices)) > 1

        def on(shard: _Shard, *shape: int, kind: torch.dtype = torch.uint8) -> torch.Tensor:
            return torch.empty(shape, dtype=kind, device=shard.device)

        split = num_rows * plan.vocab_ctas * PARTIAL_BYTES
        return _CallBuffers(
            plan=plan, per_part=per_part,
            inputs=[None if s.device == self.main else on(s, num_rows, dim, kind=dtype) for s in self._shards],
            scratch=[on(s, plan.scratch_bytes) for s in self._shards],
            receives=[on(s, count, plan.scratch_bytes) for s in self._shards] if exchanged else [],
            streams=[stream_address(s.device) for s in self._shards] if exchanged else None,
            partials=on(self._shards[0], num_rows, count, split // num_rows) if count > 1 else None,
            cands=on(self._shards[0], num_rows, count, (plan.scratch_bytes - split) // num_rows)
            if count > 1 and per_part else None)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, V] of hidden states [B, D] on the first device: each shard's columns (the whole
        head's logits() there) gathered."""
        return torch.cat([shard.head.logits(states.to(shard.device)).to(self.main) for shard in self._shards], dim=1)

    def sample(self, batch: SamplingBatch,
               logits_path: Callable[[SamplingBatch], SamplingResult]) -> SamplingResult:
        """Samples a hidden-state batch through this head (batch.hidden.lm_head is `head`): the fused path where the
        kernel takes the request, `logits_path` (a single-GPU backend's sample on the first device) for the rest and
        for the rows the kernel flags. Every request is served; a stalled GPU raises NcclError."""
        if batch.hidden is None or batch.hidden.lm_head is not self.head:
            raise ValueError("a vocabulary-parallel head samples hidden states through itself")
        states = batch.hidden.states
        if states.dtype != self.head.weight.dtype or cuda_fused.request_unsupported_reason(batch) is not None:
            return logits_path(replace(batch, logits=self.logits(states), hidden=None))
        states = states.to(self.main)
        with self._lock:
            params = [cuda_fused.row_params(batch, shard.device) for shard in self._shards]
            tokens, logprobs, flags = self.launch(states.contiguous(), params, batch.num_samples,
                                                  batch.return_logprobs, cuda_fused.has_filters(batch))
            self._wait()
        flags = flags.cpu()
        valid, nan = row_states(flags)
        result = SamplingResult(tokens=tokens.cpu(), valid=valid, nan_detected=nan,
                                logprobs=None if logprobs is None else logprobs.cpu())
        redo = ((flags & cuda_fused.FLAG_LOGITS_PATH) != 0).nonzero().squeeze(1)
        if not redo.numel():
            return result
        rows = select_rows(replace(batch, hidden=HiddenInput(batch.hidden.states, self.head)), redo)
        again = logits_path(replace(rows, logits=self.logits(rows.hidden.states), hidden=None))
        return merge_rows(result, redo, again)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def _communicators(self) -> NcclGroup:
        """The NCCL group of the devices, built again after an abort."""
        if self._group is None or not self._group.usable:
            self._group = NcclGroup(self.devices, self.timeout_s)
        return self._group

    def _wait(self) -> None:
        """The call's end on every device, within timeout_s."""
        events = []
        for shard in self._shards:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(shard.device))
            events.append(event)
        if len(set(self.devices)) == 1:
            events[0].synchronize()
        else:
            self._group.wait(events, self.timeout_s)
