"""Sampling in the caller's process: the service's backends without a process boundary (docs/inprocess.md).

One parameter model and one implementation: a call's keywords are those of `SamplerClient.sample`, filled into the
contract's SamplingParams by the client's own code and checked by the service's own validation, and the batch goes
to the same backend the server runs. So a call gives the tokens the service gives for the same request, and refuses
what the service refuses, with the same field-named message (as ValueError).

    sampler = LocalSampler("cuda")
    out = sampler.sample(logits, temperature=0.8, top_k=50, top_p=0.9, seed=seeds, position=step)
    out.tokens  # int64 [B, n] on the CPU: the client's SampleResult, as a remote call returns it

    head = sampler.register_head(model.lm_head.weight)         # once
    out = sampler.sample_hidden(hidden_states, head, top_k=50)  # W·h inside the fused kernel where it applies

    scores = sampler.score(logits, token_ids, mode="processed", temperature=0.8)  # ScoreTokens in process
    best = sampler.topk_probs(logits, 20)                                         # TopKProbs in process

    step = sampler.prepare(batch_size, vocab_size, top_k=50, top_p=0.9, seed=seeds)  # planned once
    step.position.fill_(n)          # the counters are device tensors, written in place (or inside a graph)
    tokens = step(logits).tokens    # on the caller's stream, no synchronisation: capturable in a CUDA graph
"""

from __future__ import annotations

import numbers
import time
from dataclasses import replace
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client.params import PREPARED_KEYWORDS, fill_request_options, fill_sampling_params
from tokensampler_client.result import SampleResult, Timings
from tokensampler_client.workloads import ScoreTokensResult, TopKProbsResult, fill_score_options, fill_topk_options

from tokensampler_server.backends import create_backend
from tokensampler_server.backends.base import Backend, PreparedSampling
from tokensampler_server.core.config import Limits
from tokensampler_server.core.errors import InvalidArgument
from tokensampler_server.model.sampling import SamplingResult
from tokensampler_server.validation.prepared import validate_prepared_request
from tokensampler_server.validation.sample import check_in_place_dtype, validate_sample_request
from tokensampler_server.validation.workloads import validate_score_request, validate_topk_request
from tokensampler_server.workloads.cuda import workloads_of
from tokensampler_server.resources.weights import (WEIGHT_DTYPES, RegisteredWeight, check_finish, check_finite_weight,
                                                  check_weight_shape)

__all__ = ["LocalSampler", "PreparedSampler", "capture"]

T = TypeVar("T")


def _input(x: Any, dims: tuple[int, ...], expected: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() not in dims:
        raise ValueError(f"input: {expected} expected")
    if x.layout != torch.strided:
        raise ValueError(f"input: got a {x.layout} tensor, expected a dense (strided) tensor")


_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
_INT64_MAX = 2**63 - 1


def _usable(name: str, value: Any) -> None:
    """ValueError naming `name` for an argument no request can hold: a meta tensor (it has no data; meta tensors only
    describe prepare's inputs), or a Python integer past float32's range, which every field refuses (int64 and
    uint64 fields sooner) but which 10**400 makes an OverflowError before any field sees it."""
    if isinstance(value, torch.Tensor):
        if value.is_meta:
            raise ValueError(f"{name}: got a meta tensor, expected one with data (meta tensors describe prepare's "
                             "inputs)")
    elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > _FLOAT32_MAX:
        raise ValueError(f"{name}: got an integer of {value.bit_length()} bits, expected a number within float32's "
                         "range (int64's for an integer field)")


def _usable_within(name: str, value: Any) -> None:
    """_usable for `value` and whatever its lists, tuples and dicts hold (the slow path: only once a fill failed)."""
    _usable(name, value)
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if isinstance(value, (list, tuple)):
        for item in value:
            _usable_within(name, item)


def _float32_option(name: str, value: float | None) -> float | None:
    """A head option as the service's float32 field holds it (1e300 there is inf, which check_finish refuses)."""
    if value is None:
        return None
    try:
        return torch.tensor(float(value), dtype=torch.float32).item()
    except OverflowError:
        raise ValueError(f"head.{name}: got {value!r}, expected a finite number") from None


def _check_head(head: Any, optional: bool = False) -> None:
    if not (isinstance(head, RegisteredWeight) or (optional and head is None)):
        raise ValueError(f"head: got {type(head).__name__}, expected the head register_head returned")


def _filled(fill: Callable[..., None], request: Any, *args: Any, **kwargs: Any) -> None:
    """A client builder's fill of a request from the call's arguments (`kwargs`, by name): an unknown keyword, a value
    of the wrong type or one no field holds (_usable; inside a list or dict, found once the fill fails) as ValueError
    naming it."""
    for name, value in kwargs.items():
        _usable(name, value)
    try:
        fill(request, *args, **kwargs)
    except (TypeError, OverflowError, RuntimeError, NotImplementedError) as err:
        for name, value in kwargs.items():
            _usable_within(name, value)
        if isinstance(err, TypeError):
            raise ValueError(str(err)) from None
        raise


def _validated(validate: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """The service's validation of a request: its field-named refusal as ValueError."""
    try:
        return validate(*args, **kwargs)
    except InvalidArgument as err:
        raise ValueError(str(err)) from None


def _timings(started: int, computing: int) -> Timings:
    """A call's timings as a remote result reports them: compute_ns the backend's part, total_ns with the
    validation (no queue)."""
    finished = time.perf_counter_ns()
    return Timings(queue_ns=0, compute_ns=finished - computing, total_ns=finished - started)


class LocalSampler:
    """The sampler of docs/semantics.md on a backend of this process: "cuda", "cuda:N", "cpu" or "auto".

    Calls are serialised per sampler (the CUDA backend reuses its buffers from call to call); tensors may live on
    the CPU or on the sampler's GPU. `limits` bounds a call as the server's flags bound a request (defaults: the
    server's).
    """

    def __init__(self, device: str = "auto", limits: Limits | None = None) -> None:
        self._backend: Backend = create_backend(device)
        self._workloads = workloads_of(self._backend)
        self._limits = limits or Limits()

    @property
    def device(self) -> torch.device:
        """Where the sampler computes: the GPU, or the CPU for the reference backend."""
        return self._backend.device

    def sample(self, logits: torch.Tensor, *, num_samples: int = 1, return_logprobs: bool = False,
               logprobs_mode: str = "raw", top_logprobs: int = 0, **params: Any) -> SampleResult:
        """Samples logits [B, V] (float32, bfloat16 or float16).

        Keywords: SamplerClient.sample's per-row parameters (temperature, top_k, top_p, min_p, seed, position,
        iteration, the token lists, logit bias and penalties, the local samplers), each a scalar shared by every
        row or one value per row; num_samples; return_logprobs, logprobs_mode ("raw" or "processed") and
        top_logprobs. Raises ValueError naming the field of any invalid value.
        """
        request = self._request(logits, num_samples, return_logprobs, logprobs_mode, top_logprobs, params)
        request.logits_ref.SetInParent()
        return self._run(request, logits, None)

    def register_head(self, weight: torch.Tensor, *, bias: torch.Tensor | None = None, logit_scale: float | None = None,
                      soft_cap: float | None = None, vocab_size: int | None = None) -> RegisteredWeight:
        """An LM head W [V, D] for sample_hidden, used in place when it already lies on the sampler's device:
        x = cap·tanh(((W·h + bias)·scale)/cap), rows from vocab_size on never sampled (docs/semantics.md)."""
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"weight: got {type(weight).__name__}, expected a torch tensor [V, D]")
        if weight.dim() != 2:
            raise ValueError(f"weight: got {weight.dim()} dimensions, expected [V, D]")
        if weight.dtype not in WEIGHT_DTYPES:  # as the service refuses an upload
            raise ValueError(f"weight: got {weight.dtype}, expected float32, bfloat16 or float16")
        if bias is not None and not isinstance(bias, torch.Tensor):
            raise ValueError(f"head.bias: got {type(bias).__name__}, expected a torch tensor [V] or None")
        _usable("weight", weight)
        _usable("head.bias", bias)
        for name, value in (("logit_scale", logit_scale), ("soft_cap", soft_cap)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
                raise ValueError(f"head.{name}: got {value!r}, expected a number or None")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral)):
            raise ValueError(f"head.vocab_size: got {vocab_size!r}, expected an integer or None")
        if bias is not None and not bias.is_floating_point():  # as the service refuses options.bias.dtype
            raise ValueError(f"head.bias.dtype: got {bias.dtype}, expected float32 (or bfloat16, float16)")
        logit_scale, soft_cap = _float32_option("logit_scale", logit_scale), _float32_option("soft_cap", soft_cap)
        vocab_size = None if vocab_size is None else int(vocab_size)
        try:
            check_weight_shape(tuple(weight.shape), "weight")
            check_finite_weight(weight, "weight")
            finish = check_finish(weight.shape[0], bias, vocab_size, soft_cap, logit_scale, field_prefix="head")
        except InvalidArgument as err:
            raise ValueError(str(err)) from None
        if finish.bias is not None:
            finish = replace(finish, bias=finish.bias.to(self.device))
        return RegisteredWeight(name="local", weight=weight.to(self.device), finish=finish, sha256="")

    def sample_hidden(self, hidden: torch.Tensor, head: RegisteredWeight, *, num_samples: int = 1,
                      return_logprobs: bool = False, logprobs_mode: str = "raw", top_logprobs: int = 0,
                      **params: Any) -> SampleResult:
        """Samples hidden states [B, D] through `head` (register_head): the logits are W·h as the service
        computes them, inside the fused kernel where it applies. The keywords of sample()."""
        _check_head(head)
        request = self._request(hidden, num_samples, return_logprobs, logprobs_mode, top_logprobs, params)
        request.hidden.states_ref.SetInParent()
        return self._run(request, hidden, head)

    def score(self, logits: torch.Tensor, token_ids: Any, **options: Any) -> ScoreTokensResult:
        """ScoreTokens in process (docs/semantics.md, choice 18): the log-probs of token_ids [B, T] under logits
        [B, T, V]. Keywords: mode ("raw" or "processed"), temperature, top_k, top_p, min_p (per row, PROCESSED),
        top_logprobs, return_entropy. Returns the client's ScoreTokensResult (CPU tensors)."""
        request = self._score_request(logits, token_ids, options)
        request.logits.SetInParent()
        return self._score(request, logits, None)

    def score_hidden(self, hidden: torch.Tensor, head: RegisteredWeight, token_ids: Any,
                     **options: Any) -> ScoreTokensResult:
        """score() under the logits `head` (register_head) makes of hidden states [B, T, D], which are never
        computed whole: the keywords of score()."""
        _check_head(head)
        request = self._score_request(hidden, token_ids, options)
        request.hidden.weights = head.name
        return self._score(request, hidden, head)

    def topk_probs(self, logits: torch.Tensor, k: int, *, temperature: Any = None) -> TopKProbsResult:
        """TopKProbs in process (docs/semantics.md, choice 15): the k most probable ids of softmax(logits / T) and
        their probabilities for logits [B, V] or [B, S, V]; temperature None (1), one value or one a row. Returns the
        client's TopKProbsResult (CPU tensors, [B, k] or [B, S, k])."""
        request = self._topk_request(logits, k, temperature)
        request.logits.SetInParent()
        return self._topk(request, logits, None)

    def topk_probs_hidden(self, hidden: torch.Tensor, head: RegisteredWeight, k: int, *,
                          temperature: Any = None) -> TopKProbsResult:
        """topk_probs() of the logits `head` (register_head) makes of hidden states [B, D] or [B, S, D]."""
        _check_head(head)
        request = self._topk_request(hidden, k, temperature)
        request.hidden.weights = head.name
        return self._topk(request, hidden, head)

    def prepare(self, batch_size: int, vocab_size: int | None = None, *, head: RegisteredWeight | None = None,
                num_samples: int = 1, return_logprobs: bool = False, logprobs_mode: str = "raw",
                top_logprobs: int = 0, **params: Any) -> PreparedSampler:
        """A call planned once for batch_size rows of vocab_size logits (or of hidden states through `head`) and
        run many times: the rows' temperature, top_k, top_p and min_p and the log-prob options are fixed here, their
        seed, position and iteration are device tensors of the result, written in place between calls. Raises
        ValueError naming the field of an invalid value, or a keyword a prepared call does not take."""
        for name in params:
            if name not in PREPARED_KEYWORDS:
                raise ValueError(f"{name}: not taken by a prepared call; expected only {', '.join(PREPARED_KEYWORDS)}"
                                 " (sample() takes every parameter)")
        _check_head(head, optional=True)
        if head is not None:
            vocab_size = head.finish.vocab_size
        for name, size in (("batch_size", batch_size), ("vocab_size", vocab_size)):
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 1 <= size <= _INT64_MAX:
                raise ValueError(f"{name}: got {size!r}, expected an integer from 1 to 2^63 - 1"
                                 + (" (the logits' V, or a head)" if name == "vocab_size" else ""))
        batch_size, vocab_size = int(batch_size), int(vocab_size)
        shape = (batch_size, head.weight.shape[1] if head is not None else vocab_size)
        for rows, width in (shape, (batch_size, vocab_size)):  # before a meta tensor of that shape (int64 numel)
            if rows * width > self._limits.max_batch_elements:
                raise ValueError(f"batch_size: {rows} rows of {width}, {rows * width} elements, expected at most "
                                 f"{self._limits.max_batch_elements} (max_batch_elements)")
        request = self._request(torch.empty(shape, device="meta"), num_samples, return_logprobs, logprobs_mode,
                                top_logprobs, params)
        if head is not None:
            request.hidden.states_ref.SetInParent()
        else:
            request.logits_ref.SetInParent()
        template, seeds = _validated(validate_prepared_request, request, self._limits, batch_size, vocab_size, head)
        return PreparedSampler(self._backend.prepare(template, head), shape, [int(s) for s in seeds])

    # -----------------------------------------------------------------------------------------------
    @staticmethod
    def _topk_request(x: torch.Tensor, k: int, temperature: Any) -> pb.TopKProbsRequest:
        _input(x, (2, 3), "a [B, V] or [B, S, V] logits, or [B, D] or [B, S, D] hidden-state tensor")
        request = pb.TopKProbsRequest()
        _filled(fill_topk_options, request, k=k, temperature=temperature)
        return request

    @torch.no_grad()  # results are values, as a remote call's are: no autograd graph from an input that needs one
    def _topk(self, request: pb.TopKProbsRequest, x: torch.Tensor, head: RegisteredWeight | None) -> TopKProbsResult:
        """TopKProbs' result (request_id empty)."""
        _usable("input", x)
        started = time.perf_counter_ns()
        logits, temperature, k = _validated(validate_topk_request, request, self._limits, lm_head=head, in_place=x)
        computing = time.perf_counter_ns()
        probs, ids = self._workloads.topk_probs(logits.compute().flatten(0, -2), temperature, k)
        shape = [*logits.shape[:-1], k]
        probs, ids = probs.cpu().reshape(shape), ids.to(torch.int64).cpu().reshape(shape)
        return TopKProbsResult(probs=probs, ids=ids, timings=_timings(started, computing), request_id="")

    @staticmethod
    def _score_request(x: torch.Tensor, token_ids: Any, options: dict[str, Any]) -> pb.ScoreTokensRequest:
        _input(x, (3,), "a [B, T, V] logits or [B, T, D] hidden-state tensor")
        request = pb.ScoreTokensRequest()
        _filled(fill_score_options, request, x.shape[0], token_ids=token_ids, **options)
        return request

    @torch.no_grad()
    def _score(self, request: pb.ScoreTokensRequest, x: torch.Tensor,
               head: RegisteredWeight | None) -> ScoreTokensResult:
        """ScoreTokens' result (request_id empty)."""
        _usable("input", x)
        started = time.perf_counter_ns()
        _, source, scoring = _validated(validate_score_request, request, self._limits, lm_head=head, in_place=x)
        computing = time.perf_counter_ns()
        scores = self._workloads.score_tokens(source, scoring)
        shape = list(x.shape[:2])

        def host(t: torch.Tensor | None, *trailing: int) -> torch.Tensor | None:
            return None if t is None else t.cpu().reshape([*shape, *trailing])

        logprobs, top_ids = host(scores.logprobs), host(scores.top_ids, -1)
        top_values, entropy = host(scores.top_values, -1), host(scores.entropy)
        return ScoreTokensResult(logprobs=logprobs, top_logprob_ids=top_ids, top_logprobs=top_values, entropy=entropy,
                                 timings=_timings(started, computing), request_id="")

    @staticmethod
    def _request(x: torch.Tensor, num_samples: int, return_logprobs: bool, logprobs_mode: str, top_logprobs: int,
                 params: dict[str, Any]) -> pb.SampleRequest:
        _input(x, (2,), "a [B, V] logits or [B, D] hidden-state tensor")
        request = pb.SampleRequest()
        _filled(fill_request_options, request, num_samples=num_samples, return_logprobs=return_logprobs,
                top_logprobs=top_logprobs, logprobs_mode=logprobs_mode)
        _filled(fill_sampling_params, request.params, x.shape[0], **params)
        return request

    @torch.no_grad()
    def _run(self, request: pb.SampleRequest, x: torch.Tensor, head: RegisteredWeight | None) -> SampleResult:
        """The result a remote call returns (request_id empty)."""
        _usable("input", x)
        started = time.perf_counter_ns()
        batch, seeds = _validated(validate_sample_request, request, self._limits, lm_head=head, referenced=x)
        computing = time.perf_counter_ns()
        result = self._backend.sample(batch)
        return SampleResult(tokens=result.tokens, seeds=[int(s) for s in np.asarray(seeds, dtype=np.uint64)],
                            logprobs=result.logprobs, top_logprob_ids=result.top_logprob_ids,
                            top_logprobs=result.top_logprobs, valid=result.valid, nan_detected=result.nan_detected,
                            timings=_timings(started, computing), request_id="")


class PreparedSampler:
    """A call of LocalSampler.prepare: `sampler(x)` samples logits [B, V] (or hidden states [B, D] through the
    head) on the sampler's device and returns the backend's SamplingResult there: tokens int64 [B, num_samples]
    (-1 in rows that are not valid), valid and nan_detected bool [B], and the log-probs and top log-probs when
    prepared with them. On the CUDA backend the call launches on the
    current stream and never synchronises, so it can be captured in a CUDA graph; its result tensors are new each
    call (inside a graph: the graph's own). `seed`, `position` and `iteration` are the rows' int64 [B] Philox
    counters on the device, read at each call: write them in place (copy_, fill_, add_), never rebind them."""

    def __init__(self, prepared: PreparedSampling, shape: tuple[int, int], seeds: list[int]) -> None:
        self._prepared = prepared
        self._shape = shape
        self.seeds = seeds
        """The uint64 seed of each row as prepared (drawn where none was given)."""

    @property
    def seed(self) -> torch.Tensor:
        return self._prepared.seed

    @property
    def position(self) -> torch.Tensor:
        return self._prepared.position

    @property
    def iteration(self) -> torch.Tensor:
        return self._prepared.iteration

    def __call__(self, x: torch.Tensor) -> SamplingResult:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != self._shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"input: got {got}, expected a tensor of shape {list(self._shape)} as prepared")
        _usable("input", x)
        _validated(check_in_place_dtype, x, "input")  # as sample() refuses them
        return self._prepared.sample(x)


def capture(call: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """call() run once on a side stream (the warm-up that torch.cuda.graph asks for: its first call builds what it
    needs), then captured in a CUDA graph on the current device: (the graph, what the captured call returned, whose
    tensors each replay rewrites). For a prepared call with whatever the caller adds around it, e.g. its counters'
    update."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out
