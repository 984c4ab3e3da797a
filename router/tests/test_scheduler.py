"""The batching loop against a fake worker: admission, KV blocks that grow and preemption, continuous batching,
cancellation, failures. The fake checks every step against the worker's contract (see fake_worker.py): a test
fails when the router sent a step the worker would refuse or that would corrupt another request's KV."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fake_worker import FakeClient

from specula_router.block_allocator import BlockAllocator
from specula_router.client import ShardError
from specula_router.entries import TokenOut
from specula_router.metrics import Metrics
from specula_router.requests import SamplingParameters, StoppingParameters, ValidGenerateRequest
from specula_router.scheduler import (
    ErrorEvent,
    FinalEvent,
    Scheduler,
    SchedulerConfig,
    ShardUnresponsive,
    TokensEvent,
)
from specula_router.step_messages import GenerationOut


def make_request(prompt_len: int = 4, max_new: int = 3) -> ValidGenerateRequest:
    return ValidGenerateRequest(
        inputs="x", input_ids=tuple(range(prompt_len)),
        sampling=SamplingParameters(False, 1.0, 0, 1.0, 1.0, 1.0, 0.0, 0.0, seed=5),
        stopping=StoppingParameters(max_new, (), False), truncate=None, decoder_input_details=False,
        details=True, return_full_text=False, top_n_tokens=0, best_of=1,
    )


_CLIENTS: list[FakeClient] = []


@pytest.fixture(autouse=True)
def no_misuse():
    """Every step the router sent in a test kept the worker's contract."""
    _CLIENTS.clear()
    yield
    assert [m for c in _CLIENTS for m in c.misuse] == []


def make_scheduler(num_blocks=64, block_size=4, step_delay=0.0, prefix_caching=False, eos_after=None, **config):
    client = FakeClient(step_delay, block_size=block_size, num_blocks=num_blocks,
                        lookahead=config.get("lookahead", 0), eos_after=eos_after)
    _CLIENTS.append(client)
    config = SchedulerConfig(**{"max_batch_prefill_tokens": 64, **config})
    allocator = BlockAllocator(num_blocks, block_size, prefix_caching)
    return Scheduler(client, allocator, config, Metrics()), client


def new_ids(client) -> list[list[int]]:
    """The new requests of every step that had some."""
    return [[r.id for r in step.new_requests] for step in client.steps if step.new_requests]


def samples(scheduler) -> dict[str, float]:
    return {s.name: s.value for m in scheduler.metrics.registry.collect() for s in m.samples}


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


def test_kv_blocks_admit_fifo():
    async def body():
        # 4 blocks of 4 tokens: a request of 4 + 4 tokens grows to 2 blocks, so only two fit at once.
        scheduler, client = make_scheduler(num_blocks=4, block_size=4, step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(prompt_len=4, max_new=4)) for _ in range(3)]
        await asyncio.sleep(0.02)
        assert [e.state.name for e in entries] == ["RUNNING", "RUNNING", "QUEUED"]
        for e in entries:
            await drain(e)
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 4
        assert new_ids(client) == [[0, 1], [2]]
    run(body())


def test_a_request_is_admitted_with_blocks_for_its_prompt_and_one_step():
    scheduler, _ = make_scheduler(num_blocks=8, block_size=4, lookahead=3)
    entry = scheduler.submit(make_request(prompt_len=4, max_new=40))
    assert scheduler.admission.first().batch == [entry]
    assert len(entry.blocks) == 2  # 4 + 1 + 3 = 8 positions, not its whole budget of 4 + 40 + 3


def test_blocks_grow_with_the_sequence_up_to_its_budget_and_lookahead():
    async def body():
        scheduler, client = make_scheduler(num_blocks=16, block_size=4, lookahead=3, step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        entry = scheduler.submit(make_request(prompt_len=4, max_new=20))
        sizes = []
        while entry.state.name != "DONE":
            sizes.append(len(entry.blocks))
            await asyncio.sleep(0.001)
        events = await drain(entry)
        loop.cancel()
        assert events[-1].generated_tokens == 20
        assert sizes[0] <= 3 and max(sizes) == 7  # at most 4 + 20 + 3 = 27 positions: 7 blocks
        assert sizes == sorted(sizes)
        grown = [b for step in client.steps for u in step.updates for b in u.new_blocks]
        assert len(grown) == 7 - len(client.prefilled[0].blocks)
    run(body())


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


def test_a_cancelled_request_leaves_in_the_next_step_and_its_blocks_are_reused():
    async def body():
        # 4 blocks of 4: `gone` (4 + 12 tokens) takes 2 to 4 of them, `after` (8 + 2) needs 3 to start.
        scheduler, client = make_scheduler(num_blocks=4, block_size=4, step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        gone = scheduler.submit(make_request(prompt_len=4, max_new=12))
        after = scheduler.submit(make_request(prompt_len=8, max_new=2))
        await asyncio.sleep(0.035)
        assert gone.state.name == "RUNNING" and after.state.name == "QUEUED"
        held = list(gone.blocks)
        steps_before = len(client.steps)
        scheduler.cancel(gone)
        assert isinstance((await drain(after))[-1], FinalEvent)
        loop.cancel()
        assert list(client.steps[steps_before].finished) == [gone.id]  # the next step sent
        [sent] = [r for r in client.prefilled if r.id == after.id]
        assert set(sent.blocks) & set(held)
        assert gone.id not in scheduler.running and scheduler.allocator.num_free_blocks == 4
    run(body())


def test_kv_block_gauges_return_to_idle_after_a_burst_of_cancellations():
    """/metrics reads the allocator when scraped: blocks freed by cancelled requests show at once, with or
    without a step after them. Before, only `batch_current_max_tokens` existed, set after steps."""
    async def body():
        scheduler, _ = make_scheduler(num_blocks=64, block_size=4, step_delay=0.01, prefix_caching=True)
        gauges = ("specula_kv_blocks_capacity", "specula_kv_blocks_used", "specula_kv_blocks_free",
                  "specula_kv_blocks_cached_idle")
        idle = {name: samples(scheduler)[name] for name in gauges}
        assert idle == {"specula_kv_blocks_capacity": 64, "specula_kv_blocks_used": 0,
                        "specula_kv_blocks_free": 64, "specula_kv_blocks_cached_idle": 0}
        loop = asyncio.create_task(scheduler.run())
        burst = [scheduler.submit(make_request(prompt_len=8, max_new=20)) for _ in range(6)]
        await asyncio.sleep(0.05)
        busy = samples(scheduler)
        assert busy["specula_kv_blocks_used"] > 0
        assert busy["specula_kv_blocks_used"] + busy["specula_kv_blocks_free"] == 64
        for entry in burst:
            scheduler.cancel(entry)
        await asyncio.sleep(0.05)
        loop.cancel()
        after = samples(scheduler)
        assert after["specula_kv_blocks_used"] == 0 and after["specula_kv_blocks_free"] == 64
        assert after["specula_kv_blocks_cached_idle"] == scheduler.allocator.num_cached_blocks  # prompts kept
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
        failed_at = next(i for i, step in enumerate(client.steps) if failed.id in [r.id for r in step.new_requests])
        assert any(failed.id in step.finished for step in client.steps[failed_at + 1:])  # it left the workers
        assert samples(scheduler)["specula_batch_inference_failure_total"] == 1
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
    first_result = kinds.index("prefilled")
    # With depth 2 the second step is on its way before the first one has run.
    assert kinds[:first_result].count("step") == depth


@pytest.mark.parametrize("depth", [1, 2])
def test_calls_run_several_decode_steps_while_every_request_decodes_and_none_waits(depth):
    async def body():
        scheduler, client = make_scheduler(num_scheduler_steps=4, pipeline_depth=depth, step_delay=0.002)
        loop = asyncio.create_task(scheduler.run())
        first = scheduler.submit(make_request(max_new=60))
        await asyncio.sleep(0.01)
        later = [scheduler.submit(make_request(max_new=n)) for n in (9, 14)]
        results = [await drain(e) for e in [first, *later]]
        loop.cancel()
        for entry, events in zip([first, *later], results):
            assert _tokens_of(events) == [1000 * entry.id + k for k in range(entry.request.stopping.max_new_tokens)]
            grouped = [e for e in events if isinstance(e, TokensEvent) and len(e.tokens) > 1]
            assert grouped and all(e.skipped == [False] * len(e.tokens) for e in grouped)  # each its own step
            assert entry.num_skipped == 0
        assert scheduler.allocator.num_free_blocks == 64 and client.held == {}
        return client.steps

    steps = run(body())
    assert any(step.decode_steps == 4 for step in steps)
    # Newcomers join in a call of one step; their prompts' call is one step too.
    assert all(step.decode_steps == 1 for step in steps if step.new_requests)
    assert len(steps) < 60 / 2


def test_a_call_runs_one_decode_step_when_the_free_blocks_do_not_cover_more():
    scheduler, _ = make_scheduler(num_blocks=4, block_size=4, num_scheduler_steps=4)
    running = scheduler.submit(make_request(prompt_len=4, max_new=40))
    assert scheduler.planner.plan(0, 4).new_requests  # 2 blocks: its prompt and first step
    running.token_ids += [1]
    plan = scheduler.planner.plan(0, 4)  # 4 steps more: 4 + 1 + 4 positions, 3 blocks
    assert plan.decode_steps == 4 and len(plan.updates[running.id].new_blocks) == 1
    running.token_ids += [2, 3, 4, 5]
    plan = scheduler.planner.plan(0, 4)  # 4 + 5 + 4 positions: the 4th block, the last one free
    assert plan.decode_steps == 4 and len(plan.updates[running.id].new_blocks) == 1
    running.token_ids += [6, 7, 8, 9]
    plan = scheduler.planner.plan(0, 4)  # 4 + 9 + 4 positions would need a 5th: one step, 4 + 9 + 1, fits
    assert plan.decode_steps == 1 and running.id not in plan.updates


def test_a_pipelined_step_naming_a_request_that_just_ended_is_harmless():
    async def body():
        # Blocks of 1 token: the step sent while the request's last step runs gives it a block it never uses.
        scheduler, client = make_scheduler(block_size=1, pipeline_depth=2, eos_after=3)
        loop = asyncio.create_task(scheduler.run())
        entry = scheduler.submit(make_request(prompt_len=3, max_new=30))
        events = await drain(entry)
        await asyncio.sleep(0.01)
        loop.cancel()
        assert events[-1].generated_tokens == 3 and not scheduler.running
        assert client.held == {} and scheduler.allocator.num_free_blocks == 64
        assert any(u.id == entry.id for step in client.steps[3:] for u in step.updates)
    run(body())


# --- one request, one failure: the loop goes on ------------------------------------------------------------


def _tokens_of(events) -> list[int]:
    return [t.id for e in events if isinstance(e, TokensEvent) for t in e.tokens]


def test_a_request_the_wire_cannot_hold_fails_alone_and_the_loop_goes_on():
    """top_k = 2**32 does not fit the proto's uint32: building the request raised and ended the loop."""
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

        def flaky(entry, generation):
            if entry is bad and bad.num_generated == 2:
                raise RuntimeError("cannot encode this token")
            deliver(entry, generation)

        scheduler._deliver = flaky
        bad_events, good_events = await drain(bad), await drain(good)
        assert isinstance(bad_events[-1], ErrorEvent) and bad_events[-1].status == 500
        assert "cannot encode this token" in bad_events[-1].message
        assert len(_tokens_of(bad_events)) == 2  # what it had before the failure, nothing after
        assert _tokens_of(good_events) == [1000 * good.id + k for k in range(6)]
        await asyncio.sleep(0.02)
        loop.cancel()
        # It left the workers before its blocks were freed.
        assert any(list(step.finished) == [bad.id] for step in client.steps)
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
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.running
        assert any(failed.id in step.finished for step in client.steps)  # the workers dropped it too
    run(body())


@pytest.mark.parametrize("where", ["a step on the wire", "the recovery itself"])
def test_an_error_while_recovering_from_an_error_fails_the_running_requests_and_the_loop_goes_on(where):
    """A second fault met by the recovery after a failed step (the next step on the wire raising too, or a defect
    in the recovery's own code) left the batching loop, and the router exited."""
    async def body():
        scheduler, client = make_scheduler(step_delay=0.001)
        recovering: list[ErrorEvent] = []
        faults: list[str] = []
        recover = scheduler._recover

        async def tracked(event):
            recovering.append(event)
            await recover(event)

        scheduler._recover = tracked
        if where == "a step on the wire":
            maybe_fail = client._maybe_fail

            def fail_twice(method):
                if method == "decode" and len(faults) < 2:
                    faults.append("while recovering" if recovering else "in a step")
                    raise RuntimeError(f"unexpected {len(faults)}")
                maybe_fail(method)

            client._maybe_fail = fail_twice
        else:
            client.raise_next = ("decode", RuntimeError("unexpected 1"))
            settle = scheduler._settle_preempted

            def broken(plan):
                if recovering and not faults:
                    faults.append("while recovering")
                    raise RuntimeError("recovery broke")
                settle(plan)

            scheduler._settle_preempted = broken
        loop = asyncio.create_task(scheduler.run())
        failed = [scheduler.submit(make_request(max_new=8)) for _ in range(2)]
        results = [await drain(e) for e in failed]
        assert faults[-1] == "while recovering"  # the second fault did happen inside the recovery
        for events in results:
            assert isinstance(events[-1], ErrorEvent) and events[-1].status == 500
            assert events[-1].error_type == "internal" and "unexpected 1" in events[-1].message
            if where == "the recovery itself":
                assert "while recovering: RuntimeError: recovery broke" in events[-1].message
        ok = scheduler.submit(make_request(max_new=2))
        assert isinstance((await drain(ok))[-1], FinalEvent)
        assert not loop.done()
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 64 and not scheduler.running
        assert all(any(e.id in step.finished for step in client.steps) for e in failed)  # the workers dropped them
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


def test_a_shard_that_cannot_be_reached_stops_the_loop():
    """A shard whose process is gone (on another node, where no launcher of ours sees it die) answers nothing
    ever again: the router fails everything and stops, as for a shard that hangs."""
    async def body():
        scheduler, client = make_scheduler(step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        running = scheduler.submit(make_request(max_new=50))
        await asyncio.sleep(0.01)
        client.raise_next = ("decode", ShardError("Step failed: failed to connect to all addresses",
                                                  unreachable=True))
        events = await drain(running)
        assert isinstance(events[-1], ErrorEvent) and "cannot be reached" in events[-1].message
        with pytest.raises(ShardUnresponsive):
            await asyncio.wait_for(loop, 5)
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
        counts = samples(scheduler)
        assert counts["specula_prefix_cache_hits_total"] == 12
        assert counts["specula_prefix_cache_queries_total"] == 13 + 14 + 14
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
        [sent] = client.prefilled
        assert (sent.cached_tokens, sent.prefill_until) == (0, 16)  # its first chunk
        # The next ones, one per step; the last (0: the rest) yields its first token.
        assert [u.prefill_until for step in client.steps for u in step.updates if u.id == 0][:2] == [32, 0]
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
        assert kinds.count("chunk") == 4  # 40 tokens: four chunks of 8, then the last 8
        # Each chunk runs in a step that also decodes the running request.
        assert all(kinds[i + 1] == "decoded" for i in range(len(kinds)) if kinds[i] == "chunk")
        chunk_steps = [step for step in client.steps
                       if any(u.id == long.id for u in step.updates) or long.id in [r.id for r in step.new_requests]]
        assert len(chunk_steps) == 5  # the first chunk, three more, the rest: one per step
        for step in chunk_steps:
            assert len(step.new_requests) + sum(1 for u in step.updates if u.prefill_until or u.id == long.id) == 1
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


SEEDS = [1, 2, 3]

# --- blocks that grow, preemption ------------------------------------------------------------------------------


@pytest.mark.parametrize(("lookahead", "prefix_caching", "depth"), [(0, False, 2), (2, True, 2), (0, True, 1)])
def test_more_requests_than_blocks_all_complete_through_preemption(lookahead, prefix_caching, depth):
    async def body():
        # 10 blocks of 4 tokens: each request grows to 16 + lookahead positions, so about two fit at once, yet
        # four are admitted (their prompts and first steps fit) and the newest are preempted as they grow.
        scheduler, client = make_scheduler(num_blocks=10, block_size=4, step_delay=0.001, lookahead=lookahead,
                                           prefix_caching=prefix_caching, pipeline_depth=depth)
        preempted_with: list[tuple[int, int]] = []  # (request, tokens it had when preempted)
        preempt = scheduler.planner._preempt

        def counting(entry, plan):
            preempted_with.append((entry.id, len(entry.token_ids)))
            preempt(entry, plan)

        scheduler.planner._preempt = counting
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(prompt_len=4, max_new=12)) for _ in range(6)]
        results = [await drain(e) for e in entries]
        loop.cancel()
        for entry, events in zip(entries, results):
            streamed = _tokens_of(events)  # no duplicate, no missing token: exactly what it makes alone
            assert streamed == [1000 * entry.id + k for k in range(12)]
            final = events[-1]
            assert isinstance(final, FinalEvent) and final.generated_tokens == 12
            assert final.generated_text == "".join(f"t{k} " for k in range(12))
            assert entry.num_generated == 12
        assert samples(scheduler)["specula_request_preemptions_total"] >= 1
        resumed = [r for r in client.prefilled if r.generated_ids]
        assert resumed
        for request in resumed:  # it resumes with every token it had: those of steps on the wire too
            assert list(request.generated_ids) == [1000 * request.id + k for k in range(len(request.generated_ids))]
            assert request.cached_tokens % 4 == 0 and request.cached_tokens < 4 + len(request.generated_ids)
            assert not request.prefill_logprobs
        if depth == 2:  # a step on the wire when it was preempted still gave it a token, which it kept
            had = dict(preempted_with)
            assert any(len(r.generated_ids) > had.get(r.id, 12) for r in resumed)
        assert scheduler.allocator.num_free_blocks == 10 and not scheduler.running and not scheduler.queue
        assert client.held == {}
    run(body())


def test_the_most_recently_admitted_request_is_preempted_and_resumes_first():
    async def body():
        scheduler, client = make_scheduler(num_blocks=6, block_size=4, step_delay=0.002)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(prompt_len=4, max_new=12)) for _ in range(3)]
        later = scheduler.submit(make_request(prompt_len=4, max_new=2))
        results = [await drain(e) for e in [*entries, later]]
        loop.cancel()
        assert all(isinstance(r[-1], FinalEvent) for r in results)
        preempted = [i for step in client.steps for i in step.finished]
        assert preempted and preempted[0] == entries[-1].id  # the newest first
        # The preempted request resumed before `later`, which was queued behind it.
        starts = [r.id for r in client.prefilled]
        resumed_at = starts.index(entries[-1].id, starts.index(entries[-1].id) + 1)
        assert resumed_at < starts.index(later.id)
    run(body())


def test_a_request_whose_prompt_alone_fills_the_cache_still_completes():
    async def body():
        scheduler, client = make_scheduler(num_blocks=4, block_size=4, step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        small = scheduler.submit(make_request(prompt_len=4, max_new=6))
        await asyncio.sleep(0.005)
        big = scheduler.submit(make_request(prompt_len=8, max_new=8))  # 16 positions: the whole cache
        assert _tokens_of(await drain(big)) == [1000 * big.id + k for k in range(8)]
        assert _tokens_of(await drain(small)) == [1000 * small.id + k for k in range(6)]
        loop.cancel()
        assert scheduler.allocator.num_free_blocks == 4
    run(body())


def test_requests_with_large_budgets_that_stop_early_run_together():
    async def body():
        # 70 blocks of 16 tokens: one request's whole budget (4 + 1000 tokens) takes 63 of them, so reserving
        # budgets up front would run these one at a time. Blocks that grow let them run side by side.
        scheduler, client = make_scheduler(num_blocks=70, block_size=16, eos_after=20, step_delay=0.001)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(make_request(prompt_len=4, max_new=1000)) for _ in range(4)]
        results = [await drain(e) for e in entries]
        loop.cancel()
        for entry, events in zip(entries, results):
            assert _tokens_of(events) == [1000 * entry.id + k for k in range(20)]
            assert events[-1].finish_reason == "eos_token"
        decoded = [ids for kind, ids in client.calls if kind == "decoded"]
        assert max(len(ids) for ids in decoded) == 4  # all four in one step
        assert new_ids(client) == [[e.id for e in entries]]
        assert samples(scheduler)["specula_request_preemptions_total"] == 0
    run(body())


def test_a_newcomer_waits_rather_than_take_the_blocks_the_running_requests_grow_into():
    scheduler, _ = make_scheduler(num_blocks=4, block_size=4)
    running = scheduler.submit(make_request(prompt_len=4, max_new=8))
    assert scheduler.planner.plan(0).new_requests  # it takes 2 blocks (4 + 1 positions)
    running.token_ids += [1, 2]  # with two steps on the wire it may write 4 + 2 + 2 positions: its 2 blocks
    newcomer = scheduler.submit(make_request(prompt_len=4, max_new=2))  # needs the 2 free blocks ...
    plan = scheduler.planner.plan(1)
    assert not plan.new_requests and newcomer.state.name == "QUEUED"  # ... one of which `running` needs next
    running.token_ids += [3, 4]
    plan = scheduler.planner.plan(0)  # 4 + 4 + 1 positions: it grows into a third block, the fourth stays free
    assert len(plan.updates[running.id].new_blocks) == 1 and not plan.new_requests


@pytest.mark.parametrize("decode_steps", [1, 3])
@pytest.mark.parametrize("seed", SEEDS)
def test_a_random_mix_under_pressure_keeps_the_contract_and_every_stream_exact(seed, decode_steps):
    """Long and short prompts, shared prefixes, speculation's lookahead, clients that leave, rows and steps that
    fail, on a cache that forces preemptions: every step keeps the worker's contract (checked by the fake), every
    request that completes streams exactly its own tokens, and every block comes back."""
    import random

    async def body():
        rng = random.Random(seed)
        scheduler, client = make_scheduler(num_blocks=24, block_size=4, step_delay=0.0005, lookahead=seed % 2,
                                           prefix_caching=True, max_batch_prefill_tokens=12,
                                           pipeline_depth=1 + seed % 3 // 2, num_scheduler_steps=decode_steps)
        loop = asyncio.create_task(scheduler.run())
        shared = list(range(100, 120))
        entries, gone = [], set()
        for _ in range(40):
            prompt = shared[: rng.randrange(0, 20)] + [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            entries.append(scheduler.submit(_with_prompt(prompt, max_new=rng.randrange(1, 30))))
            if rng.random() < 0.1:
                client.failing_rows.add(entries[-1].id)
            if rng.random() < 0.03:
                client.fail_next = rng.choice(["prefill", "decode"])
            await asyncio.sleep(rng.random() * 0.004)
            if rng.random() < 0.15:
                victim = rng.choice(entries)
                gone.add(victim)
                scheduler.cancel(victim)
        completed = 0
        for entry in entries:
            if entry in gone:
                continue  # its client went away: it may never get another event
            events = await drain(entry)
            if isinstance(events[-1], ErrorEvent):
                assert "non-finite" in events[-1].message or "shard exploded" in events[-1].message
                continue
            assert _tokens_of(events) == [1000 * entry.id + k for k in range(entry.request.stopping.max_new_tokens)]
            completed += 1
        assert completed >= 10
        assert samples(scheduler)["specula_request_preemptions_total"] >= 1
        assert any(kind == "chunk" for kind, _ in client.calls)
        await asyncio.sleep(0.05)
        loop.cancel()
        assert not scheduler.running and not scheduler.queue and client.held == {}
        assert scheduler.allocator.num_free_blocks == 24
    run(body())


def test_speculation_metrics_count_each_decode_step_of_a_call():
    """A call of three decode steps that verified 2, 3 and 3 drafts (1, 0 and 3 accepted): three request steps
    in the metrics, as three calls of one step would count them."""
    scheduler, _ = make_scheduler(speculation_method="ngram")
    entry = scheduler.submit(make_request(max_new=20))
    tokens = [TokenOut(7, "a", -0.1, False) for _ in range(7)]
    scheduler._deliver(entry, GenerationOut(entry.id, tokens=tokens, drafted_tokens=8, accepted_tokens=4,
                                            draft_method="ngram", step_tokens=[2, 1, 4], step_drafted=[2, 3, 3],
                                            step_accepted=[1, 0, 3]))
    m = scheduler.metrics
    value = lambda metric, *labels: metric.labels(*labels)._value.get()  # noqa: E731
    assert value(m.spec_decode_num_drafts, "ngram", "") == 3
    assert value(m.spec_decode_num_draft_tokens, "ngram", "") == 8
    assert value(m.spec_decode_num_accepted_tokens, "ngram", "") == 4
    assert [value(m.spec_decode_accepted_tokens_per_pos, "ngram", "", str(p)) for p in (1, 2, 3)] == [2, 1, 1]
    assert entry.num_skipped == 4


def test_a_request_moves_only_along_its_life_cycle():
    """`Entry.move` is the one writer of a request's state: the moves of its life cycle pass, others fail."""
    from specula_router.entries import Entry, EntryState

    entry = Entry(1, make_request())
    for state in (EntryState.WAITING_ADAPTER, EntryState.QUEUED, EntryState.PREFILLING, EntryState.RUNNING,
                  EntryState.PREEMPTED, EntryState.RUNNING, EntryState.DONE):
        entry.move(state)
        assert entry.state is state
    for start, illegal in ((EntryState.DONE, EntryState.RUNNING), (EntryState.RUNNING, EntryState.QUEUED),
                           (EntryState.PREEMPTED, EntryState.WAITING_ADAPTER)):
        entry.state = start
        with pytest.raises(AssertionError, match=f"from {start.name} to {illegal.name}"):
            entry.move(illegal)
