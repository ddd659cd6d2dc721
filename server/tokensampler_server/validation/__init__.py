"""Requests decoded and checked into the model's types (the from_pb of every RPC), with field-named
INVALID_ARGUMENT errors. Imports workloads and below."""
