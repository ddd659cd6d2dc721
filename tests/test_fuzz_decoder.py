"""The native path's decoder and validation (csrc/wire.h, csrc/native_path.cpp) fuzzed in small, as
scripts/fuzz_decoder.sh does at length: the AddressSanitizer + UndefinedBehaviorSanitizer build on the CPU,
every input of the regression corpus tests/fuzz_corpus/decoder/ replayed (each once crashed the decoder), then a
few thousand mutations of the seed requests. Skipped where no C++ compiler has both sanitizers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "fuzz_corpus" / "decoder"
NO_COMPILER = 77  # scripts/fuzz_decoder.sh: no compiler with the sanitizers
RUNS = 5000


def test_regression_corpus_and_mutations_run_without_a_sanitizer_report(tmp_path: Path) -> None:
    result = subprocess.run(
        ["bash", str(ROOT / "scripts" / "fuzz_decoder.sh"), "-n", str(RUNS), "-s", "1", "--work", str(tmp_path)],
        capture_output=True, text=True, timeout=240, env={**os.environ, "PYTHON": sys.executable},
    )
    if result.returncode == NO_COMPILER:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    replayed = re.search(r"replayed (\d+) regression inputs, no crash", result.stdout)
    assert replayed and int(replayed.group(1)) == sum(1 for f in CORPUS.iterdir() if f.is_file()) > 0, result.stdout
    ran = re.search(r"(\d+) inputs in \d+ s .*no crash", result.stdout)
    assert ran and int(ran.group(1)) == RUNS, result.stdout
