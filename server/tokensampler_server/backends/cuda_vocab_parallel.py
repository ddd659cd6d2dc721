"""Hidden states through an LM head split by vocabulary rows over several GPUs of this process
(docs/design/vocab-parallel.md, "The fused path").

Each GPU holds a contiguous slice of W's rows; an NCCL broadcast brings it the hidden states, and it runs the fused
kernel's first stage on its slice: its CTAs' partial results (row max, sums, the Gumbel-max or argmax winner, a
filtered row's best keys) with global token ids and noise keyed by the global id. One NCCL all-gather brings every
shard's partials to the first GPU, whose second stage merges them where they land as it merges one GPU's CTAs. The
winner and the candidates are maxima over tokens, so the tokens are those of the whole head on one GPU; only the
sums (log-probs, top-p's mass) add the CTAs' partials in another grouping, within fp32 rounding. Requests the fused
kernel does not take, and rows it flags (a kept set reaching past its candidates), take the logits path: every
shard's logits gathered on the first GPU, then the single-GPU logits kernels.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from tokensampler_server.model.sampling import SamplingBatch, SamplingResult, merge_rows, select_rows
from tokensampler_server.resources.weights import RegisteredWeight
from tokensampler_server.backends import cuda_fused
from tokensampler_server.backends.cuda_kernels import RowParams, stream_address
from tokensampler_server.backends.nccl import NcclError, NcclGroup, record_events
from tokensampler_server.backends.vocab_parallel import shard_head

TILE_ROWS = 128
"""The fused kernel's vocabulary tile: a shard starts at a multiple of it (csrc/fused.h, TsLmHead.first_token)."""
PARTIAL_BYTES = 32
"""One (row, CTA) partial result (csrc/fused.h, TS_FUSED_PARTIAL_BYTES)."""
_BUFFERED = 8
"""Call shapes whose buffers a head keeps."""

log = logging.getLogger(__name__)


def splittable(weight: torch.Tensor) -> bool:
    """Whether the fused kernel can split this head weight: bf16/fp16, D a multiple of 64."""
    return weight.dtype in (torch.bfloat16, torch.float16) and weight.shape[1] % 64 == 0


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
    inputs: list[torch.Tensor | None]
    """The hidden states' copy on each device but the first (None there)."""
    scratch: list[torch.Tensor]
    """Each shard's stage 1 output, uint8 [plan.scratch_bytes] (without an exchange, the rows of `merged`)."""
    receives: list[torch.Tensor]
    """Each device's all-gather output, uint8 [N, plan.scratch_bytes] (none without an exchange)."""
    merged: torch.Tensor
    """What stage 2 reads on the first device, uint8 [N, plan.scratch_bytes]: every shard's stage 1 output."""
    streams: list[int] | None
    """The devices' streams when the buffers were made (None without an exchange): the buffers are theirs."""


@dataclass(frozen=True)
class _Shard:
    start: int
    head: RegisteredWeight
    """Rows start.. of the whole head, on this shard's device, with their own finish (bias slice)."""

    @property
    def device(self) -> torch.device:
        return self.head.weight.device


class DeviceGroup:
    """The GPUs heads are split over (CUDA indices; the first answers) and their NCCL communicators, shared by every
    head on them. One index repeated puts every shard on one GPU: the same merge without an exchange (the tests'
    single-GPU form). Calls are serialised by `lock`: the communicators take one collective at a time. A collective
    that misses timeout_s (a GPU stalled) aborts the communicators and raises NcclError; `recover`, or the next
    call, builds new ones."""

    def __init__(self, devices: Sequence[int], timeout_s: float = 10.0) -> None:
        if not devices or len(set(devices)) not in (1, len(devices)):
            raise ValueError(f"devices: distinct CUDA device indices (or one index repeated: every shard on one GPU) "
                             f"expected, got {list(devices)}")
        sms = {torch.cuda.get_device_properties(d).multi_processor_count for d in devices}
        if len(sms) != 1:
            raise ValueError(f"devices: GPUs of one kind expected (one launch plan), got SM counts {sorted(sms)}")
        self.devices = list(devices)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self._nccl: NcclGroup | None = None

    @property
    def exchanged(self) -> bool:
        """Whether the shards lie on several GPUs (and so exchange over NCCL)."""
        return len(set(self.devices)) > 1

    def communicators(self) -> NcclGroup:
        """The NCCL communicators of the devices, built again after an abort (NcclError when that fails, or while a
        device has not finished the work of the call that failed)."""
        if self._nccl is None or not self._nccl.usable:
            if self._nccl is not None:  # a failed call's work may still run; a first build waits for ordinary work
                self.check_idle()
            self._nccl = NcclGroup(self.devices, self.timeout_s)
        return self._nccl

    def check_idle(self) -> None:
        """NcclError unless every device's current stream has finished its work. After a stall that work may never
        finish, and anything that waits for it (a copy to the device, NCCL's connection on the host) has no deadline.
        """
        busy = [device for device in dict.fromkeys(self.devices) if not torch.cuda.current_stream(device).query()]
        if busy:
            raise NcclError(f"GPUs {busy} have not finished the work of a call that failed; they take no call until "
                            "they do")

    def ready(self) -> None:
        """Before a call, under `lock`: NcclError unless the group can take it (after a failure: its devices idle
        again and its communicators rebuilt)."""
        if self.exchanged:
            self.communicators()

    def wait(self) -> None:
        """The end of the work enqueued so far on every device's current stream, within timeout_s."""
        events = record_events(dict.fromkeys(self.devices))
        if not self.exchanged:
            events[0].synchronize()
        else:
            self.communicators().wait(events, self.timeout_s)

    def recover(self) -> bool:
        """Whether the group can serve: its communicators are usable, or were just built again (and connected)."""
        if not self.exchanged:
            return True
        # A call holds the lock for at most its exchange's deadline; longer, and a device stalled outside it.
        if not self.lock.acquire(timeout=2 * self.timeout_s):
            log.warning("vocabulary-parallel devices %s: a call has held them for over %g s", self.devices,
                        2 * self.timeout_s)
            return False
        try:
            self.communicators()
        except NcclError as err:
            log.warning("vocabulary-parallel devices %s: %s", self.devices, err)
            return False
        finally:
            self.lock.release()
        return True

    def close(self) -> None:
        if self._nccl is not None:
            self._nccl.close()
            self._nccl = None


class VocabParallelHead:
    """A registered head split over a DeviceGroup's devices, sampled by `sample`. The shards are copies of W's rows
    on their devices (views where a device already holds W); the head itself is only weakly referenced, so that a
    cache keyed by it lets it go when it is unregistered."""

    def __init__(self, head: RegisteredWeight, group: DeviceGroup) -> None:
        weight = head.weight
        if not splittable(weight):
            raise ValueError(f"a vocabulary-parallel head takes a bf16/fp16 weight of hidden size a multiple of 64, "
                             f"got {weight.dtype} [{weight.shape[0]}, {weight.shape[1]}]")
        self._head = weakref.ref(head)
        self.dtype = weight.dtype
        self.group = group
        self._shards = [self._place(head, start, stop, torch.device("cuda", device))
                        for (start, stop), device in zip(shard_bounds(head.finish.vocab_size, len(group.devices)),
                                                         group.devices)]
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
        fused_sample's tokens, raw log-probs and flags, on the first device. The caller holds the group's lock;
        the call's buffers are reused by the next call of its shape, after it on the same streams."""
        num_rows, dim = states.shape
        buffers = self._buffers(num_rows, dim, filtered)
        inputs = [states if copy is None else copy for copy in buffers.inputs]
        if buffers.streams is not None:
            # An NCCL broadcast rather than a copy: a copy between devices made each stream wait for the other
            # through events, 15-20 µs a call on two H200s (docs/design/vocab-parallel.md).
            self.group.communicators().broadcast(inputs, buffers.streams)
        for shard, shard_params, local, scratch in zip(self._shards, params, inputs, buffers.scratch):
            with torch.cuda.device(shard.device):
                finish = shard.head.finish
                cuda_fused.fused_partials(shard.head.weight, local, shard_params, buffers.plan, scratch,
                                          first_token=shard.start, bias=finish.bias, logit_scale=finish.logit_scale,
                                          soft_cap=finish.soft_cap, want_sum1=logprobs)
        if buffers.streams is not None:
            self.group.communicators().all_gather(buffers.scratch, buffers.receives, buffers.streams)
        with torch.cuda.device(self.main):  # stage 2 reads the shards' outputs where the exchange left them
            return cuda_fused.fused_finish(params[0], buffers.merged, num_rows, buffers.plan, num_samples, logprobs)

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

    def _plan(self, num_rows: int, dim: int, filtered: bool) -> cuda_fused.FusedPlan | None:
        """One plan for every shard (the shortest's CTAs along V), so that their partials line up for one
        all-gather; None where the kernel does not take D."""
        shortest = min(s.head.finish.vocab_size for s in self._shards)
        return cuda_fused.plan(num_rows, dim, shortest, self.main.index, filtered)

    def _fused_takes(self, num_rows: int, dim: int, filtered: bool) -> bool:
        """Whether the split call has a plan and its second stage fits the first GPU: with full candidate lists
        that stage stages every part's list in shared memory, N shards x CTAs x 64 keys."""
        plan = self._plan(num_rows, dim, filtered)
        if plan is None:
            return False
        per_part = cuda_fused.candidates_per_part(plan, self.main.index)
        staged = len(self._shards) * plan.vocab_ctas * per_part * 8 if per_part > cuda_fused.max_top_k(self.main.index) else 0
        return staged <= torch.cuda.get_device_properties(self.main).shared_memory_per_block_optin

    def _make_buffers(self, num_rows: int, dim: int, filtered: bool) -> _CallBuffers:
        plan = self._plan(num_rows, dim, filtered)
        if plan is None:
            raise ValueError(f"hidden size {dim} does not fit the fused kernel")
        count, dtype = len(self._shards), self.dtype
        exchanged = self.group.exchanged

        def on(shard: _Shard, *shape: int, kind: torch.dtype = torch.uint8) -> torch.Tensor:
            return torch.empty(shape, dtype=kind, device=shard.device)

        if exchanged:
            scratch = [on(s, plan.scratch_bytes) for s in self._shards]
            receives = [on(s, count, plan.scratch_bytes) for s in self._shards]
            merged = receives[0]
        else:  # every shard on one GPU: stage 1 writes the rows of what stage 2 reads
            merged = on(self._shards[0], count, plan.scratch_bytes)
            scratch, receives = list(merged), []
        return _CallBuffers(
            plan=plan,
            inputs=[None if s.device == self.main else on(s, num_rows, dim, kind=dtype) for s in self._shards],
            scratch=scratch, receives=receives, merged=merged,
            streams=[stream_address(s.device) for s in self._shards] if exchanged else None)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, V] of hidden states [B, D] on the first device: each shard's columns (the whole
        head's logits() there) gathered."""
        return torch.cat([shard.head.logits(states.to(shard.device)).to(self.main) for shard in self._shards], dim=1)

    def sample(self, batch: SamplingBatch,
               logits_path: Callable[[SamplingBatch], SamplingResult]) -> SamplingResult:
        """Samples a hidden-state batch through this head (batch.hidden.lm_head is `head`): the fused path where the
        kernel takes the request, `logits_path` (a single-GPU backend's sample on the first device) for the rest and
        for the rows the kernel flags. Every request is served; a stalled GPU raises NcclError."""
        if batch.hidden is None or batch.hidden.lm_head is not self._head():
            raise ValueError("a vocabulary-parallel head samples hidden states through itself")
        states = batch.hidden.states
        filtered = cuda_fused.has_filters(batch)
        # Each path checks the group first: after a failure, a copy to a device still busy with it would not end.
        if (states.dtype != self.dtype or cuda_fused.request_unsupported_reason(batch, self.main.index) is not None
                or not self._fused_takes(batch.num_rows, states.shape[1], filtered)):
            with self.group.lock:
                self.group.ready()
            return logits_path(replace(batch, logits=self.logits(states), hidden=None))
        with self.group.lock:
            self.group.ready()
            params = [cuda_fused.row_params(batch, shard.device) for shard in self._shards]
            tokens, logprobs, flags = self.launch(states.to(self.main).contiguous(), params, batch.num_samples,
                                                  batch.return_logprobs, filtered)
            self.group.wait()
        result, redo = cuda_fused.host_result(tokens, logprobs, flags)
        if not redo.numel():
            return result
        rows = select_rows(batch, redo)
        again = logits_path(replace(rows, logits=self.logits(rows.hidden.states), hidden=None))
        return merge_rows(result, redo, again)


class SplitHeads:
    """Every registered head the backend samples hidden states through, split over one DeviceGroup the first time
    a request goes through it, and let go with the head."""

    def __init__(self, group: DeviceGroup) -> None:
        self.group = group
        self._heads: weakref.WeakKeyDictionary[RegisteredWeight, VocabParallelHead] = weakref.WeakKeyDictionary()

    def takes(self, batch: SamplingBatch) -> bool:
        """Whether the batch goes through a split head: hidden states through a head on a GPU that the fused kernel
        can split, 16-byte aligned as its loads need, with a tile of rows for every device (other heads, and logits,
        stay on the first GPU)."""
        if batch.hidden is None:
            return False
        head = batch.hidden.lm_head
        weight = head.weight
        tiles = -(-head.finish.vocab_size // TILE_ROWS)
        return (weight.is_cuda and splittable(weight) and weight.data_ptr() % 16 == 0
                and tiles >= len(self.group.devices))

    def sample(self, batch: SamplingBatch,
               logits_path: Callable[[SamplingBatch], SamplingResult]) -> SamplingResult:
        """VocabParallelHead.sample through the request's head (NcclError when an exchange failed)."""
        head = batch.hidden.lm_head
        split = self._heads.get(head)
        if split is None:
            split = self._heads[head] = VocabParallelHead(head, self.group)
        return split.sample(batch, logits_path)
