"""TGI and LoRAX launcher flags: the ones Specula has under another name are aliases (flag and environment
variable), and every known one it lacks is refused or warned about by name (compat.py), never ignored silently."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from specula_launcher import cli
from specula_launcher.compat import (
    FOREIGN_FLAGS,
    Action,
    UnknownArgument,
    check_foreign,
)
from specula_launcher.config import LauncherConfig

# Every variable an alias or a foreign flag reads, plus the Specula names they stand for.
ENV_VARS = {"SPECULATIVE_TOKENS", "SPECULATE", "PRELOADED_ADAPTER_IDS", "LORA_ADAPTERS", "ADAPTER_SOURCE",
            "DEFAULT_ADAPTER_SOURCE", "PORT", "SHUTDOWN_TIMEOUT", "GRACEFUL_TERMINATION_TIMEOUT", "MODEL_ID",
            "DEVICE", "API_KEY", *(f.env_name for f in FOREIGN_FLAGS.values() if f.env_name)}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[LauncherConfig]:
    configs: list[LauncherConfig] = []
    monkeypatch.setattr(cli, "launch", lambda config: configs.append(config) or 0)
    return configs


def invoke(args: list[str], env: dict[str, str] | None = None):
    # The bundled demo model (no --model-id) brings its demo adapter directory, so its local adapters preload.
    # A wide terminal: rich would otherwise wrap the error inside its box, splitting the names tests look for.
    return CliRunner().invoke(cli.app, ["--device", "cpu", *args], env={"COLUMNS": "400", **(env or {})})


def output(result) -> str:
    return " ".join(result.output.split())


ALIASES = [  # (TGI/LoRAX flag, its env, Specula flag, value, the LauncherConfig field and the value it becomes)
    ("--speculate", "SPECULATE", "--speculative-tokens", "3", "speculative_tokens", 3),
    ("--lora-adapters", "LORA_ADAPTERS", "--preloaded-adapter-ids", "camel-case", "preloaded_adapter_ids",
     ("camel-case",)),
    ("--default-adapter-source", "DEFAULT_ADAPTER_SOURCE", "--adapter-source", "hub", "adapter_source", "hub"),
    ("-p", None, "--port", "8123", "port", 8123),
    ("--graceful-termination-timeout", "GRACEFUL_TERMINATION_TIMEOUT", "--shutdown-timeout", "7",
     "shutdown_timeout", 7),
]


@pytest.mark.parametrize("alias,env,flag,value,field,expected", ALIASES, ids=[a[0] for a in ALIASES])
def test_each_alias_and_its_environment_variable(seen, alias, env, flag, value, field, expected) -> None:
    result = invoke([alias, value])
    assert result.exit_code == 0, result.output
    assert getattr(seen[-1], field) == expected
    if env is not None:
        result = invoke([], env={env: value})
        assert result.exit_code == 0, result.output
        assert getattr(seen[-1], field) == expected
    # One option under both names, Specula's first (--help shows them together).
    option = next(p for p in typer.main.get_command(cli.app).params if p.name == field)
    assert option.opts[0] == flag and alias in option.opts


def test_specula_names_win_over_aliases_in_the_environment(seen) -> None:
    result = invoke([], env={"SPECULATIVE_TOKENS": "2", "SPECULATE": "5"})
    assert result.exit_code == 0, result.output
    assert seen[-1].speculative_tokens == 2


REFUSED = sorted(f.flag for f in FOREIGN_FLAGS.values() if f.action is Action.REFUSE)
WARNED = sorted(f.flag for f in FOREIGN_FLAGS.values() if f.action is Action.WARN)


def sample_args(flag: str) -> list[str]:
    return [flag] if not FOREIGN_FLAGS[flag].takes_value else [flag, "s3"]  # a value no flag finds harmless


@pytest.mark.parametrize("flag", REFUSED)
def test_each_refused_flag_stops_the_start_naming_it(seen, flag) -> None:
    result = invoke(sample_args(flag))
    assert result.exit_code == 2 and not seen, result.output
    assert f"{flag} (" in output(result) and "is not supported" in output(result)


@pytest.mark.parametrize("flag", [f for f in REFUSED if FOREIGN_FLAGS[f].env_name])
def test_each_refused_flag_is_refused_from_its_environment_variable(seen, flag) -> None:
    env = FOREIGN_FLAGS[flag].env_name
    result = invoke([], env={env: "s3" if FOREIGN_FLAGS[flag].takes_value else "true"})
    assert result.exit_code == 2 and not seen, result.output
    assert f"{flag} (" in output(result) and f"env {env}" in output(result)


@pytest.mark.parametrize("flag", WARNED)
def test_each_harmless_flag_is_ignored_with_a_warning(seen, flag) -> None:
    result = invoke(sample_args(flag))
    assert result.exit_code == 0 and len(seen) == 1, result.output
    assert f"warning: {flag} (" in output(result) and "is ignored" in output(result)
    env = FOREIGN_FLAGS[flag].env_name
    if env is not None:
        result = invoke([], env={env: "s3" if FOREIGN_FLAGS[flag].takes_value else "true"})
        assert result.exit_code == 0 and f"warning: {flag} (" in output(result), result.output


def test_values_that_ask_for_what_specula_does_anyway_pass_silently(seen) -> None:
    env = {"USAGE_STATS": "off", "TRUST_REMOTE_CODE": "false", "SHARDED": "false",
           "PREFIX_CACHING": "true", "DISABLE_CUSTOM_KERNELS": "0"}
    result = invoke(["--source", "hub"], env=env)
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    assert check_foreign(["--sharded=false", "--source=local"], {}) == []


def test_flag_values_are_consumed_and_secrets_never_echoed() -> None:
    assert len(check_foreign(["--memory-wiggle-room", "0.9", "--usage-stats=on"], {})) == 2
    with pytest.raises(ValueError) as e:
        check_foreign([], {"NGROK_AUTHTOKEN": "tok-123"})
    assert "tok-123" not in str(e.value) and "NGROK_AUTHTOKEN" in str(e.value)
    with pytest.raises(ValueError) as e:
        check_foreign(["--predibase-api-token", "tok-456"], {})
    assert "tok-456" not in str(e.value)


def test_unknown_flags_and_stray_arguments_are_still_usage_errors(seen) -> None:
    with pytest.raises(UnknownArgument):
        check_foreign(["--max-batch-sise", "3"], {})
    result = invoke(["--max-batch-sise", "3"])
    assert result.exit_code == 2 and "No such option: --max-batch-sise" in output(result) and not seen
    result = invoke(["stray"])
    assert result.exit_code == 2 and "unexpected extra argument (stray)" in output(result) and not seen
