"""Exact acceptance of draft tokens, given the target model's logits at every verified position.

Request r verified `[last, d1 .. dk]` in one forward, so its logits rows j = 0..k hold the target's
distribution p_j of the token after `d1 .. dj`. The rules (both exact):

- greedy: keep drafts while `d_(j+1) == argmax p_j`; the first mismatch (or the bonus after all k) is the target's
  own argmax. Output identical to decoding without drafts.
- sampling, deterministic drafts: draw `y_j ~ p_j` with the request's own generator, in order, keep going while
  `y_j == d_(j+1)`, stop at the first mismatch, which is emitted. Every emitted token is a draw from the target's
  distribution given everything before it, so the output distribution is exactly the model's. Draws are made
  lazily, one per emitted token, so a seed yields the same tokens whatever the draft lengths.

p_j is the sampler's processed distribution (penalties, temperature, top-k/p, typical-p) computed with the draft
prefix `d1 .. dj` in the history, so penalties see exactly the context each token is sampled in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from specula_server.request import RequestState
from specula_server.sampling import Sampler, SamplingRow


@dataclass
class Verdict:
    """What one request emits this step: accepted drafts, then the target's own token."""

    token_ids: list[int]
    logprobs: list[float]
    rows: list[int]  # logits row each emitted token was chosen from (for top-n alternatives)
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(
    logits: torch.Tensor,  # [sum(k_i + 1), vocab]: request i's rows are row_starts[i] .. + k_i
    requests: Sequence[RequestState],
    drafts: Sequence[list[int]],
    row_starts: Sequence[int],
    sampler: Sampler,
) -> tuple[list[Verdict], torch.Tensor | None]:
    """Accepts drafts per request. Returns the verdicts and the processed log-probs (None when every row was
    plain greedy, in which case log-probs are log_softmax of the logits)."""
    rows = [
        SamplingRow(r.spec.sampling, r.token_ids[: r.num_tokens + j], r.generator)
        for r, d in zip(requests, drafts)
        for j in range(len(d) + 1)
    ]
    plain = all(row.params.is_greedy and not row.params.has_penalties for row in rows)
    logprobs = None if plain else sampler.process(logits.float(), rows)  # [n, vocab]
    scores = logits if plain else logprobs
    argmax = scores.argmax(dim=-1).tolist()

    verdicts = []
    for r, d, start in zip(requests, drafts, row_starts):
        if r.spec.sampling.is_greedy:
            accepted = 0
            while accepted < len(d) and d[accepted] == argmax[start + accepted]:
                accepted += 1
            emitted = argmax[start : start + accepted + 1]
        else:
            emitted = []
            for j in range(len(d) + 1):  # one draw per emitted token, from that position's distribution
                token = int(sampler.choose(logprobs[start + j : start + j + 1], [rows[start + j]])[0])
                emitted.append(token)
                if j == len(d) or token != d[j]:
                    break
        emitted_rows = list(range(start, start + len(emitted)))
        verdicts.append(Verdict(emitted, [], emitted_rows, len(d)))

    all_rows = torch.tensor([i for v in verdicts for i in v.rows], device=logits.device)
    all_tokens = torch.tensor([t for v in verdicts for t in v.token_ids], device=logits.device)
    if plain:
        chosen = logits[all_rows].float()
        values = chosen.gather(1, all_tokens[:, None]).squeeze(1) - torch.logsumexp(chosen, dim=-1)
    else:
        values = logprobs[all_rows, all_tokens]
    flat = values.tolist()
    offset = 0
    for v in verdicts:
        v.logprobs = flat[offset : offset + len(v.token_ids)]
        offset += len(v.token_ids)
    return verdicts, logprobs
