"""Hidden-state input end to end: weights registered by upload or from a file, then sampled by name."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from scipy import stats
from tokensampler_client import SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb

from .conftest import RunningServer, assert_unregister_waits, connected, serving
from .gated_server import GATE_SEED, ServerGate

ALPHA = 1e-3


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("weights")
    save_file({"lm_head.weight": torch.randn(300, 64, generator=torch.Generator().manual_seed(9)).bfloat16()},
              root / "model.safetensors")
    os.symlink(root / "model.safetensors", root / "link.safetensors")
    os.mkfifo(root / "pipe.safetensors")  # opening it for reading would wait for a writer
    return root


@pytest.fixture(scope="module")
def weights_server(weights_dir: Path):
    yield from serving("--device", "cpu", "--weights-dir", str(weights_dir), "--uds", str(weights_dir / "ts.sock"),
                       gate=ServerGate())


@pytest.fixture(scope="module")
def client(weights_server: RunningServer):
    yield from connected(weights_server)


def test_upload_register_sample_and_unregister(client: SamplerClient) -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(1000, 96, generator=gen).half(), torch.randn(1000, generator=gen)
    progress: list[tuple[int, int]] = []
    info = client.register_weights(
        "head-a", weight, vocab_size=990, bias=bias, soft_cap=20.0, logit_scale=0.5,
        chunk_bytes=50_000, progress=lambda sent, total: progress.append((sent, total)),
    )
    assert (info.vocab_size, info.padded_vocab_size, info.hidden_size) == (990, 1000, 96)
    assert (info.dtype, info.bytes, info.region) == (pb.DTYPE_FLOAT16, weight.numel() * 2, "")
    assert info.sha256 == hashlib.sha256(weight.numpy().tobytes()).hexdigest()
    assert progress[-1] == (weight.numel() * 2, weight.numel() * 2) and len(progress) == 4
    assert [w.name for w in client.list_weights()] == ["head-a"]
    assert client.server_info().registered_weights_bytes == weight.numel() * 2

    hidden = torch.randn(64, 96, generator=gen)
    logits = 20.0 * torch.tanh(((hidden @ weight.float().T + bias) * 0.5) / 20.0)
    params = dict(top_k=50, top_p=0.9, seed=list(range(64)), return_logprobs=True)
    from_hidden = client.sample_hidden(hidden, "head-a", **params)
    from_logits = client.sample(logits[:, :990], **params)
    agreement = (from_hidden.tokens == from_logits.tokens).float().mean().item()
    assert agreement >= 0.999, agreement
    assert (from_hidden.tokens < 990).all()  # padded rows are never sampled
    greedy = client.sample_hidden(hidden, "head-a", temperature=0.0)
    assert torch.equal(greedy.tokens[:, 0], logits[:, :990].argmax(dim=1))

    assert client.unregister_weights("head-a").name == "head-a"
    with pytest.raises(TokenSamplerError) as raised:
        client.sample_hidden(hidden, "head-a")
    assert raised.value.code == grpc.StatusCode.NOT_FOUND and "hidden.weights" in raised.value.details


def _every_parameter(rows: int, vocab: int, gen: torch.Generator) -> dict:
    """Per-row sampling parameters touching every step of the semantics: greedy rows (every eighth), temperature,
    top-k, top-p, min-p, penalties over a history, logit bias, banned tokens, processed log-probs and top log-probs."""
    row = torch.arange(rows)
    return dict(
        temperature=torch.where(row % 8 == 0, 0.0, 0.5 + (row % 5).float() / 4).tolist(),
        top_k=[(0, 20, 100)[i % 3] for i in range(rows)],
        top_p=[(1.0, 0.9, 0.5)[i % 3] for i in range(rows)],
        min_p=[(0.0, 0.05)[i % 2] for i in range(rows)],
        repetition_penalty=[(1.0, 1.3)[i % 2] for i in range(rows)],
        presence_penalty=[(0.0, 0.5)[i % 2] for i in range(rows)],
        frequency_penalty=[(0.0, 0.2)[i % 2] for i in range(rows)],
        output_token_ids=[torch.randint(0, vocab, (i % 6,), generator=gen).tolist() for i in range(rows)],
        logit_bias=[{int(torch.randint(0, vocab, (), generator=gen)): 3.0} for _ in range(rows)],
        banned_token_ids=[[i % vocab] for i in range(rows)],
        num_samples=8, return_logprobs=True, logprobs_mode="processed", top_logprobs=5,
    )


@pytest.mark.parametrize("states_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_parameter_from_hidden_states_matches_the_same_request_as_logits(
    client: SamplerClient, states_dtype: torch.dtype
) -> None:
    """The same requests as hidden states and as their logits W·h (fp32): >= 99.9 % of 4096 tokens identical,
    the greedy rows' tokens all identical, and equal tokens' log-probs equal to fp32 rounding."""
    rows, vocab, padded, dim = 128, 2000, 2048, 128
    gen = torch.Generator().manual_seed(11)
    weight, bias = (torch.randn(padded, dim, generator=gen) / dim**0.5).bfloat16(), torch.randn(padded, generator=gen)
    client.register_weights("every-param", weight, vocab_size=vocab, bias=bias)
    try:
        hidden = (torch.randn(rows, dim, generator=gen) * 2).to(states_dtype)
        logits = (hidden.float() @ weight.float().T + bias)[:, :vocab]
        params = _every_parameter(rows, vocab, gen)
        same = total = 0
        for attempt in range(4):
            seeds = [attempt * rows + i for i in range(rows)]
            from_hidden = client.sample_hidden(hidden, "every-param", seed=seeds, **params)
            from_logits = client.sample(logits, seed=seeds, **params)
            equal = from_hidden.tokens == from_logits.tokens
            same, total = same + int(equal.sum()), total + equal.numel()
            greedy = torch.tensor(params["temperature"]) == 0
            assert torch.equal(from_hidden.tokens[greedy], from_logits.tokens[greedy])
            assert torch.allclose(from_hidden.logprobs[equal], from_logits.logprobs[equal], atol=1e-4)
            assert torch.equal(from_hidden.top_logprob_ids[greedy], from_logits.top_logprob_ids[greedy])
        assert total == 4096 and same / total >= 0.999, (same, total)
    finally:
        client.unregister_weights("every-param")


@pytest.mark.parametrize("vocab_size", [100, 256, 512])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_distribution_through_an_identity_head(client: SamplerClient, vocab_size: int, rows: int) -> None:
    """W = [I | 0] makes the logits exactly the first V hidden values: chi-square against softmax."""
    name = f"identity-{vocab_size}-{rows}"
    client.register_weights(name, torch.eye(vocab_size, vocab_size + 8))
    gen = torch.Generator().manual_seed(vocab_size * 10 + rows)
    targets = torch.randn(rows, vocab_size, generator=gen) * 2
    draws = 3000
    hidden = torch.cat([targets, torch.randn(rows, 8, generator=gen)], dim=1).repeat_interleave(draws, dim=0)
    for params in (dict(temperature=0.9), dict(temperature=1.0, top_k=40, top_p=0.9)):
        tokens = torch.cat([  # in requests of at most 4096 rows, the server's default limit
            client.sample_hidden(hidden[start : start + 4096], name, seed=list(range(start, start + 4096))[: len(hidden) - start],
                                 **params).tokens[:, 0]
            for start in range(0, len(hidden), 4096)
        ])
        for row in range(rows):
            probs = torch.softmax(targets[row].double() / params["temperature"], dim=0).numpy()
            if "top_k" in params:
                order = np.argsort(-probs, kind="stable")[:40]
                kept = order[: int(np.searchsorted(np.cumsum(probs[order]) / probs[order].sum(), 0.9)) + 1]
                mask = np.zeros_like(probs, dtype=bool)
                mask[kept] = True
                probs = np.where(mask, probs, 0) / probs[mask].sum()
            counts = np.bincount(tokens[row * draws : (row + 1) * draws].numpy(), minlength=vocab_size)
            assert counts[probs == 0].sum() == 0
            expected = probs * draws
            # Pool the tokens expected fewer than 5 times into one bin, as chi-square needs.
            small = (expected < 5) & (probs > 0)
            observed = np.append(counts[~small & (probs > 0)], counts[small].sum())
            expected = np.append(expected[~small & (probs > 0)], expected[small].sum())
            if expected[-1] == 0:
                observed, expected = observed[:-1], expected[:-1]
            assert stats.chisquare(observed, expected).pvalue >= ALPHA, (params, row)
    client.unregister_weights(name)


def test_register_from_file_inside_weights_dir(client: SamplerClient) -> None:
    info = client.register_weights_from_file("from-file", "model.safetensors", "lm_head.weight", vocab_size=290)
    assert (info.vocab_size, info.padded_vocab_size, info.hidden_size) == (290, 300, 64)
    result = client.sample_hidden(torch.randn(3, 64), "from-file", seed=1)
    assert ((result.tokens >= 0) & (result.tokens < 290)).all()
    client.unregister_weights("from-file")


def test_a_weight_file_rewritten_after_registration_changes_nothing(client: SamplerClient, weights_dir: Path) -> None:
    """The registered head is the server's copy: a file truncated or rewritten in place afterwards (its pages
    mapped by safetensors) neither kills the server (SIGBUS) nor changes the tokens."""
    from safetensors.torch import save_file

    path = weights_dir / "rewritten.safetensors"
    save_file({"lm_head.weight": torch.randn(300, 64, generator=torch.Generator().manual_seed(3))}, str(path))
    info = client.register_weights_from_file("rewritten", path.name, "lm_head.weight")
    hidden = torch.randn(4, 64, generator=torch.Generator().manual_seed(4))
    before = client.sample_hidden(hidden, "rewritten", seed=[1, 2, 3, 4], return_logprobs=True)
    os.truncate(path, 0)
    after_truncation = client.sample_hidden(hidden, "rewritten", seed=[1, 2, 3, 4], return_logprobs=True)
    save_file({"lm_head.weight": torch.full((300, 64), float("nan"))}, str(path))
    after_rewrite = client.sample_hidden(hidden, "rewritten", seed=[1, 2, 3, 4], return_logprobs=True)
    for after in (after_truncation, after_rewrite):
        assert torch.equal(after.tokens, before.tokens) and torch.equal(after.logprobs, before.logprobs)
    assert client.list_weights()[[w.name for w in client.list_weights()].index("rewritten")].sha256 == info.sha256
    client.unregister_weights("rewritten")


@pytest.mark.parametrize(
    "path, code",
    [
        ("../model.safetensors", grpc.StatusCode.PERMISSION_DENIED),
        ("/etc/passwd", grpc.StatusCode.PERMISSION_DENIED),
        ("link.safetensors", grpc.StatusCode.PERMISSION_DENIED),
        ("absent.safetensors", grpc.StatusCode.NOT_FOUND),
        ("pipe.safetensors", grpc.StatusCode.NOT_FOUND),
    ],
)
def test_files_outside_weights_dir_are_refused(client: SamplerClient, path: str, code: grpc.StatusCode) -> None:
    """Refused at once, and the server serves on (a FIFO's open used to freeze the process)."""
    with pytest.raises(TokenSamplerError) as raised:
        client.register_weights_from_file("bad", path, timeout=10)
    assert raised.value.code == code
    assert client.health() == "SERVING"


def test_registry_errors(client: SamplerClient) -> None:
    client.register_weights("dup", torch.randn(10, 4))
    cases = [
        (lambda: client.register_weights("dup", torch.randn(10, 4)), grpc.StatusCode.ALREADY_EXISTS, "name"),
        (lambda: client.sample_hidden(torch.randn(2, 5), "dup"), grpc.StatusCode.INVALID_ARGUMENT, "hidden.states.shape"),
        (lambda: client.sample_hidden(torch.randn(2, 4), "nope"), grpc.StatusCode.NOT_FOUND, "hidden.weights"),
        (lambda: client.register_weights("capped", torch.randn(10, 4), soft_cap=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "options.soft_cap"),
        (lambda: client.unregister_weights("nope"), grpc.StatusCode.NOT_FOUND, "name"),
        (lambda: client.sample_hidden(torch.randn(2, 4), "dup", banned_token_ids=[10]), grpc.StatusCode.INVALID_ARGUMENT,
         "params.banned_token_ids.ids"),
    ]
    for call, code, field in cases:
        with pytest.raises(TokenSamplerError) as raised:
            call()
        assert raised.value.code == code and raised.value.details.startswith(f"{field}:"), raised.value
    assert "capped" not in [w.name for w in client.list_weights()]
    client.unregister_weights("dup")


def test_weights_from_file_are_off_without_weights_dir(server: RunningServer) -> None:
    with SamplerClient(server.target, timeout=30) as plain:
        with pytest.raises(TokenSamplerError) as raised:
            plain.register_weights_from_file("x", "model.safetensors")
    assert raised.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_unregister_waits_for_requests_in_flight(weights_server: RunningServer, client: SamplerClient) -> None:
    client.register_weights("busy", torch.randn(1000, 16))
    assert weights_server.gate is not None
    assert_unregister_waits(
        weights_server.gate, lambda: client.sample_hidden(torch.randn(48, 16), "busy", top_p=0.9, seed=GATE_SEED),
        client.list_weights, lambda: client.unregister_weights("busy"), "weight",
    )


def test_unix_domain_socket(weights_dir: Path, weights_server: RunningServer) -> None:
    with SamplerClient(f"unix://{weights_dir / 'ts.sock'}", timeout=30) as over_uds:
        assert over_uds.health() == "SERVING"
        assert over_uds.sample(torch.zeros(2, 8), seed=1).tokens.shape == (2, 1)
