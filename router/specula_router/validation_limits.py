"""What generate requests are checked against, and how a check refuses one.

`ValidationLimits` gathers the limits of the launcher's flags and the model's config; `ValidationError` is the
refusal every check raises (`validation.py`, `sampling_validation.py`), which the HTTP layer answers with 422
`{"error": message, "error_type": "validation"}`.
"""

from __future__ import annotations

from dataclasses import dataclass

from specula_router.grammar import DEFAULT_MAX_GRAMMAR_BYTES


class ValidationError(Exception):
    """A request the router refuses: HTTP 422 with `message`; `field` names the offending parameter."""

    error_type = "validation"

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


@dataclass(frozen=True)
class ValidationLimits:
    """The limits requests are checked against, from the launcher's flags and the model's config."""

    max_input_tokens: int
    max_total_tokens: int
    max_stop_sequences: int = 4
    max_best_of: int = 2
    max_top_n_tokens: int = 5
    max_speculative_tokens: int = 0
    max_position_embeddings: int | None = None
    vocab_size: int | None = None  # rows of the workers' LM head, the largest `top_k`; None: the tokenizer's
    # Prompt tokens in one prefill; longer prompts are prefilled in chunks, except with `decoder_input_details`,
    # whose prompt log-probabilities need every prompt row in one forward. None: no such limit.
    max_batch_prefill_tokens: int | None = None
    # Largest grammar, JSON schema or regex text of a request, in bytes as received (--max-grammar-bytes).
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES

    def __post_init__(self) -> None:
        if self.max_input_tokens < 1:
            raise ValueError(f"max_input_tokens must be >= 1, got {self.max_input_tokens}")
        if self.max_total_tokens <= self.max_input_tokens:
            raise ValueError(
                f"max_total_tokens ({self.max_total_tokens}) must be > max_input_tokens ({self.max_input_tokens})"
            )
        for name in ("max_stop_sequences", "max_top_n_tokens", "max_speculative_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_best_of < 1:
            raise ValueError(f"max_best_of must be >= 1, got {self.max_best_of}")
        if self.max_position_embeddings is not None and self.max_position_embeddings < 1:
            raise ValueError(f"max_position_embeddings must be >= 1, got {self.max_position_embeddings}")
        if self.vocab_size is not None and self.vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {self.vocab_size}")
        if self.max_grammar_bytes < 1:
            raise ValueError(f"--max-grammar-bytes must be at least 1, got {self.max_grammar_bytes}")
