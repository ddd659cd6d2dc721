"""One seed value is the seed of every row (v1's meaning, which stored seeds rely on), and every place a user
reads about `seed` says that the rows' tokens are then correlated."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import tokensampler_client.params
from tokensampler_client import AsyncSamplerClient, SamplerClient, cli
from tokensampler_client.params import build_sample_request
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.validation.sample import validate_sample_request

ROOT = Path(__file__).resolve().parent.parent
ROWS, VOCAB = 16, 1000


def _tokens(seed: object) -> tuple[list[int], list[int]]:
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)).expand(ROWS, VOCAB)  # identical rows
    batch, seeds = validate_sample_request(build_sample_request(logits, seed=seed), Limits())
    return CpuBackend().sample(batch).tokens[:, 0].tolist(), seeds.tolist()


def test_a_scalar_seed_is_every_rows_seed_so_identical_rows_get_one_token() -> None:
    tokens, seeds = _tokens(7)
    assert seeds == [7] * ROWS and len(set(tokens)) == 1
    independent, _ = _tokens(list(range(ROWS)))
    assert len(set(independent)) > 1  # one seed per row: the rows draw their own noise


def _flat(text: str | None) -> str:
    return " ".join((text or "").split())


def test_the_shared_seed_is_documented_where_seed_is() -> None:
    places = {
        "SamplerClient.sample": SamplerClient.sample.__doc__,
        "AsyncSamplerClient.sample": AsyncSamplerClient.sample.__doc__,
        "params module": tokensampler_client.params.__doc__,
        "docs/semantics.md": (ROOT / "docs/semantics.md").read_text(),
    }
    for place, text in places.items():
        assert re.search(r"seed.{0,120}every row.{0,200}correlated", _flat(text)), place


def test_cli_seed_help_says_rows_are_correlated(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["sample", "--help"])
    help_text = _flat(capsys.readouterr().out)
    seed_help = help_text[help_text.rindex("--seed SEED"):help_text.rindex("--num-samples")]  # past the usage
    assert "every row" in seed_help and "correlated" in seed_help
