"""One request's state inside the worker, from prefill to its last token.

A `RequestState` is created at prefill from the router's request and lives in a batch until it finishes or
the router filters it out. Everything a step needs (token ids, KV slots, sampling generator, detokenizer,
stop checker) hangs off this one object; batch tensors are rebuilt from these objects each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import tokenizers
import torch

from specula_server.params import FinishReason, SamplingParams, StoppingParams
from specula_server.speculation.controller import AcceptanceEstimate
from specula_server.tokens import IncrementalDetokenizer, StopChecker


@dataclass(frozen=True)
class TokenInfo:
    """A token as reported to the router."""

    id: int
    logprob: float
    text: str
    is_special: bool


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
    cached_tokens: int = 0  # leading prompt positions whose KV `blocks` already hold (a reused prefix)
    prefill_until: int = 0  # a chunk of a long prompt computes positions [cached_tokens, prefill_until); 0: all

    @property
    def is_chunk(self) -> bool:
        """Whether this prefill computes only a part of the prompt (no token comes out of it)."""
        return 0 < self.prefill_until < len(self.input_ids)


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

    @classmethod
    def create(
        cls,
        spec: RequestSpec,
        tokenizer: tokenizers.Tokenizer,
        slots: torch.Tensor,
        eos_token_ids: frozenset[int],
        device: torch.device,
    ) -> RequestState:
        capacity = slots.numel()
        token_ids = torch.zeros(capacity, dtype=torch.long)
        token_ids[: len(spec.input_ids)] = torch.tensor(spec.input_ids, dtype=torch.long)
        generator = None
        if not spec.sampling.is_greedy:
            generator = torch.Generator(device=device)
            generator.manual_seed(spec.sampling.seed)
        return cls(
            spec=spec,
            token_ids=token_ids,
            slots=slots,
            detokenizer=IncrementalDetokenizer(tokenizer, list(spec.input_ids)),
            stop_checker=StopChecker(spec.stopping, eos_token_ids),
            generator=generator,
            num_tokens=len(spec.input_ids),
        )

    @property
    def id(self) -> int:
        return self.spec.id

    @property
    def capacity(self) -> int:
        """Positions the request's KV blocks cover."""
        return self.slots.numel()

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
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len : self.num_tokens].tolist()

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
        if self.finish_reason is not None:
            text += self.detokenizer.finish()  # bytes of a character cut short by the end
        if self.finish_reason is FinishReason.STOP_SEQUENCE:
            # The match ends in text this token added (earlier text was searched without one), so the cut
            # falls inside `text`; the held-back bytes `finish()` added come after it and are dropped too.
            text_start = len(self.detokenizer.text) - len(text)
            text = text[: self.text_end - text_start]
        return TokenInfo(token_id, logprob, text, self.detokenizer.is_special(token_id))

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
