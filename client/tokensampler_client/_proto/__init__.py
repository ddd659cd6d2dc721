"""Generated gRPC stubs of proto/tokensampler/v1 (tools/generate_stubs.py). Do not edit."""
