"""The `tokensampler` command line: its JSON output and its help."""

from __future__ import annotations

import argparse
import json
from typing import Any

import pytest
import torch
from tokensampler_client import SampleResult, cli
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.tensors import encode_tensor

DRAWN_SEEDS = [2**64 - 1, 2**63 + 1, 2**53 + 1]  # seeds a server draws: any uint64


class _DrawingClient:
    """Stands in for SamplerClient: answers each row with token 0 and a seed it drew."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __enter__(self) -> _DrawingClient:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def sample(self, logits: torch.Tensor, **params: Any) -> SampleResult:
        rows = logits.shape[0]
        return SampleResult.from_response(pb.SampleResponse(
            tokens=encode_tensor(torch.zeros(rows, 1, dtype=torch.int64)), seeds=DRAWN_SEEDS[:rows],
            valid=[True] * rows, nan_detected=[False] * rows, timings=pb.Timings(), request_id="r"))


def test_json_seeds_are_strings_that_survive_a_double_parser(monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(cli, "SamplerClient", _DrawingClient)
    assert cli.main(["sample", "--random-logits", f"{len(DRAWN_SEEDS)}x8", "--json"]) == 0
    out = capsys.readouterr().out
    # Read as JavaScript and jq read JSON: every number a double.
    as_doubles = json.loads(out, parse_int=float)
    assert [int(seed) for seed in as_doubles["seeds"]] == DRAWN_SEEDS
    assert json.loads(out)["seeds"] == [str(seed) for seed in DRAWN_SEEDS]


def test_json_help_says_seeds_are_strings(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["sample", "--help"])
    assert "seeds are decimal strings" in " ".join(capsys.readouterr().out.split())



def _subcommands() -> tuple[dict[str, argparse.ArgumentParser], dict[str, str | None]]:
    """Each subcommand's parser, and the help line the overview shows for it."""
    (commands,) = [action for action in cli._parser()._actions if isinstance(action, argparse._SubParsersAction)]
    return dict(commands.choices), {action.dest: action.help for action in commands._choices_actions}


def test_every_subcommand_has_a_help_line_and_a_description(capsys: pytest.CaptureFixture[str]) -> None:
    parsers, help_lines = _subcommands()
    assert {"sample", "info", "health"} <= set(parsers) and set(help_lines) == set(parsers)
    for name, parser in parsers.items():
        assert help_lines[name] and parser.description, name
        with pytest.raises(SystemExit):
            cli.main([name, "--help"])
        assert " ".join(parser.description.split()) in " ".join(capsys.readouterr().out.split()), name
