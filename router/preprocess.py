"""OpenAI request -> PreparedRequest: validated sampling params and prompt token ids.

Runs once per request, on the router: chat template and tokenization happen here and
nowhere else (workers get token ids). Every rejection is a 400 naming the field, or a
404 for an unknown model; nothing here can be a 5xx for user input.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Literal

from modelinfo.info import ModelInfo
from protocol.errors import InvalidRequestError
from protocol.grammar import check_grammar
from protocol.sampling import MAX_TOP_LOGPROBS, GrammarSpec, SamplingParams
from router.api_types import ChatCompletionRequest, CompletionRequest, GenerationFields
from router.errors import InvalidRequest, NotFound
from router.prompt_tokens import PromptEncoder
from router.tool_parsers import ToolParser, pick_parser
from router.tools import ToolRequest, tool_request

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
_THREAD_TOKENIZE_CHARS = 16_384
"""Longer prompts are templated and tokenized off the event loop."""
_SEED_RANGE = (-(2**63), 2**64 - 1)
MAX_N = 16
MAX_MESSAGES = 10_000
"""Messages of one chat request (a long agent session has hundreds)."""
"""Most choices per request (each one is a sequence on the workers)."""


@dataclass
class PreparedRequest:
    """One validated request, ready to route."""

    request_id: str
    kind: Literal["chat", "completion"]
    model: str
    """Model name echoed in responses."""
    created: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    """Alternatives per token asked for (chat: top_logprobs; completions: logprobs)."""
    user: str | None
    skip_special_tokens: bool
    n: int = 1
    tool_parser: ToolParser | None = None
    """Set when the output is parsed for tool calls (tools given, tool_choice not none)."""
    parallel_tool_calls: bool = True


class Preprocessor:
    """Owns the model's tokenizer, chat template and limits (immutable, shared)."""

    def __init__(
        self,
        model: ModelInfo,
        served_name: str,
        max_input_tokens: int | None,
        max_output_tokens: int | None = None,
        *,
        tool_parser: str | None = None,
    ) -> None:
        self.model = model
        self.served_name = served_name
        self.context_len = model.max_context_len
        self.max_input_tokens = min(max_input_tokens or self.context_len, self.context_len)
        self.max_output_tokens = max_output_tokens
        """Longest completion (cluster.yaml router.admission.max_output_tokens); None: none."""
        self._accepted_names = {served_name, model.source.spec, model.served_name}
        template = model.chat_template
        self.template_source = template.source() if template is not None else ""
        self.tool_parser = pick_parser(self.template_source, tool_parser)
        """The format tool calls are parsed in (cluster.yaml router.tool_parser, else the
        chat template's)."""
        self._prompt_encoder = PromptEncoder(model.tokenizer)
        """Prompts' token ids, the pieces between special tokens remembered (chat
        prompts; completions prompts that hold special tokens)."""
        self._tool_calls_id = model.tokenizer.token_to_id("[TOOL_CALLS]")
        """Mistral's call marker, looked up once: `token_to_id` costs tokenizers ~100 k
        instructions a call (a tenth of a whole chat request's routing)."""

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self._accepted_names:
            raise NotFound(
                f"The model `{name}` does not exist. This server serves `{self.served_name}`.",
                param="model",
                code="model_not_found",
            )

    async def chat(self, req: ChatCompletionRequest) -> PreparedRequest:
        self.check_model(req.model)
        _check_common(req)
        top = req.top_logprobs or 0
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top}",
                param="top_logprobs",
            )
        if top and not req.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true", param="top_logprobs")
        if not req.messages:
            raise InvalidRequest("messages must hold at least one message", param="messages")
        if len(req.messages) > MAX_MESSAGES:
            raise InvalidRequest(
                f"messages holds {len(req.messages)} messages; at most {MAX_MESSAGES} are accepted",
                param="messages",
            )
        messages = [_message_dict(i, m) for i, m in enumerate(req.messages)]
        template = self.model.chat_template
        if template is None:
            raise InvalidRequest(
                f"model `{self.served_name}` has no chat template; use /v1/completions",
                param="messages",
            )
        tools = tool_request(
            req.tools,
            req.tool_choice,
            self.tool_parser,
            self.template_source,
            self._tool_calls_id,
        )
        fmt = req.response_format
        if tools.grammar is not None and fmt is not None and fmt.type != "text":
            raise InvalidRequest(
                "response_format cannot be combined with a forced tool_choice",
                param="response_format",
            )
        rendered = tools.messages(messages)

        def render_and_encode() -> list[int]:
            text = template.render(rendered, add_generation_prompt=True, tools=tools.template_tools)
            return self._prompt_encoder.encode(text, add_special_tokens=False)

        # every message costs the template a loop turn even when empty
        size = sum(len(str(m.get("content") or "")) + 64 for m in messages)
        ids = await _maybe_in_thread(render_and_encode, size)
        max_tokens = (
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        )
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        prepared = self._prepare(
            req, "chat", ids, max_tokens, param, bool(req.logprobs), "messages", top, tools
        )
        prepared.parallel_tool_calls = req.parallel_tool_calls is not False
        return prepared

    async def completion(self, req: CompletionRequest) -> PreparedRequest:
        self.check_model(req.model)
        _check_common(req)
        if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (alternatives per token)",
                param="logprobs",
            )
        if req.echo:
            raise InvalidRequest("echo is not supported", param="echo")
        if req.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if req.best_of is not None and req.best_of != 1:
            raise InvalidRequest("best_of other than 1 is not supported", param="best_of")
        prompt = _single_prompt(req.prompt)
        if isinstance(prompt, str):
            # Not _maybe_in_thread: no template here to fail, and a short prompt (the
            # rule) then costs no coroutine and closure of its own.
            encoder = self._prompt_encoder
            if len(prompt) > _THREAD_TOKENIZE_CHARS:
                ids = await asyncio.to_thread(encoder.encode, prompt)
            else:
                ids = encoder.encode(prompt)
        else:
            vocab = self.model.config.vocab_size
            bad = next((t for t in prompt if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"prompt token id {bad} is outside the vocabulary [0, {vocab})",
                    param="prompt",
                )
            ids = prompt
        logprobs = req.logprobs is not None
        return self._prepare(
            req,
            "completion",
            ids,
            req.max_tokens,
            "max_tokens",
            logprobs,
            "prompt",
            req.logprobs or 0,
        )

    def _prepare(
        self,
        req: GenerationFields,
        kind: Literal["chat", "completion"],
        ids: list[int],
        max_tokens: int | None,
        max_tokens_param: str,
        logprobs: bool,
        prompt_param: str,
        top_logprobs: int = 0,
        tools: ToolRequest | None = None,
    ) -> PreparedRequest:
        num_prompt = len(ids)
        if num_prompt == 0:
            raise InvalidRequest("the prompt is empty", param=prompt_param)
        if max_tokens is not None and max_tokens < 1:
            raise InvalidRequest(
                f"{max_tokens_param} must be at least 1, got {max_tokens}", param=max_tokens_param
            )
        if num_prompt > self.max_input_tokens or num_prompt >= self.context_len:
            limit = min(self.max_input_tokens, self.context_len - 1)
            raise InvalidRequest(
                f"This model's maximum input length is {limit} tokens. However, your "
                f"{prompt_param} has {num_prompt} tokens. Please shorten it.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        out_limit = self.max_output_tokens
        if max_tokens is not None and out_limit is not None and max_tokens > out_limit:
            raise InvalidRequest(
                f"{max_tokens_param} is {max_tokens} but this server generates at most "
                f"{out_limit} tokens per request; lower {max_tokens_param}",
                param=max_tokens_param,
            )
        if max_tokens is None:
            max_tokens = self.context_len - num_prompt
            if out_limit is not None:
                max_tokens = min(max_tokens, out_limit)
        elif num_prompt + max_tokens > self.context_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.context_len} tokens. However, "
                f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the "
                f"{prompt_param}, {max_tokens} in the completion). Please reduce the length "
                f"of the {prompt_param} or {max_tokens_param}.",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
        grammar = tools.grammar if tools is not None else None
        if grammar is None:
            grammar = _response_format(req)
        if grammar is not None:
            problem = check_grammar(grammar)
            if problem is not None:
                param = "tools" if tools is not None and tools.grammar else "response_format"
                raise InvalidRequest(
                    f"{param} does not compile to a grammar: {problem}", param=param
                )
        params = _sampling_params(
            req, max_tokens, logprobs, self.model.config.vocab_size, top_logprobs, grammar
        )
        parser = tools.parser if tools is not None else None
        skip_special = req.skip_special_tokens is not False
        if parser is not None and parser.needs_special_tokens:
            skip_special = False  # the call marker is a special token
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        options = req.stream_options
        return PreparedRequest(
            # 128 random bits as 32 hex digits, like uuid4().hex without UUID's Python
            # constructor (version bits, int conversions) per request
            request_id=f"{prefix}-{os.urandom(16).hex()}",
            kind=kind,
            model=self.served_name,
            created=int(time.time()),
            prompt_token_ids=ids,
            params=params,
            stream=bool(req.stream),
            include_usage=bool(req.stream and options is not None and options.include_usage),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            user=req.user,
            skip_special_tokens=skip_special,
            n=req.n or 1,
            tool_parser=parser,
        )


def _check_common(req: GenerationFields) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise InvalidRequest(f"n must be in [1, {MAX_N}], got {req.n}", param="n")
    if req.seed is not None and not _SEED_RANGE[0] <= req.seed <= _SEED_RANGE[1]:
        raise InvalidRequest("seed must fit in 64 bits", param="seed")


def _response_format(req: GenerationFields) -> GrammarSpec | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec(kind="json_object")
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise InvalidRequest(
                "response_format json_schema needs json_schema.schema",
                param="response_format.json_schema",
            )
        return GrammarSpec(kind="json_schema", text=json.dumps(fmt.json_schema.schema))
    raise InvalidRequest(
        f"response_format.type {fmt.type!r} is not one of text, json_object, json_schema",
        param="response_format.type",
    )


def _logit_bias(req: GenerationFields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    out = []
    for key, bias in (req.logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                param="logit_bias",
            )
        out.append((token_id, float(bias)))
    return tuple(out)


def _sampling_params(
    req: GenerationFields,
    max_tokens: int,
    logprobs: bool,
    vocab_size: int,
    top_logprobs: int = 0,
    grammar: GrammarSpec | None = None,
) -> SamplingParams:
    stop = req.stop
    stop_ids = tuple(req.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise InvalidRequest(
            f"stop_token_ids must lie in the vocabulary [0, {vocab_size})", param="stop_token_ids"
        )
    params = SamplingParams(
        max_tokens=max_tokens,
        min_tokens=req.min_tokens or 0,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stop_token_ids=stop_ids,
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=_logit_bias(req, vocab_size),
        grammar=grammar,
    )
    try:
        params.validate()
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        param = field if field in SamplingParams.__struct_fields__ else None
        if "stop sequence" in message:
            param = "stop"
        if message.startswith("logit_bias"):
            param = "logit_bias"
        raise InvalidRequest(message, param=param) from None
    return params


def _message_dict(index: int, message: Any) -> dict[str, Any]:
    """A ChatMessage as the dict a chat template reads; bad roles and parts are 400s."""
    if message.role not in CHAT_ROLES:
        raise InvalidRequest(
            f"messages[{index}].role {message.role!r} is not one of "
            f"{', '.join(sorted(CHAT_ROLES))}",
            param=f"messages[{index}].role",
        )
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise InvalidRequest(
                    f"messages[{index}].content[{j}]: only text parts "
                    f'({{"type": "text", "text": ...}}) are supported, got type {part.type!r}',
                    param=f"messages[{index}].content[{j}]",
                )
            texts.append(part.text)
        content = "\n".join(texts)
    if content is not None:
        out["content"] = content
    for key in ("name", "tool_calls", "tool_call_id", "reasoning_content"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    return out


def _single_prompt(prompt: str | list[Any]) -> str | list[int]:
    """The one prompt of a completions request: text or token ids."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        inner = prompt[0]
        if isinstance(inner, str):
            return inner
        prompt = inner
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise InvalidRequest(
        "prompt must be a string, a list of token ids, or a one-element list of either "
        "(batched prompts are not supported; send one request per prompt)",
        param="prompt",
    )


async def _maybe_in_thread(fn: Any, size: int) -> list[int]:
    """Run `fn` here for small inputs, in a worker thread for large ones. Template
    errors (InvalidRequestError) become 400s."""
    try:
        if size > _THREAD_TOKENIZE_CHARS:
            return await asyncio.to_thread(fn)
        return fn()
    except InvalidRequestError as e:
        raise InvalidRequest(str(e), param="messages") from None
