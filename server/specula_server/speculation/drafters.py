"""Drafters: where speculative tokens come from.

A drafter proposes, for each request of a decode step, up to `max_tokens` tokens that it guesses follow the
request's tokens: a chain, or a tree of candidates (`Draft`). It never sees the target model's output for
them; verification decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from specula_proto.choices import NgramMatch, parse_choice
from specula_server.request import RequestState


@dataclass(frozen=True)
class Draft:
    """Draft tokens for one request: a chain, or a tree whose root is the request's last committed token.

    `parents[i]` is the index of node i's parent in `tokens`, -1 for a child of the root; parents come before
    their children, and nodes are in the drafter's order of preference, so the first k nodes are always a
    tree (`truncated`). A chain has `parents = None` (node i's parent is i - 1).

        tokens  [a, b, c, x]        root ─ a ─ b ─ c       (the chain a b c, and x as
        parents [-1, 0, 1, 0]                └ x           an alternative to b)
    """

    tokens: torch.Tensor  # [n] long (CPU)
    parents: torch.Tensor | None = None  # [n] long, or None for a chain
    # [n, vocab] probabilities each token was sampled from (a draft model's q), chains only; None for
    # deterministic drafts. Verification then accepts token i with probability min(1, p_i(x) / q_i(x)).
    q: torch.Tensor | None = None
    # Tokens the drafter will produce on demand once the controller has chosen how many (a draft model,
    # for which drafting is a forward per token): `tokens` is empty until `DraftModelDrafter.draft` fills it.
    pending: int = 0
    # The drafter's own estimate of the chance that each draft token is accepted given the ones before it were
    # (suffix decoding's, from how often its continuations followed); None: the drafter has none. The adaptive
    # controller trusts it where the request's measured acceptance is lower.
    confidence: float | None = None
    # A model drafter's probability of each token of a chain, given the ones before it (EAGLE-3's draft layer):
    # the controller prices each token by what tokens of that probability were accepted at (`token_acceptance`).
    confidences: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.q is not None and self.parents is not None:
            raise ValueError("a draft with a distribution q must be a chain")

    def __len__(self) -> int:
        return self.tokens.numel()

    @property
    def available(self) -> int:
        """Tokens this draft can verify: its nodes, or the tokens still to be drafted on demand."""
        return self.pending if self.pending else len(self)

    @property
    def is_chain(self) -> bool:
        """Whether every node has one child at most (an empty tree, or one node, is a chain too)."""
        return self.parents is None or len(self) <= 1

    def truncated(self, k: int) -> Draft:
        if self.pending:
            return Draft(self.tokens, pending=max(0, min(k, self.pending)))
        if k >= len(self):
            return self
        return Draft(self.tokens[:k], None if self.parents is None else self.parents[:k],
                     None if self.q is None else self.q[:k], confidence=self.confidence,
                     confidences=None if self.confidences is None else self.confidences[:k])

    def subtree(self, keep: Sequence[int]) -> Draft:
        """The nodes `keep` (ascending; every kept node's parent kept too), renumbered."""
        if len(keep) == len(self):
            return self
        if self.is_chain:
            return self.truncated(len(keep))
        index = {old: new for new, old in enumerate(keep)}
        parents = self.parents.tolist()
        new_parents = [index[parents[i]] if parents[i] >= 0 else -1 for i in keep]
        return Draft(self.tokens[list(keep)], torch.tensor(new_parents, dtype=torch.long), confidence=self.confidence)

    def node_parents(self) -> list[int]:
        """Every node's parent index (-1: the root), for chains too."""
        if self.parents is None:
            return list(range(-1, len(self) - 1))
        return self.parents.tolist()

    def depths(self) -> list[int]:
        """Each node's depth below the root (1 for the root's children)."""
        depths: list[int] = []
        for parent in self.node_parents():
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def ancestors(self) -> torch.Tensor:
        """`[n + 1, n + 1]` bool over root + nodes: row q sees column j when j is q itself or its ancestor."""
        n = len(self)
        seen = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        seen[:, 0] = True
        for i, parent in enumerate(self.node_parents()):
            seen[i + 1] = seen[parent + 1]
            seen[i + 1, i + 1] = True
        return seen


NO_DRAFT = Draft(torch.empty(0, dtype=torch.long))  # shared by every request without drafts (never changed in place)


class Drafter(Protocol):
    """Proposes draft tokens. Deterministic drafters (no draft distribution q) are verified exactly by
    sampling the target at every position and keeping drafts while they match; drafts that carry the
    distribution q they were sampled from (a draft model's) by the rejection rule of speculative sampling.

    A drafter for which each token costs a forward (the draft model) proposes `pending` drafts instead: the
    controller first picks how many tokens each request verifies, then exactly that many are drafted.

    `name` labels the speculation metrics; `method_for(request)` may name another method for some requests
    (a composite drafter). A drafter that keeps state per request also has `release(request)`, called when the
    request leaves the worker. A drafter whose drafts carry a `confidence` sets `confident = True`: the
    controller then asks it for drafts even for requests whose measured acceptance is low, as long as drafts of
    some confidence have lately been accepted above its bar (`controller.ConfidenceCalibration`)."""

    name: str

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        """Per request, at most `max_tokens[i]` draft nodes (may be empty)."""
        ...

    def method_for(self, request: RequestState) -> str:
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

    def __init__(self, min_n: int = 1, max_n: int = 3, match: str = NgramMatch.LATEST) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= ngram min ({min_n}) <= ngram max ({max_n})")
        self.min_n, self.max_n, self.match = min_n, max_n, parse_choice(NgramMatch, match, "ngram match")

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        return [Draft(self.lookup(r.history, k)) for r, k in zip(requests, max_tokens)]

    def method_for(self, request: RequestState) -> str:
        return self.name

    def lookup(self, history: torch.Tensor, max_tokens: int) -> torch.Tensor:
        """Draft for one token sequence (a CPU tensor).

        The search runs over the sequence's bytes (8 per token id) with `bytes.find` / `rfind`, a C substring
        search, where tensor comparisons cost a dozen operator calls per n-gram length. A match must start on a
        token boundary; an unaligned one is skipped.
        """
        length = history.numel()
        if max_tokens <= 0 or length < 2:
            return history[:0]
        data = history.numpy().tobytes()
        width = history.element_size()
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = data[(length - n) * width :]
            # Matches lie inside the first length - 1 tokens, so each has at least one token after it.
            first = _find(data, suffix, (length - 1) * width, width, last=False)
            if first < 0:
                continue
            start = first + n
            if self.match == NgramMatch.LATEST:  # the latest match with max_tokens tokens after it, if any
                full = _find(data, suffix, (length - max_tokens) * width, width, last=True)
                if full >= 0:
                    start = full + n
            return history[start : start + max_tokens]
        return history[:0]


def _find(data: bytes, pattern: bytes, end: int, width: int, last: bool) -> int:
    """Token index of the first (or last) occurrence of `pattern` in `data[:end]` that starts on a token
    boundary, or -1."""
    lo, hi = 0, end
    while True:
        at = data.rfind(pattern, lo, hi) if last else data.find(pattern, lo, hi)
        if at < 0:
            return -1
        if at % width == 0:
            return at // width
        if last:
            hi = at + len(pattern) - 1
        else:
            lo = at + 1
