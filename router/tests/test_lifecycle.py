"""The router's end of life over a fake worker, on a real socket: a drain whose cut is answered, a hung shard."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import tokenizers
import uvicorn
from fake_worker import FakeClient

from specula_router.block_allocator import BlockAllocator
from specula_router.lifecycle import DrainingServer
from specula_router.metrics import Metrics
from specula_router.scheduler import Scheduler, SchedulerConfig
from specula_router.server import RouterState, create_app
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing.tokenizer import build_tokenizer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(tmp_path, drain_timeout: float, step_delay: float, step_timeout: float | None = None):
    build_tokenizer(tmp_path)
    tokenizer = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    metrics = Metrics()
    scheduler = Scheduler(FakeClient(step_delay), BlockAllocator(256, 16),
                          SchedulerConfig(max_batch_prefill_tokens=512, step_timeout=step_timeout), metrics)
    validator = Validator(tokenizer, ValidationLimits(max_input_tokens=100, max_total_tokens=2000))
    state = RouterState(scheduler, validator, scheduler.client, metrics, {"model_id": "fake"}, 8, "cpu")
    port = _free_port()
    server = DrainingServer(uvicorn.Config(create_app(state), host="127.0.0.1", port=port, log_config=None),
                            scheduler, drain_timeout)
    return server, scheduler, f"http://127.0.0.1:{port}"


async def _started(server: uvicorn.Server) -> asyncio.Task:
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    return task


async def _stream_events(client: httpx.AsyncClient, max_new_tokens: int, seen: asyncio.Event) -> list[dict]:
    events = []
    async with client.stream("POST", "/generate_stream",
                             json={"inputs": "hi", "parameters": {"max_new_tokens": max_new_tokens}}) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
                seen.set()
    return events


def test_a_drain_that_runs_out_ends_streams_with_a_shutdown_event(tmp_path):
    async def body():
        server, scheduler, url = _serve(tmp_path, drain_timeout=0.5, step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        serving = await _started(server)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            seen = asyncio.Event()
            stream = asyncio.create_task(_stream_events(client, 1500, seen))  # 15 s of tokens: outlives the drain
            await seen.wait()
            server.should_exit = True  # what SIGTERM does
            events = await asyncio.wait_for(stream, 10)
        await asyncio.wait_for(serving, 10)
        await asyncio.sleep(0.1)  # the cut request leaves the workers' batch at the next step
        loop.cancel()
        assert "token" in events[0] and len(events) < 1500
        assert events[-1]["error_type"] == "shutdown" and "--shutdown-timeout" in events[-1]["error"]
        assert server.num_cut == 1
        assert scheduler.allocator.num_free_blocks == 256 and not scheduler.running

    asyncio.run(body())


def test_a_drain_that_finishes_in_time_cuts_nothing(tmp_path):
    async def body():
        server, scheduler, url = _serve(tmp_path, drain_timeout=5.0, step_delay=0.01)
        loop = asyncio.create_task(scheduler.run())
        serving = await _started(server)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            seen = asyncio.Event()
            stream = asyncio.create_task(_stream_events(client, 20, seen))
            await seen.wait()
            server.should_exit = True
            events = await asyncio.wait_for(stream, 10)
        await asyncio.wait_for(serving, 10)
        loop.cancel()
        assert len(events) == 20 and events[-1]["generated_text"] is not None
        assert server.num_cut == 0

    asyncio.run(body())


def test_a_hung_shard_fails_the_request_and_turns_health_unhealthy(tmp_path):
    async def body():
        server, scheduler, url = _serve(tmp_path, drain_timeout=5.0, step_delay=0.01, step_timeout=0.3)
        loop = asyncio.create_task(scheduler.run())
        serving = await _started(server)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/health")).status_code == 200
            scheduler.client.hang = "prefill"  # a stopped shard: the step never answers
            r = await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 5}})
            assert r.status_code == 424 and "--step-timeout" in r.json()["error"]
            health = await client.get("/health")
            assert health.status_code == 503 and "--step-timeout" in health.json()["error"]
            r = await client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 5}})
            assert r.status_code == 503
        assert loop.done() and loop.exception() is not None
        server.should_exit = True
        await asyncio.wait_for(serving, 10)

    asyncio.run(body())
