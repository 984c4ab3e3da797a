"""Suffix decoding: drafts from the request's own context and from the outputs of earlier requests, as trees.

Agent loops, retries, code edits and batch extraction regenerate text that earlier requests (or the request
itself) already produced. A suffix tree here is a trie of every token string of length up to `depth` that
occurred in some sequences, each node counting its occurrences. Drafting matches the longest suffix of a
request's context that occurred before and proposes what most often followed it, as a tree of the likeliest
continuations (SuffixDecoding, Oliaro et al., 2025; the method of Snowflake's Arctic Inference):

    context  ... a b c d | ?       suffix "b c d" occurred 3 times, followed by "e f" twice and "x" once
    draft    e (2/3) ─ f (2/3)     best-first by path probability, while it stays >= `min_token_prob`,
             x (1/3)               at most `factor * match_len + offset` nodes (longer matches earn longer drafts)

Two trees per request are consulted, and the one whose draft has the higher expected number of accepted tokens
(the sum of its nodes' path probabilities) wins: the request's own (prompt and output so far), and the global
tree of its adapter (outputs of recent finished requests of the same adapter, each after the last `depth` tokens
of its prompt; an adapter's outputs never draft for another adapter or the base model). The global trees hold at
most `cache_tokens` tokens in all; the oldest request's output leaves first.

Cost. Appending a token to a sequence extends the `depth` suffixes that end at it: O(depth) per token, whatever
the sequence's length. Each request keeps a cursor per tree (the nodes of its current suffixes), so matching
is O(depth) per step too; a global tree that lost an output since a cursor was built (evicted) rebuilds that
cursor, O(depth^2) once (an output added leaves cursors valid: they find the longer matches as they follow).
Nodes are Python objects (about 260 bytes each with their children's dict): a 2,000-token prompt at depth 24
makes up to 48,000 nodes in its own tree, freed when it ends. In Python this is the cost of the method, a large
share of a small model's step (docs/benchmarks.md#suffix-decoding).

Backends. Where arctic-inference is installed (`suffix_native`: Snowflake's C++ suffix tree, path-compressed,
children sorted by count), the same drafter runs on it instead, much cheaper; the
Python trees here are the fallback without it, and `backend="python"` (or SPECULA_SUFFIX_BACKEND=python) forces them.
The two draft alike where the likeliest continuations are unique; `suffix_native` says where they may differ.

Everything is deterministic in the order of the steps, so tensor-parallel ranks draft the same trees without
communicating.
"""

from __future__ import annotations

import heapq
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specula_server.request import RequestState
from specula_server.speculation import suffix_native
from specula_server.speculation.drafters import NO_DRAFT, Draft

SUFFIX = "suffix"  # the --speculator value that selects this drafter
DEFAULT_DEPTH = 24
MIN_MATCH = 2  # shortest suffix drafted from
DEFAULT_CACHE_TOKENS = 100_000
BACKENDS = ("auto", "native", "python")
BACKEND_ENV = "SPECULA_SUFFIX_BACKEND"  # overrides backend="auto" (to compare the two, or to rule one out)


_LEAF: dict = {}  # the children of every node that has none yet: shared, never written (see `extend`)


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        # A dict of its own only once it gets a child: the deepest nodes never do, which saves allocating one
        # per leaf when requests' trees are extended.
        self.children: dict[int, _Node] = _LEAF
        self.count = 0


class SuffixTree:
    """Counts of every token string of length <= `depth` in the sequences added (a trie)."""

    def __init__(self, depth: int = DEFAULT_DEPTH) -> None:
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0
        # Changes when sequences are removed: a cursor built before may hold nodes that left the tree. (Added
        # sequences only add nodes and counts: a cursor stays valid, and finds longer matches as it follows.)
        self.version = 0

    def extend(self, cursor: list[_Node], token: int) -> list[_Node]:
        """Appends `token` to the sequence whose current suffixes are `cursor` (cursor[k]: the node of its last k
        tokens, cursor[0] the root); returns the new cursor."""
        new = [self.root]
        for node in cursor[: self.depth]:
            child = node.children.get(token)
            if child is None:
                if node.children is _LEAF:
                    node.children = {}
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            new.append(child)
        return new

    def add(self, tokens: Sequence[int]) -> None:
        """Counts every string of length <= depth of `tokens`."""
        cursor = [self.root]
        for token in tokens:
            cursor = self.extend(cursor, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undoes `add(tokens)`: counts go down, nodes whose count reaches 0 go."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= _size(child)
                    break
                node = child
        self.version += 1

    def match(self, context: Sequence[int]) -> list[_Node]:
        """The cursor of `context` in this tree: the nodes of its suffixes that occur, shortest first. Every
        substring of an occurring string occurs, so they are the suffixes of lengths 0 .. m for some m."""
        context = list(context[-self.depth :]) if self.depth else []
        for start in range(len(context)):  # the longest suffix first
            if self.find(context[start:]) is not None:
                longest = len(context) - start
                return [self.root] + [self.find(context[len(context) - k :]) for k in range(1, longest + 1)]
        return [self.root]

    def find(self, tokens: Sequence[int]) -> _Node | None:
        """The node of the string `tokens`, None when it does not occur."""
        node: _Node | None = self.root
        for token in tokens:
            node = node.children.get(token)
            if node is None:
                return None
        return node


def _size(node: _Node) -> int:
    """Nodes in the subtree of `node`."""
    return 1 + sum(_size(child) for child in node.children.values())


def follow(cursor: list[_Node], token: int, depth: int) -> list[_Node]:
    """A cursor after `token`, in a tree that does not change (the global one, between versions)."""
    new = [cursor[0]]
    for node in cursor[:depth]:
        child = node.children.get(token)
        if child is None:
            break
        new.append(child)
    return new


@dataclass(frozen=True)
class SuffixDraft:
    draft: Draft
    score: float  # expected accepted tokens: the sum of the nodes' path probabilities


def draft_from(cursor: list[_Node], max_tokens: int, factor: float, offset: float, min_prob: float,
               depth: int) -> SuffixDraft:
    """The best-first tree of continuations of the longest suffix in `cursor` that has any and leaves room for
    `max_tokens` below it (the tree holds strings of `depth` tokens at most: a match of m tokens can be followed
    `depth - m` deep).

    A node's children are what followed its string's earlier occurrences; in a request's own tree the latest
    occurrence (the context's end) has no continuation yet, so probabilities are over the children's counts."""
    longest = min(len(cursor) - 1, max(depth - max_tokens, 1))
    for match_len in range(longest, MIN_MATCH - 1, -1):
        if cursor[match_len].children:
            break
    else:  # a single token's continuations are too many to scan and too weak to draft
        return SuffixDraft(NO_DRAFT, 0.0)
    budget = min(max_tokens, int(factor * match_len + offset))
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    frontier: list[tuple[float, int, int, _Node, int]] = []  # (-path probability, order, parent, node, token)
    order = 0

    def push_children(node: _Node, probability: float, index: int) -> None:
        nonlocal order
        total = sum(child.count for child in node.children.values())
        for token, child in node.children.items():
            p = probability * child.count / total
            if p >= min_prob:
                heapq.heappush(frontier, (-p, order, index, child, token))
                order += 1

    push_children(cursor[match_len], 1.0, -1)
    confidences: list[float] = []  # along the likeliest path: count / (the parent's children's counts + 1)
    path_end, path_node = -1, cursor[match_len]  # the likeliest path's last node so far (-1: the match)
    while frontier and len(tokens) < budget:
        negative, _, parent, node, token = heapq.heappop(frontier)
        if parent == path_end:  # the likeliest path goes on
            confidences.append(node.count / (sum(c.count for c in path_node.children.values()) + 1))
            path_end, path_node = len(tokens), node
        tokens.append(token)
        parents.append(parent)
        score -= negative
        push_children(node, -negative, len(tokens) - 1)
    if not tokens:
        return SuffixDraft(NO_DRAFT, 0.0)
    chain = all(p == i - 1 for i, p in enumerate(parents))
    # What the controller is told: how often each step of the likeliest path was taken, shrunk by one unseen
    # alternative (one observation says 1/2, not certainty).
    draft = Draft(torch.tensor(tokens, dtype=torch.long),
                  None if chain else torch.tensor(parents, dtype=torch.long),
                  confidence=sum(confidences) / len(confidences))
    return SuffixDraft(draft, score)


@dataclass
class _RequestState:
    local: SuffixTree
    local_cursor: list[_Node]
    adapter: str
    num_seen: int = 0  # tokens of the request added to its own tree (and followed in the global one)
    global_cursor: list[_Node] = field(default_factory=list)
    global_tree: SuffixTree | None = None  # the tree `global_cursor` is in
    global_version: int = -1


class GlobalSuffixCache:
    """One suffix tree per adapter over the outputs of recent finished requests, `cache_tokens` tokens in all;
    the oldest output leaves first."""

    def __init__(self, cache_tokens: int = DEFAULT_CACHE_TOKENS, depth: int = DEFAULT_DEPTH) -> None:
        self.cache_tokens = cache_tokens
        self.depth = depth
        self.trees: dict[str, SuffixTree] = {}
        self._outputs: deque[tuple[str, tuple[int, ...]]] = deque()
        self.num_tokens = 0

    def tree(self, adapter: str) -> SuffixTree:
        tree = self.trees.get(adapter)
        if tree is None:
            tree = self.trees[adapter] = SuffixTree(self.depth)
        return tree

    def add(self, adapter: str, output: Sequence[int]) -> None:
        output = tuple(output)[-self.cache_tokens :] if self.cache_tokens else ()
        if not output:
            return
        self.tree(adapter).add(output)
        self._outputs.append((adapter, output))
        self.num_tokens += len(output)
        while self.num_tokens > self.cache_tokens:
            old_adapter, old = self._outputs.popleft()
            self.trees[old_adapter].remove(old)
            self.num_tokens -= len(old)
            if not self.trees[old_adapter].root.children:
                del self.trees[old_adapter]

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self.trees.values())


class SuffixDrafter:
    """`--speculator suffix`: per request, the better of its own tree's draft and its adapter's global tree's
    (see the module docstring); a request with neither gets prompt lookup's draft (`fallback`), if any."""

    name = SUFFIX
    confident = True  # drafts carry a confidence (see `draft_from`)

    def __init__(self, fallback=None, cache_tokens: int = DEFAULT_CACHE_TOKENS, depth: int = DEFAULT_DEPTH,
                 factor: float = 1.0, offset: float = 0.0, min_token_prob: float = 0.1,
                 backend: str = "auto") -> None:
        self.fallback = fallback
        self.depth = depth
        self.factor, self.offset, self.min_token_prob = factor, offset, min_token_prob
        self.backend = resolve_backend(backend)
        self.native = self.backend == "native"
        if self.native:
            self.cache = suffix_native.NativeGlobalSuffixCache(cache_tokens, depth)
        else:
            self.cache = GlobalSuffixCache(cache_tokens, depth)
        self._requests: dict[int, _RequestState | suffix_native.NativeRequestState] = {}

    def method_for(self, request: RequestState) -> str:
        return self.name

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        drafts = [NO_DRAFT] * len(requests)
        for i, (r, k) in enumerate(zip(requests, max_tokens)):
            if k > 0:  # else not drafting this step: its trees catch up on the tokens when it next does
                drafts[i] = self._propose_native(r, k) if self.native else self._propose_python(r, k)
        # Requests neither tree drafts for get prompt lookup's draft, when it runs behind: one call for all.
        undrafted = [i for i, (d, k) in enumerate(zip(drafts, max_tokens)) if k > 0 and not len(d)]
        if undrafted and self.fallback is not None:
            proposed = self.fallback.propose([requests[i] for i in undrafted], [max_tokens[i] for i in undrafted])
            for i, draft in zip(undrafted, proposed):
                drafts[i] = draft
        return drafts

    def _propose_python(self, r: RequestState, k: int) -> Draft:
        """The better of the request's own tree's draft and its adapter's tree's, on the Python trees."""
        state = self._sync(r)
        local = draft_from(state.local_cursor, k, self.factor, self.offset, self.min_token_prob, self.depth)
        remote = draft_from(state.global_cursor, k, self.factor, self.offset, self.min_token_prob, self.depth)
        return max(local, remote, key=lambda d: d.score).draft

    def _propose_native(self, r: RequestState, k: int) -> Draft:
        """The same on Arctic Inference's trees (`suffix_native`)."""
        state = self._requests.get(r.id)
        if state is None:
            state = self._requests[r.id] = suffix_native.NativeRequestState(
                suffix_native.NativeSuffixTree(self.depth), r.spec.adapter_id)
        context = suffix_native.sync(state, r.history, self.depth)
        args = (self.factor, self.offset, self.min_token_prob, True)
        local = state.local.speculate(context, k, *args)
        tree = self.cache.trees.get(state.adapter)
        remote = tree.speculate(context, k, *args) if tree is not None else None
        best = suffix_native.best_draft(local, remote, MIN_MATCH)
        return NO_DRAFT if best is None else suffix_native.to_draft(best)

    def _sync(self, r: RequestState) -> _RequestState:
        """The request's state, with the tokens it gained since the last step added to its own tree and
        followed in its adapter's global tree."""
        state = self._requests.get(r.id)
        if state is None:
            local = SuffixTree(self.depth)
            state = self._requests[r.id] = _RequestState(local, [local.root], r.spec.adapter_id)
        history = r.history
        new = history[state.num_seen :].tolist()
        for token in new:
            state.local_cursor = state.local.extend(state.local_cursor, token)
        state.num_seen = history.numel()
        tree = self.cache.trees.get(state.adapter)
        if tree is None:
            state.global_cursor, state.global_tree = [], None
        elif tree is not state.global_tree or tree.version != state.global_version:  # new, or nodes removed
            state.global_cursor = tree.match(history[-self.depth :].tolist())
            state.global_tree, state.global_version = tree, tree.version
        else:
            for token in new:
                state.global_cursor = follow(state.global_cursor, token, self.depth)
        return state

    def release(self, request: RequestState) -> None:
        """The request left the worker: its own tree goes; a request that finished adds its output to its
        adapter's global tree, led in by the last `depth` tokens of its prompt.

        The lead-in is what lets a request that ends its prompt as an earlier one did (a retry, a regeneration
        after feedback) draft that answer from its first decode step: with the output alone, the first tokens
        of the answer must be generated one step at a time before the suffix matches anything, and a match of
        m tokens earns m drafts at most (`factor * match_len`), so the drafts grow over several steps."""
        self._requests.pop(request.id, None)
        if request.is_finished and request.num_tokens > request.prompt_len:
            start = max(request.prompt_len - self.depth, 0)
            self.cache.add(request.spec.adapter_id, request.token_ids[start : request.num_tokens].tolist())


def resolve_backend(backend: str = "auto") -> str:
    """"native" (Arctic Inference's C++ trees, `suffix_native`) or "python" (the trees above). "auto": the
    `SPECULA_SUFFIX_BACKEND` environment variable if set, else native where arctic-inference is installed."""
    if backend == "auto":
        backend = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"suffix decoding backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "auto":
        return "native" if suffix_native.AVAILABLE else "python"
    if backend == "native" and not suffix_native.AVAILABLE:
        raise ImportError("the native suffix trees need arctic-inference: pip install nanobind==2.9.2 cmake ninja "
                          "&& pip install --no-build-isolation --no-deps arctic-inference==0.3.0")
    return backend
