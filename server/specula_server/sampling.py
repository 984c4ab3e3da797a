"""The worker's token chooser: logits → processed log-probs → one token per position, vectorised over a batch.

Where it sits: the model runner produces logits for every position that needs a token (one per running
request in a plain decode step; several per request when a speculative draft is verified). `Sampler.process`
turns each row into a log-prob distribution and `Sampler.choose` draws from it. Speculative acceptance
calls `process` on its own and applies its acceptance rule to those distributions, so the two halves stay
separately usable; `Sampler.__call__` is both plus the reported log-probs.

Order of operations for one row (the order of TGI's heterogeneous chooser and of transformers' `generate`):

    logits (any float dtype) → float32 scores
    0. logit bias           score[id] += bias for each (id, bias) of the request   (OpenAI's `logit_bias`)
    1. repetition penalty   tokens in history: score < 0 ? score * p : score / p   (transformers' processor)
    2. frequency penalty    score -= f * count(token in history)    (OpenAI/vLLM form: count, not TGI's
                                                                     count / len(history))
    3. presence penalty     score -= r * [token in history]
    4. temperature          score /= t
    5. top-k                keep scores >= the k-th largest (ties at the boundary are kept)
    6. top-p                sort ascending, drop tokens whose cumulative prob <= 1 - top_p (the top one stays)
    7. typical-p            keep tokens whose surprise -log p is closest to the entropy, up to mass typical_p
    log_softmax → [n, V] log-probs; filtered tokens are -inf
    choose: argmax for greedy rows; for sampling rows an inverse-CDF draw with one uniform from the row's
            own generator

`history` is prompt + generated tokens (TGI applies penalties over both). The bias comes first, as in vLLM
(its logit-bias processor runs before the penalties), so every later step and the greedy argmax see the biased
logits; the log-probs reported are those of this processed distribution, bias included (vLLM reports the raw
model's by default; ours are what the token was actually drawn from, as for temperature). Speculative
verification (`speculation/verify.py`) and the draft model call `process` too, so they see the same bias and
greedy output stays identical with and without drafts. Bias and penalties run on every row that sets them,
greedy or not; warpers only on sampling rows (setting a warper makes a row sample, see
`SamplingParams.is_greedy`). Each step sees the previous step's output, as in transformers, so top-p's
cumulative mass is over the top-k survivors. Steps 5-7 match transformers' TopK/TopP/TypicalLogitsWarper
with min_tokens_to_keep=1.

Cost: a batch of plain greedy rows (no penalties, no bias) is one pass over each row (its argmax and logsumexp).
Otherwise each step runs once on the rows that need it, with per-row parameters as [m, 1] tensors; only the
sort-based steps (top-p, typical-p) sort, and only their rows. The one per-row Python loop draws one uniform from
each row's generator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specula_kernels.fused import logit_rows

from .params import SamplingParams

# Independent random streams of one request (see `seed_for`).
TARGET_STREAM = 0  # the target model's token at a position (a plain step, a verified row, a prompt's end)
DRAFT_STREAM = 1  # a draft model's sampled draft at a position
ACCEPT_STREAM = 2  # the uniforms of speculative sampling's acceptance test


def seed_for(seed: int, position: int, stream: int = TARGET_STREAM) -> int:
    """A 63-bit seed from (request seed, position, stream): splitmix64's finaliser, so nearby inputs give
    unrelated generator states.

    Every draw reseeds the request's generator from its seed and the position it draws for, so a request's
    tokens are a function of (seed, position) alone: the same whatever its batch-mates, after a preemption that
    recomputed it, and with or without speculation that verifies deterministic drafts (a verified row draws the
    target's token at its position exactly as a plain step does, and a draft is kept only when it equals it).
    Streams keep the draws that must be independent apart: a draft model's sample for a position and the
    target's draw there (speculative sampling's residual draw must not reuse the uniform that chose the draft).
    """
    z = (seed * 0x9E3779B97F4A7C15 + position * 0xD1B54A32D192ED03 + stream + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


@dataclass
class SamplingRow:
    """One position to choose a token for: the token at index `len(history)` of its request's sequence."""

    params: SamplingParams
    history: torch.Tensor  # [num_context_tokens] long: prompt + generated (+ draft prefix), for penalties
    generator: torch.Generator | None  # the request's own generator; None when greedy
    stream: int = TARGET_STREAM  # which of the request's random streams the draw comes from


@dataclass
class SampleResult:
    token_ids: torch.Tensor  # [n] long
    logprobs: torch.Tensor  # [n] float32: log-prob of the chosen token under the processed distribution
    top_ids: torch.Tensor  # [n, num_top] long, most likely first
    top_logprobs: torch.Tensor  # [n, num_top] float32, processed distribution


class Sampler:
    """Chooses tokens for a batch of positions; stateless, every per-request state arrives in the rows."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow], num_top: int = 0) -> SampleResult:
        """`logits`: [n, vocab], one row per entry of `rows`."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        logits = logits.float()  # [n, vocab]
        if all(row.params.is_plain_greedy for row in rows):
            return _plain_greedy(logits, num_top)
        logprobs = self.process(logits, rows)  # [n, vocab]
        token_ids = self.choose(logprobs, rows)  # [n]
        top = logprobs.topk(num_top, dim=-1)
        return SampleResult(
            token_ids=token_ids,
            logprobs=logprobs.gather(1, token_ids[:, None]).squeeze(1),
            top_ids=top.indices,
            top_logprobs=top.values,
        )

    def process(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Log-probs after penalties and warpers: [n, vocab] float32, filtered tokens -inf.

        Rows that are greedy without penalties nor bias get plain `log_softmax(logits)`. `logits` is not modified.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (tuple(logits.shape), len(rows))
        scores: torch.Tensor | None = None  # [n, vocab]; our own copy once any step applies
        for applies, step in _STEPS:
            row_ids = [i for i, row in enumerate(rows) if applies(row.params)]
            if not row_ids:
                continue
            if scores is None:
                scores = logits.to(torch.float32, copy=True)
            selected = [rows[i] for i in row_ids]
            if len(row_ids) == len(rows):
                scores = step(scores, selected)
            else:
                index = torch.tensor(row_ids, device=scores.device)
                scores[index] = step(scores[index], selected)
        return torch.log_softmax(logits.float() if scores is None else scores, dim=-1)

    def choose(self, logprobs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """[n] long: argmax for greedy rows, a draw from exp(logprobs) with the row's generator otherwise.

        `logprobs` may be unnormalised (a residual distribution's log). A row's draw depends only on its seed,
        position and stream (`seed_for`) and its own distribution, never on the other rows, so a seed reproduces
        its tokens whatever the batch. The draw is by inverse CDF: one uniform u per row from its generator, then the
        first token whose cumulative mass exceeds u times the total (`draw_by_inverse_cdf`). One random number
        per row instead of one per vocabulary entry (an exponential race), whose cost grew with the vocabulary
        times the sampling rows (docs/benchmarks.md#decode-in-the-worker).
        """
        token_ids = logprobs.argmax(dim=-1)  # [n]
        sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
        if not sampled:
            return token_ids
        draws = []
        for i in sampled:
            row = rows[i]
            generator = row.generator
            assert generator is not None, f"row {i} samples but has no generator"
            generator.manual_seed(seed_for(row.params.seed, row.history.numel(), row.stream))
            # Drawn on the generator's own device (a CPU generator may serve logits on an accelerator).
            draw = torch.rand((), generator=generator, device=generator.device, dtype=torch.float64)
            draws.append(draw.to(logprobs.device))
        index = torch.tensor(sampled, device=logprobs.device)
        token_ids[index] = draw_by_inverse_cdf(logprobs[index], torch.stack(draws))
        return token_ids


def draw_by_inverse_cdf(logprobs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[m] long: for each row of `logprobs` [m, vocab], the smallest token i with `cdf[i] > u * total`.

    The cumulative sum runs in float64 over the float32 probabilities, so the partition of [0, total) into
    the tokens' intervals is exact to float64 rounding (under 1e-10 of the mass at a 128k vocabulary). A token of
    probability 0 (filtered, -inf) has an empty interval and can never be chosen; the target is kept strictly
    below the total so rounding in `u * total` cannot run past the last token of positive probability.
    """
    cdf = (logprobs - logprobs.amax(dim=-1, keepdim=True)).exp().to(torch.float64).cumsum_(dim=-1)  # [m, vocab]
    total = cdf[:, -1:]
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _plain_greedy(logits: torch.Tensor, num_top: int) -> SampleResult:
    """The common case without materialising [n, vocab] log-probs: argmax, and logits - logsumexp (one pass per
    row, `fused.logit_rows`)."""
    _, token_ids, log_normalizer = logit_rows(logits, finite=False)  # [n], [n]
    top = logits.topk(num_top, dim=-1)  # [n, num_top]
    return SampleResult(
        token_ids=token_ids,
        logprobs=logits.gather(1, token_ids[:, None]).squeeze(1) - log_normalizer,
        top_ids=top.indices,
        top_logprobs=top.values - log_normalizer[:, None],
    )


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row parameters as an [m, 1] tensor that broadcasts over the vocab."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


def _apply_logit_bias(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Adds each row's biases to its scores, one scatter for the batch. scores: [m, vocab].

    Ids at or past the scores' width are skipped: the router checks ids against the target's vocabulary, and a
    draft model's LM head may be narrower (its drafts of such tokens would be rejected anyway).
    """
    vocab = scores.shape[-1]
    pairs = [(i, token, bias) for i, row in enumerate(rows) for token, bias in row.params.logit_bias if token < vocab]
    if not pairs:
        return scores
    row_ids, token_ids, biases = zip(*pairs)
    index = (torch.tensor(row_ids, device=scores.device), torch.tensor(token_ids, device=scores.device))
    return scores.index_put(index, torch.tensor(biases, dtype=scores.dtype, device=scores.device), accumulate=True)


def _apply_penalties(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, frequency and presence penalties over each row's history. scores: [m, vocab]."""
    num_rows, vocab = scores.shape
    device = scores.device
    lengths = torch.tensor([row.history.numel() for row in rows], device=device)  # [m]
    token_ids = torch.cat([row.history.reshape(-1) for row in rows]).to(device=device, dtype=torch.long)
    row_ids = torch.repeat_interleave(torch.arange(num_rows, device=device), lengths)  # [sum(lengths)]
    # Ids past the logits' vocab (embedding tables can be padded larger than lm_head) land in an extra
    # column that is dropped: such tokens cannot be generated, so there is nothing to penalise.
    counts = torch.zeros(num_rows, vocab + 1, dtype=scores.dtype, device=device)  # [m, vocab + 1]
    ones = torch.ones_like(token_ids, dtype=scores.dtype)
    counts.index_put_((row_ids, token_ids.clamp(max=vocab)), ones, accumulate=True)
    counts = counts[:, :vocab]  # [m, vocab]
    present = counts > 0  # [m, vocab]

    repetition = _column([row.params.repetition_penalty for row in rows], scores)  # [m, 1]
    frequency = _column([row.params.frequency_penalty for row in rows], scores)
    presence = _column([row.params.presence_penalty for row in rows], scores)
    # Dividing a negative score would raise its probability, hence multiply below zero (transformers).
    repeated = torch.where(scores < 0, scores * repetition, scores / repetition)
    scores = torch.where(present, repeated, scores)
    return scores - frequency * counts - presence * present


def _apply_temperature(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    return scores / _column([row.params.temperature for row in rows], scores)


def _apply_top_k(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Keep each row's k largest scores; topk runs with the batch's largest k, not a full sort."""
    vocab = scores.shape[-1]
    top_k = [min(row.params.top_k, vocab) for row in rows]
    top_values = scores.topk(max(top_k), dim=-1).values  # [m, max_k], descending
    kth = top_values.gather(1, torch.tensor(top_k, device=scores.device)[:, None] - 1)  # [m, 1]
    return scores.masked_fill(scores < kth, float("-inf"))


def _apply_top_p(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    # 1 - top_p in Python doubles, as transformers computes it, so boundary tokens are decided alike.
    threshold = _column([1.0 - row.params.top_p for row in rows], scores)  # [m, 1]
    sorted_scores, sorted_ids = scores.sort(dim=-1, descending=False)  # [m, vocab] each
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove = cumulative <= threshold
    remove[:, -1] = False  # the most likely token always survives
    remove = remove.scatter(1, sorted_ids, remove)
    return scores.masked_fill(remove, float("-inf"))


def _apply_typical_p(scores: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022) as transformers' TypicalLogitsWarper does it."""
    mass = _column([row.params.typical_p for row in rows], scores)  # [m, 1]
    logprobs = torch.log_softmax(scores, dim=-1)  # [m, vocab]
    entropy = -(logprobs * logprobs.exp()).nansum(dim=-1, keepdim=True)  # [m, 1]; nansum skips -inf * 0
    surprise_gap = (-logprobs - entropy).abs()  # [m, vocab]
    sorted_gap, sorted_ids = surprise_gap.sort(dim=-1, descending=False)
    cumulative = scores.gather(-1, sorted_ids).softmax(dim=-1).cumsum(dim=-1)
    last = (cumulative < mass).sum(dim=-1).clamp(max=scores.shape[-1] - 1)  # [m]: first index reaching mass
    remove = sorted_gap > sorted_gap.gather(1, last[:, None])
    remove[:, 0] = False  # the most typical token always survives
    remove = remove.scatter(1, sorted_ids, remove)
    return scores.masked_fill(remove, float("-inf"))


# (does the step apply to a row, step on the rows it applies to) in the documented order. Warpers imply
# sampling, so their predicates need no `is_greedy` check.
_STEPS: tuple[tuple[Callable[[SamplingParams], bool], Callable[..., torch.Tensor]], ...] = (
    (lambda p: bool(p.logit_bias), _apply_logit_bias),
    (lambda p: p.has_penalties, _apply_penalties),
    (lambda p: p.temperature != 1.0, _apply_temperature),
    (lambda p: p.top_k > 0, _apply_top_k),
    (lambda p: p.top_p < 1.0, _apply_top_p),
    (lambda p: p.typical_p < 1.0, _apply_typical_p),
)
