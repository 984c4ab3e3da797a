"""The derived defaults of a launcher run: `build_config` resolves the model (the bundled demo model, a
directory, a GGUF file or a Hub id), the device, the dtype and the token limits, then returns the `LauncherConfig`
(config.py) that checks them.

Token limits follow TGI 3, except that speculation's lookahead is reserved inside the model's positions (a
request may hold `max_total_tokens + speculative_tokens` positions while drafts are verified; LoRAX #474): the
formulas are specula_proto/limits.py's, which the router uses too. For a local model with
`max_position_embeddings = 2048`, `--speculative-tokens 3` and no limit given:

    max_total_tokens         = 2048 - 3                          = 2045
    max_input_tokens         = max_total_tokens - 1              = 2044
    max_batch_prefill_tokens = min(max_input_tokens + 50, 4096)  = 2094

These defaults are checked here and shown, but only limits the user set reach the router: it derives the same
defaults and lowers them to what the KV cache holds once the workers have measured it (TGI 3 does the same), so
a model of 128k positions on a small cache starts rather than failing. For a Hub id the launcher does not
download anything: limits not given stay None.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from specula_launcher.config import LauncherConfig
from specula_proto.choices import AdapterSource, Device, Dtype
from specula_proto.limits import DEFAULT_PREFILL_CAP, default_input_tokens, default_prefill_tokens, default_total_tokens

# The small Llama model shipped inside the package (see demo_model/README.md).
DEMO_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"
# Its family, shipped beside it (see demo_adapters/README.md): LoRA adapters and Medusa heads that requests name
# as local adapters, and an MLP speculator and a draft model for --speculator. Served with the demo model, this
# is the default --adapter-dir, local the default --adapter-source, and --speculator may name a member.
DEMO_ADAPTERS_DIR = Path(__file__).resolve().parent / "demo_adapters"

# config.json keys that hold the position limit, in order of preference (Llama-family first).
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def build_config(
    *,
    model_id: str | None = None,
    dtype: str | None = None,
    device: str | None = None,
    max_input_tokens: int | None = None,
    max_total_tokens: int | None = None,
    max_batch_prefill_tokens: int | None = None,
    max_batch_total_tokens: int | None = None,
    num_shard: int = 1,
    speculative_tokens: int = 0,
    cors_allow_origin: list[str] | tuple[str, ...] | None = None,
    adapter_dir: list[str] | tuple[str, ...] | None = None,
    adapter_source: str | None = None,
    speculator: str | None = None,
    preloaded_adapter_ids: list[str] | tuple[str, ...] | None = None,
    log_level: str = "INFO",
    count_cuda_devices: Callable[[], int] | None = None,
    **settings: object,
) -> LauncherConfig:
    """Fills in the derived defaults and returns the validated config.

    `settings` are the remaining `LauncherConfig` fields, passed through unchanged. `count_cuda_devices` is
    only called when the device is not given or is "cuda" (it imports torch; tests pass a stub). `adapter_dir`
    and `preloaded_adapter_ids` may be given repeated, comma-separated, or both.

    Serving the bundled demo model, the defaults bring in its family: `adapter_dir` defaults to the bundled
    demo adapters, `adapter_source` to local (so a request's `"adapter_id": "camel-case"` needs nothing else),
    and a `speculator` that is no existing path but names a member (`draft-model`, `mlp-speculator`, `medusa`)
    is that member's directory. Elsewhere `adapter_source` defaults to hub.
    """
    resolved_id, model_dir = resolve_model(model_id)
    demo = is_demo_model(model_dir)
    adapter_dirs = split_list(adapter_dir)
    if demo and not adapter_dirs and DEMO_ADAPTERS_DIR.is_dir():
        adapter_dirs = (str(DEMO_ADAPTERS_DIR),)
    if adapter_source is None:
        adapter_source = AdapterSource.LOCAL if demo else AdapterSource.HUB
    if demo and speculator:
        speculator = demo_family_member(speculator)
    count = count_cuda_devices or _count_cuda_devices
    if device is None:
        device = Device.CUDA if count() > 0 else Device.CPU
    elif device == Device.CUDA:
        _check_cuda(count(), num_shard // int(settings.get("nnodes", 1)))  # type: ignore[call-overload]
    if dtype is None:
        dtype = Dtype.BFLOAT16 if device == Device.CUDA else Dtype.FLOAT32
    max_positions = read_max_positions(model_dir) if model_dir is not None else None
    given = dict(max_input_tokens=max_input_tokens, max_total_tokens=max_total_tokens,
                 max_batch_prefill_tokens=max_batch_prefill_tokens)
    max_input_tokens, max_total_tokens, max_batch_prefill_tokens = derive_token_limits(
        max_positions, max_input_tokens, max_total_tokens, max_batch_prefill_tokens, max_batch_total_tokens,
        speculative_tokens)
    return LauncherConfig(
        model_id=resolved_id, dtype=dtype, device=device, num_shard=num_shard, max_input_tokens=max_input_tokens,
        max_total_tokens=max_total_tokens, max_batch_prefill_tokens=max_batch_prefill_tokens,
        max_batch_total_tokens=max_batch_total_tokens, speculative_tokens=speculative_tokens,
        cors_allow_origin=tuple(cors_allow_origin or ()), log_level=log_level.upper(),
        adapter_dir=adapter_dirs, adapter_source=adapter_source, speculator=speculator,
        preloaded_adapter_ids=tuple(dict.fromkeys(split_list(preloaded_adapter_ids))),  # in order, once each
        given_limits=tuple(name for name, value in given.items() if value is not None),
        **settings,  # type: ignore[arg-type]
    )


def split_list(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """A list flag given repeated, comma-separated or both: ["a,b", "c"] -> ("a", "b", "c")."""
    return tuple(part.strip() for value in values or () for part in value.split(",") if part.strip())


def resolve_model(model_id: str | None) -> tuple[str, Path | None]:
    """Returns the id to pass on and, for a local model, its directory; None means the bundled demo model."""
    if model_id is None:
        if not (DEMO_MODEL_DIR / "config.json").is_file():
            raise ValueError(f"the bundled demo model is missing from {DEMO_MODEL_DIR}; rebuild it with "
                             f"`python scripts/build_demo_model.py` or pass --model-id")
        return str(DEMO_MODEL_DIR), DEMO_MODEL_DIR
    path = Path(model_id).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return model_id, gguf_model_dir(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model-id {model_id}: the directory has no config.json")
        return str(path), path
    if path.exists():
        raise ValueError(f"--model-id {model_id}: expected a model directory, a .gguf file or a Hub id, found "
                         f"another file")
    if model_id.startswith(("/", "./", "../", "~")):
        raise ValueError(f"--model-id {model_id}: no such {'file' if model_id.endswith('.gguf') else 'directory'}")
    return model_id, None


def gguf_model_dir(path: Path) -> Path:
    """A local GGUF file, checked (architecture, tensor types, a whole file) and its metadata written as a model
    directory before any shard starts; a file Specula cannot serve is a ValueError naming it and the reason."""
    from specula_server.gguf_checkpoint import GGUFError  # imported here: only GGUF models need numpy and gguf
    from specula_server.gguf_metadata import model_directory

    try:
        return model_directory(path)
    except GGUFError as error:
        raise ValueError(f"--model-id: {error}") from error


def is_demo_model(model_dir: Path | None) -> bool:
    """Whether `model_dir` is the bundled demo model's directory."""
    if model_dir is None:
        return False
    try:
        return model_dir.resolve() == DEMO_MODEL_DIR.resolve()
    except OSError:
        return False


def demo_family_member(speculator: str) -> str:
    """`speculator` unchanged when it is an existing path, else the bundled demo family member of that name
    (`draft-model`, `mlp-speculator`, `medusa`) when there is one, else unchanged (e.g. a Hub id)."""
    if Path(speculator).expanduser().exists() or "/" in speculator:
        return speculator
    member = DEMO_ADAPTERS_DIR / speculator
    return str(member) if (member / "config.json").is_file() else speculator


def read_max_positions(model_dir: Path) -> int | None:
    """The model's position limit from its config.json, or None when it declares none."""
    path = model_dir / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    for key in POSITION_KEYS:
        if isinstance(raw.get(key), int):
            return raw[key]
    return None


def derive_token_limits(
    max_positions: int | None,
    max_input_tokens: int | None,
    max_total_tokens: int | None,
    max_batch_prefill_tokens: int | None,
    max_batch_total_tokens: int | None = None,
    speculative_tokens: int = 0,
) -> tuple[int | None, int | None, int | None]:
    """Fills (max_input_tokens, max_total_tokens, max_batch_prefill_tokens) that were not given.

    With a known position limit P both sequence limits are always set: total defaults to P - speculative_tokens,
    raised to one more than an explicit input limit; input defaults to total - 1; and total + speculative_tokens
    must fit in P. The prefill budget defaults to min(input + 50, 4096), capped by an explicit batch budget.
    Example, P = 2048, only `--max-input-tokens 3000`: total becomes 3001, and the error names the model's limit
    rather than a flag the user never set.
    """
    if max_positions is not None:
        if speculative_tokens >= max_positions - 1:
            raise ValueError(f"--speculative-tokens ({speculative_tokens}) leaves no room for a request in the "
                             f"model's {max_positions} positions")
        if max_total_tokens is None:
            max_total_tokens = default_total_tokens(max_positions, speculative_tokens)
            if max_batch_total_tokens is not None:  # the batch's KV budget, which the router fits to
                max_total_tokens = min(max_total_tokens, default_total_tokens(max_batch_total_tokens,
                                                                              speculative_tokens))
            if max_input_tokens is not None:
                max_total_tokens = max(max_total_tokens, max_input_tokens + 1)
        if max_input_tokens is None:
            max_input_tokens = default_input_tokens(max_total_tokens)
        if max_total_tokens + speculative_tokens > max_positions:
            raise ValueError(f"--max-total-tokens ({max_total_tokens}) + --speculative-tokens ({speculative_tokens}) "
                             f"exceeds the model's max_position_embeddings ({max_positions}); lower "
                             f"--max-total-tokens or --max-input-tokens")
    if max_batch_prefill_tokens is None and max_input_tokens is not None:
        budget = DEFAULT_PREFILL_CAP if max_batch_total_tokens is None else max_batch_total_tokens
        max_batch_prefill_tokens = default_prefill_tokens(max_input_tokens, min(DEFAULT_PREFILL_CAP, budget))
    return max_input_tokens, max_total_tokens, max_batch_prefill_tokens


def _check_cuda(num_devices: int, num_shard: int) -> None:
    if num_devices == 0:
        raise ValueError("--device cuda, but torch sees no CUDA device")
    if num_shard > num_devices:
        raise ValueError(f"--num-shard {num_shard} needs one GPU per shard; torch sees {num_devices}")


def _count_cuda_devices() -> int:
    import torch  # imported here: loading torch takes a second and most of the launcher never needs it

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
