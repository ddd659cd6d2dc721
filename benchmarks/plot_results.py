"""Plots a results file: a time against B, one line per method (and mode, generator, depth), log scale.

  python benchmarks/plot_results.py benchmarks/results/logits-spiky-h100-2026-11-21.json
  python benchmarks/plot_results.py --value step_p50_us benchmarks/results/e2e-h200-2026-12-01.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def plot(path: Path, value: str = "median_us") -> Path:
    """The PNG beside `path` of each row's `value`; the HBM roofline where the rows carry one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(Path(path).read_text())
    series: dict[str, list[tuple[int, float]]] = {}
    roof: dict[int, float] = {}
    for row in data["rows"]:
        label = row["method"] + (f" {row['mode']}" if row.get("mode") else "")
        label += f" ({row['generator']})" if row.get("generator") else ""
        label += f", {row['layers']} layers" if row.get("layers") else ""
        # Several head shapes and GPU counts in one file (vocabulary-parallel): a line each, no shared roofline.
        label += f", V = {row['V']}, D = {row['D']}, N = {row['N']}" if "N" in row else ""
        series.setdefault(label, []).append((row["B"], row[value]))
        if "roofline_us" in row and "N" not in row:
            roof[row["B"]] = row["roofline_us"]
    fig, ax = plt.subplots(figsize=(10, 6))
    for label, points in sorted(series.items()):
        points.sort()
        style = "-o" if label.startswith("tokensampler") else "--x"
        ax.plot([b for b, _ in points], [t for _, t in points], style, label=label, linewidth=1.2, markersize=4)
    if roof:
        bs = sorted(roof)
        ax.plot(bs, [roof[b] for b in bs], "k:", label="HBM roofline (read once)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("B (rows)" + (", V = %d" % data["meta"]["V"] if "V" in data["meta"] else ""))
    ax.set_ylabel("median time (us)" if value == "median_us" else value)
    ax.set_title(f"{data['rows'][0]['workload']} on {data['meta']['gpu']} ({data['meta']['date']})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    out = Path(path).with_suffix(".png")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    column = "median_us"
    if args[:1] == ["--value"]:
        column, args = args[1], args[2:]
    for arg in args:
        print(plot(Path(arg), column))
