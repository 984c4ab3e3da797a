"""Sampling-parameter validation: a request's warpers, penalties, seed and `logit_bias` checked and resolved into
the `SamplingParameters` the workers receive (for `validation.Validator`; refusals raise `ValidationError`).

Resolution rules (where Specula differs from TGI/LoRAX, the reason is given):
- Sampling is on iff `do_sample` or any warper is active (temperature != 1, top_k, top_p < 1,
  typical_p). TGI's router only turns `do_sample` on when the whole `parameters` object is missing.
- `top_p == 1.0` is accepted and means "off" (TGI rejects it; OpenAI-style clients send it).
- A missing seed is drawn from the validator's generator, so all shards sample alike.
- Every number must fit the worker's wire type (`wire.py`): `top_k` at most the vocabulary, floats that stay
  normal and finite as a float32. TGI checks only the sign, so its `top_k` 2**32 fails building the message.
- `logit_bias` (OpenAI's): at most 300 token ids, each a canonical decimal below the vocabulary size (the
  workers' LM head rows, like `top_k`), each value in [-100, 100]. vLLM clamps out-of-range values; OpenAI
  refuses them, and so do we. Zero biases are dropped: they change nothing, and a greedy request without any
  keeps the workers' argmax-only path.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from specula_router.requests import SamplingParameters
from specula_router.schemas import LOGIT_BIAS_KEY_PATTERN, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, GenerateParameters
from specula_router.validation_limits import ValidationError
from specula_router.wire import FLOAT32_BELOW_ONE, FLOAT32_MAX, FLOAT32_MIN_NORMAL, UINT64_MAX, float_range_text

if TYPE_CHECKING:
    from specula_router.validation import Validator

MAX_SEED = UINT64_MAX
_LOGIT_BIAS_KEY = re.compile(LOGIT_BIAS_KEY_PATTERN)


def check_sampling(validator: Validator, params: GenerateParameters) -> SamplingParameters:
    """The request's `SamplingParameters`, every parameter checked; a missing seed is drawn from `validator.rng`.

    `validator.max_top_k` is read only when `top_k` or `logit_bias` is given: it may count the whole vocabulary.
    """
    # Floats travel as float32: a float64 that is positive here must not round to 0 or to infinity there.
    temperature = _float32(params.temperature, 1.0, "temperature", "strictly positive", FLOAT32_MIN_NORMAL)
    top_k = params.top_k if params.top_k is not None else 0
    if params.top_k is not None and not (0 < params.top_k <= validator.max_top_k):
        raise ValidationError(f"`top_k` must be strictly positive and at most the vocabulary size "
                              f"({validator.max_top_k}). Given: {params.top_k}", "top_k")
    top_p = _float32(params.top_p, 1.0, "top_p", "> 0.0 and <= 1.0", FLOAT32_MIN_NORMAL, 1.0)
    typical_p = _float32(params.typical_p, 1.0, "typical_p", "> 0.0 and < 1.0", FLOAT32_MIN_NORMAL,
                         FLOAT32_BELOW_ONE)
    repetition_penalty = _float32(params.repetition_penalty, 1.0, "repetition_penalty", "strictly positive",
                                  FLOAT32_MIN_NORMAL)
    frequency_penalty = _penalty(params.frequency_penalty, "frequency_penalty")
    presence_penalty = _penalty(params.presence_penalty, "presence_penalty")
    seed = params.seed
    if seed is not None and not (0 <= seed <= MAX_SEED):
        raise ValidationError(f"`seed` must be >= 0 and <= {MAX_SEED}. Given: {seed}", "seed")

    has_warper = temperature != 1.0 or top_k > 0 or top_p < 1.0 or typical_p < 1.0
    return SamplingParameters(
        do_sample=params.do_sample or has_warper,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        typical_p=typical_p,
        repetition_penalty=repetition_penalty,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        seed=seed if seed is not None else validator.rng.getrandbits(64),
        logit_bias=_logit_bias(validator, params.logit_bias),
    )


def _logit_bias(validator: Validator, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """(token id, bias) pairs sorted by id, zero biases dropped.

    Example (vocabulary of 512): {"7": -100, "3": 0.5, "9": 0} -> ((3, 0.5), (7, -100.0));
    {"512": 1} -> "`logit_bias` keys must be token ids in [0, 511] ... Given: '512'".
    """
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS_TOKENS:
        raise ValidationError(f"`logit_bias` may bias at most {MAX_LOGIT_BIAS_TOKENS} tokens. Given: {len(bias)}",
                              "logit_bias")
    vocab = validator.max_top_k
    pairs = []
    for key, value in bias.items():
        if not _LOGIT_BIAS_KEY.fullmatch(key) or int(key) >= vocab:  # fullmatch: `$` passes a final \n
            raise ValidationError(f"`logit_bias` keys must be token ids in [0, {vocab - 1}] (the vocabulary), "
                                  f"written in decimal. Given: {key[:20]!r}", "logit_bias")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:  # also refuses NaN and infinities
            raise ValidationError(f"`logit_bias` values must be >= {-MAX_LOGIT_BIAS:g} and <= "
                                  f"{MAX_LOGIT_BIAS:g}. Given: {value!r} for token {key}", "logit_bias")
        if value != 0:
            pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _penalty(value: float | None, name: str) -> float:
    if value is None:
        return 0.0
    if not (-2.0 <= value <= 2.0):  # also refuses NaN; a tiny value rounds to 0 as a float32, which it means
        raise ValidationError(f"`{name}` must be >= -2.0 and <= 2.0. Given: {value!r}", name)
    return value


def _float32(value: float | None, default: float, name: str, rule: str, low: float,
             high: float = FLOAT32_MAX) -> float:
    """`value` (or `default` when absent) if it lies in [low, high], the bounds that keep it meaningful as a float32.

    Example: temperature 1e-50 is positive but rounds to 0.0 as a float32, so it is refused:
        "`temperature` must be strictly positive: in [1.1754944e-38, 3.4028235e+38] as a float32. Given: 1e-50"
    """
    if value is None:
        return default
    if not (low <= value <= high):  # also refuses NaN and infinities
        raise ValidationError(f"`{name}` must be {rule}: in {float_range_text(low, high)} as a float32. "
                              f"Given: {value!r}", name)
    return value
