"""Request validation: a client's `GenerateParameters` in, a checked `ValidGenerateRequest` out.

Sits between the HTTP handlers and the scheduler. Every rule a user can break is checked here (the sampling
parameters' rules in `sampling_validation.py`) and raises `ValidationError` (`validation_limits.py`), which the HTTP
layer answers with 422 `{"error": message, "error_type": "validation"}`; the message names the field and its limit,
in TGI's words where TGI has them.

Resolution rules (where Specula differs from TGI/LoRAX, the reason is given):
- `max_new_tokens` defaults to what `max_total_tokens` leaves after the prompt (LoRAX), and never lets
  prompt + new tokens + speculative lookahead pass the model's position limit (LoRAX #474).
- `truncate` keeps the last `truncate` tokens of the encoded prompt, BOS included in the count (TGI).
- `grammar` (TGI) and `response_format` (LoRAX) become one llguidance grammar (`grammar.py`), built here and
  held to `max_grammar_bytes`; whether it compiles against the tokenizer is checked next, by the HTTP layer
  (`GrammarChecker`: off the event loop, under a time limit, cached).
- `watermark` is refused, never silently ignored. `merged_adapters` (LoRAX) becomes an adapter named by the
  whole merge (`merges.py`); with `adapter_id` too, it is LoRAX's 422.
- `adapter_id` "" means the base model (LoRAX); a named adapter gets `adapter_source` (default: the server's
  `--adapter-source`) and keeps the request's `api_token`, which no error message ever repeats.

`Validator.validate` and `Validator.tokenize` are synchronous and may tokenise a long prompt: run them in the
router's validation workers. Tokenisation releases the GIL, so it never stalls the event loop.
"""

from __future__ import annotations

import random
import unicodedata
from collections.abc import Sequence

import tokenizers

from specula_proto.choices import AdapterSource, parse_choice
from specula_router.grammar import Grammar, GrammarError, from_generate_parameters
from specula_router.merges import (
    ADAPTER_ID_CONFLICT,
    MERGED_ID_PREFIX,
    MergeError,
    MergeSpec,
    is_merged_id,
    merge_spec,
)
from specula_router.requests import SamplingParameters, StoppingParameters, ValidGenerateRequest
from specula_router.response_schemas import SimpleToken
from specula_router.sampling_validation import check_sampling
from specula_router.schemas import ADAPTER_SOURCES, MAX_ADAPTER_ID_LENGTH, GenerateParameters
from specula_router.validation_limits import ValidationError, ValidationLimits


class Validator:
    """Checks generate requests against `limits` and tokenises their prompts."""

    def __init__(
        self, tokenizer: tokenizers.Tokenizer, limits: ValidationLimits, rng: random.Random | None = None,
        default_adapter_source: str = AdapterSource.HUB,
    ) -> None:
        parse_choice(AdapterSource, default_adapter_source, "--adapter-source")
        self.tokenizer = tokenizer
        self.limits = limits
        self.rng = rng if rng is not None else random.Random()
        self.default_adapter_source = default_adapter_source

    @property
    def max_top_k(self) -> int:
        """The largest `top_k`: the vocabulary size (the worker's, else the tokenizer's with added tokens)."""
        return self.limits.vocab_size or self.tokenizer.get_vocab_size(with_added_tokens=True)

    def validate(self, inputs: str, params: GenerateParameters, stream: bool = False,
                 add_special_tokens: bool = True) -> ValidGenerateRequest:
        """Check every parameter, tokenise and truncate the prompt, and fill in every default.

        Cheap checks run before tokenisation, so a bad parameter fails fast even for a long prompt.
        `add_special_tokens` False: the prompt already holds them (a rendered chat template writes its own BOS).
        """
        if not inputs:
            raise ValidationError("`inputs` cannot be empty", "inputs")
        self._check_unsupported(params)
        grammar = self.grammar(params)
        adapter_id, adapter_source = self._adapter(params)
        merge = self._merge(params)
        if merge is not None:
            adapter_id, adapter_source = merge.adapter_id, merge.source
        sampling = check_sampling(self, params)
        best_of = self._best_of(params, sampling, stream)
        if stream and params.decoder_input_details:
            raise ValidationError(
                "`decoder_input_details` == true is not supported when streaming tokens", "decoder_input_details"
            )
        stop_sequences = self._stop_sequences(params.stop)
        top_n_tokens = self._top_n_tokens(params)
        speculative_tokens = self._speculative_tokens(params.speculative_tokens)
        truncate = self._truncate(params.truncate)
        if params.max_new_tokens is not None and params.max_new_tokens <= 0:
            raise ValidationError("`max_new_tokens` must be strictly positive", "max_new_tokens")

        input_ids = self._prompt_ids(inputs, add_special_tokens, truncate, params.decoder_input_details)
        lookahead = self.limits.max_speculative_tokens if speculative_tokens is None else speculative_tokens
        max_new_tokens = self._max_new_tokens(len(input_ids), params.max_new_tokens, lookahead)

        return ValidGenerateRequest(
            inputs=inputs,
            input_ids=tuple(input_ids),
            sampling=sampling,
            stopping=StoppingParameters(
                max_new_tokens=max_new_tokens,
                stop_sequences=stop_sequences,
                ignore_eos_token=params.ignore_eos_token,
            ),
            truncate=truncate,
            decoder_input_details=params.decoder_input_details,
            details=params.details,
            return_full_text=bool(params.return_full_text),
            top_n_tokens=top_n_tokens,
            best_of=best_of,
            adapter_id=adapter_id,
            adapter_source=adapter_source,
            merge=merge,
            api_token=params.api_token if adapter_id is not None else None,
            speculative_tokens=speculative_tokens,
            grammar=grammar.text if grammar is not None else "",
        )

    def _prompt_ids(self, inputs: str, add_special_tokens: bool, truncate: int | None,
                    decoder_input_details: bool) -> list[int]:
        """The prompt's token ids, truncated and within the input limits (the whole prompt in one prefill when
        `decoder_input_details` asks for its tokens' details)."""
        input_ids = self._encoding(inputs, add_special_tokens).ids
        if truncate is not None:
            input_ids = input_ids[-truncate:]
        self._check_input_length(len(input_ids))
        prefill_limit = self.limits.max_batch_prefill_tokens
        if decoder_input_details and prefill_limit is not None and len(input_ids) > prefill_limit:
            raise ValidationError(
                f"`decoder_input_details` needs the whole prompt in one prefill: at most {prefill_limit} tokens "
                f"(--max-batch-prefill-tokens). Given: {len(input_ids)}", "decoder_input_details")
        return input_ids

    def tokenize(self, inputs: str, add_special_tokens: bool = True, truncate: int | None = None) -> list[SimpleToken]:
        """The prompt's tokens for `POST /tokenize`, with UTF-8 byte offsets into `inputs` (as TGI).

        The limits of `validate` apply: `truncate` keeps the last tokens, and more than `max_input_tokens` tokens
        is a 422, so an answer is never larger than a prompt the server would accept.

        Example (a byte-level BPE with BOS `<s>` = 1; "é" is two bytes and here two tokens, which both
        report the whole character):
            tokenize("hé!") -> [SimpleToken(id=1, text="<s>", start=0, stop=0, special=True),
                                SimpleToken(id=74, text="h", start=0, stop=1),
                                SimpleToken(id=130, text="é", start=1, stop=3),
                                SimpleToken(id=105, text="é", start=1, stop=3),
                                SimpleToken(id=3, text="!", start=3, stop=4)]
        """
        truncate = self._truncate(truncate)
        encoding = self._encoding(inputs, add_special_tokens)
        first = 0 if truncate is None else max(len(encoding) - truncate, 0)
        self._check_input_length(len(encoding) - first)
        offsets = encoding.offsets[first:]
        byte_offset = _byte_offsets(inputs, [char for span in offsets for char in span])
        encoded = inputs.encode("utf-8")
        tokens = []
        for token_id, token, (start, stop), special in zip(
            encoding.ids[first:], encoding.tokens[first:], offsets, encoding.special_tokens_mask[first:]
        ):
            byte_start, byte_stop = byte_offset[start], byte_offset[stop]
            text = token if special else encoded[byte_start:byte_stop].decode("utf-8", errors="replace")
            tokens.append(
                SimpleToken(id=token_id, text=text, start=byte_start, stop=byte_stop, special=bool(special))
            )
        return tokens

    def grammar(self, params: GenerateParameters) -> Grammar | None:
        """The llguidance grammar of `grammar` or `response_format` (None: unconstrained), not yet checked
        against the tokenizer (`GrammarChecker.check` does that, off the event loop).

        Example: {"grammar": {"type": "regex", "value": "[0-9]+"}} -> Grammar(text='{"grammars":[...', field=
        "grammar.value"); {"grammar": {"type": "xml"}} -> "`grammar.type` must be one of json, json_object, regex"
        """
        try:
            return from_generate_parameters(params.grammar, params.response_format, self.limits.max_grammar_bytes)
        except GrammarError as e:
            raise ValidationError(e.message, e.field) from None

    # -- parameter checks ---------------------------------------------------------------------------------

    @staticmethod
    def _check_unsupported(params: GenerateParameters) -> None:
        if params.watermark:
            raise ValidationError("`watermark` is not supported", "watermark")

    def _adapter(self, params: GenerateParameters) -> tuple[str | None, str | None]:
        """(adapter_id, adapter_source); (None, None) for the base model. Never quotes `api_token`."""
        source = params.adapter_source
        if source is not None and source not in ADAPTER_SOURCES:
            raise ValidationError(f"`adapter_source` must be one of {list(ADAPTER_SOURCES)}. Given: {source!r}",
                                  "adapter_source")
        adapter_id = params.adapter_id or None  # LoRAX sends "" for the base model
        if adapter_id is None:
            return None, None
        if len(adapter_id) > MAX_ADAPTER_ID_LENGTH:
            raise ValidationError(f"`adapter_id` must be at most {MAX_ADAPTER_ID_LENGTH} characters. "
                                  f"Given: {len(adapter_id)}", "adapter_id")
        if any(unicodedata.category(char) == "Cc" for char in adapter_id):
            raise ValidationError("`adapter_id` must not contain control characters", "adapter_id")
        if adapter_id != adapter_id.strip():
            raise ValidationError("`adapter_id` must not start or end with whitespace", "adapter_id")
        if is_merged_id(adapter_id):
            raise ValidationError(f"`adapter_id` must not start with `{MERGED_ID_PREFIX}` (merged adapters' names): "
                                  "use `merged_adapters`", "adapter_id")
        return adapter_id, source or self.default_adapter_source

    def _merge(self, params: GenerateParameters) -> MergeSpec | None:
        """LoRAX's `merged_adapters`, checked and named (`merges.py`); None without one."""
        merged = params.merged_adapters
        if merged is None:
            return None
        if params.adapter_id:  # "" is the base model, as everywhere
            raise ValidationError(ADAPTER_ID_CONFLICT, "merged_adapters")
        try:
            return merge_spec(merged.ids, merged.weights, merged.merge_strategy, merged.density,
                              merged.majority_sign_method, merged.seed,
                              params.adapter_source or self.default_adapter_source)
        except MergeError as e:
            raise ValidationError(e.message, e.field) from None

    def _best_of(self, params: GenerateParameters, sampling: SamplingParameters, stream: bool) -> int:
        best_of = params.best_of if params.best_of is not None else 1
        if best_of == 1:
            return 1
        out_of_range = ValidationError(
            f"`best_of` must be > 0 and <= {self.limits.max_best_of}. Given: {best_of}", "best_of"
        )
        if best_of <= 0:
            raise out_of_range
        if stream:
            raise ValidationError("`best_of` != 1 is not supported when streaming tokens", "best_of")
        if self.limits.max_best_of == 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint", "best_of")
        if best_of > self.limits.max_best_of:
            raise out_of_range
        if not sampling.do_sample:
            raise ValidationError("you must use sampling when `best_of` is > 1", "best_of")
        if params.seed is not None:
            raise ValidationError("`seed` must not be set when `best_of` > 1", "seed")
        return best_of

    def _stop_sequences(self, stop: list[str]) -> tuple[str, ...]:
        if len(stop) > self.limits.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {self.limits.max_stop_sequences} stop sequences. Given: {len(stop)}", "stop"
            )
        if any(sequence == "" for sequence in stop):
            # An empty stop sequence would match before the first token: almost certainly a client bug.
            raise ValidationError("`stop` sequences must not be empty strings", "stop")
        return tuple(stop)

    def _top_n_tokens(self, params: GenerateParameters) -> int:
        top_n, k_alternatives = params.top_n_tokens, params.return_k_alternatives
        if top_n is not None and k_alternatives is not None and top_n != k_alternatives:
            raise ValidationError(
                "`top_n_tokens` and `return_k_alternatives` are aliases and must be equal when both are given. "
                f"Given: {top_n} and {k_alternatives}",
                "top_n_tokens",
            )
        name, value = ("top_n_tokens", top_n) if top_n is not None else ("return_k_alternatives", k_alternatives)
        if value is None:
            return 0
        if not (0 <= value <= self.limits.max_top_n_tokens):
            raise ValidationError(
                f"`{name}` must be >= 0 and <= {self.limits.max_top_n_tokens}. Given: {value}", name
            )
        return value

    def _speculative_tokens(self, value: int | None) -> int | None:
        if value is not None and not (0 <= value <= self.limits.max_speculative_tokens):
            raise ValidationError(
                f"`speculative_tokens` must be >= 0 and <= {self.limits.max_speculative_tokens}. Given: {value}",
                "speculative_tokens",
            )
        return value

    def _truncate(self, value: int | None) -> int | None:
        if value is not None and not (0 < value <= self.limits.max_input_tokens):
            raise ValidationError(
                f"`truncate` must be between 1 and {self.limits.max_input_tokens}. Given: {value}",
                "truncate",
            )
        return value

    def _check_input_length(self, num_tokens: int) -> None:
        if num_tokens > self.limits.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have at most {self.limits.max_input_tokens} tokens. Given: {num_tokens}", "inputs"
            )

    def _max_new_tokens(self, input_length: int, requested: int | None, lookahead: int) -> int:
        """The request's `max_new_tokens`: checked when given, else the most the limits allow.

        Two budgets bound it: the KV budget `input + max_new_tokens <= max_total_tokens`, and the model's
        position limit, which the verify forward reaches `lookahead` positions early:
        `input + max_new_tokens + lookahead <= max_position_embeddings`.
        """
        limits = self.limits
        position_room = None
        if limits.max_position_embeddings is not None:
            position_room = limits.max_position_embeddings - input_length - lookahead
        if requested is None:
            requested = limits.max_total_tokens - input_length
            if position_room is not None:
                requested = min(requested, position_room)
            requested = max(requested, 1)  # too little room left: report it with the smallest valid value
        if input_length + requested > limits.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {limits.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {requested} `max_new_tokens`",
                "max_new_tokens",
            )
        if position_room is not None and requested > position_room:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` + speculative tokens must be <= "
                f"{limits.max_position_embeddings} (the model's maximum positions). Given: {input_length} "
                f"`inputs` tokens, {requested} `max_new_tokens` and {lookahead} speculative tokens",
                "max_new_tokens",
            )
        return requested

    # -- tokenisation -------------------------------------------------------------------------------------

    def _encoding(self, inputs: str, add_special_tokens: bool) -> tokenizers.Encoding:
        try:
            # `encode_batch` releases the GIL while the Rust tokenizer runs and `encode` does not: a 2 MB prompt
            # in a validation worker would otherwise hold up the event loop (and /health) for seconds.
            return self.tokenizer.encode_batch([inputs], add_special_tokens=add_special_tokens)[0]
        except Exception as exc:  # the Rust tokenizer raises plain Exception subclasses
            raise ValidationError(f"tokenizer error {exc}", "inputs") from exc


def _byte_offsets(text: str, positions: Sequence[int]) -> dict[int, int]:
    """The UTF-8 byte offset of each character position in `positions`.

    Walks `text` once, in C-speed slices between the positions asked for, so a long input with a short
    truncated tail costs one `encode` rather than a Python loop over every character.
    """
    if text.isascii():
        return {position: position for position in positions}
    offsets, byte, previous = {}, 0, 0
    for position in sorted(set(positions)):
        byte += len(text[previous:position].encode("utf-8"))
        offsets[position], previous = byte, position
    return offsets
