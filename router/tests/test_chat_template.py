"""Chat templates: loading as transformers finds them, and prompt ids equal to `apply_chat_template`'s.

Parity: for real templates (Llama-3, ChatML/Qwen2, Mistral, Qwen2.5 with tools), the prompt the router builds
(`ChatTemplate.render`, then `Validator.validate` without adding special tokens) equals, token for token,
`AutoTokenizer.from_pretrained(dir).apply_chat_template(messages, add_generation_prompt=True)`.
"""

from __future__ import annotations

import json
import random

import jinja2
import pytest
import tokenizers
import transformers

from specula_router.chat_template import ChatTemplate, ChatTemplateError, load_chat_template
from specula_router.schemas import GenerateParameters
from specula_router.validation import Validator
from specula_router.validation_limits import ValidationLimits
from specula_testing.chat_templates import TEMPLATES, WEATHER_TOOL, add_chat_template
from specula_testing.tokenizer import build_tokenizer

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Write a haiku about caching. ✨"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there"}],
    "multi_turn": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "  return a + b"},
                   {"role": "user", "content": "Now in Go, with <tags> & \"quotes\"."}],
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"clear\", \"temp_c\": 21}"},
]
# Conversations each template accepts (Mistral's has no system role; its turns must alternate).
CASES = [(name, conv) for name in TEMPLATES for conv in CONVERSATIONS
         if not (name == "mistral" and conv == "system")]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    dirs = {}
    for name in TEMPLATES:
        path = tmp_path_factory.mktemp(name)
        build_tokenizer(path)
        add_chat_template(path, name)
        dirs[name] = path
    return dirs


def router_ids(model_dir, messages, tools=None) -> list[int]:
    """The prompt ids the router sends to the workers for a chat request."""
    template = load_chat_template(model_dir)
    prompt = template.render(messages, tools, add_generation_prompt=True)
    validator = Validator(tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json")),
                          ValidationLimits(max_input_tokens=4000, max_total_tokens=4096), rng=random.Random(0))
    valid = validator.validate(prompt, GenerateParameters(max_new_tokens=1), add_special_tokens=False)
    return list(valid.input_ids)


def transformers_ids(model_dir, messages, tools=None) -> list[int]:
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


@pytest.mark.parametrize("name,conversation", CASES)
def test_prompt_ids_equal_transformers_apply_chat_template(model_dirs, name, conversation):
    messages = CONVERSATIONS[conversation]
    ours = router_ids(model_dirs[name], messages)
    assert ours == transformers_ids(model_dirs[name], messages)
    assert any(t in transformers.AutoTokenizer.from_pretrained(model_dirs[name]).convert_ids_to_tokens(ours)
               for t in TEMPLATES[name].special_tokens)  # the markers are single special tokens, not text


def test_tools_and_tool_calls_render_as_transformers_does(model_dirs):
    path = model_dirs["qwen_tools"]
    ours = router_ids(path, TOOL_CONVERSATION, [WEATHER_TOOL])
    assert ours == transformers_ids(path, TOOL_CONVERSATION, [WEATHER_TOOL])
    prompt = load_chat_template(path).render(TOOL_CONVERSATION, [WEATHER_TOOL])
    assert '"name": "get_weather"' in prompt and "<tool_response>" in prompt and "<tools>" in prompt
    assert "\\u" not in prompt.split("<tools>")[1]  # tojson without HTML escaping, as transformers


def test_raise_exception_is_a_chat_template_error_with_the_templates_message(model_dirs):
    bad = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        load_chat_template(model_dirs["mistral"]).render(bad)
    with pytest.raises(Exception, match="Conversation roles must alternate"):  # transformers refuses it too
        transformers_ids(model_dirs["mistral"], bad)
    with pytest.raises(ChatTemplateError, match="Unexpected message role: critic"):
        load_chat_template(model_dirs["qwen_tools"]).render([{"role": "critic", "content": "x"}])


def test_bos_and_eos_come_from_the_tokenizer_config(model_dirs):
    template = load_chat_template(model_dirs["mistral"])
    prompt = template.render(CONVERSATIONS["multi_turn"])
    assert prompt.startswith("<s>[INST] def add(a, b): [/INST]  return a + b</s>[INST]")
    assert template.special_tokens["eos_token"] == "</s>" and template.special_tokens["bos_token"] == "<s>"


def test_named_template_list_and_jinja_files(tmp_path):
    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "T{{ tools | length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": "x"}]) == "Dx"
    assert template.render([{"role": "user", "content": "x"}], [WEATHER_TOOL]) == "T1"
    assert transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
        [{"role": "user", "content": "x"}], tools=[WEATHER_TOOL], tokenize=False) == "T1"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "J1"  # the file wins


def test_override_is_a_file_or_an_inline_template(tmp_path):
    build_tokenizer(tmp_path)
    assert load_chat_template(tmp_path) is None  # no template anywhere
    inline = load_chat_template(tmp_path, "{{ bos_token }}{{ messages[0]['content'] }}")
    assert inline.render([{"role": "user", "content": "hi"}]) == "<s>hi"
    (tmp_path / "t.jinja").write_text("F{{ add_generation_prompt }}")
    assert load_chat_template(tmp_path, str(tmp_path / "t.jinja")).render([]) == "FTrue"
    with pytest.raises(ValueError, match="neither a file nor a jinja template"):
        load_chat_template(tmp_path, "no-such-file.jinja")
    with pytest.raises(jinja2.TemplateSyntaxError):  # a syntax error stops the startup
        load_chat_template(tmp_path, "{% for %}")


def test_globals_and_filters_of_transformers(tmp_path):
    text = ("{{ strftime_now('%Y') }}|{{ {'a': '<é>'} | tojson }}|{% set ns = namespace(n=0) %}{% for m in messages %}"
            "{% set ns.n = ns.n + 1 %}{% if loop.index > 1 %}{% break %}{% endif %}{% endfor %}{{ ns.n }}|"
            "{{ dict(k=1).k }}|{% generation %}g{% endgeneration %}")
    build_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = text
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "a"}] * 3
    ours = ChatTemplate.from_text(text).render(messages)
    assert ours == transformers.AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(messages, tokenize=False)
    assert '{"a": "<é>"}' in ours


def test_the_sandbox_refuses_reaching_python_internals():
    template = ChatTemplate.from_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        template.render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):
        ChatTemplate.from_text("{% set ns = namespace() %}{% set ns._x = 1 %}").render([])


def test_demo_model_has_an_honest_template():
    from specula_launcher.defaults import DEMO_MODEL_DIR

    template = load_chat_template(DEMO_MODEL_DIR)
    assert template is not None
    prompt = template.render([{"role": "user", "content": "def read_config(path):"}])
    assert "def read_config(path):" in prompt
    ids = transformers.AutoTokenizer.from_pretrained(DEMO_MODEL_DIR).apply_chat_template(
        [{"role": "user", "content": "def read_config(path):"}], add_generation_prompt=True, return_dict=False)
    tokenizer = tokenizers.Tokenizer.from_file(str(DEMO_MODEL_DIR / "tokenizer.json"))
    assert tokenizer.encode(prompt, add_special_tokens=False).ids == ids
