"""The named choices every process shares: speculation modes, n-gram match kinds, adapter sources and kinds.

Each is a string enum, so a member equals (and prints as) its value: `SpeculationMode.FIXED == "fixed"`, and a
value read from a flag, a request or a gRPC field compares with the members directly. `parse_choice` turns a
string into a member, with an error that names where the value came from.
"""

from __future__ import annotations

import enum
from typing import TypeVar

try:
    from enum import StrEnum
except ImportError:  # Python 3.10
    class StrEnum(str, enum.Enum):  # type: ignore[no-redef]
        def __str__(self) -> str:
            return str(self.value)


class SpeculationMode(StrEnum):
    """How many drafts a request verifies each step (--speculation-mode)."""

    ADAPTIVE = "adaptive"  # each request's draft length follows its acceptance and the load
    FIXED = "fixed"  # every request verifies what its drafter proposed, up to --speculative-tokens


class NgramMatch(StrEnum):
    """Which earlier occurrence of the context's last n-gram prompt lookup copies from (--ngram-match)."""

    LATEST = "latest"
    EARLIEST = "earliest"


class AdapterSource(StrEnum):
    """Where an adapter id is looked up (--adapter-source, a request's `adapter_source`)."""

    HUB = "hub"  # a Hugging Face Hub repository id
    LOCAL = "local"  # a directory under one of the --adapter-dir roots


class AdapterKind(StrEnum):
    """What an adapter directory holds, as the workers detect it and report it to the router."""

    LORA = "lora"
    MEDUSA = "medusa"
    LORA_MEDUSA = "lora+medusa"

    @property
    def has_lora(self) -> bool:
        return self in (AdapterKind.LORA, AdapterKind.LORA_MEDUSA)

    @property
    def has_medusa(self) -> bool:
        return self in (AdapterKind.MEDUSA, AdapterKind.LORA_MEDUSA)


Choice = TypeVar("Choice", bound=StrEnum)


def values(choices: type[StrEnum]) -> tuple[str, ...]:
    """The values of a choice enum, in declaration order: values(NgramMatch) == ("latest", "earliest")."""
    return tuple(member.value for member in choices)


def parse_choice(choices: type[Choice], value: str, name: str) -> Choice:
    """`value` as a member of `choices`; a ValueError naming `name` (a flag, a field) and the choices otherwise.

    >>> parse_choice(SpeculationMode, "fixed", "--speculation-mode") is SpeculationMode.FIXED
    True
    """
    try:
        return choices(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(values(choices))}; got {value!r}") from None
