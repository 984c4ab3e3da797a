"""Chat templates: a conversation in, the prompt text the model was trained on out, as transformers renders it.

Loaded once at router startup (`specula_router.startup`) from the model directory, or the Hub snapshot, the way
`transformers.AutoTokenizer` finds it:

    tokenizer_config.json "chat_template"   a string, or the list form [{"name", "template"}, ...]
    chat_template.jinja                     replaces the config's default template when present
    additional_chat_templates/NAME.jinja    further named templates
    --chat-template FILE|TEMPLATE           overrides all of them

and rendered by `openai_api` for `POST /v1/chat/completions`. Rendering matches `apply_chat_template`: jinja2's
immutable sandbox with trim_blocks/lstrip_blocks and loopcontrols, transformers' `tojson` (no HTML escaping),
`raise_exception`, `strftime_now`, `namespace` and `dict`, the tokenizer's named special tokens (`bos_token`,
`eos_token`, ...) as variables, `tools` and `add_generation_prompt`. The text is then tokenised without adding
special tokens again (the template writes BOS itself), so the prompt ids equal
`tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.

A template's own `raise_exception(...)` (e.g. "roles must alternate") is a `ChatTemplateError`: the client's
conversation is what the template refused, so the HTTP layer answers it with a 4xx carrying the message. So is any
other failure while rendering (a `range` past the sandbox's 100,000 items, a recursive macro, a string or list
repeated past `MAX_REPEAT_ITEMS`): a template may size its work from the messages or tools, so it fails on client
input, and that request alone gets the 4xx (the failure is logged).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.runtime
import jinja2.sandbox
import jinja2.utils

logger = logging.getLogger("specula.router.chat")

CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
# The named special tokens transformers passes to every template (`PreTrainedTokenizerBase.special_tokens_map`).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Template names transformers picks by default, with tools first (`get_chat_template`).
TOOL_USE, DEFAULT = "tool_use", "default"
# Bounds on what a template's `*` and `**` may build (see `_TemplateEnvironment`).
MAX_REPEAT_ITEMS = 1_000_000
MAX_POWER_EXPONENT = 4096


class ChatTemplateError(Exception):
    """The template refused the conversation (its `raise_exception`) or failed while rendering it."""


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat templates by name ("default", "tool_use", ...) and the special tokens they may use."""

    templates: Mapping[str, str]
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    source: str = ""  # where the template came from, for the startup log
    _compiled: Mapping[str, jinja2.Template] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.templates:
            raise ValueError("a ChatTemplate needs at least one template")
        if len(self.templates) > 1 and DEFAULT not in self.templates:
            raise ValueError(f"{self.source}: several chat templates ({', '.join(sorted(self.templates))}) and "
                             f"none named `{DEFAULT}`; pick one with --chat-template")
        # Compiled once here: a template with a syntax error stops the startup, not the first chat request.
        object.__setattr__(self, "_compiled", {name: _environment().from_string(text)
                                               for name, text in self.templates.items()})

    def template_for(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        """The name of the template used: `tool_use` when there are tools and such a template, else the default
        (transformers' `get_chat_template`)."""
        if tools is not None and TOOL_USE in self.templates:
            return TOOL_USE
        return DEFAULT if DEFAULT in self.templates else next(iter(self.templates))

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text for `messages`; raises `ChatTemplateError` when the template refuses them.

        Example (a ChatML template):
            render([{"role": "user", "content": "Hi"}])
            -> "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n"
        """
        compiled = self._compiled[self.template_for(tools)]
        variables = {**self.special_tokens, **kwargs}
        try:
            return compiled.render(messages=_plain(list(messages)), tools=_plain(tools), documents=None,
                                   add_generation_prompt=add_generation_prompt, **_plain(variables))
        except jinja2.TemplateError as e:  # raise_exception, undefined calls, sandbox refusals
            raise ChatTemplateError(_short(str(e))) from None
        except Exception as e:  # noqa: BLE001 - anything a template can raise on client input (a range past the
            # sandbox's limit, a recursive macro, an allocation too large) fails this request alone, never the route
            logger.warning("the chat template failed on a conversation: %s: %s", type(e).__name__, _short(str(e)))
            raise ChatTemplateError(f"the chat template failed on this conversation: {type(e).__name__}: "
                                    f"{_short(str(e))}") from None

    @classmethod
    def from_text(cls, text: str, special_tokens: Mapping[str, str] | None = None,
                  source: str = "--chat-template") -> ChatTemplate:
        return cls({DEFAULT: text}, dict(special_tokens or {}), source)


def load_chat_template(model_dir: Path, override: str | None = None) -> ChatTemplate | None:
    """The model's chat templates (see the module docstring), or None when it has none and none is given.

    `override` is --chat-template: a file holding a template, or a template itself. Raises ValueError naming the
    file or flag when a template cannot be read or compiled.
    """
    model_dir = Path(model_dir)
    special_tokens = read_special_tokens(model_dir)
    if override:
        path = Path(override).expanduser()
        if path.is_file():
            return ChatTemplate.from_text(_read(path), special_tokens, f"--chat-template {path}")
        if "{{" not in override and "{%" not in override:
            raise ValueError(f"--chat-template: {override!r} is neither a file nor a jinja template")
        return ChatTemplate.from_text(override, special_tokens, "--chat-template (inline)")
    templates = _config_templates(model_dir)
    jinja_file = model_dir / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        templates[DEFAULT] = _read(jinja_file)
    extra_dir = model_dir / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = _read(path)
    if not templates:
        return None
    if len(templates) == 1:
        templates = {DEFAULT: next(iter(templates.values()))}
    return ChatTemplate(templates, special_tokens, str(model_dir))


def read_special_tokens(model_dir: Path) -> dict[str, str]:
    """The named special tokens' strings, as transformers reads them: from tokenizer_config.json, overridden by the
    legacy special_tokens_map.json unless the config lists its `added_tokens_decoder`.

    Either file may write a token as a string or as an AddedToken object `{"content": "<s>", ...}`.
    """
    config = _read_json(Path(model_dir) / TOKENIZER_CONFIG)
    legacy = {} if "added_tokens_decoder" in config else _read_json(Path(model_dir) / SPECIAL_TOKENS_MAP)
    tokens: dict[str, str] = {}
    for raw in (config, legacy):
        for key in SPECIAL_TOKEN_NAMES:
            value = raw.get(key)
            if isinstance(value, Mapping):
                value = value.get("content")
            if isinstance(value, str):
                tokens[key] = value
    return tokens


def _config_templates(model_dir: Path) -> dict[str, str]:
    path = model_dir / TOKENIZER_CONFIG
    value = _read_json(path).get("chat_template")
    if value is None:
        return {}
    if isinstance(value, str):
        return {DEFAULT: value}
    if isinstance(value, list) and all(isinstance(t, Mapping) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{path}: `chat_template` must be a string or a list of {{name, template}} objects")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    return raw if isinstance(raw, dict) else {}


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the chat template {path}: {e}") from e


def _plain(value: Any) -> Any:
    """Only plain JSON values reach the sandbox (transformers' `_plain_template_data`): no object whose methods
    the sandbox does not know."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return f"<{type(value).__name__}>"


# --- the environment transformers renders templates in (`_cached_compile_jinja_template`) ----------------------


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters (`<` as \u003c), which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` for templates without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja2's namespace, refusing underscore-prefixed attributes (a way towards CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, with `*` and `**` bounded: `"x" * 10**10` would otherwise allocate gigabytes in the
    router before anything could refuse it (jinja2 bounds `range` only)."""

    intercepted_binops: ClassVar[frozenset[str]] = frozenset({"*", "**"})

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) \
                        and len(seq) * times > MAX_REPEAT_ITEMS:
                    raise OverflowError(f"a repeated {type(seq).__name__} would hold more than {MAX_REPEAT_ITEMS} "
                                        f"items")
        elif isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > MAX_POWER_EXPONENT:
            raise OverflowError(f"an integer power with an exponent above {MAX_POWER_EXPONENT}")
        return super().call_binop(context, operator, left, right)


def _short(message: str, limit: int = 300) -> str:
    message = " ".join(message.split())
    return message if len(message) <= limit else message[:limit - 3] + "..."


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = _TemplateEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env
