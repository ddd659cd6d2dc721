"""The batcher: requests merged into one backend call, and the results split back. Imports backends and below."""
