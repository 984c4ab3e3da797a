"""The router's command line and startup: adapter flags, their checks, /info, and preloading before serving."""

from __future__ import annotations

import asyncio
import logging

import pytest
import typer
from fake_worker import AdapterBehaviour, FakeClient
from typer.testing import CliRunner

from specula_proto import generate_pb2 as pb
from specula_router import cli, server
from specula_router.client import ShardedClient
from specula_router.config import RouterConfig, split_ids
from specula_router.startup import Limits, derive_limits, fit_to_kv, run
from specula_testing.tokenizer import build_tokenizer


def parse(args: list[str], env: dict[str, str] | None = None, monkeypatch: pytest.MonkeyPatch | None = None) -> dict:
    for name, value in (env or {}).items():
        assert monkeypatch is not None
        monkeypatch.setenv(name, value)
    return typer.main.get_command(cli.app).make_context("specula-router", ["--model-id", "m", *args]).params


def test_adapter_flags_and_environment(monkeypatch):
    for name in ("MAX_ACTIVE_ADAPTERS", "PRELOADED_ADAPTER_IDS", "ADAPTER_SOURCE"):
        monkeypatch.delenv(name, raising=False)
    params = parse([])
    assert (params["max_active_adapters"], list(params["preloaded_adapter_ids"]), params["adapter_source"]) == (
        8, [], "hub")
    params = parse(["--preloaded-adapter-ids", "a,b", "--preloaded-adapter-ids", "c", "--max-active-adapters", "3"])
    assert split_ids(params["preloaded_adapter_ids"]) == ("a", "b", "c") and params["max_active_adapters"] == 3
    params = parse([], {"PRELOADED_ADAPTER_IDS": "org/a,org/b org/c", "MAX_ACTIVE_ADAPTERS": "4"}, monkeypatch)
    assert split_ids(params["preloaded_adapter_ids"]) == ("org/a", "org/b", "org/c")
    assert params["max_active_adapters"] == 4
    with pytest.raises(Exception, match="greater than or equal to 1"):
        parse(["--max-active-adapters", "0"])


@pytest.mark.parametrize(("settings", "message"), [
    (dict(adapter_source="s3"), "--adapter-source must be one of hub, local; got 's3'"),
    (dict(max_active_adapters=0), "--max-active-adapters must be at least 1; got 0"),
    (dict(max_active_adapters=1, preloaded_adapter_ids=("a", "b")),
     r"--preloaded-adapter-ids names 2 adapters, more than --max-active-adapters \(1\)"),
    (dict(preloaded_adapter_ids=("x" * 300,)), "is not an adapter id"),
    (dict(validation_workers=0), "--validation-workers must be at least 1; got 0"),
    (dict(max_adapter_labels=-1), "--max-adapter-labels must be at least 0; got -1"),
    (dict(metrics_prefix="tgi-x"), "--metrics-prefix must be letters, digits and _ .*; got 'tgi-x'"),
    (dict(metrics_prefix="1tgi"), "--metrics-prefix must be letters"),
])
def test_adapter_settings_are_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(model_id="m", master_shard_uds_path="/tmp/s-0", **settings)


class StartupClient(FakeClient):
    """The fake worker with the startup RPCs the router calls before serving."""

    async def info(self) -> pb.InfoResponse:
        return pb.InfoResponse(model_id="m", dtype="float32", device_type="cpu", block_size=16,
                               max_position_embeddings=512, world_size=1,
                               speculation=pb.SpeculationInfo(method="none", mode="off"))

    async def warmup(self, *limits) -> pb.WarmupResponse:
        return pb.WarmupResponse(num_blocks=64)

    async def close(self) -> None:
        return None


@pytest.fixture()
def startup(tmp_path, monkeypatch):
    """Runs `run` against a StartupClient; uvicorn's serve is replaced by a check of the state it would serve."""
    build_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "max_position_embeddings": 512}')
    client = StartupClient()
    served: list[server.RouterState] = []

    async def connect(url, timeout=30.0, instance_id=""):
        return client

    async def serve(self):
        served.append(self.config.app.state.router)
        served.append(set(client.loaded_adapters))  # what the workers held when serving began

    monkeypatch.setattr(ShardedClient, "connect", staticmethod(connect))
    monkeypatch.setattr("uvicorn.Server.serve", serve)
    config = dict(model_id=str(tmp_path), master_shard_uds_path="/tmp/unused-0", max_active_adapters=2)
    return client, served, config


def test_preloaded_adapters_are_loaded_before_serving_and_reported(startup):
    client, served, config = startup
    code = asyncio.run(run(RouterConfig(**config, preloaded_adapter_ids=("org/a", "org/b"))))
    state, loaded = served
    assert code == 0 and loaded == {"org/a", "org/b"}
    assert client.adapter_calls == [("load", "org/a"), ("load", "org/b")]
    assert state.info["adapters"] == {"max_active_adapters": 2, "adapter_source": "hub",
                                      "preloaded_adapter_ids": ["org/a", "org/b"]}
    assert state.scheduler.adapters.is_ready("org/a") and state.scheduler.adapters.max_active_adapters == 2


def test_validation_and_metrics_flags_and_environment(monkeypatch):
    for name in ("VALIDATION_WORKERS", "MAX_ADAPTER_LABELS"):
        monkeypatch.delenv(name, raising=False)
    params = parse([])
    assert (params["validation_workers"], params["max_adapter_labels"]) == (2, 32)
    params = parse([], {"VALIDATION_WORKERS": "4", "MAX_ADAPTER_LABELS": "0"}, monkeypatch)
    assert (params["validation_workers"], params["max_adapter_labels"]) == (4, 0)
    with pytest.raises(Exception, match="greater than or equal to 1"):
        parse(["--validation-workers", "0"])


def test_metrics_prefix_flag_and_environment(monkeypatch):
    monkeypatch.delenv("METRICS_PREFIX", raising=False)
    assert parse([])["metrics_prefix"] == "specula"
    assert parse(["--metrics-prefix", "lorax"])["metrics_prefix"] == "lorax"
    assert parse([], {"METRICS_PREFIX": "tgi"}, monkeypatch)["metrics_prefix"] == "tgi"


def test_validation_workers_and_adapter_labels_reach_the_served_state(startup):
    client, served, config = startup
    run_config = RouterConfig(**config, preloaded_adapter_ids=("org/a", "org/b"), validation_workers=3,
                              max_adapter_labels=1, metrics_prefix="tgi")
    assert asyncio.run(run(run_config)) == 0
    state = served[0]
    assert state.validation_workers == 3 and state.validation_pool._max_workers == 3
    assert state.info["validation_workers"] == 3
    assert [state.metrics.adapter_label(a) for a in ("org/a", "org/b", "")] == ["org/a", "other", ""]
    assert b"\ntgi_queue_size " in state.metrics.render()  # --metrics-prefix reached the served metrics
    assert state.validator.max_top_k == state.validator.tokenizer.get_vocab_size(with_added_tokens=True)


def test_a_preload_failure_stops_startup_naming_the_adapter(startup, caplog):
    client, served, config = startup
    client.adapters["org/bad"] = AdapterBehaviour(error="adapter `org/bad`: no adapter_config.json")
    with pytest.raises(ValueError, match="preloaded adapter `org/bad` could not be loaded: .*no adapter_config.json"):
        asyncio.run(run(RouterConfig(**config, preloaded_adapter_ids=("org/good", "org/bad"))))
    assert served == []

    caplog.set_level(logging.ERROR)
    result = CliRunner().invoke(cli.app, [
        "--model-id", config["model_id"], "--preloaded-adapter-ids", "org/bad"])
    assert result.exit_code == 2 and served == []
    assert any("preloaded adapter `org/bad`" in r.getMessage() for r in caplog.records)


def test_the_router_takes_the_lookahead_and_block_size_from_the_workers(startup, monkeypatch):
    client, served, config = startup
    info = asyncio.run(client.info())
    info.block_size, info.speculation.max_speculative_tokens = 8, 3

    async def workers_info():
        return info

    monkeypatch.setattr(client, "info", workers_info)
    assert asyncio.run(run(RouterConfig(**config, speculative_tokens=0))) == 0
    scheduler = served[0].scheduler
    assert scheduler.config.lookahead == 3 and scheduler.allocator.block_size == 8
    assert served[0].info["speculation"]["reserved_lookahead_tokens"] == 3
    assert served[0].validator.limits.max_speculative_tokens == 3
    assert client.steps == []  # nothing but Info and Warmup before serving (no ClearCache: Warmup resets)


def test_default_limits_are_lowered_to_the_kv_cache_and_flags_are_refused_when_they_do_not_fit():
    """TGI 3's defaults: every position of the model, then lowered to what the cache holds once warmup measured
    it (a 128k-position model on a small CPU cache starts). A limit a flag set is never lowered."""
    config = RouterConfig(model_id="m", master_shard_uds_path="/tmp/s-0")
    limits = derive_limits(config, 131072, lookahead=3)
    assert limits == Limits(131068, 131069, 4096)  # no 4096 cap on sequences; prefill steps of 4096
    fitted = fit_to_kv(limits, config, kv_tokens=4000, lookahead=3)
    assert fitted == Limits(3996, 3997, 4046)  # one request of max_total + lookahead fits the cache
    assert fit_to_kv(limits, config, kv_tokens=200_000, lookahead=3) == limits
    explicit = RouterConfig(model_id="m", master_shard_uds_path="/tmp/s-0", max_total_tokens=8000)
    with pytest.raises(ValueError, match=r"holds 4000 tokens, fewer than one request's 8003 .*--max-total-tokens"):
        fit_to_kv(derive_limits(explicit, 131072, 3), explicit, kv_tokens=4000, lookahead=3)
    long_input = RouterConfig(model_id="m", master_shard_uds_path="/tmp/s-0", max_input_tokens=5000)
    with pytest.raises(ValueError, match=r"--max-input-tokens \(5000\)"):
        fit_to_kv(derive_limits(long_input, 131072, 3), long_input, kv_tokens=4000, lookahead=3)
