"""TGI and LoRAX launcher flags that Specula does not have, and what a start with one of them does.

A flag whose feature Specula lacks is never ignored silently. Given on the command line or through its
environment variable (TGI and LoRAX read `--otlp-endpoint` from OTLP_ENDPOINT), it either stops the start with an
error naming the flag (`REFUSE`: serving without it would behave differently from what was asked: another
port, other outputs, a missing trace) or is logged as a warning and ignored (`WARN`: tuning that only changes
speed or memory, or asks for what Specula does anyway). Flags Specula does have under another name are typer
aliases in cli.py (`--speculate`, `--lora-adapters`, ...), not listed here.

    check_foreign(["--otlp-endpoint", "http://c:4317"], {})
      -> ValueError: --otlp-endpoint (TGI/LoRAX, env OTLP_ENDPOINT) is not supported: ...
    check_foreign([], {"MEMORY_WIGGLE_ROOM": "0.9"})
      -> ["--memory-wiggle-room (LoRAX, env MEMORY_WIGGLE_ROOM) is ignored: size the KV cache with
           --kv-cache-memory (given: MEMORY_WIGGLE_ROOM=0.9)"]
    check_foreign([], {"USAGE_STATS": "off", "TRUST_REMOTE_CODE": "false"})
      -> [] (they ask for what Specula does anyway)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


class Action(enum.Enum):
    REFUSE = "refuse"
    WARN = "warn"


@dataclass(frozen=True)
class ForeignFlag:
    """One TGI/LoRAX launcher flag without a Specula equivalent."""

    flag: str  # "--otlp-endpoint"
    origin: str  # "TGI", "LoRAX" or "TGI/LoRAX"
    action: Action
    reason: str  # why, and what to use instead
    takes_value: bool = True  # False: a bare switch (`--trust-remote-code`)
    # Its environment variable, None where the name is too common to be read as meant for us (BACKEND, SOURCE).
    env: str | None = ""  # "": the flag's name upper-cased (OTLP_ENDPOINT), as clap's `env` derives it
    harmless_values: tuple[str, ...] = ()  # values that ask for what Specula does anyway: accepted silently

    @property
    def env_name(self) -> str | None:
        return self.flag[2:].replace("-", "_").upper() if self.env == "" else self.env


R, W = Action.REFUSE, Action.WARN
FOREIGN_FLAGS = {f.flag: f for f in (
    # TGI
    ForeignFlag("--sharded", "TGI/LoRAX", R, "use --num-shard N (1: one process, no tensor parallelism)",
                harmless_values=("false",)),
    ForeignFlag("--trust-remote-code", "TGI/LoRAX", R, "Specula runs its own Llama-family implementation and never "
                "executes a checkpoint's code", takes_value=False),
    ForeignFlag("--prometheus-port", "TGI", R, "metrics are served at GET /metrics on --port"),
    ForeignFlag("--weights-cache-override", "TGI/LoRAX", R, "use --huggingface-hub-cache, or a local --model-id"),
    ForeignFlag("--disable-custom-kernels", "TGI/LoRAX", W, "there are no custom kernels to turn off",
                takes_value=False),
    ForeignFlag("--cuda-memory-fraction", "TGI/LoRAX", R, "size the KV cache with --kv-cache-memory"),
    ForeignFlag("--rope-scaling", "TGI", R, "RoPE scaling is read from the model's config.json only"),
    ForeignFlag("--rope-factor", "TGI", R, "RoPE scaling is read from the model's config.json only"),
    ForeignFlag("--otlp-endpoint", "TGI/LoRAX", R, "there is no OpenTelemetry tracing; use GET /metrics and the "
                "timing headers"),
    ForeignFlag("--otlp-service-name", "TGI", R, "there is no OpenTelemetry tracing"),
    ForeignFlag("--watermark-gamma", "TGI/LoRAX", R, "watermarking is not implemented (requests asking for it "
                "get a 422)"),
    ForeignFlag("--watermark-delta", "TGI/LoRAX", R, "watermarking is not implemented (requests asking for it "
                "get a 422)"),
    ForeignFlag("--ngrok", "TGI/LoRAX", R, "there is no ngrok tunnel; expose --port yourself", takes_value=False),
    ForeignFlag("--ngrok-authtoken", "TGI/LoRAX", R, "there is no ngrok tunnel"),
    ForeignFlag("--ngrok-edge", "TGI/LoRAX", R, "there is no ngrok tunnel"),
    ForeignFlag("--tokenizer-config-path", "TGI/LoRAX", R, "the tokenizer is read from the model's directory; give "
                "a chat template with --chat-template"),
    ForeignFlag("--disable-grammar-support", "TGI", W, "structured output (grammar, response_format) is always "
                "on; bound it with --max-grammar-bytes and --grammar-compile-timeout", takes_value=False),
    ForeignFlag("--max-client-batch-size", "TGI", R, "the number of prompts of one /v1/completions request is "
                "bounded by --max-concurrent-requests"),
    ForeignFlag("--usage-stats", "TGI", W, "Specula sends no usage statistics", harmless_values=("off",)),
    ForeignFlag("--enable-prefill-logprobs", "TGI", W, "prompt log-probabilities (decoder_input_details) are "
                "always available", takes_value=False),
    ForeignFlag("--env", "TGI/LoRAX", W, "no environment report is printed", takes_value=False, env=None),
    # LoRAX
    ForeignFlag("--adapter-id", "LoRAX", R, "there is no default adapter: requests name theirs in adapter_id "
                "(preload it with --preloaded-adapter-ids)"),
    ForeignFlag("--source", "LoRAX", R, "the model is read from the Hub or a local --model-id directory only",
                env=None, harmless_values=("hub", "local")),
    ForeignFlag("--preloaded-adapter-source", "LoRAX", R, "preloaded adapters load from --adapter-source"),
    ForeignFlag("--predibase-api-token", "LoRAX", R, "adapters load from the Hub or --adapter-dir only"),
    ForeignFlag("--adapter-memory-fraction", "LoRAX", R, "bound adapter memory with --max-active-adapters"),
    ForeignFlag("--adapter-cycle-time-s", "LoRAX", W, "adapters are scheduled by the one queue, with no cycle"),
    ForeignFlag("--speculation-max-batch-size", "LoRAX", R, "--speculation-mode adaptive shortens drafts as the "
                "load grows instead"),
    ForeignFlag("--merge-adapter-weights", "LoRAX", R, "adapters are applied unmerged", takes_value=False),
    ForeignFlag("--compile", "LoRAX", W, "Specula captures no CUDA graphs (this only changes speed)",
                takes_value=False, env=None),
    ForeignFlag("--eager", "LoRAX", W, "the model always runs eagerly", takes_value=False, env=None),
    ForeignFlag("--compile-max-batch-size", "LoRAX", W, "set the batch sizes captured as CUDA graphs with "
                "--cuda-graphs"),
    ForeignFlag("--compile-max-rank", "LoRAX", W, "Specula captures no CUDA graphs"),
    ForeignFlag("--compile-batch-size", "LoRAX", W, "Specula captures no CUDA graphs"),
    ForeignFlag("--eager-prefill", "LoRAX", W, "prefills are scheduled by --waiting-served-ratio and "
                "--max-waiting-tokens"),
    ForeignFlag("--chunked-prefill", "LoRAX", W, "prompts longer than --max-batch-prefill-tokens are always "
                "prefilled in chunks", harmless_values=("true",)),
    ForeignFlag("--prefix-caching", "LoRAX", W, "prefix caching is on by default; turn it off with "
                "--no-prefix-caching", harmless_values=("true",)),
    ForeignFlag("--memory-wiggle-room", "LoRAX", W, "size the KV cache with --kv-cache-memory"),
    ForeignFlag("--disable-sgmv", "LoRAX", W, "there are no SGMV kernels to turn off", takes_value=False),
    ForeignFlag("--backend", "LoRAX", R, "there is one attention implementation", env=None),
    ForeignFlag("--embedding-dim", "LoRAX", R, "there is no embeddings endpoint"),
    ForeignFlag("--download-only", "LoRAX", R, "the launcher always serves after loading", takes_value=False),
    ForeignFlag("--cors-allow-header", "LoRAX", R, "CORS allows every header for --cors-allow-origin"),
    ForeignFlag("--cors-expose-header", "LoRAX", R, "CORS exposes no extra headers"),
    ForeignFlag("--cors-allow-method", "LoRAX", R, "CORS allows every method for --cors-allow-origin"),
    ForeignFlag("--cors-allow-credentials", "LoRAX", R, "CORS credentials are not allowed"),
)}


# How a switch's environment variable says "off" (clap and click read these as false).
_OFF = frozenset({"false", "0", "no", "off", "f", "n"})


class UnknownArgument(Exception):
    """An argument that is neither a Specula flag nor a known TGI/LoRAX one (a typo, a stray value)."""

    def __init__(self, argument: str) -> None:
        super().__init__(argument)
        self.argument = argument


def check_foreign(extra_args: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """Warnings for the harmless foreign flags among `extra_args` (what the CLI did not parse) and `environ`.

    Raises ValueError naming the first flag that must be refused, and UnknownArgument for anything in
    `extra_args` that is not a known foreign flag or its value.
    """
    warnings: list[str] = []
    i = 0
    while i < len(extra_args):
        token = extra_args[i]
        name, has_inline_value, inline_value = token.partition("=")
        flag = FOREIGN_FLAGS.get(name)
        if flag is None:
            raise UnknownArgument(token)
        value = inline_value if has_inline_value else None
        if flag.takes_value and not has_inline_value and i + 1 < len(extra_args):
            i += 1
            value = extra_args[i]
        warnings += _judge(flag, value, f"{flag.flag}" + (f" {value}" if value is not None else ""))
        i += 1
    for flag in FOREIGN_FLAGS.values():
        env = flag.env_name
        if env is not None and environ.get(env, "") != "":  # set but empty means unset, as the CLI reads it
            warnings += _judge(flag, environ[env], f"{env}={environ[env]}")
    return warnings


def _judge(flag: ForeignFlag, value: str | None, given: str) -> list[str]:
    if value is not None and value.lower() in flag.harmless_values:
        return []
    if not flag.takes_value and value is not None and value.lower() in _OFF:  # TRUST_REMOTE_CODE=false: not asked
        return []
    env = f", env {flag.env_name}" if flag.env_name else ""
    if flag.action is Action.REFUSE:
        raise ValueError(f"{flag.flag} ({flag.origin}{env}) is not supported: {flag.reason}. Remove it to start "
                         f"(given: {_redacted(flag, given)})")
    return [f"{flag.flag} ({flag.origin}{env}) is ignored: {flag.reason} (given: {_redacted(flag, given)})"]


def _redacted(flag: ForeignFlag, given: str) -> str:
    # Tokens are secrets: say where they came from, never what they are.
    return given.split("=")[0].split(" ")[0] if "token" in flag.flag else given
