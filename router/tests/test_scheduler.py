"""The batching loop against a fake worker: admission, budgets, continuous batching, cancellation, failures."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fake_worker import FakeClient

from specula_router.block_allocator import BlockAllocator
from specula_router.metrics import Metrics
from specula_router.requests import SamplingParameters, StoppingParameters, ValidGenerateRequest
from specula_router.scheduler import (
    ErrorEvent, FinalEvent, Scheduler, SchedulerConfig, ShardUnresponsive, TokensEvent,
)


def make_request(prompt_len: int = 4, max_new: int = 3) -> ValidGenerateRequest:
    return ValidGenerateRequest(
        inputs="x", input_ids=tuple(range(prompt_len)),
        sampling=SamplingParameters(False, 1.0, 0, 1.0, 1.0, 1.0, 0.0, 0.0, seed=5),
        stopping=StoppingParameters(max_new, (), False), truncate=None, decoder_input_details=False,
        details=True, return_full_text=False, top_n_tokens=0, best_of=1,
    )


def make_scheduler(num_blocks=64, block_size=4, step_delay=0.0, prefix_caching=False, **config):
    client = FakeClient(step_delay)
    config = SchedulerConfig(**{"max_batch_prefill_tokens": 64, **config})
    allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
    return Scheduler(client, allocator, config, Metrics()), client


async def drain(entry) -> list:
    events = []
    while True:
        event = await asyncio.wait_for(entry.events.get(), timeout=5)
        events.append(event)
        if isinstance(event, TokensEvent) and event.final is not None:
            events.append(event.final)  # the last tokens and the end of the request arrive together
            return events
        if isinstance(event, (FinalEvent, ErrorEvent)):
            return events


def run(coro):
    return asyncio.run(coro)


def test_requests_complete_and_blocks_return():
    async def body():
        scheduler, client = make_scheduler()
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(max_new=n)) for n in (3, 1, 5)]
        results = [await drain(e) for e in entries]
        loop.cancel()
        for events, n in zip(results, (3, 1, 5)):
            tokens = [t for e in events if isinstance(e, TokensEvent) for t in e.tokens]
            assert len(tokens) == n and events[-1].generated_tokens == n
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.running
    run(body())


def test_newcomers_join_the_running_batch_without_waiting_for_it():
    async def body():
        scheduler, client = make_scheduler(step_delay=0.01, waiting_served_ratio=0.0)
        loop = asyncio.create_task(scheduler.run())
        long = scheduler.submit(make_request(max_new=30))
        await asyncio.sleep(0.05)
        short = scheduler.submit(make_request(max_new=2))
        await drain(short)
        assert long.state.name == "RUNNING"  # the short one finished while the long one ran
        decodes_with_both = [c for kind, c in client.calls if kind == "decoded" and set(c) == {long.id, short.id}]
        assert decodes_with_both
        await drain(long)
        loop.cancel()
    run(body())


def test_kv_budget_admits_fifo_and_exactly():
    async def body():
        # 4 blocks of 4 tokens: a request of 4 + 4 tokens takes 2 blocks, so only two fit at once.
        scheduler, client = make_scheduler(num_blocks=4, block_size=4, step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(prompt_len=4, max_new=4)) for _ in range(3)]
        await asyncio.sleep(0.02)
        assert [e.state.name for e in entries] == ["RUNNING", "RUNNING", "QUEUED"]
        for e in entries:
            await drain(e)
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 4
        prefills = [ids for kind, ids in client.calls if kind == "prefill"]
        assert prefills == [[0, 1], [2]]
    run(body())


def test_lookahead_is_reserved():
    scheduler, _ = make_scheduler(num_blocks=8, block_size=4, lookahead=3)
    entry = scheduler.submit(make_request(prompt_len=4, max_new=4))
    assert scheduler.admission.first().batch == [entry]
    assert len(entry.blocks) == 3  # 4 + 4 + 3 = 11 positions -> 3 blocks


def test_prefill_token_limit_splits_batches():
    scheduler, _ = make_scheduler(max_batch_prefill_tokens=10)
    entries = [scheduler.submit(make_request(prompt_len=4)) for _ in range(3)]
    assert scheduler.admission.first().batch == entries[:2]
    assert scheduler.admission.first().batch == entries[2:]


def test_min_size_holds_back_a_too_small_batch():
    scheduler, _ = make_scheduler()
    scheduler.submit(make_request())
    assert not scheduler.admission.more(num_running=2, waiting_steps=1)  # 1 waiting < floor(2 * 1.2)
    assert scheduler.allocator.num_free_blocks == 64 and len(scheduler.queue) == 1
    assert scheduler.admission.more(num_running=2, waiting_steps=20).batch  # it waited max_waiting_tokens steps


def test_cancelled_request_is_filtered_within_one_step():
    async def body():
        scheduler, client = make_scheduler(step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        keep = scheduler.submit(make_request(max_new=20))
        gone = scheduler.submit(make_request(max_new=20))
        await asyncio.sleep(0.05)
        scheduler.cancel(gone)
        steps_before = len(client.calls)
        await asyncio.sleep(0.05)
        filters = [ids for kind, ids in client.calls[steps_before:] if kind == "filter"]
        assert filters and filters[0] == [keep.id]
        assert gone.id not in scheduler.running
        await drain(keep)
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64
    run(body())


def test_queued_request_cancelled_before_admission():
    scheduler, _ = make_scheduler()
    entry = scheduler.submit(make_request())
    scheduler.cancel(entry)
    assert not scheduler.queue and not scheduler.admission.first()


@pytest.mark.parametrize("method", ["prefill", "decode"])
def test_worker_failure_fails_only_that_step_and_frees_blocks(method):
    async def body():
        scheduler, client = make_scheduler()
        loop = asyncio.create_task(scheduler.run())
        client.fail_next = method
        failed = scheduler.submit(make_request(max_new=4))
        events = await drain(failed)
        assert isinstance(events[-1], ErrorEvent) and "shard exploded" in events[-1].message
        ok = scheduler.submit(make_request(max_new=2))  # the server keeps serving
        assert isinstance((await drain(ok))[-1], FinalEvent)
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64
    run(body())


@pytest.mark.parametrize("depth", [1, 2])
def test_pipeline_depth_changes_no_output(depth):
    async def body():
        scheduler, client = make_scheduler(pipeline_depth=depth, step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(max_new=n)) for n in (5, 2, 7)]
        texts = [(await drain(e))[-1].generated_text for e in entries]
        loop.cancel()
        assert texts == ["".join(f"t{i} " for i in range(n)) for n in (5, 2, 7)]
        assert scheduler.allocator.num_free_blocks == 64
        return client.calls

    calls = run(body())
    kinds = [kind for kind, _ in calls]
    first_result = kinds.index("decoded")
    # With depth 2 the second Decode is on its way before the first one's result is processed.
    assert kinds[:first_result].count("decode") == depth


def test_pipelined_decode_of_a_batch_that_just_ended_is_harmless():
    async def body():
        scheduler, client = make_scheduler(pipeline_depth=2)
        loop = asyncio.create_task(scheduler.run())
        entry = scheduler.submit(make_request(max_new=2))  # ends in the first decode step
        events = await drain(entry)
        await asyncio.sleep(0.01)
        loop.cancel()
        assert events[-1].generated_tokens == 2 and not scheduler.running
        assert ("decode", [0]) in client.calls and client.batches == {}
    run(body())


# --- one request, one failure: the loop goes on ------------------------------------------------------------


def _tokens_of(events) -> list[int]:
    return [t.id for e in events if isinstance(e, TokensEvent) for t in e.tokens]


def test_a_request_the_wire_cannot_hold_fails_alone_and_the_loop_goes_on():
    """top_k = 2**32 does not fit the proto's uint32: building the Prefill raised and ended the loop."""
    async def body():
        scheduler, client = make_scheduler()
        loop = asyncio.create_task(scheduler.run())
        bad = make_request()
        bad = dataclasses.replace(bad, sampling=dataclasses.replace(bad.sampling, top_k=2**32))
        entries = [scheduler.submit(make_request(max_new=3)), scheduler.submit(bad),
                   scheduler.submit(make_request(max_new=2))]
        results = [await drain(e) for e in entries]
        assert isinstance(results[1][-1], ErrorEvent) and results[1][-1].status == 422
        assert "4294967296" in results[1][-1].message  # protobuf names the value it could not hold
        assert [len(_tokens_of(r)) for r in (results[0], results[2])] == [3, 2]
        later = scheduler.submit(make_request(max_new=2))
        assert isinstance((await drain(later))[-1], FinalEvent)
        assert not loop.done()
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.running
    run(body())


def test_an_error_delivering_one_result_fails_that_request_only():
    async def body():
        scheduler, client = make_scheduler(step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        good, bad = scheduler.submit(make_request(max_new=6)), scheduler.submit(make_request(max_new=6))
        deliver = scheduler._deliver

        def flaky(generation):
            if generation.request_id == bad.id and scheduler.running[bad.id].num_generated == 2:
                raise RuntimeError("cannot encode this token")
            deliver(generation)

        scheduler._deliver = flaky
        bad_events, good_events = await drain(bad), await drain(good)
        assert isinstance(bad_events[-1], ErrorEvent) and bad_events[-1].status == 500
        assert "cannot encode this token" in bad_events[-1].message
        assert len(_tokens_of(bad_events)) == 2  # what it had before the failure, nothing after
        assert _tokens_of(good_events) == [1000 * good.id + k for k in range(6)]
        await asyncio.sleep(0.02)
        loop.cancel()
        # It left the workers' batch before its blocks were freed.
        assert any(kind == "filter" and ids == [good.id] for kind, ids in client.calls)
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.running
    run(body())


@pytest.mark.parametrize("method", ["prefill", "decode"])
def test_an_unexpected_error_in_a_step_fails_its_requests_and_the_loop_goes_on(method):
    async def body():
        scheduler, client = make_scheduler()
        loop = asyncio.create_task(scheduler.run())
        client.raise_next = (method, RuntimeError("unexpected"))
        failed = scheduler.submit(make_request(max_new=4))
        events = await drain(failed)
        assert isinstance(events[-1], ErrorEvent) and events[-1].status == 500
        assert "unexpected" in events[-1].message
        ok = scheduler.submit(make_request(max_new=2))
        assert isinstance((await drain(ok))[-1], FinalEvent)
        assert not loop.done()
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64
        assert ("clear", None) in client.calls  # the workers' batches were dropped with the requests
    run(body())


def test_a_request_the_worker_fails_alone_ends_with_its_error_and_its_neighbours_go_on():
    async def body():
        scheduler, client = make_scheduler(step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(max_new=5)) for _ in range(3)]
        await asyncio.sleep(0.005)
        client.failing_rows.add(entries[1].id)
        results = [await drain(e) for e in entries]
        assert isinstance(results[1][-1], ErrorEvent) and results[1][-1].status == 424
        assert "non-finite" in results[1][-1].message
        for entry, events in zip(entries[::2], results[::2]):
            assert _tokens_of(events) == [1000 * entry.id + k for k in range(5)]
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.running
    run(body())


def test_a_shard_that_does_not_answer_fails_every_request_and_stops_the_loop():
    async def body():
        scheduler, client = make_scheduler(step_timeout=0.2, step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        running = scheduler.submit(make_request(max_new=50))
        await asyncio.sleep(0.01)
        client.hang = "decode"
        events = await drain(running)
        assert isinstance(events[-1], ErrorEvent) and "--step-timeout" in events[-1].message
        with pytest.raises(ShardUnresponsive):
            await asyncio.wait_for(loop, 5)
        assert scheduler.failure is not None
        later = await drain(scheduler.submit(make_request()))
        assert isinstance(later[-1], ErrorEvent) and later[-1].status == 503
    run(body())


def test_abort_all_answers_running_and_queued_requests_at_once():
    async def body():
        scheduler, client = make_scheduler(num_blocks=4, block_size=4, step_delay=0.005)
        loop = asyncio.create_task(scheduler.run())
        running = [scheduler.submit(make_request(max_new=4)) for _ in range(2)]
        queued = scheduler.submit(make_request(max_new=4))  # no blocks left: it waits in the queue
        await asyncio.sleep(0.02)
        assert queued.state.name == "QUEUED"
        shutdown = ErrorEvent("shutting down", "shutdown", 503)
        assert scheduler.abort_all(shutdown) == 3
        for entry in [*running, queued]:
            events = await drain(entry)
            assert events[-1] == shutdown
        await asyncio.sleep(0.05)
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 4 and not scheduler.running
    run(body())


# --- prefix caching ---------------------------------------------------------------------------------------------


def _with_prompt(prompt, max_new=3, **fields) -> ValidGenerateRequest:
    return dataclasses.replace(make_request(max_new=max_new), input_ids=tuple(prompt), **fields)


def test_a_prompt_sharing_a_finished_requests_prefix_reuses_its_blocks():
    async def body():
        scheduler, client = make_scheduler(prefix_caching=True)
        loop = asyncio.create_task(scheduler.run())
        shared = list(range(10, 22))  # three blocks of 4
        await drain(scheduler.submit(_with_prompt(shared + [1])))
        await drain(scheduler.submit(_with_prompt(shared + [2, 3])))
        details = await drain(scheduler.submit(_with_prompt(shared + [2, 3], decoder_input_details=True)))
        loop.cancel()
        first, second, third = client.prefilled
        assert (first.cached_tokens, second.cached_tokens) == (0, 12)
        assert list(second.blocks[:3]) == list(first.blocks[:3])
        assert third.cached_tokens == 0  # its prompt log-probabilities need every prompt row
        assert isinstance(details[-1], FinalEvent)
        samples = {s.name: s.value for m in scheduler.metrics.registry.collect() for s in m.samples}
        assert samples["specula_prefix_cache_hits_total"] == 12
        assert samples["specula_prefix_cache_queries_total"] == 13 + 14 + 14
        assert scheduler.allocator.num_free_blocks == 64  # cached blocks held by nobody count as free
    run(body())


def test_a_next_turn_reuses_the_answer_of_the_last_one():
    async def body():
        scheduler, client = make_scheduler(prefix_caching=True)
        loop = asyncio.create_task(scheduler.run())
        prompt = list(range(10, 17))
        first = await drain(scheduler.submit(_with_prompt(prompt, max_new=6)))
        answer = [t.id for e in first if isinstance(e, TokensEvent) for t in e.tokens]
        await drain(scheduler.submit(_with_prompt(prompt + answer + [5, 5], max_new=2)))
        loop.cancel()
        # 7 prompt + 5 fed answer tokens are written: three whole blocks.
        assert client.prefilled[1].cached_tokens == 12
    run(body())


def test_a_request_that_failed_in_the_worker_leaves_nothing_in_the_cache():
    async def body():
        scheduler, client = make_scheduler(prefix_caching=True)
        loop = asyncio.create_task(scheduler.run())
        prompt = list(range(10, 22)) + [1]
        failed = scheduler.submit(_with_prompt(prompt))
        client.failing_rows.add(failed.id)
        assert isinstance((await drain(failed))[-1], ErrorEvent)
        await drain(scheduler.submit(_with_prompt(prompt)))
        loop.cancel()
        assert client.prefilled[1].cached_tokens == 0
    run(body())


# --- chunked prefill --------------------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_prefill_budget_is_prefilled_in_chunks():
    async def body():
        scheduler, client = make_scheduler(max_batch_prefill_tokens=16)  # chunks of 16 (blocks of 4)
        loop = asyncio.create_task(scheduler.run())
        events = await drain(scheduler.submit(make_request(prompt_len=45, max_new=3)))
        loop.cancel()
        assert isinstance(events[-1], FinalEvent) and events[-1].generated_tokens == 3
        chunks = [c for kind, c in client.calls if kind == "chunk"]
        assert chunks == [[(0, 0, 16)], [(0, 16, 32)]]
        assert client.prefilled[-1].cached_tokens == 32 and client.prefilled[-1].prefill_until == 0
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.chunking
    run(body())


def test_running_requests_decode_between_the_chunks_of_a_long_prompt():
    async def body():
        scheduler, client = make_scheduler(max_batch_prefill_tokens=8, step_delay=0.002)
        loop = asyncio.create_task(scheduler.run())
        running = scheduler.submit(make_request(prompt_len=4, max_new=30))
        await asyncio.sleep(0.02)
        long = scheduler.submit(make_request(prompt_len=40, max_new=2))
        assert isinstance((await drain(long))[-1], FinalEvent)
        await drain(running)
        loop.cancel()
        kinds = [kind for kind, _ in client.calls if kind in ("chunk", "decoded")]
        first, last = kinds.index("chunk"), len(kinds) - 1 - kinds[::-1].index("chunk")
        assert kinds.count("chunk") == 4  # 40 tokens: four chunks of 8, then the last 8 as a plain prefill
        assert all(kinds[i + 1] == "decoded" for i in range(first, last) if kinds[i] == "chunk")
    run(body())


def test_a_request_cancelled_while_its_prompt_is_chunked_frees_its_blocks():
    async def body():
        scheduler, client = make_scheduler(max_batch_prefill_tokens=8, step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        long = scheduler.submit(make_request(prompt_len=60, max_new=2))
        await asyncio.sleep(0.025)
        assert long.state.name == "PREFILLING"
        scheduler.cancel(long)
        await asyncio.sleep(0.05)
        after = scheduler.submit(make_request(max_new=2))
        assert isinstance((await drain(after))[-1], FinalEvent)
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.chunking
        assert len([c for kind, c in client.calls if kind == "chunk"]) < 7
    run(body())


def test_chunks_of_a_prompt_are_reused_by_a_prompt_with_the_same_start():
    async def body():
        scheduler, client = make_scheduler(max_batch_prefill_tokens=16, prefix_caching=True)
        loop = asyncio.create_task(scheduler.run())
        long = make_request(prompt_len=45, max_new=2)
        await drain(scheduler.submit(long))
        await drain(scheduler.submit(dataclasses.replace(long, input_ids=long.input_ids[:40] + (7, 7, 7))))
        loop.cancel()
        assert client.prefilled[-1].cached_tokens == 40  # every whole block of the shared 40 tokens
    run(body())
