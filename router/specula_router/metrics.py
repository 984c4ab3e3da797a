"""Prometheus metrics of the router: TGI's set under the `specula_` prefix, plus what TGI and LoRAX lack.
With the prefix `tgi` (or `lorax`) the text is written as TGI writes it, so dashboards built for TGI work.

Additions: time to first token, inter-token latency, an `adapter` label on per-request metrics (empty
for the base model), and the adapters' own loads, failures and offloads. Each `Metrics` owns its registry, so
several routers (or tests) can live in one process.

Adapter ids are chosen by clients, so they never become label values by themselves: `adapter_label` gives an
adapter its own label only once it has loaded successfully (`add_adapter_label`), for the first
`max_adapter_labels` adapters to do so; every other adapter id (unknown, still loading, failed, or past the
cap) is `other`. The series count stays bounded, and /metrics never shows an id nobody could load. Merged
adapters (`merges.py`) are all labelled `merged`: their names say nothing to a reader and are countless.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.utils import floatToGoString

from specula_router.block_allocator import BlockAllocator
from specula_router.entries import Entry, ErrorEvent, FinalEvent
from specula_router.merges import is_merged_id

OTHER_ADAPTERS = "other"  # the label of every adapter without its own
MERGED_ADAPTERS = "merged"  # the label of every merged adapter
# Prefixes whose exposition is written the way TGI's exporter writes it, so that a dashboard built for TGI or LoRAX
# finds its series: counters without prometheus_client's `_total` suffix (TGI queries `tgi_request_count`), and no
# `_created` series.
TGI_STYLE_PREFIXES = ("tgi", "lorax")

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LOAD_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self, prefix: str = "specula", max_adapter_labels: int = 32) -> None:
        if max_adapter_labels < 0:
            raise ValueError(f"--max-adapter-labels must be >= 0; got {max_adapter_labels}")
        self.max_adapter_labels = max_adapter_labels
        self.is_tgi_style = prefix in TGI_STYLE_PREFIXES
        self._adapter_labels: set[str] = set()
        self.registry = CollectorRegistry()
        self.prefix = prefix
        self._request_metrics()
        self._step_metrics()
        self._speculation_metrics()
        self._adapter_metrics()
        self._cache_metrics()
        # What the workers run, as labels of a constant 1 (as vLLM's `cache_config_info`): set once from Info.
        self.model_info = self._gauge("model_info", "The served model's formats (value 1)",
                                      ["dtype", "quantize", "kv_cache_dtype", "device"])

    def _counter(self, name: str, doc: str, labels=()) -> Counter:
        return Counter(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets, labels=()) -> Histogram:
        return Histogram(f"{self.prefix}_{name}", doc, labels, buckets=buckets, registry=self.registry)

    def _gauge(self, name: str, doc: str, labels=()) -> Gauge:
        return Gauge(f"{self.prefix}_{name}", doc, labels, registry=self.registry)

    def _request_metrics(self) -> None:
        """Per request: counts, outcomes, the queue, times and lengths."""
        self.request_count = self._counter("request_count", "Requests received", ["adapter"])
        self.request_success = self._counter("request_success", "Requests that completed", ["adapter"])
        self.request_failure = self._counter(
            "request_failure", "Requests that failed, by error type", ["err", "adapter"])
        # The base model's series of each kind exist from the start at 0, so `rate()` and `increase()` see the
        # first failure of a kind (a series that appears with the value 1 has no increase to show).
        for err in ("validation", "overloaded", "generation", "cancelled"):
            self.request_failure.labels(err, "")
        self.queue_size = self._gauge("queue_size", "Requests waiting to be admitted")
        self.request_duration = self._histogram(
            "request_duration", "End-to-end request time (s)", _SECONDS, ["adapter"])
        self.request_validation_duration = self._histogram(
            "request_validation_duration", "Validation and tokenisation time (s)", _SECONDS)
        self.request_queue_duration = self._histogram(
            "request_queue_duration", "Time in queue (s)", _SECONDS, ["adapter"])
        self.request_inference_duration = self._histogram(
            "request_inference_duration", "Time from admission to last token (s)", _SECONDS, ["adapter"])
        self.request_mean_time_per_token_duration = self._histogram(
            "request_mean_time_per_token_duration", "Mean time per generated token (s)", _SECONDS, ["adapter"])
        self.request_time_to_first_token = self._histogram(
            "request_time_to_first_token", "Time from arrival to first token (s)", _SECONDS, ["adapter"])
        self.request_inter_token_latency = self._histogram(
            "request_inter_token_latency", "Time between consecutive tokens of a request (s)", _SECONDS, ["adapter"])
        self.request_input_length = self._histogram("request_input_length", "Prompt tokens", _TOKENS, ["adapter"])
        self.request_generated_tokens = self._histogram(
            "request_generated_tokens", "Generated tokens", _TOKENS, ["adapter"])
        self.request_max_new_tokens = self._histogram("request_max_new_tokens", "max_new_tokens asked", _TOKENS)
        self.request_skipped_tokens = self._histogram(
            "request_skipped_tokens", "Tokens beyond the first of a step (speculation)", _TOKENS, ["adapter"])

    def _step_metrics(self) -> None:
        """Per worker step: counts, outcomes, the running batch, times."""
        self.batch_inference_count = self._counter("batch_inference_count", "Worker steps run", ["method"])
        self.batch_inference_success = self._counter(
            "batch_inference_success", "Worker steps that succeeded", ["method"])
        self.batch_inference_failure = self._counter("batch_inference_failure", "Worker steps that failed", ["method"])
        self.batch_concat = self._counter("batch_concat", "Running batch extended with new requests", ["reason"])
        self.request_preemptions = self._counter(
            "request_preemptions", "Running requests preempted for lack of KV blocks (resumed later)")
        self.batch_current_size = self._gauge("batch_current_size", "Requests in the running batch")
        self.batch_current_max_tokens = self._gauge(
            "batch_current_max_tokens", "KV cache tokens in blocks the running requests hold")
        self.batch_inference_duration = self._histogram(
            "batch_inference_duration", "Worker step time seen by the router (s)", _SECONDS, ["method"])
        self.batch_forward_duration = self._histogram(
            "batch_forward_duration", "Model forward time of a step (s)", _SECONDS, ["method"])
        self.batch_decode_duration = self._histogram(
            "batch_decode_duration", "Sampling and detokenisation time of a step (s)", _SECONDS, ["method"])
        self.batch_next_size = self._histogram("batch_next_size", "Requests in a new prefill batch", _BATCH)

    def _speculation_metrics(self) -> None:
        """Speculative decoding. Acceptance rate = accepted / draft tokens; mean tokens per step for a request
        that drafted = 1 + accepted tokens / drafts."""
        spec = ["method", "adapter"]
        self.spec_decode_num_drafts = self._counter(
            "spec_decode_num_drafts", "Request steps that verified drafts", spec)
        self.spec_decode_num_draft_tokens = self._counter("spec_decode_num_draft_tokens", "Draft tokens verified", spec)
        self.spec_decode_num_accepted_tokens = self._counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted and emitted", spec)
        self.spec_decode_accepted_tokens_per_pos = self._counter(
            "spec_decode_accepted_tokens_per_pos", "Accepted draft tokens by position in the draft (1-based)",
            spec + ["position"])
        self.spec_decode_draft_length = self._histogram(
            "spec_decode_draft_length", "Draft tokens verified per request step", (0, 1, 2, 3, 4, 5, 6, 8, 10, 16),
            spec)

    def _adapter_metrics(self) -> None:
        """Adapters (adapters.py). A load's duration is LoadAdapter's wall time seen by the router: download,
        reading and installing the weights on every shard."""
        self.adapter_load_duration = self._histogram(
            "adapter_load_duration", "Time to download and load an adapter (s)", _LOAD_SECONDS, ["adapter"])
        self.adapter_load_failure = self._counter(
            "adapter_load_failure", "Adapter loads that failed, by HTTP status given to its requests",
            ["adapter", "status"])
        self.adapter_offload = self._counter(
            "adapter_offload", "Adapters offloaded to make room for another", ["adapter"])
        self.adapter_active = self._gauge("adapter_active", "Adapters loaded in the workers")
        self.adapter_loading = self._gauge("adapter_loading", "Adapters being loaded")
        self.adapter_merge_requests = self._counter(
            "adapter_merge_requests", "Requests for a merged adapter, by whether the merge was cached (hit: loaded "
            "or being loaded) or had to be computed (miss)", ["cache"])
        self.adapter_waiting_requests = self._gauge(
            "adapter_waiting_requests", "Requests waiting for their adapter to load (also in queue_size)")

    def _cache_metrics(self) -> None:
        """The KV cache: prefix caching, blocks, suffix trees."""
        # Prefix caching (block_allocator.py), in prompt tokens: hit rate = hits / queries.
        self.prefix_cache_queries = self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled)")
        self.prefix_cache_blocks = self._gauge("prefix_cache_blocks", "KV blocks holding a reusable prefix")
        # The KV cache's blocks (block_allocator.py), read when scraped (`watch_kv_blocks`): used + free = capacity.
        self.kv_blocks_capacity = self._gauge("kv_blocks_capacity", "KV cache blocks the router allocates from")
        self.kv_blocks_used = self._gauge("kv_blocks_used", "KV blocks held by requests (running, or prefilling)")
        self.kv_blocks_free = self._gauge(
            "kv_blocks_free", "KV blocks a new request may take: never used, or holding a cached prefix no request "
            "holds (counted again in kv_blocks_cached_idle)")
        self.kv_blocks_cached_idle = self._gauge(
            "kv_blocks_cached_idle", "Free KV blocks that hold a reusable prefix (taken last, oldest use first)")
        self.suffix_cache_tokens = self._gauge(
            "suffix_cache_tokens", "Tokens in the global suffix trees of suffix decoding (outputs, each after its "
            "prompt's last 24), per shard")
        self.suffix_cache_nodes = self._gauge(
            "suffix_cache_nodes", "Nodes of the global suffix trees of suffix decoding, per shard")

    def watch_kv_blocks(self, allocator: BlockAllocator) -> None:
        """The KV block gauges read `allocator` when scraped, so they are current between steps too (blocks freed
        by cancelled requests while nothing runs)."""
        self.kv_blocks_capacity.set(allocator.num_blocks)
        self.kv_blocks_used.set_function(lambda: allocator.num_blocks - allocator.num_free_blocks)
        self.kv_blocks_free.set_function(lambda: allocator.num_free_blocks)
        self.kv_blocks_cached_idle.set_function(lambda: allocator.num_idle_cached_blocks)

    def set_model_info(self, dtype: str, quantize: str, kv_cache_dtype: str, device: str) -> None:
        """`quantize`: "" for float weights; `kv_cache_dtype`: `dtype` when the workers did not say."""
        self.model_info.labels(dtype, quantize or "none", kv_cache_dtype or dtype, device).set(1)

    def adapter_label(self, adapter_id: str | None) -> str:
        """The `adapter` label of a request or adapter: "" for the base model, the id once it has its own label
        (see `add_adapter_label`), else `other`."""
        if not adapter_id:
            return ""
        if is_merged_id(adapter_id):
            return MERGED_ADAPTERS
        return adapter_id if adapter_id in self._adapter_labels else OTHER_ADAPTERS

    def add_adapter_label(self, adapter_id: str) -> str:
        """An adapter loaded: it gets its own label while fewer than `max_adapter_labels` have one. Labels are
        never taken back (a series that disappeared would look like a counter reset). Returns its label."""
        if (adapter_id and len(self._adapter_labels) < self.max_adapter_labels and adapter_id != OTHER_ADAPTERS
                and not is_merged_id(adapter_id)):
            self._adapter_labels.add(adapter_id)
        return self.adapter_label(adapter_id)

    # --- what a request's life records (called by the scheduler) -------------------------------------------

    def observe_tokens(self, entry: Entry, num_tokens: int, now: float) -> None:
        """A step gave `entry` `num_tokens` tokens (several under speculation): its first token's latency, or
        the gap since its last step spread over the tokens."""
        label = self.adapter_label(entry.adapter)
        if entry.first_token_at is None:
            self.request_time_to_first_token.labels(label).observe(now - entry.queued_at)
            return
        gap = (now - (entry.last_token_at or now)) / num_tokens
        for _ in range(num_tokens):
            self.request_inter_token_latency.labels(label).observe(gap)

    def observe_speculation(self, method: str, adapter_id: str, drafted: int, accepted: int) -> None:
        """One request step's drafts: how many were verified and accepted, and at which positions."""
        labels = (method, self.adapter_label(adapter_id))
        self.spec_decode_draft_length.labels(*labels).observe(drafted)
        if drafted == 0:
            return
        self.spec_decode_num_drafts.labels(*labels).inc()
        self.spec_decode_num_draft_tokens.labels(*labels).inc(drafted)
        self.spec_decode_num_accepted_tokens.labels(*labels).inc(accepted)
        for position in range(1, accepted + 1):
            self.spec_decode_accepted_tokens_per_pos.labels(*labels, str(position)).inc()

    def observe_end(self, entry: Entry, event: FinalEvent | ErrorEvent | None, now: float) -> None:
        """A request ended: completed (`FinalEvent`), failed (`ErrorEvent`) or cancelled (None)."""
        adapter = self.adapter_label(entry.adapter)  # never a client-chosen id by itself
        if isinstance(event, ErrorEvent):
            self.request_failure.labels(event.error_type, adapter).inc()
            return
        if event is None:
            self.request_failure.labels("cancelled", adapter).inc()
            return
        self.request_success.labels(adapter).inc()
        inference = now - (entry.admitted_at or now)
        self.request_inference_duration.labels(adapter).observe(inference)
        if entry.num_generated:
            self.request_mean_time_per_token_duration.labels(adapter).observe(inference / entry.num_generated)
        self.request_generated_tokens.labels(adapter).observe(entry.num_generated)
        self.request_skipped_tokens.labels(adapter).observe(entry.num_skipped)

    def observe_prefix_cache(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A request admitted with prefix caching on: its prompt tokens looked up, and those found cached."""
        self.prefix_cache_queries.inc(prompt_tokens)
        self.prefix_cache_hits.inc(cached_tokens)

    def render(self) -> bytes:
        """The text format. Safe from any thread (prometheus_client locks each metric): the HTTP route runs it off
        the event loop, since a scrape's cost grows with the number of series."""
        if self.is_tgi_style:
            return _render_tgi_style(self.registry)
        return generate_latest(self.registry)


def _render_tgi_style(registry: CollectorRegistry) -> bytes:
    """The text format as TGI writes it: a counter's samples carry the family's own name (`tgi_request_count 3`,
    not `tgi_request_count_total`), and no family has `_created` samples.

    >>> m = Metrics(prefix="tgi"); m.request_count.labels("").inc()
    >>> b'tgi_request_count{adapter=""} 1.0' in m.render()
    True
    """
    lines = []
    for family in registry.collect():
        lines.append(f"# HELP {family.name} {_escape(family.documentation, quote=False)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            name = family.name if family.type == "counter" else sample.name
            labels = ",".join(f'{k}="{_escape(v, quote=True)}"' for k, v in sample.labels.items())
            lines.append(f"{name}{{{labels}}} {floatToGoString(sample.value)}" if labels
                         else f"{name} {floatToGoString(sample.value)}")
    return ("\n".join(lines) + "\n").encode()


def _escape(text: str, quote: bool) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text
