"""Containment of non-finite logits: a request whose logits are not finite fails alone, before sampling.

Where it sits: `TextGenerator` checks each step's logits right after the forward, before the sampler or the
verifier reads them. A request with a NaN or an infinity in any of its rows (its one row in a plain step,
every verified row in a speculative step, its prompt rows when it asked for prompt log-probs) gets a
`failure` output instead of tokens and leaves its batch, as a finished request does; the router fails that
request alone (`Generation.error`). The other requests' rows are selected out and go on unchanged: after the
forward, every operation (sampling, verification, detokenizing) is row by row.

Inside the forward a request's values stay in its own rows: projections and norms are row-wise, LoRA deltas
read each row's own adapter, and attention reads only slots the sequence wrote itself (see
`batch._padded_slots` for the one place that once broke this).

Cost: one pass over the logits and one read of a bool per step; the per-request work below
runs only when some row is not finite.

Example: a decode step over requests [a, b, c] whose row 1 holds a NaN: `nonfinite_requests(logits,
[1, 1, 1])` is `[1]`; `kept_rows([1, 1, 1], [0, 2])` is `([0, 2], [0, 1])`; b is answered with
`failure(b)` and a, c are sampled from rows 0 and 2.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specula_kernels.fused import logit_rows
from specula_server.request import RequestState, StepOutput


def nonfinite_requests(logits: torch.Tensor, counts: Sequence[int]) -> list[int]:
    """Indices of the requests with a non-finite value in any of their rows (almost always none).

    `logits` `[sum(counts), vocab]` holds the requests' rows one request after another, `counts[i]` each.
    """
    # One pass per row (`fused.logit_rows`: natively, else a row is finite iff its largest and smallest values
    # are); `isfinite(logits).all(-1)` materialises a bool per logit, which is far slower on CPU.
    finite = logit_rows(logits, argmax=False, normalizer=False)[0]  # [num_rows]
    if bool(finite.all()):
        return []
    finite_rows = finite.tolist()
    failed, start = [], 0
    for i, count in enumerate(counts):
        if not all(finite_rows[start : start + count]):
            failed.append(i)
        start += count
    return failed


def kept_rows(counts: Sequence[int], keep: Sequence[int]) -> tuple[list[int], list[int]]:
    """The rows of the kept requests (`keep`, ascending) and each kept request's first row among them."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    rows, kept_starts = [], []
    for i in keep:
        kept_starts.append(len(rows))
        rows.extend(range(starts[i], starts[i + 1]))
    return rows, kept_starts


def failure(r: RequestState, what: str = "logits") -> StepOutput:
    """The output of a request that failed this step: its id and the reason, nothing else."""
    adapter = f" (adapter `{r.spec.adapter_id}`)" if r.spec.adapter_id else ""
    return StepOutput(r.id, [], [], error=f"the model produced non-finite {what} for this request{adapter}")
