"""Launcher tests: config defaults and checks, the children's command lines, and supervision of fake children.

The supervision tests run small `python -c` programs in place of the shards and the router: they record what
happens to them (start, SIGTERM, exit) in an events file, create their "socket" like a real shard, and crash
or ignore SIGTERM on demand. Real shards and a real router are started by integration-tests/.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specula_launcher import cli
from specula_launcher.commands import router_command, router_spec, shard_command, shard_env, shard_sockets, shard_specs
from specula_launcher.compat import FOREIGN_FLAGS
from specula_launcher.config import LauncherConfig
from specula_launcher.defaults import DEMO_ADAPTERS_DIR, DEMO_MODEL_DIR, build_config, derive_token_limits
from specula_launcher.endpoints import claim_endpoints
from specula_launcher.processes import ChildSpec, LogSink, Supervisor, describe_exit

LAUNCHER_DIR = Path(__file__).resolve().parent.parent
ENV_VARS = (
    "MODEL_ID", "REVISION", "NUM_SHARD", "DTYPE", "DEVICE", "PORT", "SPECULA_HOSTNAME", "SPECULATIVE_TOKENS",
    "SPECULATOR",
    "ADAPTER_SOURCE", "MAX_CONCURRENT_REQUESTS", "MAX_BEST_OF", "MAX_STOP_SEQUENCES", "MAX_TOP_N_TOKENS",
    "MAX_GRAMMAR_BYTES", "GRAMMAR_COMPILE_TIMEOUT",
    "MAX_INPUT_TOKENS", "MAX_INPUT_LENGTH", "MAX_TOTAL_TOKENS", "WAITING_SERVED_RATIO", "MAX_BATCH_PREFILL_TOKENS",
    "MAX_BATCH_TOTAL_TOKENS", "MAX_WAITING_TOKENS", "MAX_BATCH_SIZE", "SHARD_UDS_PATH", "MASTER_ADDR",
    "MASTER_PORT", "HUGGINGFACE_HUB_CACHE", "JSON_OUTPUT", "PAYLOAD_LIMIT", "CORS_ALLOW_ORIGIN", "KV_CACHE_MEMORY",
    "KV_CACHE_DTYPE",
    "BLOCK_SIZE", "SHUTDOWN_TIMEOUT", "LOG_LEVEL", "ADAPTER_DIR", "MAX_ACTIVE_ADAPTERS", "PRELOADED_ADAPTER_IDS",
    "DRAFT_TREE_WIDTH", "STEP_TIMEOUT", "NO_PREFIX_CACHING", "VALIDATION_WORKERS", "MAX_ADAPTER_LABELS",
    "METRICS_PREFIX", "CHAT_TEMPLATE", "API_KEY", "SPECULATE", "LORA_ADAPTERS", "DEFAULT_ADAPTER_SOURCE",
    "GRACEFUL_TERMINATION_TIMEOUT",
    # TGI/LoRAX variables the launcher refuses or warns about (compat.py)
    *(flag.env_name for flag in FOREIGN_FLAGS.values() if flag.env_name),
)
NO_GPU = dict(count_cuda_devices=lambda: 0)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher reads these variables; the machine running the tests must not leak its own."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


def flags(argv: list[str]) -> dict[str, tuple[str, ...]]:
    """A command line's flags and their values, in no order (a child's CLI reads them in any):
    ["--a", "1", "--b", "--a", "2"] -> {"--a": ("1", "2"), "--b": ()}."""
    found: dict[str, tuple[str, ...]] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            value = argv[i + 1:i + 2] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else []
            found[arg] = found.get(arg, ()) + tuple(value)
    return found


def make_model_dir(root: Path, max_positions: int = 8192) -> Path:
    model = root / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": max_positions}))
    return model


def claimed(c: LauncherConfig) -> LauncherConfig:
    """`c` as the launch step leaves it, with a fixed socket path and port where it chose none (no id)."""
    return dataclasses.replace(c, shard_uds_path=c.shard_uds_path or "/run/s", master_port=c.master_port or 29600)


# ---------------------------------------------------------------------------------------------------- config


def test_defaults_serve_the_bundled_demo_model() -> None:
    c = build_config(**NO_GPU)
    assert c.model_id == str(DEMO_MODEL_DIR) and (DEMO_MODEL_DIR / "model.safetensors").is_file()
    assert (c.device, c.dtype, c.num_shard, c.port, c.hostname) == ("cpu", "float32", 1, 3000, "0.0.0.0")
    # The demo model has 2048 positions: total = min(2048, 4096), input = total - 1, prefill = input + 50.
    assert (c.max_total_tokens, c.max_input_tokens, c.max_batch_prefill_tokens) == (2048, 2047, 2097)
    assert (c.max_concurrent_requests, c.max_best_of, c.max_stop_sequences, c.max_top_n_tokens) == (128, 2, 4, 5)
    assert (c.waiting_served_ratio, c.max_waiting_tokens, c.max_batch_size, c.max_batch_total_tokens) == (
        1.2, 20, None, None)
    # Chosen per launcher at launch (endpoints.py), so two launchers never share them.
    assert (c.shard_uds_path, c.master_addr, c.master_port, c.instance_id) == (None, "localhost", None, None)
    # ... with its family: the bundled adapters are the local adapters, and local the default source.
    assert (c.speculative_tokens, c.speculator, c.adapter_source) == (0, None, "local")
    assert (c.max_active_adapters, c.preloaded_adapter_ids, c.adapter_dir) == (8, (), (str(DEMO_ADAPTERS_DIR),))
    assert (c.payload_limit, c.block_size, c.shutdown_timeout, c.log_level) == (2_000_000, 16, 30, "INFO")
    assert (c.json_output, c.cors_allow_origin, c.kv_cache_memory, c.revision) == (False, (), None, None)


def test_the_demo_family_is_served_with_the_demo_model(tmp_path: Path) -> None:
    """The bundled adapters are local adapters by default with the demo model only; flags given win; the
    family's members may be named as --speculator."""
    members = {"camel-case", "two-space", "medusa", "mlp-speculator", "draft-model"}
    assert members <= {p.name for p in DEMO_ADAPTERS_DIR.iterdir() if p.is_dir()}
    for name in ("camel-case", "two-space"):
        files = {p.name for p in (DEMO_ADAPTERS_DIR / name).iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    c = build_config(model_id=str(DEMO_MODEL_DIR), **NO_GPU)  # the demo model named explicitly
    assert (c.adapter_dir, c.adapter_source) == ((str(DEMO_ADAPTERS_DIR),), "local")
    assert flags(shard_command(claimed(c)))["--adapter-dir"] == (str(DEMO_ADAPTERS_DIR),)
    argv = router_command(claimed(c))
    assert argv[argv.index("--adapter-source") + 1] == "local"
    c = build_config(adapter_dir=[str(tmp_path)], adapter_source="hub", **NO_GPU)
    assert (c.adapter_dir, c.adapter_source) == ((str(tmp_path),), "hub")
    other = str(make_model_dir(tmp_path))
    c = build_config(model_id=other, **NO_GPU)  # another model: no family
    assert (c.adapter_dir, c.adapter_source) == ((), "hub")
    for name in ("draft-model", "mlp-speculator", "medusa"):
        c = build_config(speculative_tokens=3, speculator=name, **NO_GPU)
        assert c.speculator == str(DEMO_ADAPTERS_DIR / name)
        argv = shard_command(claimed(c))
        assert argv[argv.index("--speculator") + 1] == str(DEMO_ADAPTERS_DIR / name)
    assert build_config(speculative_tokens=3, speculator="org/heads", **NO_GPU).speculator == "org/heads"
    assert build_config(model_id=other, speculative_tokens=3, speculator="draft-model",
                        **NO_GPU).speculator == "draft-model"  # not the demo model: a Hub id as given


def test_device_and_dtype_follow_the_gpu() -> None:
    c = build_config(count_cuda_devices=lambda: 2)
    assert (c.device, c.dtype) == ("cuda", "bfloat16")
    assert build_config(count_cuda_devices=lambda: 2, device="cpu").dtype == "float32"
    assert build_config(count_cuda_devices=lambda: 2, dtype="float16").dtype == "float16"
    with pytest.raises(ValueError, match="--num-shard 3 needs one GPU per shard; torch sees 2"):
        build_config(count_cuda_devices=lambda: 2, device="cuda", num_shard=3)
    with pytest.raises(ValueError, match="torch sees no CUDA device"):
        build_config(count_cuda_devices=lambda: 0, device="cuda")


def test_token_limits_come_from_the_model_config(tmp_path: Path) -> None:
    model = str(make_model_dir(tmp_path, max_positions=8192))
    c = build_config(model_id=model, **NO_GPU)  # every position; prefill steps of 4096 at most
    assert (c.max_input_tokens, c.max_total_tokens, c.max_batch_prefill_tokens) == (8191, 8192, 4096)
    assert c.given_limits == ()  # defaults: the router derives them again and fits them to the KV cache
    assert not {"--max-input-tokens", "--max-total-tokens", "--max-batch-prefill-tokens"} & set(
        router_command(claimed(c)))
    c = build_config(model_id=model, max_total_tokens=1000, **NO_GPU)
    assert (c.max_input_tokens, c.max_total_tokens, c.max_batch_prefill_tokens) == (999, 1000, 1049)
    assert c.given_limits == ("max_total_tokens",)
    argv = router_command(claimed(c))
    assert argv[argv.index("--max-total-tokens") + 1] == "1000" and "--max-input-tokens" not in argv
    c = build_config(model_id=model, max_input_tokens=5000, **NO_GPU)
    assert (c.max_input_tokens, c.max_total_tokens) == (5000, 8192)
    c = build_config(model_id=model, max_batch_total_tokens=3000, **NO_GPU)  # a request fits the batch
    assert (c.max_total_tokens, c.max_batch_prefill_tokens) == (3000, 3000)


def test_speculative_lookahead_is_reserved_in_the_positions() -> None:
    assert derive_token_limits(2048, None, None, None, None, speculative_tokens=3) == (2044, 2045, 2094)
    c = build_config(speculative_tokens=3, **NO_GPU)  # the 2048-position demo model
    assert (c.max_total_tokens, c.speculative_tokens) == (2045, 3)
    with pytest.raises(ValueError, match=r"--max-total-tokens \(2048\) \+ --speculative-tokens \(3\) exceeds"):
        build_config(speculative_tokens=3, max_total_tokens=2048, **NO_GPU)


def test_hub_models_leave_limits_to_the_router() -> None:
    c = build_config(model_id="meta-llama/Llama-3.1-8B", **NO_GPU)
    assert c.model_id == "meta-llama/Llama-3.1-8B"
    assert (c.max_input_tokens, c.max_total_tokens, c.max_batch_prefill_tokens) == (None, None, None)
    c = build_config(model_id="org/model", max_input_tokens=100, **NO_GPU)
    assert (c.max_input_tokens, c.max_total_tokens, c.max_batch_prefill_tokens) == (100, None, 150)


@pytest.mark.parametrize(("settings", "message"), [
    (dict(max_input_tokens=100, max_total_tokens=100), r"--max-input-tokens \(100\) must be less than "
                                                       r"--max-total-tokens \(100\)"),
    (dict(max_total_tokens=3000), r"--max-total-tokens \(3000\) \+ --speculative-tokens \(0\) exceeds the "
                                  r"model's max_position_embeddings \(2048\)"),
    (dict(max_total_tokens=1000, max_batch_total_tokens=999), r"must not exceed --max-batch-total-tokens \(999\)"),
    (dict(max_batch_prefill_tokens=5000, max_batch_total_tokens=4096), r"--max-batch-prefill-tokens \(5000\) must "
                                                                        r"not exceed --max-batch-total-tokens"),
    (dict(dtype="fp8"), r"--dtype must be one of float32, bfloat16, float16; got 'fp8'"),
    (dict(port=70000), r"--port must be between 1 and 65535; got 70000"),
    (dict(port=29500, master_port=29500), r"--port and --master-port are both 29500"),
    (dict(master_port=0), r"--master-port must be between 1 and 65535; got 0"),
    (dict(num_shard=0), r"--num-shard must be at least 1; got 0"),
    (dict(adapter_source="s3"), r"--adapter-source must be one of hub, local; got 's3'"),
    (dict(max_active_adapters=0), r"--max-active-adapters must be at least 1; got 0"),
    (dict(max_active_adapters=1, preloaded_adapter_ids=["a,b"]),
     r"--preloaded-adapter-ids names 2 adapters, more than --max-active-adapters \(1\)"),
    (dict(adapter_dir=["/no/such/adapters"]), r"--adapter-dir /no/such/adapters: no such directory"),
    (dict(kv_cache_memory="lots"), r"--kv-cache-memory is not a size: 'lots'"),
    (dict(log_level="chatty"), r"--log-level must be one of"),
    (dict(shard_uds_path="/tmp/" + "x" * 120), r"--shard-uds-path is too long"),
    (dict(model_id="./no/such/dir"), r"--model-id ./no/such/dir: no such directory"),
])
def test_invalid_settings_are_named(settings: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_config(**settings, **NO_GPU)


def test_model_directory_checks(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="the directory has no config.json"):
        build_config(model_id=str(tmp_path / "empty"), **NO_GPU)
    (tmp_path / "file.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="expected a model directory, a .gguf file or a Hub id, found another file"):
        build_config(model_id=str(tmp_path / "file.bin"), **NO_GPU)


def test_cli_reads_environment_variables(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[LauncherConfig] = []
    monkeypatch.setattr(cli, "launch", lambda config: seen.append(config) or 0)
    model = make_model_dir(tmp_path)
    env = {
        "MODEL_ID": str(model), "NUM_SHARD": "2", "PORT": "8080", "DEVICE": "cpu", "MAX_INPUT_LENGTH": "100",
        "MAX_TOTAL_TOKENS": "200", "CORS_ALLOW_ORIGIN": "http://a http://b", "JSON_OUTPUT": "true",
        "SPECULATIVE_TOKENS": "3", "LOG_LEVEL": "debug", "HUGGINGFACE_HUB_CACHE": "/data", "SHUTDOWN_TIMEOUT": "7",
        "KV_CACHE_MEMORY": "2GiB", "MAX_BATCH_SIZE": "8", "WAITING_SERVED_RATIO": "0.5",
    }
    result = CliRunner().invoke(cli.app, [], env=env)
    assert result.exit_code == 0, result.output
    c = seen[0]
    assert (c.model_id, c.num_shard, c.port, c.device, c.dtype) == (str(model), 2, 8080, "cpu", "float32")
    assert (c.max_input_tokens, c.max_total_tokens, c.max_batch_prefill_tokens) == (100, 200, 150)
    assert (c.cors_allow_origin, c.json_output, c.speculative_tokens) == (("http://a", "http://b"), True, 3)
    assert (c.log_level, c.huggingface_hub_cache, c.shutdown_timeout) == ("DEBUG", "/data", 7)
    assert (c.kv_cache_memory, c.max_batch_size, c.waiting_served_ratio) == ("2GiB", 8, 0.5)
    # A flag beats its environment variable.
    result = CliRunner().invoke(cli.app, ["--port", "9000", "--max-input-tokens", "50"], env=env)
    assert result.exit_code == 0, result.output
    assert (seen[1].port, seen[1].max_input_tokens) == (9000, 50)


def test_metrics_prefix_reaches_the_router_from_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[LauncherConfig] = []
    monkeypatch.setattr(cli, "launch", lambda config: seen.append(config) or 0)
    runs = (([], {}), ([], {"METRICS_PREFIX": "tgi"}), (["--metrics-prefix", "lorax"], {"METRICS_PREFIX": "tgi"}))
    for args, env in runs:
        result = CliRunner().invoke(cli.app, args, env=env)
        assert result.exit_code == 0, result.output
    assert [c.metrics_prefix for c in seen] == ["specula", "tgi", "lorax"]
    command = router_command(claimed(seen[1]))
    assert command[command.index("--metrics-prefix") + 1] == "tgi"


def test_cli_max_input_length_alias_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[LauncherConfig] = []
    monkeypatch.setattr(cli, "launch", lambda config: seen.append(config) or 0)
    args = ["--device", "cpu", "--max-input-length", "300", "--max-total-tokens", "400",
            "--cors-allow-origin", "https://x", "--cors-allow-origin", "https://y"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert (seen[0].max_input_tokens, seen[0].cors_allow_origin) == (300, ("https://x", "https://y"))
    result = CliRunner().invoke(cli.app, ["--device", "cpu", "--max-input-length", "400", "--max-total-tokens", "400"])
    assert result.exit_code == 2 and len(seen) == 1
    assert "--max-input-tokens (400) must be less" in " ".join(result.output.split())


# ---------------------------------------------------------------------------------------------------- commands


def test_shard_command_and_environment(tmp_path: Path) -> None:
    model = str(make_model_dir(tmp_path))
    c = build_config(model_id=model, num_shard=2, master_port=29600, log_level="debug", shard_uds_path="/run/x",
                     instance_id="abc", **NO_GPU)
    argv = shard_command(c)
    assert argv[:5] == [sys.executable, "-m", "specula_server.cli", "serve", model]
    assert flags(argv) == {"--uds-path": ("/run/x",), "--dtype": ("float32",), "--device": ("cpu",),
                           "--block-size": ("16",), "--max-active-adapters": ("8",), "--instance-id": ("abc",)}
    c = build_config(model_id="org/model", revision="v1", huggingface_hub_cache="/data", kv_cache_memory="4GiB",
                     dtype="bfloat16", block_size=32, shard_uds_path="/run/s", **NO_GPU)
    argv = shard_command(c)
    assert argv[:5] == [sys.executable, "-m", "specula_server.cli", "serve", "org/model"]
    assert flags(argv) == {"--uds-path": ("/run/s",), "--dtype": ("bfloat16",), "--device": ("cpu",),
                           "--block-size": ("32",), "--max-active-adapters": ("8",), "--revision": ("v1",),
                           "--huggingface-hub-cache": ("/data",), "--kv-cache-memory": ("4GiB",)}
    c = build_config(model_id=model, speculative_tokens=4, speculation_mode="fixed", ngram_max=4, **NO_GPU)
    speculation = {"--speculative-tokens": ("4",), "--speculation-mode": ("fixed",), "--ngram-min": ("1",),
                   "--ngram-max": ("4",), "--ngram-match": ("latest",), "--draft-tree-width": ("1",)}
    assert flags(shard_command(claimed(c))).items() >= speculation.items()
    assert "--speculator" not in shard_command(claimed(c)) and "--suffix-cache-tokens" not in shard_command(claimed(c))
    c = build_config(model_id=model, speculative_tokens=4, speculator="/m/heads", draft_tree_width=3, **NO_GPU)
    assert flags(shard_command(claimed(c))).items() >= {"--speculator": ("/m/heads",),
                                                        "--draft-tree-width": ("3",)}.items()
    c = build_config(model_id=model, speculative_tokens=4, speculator="suffix", suffix_cache_tokens=500, **NO_GPU)
    assert flags(shard_command(claimed(c)))["--suffix-cache-tokens"] == ("500",)
    c = build_config(model_id=model, speculative_tokens=4, speculator="/m/eagle", speculator_quantize="int4",
                     quantize_group_size=32, **NO_GPU)  # int4 takes its group size along, though --quantize is off
    assert flags(shard_command(claimed(c))).items() >= {"--speculator-quantize": ("int4",),
                                                        "--quantize-group-size": ("32",)}.items()
    with pytest.raises(ValueError, match="--speculator-quantize gguf is not supported"):
        build_config(model_id=model, speculative_tokens=4, speculator="/m/eagle", speculator_quantize="gguf", **NO_GPU)
    with pytest.raises(ValueError, match="no --speculator names one"):
        build_config(model_id=model, speculative_tokens=4, speculator_quantize="int8", **NO_GPU)
    c = build_config(model_id=model, ngram_max=4, speculator="/m/heads", **NO_GPU)  # speculation off
    assert not set(flags(shard_command(claimed(c)))) & {*speculation, "--speculator"}
    with pytest.raises(ValueError, match="--speculation-mode"):
        build_config(model_id=model, speculation_mode="sometimes", **NO_GPU)
    c = build_config(model_id=model, cuda_graphs="1,2,8", **NO_GPU)  # TGI's --cuda-graphs, passed to every shard
    assert flags(shard_command(claimed(c)))["--cuda-graphs"] == ("1,2,8",)
    import typer  # as in test_command_lines_parse_with_the_children_clis: the worker CLI reads what is written

    from specula_server import cli as server_cli

    serve = typer.main.get_command(server_cli.app).commands["serve"]  # type: ignore[attr-defined]
    assert serve.make_context("serve", shard_command(claimed(c))[4:]).params["cuda_graphs"] == "1,2,8"
    with pytest.raises(ValueError, match="--cuda-graphs takes batch sizes"):
        build_config(model_id=model, cuda_graphs="1,two", **NO_GPU)
    c = build_config(model_id=model, num_shard=2, master_port=29600, log_level="debug", **NO_GPU)
    env = shard_env(c, 1, {"HF_TOKEN": "secret", "PATH": "/bin"})
    assert env == {"HF_TOKEN": "secret", "PATH": "/bin", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2",
                   "MASTER_ADDR": "localhost", "MASTER_PORT": "29600", "LOG_LEVEL": "DEBUG", "PYTHONUNBUFFERED": "1"}
    specs = shard_specs(claimed(c), {"HF_TOKEN": "secret"})
    assert [s.name for s in specs] == ["shard-0", "shard-1"] and [s.env["RANK"] for s in specs] == ["0", "1"]


def test_each_node_of_a_multi_node_group_runs_its_share_of_the_ranks(tmp_path):
    """torchrun's flags: 4 shards over 2 nodes; node 1 runs ranks 2 and 3 (local ranks 0 and 1), serves them over
    TCP on the address node 0 reaches it at, and runs no router; both nodes agree on the instance id."""
    model = str(make_model_dir(tmp_path))
    common = dict(model_id=model, num_shard=4, nnodes=2, master_addr="10.0.0.1", master_port=29600, **NO_GPU)
    node0 = claim_endpoints(build_config(**common), parent=tmp_path).config
    node1 = claim_endpoints(build_config(**common, node_rank=1, node_host="10.0.0.2"), parent=tmp_path).config
    assert list(node0.local_ranks) == [0, 1] and list(node1.local_ranks) == [2, 3]
    assert node0.runs_router and not node1.runs_router and node0.instance_id == node1.instance_id
    specs = shard_specs(node1, {})
    assert [s.name for s in specs] == ["shard-2", "shard-3"]
    assert [(s.env["RANK"], s.env["LOCAL_RANK"], s.env["WORLD_SIZE"]) for s in specs] == [("2", "0", "4"),
                                                                                          ("3", "1", "4")]
    assert specs[0].argv[-2:] == ("--grpc-host", "10.0.0.2") and "--grpc-host" not in shard_specs(node0, {})[0].argv
    assert [p.name for p in shard_sockets(node1)] == ["shard-2", "shard-3"]
    for bad, match in ((dict(num_shard=3), "multiple of --nnodes"), (dict(node_rank=2), "--node-rank"),
                       (dict(master_port=None), "needs --master-port")):
        with pytest.raises(ValueError, match=match):
            build_config(**{**common, **bad})


def test_router_command_with_defaults(tmp_path: Path) -> None:
    c = claim_endpoints(build_config(**NO_GPU), parent=tmp_path).config  # a socket directory of its own
    assert Path(c.shard_uds_path).parent.parent == tmp_path and len(c.instance_id) == 32
    argv = router_command(c)
    assert argv[:3] == [sys.executable, "-m", "specula_router.cli"]
    assert flags(argv) == {
        "--model-id": (str(DEMO_MODEL_DIR),), "--master-shard-uds-path": (f"{c.shard_uds_path}-0",),
        "--hostname": ("0.0.0.0",), "--port": ("3000",), "--instance-id": (c.instance_id,),
        "--speculative-tokens": ("0",), "--adapter-source": ("local",), "--max-active-adapters": ("8",),
        "--max-concurrent-requests": ("128",), "--max-best-of": ("2",), "--max-stop-sequences": ("4",),
        "--max-top-n-tokens": ("5",), "--waiting-served-ratio": ("1.2",), "--max-waiting-tokens": ("20",),
        "--num-scheduler-steps": ("4",), "--payload-limit": ("2000000",), "--num-shard": ("1",),
        "--shutdown-timeout": ("30",),
        "--step-timeout": ("600.0",), "--log-level": ("INFO",), "--validation-workers": ("2",),
        "--max-adapter-labels": ("32",), "--metrics-prefix": ("specula",), "--adapter-dir": (str(DEMO_ADAPTERS_DIR),),
    }
    assert router_spec(c, {"HF_TOKEN": "t"}).env == {"HF_TOKEN": "t", "PYTHONUNBUFFERED": "1"}


def test_router_command_passes_every_flag() -> None:
    c = build_config(
        model_id="org/model", revision="main", huggingface_hub_cache="/data", speculative_tokens=3,
        speculator="org/medusa", adapter_source="local", max_active_adapters=4,
        preloaded_adapter_ids=["org/a,org/b", "org/c"], max_concurrent_requests=64, max_best_of=1,
        max_stop_sequences=2, max_top_n_tokens=0, max_input_tokens=1000, max_total_tokens=2000,
        waiting_served_ratio=0.5, max_batch_prefill_tokens=4000, max_batch_total_tokens=16000, max_waiting_tokens=5,
        max_batch_size=8, payload_limit=100, cors_allow_origin=["https://a", "https://b"], json_output=True,
        num_shard=2, shutdown_timeout=9, step_timeout=45, log_level="warning", hostname="127.0.0.1", port=8080,
        shard_uds_path="/run/s", validation_workers=3, max_adapter_labels=7, chat_template="/t/chat.jinja",
        metrics_prefix="tgi", adapter_dir=["/", "/tmp"], **NO_GPU,
    )
    argv = router_command(c)
    assert argv[1:3] == ["-m", "specula_router.cli"]
    assert flags(argv) == {
        "--model-id": ("org/model",), "--master-shard-uds-path": ("/run/s-0",), "--hostname": ("127.0.0.1",),
        "--port": ("8080",), "--revision": ("main",), "--huggingface-hub-cache": ("/data",),
        "--speculative-tokens": ("3",), "--speculator": ("org/medusa",), "--adapter-source": ("local",),
        "--max-active-adapters": ("4",), "--preloaded-adapter-ids": ("org/a", "org/b", "org/c"),
        "--max-concurrent-requests": ("64",), "--max-best-of": ("1",), "--max-stop-sequences": ("2",),
        "--max-top-n-tokens": ("0",), "--max-input-tokens": ("1000",), "--max-total-tokens": ("2000",),
        "--waiting-served-ratio": ("0.5",), "--max-batch-prefill-tokens": ("4000",),
        "--max-batch-total-tokens": ("16000",), "--max-waiting-tokens": ("5",), "--max-batch-size": ("8",),
        "--num-scheduler-steps": ("4",),
        "--payload-limit": ("100",), "--cors-allow-origin": ("https://a", "https://b"), "--json-output": (),
        "--num-shard": ("2",), "--shutdown-timeout": ("9",), "--step-timeout": ("45",), "--log-level": ("WARNING",),
        "--validation-workers": ("3",), "--max-adapter-labels": ("7",), "--chat-template": ("/t/chat.jinja",),
        "--metrics-prefix": ("tgi",), "--adapter-dir": ("/", "/tmp"),
    }


def test_adapter_flags_reach_the_router_and_every_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = [tmp_path / "team", tmp_path / "shared"]
    for d in dirs:
        d.mkdir()
    seen: list[LauncherConfig] = []
    monkeypatch.setattr(cli, "launch", lambda config: seen.append(config) or 0)
    env = {"DEVICE": "cpu", "ADAPTER_DIR": f"{dirs[0]},{dirs[1]}", "MAX_ACTIVE_ADAPTERS": "3",
           "PRELOADED_ADAPTER_IDS": "org/a,org/b org/c", "ADAPTER_SOURCE": "local"}
    result = CliRunner().invoke(cli.app, [], env=env)
    assert result.exit_code == 0, result.output
    c = seen[0]
    assert c.adapter_dir == (str(dirs[0]), str(dirs[1])) and c.adapter_source == "local"
    assert (c.max_active_adapters, c.preloaded_adapter_ids) == (3, ("org/a", "org/b", "org/c"))
    result = CliRunner().invoke(cli.app, ["--device", "cpu", "--adapter-dir", str(dirs[1]), "--preloaded-adapter-ids",
                                          "org/x", "--preloaded-adapter-ids", "org/y,org/x"])
    assert result.exit_code == 0, result.output
    assert (seen[1].adapter_dir, seen[1].preloaded_adapter_ids) == ((str(dirs[1]),), ("org/x", "org/y"))
    shard = flags(shard_command(claimed(c)))
    assert (shard["--max-active-adapters"], shard["--adapter-dir"]) == (("3",), (str(dirs[0]), str(dirs[1])))
    assert "--preloaded-adapter-ids" not in shard
    router = flags(router_command(claimed(c)))
    assert router["--max-active-adapters"] == ("3",)
    assert router["--preloaded-adapter-ids"] == ("org/a", "org/b", "org/c")
    result = CliRunner().invoke(cli.app, ["--device", "cpu", "--max-active-adapters", "1"],
                                env={"PRELOADED_ADAPTER_IDS": "a,b"})
    assert result.exit_code == 2 and len(seen) == 2
    assert "--preloaded-adapter-ids names 2 adapters" in " ".join(result.output.split())
    help_text = " ".join(CliRunner().invoke(cli.app, ["--help"], terminal_width=200).output.split())
    for flag in ("--adapter-dir", "--max-active-adapters", "--preloaded-adapter-ids"):
        assert flag in help_text


def test_command_lines_parse_with_the_children_clis(tmp_path: Path) -> None:
    """The contract: the router and worker CLIs accept exactly what the launcher passes."""
    import typer

    router_cli = pytest.importorskip("specula_router.cli")
    from specula_server import cli as server_cli

    c = build_config(model_id="org/model", revision="main", speculator="org/medusa", max_input_tokens=100,
                     max_batch_size=4, cors_allow_origin=["https://a", "https://b"], json_output=True,
                     kv_cache_memory="1GiB", huggingface_hub_cache="/data", adapter_dir=[str(tmp_path)] * 2,
                     max_active_adapters=2, preloaded_adapter_ids=["org/a", "org/b"], chat_template="{{ x }}",
                     prefix_caching=False, step_timeout=45, **NO_GPU)
    endpoints = claim_endpoints(c, parent=tmp_path)
    c = endpoints.config
    params = typer.main.get_command(router_cli.app).make_context("specula-router", router_command(c)[3:]).params
    assert params["model_id"] == "org/model" and params["master_shard_uds_path"] == f"{c.shard_uds_path}-0"
    assert params["instance_id"] == c.instance_id
    assert params["max_input_tokens"] == 100 and params["max_batch_size"] == 4 and params["json_output"] is True
    assert tuple(params["cors_allow_origin"]) == ("https://a", "https://b") and params["speculator"] == "org/medusa"
    assert params["max_active_adapters"] == 2 and tuple(params["preloaded_adapter_ids"]) == ("org/a", "org/b")
    assert params["chat_template"] == "{{ x }}" and tuple(params["adapter_dir"]) == (str(tmp_path),) * 2
    assert params["no_prefix_caching"] is True and params["step_timeout"] == 45
    serve = typer.main.get_command(server_cli.app).commands["serve"]  # type: ignore[attr-defined]
    params = serve.make_context("serve", shard_command(c)[4:]).params
    assert (params["model_id"], params["uds_path"], params["kv_cache_memory"]) == ("org/model", c.shard_uds_path,
                                                                                   "1GiB")
    assert params["instance_id"] == c.instance_id
    assert (params["revision"], str(params["huggingface_hub_cache"]), params["block_size"]) == ("main", "/data", 16)
    assert params["max_active_adapters"] == 2 and [str(d) for d in params["adapter_dir"]] == [str(tmp_path)] * 2


# ---------------------------------------------------------------------------------------------------- supervision

# A stand-in for a shard or the router. argv: name, events file, behaviour, then for a shard: socket, delay.
#   serve: run until SIGTERM; drain: on SIGTERM print, wait 0.3 s, then exit; stubborn: ignore SIGTERM;
#   crash: print 30 lines and an error on stderr, exit 3; cut: on SIGTERM exit 3 (a router whose drain was cut).
FAKE_CHILD = r"""
import os, signal, socket, sys, time
name, events, behaviour, rest = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def event(what):
    with open(events, "a") as f:
        f.write(f"{name} {what}\n")
def on_term(signum, frame):
    event("sigterm")
    if behaviour == "drain":
        print(f"{name} draining", flush=True)
        time.sleep(0.3)
    event("exit")
    sys.exit(3 if behaviour == "cut" else 0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if behaviour == "stubborn" else on_term)
event(f"start own_group={os.getpgid(0) == os.getpid()}" + (f" stale={os.path.exists(rest[0])}" if rest else ""))
print(f"{name} starting", flush=True)
if behaviour == "crash":
    time.sleep(0.2)
    for i in range(30):
        print(f"line {i}", flush=True)
    print("fatal: out of memory", file=sys.stderr, flush=True)
    sys.exit(3)
if rest:
    time.sleep(float(rest[1]))
    event("bind")  # written before the socket exists, so it always precedes the router's start
    socket.socket(socket.AF_UNIX).bind(rest[0])
    print(f"{name} ready", flush=True)
while True:
    time.sleep(0.02)
"""


class Harness:
    """Builds a Supervisor over fake children in `tmp_path` and reads back what happened."""

    def __init__(self, tmp_path: Path, json_output: bool = False) -> None:
        self.events = tmp_path / "events"
        self.events.touch()
        self.sockets = [tmp_path / f"s-{rank}" for rank in range(2)]
        self.out = io.StringIO()
        self.sink = LogSink(self.out, json_output)

    def spec(self, name: str, behaviour: str, *rest: object) -> ChildSpec:
        argv = (sys.executable, "-c", FAKE_CHILD, name, str(self.events), behaviour, *map(str, rest))
        return ChildSpec(name, argv, dict(os.environ))

    def supervisor(self, shards: tuple[str, str] = ("serve", "serve"), router: str = "serve",
                   shard_delay: float = 0.0, drain_timeout: float = 5.0, **kwargs: float) -> Supervisor:
        specs = [self.spec(f"shard-{r}", b, self.sockets[r], shard_delay) for r, b in enumerate(shards)]
        return Supervisor(specs, self.spec("router", router), self.sockets, self.sink, drain_timeout=drain_timeout,
                          stop_timeout=5.0, poll_interval=0.02, **kwargs)

    def event_lines(self) -> list[str]:
        return self.events.read_text().splitlines()

    def wait_for_event(self, text: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.event_lines()):
            assert time.monotonic() < deadline, f"no {text!r} in {self.event_lines()}"
            time.sleep(0.02)

    def stop_when(self, sup: Supervisor, text: str) -> threading.Thread:
        """Calls request_stop (as the signal handler would) once `text` shows up in the events."""
        thread = threading.Thread(target=lambda: (self.wait_for_event(text), sup.request_stop("received SIGTERM")))
        thread.start()
        return thread

    def output(self) -> list[str]:
        return self.out.getvalue().splitlines()

    def index(self, event: str) -> int:
        return self.event_lines().index(event)


def test_stop_drains_router_before_shards(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    sup = h.supervisor(router="drain")
    stopper = h.stop_when(sup, "router start")
    assert sup.run() == 0
    stopper.join()
    assert h.index("router exit") < h.index("shard-0 sigterm") and h.index("router exit") < h.index("shard-1 sigterm")
    assert h.index("router sigterm") < h.index("router exit")
    assert "shard-0 start own_group=True stale=False" in h.event_lines()  # own process group, stale socket gone
    assert "router start own_group=True" in h.event_lines()
    assert all(c.returncode == 0 for c in sup.children)
    out = h.output()
    assert out.index("[router] router draining") < out.index("[launcher] stopping shards")
    assert out[-1] == "[launcher] all processes stopped" and not any(p.exists() for p in h.sockets)


def test_output_is_prefixed_with_the_child_name(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    sup = h.supervisor()
    stopper = h.stop_when(sup, "router start")
    assert sup.run() == 0
    stopper.join()
    out = h.output()
    for line in ("[shard-0] shard-0 starting", "[shard-1] shard-1 ready", "[router] router starting",
                 "[launcher] shard 1 ready (" + str(h.sockets[1]) + ")", "[launcher] starting router",
                 "[launcher] received SIGTERM: shutting down"):
        assert line in out
    # The children's output is relayed by threads, so only the launcher's own lines have a fixed order.
    assert out.index("[launcher] starting router") > max(out.index(f"[launcher] shard {r} ready ({h.sockets[r]})")
                                                         for r in range(2))
    assert h.index("router start own_group=True") > max(h.index("shard-0 bind"), h.index("shard-1 bind"))


def test_json_output_wraps_every_line(tmp_path: Path) -> None:
    h = Harness(tmp_path, json_output=True)
    sup = h.supervisor()
    stopper = h.stop_when(sup, "router start")
    assert sup.run() == 0
    stopper.join()
    records = [json.loads(line) for line in h.output()]
    assert all(set(r) == {"process", "line"} for r in records)
    assert {"process": "shard-1", "line": "shard-1 ready"} in records
    assert {"process": "router", "line": "router starting"} in records
    assert {"process": "launcher", "line": "starting router"} in records


def test_a_dying_shard_stops_the_others_and_shows_its_output(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    sup = h.supervisor(shards=("serve", "crash"))
    started = time.monotonic()
    assert sup.run() == 1
    assert time.monotonic() - started < 5
    shard0, shard1, router = sup.children
    assert shard1.returncode == 3 and shard0.returncode is not None and not router.is_started
    assert not any(line.startswith("router") for line in h.event_lines())
    out = h.output()
    assert "[launcher] shard-1 exited unexpectedly (exit code 3); stopping the others" in out
    report = out.index("[launcher] shard-1 failed: exit code 3; last 20 line(s) of its output:")
    assert out[report + 1:] == [f"[launcher]   | line {i}" for i in range(11, 30)] + [
        "[launcher]   | fatal: out of memory"]
    assert "[shard-1] fatal: out of memory" in out  # stderr is streamed too


def test_a_dying_router_stops_the_shards(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    sup = h.supervisor(router="crash")
    assert sup.run() == 1
    assert {"shard-0 sigterm", "shard-1 sigterm"} <= set(h.event_lines())
    assert all(c.returncode is not None for c in sup.children)
    out = h.output()
    assert "[launcher] router failed: exit code 3; last 20 line(s) of its output:" in out
    assert out[-1] == "[launcher]   | fatal: out of memory"


def test_a_router_ignoring_sigterm_is_killed_after_the_drain_timeout(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    sup = h.supervisor(router="stubborn", drain_timeout=0.5)
    stopper = h.stop_when(sup, "router start")
    assert sup.run() == 0
    stopper.join()
    router = sup.children[-1]
    assert router.returncode == -signal.SIGKILL
    assert "[launcher] router still running, sending SIGKILL" in h.output()
    assert h.index("shard-0 exit") > 0 and all(c.returncode is not None for c in sup.children)


def test_waits_for_every_socket_and_removes_stale_ones(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    stale_socket(h.sockets[0])  # left behind by a crashed run: must not count as ready
    sup = h.supervisor(shard_delay=0.5, progress_interval=0.1)
    stopper = h.stop_when(sup, "router start")
    assert sup.run() == 0
    stopper.join()
    assert "shard-0 start own_group=True stale=False" in h.event_lines()
    out = h.output()
    assert "[launcher] waiting for shard 0 (0s)" in out
    assert out.index("[launcher] starting router") > out.index(f"[launcher] shard 0 ready ({h.sockets[0]})")
    assert h.index("router start own_group=True") > h.index("shard-0 bind")


def stale_socket(path: Path) -> None:
    """A socket file whose server is gone, as a killed shard leaves it."""
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))


def test_a_file_at_a_socket_path_is_refused_never_deleted(tmp_path: Path) -> None:
    """A mistyped --shard-uds-path may name someone's file: the launcher stops before starting anything and
    leaves the file as it was (only sockets are ever removed)."""
    h = Harness(tmp_path)
    h.sockets[1].write_text("data")
    sup = h.supervisor()
    assert sup.run() == 1
    assert h.sockets[1].read_text() == "data"
    assert not any(c.is_started for c in sup.children)
    assert any(f"{h.sockets[1]} exists and is not a socket; choose another --shard-uds-path" in line
               for line in h.output())


def test_stop_during_startup_never_starts_the_router(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    sup = h.supervisor(shard_delay=30.0)
    stopper = h.stop_when(sup, "shard-1 start")
    assert sup.run() == 0
    stopper.join()
    assert not sup.children[-1].is_started and all(c.returncode is not None for c in sup.children[:-1])


DRIVER = r"""
import sys
from pathlib import Path
from specula_launcher.processes import ChildSpec, LogSink, Supervisor, run_with_signal_handlers
fake, events, tmp = sys.argv[1], sys.argv[2], Path(sys.argv[3])
def spec(name, behaviour, *rest):
    return ChildSpec(name, (sys.executable, "-c", fake, name, events, behaviour, *rest), {})
sockets = [tmp / "s-0"]
sup = Supervisor([spec("shard-0", "serve", str(sockets[0]), "0")], spec("router", "drain"), sockets,
                 LogSink(sys.stdout), drain_timeout=5, poll_interval=0.02)
sys.exit(run_with_signal_handlers(sup))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_shut_down_in_order_and_exit_zero(tmp_path: Path, sig: signal.Signals) -> None:
    h = Harness(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(LAUNCHER_DIR)}
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, FAKE_CHILD, str(h.events), str(tmp_path)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        h.wait_for_event("router start")
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0, out
    assert f"[launcher] received {sig.name}: shutting down" in out.splitlines()
    assert h.index("router exit") < h.index("shard-0 sigterm")


def test_describe_exit() -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-9) == "killed by SIGKILL"


def test_a_router_whose_drain_was_cut_makes_the_launcher_exit_with_its_code(tmp_path: Path) -> None:
    from specula_launcher.processes import DRAIN_CUT_EXIT_CODE
    from specula_router.lifecycle import DRAIN_CUT_EXIT_CODE as ROUTER_CODE

    assert DRAIN_CUT_EXIT_CODE == ROUTER_CODE
    h = Harness(tmp_path)
    sup = h.supervisor(router="cut")
    stopper = h.stop_when(sup, "router start")
    assert sup.run() == DRAIN_CUT_EXIT_CODE
    stopper.join()
    assert any("drain was cut by --shutdown-timeout" in line for line in h.output())


def test_prefix_caching_is_on_unless_turned_off_by_flag_or_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[LauncherConfig] = []
    monkeypatch.setattr(cli, "launch", lambda config: seen.append(config) or 0)
    for args, env in (([], {}), (["--no-prefix-caching"], {}), ([], {"NO_PREFIX_CACHING": "true"})):
        result = CliRunner().invoke(cli.app, ["--device", "cpu", *args], env=env)
        assert result.exit_code == 0, result.output
    assert [c.prefix_caching for c in seen] == [True, False, False]
    assert "--no-prefix-caching" not in router_command(claimed(seen[0]))
    assert flags(router_command(claimed(seen[1])))["--no-prefix-caching"] == ()


def test_a_prefill_budget_below_the_longest_prompt_is_allowed_long_prompts_are_chunked() -> None:
    c = build_config(max_input_tokens=1000, max_total_tokens=2000, max_batch_prefill_tokens=256, **NO_GPU)
    assert (c.max_input_tokens, c.max_batch_prefill_tokens) == (1000, 256)
