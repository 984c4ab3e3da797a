"""The rows one worker step feeds its forward, by kind: the decoding requests (`Decodes`: each its last token,
and the drafts it verifies) and the prompt chunks (`PromptChunks`). `TextGenerator` runs both in one forward,
decodes first, and hands each kind its own rows of the result."""

from __future__ import annotations

from dataclasses import dataclass

from specula_server.grammar import MaskJob
from specula_server.request import RequestState
from specula_server.speculation.drafters import Draft
from specula_server.speculation.speculator import DraftPlan, Speculator
from specula_server.speculative_step import place_drafts
from specula_server.step_outputs import grammar_masks


@dataclass
class Decodes:
    reqs: list[RequestState]
    plan: DraftPlan | None  # the drafts they verify; None: a plain decode step
    trees: list[Draft | None]  # per request, the tree its drafts form (None: a chain, or no draft)
    masks: MaskJob | None  # the constrained requests' allowed tokens, computing while the forward runs

    @property
    def counts(self) -> list[int]:
        return self.plan.counts if self.plan is not None else [1] * len(self.reqs)

    @property
    def starts(self) -> list[int]:
        return [r.num_tokens - 1 for r in self.reqs]

    @classmethod
    def of(cls, reqs: list[RequestState], speculator: Speculator | None, vocab_size: int) -> Decodes:
        """The decoding requests' rows: each its last token, and the drafts `speculator` plans for it, written
        after it in its token buffer."""
        plan = speculator.plan(reqs) if speculator is not None else None
        trees = place_drafts(reqs, plan.drafts) if plan is not None else [None] * len(reqs)
        return cls(reqs, plan, trees, grammar_masks(reqs, vocab_size, plan))


@dataclass
class PromptChunks:
    reqs: list[RequestState]
    starts: list[int]  # first position each computes
    untils: list[int]  # the end of each one's chunk
    done: list[int]  # indices of the prompts whose end runs this step: they yield their first token
    waiting: list[int]  # indices of those whose grammar still compiles: they keep their last logits for it
    masks: MaskJob | None  # the allowed first tokens of the constrained prompts among `done`

    @property
    def counts(self) -> list[int]:
        return [until - start for start, until in zip(self.starts, self.untils)]

    @classmethod
    def of(cls, items: list[tuple[RequestState, int]], vocab_size: int) -> PromptChunks:
        """The chunks `(request, end of its chunk)`, each from where its prompt was computed up to."""
        reqs = [r for r, _ in items]
        done = [i for i, (r, until) in enumerate(items) if until == r.num_tokens]
        # A prompt whose grammar is still compiling waits for it, with its last logits, while the others go on.
        waiting = [i for i in done if reqs[i].grammar is not None and not reqs[i].grammar.is_ready
                   and not reqs[i].spec.prefill_logprobs]
        done = [i for i in done if i not in waiting]
        return cls(reqs, [r.prefilled for r in reqs], [until for _, until in items], done, waiting,
                   grammar_masks([reqs[i] for i in done], vocab_size))
