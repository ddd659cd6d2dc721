"""`python -m tokensampler_server.app.prebuild`: compiles the CUDA kernels ahead of time (the container
image does it while it is built), so that the server's first request does not wait for a JIT build.

An image build sees no GPU, so the GPU generation to build for is given instead: --capability
(TOKENSAMPLER_PREBUILD_CAPABILITY), 9.0 for H100/H200 by default. The build lands in the cache
directory under $TOKENSAMPLER_BUILD_DIR that a server on such a GPU imports it from.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time


def _capability(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\.(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected MAJOR.MINOR, e.g. 9.0, got {text!r}")
    return int(match[1]), int(match[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tokensampler_server.app.prebuild",
        description="Compile the CUDA kernels ahead of time, into $TOKENSAMPLER_BUILD_DIR.",
    )
    parser.add_argument(
        "--capability", type=_capability, default=os.environ.get("TOKENSAMPLER_PREBUILD_CAPABILITY", "9.0"),
        help="compute capability of the GPUs to build for (default: %(default)s) [TOKENSAMPLER_PREBUILD_CAPABILITY]",
    )
    capability = parser.parse_args(argv).capability
    from tokensampler_server.backends.cuda_build import CudaBackendUnavailable, build_kernels

    started = time.monotonic()
    try:
        build_kernels(capability)
    except CudaBackendUnavailable as err:
        print(f"tokensampler prebuild: {err}", file=sys.stderr)
        return 1
    print(f"tokensampler kernels built for sm_{capability[0]}{capability[1]} in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
