"""tokensampler's gRPC server: samples token ids from logits on the CPU or with CUDA kernels."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tokensampler")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"
