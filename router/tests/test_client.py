"""`ShardedClient` over real gRPC, against in-process shards that answer as told: Step and Warmup, the adapter
RPCs, and the check at connect that every shard belongs to the router's launcher run."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc

from specula_proto import generate_pb2 as pb
from specula_proto import generate_pb2_grpc
from specula_router.client import ForeignShardError, ShardedClient
from specula_router.requests import SamplingParameters, StoppingParameters
from specula_router.step_messages import NewRequest, RequestUpdate


class AdapterShard(generate_pb2_grpc.TextGenerationServiceServicer):
    """Loads whatever it is asked to, unless `refuse` (answer loaded=False) or `abort` (fail the RPC) say no."""

    def __init__(self, refuse: str | None = None, abort: str | None = None) -> None:
        self.refuse, self.abort = refuse, abort
        self.loaded: set[str] = set()
        self.requests: list[pb.LoadAdapterRequest] = []

    async def LoadAdapter(self, request, context):
        self.requests.append(request)
        if self.abort is not None:
            await context.abort(grpc.StatusCode.INTERNAL, self.abort)
        if self.refuse is not None:
            return pb.LoadAdapterResponse(loaded=False, error=self.refuse, error_status=400)
        self.loaded.add(request.adapter_id)
        return pb.LoadAdapterResponse(loaded=True, kind="lora", load_seconds=0.25)

    async def OffloadAdapter(self, request, context):
        offloaded = request.adapter_id in self.loaded
        self.loaded.discard(request.adapter_id)
        return pb.OffloadAdapterResponse(offloaded=offloaded)


def with_shards(tmp_path, shards: list[AdapterShard], body) -> None:
    async def main():
        servers, channels = [], []
        for rank, shard in enumerate(shards):
            server = grpc.aio.server()
            generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(shard, server)
            url = f"unix://{tmp_path}/shard-{rank}"
            server.add_insecure_port(url)
            await server.start()
            servers.append(server)
            channels.append(grpc.aio.insecure_channel(url))
        client = ShardedClient(channels)
        try:
            await body(client)
        finally:
            await client.close()
            await asyncio.gather(*(s.stop(None) for s in servers))

    asyncio.run(main())


def test_an_adapter_loads_on_every_shard_and_offloads(tmp_path):
    shards = [AdapterShard(), AdapterShard()]

    async def body(client):
        response = await client.load_adapter("org/lora", "hub", "hf_token")
        assert (response.loaded, response.kind, response.load_seconds) == (True, "lora", 0.25)
        assert all(s.loaded == {"org/lora"} for s in shards)
        assert [(r.adapter_source, r.api_token) for s in shards for r in s.requests] == [("hub", "hf_token")] * 2
        assert await client.offload_adapter("org/lora") is True
        assert await client.offload_adapter("org/lora") is False
        assert all(not s.loaded for s in shards)

    with_shards(tmp_path, shards, body)


def test_one_shard_refusing_fails_the_load_and_the_others_let_go(tmp_path):
    shards = [AdapterShard(), AdapterShard(refuse="adapter `../x` is outside the adapter directories")]

    async def body(client):
        response = await client.load_adapter("../x", "local")
        assert (response.loaded, response.error_status) == (False, 400) and "outside" in response.error
        assert shards[0].loaded == set()  # offloaded again: no slot stays taken

    with_shards(tmp_path, shards, body)


def test_a_failed_rpc_is_a_424_with_its_message(tmp_path):
    shards = [AdapterShard(abort="CUDA out of memory"), AdapterShard()]

    async def body(client):
        response = await client.load_adapter("org/big", "hub")
        assert (response.loaded, response.error_status) == (False, 424)
        assert response.error == "adapter `org/big`: LoadAdapter failed on shard 0: CUDA out of memory"
        assert shards[1].loaded == set()

    with_shards(tmp_path, shards, body)


class InstanceShard(generate_pb2_grpc.TextGenerationServiceServicer):
    """Lists every shard's URL (as shard 0 does) and reports a launcher run's instance id in Info."""

    def __init__(self, urls: list[str], instance_id: str, model_id: str = "m") -> None:
        self.urls, self.instance_id, self.model_id = urls, instance_id, model_id

    async def ServiceDiscovery(self, request, context):
        return pb.ServiceDiscoveryResponse(urls=self.urls)

    async def Info(self, request, context):
        return pb.InfoResponse(model_id=self.model_id, instance_id=self.instance_id)


def connect_to(tmp_path, shard_ids: list[str], router_id: str) -> str | None:
    """Serves one InstanceShard per id and connects to shard 0 as a router given `router_id`; returns the
    ForeignShardError's message, or None when the router accepted every shard."""
    async def main():
        urls = [f"unix://{tmp_path}/shard-{rank}" for rank in range(len(shard_ids))]
        servers = []
        for url, shard_id in zip(urls, shard_ids):
            server = grpc.aio.server()
            generate_pb2_grpc.add_TextGenerationServiceServicer_to_server(
                InstanceShard(urls, shard_id, model_id=f"model-of-{shard_id or 'none'}"), server)
            server.add_insecure_port(url)
            await server.start()
            servers.append(server)
        try:
            client = await ShardedClient.connect(urls[0], timeout=10, instance_id=router_id)
            assert client.num_shards == len(shard_ids)
            await client.close()
            return None
        except ForeignShardError as e:
            return str(e)
        finally:
            await asyncio.gather(*(s.stop(None) for s in servers))

    return asyncio.run(main())


def test_a_router_connects_to_the_shards_of_its_own_launcher_run(tmp_path):
    assert connect_to(tmp_path, ["run-a", "run-a"], "run-a") is None
    assert connect_to(tmp_path, ["", ""], "") is None  # started by hand: no ids on either side


def test_a_shard_of_another_launcher_run_is_refused_naming_it(tmp_path):
    error = connect_to(tmp_path, ["run-a", "run-b"], "run-a")
    assert error is not None and error.startswith(f"shard 1 at unix://{tmp_path}/shard-1 belongs to instance run-b "
                                                  f"(serving model-of-run-b), not to this router's instance run-a")
    assert "--shard-uds-path" in error
    error = connect_to(tmp_path, ["run-b"], "run-a")
    assert error is not None and error.startswith("shard 0 at") and "belongs to instance run-b" in error
    error = connect_to(tmp_path, [""], "run-a")  # a shard started alone is no shard of this launcher's
    assert error is not None and "belongs to no launcher (started alone)" in error
    # A router given no id still refuses shards that disagree among themselves.
    error = connect_to(tmp_path, ["run-a", "run-b"], "")
    assert error is not None and "not to shard 0's instance run-a" in error


class StepShard(generate_pb2_grpc.TextGenerationServiceServicer):
    """Records the steps it gets and answers each with its rank and the step's sequence number."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.steps: list[pb.StepRequest] = []

    async def Step(self, request, context):
        self.steps.append(request)
        return pb.StepResponse(generations=[pb.Generation(request_id=self.rank, drafted_tokens=request.sequence)],
                               timings=pb.Timings(total_ns=5), num_requests=len(request.new_requests))

    async def Warmup(self, request, context):
        return pb.WarmupResponse(num_blocks=10 + self.rank)


def test_a_step_goes_to_every_shard_in_sequence_and_warmup_restarts_the_count(tmp_path):
    shards = [StepShard(0), StepShard(1)]

    async def body(client):
        update = RequestUpdate(7, [3, 4])
        sampling = SamplingParameters(True, 0.7, 5, 0.9, 1.0, 1.0, 0.0, 0.0, seed=2**64 - 1, logit_bias=((3, -1.5),))
        new = NewRequest(8, (5,), sampling, StoppingParameters(9, ("x",), False), blocks=(0, 1), grammar="g")
        off = dataclasses.replace(new, id=9, speculative_tokens=0)  # 0 is set (speculation off); None is not
        first = client.step([1], [update], [new, off])  # sent before it is awaited
        second = client.step([], [], [])
        responses = [await first, await second]
        assert [(r.generations[0].request_id, r.generations[0].drafted_tokens) for r in responses] == [(0, 1), (0, 2)]
        assert responses[0].timings.total_ns == 5
        for shard in shards:  # they may arrive in any order: the worker runs them by sequence number
            steps = sorted(shard.steps, key=lambda s: s.sequence)
            assert [s.sequence for s in steps] == [1, 2]
            assert list(steps[0].finished) == [1]
            assert list(steps[0].updates) == [pb.RequestUpdate(id=7, new_blocks=[3, 4])]
            sent = steps[0].new_requests[0]  # the router's message, field for field on the wire
            assert (sent.id, list(sent.input_ids), list(sent.blocks), sent.grammar) == (8, [5], [0, 1], "g")
            assert (sent.parameters.seed, dict(sent.parameters.logit_bias), sent.parameters.top_k) == (2**64 - 1,
                                                                                                    {3: -1.5}, 5)
            assert (sent.stopping_parameters.max_new_tokens, list(sent.stopping_parameters.stop_sequences)) == (
                9, ["x"])
            assert not sent.HasField("speculative_tokens")
            assert steps[0].new_requests[1].HasField("speculative_tokens")
            assert steps[0].new_requests[1].speculative_tokens == 0
        assert (await client.warmup(10, 10, 20)).num_blocks == 10  # the smallest cache over shards
        await client.step([], [], [])
        assert shards[1].steps[-1].sequence == 1

    with_shards(tmp_path, shards, body)
