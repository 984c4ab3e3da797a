"""Suffix decoding's trees in C++: Arctic Inference's suffix tree (`arctic_inference.suffix_decoding._C`).

The same drafter as `suffix.py` (a tree per request over its prompt and output, a tree per adapter over the
outputs of recent finished requests, `cache_tokens` output tokens in all, oldest out; the better of the two
drafts), with the trees kept by Snowflake's implementation of the method instead of Python objects: a
path-compressed suffix tree whose children are kept sorted by count, so appending a token and drafting cost
far less than on the Python trees (docs/benchmarks.md#suffix-decoding).

Arctic's own `SuffixDecodingCache` is not used, only its tree (`SuffixTree`, which that class wraps): the
cache adds a request's output to the shared tree while the request runs (so a request later cancelled or
preempted would have drafted for others), keeps one shared tree for all requests (no adapter separation) and
bounds it by a number of requests, not tokens. Here a finished request's output enters its adapter's tree
when it leaves, as in the Python drafter, and the token budget evicts oldest outputs first.

What differs from the Python trees (both are the method; neither draft is wrong, verification keeps the
output exact whatever is drafted):

- Probabilities are a child's count over its node's count, and a node's count includes the occurrences that
  end there (the context's own end in a request's tree, an output's end or the depth limit in an adapter's
  tree); the Python trees divide by the children's counts. In a request's own tree the two agree (the
  context's end is the one extra occurrence both count); in an adapter's tree a continuation seen once has
  probability 1 here and the Python drafter's confidence says 1/2.
- The match drafted from is the one whose draft scores highest over all match lengths (ties: the longer),
  not the longest one that leaves room; matches shorter than `MIN_MATCH` tokens are still not drafted from.
- Equal path probabilities may be drafted in another order.
- Nodes are not counted (path compression makes the count meaningless to compare): `num_nodes` is 0.

Deterministic in the order of the calls, as the Python trees: tensor-parallel ranks draft the same trees.

Build: `pip install nanobind==2.9.2 cmake ninja` then `pip install --no-build-isolation --no-deps
arctic-inference==0.3.0` (an sdist: a build in an isolated environment would install an unpinned torch).
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula_server.speculation.drafters import Draft

try:  # the tree alone: importing arctic_inference.suffix_decoding needs numpy besides, and nothing else
    from arctic_inference.suffix_decoding._C import SuffixTree as NativeSuffixTree
except ImportError:  # not installed: the Python trees serve
    NativeSuffixTree = None

AVAILABLE = NativeSuffixTree is not None
_SEQ_MASK = 0x7FFFFFFF  # sequence ids are non-negative int32


class NativeGlobalSuffixCache:
    """One native suffix tree per adapter over the outputs of recent finished requests, `cache_tokens` tokens
    in all; the oldest output leaves first (as `suffix.GlobalSuffixCache`)."""

    def __init__(self, cache_tokens: int, depth: int) -> None:
        self.cache_tokens = cache_tokens
        self.depth = depth
        self.trees: dict[str, NativeSuffixTree] = {}
        self._outputs: deque[tuple[str, int, int]] = deque()  # (adapter, sequence id, tokens), oldest first
        self._next_id = 0
        self.num_tokens = 0
        self.num_nodes = 0  # not counted natively (see the module docstring)

    def tree(self, adapter: str):
        tree = self.trees.get(adapter)
        if tree is None:
            tree = self.trees[adapter] = NativeSuffixTree(self.depth)
        return tree

    def add(self, adapter: str, output: Sequence[int]) -> None:
        output = list(output)[-self.cache_tokens :] if self.cache_tokens else []
        if not output:
            return
        # Ids cycle through 2^31; a cached output keeps its id until it leaves, long before the ids come round
        # (each holds at least one token of the budget).
        seq_id, self._next_id = self._next_id, (self._next_id + 1) & _SEQ_MASK
        self.tree(adapter).extend(seq_id, output)
        self._outputs.append((adapter, seq_id, len(output)))
        self.num_tokens += len(output)
        while self.num_tokens > self.cache_tokens:
            old_adapter, old_id, length = self._outputs.popleft()
            tree = self.trees[old_adapter]
            tree.remove(old_id)
            self.num_tokens -= length
            if not tree.num_seqs():
                del self.trees[old_adapter]


@dataclass
class NativeRequestState:
    local: object  # NativeSuffixTree over the request's history (sequence 0)
    adapter: str
    num_seen: int = 0  # tokens of the request added to its own tree
    tail: list[int] | None = None  # its last `depth` tokens: the context matched


def sync(state: NativeRequestState, history: torch.Tensor, depth: int) -> list[int]:
    """Adds the tokens the request gained since the last step to its own tree; returns its last `depth`
    tokens."""
    new = history[state.num_seen :].tolist()
    if new:
        state.local.extend(0, new)
        state.tail = (state.tail + new)[-depth:] if state.tail else new[-depth:]
    state.num_seen = history.numel()
    return state.tail or []


def best_draft(local, remote, min_match: int):
    """The better scoring of the two native drafts (the request's own on ties, as `max` in the Python
    drafter), a draft from a match shorter than `min_match` counting as none; None when neither drafts."""
    candidates = [d for d in (local, remote) if d is not None and d.match_len >= min_match and d.token_ids]
    if not candidates:
        return None
    return candidates[0] if len(candidates) == 1 or candidates[0].score >= candidates[1].score else candidates[1]


def to_draft(native) -> Draft:
    """A `Draft` of a native draft (nodes parents-first, as the native tree returns them). The confidence is
    the Python drafter's: the mean, along the likeliest path, of each step's probability given the one before
    (here count / node count, see the module docstring)."""
    tokens, parents, probs = native.token_ids, native.parents, native.probs
    confidences = []
    path_end, path_prob = -1, 1.0
    for i, parent in enumerate(parents):  # popped best-first: a path's first child popped is its likeliest
        if parent == path_end:
            confidences.append(probs[i] / path_prob)
            path_end, path_prob = i, probs[i]
    chain = all(p == i - 1 for i, p in enumerate(parents))
    return Draft(_long_tensor(tokens), None if chain else _long_tensor(parents),
                 confidence=sum(confidences) / len(confidences))


def _long_tensor(values: list[int]) -> torch.Tensor:
    """A long tensor of a non-empty list, over an array's buffer (cheaper than `torch.tensor` for a short list,
    which this is at every request's every drafting step)."""
    return torch.frombuffer(array("q", values), dtype=torch.long)
