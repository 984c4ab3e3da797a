"""EAGLE-3 drafting in the decode step: the draft layer over its own paged KV, fed by the target's hidden states.

The draft layer's KV lives in the worker beside the target's, in as many blocks of the same size, addressed by
the same slots (`RequestState.slots`), like a draft model's: the router's block allocation covers both. Slot p
holds the draft entry for the pair (token p + 1, the target's auxiliary hidden state at position p), at rotary
position p; that entry's logits guess token p + 2. (The pair is how EAGLE-3 is trained: `speculators` aligns
x_(i+1) with g_i; rotary attention depends only on position differences, so the offset is free.)

Per request, `RequestState.draft_cached` counts the slots (from 0) whose entries were computed from the
target's own hidden states, and `RequestState.eagle_aux` keeps the target's auxiliary rows for positions
`draft_cached ..` that the draft layer has not run over yet (the generator appends them after every forward:
a prompt's rows, a plain step's row, a verification's accepted rows). With N tokens, a step that drafts k:

    catch up   one forward over slots draft_cached .. N - 2, all requests together (tokens draft_cached + 1
               .. N - 1 with their rows); the last row's logits give d_1, over the draft vocabulary, mapped to
               the target's by d2t; draft_cached becomes N - 1
    chain      slot N - 2 + j takes d_j and the draft's own output state at slot N - 3 + j, and gives d_(j+1):
               k - 1 one-token forwards, requests batched, each dropping out once it has its k

Steps that draft nothing (the controller backing off, a request below its bar) only keep rows; past
`MAX_KEPT_ROWS` the draft layer runs over all but the last of them at the end of the step, so what a request
keeps stays bounded. A request that turned speculation off keeps none.

Idle requests. Rows that only decode steps kept pile up past `IDLE_ROWS` when a request has not drafted for that
many steps: its drafts did not pay (the controller backed off, or its estimate stayed below the bar). Running
the draft layer over them would cost a layer and the fusion of its inputs for every token the request decodes
while drafting is off (3.8% of the worker's time on the real model at 32 streams, nothing drafted), so they are dropped
instead, all but the last: their draft entries are zeroed and marked cached. When drafting resumes, the draft
layer attends over zeros there (a key of zeros, a value of zeros): drafts see less context and may be accepted
less often; output is unchanged. A prompt's rows are run over (the draft layer needs the prompt most) unless,
when the request's rows pass `MAX_KEPT_ROWS`, the controller could not grant it drafts at that load (its
acceptance estimate below the bar of the batch's size): then they are dropped as an idle request's are.

The chain's entries (slots N - 1 ..) are never marked cached: after verification the next catch-up rewrites
them from the target's states for the tokens it accepted. Drafts are the draft layer's argmax for every
request (with a tree width W > 1, trees by top-W expansion, `_expand`; leaves-only trees, `best_nodes`, when a
step would need more scratch slots than there are), so they are deterministic and
verification is exact for greedy and sampled requests alike (`verify.py`: a sampled request keeps drafts while
they equal the tokens it samples). Each chain token carries the draft layer's probability of it
(`Draft.confidences`), by which the adaptive controller prices it (`Speculator._draft_rated`).

A prompt that reused cached KV blocks (prefix caching) has no target rows for that prefix: its draft entries
there are read as the request that computed those blocks left them (the same tokens and model, when it had
drafted that far); acceptance may be lower, output is unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from types import SimpleNamespace

import torch

from specula_server.batch import build_step
from specula_server.kv_cache import KVCache
from specula_server.request import RequestState
from specula_server.speculation.drafters import Draft
from specula_server.speculation.eagle3 import Eagle3Model

logger = logging.getLogger("specula.speculation")

SCRATCH_SLOTS = 4096  # draft KV slots for expanded tree nodes (a step needing more drafts leaves-only trees)
MAX_KEPT_ROWS = 64  # a request's target rows kept between drafts before the draft layer runs over them anyway
IDLE_ROWS = 64  # rows kept by decode steps alone past which a request is idle: they are dropped, not run over


class Eagle3Drafter:
    """Drafts chains with an EAGLE-3 draft layer (see the module docstring).

    `propose` only says how many tokens each request could draft (`Draft.pending`); once the controller has
    chosen, the generator has `draft` produce exactly those, after `keep_aux` gave it the target's states.
    """

    name = "eagle3"

    def __init__(self, model: Eagle3Model, device: torch.device, model_name: str = "EAGLE-3 speculator",
                 tree_width: int = 1) -> None:
        if tree_width < 1:
            raise ValueError(f"the draft tree width must be at least 1, got {tree_width}")
        self.model = model
        self.tree_width = tree_width
        # Chains carry the draft layer's probability of each token (`Draft.confidences`): the controller drafts
        # first and verifies the tokens those probabilities make worth it (speculator.py, `_draft_rated`).
        self.confident = tree_width == 1
        self.device = device
        self.model_name = model_name
        self.dtype = model.dtype
        self.kv_cache: KVCache | None = None

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """The target layers whose hidden states the draft layer reads (after that many layers; 0: embeddings)."""
        return self.model.layer_ids

    # --- KV cache (sized and allocated by the generator, beside the target's) -----------------------------

    def bytes_per_block(self, block_size: int) -> int:
        cfg = self.model.spec.layer
        return KVCache.bytes_per_block(cfg.num_layers, self.model.num_kv_heads, cfg.head_dim, block_size, self.dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """The blocks the router hands out, and, for trees, `SCRATCH_SLOTS` more past them for the entries of
        expanded tree nodes (several per position, so not in any request's blocks)."""
        self.kv_cache = None
        cfg = self.model.spec.layer
        scratch_blocks = -(-SCRATCH_SLOTS // block_size) if self.tree_width > 1 else 0
        self.kv_cache = KVCache.allocate(num_blocks + scratch_blocks, block_size, cfg.num_layers,
                                         self.model.num_kv_heads, cfg.head_dim, self.dtype, self.device)
        self.scratch = torch.arange(num_blocks * block_size, (num_blocks + scratch_blocks) * block_size,
                                    device=self.device)

    def release_kv_cache(self) -> None:
        self.kv_cache = None

    # --- the target's states --------------------------------------------------------------------------------

    def keep_aux(self, r: RequestState, aux: torch.Tensor, first_position: int) -> None:
        """Keeps the target's auxiliary rows `aux [n, A * target_hidden]` of positions `first_position ..`
        (none for a request that turned speculation off).

        They continue the rows kept so far; a prompt that starts past position 0 (a reused prefix) or a gap
        (which the generator never leaves) restarts them there, over the draft entries already in the blocks.
        """
        if r.spec.speculative_tokens == 0:
            return
        if first_position != r.draft_cached + r.eagle_kept:
            r.eagle_aux.clear()
            r.eagle_kept = 0
            r.draft_cached = first_position
        r.eagle_aux.append(aux)
        r.eagle_kept += aux.shape[0]

    # --- the Drafter interface ------------------------------------------------------------------------------

    def method_for(self, request: RequestState) -> str:
        return self.name

    def propose(self, requests: Sequence[RequestState], max_tokens: Sequence[int]) -> list[Draft]:
        """Pending drafts: up to the cap, within the draft layer's positions (the chain's last entry sits at
        position n + k - 3) and for requests whose rows reach their last token."""
        limit = self.model.spec.layer.max_position_embeddings
        empty = torch.empty(0, dtype=torch.long)
        drafts = []
        for r, k in zip(requests, max_tokens):
            ready = r.draft_cached + r.eagle_kept >= r.num_tokens - 1
            drafts.append(Draft(empty, pending=max(0, min(k, limit - r.num_tokens + 2)) if ready else 0))
        return drafts

    @torch.inference_mode()
    def draft(self, requests: Sequence[RequestState], lengths: Sequence[int],
              extend: Callable[[int, Sequence[float]], bool] | None = None) -> list[Draft]:
        """`lengths[i] >= 1` draft tokens for request i (see the module docstring), written into each request's
        token buffer past its tokens, where verification reads them. A chain carries the draft layer's
        probability of each of its tokens (`Draft.confidences`), and stops before `lengths[i]` where
        `extend(i, its probabilities so far)` says another token is not worth drafting."""
        assert self.kv_cache is not None, "the EAGLE-3 speculator's KV cache is not allocated"
        assert all(k >= 1 for k in lengths)
        model, kv = self.model, self.kv_cache.layers
        n0 = [r.num_tokens for r in requests]
        logits, state = self._catch_up(requests, [n - 1 - r.draft_cached for r, n in zip(requests, n0)])
        if self.tree_width > 1 and len(requests) * self.tree_width * (max(lengths) - 1) <= len(self.scratch):
            return self._expand(requests, lengths, logits, state)
        drafted: list[list[int]] = [[] for _ in requests]
        confidences: list[list[float]] = [[] for _ in requests]
        levels: list[list[tuple[list[float], list[int]]]] = [[] for _ in requests]  # tree: each depth's top-w
        active = list(range(len(requests)))  # the requests whose next draft `logits` rows (in order) give
        for j in range(max(lengths)):
            if self.tree_width > 1:
                top = torch.log_softmax(logits, dim=-1).topk(min(self.tree_width, logits.shape[-1]), dim=-1)
                ids = model.to_target(top.indices)  # [len(active), w] target token ids, best first
                for i, values, row in zip(active, top.values.tolist(), ids.tolist()):
                    levels[i].append((values, row))
                chosen = ids[:, 0]
            else:
                best = logits.argmax(dim=-1)
                chosen = model.to_target(best)  # [len(active)] target token ids
                # Each token's probability by one softmax (a quarter of logsumexp's time on this CPU).
                probability = logits.float().softmax(dim=-1).gather(-1, best[:, None])[:, 0]
                for i, p in zip(active, probability.tolist()):
                    confidences[i].append(p)
            for i, token in zip(active, chosen.tolist()):
                requests[i].token_ids[n0[i] + j] = token  # the buffer tail past num_tokens is free: drafts go there
                drafted[i].append(token)
            still = [a for a, i in enumerate(active)
                     if lengths[i] > j + 1 and (extend is None or self.tree_width > 1 or extend(i, confidences[i]))]
            if not still:
                break
            active = [active[a] for a in still]
            rows = torch.tensor(still, device=self.device)
            step = build_step([requests[i] for i in active], [n0[i] - 1 + j for i in active], [1] * len(active),
                              self.device)
            logits, state = model(chosen[rows], state[rows], step.positions, kv, step.attn)
        if self.tree_width > 1:
            return [best_nodes(level, k) for level, k in zip(levels, lengths)]
        return [Draft(torch.tensor(t, dtype=torch.long), confidences=tuple(c)) for t, c in zip(drafted, confidences)]

    def _expand(self, requests: Sequence[RequestState], lengths: Sequence[int], logits: torch.Tensor,
                state: torch.Tensor) -> list[Draft]:
        """Trees by top-W expansion (SGLang's): at each depth every request's W best nodes so far run the draft
        layer (their entries in scratch slots, seeing the context and their own ancestors), each offers its
        top-W tokens as children, and of all nodes made the `lengths[i]` best by path log-probability are
        verified, parents first (a child never scores above its parent; ties go to the shallower)."""
        model, w = self.model, self.tree_width
        n0 = [r.num_tokens for r in requests]
        # Every node made: (score, depth, request, token, parent node); the frontier: nodes to run, with the
        # state their entry reads and their ancestors' scratch slots.
        nodes: list[tuple[float, int, int, int, int]] = []
        frontier = [(-1, i, state[i], []) for i in range(len(requests))]  # the roots: the catch-up's last rows
        rows_logits, used = logits, 0
        for depth in range(1, max(lengths) + 1):
            top = torch.log_softmax(rows_logits, dim=-1).topk(min(w, rows_logits.shape[-1]), dim=-1)
            ids = model.to_target(top.indices).tolist()
            offered: dict[int, list[tuple[float, int, int, int]]] = {}  # request -> (score, token, parent, row)
            for row, ((parent, i, _, _), values, tokens) in enumerate(zip(frontier, top.values.tolist(), ids)):
                base = nodes[parent][0] if parent >= 0 else 0.0
                offered.setdefault(i, []).extend((base + v, t, parent, row) for v, t in zip(values, tokens))
            next_frontier = []
            for i, candidates in offered.items():
                candidates.sort(key=lambda c: -c[0])
                for rank, (score, token, parent, row) in enumerate(candidates):
                    nodes.append((score, depth, i, token, parent))
                    if rank < w and depth < lengths[i]:  # the best W go deeper, reading their parent's state
                        _, _, parent_state, path = frontier[row]
                        next_frontier.append((len(nodes) - 1, i, parent_state, path))
            if not next_frontier:
                break
            # Each runs at position n - 2 + depth in a scratch slot of its own, seeing the context and its path.
            slots = self.scratch[used : used + len(next_frontier)]
            used += len(next_frontier)
            views = [SimpleNamespace(token_ids=requests[i].token_ids,
                                     slots=torch.cat([requests[i].slots[: n0[i] - 1], *path, slot[None]]))
                     for (_, i, _, path), slot in zip(next_frontier, slots)]
            starts = [n0[i] - 2 + depth for _, i, _, _ in next_frontier]
            step = build_step(views, starts, [1] * len(views), self.device)
            tokens = torch.tensor([nodes[node][3] for node, *_ in next_frontier], device=self.device)
            states = torch.stack([st for _, _, st, _ in next_frontier])
            rows_logits, out_state = model(tokens, states, step.positions, self.kv_cache.layers, step.attn)
            frontier = [(node, i, out_state[j], path + [slot[None]])
                        for j, ((node, i, _, path), slot) in enumerate(zip(next_frontier, slots))]
        return [_best_of(nodes, i, k) for i, k in enumerate(lengths)]

    def _catch_up(self, requests: Sequence[RequestState], counts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Runs the draft layer over the next `counts[i] >= 1` slots from `draft_cached` of each request, with
        their kept rows (then dropped); returns the logits and output state of each request's last slot."""
        model = self.model
        starts = [r.draft_cached for r in requests]
        step = build_step(requests, starts, counts, self.device)
        tokens = torch.cat([r.token_ids[s + 1 : s + 1 + c] for r, s, c in zip(requests, starts, counts)])
        aux = [torch.cat(r.eagle_aux) for r in requests]
        logits, state = model(tokens.to(self.device), model.combine(torch.cat([a[:c] for a, c in zip(aux, counts)])),
                              step.positions, self.kv_cache.layers, step.attn, rows=step.last_rows)
        for r, a, s, c in zip(requests, aux, starts, counts):
            r.eagle_aux[:] = [a[c:]] if a.shape[0] > c else []
            r.eagle_kept = a.shape[0] - c
            r.draft_cached = s + c
        return logits, state

    @torch.inference_mode()
    def bound_kept_rows(self, requests: Sequence[RequestState],
                        could_draft: Callable[[Sequence[RequestState]], list[bool]] | None = None) -> None:
        """Bounds the rows each request keeps while it does not draft (a backing-off controller, a bar it never
        clears): an idle request's rows (decode steps' alone, more than `IDLE_ROWS`) are dropped (`_skip`), another
        request's are run over by the draft layer once more than `MAX_KEPT_ROWS`, unless the controller could not
        grant it drafts at this load (`could_draft(those requests)` false for it, `Speculator.could_draft`): then
        they are dropped too, prompt rows included. Both keep the last row, whose entry the next draft starts from.
        What a request keeps stays bounded, and so does its next catch-up."""
        if self.kv_cache is None:
            return
        def is_idle(r: RequestState) -> bool:  # after the prompt's catch-up every kept row is a decode step's
            return r.eagle_kept > IDLE_ROWS and r.draft_cached >= r.prompt_len - 1

        idle = [r for r in requests if is_idle(r)]
        over = [r for r in requests if r.eagle_kept > MAX_KEPT_ROWS and not is_idle(r)]
        could = could_draft(over) if over and could_draft is not None else [True] * len(over)
        run_over = [r for r, c in zip(over, could) if c]
        dropped = idle + [r for r, c in zip(over, could) if not c]
        if run_over:
            self._catch_up(run_over, [r.eagle_kept - 1 for r in run_over])
        if dropped:
            self._skip(dropped, [r.eagle_kept - 1 for r in dropped])

    def _skip(self, requests: Sequence[RequestState], counts: Sequence[int]) -> None:
        """Drops all but the last kept row of each request (`counts[i]` rows) without running the draft layer over
        them: their slots' draft entries become zeros (whatever they held: an earlier chain's entries, another
        request's)."""
        slots = torch.cat([r.slots[r.draft_cached : r.draft_cached + c] for r, c in zip(requests, counts)])
        slots = slots.to(self.device)
        for keys, values in self.kv_cache.layers:
            keys.index_fill_(0, slots, 0)
            values.index_fill_(0, slots, 0)
        for r, c in zip(requests, counts):
            r.eagle_aux[:] = [r.eagle_aux[-1][-1:]]
            r.eagle_kept = 1
            r.draft_cached += c


def best_nodes(levels: Sequence[tuple[Sequence[float], Sequence[int]]], budget: int) -> Draft:
    """The `budget` best nodes of the chain of top-1 tokens with, at each depth, the other top-w tokens as
    leaves beside it (`levels[d]`: the log-probabilities and target tokens of depth d + 1, best first), scored by
    the sum of the log-probabilities along their path; parents come before their children (a parent scores at
    least as high; ties go to the shallower). A chain when the leaves lose.

    >>> best_nodes([([-0.1, -2.5], [7, 9]), ([-0.2, -1.0], [8, 4])], 3).tokens.tolist()   # 7, 7-8, 7-4
    [7, 8, 4]
    """
    nodes = []  # (score, depth, rank, token, parent node or -1)
    path = 0.0
    for depth, (values, tokens) in enumerate(levels):
        parent = -1 if depth == 0 else (depth - 1) * len(values)  # the chain node of the depth above
        for rank, (value, token) in enumerate(zip(values, tokens)):
            nodes.append((path + value, depth, rank, token, parent))
        path += values[0]
    order = sorted(range(len(nodes)), key=lambda n: (-nodes[n][0], nodes[n][1], nodes[n][2]))[:budget]
    position = {n: p for p, n in enumerate(order)}
    tokens = torch.tensor([nodes[n][3] for n in order], dtype=torch.long)
    parents = [position[nodes[n][4]] if nodes[n][4] >= 0 else -1 for n in order]
    if parents == list(range(-1, len(order) - 1)):
        return Draft(tokens)
    return Draft(tokens, torch.tensor(parents, dtype=torch.long))


def _best_of(nodes: Sequence[tuple[float, int, int, int, int]], request: int, budget: int) -> Draft:
    """Request `request`'s `budget` best nodes of `nodes` (score, depth, request, token, parent), parents first."""
    mine = sorted((n for n in range(len(nodes)) if nodes[n][2] == request),
                  key=lambda n: (-nodes[n][0], nodes[n][1], n))[:budget]
    position = {n: p for p, n in enumerate(mine)}
    parents = [position[nodes[n][4]] if nodes[n][4] >= 0 else -1 for n in mine]
    tokens = torch.tensor([nodes[n][3] for n in mine], dtype=torch.long)
    if parents == list(range(-1, len(mine) - 1)):
        return Draft(tokens)
    return Draft(tokens, torch.tensor(parents, dtype=torch.long))
