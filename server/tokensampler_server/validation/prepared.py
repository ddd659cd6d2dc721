"""A call planned once and run many times (LocalSampler.prepare, a colocated loop): its SampleRequest checked
into the template the backend plans (Backend.prepare).

Such a call takes the per-row parameters the kernels read (temperature, the filters, the Philox counters) and
the log-prob options; the processing of steps 2-5 needs the host between calls, so it is refused here, by field.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb

from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.sampling import ROW_FIELDS, SamplingBatch
from tokensampler_server.resources.weights import RegisteredWeight
from tokensampler_server.validation.sample import validate_sample_request

# The SamplingParams fields of a prepared call (docs/inprocess.md, "Prepared calls"): the per-row parameters, and
# has_seed beside their seeds.
PREPARED_PARAMS = (*ROW_FIELDS, "has_seed")


def validate_prepared_request(request: pb.SampleRequest, limits: Limits, batch_size: int, vocab_size: int,
                              head: RegisteredWeight | None, field: str = "params") -> tuple[SamplingBatch, np.ndarray]:
    """(the template of `batch_size` rows of `vocab_size` logits, the rows' seeds) of a request whose input is
    a reference (logits_ref, or hidden.states_ref through `head`): refuses, naming `field`.<name>, any parameter
    outside PREPARED_PARAMS."""
    for descriptor, _ in request.params.ListFields():
        if descriptor.name not in PREPARED_PARAMS:
            raise InvalidArgument(f"{field}.{descriptor.name}",
                                  f"not taken by a call planned once; expected only {', '.join(PREPARED_PARAMS)}")
    width = head.weight.shape[1] if head is not None else vocab_size
    placeholder = torch.empty((batch_size, width), device="meta")  # the input's shape, no memory
    template, seeds = validate_sample_request(request, limits, lm_head=head, referenced=placeholder)
    if template.hidden is not None:  # the call computes the logits itself, then plans on them
        template = replace(template, hidden=None, logits=torch.empty((batch_size, vocab_size), device="meta"))
    return template, np.asarray(seeds, dtype=np.uint64)
