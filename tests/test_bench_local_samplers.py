"""benchmarks/bench_local_samplers.py runs on the CPU reference (a smoke test): every case at every B, and a results
file in the format of the others."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_local_samplers import REFERENCE, main  # noqa: E402


def test_the_benchmark_times_every_case_on_the_cpu(tmp_path: Path) -> None:
    path = main(["--device", "cpu", "--batch-sizes", "1", "2", "--vocab", "1024", "--history", "256", "--rounds", "2",
                 "--out", str(tmp_path)])
    data = json.loads(path.read_text())
    assert path.name == f"local_samplers-cpu-{data['meta']['date']}.json"
    rows = data["rows"]
    assert len({row["mode"] for row in rows}) == 8 and {row["B"] for row in rows} == {1, 2}
    assert all(row["median_us"] > 0 for row in rows)
    assert all(row["of_reference"] == 1.0 for row in rows if row["mode"] == REFERENCE)
    assert data["meta"]["rounds"] == 2
    assert all(row["of_reference_range"][0] <= row["of_reference"] <= row["of_reference_range"][1] for row in rows)
