"""The models the OpenAI-compatible API can name: the base model and its adapters (LoRAX's and vLLM's
"adapters as models").

`GET /v1/models` lists, and a request's `model` resolves against, what the server can name right now:

    the base model           its id (`--model-id`), also "", `tgi` and `dummy` (what the TGI and Hub clients send)
    loaded adapters          those the router's `AdapterManager` holds loaded
    preloaded adapters       `--preloaded-adapter-ids`
    local adapters           subdirectories of `--adapter-dir` that hold a LoRA or Medusa adapter

Any other `model` is OpenAI's 404 `model_not_found`, unless the body names its source (`adapter_source`, e.g.
`hub`): then it is an adapter id like `/generate`'s `adapter_id`, loaded on first use. So a typo never starts a
Hub download. An adapter chosen by `model` goes through the same validation, loading, LRU and safety rules
(the workers' checks of local paths) as `adapter_id`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specula_router.adapters import AdapterManager
from specula_router.chat_template import ChatTemplate
from specula_router.merges import is_merged_id

# "tgi": what text-generation's Client.chat sends; "dummy": what huggingface_hub's InferenceClient sends when it
# knows only the server's URL.
BASE_MODEL_ALIASES = ("", "tgi", "dummy")
OWNED_BY = "specula"
LORA_CONFIG = "adapter_config.json"
MEDUSA_CONFIG = "config.json"


@dataclass(frozen=True)
class OpenAISettings:
    """What the OpenAI routes need beyond the router's state; built once at startup by `specula_router.startup`."""

    chat_template: ChatTemplate | None = None
    adapter_dirs: tuple[Path, ...] = ()  # the workers' `--adapter-dir`: their subdirectories are local adapters
    created: int = field(default_factory=lambda: int(time.time()))  # `created` of every model card


class ModelNotFound(Exception):
    """`model` names neither the base model nor an adapter the server can name."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist: GET /v1/models lists the base model and the "
                         f"adapters this server can name; a Hub adapter not loaded yet needs "
                         f"`adapter_source: \"hub\"` in the body")
        self.model = model


@dataclass(frozen=True)
class ModelChoice:
    """The adapter a request runs with: (None, None) for the base model."""

    adapter_id: str | None
    adapter_source: str | None


class ModelCatalog:
    """Lists and resolves model names for one router (see the module docstring)."""

    def __init__(self, model_id: str, settings: OpenAISettings, adapters: AdapterManager,
                 preloaded_adapter_ids: Sequence[str] = ()) -> None:
        self.model_id = model_id
        self.settings = settings
        self.adapters = adapters
        self.preloaded_adapter_ids = tuple(preloaded_adapter_ids)

    def is_base(self, model: str) -> bool:
        return model in BASE_MODEL_ALIASES or model == self.model_id

    def resolve(self, model: str, adapter_id: str | None = None, adapter_source: str | None = None) -> ModelChoice:
        """The adapter `model` names (or the body's `adapter_id`, which wins); raises `ModelNotFound`.

        A source given in the body is kept; otherwise a local adapter's is `local` and the others' the
        server's default (None here: the validator fills it in).
        """
        if adapter_id:
            return ModelChoice(adapter_id, adapter_source)
        if self.is_base(model):
            return ModelChoice(None, None)
        if adapter_source is not None:
            return ModelChoice(model, adapter_source)
        if self._is_local_adapter(model):
            return ModelChoice(model, "local")
        if self.adapters.state(model) is not None or model in self.preloaded_adapter_ids:
            return ModelChoice(model, None)
        raise ModelNotFound(model)

    def cards(self) -> list[dict]:
        """`GET /v1/models`'s `data`: the base model, then every adapter it can name (vLLM's `parent`/`root`)."""
        created = self.settings.created
        cards = [{"id": self.model_id, "object": "model", "created": created, "owned_by": OWNED_BY,
                  "root": self.model_id, "parent": None}]
        for adapter_id in self.adapter_ids():
            cards.append({"id": adapter_id, "object": "model", "created": created, "owned_by": OWNED_BY,
                          "root": self.model_id, "parent": self.model_id})
        return cards

    def card(self, model: str) -> dict | None:
        return next((c for c in self.cards() if c["id"] == model), None)

    def adapter_ids(self) -> list[str]:
        """Loaded, preloaded and local adapters, each once, in that order."""
        ready = [a for a in self.adapters.ready_ids if not is_merged_id(a)]  # a merge is no model to name
        ids = [*ready, *self.preloaded_adapter_ids, *self.local_adapter_ids()]
        return list(dict.fromkeys(ids))

    def local_adapter_ids(self) -> list[str]:
        ids = []
        for root in self.settings.adapter_dirs:
            try:
                children = sorted(p for p in Path(root).iterdir() if p.is_dir())
            except OSError:
                continue
            ids += [p.name for p in children if is_adapter_dir(p)]
        return ids

    def _is_local_adapter(self, model: str) -> bool:
        parts = Path(model).parts
        if not parts or Path(model).is_absolute() or ".." in parts:
            return False  # the workers would refuse it anyway; here it is simply not a name we list
        return any(is_adapter_dir(Path(root) / model) for root in self.settings.adapter_dirs)


def is_adapter_dir(path: Path) -> bool:
    """A LoRA (`adapter_config.json`) or Medusa (`config.json` with `medusa_num_heads`) directory; speculators
    and draft models beside them in an adapter directory are not adapters."""
    if (path / LORA_CONFIG).is_file():
        return True
    config = path / MEDUSA_CONFIG
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(raw, dict) and "medusa_num_heads" in raw
