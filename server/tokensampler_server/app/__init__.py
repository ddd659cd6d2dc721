"""The process: the command line, the server's assembly (gRPC, health, metrics endpoints) and TLS.

The top layer: it may import every layer below (rpc, batching, validation, workloads, backends, model, resources, core)."""
