"""The settings table (specula_proto/settings.py) and the three command lines built from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import typer

from specula_launcher import cli as launcher_cli
from specula_launcher.config import LauncherConfig
from specula_proto.choices import (
    AdapterKind,
    AdapterSource,
    Device,
    Dtype,
    KVCacheDtype,
    LogLevel,
    NgramMatch,
    QuantizeMethod,
    SpeculationMode,
    listed,
    parse_choice,
    values,
)
from specula_proto.limits import default_input_tokens, default_prefill_tokens, default_total_tokens
from specula_proto.setting import Decl, Process, Setting
from specula_proto.settings import SETTINGS, settings_of, shared_with


def commands() -> dict[Process, object]:
    router_cli = pytest.importorskip("specula_router.cli")
    from specula_server import cli as server_cli

    return {Process.LAUNCHER: typer.main.get_command(launcher_cli.app),
            Process.ROUTER: typer.main.get_command(router_cli.app),
            Process.WORKER: typer.main.get_command(server_cli.app).commands["serve"]}  # type: ignore[attr-defined]


def test_each_command_takes_exactly_its_settings_each_with_help_and_variable() -> None:
    for process, command in commands().items():
        params = {p.name: p for p in command.params}  # type: ignore[attr-defined]
        assert list(params) == [s.name for s in settings_of(process)]
        for name, param in params.items():
            assert param.help and param.envvar, f"{process.name} {name}: no help or environment variable"


def test_the_table_names_each_setting_once_and_flags_lead_with_its_own() -> None:
    names = [s.name for s in SETTINGS]
    assert len(names) == len(set(names))
    for setting in SETTINGS:
        assert not setting.flags or setting.flags[0] == setting.flag
        env = (setting.env,) if isinstance(setting.env, str) else setting.env or (setting.name.upper(),)
        assert len(env) in (1, len(setting.flags)), f"{setting.flag}: one variable per name"


def test_launcher_settings_are_its_config_fields() -> None:
    fields = {f.name for f in dataclasses.fields(LauncherConfig)} | {"no_prefix_caching"}
    assert {s.name for s in settings_of(Process.LAUNCHER)} <= fields
    for child in (Process.ROUTER, Process.WORKER):
        assert all((Process.LAUNCHER | child) in s.processes for s in shared_with(child))


def test_a_child_declaration_changes_only_what_it_names() -> None:
    setting = Setting("depth", int, 2, Process.LAUNCHER | Process.ROUTER, "Steps queued.", flags=("--depth", "-d"),
                      router=Decl(default=3, flags=(), min=1))
    router = setting.declared(Process.ROUTER)
    assert (router.default, router.flags, router.min, router.help) == (3, (), 1, "Steps queued.")
    assert setting.declared(Process.LAUNCHER) is setting
    with pytest.raises(ValueError, match="--depth is not a worker setting"):
        setting.declared(Process.WORKER)


def test_choices_are_strings_and_errors_name_the_flag() -> None:
    assert SpeculationMode.FIXED == "fixed" and str(NgramMatch.EARLIEST) == "earliest"
    assert values(AdapterSource) == ("hub", "local")
    assert parse_choice(AdapterSource, "local", "--adapter-source") is AdapterSource.LOCAL
    with pytest.raises(ValueError, match=r"--ngram-match must be one of latest, earliest; got 'first'"):
        parse_choice(NgramMatch, "first", "--ngram-match")
    assert AdapterKind.LORA_MEDUSA.has_lora and AdapterKind.LORA_MEDUSA.has_medusa
    assert not AdapterKind.MEDUSA.has_lora


def test_the_model_flags_take_the_values_their_choices_declare() -> None:
    """--dtype, --device, --quantize, --kv-cache-dtype and --log-level are checked against specula_proto.choices
    (the worker's maps are keyed by the same members); the config holds the members, the help lists the values."""
    config = LauncherConfig(model_id="m", dtype="bfloat16", device="cuda", quantize="int8", kv_cache_dtype="fp8",
                            log_level="DEBUG")
    assert (config.dtype, config.device, config.quantize, config.kv_cache_dtype, config.log_level) == (
        Dtype.BFLOAT16, Device.CUDA, QuantizeMethod.INT8, KVCacheDtype.FP8, LogLevel.DEBUG)
    assert type(config.dtype) is Dtype and type(config.log_level) is LogLevel
    assert values(QuantizeMethod) == ("int8", "int4", "w8a8", "gguf")
    assert (listed(Dtype), listed(Device)) == ("float32, bfloat16 or float16", "cpu or cuda")
    dtype = next(s for s in SETTINGS if s.name == "dtype")
    assert dtype.help.startswith("float32, bfloat16 or float16. ")
    with pytest.raises(ValueError, match=r"--device must be one of cpu, cuda; got 'tpu'"):
        LauncherConfig(model_id="m", dtype="float32", device="tpu")
    with pytest.raises(ValueError, match=r"--log-level must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL; got 'x'"):
        LauncherConfig(model_id="m", dtype="float32", device="cpu", log_level="x")


def defaults_of(config_class: type) -> dict[str, object]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            for f in dataclasses.fields(config_class)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


@pytest.mark.parametrize("process", [Process.LAUNCHER, Process.ROUTER])
def test_the_configs_default_to_what_the_command_lines_do(process: Process) -> None:
    """A setting left out of a command line and one left out of the config built by hand are the same value
    (the launcher's None are filled in by build_config; list flags are tuples in the configs)."""
    if process is Process.ROUTER:
        config = pytest.importorskip("specula_router.config").RouterConfig
    else:
        config = LauncherConfig
    fields = defaults_of(config)
    for setting in settings_of(process):
        default = setting.declared(process).default
        name = "prefix_caching" if setting.name == "no_prefix_caching" else setting.name
        if name not in fields or default is None or default is ...:
            continue
        expected = tuple(default) if isinstance(default, list) else default
        expected = not expected if name != setting.name else expected
        assert fields[name] == expected, f"{process.name} {setting.flag}: {fields[name]!r} != {expected!r}"


def test_the_token_limit_defaults_are_the_documented_ones() -> None:
    """limits.py's example, which the launcher shows and the router derives again: 2048 positions, lookahead 3."""
    assert (default_total_tokens(2048, 3), default_input_tokens(2045), default_prefill_tokens(2044)) == (2045, 2044,
                                                                                                        2094)
    assert (default_prefill_tokens(8000), default_prefill_tokens(100, cap=64)) == (4096, 64)


@pytest.mark.parametrize("setting", [s for s in settings_of(Process.LAUNCHER) if s.at_least is not None],
                         ids=lambda s: s.name)
def test_the_launcher_refuses_a_value_below_a_settings_bound_naming_the_flag(setting: Setting) -> None:
    assert setting.at_least is not None
    LauncherConfig(model_id="m", dtype="float32", device="cpu", **{setting.name: setting.at_least})
    with pytest.raises(ValueError, match=f"^{setting.flag} must be at least {setting.at_least}; got "):
        LauncherConfig(model_id="m", dtype="float32", device="cpu", **{setting.name: setting.at_least - 1})


def test_the_configuration_document_lists_each_launcher_flag_with_its_variables() -> None:
    """docs/configuration.md's flag table: one row per launcher setting, naming its flags and variables as the
    table declares them (`--speculative-tokens / --speculate` | `SPECULATIVE_TOKENS / SPECULATE`)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text()
    table = doc[doc.index("| flag | environment |"):doc.index("\n\n", doc.index("| flag | environment |"))]
    rows = {}
    for line in table.splitlines()[2:]:
        names, env = (cell.strip().replace("`", "") for cell in line.split("|")[1:3])
        rows[tuple(name.strip() for name in names.replace(", ", " / ").split(" / "))] = tuple(env.split(" / "))
    expected = {}
    for setting in settings_of(Process.LAUNCHER):
        env = setting.env if setting.env is not None else setting.name.upper()
        expected[setting.flags or (setting.flag,)] = env if isinstance(env, tuple) else (env,)
    assert rows == expected
