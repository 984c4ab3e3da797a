"""One request's state inside the worker, from its first step to its last token.

A `RequestState` is created when the router first sends the request and is kept, by id, until it finishes or
the router lists it as finished. Everything a step needs (token ids, KV slots, sampling generator,
detokenizer, stop checker) hangs off this one object; a step's tensors are rebuilt from these objects.
Its KV slots grow as the router appends blocks (`grow`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import tokenizers
import torch

from specula_server.grammar import RequestGrammar
from specula_server.params import FinishReason, SamplingParams, StoppingParams
from specula_server.speculation.controller import AcceptanceEstimate
from specula_server.tokens import IncrementalDetokenizer, StopChecker


@dataclass(frozen=True)
class TokenInfo:
    """A token as reported to the router: the fields of the wire's `Tokens` columns and of the router's
    `TokenOut`, in the same order and with the same names."""

    id: int
    text: str
    logprob: float  # NaN where undefined (the first prompt token)
    special: bool


@dataclass(frozen=True)
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None


@dataclass
class StepOutput:
    """What one request produced in one step."""

    request_id: int
    tokens: list[TokenInfo]
    top_tokens: list[list[TokenInfo]]  # per entry of `tokens`, its `top_n_tokens` alternatives
    prefill_tokens: list[TokenInfo] | None = None
    generated_text: GeneratedText | None = None
    num_drafted: int = 0  # draft tokens verified this step
    num_accepted: int = 0  # of which accepted and emitted
    draft_method: str = ""  # the drafter that proposed them ("ngram", "medusa", "draft_model"; "" when none)
    # Set when the request failed this step (its logits were not finite, see `nonfinite`): it left its batch
    # and no other field is set.
    error: str = ""
    # Once later steps of the same call are appended (`extend`): how many of `tokens` each step produced, and the
    # draft tokens each verified and accepted.
    step_tokens: list[int] = field(default_factory=list)
    step_drafted: list[int] = field(default_factory=list)
    step_accepted: list[int] = field(default_factory=list)

    def extend(self, later: StepOutput) -> None:
        """Appends what the request produced in a later step of the same call; a failure then replaces it all."""
        if later.error:
            self.tokens, self.top_tokens, self.prefill_tokens, self.generated_text = [], [], None, None
            self.num_drafted = self.num_accepted = 0
            self.draft_method, self.error = "", later.error
            self.step_tokens, self.step_drafted, self.step_accepted = [], [], []
            return
        self.step_tokens = (self.step_tokens or [len(self.tokens)]) + (later.step_tokens or [len(later.tokens)])
        self.step_drafted = (self.step_drafted or [self.num_drafted]) + (later.step_drafted or [later.num_drafted])
        self.step_accepted = ((self.step_accepted or [self.num_accepted])
                              + (later.step_accepted or [later.num_accepted]))
        self.tokens = self.tokens + later.tokens
        self.top_tokens = self.top_tokens + later.top_tokens
        self.num_drafted += later.num_drafted
        self.num_accepted += later.num_accepted
        self.draft_method = later.draft_method or self.draft_method
        self.generated_text = later.generated_text


class InvalidRequestError(ValueError):
    """A step or request the worker cannot run: a whole step is reported as INVALID_ARGUMENT, a request fails
    alone (`StepOutput.error`)."""


@dataclass(frozen=True)
class RequestSpec:
    """A request as the router sends it (after protobuf decoding and validation)."""

    id: int
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    stopping: StoppingParams
    blocks: tuple[int, ...]
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    speculative_tokens: int | None = None  # per-request cap on draft tokens (None: the server's)
    adapter_id: str = ""  # LoRA adapter applied to this request ("": the base model)
    cached_tokens: int = 0  # leading positions whose KV `blocks` already hold (a reused prefix)
    prefill_until: int = 0  # its first step computes positions [cached_tokens, prefill_until); 0: all
    generated_ids: tuple[int, ...] = ()  # tokens generated before it was preempted (recomputed, not re-emitted)
    grammar: str = ""  # llguidance grammar every generated token follows ("": unconstrained), see `grammar.py`

    @property
    def context_len(self) -> int:
        """Positions its prefill computes: the prompt's, and those of tokens generated before a preemption."""
        return len(self.input_ids) + len(self.generated_ids)


def check_spec(spec: RequestSpec, vocab_size: int, max_positions: int, block_size: int) -> None:
    """Raises InvalidRequestError unless a new request fits the model and its blocks hold its first step."""
    def refuse(reason: str) -> None:
        raise InvalidRequestError(f"request {spec.id}: {reason}")

    if not spec.input_ids:
        refuse("empty prompt")
    bad = [t for t in spec.input_ids + spec.generated_ids if not 0 <= t < vocab_size]
    if bad:
        refuse(f"token ids {bad[:5]} outside the vocabulary [0, {vocab_size})")
    if spec.stopping.max_new_tokens <= len(spec.generated_ids):
        refuse(f"max_new_tokens ({spec.stopping.max_new_tokens}) must exceed the tokens already generated "
               f"({len(spec.generated_ids)})")
    if len(spec.input_ids) + spec.stopping.max_new_tokens > max_positions:
        refuse(f"{len(spec.input_ids)} prompt + {spec.stopping.max_new_tokens} new tokens exceed the model's "
               f"{max_positions} positions")
    context, until = spec.context_len, spec.prefill_until or spec.context_len
    if spec.cached_tokens and (spec.cached_tokens >= context or spec.cached_tokens % block_size):
        refuse(f"cached_tokens ({spec.cached_tokens}) must be whole blocks of {block_size} shorter than its "
               f"context ({context} tokens)")
    if not spec.cached_tokens < until <= context:
        refuse(f"prefill_until ({spec.prefill_until}) must lie past cached_tokens ({spec.cached_tokens}) and "
               f"within its context ({context})")
    if spec.prefill_logprobs and (spec.cached_tokens or until < context or spec.generated_ids):
        refuse("prefill_logprobs needs the whole prompt computed in one step (no cached prefix, no chunks, "
               "not resumed)")
    if len(spec.blocks) * block_size < until:
        refuse(f"{len(spec.blocks)} KV blocks of {block_size} tokens cannot hold the {until} positions of its "
               f"first step")


@dataclass(frozen=True)
class RequestUpdate:
    """What changes this step for a request the worker holds: blocks appended, or its prompt's next chunk
    (positions up to `prefill_until`, 0: to the end) for one still prefilling."""

    id: int
    new_blocks: tuple[int, ...] = ()
    prefill_until: int = 0


@dataclass(frozen=True)
class StepPlan:
    """One engine step as the router orders it (the Step RPC): `finished` requests leave, `updates` apply,
    `new` requests join, then one step runs over every request (named prompt chunks, every decode), and up to
    `decode_steps - 1` more while every request decodes and has room (`TextGenerator.step`)."""

    new: Sequence[RequestSpec] = ()
    updates: Sequence[RequestUpdate] = ()
    finished: Sequence[int] = ()
    decode_steps: int = 1


@dataclass(eq=False)
class RequestState:
    spec: RequestSpec
    token_ids: torch.Tensor  # [capacity] long (CPU): prompt then generated ids; the tail is unused
    slots: torch.Tensor  # [capacity] long (device): KV slot of each position
    detokenizer: IncrementalDetokenizer
    stop_checker: StopChecker
    generator: torch.Generator | None
    num_tokens: int  # prompt + generated tokens so far
    finish_reason: FinishReason | None = None
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)  # of its draft tokens
    # Final-normed hidden state of the position its last token was chosen from (what Medusa heads read).
    last_hidden: torch.Tensor | None = None
    # Positions 0 .. draft_cached - 1 hold the draft model's KV of this request's own tokens (draft-model
    # speculation); the draft model runs over the rest of its tokens before drafting again.
    draft_cached: int = 0
    # EAGLE-3: the target's auxiliary hidden states (`[n, A * hidden]` tensors, in order) of the positions from
    # draft_cached on that the draft layer has not run over yet (see speculation/eagle3_drafter.py).
    eagle_aux: list[torch.Tensor] = field(default_factory=list)
    eagle_kept: int = 0  # their rows in all
    # Positions whose KV the target holds, while the prompt (and any tokens recomputed after a preemption) is
    # being prefilled; None once that prefill chose its first token and the request decodes.
    prefilled: int | None = 0
    # Where its output stands in its grammar (structured output); None: unconstrained.
    grammar: RequestGrammar | None = None

    @classmethod
    def create(
        cls,
        spec: RequestSpec,
        tokenizer: tokenizers.Tokenizer,
        slots: torch.Tensor,
        eos_token_ids: frozenset[int],
        device: torch.device,
        grammar: RequestGrammar | None = None,
    ) -> RequestState:
        context = spec.input_ids + spec.generated_ids
        # One entry past the last slot: the token chosen at the last position the blocks cover is appended there.
        token_ids = torch.zeros(max(slots.numel(), len(context)) + 1, dtype=torch.long)
        token_ids[: len(context)] = torch.tensor(context, dtype=torch.long)
        generator = None if spec.sampling.is_greedy else torch.Generator(device=device)
        state = cls(
            spec=spec,
            token_ids=token_ids,
            slots=slots,
            detokenizer=IncrementalDetokenizer(tokenizer, list(spec.input_ids)),
            stop_checker=StopChecker(spec.stopping, eos_token_ids),
            generator=generator,
            num_tokens=len(context),
            prefilled=spec.cached_tokens,
            grammar=grammar,
        )
        for token_id in spec.generated_ids:  # a resumed request: text and stop checks as they were
            state.detokenizer.push(token_id)
            state.stop_checker.check(token_id, state.detokenizer.text)
        return state

    def grow(self, slots: torch.Tensor) -> None:
        """Appends the slots of blocks the router added."""
        self.slots = torch.cat([self.slots, slots])
        if self.token_ids.numel() < self.slots.numel() + 1:
            grown = torch.zeros(self.slots.numel() + 1, dtype=torch.long)
            grown[: self.token_ids.numel()] = self.token_ids
            self.token_ids = grown

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def capacity(self) -> int:
        """Positions the request's KV blocks cover."""
        return self.slots.numel()

    @property
    def is_prefilling(self) -> bool:
        return self.prefilled is not None

    @property
    def prompt_len(self) -> int:
        return len(self.spec.input_ids)

    @property
    def num_generated(self) -> int:
        return self.num_tokens - self.prompt_len

    @property
    def history(self) -> torch.Tensor:  # [num_tokens]: every token in context, for penalties
        return self.token_ids[: self.num_tokens]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token_id: int, logprob: float) -> TokenInfo:
        """Commits one generated token: detokenises it and checks the stopping criteria.

        Returns the token with the text it adds, so the texts of all tokens appended join to
        `generated_text().text`. On a stop sequence that text ends where the stop sequence ends, even inside
        the token's piece: `stop: ["terv"]` over pieces "I", "ter", "viron" gives "I", "ter", "v".
        """
        assert not self.is_finished, "no token may follow the end of a request"
        self.token_ids[self.num_tokens] = token_id
        self.num_tokens += 1
        text = self.detokenizer.push(token_id)
        self.finish_reason = self.stop_checker.check(token_id, self.detokenizer.text)
        if self.grammar is not None and self.finish_reason is None:
            self.grammar.consume(token_id)
            if self.grammar.is_complete:  # only EOS may follow: end as if the model had chosen it
                self.finish_reason = FinishReason.EOS_TOKEN
        if self.finish_reason is not None:
            text += self.detokenizer.finish()  # bytes of a character cut short by the end
        if self.finish_reason is FinishReason.STOP_SEQUENCE:
            # The match ends in text this token added (earlier text was searched without one), so the cut
            # falls inside `text`; the held-back bytes `finish()` added come after it and are dropped too.
            text_start = len(self.detokenizer.text) - len(text)
            text = text[: self.text_end - text_start]
        return TokenInfo(token_id, text, logprob, self.detokenizer.is_special(token_id))

    def commit(self, token_ids: Sequence[int], logprobs: Sequence[float],
               top_tokens: Sequence[list[TokenInfo]]) -> StepOutput:
        """Appends a step's tokens up to the end of the request (nothing after a stop is emitted or counted) and
        reports them, with the alternatives of each (`top_tokens`, cut alike)."""
        tokens = []
        for token_id, logprob in zip(token_ids, logprobs):
            tokens.append(self.append(token_id, logprob))
            if self.is_finished:
                break
        out = StepOutput(self.id, tokens, list(top_tokens[: len(tokens)]))
        if self.is_finished:
            out.generated_text = self.generated_text()
        return out

    @property
    def text_end(self) -> int:
        """Length of the generated text reported: all of it, or up to the end of the stop sequence that ended it."""
        stop_end = self.stop_checker.stop_end
        return len(self.detokenizer.text) if stop_end is None else stop_end

    def generated_text(self) -> GeneratedText:
        assert self.finish_reason is not None
        seed = None if self.spec.sampling.is_greedy else self.spec.sampling.seed
        text = self.detokenizer.text[: self.text_end]
        return GeneratedText(text, self.num_generated, self.finish_reason, seed)

