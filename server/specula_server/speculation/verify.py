"""Exact acceptance of draft tokens, given the target model's logits at every verified position.

Request r verified `[last, d1 .. dk]` in one forward, so its logits rows j = 0..k hold the target's
distribution p_j of the token after `d1 .. dj`. For a tree of drafts the rows are the root (`last`) and then
the nodes, row 1 + i holding the distribution after the path to node i; acceptance walks down from the root,
following the child whose token the rule picks, and the chain is the tree with one child per node.
The rules (all exact):

- greedy: keep drafts while `d_(j+1) == argmax p_j`; the first mismatch (or the bonus after all k) is the target's
  own argmax. Output identical to decoding without drafts.
- sampling, deterministic drafts: draw `y_j ~ p_j` with the request's own generator, in order, keep going while
  `y_j == d_(j+1)`, stop at the first mismatch, which is emitted. Every emitted token is a draw from the target's
  distribution given everything before it, so the output distribution is exactly the model's. Draws are made
  lazily, one per emitted token, so a seed yields the same tokens whatever the draft lengths. In a tree the
  draw moves to the child holding the drawn token, if any (siblings are distinct tokens): still one draw from
  p per emitted token, so still exact.
- sampling, drafts sampled from a distribution q (a draft model's: `Draft.q`, chains only): speculative
  sampling (Leviathan et al. 2023, Chen et al. 2023). Draft x_(j+1) ~ q_j is accepted with probability
  min(1, p_j(x) / q_j(x)) (one uniform per draft from the request's generator); at the first rejection the
  emitted token is drawn from norm(max(0, p_j - q_j)), and after k acceptances the bonus from p_k. Each
  emitted token is then distributed exactly as p given everything before it. Greedy requests ignore q: the
  draft took its argmax and the greedy rule applies.

p_j is the sampler's processed distribution (logit bias, penalties, temperature, top-k/p, typical-p) computed with
the draft prefix `d1 .. dj` in the history, so penalties see exactly the context each token is sampled in, and a
greedy request's argmax is that of its biased logits, as without drafts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specula_kernels.fused import logit_rows
from specula_server.request import RequestState
from specula_server.sampling import ACCEPT_STREAM, Sampler, SamplingRow, seed_for
from specula_server.speculation.drafters import Draft


@dataclass
class Verdict:
    """What one request emits this step: accepted drafts, then the target's own token."""

    token_ids: list[int]
    logprobs: list[float]
    rows: list[int]  # logits row each emitted token was chosen from (for top-n alternatives)
    num_drafted: int
    path: list[int]  # accepted draft nodes, root's child first (a chain's are 0, 1, 2, ...)

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def _row_histories(r: RequestState, draft: Draft) -> list[torch.Tensor]:
    """The context each verified row's token is chosen in: the request's tokens plus the path to the node."""
    if draft.is_chain:  # the drafts sit in the request's token buffer right after its tokens
        return [r.token_ids[: r.num_tokens + j] for j in range(len(draft) + 1)]
    paths: list[list[int]] = []
    tokens = draft.tokens.tolist()
    for i, parent in enumerate(draft.node_parents()):
        paths.append((paths[parent] if parent >= 0 else []) + [tokens[i]])
    history = r.history
    return [history] + [torch.cat([history, torch.tensor(p, dtype=torch.long)]) for p in paths]


def _children(draft: Draft) -> dict[int, dict[int, int]]:
    """node (-1: root) -> {token: child node}."""
    children: dict[int, dict[int, int]] = {}
    for i, (parent, token) in enumerate(zip(draft.node_parents(), draft.tokens.tolist())):
        children.setdefault(parent, {})[token] = i
    return children


def verify(
    logits: torch.Tensor,  # [sum(len(d_i) + 1), vocab]: request i's rows are row_starts[i] .. + len(d_i)
    requests: Sequence[RequestState],
    drafts: Sequence[Draft],
    row_starts: Sequence[int],
    sampler: Sampler,
) -> tuple[list[Verdict], torch.Tensor | None]:
    """Accepts drafts per request. Returns the verdicts and the processed log-probs (None when every row was
    plain greedy, in which case log-probs are log_softmax of the logits)."""
    rows = [
        SamplingRow(r.spec.sampling, history, r.generator)
        for r, d in zip(requests, drafts)
        for history in _row_histories(r, d)
    ]
    plain = all(row.params.is_plain_greedy for row in rows)
    logprobs = None if plain else sampler.process(logits.float(), rows)  # [n, vocab]
    argmax = (logit_rows(logits, finite=False, normalizer=False)[1] if plain else logprobs.argmax(dim=-1)).tolist()

    # Every request emits at least the root's token: those draws are made together, as a plain step makes
    # them (each with the request's own generator, so still one draw per emitted token, in order).
    first: dict[int, int] = {}
    sampled_roots = [start for r, d, start in zip(requests, drafts, row_starts)
                     if not r.spec.sampling.is_greedy and not _rejection_sampled(r, d)]
    if sampled_roots:
        drawn = sampler.choose(logprobs[sampled_roots], [rows[i] for i in sampled_roots]).tolist()
        first = dict(zip(sampled_roots, drawn))

    verdicts = [_speculative_sampling(logprobs, r, d, start, rows, sampler) if _rejection_sampled(r, d)
                else _walk_drafts(r, d, start, argmax, first, logprobs, rows, sampler)
                for r, d, start in zip(requests, drafts, row_starts)]
    _fill_logprobs(verdicts, logits, None if plain else logprobs)
    return verdicts, logprobs


def _walk_drafts(r: RequestState, d: Draft, start: int, argmax: list[int], first: dict[int, int],
                 logprobs: torch.Tensor | None, rows: list[SamplingRow], sampler: Sampler) -> Verdict:
    """Request `r`'s verdict on draft `d` (rows from `start`), walked from the root: each visited node emits the
    token its row gives (the argmax when greedy; else the root's draw in `first`, or a draw from its row), and
    the walk goes on into the child drafted with that token, if any."""
    children = _children(d) if len(d) else {}
    greedy = r.spec.sampling.is_greedy
    node, emitted, emitted_rows, path = -1, [], [], []
    while True:  # one emitted token per visited node, from that node's row
        row = start + 1 + node
        if greedy:
            token = argmax[row]
        elif node < 0:
            token = first[row]
        else:
            token = int(sampler.choose(logprobs[row : row + 1], [rows[row]])[0])
        emitted.append(token)
        emitted_rows.append(row)
        child = children.get(node, {}).get(token)
        if child is None:
            return Verdict(emitted, [], emitted_rows, len(d), path)
        path.append(child)
        node = child


def _fill_logprobs(verdicts: list[Verdict], logits: torch.Tensor, logprobs: torch.Tensor | None) -> None:
    """Each verdict's emitted tokens' log-probabilities: from `logprobs`, or (None: plain greedy rows) the
    log-softmax of their logit rows."""
    all_rows = torch.tensor([i for v in verdicts for i in v.rows], device=logits.device)
    all_tokens = torch.tensor([t for v in verdicts for t in v.token_ids], device=logits.device)
    if logprobs is None:
        chosen = logits[all_rows].float()
        values = chosen.gather(1, all_tokens[:, None]).squeeze(1) - logit_rows(chosen, finite=False, argmax=False)[2]
    else:
        values = logprobs[all_rows, all_tokens]
    flat = values.tolist()
    offset = 0
    for v in verdicts:
        v.logprobs = flat[offset : offset + len(v.token_ids)]
        offset += len(v.token_ids)


def _rejection_sampled(r: RequestState, draft: Draft) -> bool:
    """Whether the request's drafts are verified by the rejection rule: sampled drafts that carry q."""
    return draft.q is not None and len(draft) > 0 and not r.spec.sampling.is_greedy


def _speculative_sampling(logprobs: torch.Tensor, r: RequestState, draft: Draft, start: int,
                          rows: Sequence[SamplingRow], sampler: Sampler) -> Verdict:
    """Accepts x_(j+1) ~ q_j with probability min(1, p_j(x) / q_j(x)); at the first rejection emits a draw
    from norm(max(0, p_j - q_j)), after k acceptances a draw from p_k. `logprobs` rows start .. start + k are
    the target's processed log p_0 .. p_k."""
    k = len(draft)
    device = logprobs.device
    tokens = draft.tokens.to(device)
    index = torch.arange(k, device=device)
    p = logprobs[start : start + k].exp()  # [k, vocab]
    q = draft.q.to(device=device, dtype=p.dtype)  # [k, vocab]
    generator = r.generator
    assert generator is not None, f"request {r.id} samples but has no generator"
    generator.manual_seed(seed_for(r.spec.sampling.seed, r.num_tokens, ACCEPT_STREAM))
    uniform = torch.rand(k, generator=generator, device=generator.device).to(device)
    # u < p / q, written without the division (q(x) > 0: x was drawn from q).
    accepted = (uniform * q[index, tokens] < p[index, tokens]).tolist()
    m = accepted.index(False) if False in accepted else k
    emitted = draft.tokens[:m].tolist()
    if m < k:
        residual = (p[m] - q[m]).clamp(min=0)
        if not bool(residual.sum() > 0):  # a rejection means p(x) < q(x), so the residual has mass; this
            residual = p[m]  # only guards against rounding
        token = int(sampler.choose(residual.log().unsqueeze(0), [rows[start + m]])[0])
    else:
        token = int(sampler.choose(logprobs[start + k : start + k + 1], [rows[start + k]])[0])
    emitted.append(token)
    return Verdict(emitted, [], list(range(start, start + m + 1)), k, list(range(m)))
