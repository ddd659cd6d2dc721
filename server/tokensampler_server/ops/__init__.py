"""Sampling workloads beyond next-token sampling, in torch: the reference every kernel is held to."""
