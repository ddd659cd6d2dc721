"""Hidden states through a head split by vocabulary rows (backends/cuda_vocab_parallel.py) against the whole head on
one GPU.

The fused kernel's first stage runs on each shard with global ids and noise, its second stage merges every shard's
partials: the tokens must be the whole head's fused tokens exactly wherever both calls decided the row (the
winner and the candidates are maxima over tokens; only sums are grouped otherwise), flags alike, raw log-probs to
fp32 rounding. Through `sample`, every request (flagged rows and requests the kernel does not take included) must
give CudaBackend's tokens on the whole head. Shards on one GPU (two and three, one of them ragged) run on any GPU;
shards on two GPUs, exchanged over NCCL, when two are present, with an NCCL group that a rank never joins: the wait
ends at its deadline, the group is aborted, and a new one serves the next call.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import grpc
import pytest
import torch
from scipy.stats import chisquare

from tokensampler_server.model.sampling import HiddenInput
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from .conftest import make_batch

pytestmark = pytest.mark.gpu

ALPHA = 0.001  # significance of the chi-square test (fixed seeds: its outcome is deterministic)
MODES = {
    "greedy": {"temperature": 0.0},
    "gumbel": {"temperature": 0.8},
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_k_top_p": {"temperature": 1.0, "top_k": 50, "top_p": 0.9},
    "top_k_min_p": {"temperature": 1.2, "top_k": 40, "min_p": 0.05},
    "top_p": {"temperature": 1.0, "top_p": 0.9},
}


def _modules():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    from tokensampler_server.backends import cuda_fused, cuda_vocab_parallel
    from tokensampler_server.backends.cuda import CudaBackend

    return cuda_fused, cuda_vocab_parallel, CudaBackend


@functools.lru_cache(maxsize=8)
def _head(vocab: int, dim: int, *, seed: int = 0, bias: bool = False) -> RegisteredWeight:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, dim, generator=gen) / dim ** 0.5).to(torch.bfloat16)
    finish = LogitsFinish(vocab_size=vocab, bias=torch.randn(vocab, generator=gen) if bias else None,
                          soft_cap=30.0 if bias else None, logit_scale=1.25 if bias else 1.0)
    if bias:
        finish = dataclasses.replace(finish, bias=finish.bias.cuda())
    return RegisteredWeight(name="w", weight=weight.cuda(), finish=finish, sha256="")


def _hidden(num_rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(num_rows, dim, generator=gen) * 4.0).to(torch.bfloat16)


def _batch(head: RegisteredWeight, hidden: torch.Tensor, **params):
    batch = make_batch(torch.empty(hidden.shape[0], 0), **params)
    return dataclasses.replace(batch, logits=None, hidden=HiddenInput(hidden, head))


def _launch_both(head, sharded, hidden, params, logprobs=False):
    """(whole head's fused_sample, the shards' launch) of the same rows, each (tokens, log-probs, flags) on the CPU."""
    cuda_fused, _, _ = _modules()
    states = hidden.cuda()
    batch = make_batch(torch.empty(states.shape[0], 0), **params)
    filtered = cuda_fused.has_filters(batch)
    whole = cuda_fused.fused_sample(head.weight, states, cuda_fused.row_params(batch, states.device),
                                    vocab=head.finish.vocab_size, bias=head.finish.bias,
                                    logit_scale=head.finish.logit_scale, soft_cap=head.finish.soft_cap,
                                    logprobs=logprobs, filtered=filtered)
    shard_params = [cuda_fused.row_params(batch, torch.device("cuda", d)) for d in sharded.group.devices]
    with sharded.group.lock:
        parts = sharded.launch(states, shard_params, 1, logprobs, filtered)
        sharded.group.wait()
    return tuple(tuple(None if t is None else t.cpu() for t in out) for out in (whole, parts))


def _assert_same_decided(whole, parts, logprobs: bool, least: float) -> None:
    """Tokens and flags identical in the rows both calls decided (at least `least` of them), raw log-probs to fp32
    rounding."""
    (w_tokens, w_logprobs, w_flags), (p_tokens, p_logprobs, p_flags) = whole, parts
    decided = ((w_flags & 4) == 0) & ((p_flags & 4) == 0)
    assert int(decided.sum()) >= least * decided.numel(), f"{int(decided.sum())} rows decided"
    assert torch.equal(w_tokens[decided], p_tokens[decided])
    assert torch.equal(w_flags[decided], p_flags[decided])
    if logprobs:
        torch.testing.assert_close(p_logprobs[decided], w_logprobs[decided], rtol=0, atol=2e-5, equal_nan=True)


def _devices(count: int, same: bool) -> list[int]:
    if same:
        return [0] * count
    if torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} GPUs")
    return list(range(count))


@pytest.mark.parametrize("shape", [(32000, 4096, 64), (5000, 256, 8), (151936, 4096, 1)])
@pytest.mark.parametrize("layout", [("same", 2), ("same", 3), ("distinct", 2)])
@pytest.mark.parametrize("mode", list(MODES))
def test_shards_give_the_whole_heads_tokens(layout, mode, shape):
    _, cuda_vocab_parallel, _ = _modules()
    vocab, dim, rows = shape
    head = _head(vocab, dim, bias=vocab == 5000)
    group = cuda_vocab_parallel.DeviceGroup(_devices(layout[1], layout[0] == "same"))
    sharded = cuda_vocab_parallel.VocabParallelHead(head, group)
    try:
        for seed in range(3):
            params = {**MODES[mode], "seed": 1000 * seed + 17}
            logprobs = mode in ("gumbel", "greedy")
            whole, parts = _launch_both(head, sharded, _hidden(rows, dim, seed), params, logprobs=logprobs)
            # Top-p without k is often past the candidates: those rows take the logits path in both calls.
            _assert_same_decided(whole, parts, logprobs, least=0.0 if mode == "top_p" else 0.9)
    finally:
        group.close()


@pytest.mark.parametrize("layout", [("same", 2), ("distinct", 2)])
def test_sample_serves_every_request_as_the_whole_head(layout):
    """Through `sample`: fused rows, flagged rows (top-p without k), requests the kernel does not take (k > 63,
    top log-probs, fp32 states), several samples; the same tokens as CudaBackend on the whole head."""
    _, cuda_vocab_parallel, CudaBackend = _modules()
    head = _head(32000, 1024, seed=3)
    backend = CudaBackend(0)
    group = cuda_vocab_parallel.DeviceGroup(_devices(2, layout[0] == "same"))
    sharded = cuda_vocab_parallel.VocabParallelHead(head, group)
    cases = [
        ({"temperature": 0.7, "top_k": 30}, torch.bfloat16),
        ({"temperature": 1.0, "top_p": 0.9}, torch.bfloat16),
        ({"temperature": 1.0, "top_k": 1000, "top_p": 0.95}, torch.bfloat16),
        ({"temperature": 1.0, "top_k": 20, "num_samples": 3}, torch.bfloat16),
        ({"temperature": 0.9, "return_logprobs": True, "top_logprobs": 5}, torch.bfloat16),
        ({"temperature": 1.0, "min_p": 0.1}, torch.float32),
    ]
    try:
        for params, dtype in cases:
            hidden = _hidden(16, 1024, seed=5).to(dtype)
            batch = _batch(head, hidden, **params)
            want = backend.sample(batch)
            got = sharded.sample(batch, backend.sample)
            assert torch.equal(got.tokens, want.tokens), params
            assert torch.equal(got.valid, want.valid) and torch.equal(got.nan_detected, want.nan_detected)
            if want.logprobs is not None:
                torch.testing.assert_close(got.logprobs, want.logprobs, rtol=0, atol=1e-4)
            if want.top_logprob_ids is not None:
                assert torch.equal(got.top_logprob_ids, want.top_logprob_ids)
    finally:
        group.close()


def test_gumbel_over_shards_follows_the_exact_distribution():
    """One row's hidden state under 20,000 seeds, its head split in three on one GPU: the tokens' counts against
    softmax of the row's fp32 logits (tokens with an expected count below 5 pooled)."""
    _, cuda_vocab_parallel, _ = _modules()
    vocab, dim, draws = 1000, 256, 20000
    head = _head(vocab, dim, seed=11)
    sharded = cuda_vocab_parallel.VocabParallelHead(head, cuda_vocab_parallel.DeviceGroup([0, 0, 0]))
    hidden = (_hidden(1, dim, seed=4) * 0.3).repeat(draws, 1)
    batch = dataclasses.replace(_batch(head, hidden, temperature=1.0), seed=torch.arange(draws, dtype=torch.int64))
    tokens = sharded.sample(batch, lambda b: pytest.fail("no row needs the logits path")).tokens[:, 0]
    logits = head.logits(hidden[:1].cuda()).cpu()[0].double()
    expected = torch.softmax(logits, 0) * draws
    counts = torch.bincount(tokens, minlength=vocab).double()
    big = expected >= 5
    f_obs = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    f_exp = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    assert chisquare(f_obs.numpy(), f_exp.numpy() * f_obs.sum().item() / f_exp.sum().item()).pvalue > ALPHA


def test_a_rank_that_never_joins_ends_at_the_deadline_and_a_new_group_serves():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from tokensampler_server.backends.nccl import NcclError, NcclGroup

    group = NcclGroup([0, 1])  # connected: a collective now only enqueues
    sends = [torch.full((1024,), rank + 1, dtype=torch.uint8, device=f"cuda:{rank}") for rank in range(2)]
    receives = [torch.zeros((2, 1024), dtype=torch.uint8, device=f"cuda:{rank}") for rank in range(2)]
    group.all_gather(sends, receives, ranks=[0])  # rank 1 never joins
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(0))
    started = time.monotonic()
    with pytest.raises(NcclError, match="aborted"):
        group.wait([event], timeout_s=1.0)
    assert time.monotonic() - started < 5.0
    assert not group.usable
    torch.cuda.synchronize(0)  # the aborted collective's kernel returned
    fresh = NcclGroup([0, 1])
    receives = [torch.zeros((2, 1024), dtype=torch.uint8, device=f"cuda:{rank}") for rank in range(2)]
    fresh.all_gather(sends, receives)
    events = []
    for rank in range(2):
        events.append(torch.cuda.Event())
        events[-1].record(torch.cuda.current_stream(rank))
    fresh.wait(events, timeout_s=10.0)
    for rank in range(2):
        assert receives[rank][0].eq(1).all() and receives[rank][1].eq(2).all()
    fresh.close()


@pytest.fixture(scope="module")
def split_server():
    """A server with --vocab-parallel-devices 0,1 (two GPUs)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from ..conftest import serving

    yield from serving("--device", "cuda:0", "--vocab-parallel-devices", "0,1", timeout=300)


def test_the_server_samples_hidden_states_through_a_split_head(split_server) -> None:
    """Through the service, a head registered once and split over two GPUs: the tokens of an in-process sampler
    on the whole head on one GPU, for fused rows exactly, for top-p rows (the logits path: every shard's logits
    gathered) at the contract's agreement; GetServerInfo names the route, health says SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from tokensampler_client import SamplerClient
    from tokensampler_server.inprocess import LocalSampler

    split_client = SamplerClient(split_server.target, timeout=300)
    weight = (torch.randn(32000, 1024, generator=torch.Generator().manual_seed(9)) / 32).to(torch.bfloat16)
    split_client.register_weights("split-head", weight, chunk_bytes=64 << 20)
    local = LocalSampler("cuda:0")
    whole = local.register_head(weight)
    try:
        info = split_client.server_info()
        assert any("vocab-parallel" in route.rows and "ncclAllGather" in route.kernels for route in info.routes)
        hidden = (torch.randn(32, 1024, generator=torch.Generator().manual_seed(10)) * 4).to(torch.bfloat16)
        seeds = list(range(100, 132))
        for params in ({"temperature": 0.0}, {"temperature": 0.8}, {"top_k": 30}, {"top_k": 50, "top_p": 0.9},
                       {"top_k": 20, "num_samples": 4}):
            got = split_client.sample_hidden(hidden, "split-head", seed=seeds, **params)
            want = local.sample_hidden(hidden.cuda(), whole, seed=seeds, **params)
            assert torch.equal(got.tokens, want.tokens.cpu()), params
        got = split_client.sample_hidden(hidden, "split-head", seed=seeds, top_p=0.9, num_samples=8)
        want = local.sample_hidden(hidden.cuda(), whole, seed=seeds, top_p=0.9, num_samples=8)
        assert (got.tokens == want.tokens.cpu()).float().mean().item() >= 0.99
        with grpc.insecure_channel(split_server.target) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    finally:
        split_client.unregister_weights("split-head")
        split_client.close()


def test_heads_a_split_cannot_take_stay_on_the_first_gpu():
    """A head with fewer 128-row tiles than devices, or a weight not 16-byte aligned (a region at an odd offset),
    is not split: the backend's single-GPU path serves it."""
    _, cuda_vocab_parallel, _ = _modules()
    heads = cuda_vocab_parallel.SplitHeads(cuda_vocab_parallel.DeviceGroup([0, 0]))
    hidden = _hidden(4, 256, seed=2)
    assert heads.takes(_batch(_head(1000, 256), hidden, temperature=1.0))
    assert not heads.takes(_batch(_head(100, 256), hidden, temperature=1.0))  # one tile, two devices
    whole = _head(1000, 256)
    storage = torch.zeros(whole.weight.numel() + 8, dtype=torch.bfloat16, device="cuda")
    odd = storage[1:1 + whole.weight.numel()].view_as(whole.weight)  # 2 bytes past a 16-byte boundary
    odd.copy_(whole.weight)
    assert odd.data_ptr() % 16 == 2
    assert not heads.takes(_batch(dataclasses.replace(whole, weight=odd), hidden, temperature=1.0))


def test_a_second_stage_past_shared_memory_takes_the_logits_path():
    """Eight shards of V = 64000 with filters: each shard has 62 tiles, so stage 1 runs the register ring (64
    candidates a CTA) and stage 2 would stage 8 x 62 x 64 keys, past an H200's shared memory. The whole request
    then takes the logits path, with the tokens of CudaBackend on the whole head's logits; four shards still take
    the fused path."""
    _, cuda_vocab_parallel, CudaBackend = _modules()
    head = _head(64000, 256, seed=7)
    backend = CudaBackend(0)
    batch = _batch(head, _hidden(8, 256, seed=6), temperature=1.0, top_k=40, top_p=0.9)
    eight = cuda_vocab_parallel.VocabParallelHead(head, cuda_vocab_parallel.DeviceGroup([0] * 8))
    four = cuda_vocab_parallel.VocabParallelHead(head, cuda_vocab_parallel.DeviceGroup([0] * 4))
    assert not eight._fused_takes(8, 256, True) and four._fused_takes(8, 256, True)
    whole_requests = []

    def logits_path(rows):
        whole_requests.append(rows.num_rows)
        return backend.sample(rows)

    got = eight.sample(batch, logits_path)
    assert whole_requests == [8]
    whole_logits = dataclasses.replace(batch, logits=head.logits(batch.hidden.states), hidden=None)
    assert torch.equal(got.tokens, backend.sample(whole_logits).tokens)


def test_a_device_still_busy_after_a_failure_takes_no_call():
    """check_idle, which guards the rebuild after a failed call: NcclError while a device's stream still runs
    work (as a stalled kernel would), none once it has finished."""
    _, cuda_vocab_parallel, _ = _modules()
    from tokensampler_server.backends.nccl import NcclError

    group = cuda_vocab_parallel.DeviceGroup([0, 0])
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles on the current stream
    with pytest.raises(NcclError, match=r"GPUs \[0\] have not finished"):
        group.check_idle()
    torch.cuda.synchronize()
    group.check_idle()


def test_a_group_that_fails_to_connect_aborts_its_communicators(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    from tokensampler_server.backends import nccl

    aborted = []
    real_abort = nccl.NcclGroup.abort

    def connect(self, timeout_s):
        raise RuntimeError("CUDA error: out of memory")

    def abort(self):
        aborted.append(list(self._comms or ()))
        real_abort(self)

    monkeypatch.setattr(nccl.NcclGroup, "_connect", connect)
    monkeypatch.setattr(nccl.NcclGroup, "abort", abort)
    with pytest.raises(RuntimeError, match="out of memory"):
        nccl.NcclGroup([0, 1])
    assert len(aborted) == 1 and len(aborted[0]) == 2
