"""How the kernel benchmarks time and size their runs, without any peer (docs/performance.md, "Method").

The names match those of the peers module (`--peers PATH`), so a benchmark times tokensampler alone with this
module (`--no-peers`) or beside the peers with theirs, the same way either time.
"""

from __future__ import annotations

import torch
import triton

from generators import flat as flat_logits  # noqa: F401 - the peers module's names
from generators import spiky as spiky_logits  # noqa: F401


def bench(fn) -> float:
    """Median µs of `fn`: CUDA events, L2 flushed before each call, after a warm-up."""
    return 1e3 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bandwidth() -> tuple[float, float]:
    """(copy, read) bandwidth in bytes/s: a copy of 2 GiB of bf16 and a sum over it."""
    n = 1 << 30
    x = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x))
    t_sum = bench(lambda: x.sum(dtype=torch.float32))
    copy_bw = 2 * x.numel() * 2 / (t_copy * 1e-6)
    read_bw = x.numel() * 2 / (t_sum * 1e-6)
    del x, y
    torch.cuda.empty_cache()
    return copy_bw, read_bw
