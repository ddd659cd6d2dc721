"""Sampling workloads beyond next-token sampling: the torch references every kernel is held to, and their CUDA
implementations with the dispatch the service calls (cuda.py)."""
