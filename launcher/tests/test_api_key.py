"""`--api-key` (env API_KEY) in the launcher: read from flag or environment, handed to the router in its
environment only (never on a command line `ps` shows, never to the shards), and never printed."""

from __future__ import annotations

import dataclasses
import io

import pytest
import typer
from typer.testing import CliRunner

from specula_launcher import cli
from specula_launcher.commands import router_command, router_spec, shard_specs
from specula_launcher.config import LauncherConfig
from specula_launcher.defaults import build_config

KEY = "s3cret-key-0123"
NO_GPU = {"count_cuda_devices": lambda: 0}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("API_KEY", "MODEL_ID", "PORT", "DEVICE"):
        monkeypatch.delenv(name, raising=False)


def parsed(args: list[str], env: dict[str, str] | None = None) -> LauncherConfig:
    seen: list[LauncherConfig] = []
    original = cli.launch
    cli.launch = lambda config: seen.append(config) or 0  # type: ignore[assignment]
    try:
        result = CliRunner().invoke(cli.app, ["--device", "cpu", *args], env=env)
    finally:
        cli.launch = original  # type: ignore[assignment]
    assert result.exit_code == 0, result.output
    return seen[0]


def claimed(c: LauncherConfig) -> LauncherConfig:
    return dataclasses.replace(c, shard_uds_path="/run/s", master_port=29600, instance_id="i")


def test_the_key_is_read_from_api_key_or_the_flag() -> None:
    assert parsed([], env={"API_KEY": KEY}).api_key == KEY
    assert parsed(["--api-key", KEY]).api_key == KEY
    assert parsed([]).api_key is None


def test_an_empty_or_blank_key_is_refused() -> None:
    result = CliRunner().invoke(cli.app, ["--device", "cpu", "--api-key", " "])
    assert result.exit_code == 2 and "--api-key (env API_KEY) must not be empty" in " ".join(result.output.split())


def test_the_router_gets_the_key_in_its_environment_only() -> None:
    c = claimed(build_config(api_key=KEY, **NO_GPU))
    spec = router_spec(c, {"HF_TOKEN": "t"})
    assert spec.env["API_KEY"] == KEY
    assert not any(KEY in arg for arg in spec.argv) and "--api-key" not in spec.argv
    for shard in shard_specs(c, {"API_KEY": KEY, "HF_TOKEN": "t"}):
        assert "API_KEY" not in shard.env and not any(KEY in arg for arg in shard.argv)


def test_without_a_key_the_router_gets_none_even_from_the_environment() -> None:
    c = claimed(build_config(**NO_GPU))
    assert "API_KEY" not in router_spec(c, {"API_KEY": "stale"}).env


def test_the_router_reads_the_key_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """The contract with the router's CLI: nothing on its command line, API_KEY in its environment."""
    router_cli = pytest.importorskip("specula_router.cli")
    spec = router_spec(claimed(build_config(api_key=KEY, **NO_GPU)), {})
    command = typer.main.get_command(router_cli.app)
    assert command.make_context("specula-router", list(spec.argv[3:])).params["api_key"] is None
    monkeypatch.setenv("API_KEY", spec.env["API_KEY"])
    assert command.make_context("specula-router", list(spec.argv[3:])).params["api_key"] == KEY


def test_the_key_is_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    c = claimed(build_config(api_key=KEY, **NO_GPU))
    assert KEY not in repr(c) and KEY not in " ".join(router_command(c))
    # The launcher's own log lines, up to starting the children (stubbed here).
    monkeypatch.setattr(cli, "run_with_signal_handlers", lambda supervisor: 0)
    out = io.StringIO()
    assert cli.launch(build_config(api_key=KEY, **NO_GPU), stream=out) == 0
    assert out.getvalue() and KEY not in out.getvalue()
