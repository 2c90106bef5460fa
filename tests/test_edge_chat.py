"""kvserve-edge's chat templates (edge/src/chat.rs) against the router's own rendering:
programs derived by router/edge_template.py, run by the Rust binary's `chat` driver on
random conversations, must give the router's text (and its prompt ids through a
whole-text encode), or None where they do not cover a conversation."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from modelinfo.chat_template import ChatTemplate
from modelinfo.info import ModelInfo, load_model_info
from router.api_types import ChatCompletionRequest
from router.edge_template import (
    PYTHON_WHITESPACE,
    derive_template,
    program_text,
    router_text,
    write_template,
)
from router.edge_tokenizer import write_tokenizer_json
from router.preprocess import Preprocessor

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | "
    "trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
ALTERNATING = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
    "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
    "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
    "alternate user/assistant/user/assistant/...') }}{% endif %}{{ '<start_of_turn>' + "
    "message['role'] + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
QWEN25 = (
    # Qwen2.5's template without its tool branches (it still names `tools`, so the router
    # passes messages the tool-aware way): a default system message unless the first
    # message is one, which is then written without the loop's handling.
    "{%- if tools %}{{ raise_exception('no tools in this test') }}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
NUMBERED = "{% for message in messages %}{{ loop.index }}: {{ message['content'] }}\n{% endfor %}"
DATED = "{{ strftime_now('%d %b %Y') }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
SYSTEM_DROPPED = (
    "{% for m in messages %}{% if m['role'] != 'system' %}[{{ m['role'] }}] "
    "{{ m['content'] | trim }}\n{% endif %}{% endfor %}"
)
NEWLINES_REPLACED = "{% for m in messages %}{{ m['content'] | replace('\n', ' ') }};{% endfor %}"
SPECIALS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}

_FRAGMENTS = (
    "hi",
    "  padded  ",
    "\n\nlines\n",
    "\t\u3000\x1c",
    "<|im_start|>user\n",
    "<|im_end|>",
    "<|eot_id|>",
    "{{ x }}{% if %}",
    "é🙂你好",
    "a\r\nb",
    "",
)


@pytest.fixture(scope="module")
def smollm2() -> ModelInfo:
    return load_model_info("builtin:smollm2-135m-instruct")


def _conversations(seed: int, count: int, roles: tuple[str, ...]) -> list[list[dict[str, str]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        messages = []
        for _ in range(rng.randint(1, 6)):
            content = "".join(rng.choices(_FRAGMENTS, k=rng.randint(0, 3)))
            messages.append({"role": rng.choice(roles), "content": content})
        out.append(messages)
    return out


def _rust_texts(
    edge_bin: Path, program_path: Path, cases: list[tuple[list[dict[str, str]], bool]]
) -> list[str | None]:
    lines = "".join(
        json.dumps({"messages": m, "add_generation_prompt": gen}) + "\n" for m, gen in cases
    )
    run = subprocess.run(
        [str(edge_bin), "chat", "--template", str(program_path)],
        input=lines,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [json.loads(line)["text"] for line in run.stdout.splitlines()]


def _rust_ids(edge_bin: Path, tokenizer_path: Path, texts: list[str]) -> list[list[int]]:
    lines = "".join(json.dumps({"text": t, "add_special_tokens": False}) + "\n" for t in texts)
    run = subprocess.run(
        [str(edge_bin), "tokenize", "--tokenizer", str(tokenizer_path)],
        input=lines,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return [json.loads(line)["ids"] for line in run.stdout.splitlines()]


def _derived(template: ChatTemplate, model: ModelInfo, tmp_path: Path) -> Path:
    program = derive_template(template, model.tokenizer)
    assert program is not None
    path = tmp_path / "chat_template.json"
    write_template(program, path)
    return path


def test_smollm2_edge_text_and_ids_are_the_routers(
    edge_bin: Path, smollm2: ModelInfo, tmp_path: Path
) -> None:
    template = smollm2.chat_template
    assert template is not None
    path = _derived(template, smollm2, tmp_path)
    roles = ("system", "user", "assistant", "developer")
    cases = [(m, i % 3 != 0) for i, m in enumerate(_conversations(1, 200, roles))]
    texts = _rust_texts(edge_bin, path, cases)
    assert len(texts) == len(cases)
    for (messages, gen), text in zip(cases, texts, strict=True):
        # every order of these roles is covered: the edge serves them all
        assert text is not None
        assert text == router_text(template, messages, gen)
    # The router's own chat path (add_generation_prompt is always true there): its
    # prompt ids are the edge tokenizer's whole-text encode of the edge's text,
    # special-token text in contents included (the router does not tokenize contents
    # apart).
    tokenizer_path = tmp_path / "tokenizer.json"
    write_tokenizer_json(smollm2.tokenizer, tokenizer_path)
    served = [(m, t) for (m, gen), t in zip(cases, texts, strict=True) if gen and t][:80]
    assert len(served) == 80
    edge_ids = _rust_ids(edge_bin, tokenizer_path, [t for _, t in served])
    pre = Preprocessor(smollm2, "smollm2", None)
    for (messages, _), ids in zip(served, edge_ids, strict=True):
        body = msgspec.json.encode({"messages": messages, "max_tokens": 1})
        prepared = asyncio.run(pre.chat(msgspec.json.decode(body, type=ChatCompletionRequest)))
        assert prepared.prompt_token_ids == ids
    tokenizer = smollm2.tokenizer
    im_start = tokenizer.token_to_id("<|im_start|>")
    text = router_text(template, [{"role": "user", "content": "<|im_start|>"}], True)
    assert text is not None
    assert tokenizer.encode(text, add_special_tokens=False).count(im_start) == 4


def test_uncovered_roles_and_empty_conversations_are_none(
    edge_bin: Path, smollm2: ModelInfo, tmp_path: Path
) -> None:
    template = smollm2.chat_template
    assert template is not None
    path = _derived(template, smollm2, tmp_path)
    cases: list[tuple[list[dict[str, str]], bool]] = [
        ([], True),
        ([{"role": "tool", "content": "42"}], True),
        ([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}], True),
        ([{"role": "bogus", "content": "x"}], False),
    ]
    assert _rust_texts(edge_bin, path, cases) == [None] * len(cases)
    run = subprocess.run(
        [str(edge_bin), "chat", "--template", str(path)],
        input='{"messages": [{"role": "user", "content": null}], "add_generation_prompt": true}\n',
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "error" in json.loads(run.stdout)


@pytest.mark.parametrize(
    "source", [CHATML, LLAMA3, QWEN25, ALTERNATING], ids=["chatml", "llama3", "qwen", "alt"]
)
def test_string_templates_render_as_the_router(
    edge_bin: Path, smollm2: ModelInfo, tmp_path: Path, source: str
) -> None:
    template = ChatTemplate(source, SPECIALS)
    path = _derived(template, smollm2, tmp_path)
    program = json.loads(path.read_text())
    cases = [
        (m, i % 2 == 0)
        for i, m in enumerate(_conversations(2, 150, ("system", "user", "assistant")))
    ]
    texts = _rust_texts(edge_bin, path, cases)
    num_served = 0
    for (messages, gen), text in zip(cases, texts, strict=True):
        assert text == program_text(program, messages, gen)
        if text is not None:
            num_served += 1
            assert text == router_text(template, messages, gen)
    assert num_served >= (150 if source != ALTERNATING else 5)
    if source == QWEN25:
        assert "You are Qwen" in program["separators"]["^"]["user"]
        assert "You are Qwen" not in program["separators"]["^"]["system"]
    if source == LLAMA3:
        assert program["content"]["user"] == {"strip": "both", "chars": PYTHON_WHITESPACE}
    if source == ALTERNATING:
        # the template refuses these orders: the program does not cover them
        assert sorted(program["separators"]["^"]) == ["user"]
        assert "user" not in program["separators"]["user"]


@pytest.mark.parametrize(
    "source", [NUMBERED, DATED, NEWLINES_REPLACED], ids=["numbered", "dated", "replaced"]
)
def test_templates_beyond_pieces_are_not_derived(smollm2: ModelInfo, source: str) -> None:
    assert derive_template(ChatTemplate(source, SPECIALS), smollm2.tokenizer) is None


def test_a_role_the_template_drops_is_not_covered(smollm2: ModelInfo) -> None:
    program = derive_template(ChatTemplate(SYSTEM_DROPPED, SPECIALS), smollm2.tokenizer)
    assert program is not None
    assert sorted(program["separators"]["^"]) == ["assistant", "user"]
    assert "system" not in program["separators"]["user"]


def test_no_template_is_none(smollm2: ModelInfo) -> None:
    assert derive_template(None, smollm2.tokenizer) is None


def test_python_whitespace_is_str_isspace() -> None:
    every = "".join(chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace())
    assert every == PYTHON_WHITESPACE
