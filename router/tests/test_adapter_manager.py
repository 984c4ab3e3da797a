"""Adapters in the batching loop, over the fake worker: background loads, one load per adapter, failures that
stay with their adapter, retries, LRU offload that never takes an adapter in use, and preloading."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fake_worker import AdapterBehaviour, FakeClient
from test_scheduler import drain, make_request

from specula_router.adapters import AdapterManager, AdapterState
from specula_router.block_allocator import BlockAllocator
from specula_router.metrics import Metrics
from specula_router.scheduler import EntryState, ErrorEvent, FinalEvent, Scheduler, SchedulerConfig


def make_scheduler(step_delay=0.0, max_active_adapters=8, max_adapter_slots=None, **behaviours):
    client = FakeClient(step_delay, max_adapter_slots=max_adapter_slots)
    client.adapters.update(behaviours)
    metrics = Metrics()
    adapters = AdapterManager(client, metrics, max_active_adapters)
    scheduler = Scheduler(client, BlockAllocator(64, 4), SchedulerConfig(max_batch_prefill_tokens=64), metrics,
                          adapters)
    return scheduler, client


def adapter_request(adapter_id: str, max_new: int = 3, prompt_len: int = 4, **fields):
    return dataclasses.replace(make_request(prompt_len, max_new), adapter_id=adapter_id, adapter_source="hub",
                               **fields)


def text(events) -> str:
    return events[-1].generated_text if isinstance(events[-1], FinalEvent) else ""


def run(body):
    asyncio.run(body())


def test_slow_adapter_load_does_not_delay_base_requests():
    async def body():
        scheduler, client = make_scheduler(step_delay=0.002, slow=AdapterBehaviour(delay=1.0))
        loop = asyncio.create_task(scheduler.run())
        running = scheduler.submit(make_request(max_new=40))  # decoding while the adapter loads
        await asyncio.sleep(0.01)
        waiting = scheduler.submit(adapter_request("slow"))
        assert waiting.state is EntryState.WAITING_ADAPTER and scheduler.adapters.state("slow") is AdapterState.LOADING
        base = [scheduler.submit(make_request(max_new=2)) for _ in range(3)]
        for entry in [*base, running]:
            assert isinstance((await drain(entry))[-1], FinalEvent)
        # All of them were admitted and finished while the adapter was still loading.
        assert waiting.state is EntryState.WAITING_ADAPTER and waiting.events.empty()
        assert scheduler.adapters.state("slow") is AdapterState.LOADING
        assert text(await drain(waiting)) == "slow:t0 slow:t1 slow:t2 "
        loop.cancel()
        assert client.adapter_calls == [("load", "slow")]
        assert scheduler.allocator.num_free_blocks == 64
    run(body)


def test_many_requests_for_one_adapter_trigger_a_single_load():
    async def body():
        scheduler, client = make_scheduler(a=AdapterBehaviour(delay=0.05))
        loop = asyncio.create_task(scheduler.run())
        first = [scheduler.submit(adapter_request("a", max_new=n)) for n in (1, 2, 3)]
        assert [text(await drain(e)) for e in first] == ["a:t0 ", "a:t0 a:t1 ", "a:t0 a:t1 a:t2 "]
        again = scheduler.submit(adapter_request("a"))  # ready now: straight into the FIFO
        assert again.state is EntryState.QUEUED
        await drain(again)
        loop.cancel()
        assert client.adapter_calls == [("load", "a")]
    run(body)


def test_failed_load_answers_only_that_adapters_requests_with_its_status():
    async def body():
        scheduler, client = make_scheduler(
            missing=AdapterBehaviour(delay=0.02, error="adapter `missing`: repository not found"),
            outside=AdapterBehaviour(error="adapter `../x` is outside the adapter directories", status=400))
        loop = asyncio.create_task(scheduler.run())
        failing = [scheduler.submit(adapter_request("missing")) for _ in range(2)]
        refused = scheduler.submit(adapter_request("outside"))
        fine = [scheduler.submit(make_request()), scheduler.submit(adapter_request("good"))]
        for entry in failing:
            error = (await drain(entry))[-1]
            assert isinstance(error, ErrorEvent) and (error.status, error.error_type) == (424, "generation")
            assert error.message == "adapter `missing`: repository not found"
        error = (await drain(refused))[-1]
        assert (error.status, error.error_type) == (400, "validation") and "outside" in error.message
        assert [text(await drain(e)) for e in fine] == ["t0 t1 t2 ", "good:t0 good:t1 good:t2 "]
        loop.cancel()
        assert scheduler.adapters.state("missing") is None and not scheduler.waiting
        assert all(e.state is EntryState.DONE for e in [*failing, refused])
    run(body)


def test_the_next_request_retries_a_failed_adapter():
    async def body():
        scheduler, client = make_scheduler(flaky=AdapterBehaviour(error="adapter `flaky`: connection reset"))
        loop = asyncio.create_task(scheduler.run())
        assert isinstance((await drain(scheduler.submit(adapter_request("flaky"))))[-1], ErrorEvent)
        client.adapters["flaky"] = AdapterBehaviour()
        assert text(await drain(scheduler.submit(adapter_request("flaky")))) == "flaky:t0 flaky:t1 flaky:t2 "
        loop.cancel()
        assert client.adapter_calls == [("load", "flaky"), ("load", "flaky")]
    run(body)


def test_one_slot_never_offloads_an_adapter_with_a_running_request():
    async def body():
        scheduler, client = make_scheduler(step_delay=0.002, max_active_adapters=1, max_adapter_slots=1)
        loop = asyncio.create_task(scheduler.run())
        long = scheduler.submit(adapter_request("a", max_new=30))
        await asyncio.sleep(0.02)
        assert long.state is EntryState.RUNNING
        other = scheduler.submit(adapter_request("b"))
        await asyncio.sleep(0.02)
        # b needs a's slot; a is decoding, so b waits and nothing is offloaded.
        assert other.state is EntryState.WAITING_ADAPTER and scheduler.adapters.state("b") is AdapterState.WAITING
        assert client.adapter_calls == [("load", "a")]
        assert text(await drain(long)).startswith("a:t0 a:t1 ")
        assert text(await drain(other)) == "b:t0 b:t1 b:t2 "
        loop.cancel()
        assert client.adapter_calls == [("load", "a"), ("offload", "a"), ("load", "b")]
        assert client.offloaded_in_use == [] and client.loaded_adapters == {"b"}
        assert scheduler.adapters.ready_ids == ["b"]
    run(body)


def test_queued_requests_keep_their_adapter_loaded():
    async def body():
        # Two requests of `a` fill the KV cache; a third one of `a` is queued behind them; `b` must wait for all.
        scheduler, client = make_scheduler(step_delay=0.002, max_active_adapters=1, max_adapter_slots=1)
        scheduler.allocator = BlockAllocator(4, 4)
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(adapter_request("a", prompt_len=4, max_new=4)) for _ in range(2)]
        await asyncio.sleep(0.02)
        entries.append(scheduler.submit(adapter_request("a", max_new=4)))
        other = scheduler.submit(adapter_request("b", max_new=1))
        for entry in entries:
            assert text(await drain(entry)) == "a:t0 a:t1 a:t2 a:t3 "
        assert text(await drain(other)) == "b:t0 "
        loop.cancel()
        assert client.adapter_calls == [("load", "a"), ("offload", "a"), ("load", "b")]
        assert client.offloaded_in_use == []
    run(body)


def test_the_least_recently_used_idle_adapter_is_offloaded():
    async def body():
        scheduler, client = make_scheduler(max_active_adapters=2, max_adapter_slots=2)
        loop = asyncio.create_task(scheduler.run())
        for adapter_id in ("a", "b", "a"):  # b is now the least recently used
            await drain(scheduler.submit(adapter_request(adapter_id, max_new=1)))
        assert text(await drain(scheduler.submit(adapter_request("c", max_new=1)))) == "c:t0 "
        assert client.adapter_calls[-2:] == [("offload", "b"), ("load", "c")]
        # b comes back: a is now the least recently used.
        assert text(await drain(scheduler.submit(adapter_request("b", max_new=1)))) == "b:t0 "
        loop.cancel()
        assert client.adapter_calls[-2:] == [("offload", "a"), ("load", "b")]
        assert sorted(scheduler.adapters.ready_ids) == ["b", "c"] and client.loaded_adapters == {"b", "c"}
        assert client.offloaded_in_use == []
    run(body)


def test_cancelled_requests_leave_their_adapter_behind():
    async def body():
        scheduler, client = make_scheduler(a=AdapterBehaviour(delay=0.05), max_active_adapters=1)
        loop = asyncio.create_task(scheduler.run())
        entry = scheduler.submit(adapter_request("a"))
        scheduler.cancel(entry)
        assert entry.state is EntryState.DONE and not scheduler.waiting
        blocked = scheduler.submit(adapter_request("b"))  # no slot until a's load ends
        assert scheduler.adapters.state("b") is AdapterState.WAITING
        scheduler.cancel(blocked)
        assert scheduler.adapters.state("b") is None  # never loaded, forgotten
        await asyncio.sleep(0.1)
        loop.cancel()
        assert scheduler.adapters.state("a") is AdapterState.READY and entry.events.empty()
        assert client.adapter_calls == [("load", "a")] and scheduler.num_waiting == 0
    run(body)


def test_the_requests_token_reaches_the_load_once():
    async def body():
        scheduler, client = make_scheduler(private=AdapterBehaviour(delay=0.02))
        loop = asyncio.create_task(scheduler.run())
        entries = [scheduler.submit(adapter_request("private", api_token=t)) for t in ("hf_token", None)]
        for entry in entries:
            await drain(entry)
        loop.cancel()
        [load] = client.load_requests  # the load the first request started serves both
        assert (load.adapter_id, load.adapter_source, load.api_token) == ("private", "hub", "hf_token")
    run(body)


def test_preload_loads_before_serving_and_names_a_failure():
    async def body():
        scheduler, client = make_scheduler()
        await scheduler.adapters.preload(["a", "b", "a"])
        assert sorted(scheduler.adapters.ready_ids) == ["a", "b"]
        entry = scheduler.submit(adapter_request("a"))
        assert entry.state is EntryState.QUEUED  # no wait: already loaded
        assert client.adapter_calls == [("load", "a"), ("load", "b")]

        failing, client = make_scheduler(bad=AdapterBehaviour(error="adapter `bad`: not a LoRA adapter"))
        with pytest.raises(ValueError, match="preloaded adapter `bad` could not be loaded: adapter `bad`: not a LoRA"):
            await failing.adapters.preload(["good", "bad"])
        too_many, _ = make_scheduler(max_active_adapters=1)
        with pytest.raises(ValueError, match="names 2 adapters, more than --max-active-adapters"):
            await too_many.adapters.preload(["a", "b"])
    run(body)


def test_adapter_metrics_and_gauges():
    async def body():
        scheduler, client = make_scheduler(max_active_adapters=1, bad=AdapterBehaviour(error="nope", status=400))
        loop = asyncio.create_task(scheduler.run())
        await drain(scheduler.submit(adapter_request("a", max_new=1)))
        await drain(scheduler.submit(adapter_request("bad", max_new=1)))
        await drain(scheduler.submit(adapter_request("b", max_new=1)))
        loop.cancel()
        registry = scheduler.metrics.registry
        assert registry.get_sample_value("specula_adapter_load_duration_count", {"adapter": "a"}) == 1
        # A failed load keeps its client-chosen id out of the labels.
        assert registry.get_sample_value("specula_adapter_load_failure_total",
                                         {"adapter": "other", "status": "400"}) == 1
        assert registry.get_sample_value("specula_adapter_offload_total", {"adapter": "a"}) == 1
        assert registry.get_sample_value("specula_adapter_active") == 1
        assert registry.get_sample_value("specula_adapter_loading") == 0
        assert registry.get_sample_value("specula_queue_size") == 0
        assert registry.get_sample_value("specula_request_success_total", {"adapter": "b"}) == 1
        assert registry.get_sample_value("specula_request_failure_total",
                                         {"err": "validation", "adapter": "other"}) == 1
        assert b"bad" not in scheduler.metrics.render()
    run(body)


def test_the_base_model_is_always_ready():
    scheduler, client = make_scheduler()
    assert scheduler.adapters.is_ready("") and not scheduler.adapters.is_ready("a")
    entry = scheduler.submit(make_request())
    assert entry.state is EntryState.QUEUED and client.adapter_calls == []
