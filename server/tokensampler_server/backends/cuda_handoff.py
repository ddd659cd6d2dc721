"""The server's side of a colocated loop on the GPU (docs/colocated.md): each announced step queued on the
loop's own stream, with no host work between the engine's "input ready" and its "tokens done".

Step n, in stream order:
1. the rows' positions set to the loop's base + n - 1 (before the wait: off the critical path);
2. wait until READY >= n (cuStreamWaitValue32 on the flags' mapped page);
3. the engine's input copied into the loop's own buffer if READY still holds n (csrc/handoff.h);
4. the prepared call on that buffer (backends/cuda_prepared.py; for hidden states cuda_prepared_hidden.py, or the
   head's product first where the fused kernel does not take the call);
5. the tokens and log-probs written into the engine's output, then RELEASE = n, if READY still holds n.
The engine's memory is read and written only while READY holds n and the loop's stop word (pinned host memory of
the server's) is 0. To end a loop the server's CPU sets the stop word, then writes ABORT into READY (through the
flags' file, and by a stream of its own), which ends the wait of step 2: no kernel of the loop touches the
engine's memory after that, however late the GPU runs it. An engine that has exited leaves memory whose access would
fault the server's GPU context.
"""

from __future__ import annotations

import time

import torch
from tokensampler_client.handoff import ABORT, READY_OFFSET, RELEASE_OFFSET, StreamMemOps

from tokensampler_server.backends.base import PreparedSampling
from tokensampler_server.backends.cuda_build import load_kernels
from tokensampler_server.backends.cuda_streams import exclusive_stream, give_back
from tokensampler_server.resources.flags import MappedFlags

__all__ = ["Handoff", "load_libraries"]


class Handoff:
    """Queues the steps of one loop on `device`: the engine's `source` ([B, V] logits, or [B, D] hidden states of a
    call prepared with a head) sampled by `prepared` into the engine's `tokens` (int32 or int64 [B, S]) and
    `logprobs` (float32 [B, S] or None), with `flags`."""

    def __init__(self, device: torch.device, prepared: PreparedSampling, source: torch.Tensor, tokens: torch.Tensor,
                 logprobs: torch.Tensor | None, flags: MappedFlags) -> None:
        self._module = load_kernels(device.index or 0)
        self._ops = StreamMemOps.get()
        self._prepared = prepared
        self._source = source
        self._tokens = tokens
        self._logprobs = logprobs
        self._flags = flags
        self._ready, self._release = flags.device_address + READY_OFFSET, flags.device_address + RELEASE_OFFSET
        # Streams no other loop shares: a shared one would queue this loop's steps behind another's wait.
        self.stream = exclusive_stream(device)
        self._abort_stream = exclusive_stream(device)  # never blocked: what ends a wait of `stream`
        self._streams_held = True
        try:
            # Pinned, so mapped for the GPU (unified addressing): the CPU's store is what every later gate reads.
            self._stop = torch.zeros(1, dtype=torch.int32, pin_memory=True)
            with torch.cuda.stream(self.stream):
                self._input = torch.empty_like(source)
                self._verdict = torch.zeros(1, dtype=torch.int32, device=device)  # the copy's gate, read once a step
                self._base_position = prepared.position.clone()
        except BaseException:
            self.release()
            raise

    def enqueue(self, step: int) -> torch.cuda.Event:
        """Queues step `step` (1 <= step < ABORT); the event is recorded once its tokens are delivered (or skipped,
        after an abort)."""
        stream = self.stream
        raw = stream.cuda_stream
        with torch.cuda.stream(stream):
            torch.add(self._base_position, step - 1, out=self._prepared.position)
            self._ops.wait_at_least(raw, self._ready, step)
            stop = self._stop.data_ptr()
            self._module.gated_copy(self._source.data_ptr(), self._input.data_ptr(),
                                    self._input.numel() * self._input.element_size(), self._ready, stop, step,
                                    self._verdict.data_ptr(), raw)
            result = self._prepared.sample(self._input)
            logprobs = result.logprobs if self._logprobs is not None else None
            self._module.deliver(result.tokens.data_ptr(), result.tokens.numel(), self._tokens.data_ptr(),
                                 self._tokens.dtype == torch.int64, 0 if logprobs is None else logprobs.data_ptr(),
                                 0 if logprobs is None else self._logprobs.data_ptr(), self._ready, stop, step,
                                 self._release, raw)
            done = torch.cuda.Event(blocking=True)  # its waiter sleeps instead of spinning a core
            done.record(stream)
        return done

    def abort(self) -> None:
        """Ends the wait of every queued step: from here on no queued kernel reads or writes the engine's memory."""
        self._stop[0] = 1
        self._flags.abort()
        self._ops.write(self._abort_stream.cuda_stream, self._ready, ABORT)  # where the file no longer reaches

    def drain(self, timeout_s: float) -> bool:
        """Whether every queued step is done within `timeout_s` (after an abort: at once, up to the kernels in
        flight); polled, so a wait that never ends leaves this thread free. Once drained the loop's streams are let
        go."""
        deadline = time.monotonic() + timeout_s
        while not (self.stream.query() and self._abort_stream.query()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        self.release()
        return True

    def release(self) -> None:
        """Lets other loops have the streams once they have drained (streams with work queued stay held)."""
        if self._streams_held and self.stream.query() and self._abort_stream.query():
            self._streams_held = False
            give_back(self.stream, self._abort_stream)


def load_libraries(device: torch.device) -> None:
    """Loads the libraries a loop's step and the calls beside it open on first use (cuBLAS and cuBLASLt, through one
    small product of each dtype a head takes): loading one waits for every stream of the context, a loop's stream
    waiting on its engine included. Run before any loop."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.ones(8, 64, dtype=dtype, device=device)
        torch.nn.functional.linear(x, x)
    torch.cuda.synchronize(device)
