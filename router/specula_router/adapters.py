"""Which adapters the workers hold: loading them on demand, offloading the least recently used (LoRAX semantics).

Sits between the scheduler and the workers' LoadAdapter/OffloadAdapter RPCs, which run beside the steps (they
are not part of the step sequence). The scheduler keeps the requests; this module keeps the adapters:

    request for A ─ A ready? ─ yes ─> scheduler FIFO (A counted as in use until the request ends)
                        └─ no ──> the scheduler parks it in A's own queue; A is WAITING for a slot
    WAITING ─ a slot is free, or the least recently used READY adapter with no queued or running
    │         request can be offloaded to make one (none can: A keeps waiting) ─> LOADING
    LOADING ─ LoadAdapter on every shard ─> READY: A's parked requests join the FIFO
                                         └> FAILED: they are answered with the worker's status and reason;
                                            the adapter is forgotten, so its next request tries again

At most `max_active_adapters` adapters are LOADING or READY at once, the workers' number of adapter slots.
The base model (empty id) is always ready. Everything runs on the router's event loop: the state changes
below never interleave, and the loads themselves are background tasks that block nothing else.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specula_router.client import ShardedClient, ShardError
from specula_router.merges import MergeSpec
from specula_router.metrics import Metrics

logger = logging.getLogger("specula.router.adapters")

DEFAULT_ERROR_STATUS = 424  # what a load failure answers when the worker names no status


class AdapterState(enum.IntEnum):
    WAITING = 0  # asked for; waits for a free adapter slot
    LOADING = 1  # LoadAdapter sent to the workers
    READY = 2  # loaded in every shard; its requests may be prefilled
    FAILED = 3  # the load failed; the record is dropped at once, so the next request retries


@dataclass(frozen=True)
class AdapterFailure:
    """Why an adapter could not be loaded, as its waiting requests are answered."""

    status: int  # HTTP status: 400 for an id the workers refuse, 424 for one they could not fetch or load
    message: str

    @property
    def error_type(self) -> str:
        return "validation" if self.status in (400, 422) else "generation"


@dataclass(eq=False)
class Adapter:
    """One adapter the router knows about, from its first request until it is offloaded or fails."""

    adapter_id: str
    source: str
    state: AdapterState = AdapterState.WAITING
    api_token: str | None = field(default=None, repr=False)  # of the request that asked first; never logged
    num_requests: int = 0  # requests queued for prefill or running; while > 0 it is never offloaded
    last_used: int = 0  # LRU clock: the tick of its last request's arrival or end
    kind: str = ""  # "lora", "medusa" or "lora+medusa", as the workers report
    merge: MergeSpec | None = None  # a merged adapter (`merges.py`): what the workers merge when they load it
    load_seconds: float = 0.0

    @property
    def holds_slot(self) -> bool:
        return self.state in (AdapterState.LOADING, AdapterState.READY)

    @property
    def can_offload(self) -> bool:
        return self.state is AdapterState.READY and self.num_requests == 0


class AdapterManager:
    """Adapter states, LRU offload and background loads; the scheduler is told when a load settles.

    `on_settled(adapter_id, failure)` is called once per load, with None when the adapter became ready.
    """

    def __init__(self, client: ShardedClient, metrics: Metrics, max_active_adapters: int = 8,
                 default_source: str = "hub") -> None:
        if max_active_adapters < 1:
            raise ValueError(f"--max-active-adapters must be at least 1; got {max_active_adapters}")
        self.client = client
        self.metrics = metrics
        self.max_active_adapters = max_active_adapters
        self.default_source = default_source
        self.on_settled: Callable[[str, AdapterFailure | None], None] = lambda adapter_id, failure: None
        self._adapters: dict[str, Adapter] = {}  # insertion order = order of first request (WAITING ones load FIFO)
        self._offloads: dict[str, asyncio.Task] = {}  # offloads on the wire; a reload of the same id waits for it
        self._tasks: set[asyncio.Task] = set()  # keeps background tasks referenced until they end
        self._clock = itertools.count(1)

    # --- queries ------------------------------------------------------------------------------------------

    def is_ready(self, adapter_id: str) -> bool:
        adapter = self._adapters.get(adapter_id)
        return not adapter_id or (adapter is not None and adapter.state is AdapterState.READY)

    def state(self, adapter_id: str) -> AdapterState | None:
        """The adapter's state; None when the router does not know it (never asked for, offloaded or failed)."""
        adapter = self._adapters.get(adapter_id)
        return adapter.state if adapter is not None else None

    @property
    def ready_ids(self) -> list[str]:
        return [a.adapter_id for a in self._adapters.values() if a.state is AdapterState.READY]

    @property
    def num_slots_used(self) -> int:
        return sum(a.holds_slot for a in self._adapters.values())

    # --- called by the scheduler --------------------------------------------------------------------------

    def request(self, adapter_id: str, source: str | None = None, api_token: str | None = None,
                merge: MergeSpec | None = None) -> None:
        """A request needs an adapter that is not ready: start loading it unless a load is already coming.
        `merge`: the adapter is that merge (`adapter_id` its name), computed by the workers as they load it."""
        assert adapter_id, "the base model is always ready"
        adapter = self._adapters.get(adapter_id)
        if adapter is None:
            adapter = Adapter(adapter_id, source or self.default_source, api_token=api_token, merge=merge)
            self._adapters[adapter_id] = adapter
        elif adapter.state is AdapterState.WAITING and adapter.api_token is None:
            adapter.api_token = api_token  # a private adapter asked for first without a token
        adapter.last_used = next(self._clock)
        self._schedule()

    def count_merge(self, adapter_id: str) -> None:
        """A request for a merged adapter arrived: a cache hit when the merge is loaded or on its way (it is
        computed once), a miss when it must be computed."""
        outcome = "hit" if adapter_id in self._adapters else "miss"
        self.metrics.adapter_merge_requests.labels(outcome).inc()

    def withdraw(self, adapter_id: str) -> None:
        """Every request waiting for the adapter went away: forget it if its load has not started."""
        adapter = self._adapters.get(adapter_id)
        if adapter is not None and adapter.state is AdapterState.WAITING:
            del self._adapters[adapter_id]

    def acquire(self, adapter_id: str) -> None:
        """A request of a ready adapter joined the FIFO: the adapter stays loaded until `release`."""
        if adapter_id:
            adapter = self._adapters[adapter_id]
            assert adapter.state is AdapterState.READY, f"adapter {adapter_id} used while {adapter.state.name}"
            adapter.num_requests += 1
            adapter.last_used = next(self._clock)

    def release(self, adapter_id: str) -> None:
        """A request counted by `acquire` ended (finished, failed or cancelled)."""
        if not adapter_id:
            return
        adapter = self._adapters[adapter_id]
        adapter.num_requests -= 1
        adapter.last_used = next(self._clock)
        assert adapter.num_requests >= 0
        if adapter.num_requests == 0:
            self._schedule()  # it may now make room for a waiting adapter

    async def preload(self, adapter_ids: Sequence[str]) -> None:
        """Loads adapters before serving; raises ValueError naming the first adapter that failed."""
        adapter_ids = list(dict.fromkeys(adapter_ids))
        if len(adapter_ids) > self.max_active_adapters:
            raise ValueError(f"--preloaded-adapter-ids names {len(adapter_ids)} adapters, more than "
                             f"--max-active-adapters ({self.max_active_adapters})")
        adapters = []
        for adapter_id in adapter_ids:
            adapter = Adapter(adapter_id, self.default_source, AdapterState.LOADING, last_used=next(self._clock))
            self._adapters[adapter_id] = adapter
            adapters.append(adapter)
        failures = await asyncio.gather(*(self._load(a) for a in adapters))
        for adapter, failure in zip(adapters, failures):
            if failure is not None:
                raise ValueError(f"preloaded adapter `{adapter.adapter_id}` could not be loaded: {failure.message}")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- loads and offloads -------------------------------------------------------------------------------

    def _schedule(self) -> None:
        """Starts the loads of waiting adapters, first asked first served, while slots are free or can be freed.

        Example, max_active_adapters=2, A and B ready, A has a running request, B none, C waiting:
        C takes B's slot (B is offloaded first); a later D waits until A's request ends.
        """
        for adapter in [a for a in self._adapters.values() if a.state is AdapterState.WAITING]:
            if self.num_slots_used >= self.max_active_adapters:
                victim = self._least_recently_used()
                if victim is None:
                    break  # every slot holds an adapter in use: wait for a `release`
                del self._adapters[victim.adapter_id]  # its slot passes to `adapter` once the offload is done
                self._start_offload(victim.adapter_id)
            adapter.state = AdapterState.LOADING
            self._spawn(self._load_and_settle(adapter))
        self._update_gauges()

    def _least_recently_used(self) -> Adapter | None:
        candidates = [a for a in self._adapters.values() if a.can_offload]
        return min(candidates, key=lambda a: a.last_used, default=None)

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _start_offload(self, adapter_id: str) -> None:
        task = self._spawn(self._offload(adapter_id))
        self._offloads[adapter_id] = task

        def forget(done: asyncio.Task) -> None:
            if self._offloads.get(adapter_id) is done:
                del self._offloads[adapter_id]

        task.add_done_callback(forget)

    async def _offload(self, adapter_id: str) -> None:
        try:
            await self.client.offload_adapter(adapter_id)
        except ShardError as e:
            # The slot may stay taken in a worker; a later load then fails with the worker's reason.
            logger.error("could not offload adapter %s: %s", adapter_id, e)
            return
        self.metrics.adapter_offload.labels(self.metrics.adapter_label(adapter_id)).inc()
        logger.info("offloaded adapter %s", adapter_id)

    async def _load_and_settle(self, adapter: Adapter) -> None:
        failure = await self._load(adapter)
        self.on_settled(adapter.adapter_id, failure)
        self._schedule()  # a failed load gave its slot back

    async def _load(self, adapter: Adapter) -> AdapterFailure | None:
        """Runs LoadAdapter on every shard and records the outcome; returns the failure, None when ready."""
        adapter_id, token = adapter.adapter_id, adapter.api_token
        adapter.api_token = None  # needed for this load only
        # The slot this load takes may be the one an offload is freeing, and a reload of an adapter still being
        # offloaded must not reach the workers before that offload: wait for the offloads under way.
        if self._offloads:
            await asyncio.gather(*self._offloads.values(), return_exceptions=True)
        started = time.monotonic()
        try:
            response = await self.client.load_adapter(adapter_id, adapter.source, token or "", adapter.merge)
            failure = None if response.loaded else AdapterFailure(
                response.error_status if 400 <= response.error_status <= 599 else DEFAULT_ERROR_STATUS,
                _redact(response.error or f"adapter `{adapter_id}` could not be loaded", token))
        except Exception as e:  # whatever went wrong fails this adapter's requests, never the router
            failure = AdapterFailure(DEFAULT_ERROR_STATUS, _redact(f"adapter `{adapter_id}`: {e}", token))
        assert self._adapters.get(adapter_id) is adapter, "a loading adapter is never dropped"
        if failure is not None:
            adapter.state = AdapterState.FAILED
            del self._adapters[adapter_id]
            # Labelled `other` unless this id loaded once before: a client-chosen id is not a label value.
            label = self.metrics.adapter_label(adapter_id)
            self.metrics.adapter_load_failure.labels(label, str(failure.status)).inc()
            self._update_gauges()
            logger.warning("adapter %s failed to load (%d): %s", adapter_id, failure.status, failure.message)
            return failure
        elapsed = time.monotonic() - started  # as the requests waiting for it saw it, gRPC included
        adapter.state = AdapterState.READY
        adapter.kind = response.kind
        adapter.load_seconds = elapsed
        adapter.last_used = next(self._clock)
        self.metrics.adapter_load_duration.labels(self.metrics.add_adapter_label(adapter_id)).observe(elapsed)
        self._update_gauges()
        logger.info("adapter %s (%s, source %s) loaded in %.2fs (workers: %.2fs)", adapter_id,
                    adapter.kind or "unknown kind", adapter.source, elapsed, response.load_seconds)
        return None

    def _update_gauges(self) -> None:
        self.metrics.adapter_active.set(sum(a.state is AdapterState.READY for a in self._adapters.values()))
        self.metrics.adapter_loading.set(sum(a.state is AdapterState.LOADING for a in self._adapters.values()))


def _redact(message: str, secret: str | None) -> str:
    """A worker's message, with the request's token removed should the worker have quoted it."""
    return message.replace(secret, "***") if secret else message
