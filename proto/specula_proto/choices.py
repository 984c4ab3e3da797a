"""The named choices every process shares: speculation modes, n-gram match kinds, adapter sources and kinds, and
the values the model's flags take (--dtype, --device, --quantize, --kv-cache-dtype, --log-level). Each set of
values is declared here once; the launcher's checks, the worker's and the help that lists them read it from here.

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


class Dtype(StrEnum):
    """What the model computes in (--dtype): torch's dtype of the same name."""

    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Device(StrEnum):
    """Where the model runs (--device): torch's device type of the same name."""

    CPU = "cpu"
    CUDA = "cuda"


class QuantizeMethod(StrEnum):
    """Quantization of the linear layers (--quantize); none: float weights."""

    INT8 = "int8"  # a scale per output channel, quantized at load time
    INT4 = "int4"  # a scale and zero per group of --quantize-group-size inputs, quantized at load time
    W8A8 = "w8a8"  # int8's weights by activations quantized to int8 per block of 32 inputs at each product
    GGUF = "gguf"  # a .gguf file's own Q8_0/Q4_0/Q4_1 blocks


class KVCacheDtype(StrEnum):
    """What the KV cache stores keys and values in (--kv-cache-dtype): vLLM's names, plus TGI's fp8_e4m3fn."""

    AUTO = "auto"  # the --dtype
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FP8 = "fp8"  # float8 e4m3fn
    FP8_E4M3 = "fp8_e4m3"
    FP8_E4M3FN = "fp8_e4m3fn"
    FP8_E5M2 = "fp8_e5m2"


class LogLevel(StrEnum):
    """Python logging levels (--log-level), as the launcher accepts them (upper case)."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"
    CRITICAL = "CRITICAL"


Choice = TypeVar("Choice", bound=StrEnum)


def values(choices: type[StrEnum]) -> tuple[str, ...]:
    """The values of a choice enum, in declaration order: values(NgramMatch) == ("latest", "earliest")."""
    return tuple(member.value for member in choices)


def listed(choices: type[StrEnum]) -> str:
    """The values of a choice enum as help text writes them: listed(Dtype) == "float32, bfloat16 or float16"."""
    *others, last = values(choices)
    return f"{', '.join(others)} or {last}" if others else last


def quantize_method(value: str) -> QuantizeMethod:
    """--quantize's value as its member; otherwise a ValueError that says what each method serves (the launcher
    checks it before any start, the worker when it loads)."""
    if value not in values(QuantizeMethod):
        raise ValueError(f"--quantize {value} is not supported; supported: {', '.join(values(QuantizeMethod))} "
                         "(int8 and int4: weight-only, quantized at load time from a float checkpoint, so for a GPTQ "
                         "or AWQ model serve its float original with --quantize int4; w8a8: int8's weights by int8 "
                         "activations; gguf: a GGUF file's own "
                         "Q8_0/Q4_0/Q4_1 blocks)")
    return QuantizeMethod(value)


def speculator_quantize_method(value: str, speculator: str | None) -> QuantizeMethod:
    """--speculator-quantize's value as its member (int8 or int4), with `speculator` (--speculator) naming a
    drafter it could quantize; otherwise a ValueError naming the flag. (Whether that drafter is an EAGLE-3 one is
    known once it is found: the worker checks that when it loads it.)"""
    if value not in (QuantizeMethod.INT8, QuantizeMethod.INT4):
        raise ValueError(f"--speculator-quantize {value} is not supported; supported: int8, int4 (weight-only, "
                         "quantized at load time)")
    if not speculator or speculator == "suffix":
        raise ValueError("--speculator-quantize quantizes an EAGLE-3 speculator; no --speculator names one")
    return QuantizeMethod(value)


def parse_choice(choices: type[Choice], value: str, name: str) -> Choice:
    """`value` as a member of `choices`; a ValueError naming `name` (a flag, a field) and the choices otherwise.

    >>> parse_choice(SpeculationMode, "fixed", "--speculation-mode") is SpeculationMode.FIXED
    True
    """
    try:
        return choices(value)
    except ValueError:
        raise ValueError(f"{name} must be one of {', '.join(values(choices))}; got {value!r}") from None
