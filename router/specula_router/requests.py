"""A generate request after validation: what the router queues, batches and sends to the workers.

The HTTP layer turns a client's JSON into a `ValidGenerateRequest` (see `validation.py`); from then on the
request is plain, checked data: token ids already truncated, every sampling parameter filled in, a seed
chosen, and `max_new_tokens` known, so the scheduler can budget its KV cache exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specula_router.merges import MergeSpec


@dataclass(frozen=True)
class SamplingParameters:
    do_sample: bool
    temperature: float
    top_k: int  # 0: off
    top_p: float  # 1.0: off
    typical_p: float  # 1.0: off
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int  # chosen by the router when the client gave none, so every shard samples alike
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) sorted by id, zero biases dropped; (): none


@dataclass(frozen=True)
class StoppingParameters:
    max_new_tokens: int
    stop_sequences: tuple[str, ...]
    ignore_eos_token: bool


@dataclass(frozen=True)
class ValidGenerateRequest:
    inputs: str  # the prompt text as received (after truncation it may no longer match input_ids)
    input_ids: tuple[int, ...]  # the tokenised prompt, truncated to the last `truncate` tokens when asked
    sampling: SamplingParameters
    stopping: StoppingParameters
    truncate: int | None
    decoder_input_details: bool  # return prompt tokens with log-probabilities
    details: bool
    return_full_text: bool
    top_n_tokens: int  # alternatives per generated token (TGI top_n_tokens / LoRAX return_k_alternatives)
    best_of: int  # 1 unless several sequences are sampled and the best returned
    adapter_id: str | None = None  # None: the base model
    adapter_source: str | None = None  # "hub" or "local" when adapter_id is set (the server's default if not given)
    merge: MergeSpec | None = None  # LoRAX's merged_adapters: adapter_id is then the merge's name (`merges.py`)
    api_token: str | None = field(default=None, repr=False)  # for LoadAdapter only: never logged nor echoed
    speculative_tokens: int | None = None  # per-request override of the speculation length
    grammar: str = ""  # llguidance grammar (JSON text) the output must follow, checked against the tokenizer; "": none

    @property
    def input_length(self) -> int:
        return len(self.input_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this request can occupy in the KV cache (prompt + everything it may generate)."""
        return self.input_length + self.stopping.max_new_tokens
