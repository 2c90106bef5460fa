"""modelinfo.chat_template renders exactly what transformers' apply_chat_template renders."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from modelinfo.chat_template import ChatTemplate
from modelinfo.info import ModelInfo, load_model_info
from protocol.errors import InvalidRequestError, ModelLoadError

BUILTIN = "builtin:smollm2-135m-instruct"

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "What is 2+2?"}],
    "with_system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi_turn": [
        {"role": "system", "content": "Answer in French. Réponds en français."},
        {"role": "user", "content": "Hello 👋"},
        {"role": "assistant", "content": "Bonjour !"},
        {"role": "user", "content": "  spaces\n\tand tabs  "},
        {"role": "assistant", "content": "D'accord."},
        {"role": "user", "content": "<|im_start|> inside text"},
    ],
}

# Uses every helper transformers gives templates.
CUSTOM_TEMPLATE = """{{ bos_token }}{% set ns = namespace(count=0) %}
{% for m in messages %}
{% if m.role == 'skip' %}{% continue %}{% endif %}
{% set ns.count = ns.count + 1 %}
{% generation %}[{{ m.role }}] {{ m.content }}{% endgeneration %}
{{ eos_token if loop.last else '|' }}
{% endfor %}
{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}
{{ dict(a=1, b='é') | tojson }} {{ ns.count }} {{ unk_token }} {{ pad_token }}
{{ strftime_now('%Y') | length }}
{% if add_generation_prompt %}<assistant>{% endif %}"""


@pytest.fixture(scope="module")
def reference(smollm2_hf_tokenizer, smollm2_gguf):  # type: ignore[no-untyped-def]
    """transformers' tokenizer for the builtin GGUF (conftest.py: once per session)."""
    from modelinfo.source import resolve_model

    assert resolve_model(BUILTIN).path == smollm2_gguf
    return smollm2_hf_tokenizer


@pytest.fixture(scope="module")
def info() -> ModelInfo:
    return load_model_info(BUILTIN)


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_builtin_template_matches_transformers(
    info: ModelInfo, reference, name: str, add_generation_prompt: bool
) -> None:
    messages = CONVERSATIONS[name]
    expected = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = info.require_chat_template().render(
        messages, add_generation_prompt=add_generation_prompt
    )
    assert rendered == expected
    # And the ids the router would send equal transformers' tokenized chat.
    expected_ids = reference.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert info.tokenizer.encode(rendered, add_special_tokens=False) == list(expected_ids)


def test_custom_template_helpers_match_transformers(info: ModelInfo, reference) -> None:
    template = ChatTemplate(CUSTOM_TEMPLATE, info.tokenizer.special_tokens)
    messages = [*CONVERSATIONS["multi_turn"], {"role": "skip", "content": "hidden"}]
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    for add_generation_prompt in (True, False):
        for tool_list in (None, tools):
            expected = reference.apply_chat_template(
                messages,
                chat_template=CUSTOM_TEMPLATE,
                tools=tool_list,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
            )
            rendered = template.render(
                messages, tools=tool_list, add_generation_prompt=add_generation_prompt
            )
            assert rendered == expected


def test_text_parts_and_none_fields(info: ModelInfo, reference) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    template = info.require_chat_template()
    rendered = template.render(
        [
            {"role": "user", "content": parts, "name": None},
            {"role": "assistant", "content": "ok", "tool_calls": None},
        ]
    )
    expected = reference.apply_chat_template(
        [{"role": "user", "content": "first\nsecond"}, {"role": "assistant", "content": "ok"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert rendered == expected


def test_template_kwargs_reach_the_template(info: ModelInfo) -> None:
    template = ChatTemplate(
        "{{ 'think' if enable_thinking else 'plain' }}:{{ bos_token }}",
        info.tokenizer.special_tokens,
    )
    messages = [{"role": "user", "content": "x"}]
    assert template.render(messages, template_kwargs={"enable_thinking": True}) == (
        "think:<|im_start|>"
    )
    assert template.render(messages, template_kwargs={"bos_token": "B"}) == "plain:B"


def test_raise_exception_becomes_invalid_request() -> None:
    template = ChatTemplate(
        "{% if messages[0].role != 'user' %}"
        "{{ raise_exception('Conversations must start with a user message') }}{% endif %}ok",
        {},
    )
    assert template.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(InvalidRequestError) as exc:
        template.render([{"role": "assistant", "content": "x"}])
    assert str(exc.value) == "Conversations must start with a user message"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "at least one message"),
        ([{"content": "no role"}], "string 'role'"),
        ([{"role": "user", "content": 3}], "string or a list"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "'image_url' is not supported",
        ),
    ],
)
def test_bad_messages_are_invalid_requests(info: ModelInfo, messages, match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        info.require_chat_template().render(messages)


def test_template_errors_and_sandbox_are_invalid_requests() -> None:
    for source in ("{{ messages[0].content + 1 }}", "{{ ''.__class__.__mro__ }}", "{{ x.y.z }}"):
        with pytest.raises(InvalidRequestError, match="cannot render"):
            ChatTemplate(source, {}).render([{"role": "user", "content": "x"}])


def test_invalid_jinja_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="invalid jinja"):
        ChatTemplate("{% for m in messages %}", {})


def _write_hf_folder(folder: Path, info: ModelInfo, tokenizer_config: dict) -> Path:
    """A loadable HF folder: SmolLM2's tokenizer, a config.json, one tiny safetensors file."""
    folder.mkdir()
    info.tokenizer.backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({**info.tokenizer.special_tokens, **tokenizer_config})
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 2048,
        "eos_token_id": 2,
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(folder / "model.safetensors"))
    return folder


def test_hf_folder_template_sources(tmp_path: Path, info: ModelInfo) -> None:
    messages = [{"role": "user", "content": "x"}]
    special = info.tokenizer.special_tokens
    named = _write_hf_folder(
        tmp_path / "named",
        info,
        {
            "chat_template": [
                {"name": "default", "template": "D{{ messages | length }}"},
                {"name": "tool_use", "template": "T{{ tools | length }}"},
            ]
        },
    )
    template = ChatTemplate.from_hf_folder(named, special)
    assert template is not None and set(template.names) == {"default", "tool_use"}
    assert template.render(messages) == "D1"
    assert template.render(messages, tools=[{"type": "function"}]) == "T1"
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (named / "chat_template.jinja").write_text("J{{ bos_token }}")
    assert ChatTemplate.from_hf_folder(named, special).render(messages) == "J<|im_start|>"  # type: ignore[union-attr]
    ambiguous = _write_hf_folder(
        tmp_path / "ambiguous",
        info,
        {"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]},
    )
    with pytest.raises(ModelLoadError, match="none named 'default'"):
        ChatTemplate.from_hf_folder(ambiguous, special)


def test_model_without_template_refuses_chat(tmp_path: Path, info: ModelInfo) -> None:
    folder = _write_hf_folder(tmp_path / "plain", info, {})
    plain = load_model_info(str(folder))
    assert plain.chat_template is None
    with pytest.raises(InvalidRequestError, match="has no chat template"):
        plain.require_chat_template()
    # The plain-prompt path still works.
    assert plain.tokenizer.encode("Hello world") == info.tokenizer.encode("Hello world")


def test_hf_folder_model_info(tmp_path: Path, info: ModelInfo) -> None:
    folder = _write_hf_folder(
        tmp_path / "chat", info, {"chat_template": info.require_chat_template().source()}
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    loaded = load_model_info(str(folder), served_name="tiny")
    assert loaded.served_name == "tiny"
    assert loaded.source.kind == "hf" and loaded.max_context_len == 2048
    assert loaded.eos_token_ids == (2, 0)
    messages = CONVERSATIONS["multi_turn"]
    assert loaded.require_chat_template().render(messages) == info.require_chat_template().render(
        messages
    )
