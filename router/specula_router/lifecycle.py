"""How the router's HTTP server ends: a drain whose cut is answered, and exit codes the launcher reads.

On SIGTERM uvicorn stops accepting connections and waits for the open ones. Left alone, when its graceful
timeout passes it cancels the handlers and a stream just stops mid-response. `DrainingServer` ends the
requests itself first:

    SIGTERM ──> stop accepting ──> in-flight requests go on ──> done: exit 0
                                        │ --shutdown-timeout passes
                                        └─> every request still in flight gets an error (a stream: an SSE
                                            event with error_type "shutdown"; /generate: 503), then exit 3

Exit codes: 0 after a full drain, 1 when the batching loop stopped (e.g. a shard did not answer within
--step-timeout), 2 for bad configuration, `DRAIN_CUT_EXIT_CODE` when the drain was cut.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from specula_router.entries import ErrorEvent
from specula_router.scheduler import Scheduler

logger = logging.getLogger("specula.router")

DRAIN_CUT_EXIT_CODE = 3
# Between ending the requests and uvicorn closing their connections: time for the last events to be written.
CLOSE_GRACE_S = 2.0


class DrainingServer(uvicorn.Server):
    """uvicorn's server whose drain, when `drain_timeout` runs out, ends every request with a `shutdown` error."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout: float) -> None:
        config.timeout_graceful_shutdown = int(drain_timeout + CLOSE_GRACE_S + 0.999)
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_timeout = drain_timeout
        self.num_cut = 0  # requests the drain's end cut short

    def handle_exit(self, sig: int, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn raises the signal again once it has stopped serving, so the process would end by SIGTERM
        # whatever happened; the router ends with its own exit code instead, which tells the launcher how the
        # drain went.
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        cut = asyncio.get_running_loop().call_later(self.drain_timeout, self._cut_drain)
        try:
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    def _cut_drain(self) -> None:
        event = ErrorEvent(f"the server is shutting down and its drain (--shutdown-timeout "
                           f"{self.drain_timeout:g}s) ended before this request did", "shutdown", 503)
        self.num_cut = self.scheduler.abort_all(event)
        if self.num_cut:
            logger.warning("drain cut: %d request(s) ended with a shutdown error", self.num_cut)
