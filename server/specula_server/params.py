"""Per-request generation parameters as the worker sees them.

The router validates everything a client sends; these dataclasses are what arrives at the worker after the
gRPC edge has converted the protobuf messages. They are immutable: a request's parameters never change
while it runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen from the model's logits (TGI semantics)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables nucleus filtering
    typical_p: float = 1.0  # 1.0 disables typical filtering
    repetition_penalty: float = 1.0  # 1.0 disables; >1 discourages tokens already in context
    frequency_penalty: float = 0.0  # subtracted once per occurrence of a token in context
    presence_penalty: float = 0.0  # subtracted once if a token occurs in context at all
    seed: int = 0  # seeds the request's own generator; the router always picks one
    # OpenAI's logit bias as (token id, bias) pairs sorted by id; a tuple keeps the dataclass hashable.
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def has_warpers(self) -> bool:
        """True when the distribution is reshaped (temperature, top-k/p, typical)."""
        return self.temperature != 1.0 or self.top_k > 0 or self.top_p < 1.0 or self.typical_p < 1.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
        )

    @property
    def is_greedy(self) -> bool:
        """Like TGI, setting any warper implies sampling even when `do_sample` is false."""
        return not (self.do_sample or self.has_warpers)

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy on the raw logits: no penalty nor bias reshapes them, so the argmax of the logits is the token."""
        return self.is_greedy and not self.has_penalties and not self.logit_bias


@dataclass(frozen=True)
class StoppingParams:
    """When a request stops generating."""

    max_new_tokens: int
    stop_sequences: tuple[str, ...] = ()
    ignore_eos_token: bool = False


class FinishReason(enum.Enum):
    """Why a request finished; the values are the strings the HTTP API reports."""

    LENGTH = "length"
    EOS_TOKEN = "eos_token"
    STOP_SEQUENCE = "stop_sequence"
