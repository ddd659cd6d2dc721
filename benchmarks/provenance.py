"""Which commit a benchmark ran: what every result file records."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree_commit() -> str:
    """The checkout's short commit; TOKENSAMPLER_BENCH_COMMIT names it where the tree was copied without its
    git history. "unknown" when neither says."""
    commit = os.environ.get("TOKENSAMPLER_BENCH_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                    text=True).stdout.strip()
        except OSError:
            commit = ""
    return commit or "unknown"
