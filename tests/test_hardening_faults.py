"""Faults injected into a real server: callers that leave mid-batch, SIGTERM under load with client
failover, weights and regions unregistered while requests use them. Every response that arrives is
checked against the tokens its request gets alone; every failure must carry its precise status.

(GPU out of memory and the exit of a CUDA IPC producer need a GPU: tests/gpu/ covers those.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import signal
import threading
import time
from collections.abc import Callable

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokensampler_client import Backoff, SamplerClient, TokenSamplerError
from tokensampler_client._proto import sampler_pb2 as pb
from tokensampler_client._proto import sampler_pb2_grpc as pb_grpc
from tokensampler_client.params import build_sample_request
from tokensampler_client.result import SampleResult
from tokensampler_server.backends.cpu import CpuBackend
from tokensampler_server.core.config import Limits
from tokensampler_server.validation.sample import validate_sample_request
from tokensampler_server.resources.weights import LogitsFinish, RegisteredWeight

from .conftest import RunningServer, start_server
from .gated_server import GATE_SEED, ServerGate
from .polling import wait_until, wait_until_async
from .test_hardening_load import check, mixed_request
from .test_metrics import metrics_port, parse_samples, scrape_text, value

SAMPLE = "tokensampler.v1.Sampler/Sample"


def _samples(server: RunningServer) -> dict:
    return parse_samples(scrape_text(metrics_port(server)))


def _queue_depth(server: RunningServer) -> float | None:
    return value(_samples(server), "tokensampler_queue_depth")


def test_callers_that_leave_mid_batch_lose_only_their_own_rows() -> None:
    """8 requests wait behind a batch the backend holds: 2 cancel and 2 pass their deadline there; then a
    batching window of 1 s gathers the other 4 into one batch, and 1 cancels while that batch is in the
    backend. The 3 that stay get their own tokens; the rows of the ones gone before the batch are never
    sampled."""
    gate = ServerGate()
    running = start_server("--device", "cpu", "--max-queue-delay-us", "1000000", gate=gate)
    rng = random.Random(3)
    # One vocabulary size and options, so that all can share one batch.
    requests = []
    for _ in range(8):
        rows = rng.randint(4, 12)
        requests.append(build_sample_request(torch.randn(rows, 1000), top_p=0.9, temperature=rng.choice([0.5, 1.0]),
                                             seed=[rng.randrange(2**64) for _ in range(rows)]))
    stay, cancel_early, expire, cancel_late = requests[:3], requests[3:5], requests[5:7], requests[7:]
    stay[0].params.seed[0] = GATE_SEED  # the batch of those that stay is held too: the late cancel lands in it
    blocker = build_sample_request(torch.randn(2, 1000), seed=[GATE_SEED, 1])
    stayed, late = (sum(r.logits.shape[0] for r in group) for group in (stay, cancel_late))

    def queued(count: int) -> Callable[[], bool]:
        return lambda: _queue_depth(running) == count

    async def run() -> tuple[int, dict[int, tuple[grpc.StatusCode, pb.SampleResponse | None]]]:
        async with grpc.aio.insecure_channel(running.target) as channel:
            stub = pb_grpc.SamplerStub(channel)
            blocking = stub.Sample(blocker, timeout=60)
            await asyncio.to_thread(gate.wait_held)  # the backend is busy: the requests below all queue
            calls = {id(r): stub.Sample(r, timeout=60) for r in stay + cancel_early + cancel_late}
            await wait_until_async(queued(6), "6 requests queued behind the held batch")
            # Their deadline passes while they are queued: far beyond the time two small requests take to arrive.
            calls.update({id(r): stub.Sample(r, timeout=3) for r in expire})
            await wait_until_async(queued(8), "all 8 requests queued behind the held batch")
            for request in cancel_early:
                calls[id(request)].cancel()
            for request in expire:
                assert await calls[id(request)].code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await wait_until_async(queued(4), "the 4 callers gone from the queue, the 4 others still in it")
            gate.release()  # the window opens for the 4 left
            batch_rows = await asyncio.to_thread(gate.wait_held)
            for request in cancel_late:  # while the batch holding its rows is in the backend
                calls[id(request)].cancel()
            gate.release()
            await blocking
            outcomes = {}
            for request in requests:
                try:
                    outcomes[id(request)] = (grpc.StatusCode.OK, await calls[id(request)])
                except asyncio.CancelledError:
                    outcomes[id(request)] = (grpc.StatusCode.CANCELLED, None)
                except grpc.aio.AioRpcError as err:
                    outcomes[id(request)] = (err.code(), None)
            return batch_rows, outcomes

    try:
        batch_rows, outcomes = asyncio.run(run())
        assert batch_rows == stayed + late  # the gone callers' rows were dropped before the batch formed
        for request in stay:
            code, response = outcomes[id(request)]
            assert code == grpc.StatusCode.OK
            check(request, SampleResult.from_response(response))
        assert all(outcomes[id(r)][0] == grpc.StatusCode.CANCELLED for r in cancel_early)
        assert all(outcomes[id(r)][0] == grpc.StatusCode.DEADLINE_EXCEEDED for r in expire)
        # Had the batch finished before the late cancel, that call would have its answer: either is right.
        late_code = outcomes[id(cancel_late[0])][0]
        assert late_code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.OK)
        # The rows of the callers gone before the batch never reached the backend: it sampled the
        # blocker's, then those that stayed and the late one's.
        sampled = value(_samples(running), "tokensampler_batch_rows_sum")
        assert sampled == blocker.logits.shape[0] + stayed + late, (sampled, stayed, late)
        print(f"\nmid-batch: {stayed} rows served, {late} rows computed for a caller that left ({late_code.name}), "
              f"{sum(r.logits.shape[0] for r in cancel_early + expire)} rows dropped before the batch")
        request = mixed_request(rng)
        with SamplerClient(running.target, timeout=30) as client:
            check(request, client.sample_request(request))
    finally:
        running.stop()


def test_sigterm_under_load_drains_and_the_client_fails_over() -> None:
    """Two replicas, load on the first through a client that lists both. At SIGTERM the first turns
    NOT_SERVING at once (while a call is still held in its backend), its in-flight calls complete, new
    calls get UNAVAILABLE, it exits 0, and the load moves to the second without a single failed or wrong
    answer."""
    gate = ServerGate()
    first = start_server("--device", "cpu", "--grace-period-s", "30", gate=gate)
    second = start_server("--device", "cpu")
    statuses: list[tuple[float, str]] = []
    results: list[tuple[pb.SampleRequest, SampleResult]] = []
    errors: list[BaseException] = []
    stop = threading.Event()
    try:
        with grpc.insecure_channel(first.target) as watch_channel:
            watch = health_pb2_grpc.HealthStub(watch_channel).Watch(health_pb2.HealthCheckRequest(service=""))

            def read_watch() -> None:
                try:
                    for update in watch:
                        statuses.append((time.monotonic(), health_pb2.HealthCheckResponse.ServingStatus.Name(update.status)))
                except grpc.RpcError:
                    pass  # cancelled below

            def load(index: int) -> None:
                rng = random.Random(100 + index)
                targets = [first.target, second.target]
                with SamplerClient(targets, timeout=60, retries=20, backoff=Backoff(initial=0.02, maximum=0.5)) as client:
                    while not stop.is_set():
                        request = mixed_request(rng)
                        try:
                            results.append((request, client.sample_request(request)))
                        except TokenSamplerError as err:
                            errors.append(err)

            watcher = threading.Thread(target=read_watch)
            watcher.start()
            wait_until(lambda: statuses and statuses[-1][1] == "SERVING", "the first replica SERVING")
            with SamplerClient(first.target, timeout=60) as direct:
                slow_request = build_sample_request(torch.randn(64, 1000), top_p=0.9, seed=[GATE_SEED, *range(1, 64)])
                slow: list[SampleResult] = []
                in_flight = threading.Thread(target=lambda: slow.append(direct.sample_request(slow_request)))
                loaders = [threading.Thread(target=load, args=(i,)) for i in range(4)]
                for thread in loaders:
                    thread.start()
                wait_until(lambda: len(results) >= 50, "50 answers under load")
                in_flight.start()
                with gate.holding():  # the slow request is in the first replica's backend until the block ends
                    before_sigterm = len(results)
                    signalled = time.monotonic()
                    first.process.send_signal(signal.SIGTERM)
                    wait_until(lambda: statuses[-1][1] == "NOT_SERVING", "NOT_SERVING after SIGTERM")
                    not_serving_after = statuses[-1][0] - signalled
                    watch.cancel()  # an open Watch would hold the draining server for its whole grace period

                    # New calls to the draining replica are refused.
                    with grpc.insecure_channel(first.target) as fresh:
                        with pytest.raises(grpc.RpcError) as refused:
                            pb_grpc.SamplerStub(fresh).Sample(mixed_request(random.Random(1)), timeout=10)
                        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                    assert in_flight.is_alive() and not slow and first.process.poll() is None  # still draining

                in_flight.join(120)
                assert first.process.wait(timeout=60) == 0
                # The answers counted after the signal include the first replica's drained calls: the second's
                # own count says the load has moved.
                wait_until(lambda: len(results) >= before_sigterm + 100
                           and (value(_samples(second), "tokensampler_requests_total", method=SAMPLE, code="OK")
                                or 0) >= 100, "100 answers after SIGTERM, 100 of them the second's")
                stop.set()
                for thread in loaders:
                    thread.join(60)
            watcher.join(10)
        assert slow and slow[0].tokens.shape == (64, 1)  # in flight at SIGTERM: completed
        check(slow_request, slow[0])
        assert not errors, errors[:3]
        for request, result in results:
            check(request, result)
        served_by_second = value(_samples(second), "tokensampler_requests_total", method=SAMPLE, code="OK")
        assert served_by_second and served_by_second >= 100
        print(f"\nsigterm: NOT_SERVING {not_serving_after * 1e3:.0f} ms after the signal; {len(results)} requests "
              f"checked ({before_sigterm} before, {served_by_second:.0f} served by the second replica), 0 errors")
    finally:
        stop.set()
        first.stop()
        second.stop()


Make = Callable[[random.Random, bool], tuple[pb.SampleRequest, Callable]]
"""A request that uses the item under test, and how to check its answer; held in the backend when asked."""


def _under_load(server: RunningServer, client: SamplerClient, make: Make, listed: Callable[[], list],
                remove: Callable[[], None]) -> tuple[int, list[str]]:
    """Four threads sample while `remove()` runs, and a request holds the item in the backend meanwhile:
    the item is gone for new requests at once, and remove() returns only once that request let it go.
    `listed()` gives the items registered (with their in_flight). Returns (answers checked, details of NOT_FOUND)."""
    checked: list[int] = []
    not_found: list[str] = []
    unexpected: list[BaseException] = []
    removed = threading.Event()

    def loop(index: int) -> None:
        rng = random.Random(index)
        misses_after_removal = 0
        while misses_after_removal < 3:
            request, verify = make(rng, False)
            try:
                verify(request, client.sample_request(request))
                checked.append(1)
            except TokenSamplerError as err:
                if err.code != grpc.StatusCode.NOT_FOUND:
                    unexpected.append(err)
                    return
                not_found.append(err.details)
                misses_after_removal += removed.is_set()
            except AssertionError as err:
                unexpected.append(err)
                return

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(checked) >= 20, "20 answers under load")
    held_request, verify_held = make(random.Random(99), True)
    held: list[SampleResult] = []
    holder = threading.Thread(target=lambda: held.append(client.sample_request(held_request)))
    holder.start()
    assert server.gate is not None
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with server.gate.holding():
            in_flight = [item.in_flight for item in listed()]
            assert in_flight and in_flight[0] >= 1, in_flight  # the held request uses the item
            removing = pool.submit(remove)
            wait_until(lambda: not listed(), "the item gone for new requests")
            assert not removing.done() and holder.is_alive()  # the removal waits for the request using it
        removing.result(60)
    removed.set()
    holder.join(60)
    for thread in threads:
        thread.join(60)
    assert not unexpected, unexpected[:3]
    assert held, "the request that used the item while it was removed got no answer"
    verify_held(held_request, held[0])
    return len(checked), not_found


def test_weights_unregistered_under_load_give_not_found_then_recover(shm_server: RunningServer) -> None:
    weight = torch.randn(512, 32, generator=torch.Generator().manual_seed(0))
    entry = RegisteredWeight("head", weight, LogitsFinish(vocab_size=512), sha256="")
    reference = CpuBackend()

    def make(rng: random.Random, gated: bool = False) -> tuple[pb.SampleRequest, Callable]:
        rows = rng.randint(1, 4)
        seeds = [rng.randrange(2**63) for _ in range(rows)]
        if gated:
            seeds[0] = GATE_SEED
        request = build_sample_request(hidden=torch.randn(rows, 32), weights="head", top_k=20, seed=seeds)

        def verify(request: pb.SampleRequest, result: SampleResult) -> None:
            batch, _ = validate_sample_request(request, Limits(), lm_head=entry)
            assert torch.equal(result.tokens, reference.sample(batch.with_logits()).tokens.long())

        return request, verify

    with SamplerClient(shm_server.target, timeout=60) as client:
        client.register_weights("head", weight)
        checked, not_found = _under_load(shm_server, client, make, client.list_weights,
                                         lambda: client.unregister_weights("head"))
        assert not_found and all(d.startswith("hidden.weights:") for d in not_found), not_found[:3]
        assert client.list_weights() == []
        client.register_weights("head", weight)  # the same name again: the server recovered
        request, verify = make(random.Random(9))
        verify(request, client.sample_request(request))
        client.unregister_weights("head")
    print(f"\nweights removed under load: {checked} answers checked, {len(not_found)} NOT_FOUND")


def test_region_unregistered_under_load_gives_not_found_then_recovers(shm_server: RunningServer) -> None:
    rows, vocab = 4, 1000
    with SamplerClient(shm_server.target, timeout=60) as client:
        region = client.register_shm_region("logits", rows * vocab * 4)
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
        region.tensor(torch.float32, (rows, vocab)).copy_(logits)

        def make(rng: random.Random, gated: bool = False) -> tuple[pb.SampleRequest, Callable]:
            seeds = [rng.randrange(2**63) for _ in range(rows)]
            if gated:
                seeds[0] = GATE_SEED
            request = build_sample_request(region.view(torch.float32, (rows, vocab)), top_p=0.9, seed=seeds)
            twin = build_sample_request(logits, top_p=0.9, seed=seeds)  # the same rows on the wire
            return request, lambda _, result: check(twin, result)

        try:
            checked, not_found = _under_load(shm_server, client, make, client.list_regions,
                                             lambda: client.unregister_region("logits"))
        finally:
            region.release()
        assert not_found and all(d.startswith("logits_ref.region:") for d in not_found), not_found[:3]
        assert client.list_regions() == []
        again = client.register_shm_region("logits", rows * vocab * 4)  # recovered: the name is free again
        try:
            again.tensor(torch.float32, (rows, vocab)).copy_(logits)
            request, verify = make(random.Random(5))
            verify(request, client.sample_request(request))
        finally:
            client.unregister_region(again)
    print(f"\nregion removed under load: {checked} answers checked, {len(not_found)} NOT_FOUND")
