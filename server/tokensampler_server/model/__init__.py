"""The validated request types every backend reads (SamplingBatch, LogitProcessing, ...) and what is derived
from token ids alone (repetition). Imports resources and core."""
