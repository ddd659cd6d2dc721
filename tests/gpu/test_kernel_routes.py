"""One small call down every kernel and route of the CUDA backend, each checked against the CPU reference.

Small shapes on purpose: this is the subset the CUDA sanitizer runs (memcheck and racecheck cost 10-100x;
the command is in docs/hardening.md). The statistical and large-vocabulary checks live in the other files.
Every case also asserts (tests/gpu/conftest.py) that no row left its route, so a kernel that flags its rows
cannot pass on another path's answers.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.workloads.diffusion import diffusion_step
from tokensampler_server.workloads.topk_probs import topk_probs
from tokensampler_server.workloads.verify import verify_draft
from tokensampler_server.model.sampling import HiddenInput, LogprobsMode
from tokensampler_server.validation.sample import validate_sample_request
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from .conftest import MODES, logits, make_batch
from .test_cuda_workloads import _assert_step_agrees, _assert_verdicts_agree, _step, _verification

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB = 3000
ROWS = 4
FRONTIER_ROWS = 32  # top-p without k takes the frontier route from this many rows (backends/cuda.py)


def _agrees(got, ref, rows: int) -> None:
    """Tokens equal to the reference's in all but at most one row in four (rounding ties), validity exact."""
    assert torch.equal(got.valid, ref.valid)
    same = (got.tokens == ref.tokens).all(dim=1).sum().item()
    assert same >= rows - rows // 4, f"{same} of {rows} rows agree"


@pytest.mark.parametrize("mode", list(MODES))
def test_every_logits_route(cuda_backend, mode: str) -> None:
    x = logits("spiky", ROWS, VOCAB, seed=3)
    batch = make_batch(x, **MODES[mode])
    _agrees(cuda_backend.sample(batch), CpuBackend().sample(batch), ROWS)


def test_top_p_frontier_route(cuda_backend) -> None:
    x = logits("flat", FRONTIER_ROWS, VOCAB, seed=4)
    batch = make_batch(x, top_p=0.9)
    _agrees(cuda_backend.sample(batch), CpuBackend().sample(batch), FRONTIER_ROWS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(cuda_backend, dtype: torch.dtype) -> None:
    x = logits("spiky", ROWS, VOCAB, seed=5, dtype=dtype)
    batch = make_batch(x, top_k=50, top_p=0.9)
    _agrees(cuda_backend.sample(batch), CpuBackend().sample(batch), ROWS)


@pytest.mark.parametrize("mode", [LogprobsMode.RAW, LogprobsMode.PROCESSED])
def test_logprobs_and_top_logprobs(cuda_backend, mode: LogprobsMode) -> None:
    x = logits("spiky", ROWS, VOCAB, seed=6)
    batch = make_batch(x, top_k=40, return_logprobs=True, logprobs_mode=mode, top_logprobs=3, num_samples=2)
    got, ref = cuda_backend.sample(batch), CpuBackend().sample(batch)
    _agrees(got, ref, ROWS)
    same = got.tokens == ref.tokens
    torch.testing.assert_close(got.logprobs[same], ref.logprobs[same], rtol=1e-4, atol=1e-4)
    assert torch.equal(got.top_logprob_ids, ref.top_logprob_ids)


def test_processing_masks_bias_and_penalties(cuda_backend) -> None:
    x = logits("spiky", ROWS, VOCAB, seed=7)
    request = build_sample_request(logits=x, top_k=30, seed=list(range(ROWS)), banned_token_ids=[[1, 2, 3]] * ROWS,
                                   repetition_penalty=1.3, output_token_ids=[[5, 6, 7, 8]] * ROWS,
                                   logit_bias=[{9: 5.0}] * ROWS)
    batch, _ = validate_sample_request(request, Limits())
    _agrees(cuda_backend.sample(batch), CpuBackend().sample(batch), ROWS)


@pytest.mark.parametrize("mode", ["gumbel", "top_k_top_p", "greedy"])
def test_fused_lm_head(cuda_backend, mode: str) -> None:
    dim = 256
    gen = torch.Generator().manual_seed(8)
    weight = (torch.randn(VOCAB, dim, generator=gen) / dim ** 0.5).to(torch.bfloat16)
    head = RegisteredWeight(name="w", weight=weight.cuda(), finish=LogitsFinish(vocab_size=VOCAB), sha256="")
    hidden = (torch.randn(ROWS, dim, generator=gen) * 4).to(torch.bfloat16)
    params = MODES[mode]
    batch = dataclasses.replace(make_batch(torch.empty(ROWS, 0), **params), logits=None,
                                hidden=HiddenInput(hidden, head))
    cpu_head = dataclasses.replace(head, weight=weight)
    reference = CpuBackend().sample(make_batch(cpu_head.logits(hidden), **params))
    _agrees(cuda_backend.sample(batch), reference, ROWS)


def test_topk_probs_kernel(cuda_backend) -> None:
    from tokensampler_server.workloads.cuda import workloads_of

    x = logits("spiky", ROWS, VOCAB, seed=9)
    temperature = torch.full((ROWS,), 0.8)
    probs, ids = workloads_of(cuda_backend).topk_probs(x, temperature, 20)
    ref_probs, ref_ids = topk_probs(x, temperature, 20)
    assert torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(probs.cpu(), ref_probs, rtol=1e-5, atol=1e-7)


def test_diffusion_step_kernel(cuda_backend, cpu_backend) -> None:
    from tokensampler_server.workloads.cuda import workloads_of

    step = _step(3, 8, 1000, seed=10, temperature=[1.0, 0.0, 0.7])
    _assert_step_agrees(workloads_of(cuda_backend).diffusion_step(step), diffusion_step(step, cpu_backend), step.mask)


def test_verify_draft_kernel(cuda_backend) -> None:
    from tokensampler_server.workloads.cuda import workloads_of

    v = _verification(4, 3, 1000, seed=11, temperature=[1.0, 0.7, 0.0, 1.2])
    _assert_verdicts_agree(workloads_of(cuda_backend).verify_draft(v), verify_draft(v))


def test_native_path_routes(cuda_backend) -> None:
    from tokensampler_server.batching.batcher import DynamicBatcher
    from tokensampler_server.rpc.native_path import NativePath

    limits = Limits()
    batcher = DynamicBatcher(cuda_backend, max_batch_rows=limits.max_batch_rows,
                             max_batch_elements=limits.max_batch_elements)
    path = NativePath.for_backend(cuda_backend, limits, batcher)
    x = logits("spiky", ROWS, VOCAB, seed=12)
    request = build_sample_request(logits=x, top_k=50, top_p=0.9, seed=list(range(ROWS)))
    answer = asyncio.run(path.sample(request.SerializeToString(), "rid", False))
    assert answer is not None, "the native path declined a plain carried-logits request"
    got = pb.SampleResponse.FromString(answer.response)
    tokens = torch.frombuffer(bytearray(got.tokens.data), dtype=torch.int32).view(ROWS, 1).long()
    batch, _ = validate_sample_request(request, Limits())
    expected = cuda_backend.sample(batch)
    assert torch.equal(tokens, expected.tokens)
