"""Generates the Python stubs of the gRPC contract into the client package.

Run `python tools/generate_stubs.py` after editing anything under proto/. The stubs are committed,
and tests/test_stubs.py regenerates them and fails when they differ from the committed ones.

grpcio-tools is pinned (pyproject's `dev` extra) so the generated code is reproducible and imports with
grpcio >= its version and protobuf >= 6.31 (the protoc it bundles is 31.1).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
PROTO_FILES = ["tokensampler/v1/sampler.proto"]
STUB_DIR = ROOT / "client" / "tokensampler_client" / "_proto"

# protoc writes absolute imports named after the proto package (`from tokensampler.v1 import ...`);
# the stubs live inside tokensampler_client, so those become relative imports.
_ABSOLUTE_IMPORT = re.compile(r"^from tokensampler\.v1 import ", re.MULTILINE)


def generate(out_dir: Path) -> list[Path]:
    """Writes the stubs into out_dir and returns the files written."""
    from grpc_tools import protoc
    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as raw:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{include}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *PROTO_FILES,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted(Path(raw, "tokensampler", "v1").glob("*.py*")):
            text = _ABSOLUTE_IMPORT.sub("from . import ", src.read_text())
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
        return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=STUB_DIR, help="output folder (default: %(default)s)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
