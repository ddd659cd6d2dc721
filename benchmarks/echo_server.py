"""An empty gRPC echo server: the transport floor the service benchmark compares against.

  python benchmarks/echo_server.py --port 0 [--uds PATH]

Serves /bench.Echo/Unary (bytes in, the same bytes out) and /bench.Echo/Stream (each message echoed)
with grpc.aio and no protobuf work at all; prints "echo serving on PORT" once ready.
"""

from __future__ import annotations

import argparse
import asyncio

import grpc

UNARY = "/bench.Echo/Unary"
STREAM = "/bench.Echo/Stream"
MAX_MESSAGE = 1 << 30


async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def _stream(requests, context: grpc.aio.ServicerContext):
    async for request in requests:
        yield request


async def serve(port: int, uds: str | None) -> None:
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    server = grpc.aio.server(options=options)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Echo", handlers),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    if uds:
        server.add_insecure_port(f"unix:{uds}")
    await server.start()
    print(f"echo serving on {bound}", flush=True)
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--uds")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.uds))


if __name__ == "__main__":
    main()
