"""The token limits' defaults, derived in one place for the two processes that derive them.

The launcher derives them from the model's config.json to show them and to check the flags before anything
starts (launcher/specula_launcher/defaults.py); the router derives them again from the workers' Info and lowers
them to what the KV cache holds (router/specula_router/startup.py). TGI 3's rules, except that speculation's
lookahead is reserved inside the positions: a request may hold `max_total_tokens + lookahead` of them while its
drafts are verified. For 2048 positions and a lookahead of 3:

    max_total_tokens         = 2048 - 3                          = 2045
    max_input_tokens         = max_total_tokens - 1              = 2044
    max_batch_prefill_tokens = min(max_input_tokens + 50, 4096)  = 2094
"""

from __future__ import annotations

# TGI's default prefill budget: one full prompt plus a little room for a second, short one; at most 4096 tokens
# a step (a longer prompt is prefilled in chunks).
PREFILL_TOKENS_HEADROOM = 50
DEFAULT_PREFILL_CAP = 4096


def default_total_tokens(positions: int, lookahead: int) -> int:
    """The longest prompt + generation in `positions` (the model's, or what the KV cache holds): all of them but
    the speculative lookahead's."""
    return positions - lookahead


def default_input_tokens(max_total_tokens: int) -> int:
    """The longest prompt: one token less than the longest request, so that it generates at least one."""
    return max_total_tokens - 1


def default_prefill_tokens(max_input_tokens: int, cap: int = DEFAULT_PREFILL_CAP) -> int:
    """Prompt tokens per step: the longest prompt and a little more, at most `cap`."""
    return min(max_input_tokens + PREFILL_TOKENS_HEADROOM, cap)
