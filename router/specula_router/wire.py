"""What the workers' wire types can hold: the outer bounds of every numeric request parameter.

The router validates a request in Python (unbounded ints, float64) and sends it as protobuf (`uint32`, `uint64`,
`float`, see `proto/generate.proto`). A value the wire type cannot hold either makes building the message raise
(an int past `uint32`) or silently changes its meaning (a float64 that rounds to 0 or to infinity as a float32:
temperature 1e-50 becomes a division by zero). `schemas.py` states these bounds in the OpenAPI document and
`validation.py` and `sampling_validation.py` enforce them, so all read them from here.

The float bounds are float32 values written exactly as float64, so "x <= FLOAT32_MAX" in float64 guarantees
that float32(x) is finite, and "x >= FLOAT32_MIN_NORMAL" that float32(x) is a normal number, not 0.
"""

from __future__ import annotations

UINT32_MAX = 2**32 - 1  # top_k, max_new_tokens, top_n_tokens, truncate, speculative_tokens
UINT64_MAX = 2**64 - 1  # seed

FLOAT32_MAX = 3.4028234663852886e38  # largest finite float32
FLOAT32_MIN_NORMAL = 1.1754943508222875e-38  # smallest positive normal float32
FLOAT32_BELOW_ONE = 1.0 - 2.0**-24  # largest float32 below 1: typical_p must stay below 1 once rounded


def float_range_text(low: float, high: float) -> str:
    """How a 422 message writes a float range: `[1.1754944e-38, 3.4028235e+38]`."""
    return f"[{low:.8g}, {high:.8g}]"
