"""What the worker checks of what the router sends about a request before it changes any state: a new request
against those running, the model, the cache and the adapters (`check_new_request`), KV block ids
(`block_slots`), and the prompt chunk an update schedules (`chunk_end`). A failed check raises
`InvalidRequestError`, which fails that request alone."""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

import torch

from specula_server.adapters.sources import AdapterError
from specula_server.kv_cache import slots_for_blocks
from specula_server.request import InvalidRequestError, RequestSpec, RequestState, RequestUpdate, check_spec

if TYPE_CHECKING:
    from specula_server.adapters.registry import AdapterRegistry
    from specula_server.models.config import ModelConfig


def check_new_request(spec: RequestSpec, running: Container[int], config: ModelConfig, block_size: int,
                      adapters: AdapterRegistry | None) -> None:
    """Checks a new request's id against the requests `running`, its spec against the model and the cache
    (`check_spec`), and its adapter against those the worker serves."""
    if spec.id in running:
        raise InvalidRequestError(f"request {spec.id} is already running")
    check_spec(spec, config.vocab_size, config.max_position_embeddings, block_size)
    if spec.adapter_id:
        if adapters is None:
            raise InvalidRequestError(f"request {spec.id}: this worker serves no adapters")
        try:
            adapters.check(spec.adapter_id)
        except AdapterError as e:
            raise InvalidRequestError(f"request {spec.id}: {e}") from None


def block_slots(request_id: int, blocks: Sequence[int], num_blocks: int, block_size: int,
                device: torch.device) -> torch.Tensor:
    """The KV slots of a request's `blocks`, whose ids must lie in [0, num_blocks)."""
    if any(not 0 <= b < num_blocks for b in blocks):
        raise InvalidRequestError(f"request {request_id}: KV block ids must be in [0, {num_blocks})")
    return slots_for_blocks(torch.tensor(blocks, dtype=torch.long, device=device), block_size)


def chunk_end(r: RequestState, update: RequestUpdate) -> int | None:
    """The end of the prompt chunk `update` schedules for `r` (None: its prompt is computed already)."""
    if not r.is_prefilling:
        return None
    until = update.prefill_until or r.num_tokens
    if not r.prefilled < until <= r.num_tokens:
        raise InvalidRequestError(f"request {r.id}: prefill_until ({update.prefill_until}) must lie past the "
                                  f"{r.prefilled} positions already computed, within {r.num_tokens}")
    return until
