"""Small workload requests whose token lists and local samplers are applied at every position they sample.

A diffusion step copies its request's token lists to every masked position, and a verification applies its
processing at each of its n + 1 positions: a few KB of request can mean 2^25 list copies (Limits.max_token_entries)
or 4096 passes of the local samplers. These hold the work to what the copies themselves cost: the copies are made
without temporaries, held a bounded batch at a time, and a verification's positions are processed together, with
the answers of one position at a time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor
from torch.profiler import ProfilerActivity, profile

from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.model.sampling import SamplingBatch, SamplingResult, TokenEntries
from tokensampler_server.validation.workloads import validate_diffusion_request, validate_verify_request
from tokensampler_server.workloads import diffusion, verify

LIMITS = Limits(max_batch_elements=1 << 26)
HISTORY = pb.TokenLists(ids=[0, 1] * 16, lengths=[32])
LOCAL_SAMPLERS = dict(typical_p=[0.5], top_n_sigma=[1.0], xtc_threshold=[0.1], xtc_probability=[0.5],
                      dry_multiplier=[1.0], dry_allowed_length=[1], no_repeat_ngram_size=[3], repetition_penalty=[1.2],
                      presence_penalty=[0.5], frequency_penalty=[0.5], output_token_ids=HISTORY, top_k=[1], top_p=[0.9])


def _tensor(array: np.ndarray) -> pb.Tensor:
    message = pb.Tensor()
    encode_tensor(torch.from_numpy(np.ascontiguousarray(array)), out=message)
    return message


def _copy_bytes(work: Callable[[], object]) -> int:
    """Bytes the CPU allocations of `work()` took together, freed or not (torch's profiler)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiled:
        work()
    return sum(event.self_cpu_memory_usage for event in profiled.events() if event.self_cpu_memory_usage > 0)


def test_a_list_shared_by_every_position_is_copied_without_temporaries() -> None:
    """A list of 1024 ids copied to 1024 positions allocates its copies (a row and an id, 16 bytes each) and little
    more (before: an index of the entry each copy is for, its offset and a gather per field, 80 bytes a copy; a
    28 KB diffusion step took 5 s of CPU)."""
    entries, positions = 1024, 1024
    listed = TokenEntries(rows=torch.zeros(entries, dtype=torch.int64), tokens=torch.arange(entries))
    copies: list[TokenEntries] = []
    allocated = _copy_bytes(lambda: copies.append(diffusion._expand_entries(
        listed, torch.tensor([positions]), torch.tensor([0]))[0]))
    copied = copies[0]
    by_row = torch.argsort(copied.rows, stable=True)  # each position's copies, in the list's order
    assert torch.equal(copied.rows[by_row], torch.arange(positions).repeat_interleave(entries))
    assert torch.equal(copied.tokens[by_row], torch.arange(entries).repeat(positions))
    assert allocated <= 24 * len(copied), allocated / len(copied)


class _Recording(CpuBackend):
    """The CPU backend, keeping what each batch it samples holds."""

    def __init__(self) -> None:
        super().__init__()
        self.banned: list[int] = []

    def sample(self, batch: SamplingBatch) -> SamplingResult:
        self.banned.append(len(batch.processing.banned))
        return super().sample(batch)


def test_a_diffusion_step_holds_a_bounded_batch_of_list_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Masked positions whose requests' lists would make more copies than _BATCH_COPIES are sampled in consecutive
    batches of about that many, with the tokens, confidences and mask of one batch (before: every copy at once, a
    28 KB request +1.3 GB of server memory)."""
    num_rows, length, entries = 3, 64, 40
    rng = np.random.default_rng(0)
    mask = (rng.random((num_rows, length)) < 0.7).astype(np.uint8)
    request = pb.DiffusionStepRequest(
        logits=_tensor(rng.standard_normal((num_rows, length, 50)).astype(np.float32)), mask=_tensor(mask),
        params=pb.SamplingParams(seed=[1, 2, 3], banned_token_ids=pb.TokenLists(ids=list(range(entries)),
                                                                                lengths=[entries]),
                                 xtc_threshold=[0.05], xtc_probability=[0.5]), commit_count=[2])
    logits, step, _ = validate_diffusion_request(request, LIMITS)
    whole = diffusion.diffusion_step(step(logits.compute()), CpuBackend())
    budget = 16 * entries
    monkeypatch.setattr(diffusion, "_BATCH_COPIES", budget, raising=False)
    backend = _Recording()
    batched = diffusion.diffusion_step(step(logits.compute()), backend)
    assert sum(backend.banned) == entries * int(mask.sum()) and len(backend.banned) > 1
    assert max(backend.banned) <= budget + entries, backend.banned
    for got, expected in zip(batched, whole, strict=True):
        assert torch.equal(got, expected)


def _verification(positions: int, vocab: int, **params) -> verify.DraftVerification:
    rng = np.random.default_rng(positions)
    request = pb.VerifyDraftRequest(
        draft_ids=_tensor(rng.integers(0, vocab, (1, positions - 1))),
        draft_probs=_tensor(rng.random((1, positions - 1, vocab)).astype(np.float32) + 0.01),
        target_logits=_tensor(rng.standard_normal((1, positions, vocab)).astype(np.float16)),
        params=pb.SamplingParams(seed=[7], position=[2**32 - 100], **params))
    return validate_verify_request(request, LIMITS)[0]


def test_a_verification_processes_its_positions_together(monkeypatch: pytest.MonkeyPatch) -> None:
    """256 positions of 2 logits with every local sampler on take one pass of the processing, not one a position
    (2-9 ms each: n = 4095 held the worker 9-18 s of CPU for a 49 KB request); the answer is the one processing a
    position at a time gives, Philox positions wrapping past 2^32 included."""
    verification = _verification(256, 2, **LOCAL_SAMPLERS)
    passes = []
    processing = verify.apply_processing
    monkeypatch.setattr(verify, "apply_processing", lambda *args: passes.append(1) or processing(*args))
    together = verify.verify_draft(verification)
    assert len(passes) <= 2, len(passes)
    monkeypatch.setattr(verify, "_CHUNK_ELEMENTS", 1, raising=False)  # one position a chunk: the lists not copied
    one_at_a_time = verify.verify_draft(verification)
    assert len(passes) > 256
    for got, expected in zip(together, one_at_a_time, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("chunk_elements", [3, 40, 1 << 22])
def test_a_verification_answers_alike_whatever_its_chunks(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    """Chunks of several positions, the last one shorter, a shared list copied to each: the answer of one position
    at a time."""
    params = dict(LOCAL_SAMPLERS, banned_token_ids=pb.TokenLists(ids=[3, 4], lengths=[2]),
                  logit_bias=pb.LogitBias(tokens=pb.TokenLists(ids=[5, 5, 1], lengths=[3]), values=[1.5, -0.5, 2.0]))
    verification = _verification(37, 8, **params)
    monkeypatch.setattr(verify, "_CHUNK_ELEMENTS", 1, raising=False)
    expected = verify.verify_draft(verification)
    monkeypatch.setattr(verify, "_CHUNK_ELEMENTS", chunk_elements, raising=False)
    for got, want in zip(verify.verify_draft(verification), expected, strict=True):
        assert torch.equal(got, want)


def test_a_steps_list_copies_count_toward_the_long_worker() -> None:
    """A diffusion step of 4096 positions of 2 logits whose one list of 8192 ids every position shares reads 8192
    logits (a 37 KB request) but makes 2^25 copies (2.4 s of the CPU): the copies count as logits read, so it goes to the long worker
    and short requests run beside it (before: logits alone counted, and it held the short worker)."""
    from tokensampler_server.batching.batcher import DynamicBatcher
    from tokensampler_server.rpc.service import _list_copies

    length, vocab, entries = 4096, 2, 8192
    request = pb.DiffusionStepRequest(
        logits=_tensor(np.zeros((1, length, vocab), np.float16)), mask=_tensor(np.ones((1, length), np.uint8)),
        params=pb.SamplingParams(seed=[1], banned_token_ids=pb.TokenLists(ids=[1] * entries,
                                                                          lengths=[entries])))
    assert request.ByteSize() < 40 << 10
    logits, step, _ = validate_diffusion_request(request, Limits(max_token_entries=1 << 25))
    copies = _list_copies(step.keywords["processing"], logits.shape[1])
    assert copies == entries * length
    batcher = DynamicBatcher(CpuBackend(), max_batch_rows=64)
    assert batcher._reads_long(length * vocab + copies) and not batcher._reads_long(length * vocab)
