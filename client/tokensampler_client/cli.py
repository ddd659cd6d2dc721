"""`tokensampler`: a command-line client for a quick manual call to a running server.

    tokensampler sample --random-logits 4x32000 --top-k 50
    tokensampler info
    tokensampler health

Exit status: 0 on success, 1 when the call fails (one line with the gRPC code and details on
stderr) or `health` is not SERVING, 2 for a usage error (a bad flag, or a file or value a flag names).
`--json` writes non-finite numbers as the strings "NaN", "Infinity" and "-Infinity" (JSON has no such
numbers), and uint64 seeds as strings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from google.protobuf import json_format

from . import __version__
from ._proto import sampler_pb2 as pb
from ._torch import require_torch
from .client import SamplerClient
from .errors import TokenSamplerError
from .result import SampleResult

DEFAULT_TARGET = "localhost:50051"
DTYPES = ("float32", "bfloat16", "float16")


def _shape(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)[xX](\d+)", text)
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise argparse.ArgumentTypeError(f"expected BxV with B, V >= 1 (e.g. 4x32000), got {text!r}")
    return int(match[1]), int(match[2])


def _shape3(text: str) -> tuple[int, int, int]:
    match = re.fullmatch(r"(\d+)[xX](\d+)[xX](\d+)", text)
    if not match or 0 in (sizes := tuple(int(g) for g in match.groups())):
        raise argparse.ArgumentTypeError(f"expected BxTxV with sizes >= 1, e.g. 2x16x32000, got {text!r}")
    return sizes


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text}")
        return value

    parse.__name__ = "int"  # argparse names the type in its message for text that is no integer
    return parse


_non_negative = _int_at_least(0)
_positive = _int_at_least(1)


def _seed(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        value = int(text, 10)  # decimal with leading zeros ("007"), which base 0 refuses
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"expected a uint64 seed, 0 <= seed < 2**64, got {text}")
    return value


_seed.__name__ = "seed"  # argparse names the type in its message for text that is no integer


def _ids(text: str) -> list[int]:
    """Comma-separated token ids, e.g. 13,11,2."""
    try:
        ids = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids (e.g. 13,11,2), got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id")
    return ids


def _add_local_samplers(sample: argparse.ArgumentParser) -> None:
    """The local samplers' flags (docs/semantics.md, "Local samplers"); each row gets the same values."""
    local = sample.add_argument_group("local samplers", "each off unless given (docs/semantics.md)")
    local.add_argument("--sequence", type=_ids, metavar="IDS", help="the tokens generated so far, oldest first "
                       "(output_token_ids: the penalties', DRY's and no-repeat-n-gram's history)")
    local.add_argument("--min-tokens", type=_non_negative, help="ban --stop-ids until this many tokens are generated")
    local.add_argument("--num-generated", type=_non_negative, help="tokens each row has generated so far (default 0)")
    local.add_argument("--stop-ids", type=_ids, metavar="IDS", help="ids that end generation (EOS included)")
    local.add_argument("--no-repeat-ngram-size", type=_non_negative, metavar="N", help="ban tokens that repeat an n-gram of --sequence")
    local.add_argument("--dry-multiplier", type=float, help="DRY's multiplier (0 is off)")
    local.add_argument("--dry-base", type=float, help="DRY's base, >= 1 (server default 1.75)")
    local.add_argument("--dry-allowed-length", type=_positive, help="repeats DRY allows unpenalised (server default 2)")
    local.add_argument("--dry-penalty-last-n", type=int, help="DRY's window of the last n tokens; -1 is all (the default)")
    local.add_argument("--dry-breaker", type=_ids, action="append", metavar="IDS",
                       help="a DRY sequence breaker as token ids; repeat the flag for more")
    local.add_argument("--typical-p", type=float, help="locally typical sampling, 0 < p <= 1; 1 disables")
    local.add_argument("--top-n-sigma", type=float, help="keep logits within n standard deviations of the max; <= 0 disables")
    local.add_argument("--xtc-threshold", type=float, help="XTC's threshold, 0 < t <= 1 (server default 0.1)")
    local.add_argument("--xtc-probability", type=float, help="XTC's probability, 0 <= q <= 1; 0 disables")


Run = Callable[[SamplerClient, argparse.Namespace], int]


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], run: Run, name: str, help: str, description: str
) -> argparse.ArgumentParser:
    """The parser of subcommand `name`, which `run` carries out."""
    command = commands.add_parser(name, help=help, description=description)
    command.set_defaults(run=run)
    return command


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokensampler",
        description="Command-line client of a tokensampler server.",
        epilog="Exit status: 0 on success, 1 when the call fails or health is not SERVING, 2 on a usage error.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument(
        "--target",
        default=os.environ.get("TOKENSAMPLER_TARGET", DEFAULT_TARGET),
        help="server address, host:port or unix:///path (default: $TOKENSAMPLER_TARGET or %(default)s)",
    )
    parser.add_argument("--timeout", type=_positive_seconds, default=30.0,
                        help="deadline of the call in seconds (default: %(default)s)")
    parser.add_argument(
        "--auth-token-file", type=Path, default=os.environ.get("TOKENSAMPLER_AUTH_TOKEN_FILE"),
        help="file whose first line is the bearer token to send (default: $TOKENSAMPLER_AUTH_TOKEN_FILE)",
    )
    parser.add_argument("--tls-ca", type=Path, help="PEM file of the CA that signed the server's certificate (turns TLS on)")
    parser.add_argument("--tls-cert", type=Path, help="PEM client certificate, for servers that require mutual TLS")
    parser.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sample = _command(commands, _run_sample, "sample", "sample tokens from random logits",
                      "Sample tokens from random logits and print them.")
    sample.add_argument("--random-logits", type=_shape, required=True, metavar="BxV", help="batch of B rows of V standard-normal logits, e.g. 4x32000")
    sample.add_argument("--dtype", choices=DTYPES, default="float32", help="logits dtype on the wire (default: %(default)s)")
    sample.add_argument("--logits-seed", type=_seed, default=0, help="seed of the random logits, so that runs are repeatable (default: %(default)s)")
    sample.add_argument("--temperature", type=float, help="T >= 0; 0 is greedy (server default 1)")
    sample.add_argument("--top-k", type=int, help="keep the k most likely tokens; 0 or -1 disables")
    sample.add_argument("--top-p", type=float, help="nucleus sampling, 0 < p <= 1; 1 disables")
    sample.add_argument("--min-p", type=float, help="keep tokens with probability >= m * max, 0 <= m <= 1")
    sample.add_argument("--seed", type=_seed,
                        help="Philox seed of every row: the rows then draw the same noise, so their tokens are "
                             "correlated (default: the server draws one seed per row)")
    sample.add_argument("--num-samples", type=_positive, help="samples per row (default 1)")
    sample.add_argument("--logprobs", action="store_true", help="also return the log-prob of each sampled token")
    sample.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw", help="distribution of the log-probs (default: %(default)s)")
    sample.add_argument("--top-logprobs", type=_non_negative, default=0, metavar="N", help="also return the N best (id, log-prob) pairs per row")
    sample.add_argument("--token-bitmask", type=Path, metavar="NPY",
                        help="structured output: a .npy file of int32 [B, ceil(V / 32)] packed allowed-token words "
                             "(bit i %% 32 of word i // 32 allows token i)")
    _add_local_samplers(sample)
    sample.add_argument("--json", action="store_true",
                        help="print the result as JSON; seeds are decimal strings, since JavaScript and jq read "
                             "JSON numbers as doubles and round a uint64 seed above 2^53, which then no longer "
                             "reproduces the sample")

    score = _command(commands, _run_score, "score", "score random tokens under random logits",
                     "Score random token ids under random logits (ScoreTokens) and print what the server answers.")
    score.add_argument("--random-logits", type=_shape3, required=True, metavar="BxTxV",
                       help="B rows of T positions of V standard-normal logits, e.g. 2x16x32000; the token ids are "
                            "uniform in [0, V)")
    score.add_argument("--logits-seed", type=_seed, default=0, help="seed of the random logits and ids (default: %(default)s)")
    score.add_argument("--mode", choices=("raw", "processed"), default="raw",
                       help="raw: log_softmax of the logits; processed: after temperature and filters (default: %(default)s)")
    score.add_argument("--temperature", type=float, help="T >= 0 (processed; server default 1)")
    score.add_argument("--top-k", type=int, help="top-k of the processed distribution; 0 or -1 disables")
    score.add_argument("--top-p", type=float, help="top-p of the processed distribution, 0 < p <= 1")
    score.add_argument("--min-p", type=float, help="min-p of the processed distribution, 0 <= m <= 1")
    score.add_argument("--top-logprobs", type=_non_negative, default=0, metavar="N", help="also return the N best log-probs per position")
    score.add_argument("--entropy", action="store_true", help="also return the entropy of each position")
    score.add_argument("--json", action="store_true", help="print the result as JSON")

    info = _command(commands, _run_info, "info", "print the server's version, backend, device, limits and features",
                    "Print what GetServerInfo answers: the server's version, backend and device, its limits, the "
                    "logits dtypes and features it serves, its compiled kernels.")
    info.add_argument("--json", action="store_true", help="print the ServerInfo as JSON")

    _command(commands, _run_health, "health", "print the server's grpc.health.v1 status",
             "Print the server's grpc.health.v1 status (SERVING, NOT_SERVING, ...); the exit status is 0 only for "
             "SERVING.")
    return parser


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"got {text}, expected a finite number of seconds > 0")
    return value


_positive_seconds.__name__ = "seconds"


def _random_logits(torch: Any, shape: tuple[int, ...], generator: Any) -> Any:
    """Standard-normal logits of `shape` drawn from `generator`; ValueError (status 2) when this machine cannot
    hold them."""
    try:
        return torch.randn(*shape, generator=generator)
    except (RuntimeError, MemoryError, TypeError):  # TypeError: a size past int64
        size = "x".join(map(str, shape))
        raise ValueError(f"--random-logits: {size} float32 logits take {4 * math.prod(shape)} bytes, more than "
                         "this machine can allocate") from None


def _token_bitmask(path: Path) -> np.ndarray:
    """The int32 words of a .npy file (never unpickled)."""
    try:
        words = np.load(path, allow_pickle=False)
    except (ValueError, EOFError):  # EOFError: an empty file
        raise ValueError(f"--token-bitmask: {path} is not a .npy array file (np.save's format)") from None
    if not isinstance(words, np.ndarray):  # an .npz archive
        raise ValueError(f"--token-bitmask: {path} is an archive of arrays, expected one .npy array")
    if words.dtype != np.int32:
        raise ValueError(f"--token-bitmask: {path} holds {words.dtype} words, expected int32")
    return words


def _finite(value: object) -> object:
    """`value` with its non-finite floats as the strings JSON readers parse back (float("-Infinity"))."""
    if isinstance(value, float) and not np.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite(item) for item in value]
    return value


def _json(value: object) -> str:
    return json.dumps(_finite(value), allow_nan=False)


def _result_dict(result: SampleResult) -> dict[str, object]:
    out: dict[str, object] = {
        "request_id": result.request_id,
        "tokens": result.tokens.tolist(),
        "seeds": [str(seed) for seed in result.seeds],  # uint64: JSON readers that parse doubles round past 2^53
        "valid": result.valid.tolist(),
        "nan_detected": result.nan_detected.tolist(),
        "timings": vars(result.timings),
    }
    if result.logprobs is not None:
        out["logprobs"] = result.logprobs.tolist()
    if result.top_logprob_ids is not None and result.top_logprobs is not None:
        out["top_logprob_ids"] = result.top_logprob_ids.tolist()
        out["top_logprobs"] = result.top_logprobs.tolist()
    return out


def _print_result(result: SampleResult) -> None:
    t = result.timings
    print(f"request {result.request_id}: queue {t.queue_ns / 1e6:.3f} ms, compute {t.compute_ns / 1e6:.3f} ms, total {t.total_ns / 1e6:.3f} ms")
    for row, tokens in enumerate(result.tokens.tolist()):
        line = f"row {row}: tokens {tokens}  seed {result.seeds[row]}  valid {bool(result.valid[row])}"
        if result.nan_detected[row]:
            line += "  nan_detected"
        if result.logprobs is not None:
            line += f"  logprobs {[round(x, 4) for x in result.logprobs[row].tolist()]}"
        print(line)
        if result.top_logprob_ids is not None and result.top_logprobs is not None:
            pairs = zip(result.top_logprob_ids[row].tolist(), result.top_logprobs[row].tolist())
            print("       top: " + ", ".join(f"{i}:{lp:.4f}" for i, lp in pairs))


def _run_sample(client: SamplerClient, args: argparse.Namespace) -> int:
    torch = require_torch("tokensampler sample (its random logits)")
    generator = torch.Generator().manual_seed(args.logits_seed)
    logits = _random_logits(torch, args.random_logits, generator).to(getattr(torch, args.dtype))
    result = client.sample(
        logits,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        num_samples=args.num_samples,
        return_logprobs=args.logprobs,
        logprobs_mode=args.logprobs_mode,
        top_logprobs=args.top_logprobs,
        output_token_ids=args.sequence,
        min_tokens=args.min_tokens,
        num_generated=args.num_generated,
        stop_token_ids=args.stop_ids,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        dry_multiplier=args.dry_multiplier,
        dry_base=args.dry_base,
        dry_allowed_length=args.dry_allowed_length,
        dry_penalty_last_n=args.dry_penalty_last_n,
        dry_sequence_breakers=args.dry_breaker,
        typical_p=args.typical_p,
        top_n_sigma=args.top_n_sigma,
        xtc_threshold=args.xtc_threshold,
        xtc_probability=args.xtc_probability,
        token_bitmask=None if args.token_bitmask is None else _token_bitmask(args.token_bitmask),
    )
    if args.json:
        print(_json(_result_dict(result)))
    else:
        _print_result(result)
    return 0


def _run_score(client: SamplerClient, args: argparse.Namespace) -> int:
    torch = require_torch("tokensampler score (its random logits)")
    rows, length, vocab = args.random_logits
    generator = torch.Generator().manual_seed(args.logits_seed)
    logits = _random_logits(torch, args.random_logits, generator)
    token_ids = torch.randint(vocab, (rows, length), generator=generator)
    result = client.score_tokens(logits, token_ids, mode=args.mode, temperature=args.temperature, top_k=args.top_k,
                                 top_p=args.top_p, min_p=args.min_p, top_logprobs=args.top_logprobs,
                                 return_entropy=args.entropy)
    out: dict[str, object] = {"request_id": result.request_id, "token_ids": token_ids.tolist(),
                              "logprobs": result.logprobs.tolist()}
    if result.entropy is not None:
        out["entropy"] = result.entropy.tolist()
    if result.top_logprob_ids is not None and result.top_logprobs is not None:
        out["top_logprob_ids"] = result.top_logprob_ids.tolist()
        out["top_logprobs"] = result.top_logprobs.tolist()
    if args.json:
        print(_json(out))
        return 0
    for name, value in out.items():
        print(f"{name}: {value}")
    return 0


def _run_info(client: SamplerClient, args: argparse.Namespace) -> int:
    info = client.server_info()
    if args.json:
        print(json.dumps(json_format.MessageToDict(info, preserving_proto_field_name=True)))
        return 0
    limits = info.limits
    print(f"version: {info.version}")
    print(f"api_version: {info.api_version}")
    print(f"backend: {info.backend}")
    print(f"device: {info.device}")
    print(
        f"limits: max_batch_rows={limits.max_batch_rows} max_message_bytes={limits.max_message_bytes} "
        f"max_num_samples={limits.max_num_samples} max_top_logprobs={limits.max_top_logprobs}"
    )
    dtypes = ", ".join(pb.DType.Name(d).removeprefix("DTYPE_").lower() for d in info.logits_dtypes)
    print(f"logits_dtypes: {dtypes}")
    print(f"features: {', '.join(info.features)}")
    print(f"kernels: {', '.join(info.kernels) or '-'}")
    return 0


def _run_health(client: SamplerClient, args: argparse.Namespace) -> int:
    status = client.health()
    print(status)
    return 0 if status == "SERVING" else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tokensampler` console script; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None) or (args.tls_cert and args.tls_ca is None):
        parser.error("--tls-cert and --tls-key go together, and with --tls-ca")
    token = None
    if args.auth_token_file:
        try:
            token = next(iter(args.auth_token_file.read_text().split()), None)
        except OSError as err:
            parser.error(f"--auth-token-file: cannot read {args.auth_token_file}: {err.strerror}")
        except UnicodeDecodeError:
            parser.error(f"--auth-token-file: {args.auth_token_file} is not UTF-8 text, expected a bearer token")
        if token is None:
            parser.error(f"--auth-token-file: {args.auth_token_file} is empty, expected a bearer token")
    try:
        with SamplerClient(args.target, timeout=args.timeout, auth_token=token, tls_ca=args.tls_ca,
                           tls_cert=args.tls_cert, tls_key=args.tls_key) as client:
            return int(args.run(client, args))
    except TokenSamplerError as err:
        print(f"tokensampler: error: {err.code.name}: {err.details}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError) as err:  # a file a flag names, or a value the client refuses
        print(f"tokensampler: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
