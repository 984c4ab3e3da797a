"""Medusa drafting: heads on the base model's last hidden state guess the next tokens, as a chain or a tree.

After each step the worker keeps, per request, the final-normed hidden state of the position its last token
was chosen from (`RequestState.last_hidden`). The base LM head on that state gave the last token; Medusa head
h on it guesses the token h + 1 places after it. So the heads give, without another forward pass, a guess for
each of the next `num_heads` tokens, with a distribution over each.

Chain (`tree_width` 1): the top-1 token of each head. Tree (`tree_width` K > 1): every head offers its top K
tokens; a node at depth d is a choice of one token per head 1..d, scored by the sum of the chosen log-probs.
The best `budget` nodes are taken best-first (a node's score never beats its parent's, so parents are always
in), which spends the verification budget where the heads are confident: a sure head grows a long spine, an
unsure one a fan of alternatives. The chain is the tree's special case and is always its first nodes when the
heads' top-1 scores are their best.

Drafts are deterministic functions of the context, so verification stays exact (`verify.py`).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

import torch

from specula_server.adapters.medusa import LMHead, MedusaHeads
from specula_server.request import RequestState
from specula_server.speculation.drafters import NO_DRAFT, Draft, Drafter


def best_first_tree(logprobs: torch.Tensor, token_ids: torch.Tensor, budget: int) -> Draft:
    """The `budget` highest-scoring nodes of the candidate tree of one request.

    `logprobs`, `token_ids`: `[num_heads, K]`, each head's top K tokens (best first) and their log-probs.
    Node order is the order of discovery, so parents precede children.
    """
    num_heads, width = logprobs.shape
    if budget <= 0 or num_heads == 0:
        return Draft(token_ids.new_empty(0))
    lps, ids = logprobs.tolist(), token_ids.tolist()
    if width == 1:  # the chain: no search needed
        depth = min(budget, num_heads)
        return Draft(token_ids[:depth, 0].clone())
    tokens: list[int] = []
    parents: list[int] = []
    heap = [(-lps[0][k], 0, k, -1) for k in range(width)]  # (-score, depth index, rank in head, parent node)
    heapq.heapify(heap)
    while heap and len(tokens) < budget:
        neg_score, depth, k, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[depth][k])
        parents.append(parent)
        if depth + 1 < num_heads:
            for k2 in range(width):
                heapq.heappush(heap, (neg_score - lps[depth + 1][k2], depth + 1, k2, node))
    return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


class MedusaDrafter:
    """Medusa heads for the requests that have them; `fallback` (prompt lookup) for the others.

    `heads_for(request)` gives a request's heads: its adapter's, else the server's `--speculator`, else None.
    `lm_head` is the base model's, for heads that reuse it (the LoRAX v2 layout).
    """

    def __init__(
        self,
        heads_for: Callable[[RequestState], MedusaHeads | None],
        lm_head: LMHead,
        fallback: Drafter | None,
        tree_width: int = 1,
        name: str | None = None,
    ) -> None:
        if tree_width < 1:
            raise ValueError(f"the draft tree width must be at least 1, got {tree_width}")
        self.heads_for = heads_for
        self.lm_head = lm_head
        self.fallback = fallback
        self.tree_width = tree_width
        # What /info reports: "medusa" when every request may draft with heads, else the fallback's name.
        self.name = name or (fallback.name if fallback is not None else "medusa")
        self.confident = getattr(fallback, "confident", False)

    def release(self, request: RequestState) -> None:
        """The request left the worker: a fallback that keeps state per request (suffix decoding) lets it go."""
        release = getattr(self.fallback, "release", None)
        if release is not None:
            release(request)

    def method_for(self, request: RequestState) -> str:
        if self.heads_for(request) is not None and request.last_hidden is not None:
            return "medusa"
        return self.fallback.method_for(request) if self.fallback is not None else "none"

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(requests)
        groups: dict[int, tuple[MedusaHeads, list[int]]] = {}
        others: list[int] = []
        for i, r in enumerate(requests):
            heads = self.heads_for(r)
            if heads is None or r.last_hidden is None:
                others.append(i)
            elif max_tokens[i] <= 0:
                drafts[i] = NO_DRAFT
            else:
                groups.setdefault(id(heads), (heads, []))[1].append(i)
        for heads, members in groups.values():
            hidden = torch.stack([requests[i].last_hidden for i in members])  # [n, hidden]
            with torch.inference_mode():
                logits = heads(hidden, self.lm_head)  # [H, n, vocab]
                top = torch.log_softmax(logits, dim=-1).topk(self.tree_width, dim=-1)
            values, indices = top.values.cpu(), top.indices.cpu()  # [H, n, K]
            for j, i in enumerate(members):
                drafts[i] = best_first_tree(values[:, j], indices[:, j], max_tokens[i])
        if others:
            if self.fallback is None:
                proposed = [NO_DRAFT] * len(others)
            else:
                proposed = self.fallback.propose([requests[i] for i in others], [max_tokens[i] for i in others])
            for i, draft in zip(others, proposed):
                drafts[i] = draft
        return [d for d in drafts if d is not None]
