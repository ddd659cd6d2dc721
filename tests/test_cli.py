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


def test_json_writes_non_finite_numbers_as_strings(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """-inf log-probs (outside the kept set) and NaN (an invalid row) are not JSON numbers: strict readers
    (JavaScript's JSON.parse) refuse them, and jq reads -inf as -1.797e308."""

    class NonFinite(_DrawingClient):
        def sample(self, logits: torch.Tensor, **params: Any) -> SampleResult:
            return SampleResult.from_response(pb.SampleResponse(
                tokens=encode_tensor(torch.tensor([[0], [-1]], dtype=torch.int32)), seeds=[1, 2], valid=[True, False],
                nan_detected=[False, True], logprobs=encode_tensor(torch.tensor([[float("-inf")], [float("nan")]])),
                timings=pb.Timings(), request_id="r"))

    monkeypatch.setattr(cli, "SamplerClient", NonFinite)
    assert cli.main(["sample", "--random-logits", "2x8", "--logprobs", "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"non-JSON number {name}"))
    assert out["logprobs"] == [["-Infinity"], ["NaN"]]
    assert [float(x) for x in out["logprobs"][0]] == [float("-inf")]


@pytest.mark.parametrize("argv, words", [
    (["--timeout", "0", "health"], "expected a finite number of seconds > 0"),
    (["--timeout", "inf", "health"], "expected a finite number of seconds > 0"),
    (["--timeout", "abc", "health"], "invalid seconds value"),
    (["--auth-token-file", "/nonexistent/token", "health"], "--auth-token-file: cannot read"),
    (["sample", "--random-logits", "1x8", "--seed", "x1"], "invalid seed value"),
    (["sample", "--random-logits", "1x8", "--logits-seed", str(2**64)], "--logits-seed"),
])
def test_bad_flag_values_are_usage_errors(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2 and words in capsys.readouterr().err


def test_a_file_a_flag_names_that_cannot_be_used_is_one_line_and_status_2(
        monkeypatch: pytest.MonkeyPatch, tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import numpy as np

    monkeypatch.setattr(cli, "SamplerClient", _DrawingClient)
    empty = tmp_path / "token"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--auth-token-file", str(empty), "health"])
    assert exited.value.code == 2 and "is empty" in capsys.readouterr().err
    monkeypatch.undo()  # the real client: it checks the mask before any call (none is made: no server there)
    np.save(tmp_path / "mask.npy", np.zeros((3, 1), dtype=np.int32))  # 3 rows for 2
    binary = tmp_path / "binary-token"
    binary.write_bytes(b"\xff\xfe\x00token")
    with pytest.raises(SystemExit) as exited:
        cli.main(["--auth-token-file", str(binary), "health"])
    assert exited.value.code == 2 and "not UTF-8" in capsys.readouterr().err
    (tmp_path / "text.npy").write_text("not an array\n")
    (tmp_path / "empty.npy").write_bytes(b"")
    np.save(tmp_path / "int64.npy", np.zeros((2, 1), dtype=np.int64))
    np.savez(tmp_path / "archive.npz", mask=np.zeros((2, 1), dtype=np.int32))
    for mask, words in ((tmp_path / "text.npy", "not a .npy array file"), (tmp_path / "empty.npy", "not a .npy array"),
                        (tmp_path / "int64.npy", "expected int32"), (tmp_path / "archive.npz", "an archive")):
        argv = ["--target", "127.0.0.1:1", "sample", "--random-logits", "2x8", "--token-bitmask", str(mask)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--token-bitmask: {mask}" in err and words in err and "pickle" not in err, err
    for command, shape in (("sample", "100000000x100000000"), ("sample", "1x99999999999999999999"),
                           ("score", "1x1x99999999999999999999")):  # the last two: past int64
        assert cli.main(["--target", "127.0.0.1:1", command, "--random-logits", shape]) == 2
        err = capsys.readouterr().err
        assert "--random-logits" in err and len(err.strip().splitlines()) == 1, err
    for mask in (tmp_path / "absent.npy", tmp_path / "mask.npy"):
        argv = ["--target", "127.0.0.1:1", "sample", "--random-logits", "2x8", "--token-bitmask", str(mask)]
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("tokensampler: error:") and len(err.strip().splitlines()) == 1, err
