"""ChatTemplate: render OpenAI-style chat messages into a prompt string with the model's jinja
template, the way transformers' `apply_chat_template` does."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from protocol.errors import InvalidRequestError, ModelLoadError

DEFAULT_TEMPLATE_NAME = "default"
TOOL_USE_TEMPLATE_NAME = "tool_use"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _TemplateRaised(jinja2.TemplateError):
    """Raised by a template's own `raise_exception(message)`; the message is for the user."""


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markers of
    transformers' templates) and renders the body unchanged."""

    tags = {"generation"}  # noqa: RUF012 (jinja's API)

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(
            lineno
        )

    def _render_body(self, caller: Any) -> str:
        return str(caller())


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes, as transformers' sandbox does."""

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
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace: {name!r}"
            )


class _TemplateDict:
    """`dict(...)` for templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _new_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


class ChatTemplate:
    """Owns a model's compiled chat templates (by name: "default", maybe "tool_use", ...) and
    the special-token strings templates read as `bos_token`, `eos_token`, ...

    Runs untrusted template code in jinja's immutable sandbox. Rendering errors are the
    request's fault (a template rejecting a role order, say): InvalidRequestError.
    """

    def __init__(
        self, templates: str | Mapping[str, str], special_tokens: Mapping[str, str]
    ) -> None:
        """templates: one template source, or name -> source. special_tokens: e.g.
        {"bos_token": "<s>"} (Tokenizer.special_tokens)."""
        sources = {DEFAULT_TEMPLATE_NAME: templates} if isinstance(templates, str) else templates
        if not sources:
            raise ModelLoadError("the model's chat template list is empty")
        if DEFAULT_TEMPLATE_NAME not in sources and len(sources) > 1:
            raise ModelLoadError(
                f"the model has several chat templates {sorted(sources)} and none named "
                f"{DEFAULT_TEMPLATE_NAME!r}; kvserve cannot tell which one to use"
            )
        env = _new_environment()
        self._sources = dict(sources)
        self._templates: dict[str, jinja2.Template] = {}
        for name, source in sources.items():
            try:
                self._templates[name] = env.from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise ModelLoadError(
                    f"the model's chat template {name!r} is invalid jinja (line {e.lineno}: "
                    f"{e.message})"
                ) from None
        self._default = (
            DEFAULT_TEMPLATE_NAME if DEFAULT_TEMPLATE_NAME in sources else next(iter(sources))
        )
        self._special_tokens = dict(special_tokens)

    @classmethod
    def from_hf_folder(
        cls, path: str | Path, special_tokens: Mapping[str, str]
    ) -> ChatTemplate | None:
        """The folder's template: chat_template.jinja (+ additional_chat_templates/*.jinja),
        else tokenizer_config.json's `chat_template` (a string or a list of {name, template}).
        None when the model has none."""
        folder = Path(path)
        templates: dict[str, str] = {}
        if (folder / "chat_template.jinja").is_file():
            templates[DEFAULT_TEMPLATE_NAME] = (folder / "chat_template.jinja").read_text("utf-8")
        for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            templates[extra.stem] = extra.read_text("utf-8")
        if templates:
            return cls(templates, special_tokens)
        config_path = folder / "tokenizer_config.json"
        if not config_path.is_file():
            return None
        try:
            raw = json.loads(config_path.read_text("utf-8")).get("chat_template")
        except (ValueError, AttributeError) as e:
            raise ModelLoadError(f"{config_path} is not a valid JSON object: {e}") from None
        if raw is None:
            return None
        if isinstance(raw, str):
            return cls(raw, special_tokens)
        try:
            return cls({t["name"]: t["template"] for t in raw}, special_tokens)
        except (TypeError, KeyError):
            raise ModelLoadError(
                f"{config_path}: chat_template must be a string or a list of "
                '{"name": ..., "template": ...} objects'
            ) from None

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], special_tokens: Mapping[str, str]
    ) -> ChatTemplate | None:
        """The GGUF's `tokenizer.chat_template` (+ named `tokenizer.chat_template.<name>`
        ones), or None when the file has none."""
        templates = {
            key.removeprefix("tokenizer.chat_template."): value
            for key, value in metadata.items()
            if key.startswith("tokenizer.chat_template.") and isinstance(value, str)
        }
        default = metadata.get("tokenizer.chat_template")
        if isinstance(default, str):
            templates[DEFAULT_TEMPLATE_NAME] = default
        return cls(templates, special_tokens) if templates else None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._templates)

    def source(self, name: str | None = None) -> str:
        """The jinja source of a template (the default one when name is None)."""
        return self._sources[name or self._default]

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt for `messages` (OpenAI-style dicts with "role" and "content").

        A content that is a list of {"type": "text", "text": ...} parts is joined with "\\n"
        into one string (as vLLM does) so templates that expect a string work. Keys whose
        value is None are dropped, as transformers does. template_kwargs are extra template
        variables (e.g. {"enable_thinking": False}); they override the special tokens.
        The prompt already holds the template's special tokens: encode it with
        add_special_tokens=False.
        """
        name = self._default
        if tools is not None and TOOL_USE_TEMPLATE_NAME in self._templates:
            name = TOOL_USE_TEMPLATE_NAME
        variables = {**self._special_tokens, **(template_kwargs or {})}
        try:
            return self._templates[name].render(
                messages=_normalize_messages(messages),
                tools=list(tools) if tools is not None else None,
                documents=list(documents) if documents is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except _TemplateRaised as e:
            raise InvalidRequestError(str(e.message)) from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise InvalidRequestError(
                f"the model's chat template cannot render these messages: {type(e).__name__}: {e}"
            ) from None


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidRequestError("messages must hold at least one message")
    normalized = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{index}] must be an object with a string 'role'")
        out = {key: value for key, value in message.items() if value is not None}
        if "content" in out:
            out["content"] = _content_text(out["content"], index)
        # Templates read reasoning under different names; offer it under all of them.
        reasoning = next((out[k] for k in _REASONING_FIELDS if k in out), None)
        if reasoning is not None:
            out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
        normalized.append(out)
    return normalized


def _content_text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"messages[{index}].content must be a string or a list of content parts"
        )
    texts = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise InvalidRequestError(
                f"messages[{index}].content: part type {kind!r} is not supported; this model "
                "takes text only ({'type': 'text', 'text': ...})"
            )
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"messages[{index}].content: a text part needs a 'text' string"
            )
        texts.append(part["text"])
    return "\n".join(texts)
