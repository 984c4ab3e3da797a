"""The worker at its gRPC edge: the contract the router relies on, and errors that must not crash it."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from specula_proto import generate_pb2 as pb
from specula_proto import generate_pb2_grpc
from specula_proto.setting import Process
from specula_proto.settings import settings_of
from specula_server.distributed import ShardGroup
from specula_server.server import ServerConfig, load_generator
from specula_server.service import ExceptionInterceptor, TextGenerationService, WorkerInfo, fault_policy

REPO = Path(__file__).resolve().parents[2]


def request(rid: int, ids: list[int], blocks: list[int], max_new: int = 4, top_n_tokens: int = 0,
            **params) -> pb.Request:
    return pb.Request(
        id=rid,
        top_n_tokens=top_n_tokens,
        input_ids=ids,
        parameters=pb.NextTokenChooserParameters(**params),
        stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=max_new, ignore_eos_token=True),
        blocks=blocks,
    )


def in_process_worker(llama_dir, tmp_path, world_size: int = 1) -> tuple:
    """A generator and the WorkerInfo of a shard serving it on a socket under `tmp_path`."""
    config = ServerConfig(model_id=str(llama_dir), uds_path=str(tmp_path / "sock"), kv_cache_memory=2**22)
    generator, _ = load_generator(config, ShardGroup())
    info = WorkerInfo(str(llama_dir), "", config.torch_device, world_size, (config.uds_url(0),),
                      config.kv_cache_memory)
    return generator, info


@pytest.fixture
def stub_factory(llama_dir, tmp_path):
    """Runs the service in-process on a unix socket and yields an async client stub."""
    generator, info = in_process_worker(llama_dir, tmp_path)
    fatal: list[BaseException] = []

    async def run(body):
        await serve_in_process(generator, info, fatal, body)
        assert not fatal, f"a request error was treated as fatal: {fatal}"

    return lambda body: asyncio.run(run(body))


async def serve_in_process(generator, info: WorkerInfo, fatal: list, body) -> None:
    """Serves the worker on its unix socket for the duration of `body(stub)`."""
    server = grpc.aio.server(interceptors=[ExceptionInterceptor(fatal.append, fault_policy(info))])
    generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(TextGenerationService(generator, info), server)
    server.add_insecure_port(info.uds_urls[0])
    await server.start()
    try:
        async with grpc.aio.insecure_channel(info.uds_urls[0]) as channel:
            await body(generate_pb2_grpc.TextGenerationServiceStub(channel))
    finally:
        await server.stop(None)


def step(new=(), finished=(), updates=(), sequence: int = 0) -> pb.StepRequest:
    return pb.StepRequest(new_requests=list(new), finished=list(finished), updates=list(updates), sequence=sequence)


def test_contract_round_trip(stub_factory):
    async def body(stub):
        info = await stub.Info(pb.InfoRequest())
        assert info.block_size == 16 and info.dtype == "float32" and info.device_type == "cpu"
        assert info.speculation.max_speculative_tokens == 0 and 2 in info.eos_token_ids
        await stub.Health(pb.HealthRequest())
        urls = (await stub.ServiceDiscovery(pb.ServiceDiscoveryRequest())).urls
        assert len(urls) == 1 and urls[0].startswith("unix://")
        warm = await stub.Warmup(pb.WarmupRequest(max_input_tokens=64, max_prefill_tokens=128, max_total_tokens=96))
        assert warm.num_blocks > 0 and warm.max_supported_total_tokens == warm.num_blocks * info.block_size
        first = await stub.Step(step([request(10, [1, 5, 6, 7], [0], max_new=3),
                                      request(11, [1, 9], [1], max_new=2, top_n_tokens=2)]))
        assert [g.request_id for g in first.generations] == [10, 11]
        assert len(first.generations[1].top_tokens[0].ids) == 2
        assert first.num_requests == 2 and first.timings.forward_ns > 0
        second = await stub.Step(step())
        finished = {g.request_id: g.HasField("generated_text") for g in second.generations}
        assert finished == {10: False, 11: True} and second.num_requests == 1
        # A request joins while 10 runs, with blocks for its prompt only; 10 leaves as a cancelled request does;
        # an id the worker no longer holds (11 finished) is ignored.
        third = await stub.Step(step([request(12, [1, 3, 3, 3], [2], max_new=2)], finished=[10, 11]))
        assert [g.request_id for g in third.generations] == [12] and third.num_requests == 1
        fourth = await stub.Step(step(updates=[pb.RequestUpdate(id=12, new_blocks=[3])]))
        assert fourth.generations[0].HasField("generated_text") and fourth.num_requests == 0

    stub_factory(body)


def test_malformed_requests_are_errors_not_crashes(stub_factory):
    async def expect(call, code, match):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == code and match in err.value.details()

    async def body(stub):
        await expect(stub.Step(step([request(1, [1, 2], [0])])), grpc.StatusCode.INVALID_ARGUMENT, "Warmup")
        await stub.Warmup(pb.WarmupRequest(max_input_tokens=32, max_prefill_tokens=32, max_total_tokens=64))
        running = await stub.Step(step([request(100, [1, 2, 3], [5], max_new=20)]))
        assert not running.generations[0].error
        bad = [
            (request(1, [1, 10**6], [0]), "outside the vocabulary"),
            (request(1, [1] * 30, [0], max_new=8), "cannot hold"),
            (request(1, [1, 2], [10**6]), "KV block ids"),
            (request(1, [], [0]), "empty prompt"),
            (request(1, [1, 2], [0], max_new=0), "max_new_tokens"),
            (request(1, [1, 2], [0], temperature=-1.0), "temperature"),
            (request(1, [1, 2], [0], logit_bias={3: float("nan")}), "logit_bias"),
            (request(100, [1, 2], [0]), "already running"),
        ]
        for req, match in bad:  # each fails alone, in the step's answer; request 100 keeps decoding
            response = await stub.Step(step([req]))
            errors = {g.request_id: g.error for g in response.generations if g.error}
            assert list(errors) == [req.id] and match in errors[req.id], errors
            assert [g.request_id for g in response.generations if not g.error] == [100]
        grown = await stub.Step(step(updates=[pb.RequestUpdate(id=100, new_blocks=[10**6])]))
        assert "KV block ids" in grown.generations[0].error and grown.num_requests == 0
        # The worker still serves after all of that.
        ok = await stub.Step(step([request(1, [1, 2], [0])]))
        assert len(ok.generations) == 1 and not ok.generations[0].error

    stub_factory(body)


def test_cli_serves_on_a_socket_and_stops_on_sigterm(llama_dir, tmp_path):
    uds = tmp_path / "shard"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("server", "kernels", "proto")))
    proc = subprocess.Popen(
        [sys.executable, "-m", "specula_server.cli", "serve", str(llama_dir), "--uds-path", str(uds),
         "--kv-cache-memory", "4MiB"],
        env={**env, "SPECULA_INSTANCE_ID": "run-1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{uds}-0").exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "socket never appeared"
            time.sleep(0.1)

        async def info():
            async with grpc.aio.insecure_channel(f"unix://{uds}-0") as channel:
                return await generate_pb2_grpc.TextGenerationServiceStub(channel).Info(pb.InfoRequest())

        served = asyncio.run(info())
        assert (served.model_id, served.instance_id) == (str(llama_dir), "run-1")  # the launcher run it belongs to
    finally:
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=30)[0]
    assert proc.returncode == 0, output
    assert not Path(f"{uds}-0").exists()


def test_cli_never_takes_over_a_live_socket(llama_dir, tmp_path):
    """Another server's socket at our path: refuse (exit 1) rather than unlink it and answer its router."""
    uds = tmp_path / "shard"
    taken = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    taken.bind(f"{uds}-0")
    taken.listen(1)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("server", "kernels", "proto")))
    try:
        result = subprocess.run(
            [sys.executable, "-m", "specula_server.cli", "serve", str(llama_dir), "--uds-path", str(uds),
             "--kv-cache-memory", "4MiB"], env=env, capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{uds}-0 is in use by another process (a live socket)" in result.stdout + result.stderr


def test_cli_never_deletes_a_file_at_its_socket_path(llama_dir, tmp_path):
    """A file that is not a socket at our path (a mistyped --uds-path): refuse (exit 1) and leave it be."""
    uds = tmp_path / "data"
    Path(f"{uds}-0").write_text("keep me")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("server", "kernels", "proto")))
    result = subprocess.run(
        [sys.executable, "-m", "specula_server.cli", "serve", str(llama_dir), "--uds-path", str(uds),
         "--kv-cache-memory", "4MiB"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{uds}-0 exists and is not a socket; choose another --uds-path" in result.stdout + result.stderr
    assert Path(f"{uds}-0").read_text() == "keep me"


def test_cli_help_lists_every_option():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(REPO / p) for p in ("server", "kernels", "proto")))
    out = subprocess.run([sys.executable, "-m", "specula_server.cli", "serve", "--help"], env=env,
                         capture_output=True, text=True, check=True).stdout
    for flag in ("--uds-path", "--revision", "--dtype", "--device", "--kv-cache-memory", "--block-size"):
        assert flag in out


def test_the_worker_config_defaults_to_what_its_command_line_does():
    """A ServerConfig built by hand and one `specula-server serve MODEL` builds agree on every setting left out
    (the config's names for two: hub_cache, adapter_dirs; list flags are tuples)."""
    fields = {f.name: f.default for f in dataclasses.fields(ServerConfig) if f.default is not dataclasses.MISSING}
    renamed = {"huggingface_hub_cache": "hub_cache", "adapter_dir": "adapter_dirs"}
    compared = 0
    for setting in settings_of(Process.WORKER):
        name, default = renamed.get(setting.name, setting.name), setting.declared(Process.WORKER).default
        if name in fields:
            assert fields[name] == (tuple(default) if isinstance(default, list) else default), setting.flag
            compared += 1
    assert compared >= 25


def broken_once(generator):
    """Makes the generator's next step fail as an unexpected fault would, and the ones after work."""
    original = generator.step

    def fail_then_restore(plan, newcomers_waiting=None):
        generator.step = original
        raise RuntimeError("device fell over")

    generator.step = fail_then_restore


def test_a_fault_in_a_step_fails_that_step_and_a_lone_shard_keeps_serving(llama_dir, tmp_path):
    generator, info = in_process_worker(llama_dir, tmp_path)
    generator.allocate_kv_cache(64)
    fatal: list[BaseException] = []

    async def generate(stub, request_id: int, blocks: list[int]) -> list[int]:
        response = await stub.Step(step([request(request_id, [1, 5, 9, 13], blocks, max_new=3)]))
        tokens = [t for g in response.generations for t in g.tokens.ids]
        while response.num_requests:
            response = await stub.Step(step())
            tokens += [t for g in response.generations for t in g.tokens.ids]
        return tokens

    async def body(stub):
        expected = await generate(stub, 1, [0])
        await stub.Step(step([request(2, [1, 5, 9, 13], [1])]))
        broken_once(generator)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Step(step())
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "device fell over" in err.value.details()
        # What the router does after a failed step: its requests are listed as finished in the next one.
        assert (await stub.Step(step(finished=[2]))).num_requests == 0
        assert await generate(stub, 3, [2]) == expected
        await stub.Health(pb.HealthRequest())

    asyncio.run(serve_in_process(generator, info, fatal, body))
    assert not fatal


def test_a_fault_in_a_step_stops_a_tensor_parallel_shard(llama_dir, tmp_path):
    """A rank that failed may have left its peers in a collective or a step behind: only a restart is safe."""
    generator, info = in_process_worker(llama_dir, tmp_path, world_size=2)
    fatal: list[BaseException] = []
    broken_once(generator)

    async def body(stub):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Step(step())
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "device fell over" in err.value.details()

    asyncio.run(serve_in_process(generator, info, fatal, body))
    assert len(fatal) == 1 and isinstance(fatal[0], RuntimeError)


def test_sequenced_steps_run_in_order_whatever_order_they_arrive(stub_factory):
    async def body(stub):
        await stub.Warmup(pb.WarmupRequest(max_input_tokens=32, max_prefill_tokens=32, max_total_tokens=64))
        await stub.Step(step([request(9, [1, 2], [3], max_new=8)], sequence=1))
        await stub.Warmup(pb.WarmupRequest(max_input_tokens=32, max_prefill_tokens=32, max_total_tokens=64))
        # Warmup drops every request and sequences restart at 1.
        first = step([request(1, [1, 5, 6], [0, 1], max_new=8)], sequence=1)
        # Step 3 and 2 are sent before step 1; each must wait for its turn.
        third = asyncio.ensure_future(stub.Step(step(sequence=3)))
        second = asyncio.ensure_future(stub.Step(step(sequence=2)))
        await asyncio.sleep(0.2)
        assert not third.done() and not second.done()
        r1 = await stub.Step(first)
        r2, r3 = await second, await third
        assert [g.request_id for r in (r1, r2, r3) for g in r.generations] == [1, 1, 1]
        assert r2.timings.total_ns > 0 and r3.num_requests == 1
        # A stale sequence number is refused, not run.
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Step(step(sequence=2))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "arrived after" in err.value.details()

    stub_factory(body)
