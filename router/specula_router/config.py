"""The router's settings: one frozen `RouterConfig`, built once by `cli.py` from the flags and environment.

`RouterConfig.__post_init__` checks every value, with errors that name the flag. `split_ids` reads list flags
given repeated, comma-separated or both.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from specula_proto.choices import AdapterSource, parse_choice
from specula_proto.setting import Process
from specula_proto.settings import check_bounds


@dataclass(frozen=True)
class RouterConfig:
    model_id: str
    master_shard_uds_path: str
    instance_id: str = ""  # the launcher run whose shards this router may use; "": any (started by hand)
    revision: str | None = None
    huggingface_hub_cache: Path | None = None
    hostname: str = "0.0.0.0"
    port: int = 3000
    speculative_tokens: int = 0
    speculator: str | None = None
    adapter_source: AdapterSource = AdapterSource.HUB
    max_active_adapters: int = 8
    preloaded_adapter_ids: tuple[str, ...] = ()
    max_concurrent_requests: int = 128
    max_best_of: int = 2
    max_stop_sequences: int = 4
    max_top_n_tokens: int = 5
    max_input_tokens: int | None = None
    max_total_tokens: int | None = None
    waiting_served_ratio: float = 1.2
    max_batch_prefill_tokens: int | None = None
    max_batch_total_tokens: int | None = None
    max_waiting_tokens: int = 20
    max_batch_size: int | None = None
    num_scheduler_steps: int = 4  # decode steps a Step call may run (step_planner.py)
    payload_limit: int = 2_000_000
    cors_allow_origin: tuple[str, ...] = field(default_factory=tuple)
    json_output: bool = False
    num_shard: int = 1
    shutdown_timeout: float = 30.0
    pipeline_depth: int = 2
    validation_workers: int = 2  # threads that validate and tokenise requests off the event loop
    max_adapter_labels: int = 32  # adapters with their own metrics label; the rest are `other`
    metrics_prefix: str = "specula"  # metric names' prefix; `tgi`/`lorax` also write counters as TGI does
    step_timeout: float = 600.0  # seconds a shard may take to answer one step; 0: no limit
    prefix_caching: bool = True  # reuse the KV blocks of prompts' shared prefixes (block_allocator.py)
    chat_template: str | None = None  # --chat-template: a file or a template, overriding the model's
    adapter_dir: tuple[str, ...] = ()  # the workers' --adapter-dir, whose adapters GET /v1/models lists
    max_grammar_bytes: int = 65536  # largest grammar / JSON schema / regex text of a request (structured output)
    grammar_compile_timeout: float = 10.0  # seconds a request's grammar may take to check against the tokenizer
    # --api-key: the bearer token every route but the probes requires (auth.py). repr=False: a logged or printed
    # config never shows it.
    api_key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from specula_router.schemas import MAX_ADAPTER_ID_LENGTH

        object.__setattr__(self, "adapter_source", parse_choice(AdapterSource, self.adapter_source,
                                                                "--adapter-source"))
        check_bounds(self, Process.ROUTER)  # the settings table's
        if len(set(self.preloaded_adapter_ids)) > self.max_active_adapters:
            raise ValueError(f"--preloaded-adapter-ids names {len(set(self.preloaded_adapter_ids))} adapters, more "
                             f"than --max-active-adapters ({self.max_active_adapters})")
        if not re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", self.metrics_prefix):
            raise ValueError(f"--metrics-prefix must be letters, digits and _ (not first a digit); "
                             f"got {self.metrics_prefix!r}")
        if self.step_timeout < 0:
            raise ValueError(f"--step-timeout must not be negative; got {self.step_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"--grammar-compile-timeout must be positive; got {self.grammar_compile_timeout}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key (env API_KEY) must not be empty or blank")
        for adapter_id in self.preloaded_adapter_ids:
            if not adapter_id or len(adapter_id) > MAX_ADAPTER_ID_LENGTH:
                raise ValueError(f"--preloaded-adapter-ids: {adapter_id!r} is not an adapter id")


def split_ids(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Flag values given repeated, comma-separated or both: ["a,b", "c"] -> ("a", "b", "c")."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())
