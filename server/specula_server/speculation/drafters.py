"""Drafters: where speculative tokens come from.

A drafter proposes, for each request of a decode step, a chain of up to `max_tokens` tokens that it guesses
follow the request's tokens. It never sees the target model's output for them; verification decides.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from specula_server.request import RequestState


class Drafter(Protocol):
    """Proposes draft tokens. Deterministic drafters (no draft distribution q) are verified exactly by
    sampling the target at every position and keeping drafts while they match."""

    name: str

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[torch.Tensor]:
        """Per request, a 1-D long tensor of at most `max_tokens[i]` draft ids (may be empty)."""
        ...


class PromptLookupDrafter:
    """Prompt lookup (n-gram) drafting: reuse what followed an earlier occurrence of the latest n-gram.

    For n from `max_n` down to `min_n`, the last n tokens of prompt + generated text are searched for earlier in
    the same text; the tokens that followed the match are the draft. Which match wins when there are several:
    `latest` (the most recent occurrence that still has `max_tokens` tokens after it, else the earliest, which
    has the longest continuation; in a run like "a a a a" the very latest match has one token after it) or
    `earliest` (the first, as transformers and vLLM do).

    >>> drafter = PromptLookupDrafter(min_n=1, max_n=3)
    >>> history = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7])    # "... 5 6 7" seen before, followed by 8 9
    >>> drafter.lookup(history, 3).tolist()
    [8, 9, 5]
    """

    name = "ngram"

    def __init__(self, min_n: int = 1, max_n: int = 3, match: str = "latest") -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram min ({min_n}) <= ngram max ({max_n})")
        if match not in ("latest", "earliest"):
            raise ValueError(f"ngram match must be 'latest' or 'earliest', got {match!r}")
        self.min_n, self.max_n, self.match = min_n, max_n, match

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[torch.Tensor]:
        return [self.lookup(r.history, k) for r, k in zip(requests, max_tokens)]

    def lookup(self, history: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Draft for one token sequence; each n is one vectorised comparison over all earlier windows."""
        length = history.numel()
        if max_tokens <= 0:
            return history[:0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = history[length - n :]
            # Windows starting at 0 .. length-n-1: each has at least one token after it.
            windows = history[: length - 1].unfold(0, n, 1)  # [length - n, n]
            hits = (windows == suffix).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[0]) + n
                if self.match == "latest":
                    full = hits[hits + n + max_tokens <= length]
                    if full.numel():
                        start = int(full[-1]) + n
                return history[start : start + max_tokens]
        return history[:0]
