"""E2E workload: what an engine sees, a transformers decode loop that samples every step (docs/performance.md).

  python benchmarks/bench_e2e.py [--layers 32,4] [--batch-sizes 1,8,64] [--steps 128] [--prompt 128] [--repeats 5]
                                 [--methods torch,flashinfer,...] [--remote-form auto] [--out benchmarks/results]
                                 [--small]

A `LlamaForCausalLM` built from a config with random bf16 weights made on the device (Llama-3-8B shapes: hidden
4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256; all 32 layers, and 4), a static KV cache, and one
decode step captured as a CUDA graph (eager where capture fails; the rows say which). After a prompt of --prompt
tokens, each of --steps steps samples one token a row (T 0.8, top-k 50, top-p 0.9, a seed a row) from the step's
output, feeds it back and runs the next forward; every step's tokens reach the host, as an engine's stop checks
read them (from the GPU: a non-blocking copy to pinned memory and an event, read one step later). Methods, on the
same model, GPU and prompt, in one run:
  torch                          transformers' temperature, top-k and top-p warpers, softmax, multinomial
  flashinfer                     FlashInfer's top_k_top_p_sampling_from_logits (the faster filter order at each B)
  tokensampler_inprocess_logits  LocalSampler.sample of the model's logits
  tokensampler_graph_logits      LocalSampler.prepare's call on the logits, captured in a CUDA graph (the position
                                 read from the decoder's device tensor inside it): no host work, no synchronisation
  tokensampler_inprocess_hidden  LocalSampler.sample_hidden of the final hidden states, lm_head.weight in place
  tokensampler_graph_hidden      LocalSampler.prepare's call on the hidden states (the fused kernel), in a CUDA graph
  tokensampler_remote_logits     a server (a subprocess on a Unix socket) sampling the logits in a region
  tokensampler_remote_hidden     the same from the hidden states in a region, lm_head.weight registered in place
  tokensampler_colocated_logits  the same server, colocated (SamplerClient.colocate): each step handed off on the GPU,
                                 no host round trip on the step's way (docs/colocated.md; needs a GPU)
  tokensampler_colocated_hidden  the same from the hidden states, lm_head.weight registered in place
  tokensampler_colocated_late_logits
                                 colocated from logits with every announcement late: the engine's host sends it
                                 only once its GPU has reached the hand-off, so each step waits for the message,
                                 the server's queueing of the step and its kernels (the worst a late one costs)
Rows: tokens/s and step p50/p99 per method, B and depth (medians of --repeats runs, with their range), the
remote overhead per step, whether the tokens of one input kind are the same in process and remote, and how often
the tokens of the two kinds agree. Writes e2e-<gpu>-<date>.json (e2e-mps-... when an MPS daemon serves the GPU)
and a PNG of the step p50.

Without a GPU the same loop runs on the CPU (float32, eager steps, shared-memory regions, no FlashInfer): a check,
with --small, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import itertools
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
for package in ("server", "client", "benchmarks"):
    sys.path.insert(0, str(ROOT / package))

import grpc  # noqa: E402
import transformers  # noqa: E402
from bench_kernels import write_results  # noqa: E402
from bench_service import latency, share_tensor, start  # noqa: E402
from provenance import tree_commit  # noqa: E402
from tokensampler_client import SamplerClient  # noqa: E402
from tokensampler_client.params import serialize_sample_request  # noqa: E402
from tokensampler_client.regions import CudaRegion, RegionView, SharedMemoryRegion  # noqa: E402
from tokensampler_server.inprocess import LocalSampler, capture  # noqa: E402
from tokensampler_server.backends.mps import mps_state  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessorList,
    StaticCache,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256}
SMALL = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 4096}
PARAMS = {"temperature": 0.8, "top_k": 50, "top_p": 0.9}
WEIGHT_STD = 0.02
LOGIT_STD = 2.0
"""The LM head is N(0, (LOGIT_STD / sqrt(D))^2): the final norm's output has unit RMS, so the logits have a std of
about LOGIT_STD, which leaves tens of tokens after top-k and top-p (meta's step0_distribution measures it)."""
METHODS = ("torch", "flashinfer", "tokensampler_inprocess_logits", "tokensampler_graph_logits",
           "tokensampler_inprocess_hidden", "tokensampler_graph_hidden", "tokensampler_remote_logits", "tokensampler_remote_hidden",
           "tokensampler_colocated_logits", "tokensampler_colocated_hidden", "tokensampler_colocated_late_logits")
REMOTE_OF_INPROCESS = {"tokensampler_remote_logits": "tokensampler_inprocess_logits",
                       "tokensampler_remote_hidden": "tokensampler_inprocess_hidden",
                       "tokensampler_colocated_logits": "tokensampler_inprocess_logits",
                       "tokensampler_colocated_hidden": "tokensampler_inprocess_hidden"}
REMOTE_PREFIXES = ("tokensampler_remote_", "tokensampler_colocated_")
_REGION_NUMBERS = itertools.count()


def llama_config(layers: int, shapes: dict[str, int]) -> LlamaConfig:
    return LlamaConfig(**shapes, num_hidden_layers=layers, max_position_embeddings=8192, tie_word_embeddings=False,
                       attn_implementation="sdpa")


@torch.no_grad()
def build_model(config: LlamaConfig, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                seed: int = 0) -> LlamaForCausalLM:
    """Random weights made on `device` in `dtype` (nothing is downloaded, nothing is built on the host first):
    N(0, 0.02^2), the norms 1, the LM head scaled by LOGIT_STD."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    generator = torch.Generator(device).manual_seed(seed)
    for name, weight in model.named_parameters():
        if weight.dim() == 1:
            weight.fill_(1.0)
        else:
            std = LOGIT_STD / config.hidden_size**0.5 if name == "lm_head.weight" else WEIGHT_STD
            weight.normal_(0.0, std, generator=generator)
    return model.eval().requires_grad_(False)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decoder:
    """One batch's decode state: a static KV cache, the step's input tokens and position, and the buffers each step
    writes for the samplers: the final hidden state [B, D] in the model's dtype and the logits [B, V] in fp32 (the LM
    head's output upcast, as transformers' generate does). On a GPU, `capture` makes one step with the LM head (for
    the logits methods) and one without (the hidden-state methods) CUDA graphs."""

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int) -> None:
        device, config = model.device, model.config
        self.model = model
        self.cache = StaticCache(config=config, max_cache_len=max_len, max_batch_size=batch, device=device,
                                 dtype=model.dtype)
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(batch, config.hidden_size, dtype=model.dtype, device=device)
        self.logits = torch.zeros(batch, config.vocab_size, dtype=torch.float32, device=device)
        self.forward = "eager"
        self._keys = torch.arange(max_len, device=device)
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        # The cache's keyword and whether the model wants cache_position differ between transformers releases.
        accepted = inspect.signature(model.model.forward).parameters
        self._cache_keyword = "cache" if "cache" in accepted else "past_key_values"
        self._cache_position = "cache_position" in accepted

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, with_logits: bool) -> None:
        # The mask and the positions come from device tensors, so nothing in a step depends on the host's state and
        # one captured step replays correctly at every position.
        dtype = self.model.dtype
        visible = self._keys[None, :] <= positions[:, None]
        mask = torch.where(visible, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
        cache: dict[str, Any] = {self._cache_keyword: self.cache}
        if self._cache_position:
            cache["cache_position"] = positions
        out = self.model.model(input_ids=input_ids, attention_mask=mask, position_ids=positions[None], use_cache=True,
                               **cache)
        self.hidden.copy_(out.last_hidden_state[:, -1])
        if with_logits:
            self.logits.copy_(self.model.lm_head(self.hidden))

    def _step(self, with_logits: bool) -> None:
        self._forward(self.input_ids, self.position, with_logits)
        self.position.add_(1)

    def prefill(self, prompt: torch.Tensor) -> None:
        """Empties the cache and runs the prompt [B, P] (eager): the buffers then hold the outputs at its last
        position, and the next step is at position P."""
        self.cache.reset()
        self._forward(prompt, torch.arange(prompt.shape[1], device=prompt.device), with_logits=True)
        self.position.fill_(prompt.shape[1])

    def step(self, with_logits: bool) -> None:
        """The forward of input_ids at the current position, which it advances."""
        graph = self._graphs.get(with_logits)
        if graph is None:
            self._step(with_logits)
        else:
            graph.replay()

    def capture(self, prompt: torch.Tensor) -> None:
        """Captures both steps and checks the replay against the eager step; where either fails, the steps stay
        eager and `forward` says why."""
        try:
            for with_logits in (True, False):
                self.prefill(prompt)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # the warm-up torch.cuda.graph asks for
                    for _ in range(2):
                        self._step(with_logits)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    self._step(with_logits)
                self._graphs[with_logits] = graph
            self._check_replay(prompt)
        except Exception as err:  # noqa: BLE001 - recorded in the rows, the run goes on eager
            self._graphs.clear()
            self.forward = f"eager (CUDA graph: {type(err).__name__}: {err})"[:300]
            return
        self.forward = "cuda_graph"

    def _check_replay(self, prompt: torch.Tensor) -> None:
        """Two steps replayed against two eager steps: a position, mask or cache index frozen into the graph would
        give other logits; kernel choices inside a capture may only round differently."""
        outputs = []
        for replay in (False, True):
            self.prefill(prompt)
            self.input_ids.copy_(prompt[:, -1:])
            for _ in range(2):
                if replay:
                    self.step(True)
                else:
                    self._step(True)
            outputs.append(self.logits.clone())
        error = float((outputs[1] - outputs[0]).norm() / outputs[0].norm())
        if not error < 0.05:
            raise RuntimeError(f"replayed steps differ from eager ones: relative error {error:.3g}")


class Sampling:
    """One way to sample a step: `sample(position)` returns the step's tokens ([B] or [B, 1]; on the GPU, or already
    on the host). `kind` is the buffer it samples ("logits" or "hidden"), which also picks the step the loop runs."""

    kind = "logits"

    def __init__(self) -> None:
        self.extra: dict[str, Any] = {}
        """What the method's rows record about it."""

    def begin(self) -> None:
        """Before each run."""

    def sample(self, position: int) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """After the last run."""


class TorchSampling(Sampling):
    """transformers' sampling: its temperature, top-k and top-p warpers in generate's order, softmax, multinomial;
    one generator for the batch, seeded at each run (torch has no per-row seeds)."""

    def __init__(self, decoder: Decoder, seed: int) -> None:
        super().__init__()
        self._decoder = decoder
        self._warpers = LogitsProcessorList([TemperatureLogitsWarper(PARAMS["temperature"]),
                                             TopKLogitsWarper(PARAMS["top_k"]), TopPLogitsWarper(PARAMS["top_p"])])
        self._generator = torch.Generator(decoder.logits.device)
        self._seed = seed

    def begin(self) -> None:
        self._generator.manual_seed(self._seed)

    def sample(self, position: int) -> torch.Tensor:
        scores = self._warpers(self._decoder.input_ids, self._decoder.logits)
        return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=self._generator)


class FlashInferSampling(Sampling):
    """FlashInfer's top_k_top_p_sampling_from_logits of logits / T, k and p as scalars, in the filter order that is
    faster at this B (both timed first); one generator for the batch, seeded at each run."""

    def __init__(self, sampling: ModuleType, decoder: Decoder, seed: int, probe_iters: int) -> None:
        super().__init__()
        self._decoder = decoder
        self._seed = seed
        self._generator = torch.Generator(decoder.logits.device)
        function = sampling.top_k_top_p_sampling_from_logits
        takes_generator = "generator" in inspect.signature(function).parameters
        self._reseed: Callable[[int], object] = (self._generator.manual_seed if takes_generator
                                                 else torch.cuda.manual_seed)
        options = {"generator": self._generator} if takes_generator else {}
        forms = {order: partial(function, top_k=PARAMS["top_k"], top_p=PARAMS["top_p"], filter_apply_order=order,
                                **options) for order in ("top_k_first", "joint")}
        probe = {order: round(latency(lambda form=form: self._timed(form), probe_iters)[0], 1)
                 for order, form in forms.items()}
        order = min(probe, key=probe.__getitem__)
        self._sample = forms[order]
        self.extra = {"flashinfer_order": order, "flashinfer_probe_p50_us": probe}

    def _timed(self, form: Callable[[torch.Tensor], torch.Tensor]) -> None:
        form(self._decoder.logits / PARAMS["temperature"])
        torch.cuda.synchronize()

    def begin(self) -> None:
        self._reseed(self._seed)

    def sample(self, position: int) -> torch.Tensor:
        return self._sample(self._decoder.logits / PARAMS["temperature"])


class InProcessSampling(Sampling):
    """tokensampler in process (LocalSampler): the logits, or the hidden states through the model's own
    lm_head.weight (used in place on the GPU), with a seed a row and the token's position."""

    def __init__(self, sampler: LocalSampler, decoder: Decoder, kind: str, seeds: list[int]) -> None:
        super().__init__()
        self.kind = kind
        self._seeds = seeds
        if kind == "hidden":
            head = sampler.register_head(decoder.model.lm_head.weight)
            self._call: Callable[..., Any] = partial(sampler.sample_hidden, decoder.hidden, head)
        else:
            self._call = partial(sampler.sample, decoder.logits)

    def sample(self, position: int) -> torch.Tensor:
        return self._call(seed=self._seeds, position=position, **PARAMS).tokens


class GraphSampling(Sampling):
    """tokensampler in process as a prepared call (LocalSampler.prepare) captured in a CUDA graph of its own: the
    step's position copied into the call's counters from the decoder's device tensor inside the graph, so a step's
    sampling is one replay, with no host work around the kernels and no synchronisation (eager on the CPU). From
    hidden states the call runs the fused kernel (the model's own lm_head.weight used in place)."""

    def __init__(self, sampler: LocalSampler, decoder: Decoder, kind: str, seeds: list[int]) -> None:
        super().__init__()
        self.kind = kind
        self._decoder = decoder
        if kind == "hidden":
            head = sampler.register_head(decoder.model.lm_head.weight)
            self._input = decoder.hidden
            self._prepared = sampler.prepare(self._input.shape[0], head=head, seed=seeds, **PARAMS)
        else:
            self._input = decoder.logits
            self._prepared = sampler.prepare(*self._input.shape, seed=seeds, **PARAMS)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._tokens = torch.empty(0)
        if self._input.is_cuda:
            self._graph, self._tokens = capture(self._replayed)
        self.extra = {"sampling": "cuda_graph" if self._graph is not None else "eager"}

    def _replayed(self) -> torch.Tensor:
        """What the graph holds: the position from the device, then the prepared call."""
        self._prepared.position.copy_(self._decoder.position.expand_as(self._prepared.position))
        return self._prepared(self._input).tokens

    def sample(self, position: int) -> torch.Tensor:
        if self._graph is None:
            self._prepared.position.fill_(position)
            return self._prepared(self._input).tokens
        self._graph.replay()
        return self._tokens


class SharedBuffer:
    """A decoder buffer that a server reads where it lies. On a GPU a CUDA IPC region with a ready event: `publish`
    records the event after the step's writes, and the server's work waits for it on the GPU, the host does not. On
    the CPU a shared-memory region (a server never maps a segment): `publish` copies the step's output into it."""

    def __init__(self, client: SamplerClient, name: str, tensor: torch.Tensor) -> None:
        self._client = client
        self._source = tensor
        self.region: CudaRegion | SharedMemoryRegion
        if tensor.is_cuda:
            self.region = client.register_cuda_region(name, tensor, ready_event=True)
            self.view: RegionView = self.region.view_of(tensor)
            self._copy: torch.Tensor | None = None
        else:
            shape = tuple(tensor.shape)
            self.region = client.register_shm_region(name, tensor.numel() * tensor.element_size())
            self.view = self.region.view(tensor.dtype, shape)
            self._copy = self.region.tensor(tensor.dtype, shape)

    def publish(self) -> None:
        if self._copy is None:
            self.region.mark_ready()
        else:
            self._copy.copy_(self._source)

    def close(self) -> None:
        self._copy = None
        self._client.unregister_region(self.region)


class RemoteSampling(Sampling):
    """tokensampler through a running server: the logits, or the hidden states with the model's lm_head.weight
    registered from a region (in place on a GPU), each step's buffer read from its region. `form` is "stream" (one
    SampleStream kept open across steps), "unary" (one Sample call a step) or "auto": the faster of the two on this
    buffer, both timed first."""

    def __init__(self, client: SamplerClient, decoder: Decoder, kind: str, seeds: list[int], form: str,
                 probe_iters: int) -> None:
        super().__init__()
        self.kind = kind
        self._client = client
        self._seeds = seeds
        self._head_region: CudaRegion | SharedMemoryRegion | None = None
        # Names never used before: what a method that failed half set up left registered blocks no later one.
        suffix = f"{kind}-{next(_REGION_NUMBERS)}"
        self._head = f"e2e-lm-head-{suffix}"
        self._buffer = SharedBuffer(client, f"e2e-{suffix}", decoder.hidden if kind == "hidden" else decoder.logits)
        self._inputs: dict[str, Any] = {"logits": self._buffer.view}
        if kind == "hidden":
            self._head_region, head = share_tensor(client, self._head, decoder.model.lm_head.weight)
            client.register_weights_from_region(self._head, head)
            self._inputs = {"hidden": self._buffer.view, "weights": self._head}
        self._stream = client.stream()
        forms = {"stream": self._stream.sample, "unary": client.sample_request}
        if form == "auto":
            probe = {name: round(latency(lambda call=call: self._sample(call, 0), probe_iters)[0], 1)
                     for name, call in forms.items()}
            form = min(probe, key=probe.__getitem__)
            self.extra["remote_form_probe_p50_us"] = probe
        self._call = forms[form]
        self.extra["remote_form"] = form

    def _sample(self, call: Callable[[bytes], Any], position: int) -> torch.Tensor:
        self._buffer.publish()
        request = serialize_sample_request(**self._inputs, seed=self._seeds, position=position, **PARAMS)
        return call(request).tokens

    def sample(self, position: int) -> torch.Tensor:
        return self._sample(self._call, position)

    def close(self) -> None:
        self._stream.close()
        if self._head_region is not None:
            self._client.unregister_weights(self._head)
            self._client.unregister_region(self._head_region)
        self._buffer.close()


class ColocatedSampling(Sampling):
    """tokensampler colocated on the GPU (SamplerClient.colocate): the server's stream waits for the step's buffer on
    the GPU and the decode loop's stream for the tokens, the step's announcement travelling on a gRPC thread meanwhile.
    One loop a run (its steps count from 1), opened before the run's clock starts."""

    def __init__(self, client: SamplerClient, decoder: Decoder, kind: str, seeds: list[int], prompt_len: int,
                 late: bool = False) -> None:
        super().__init__()
        self.kind = kind
        self._late = late
        self._client = client
        self._seeds = seeds
        self._prompt_len = prompt_len
        self._source = decoder.hidden if kind == "hidden" else decoder.logits
        self._head = decoder.model.lm_head.weight if kind == "hidden" else None
        self._loop: Any = None
        self.begin()  # fails here, not in a run, when the server cannot open one
        self.extra = {"mps": client.server_info().mps}

    def begin(self) -> None:
        self.close()
        self._loop = self._client.colocate(self._source, head=self._head, seed=self._seeds,
                                           position=self._prompt_len, **PARAMS)

    def sample(self, position: int) -> torch.Tensor:
        if self._late:  # the step's input is on the GPU before its announcement leaves
            torch.cuda.current_stream().synchronize()
        return self._loop.step()

    def close(self) -> None:
        if self._loop is not None:
            self.extra["fallbacks"] = self.extra.get("fallbacks", 0) + self._loop.fallbacks
            self._loop.close()
            self._loop = None


class HostTokens:
    """Every step's tokens on the host, as an engine reads them for its stop checks: tokens still on the GPU are
    copied to pinned memory without blocking and read one step later, after their event; tokens a sampler already
    brought to the host are taken as they are."""

    def __init__(self, batch: int, steps: int, device: torch.device) -> None:
        self.tokens = torch.empty(batch, steps, dtype=torch.long)
        cuda = device.type == "cuda"
        self._slots = [torch.empty(batch, dtype=torch.long, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self._pending: int | None = None

    def push(self, step: int, tokens: torch.Tensor) -> None:
        tokens = tokens.view(-1)
        if not tokens.is_cuda:
            self.tokens[:, step] = tokens
            return
        self._slots[step % 2].copy_(tokens, non_blocking=True)
        self._events[step % 2].record()
        self._read_pending()
        self._pending = step

    def _read_pending(self) -> None:
        if self._pending is not None:
            self._events[self._pending % 2].synchronize()
            self.tokens[:, self._pending] = self._slots[self._pending % 2]
            self._pending = None

    def finish(self) -> torch.Tensor:
        self._read_pending()
        return self.tokens


class StepClock:
    """When each step starts: CUDA events on the model's stream on a GPU (the GPU's timeline, so a step's time holds
    the forward, the sampling, the token copies and any gap a host wait leaves), the host's clock on the CPU."""

    def __init__(self, steps: int, device: torch.device) -> None:
        self._events = ([torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
                        if device.type == "cuda" else [])
        self._times: list[float] = []

    def start(self) -> None:
        self._times = []

    def mark(self) -> None:
        if self._events:
            self._events[len(self._times)].record()
        self._times.append(time.perf_counter())

    def step_us(self) -> list[float]:
        """The steps' times, once the run has been synchronised."""
        if self._events:
            marks = self._events[: len(self._times)]
            return [1e3 * a.elapsed_time(b) for a, b in zip(marks[:-1], marks[1:])]
        return [1e6 * (b - a) for a, b in zip(self._times[:-1], self._times[1:])]


@dataclass
class Run:
    tokens: torch.Tensor
    """int64 [B, steps] on the host."""
    step_us: list[float]
    wall_s: float


def decode(decoder: Decoder, method: Sampling, prompt: torch.Tensor, steps: int, clock: StepClock) -> Run:
    """Prefill, then `steps` steps of: sample the step's buffer, feed the tokens back (and towards the host), run the
    next forward."""
    device = prompt.device
    decoder.prefill(prompt)
    method.begin()
    host = HostTokens(prompt.shape[0], steps, device)
    clock.start()
    synchronize(device)
    started = time.perf_counter()
    for step in range(steps):
        clock.mark()
        tokens = method.sample(prompt.shape[1] + step)
        decoder.input_ids.copy_(tokens.view(-1, 1), non_blocking=True)
        host.push(step, tokens)
        decoder.step(with_logits=method.kind == "logits")
    clock.mark()
    synchronize(device)
    wall = time.perf_counter() - started
    return Run(tokens=host.finish(), step_us=clock.step_us(), wall_s=wall)


def step0_distribution(logits: torch.Tensor) -> dict[str, float]:
    """How peaked the first step's distributions are after the temperature: the mean top probability and the mean
    number of tokens top-k and then top-p keep."""
    probs = torch.softmax(logits.float() / PARAMS["temperature"], dim=-1)
    top = torch.topk(probs, PARAMS["top_k"], dim=-1).values
    top = top / top.sum(dim=-1, keepdim=True)
    kept = ((top.cumsum(dim=-1) - top) < PARAMS["top_p"]).sum(dim=-1).float()
    return {"top_probability_mean": round(float(probs.max(dim=-1).values.mean()), 4),
            "kept_tokens_mean": round(float(kept.mean()), 1)}


def agreement(logits_tokens: torch.Tensor, hidden_tokens: torch.Tensor) -> dict[str, float]:
    """How often the tokens of the two input kinds agree: over every (row, step); at the first step, where both
    sample the same prefill state (what the rounding of the logits to bf16 changes); and the rows whose whole
    continuation agrees (a first difference changes the context of every later step)."""
    same = logits_tokens == hidden_tokens
    return {"agreement_rate": round(float(same.float().mean()), 4),
            "first_step_agreement": round(float(same[:, 0].float().mean()), 4),
            "rows_identical": round(float(same.all(dim=1).float().mean()), 4)}


def summarize(name: str, method: Sampling, runs: list[Run], batch: int, layers: int, forward: str) -> dict[str, Any]:
    steps = runs[0].tokens.shape[1]
    per_run = {
        "tokens_per_s": [batch * steps / run.wall_s for run in runs],
        "step_p50_us": [float(np.percentile(run.step_us, 50)) for run in runs],
        "step_p99_us": [float(np.percentile(run.step_us, 99)) for run in runs],
    }
    row: dict[str, Any] = {"workload": "e2e", "method": name, "mode": method.kind, "B": batch, "layers": layers}
    for key, values in per_run.items():
        row[key] = round(float(np.median(values)), 1)
    for key, values in per_run.items():
        row[f"{key}_range"] = [round(min(values), 1), round(max(values), 1)]
    row["runs"] = len(runs)
    row["forward"] = forward
    row["tokens_same_every_run"] = all(torch.equal(run.tokens, runs[0].tokens) for run in runs)
    return {**row, **method.extra}


def compare(rows: dict[str, dict[str, Any]], tokens: dict[str, torch.Tensor]) -> None:
    """Adds to the remote rows their overhead a step over in process and whether their tokens are the in-process
    ones, and to the hidden-state rows their agreement with the logits rows."""
    for remote, local in REMOTE_OF_INPROCESS.items():
        if remote in rows and local in rows:
            rows[remote]["remote_overhead_us"] = round(rows[remote]["step_p50_us"] - rows[local]["step_p50_us"], 1)
            rows[remote]["tokens_identical_to_inprocess"] = torch.equal(tokens[remote], tokens[local])
    for kind in ("logits", "hidden"):
        graph, local, colocated = (f"tokensampler_{how}_{kind}" for how in ("graph", "inprocess", "colocated"))
        if colocated in rows and graph in rows:  # against the fastest sampling in process
            rows[colocated]["overhead_over_graph_us"] = round(
                rows[colocated]["step_p50_us"] - rows[graph]["step_p50_us"], 1)
        if graph in rows and local in rows:
            rows[graph]["saving_over_inprocess_us"] = round(rows[local]["step_p50_us"] - rows[graph]["step_p50_us"], 1)
            rows[graph]["tokens_identical_to_inprocess"] = torch.equal(tokens[graph], tokens[local])
    late, on_time = "tokensampler_colocated_late_logits", "tokensampler_colocated_logits"
    if late in rows and on_time in rows:
        rows[late]["late_cost_us"] = round(rows[late]["step_p50_us"] - rows[on_time]["step_p50_us"], 1)
        rows[late]["tokens_identical_to_on_time"] = torch.equal(tokens[late], tokens[on_time])
    kinds = {kind: next((name for name in (f"tokensampler_inprocess_{kind}", f"tokensampler_remote_{kind}")
                         if name in tokens), None) for kind in ("logits", "hidden")}
    if kinds["logits"] and kinds["hidden"]:
        rate = agreement(tokens[kinds["logits"]], tokens[kinds["hidden"]])
        for name in ("tokensampler_inprocess_hidden", "tokensampler_remote_hidden"):
            if name in rows:
                rows[name]["agreement_with_logits"] = {"compared_with": kinds["logits"], **rate}


@dataclass
class Case:
    rows: list[dict[str, Any]]
    tokens: dict[str, torch.Tensor]
    """Each method's tokens of its first counted run, [B, steps]."""
    step0: dict[str, float]
    skipped: dict[str, str]
    """The methods that could not be set up, and why."""


def make_sampling(name: str, decoder: Decoder, seeds: list[int], seed: int, *, sampler: LocalSampler | None,
                  client: SamplerClient | None, flashinfer: ModuleType | None, remote_form: str,
                  probe_iters: int, prompt_len: int) -> Sampling:
    if name == "torch":
        return TorchSampling(decoder, seed)
    if name == "flashinfer":
        return FlashInferSampling(flashinfer, decoder, seed, probe_iters)
    kind = name.rsplit("_", 1)[1]
    if name.startswith("tokensampler_graph_"):
        return GraphSampling(sampler, decoder, kind, seeds)
    if name.startswith("tokensampler_inprocess_"):
        return InProcessSampling(sampler, decoder, kind, seeds)
    if name.startswith("tokensampler_colocated_"):
        return ColocatedSampling(client, decoder, kind, seeds, prompt_len, late="_late_" in name)
    return RemoteSampling(client, decoder, kind, seeds, remote_form, probe_iters)


@torch.no_grad()
def run_case(model: LlamaForCausalLM, batch: int, prompt_len: int, steps: int, repeats: int, methods: Sequence[str], *,
             sampler: LocalSampler | None = None, client: SamplerClient | None = None,
             flashinfer: ModuleType | None = None, remote_form: str = "auto", seed: int = 0,
             probe_iters: int = 30) -> Case:
    """Every method's decode loop at one B on one prompt, each run `repeats` times after a warm-up run, the methods'
    runs interleaved. The tokensampler methods need `sampler` (in process) or `client` (remote), flashinfer the
    module flashinfer.sampling. A method that cannot be set up is left out (Case.skipped says why); the others run."""
    device = model.device
    decoder = Decoder(model, batch, prompt_len + steps)
    prompt = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                           generator=torch.Generator().manual_seed(seed)).to(device)
    if device.type == "cuda":
        decoder.capture(prompt)
    decoder.prefill(prompt)  # the buffers the probes of the forms sample
    seeds = [seed * batch + row for row in range(batch)]
    samplers: dict[str, Sampling] = {}
    skipped: dict[str, str] = {}
    try:
        for name in methods:
            try:
                samplers[name] = make_sampling(name, decoder, seeds, seed, sampler=sampler, client=client,
                                               flashinfer=flashinfer, remote_form=remote_form, probe_iters=probe_iters,
                                               prompt_len=prompt_len)
            except Exception as err:  # noqa: BLE001 - recorded in the results, the other methods run
                skipped[name] = f"{type(err).__name__}: {err}"[:300]
                print(f"e2e B={batch} {name} skipped: {skipped[name]}", flush=True)
        step0 = step0_distribution(decoder.logits)
        clock = StepClock(steps, device)
        runs: dict[str, list[Run]] = {name: [] for name in samplers}
        for repeat in range(repeats + 1):
            for name, method in samplers.items():
                run = decode(decoder, method, prompt, steps, clock)
                if repeat:
                    runs[name].append(run)
    finally:
        for method in samplers.values():
            method.close()
    layers = model.config.num_hidden_layers
    rows = {name: summarize(name, samplers[name], done, batch, layers, decoder.forward) for name, done in runs.items()}
    tokens = {name: done[0].tokens for name, done in runs.items()}
    compare(rows, tokens)
    for row in rows.values():
        print(f"e2e {layers:3d} layers B={batch:3d} {row['method']:30s} {row['tokens_per_s']:10.1f} tokens/s  "
              f"step p50 {row['step_p50_us']:9.1f} us  p99 {row['step_p99_us']:9.1f} us", flush=True)
    return Case(rows=list(rows.values()), tokens=tokens, step0=step0, skipped=skipped)


def import_flashinfer(meta: dict[str, Any], device: torch.device) -> ModuleType | None:
    """flashinfer.sampling, or None; meta["flashinfer"] records which."""
    if device.type != "cuda":
        meta["flashinfer"] = "not run: no GPU"
        return None
    try:
        import flashinfer
        import flashinfer.sampling
    except Exception as err:  # noqa: BLE001 - recorded in the results, the run goes on without its rows
        meta["flashinfer"] = f"unavailable, rows skipped: {type(err).__name__}: {err}"[:300]
        return None
    meta["flashinfer"] = f"imported {getattr(flashinfer, '__version__', '')}".strip()
    return flashinfer.sampling


def describe(args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
             shapes: dict[str, int]) -> dict[str, Any]:
    """The run's meta: provenance, model, parameters, and how each thing was done and timed."""
    return {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu{os.cpu_count()}",
        "device": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
        "grpc": grpc.__version__, "commit": tree_commit(), "date": datetime.date.today().isoformat(),
        "cpus": os.cpu_count(), "V": shapes["vocab_size"],
        "model": {"class": "LlamaForCausalLM", **shapes, "layers": args.layers,
                  "dtype": str(dtype).removeprefix("torch."),
                  "attention": "sdpa", "weights": f"random, made on the device: N(0, {WEIGHT_STD}^2), norms 1, "
                  f"lm_head N(0, ({LOGIT_STD}/sqrt(hidden_size))^2): the final norm's unit-RMS output gives "
                  f"logits of std ~{LOGIT_STD} (step0_distribution: what the filters keep)"},
        "prompt": args.prompt, "steps": args.steps, "repeats": args.repeats, "params": PARAMS,
        "seeds": "tokensampler: row r has seed --seed * B + r, the token's position (prompt + step) as Philox "
                 "position; torch and flashinfer: one generator for the batch, seeded --seed at each run",
        "forward": "one decode step (static KV cache; mask and positions built inside the step from device tensors) "
                   "captured as a CUDA graph, with the LM head for the logits methods and without it for the "
                   "hidden-state ones, checked against the eager step; prefill eager. A row's `forward` is "
                   "'eager (why)' where capture failed, and always on the CPU",
        "logits": "the LM head's output upcast to a float32 [B, V] buffer inside the step, as generate does",
        "tokens_to_host": "every step; tokens on the GPU (torch, flashinfer): non-blocking copy to pinned memory + "
                          "an event, read one step later; tokensampler returns them on the host, and they go back "
                          "to the GPU as the next input",
        "timing": "step_p50_us/step_p99_us: percentiles of one run's step times, CUDA events recorded on the model's "
                  "stream at each step's start (forward, sampling, token copies and the gaps host waits leave; "
                  "the host clock on the CPU); tokens_per_s: B * steps over the run's host wall time, synchronised "
                  "before and after; each value the median over the runs, *_range min and max; every method's "
                  "first run a warm-up, not counted; the methods' runs interleaved",
        "remote": {"server": "python -m tokensampler_server --device <device> --allow-cuda-ipc --allow-shm, a "
                             "subprocess; the client on its Unix socket",
                   "buffers": "the step's logits or hidden states in a CUDA IPC region registered once with a ready "
                              "event recorded after each forward (shared memory, copied each step, on the CPU); "
                              "lm_head.weight registered from a region in place",
                   "form": f"{args.remote_form}: auto times {args.probe_iters} calls of a SampleStream kept open and "
                           "of unary Sample on the buffer at each B and kind and takes the faster (rows: "
                           "remote_form, remote_form_probe_p50_us)"},
        "overhead": "remote_overhead_us: the remote row's step p50 minus the in-process row's of the same input kind",
        "step0_distribution": {},
        "skipped": {},
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(part) for part in text.split(",")]

    def names(text: str) -> list[str]:
        chosen = text.split(",")
        unknown = sorted(set(chosen) - set(METHODS))
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown methods {unknown}; expected some of {','.join(METHODS)}")
        return chosen

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=ints, default=[32, 4], help="model depths, one model each")
    parser.add_argument("--batch-sizes", type=ints, default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=128, help="decode steps a run")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--repeats", type=int, default=5, help="counted runs of each method, after one warm-up run")
    parser.add_argument("--methods", type=names, default=list(METHODS))
    parser.add_argument("--remote-form", choices=("auto", "stream", "unary"), default="auto")
    parser.add_argument("--probe-iters", type=int, default=30, help="calls timed per form when picking one")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--small", action="store_true", help=f"a tiny model ({SMALL}) for a quick check")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> Path:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = SMALL if args.small else LLAMA3_8B
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # a CPU's bf16 matmuls are a check's bottleneck
    meta = describe(args, device, dtype, shapes)
    meta["mps"] = mps_state() if device.type == "cuda" else "no GPU"
    methods = list(args.methods)
    flashinfer = import_flashinfer(meta, device) if "flashinfer" in methods else None
    if flashinfer is None and "flashinfer" in methods:
        methods.remove("flashinfer")
    in_process = ("tokensampler_inprocess_", "tokensampler_graph_")
    sampler = LocalSampler(device.type) if any(m.startswith(in_process) for m in methods) else None
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tokensampler-e2e-") as tmp:
        server = client = None
        if any(m.startswith(REMOTE_PREFIXES) for m in methods):
            # The server imports this tree's packages, as this process does.
            path = os.pathsep.join([str(ROOT / "server"), str(ROOT / "client"), os.environ.get("PYTHONPATH", "")])
            socket = Path(tmp) / "ts.sock"
            server, _ = start([sys.executable, "-m", "tokensampler_server", "--host", "127.0.0.1", "--port", "0",
                               "--device", device.type, "--no-metrics", "--allow-shm", "--allow-cuda-ipc",
                               "--uds", str(socket)], re.compile(r"tokensampler serving on .*:(\d+)"),
                              env={**os.environ, "PYTHONPATH": path})
            client = SamplerClient(f"unix://{socket}", timeout=600)
        try:
            for layers in args.layers:
                model = build_model(llama_config(layers, shapes), device, dtype, args.seed)
                for batch in args.batch_sizes:
                    case = run_case(model, batch, args.prompt, args.steps, args.repeats, methods, sampler=sampler,
                                    client=client, flashinfer=flashinfer, remote_form=args.remote_form,
                                    seed=args.seed, probe_iters=args.probe_iters)
                    rows += case.rows
                    meta["step0_distribution"][f"{layers} layers, B={batch}"] = case.step0
                    if case.skipped:
                        meta["skipped"][f"{layers} layers, B={batch}"] = case.skipped
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            if client is not None:
                client.close()
            if server is not None:
                server.terminate()
                server.wait(30)
    # A run under MPS (every process a client of one daemon: what a colocated loop is deployed with) is its own file.
    workload = "e2e-mps" if meta["mps"] == "active" else "e2e"
    return write_results(args.out, workload, meta, rows, plot_value="step_p50_us")


if __name__ == "__main__":
    main()
