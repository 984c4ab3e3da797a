"""Speculative decoding inside the worker's decode step: propose → verify → accept → commit.

    propose  a drafter suggests up to k tokens per request (`drafters.py`); the controller picks how many
             of them each request verifies this step (`controller.py`)
    verify   one forward pass over `[last, d1 .. dk]` of every request, all requests together, writing the
             paged KV of every position (the generator's decode step)
    accept   the exact acceptance rule per request (`verify.py`): greedy keeps drafts while they equal the
             target's argmax; sampling draws the target's token at each position and keeps drafts while they
             match, so the output distribution is exactly the model's; drafts sampled from a draft model's q
             are accepted with probability min(1, p/q), a rejection resampled from norm(max(0, p - q))
    commit   accepted tokens (and the target's own next token) are appended one at a time through the
             stopping criteria; rejected positions' KV is never read and is overwritten by later steps

Drafters implement one small interface; prompt lookup is the first, Medusa heads, MLP speculators and draft
models plug in beside it.
"""
