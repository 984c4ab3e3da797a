"""One setting of a Specula deployment, declared once for the three processes that may read it.

A `Setting` says its name, type, default, environment variable, help and the processes whose command lines take
it (`Process` flags: the launcher, the router, the worker). Where a child process declares it otherwise (its own
default, because the launcher fills in derived ones before passing a value; a shorter help; a bound that click
checks), a `Decl` for that process says only what differs; `at_least` is the lower bound the launcher's and the
router's configs check. `Setting.parameter` turns the declaration of one process into the typer parameter of
that process's command; settings.py holds the table and builds the commands.
"""

from __future__ import annotations

import enum
import inspect
from dataclasses import dataclass, field, replace

import typer


class Process(enum.Flag):
    """The processes of a deployment: `specula-launcher`, and the `specula-router` and `specula-server serve` it
    starts."""

    LAUNCHER = enum.auto()
    ROUTER = enum.auto()
    WORKER = enum.auto()


class _Same:
    """A `Decl` field left as the setting declares it."""

    def __repr__(self) -> str:
        return "SAME"


SAME = _Same()


@dataclass(frozen=True)
class Decl:
    """How one child process declares a setting, where that differs from the setting's own declaration."""

    type: object = SAME
    default: object = SAME
    help: str | None = None  # None: the setting's
    env: str | tuple[str, ...] | None = None  # None: the setting's
    flags: tuple[str, ...] | None = None  # None: the setting's; (): the name's own flag only
    min: float | None = None
    max: float | None = None
    argument: bool = False  # a positional argument rather than an option


@dataclass(frozen=True)
class Setting:
    """One setting. `flags` () is `--name` (for a boolean, also `--no-name`); with names, the first is
    Specula's own and the others aliases (TGI's or LoRAX's), each reading the matching variable of `env`."""

    name: str
    type: object
    default: object  # `...`: required
    processes: Process
    help: str
    env: str | tuple[str, ...] | None = None  # None: the name in capitals
    flags: tuple[str, ...] = ()
    min: float | None = None  # bounds click checks (for the launcher, config.py checks every value instead)
    max: float | None = None
    # The least value the launcher's and the router's configs accept (settings.check_bounds); None: no bound.
    at_least: int | None = None
    show_default: bool = True
    argument: bool = False
    router: Decl | None = field(default=None, repr=False)
    worker: Decl | None = field(default=None, repr=False)

    @property
    def flag(self) -> str:
        """The command-line name every process knows the setting by: `max_batch_size` -> `--max-batch-size`."""
        return "--" + self.name.replace("_", "-")

    def declared(self, process: Process) -> Setting:
        """The setting as `process` declares it (its `Decl` applied); a ValueError for a process without it."""
        if process not in self.processes:
            raise ValueError(f"{self.flag} is not a {process.name.lower()} setting")
        decl = {Process.ROUTER: self.router, Process.WORKER: self.worker}.get(process)
        if decl is None:
            return self
        changes = {name: value for name, value in (("type", decl.type), ("default", decl.default))
                   if value is not SAME}
        changes |= {name: value for name, value in (("help", decl.help), ("env", decl.env), ("flags", decl.flags),
                                                    ("min", decl.min), ("max", decl.max)) if value is not None}
        return replace(self, **changes, argument=decl.argument or self.argument, router=None, worker=None)

    def parameter(self, process: Process) -> inspect.Parameter:
        """The typer parameter of `process`'s command: keyword `name`, annotated with the type, whose default is
        the `typer.Option` (or `typer.Argument`) carrying flags, variables, default, help and bounds."""
        own = self.declared(process)
        env = own.env if own.env is not None else own.name.upper()
        bounds = {key: value for key, value in (("min", own.min), ("max", own.max)) if value is not None}
        if own.argument:
            info = typer.Argument(own.default, envvar=env, help=own.help, show_default=own.show_default, **bounds)
        else:
            info = typer.Option(own.default, *own.flags, envvar=list(env) if isinstance(env, tuple) else env,
                                help=own.help, show_default=own.show_default, **bounds)
        return inspect.Parameter(own.name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=own.type)
