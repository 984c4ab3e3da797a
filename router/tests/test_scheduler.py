"""The batching loop against a fake worker: admission, budgets, continuous batching, cancellation, failures."""

from __future__ import annotations

import asyncio

import pytest
from fake_worker import FakeClient

from specula_router.block_allocator import BlockAllocator
from specula_router.metrics import Metrics
from specula_router.requests import SamplingParameters, StoppingParameters, ValidGenerateRequest
from specula_router.scheduler import ErrorEvent, FinalEvent, Scheduler, SchedulerConfig, TokensEvent


def make_request(prompt_len: int = 4, max_new: int = 3) -> ValidGenerateRequest:
    return ValidGenerateRequest(
        inputs="x", input_ids=tuple(range(prompt_len)),
        sampling=SamplingParameters(False, 1.0, 0, 1.0, 1.0, 1.0, 0.0, 0.0, seed=5),
        stopping=StoppingParameters(max_new, (), False), truncate=None, decoder_input_details=False,
        details=True, return_full_text=False, top_n_tokens=0, best_of=1,
    )


def make_scheduler(num_blocks=64, block_size=4, step_delay=0.0, **config):
    client = FakeClient(step_delay)
    config = SchedulerConfig(**{"max_batch_prefill_tokens": 64, **config})
    return Scheduler(client, BlockAllocator(num_blocks, block_size), config, Metrics()), client


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
    assert scheduler._next_batch(None, None) == [entry]
    assert len(entry.blocks) == 3  # 4 + 4 + 3 = 11 positions -> 3 blocks


def test_prefill_token_limit_splits_batches():
    scheduler, _ = make_scheduler(max_batch_prefill_tokens=10)
    entries = [scheduler.submit(make_request(prompt_len=4)) for _ in range(3)]
    assert scheduler._next_batch(None, None) == entries[:2]
    assert scheduler._next_batch(None, None) == entries[2:]


def test_min_size_holds_back_a_too_small_batch():
    scheduler, _ = make_scheduler()
    scheduler.submit(make_request())
    assert scheduler._next_batch(min_size=2, max_size=None) is None
    assert scheduler.allocator.num_free_blocks == 64 and len(scheduler.queue) == 1


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
    assert not scheduler.queue and scheduler._next_batch(None, None) is None


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
