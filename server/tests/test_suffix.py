"""Suffix trees and the suffix drafter, against brute force over the same token sequences."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from specula_server.speculation import suffix_native
from specula_server.speculation.drafters import PromptLookupDrafter
from specula_server.speculation.suffix import (
    MIN_MATCH,
    GlobalSuffixCache,
    SuffixDrafter,
    SuffixTree,
    draft_from,
    follow,
    resolve_backend,
)

needs_native = pytest.mark.skipif(not suffix_native.AVAILABLE, reason="arctic-inference is not installed")
BACKENDS = ["python", pytest.param("native", marks=needs_native)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def substring_counts(sequences, depth):
    counts = Counter()
    for seq in sequences:
        for i in range(len(seq)):
            for j in range(i + 1, min(len(seq), i + depth) + 1):
                counts[tuple(seq[i:j])] += 1
    return counts


def tree_counts(tree: SuffixTree):
    counts, stack = {}, [((), tree.root)]
    while stack:
        prefix, node = stack.pop()
        for token, child in node.children.items():
            counts[prefix + (token,)] = child.count
            stack.append((prefix + (token,), child))
    return counts


def test_a_tree_counts_every_string_up_to_its_depth_and_forgets_what_is_removed():
    rng = random.Random(0)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    tree = SuffixTree(depth=6)
    for seq in sequences:
        tree.add(seq)
    assert tree_counts(tree) == substring_counts(sequences, 6)
    assert tree.num_nodes == len(substring_counts(sequences, 6))
    for seq in sequences[:4]:
        tree.remove(seq)
    assert tree_counts(tree) == substring_counts(sequences[4:], 6)
    assert tree.num_nodes == len(substring_counts(sequences[4:], 6))


def test_cursors_follow_a_growing_sequence_and_match_finds_the_same_nodes():
    rng = random.Random(1)
    stored = [rng.randrange(4) for _ in range(200)]
    tree = SuffixTree(depth=8)
    tree.add(stored)
    context = [rng.randrange(4) for _ in range(30)]
    cursor = tree.match(context[:1])
    for i in range(1, len(context)):
        cursor = follow(cursor, context[i], tree.depth)
        expected = tree.match(context[: i + 1])
        assert [id(n) for n in cursor] == [id(n) for n in expected]
        # the longest suffix that occurs, as brute force finds it
        suffix = context[: i + 1]
        longest = max(k for k in range(0, min(8, len(suffix)) + 1)
                      if k == 0 or any(stored[j:j + k] == suffix[-k:] for j in range(len(stored))))
        assert len(cursor) - 1 == longest


def test_drafts_are_the_likeliest_continuations_best_first():
    tree = SuffixTree(depth=8)
    # "1 2 3" was followed by "4 5" twice and by "9" once
    for seq in ([1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9]):
        tree.add(seq)
    cursor = tree.match([7, 1, 2, 3])
    assert len(cursor) - 1 == 3
    best = draft_from(cursor, max_tokens=5, factor=1.0, offset=0.0, min_prob=0.1, depth=8)
    assert best.draft.tokens.tolist() == [4, 5, 9]  # 4 (2/3), then 5 (2/3 * 1), then 9 (1/3)
    assert best.draft.node_parents() == [-1, 0, -1]
    assert abs(best.score - (2 / 3 + 2 / 3 + 1 / 3)) < 1e-9
    # the length budget grows with the match: factor * match_len + offset
    # a match too deep to leave room for the draft is passed over for a shorter one
    deep = SuffixTree(depth=4)
    deep.add([1, 2, 3, 4, 9, 1, 2, 3, 4])
    cursor4 = deep.match([1, 2, 3, 4])
    assert len(cursor4) - 1 == 4 and not cursor4[4].children  # the full match cannot be followed
    assert draft_from(cursor4, 2, 1.0, 0.0, 0.1, depth=4).draft.tokens.tolist() == [9, 1]
    assert len(draft_from(cursor, 5, factor=0.5, offset=0.0, min_prob=0.1, depth=8).draft) == 1
    # unlikely branches are not drafted
    assert draft_from(cursor, 5, 1.0, 0.0, min_prob=0.5, depth=8).draft.tokens.tolist() == [4, 5]
    # a chain stays a chain (no parents tensor)
    assert draft_from(cursor, 5, 1.0, 0.0, min_prob=0.5, depth=8).draft.is_chain


def test_the_global_cache_stays_within_its_token_budget_oldest_out():
    cache = GlobalSuffixCache(cache_tokens=50, depth=4)
    rng = random.Random(2)
    outputs = [[rng.randrange(50) for _ in range(20)] for _ in range(10)]
    for output in outputs:
        cache.add("", output)
        assert cache.num_tokens <= 50
    # the last two outputs (40 tokens) remain; older ones were evicted
    assert tree_counts(cache.tree("")) == substring_counts(outputs[-2:], 4)


@dataclass
class FakeSpec:
    adapter_id: str = ""


@dataclass
class FakeRequest:
    """What the drafter reads of a request."""

    id: int
    tokens: list[int]
    prompt_len: int
    spec: FakeSpec = field(default_factory=FakeSpec)
    is_finished: bool = False

    @property
    def history(self):
        return torch.tensor(self.tokens)

    @property
    def token_ids(self):
        return torch.tensor(self.tokens)

    @property
    def num_tokens(self):
        return len(self.tokens)


def test_outputs_of_one_adapter_never_draft_for_another(backend):
    drafter = SuffixDrafter(depth=8, backend=backend)
    answer = [11, 12, 13, 14, 15, 16, 17, 18]
    done = FakeRequest(0, [1, 2, 3] + answer, prompt_len=3, spec=FakeSpec("a"), is_finished=True)
    drafter.propose([done], [0])
    drafter.release(done)
    same = FakeRequest(1, [5, 11, 12, 13], prompt_len=4, spec=FakeSpec("a"))
    other = FakeRequest(2, [5, 11, 12, 13], prompt_len=4, spec=FakeSpec("b"))
    base = FakeRequest(3, [5, 11, 12, 13], prompt_len=4)
    drafts = drafter.propose([same, other, base], [4, 4, 4])
    assert drafts[0].tokens.tolist() == [14, 15, 16]  # 3 tokens: the match is 3 long
    assert len(drafts[1]) == 0 and len(drafts[2]) == 0


def test_a_request_drafts_from_its_own_context_as_it_grows(backend):
    drafter = SuffixDrafter(depth=8, backend=backend)
    r = FakeRequest(0, [1, 2, 3, 4, 1, 2], prompt_len=6)
    assert drafter.propose([r], [4])[0].tokens.tolist() == [3, 4]
    r.tokens += [3]  # accepted tokens arrive between steps
    assert drafter.propose([r], [4])[0].tokens.tolist() == [4, 1, 2]
    drafter.release(r)  # not finished: nothing enters the global cache
    assert drafter.cache.num_tokens == 0 and not drafter._requests


def test_a_batch_drafts_as_each_request_alone_with_prompt_lookup_behind(backend):
    """Prompt lookup is asked once per step for the requests neither tree drafts for; each request still gets
    the draft it would alone."""
    def requests():
        return [FakeRequest(0, [1, 2, 3, 4, 1, 2], prompt_len=6),  # its own tree drafts [3, 4]
                FakeRequest(1, [7, 8, 9, 7], prompt_len=4),  # a 1-token match: prompt lookup's [8, 9, 7]
                FakeRequest(2, [5, 6], prompt_len=2),  # nothing to draft from
                FakeRequest(3, [1, 2, 3, 1, 2], prompt_len=5)]  # not drafting this step
    caps = [4, 3, 4, 0]
    batched = SuffixDrafter(fallback=PromptLookupDrafter(), depth=8, backend=backend)
    alone = SuffixDrafter(fallback=PromptLookupDrafter(), depth=8, backend=backend)
    drafts = batched.propose(requests(), caps)
    assert [d.tokens.tolist() for d in drafts] == [
        alone.propose([r], [k])[0].tokens.tolist() for r, k in zip(requests(), caps)]
    assert [d.tokens.tolist() for d in drafts] == [[3, 4], [8, 9, 7], [], []]


def test_a_long_run_of_distinct_requests_keeps_the_cache_bounded(backend):
    drafter = SuffixDrafter(cache_tokens=1_000, depth=8, backend=backend)
    rng = random.Random(3)
    for i in range(300):
        r = FakeRequest(i, [rng.randrange(1000) for _ in range(40)], prompt_len=10, is_finished=True)
        drafter.propose([r], [4])
        drafter.release(r)
    assert drafter.cache.num_tokens <= 1_000 and not drafter._requests
    assert drafter.cache.num_nodes <= 1_000 * 8
    if backend == "native":  # the native trees hold what the budget keeps: the last 26 outputs (30 tokens each,
        # after the last 8 of their prompt's 10)
        assert sum(t.num_seqs() for t in drafter.cache.trees.values()) == 26


def test_the_backend_is_native_where_arctic_is_installed_unless_told(monkeypatch):
    monkeypatch.delenv("SPECULA_SUFFIX_BACKEND", raising=False)
    assert resolve_backend() == ("native" if suffix_native.AVAILABLE else "python")
    assert resolve_backend("python") == "python"
    monkeypatch.setenv("SPECULA_SUFFIX_BACKEND", "python")
    assert resolve_backend() == "python" and SuffixDrafter().backend == "python"
    with pytest.raises(ValueError):
        resolve_backend("rust")
    if not suffix_native.AVAILABLE:
        with pytest.raises(ImportError):
            resolve_backend("native")


def occurs(needle, haystack):
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


def paths(draft):
    """Every node's token string from the draft's root down, parents first."""
    tokens, parents, out = draft.tokens.tolist(), draft.node_parents(), []
    for i, p in enumerate(parents):
        out.append((out[p] if p >= 0 else []) + [tokens[i]])
    return out


@needs_native
def test_native_and_python_trees_draft_the_same_on_unambiguous_sequences():
    cases = [  # (cached outputs, context, max tokens): the likeliest continuations are unique
        ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9]], [7, 1, 2, 3], 5),
        ([[1, 2, 3, 4, 5], [1, 2, 3, 4, 5], [1, 2, 3, 9]], [7, 1, 2, 3], 2),
        ([[10, 11, 12, 13, 14, 15, 16]], [8, 11, 12, 13], 4),
        ([[10, 11, 12, 13, 14, 15, 16], [20, 12, 13, 30, 31]], [8, 11, 12, 13], 4),
    ]
    # (Not with 6 tokens: the Python trees then pass over the 3-token match for a 2-token one, which leaves
    # `depth - 2` room below it, and draft 2 tokens; the native trees draft 3 from the longer match.)
    for outputs, context, k in cases:
        drafts = {}
        for backend in ("python", "native"):
            drafter = SuffixDrafter(depth=8, backend=backend)
            for i, output in enumerate(outputs):
                drafter.release(FakeRequest(100 + i, [0] + output, prompt_len=1, is_finished=True))
            drafts[backend] = drafter.propose([FakeRequest(0, context, prompt_len=len(context))], [k])[0]
        assert drafts["native"].tokens.tolist() == drafts["python"].tokens.tolist(), (outputs, context)
        assert drafts["native"].node_parents() == drafts["python"].node_parents()


@needs_native
def test_native_drafts_are_valid_continuations_and_deterministic():
    """On random text (many ties, where the two backends may order or choose differently), every native draft
    node continues a suffix of at least MIN_MATCH tokens of the context as the request itself or a cached output
    of its adapter did, within the length budget; two drafters fed the same steps draft the same (as
    tensor-parallel ranks must)."""
    rng = random.Random(4)
    a, b = SuffixDrafter(depth=8, backend="native"), SuffixDrafter(depth=8, backend="native")
    python = SuffixDrafter(depth=8, backend="python")
    cached = {"": [], "x": []}
    drafted = same = 0
    for i in range(40):
        adapter = rng.choice(["", "x"])
        tokens = [rng.randrange(6) for _ in range(rng.randrange(6, 30))]
        r = FakeRequest(i, tokens, prompt_len=len(tokens), spec=FakeSpec(adapter))
        for _ in range(12):
            k = rng.randrange(1, 7)
            da, db = a.propose([r], [k])[0], b.propose([r], [k])[0]
            dp = python.propose([r], [k])[0]
            assert da.tokens.tolist() == db.tokens.tolist() and da.node_parents() == db.node_parents()
            assert len(da) <= k
            if len(da):
                drafted += 1
                same += da.tokens.tolist() == dp.tokens.tolist() and da.node_parents() == dp.node_parents()
                assert 0 < da.confidence <= 1
                sources = [r.tokens] + cached[adapter]
                for path in paths(da):
                    assert any(occurs(r.tokens[-m:] + path, s) for s in sources for m in range(MIN_MATCH, 8)), path
            r.tokens.append(rng.randrange(6))
        r.is_finished = True
        for drafter in (a, b, python):
            drafter.release(r)
        cached[adapter].append(r.tokens[max(r.prompt_len - 8, 0):])  # the output after its prompt's last 8
    assert drafted > 100 and same > drafted // 2  # mostly alike (301 of 420 when written); else both valid
