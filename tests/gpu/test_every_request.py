"""Every valid request on the GPU, exact: any k in [1, V] (alone, with top-p and min-p, per row within one batch),
every input dtype, vocabularies from 111 to 262144, logits and hidden states.

The factors are covered pairwise (every pair of values of any two factors meets in some case), not as the full
product, so that the sweep fits the GPU suite's time. Each case agrees with the CPU reference token for token,
except where the reference itself sits on a rounding edge (agreement.py), and none of it leaves the GPU.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tokensampler_client import SamplerClient
from tokensampler_server.backends.cpu import CpuBackend, kept_token_mask
from tokensampler_server.model.sampling import HiddenInput, SamplingBatch
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from ..batches import make_batch
from ..conftest import RunningServer, serving
from ..test_metrics import metrics_port, parse_samples, scrape_text
from .agreement import assert_tokens_agree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

ROWS, SAMPLES, DIM = 6, 2, 64
ALPHA = 0.001  # significance of the chi-square tests (fixed seeds: the outcome is deterministic)

FACTORS: dict[str, list] = {
    "vocab": [111, 32000, 128256, 151936, 262144],
    "k": ["256", "1000", "4096", "half", "v-1", "v", "per-row"],
    "p": [1.0, 0.1, 0.5, 0.99],
    "min_p": [0.0, 0.05],
    "dtype": [torch.float32, torch.bfloat16, torch.float16],
    "input": ["logits", "hidden"],
}


def pairwise_cases(factors: dict[str, list]) -> list[dict]:
    """A small list of cases in which every pair of values of two factors appears (greedy, deterministic)."""
    names = list(factors)
    uncovered = {(a, va, b, vb) for a, b in itertools.combinations(names, 2)
                 for va, vb in itertools.product(range(len(factors[a])), range(len(factors[b])))}
    cases = []
    while uncovered:
        first = next(iter(sorted(uncovered, key=repr)))
        case = {first[0]: first[1], first[2]: first[3]}
        for name in names:
            if name in case:
                continue
            case[name] = max(range(len(factors[name])), key=lambda v: sum(
                ((a, case[a], name, v) in uncovered) if names.index(a) < names.index(name)
                else ((name, v, a, case[a]) in uncovered) for a in case))
        uncovered -= {(a, case[a], b, case[b]) for a, b in itertools.combinations(names, 2)}
        cases.append({name: factors[name][case[name]] for name in names})
    return cases


CASES = pairwise_cases(FACTORS)


def _top_k(k: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    if k == "per-row":
        return torch.randint(1, vocab + 1, (ROWS,), generator=gen, dtype=torch.int32)
    value = {"half": vocab // 2, "v-1": vocab - 1, "v": vocab}.get(k) or int(k)
    return torch.full((ROWS,), max(1, value), dtype=torch.int32)


def _case_batch(case: dict, seed: int) -> tuple[SamplingBatch, torch.Tensor]:
    """The case's batch (hidden states through a registered head, or logits on the GPU) and the fp32 logits the
    CPU reference samples from (the GPU's own W·h for hidden states: the kernels must agree on the same x)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = case["vocab"]
    params = dict(temperature=0.8, top_k=_top_k(case["k"], vocab, gen), top_p=case["p"], min_p=case["min_p"],
                  seed=torch.arange(ROWS) * 7919 + seed, position=torch.arange(ROWS), iteration=2,
                  num_samples=SAMPLES)
    if case["input"] == "hidden":
        dtype = torch.float16 if case["dtype"] == torch.float16 else torch.bfloat16
        weight = (torch.randn(vocab, DIM, generator=gen) / DIM ** 0.5).to(dtype).cuda()
        head = RegisteredWeight(name="w", weight=weight, finish=LogitsFinish(vocab_size=vocab), sha256="")
        hidden = (torch.randn(ROWS, DIM, generator=gen) * 4).to(dtype)
        batch = make_batch(torch.empty(ROWS, 0), **params)
        batch = dataclasses.replace(batch, logits=None, hidden=HiddenInput(hidden, head))
        return batch, head.logits(hidden.cuda()).float().cpu()
    x = (torch.randn(ROWS, vocab, generator=gen) * 2).to(case["dtype"])
    return make_batch(x.cuda(), **params), x.float()


@pytest.mark.parametrize("case", CASES, ids=[
    f"V{c['vocab']}-k{c['k']}-p{c['p']}-m{c['min_p']}-{str(c['dtype'])[6:]}-{c['input']}" for c in CASES])
def test_pairwise_case_agrees_with_the_reference_on_the_gpu(cuda_backend, case: dict) -> None:
    batch, x = _case_batch(case, seed=len(CASES))
    got = cuda_backend.sample(batch)
    reference_batch = dataclasses.replace(batch, logits=x, hidden=None)
    want = CpuBackend().sample(reference_batch)
    assert torch.equal(got.valid, want.valid)
    assert_tokens_agree(x, reference_batch, got, want, rounding=1e-3 if case["input"] == "hidden" else 1e-5)


@pytest.mark.parametrize("fill", ["equal", "outlier"])
@pytest.mark.parametrize("params", [{"top_k": 1000}, {"top_k": 5000, "top_p": 0.5}, {"top_p": 0.3},
                                    {"top_k": 70000, "top_p": 0.9, "min_p": 1e-6}])
def test_crowded_bins_are_cut_on_the_gpu(cuda_backend, fill: str, params: dict) -> None:
    """Rows whose tokens crowd into a few bins: all logits equal (ids decide), or a far outlier (-1e9, as an engine
    masking with a finite value writes) that squeezes the other tokens into bin 0. Radix passes find each cut."""
    vocab = 151936
    gen = torch.Generator().manual_seed(5)
    if fill == "equal":
        x = torch.zeros(4, vocab)
    else:
        x = torch.randn(4, vocab, generator=gen)
        x[:, :1000] = -1e9
    batch = make_batch(x.cuda(), temperature=1.0, seed=[1, 2, 3, 4], num_samples=3, **params)
    got = cuda_backend.sample(batch)
    want = CpuBackend().sample(dataclasses.replace(batch, logits=x))
    assert_tokens_agree(x, batch, got, want)


@pytest.mark.parametrize("params", [{"top_k": 300}, {"top_k": 700, "top_p": 0.6}, {"top_k": 400, "min_p": 0.2}])
def test_large_k_follows_the_exact_distribution(cuda_backend, params: dict) -> None:
    """Chi-square over 20000 draws at V = 1000 (k above the largest top-k bucket): no draw outside the kept set,
    then the counts against softmax over it."""
    vocab, draws = 1000, 20000
    gen = torch.Generator().manual_seed(9)
    row = torch.randn(vocab, generator=gen) * 0.5
    x = row.expand(draws // 50, vocab).contiguous()
    batch = make_batch(x.cuda(), seed=torch.arange(draws // 50), num_samples=50, **params)
    got = cuda_backend.sample(batch)
    assert bool(got.valid.all())
    kept = kept_token_mask((row - row.max()).unsqueeze(0), torch.tensor([params["top_k"]]),
                           torch.tensor([params.get("top_p", 1.0)]), torch.tensor([params.get("min_p", 0.0)]))[0]
    counts = torch.bincount(got.tokens.flatten(), minlength=vocab)
    assert int(counts[~kept].sum()) == 0, "draws outside the kept set"
    probs = torch.softmax(row.double().masked_fill(~kept, float("-inf")), dim=0)[kept]
    assert chisquare(counts[kept].double().numpy(), (probs * draws).numpy()).pvalue > ALPHA


@pytest.mark.exact_rows
def test_ties_at_the_top_k_cut_stay_on_the_gpu(cuda_backend) -> None:
    """Logits within 1e-5 of each other far below their row's max: x - max rounds them all to one z, so ids order
    the top k, and the tie runs past the top-k kernel's candidates: the rows go to the exact filter (on the GPU,
    through its crowded-bin passes, which then cut by id), and the tokens are the reference's."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(16, 32000, generator=gen) * 1e-5
    x[:, 7] = 1000.0
    batch = make_batch(x.cuda(), temperature=500.0, top_k=100, top_p=0.9, seed=torch.arange(16), num_samples=4)
    before = cuda_backend.fallbacks()
    got = cuda_backend.sample(batch)
    assert cuda_backend.fallbacks()["exact_rows"] == before["exact_rows"] + 16, "the rows did not take the exact filter"
    reference = dataclasses.replace(batch, logits=x)
    want = CpuBackend().sample(reference)
    assert_tokens_agree(x, reference, got, want)


@pytest.fixture(scope="module")
def cuda_server():
    yield from serving("--device", "cuda", timeout=300)


def _fallbacks(server: RunningServer) -> float:
    """The server's fallbacks of every reason (the slower paths; none of them leaves the GPU)."""
    samples = parse_samples(scrape_text(metrics_port(server)))
    return sum(v for (name, _), v in samples.items() if name == "tokensampler_fallbacks_total")


def test_unusual_parameters_through_the_server_stay_on_their_routes(cuda_server: RunningServer) -> None:
    """A sweep of unusual-but-valid requests through the CUDA server: the fallback counter does not move."""
    gen = torch.Generator().manual_seed(1)
    before = _fallbacks(cuda_server)
    with SamplerClient(cuda_server.target, timeout=300) as client:
        for vocab, dtype in ((32000, torch.float16), (128256, torch.float32), (111, torch.bfloat16)):
            x = torch.randn(19, vocab, generator=gen).to(dtype)
            for params in ({"top_k": vocab - 1, "top_p": 0.5}, {"top_k": vocab // 2, "min_p": 0.01},
                           {"top_k": torch.randint(1, vocab + 1, (19,), generator=gen).tolist(), "top_p": 0.9},
                           {"top_k": 3200 % vocab + 1, "top_p": 0.1, "num_samples": 8}):
                result = client.sample(x, seed=list(range(19)), **params)
                assert bool(result.valid.all())
    assert _fallbacks(cuda_server) == before


def test_min_p_one_keeps_the_tied_maximum_on_the_gpu(cuda_backend, cuda_server: RunningServer) -> None:
    """min_p = 1 keeps exactly the tokens tied at the row's maximum: on the backend the reference's tokens, through
    the server (whose request decoder checks the range too) only tied ids, as often each (chi-square), no fallback."""
    gen = torch.Generator().manual_seed(5)
    vocab, tied = 128256, [5, 17, 128255]
    x = torch.randn(19, vocab, generator=gen)
    x[:, tied] = 10.0
    x[:, 6] = float(np.nextafter(np.float32(10.0), np.float32(0.0)))  # one ulp below: dropped
    batch = make_batch(x.cuda(), temperature=1.0, min_p=1.0, seed=torch.arange(19), num_samples=4)
    reference = dataclasses.replace(batch, logits=x)
    assert torch.equal(cuda_backend.sample(batch).tokens.cpu(), CpuBackend().sample(reference).tokens)
    before = _fallbacks(cuda_server)
    with SamplerClient(cuda_server.target, timeout=300) as client:
        tokens = client.sample(x, seed=list(range(19)), min_p=1.0, num_samples=64).tokens.reshape(-1).numpy()
    assert set(tokens.tolist()) <= set(tied)
    counts = np.array([(tokens == t).sum() for t in tied])
    assert chisquare(counts).pvalue >= ALPHA, counts
    assert _fallbacks(cuda_server) == before
